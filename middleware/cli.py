"""The ``mmshm`` command line (console script ``mmshm = mmshm.cli:main``).

``main`` is a click group; each subcommand is a thin function that imports
its implementation lazily (spawned processes re-import this module, and
``mmshm --help`` should stay fast). Add a subcommand with ``@main.command()``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import click


def _int_list(ctx, param, value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter("expected a comma-separated list of integers") from None
    if not out or any(v < 1 for v in out):
        raise click.BadParameter("expected positive integers")
    return out


def _str_list(ctx, param, value: str) -> tuple[str, ...]:
    out = tuple(v.strip() for v in value.split(",") if v.strip())
    if not out:
        raise click.BadParameter("expected a comma-separated list")
    return out


def _exit_on_sigterm(signum, frame) -> None:
    sys.exit(128 + signum)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mmshm")
def main() -> None:
    """mmshm: shared-memory transport for multimodal tensors in VLM serving servers."""


def _resolution_list(ctx, param, value: str) -> tuple[str, ...]:
    out = _str_list(ctx, param, value)
    bad = [v for v in out if v not in ("720p", "1080p")]
    if bad:
        raise click.BadParameter(f"unknown resolution(s) {', '.join(bad)}; "
                                 "choose from 720p, 1080p")
    return out


@main.command()
@click.option("--tp", default="2", show_default=True, callback=_int_list,
              help="Comma-separated TP sizes (a gloo group of spawned ranks each).")
@click.option("--n", "n", default="2", show_default=True, callback=_int_list,
              help="Comma-separated parallel-sampling copies per request.")
@click.option("--images", default="1,8,32", show_default=True, callback=_int_list,
              help="Comma-separated image counts per request.")
@click.option("--resolution", default="720p", show_default=True, callback=_resolution_list,
              help="Comma-separated photo resolutions (720p, 1080p) before the Qwen2-VL "
                   "processor.")
@click.option("--sweep", is_flag=True,
              help="The full grid: --tp 2,4 --n 1,8 --images 1,8,32 --resolution "
                   "720p,1080p (options given explicitly still win).")
@click.option("--modes", default="inline,fresh-segment,mmshm", show_default=True,
              callback=_str_list, help="Comma-separated transport modes.")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True,
              help="Most repetitions per (config, mode); medians are reported.")
@click.option("--budget", "budget_s", type=click.FloatRange(min=0), default=8.0,
              show_default=True,
              help="Measured end-to-end seconds after which a mode stops repeating in a "
                   "config (one run at least).")
@click.option("--max-mem", "max_mem_gb", type=click.FloatRange(min=0), default=None,
              help="Skip runs estimated to need more GB than this "
                   "[default: available memory less 2 GiB, before each config].")
@click.option("--min-bytes", type=click.IntRange(min=0), default=None,
              help="Shared-memory threshold in bytes [default: MMSHM_MIN_BYTES].")
@click.option("--shm-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Segment directory [default: MMSHM_DIR or /dev/shm].")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Simulate this many nodes on this machine (own segment directory and "
                   "node id each; TP ranks in contiguous blocks; at most the TP size).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=300.0,
              show_default=True, help="Seconds allowed for start-up and each step.")
@click.option("--warmup/--no-warmup", default=True, show_default=True,
              help="Run each mode once on a 1-image request first (not reported).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cuda: every TP rank also times copying what it holds to its GPU, "
                   "from pageable and from registered (pinned) memory.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True),
              default=None, help="Write the results as JSON to this file ('-' for stdout).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of end-to-end latency against payload, one line per mode.")
@click.option("--metrics-port", type=click.IntRange(min=0, max=65535), default=None,
              help="Serve the pipeline's Prometheus metrics (every bench process, merged) "
                   "on 127.0.0.1:PORT while it runs.")
@click.pass_context
def bench(ctx, tp, n, images, resolution, sweep, modes, repeat, budget_s, max_mem_gb,
          min_bytes, shm_dir, nodes, timeout_s, warmup, device, json_path, plot_path,
          metrics_port) -> None:
    """Time transports on the request path of a VLM server, against the floor.

    Real photos go through the Qwen2-VL image processor, each request is
    fanned out into N copies, sent over ZMQ to TP rank 0 and broadcast to
    the TP ranks; every rank checks the bytes. Modes: inline (pixels
    pickled), fresh-segment (SGLang 0.5.23's n+1 fresh segments per request,
    as a baseline) and mmshm by default; also mmshm-eager-hash (every
    content hash computed by the producer), mmshm-hash-given, and the
    servers' own code where the interpreter has it: sglang (SGLang 0.5.23),
    vllm and vllm-arena (vLLM 0.33.0; tests/integrations/run_sglang.py and
    run_vllm.sh build such interpreters under .venvs/). The floor, measured
    in the same run, is a memcpy of the payload into warm memory plus a
    metadata-only broadcast; on a busy host a mode can land below it.
    --nodes K simulates K nodes on this machine and reports the bytes sent
    between them (fresh-segment is skipped: it is single-node only).
    Runs the host cannot hold are skipped with a note. Exits 1 if any run
    delivered wrong bytes or left a shared-memory segment behind, 2 on a usage
    error, 3 if the bench itself failed (a TP rank died or timed out).
    """
    from click.core import ParameterSource
    from rich.console import Console

    from .bench import MODES, SWEEP, BenchConfig, BenchError, run_bench
    from .bench.report import FULL_WIDTH, RichReporter, print_result

    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install 'mmshm[bench]'") from None
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise click.BadParameter(f"unknown mode(s) {', '.join(unknown)}; "
                                 f"choose from {', '.join(MODES)}", param_hint="--modes")
    axes = {"tp": tp, "n": n, "images": images, "resolution": resolution}
    if sweep:
        for key in axes:
            if ctx.get_parameter_source(key) != ParameterSource.COMMANDLINE:
                axes[key] = SWEEP[key]
    cfg = BenchConfig(**axes, modes=modes, repeat=repeat, budget_s=budget_s,
                      max_mem_bytes=None if max_mem_gb is None else int(max_mem_gb * 1e9),
                      min_bytes=min_bytes, timeout_s=timeout_s, warmup=warmup, shm_dir=shm_dir,
                      nodes=nodes, device=device)
    # SIGTERM unwinds like Ctrl-C, so the TP ranks are stopped and joined
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    err = Console(stderr=True)
    out = Console(stderr=json_path == "-")
    if not out.is_terminal:  # a file or a pipe: the full table
        out.width = max(out.width, FULL_WIDTH + 20)
    metrics_dir = _start_bench_metrics(metrics_port, err) if metrics_port is not None else None
    try:
        with RichReporter(err) as rep:
            result = run_bench(cfg, reporter=rep)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    except BenchError as exc:
        err.print(f"[red]bench failed:[/] {exc}")
        sys.exit(3)
    finally:
        if metrics_port is not None:
            from . import metrics

            metrics.stop_exporter()
            if metrics_dir:
                import shutil

                shutil.rmtree(metrics_dir, ignore_errors=True)
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    print_result(result, out)
    if plot_path:
        from .bench.plot import plot_result

        plot_result(result, plot_path)
        out.print(f"plot written to {plot_path}")
    if json_path:
        text = json.dumps(result, indent=2)
        if json_path == "-":
            click.echo(text)
        else:
            with open(json_path, "w") as f:
                f.write(text + "\n")
            out.print(f"results written to {json_path}")
    bad = [r for r in result["runs"]
           if not r.get("skipped") and (not r["correct"] or r["leftover_segments"])]
    bad += [f for f in result.get("floors", []) if f.get("problems")]
    if bad or result["leftover_segments"]:
        sys.exit(1)


def _start_bench_metrics(port: int, console) -> str | None:
    """Put every bench process in prometheus-client's multiprocess mode (a
    private PROMETHEUS_MULTIPROC_DIR, inherited by the spawned producer and TP
    ranks) and serve the merged series on 127.0.0.1:``port``. Returns the
    directory it made (removed when the bench ends), or None."""
    import tempfile

    from . import metrics

    made = None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        made = tempfile.mkdtemp(prefix="mmshm-bench-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = made
    metrics.init()
    srv = metrics.start_exporter(port)
    bound = srv.server_port if hasattr(srv, "server_port") else port
    console.print(f"metrics: http://127.0.0.1:{bound}/metrics")
    return made


def _size(n: int) -> str:
    """Bytes for people: 22.5 MB -> '21.5 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def _console():
    from rich.console import Console

    # no hard wrapping into pipes and logs: names and fixes stay on one line
    return Console(soft_wrap=not sys.stdout.isatty(), highlight=False)


@main.command()
@click.option("--dir", "directory", default=None, metavar="DIR",
              help="Segment directory [default: MMSHM_DIR or /dev/shm].")
@click.option("--expected-bytes", type=click.IntRange(min=0), default=None, metavar="N",
              help="Multimodal bytes expected in flight at once "
                   "[default: 32 Qwen2-VL 720p images, about 720 MB].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(directory, expected_bytes, as_json) -> None:
    """Check that the segment directory is fit for the load.

    Reports the directory's size and free space, mmshm's segments (count,
    bytes, orphans left by crashed processes) and whether the free headroom
    covers NCCL's reserve plus the expected multimodal load, each problem with
    its concrete fix (docker --shm-size / --ipc=host, a Kubernetes emptyDir,
    `mmshm gc`). Exits 1 when something needs fixing.
    """
    import msgspec
    from rich.text import Text

    from .doctor import diagnose

    rep = diagnose(directory, expected_bytes=expected_bytes)
    if as_json:
        click.echo(msgspec.json.encode(rep).decode())
        sys.exit(0 if rep.ok else 1)
    con = _console()
    con.print(Text.assemble(("mmshm doctor: ", "bold"), rep.directory, f" ({rep.fs_type})"))
    rows = (
        ("size", _size(rep.fs_size_bytes)),
        ("free", _size(rep.fs_free_bytes)),
        ("reserve", f"{_size(rep.reserve_bytes)} kept free for NCCL (MMSHM_MIN_FREE_BYTES)"),
        ("expected load", f"{_size(rep.expected_bytes)} of multimodal tensors in flight"),
        ("segments", f"{rep.segments} ({_size(rep.segment_bytes)})"),
        ("orphans", f"{rep.orphans} ({_size(rep.orphan_bytes)})"),
    )
    for key, value in rows:
        con.print(Text.assemble(f"  {key:<14}", value))
    if rep.ok:
        con.print(Text("no problems found", style="green"))
        return
    for p in rep.problems:
        con.print(Text.assemble(("problem: ", "bold red"), p.problem))
        con.print(Text.assemble(("    fix: ", "bold"), p.fix))
    sys.exit(1)


@main.command()
@click.option("--dir", "directory", default=None, metavar="DIR",
              help="Segment directory [default: MMSHM_DIR or /dev/shm].")
@click.option("--dry-run", is_flag=True, help="List the orphans without removing them.")
@click.option("--json", "as_json", is_flag=True, help="Print the reaper's report as JSON.")
@click.option("--grace", "grace_s", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Keep segments whose references are in flight this long after their last "
                   "clean close [default: MMSHM_IN_FLIGHT_GRACE_S or 300].")
def gc(directory, dry_run, as_json, grace_s) -> None:
    """Reclaim orphaned segments: those no live process holds.

    Liveness comes from the locks every holder keeps on its segments, never
    from pids, so segments of other live servers on the host are left alone.
    Segments whose references are still in flight after a clean exit are
    kept for a grace period. Prints how many segments and bytes were (or,
    with --dry-run, would be) freed, by reason, and their names.
    """
    import msgspec
    from rich.text import Text

    from .reaper import reap

    rep = reap(directory, dry_run=dry_run, grace_s=grace_s)
    if as_json:
        click.echo(msgspec.json.encode(rep).decode())
        return
    con = _console()
    verb = "would reclaim" if dry_run else "reclaimed"
    con.print(Text.assemble(
        ("mmshm gc: ", "bold"),
        f"{verb} {rep.reclaimed} orphaned segment(s), {rep.reclaimed_bytes} bytes "
        f"({_size(rep.reclaimed_bytes)}) in {rep.directory}"
        + "".join(f", {n} {why}" for why, n in rep.reasons.items() if n)))
    for name in rep.names:
        con.print(Text(f"  {name}"))
    con.print(Text(f"kept {rep.live} live segment(s), {rep.live_bytes} bytes, and "
                   f"{rep.in_flight} with references in flight, {rep.in_flight_bytes} bytes"
                   + (" (dry run: nothing removed)" if dry_run else "")))



@main.command(context_settings={"ignore_unknown_options": True,
                                "allow_interspersed_args": False})
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(command) -> None:
    """Run COMMAND with mmshm instrumenting every Python process it starts.

    Example: mmshm run -- python -m sglang.launch_server --model-path M --tp 2

    Spawned children (SGLang's scheduler and detokenizer) are instrumented
    too. MMSHM_INSTRUMENT selects the instrumentors (comma-separated, or
    "none"); by default, every installed one. An existing sitecustomize keeps
    working. The exit status is COMMAND's.
    """
    from .autopatch import run as run_command

    sys.exit(run_command(list(command)))


if __name__ == "__main__":
    main()
