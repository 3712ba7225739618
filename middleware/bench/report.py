"""Rich progress display and result table of ``mmshm bench``."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .runner import Reporter


class RichReporter(Reporter):
    """Shows :func:`mmshm.bench.run_bench`'s progress on ``console`` (stderr)."""

    def __init__(self, console: Console):
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
            console=console, transient=True, refresh_per_second=4)
        self.task = self.progress.add_task("mmshm bench", total=None, detail="")

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def start(self, total_steps: int) -> None:
        self.progress.update(self.task, total=total_steps)

    def stage(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def step(self, text: str) -> None:
        self.progress.update(self.task, advance=1, detail=text)

    def warn(self, text: str) -> None:
        self.console.print(f"[yellow]warning:[/] {text}")


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def _mb(b: int) -> str:
    return f"{b / 1e6:,.1f}"


def _bytes(b: int) -> str:
    if b >= 1e6:
        return f"{b / 1e6:,.1f} MB"
    if b >= 1e3:
        return f"{b / 1e3:,.1f} kB"
    return f"{b} B"


def result_table(result: dict) -> Table:
    """A table of the runs: medians in milliseconds, ratios against ``inline``."""
    runs = result["runs"]
    cfg = result.get("config", {})
    title = (f"mmshm bench: TP={cfg.get('tp')} n={cfg.get('n')} {cfg.get('resolution')} "
             f"(medians of {cfg.get('repeat')})")
    t = Table(title=title, caption="bcast x, e2e x: inline's time / this mode's time")
    for col, just in (("images", "right"), ("payload MB", "right"), ("mode", "left"),
                      ("broadcast ms", "right"), ("materialize ms", "right"),
                      ("end-to-end ms", "right"), ("bcast bytes", "right"),
                      ("bcast x", "right"), ("e2e x", "right"),
                      ("correct", "center"), ("leftover", "right")):
        t.add_column(col, justify=just)
    for r in runs:
        sb = r.get("broadcast_speedup_vs_inline")
        se = r.get("end_to_end_speedup_vs_inline")
        t.add_row(
            str(r["images"]), _mb(r["payload_bytes"]), r["mode"], _ms(r["broadcast_s"]),
            _ms(r.get("materialize_s", 0.0)), _ms(r["end_to_end_s"]),
            _bytes(r.get("broadcast_bytes", 0)),
            f"{sb:,.0f}x" if sb is not None else "",
            f"{se:,.1f}x" if se is not None else "",
            "[green]yes[/]" if r["correct"] else "[red]NO[/]",
            str(len(r.get("leftover_segments", []))),
        )
    return t


def print_result(result: dict, console: Console) -> None:
    """Print the result table, any problems and the leftover check."""
    console.print(result_table(result))
    for r in result["runs"]:
        for p in r.get("problems", []):
            console.print(f"[red]{r['mode']} x{r['images']}:[/] {p}")
    left = result.get("leftover_segments", [])
    if left:
        console.print(f"[red]{len(left)} segment file(s) were left behind (removed):[/] "
                      + ", ".join(left[:5]))
    else:
        console.print(f"no mmshm-* segment left in {result['config']['shm_dir']} by the bench "
                      f"({result['elapsed_s']:.1f} s in all)")
