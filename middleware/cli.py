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

from mmshm import config as _config


#: Exit status for a directory that does not exist or cannot be read (gc, status).
EXIT_BAD_DIR = 5


def _items(value: str) -> list[str]:
    """The items of a comma-separated list; an empty item (``1,,8``, ``1,``)
    is a usage error."""
    items = [v.strip() for v in value.split(",")]
    if any(not v for v in items):
        raise click.BadParameter(f"{value!r} has an empty item: expected a comma-separated "
                                 f"list such as 1,8,32")
    return items


def _int_list(ctx, param, value: str) -> tuple[int, ...]:
    items = _items(value)
    try:
        out = tuple(int(v) for v in items)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected a comma-separated list of integers") \
            from None
    if any(v < 1 for v in out):
        raise click.BadParameter(f"{value!r}: expected positive integers")
    return out


def _str_list(ctx, param, value: str) -> tuple[str, ...]:
    return tuple(_items(value))


class _Size(click.ParamType):
    """Bytes, with units: ``720M``, ``2GiB``, ``1e9`` (:func:`mmshm.config.parse_size`)."""

    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        from mmshm.config import parse_size

        try:
            return parse_size(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _table(*columns: str, header: bool = True, indent: int = 2):
    """A borderless rich table with ``columns`` (a name ending in ``>`` is
    right-aligned: numbers), indented by ``indent``: the layout of every
    table the commands print (see :func:`_print_table`)."""
    from rich.table import Table

    t = Table(box=None, show_header=header, header_style="bold", pad_edge=False,
              padding=(0, 2, 0, 0), show_edge=False)
    for c in columns:
        right = c.endswith(">")
        t.add_column(c.rstrip(">"), justify="right" if right else "left", no_wrap=right)
    t.indent = indent
    return t


def _print_table(con, table) -> None:
    """Print ``table`` indented; into a pipe or a log (no terminal) each row
    stays on one line, however wide."""
    from rich.padding import Padding
    from rich.text import Text

    width = con.width if con.is_terminal else 100_000
    for line in con.render_lines(Padding(table, (0, 0, 0, table.indent), expand=False),
                                 con.options.update(width=width), pad=False):
        text = Text.assemble(*((seg.text, seg.style) for seg in line if not seg.control))
        text.rstrip()
        con.print(text, soft_wrap=True)


def _add_row(table, *cells, style: str | None = None) -> None:
    """Add a row of plain text (never read as rich markup: ``[default]``)."""
    from rich.text import Text

    table.add_row(*(c if isinstance(c, Text) else Text(str(c)) for c in cells), style=style)


def _default_help(name: str, extra: str = "") -> str:
    """``[default: NAME or its default]`` for an option that falls back on an
    ``MMSHM_*`` variable (its declaration in :data:`mmshm.config.VARIABLES`)."""
    return f"[default: {name} or {_config.BY_NAME[name].shown_default}{extra}]"


def _check_settings(command: str) -> None:
    """Exit with :data:`mmshm.config.EXIT_BAD_SETTING` and one line per bad
    ``MMSHM_*`` value, before the command does anything."""
    from mmshm import config

    bad = config.problems()
    if bad:
        for exc in bad:
            click.echo(f"mmshm {command}: error: {exc}", err=True)
        sys.exit(config.EXIT_BAD_SETTING)
    config.reload(warn=False)


def _dir_error(command: str, directory: str | None) -> None:
    """Exit with :data:`EXIT_BAD_DIR` and one line (:class:`mmshm.config.DirProblem`)
    if the segment directory cannot be listed."""
    from mmshm.segments.segfile import segment_dir

    d = segment_dir(directory)
    where = "--dir" if directory is not None else "MMSHM_DIR"
    problem = _config.dir_problem(d, create=False, where=where)
    if problem is None:
        try:
            os.listdir(d)
        except OSError as exc:
            problem = _config.DirProblem(d, f"it cannot be read ({exc.strerror})", where)
    if problem is not None:
        click.echo(f"mmshm {command}: error: {problem.message()}", err=True)
        sys.exit(EXIT_BAD_DIR)


#: What --quick sets (one size, one repetition).
QUICK = {"tp": (2,), "n": (2,), "images": (2,), "resolution": ("720p",), "repeat": 1}
QUICK_HELP = ("--tp 2 --n 2 --images 2 --resolution 720p --repeat 1, and a 64 MiB "
              "cache-flush buffer")
QUICK_EVICT_BYTES = 64 << 20


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


@main.group(invoke_without_command=True)
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
              help="Shared-memory threshold in bytes " + _default_help("MMSHM_MIN_BYTES")
                   + ".")
@click.option("--shm-dir", type=click.Path(), metavar="DIRECTORY", default=None,
              help="Segment directory " + _default_help("MMSHM_DIR") + ".")
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
@click.option("--quick", is_flag=True,
              help="A check in seconds, well under 1 GB: " + QUICK_HELP + " (options given "
                   "explicitly still win).")
@click.option("--skip-missing", is_flag=True,
              help="Skip requested modes this interpreter cannot run (sglang, vllm, "
                   "vllm-arena without the server installed) instead of stopping with an "
                   "error.")
@click.option("--workload", type=click.Choice(["fixed", "mixed"]), default="fixed",
              show_default=True,
              help="mixed: real photo sizes after Qwen2-VL's processor, 1-8 per request, 3 in "
                   "flight, 200 requests: the pool's hits and the registrations a CUDA host "
                   "would make per request (the first --tp, --quick, --shm-dir, --timeout and --json "
                   "apply; `mmshm bench mixed --help` has the rest).")
@click.pass_context
def bench(ctx, tp, n, images, resolution, sweep, modes, repeat, budget_s, max_mem_gb,
          min_bytes, shm_dir, nodes, timeout_s, warmup, device, json_path, plot_path,
          metrics_port, quick, skip_missing, workload) -> None:
    """Time transports on the request path of a VLM server, against the floor.

    Real photos go through the Qwen2-VL image processor, each request is
    fanned out into N copies, sent over ZMQ to TP rank 0 and broadcast to
    the TP ranks; every rank checks the bytes. Modes: inline (pixels
    pickled), fresh-segment (SGLang 0.5.23's n+1 fresh segments per request,
    as a baseline) and mmshm by default; also mmshm-eager-hash (every
    content hash computed by the producer), mmshm-hash-given, mmshm-arena
    (the GPU arena in the producer: MMSHM_ARENA_BYTES, else half the segment
    directory, at most 4 GiB; without CUDA its views are warm, unregistered
    pages: docs/gpu.md), and the
    servers' own code where the interpreter has it: sglang (SGLang 0.5.23),
    vllm and vllm-arena (vLLM 0.33.0; python -m tests.run sglang and
    python -m tests.run vllm build such interpreters under .venvs/). The floor, measured
    in the same run, is a memcpy of the payload into warm memory plus a
    metadata-only broadcast; on a busy host a mode can land below it.
    --nodes K simulates K nodes on this machine and reports the bytes sent
    between them (fresh-segment is skipped: it is single-node only).
    Runs the host cannot hold are skipped with a note; a requested mode this
    interpreter cannot run is a usage error unless --skip-missing. --quick
    checks the pipeline in seconds. Progress goes to stderr (plain lines
    when it is not a terminal). Exits 1 if any run delivered wrong bytes or
    left a shared-memory segment behind, 2 on a usage error (checked before
    anything runs, output paths included), 3 if the bench itself failed (a
    TP rank died or timed out), 4 on a bad MMSHM_* value.

    `mmshm bench serve` runs the benchmarks of a real server instead.
    """
    if ctx.invoked_subcommand is not None:
        return  # `mmshm bench serve ...`: its own options
    if workload == "mixed":
        from mmshm.bench import mixed

        args = ["--tp", str(tp[0]), "--timeout", str(timeout_s)] + (["--quick"] if quick else [])
        args += ["--shm-dir", shm_dir] if shm_dir is not None else []
        args += ["--json", json_path] if json_path else []
        sys.exit(mixed.main(args, prog="mmshm bench --workload mixed"))
    from click.core import ParameterSource
    from rich.console import Console

    from mmshm.bench import MODES, SWEEP, BenchConfig, BenchError, run_bench
    from mmshm.bench.report import FULL_WIDTH, PlainReporter, RichReporter, print_result

    _check_settings("bench")
    bad_dir = _config.dir_problem(shm_dir if shm_dir is not None else _config.get().dir,
                                  create=False,
                                  where="--shm-dir" if shm_dir is not None else "MMSHM_DIR")
    if bad_dir is not None:
        if shm_dir is not None:
            raise click.BadParameter(bad_dir.message(), param_hint="--shm-dir")
        raise click.UsageError(bad_dir.message())
    _check_output(json_path, "--json")
    _check_output(plot_path, "--plot")
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install 'mmshm[bench]'") from None
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise click.BadParameter(f"unknown mode(s) {', '.join(unknown)}; "
                                 f"choose from {', '.join(MODES)}", param_hint="--modes")
    if sweep and quick:
        raise click.UsageError("--sweep and --quick exclude each other")
    missing = {m: why for m in modes
               if (why := getattr(MODES[m], "unavailable", lambda: None)()) is not None}
    if missing and not skip_missing:
        m, why = next(iter(missing.items()))
        raise click.BadParameter(f"mode {m} cannot run: {why} "
                                 f"(--skip-missing runs the other modes)", param_hint="--modes")
    axes = {"tp": tp, "n": n, "images": images, "resolution": resolution, "repeat": repeat}
    for key, grid in (("sweep", SWEEP if sweep else None), ("quick", QUICK if quick else None)):
        for k, v in (grid or {}).items():
            if ctx.get_parameter_source(k) != ParameterSource.COMMANDLINE:
                axes[k] = v
    cfg = BenchConfig(**axes, modes=modes, budget_s=budget_s,
                      max_mem_bytes=None if max_mem_gb is None else int(max_mem_gb * 1e9),
                      min_bytes=min_bytes, timeout_s=timeout_s, warmup=warmup, shm_dir=shm_dir,
                      nodes=nodes, device=device,
                      **({"evict_max_bytes": QUICK_EVICT_BYTES} if quick else {}))
    # SIGTERM unwinds like Ctrl-C, so the TP ranks are stopped and joined
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    err = Console(stderr=True)
    out = Console(stderr=json_path == "-")
    if not out.is_terminal:  # a file or a pipe: the full table
        out.width = max(out.width, FULL_WIDTH)
    metrics_dir = _start_bench_metrics(metrics_port, err) if metrics_port is not None else None
    try:
        with (RichReporter(err) if err.is_terminal else PlainReporter(err)) as rep:
            result = run_bench(cfg, reporter=rep)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    except BenchError as exc:
        err.print(f"[red]bench failed:[/] {exc}")
        sys.exit(3)
    finally:
        if metrics_port is not None:
            from mmshm import metrics

            metrics.stop_exporter()
            if metrics_dir:
                import shutil

                shutil.rmtree(metrics_dir, ignore_errors=True)
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    print_result(result, out)
    if plot_path:
        from mmshm.bench.plot import plot_result

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


#: ``mmshm bench serve NAME``: the real-server benchmarks, module of mmshm.bench.serve each.
SERVE = {"ttft": "time to first token, plain server against under mmshm",
         "transport": "multimodal IPC cost per hop, the server's own transport against mmshm's"}


@bench.group(name="serve")
@click.option("--python", "python", default=None, metavar="PYTHON",
              type=click.Path(exists=True, dir_okay=False),
              help="The server's interpreter, which runs the benchmark (e.g. "
                   ".venvs/sglang-0.5.23-server/bin/python) [default: this one].")
def serve(python) -> None:
    """Benchmarks of a real server on this machine (SGLang or vLLM on CPU).

    Each starts the server in turn as configured (127.0.0.1, its own process
    group, killed on every way out) and prints a table; `mmshm bench serve
    NAME --help` gives its options. They need the server installed: run
    them with its interpreter (--python, or that interpreter's `-m
    mmshm.cli`). The default model is the test harness's tiny Qwen2-VL
    (.venvs/tiny-qwen2-vl, built when missing).
    """


def _serve_command(name: str, summary: str):
    @serve.command(name=name, help=f"{summary[0].upper()}{summary[1:]} (its own --help).",
                   context_settings={"ignore_unknown_options": True,
                                     "allow_interspersed_args": False},
                   add_help_option=False)
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    @click.pass_context
    def command(ctx, args) -> None:
        prog = f"mmshm bench serve {name}"
        python = ctx.parent.params["python"]
        if python is not None:
            # the server's interpreter runs this command: it replaces this process, so
            # that signals reach the benchmark (which kills its servers on the way out)
            os.execv(python, [python, "-m", "mmshm.cli", "bench", "serve", name, *args])
        import importlib

        sys.exit(importlib.import_module(f"mmshm.bench.serve.{name}").main(list(args), prog=prog))

    return command


for _name, _summary in SERVE.items():
    _serve_command(_name, _summary)


@bench.command(name="hop", context_settings={"ignore_unknown_options": True,
                                              "allow_interspersed_args": False},
               add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def hop(args) -> None:
    """The TP broadcast hop alone, gloo on 127.0.0.1 (its own --help).

    mmshm's broadcast of one SGLang-shaped batch per iteration, per rank,
    with the share of the failure agreement; --baseline DIR measures
    another mmshm alternately (mmshm.bench.hop).
    """
    from mmshm.bench import hop as hop_bench

    sys.exit(hop_bench.main(list(args), prog="mmshm bench hop"))


@bench.command(name="mixed", context_settings={"ignore_unknown_options": True,
                                                "allow_interspersed_args": False},
               add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def mixed_workload(args) -> None:
    """Real photo sizes after Qwen2-VL's processor, requests in flight (its own --help).

    The producer's pool hits and the registrations a CUDA host would make
    (simulated on a CPU host) per request, in steady state, for the pool's
    reuse rules and with the arena on or off (mmshm.bench.mixed).
    """
    from mmshm.bench import mixed

    sys.exit(mixed.main(list(args), prog="mmshm bench mixed"))


@bench.command(name="epd", context_settings={"ignore_unknown_options": True,
                                              "allow_interspersed_args": False},
               add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def epd(args) -> None:
    """The encoder -> prefill hop of EPD, each server's path beside mmshm's (its own --help).

    vLLM's ECExampleConnector (tmpfs, disk), SGLang's zmq at TP=2, mmshm's
    encoder cache and one memcpy, bytes checked on every rank, in one run
    (mmshm.bench.epd).
    """
    from mmshm.bench import epd as epd_bench

    sys.exit(epd_bench.main(list(args), prog="mmshm bench epd"))


def _check_output(path: str | None, option: str) -> None:
    """A usage error, before anything runs, if ``path`` cannot be written
    (its directory is missing or not writable, or it is a directory)."""
    if not path or path == "-":
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        why = f"the directory {parent} does not exist"
    elif os.path.isdir(path):
        why = "it is a directory"
    elif not os.access(path if os.path.exists(path) else parent, os.W_OK):
        why = "permission denied"
    else:
        return
    raise click.BadParameter(f"cannot write {path}: {why}", param_hint=option)


def _start_bench_metrics(port: int, console) -> str | None:
    """Put every bench process in prometheus-client's multiprocess mode (a
    private PROMETHEUS_MULTIPROC_DIR, inherited by the spawned producer and TP
    ranks) and serve the merged series on 127.0.0.1:``port``. Returns the
    directory it made (removed when the bench ends), or None."""
    import tempfile

    from mmshm import metrics

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


_DIR_HELP = ("Segment directory " + _default_help(
    "MMSHM_DIR", "; the launch scripts in examples/ use the default") + ".")


def _ec_config(ctx, param, value):
    """``--ec-config``: JSON text, or ``@path`` of a JSON file, of an object
    (:func:`mmshm.operations.doctor.ec_extra`); None when not given."""
    if value is None:
        return None
    from mmshm.operations.doctor import ec_extra

    text = value
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise click.BadParameter(f"{value[1:]}: {exc.strerror}") from None
    try:
        return ec_extra(text)
    except ValueError as exc:
        raise click.BadParameter(f"not a JSON object: {exc}") from None


def _print_others(con, others, total: int) -> None:
    from rich.text import Text

    if not others:
        con.print(Text("  nothing else on this file system"))
        return
    table = _table("bytes>", "files>", "owner", header=False)
    for g in others:
        ex = ", ".join(g.examples) + (", ..." if g.files > len(g.examples) else "")
        sparse = (f" [apparent size; {_size(g.allocated_bytes)} allocated now]"
                  if g.allocated_bytes < g.bytes else "")
        _add_row(table, _size(g.bytes), f"{g.files} file(s)",
                 f"{g.owner} ({g.pattern}){sparse}: {ex}")
    _add_row(table, _size(total), "", "in all")
    _print_table(con, table)


@main.command()
@click.option("--dir", "directory", default=None, metavar="DIR", help=_DIR_HELP)
@click.option("--expected-bytes", type=_Size(), default=None, metavar="SIZE",
              help="Multimodal bytes expected in flight at once, e.g. 720M, 2GiB "
                   "[default: 32 Qwen2-VL 720p images, about 687 MiB].")
@click.option("--ec-config", "ec_config", default=None, metavar="JSON|@FILE",
              callback=_ec_config,
              help="The EPD connector's ec_connector_extra_config (or vLLM's whole "
                   "--ec-transfer-config), as JSON or @file.json: also check its Mooncake "
                   "Store leg (settings, engine, master, metadata server).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(directory, expected_bytes, ec_config, as_json) -> None:
    """Check that this host is fit for mmshm's load.

    Reports the segment directory's size and free space, mmshm's segments
    (count, bytes, orphans left by crashed processes), what else fills the
    same file system (NCCL's nccl-*, psm_*, SGLang's sgl_shm_mq_* ...),
    ulimit -n against the descriptors a full batch needs, the memory cgroup
    that tmpfs pages count against, the installed SGLang/vLLM against the
    supported ranges, and server processes not started under `mmshm run`.
    With --ec-config, the EPD connector's Mooncake Store leg too: its
    settings parse, the engine's library loads, the master's RPC port
    accepts a TCP connection and its HTTP metadata server answers (each
    within store_timeout_s), and what listens where.
    Each problem comes with its fix; the --shm-size advised is the README's
    formula (expected load x 9/8 + other programs' files + the reserve,
    rounded up to whole GiB).

    Exits 0 when nothing needs fixing, 1 when something does, 2 on a usage
    error, 4 on a bad MMSHM_* value.
    """
    import msgspec
    from rich.text import Text

    from mmshm.segments import node
    from mmshm.operations.doctor import arena_text, diagnose, store_rows

    _check_settings("doctor")
    rep = diagnose(directory, expected_bytes=expected_bytes, ec_config=ec_config)
    if as_json:
        click.echo(msgspec.json.encode(rep).decode())
        sys.exit(0 if rep.ok else 1)
    con = _console()
    con.print(Text.assemble(("mmshm doctor: ", "bold"), rep.directory, f" ({rep.fs_type})"))
    fd = (f"ulimit -n {rep.fd_soft_limit if rep.fd_soft_limit is not None else 'unlimited'}"
          f" (hard {rep.fd_hard_limit if rep.fd_hard_limit is not None else 'unlimited'}); a "
          f"full batch needs about {rep.fd_needed} per process")
    if rep.cgroup_limit_bytes is not None:
        cg = (f"limit {_size(rep.cgroup_limit_bytes)}, {_size(rep.cgroup_usage_bytes or 0)} "
              f"in use (tmpfs pages count against it)")
    else:
        cg = "no memory limit" + (f" ({_size(rep.cgroup_usage_bytes)} in use)"
                                   if rep.cgroup_usage_bytes is not None else "")
    servers = ", ".join(f"{s.distribution} {s.version} "
                        f"({'supported' if s.supported else 'NOT supported'}: "
                        f"{s.supported_range})" for s in rep.servers) or "none installed here"
    missing = rep.fs_type == "missing"  # the directory cannot be read: sizes unknown
    rows = (
        ("size", "unknown" if missing else _size(rep.fs_size_bytes)),
        ("free", "unknown" if missing else _size(rep.fs_free_bytes)),
        ("reserve", "unknown" if missing else
         f"{_size(rep.reserve_bytes)} kept free for NCCL (MMSHM_MIN_FREE_BYTES)"),
        ("expected load", f"{_size(rep.expected_bytes)} of multimodal tensors in flight "
                          f"({rep.expected_assumption})"),
        ("advised size", f"--shm-size={rep.shm_size_gib}g for that load plus the other files "
                         f"below (README: sizing /dev/shm)"),
        ("segments", f"{rep.segments} ({_size(rep.segment_bytes)})"),
        ("orphans", f"{rep.orphans} ({_size(rep.orphan_bytes)})"),
        ("descriptors", fd),
        ("memory cgroup", cg),
        ("servers", servers),
        ("node", node.describe_text(rep.node) if rep.node else "unknown"),
        ("arena", "unknown" if missing else arena_text(rep)),
        *(store_rows(rep.store) if rep.store is not None else ()),
    )
    table = _table("item", "value", header=False)
    for key, value in rows:
        _add_row(table, key, value)
    _print_table(con, table)
    con.print(Text("other files on this file system:", style="bold"))
    if missing:
        con.print(Text("  unknown: the directory cannot be read"))
    else:
        _print_others(con, rep.others, rep.other_bytes)
    for note in rep.notes:
        con.print(Text.assemble(("note: ", "bold yellow"), note))
    if rep.ok:
        con.print(Text("no problems found", style="green"))
        return
    for p in rep.problems:
        con.print(Text.assemble(("problem: ", "bold red"), p.problem))
        con.print(Text.assemble(("    fix: ", "bold"), p.fix))
    sys.exit(1)


def _age(s: float | None) -> str:
    if s is None:
        return ""
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


@main.command()
@click.option("--dir", "directory", default=None, metavar="DIR", help=_DIR_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def status(directory, as_json) -> None:
    """Show what holds shared memory now: per process, then everything else.

    For each process that has segments open (pid, command, server role where
    its command line tells, whether it runs under `mmshm run`): segments it
    owns and holds, their bytes, the references outstanding on the ones it
    owns, the oldest one's age and its warm pool. Server processes with no
    segment are listed too, and so are processes with the EPD connector's
    Mooncake Store leg on: its state (connected, or the last connect
    error), its counts and what listens where. Then the other files on the same file system by
    owner (NCCL, Python shared memory, SGLang, DeepSpeed, semaphores), and
    totals against the file system's size and the reserve. Read-only and
    safe beside live servers: liveness comes from the segments' locks, and a
    pid reused during the scan is dropped. Processes of other users show up
    only when run as root.

    Exits 0, or 4 on a bad MMSHM_* value, 5 if the directory cannot be read.
    """
    import msgspec
    from rich.text import Text

    from mmshm.segments import node
    from mmshm.operations.status import MMSHM_ELSEWHERE, arena_lines, store_lines
    from mmshm.operations.status import status as survey_status

    _check_settings("status")
    _dir_error("status", directory)
    rep = survey_status(directory)
    if as_json:
        click.echo(msgspec.json.encode(rep).decode())
        return
    con = _console()
    con.print(Text.assemble(("mmshm status: ", "bold"), rep.directory, f" ({rep.fs_type}, "
                            f"{_size(rep.fs_size_bytes)})"))
    if rep.node is not None:
        con.print(Text(f"node: {node.describe_text(rep.node)}"))
    if rep.processes:
        con.print(Text("processes:", style="bold"))
        table = _table("pid>", "owned>", "held>", "bytes>", "refs>", "oldest>", "pooled", "run",
                       "role: command")
        for p in rep.processes:
            run = {True: "yes", False: "no", None: "?"}[p.under_mmshm_run]
            pooled = f"{p.pooled} ({_size(p.pooled_bytes)})" if p.pooled else "0"
            who = (f"{p.role}: " if p.role else "") + p.command
            _add_row(table, p.pid, p.owned, p.held, _size(p.bytes), p.references,
                     _age(p.oldest_age_s), pooled, run, who[:100])
        _print_table(con, table)
        con.print(Text("  owned: segments it created; held: opened from another process's "
                       "handle; refs: references outstanding on those it owns; pooled: idle "
                       "in its warm pool, reused by its next request; run: started under "
                       "`mmshm run`"))
        for p in rep.processes:
            if p.cached:
                con.print(Text(f"  {p.pid}: {p.cached} segment(s) ({_size(p.cached_bytes)}) "
                               f"held by the cache of the {p.role or 'process'} (e.g. vLLM's "
                               f"multimodal processor cache, --mm-processor-cache-gb): kept on "
                               f"purpose, released when the cache evicts them; not a leak"))
            for g in p.epd_held:
                con.print(Text(f"  {p.pid}: holds {g.entries} encoder output(s) "
                               f"({_size(g.bytes)}) of another instance (EPD) for "
                               f"{g.holder or 'an unnamed holder'}: given back when that "
                               f"lets go of them"))
            for t in p.store:
                for line in store_lines(p.pid, t, _size):
                    con.print(Text(line))
    else:
        con.print(Text("no process holds a segment in this directory, and no SGLang or vLLM "
                       "process is running" if not rep.segments else
                       "no visible process holds these segments"))
    # "live": some process holds it (its liveness lock), pooled ones included; not the
    # `held` column above (opened from another process's handle)
    live = [s for s in rep.segments if s.held]
    pooled = sum(1 for s in live if s.state == "pooled")
    con.print(Text(f"segments: {len(rep.segments)} ({_size(rep.segment_bytes)}): "
                   f"{len(live)} live ({pooled} pooled), {rep.orphans} orphaned "
                   f"({_size(rep.orphan_bytes)}; "
                   f"`mmshm gc` reclaims them), {_size(rep.pooled_bytes)} idle in pools"
                   + (f", {rep.in_flight} with references in flight "
                      f"({_size(rep.in_flight_bytes)}; kept for MMSHM_IN_FLIGHT_GRACE_S)"
                      if rep.in_flight else "")))
    if rep.unattributed:
        con.print(Text(f"  {rep.unattributed} held segment(s) ({_size(rep.unattributed_bytes)}) "
                       f"belong to processes this user cannot see"))
    for line in arena_lines(rep.arena, _size):
        con.print(Text(line))
    con.print(Text(f"other files on this file system ({rep.root}):", style="bold"))
    _print_others(con, rep.others, rep.other_bytes)
    other = rep.other_bytes - rep.mmshm_elsewhere_bytes  # sparse files at their apparent size
    other_allocated = sum(g.allocated_bytes for g in rep.others
                          if g.owner != MMSHM_ELSEWHERE)
    con.print(Text(
        f"totals: {_size(rep.fs_used_bytes)} used of {_size(rep.fs_size_bytes)} "
        f"(mmshm {_size(rep.segment_bytes + rep.mmshm_elsewhere_bytes)}"
        + (f" ({_size(rep.mmshm_elsewhere_bytes)} of it in other directories)"
           if rep.mmshm_elsewhere_bytes else "")
        + f", other files {_size(other)}"
        + (f" ({_size(other_allocated)} of it allocated now)" if other_allocated < other else "")
        + (f", not in any visible file {_size(rep.unaccounted_bytes)}"
           if rep.unaccounted_bytes else "")
        + f"); {_size(rep.fs_free_bytes)} free, of which mmshm keeps "
          f"{_size(rep.reserve_bytes)} as the reserve (MMSHM_MIN_FREE_BYTES)"))
    for note in rep.notes:
        con.print(Text.assemble(("note: ", "bold yellow"), note))


@main.command(name="config")
@click.option("--json", "as_json", is_flag=True, help="Print the settings as JSON.")
def config_cmd(as_json) -> None:
    """Print every MMSHM_* setting in effect and where it came from.

    Values are read from this environment, as a server started from it would
    read them (a launch script's exports apply only inside that script).
    Exits 0, or 4 if a variable holds a value mmshm cannot use (listed, one
    line each, with what is allowed; a server would warn and use the
    default).
    """
    from rich.text import Text

    config = _config
    rows = []
    bad = []
    d = config.reload(warn=False).dir
    try:
        st = os.statvfs(d)
        fs_size = st.f_blocks * st.f_frsize
    except OSError:
        fs_size = None
    for var in config.VARIABLES:
        raw = os.environ.get(var.name)
        try:
            value, source = config.parse_variable(var)
            error = None
        except config.SettingError as exc:
            value, source, error = var.default, "default (bad value ignored)", str(exc)
            bad.append(exc)
        if value is None and var.computed is not None and fs_size is not None:
            shown = f"{var.computed(fs_size)} ({var.shown_default}, for {d})"
        elif value is None:
            shown = var.shown_default
        elif isinstance(value, bool):
            shown = "1" if value else "0"
        else:
            shown = value
        rows.append({"variable": var.name, "value": value, "shown": str(shown), "raw": raw,
                     "source": source, "allowed": var.allowed, "meaning": var.doc,
                     "error": error})
    unknown = config.unknown_variables()
    dir_problem = config.dir_problem(d)
    if as_json:
        click.echo(json.dumps({"settings": [{k: v for k, v in r.items() if k != "shown"}
                                            for r in rows], "unknown": unknown,
                               "dir_problem": dir_problem and dir_problem.message()}))
    else:
        con = _console()
        con.print(Text("mmshm settings in effect for processes started from this environment:",
                       style="bold"))
        table = _table("variable", "value", "source", "meaning", header=False)
        # the names are what a user copies: never cut or folded (the longest sets
        # the column's width); the other columns wrap, and fold a word too long
        # for them rather than cut it
        name_col = table.columns[0]
        name_col.no_wrap, name_col.min_width = True, max(len(r["variable"]) for r in rows)
        for col in table.columns[1:]:
            col.overflow = "fold"
        for r in rows:
            _add_row(table, r["variable"], r["shown"], f"[{r['source']}]", r["meaning"],
                     style="red" if r["error"] else None)
        _print_table(con, table)
        for name in unknown:
            con.print(Text(f"note: {name} is set but mmshm reads no such variable"))
        if dir_problem is not None:
            con.print(Text.assemble(("note: ", "bold yellow"), dir_problem.message(
                "processes started from this environment send every tensor inline")))
    for exc in bad:
        click.echo(f"mmshm config: error: {exc}", err=True)
    if bad:
        sys.exit(config.EXIT_BAD_SETTING)


@main.command()
@click.option("--dir", "directory", default=None, metavar="DIR", help=_DIR_HELP)
@click.option("--dry-run", is_flag=True, help="List the orphans without removing them.")
@click.option("--json", "as_json", is_flag=True, help="Print the reaper's report as JSON.")
@click.option("--grace", "grace_s", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Keep segments whose references are in flight this long after their last "
                   "clean close " + _default_help("MMSHM_IN_FLIGHT_GRACE_S") + ".")
def gc(directory, dry_run, as_json, grace_s) -> None:
    """Reclaim orphaned segments: those no live process holds.

    Liveness comes from the locks every holder keeps on its segments, never
    from pids, so segments of other live servers on the host are left alone.
    Segments whose references are still in flight after a clean exit are
    kept for a grace period. Prints how many segments and bytes were (or,
    with --dry-run, would be) freed, by reason, and their names. With the
    warm pool on, a released segment stays in the directory (held by its
    creator) until MMSHM_POOL_IDLE_S passes: it is not an orphan, and gc
    keeps it.

    Exits 0, or 4 on a bad MMSHM_* value, 5 if the directory cannot be read.
    """
    import msgspec
    from rich.text import Text

    from mmshm.segments.reaper import reap

    _check_settings("gc")
    _dir_error("gc", directory)
    rep = reap(directory, dry_run=dry_run, grace_s=grace_s, quiet=True)  # one summary: gc's
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
@click.option("--info", is_flag=True,
              help="Say what would be instrumented for the interpreter COMMAND runs "
                   "(server, distribution, version, supported or why not), without "
                   "starting it. Exits 0 if something would be, 1 if not.")
@click.option("--observe", is_flag=True,
              help="Observe mode (MMSHM_MODE=observe): leave the server's own transport "
                   "exactly as it is and only time each hop of the multimodal path "
                   "(mmshm_ipc_seconds and mmshm_ipc_bytes with transport=\"server\"), "
                   "to measure what IPC costs before switching mmshm on.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(info, observe, command) -> None:
    """Run COMMAND with mmshm instrumenting every Python process it starts.

    Example: mmshm run -- python -m vllm.entrypoints.openai.api_server --model M

    Spawned children (vLLM's EngineCore and workers, SGLang's scheduler and
    detokenizer) are instrumented too. Each instrumented process writes one
    line to stderr naming the server, its version, its role and the paths it
    turned on; a path left off is a WARNING with the reason and the fix.
    Orphaned segments are reclaimed as the server starts, and what the
    server's processes left is reclaimed once COMMAND has exited.
    MMSHM_INSTRUMENT selects the instrumentors (comma-separated, or "none");
    by default every known one. An existing sitecustomize keeps working. The
    exit status is COMMAND's (4 for a bad MMSHM_INSTRUMENT).
    """
    from mmshm.operations.autopatch import info as run_info
    from mmshm.operations.autopatch import run as run_command
    from mmshm.config import EXIT_BAD_SETTING, SettingError

    env = dict(os.environ, MMSHM_MODE="observe") if observe else None
    try:
        sys.exit(run_info(list(command), env) if info else run_command(list(command), env))
    except SettingError as exc:
        click.echo(f"mmshm run: error: {exc}", err=True)
        sys.exit(EXIT_BAD_SETTING)


if __name__ == "__main__":
    main()
