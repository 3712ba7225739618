"""Rich progress display and result tables of ``mmshm bench``."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from mmshm.segments.segfile import PREFIX

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

    def step(self, text: str, advance: int = 1) -> None:
        self.progress.update(self.task, advance=advance, detail=text)

    def warn(self, text: str) -> None:
        self.console.print(f"[yellow]warning:[/] {text}")


class PlainReporter(Reporter):
    """Progress as plain lines on ``console`` (stderr that is not a terminal:
    a log or a pipe): each phase as it begins, and the count of finished runs
    at most every ``every_s`` seconds."""

    def __init__(self, console: Console, every_s: float = 10.0):
        import time

        self.console = console
        self.every_s = every_s
        self._clock = time.monotonic
        self.t0 = self._clock()
        self.last = self.t0
        self.done = 0
        self.total: int | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def _line(self, text: str) -> None:
        self.last = self._clock()
        self.console.print(f"[{self.last - self.t0:5.0f} s] {text}", markup=False,
                           highlight=False)

    def start(self, total_steps: int) -> None:
        self.total = total_steps

    def stage(self, text: str) -> None:
        self._line(text)

    def step(self, text: str, advance: int = 1) -> None:
        self.done += advance
        if self._clock() - self.last >= self.every_s:
            self._line(f"{self.done}/{self.total} runs done ({text})")

    def warn(self, text: str) -> None:
        self.console.print(f"warning: {text}", markup=False, highlight=False)


def _ms(s: float | None) -> str:
    return "" if s is None else f"{s * 1e3:,.1f}"


def _mb(b: int) -> str:
    return f"{b / 1e6:,.1f}"


def _bytes(b: int | None) -> str:
    if b is None:
        return ""
    if b >= 1e6:
        return f"{b / 1e6:,.1f} MB"
    if b >= 1e3:
        return f"{b / 1e3:,.1f} kB"
    return f"{b} B"


def _gbps(v: float | None) -> str:
    return "" if v is None else f"{v / 1e9:,.2f}"


def _x(v: float | None, digits: int = 1) -> str:
    return "" if v is None else f"{v:,.{digits}f}x"


def _groups(result: dict) -> list[tuple[tuple, list[dict]]]:
    out: dict[tuple, list[dict]] = {}
    for r in result["runs"]:
        out.setdefault((r["tp"], r["n"], r["resolution"]), []).append(r)
    return list(out.items())


# (header, justification, what it means: in the table's caption when shown)
_COLUMNS = (
    ("images", "right", None),
    ("MB", "right", "MB: payload per request"),
    ("mode", "left", None),
    ("copies", "right", "copies: messages TP rank 0 receives (n, or n+1 for fresh-segment)"),
    ("bcast ms", "right", "bcast ms: the broadcast step (sharing, metadata, unpickling)"),
    ("e2e ms", "right", "e2e ms: producer to every TP rank holding its tensors"),
    ("e2e/floor", "right", "e2e/floor: end to end over the floor (lower is better)"),
    ("vs inline", "right", "vs inline: inline's end to end over this mode's"),
    ("vs fresh", "right", "vs fresh: fresh-segment's end to end over this mode's"),
    ("wrap GB/s", "right", ("wrap GB/s: the producer's copy into shared memory (floor row: its "
                           "memcpy into warm memory)")),
    ("threads", "right", ("threads: the threads that copied one photo into shared memory "
                          "(MMSHM_COPY_THREADS)")),
    ("wrap/floor", "right", ("wrap/floor: that copy's time over the floor's memcpy of as many "
                             "bytes (lower is better)")),
    ("bcast B", "right", "bcast B: bytes TP rank 0 broadcasts"),
    ("RSS/payload", "right", "RSS/payload: the most a TP rank's RSS grew holding the batch"),
    ("reps", "right", ("reps: repetitions behind the medians (fewer than --repeat once --budget "
                      "is spent)")),
    ("ok", "center", "ok: bytes correct on every rank"),
    ("left", "right", "left: segments left behind"),
)
_MULTI_NODE = (
    ("inter-node", "right", "inter-node: bytes sent between the simulated nodes"),
    ("bcast all ms", "right", ("bcast all ms: the broadcast until every rank holds its tensors "
                               "(floor row: one send of the payload to the other node, point to "
                               "point over the same link)")),
    ("vs link", "right", "vs link: that over the floor's one send (lower is better)"),
)


#: the console width the bench prints its tables with into a file or a pipe
#: (every column: no terminal to fit)
FULL_WIDTH = 260
# the columns kept on a terminal too narrow for every column, and for these
_COMPACT = ("images", "mode", "e2e ms", "e2e/floor", "vs inline", "vs fresh",
            "threads", "wrap/floor", "RSS/payload", "ok")
_NARROW = ("images", "mode", "e2e ms", "e2e/floor", "vs inline", "wrap/floor", "ok")


def _table_width(widths: list[int]) -> int:
    """Characters a rich table of columns of these text widths takes (a
    space each side of a cell, a rule between and around the columns)."""
    return sum(w + 3 for w in widths) + 1


def result_tables(result: dict, width: int | None = None) -> list[Table]:
    """One table per (TP, n, resolution): medians in milliseconds; for each
    image count a ``floor`` row (warm memcpy of the payload + metadata-only
    broadcast) and one row per mode with its ratios. With ``width`` (a
    terminal's characters) the table keeps every column if they fit, else the
    :data:`_COMPACT` ones if they fit, else the :data:`_NARROW` ones (the JSON
    output has everything); no header or cell is ever cut short (rich would
    squeeze a column below its text: ``re…``, ``flo…``)."""
    tables = []
    for (tp, n, res), runs in _groups(result):
        nodes = max((r.get("nodes", 1) for r in runs), default=1)
        multi = nodes > 1
        where = f" over {nodes} nodes" if multi else ""
        columns = _COLUMNS + (_MULTI_NODE if multi else ())
        rows: list = []  # (cells, style), None for a section break

        def row(*cells, rows=rows, **kw):
            rows.append((list(cells), kw))

        extra = (lambda *v: v) if multi else (lambda *v: ())
        by_images: dict[int, list[dict]] = {}
        for r in runs:
            by_images.setdefault(r["images"], []).append(r)
        for k, rs in sorted(by_images.items()):
            f = rs[0]
            row(str(k), _mb(f["payload_bytes"]), "[dim]floor[/]", "",
                _ms(f.get("floor_broadcast_s")), _ms(f.get("floor_s")), "1.0x", "", "",
                _gbps(f.get("memcpy_Bps")), "", "1.0x" if f.get("memcpy_Bps") else "",
                _bytes(f.get("floor_broadcast_bytes")),
                "", "", "", "", *extra("", _ms(f.get("floor_link_s")),
                                      "1.0x" if f.get("floor_link_s") else ""), style="dim")
            for r in rs:
                if r.get("skipped"):
                    row("", "", r["mode"], str(r["copies"]), "",
                        "[yellow]skipped[/]", "", "", "", "", "", "", "", "", "0", "", "",
                        *extra("", "", ""))
                    continue
                row(
                    "", "", r["mode"], str(r["copies"]), _ms(r["broadcast_s"]),
                    _ms(r["end_to_end_s"]), _x(r.get("e2e_over_floor"), 2),
                    _x(r.get("end_to_end_speedup_vs_inline")),
                    _x(r.get("end_to_end_speedup_vs_fresh_segment")),
                    _gbps(r.get("wrap_Bps")),
                    "" if r.get("copy_threads") is None else str(r["copy_threads"]),
                    _x(r.get("wrap_over_floor"), 2),
                    _bytes(r.get("broadcast_bytes")), _x(r.get("rss_growth_over_payload"), 2),
                    str(r.get("repeat", "")),
                    "[green]yes[/]" if r["correct"] else "[red]NO[/]",
                    str(len(r.get("leftover_segments", []))),
                    *extra(_bytes(r.get("internode_bytes")), _ms(r.get("broadcast_total_s")),
                           _x(r.get("broadcast_over_link"), 2)),
                )
            rows.append(None)
        widest = [max([len(col)] + [Text.from_markup(r[0][i]).cell_len
                                    for r in rows if r is not None])
                  for i, (col, _, _) in enumerate(columns)]
        keep = list(range(len(columns)))
        for shown in (_COMPACT, _NARROW):
            if width is None or _table_width([widest[i] for i in keep]) <= width:
                break
            keep = [i for i, c in enumerate(columns) if c[0] in shown or c in _MULTI_NODE]
        compact = len(keep) < len(columns)
        caption = "; ".join(
            ["floor (row): a warm memcpy of the payload plus a broadcast of metadata only, "
             "the least any transport could take"]
            + [columns[i][2] for i in keep if columns[i][2]])
        caption += ("; a mode can land below the floor when the host is busy"
                    + (f"; a terminal of {_table_width(widest)}+ columns (or --json) shows "
                       "every column" if compact else ""))
        reps = max((r.get("repeat") or 0 for r in runs), default=0)
        how = "1 run" if reps <= 1 else f"medians of up to {reps} runs"
        t = Table(title=f"mmshm bench: TP={tp} n={n} {res}{where} ({how})", caption=caption)
        for i in keep:
            col, just, _ = columns[i]
            t.add_column(col, justify=just, no_wrap=True, min_width=widest[i])
        for r in rows:
            if r is None:
                t.add_section()
            else:
                t.add_row(*(r[0][i] for i in keep), **r[1])
        tables.append(t)
    return tables


def h2d_line(r: dict) -> str | None:
    """``--device cuda``: a run's host-to-device copies in words, or None."""
    if not r.get("h2d_bytes"):
        return None
    pinned = r.get("h2d_pinned_Bps")
    return (f"host to device {r['h2d_bytes'] / 1e6:,.1f} MB per rank: pageable "
            f"{r['h2d_pageable_Bps'] / 1e9:.2f} GB/s, "
            + (f"registered {pinned / 1e9:.2f} GB/s (+{r['host_register_s'] * 1e3:.1f} ms to "
               f"register, {r['host_unregister_s'] * 1e3:.1f} ms to unregister)"
               if pinned else f"registered: {r.get('h2d_error') or 'not measured'}"))


def copy_threads_line(result: dict) -> str | None:
    """The producer's copy threads in words (``threads`` and ``wrap/floor``
    columns), or None when the result does not say."""
    cfg = result.get("config") or {}
    threads = cfg.get("copy_threads")
    if threads is None:
        return None
    setting = cfg.get("copy_threads_setting")
    cpus = (result.get("host") or {}).get("cpus_affinity")
    how = ("automatic" if not setting else f"MMSHM_COPY_THREADS={setting}")
    return (f"producer copy threads: {threads} per photo ({how}"
            + (f", {cpus} CPUs in its affinity" if cpus else "") + "); wrap/floor is the "
            "wrap's time over the floor's memcpy of as many bytes")


def summary_lines(result: dict) -> list[str]:
    """The summary under the tables, in plain words: per mode (but inline)
    and configuration, how its broadcast step grew from the fewest to the
    most images, next to the metadata-only floor's, and how it compares with
    the floor's broadcast."""
    out = []
    for s in result.get("summary", []):
        if s["mode"] == "inline":
            continue
        lo, hi = s["images"]
        fg = s.get("floor_broadcast_growth")
        bf = s.get("broadcast_over_floor") or [None, None]
        line = (f"{s['mode']}, TP={s['tp']} n={s['n']} {s['resolution']}: with {hi} images "
                f"instead of {lo}, its broadcast step took {s['broadcast_growth']:.2f} times "
                f"as long")
        if fg:
            line += f" (a metadata-only broadcast: {fg:.2f} times)"
        if None not in bf:
            line += (f"; it took {bf[0]:.1f} times a metadata-only broadcast at {lo} "
                     f"image(s) and {bf[1]:.1f} times at {hi}")
        out.append(line + ".")
    return out


def print_result(result: dict, console: Console) -> None:
    """Print the result tables, skipped runs, any problems and the leftover check."""
    for t in result_tables(result, console.width):
        console.print(t)
    for r in result["runs"]:
        tag = f"{r['mode']} TP={r['tp']} n={r['n']} {r['resolution']} x{r['images']}"
        if r.get("skipped"):
            console.print(f"[yellow]{tag} skipped:[/] {r['skipped']}")
        for p in r.get("problems", []):
            console.print(f"[red]{tag}:[/] {p}")
        line = h2d_line(r)
        if line:
            console.print(f"{tag}: {line}")
    for f in result.get("floors", []):
        for p in f.get("problems", []):
            console.print(f"[red]floor TP={f['tp']} n={f['n']} x{f['images']}:[/] {p}")
    line = copy_threads_line(result)
    if line:
        console.print(line, markup=False, highlight=False)
    for line in summary_lines(result):
        console.print(line, markup=False, highlight=False)
    left = result.get("leftover_segments", [])
    if left:
        console.print(f"[red]{len(left)} segment file(s) were left behind (removed):[/] "
                      + ", ".join(left[:5]))
    else:
        k = result["config"].get("nodes", 1)
        where = f" (nor in its {k} node directories)" if k > 1 else ""
        console.print(f"no {PREFIX}* segment left in {result['config']['shm_dir']}{where} by the "
                      f"bench ({result['elapsed_s']:.1f} s in all)")
