"""The ``mmshm`` command line (console script ``mmshm = mmshm.cli:main``).

``main`` is a click group; each subcommand is a thin function that imports
its implementation lazily (spawned processes re-import this module, and
``mmshm --help`` should stay fast). Add a subcommand with ``@main.command()``.
"""

from __future__ import annotations

import json
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


@main.command()
@click.option("--tp", type=click.IntRange(min=1), default=2, show_default=True,
              help="TP ranks (spawned processes in one gloo group).")
@click.option("--n", "n", type=click.IntRange(min=1), default=2, show_default=True,
              help="Parallel-sampling copies per request.")
@click.option("--images", default="1,8,32", show_default=True, callback=_int_list,
              help="Comma-separated image counts per request.")
@click.option("--resolution", type=click.Choice(["720p", "1080p"]), default="720p",
              show_default=True, help="Photo resolution before the Qwen2-VL processor.")
@click.option("--modes", default="inline,mmshm", show_default=True, callback=_str_list,
              help="Comma-separated transport modes.")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True,
              help="Repetitions per (images, mode); medians are reported.")
@click.option("--min-bytes", type=click.IntRange(min=0), default=None,
              help="Shared-memory threshold in bytes [default: MMSHM_MIN_BYTES].")
@click.option("--shm-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Segment directory [default: MMSHM_DIR or /dev/shm].")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=300.0,
              show_default=True, help="Seconds allowed for start-up and each step.")
@click.option("--warmup/--no-warmup", default=True, show_default=True,
              help="Run each mode once on a 1-image request first (not reported).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True),
              default=None, help="Write the results as JSON to this file ('-' for stdout).")
def bench(tp, n, images, resolution, modes, repeat, min_bytes, shm_dir, timeout_s, warmup,
          json_path) -> None:
    """Time inline transport against mmshm on the request path of a VLM server.

    Real photos go through the Qwen2-VL image processor, each request is
    fanned out into N copies, sent over ZMQ to TP rank 0 and broadcast to
    the TP ranks; every rank checks the bytes. Exits 1 if any run delivered
    wrong bytes or left a shared-memory segment behind, 2 on a usage error,
    3 if the bench itself failed (a TP rank died or timed out).
    """
    from rich.console import Console

    from .bench import MODES, BenchConfig, BenchError, run_bench
    from .bench.report import RichReporter, print_result

    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise click.BadParameter(f"unknown mode(s) {', '.join(unknown)}; "
                                 f"choose from {', '.join(MODES)}", param_hint="--modes")
    cfg = BenchConfig(tp=tp, n=n, images=images, resolution=resolution, modes=modes,
                      repeat=repeat, min_bytes=min_bytes, timeout_s=timeout_s, warmup=warmup,
                      shm_dir=shm_dir)
    # SIGTERM unwinds like Ctrl-C, so the TP ranks are stopped and joined
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    err = Console(stderr=True)
    out = Console(stderr=json_path == "-")
    if not out.is_terminal:
        out.width = max(out.width, 132)
    try:
        with RichReporter(err) as rep:
            result = run_bench(cfg, reporter=rep)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    except BenchError as exc:
        err.print(f"[red]bench failed:[/] {exc}")
        sys.exit(3)
    print_result(result, out)
    if json_path:
        text = json.dumps(result, indent=2)
        if json_path == "-":
            click.echo(text)
        else:
            with open(json_path, "w") as f:
                f.write(text + "\n")
            out.print(f"results written to {json_path}")
    bad = [r for r in result["runs"] if not r["correct"] or r["leftover_segments"]]
    if bad or result["leftover_segments"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
