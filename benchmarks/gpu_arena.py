"""The GPU benchmark: the time from the tokenizer to a TP rank's GPU, and the EPD GPU hop.

    python3 benchmarks/gpu_arena.py [--json out.json]     # a CUDA host: about 2-4 minutes
    python3 benchmarks/gpu_arena.py --dry-run             # CPU, tiny payloads: the plumbing only

One self-contained file (stdlib, torch, mmshm; SGLang and safetensors used when
importable). Every process is spawned: a *producer* (SGLang's tokenizer, or the
EPD encoder) and two *consumers* (TP ranks, or the EPD consumer), each on
``cuda:<i % device_count>`` (all on one GPU is fine). Times are
``time.perf_counter`` readings (CLOCK_MONOTONIC, comparable across the
processes of one host), in milliseconds in the table, seconds in ``--json``.

**Part 1: pixels from the tokenizer to every TP rank's GPU.** The payload is
Qwen2-VL's ``pixel_values`` of K 720p photos, ``[4784 * K, 1176]`` float32
(22.5 MB a photo, concatenated per request), K = 1, 8, 32, with 1 and 2
consumers. A request's time runs from the producer's first byte of work (the
pickle, the copy to the GPU, the wrap) until the *slowest* consumer holds the
pixels on its GPU (``torch.cuda.synchronize()`` returned). The copy to the GPU
is timed as a server meets it, as the *first touch* of the bytes in the
consuming process: no consumer reads the bytes before it; each checks them
after the timing, on its GPU (the int64 sum of the payload's int32 words,
against the producer's). Before every request the producer changes one word in
every 4 KiB page of the payload, so a stale page anywhere is caught. The
consumers' CUDA contexts are made before the first request (a TP rank's is).

- ``a. plain``: the tensor pickled (``pickle.dumps``) and its bytes sent through
  a pipe (``multiprocessing`` connection, one per consumer, sent side by side),
  unpickled, then ``.to("cuda")``: SGLang 0.5.9's path.
- ``b. cuda_ipc``: SGLang 0.5.23 ``--mm-feature-transport cuda_ipc``: the
  producer copies the tensor to its GPU (``.to("cuda")`` from pageable memory),
  then into a slice of a 1 GiB pool on the GPU whose CUDA IPC handle each
  consumer opened once (SGLang's pool-handle cache), and sends the slice's
  offset; each consumer copies the slice out into a new tensor on its GPU.
  SGLang's real ``MmItemMemoryPool`` is used when ``sglang`` and
  ``cuda.bindings`` (cuda-python) import (row ``b. cuda_ipc (SGLang
  MmItemMemoryPool)``). Beside it, always on CUDA, a minimal re-creation of it
  (row ``b. cuda_ipc (re-creation)``): the same pool allocation shared once,
  the same slice copy in and out; SGLang's stream-ordered ready and
  acknowledgement words (``cuStreamWaitValue32``, which needs cuda-python) are
  replaced by a stream synchronize in the producer before the offset is sent
  (the device-to-device copy is done by then: microseconds) and by the
  consumer's reply, after which the producer frees the slice.
- ``c. mmshm today``: ``MMSHM_ARENA_BYTES=0``: the producer wraps the tensor
  (``mmshm.ShmTensor.from_tensor``, with the hash computed now, as mmshm's
  SGLang tokenizer does for items SGLang did not hash; ``--hash lazy`` leaves
  it out), a handle crosses, the consumer materializes (a copy-on-write view),
  then ``.to("cuda")``.
- ``d. mmshm arena``: the same with ``MMSHM_ARENA_BYTES`` (``--arena-bytes``,
  default 2 GiB): the producer writes into warm arena segments, each consumer
  maps each arena segment once and registers the mapping with CUDA once. The
  first request of each size (a warm-up) pays the mapping and registration:
  its time is the ``first ms`` column; the median is the steady state. The
  consumers' ``mmshm.segments.arena`` status and counters are printed and kept
  in ``--json``. With an mmshm older than the arena core, d runs as c.
- ``e. floor``: one H2D of the same bytes from pinned memory, in one process
  (``.to(dev, non_blocking=True)`` then ``synchronize``).

**Part 2: the EPD GPU hop.** An encoder output of 8 x 720p (``[9568, 3584]``
bf16, 68.6 MB) on the producer's GPU moves to the consumer's GPU:

- ``mmshm encoder cache, arena`` / ``..., MMSHM_ARENA_BYTES=0``:
  ``mmshm.transport.encoder_cache.EncoderCache.save()`` of the CUDA tensor
  (mmshm does the D2H, into a registered arena segment when the arena is on),
  then in the consumer ``lookup()``, ``handle().load()`` and ``.to("cuda")``;
- ``safetensors on tmpfs``: vLLM's ``ECExampleConnector``'s calls:
  ``safetensors.torch.save_file({"ec_cache": t.detach().cpu()}, path)``, then
  ``load_file(path, device="cuda:<i>")`` in the consumer (skipped, with the
  reason, where safetensors does not import);
- ``floor: pinned round trip``: a D2H into pinned memory, then an H2D from it.

**Part 3: the mixed-size workload and the race check** (``--skip-mixed``
leaves it out, ``--only-mixed`` runs it alone). Photo sizes as
``mmshm bench --workload mixed`` draws them (:mod:`mmshm.bench.mixed`: real
phone, screenshot and web dimensions through Qwen2-VL's ``smart_resize``, 1-8
photos a request), the arena on, 2 consumers. Each consumer copies as the
server does: the GPU busy with a forward (``torch.cuda._sleep``, 100 ms),
then per photo ``materialize()`` (an arena view) and ``.to(device,
non_blocking=True)`` on the current stream, the view dropped at once; it
tells the producer it released the request *before* any wait, and the
producer writes the next request at once, into the released segments when
they are back in its pool. After its stream is synchronized each consumer
checks every GPU tensor against the producer's checksum. With the arena's
settle on (a released registered view goes back only once the device has
run the copies queued before) no photo may be torn; the **control** run
switches the settle off (a registrar whose settle returns at once) and must
see torn photos, which shows the check can fail. Both print registrations
per request per consumer (counted by wrapping the arena's registrar) and the
producer's pool hits. On a CPU (``--dry-run``) the copy is queued on a
stand-in stream (a thread that copies later from the mapping's address, as
a DMA would, busy until the producer's next request has arrived) and the
registrations are **simulated** (nothing is registered).

**The memlock probe** (CUDA only): a child running as ``nobody`` (when the
script runs as root) under ``RLIMIT_MEMLOCK`` = 64 KiB (``ulimit -l 64``)
registers 64 MiB of anonymous memory with ``cudaHostRegister`` and reports
CUDA's error name and text: whether the locked-memory limit refuses a
registration at all (NVIDIA's driver pins with ``FOLL_LONGTERM``, which may
not be charged to it).

Each row gives its time over the floor of the same payload (``x floor``).
The arena's goals are checked at the end (where the rows ran).

**Which host.** Figures from this script must name the host: the GPU model
and its PCIe link, the CPU cores, torch and CUDA versions and the mmshm
commit, all printed in its first lines and kept in ``--json`` under ``host``;
quote ratios from one run, not times from different runs.

**``--device cpu`` / ``--dry-run``** (tiny payloads: ``[64, 1176]`` float32 a
photo, ``[128, 3584]`` bf16 encoder output; 1 warm-up, 3 requests): the same
processes and messages without CUDA, to test the plumbing on a CPU host
(``tests/test_gpu_bench.py``): "to the GPU" is then a copy into new CPU
memory, the floor a memcpy, and the paths that need CUDA (b) are listed as
skipped. Its times are no evidence of speed.

Segments go to a private directory made under ``--shm-dir`` (default
``$MMSHM_DIR``, else ``/dev/shm``), removed at the end; the script says, and
exits 1, if any segment was left behind or any bytes differed. Every wait is
bounded (``--timeout`` for the whole run, ``--request-timeout`` per request,
``--exit-grace`` for a set's processes to exit once it is done): a consumer
that hangs is killed, its rows are missing and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

#: one 720p photo's pixel_values (Qwen2-VL): rows x 1176 float32
PHOTO_SHAPE = (4784, 1176)
#: the encoder output of 8 x 720p photos (Qwen2-VL-7B): [9568, 3584] bf16
EPD_SHAPE = (9568, 3584)
#: --dry-run's tiny payloads
TINY_PHOTO_SHAPE = (64, 1176)
TINY_EPD_SHAPE = (128, 3584)
#: a word changed in every page of the payload before each request (int32 words)
STRIDE_WORDS = 1024
#: SGLang's default pool (SGLANG_MM_FEATURE_CACHE_MB = 1024)
IPC_POOL_BYTES = 1 << 30
#: its control words ahead of the data (aligned), as StreamOrderedMmFeaturePool
IPC_DATA_START = 256 * 1024

PATH_A = "a. plain (pickle + pipe, .to)"
PATH_B_REAL = "b. cuda_ipc (SGLang MmItemMemoryPool)"
PATH_B_MINI = "b. cuda_ipc (re-creation)"
PATH_C = "c. mmshm today (ARENA_BYTES=0)"
PATH_D = "d. mmshm arena"
PATH_E = "e. floor: pinned H2D"
EPD_ARENA = "mmshm encoder cache, arena"
EPD_TODAY = "mmshm encoder cache, ARENA_BYTES=0"
EPD_ST = "safetensors on tmpfs"
EPD_FLOOR = "floor: pinned round trip"
PIXEL_PATHS = (PATH_A, PATH_B_REAL, PATH_B_MINI, PATH_C, PATH_D, PATH_E)
EPD_PATHS = (EPD_ARENA, EPD_TODAY, EPD_ST, EPD_FLOOR)


# -- helpers used in every process ---------------------------------------------------------
def _flat_words(t):
    """``t``'s bytes as a flat int32 tensor (a view; ``t`` contiguous, bytes % 4 == 0)."""
    import torch

    return t.reshape(-1).view(torch.uint8).view(torch.int32)


def checksum(t) -> int:
    """The int64 sum of ``t``'s int32 words (on ``t``'s device; exact)."""
    import torch

    return int(_flat_words(t).sum(dtype=torch.int64))


class Payload:
    """A payload tensor and its checksum, kept up to date as :meth:`bump` changes
    one word in every page (4 KiB) before each request."""

    def __init__(self, t):
        self.t = t
        self.words = _flat_words(t)
        self.sum = checksum(t)
        self.nbytes = t.numel() * t.element_size()
        self._k = 0

    def bump(self) -> int:
        """Add 1 to the words ``k, k + 1024, ...`` (k the request's number mod 1024);
        returns the new checksum."""
        off = self._k % STRIDE_WORDS
        self._k += 1
        self.words[off::STRIDE_WORDS] += 1
        self.sum += len(range(off, self.words.numel(), STRIDE_WORDS))
        return self.sum


def to_dev(t, dev):
    """``t`` on ``dev``: ``t.to(dev)``; on a CPU "device" a copy into new memory
    (``.to("cpu")`` would return ``t`` itself and touch nothing)."""
    if dev.type == "cpu":
        return t.clone()
    return t.to(dev)


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _metric_samples(names) -> dict:
    """mmshm's counters ``names`` (attribute names in ``mmshm.metrics``) as
    ``{sample name{labels}: value}``; {} where a metric does not exist."""
    out: dict = {}
    try:
        from mmshm import metrics
    except Exception:  # noqa: BLE001 - an mmshm without these metrics
        return out
    for n in names:
        m = getattr(metrics, n, None)
        try:
            for fam in m.collect():
                for s in fam.samples:
                    if s.name.endswith("_created"):
                        continue
                    lab = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                    out[f"{s.name}{{{lab}}}"] = s.value
        except Exception:  # noqa: BLE001 - not a prometheus metric: left out
            continue
    return out


def arena_report() -> dict:
    """This process's ``mmshm.segments.arena.status()`` and arena counters, or
    ``{"arena": "absent"}`` with an mmshm older than the arena core."""
    try:
        from mmshm.segments import arena
    except ImportError:
        return {"arena": "absent (this mmshm has no mmshm.segments.arena)"}
    try:
        st = arena.status()
    except Exception as exc:  # noqa: BLE001 - report, not fail
        st = {"error": repr(exc)}
    return {"arena": st, "counters": _metric_samples(
        ("ARENA_REGISTRATIONS", "ARENA_FALLBACKS", "ARENA_VIEWS", "GPU_COPY_BYTES"))}


def arena_settle() -> None:
    """Wait until this process's released arena views are given back to the
    producer (a registered view waits for the GPU first; no-op without the core)."""
    try:
        from mmshm.segments import arena
    except ImportError:
        return
    settled = getattr(getattr(arena, "VIEWS", None), "settled", None)
    if settled is not None:
        settled(10.0)


_SGLANG_POOL: tuple | None = None


def sglang_pool():
    """``(MmItemMemoryPool, None)`` when SGLang's real CUDA-IPC pool can run
    here (``sglang`` and ``cuda.bindings`` import), else ``(None, why)``;
    tried once per process."""
    global _SGLANG_POOL
    if _SGLANG_POOL is None:
        _SGLANG_POOL = _import_sglang_pool()
    return _SGLANG_POOL


def _import_sglang_pool():
    try:
        from sglang.srt.multimodal.transport.cuda_ipc import MmItemMemoryPool
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason
        return None, f"sglang's cuda_ipc module does not import: {type(exc).__name__}: {exc}"
    try:
        import cuda.bindings.driver  # noqa: F401 - its stream memory operations
    except Exception as exc:  # noqa: BLE001
        return None, f"cuda.bindings (cuda-python) does not import: {exc}"
    return MmItemMemoryPool, None


# -- the consumer (a TP rank, the EPD consumer) -----------------------------------------------
def consumer_main(index: int, cfg: dict, conn) -> None:
    """Serve the producer's requests on ``conn`` until ``("stop",)`` or EOF. Each
    reply: ``("ok", t_h2d_start, t_end, checksum)`` (the copy to the device starts
    at ``t_h2d_start``; the pixels are there at ``t_end``) or ``("error", text)``."""
    import torch

    if cfg["device"] == "cuda":
        dev = torch.device("cuda", index % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        torch.ones(1, device=dev)  # the context, before any request (a TP rank has it)
        torch.cuda.synchronize(dev)
    else:
        dev = torch.device("cpu")
    import mmshm  # noqa: F401 - imported before the first request, as in a server
    from mmshm.transport.encoder_cache import EncoderCache

    store = EncoderCache(server="bench")
    ipc_pools: dict = {}  # the pool-handle cache of the re-creation: handle -> storage
    conn.send(("ready", os.getpid()))
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "report":
                conn.send(("report", arena_report()))
                continue
            if cfg.get("hang") and index == 0 and cfg["set"] == "arena" and kind == "mmshm":
                time.sleep(3600)  # --hang-for-test: a consumer that never answers
            try:
                conn.send(_consume(kind, msg, conn, dev, store, ipc_pools, index))
            except Exception:  # noqa: BLE001 - the producer records the row as failed
                conn.send(("error", traceback.format_exc()))
    finally:
        store.close()


def _consume(kind, msg, conn, dev, store, ipc_pools, index):
    import torch

    if kind == "plain":
        data = conn.recv_bytes()
        t = pickle.loads(data)  # noqa: S301 - our own producer's bytes
        del data
        t1 = time.perf_counter()
        g = to_dev(t, dev)
        sync(dev)
        t2 = time.perf_counter()
        del t
    elif kind == "mmshm":
        h = msg[1]
        t1 = time.perf_counter()
        t = h.materialize()
        g = to_dev(t, dev)
        sync(dev)
        t2 = time.perf_counter()
        del t, h
    elif kind == "ipc_mini":
        handle, offset, nbytes, shape, dtype = msg[1:]
        t1 = time.perf_counter()
        storage = ipc_pools.get(handle)
        if storage is None:  # opened once (SGLANG_USE_IPC_POOL_HANDLE_CACHE)
            storage = ipc_pools[handle] = torch.UntypedStorage._new_shared_cuda(*handle)
        sl = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
            storage, storage_offset=offset, size=(nbytes,), stride=(1,))
        g = torch.empty(shape, dtype=dtype, device=dev)
        g.view(torch.uint8).reshape(-1).copy_(sl)
        sync(dev)
        t2 = time.perf_counter()
        del sl
    elif kind == "ipc_real":
        proxy = pickle.loads(msg[1])  # noqa: S301
        t1 = time.perf_counter()
        g = proxy.reconstruct_on_target_device(dev.index, consumer_count=1,
                                               consumer_rank=msg[2])
        sync(dev)
        t2 = time.perf_counter()
        del proxy
    elif kind == "epd_mmshm":
        key, dtype, rows = msg[1:]
        t1 = time.perf_counter()
        entry = store.lookup(key, dtype, rows)
        if entry is None:
            raise RuntimeError("the encoder output was not found (lookup missed)")
        t = entry.handle().load("bench")
        g = to_dev(t, dev)
        sync(dev)
        t2 = time.perf_counter()
        del t
        entry.release()
    elif kind == "epd_st":
        from safetensors.torch import load_file

        t1 = time.perf_counter()
        if dev.type == "cuda":
            g = load_file(msg[1], device=f"cuda:{dev.index}")["ec_cache"]
        else:
            g = to_dev(load_file(msg[1])["ec_cache"], dev)
        sync(dev)
        t2 = time.perf_counter()
    else:
        raise ValueError(f"unknown request {kind!r}")
    s = checksum(g)  # after the timing, on the device
    del g
    arena_settle()
    return ("ok", t1, t2, s)


# -- the producer (the tokenizer, the EPD encoder) ----------------------------------------------
class _Abort(Exception):
    """A consumer did not answer in time: the set stops."""


class Producer:
    def __init__(self, cfg: dict, conns, ctrl):
        import torch

        self.cfg = cfg
        self.conns = conns
        self.ctrl = ctrl
        self.torch = torch
        self.cuda = cfg["device"] == "cuda"
        self.dev = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.dev)
            torch.ones(1, device=self.dev)
            torch.cuda.synchronize(self.dev)
        self.deadline = cfg["deadline"]
        self._ipc_pool = None
        self._ipc_handle = None
        self._sglang_pools: dict = {}

    # messages to the orchestrator
    def tell(self, *msg) -> None:
        self.ctrl.send(msg)

    def wait_ready(self) -> None:
        for c in self.conns:
            if not c.poll(max(1.0, self.deadline - time.time())):
                raise _Abort("a consumer did not start in time")
            c.recv()

    def replies(self, conns) -> list:
        out = []
        for c in conns:
            if not c.poll(self.cfg["request_timeout"]):
                raise _Abort(f"no answer from a consumer in {self.cfg['request_timeout']} s")
            out.append(c.recv())
        return out

    def fanout(self, conns, send) -> None:
        """``send(i, conn)`` for each consumer, side by side when there are several."""
        if len(conns) == 1:
            send(0, conns[0])
            return
        errs: list = []

        def run(i, c):
            try:
                send(i, c)
            except BaseException as exc:  # noqa: BLE001 - raised below
                errs.append(exc)

        ts = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(conns)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errs:
            raise errs[0]

    # one cell: a path, a number of consumers, a payload
    def cell(self, path: str, part: str, ncons: int, photos: int, payload: Payload,
             one, after=None) -> None:
        """Run warm-ups then timed requests of ``one(conns, expected) -> t0`` (which
        sends one request, returns the time its first byte of work started) and
        tell the orchestrator the row."""
        cfg = self.cfg
        conns = self.conns[:ncons]
        times, h2d, firsts, ok, err = [], [], [], True, None
        warm_left = cfg["warmup"]
        started = None
        while True:
            if time.time() > self.deadline - 5:
                err = err or "stopped at the run's deadline"
                break
            expected = payload.bump()
            try:
                t0 = one(conns, expected)
                rs = self.replies(conns)
            except _Abort:
                raise
            except Exception:  # noqa: BLE001 - this row fails, the others run
                err = traceback.format_exc(limit=4)
                break
            bad = [r[1] for r in rs if r[0] != "ok"]
            if bad:
                err = bad[0]
                break
            if after is not None:
                after()
            dt = max(r[2] for r in rs) - t0
            ok = ok and all(r[3] == expected for r in rs)
            if warm_left:
                firsts.append(dt)
                # one warm-up is enough where a request is slow (plain, 32 photos)
                warm_left = 0 if dt > cfg["cell_s"] / 4 else warm_left - 1
                continue
            if started is None:
                started = time.perf_counter() - dt
            times.append(dt)
            h2d.append(max(r[2] - r[1] for r in rs))
            if len(times) >= cfg["reps"] or time.perf_counter() - started > cfg["cell_s"]:
                break
        row = {"part": part, "path": path, "consumers": ncons, "photos": photos,
               "bytes": payload.nbytes, "reps": len(times), "bytes_ok": ok and bool(times),
               "first_s": firsts[0] if firsts else None,
               "median_s": statistics.median(times) if times else None,
               "min_s": min(times) if times else None,
               "h2d_median_s": statistics.median(h2d) if h2d else None,
               "error": err}
        self.tell("row", row)

    # -- the paths -------------------------------------------------------------------
    def path_plain(self, conns, expected, x):
        t0 = time.perf_counter()
        data = pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)

        def send(i, c):
            c.send(("plain",))
            c.send_bytes(data)

        self.fanout(conns, send)
        return t0

    def path_mmshm(self, conns, expected, x):
        from mmshm import ShmTensor

        t0 = time.perf_counter()
        h = ShmTensor.from_tensor(x, hash_now=self.cfg["hash"] == "now")
        h.share(len(conns))  # one reference per consumer, handed over by the pickle
        self.fanout(conns, lambda i, c: c.send(("mmshm", h)))
        h.release()
        return t0

    def path_ipc_mini(self, conns, expected, x):
        torch = self.torch
        t0 = time.perf_counter()
        g = x.to(self.dev)  # the tokenizer's copy to its GPU (pageable)
        nbytes = x.numel() * x.element_size()
        dst = self._ipc_pool[IPC_DATA_START:IPC_DATA_START + nbytes]
        dst.copy_(g.view(torch.uint8).reshape(-1), non_blocking=True)
        torch.cuda.current_stream(self.dev).synchronize()  # stands for the ready word
        msg = ("ipc_mini", self._ipc_handle, IPC_DATA_START, nbytes, tuple(x.shape), x.dtype)
        self.fanout(conns, lambda i, c: c.send(msg))
        del g
        return t0

    def path_ipc_real(self, pool, conns, expected, x):
        t0 = time.perf_counter()
        g = x.to(self.dev)
        proxy = pool.wrap_tensor(g, use_pool_handle_cache=True)
        if proxy is None:
            raise RuntimeError("MmItemMemoryPool had no room for the request")
        data = pickle.dumps(proxy)
        self.fanout(conns, lambda i, c: c.send(("ipc_real", data, i)))
        del g
        return t0

    # -- the sets ------------------------------------------------------------------
    def photos_payload(self, k: int) -> Payload:
        torch = self.torch
        shape = self.cfg["photo_shape"]
        one = torch.rand(shape)
        return Payload(one.repeat(k, 1))

    def _floor_reps(self, p: Payload, fill, src_like) -> tuple[list, bool, float | None]:
        """Time ``fill(pinned)`` (what goes into the pinned buffer, untimed or
        timed as the caller makes it) then one H2D from pinned memory (on a CPU
        host: one memcpy into warm memory), warm-up and repetitions; returns
        the timed seconds, whether every copy's bytes were right, and the first
        warm-up's seconds."""
        torch = self.torch
        cfg = self.cfg
        if self.cuda:
            pinned = torch.empty(src_like.shape, dtype=src_like.dtype, pin_memory=True)
        else:
            pinned = torch.empty_like(src_like, device="cpu")
            dst = torch.empty_like(pinned)
        ts, ok, first = [], True, None
        for rep in range(cfg["warmup"] + cfg["reps"]):
            expected = p.bump()
            t0 = fill(pinned)
            if self.cuda:
                g = pinned.to(self.dev, non_blocking=True)
                torch.cuda.synchronize(self.dev)
            else:
                dst.copy_(pinned)
                g = dst
            dt = time.perf_counter() - t0
            ok = ok and checksum(g) == expected
            del g
            if rep < cfg["warmup"]:
                first = first if first is not None else dt
            else:
                ts.append(dt)
        return ts, ok, first

    def floor_pixels(self, k: int, p: Payload) -> None:
        """One H2D from pinned memory of the payload's bytes, in this process
        (on a CPU host: one memcpy into warm memory)."""
        src = p.t.reshape(-1).view(self.torch.uint8)

        def fill(pinned):
            pinned.copy_(src)  # untimed: the bytes are in pinned memory already
            return time.perf_counter()

        ts, ok, first = self._floor_reps(p, fill, src)
        self.tell("row", {"part": "pixels", "path": PATH_E, "consumers": 0, "photos": k,
                          "bytes": p.nbytes, "reps": len(ts), "bytes_ok": ok,
                          "first_s": first, "median_s": statistics.median(ts),
                          "min_s": min(ts), "h2d_median_s": statistics.median(ts),
                          "error": None})

    def epd_payload(self) -> Payload:
        torch = self.torch
        return Payload(torch.randn(self.cfg["epd_shape"], dtype=torch.bfloat16, device=self.dev))

    def floor_epd(self, p: Payload) -> None:
        """The pinned round trip of the encoder output: a D2H into pinned
        memory, then an H2D from it, both timed."""
        def fill(pinned):
            sync(self.dev)
            t0 = time.perf_counter()
            pinned.copy_(p.t)  # D2H (blocking)
            return t0

        ts, ok, first = self._floor_reps(p, fill, p.t)
        self.tell("row", {"part": "epd", "path": EPD_FLOOR, "consumers": 0, "photos": 8,
                          "bytes": p.nbytes, "reps": len(ts), "bytes_ok": ok,
                          "first_s": first, "median_s": statistics.median(ts),
                          "min_s": min(ts), "h2d_median_s": None, "error": None})

    def epd_mmshm(self, path: str, p: Payload) -> None:
        from mmshm.transport.encoder_cache import EncoderCache

        store = EncoderCache(server="bench", keep_s=3600)
        keys: list = []

        def one(conns, expected):
            key = os.urandom(32)  # a new item each time (the key is the input's hash)
            keys.append(key)
            sync(self.dev)
            t0 = time.perf_counter()
            res = store.save(key, p.t, label="bench")
            if not res.published:
                raise RuntimeError(f"the encoder output was not published: {res.reason}")
            conns[0].send(("epd_mmshm", key, p.t.dtype, p.t.shape[0]))
            return t0

        def after():  # the producer's keep time ends: its segment goes back to its pool
            store.evict(keys[-1])

        try:
            self.cell(path, "epd", 1, 8, p, one, after)
        finally:
            store.close()

    def epd_safetensors(self, p: Payload) -> None:
        try:
            from safetensors.torch import save_file
        except ImportError as exc:
            self.tell("skip", EPD_ST, f"safetensors does not import here ({exc})")
            return
        d = self.cfg["st_dir"]
        paths: list = []

        def one(conns, expected):
            path = os.path.join(d, f"{len(paths)}.safetensors")
            paths.append(path)
            sync(self.dev)
            t0 = time.perf_counter()
            save_file({"ec_cache": p.t.detach().cpu()}, path)
            conns[0].send(("epd_st", path))
            return t0

        def after():
            os.unlink(paths[-1])

        self.cell(EPD_ST, "epd", 1, 8, p, one, after)

    def run_set(self) -> None:
        cfg = self.cfg
        torch = self.torch
        self.wait_ready()
        which = cfg["set"]
        if which == "arena":
            for k in cfg["photos"]:
                p = self.photos_payload(k)
                self.floor_pixels(k, p)
                del p
            self.floor_epd(self.epd_payload())
        for k in cfg["photos"]:
            p = self.photos_payload(k)
            for ncons in cfg["consumers"]:
                if which == "arena":
                    self.cell(PATH_D, "pixels", ncons, k, p,
                              lambda c, e: self.path_mmshm(c, e, p.t))
                    continue
                self.cell(PATH_C, "pixels", ncons, k, p,
                          lambda c, e: self.path_mmshm(c, e, p.t))
                if not self.cuda:
                    self.tell("skip", PATH_B_MINI, "needs CUDA")
                    self.tell("skip", PATH_B_REAL, "needs CUDA")
                    continue
                if IPC_DATA_START + p.nbytes > IPC_POOL_BYTES:
                    self.tell("skip", PATH_B_MINI, f"{k} photos do not fit SGLang's 1 GiB pool")
                    self.tell("skip", PATH_B_REAL, f"{k} photos do not fit SGLang's 1 GiB pool")
                    continue
                if self._ipc_pool is None:  # one pool for the producer's life, as SGLang's
                    self._ipc_pool = torch.empty(IPC_POOL_BYTES, dtype=torch.uint8,
                                                 device=self.dev)
                    self._ipc_handle = self._ipc_pool.untyped_storage()._share_cuda_()
                self.cell(PATH_B_MINI, "pixels", ncons, k, p,
                          lambda c, e: self.path_ipc_mini(c, e, p.t))
                pool_cls, why = sglang_pool()
                if pool_cls is None:
                    self.tell("skip", PATH_B_REAL, why)
                    continue
                pool = self._sglang_pools.get(ncons)
                if pool is None:  # one per consumer count (its acknowledgement words)
                    pool = self._sglang_pools[ncons] = pool_cls(
                        IPC_POOL_BYTES, 0.05, self.dev.index, ncons)

                def wait_free(pool=pool):  # the recycler frees acknowledged slices
                    end = time.time() + 5
                    while pool.active_lease_count and time.time() < end:
                        time.sleep(0.002)

                self.cell(PATH_B_REAL, "pixels", ncons, k, p,
                          lambda c, e, pool=pool: self.path_ipc_real(pool, c, e, p.t),
                          wait_free)
            del p
        ep = self.epd_payload()
        if which == "arena":
            self.epd_mmshm(EPD_ARENA, ep)
        else:
            self.epd_mmshm(EPD_TODAY, ep)
            self.epd_safetensors(ep)
            # the plain path last: the slowest; its cells are cut at --cell-s
            for k in cfg["photos"]:
                p = self.photos_payload(k)
                for ncons in cfg["consumers"]:
                    self.cell(PATH_A, "pixels", ncons, k, p,
                              lambda c, e: self.path_plain(c, e, p.t))
                del p


def producer_main(cfg: dict, conns, ctrl) -> None:
    """The producer of one set (``cfg["set"]``: ``arena`` or ``today``): its rows go
    to ``ctrl`` as ``("row", dict)``, skipped paths as ``("skip", path, why)``,
    then ``("done", reports)``; a failure as ``("error", text)``."""
    reports: dict = {}
    p = None
    try:
        p = Producer(cfg, conns, ctrl)
        p.tell("host", host_info(p))
        p.run_set()
        for i, c in enumerate(conns):
            c.send(("report",))
            if c.poll(30):
                reports[f"consumer {i}"] = c.recv()[1]
        reports["producer"] = arena_report()
    except BaseException:  # noqa: BLE001 - said to the orchestrator
        ctrl.send(("error", traceback.format_exc()))
    finally:
        for pool in (p._sglang_pools.values() if p is not None else ()):
            try:
                pool.shutdown()
            except Exception:  # noqa: BLE001
                pass
        for c in conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        try:
            from mmshm.segments.table import TABLE

            TABLE.sweep()
            TABLE.trim_pool()  # the warm pool and the arena: nothing left behind
        except Exception:  # noqa: BLE001
            pass
        ctrl.send(("done", reports))


def host_info(p: Producer | None = None) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cpus": os.cpu_count(),
            "cpus_affinity": len(os.sched_getaffinity(0)), "machine": platform.node()}
    try:
        from importlib.metadata import version

        info["mmshm"] = version("mmshm")
    except Exception:  # noqa: BLE001
        info["mmshm"] = None
    try:
        info["mmshm_commit"] = subprocess.run(
            ["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short",
             "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001
        info["mmshm_commit"] = None
    if p is not None and p.cuda:
        props = torch.cuda.get_device_properties(p.dev)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_count"] = torch.cuda.device_count()
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=pcie.link.gen.current,"
                                "pcie.link.width.current,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
            info["pcie_gen_width_driver"] = q.splitlines()[0] if q else None
        except Exception:  # noqa: BLE001
            info["pcie_gen_width_driver"] = None
        # the arena's device for a view made on a thread that never set one
        # (vLLM's EngineCore input thread): the one device with a context
        from mmshm.segments import arena

        seen: list = []
        t = threading.Thread(target=lambda: seen.append(arena.CudaRegistrar().current_device()))
        t.start()
        t.join(30)
        info["driver_active_contexts"] = arena._active_devices(torch.cuda.device_count())
        info["device_seen_from_a_fresh_thread"] = seen[0] if seen else None
    return info


# -- part 3: the mixed-size workload and the race check ---------------------------------------
MIXED = "mixed sizes, the server's own copy"
RACE_CONTROL = "control: settle off"
#: the GPU is busy for this long ahead of each request's copies (a forward in
#: flight), so that an early rewrite by the producer lands before the copy
#: (the producer writes a request of 8 photos, 190 MB, in about 20 ms)
BUSY_S = 0.1
#: --dry-run: the fake stream is busy until the producer's next request has
#: arrived (at most this long), so the control's tear does not hang on timing
BUSY_GATE_S = 2.0
#: --dry-run: pixel_values rows divided by this (tiny payloads)
TINY_ROWS_DIV = 64


class FakeStream:
    """A CPU stand-in for a CUDA stream (``--dry-run``): work queued on one
    thread, run in order, later. :meth:`copy` returns the destination at once
    and fills it when its turn comes (as ``.to(device, non_blocking=True)``
    from page-locked memory); :meth:`busy` queues a pause (a kernel);
    :meth:`synchronize` waits for everything queued so far."""

    def __init__(self):
        import queue

        self.q = queue.Queue()
        self.t = threading.Thread(target=self._run, daemon=True, name="fake-stream")
        self.t.start()

    def _run(self):
        while True:
            fn, done = self.q.get()
            try:
                if fn is not None:
                    fn()
            finally:
                if done is not None:
                    done.set()

    def busy(self, seconds: float) -> None:
        self.q.put((lambda: time.sleep(seconds), None))

    def busy_until(self, ready, seconds: float) -> None:
        """Busy until ``ready()`` is true, at most ``seconds``."""
        def wait():
            end = time.monotonic() + seconds
            while not ready() and time.monotonic() < end:
                time.sleep(0.001)

        self.q.put((wait, None))

    def copy(self, src):
        """A copy of ``src`` made later, from its address: like a DMA, it holds
        no reference to ``src`` (the arena keeps the mapping, not the view)."""
        import ctypes

        import torch

        dst = torch.empty_like(src)
        addr, n = src.data_ptr(), src.numel() * src.element_size()
        self.q.put((lambda: ctypes.memmove(dst.data_ptr(), addr, n), None))
        return dst

    def synchronize(self) -> None:
        done = threading.Event()
        self.q.put((None, done))
        done.wait(60)


class CountingRegistrar:
    """Wraps the arena's registrar in a consumer: counts registrations (what
    ``cudaHostRegister`` was asked), and with ``settle=False`` switches the
    settle off (the race check's control: a released view's pages go back
    to the producer while a copy may still read them). ``inner`` None: a
    **simulated registration on a CPU host** (``--dry-run``), whose settle
    waits for the :class:`FakeStream`."""

    name = "counting"

    def __init__(self, inner=None, settle: bool = True, stream: FakeStream | None = None):
        self.inner = inner
        self.do_settle = settle
        self.stream = stream
        self.registered = 0
        self.unregistered = 0
        self._lock = threading.Lock()

    def current_device(self):
        return self.inner.current_device() if self.inner is not None else None

    def register(self, addr, nbytes, read_only, device=None):
        with self._lock:
            self.registered += 1
        if self.inner is not None:
            self.inner.register(addr, nbytes, read_only, device)

    def unregister(self, addr, device=None):
        with self._lock:
            self.unregistered += 1
        if self.inner is not None:
            self.inner.unregister(addr, device)

    def settle(self, devices=()):
        if not self.do_settle:
            return
        if self.inner is not None:
            self.inner.settle(devices)
        elif self.stream is not None:
            self.stream.synchronize()


def mixed_consumer_main(index: int, cfg: dict, conn) -> None:
    """A TP rank of the mixed workload: per request, the GPU is made busy
    (:data:`BUSY_S`), each photo is materialized (an arena view) and copied as
    the server copies (``.to(device, non_blocking=True)`` on the current
    stream), the view dropped at once; ``("released", i)`` goes to the
    producer before any wait; then the stream is synchronized and every GPU
    tensor checked against the producer's checksum: ``("checked", i, ok,
    registrations so far)``."""
    import gc

    import torch

    cuda = cfg["device"] == "cuda"
    stream = None
    cycles_per_s = 0.0
    if cuda:
        dev = torch.device("cuda", index % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        torch.ones(1, device=dev)
        torch.cuda.synchronize(dev)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        cycles_per_s = 10_000_000 / max(a.elapsed_time(b) / 1e3, 1e-6)
    else:
        dev = torch.device("cpu")
        stream = FakeStream()
    from mmshm.segments import arena

    reg = CountingRegistrar(arena.CudaRegistrar() if cuda else None, settle=cfg["settle"],
                            stream=stream)
    arena.set_registrar(reg)
    conn.send(("ready", os.getpid()))
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg[0] == "stop":
                return
            _, i, items = msg
            try:
                if cuda:
                    torch.cuda._sleep(int(BUSY_S * cycles_per_s))
                else:  # until the producer has written the next request
                    stream.busy_until(conn.poll, BUSY_GATE_S)
                outs = []
                for h, _expected in items:
                    t = h.materialize()
                    outs.append(t.to(dev, non_blocking=True) if cuda else stream.copy(t))
                    del t  # the view goes now; the copy may still be queued
                del h
                gc.collect()
                conn.send(("released", i))
                if cuda:
                    torch.cuda.synchronize(dev)
                else:
                    stream.synchronize()
                ok = [checksum(g) == e for g, (_, e) in zip(outs, items)]
                del outs, items
                conn.send(("checked", i, ok, reg.registered, reg.unregistered))
            except Exception:  # noqa: BLE001 - said to the producer
                conn.send(("error", traceback.format_exc()))
    finally:
        arena.VIEWS.settled(10.0)


def mixed_producer_main(cfg: dict, conns, ctrl) -> None:
    """The tokenizer of the mixed workload, the arena on: per request, each
    photo's ``pixel_values`` (sizes from :func:`mmshm.bench.mixed.workload`,
    bytes changed in every page per request) written with
    ``ShmTensor.from_tensor`` (a warm arena segment when one is idle: the
    producer rewrites a released segment at once), a reference per consumer;
    the next request as soon as every consumer said it released this one."""
    out = {"requests": 0, "photos": 0, "torn": 0, "photos_checked": 0, "registrations": [],
           "unregistrations": [], "hits": 0, "misses": 0, "error": None}
    try:
        import torch

        import mmshm
        from mmshm.bench.mixed import COLUMNS, workload
        from prometheus_client import REGISTRY

        def counter(result):
            return REGISTRY.get_sample_value("mmshm_pool_requests_total",
                                             {"result": result}) or 0.0

        work = workload(cfg["requests"], cfg["seed"])
        div = TINY_ROWS_DIV if cfg["device"] != "cuda" else 1
        rows_max = max(max(t * h * w for t, h, w in r) for r in work) // div + 1
        base = torch.randint(-2**30, 2**30, (rows_max * COLUMNS,), dtype=torch.int32)
        for c in conns:
            if not c.poll(120):
                raise RuntimeError("a consumer did not start")
            c.recv()
        pending: list = []
        h0, m0 = counter("hit"), counter("miss")
        t0 = time.time()
        for i, grids in enumerate(work):
            if time.time() > cfg["deadline"]:
                out["error"] = "stopped at the run's deadline"
                break
            items = []
            for j, (t, gh, gw) in enumerate(grids):
                rows = max(1, t * gh * gw // div)
                words = base[:rows * COLUMNS].clone()
                words[(i * 8 + j) % STRIDE_WORDS::STRIDE_WORDS] += i + 1
                x = words.view(torch.float32).view(rows, COLUMNS)
                h = mmshm.ShmTensor.from_tensor(x, hash=b"")
                h.share(len(conns))  # one reference per consumer, handed over by the pickle
                items.append((h, checksum(x)))
            for c in conns:
                c.send(("request", i, items))
            for h, _ in items:
                h.release()
            del items, h
            if pending:  # the previous request's check: its copies ran while this was written
                _mixed_checked(conns, out, cfg)
            for c in conns:  # the release, not the copy: the next rewrite follows at once
                _expect(c, "released", cfg["request_timeout"])
            pending = [i]
            out["requests"] += 1
            out["photos"] += len(grids)
        if pending:
            _mixed_checked(conns, out, cfg)
        out["hits"], out["misses"] = counter("hit") - h0, counter("miss") - m0
        out["elapsed_s"] = time.time() - t0
    except Exception:  # noqa: BLE001 - said to the orchestrator
        out["error"] = traceback.format_exc()
    finally:
        for c in conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        try:
            from mmshm.segments.table import TABLE

            TABLE.sweep()
            TABLE.trim_pool()
        except Exception:  # noqa: BLE001
            pass
        ctrl.send(("mixed", out))


def _expect(conn, kind: str, timeout: float):
    if not conn.poll(timeout):
        raise RuntimeError(f"no {kind!r} from a consumer in {timeout} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"a consumer failed:\n{msg[1]}")
    if msg[0] != kind:
        raise RuntimeError(f"expected {kind!r} from a consumer, got {msg[0]!r}")
    return msg


def _mixed_checked(conns, out: dict, cfg: dict) -> None:
    regs, unregs = [], []
    for c in conns:
        _, _i, ok, r, u = _expect(c, "checked", cfg["request_timeout"])
        out["photos_checked"] += len(ok)
        out["torn"] += sum(1 for x in ok if not x)
        regs.append(r)
        unregs.append(u)
    out["registrations"], out["unregistrations"] = regs, unregs


def memlock_probe(nbytes: int = 64 << 20, limit: int = 64 << 10, timeout: float = 60.0) -> dict:
    """Register ``nbytes`` of anonymous memory with CUDA in a child running as
    ``nobody`` (when this process is root) under ``RLIMIT_MEMLOCK`` =
    ``limit`` bytes (``ulimit -l 64``): does the locked-memory limit refuse a
    ``cudaHostRegister``? Returns the child's report (CUDA's error name and
    text, the user it ran as, the limit it had), or the reason it could not
    run."""
    import pwd
    import resource

    code = r"""
import ctypes, json, mmap, os, resource
import torch
torch.cuda.init()
torch.ones(1, device="cuda")
n = %d
buf = mmap.mmap(-1, n)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
rt = torch.cuda.cudart()
rc = int(rt.cudaHostRegister(addr, n, 0))
name = text = None
with open("/proc/self/maps") as f:
    libs = {l.split()[-1] for l in f if "libcudart" in l}
for lib in libs:
    try:
        L = ctypes.CDLL(lib)
        L.cudaGetErrorName.restype = L.cudaGetErrorString.restype = ctypes.c_char_p
        name = L.cudaGetErrorName(rc).decode(); text = L.cudaGetErrorString(rc).decode()
        if rc == 0:
            L.cudaGetLastError()
        break
    except Exception:
        pass
if rc == 0:
    rt.cudaHostUnregister(addr)
print(json.dumps({"rc": rc, "error_name": name, "error_text": text, "uid": os.getuid(),
                  "memlock": resource.getrlimit(resource.RLIMIT_MEMLOCK), "bytes": n}))
""" % nbytes
    user = "root (not root: the limit only)"
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        nobody = None

    def demote():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
        if os.geteuid() == 0 and nobody is not None:
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)

    if os.geteuid() == 0 and nobody is not None:
        user = "nobody"
    elif os.geteuid() != 0:
        user = f"uid {os.geteuid()}"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, preexec_fn=demote, cwd="/",
                              env=dict(os.environ, HOME="/tmp"))
    except Exception as exc:  # noqa: BLE001 - reported
        return {"error": f"the probe did not run: {exc!r}", "user": user}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}", "user": user}
    res = json.loads(lines[-1])
    res["user"] = user
    res["limit_bytes"] = limit
    return res


def _start_set(ctx, env: dict, c: dict, n_consumers: int, consumer_target, producer_target):
    """Start ``n_consumers`` consumer processes and one producer (spawned, with
    ``env`` added to their environment, each consumer on a pipe of its own to
    the producer). Returns ``(producer, consumers, control)``: ``control`` is
    the read end of the producer's pipe of results."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    pipes = [ctx.Pipe() for _ in range(n_consumers)]
    ctrl_r, ctrl_w = ctx.Pipe(duplex=False)
    cons = [ctx.Process(target=consumer_target, args=(i, c, b), daemon=True)
            for i, (_, b) in enumerate(pipes)]
    prod = ctx.Process(target=producer_target, args=(c, [a for a, _ in pipes], ctrl_w),
                       daemon=True)
    try:
        for pr in (*cons, prod):
            pr.start()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    for a, b in pipes:  # the children hold these now
        a.close()
        b.close()
    ctrl_w.close()
    return prod, cons, ctrl_r


def run_mixed(cfg: dict, env: dict, deadline: float, out: dict) -> None:
    """Part 3: the mixed workload with the settle on (the check must pass)
    and, as its control, with the settle off (the check must see a tear where
    copies are asynchronous); each its own spawned set; rows in
    ``out["mixed"]``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    for label, settle, requests in ((MIXED, True, cfg["mixed_requests"]),
                                    (RACE_CONTROL, False, cfg["control_requests"])):
        if time.time() > deadline - 10:
            out["errors"].append(f"{label}: not run (the run's deadline)")
            continue
        c = dict(cfg, settle=settle, requests=requests, deadline=deadline - 5)
        prod, cons, ctrl_r = _start_set(ctx, env, c, cfg["mixed_consumers"],
                                        mixed_consumer_main, mixed_producer_main)
        res = None
        while time.time() < deadline:
            if ctrl_r.poll(1.0):
                try:
                    kind, res = ctrl_r.recv()
                except (EOFError, OSError):
                    break
                break
            if not prod.is_alive() and not ctrl_r.poll(0.5):
                break
        killed = _kill([prod, *cons], 30.0 if res is not None else 5.0)
        if res is None:
            out["errors"].append(f"{label}: the producer gave no result")
            res = {"error": "no result"}
        if killed:
            out["errors"].append(f"{label}: killed processes {killed} that did not exit")
            os.environ["MMSHM_DIR"] = env["MMSHM_DIR"]
            try:
                from mmshm.segments.reaper import reclaim_left_by

                reclaim_left_by({p.pid for p in (prod, *cons)}, env["MMSHM_DIR"])
            finally:
                os.environ.pop("MMSHM_DIR", None)
        ctrl_r.close()
        res["path"], res["settle"] = label, settle
        out["mixed"].append(res)


def mixed_lines(out: dict) -> list:
    """The mixed rows, the race check's verdict and the memlock probe, as text."""
    lines = []
    for r in out.get("mixed", []):
        regs = r.get("registrations") or []
        n = max(1, r.get("requests", 0))
        lookups = (r.get("hits") or 0) + (r.get("misses") or 0)
        lines.append(
            f"{r['path']}: {r.get('requests', 0)} requests, {r.get('photos', 0)} photos, "
            f"torn {r.get('torn', 0)} of {r.get('photos_checked', 0)} checked; registrations "
            f"per request per consumer {max(regs, default=0) / n:.3f} ({regs} in all); "
            f"pool hits {r.get('hits', 0):.0f} of {lookups:.0f}"
            + (f"; error: {r['error'].strip().splitlines()[-1]}" if r.get("error") else ""))
    by = {r["path"]: r for r in out.get("mixed", [])}
    on, off = by.get(MIXED), by.get(RACE_CONTROL)
    if on is not None and off is not None:
        passed = not on.get("error") and on.get("photos_checked") and on.get("torn") == 0
        lines.append(f"race check (settle on): {'passed' if passed else 'FAILED'}")
        if off.get("torn"):
            lines.append(f"race check control (settle off): the check saw {off['torn']} torn "
                         f"photo(s): it can fail")
        else:
            lines.append("race check control (settle off): NO tear seen: the check did not "
                         "show it can fail in this run")
    m = out.get("memlock")
    if m is not None:
        if "error" in m:
            lines.append(f"memlock probe: {m['error']}")
        else:
            verdict = "refused" if m["rc"] else "accepted"
            lines.append(f"memlock probe: cudaHostRegister of {m['bytes'] >> 20} MiB as "
                         f"{m['user']} under RLIMIT_MEMLOCK={m['limit_bytes'] >> 10} KiB: "
                         f"{verdict} ({m['error_name']}: {m['error_text']})")
    return lines


# -- the orchestrator -----------------------------------------------------------------------
def _kill(procs, grace: float) -> list:
    """Join ``procs`` (``grace`` seconds in all), then terminate and kill those still
    alive; the pids killed."""
    killed = []
    end = time.time() + grace
    for pr in procs:
        pr.join(max(0.1, end - time.time()))
    for pr in procs:
        if pr.is_alive():
            killed.append(pr.pid)
            pr.terminate()
            pr.join(3)
            if pr.is_alive():
                pr.kill()
                pr.join(3)
    return killed


def run_set(which: str, cfg: dict, env: dict, deadline: float, out: dict) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    c = dict(cfg, set=which, deadline=deadline)
    prod, cons, ctrl_r = _start_set(ctx, env, c, max(cfg["consumers"]), consumer_main,
                                    producer_main)
    done = False
    while time.time() < deadline:
        try:
            if not ctrl_r.poll(1.0):
                if not prod.is_alive() and not ctrl_r.poll(0.5):
                    out["errors"].append(f"set {which}: the producer exited "
                                         f"(code {prod.exitcode}) without finishing")
                    break
                continue
            msg = ctrl_r.recv()
        except (EOFError, OSError):
            out["errors"].append(f"set {which}: the producer's pipe closed early")
            break
        kind = msg[0]
        if kind == "row":
            row = dict(msg[1], set=which)
            out["rows"].append(row)
            print(f"  {row['path']}, {row['consumers']} consumer(s), {row['photos']} photo(s): "
                  f"{_ms(row['median_s'])} ms over {row['reps']} "
                  f"{'(bytes ok)' if row['bytes_ok'] else '(BYTES NOT OK)'}"
                  f"{' error: ' + row['error'].strip().splitlines()[-1] if row['error'] else ''}",
                  file=sys.stderr, flush=True)
        elif kind == "skip":
            if not any(s["path"] == msg[1] for s in out["skipped"]):
                out["skipped"].append({"path": msg[1], "why": msg[2]})
        elif kind == "host":
            out["host"].update(msg[1])
        elif kind == "error":
            out["errors"].append(f"set {which}: {msg[1].strip()}")
        elif kind == "done":
            out["reports"][which] = msg[1]
            done = True
            break
    if not done and time.time() >= deadline:
        out["errors"].append(f"set {which}: stopped at the run's deadline (--timeout)")
    # stopped processes exit within seconds (a loaded host: tens); a hung one is killed
    killed = _kill([prod, *cons], cfg["exit_grace"] if done else 5.0)
    if killed:
        out["errors"].append(f"set {which}: killed processes {killed} that did not exit")
    if killed or not done:
        # what the killed processes held: reclaimed by mmshm's reaper, as `mmshm run` does
        os.environ["MMSHM_DIR"] = env["MMSHM_DIR"]
        try:
            from mmshm.segments.reaper import reclaim_left_by

            rep = reclaim_left_by({p.pid for p in (prod, *cons)}, env["MMSHM_DIR"])
            out["errors"].append(f"set {which}: reclaimed what its processes left: {rep}")
        except Exception as exc:  # noqa: BLE001 - the leftovers are reported below
            out["errors"].append(f"set {which}: reclaiming its segments failed: {exc!r}")
        finally:
            os.environ.pop("MMSHM_DIR", None)
    ctrl_r.close()


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def floors(rows) -> dict:
    f = {}
    for r in rows:
        if r["path"] in (PATH_E, EPD_FLOOR) and r["median_s"]:
            f[(r["part"], r["photos"])] = r["median_s"]
    return f


def table(out: dict) -> str:
    rows = out["rows"]
    fl = floors(rows)
    lines = []
    for part, paths, title in (("pixels", PIXEL_PATHS, "Pixels to the GPU"),
                               ("epd", EPD_PATHS, "The EPD GPU hop")):
        lines.append(f"\n{title} (median of the timed requests; x floor: over the floor of "
                     f"the same payload)")
        lines.append(f"| {'path':38s} | cons | photos | {'MB':>7s} | {'median ms':>9s} | "
                     f"{'min ms':>8s} | {'first ms':>8s} | {'copy ms':>8s} | {'GB/s':>6s} | "
                     f"{'x floor':>7s} | reps | bytes |")
        lines.append("|" + "|".join("-" * w for w in (40, 6, 8, 9, 11, 10, 10, 10, 8, 9, 6, 7))
                     + "|")
        for r in sorted((r for r in rows if r["part"] == part),
                        key=lambda r: (r["photos"], r["consumers"], paths.index(r["path"]))):
            f = fl.get((part, r["photos"]))
            x = f"{r['median_s'] / f:.2f}" if f and r["median_s"] else "-"
            r["x_floor"] = r["median_s"] / f if f and r["median_s"] else None
            gbs = f"{r['bytes'] / r['median_s'] / 1e9:.2f}" if r["median_s"] else "-"
            ok = "ok" if r["bytes_ok"] else "FAIL"
            lines.append(f"| {r['path']:38s} | {r['consumers']:4d} | {r['photos']:6d} | "
                         f"{r['bytes'] / 1e6:7.1f} | {_ms(r['median_s']):>9s} | "
                         f"{_ms(r['min_s']):>8s} | {_ms(r['first_s']):>8s} | "
                         f"{_ms(r['h2d_median_s']):>8s} | {gbs:>6s} | {x:>7s} | "
                         f"{r['reps']:4d} | {ok:5s} |")
            if r["error"]:
                lines.append(f"|   error: {r['error'].strip().splitlines()[-1][:150]}")
    for s in out["skipped"]:
        lines.append(f"skipped: {s['path']}: {s['why']}")
    return "\n".join(lines)


def goals(out: dict) -> list:
    """The arena's goals, in this run, where the rows ran (CUDA only)."""
    if out["device"] != "cuda":
        return ["goals: not checked (no CUDA: the dry run's times are no evidence)"]
    by = {(r["path"], r["consumers"], r["photos"]): r for r in out["rows"] if r["median_s"]}
    fl = floors(out["rows"])
    res = []

    def ipc(c, k):
        return by.get((PATH_B_REAL, c, k)) or by.get((PATH_B_MINI, c, k))

    for c in out["consumers"]:
        for k, bound in ((8, 0.5), (1, 1.0)):
            d, b = by.get((PATH_D, c, k)), ipc(c, k)
            if d and b:
                q = d["median_s"] / b["median_s"]
                res.append(f"goal: {k} photo(s), {c} consumer(s): arena / cuda_ipc = {q:.2f} "
                           f"(<= {bound}): {'met' if q <= bound else 'NOT met'}")
        for k in out["photos"]:
            d = by.get((PATH_D, c, k))
            if d and fl.get(("pixels", k)):
                q = fl[("pixels", k)] / d["h2d_median_s"]
                res.append(f"goal: {k} photo(s), {c} consumer(s): a rank's H2D from the arena "
                           f"at {q:.2f}x the pinned copy's speed (>= 0.8): "
                           f"{'met' if q >= 0.8 else 'NOT met'}")
    e, s, f = by.get((EPD_ARENA, 1, 8)), by.get((EPD_ST, 1, 8)), fl.get(("epd", 8))
    if e and f:
        q = e["median_s"] / f
        res.append(f"goal: EPD hop / pinned round trip = {q:.2f} (<= 1.5): "
                   f"{'met' if q <= 1.5 else 'NOT met'}")
    if e and s:
        q = s["median_s"] / e["median_s"]
        res.append(f"goal: EPD hop {q:.2f}x faster than safetensors on tmpfs (>= 5): "
                   f"{'met' if q >= 5 else 'NOT met'}")
    return res


def segments_left(d: str) -> list:
    try:
        return sorted(n for n in os.listdir(d) if n.startswith("mmshm-"))
    except FileNotFoundError:
        return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--dry-run", action="store_true",
                    help="--device cpu with tiny payloads, 1 warm-up and 3 requests")
    ap.add_argument("--photos", default="1,8,32")
    ap.add_argument("--consumers", default="1,2")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests per cell (>= 1)")
    ap.add_argument("--reps", type=int, default=5, help="timed requests per cell (at most)")
    ap.add_argument("--cell-s", type=float, default=10.0,
                    help="stop a cell's timed requests after this many seconds (>= 1 ran)")
    ap.add_argument("--hash", choices=("now", "lazy"), default="now",
                    help="mmshm's producer computes the hash now (as the tokenizer) or not")
    ap.add_argument("--arena-bytes", default=str(2 << 30), help="MMSHM_ARENA_BYTES of path d")
    ap.add_argument("--shm-dir", default=os.environ.get("MMSHM_DIR") or "/dev/shm",
                    help="where the private segment directory is made")
    ap.add_argument("--timeout", type=float, default=280.0, help="seconds for the whole run")
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--exit-grace", type=float, default=30.0,
                    help="seconds a process set that finished gets to exit before its "
                         "processes still alive are killed (one that did not finish: 5)")
    ap.add_argument("--json")
    ap.add_argument("--mixed-requests", type=int, default=60,
                    help="requests of the mixed-size workload with the settle on (part 3)")
    ap.add_argument("--control-requests", type=int, default=12,
                    help="requests of its control, the settle off (part 3)")
    ap.add_argument("--skip-mixed", action="store_true", help="leave part 3 out")
    ap.add_argument("--only-mixed", action="store_true",
                    help="part 3 (and the memlock probe) only")
    ap.add_argument("--hang-for-test", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    t_start = time.time()
    if a.dry_run:
        a.device = "cpu"
    if a.warmup < 1 or a.reps < 1:
        ap.error("--warmup and --reps must be >= 1")
    import torch

    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    tiny = a.device == "cpu"
    if a.dry_run:
        a.warmup, a.reps = 1, 3
        a.mixed_requests, a.control_requests = min(a.mixed_requests, 8), min(
            a.control_requests, 4)
    if a.mixed_requests < 1 or a.control_requests < 1:
        ap.error("--mixed-requests and --control-requests must be >= 1")
    if a.skip_mixed and a.only_mixed:
        ap.error("--skip-mixed and --only-mixed exclude each other")
    run_dir = tempfile.mkdtemp(prefix="mmshm-gpu-arena-", dir=a.shm_dir)
    seg_dir = os.path.join(run_dir, "seg")
    st_dir = os.path.join(run_dir, "st")
    os.mkdir(seg_dir)
    os.mkdir(st_dir)
    photos = [int(x) for x in a.photos.split(",")]
    consumers = [int(x) for x in a.consumers.split(",")]
    photo_shape = TINY_PHOTO_SHAPE if tiny else PHOTO_SHAPE
    need = max(photos) * photo_shape[0] * photo_shape[1] * 4
    free = shutil.disk_usage(seg_dir).free
    if free < 3 * need:
        keep = [k for k in photos if 3 * k * photo_shape[0] * photo_shape[1] * 4 <= free]
        print(f"only {free / 2**30:.1f} GiB free in {a.shm_dir}: photos {photos} -> {keep}",
              file=sys.stderr)
        photos = keep
    cfg = {"device": a.device, "photos": photos, "consumers": consumers, "warmup": a.warmup,
           "reps": a.reps, "cell_s": a.cell_s, "hash": a.hash,
           "request_timeout": a.request_timeout, "exit_grace": a.exit_grace,
           "photo_shape": photo_shape,
           "epd_shape": TINY_EPD_SHAPE if tiny else EPD_SHAPE, "st_dir": st_dir,
           "hang": a.hang_for_test, "mixed_requests": a.mixed_requests,
           "control_requests": a.control_requests, "mixed_consumers": max(consumers),
           "seed": 0}
    out = {"device": a.device, "photos": photos, "consumers": consumers, "hash": a.hash,
           "arena_bytes": a.arena_bytes, "host": {}, "rows": [], "skipped": [],
           "errors": [], "reports": {}, "mixed": [], "memlock": None}
    # the warm pool on, as by default (the arena is the pool made persistent)
    base_env = {"MMSHM_DIR": seg_dir, "MMSHM_POOL": "1", "PYTHONUNBUFFERED": "1"}
    print(f"gpu_arena: device {a.device}, photos {photos}, consumers {consumers}, "
          f"segments in {seg_dir}", file=sys.stderr, flush=True)
    rc = 0
    try:
        end = t_start + a.timeout - 10 - (25 if a.device == "cuda" else 0)  # the memlock probe
        if not a.only_mixed:
            # the arena set first (with the floors): the rows the arena is about
            run_set("arena", cfg, dict(base_env, MMSHM_ARENA_BYTES=a.arena_bytes),
                    min(end, time.time() + max(30.0, 0.4 * (end - time.time()))), out)
            # part 3 keeps its share of the time (about 30 s on a GPU host)
            mixed_s = 0 if a.skip_mixed else min(60.0, 0.25 * (end - time.time()))
            run_set("today", cfg, dict(base_env, MMSHM_ARENA_BYTES="0"), end - mixed_s, out)
        if not a.skip_mixed:
            run_mixed(cfg, dict(base_env, MMSHM_ARENA_BYTES=a.arena_bytes), end, out)
        if a.device == "cuda":
            out["memlock"] = memlock_probe(timeout=max(5.0, t_start + a.timeout - time.time()))
        else:
            out["skipped"].append({"path": "memlock probe", "why": "needs CUDA"})
    finally:
        left = segments_left(seg_dir)
        st_left = os.listdir(st_dir) if os.path.isdir(st_dir) else []
        out["segments_left"] = left
        out["files_left"] = st_left
        shutil.rmtree(run_dir, ignore_errors=True)
    h = out["host"]
    pcie = (f", PCIe gen/width/driver {h.get('pcie_gen_width_driver')}" if h.get("gpu")
            else "")
    print(f"host: {h.get('gpu', 'no GPU (CPU dry run: plumbing only, not speed)')}{pcie}"
          f", {h.get('cpus')} CPUs ({h.get('cpus_affinity')} usable), torch {h.get('torch')}, "
          f"CUDA {h.get('cuda')}, mmshm {h.get('mmshm')} ({h.get('mmshm_commit')}); "
          f"mmshm hash: {a.hash}; MMSHM_ARENA_BYTES of d: {a.arena_bytes}")
    print(table(out))
    for which, reps in out["reports"].items():
        for who, rep in reps.items():
            st = rep.get("arena")
            if isinstance(st, dict):
                st = {k: st[k] for k in ("bytes", "registration", "mappings", "registered_bytes",
                                         "owned_bytes") if k in st}
            nz = {k: v for k, v in rep.get("counters", {}).items() if v}
            print(f"arena, {which} set, {who}: {st}; counters: {nz or 'all 0'}")
    for r in out["rows"]:
        if r["path"] == PATH_D and r["median_s"] and r["first_s"]:
            reg = " and registers" if a.device == "cuda" else ""
            print(f"arena, {r['photos']} photo(s), {r['consumers']} consumer(s): the first "
                  f"request (a consumer new to the arena segment maps{reg} it) "
                  f"{_ms(r['first_s'])} ms, then {_ms(r['median_s'])} ms: "
                  f"{_ms(r['first_s'] - r['median_s'])} ms once")
    for line in mixed_lines(out):
        print(line)
    by = {r["path"]: r for r in out["mixed"]}
    if not a.skip_mixed and (MIXED not in by or by[MIXED].get("error")
                             or by[MIXED].get("torn") or not by[MIXED].get("photos_checked")
                             or RACE_CONTROL not in by or not by[RACE_CONTROL].get("torn")):
        rc = 1  # the race check failed, or its control could not show that it can fail
    gl = goals(out)
    out["goals"] = gl
    for g in gl:
        print(g)
    for e in out["errors"]:
        print(f"error: {e}")
    bad = [r["path"] for r in out["rows"] if not r["bytes_ok"]]
    if left or st_left:
        print(f"FAIL: left behind in the segment directory: {left + st_left}")
        rc = 1
    else:
        print("segments left: none")
    if bad or out["errors"]:
        rc = 1
    out["elapsed_s"] = time.time() - t_start
    print(f"elapsed: {out['elapsed_s']:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return rc


if __name__ == "__main__":
    sys.exit(main())
