"""``mmshm bench --plot``: end-to-end latency against payload, one line per mode."""

from __future__ import annotations

_STYLES = {"720p": "-", "1080p": "--"}
_MARKERS = {"720p": "o", "1080p": "s"}


def plot_result(result: dict, path: str) -> str:
    """Write a PNG of ``end_to_end_s`` against ``payload_bytes`` (log-log):
    one subplot per (TP, n), one line per mode and resolution, the floor in
    black. Skipped runs are left out. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    runs = [r for r in result["runs"] if not r.get("skipped")]
    combos = sorted({(r["tp"], r["n"]) for r in result["runs"]})
    modes = list(dict.fromkeys(r["mode"] for r in result["runs"]))
    colors = {m: f"C{i}" for i, m in enumerate(modes)}
    cols = min(2, max(1, len(combos)))
    rows = -(-len(combos) // cols) if combos else 1
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols + 2.2, 4.6 * rows), squeeze=False,
                             layout="constrained")
    resolutions = list(dict.fromkeys(r["resolution"] for r in result["runs"]))
    for ax, (tp, n) in zip(axes.flat, combos, strict=False):
        for res in resolutions:
            floors = sorted((f["payload_bytes"], f["floor_s"]) for f in result.get("floors", [])
                            if (f["tp"], f["n"], f["resolution"]) == (tp, n, res)
                            and f.get("floor_s"))
            if floors:
                ax.plot(*zip(*floors, strict=True), color="black", linestyle=_STYLES.get(res, ":"),
                        marker=_MARKERS.get(res, "x"), linewidth=1,
                        label=f"floor {res}" if len(resolutions) > 1 else "floor")
            for m in modes:
                pts = sorted((r["payload_bytes"], r["end_to_end_s"]) for r in runs
                             if (r["tp"], r["n"], r["resolution"], r["mode"]) == (tp, n, res, m))
                if pts:
                    ax.plot(*zip(*pts, strict=True), color=colors[m],
                            linestyle=_STYLES.get(res, ":"), marker=_MARKERS.get(res, "x"),
                            label=f"{m} {res}" if len(resolutions) > 1 else m)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e6:g} MB"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"TP={tp}, n={n}")
        ax.set_xlabel("payload per request (pixel_values bytes)")
        ax.set_ylabel("end to end (s)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(combos):]:
        ax.axis("off")
    legend: dict[str, object] = {}  # one legend for all subplots, outside them
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    if legend:
        fig.legend(list(legend.values()), list(legend), loc="outside right upper",
                   fontsize="small")
    fig.suptitle("mmshm bench: producer -> ZMQ -> TP rank 0 -> broadcast -> every TP rank",
                 fontsize="medium")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
