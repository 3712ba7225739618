"""``mmshm bench --workload mixed`` (``mmshm bench mixed``): real photo sizes, requests in flight.

The fixed-shape bench sends the same 720p photos request after request, so
every segment is reused at its exact size. Real traffic is not like that: a
Qwen2-VL-style processor resizes each photo to its own grid (dynamic
resolution), so almost every ``pixel_values`` has another size. This workload
measures what that does to the warm pool and the arena: how many segment
requests the producer's pool serves (hits per request) and how many mappings
each TP rank registers with CUDA (registrations per request), in steady
state, with several requests in flight.

**Photo sizes.** Each photo's width and height are drawn from :data:`PHOTO_MIX`,
a mixture of the dimensions that user photos come in:

- *phone camera photos* (35%): the native 4:3 and 16:9 outputs of current
  phone cameras, 12 MP 4032 x 3024 (Apple's iPhone spec sheets, most Android
  flagships' default mode), 4000 x 3000, 4080 x 3072 (Google Pixel),
  4032 x 2268 (16:9), half of them portrait;
- *phone screenshots* (15%): the displays of common phones, 1170 x 2532
  (iPhone 12-14), 1284 x 2778 (iPhone Pro Max), 1080 x 2400 (20:9 Android),
  750 x 1334 (iPhone SE);
- *web images* (30%): the sizes publishing platforms ask for or serve,
  1200 x 630 (the Open Graph share image Facebook and LinkedIn document),
  1080 x 1080 and 1080 x 1350 (Instagram's square and 4:5 portrait),
  1920 x 1080 and 1280 x 720 (video frames, wallpapers), 1024 x 768,
  800 x 600, 640 x 480;
- *cropped or resized images* (20%): a width uniform in [256, 2048] pixels
  and an aspect ratio log-uniform between 1:3 and 3:1.

The dimension lists come from those published specifications; the weights
of the four groups are this module's assumption (no public corpus of VLM
requests gives them), stated here so that a run can be compared with another.

**After the processor.** Each photo goes through Qwen2-VL's ``smart_resize``
(:func:`smart_resize`: both sides rounded to multiples of 28, the area
brought between ``min_pixels`` = 56 * 56 and ``max_pixels`` = 28 * 28 * 1280,
the default ``Qwen2VLImageProcessor`` configuration), then into patches of
14 x 14 pixels, 2 frames (temporal patch 2, an image repeated) and 3 colours:
``pixel_values`` is ``[grid_t * grid_h * grid_w, 1176]`` float32 with
``grid_t = 1``, ``grid_h = height / 14``, ``grid_w = width / 14`` (the 2 x 2
merge happens in the model, after the transport). A request holds 1 to 8
photos (uniform); the photos are synthetic bytes of those shapes (the
transport does not look at them), each with its own content.

**Requests in flight.** ``--in-flight`` K (default 3): while the producer
writes request i, the TP ranks still hold requests i-1 ... i-K+1 (a running
batch), so K requests' segments are live at once; a rank lets go of a
request when it receives the one K-1 later. Each step is in lockstep (the
producer waits for every rank before the next request), so a run is
reproducible: the same seed gives the same sizes and the same pool decisions.

**One segment per request.** The producer converts a request the way
mmshm's walker does (``mmshm.wrap``, through the bench's mmshm mode): one
:meth:`mmshm.ShmTensor.from_tensors` call per request, all its photos in one
segment at 4 KiB-aligned offsets, as SGLang's and vLLM's send paths do
(:meth:`mmshm.transport.sending.Outbox.prepare`). So a pool request, a
segment and a TP rank's mapping (a registration on a GPU host) stand for a
request, not a photo, and the pool only has to cover the requests in flight.

**What is counted.** On the producer: ``mmshm_pool_requests_total{result}``
(a hit: a segment taken from the pool, arena or plain; one per request), segments created,
and arena evictions (arena segments unlinked to make room). On each TP
rank: the registrations a CUDA host would make. This host has no GPU, so
each rank installs a :class:`RecordingRegistrar` in :mod:`mmshm.segments.arena`:
a **simulated registration on a CPU host**, which records what the arena asks
CUDA to register (one call per new mapping) and to unregister, and
registers nothing. Every rank checks every photo's bytes (the int64 sum of
its int32 words, against the producer's; each request changes a word in every
4 KiB page, so a stale page or a wrong segment is seen).

**Variants.** ``--rule`` gives the pool's reuse rule(s) to run, each on the
same workload in a fresh TP group: ``best`` (mmshm's, the default: the
smallest idle segment that holds the tensor, a plain one up to 4x its size,
an arena one of any size: :data:`mmshm.segments.table.FIT_RATIO`,
:data:`~mmshm.segments.table.ARENA_FIT_RATIO`), ``exact`` (a segment only at
its exact size class, the rule before) or a number R (best fit up to R times,
both kinds); ``--arena`` ``on`` (the producer's arena, ``--arena-bytes``,
default 1 GiB, as a CUDA host has it by default) and/or ``off`` (the plain
warm pool).

Goal (on the project's 2-core CPU host): in steady state (after the first
20 requests of 200, 3 in flight), at most 1 registration per 50 requests per
rank and a pool hit rate of at least 95%.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import random
import sys
import tempfile
import threading
import time
import traceback
from collections import deque

#: Qwen2-VL's processor (the default ``Qwen2VLImageProcessor``): patch size,
#: temporal patch, spatial merge, and the pixel bounds
PATCH, TEMPORAL, MERGE = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280
#: columns of ``pixel_values``: 3 colours x temporal patch x patch x patch
COLUMNS = 3 * TEMPORAL * PATCH * PATCH

#: (weight, group, sizes or None); None: width uniform in [256, 2048], aspect
#: log-uniform in [1/3, 3]. See the module docstring for where they come from.
PHOTO_MIX = (
    (0.35, "phone camera", ((4032, 3024), (4000, 3000), (4080, 3072), (4032, 2268))),
    (0.15, "phone screenshot", ((1170, 2532), (1284, 2778), (1080, 2400), (750, 1334))),
    (0.30, "web image", ((1200, 630), (1080, 1080), (1080, 1350), (1920, 1080), (1280, 720),
                         (1024, 768), (800, 600), (640, 480))),
    (0.20, "cropped or resized", None),
)

DEFAULT_REQUESTS = 200
DEFAULT_WARM = 20
DEFAULT_IN_FLIGHT = 3
DEFAULT_ARENA_BYTES = 1 << 30
#: a word changed in every 4 KiB page before each use (int32 words)
STRIDE_WORDS = 1024


def smart_resize(height: int, width: int, factor: int = PATCH * MERGE,
                 min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize`` (``transformers``' ``image_processing_qwen2_vl``):
    ``(height, width)`` in pixels, both multiples of ``factor``, the aspect
    ratio kept as well as the rounding allows, the area within
    ``[min_pixels, max_pixels]``. Raises ValueError for an aspect ratio
    above 200, as the processor does."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid(width: int, height: int, max_pixels: int = MAX_PIXELS) -> tuple[int, int, int]:
    """``image_grid_thw`` of a ``width`` x ``height`` photo after the processor:
    ``(1, height / 14, width / 14)`` of its resized size."""
    h, w = smart_resize(height, width, max_pixels=max_pixels)
    return 1, h // PATCH, w // PATCH


def draw_photo(rng: random.Random) -> tuple[str, int, int]:
    """``(group, width, height)`` of one photo drawn from :data:`PHOTO_MIX`."""
    x = rng.random()
    for weight, group, sizes in PHOTO_MIX:
        if x < weight or group == PHOTO_MIX[-1][1]:
            break
        x -= weight
    if sizes is None:
        w = rng.randint(256, 2048)
        aspect = math.exp(rng.uniform(math.log(1 / 3), math.log(3)))
        return group, w, max(16, round(w / aspect))
    w, h = rng.choice(sizes)
    if group == "phone camera" and rng.random() < 0.5:
        w, h = h, w  # portrait
    return group, w, h


def workload(requests: int = DEFAULT_REQUESTS, seed: int = 0, min_photos: int = 1,
             max_photos: int = 8, max_pixels: int = MAX_PIXELS) -> list[list[tuple[int, int, int]]]:
    """The grids of every photo of every request (``requests`` lists of 1..8
    ``(t, h, w)``), the same for the same arguments."""
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        k = rng.randint(min_photos, max_photos)
        out.append([grid(*draw_photo(rng)[1:], max_pixels=max_pixels) for _ in range(k)])
    return out


def describe(work: list[list[tuple[int, int, int]]]) -> dict:
    """Sizes in a workload: photos, distinct ``pixel_values`` shapes, rows and
    MB (min, median, max), photos per request (mean)."""
    rows = sorted(t * h * w for req in work for t, h, w in req)
    mb = [r * COLUMNS * 4 / 1e6 for r in rows]
    return {"requests": len(work), "photos": len(rows), "distinct_shapes": len(set(rows)),
            "rows_min": rows[0], "rows_median": rows[len(rows) // 2], "rows_max": rows[-1],
            "mb_min": round(mb[0], 2), "mb_median": round(mb[len(mb) // 2], 2),
            "mb_max": round(mb[-1], 2),
            "photos_per_request": round(len(rows) / max(1, len(work)), 2),
            "mb_per_request": round(sum(mb) / max(1, len(work)), 1)}


# -- the payloads -----------------------------------------------------------------------------
def _words(t):
    import torch

    return t.reshape(-1).view(torch.int32)


def checksum(t) -> int:
    """The int64 sum of ``t``'s int32 words (``t`` float32, contiguous)."""
    import torch

    return int(_words(t).sum(dtype=torch.int64))


class Photos:
    """The producer's photo tensors, made without a copy per request: one
    buffer of random words per photo slot of a request (``slots`` of
    ``max_rows`` rows each). A photo is the first ``rows`` rows of its slot
    with one word in every 4 KiB page raised by the request's tag
    (:meth:`make`), so each request's bytes differ from every earlier
    request's in every page; :meth:`undo` lowers them again once the
    producer has copied the photo into shared memory. Checksums come from
    the prefix sums of the words, so making a photo reads none of its bytes."""

    def __init__(self, max_rows: int, slots: int = 8, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        base = torch.randint(-2**30, 2**30, (max_rows * COLUMNS,), dtype=torch.int32,
                             generator=g)
        self.prefix = torch.cumsum(base, 0, dtype=torch.int64)
        self.slots = [base.clone() for _ in range(slots)]
        self._bumped: list[tuple[int, int, int, int]] = []

    def make(self, slot: int, rows: int, tag: int):
        """``pixel_values`` ``[rows, 1176]`` float32 in photo slot ``slot``
        (its bits: the slot's words, one in every 1024 raised by ``tag + 1``)
        and its checksum (:func:`checksum`)."""
        import torch

        n = rows * COLUMNS
        k = tag % STRIDE_WORDS
        words = self.slots[slot][:n]
        words[k::STRIDE_WORDS] += tag + 1
        self._bumped.append((slot, n, k, tag + 1))
        total = int(self.prefix[n - 1]) + (tag + 1) * len(range(k, n, STRIDE_WORDS))
        return words.view(torch.float32).view(rows, COLUMNS), total

    def undo(self) -> None:
        """Give every slot its words back (after the photos were copied)."""
        for slot, n, k, d in self._bumped:
            self.slots[slot][:n][k::STRIDE_WORDS] -= d
        self._bumped.clear()


# -- the simulated registrar ------------------------------------------------------------------
class RecordingRegistrar:
    """A **simulated registration on a CPU host**: installed in a TP rank with
    :func:`mmshm.segments.arena.set_registrar`, it records what the arena
    would ask CUDA to register (``cudaHostRegister``, once per new mapping)
    and unregister, and registers nothing; :meth:`settle` returns at once
    (no copy is in flight on a CPU). Counts: :attr:`registered`,
    :attr:`unregistered`, :attr:`registered_bytes`."""

    name = "recording (simulated on a CPU host)"

    def __init__(self):
        self._lock = threading.Lock()
        self.registered = 0
        self.unregistered = 0
        self.registered_bytes = 0

    def current_device(self) -> int | None:
        """No device on a CPU host."""
        return None

    def register(self, addr: int, nbytes: int, read_only: bool, *args, **kwargs) -> None:
        with self._lock:
            self.registered += 1
            self.registered_bytes += nbytes

    def unregister(self, addr: int, *args, **kwargs) -> None:
        with self._lock:
            self.unregistered += 1

    def settle(self, *args, **kwargs) -> None:
        return None


# -- a TP rank ------------------------------------------------------------------------------
def rank_main(rank: int, tp: int, port: int, endpoint: str, conn, cfg: dict) -> None:
    """TP rank ``rank`` (a spawned process): a gloo group on 127.0.0.1, the
    recording registrar, then, per ``{"op": "request", "i": i}`` on ``conn``:
    rank 0 receives request i over ZMQ, mmshm's ``deferred_unwrap`` of
    ``broadcast_pyobj`` hands it to every rank, each checks its bytes, keeps
    it and lets go of the request ``in_flight - 1`` before it, waits until
    its released arena views are given back, and answers with its counts.
    ``{"op": "stop"}`` ends it. Any exception is sent as ``{"op": "error"}``."""
    import datetime
    import gc
    import signal
    import socket

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # die with the parent
    except (OSError, AttributeError):
        pass
    group = zctx = pull = None
    try:
        import torch.distributed as dist
        import zmq

        import mmshm
        from mmshm.segments import arena

        reg = RecordingRegistrar()
        arena.set_registrar(reg)
        if "GLOO_SOCKET_IFNAME" not in os.environ and any(
                n == "lo" for _, n in socket.if_nameindex()):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        timeout = datetime.timedelta(seconds=cfg["timeout_s"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=tp, timeout=timeout)
        group = dist.new_group(list(range(tp)), backend="gloo", timeout=timeout)
        zctx = zmq.Context()
        if rank == 0:
            pull = zctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            pull.connect(endpoint)
        bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
        held: deque = deque()
        conn.send({"op": "ready", "rank": rank, "pid": os.getpid()})
        while True:
            cmd = conn.recv()
            if cmd.get("op") == "stop":
                break
            data = None
            if rank == 0:
                if not pull.poll(int(cfg["timeout_s"] * 1000)):
                    raise TimeoutError(f"request {cmd['i']} did not arrive")
                data = [pickle.loads(pull.recv())]  # noqa: S301 - our own producer's
            out = bcast(data, rank, group, 0)
            problems = _check(out)
            held.append(out)
            del out, data
            while len(held) > cfg["in_flight"] - 1:
                held.popleft()  # the oldest request is done: its views go
            gc.collect()  # the released views' references go back (a registered
            # view's through the arena's settling thread: the producer waits for them)
            st = arena.VIEWS.status()
            conn.send({"op": "done", "rank": rank, "i": cmd["i"], "problems": problems[:5],
                       "registered": reg.registered, "unregistered": reg.unregistered,
                       "registered_bytes": reg.registered_bytes,
                       "mappings": st.get("mappings", 0)})
        held.clear()
        gc.collect()
    except EOFError:
        pass
    except BaseException:  # noqa: BLE001 - reported to the producer
        try:
            conn.send({"op": "error", "rank": rank, "error": traceback.format_exc()})
        except Exception:  # noqa: BLE001
            pass
    finally:
        if pull is not None:
            pull.close(0)
        if zctx is not None:
            zctx.term()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        conn.close()


def _check(out) -> list[str]:
    """Problems with one broadcast batch: a request that failed, a photo whose
    shape does not match its grid, or whose bytes are not the producer's."""
    import torch

    import mmshm

    problems = []
    for r in out:
        if isinstance(r, mmshm.MaterializeError):
            problems.append(f"MaterializeError: {r}")
            continue
        for j, it in enumerate(r.mm_inputs.mm_items):
            f = it.feature
            if not isinstance(f, torch.Tensor):
                problems.append(f"{r.rid} photo {j}: {type(f).__name__}, not a tensor")
            elif tuple(f.shape) != (math.prod(it.image_grid_thw), COLUMNS):
                problems.append(f"{r.rid} photo {j}: shape {tuple(f.shape)}, grid "
                                f"{it.image_grid_thw}")
            elif checksum(f) != int.from_bytes(it.hash[:8], "little", signed=True):
                problems.append(f"{r.rid} photo {j}: bytes differ from the producer's")
    return problems


# -- the producer ---------------------------------------------------------------------------
def _counter(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


class _Variant:
    """One pass of the workload: a TP group of spawned ranks, the producer's
    pool emptied first, the reuse rule and the arena as given."""

    def __init__(self, cfg: dict, rule: str, arena_on: bool, directory: str):
        self.cfg = cfg
        self.rule = rule
        self.arena_on = arena_on
        self.dir = directory
        self.procs: list = []
        self.conns: list = []

    def run(self, work, photos: Photos, log) -> dict:
        import multiprocessing as mp
        import multiprocessing.connection as mpc
        import socket

        import zmq

        import mmshm
        from mmshm import config
        from mmshm.segments import table
        from mmshm.segments.table import TABLE

        from .modes import MmshmMode

        cfg = self.cfg
        env_before = {k: os.environ.get(k) for k in ("MMSHM_ARENA_BYTES", "MMSHM_POOL",
                                                     "MMSHM_POOL_IDLE_S")}
        os.environ["MMSHM_ARENA_BYTES"] = str(cfg["arena_bytes"] if self.arena_on else 0)
        os.environ["MMSHM_POOL"] = "1"
        os.environ.setdefault("MMSHM_POOL_IDLE_S", "600")
        config.reload()
        fit_before = table.FIT_RATIO, table.ARENA_FIT_RATIO
        table.FIT_RATIO, table.ARENA_FIT_RATIO = rule_ratios(self.rule)
        TABLE.trim_pool()
        TABLE.sweep()
        tmp = tempfile.mkdtemp(prefix="mmshm-mixed-")
        zctx = zmq.Context()
        push = zctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDTIMEO, int(cfg["timeout_s"] * 1000))
        endpoint = f"ipc://{tmp}/scheduler_input"
        push.bind(endpoint)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        rcfg = {"timeout_s": cfg["timeout_s"], "in_flight": cfg["in_flight"]}
        try:
            for r in range(cfg["tp"]):
                a, b = ctx.Pipe()
                p = ctx.Process(target=rank_main, args=(r, cfg["tp"], port, endpoint, b, rcfg),
                                name=f"mmshm-mixed-tp{r}", daemon=True)
                p.start()
                b.close()
                self.procs.append(p)
                self.conns.append(a)
            self._gather(mpc)  # ready
            mode = MmshmMode(min_bytes=1)
            per_req = []
            hits0 = _counter("mmshm_pool_requests_total", result="hit")
            miss0 = _counter("mmshm_pool_requests_total", result="miss")
            made0 = _counter("mmshm_segments_created_total")
            evict0 = _evictions()
            live: deque = deque()  # segment names of the requests the ranks hold
            prev = [0] * cfg["tp"]
            prev_un = [0] * cfg["tp"]
            problems: list[str] = []
            t0 = time.perf_counter()
            for i, grids in enumerate(work):
                h0 = _counter("mmshm_pool_requests_total", result="hit")
                m0 = _counter("mmshm_pool_requests_total", result="miss")
                c0 = _counter("mmshm_segments_created_total")
                e0 = _evictions()
                req = _request(i, grids, photos)
                copies = mode.fan_out(req, 1)  # the photos are in shared memory now
                del req
                photos.undo()
                names = [h.name for c in copies for h in mmshm.handles(c)]
                for c in copies:
                    push.send(pickle.dumps(c, pickle.DEFAULT_PROTOCOL), copy=False)
                    mode.after_send(c)
                del copies, c
                for conn in self.conns:
                    conn.send({"op": "request", "i": i})
                res = self._gather(mpc)
                live.append(names)
                if len(live) >= cfg["in_flight"]:
                    # the ranks let go of this request's oldest companion: wait until its
                    # segments are back in the pool (a registered view's reference goes
                    # back from the arena's settling thread, a moment later)
                    _wait_pooled(live.popleft(), cfg["timeout_s"])
                regs = [m["registered"] - prev[m["rank"]] for m in res]
                unregs = [m["unregistered"] - prev_un[m["rank"]] for m in res]
                prev = [m["registered"] for m in res]
                prev_un = [m["unregistered"] for m in res]
                for m in res:
                    problems += [f"request {i}, rank {m['rank']}: {p}" for p in m["problems"]]
                TABLE.sweep()
                per_req.append({
                    "photos": len(grids),
                    "hits": _counter("mmshm_pool_requests_total", result="hit") - h0,
                    "misses": _counter("mmshm_pool_requests_total", result="miss") - m0,
                    "created": _counter("mmshm_segments_created_total") - c0,
                    "evicted": _evictions() - e0,
                    "registrations": regs, "unregistrations": unregs,
                    "mappings": [m["mappings"] for m in res]})
                if (i + 1) % 50 == 0:
                    log(f"  {i + 1}/{len(work)} requests")
            elapsed = time.perf_counter() - t0
            totals = {
                "hits": _counter("mmshm_pool_requests_total", result="hit") - hits0,
                "misses": _counter("mmshm_pool_requests_total", result="miss") - miss0,
                "created": _counter("mmshm_segments_created_total") - made0,
                "evicted": _evictions() - evict0}
            pooled = TABLE.pooled_names()
            pool_bytes = sum(os.path.getsize(os.path.join(self.dir, n)) for n in pooled
                             if os.path.exists(os.path.join(self.dir, n)))
        finally:
            self._stop()
            push.close(0)
            zctx.term()
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            table.FIT_RATIO, table.ARENA_FIT_RATIO = fit_before
            TABLE.trim_pool()
            TABLE.sweep()
            for k, v in env_before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            config.reload()
        return _summary(self, per_req, totals, problems, elapsed, pool_bytes, cfg["warm"])

    def _gather(self, mpc) -> list[dict]:
        deadline = time.monotonic() + self.cfg["timeout_s"]
        got: dict[int, dict] = {}
        while len(got) < len(self.conns):
            pending = [r for r in range(len(self.conns)) if r not in got]
            ready = mpc.wait([self.conns[r] for r in pending] + [p.sentinel for p in self.procs],
                             timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"TP rank(s) {pending} did not answer within "
                                   f"{self.cfg['timeout_s']} s")
            for r in pending:
                if self.conns[r].poll():
                    try:
                        msg = self.conns[r].recv()
                    except EOFError:
                        raise RuntimeError(f"TP rank {r} closed its pipe") from None
                    if msg.get("op") == "error":
                        raise RuntimeError(f"TP rank {r} failed:\n{msg['error']}")
                    got[r] = msg
            for r, p in enumerate(self.procs):
                if p.sentinel in ready and r not in got and not self.conns[r].poll():
                    p.join(1)
                    raise RuntimeError(f"TP rank {r} died (exit code {p.exitcode})")
        return [got[r] for r in range(len(self.conns))]

    def _stop(self) -> None:
        for c in self.conns:
            try:
                c.send({"op": "stop"})
            except (OSError, EOFError):
                pass
        for p in self.procs:
            p.join(15)
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []


def _wait_pooled(names: list[str], timeout_s: float) -> None:
    """Wait until this producer's segments ``names`` are idle in its pool
    (their last reference given back). Raises RuntimeError after
    ``timeout_s`` seconds."""
    from mmshm.segments.segfile import STATE_POOLED
    from mmshm.segments.table import TABLE

    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            with TABLE.lock:
                seg = TABLE.get(name)
                state = seg.status() if seg is not None else STATE_POOLED
            if state == STATE_POOLED or seg.freed():
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"segment {name} was not given back within {timeout_s} s")
            time.sleep(0.0005)


def _evictions() -> float:
    """Arena segments given back to make room so far in this process: the
    arena's own count where it keeps one, else 0."""
    return float(_EVICTED[0])


_EVICTED = [0]


def _count_evictions() -> None:
    """Count what :meth:`SegmentTable.evict_arena` gives back (wraps it once)."""
    from mmshm.segments.table import SegmentTable

    if getattr(SegmentTable.evict_arena, "_mixed_counted", False):
        return
    orig = SegmentTable.evict_arena

    def evict_arena(self, directory, need):
        before = len(self.segments)
        freed = orig(self, directory, need)
        _EVICTED[0] += max(0, before - len(self.segments))
        return freed

    evict_arena._mixed_counted = True
    SegmentTable.evict_arena = evict_arena


def _request(i: int, grids, photos: Photos):
    """Request ``i``: one SGLang-shaped request whose items are its photos'
    ``pixel_values``; each item's ``hash`` carries its checksum (8 bytes)."""
    from .requests import IMAGE_PAD, VISION_END, VISION_START, MultimodalDataItem, \
        MultimodalInputs, Req

    items = []
    ids = [9707, 11]
    for j, (t, h, w) in enumerate(grids):
        pv, s = photos.make(j, t * h * w, i * 8 + j)
        items.append(MultimodalDataItem(modality="image",
                                        hash=s.to_bytes(8, "little", signed=True) + bytes(8),
                                        feature=pv, image_grid_thw=(t, h, w), photo="mixed"))
        ids += [VISION_START, IMAGE_PAD, VISION_END]
    return Req(rid=f"mixed-{i}", mm_inputs=MultimodalInputs(mm_items=items), input_ids=ids, n=1)


def _summary(v: _Variant, per_req, totals, problems, elapsed, pool_bytes, warm) -> dict:
    steady = per_req[warm:]
    n = max(1, len(steady))
    photos = sum(r["photos"] for r in steady)
    hits = sum(r["hits"] for r in steady)
    lookups = hits + sum(r["misses"] for r in steady)
    tp = len(per_req[0]["registrations"]) if per_req else 0
    regs_rank = [sum(r["registrations"][k] for r in steady) for k in range(tp)]
    unregs_rank = [sum(r["unregistrations"][k] for r in steady) for k in range(tp)]
    first = per_req[:warm]
    return {
        "rule": v.rule, "arena": v.arena_on, "requests": len(per_req), "warm": warm,
        "steady_requests": len(steady), "steady_photos": photos,
        "pool_hit_rate": hits / lookups if lookups else None,
        "pool_hits_per_request": hits / n,
        "pool_misses_per_request": (lookups - hits) / n,
        "segments_created_steady": sum(r["created"] for r in steady),
        "arena_evictions_steady": sum(r["evicted"] for r in steady),
        "registrations_per_rank_steady": regs_rank,
        "unregistrations_per_rank_steady": unregs_rank,
        "registrations_per_request_per_rank": max(regs_rank) / n if regs_rank else 0.0,
        "requests_registering_last_20": max((sum(1 for r in per_req[-20:]
                                                 if r["registrations"][k]) for k in range(tp)),
                                            default=0),
        "first_requests": {"hits": sum(r["hits"] for r in first),
                           "misses": sum(r["misses"] for r in first),
                           "registrations_per_rank": [sum(r["registrations"][k] for r in first)
                                                      for k in range(tp)]},
        "totals": totals, "pooled_bytes_at_end": pool_bytes,
        "mappings_at_end": per_req[-1]["mappings"] if per_req else [],
        "correct": not problems, "problems": problems[:10], "elapsed_s": elapsed,
    }


def goals(row: dict) -> list[str]:
    """The workload's goals checked on one variant's figures."""
    out = []
    if row["arena"]:
        per50 = row["registrations_per_request_per_rank"] * 50
        out.append(f"registrations per 50 requests per rank: {per50:.2f} (<= 1): "
                   f"{'met' if per50 <= 1 else 'NOT met'}")
    rate = row["pool_hit_rate"]
    if rate is not None:
        out.append(f"pool hit rate {100 * rate:.1f}% (>= 95%): "
                   f"{'met' if rate >= 0.95 else 'NOT met'}")
    return out


def rule_ratios(rule: str) -> tuple[float, float]:
    """``(plain, arena)`` best-fit ratios of a reuse rule: ``best`` (mmshm's
    constants), ``exact`` (1, 1: the size class only) or a number R (R, R).
    Raises ValueError for anything else."""
    from mmshm.segments import table

    if rule == "best":
        return table.FIT_RATIO, table.ARENA_FIT_RATIO
    if rule == "exact":
        return 1.0, 1.0
    r = float(rule)
    if not r >= 1:
        raise ValueError(f"a reuse ratio must be >= 1, not {rule}")
    return r, r


def run(tp: int = 2, requests: int = DEFAULT_REQUESTS, warm: int = DEFAULT_WARM,
        in_flight: int = DEFAULT_IN_FLIGHT, rules=("best",), arenas=(True,), seed: int = 0,
        arena_bytes: int = DEFAULT_ARENA_BYTES, max_pixels: int = MAX_PIXELS,
        min_photos: int = 1, max_photos: int = 8, shm_dir: str | None = None,
        timeout_s: float = 300.0, log=None) -> dict:
    """Run the mixed-size workload once per (arena, fit) variant and return
    ``{"workload": describe(...), "variants": [...], "goals": {...}}``
    (counts per request; ``elapsed_s`` in seconds). Every spawned process
    is joined; the segments this run made are gone when it returns.

    Raises:
        ValueError: a bad argument.
        RuntimeError: a TP rank failed, died or timed out.
    """
    from mmshm import config
    from mmshm.segments.segfile import iter_segment_files

    if tp < 1 or requests < 1 or in_flight < 1 or not 0 <= warm < requests:
        raise ValueError("tp, requests and in_flight must be >= 1 and warm in [0, requests)")
    if not 1 <= min_photos <= max_photos:
        raise ValueError("photos per request: need 1 <= min <= max")
    for rule in rules:
        rule_ratios(rule)
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    before_dir = os.environ.get("MMSHM_DIR")
    if shm_dir is not None:
        os.environ["MMSHM_DIR"] = shm_dir
    config.reload()
    directory = config.get().dir
    mine = {n for n in iter_segment_files(directory) if n.startswith(f"mmshm-{os.getpid()}-")}
    work = workload(requests, seed, min_photos, max_photos, max_pixels)
    desc = describe(work)
    log(f"mixed workload: {desc['requests']} requests, {desc['photos']} photos "
        f"({desc['distinct_shapes']} distinct shapes, {desc['mb_min']}-{desc['mb_max']} MB, "
        f"median {desc['mb_median']} MB), TP={tp}, {in_flight} in flight")
    photos = Photos(desc["rows_max"], max_photos, seed)
    _count_evictions()
    cfg = {"tp": tp, "in_flight": in_flight, "timeout_s": timeout_s, "arena_bytes": arena_bytes,
           "warm": warm}
    variants = []
    try:
        for arena_on in arenas:
            for rule in rules:
                log(f"variant: arena {'on' if arena_on else 'off'}, reuse rule {rule}")
                v = _Variant(cfg, rule, arena_on, directory).run(work, photos, log)
                variants.append(v)
                rate = v["pool_hit_rate"]
                log(f"  steady state: pool hit rate "
                    f"{'-' if rate is None else f'{100 * rate:.1f}%'}, registrations per "
                    f"rank {v['registrations_per_rank_steady']}, segments created "
                    f"{v['segments_created_steady']:.0f}, bytes "
                    f"{'ok' if v['correct'] else 'WRONG'} ({v['elapsed_s']:.0f} s)")
    finally:
        if before_dir is None:
            os.environ.pop("MMSHM_DIR", None)
        else:
            os.environ["MMSHM_DIR"] = before_dir
        config.reload()
    left = sorted(n for n in iter_segment_files(directory)
                  if n.startswith(f"mmshm-{os.getpid()}-") and n not in mine)
    return {"workload": desc, "config": {**cfg, "requests": requests, "seed": seed,
                                         "rules": list(rules), "arenas": list(arenas),
                                         "max_pixels": max_pixels, "shm_dir": directory,
                                         "photos_per_request": [min_photos, max_photos]},
            "variants": variants, "goals": {f"{'arena' if v['arena'] else 'plain'}, "
                                                     f"{v['rule']}": goals(v) for v in variants},
            "leftover_segments": left,
            "registrar": RecordingRegistrar.name}


def table(result: dict) -> str:
    """The result as a plain-text table, one line per variant."""
    lines = [f"mixed-size workload: {result['workload']}",
             f"registrations: {result['registrar']} (what a CUDA host would register)",
             f"steady state: requests {result['config']['warm'] + 1}-"
             f"{result['config']['requests']}, {result['config']['in_flight']} in flight, "
             f"TP={result['config']['tp']}",
             "| pool  | rule  | hit rate | hits/req | misses/req | created | arena evictions | "
             "registrations/req/rank | per rank | unregistrations | bytes ok |",
             "|-------|-------|----------|----------|------------|---------|-----------------|"
             "------------------------|----------|-----------------|----------|"]
    for v in result["variants"]:
        rate = v["pool_hit_rate"]
        lines.append(
            f"| {'arena' if v['arena'] else 'plain':5s} | {v['rule']:5s} | "
            f"{'-' if rate is None else f'{100 * rate:6.1f}%':>8s} | "
            f"{v['pool_hits_per_request']:8.2f} | {v['pool_misses_per_request']:10.2f} | "
            f"{v['segments_created_steady']:7.0f} | {v['arena_evictions_steady']:15.0f} | "
            f"{v['registrations_per_request_per_rank']:22.3f} | "
            f"{','.join(str(x) for x in v['registrations_per_rank_steady']):>8s} | "
            f"{','.join(str(x) for x in v['unregistrations_per_rank_steady']):>15s} | "
            f"{'yes' if v['correct'] else 'NO':>8s} |")
    for name, gl in result["goals"].items():
        for g in gl:
            lines.append(f"goal ({name}): {g}")
    for v in result["variants"]:
        for p in v["problems"]:
            lines.append(f"problem: {p}")
    left = result["leftover_segments"]
    lines.append(f"segments left: {', '.join(left) if left else 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``mmshm bench mixed``: exit 0, 1 if bytes differed or a segment was
    left, 2 on a bad argument, 3 if the run failed."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--tp", type=int, default=2, help="TP ranks")
    ap.add_argument("--requests", type=int, default=DEFAULT_REQUESTS,
                    help="requests sent, the first --warm of them not counted")
    ap.add_argument("--quick", action="store_true",
                    help="a shorter check: 60 requests, the last 40 counted")
    ap.add_argument("--warm", type=int, default=DEFAULT_WARM,
                    help="requests before the steady state (not counted)")
    ap.add_argument("--in-flight", type=int, default=DEFAULT_IN_FLIGHT,
                    help="requests the producer keeps in flight at once")
    ap.add_argument("--photos", default="1,8", help="fewest,most photos per request")
    ap.add_argument("--rule", default="best",
                    help="the pool's reuse rule(s), comma separated: best (mmshm's: best fit, "
                         "plain segments up to 4x, arena segments any size), exact (the size "
                         "class only, the rule before), or a number R (best fit up to R x)")
    ap.add_argument("--arena", default="on", help="on, off or on,off")
    ap.add_argument("--arena-bytes", type=int, default=DEFAULT_ARENA_BYTES,
                    help="the producer's arena (MMSHM_ARENA_BYTES) with --arena on, bytes")
    ap.add_argument("--max-pixels", type=int, default=MAX_PIXELS,
                    help="Qwen2-VL's max_pixels: the largest photo after smart_resize")
    ap.add_argument("--seed", type=int, default=0, help="seed of the photo sizes drawn")
    ap.add_argument("--shm-dir", default=None,
                    help="the segment directory of the run (default: MMSHM_DIR, else /dev/shm)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds a variant may take before the run fails")
    ap.add_argument("--json", default=None, help="write the result as JSON to this path")
    a = ap.parse_args(argv)
    if a.quick:
        a.requests = min(a.requests, 60)
    try:
        lo, hi = (int(x) for x in a.photos.split(","))
        rules = tuple(x for x in a.rule.split(",") if x)
        for rule in rules:
            rule_ratios(rule)
        arenas = tuple({"on": True, "off": False}[x] for x in a.arena.split(","))
    except (ValueError, KeyError):
        ap.error("--photos LO,HI; --rule best, exact or numbers >= 1; --arena on, off or "
                 "on,off")
    try:
        res = run(a.tp, a.requests, a.warm, a.in_flight, rules, arenas, a.seed, a.arena_bytes,
                  a.max_pixels, lo, hi, a.shm_dir, a.timeout)
    except ValueError as exc:
        ap.error(str(exc))
    except RuntimeError as exc:
        print(f"mixed workload failed: {exc}", file=sys.stderr)
        return 3
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    bad = [v for v in res["variants"] if not v["correct"]] or res["leftover_segments"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
