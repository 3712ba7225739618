"""``mmshm bench epd``'s cross-node row: the encoder cache's Mooncake Store leg
(:mod:`mmshm.transport.ec_store`) against a raw Store get of the same bytes.

Two processes stand for two nodes, each with a segment directory of its own
(``MMSHM_DIR``): *node A* (the encoder) saves each output in its shared
memory and puts it in the Store (:meth:`StoreTier.put`), its objects held in
the segment it lends to the Store; *node B* (PD) lends a segment too small
for any object, so every read crosses the transfer engine (``tcp``). A
``mooncake_master`` on 127.0.0.1 (found beside the engine's package or on
``PATH``; without one the row says why and is skipped) keeps the index.

Each round node B reads all the items in four ways, in turn (each first in
turn): as mmshm's PD reads a request's items
(:func:`mmshm.transport.ec_store.fetch_local_many`: every item sized, then
one scattered get of them all, each record and digest checked, each entry
published in node B's shared memory, then :meth:`EncoderCache.lookup`: the
hop ends when PD holds every entry, bytes checked against the encoder's
BLAKE3); as a bare client would, into a buffer registered with the engine
once: ``get_into`` per item, and one ``batch_get_into_multi_buffers`` of all
the items (the call mmshm's read makes), the raw transfer being the faster of
the two; and as mmshm's fetch did before its one-copy read (``two_copy``,
item by item: the read buffer, then :meth:`EncoderCache.save`). ``x raw`` is
the ratio of the medians of the per-round totals, all measured in the same
run.

Then, in the same run, vLLM's own ``ECMooncakeConnector`` (0.32, push mode,
the same transfer engine over ``tcp``) moves the same items from a node A to a
node B (:mod:`mmshm.bench.ec_mooncake_baseline`: both connector halves driven
as vLLM's engine drives them, in an interpreter that imports vLLM; skipped,
with the reason, where none does, or with ``MMSHM_BENCH_VLLM_BASELINE=0``):
``vllm_push_ms``, from "the encoder holds the outputs" to "PD holds them in
the tensors its model reads", bytes checked against the same BLAKE3.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from mmshm.bench.mooncake_master import Master, kill_group, master_binary
from mmshm.bench.node_pair import blake as _blake
from mmshm.bench.node_pair import item as _item
from mmshm.bench.node_pair import line as _line

#: one Qwen2-VL-7B encoder output of a 720p photo: (rows, width), bf16
ITEM_SHAPE = (1196, 3584)
#: the goal: the cross-node hop at most this many times the raw transfer
GOAL_RAW_X = 1.3
#: the goal: the cross-node hop at most this many times vLLM's ECMooncakeConnector push
GOAL_VLLM_X = 1.0
#: node A's rounds of save + put under other keys before the items node B reads
#: (the first a warm-up; the others and the last one timed: ``encoder_put_ms``)
PUT_ROUNDS = 3


def remove_dirs(dirs, leftovers: dict) -> None:
    """Remove each of ``dirs`` (the bench's own segment directories), first
    noting in ``leftovers`` (directory -> file names) what was left in it."""
    for d in dirs:
        left = os.listdir(d) if os.path.isdir(d) else []
        if left:
            leftovers[d] = left
        shutil.rmtree(d, ignore_errors=True)


def _key(i: int, nonce: str) -> bytes:
    from mmshm.transport.encoder_cache import content_key

    return content_key(f"bench cross-node item {i} {nonce}", "bench")


# -- the two nodes ---------------------------------------------------------------------
def _connect(extra: dict, server: str, node: str):
    """Node ``node``'s Store tier, connected; None (after printing the error
    as the node's RESULT line) when it does not connect within 20 s."""
    from mmshm.transport import ec_store

    tier = ec_store.from_config(extra, server=server)
    if tier is None or not tier.wait_connected(20):
        print("RESULT " + json.dumps({"error": f"node {node} could not connect to the Store: "
                                               f"{tier and tier._connect_error}"}), flush=True)
        return None
    return tier


def _encoder(extra: dict, items: int, shape, nonce: str) -> None:
    from mmshm.transport.encoder_cache import EncoderCache

    cache = EncoderCache(keep_s=600, namespace="bench")
    tier = _connect(extra, "bench-encoder", "A")
    if tier is None:
        return
    outputs = [_item(i, shape) for i in range(items)]
    digests = [_blake(t) for t in outputs]

    def put_round(tag: str) -> tuple[bool, float | None]:
        # from "the encoder holds the outputs" to the last put done: saved, put
        done = []
        t0 = time.perf_counter()
        for i, t in enumerate(outputs):
            cache.save(_key(i, tag), t, label=f"item {i}")
            tier.put(_key(i, tag), t, on_done=lambda: done.append(time.perf_counter()))
        ok = tier.flush(120)
        return ok, (max(done) - t0) * 1e3 if ok and len(done) == items else None

    put_ms = []
    for r in range(PUT_ROUNDS):  # other keys, the first a warm-up: node A's put, warm
        ok, ms = put_round(f"{nonce} put {r}")
        if r and ms is not None:
            put_ms.append(ms)
        for i in range(items):
            cache.evict(_key(i, f"{nonce} put {r}"))
            tier._store.remove(tier.store_key(_key(i, f"{nonce} put {r}")))
    ok, ms = put_round(nonce)  # the items node B reads
    put_ms.append(ms)
    print("READY " + json.dumps({"ok": ok, "stats": tier.stats, "digests": digests,
                                 "put_ms": put_ms}), flush=True)
    sys.stdin.readline()  # node B is done
    tier.close()
    cache.close()
    print("RESULT " + json.dumps({"stats": tier.stats}), flush=True)


def _pd(extra: dict, items: int, shape, nonce: str, rounds: int, warmup: int,
        digests: list[str]) -> None:
    import torch
    from mmshm.transport import ec_store
    from mmshm.transport.encoder_cache import EncoderCache

    cache = EncoderCache(keep_s=600, namespace="bench")
    tier = _connect(extra, "bench-pd", "B")
    if tier is None:
        return
    store = tier._store  # the same client: the raw get goes through the same engine
    keys = [_key(i, nonce) for i in range(items)]
    skeys = [tier.store_key(k) for k in keys]
    size = max(store.get_size(s) for s in skeys)
    # one slot per item: the batched raw read scatters all of them in one call
    raw_buf = torch.empty(size * items, dtype=torch.uint8)
    registered = store.register_buffer(raw_buf.data_ptr(), raw_buf.numel()) == 0
    slots = [raw_buf.data_ptr() + i * size for i in range(items)]

    def two_copy(k):  # the fetch path before the one-copy read: read buffer, then save
        got, why = tier.fetch_view_why(k, torch.bfloat16, shape[0], shape=shape)
        if got is None:
            return f"store_{why}"
        view, release = got
        try:
            saved = cache.save(k, view, label="mooncake-store")
        finally:
            release()
        return "" if saved.published else str(saved.reason)

    def raw(p):  # a bare client: get_into per item, or one scattered get of them all
        if p == "raw":
            return [store.get_into(skeys[i], slots[0], size) for i in range(items)]
        return store.batch_get_into_multi_buffers(skeys, [[slots[i]] for i in range(items)],
                                                  [[size]] * items)

    def hop(p):  # PD's read of a request's items, until it holds them all
        if p == "mmshm":  # as PD's reader does: the request's items in one batch
            whys = ec_store.fetch_local_many(cache, tier, [(k, torch.bfloat16, shape[0], shape)
                                                           for k in keys])
        else:
            whys = [two_copy(k) for k in keys]
        return [cache.lookup(k, torch.bfloat16, shape[0], shape=shape) if not why else why
                for k, why in zip(keys, whys)]

    paths = ("raw", "raw_batch", "mmshm", "two_copy")
    ms = {p: [] for p in paths}
    wrong, misses = 0, []
    for r in range(warmup + rounds):
        took = dict.fromkeys(paths, 0.0)
        for p in paths[r % len(paths):] + paths[:r % len(paths)]:  # each first in turn
            t0 = time.perf_counter()
            got = raw(p) if p in ("raw", "raw_batch") else hop(p)
            took[p] = time.perf_counter() - t0
            for i, e in enumerate(got):
                if p in ("raw", "raw_batch"):
                    if e <= 0:
                        misses.append(f"{p} get {i}: {e}")
                    continue
                if not hasattr(e, "load"):
                    misses.append(f"{p} {i}: {e or 'lookup missed'}")
                    continue
                if r == warmup and _blake(e.load()) != digests[i]:
                    wrong += 1
                e.release()
                cache.evict(keys[i])  # the next read crosses nodes again
        if r >= warmup:
            for p in paths:
                ms[p].append(took[p] * 1e3)
    mm_ms, raw_ms = ms["mmshm"], ms["raw"]
    if registered:
        store.unregister_buffer(raw_buf.data_ptr())
    stats = dict(tier.stats)
    tier.close()
    cache.close()
    print("RESULT " + json.dumps({"mmshm_ms": mm_ms, "raw_ms": raw_ms, "wrong": wrong,
                                  "two_copy_ms": ms["two_copy"],
                                  "raw_batch_ms": ms["raw_batch"],
                                  "misses": misses[:8], "stats": stats,
                                  "raw_registered": registered}), flush=True)


# -- the driver --------------------------------------------------------------------------
def _child(role: str, env: dict, args: dict, stdin=None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "mmshm.bench.epd_nodes", role, json.dumps(args)]
    prof = os.environ.get("MMSHM_BENCH_PYSPY")  # a file: node B's profile (py-spy, raw)
    if prof and role == "pd" and shutil.which("py-spy"):
        argv = ["py-spy", "record", "--format", "raw", "-r", "200", "-o", prof,
                "--", *argv]
    return subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def measure(items: int = 8, rounds: int = 10, warmup: int = 2, shape=ITEM_SHAPE,
            timeout_s: float = 300.0, vllm_baseline: bool | None = None) -> dict:
    """The cross-node row: ``{"skipped": why}`` or the figures (per-round
    totals in ms for ``items`` outputs of ``shape`` bf16: ``mmshm_ms``,
    ``raw_ms``, their medians and ``x_raw``, ``wrong``, ``goal``), and under
    ``vllm`` vLLM's ``ECMooncakeConnector`` push of the same items
    (:func:`mmshm.bench.ec_mooncake_baseline.measure`: ``{"skipped": why}``,
    or ``push_ms``, ``push_ms_median``, ``x_raw``, ``wrong``, ``misses``, and
    ``goal``: mmshm's hop at most :data:`GOAL_VLLM_X` times it).
    ``vllm_baseline`` None runs it unless ``MMSHM_BENCH_VLLM_BASELINE=0``.

    Raises:
        RuntimeError: a node failed or did not answer within ``timeout_s``.
    """
    nbytes = items * shape[0] * shape[1] * 2
    base = {"items": items, "shape": list(shape), "dtype": "bfloat16", "nbytes": nbytes,
            "rounds": rounds, "transport": "tcp"}
    try:
        from mmshm.transport import ec_store

        ec_store.load_engine()
    except (ImportError, OSError) as exc:
        return {**base, "skipped": f"the Mooncake engine cannot be loaded ({exc})"}
    binary = master_binary()
    if binary is None:
        return {**base, "skipped": "no mooncake_master binary (beside the engine's package "
                                   "or on PATH)"}
    master = Master(binary=binary)
    enc = pd = None
    dirs = [tempfile.mkdtemp(prefix=f"bench-epd-node{n}-", dir="/dev/shm") for n in "AB"]
    item = shape[0] * shape[1] * 2
    extra = master.extra(local_buffer_size=item + (8 << 20),
                         store_read_buffer_bytes=item + (1 << 20), store_timeout_s=30.0,
                         store_max_pending_items=items,
                         store_max_pending_bytes=nbytes + (1 << 20))
    nonce = os.urandom(6).hex()
    leftovers = {}
    try:
        try:
            master.start(timeout_s=20)
        except RuntimeError:
            return {**base, "skipped": "mooncake_master did not listen within 20 s"}
        env = dict(os.environ, GLOG_minloglevel="2", PYTHONUNBUFFERED="1")
        enc = _child("encoder", {**env, "MMSHM_DIR": dirs[0]},
                     {"extra": {**extra, "global_segment_size": (PUT_ROUNDS + 1) * nbytes
                                + (64 << 20)},
                      "items": items, "shape": list(shape), "nonce": nonce},
                     stdin=subprocess.PIPE)
        ready = _line(enc, "READY ", timeout_s)
        if not ready["ok"] or ready["stats"]["puts"] != items * (PUT_ROUNDS + 1):
            raise RuntimeError(f"node A put {ready['stats']['puts']} of "
                               f"{items * (PUT_ROUNDS + 1)} items")
        # node B starts after every put: the objects are all in node A's segment
        pd = _child("pd", {**env, "MMSHM_DIR": dirs[1]},
                    {"extra": {**extra, "global_segment_size": 16 << 20},
                     "items": items, "shape": list(shape), "nonce": nonce, "rounds": rounds,
                     "warmup": warmup, "digests": ready["digests"]})
        got = _line(pd, "RESULT ", timeout_s)
        pd.wait(60)
        enc.stdin.write("done\n")
        enc.stdin.flush()
        _line(enc, "RESULT ", 60)
        enc.wait(60)
    finally:
        for p in (pd, enc):
            kill_group(p)
        master.kill()
        remove_dirs(dirs, leftovers)
    if "error" in got:
        raise RuntimeError(got["error"])
    vllm = _vllm_row(items, rounds, warmup, shape, timeout_s, vllm_baseline,
                     ready["digests"])
    mm = statistics.median(got["mmshm_ms"]) if got["mmshm_ms"] else None
    raw_one = statistics.median(got["raw_ms"]) if got["raw_ms"] else None
    raw_batch = statistics.median(got["raw_batch_ms"]) if got["raw_batch_ms"] else None
    raw = min(x for x in (raw_one, raw_batch) if x) if raw_one or raw_batch else None
    x = mm / raw if mm and raw else None
    two = statistics.median(got["two_copy_ms"]) if got["two_copy_ms"] else None
    return {**base, "skipped": None, "mmshm_ms": got["mmshm_ms"], "raw_ms": got["raw_ms"],
            "raw_batch_ms": got["raw_batch_ms"], "get_into_ms_median": raw_one,
            "raw_batch_ms_median": raw_batch,
            "mmshm_ms_median": mm, "raw_ms_median": raw, "x_raw": x,
            "two_copy_ms": got["two_copy_ms"], "two_copy_ms_median": two,
            "two_copy_x_raw": two / raw if two and raw else None,
            "wrong": got["wrong"], "misses": got["misses"], "leftovers": leftovers,
            "gets": got["stats"]["gets"], "get_bytes": got["stats"]["get_bytes"],
            "raw_registered": got["raw_registered"], "encoder_put_ms": ready["put_ms"],
            "encoder_put_ms_median": _median(ready["put_ms"]),
            "goal": {"goal": f"cross-node hop at most {GOAL_RAW_X}x the raw Store get",
                     "met": None if x is None else bool(x <= GOAL_RAW_X and not got["wrong"]
                                                        and not got["misses"]),
                     "value": x},
            "vllm": _vllm_goal(vllm, mm, raw, got, _median(ready["put_ms"]))}


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _vllm_row(items, rounds, warmup, shape, timeout_s, on, digests) -> dict:
    if on is None:
        on = os.environ.get("MMSHM_BENCH_VLLM_BASELINE", "1") != "0"
    if not on:
        return {"skipped": "turned off (MMSHM_BENCH_VLLM_BASELINE=0)"}
    from mmshm.bench import ec_mooncake_baseline

    try:
        return ec_mooncake_baseline.measure(items=items, rounds=rounds, warmup=warmup,
                                            shape=shape, timeout_s=timeout_s,
                                            digests=digests)
    except RuntimeError as exc:  # a node failed: this row says so, the Store rows stand
        return {"skipped": None, "error": str(exc)}


def _vllm_goal(vllm: dict, mm, raw, got: dict, put_ms: float | None = None) -> dict:
    """The vLLM row with its ratios: ``x_raw``, ``mmshm_x_vllm`` (mmshm's
    hop, PD's read, over vLLM's push) and ``mmshm_put_x_vllm`` (node A's
    save + put of the items, ``put_ms``, the median of its warm rounds, plus
    the hop, over the push: both from "the encoder holds the outputs" to "PD
    holds them"), and the goal on ``mmshm_put_x_vllm``."""
    if vllm.get("skipped") or vllm.get("error"):
        return vllm
    v = vllm["push_ms_median"]
    x = (put_ms + mm) / v if put_ms and mm and v else None
    ok = not (vllm["wrong"] or vllm["misses"] or got["wrong"] or got["misses"])
    return {**vllm, "x_raw": v / raw if v and raw else None,
            "mmshm_x_vllm": mm / v if mm and v else None, "mmshm_put_x_vllm": x,
            "goal": {"goal": f"node A's save + put and PD's read at most {GOAL_VLLM_X}x "
                             f"vLLM's ECMooncakeConnector push over the same transport",
                     "met": None if x is None else bool(x <= GOAL_VLLM_X and ok),
                     "value": x}}


def describe_vllm(res: dict) -> str:
    """The vLLM baseline's line: its hop, its ratio to raw, mmshm's to it."""
    v = res.get("vllm") or {"skipped": "not measured"}
    what = "vLLM ECMooncakeConnector (push, same engine, tcp)"
    if v.get("skipped"):
        return f"{what}: skipped: {v['skipped']}"
    if v.get("error"):
        return f"{what}: failed: {v['error']}"
    g = v["goal"]
    put = (f"; node A's save + put ({res['encoder_put_ms_median']:.1f} ms) and the hop / it "
           f"{v['mmshm_put_x_vllm']:.2f}" if v.get("mmshm_put_x_vllm") else
           "; node A's save + put: not measured")
    return (f"{what}: {v['push_ms_median']:.1f} ms from the encoder's outputs to PD holding "
            f"them (node A's calls return after {v['producer_ms_median']:.1f} ms: its staging copy "
            f"{v['stage_ms_median']:.1f} ms, the write {v['write_ms_median']:.1f} ms), x raw "
            f"{v['x_raw']:.2f}; mmshm hop (PD's read) / it {v['mmshm_x_vllm']:.2f}{put} "
            f"({'bytes equal' if not v['wrong'] else str(v['wrong']) + ' WRONG'}"
            f"{', misses: ' + '; '.join(v['misses']) if v['misses'] else ''}); "
            f"goal: {g['goal']}: {'met' if g['met'] else 'not met'}")


def describe(res: dict) -> str:
    """One or two lines for the table's footer."""
    what = (f"cross-node (Mooncake Store, {res['transport']}, two processes with their own "
            f"segment directories): {res['items']} x {res['shape']} bf16 "
            f"({res['nbytes'] / 1e6:.1f} MB)")
    if res.get("skipped"):
        return f"{what}: skipped: {res['skipped']}"
    g = res["goal"]
    mark = "met" if g["met"] else "not met"
    return (f"{what}: mmshm hop {res['mmshm_ms_median']:.1f} ms, raw Store read "
            f"{res['raw_ms_median']:.1f} ms (the faster of get_into "
            f"{res['get_into_ms_median']:.1f} ms and batch_get_into_multi_buffers "
            f"{res['raw_batch_ms_median']:.1f} ms), x raw {res['x_raw']:.2f} (the two-copy read "
            f"and save it replaced: {res['two_copy_ms_median']:.1f} ms, "
            f"x raw {res['two_copy_x_raw']:.2f}) "
            f"({'bytes equal' if not res['wrong'] else str(res['wrong']) + ' WRONG'}"
            f"{', misses: ' + '; '.join(res['misses']) if res['misses'] else ''}); "
            f"goal: {g['goal']}: {mark}\n{describe_vllm(res)}")


if __name__ == "__main__":
    role, a = sys.argv[1], json.loads(sys.argv[2])
    if role == "encoder":
        _encoder(a["extra"], a["items"], tuple(a["shape"]), a["nonce"])
    elif role == "pd":
        _pd(a["extra"], a["items"], tuple(a["shape"]), a["nonce"], a["rounds"], a["warmup"],
            a["digests"])
    elif role == "run":  # python -m mmshm.bench.epd_nodes run '{"rounds": 5}'
        res = measure(**a)
        print(json.dumps({k: v for k, v in res.items()}, indent=1))
        print(describe(res))
