"""Orchestration of ``mmshm bench``: producer, TP ranks, floor, timing, leftovers.

The calling process is the producer (the tokenizer's role). It binds a ZMQ
PUSH socket on an ``ipc://`` endpoint (as SGLang's tokenizer does) and, for
every TP size, spawns that many TP ranks (see :mod:`mmshm.bench.worker`). For
every resolution, ``n`` and image count (a *config*) and every repetition it
measures the floor, then, mode after mode, fans one request out into the
mode's copies and sends each to TP rank 0.

Measured per run (``time.perf_counter``, seconds):

* ``end_to_end_s``: from the producer starting to fan out / pickle the
  request until the last TP rank holds all its tensors (max over ranks),
  less the barrier the ranks meet at between TP rank 0's receive and the
  broadcast (``recv_s`` plus the time from TP rank 0 entering the broadcast
  to the last rank done). In a server the other ranks already wait in the
  broadcast when rank 0 gets a request; the barrier is the bench's, and on
  an oversubscribed host it takes milliseconds. The ranks collect their
  garbage and say so before the producer starts the clock.
* ``broadcast_s``: the broadcast step after that barrier: for ``inline``,
  ``broadcast_pyobj`` with its pickling and unpickling; for ``mmshm``, the
  deferred unwrap's sharing plus the metadata broadcast and unpickling;
  for ``fresh-segment``, the metadata broadcast with the opening of the
  segments (max over ranks). ``share_s`` is the part before the inner
  broadcast starts (mmshm: TP rank 0 adding ``world - 1`` references per handle).
* ``materialize_s``: what follows the inner broadcast (mmshm: mapping the
  segments, zero-copy, and agreeing on the failure flags; fresh-segment: the
  barrier, the copy-on-write mappings, the unlinks and the all-reduce; max
  over ranks). ``broadcast_total_s`` is the sum as seen by each rank.
* ``rss_growth_bytes``: how much a TP rank's resident set grew from before
  the broadcast to after the bytes check, which reads every byte (the most of
  any rank; shared pages count once per mapping); ``rss_growth_over_payload``
  divides it by one request's payload.
* ``wrap_s``/``wrap_bytes``: the producer's writes into shared memory
  (modes that make any), hence ``wrap_Bps``.
* the **floor** of the config, in the same TP group and the same repetitions:
  a copy of the payload into warm (pre-faulted) memory in the producer
  (``floor_memcpy_s``, the best of three copies, hence ``memcpy_Bps``) plus
  a metadata-only ``broadcast_pyobj`` of ``n`` requests (``floor_broadcast_s``).
  ``floor_s`` is their sum; ``e2e_over_floor`` is ``end_to_end_s / floor_s``,
  ``wrap_over_memcpy`` is ``wrap_Bps / memcpy_Bps`` and ``wrap_over_floor``
  its inverse, the wrap's time over the floor's copy of as many bytes
  (``copy_threads``: the threads the producer's copy of one photo used,
  :func:`mmshm.segments.shmtensor.copy_threads`; ``MMSHM_COPY_THREADS``). Before each of the
  floor's copies and before each run the producer writes a buffer of twice
  the last-level cache: every copy, the floor's and the modes', reads and
  writes DRAM. Without it a payload that fits in the cache (22.5 MB next to a
  260 MB L3) would be copied cache-hot by the floor's second try and
  cache-cold by a run.

The producer keeps idle pooled segments for ``BENCH_POOL_IDLE_S`` seconds
(``MMSHM_POOL_IDLE_S`` unless set): repetitions interleave the modes, and a
slow mode between two of mmshm's repetitions would otherwise outlast the
default 10 s and send mmshm back to fresh pages, which a server under steady
traffic does not do. Modes that keep memory warm across requests
(:attr:`~mmshm.bench.modes.Mode.warm_up_per_config`: mmshm's pool, vLLM's
ring buffer and arena) run once per config, unmeasured, before the
repetitions; their leftovers, if any, are reported with the run's.

Reported values are medians over the repetitions. A mode stops repeating in a
config once its samples' ``end_to_end_s`` add up to ``budget_s`` (at least one
sample: in practice only ``inline`` at large payloads is cut short). A run whose
estimated peak memory (all processes, tmpfs included) exceeds what the host
has available, or whose segments would not fit in the segment directory, is
skipped with the reason in ``skipped``. Bytes are checked against the
producer's hashes on every rank, outside the measured region.

With ``nodes`` K > 1 the bench simulates K nodes on one machine: each gets
its own segment directory under the bench's (:func:`mmshm.segments.node.simulated_dir`)
and its own ``MMSHM_NODE_ID``; TP ranks go to nodes in contiguous blocks
(:func:`mmshm.segments.node.node_of_rank`) and the producer is on node 0, the source
rank's. Every run reports ``nodes`` and ``internode_bytes``: for ``inline``
the pickled broadcast times the ranks on other nodes; for the other modes the
sum over ranks of :func:`mmshm.transport.multinode.internode_bytes` during the run.
``fresh-segment`` and ``sglang`` are single-node only and are skipped when
K > 1. A mode whose :meth:`~mmshm.bench.modes.Mode.unavailable` gives a
reason (``sglang`` where SGLang is not importable) is skipped with it.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from mmshm import config
from mmshm.segments import node
from mmshm.segments.shmtensor import copy_threads
from mmshm.segments.segfile import NAME_RE, STATE_POOLED, iter_segment_files, state_on_disk
from mmshm.segments.table import TABLE

from .modes import MODES, fresh_files, get_mode, remove_fresh_dirs
from .serve.servers import free_port

DEFAULT_IMAGES = (1, 8, 32)
DEFAULT_MODES = ("inline", "fresh-segment", "mmshm")
# the sweep's grid: ``mmshm bench --sweep``
SWEEP = {"tp": (2, 4), "n": (1, 8), "images": (1, 8, 32), "resolution": ("720p", "1080p")}
# memory left to the rest of the host when deciding what fits
HEADROOM_BYTES = 2 << 30
# the floor's memcpy is the best of this many copies in each repetition: it is
# a physical bound, and other processes on a loaded host only ever slow it down
MEMCPY_TRIES = 3
# bytes written to flush the CPU caches before every timed copy: twice the
# last-level cache (fallback 64 MiB), at most 1 GiB
EVICT_MAX_BYTES = 1 << 30


def _llc_bytes() -> int:
    """Size of the largest CPU cache of cpu0 (sysfs), or 32 MiB if unknown."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        entries = []
    for e in entries:
        try:
            with open(os.path.join(base, e, "size")) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or 32 << 20


class _CacheFlusher:
    """Writes a buffer of twice the last-level cache, so that the next copy
    reads its source from and writes its destination to DRAM, whatever ran
    before: the floor's copies and every mode's run start alike."""

    def __init__(self, max_bytes: int = EVICT_MAX_BYTES):
        import torch

        n = min(2 * _llc_bytes(), max_bytes)
        self.buf = torch.zeros(n, dtype=torch.uint8)

    def __call__(self) -> None:
        self.buf.add_(1)


class BenchError(RuntimeError):
    """The bench could not complete (a rank failed, timed out or died)."""


def _tuple(v) -> tuple:
    if isinstance(v, (str, int)):
        return (v,)
    return tuple(v)


@dataclasses.dataclass
class BenchConfig:
    """Settings of one bench invocation (each list is one axis of the grid).

    Attributes:
        tp: TP sizes; one group of spawned ranks each.
        n: parallel-sampling copies per request.
        images: image counts per request.
        resolution: ``"720p"`` and/or ``"1080p"``.
        modes: transport modes (see :data:`mmshm.bench.modes.MODES`).
        repeat: most repetitions per (config, mode); medians are reported.
        budget_s: a mode stops repeating in a config once its samples'
            ``end_to_end_s`` add up to this many seconds (it always gets one).
        max_mem_bytes: skip runs estimated to need more memory than this
            (default: available memory before each config less 2 GiB).
        min_bytes: shared-memory threshold in bytes (default ``MMSHM_MIN_BYTES``).
        timeout_s: bound in seconds on start-up, every collective and every wait.
        warmup: run each mode once on a 1-image request first (not reported).
        shm_dir: segment directory (default ``MMSHM_DIR``, else ``/dev/shm``).
        nodes: simulated nodes (1 to the smallest TP size), each with its own
            segment directory under ``shm_dir`` and its own node id.
        device: ``"cpu"``, or ``"cuda"``: every TP rank then also times the
            copy of what it holds to its GPU, from pageable and from
            registered (pinned) memory (:mod:`mmshm.bench.h2d`).
        evict_max_bytes: most bytes of the buffer the producer writes to flush
            the CPU caches before every timed copy (twice the last-level
            cache up to this; ``--quick`` uses 64 MiB, so on a CPU with a
            large cache its copies start partly warm, alike for every mode).
    """

    tp: tuple[int, ...] = (2,)
    n: tuple[int, ...] = (2,)
    images: tuple[int, ...] = DEFAULT_IMAGES
    resolution: tuple[str, ...] = ("720p",)
    modes: tuple[str, ...] = DEFAULT_MODES
    repeat: int = 3
    budget_s: float = 8.0
    max_mem_bytes: int | None = None
    min_bytes: int | None = None
    timeout_s: float = 300.0
    warmup: bool = True
    shm_dir: str | None = None
    nodes: int = 1
    device: str = "cpu"
    evict_max_bytes: int = EVICT_MAX_BYTES

    def __post_init__(self):
        for f in ("tp", "n", "images", "resolution", "modes"):
            setattr(self, f, _tuple(getattr(self, f)))

    def validate(self) -> None:
        from .photos import RESOLUTIONS

        if not self.tp or not self.n or any(v < 1 for v in self.tp + self.n) or self.repeat < 1:
            raise ValueError("tp, n and repeat must be >= 1")
        if not self.images or any(k < 1 for k in self.images):
            raise ValueError("images must be a non-empty list of counts >= 1")
        bad = [r for r in self.resolution if r not in RESOLUTIONS]
        if not self.resolution or bad:
            raise ValueError(f"resolution must be among {', '.join(RESOLUTIONS)}")
        if not self.modes:
            raise ValueError("at least one mode is needed")
        for m in self.modes:
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError("nodes must be >= 1")
        if self.nodes > min(self.tp):
            raise ValueError(f"cannot spread {min(self.tp)} TP ranks over {self.nodes} nodes "
                             f"(nodes must be <= tp)")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, not {self.device!r}")
        if self.device == "cuda":
            from .h2d import unavailable

            why = unavailable()
            if why:
                raise ValueError(f"--device cuda: {why}")
        if self.budget_s < 0:
            raise ValueError("budget_s must be >= 0")
        if self.shm_dir is not None and not os.path.isdir(self.shm_dir):
            raise ValueError(f"segment directory {self.shm_dir} does not exist")

    def configs(self) -> list[tuple[int, str, int, int]]:
        """``(tp, resolution, n, images)`` in the order they run."""
        return [(tp, r, n, k) for tp in self.tp for r in self.resolution for n in self.n
                for k in self.images]


class Reporter:
    """Progress callbacks of :func:`run_bench` (no-op; the CLI shows them with rich)."""

    def start(self, total_steps: int) -> None:
        """``total_steps`` measured runs are coming."""

    def stage(self, text: str) -> None:
        """A new phase begins (start-up, warm-up, a config)."""

    def step(self, text: str, advance: int = 1) -> None:
        """``advance`` measured runs finished (or were skipped)."""

    def warn(self, text: str) -> None:
        """Something the user should see."""



def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def mem_available_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _dir_space(directory: str) -> tuple[int, int]:
    """``(size, free)`` in bytes of the file system that holds ``directory``."""
    st = os.statvfs(directory)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def our_segments(directory: str, pids: set[int]) -> set[str]:
    """mmshm segment files in ``directory`` created by one of ``pids``, and
    the fresh-segment mode's files made by them."""
    out = set(fresh_files(directory, pids))
    for name in iter_segment_files(directory):
        m = NAME_RE.match(name)
        if m and int(m.group(1)) in pids:
            out.add(name)
    return out


def node_dirs(directory: str, nodes: int) -> list[str]:
    """The segment directories of a bench with ``nodes`` simulated nodes, as
    paths relative to ``directory`` (``""``: the directory itself)."""
    if nodes <= 1:
        return [""]
    return [""] + [os.path.relpath(node.simulated_dir(directory, k), directory)
                   for k in range(nodes)]


def all_segments(directory: str, nodes: int, pids: set[int]) -> set[str]:
    """:func:`our_segments` of ``directory`` and of every simulated node's
    directory, as paths relative to ``directory``."""
    out = set()
    for rel in node_dirs(directory, nodes):
        out |= {os.path.join(rel, name) if rel else name
                for name in our_segments(os.path.join(directory, rel), pids)}
    return out


def pooled_segments() -> set[str]:
    """Names of this process's idle segments in mmshm's warm pool (kept on
    purpose between requests, so not leftovers)."""
    return set(TABLE.pooled_names())


def _pooled_on_disk(path: str) -> bool:
    """Whether the segment file at ``path`` is idle in its owner's warm pool
    (a TP rank's, with ``--nodes``: a node leader's copies of the payloads),
    read from its header; those are unlinked when the rank stops."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        return state_on_disk(fd) == STATE_POOLED
    except OSError:
        return False
    finally:
        os.close(fd)


def _trim_pool() -> None:
    TABLE.trim_pool()
    TABLE.sweep()


class _Session:
    """The producer side of one TP size: ZMQ socket, spawned ranks and their pipes."""

    def __init__(self, cfg: BenchConfig, tp: int, directory: str, reporter: Reporter):
        import zmq

        self.cfg = cfg
        self.tp = tp
        self.dir = directory
        self.reporter = reporter
        self.procs: list = []
        self.conns: list = []
        self.pids: set[int] = {os.getpid()}
        self.rank_rss: dict[int, int] = {}
        self.tmpdir = tempfile.mkdtemp(prefix="mmshmbench-")
        self.endpoint = f"ipc://{self.tmpdir}/scheduler_input"
        self.zmq_ctx = zmq.Context()
        self.push = self.zmq_ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.setsockopt(zmq.SNDTIMEO, int(cfg.timeout_s * 1000))
        self.push.bind(self.endpoint)
        self.modes = {m: get_mode(m, min_bytes=cfg.min_bytes) for m in cfg.modes}
        self.flush_caches = _CacheFlusher(cfg.evict_max_bytes)

    # -- ranks -----------------------------------------------------------------
    def spawn(self) -> None:
        from .worker import rank_main

        ctx = mp.get_context("spawn")
        port = free_port()
        # the mode classes themselves: a spawned rank unpickles each by its module,
        # which registers it there too (vllm_modes' are registered by the package)
        wcfg = {"timeout_s": self.cfg.timeout_s, "min_bytes": self.cfg.min_bytes,
                "parent_pid": os.getpid(), "device": self.cfg.device,
                "mode_classes": {m: MODES[m] for m in self.cfg.modes}}
        for r in range(self.tp):
            parent, child = ctx.Pipe()
            rcfg = dict(wcfg)
            env: dict[str, str] = {}
            if self.cfg.nodes > 1:
                k = node.node_of_rank(r, self.tp, self.cfg.nodes)
                rcfg["node"], rcfg["node_base_dir"] = k, self.dir
                env = node.simulated_env(self.dir, k)
            p = ctx.Process(target=rank_main, name=f"mmshm-bench-tp{r}", daemon=True,
                            args=(r, self.tp, port, self.endpoint, child, rcfg))
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # the child starts with its node's settings
            try:
                p.start()
            finally:
                for key, v in saved.items():
                    if v is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = v
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def _read(self, r: int) -> dict:
        try:
            msg = self.conns[r].recv()
        except EOFError:
            self.procs[r].join(1.0)
            raise BenchError(f"TP rank {r} closed its pipe "
                             f"(exit code {self.procs[r].exitcode})") from None
        if msg.get("op") == "error":
            raise BenchError(f"TP rank {r} failed:\n{msg.get('error')}")
        return msg

    def gather(self) -> list[dict]:
        """One message from every rank, in rank order. Raises :class:`BenchError`
        as soon as any rank reports an error, dies or overruns ``timeout_s``."""
        deadline = time.monotonic() + self.cfg.timeout_s
        got: dict[int, dict] = {}
        while len(got) < len(self.conns):
            pending = [r for r in range(len(self.conns)) if r not in got]
            ready = mp_connection.wait([self.conns[r] for r in pending]
                                       + [p.sentinel for p in self.procs],
                                       timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise BenchError(f"TP rank(s) {pending} did not answer within "
                                 f"{self.cfg.timeout_s} s")
            for r in pending:
                if self.conns[r].poll():
                    got[r] = self._read(r)
            for r, p in enumerate(self.procs):
                if p.sentinel in ready:  # a rank must not exit before it is told to stop
                    p.join(1.0)
                    raise BenchError(f"TP rank {r} died (exit code {p.exitcode})")
        msgs = [got[r] for r in range(len(self.conns))]
        for m in msgs:
            self.rank_rss[m["rank"]] = max(self.rank_rss.get(m["rank"], 0),
                                           m.get("peak_rss_bytes", 0))
        return msgs

    def wait_ready(self) -> None:
        for m in self.gather():
            self.pids.add(int(m["pid"]))

    def stop(self, grace_s: float = 10.0) -> None:
        """Ask the ranks to stop; terminate (then kill) any still alive after
        ``grace_s`` seconds. Every process is joined."""
        for c in self.conns:
            try:
                c.send({"op": "stop"})
            except (OSError, EOFError, BrokenPipeError):
                pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []

    def close(self, grace_s: float = 10.0) -> None:
        try:
            self.stop(grace_s)
        finally:
            self.push.close(0)
            self.zmq_ctx.term()
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    # -- the floor -------------------------------------------------------------
    def floor_once(self, req, n: int, images: int) -> dict:
        """A copy of ``req``'s payload into warm memory, then a metadata-only
        broadcast of ``n`` requests over the TP group. The destination is
        allocated and pre-faulted outside the timing and freed after it, so
        the modes' runs do not carry it."""
        import torch

        nbytes = sum(it.feature.numel() * it.feature.element_size()
                     for it in req.mm_inputs.mm_items)
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        buf.fill_(0)  # fault every page in now: the floor copies into warm memory
        memcpy_s = float("inf")
        for _ in range(MEMCPY_TRIES):
            self.flush_caches()  # from and into DRAM, as a run's wrap
            t0 = time.perf_counter()
            off = 0
            for it in req.mm_inputs.mm_items:
                f = it.feature
                nb = f.numel() * f.element_size()
                buf[off:off + nb].copy_(f.reshape(-1).view(torch.uint8))
                off += nb
            memcpy_s = min(memcpy_s, time.perf_counter() - t0)
        del buf
        # with simulated nodes: one send of the payload to node 1's first rank
        link_dst = next((r for r in range(self.tp)
                         if node.node_of_rank(r, self.tp, self.cfg.nodes) == 1), None)
        for c in self.conns:
            c.send({"op": "floor", "n": n, "images": images, "link_dst": link_dst,
                    "link_bytes": nbytes if link_dst is not None else 0})
        res = self.gather()
        bcast_s = max(m["t_done"] for m in res) - res[0]["t_start"]  # from the source's start
        link_s = (res[link_dst]["t_link_done"] - res[0]["t_link_start"]
                  if link_dst is not None else None)
        return {"floor_s": memcpy_s + bcast_s, "memcpy_s": memcpy_s, "broadcast_s": bcast_s,
                "link_s": link_s,
                "broadcast_bytes": res[0]["broadcast_bytes"],
                "problems": [f"rank {m['rank']}: {p}" for m in res for p in m["problems"]]}

    # -- one measured run ------------------------------------------------------
    def run_once(self, mode_name: str, req, images: int, n: int) -> dict:
        """Send ``mode_name``'s copies of ``req`` for ``n`` samples and time them."""
        mode = self.modes[mode_name]
        expected = mode.copies(n)
        for c in self.conns:
            c.send({"op": "run", "mode": mode_name, "n": expected, "images": images})
        self.gather()  # "armed": every rank idle, its garbage collected
        self.flush_caches()
        t_start = time.perf_counter()
        copies = mode.fan_out(req, n)
        if len(copies) != expected:
            raise BenchError(f"mode {mode_name} made {len(copies)} copies, "
                             f"announced {expected}")
        zmq_bytes = 0
        try:
            for i in range(len(copies)):
                c, copies[i] = copies[i], None
                mode.before_send(c)
                msg = mode.dumps(c)
                self.push.send(msg, copy=False)
                mode.after_send(c)
                zmq_bytes += len(msg)
                del msg, c
        finally:
            for c in copies:  # only on error: copies not sent give their references back
                if c is not None:
                    mode.discard(c)
            del copies
        t_sent = time.perf_counter()
        res = sorted(self.gather(), key=lambda m: m["rank"])
        stats = mode.producer_stats()
        left = mode.after_run(self.dir)
        # Unmap this producer's freed segments now, outside any measured region,
        # rather than in the next run's first segment.create() or in the sweeper;
        # and map the pages of the segments that went back to the pool, as the
        # sweeper of a server would between its requests.
        TABLE.sweep()
        TABLE.warm_pooled()
        problems = [f"rank {m['rank']}: {p}" for m in res for p in m["problems"]]
        if mode_name == "inline":  # the pickled batch reaches every rank of another node
            remote = sum(1 for r in range(self.tp)
                         if node.node_of_rank(r, self.tp, self.cfg.nodes) != 0)
            internode = res[0]["broadcast_bytes"] * remote
        else:
            internode = sum(m.get("internode_bytes", 0) for m in res)
        return {
            "broadcast_s": max(m["t_broadcast_end"] - m["t_broadcast_start"] for m in res),
            "share_s": max(m["t_inner_start"] - m["t_broadcast_start"] for m in res),
            "materialize_s": max(m["t_done"] - m["t_broadcast_end"] for m in res),
            "broadcast_total_s": max(m["t_done"] - m["t_broadcast_start"] for m in res),
            # the ranks' alignment barrier (between t_recv and rank 0's broadcast) left out
            "end_to_end_s": (res[0]["t_recv"] - t_start
                             + max(m["t_done"] for m in res) - res[0]["t_broadcast_start"]),
            "produce_s": t_sent - t_start,
            "recv_s": res[0]["t_recv"] - t_start,
            "broadcast_bytes": res[0]["broadcast_bytes"],
            "zmq_bytes": zmq_bytes,
            "internode_bytes": internode,
            "problems": problems,
            "rank_open_segments": sum(m["open_segments"] for m in res),
            "rss_growth_bytes": max(m.get("rss_growth_bytes", 0) for m in res),
            "wrap_s": stats.get("wrap_s"),
            "wrap_bytes": stats.get("wrap_bytes"),
            # the threads one photo's copy into a segment used here (all are >= 4 MiB)
            "copy_threads": copy_threads() if stats.get("wrap_bytes") else None,
            **_h2d_of(res),
            "mode_leftovers": left,
        }

    def leftovers(self, before: set[str], settle_s: float = 1.0) -> list[str]:
        """Our segment files still present (waiting up to ``settle_s`` seconds),
        less this producer's idle pooled segments."""
        deadline = time.monotonic() + settle_s
        while True:
            left = all_segments(self.dir, self.cfg.nodes, self.pids) - before
            if left:
                TABLE.sweep()
                pooled = pooled_segments()
                left = {x for x in left if os.path.basename(x) not in pooled
                        and not _pooled_on_disk(os.path.join(self.dir, x))}
            if not left or time.monotonic() > deadline:
                return sorted(left)
            time.sleep(0.05)


def _remove(directory: str, names) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass


_METRICS = ("broadcast_s", "share_s", "materialize_s", "broadcast_total_s", "end_to_end_s",
            "produce_s", "recv_s")


_H2D_TIMES = ("h2d_pageable_s", "h2d_pinned_s", "host_register_s", "host_unregister_s")


def _h2d_of(res: list[dict]) -> dict:
    """``--device cuda``: each host-to-device time, the slowest rank's; the
    bytes one rank copied; the first driver error."""
    if not any("h2d_bytes" in m for m in res):
        return {}
    out: dict[str, Any] = {k: max((m[k] for m in res if m.get(k) is not None), default=None)
                           for k in _H2D_TIMES}
    out["h2d_bytes"] = max(m.get("h2d_bytes", 0) for m in res)
    out["h2d_error"] = next((m["h2d_error"] for m in res if m.get("h2d_error")), None)
    return out


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _floor_summary(samples: list[dict], payload: int) -> dict:
    memcpy_s = _median(s["memcpy_s"] for s in samples)
    return {
        "floor_s": _median(s["floor_s"] for s in samples),
        "floor_memcpy_s": memcpy_s,
        "floor_broadcast_s": _median(s["broadcast_s"] for s in samples),
        "floor_broadcast_bytes": int(_median(s["broadcast_bytes"] for s in samples)),
        "memcpy_Bps": payload / memcpy_s if memcpy_s else None,
        "floor_link_s": _median(s.get("link_s") for s in samples),
    }


def _base_run(mode: str, tp: int, n: int, copies: int, images: int, resolution: str,
              payload: int, shape, nodes: int = 1) -> dict:
    return {"mode": mode, "tp": tp, "n": n, "copies": copies, "images": images,
            "resolution": resolution, "payload_bytes": payload, "image_shape": list(shape),
            "nodes": nodes}


# modes whose transport cannot cross simulated nodes
SINGLE_NODE_MODES = ("fresh-segment", "sglang")


def _single_node_note(mode: str) -> str:
    return (f"{mode} is single-node only (its segments are opened by path on every rank); "
            f"skipped with --nodes > 1")


def _aggregate(base: dict, samples: list, leftovers: list[str], floor: dict) -> dict:
    run: dict[str, Any] = dict(base)
    for k in _METRICS:
        run[k] = statistics.median(s[k] for s in samples)
    run["broadcast_bytes"] = int(statistics.median(s["broadcast_bytes"] for s in samples))
    run["zmq_bytes"] = int(statistics.median(s["zmq_bytes"] for s in samples))
    run["internode_bytes"] = int(statistics.median(s["internode_bytes"] for s in samples))
    problems = [p for s in samples for p in s["problems"]]
    run["correct"] = not problems
    run["problems"] = problems[:10]
    run["leftover_segments"] = leftovers
    run["rank_open_segments"] = max(s["rank_open_segments"] for s in samples)
    # the most any rank's RSS grew while holding the batch, over one request's payload
    run["rss_growth_bytes"] = int(statistics.median(s["rss_growth_bytes"] for s in samples))
    run["rss_growth_over_payload"] = (run["rss_growth_bytes"] / run["payload_bytes"]
                                      if run.get("payload_bytes") else None)
    if "h2d_bytes" in samples[0]:
        for k in _H2D_TIMES:
            run[k] = _median(s.get(k) for s in samples)
        run["h2d_bytes"] = samples[0]["h2d_bytes"]
        run["h2d_error"] = next((s["h2d_error"] for s in samples if s.get("h2d_error")), None)
        for k, bps in (("h2d_pageable_s", "h2d_pageable_Bps"), ("h2d_pinned_s", "h2d_pinned_Bps")):
            run[bps] = run["h2d_bytes"] / run[k] if run[k] else None
    run["repeat"] = len(samples)
    run["samples"] = {k: [s[k] for s in samples] for k in ("broadcast_s", "end_to_end_s")}
    wrap_s = _median(s["wrap_s"] for s in samples)
    wrap_bytes = _median(s["wrap_bytes"] for s in samples)
    run["wrap_s"] = wrap_s
    run["wrap_bytes"] = int(wrap_bytes) if wrap_bytes is not None else None
    run["wrap_Bps"] = wrap_bytes / wrap_s if wrap_s and wrap_bytes else None
    run.update(floor)
    run["e2e_over_floor"] = (run["end_to_end_s"] / floor["floor_s"]
                             if floor.get("floor_s") else None)
    run["wrap_over_memcpy"] = (run["wrap_Bps"] / floor["memcpy_Bps"]
                               if run["wrap_Bps"] and floor.get("memcpy_Bps") else None)
    # the wrap's time over the floor's copy of as many bytes (lower is better)
    run["wrap_over_floor"] = (floor["memcpy_Bps"] / run["wrap_Bps"]
                              if run["wrap_Bps"] and floor.get("memcpy_Bps") else None)
    run["copy_threads"] = next((s["copy_threads"] for s in samples
                                if s.get("copy_threads") is not None), None)
    # the same number of requests and items, metadata only: what the broadcast
    # of a zero-copy transport should cost whatever the payload
    run["broadcast_over_floor"] = (run["broadcast_total_s"] / floor["floor_broadcast_s"]
                                   if floor.get("floor_broadcast_s") else None)
    # simulated nodes: the whole broadcast (every rank holding its tensors)
    # over one send of the payload across the same link
    run["broadcast_over_link"] = (run["broadcast_total_s"] / floor["floor_link_s"]
                                  if floor.get("floor_link_s") else None)
    return run


def _add_ratios(runs: list[dict]) -> None:
    def key(r):
        return (r["tp"], r["n"], r["resolution"], r["images"])

    for base_mode, suffix in (("inline", "inline"), ("fresh-segment", "fresh_segment"),
                              ("sglang", "sglang")):
        base = {key(r): r for r in runs if r["mode"] == base_mode and not r.get("skipped")}
        for r in runs:
            b = base.get(key(r))
            if b is None or r is b or r.get("skipped"):
                continue
            for k in ("broadcast_s", "end_to_end_s"):
                r[f"{k.removesuffix('_s')}_speedup_vs_{suffix}"] = (
                    b[k] / r[k] if r[k] > 0 else float("inf"))


def summarize(runs: list[dict]) -> list[dict]:
    """Per (mode, tp, n, resolution): how the broadcast and the end-to-end time
    grow from the fewest to the most images (the broadcast of a metadata-only
    mode should not grow with the payload)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if not r.get("skipped"):
            groups.setdefault((r["mode"], r["tp"], r["n"], r["resolution"]), []).append(r)
    out = []
    for (mode, tp, n, res), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["images"])
        lo, hi = rs[0], rs[-1]
        if lo is hi:
            continue
        out.append({
            "mode": mode, "tp": tp, "n": n, "resolution": res,
            "images": [lo["images"], hi["images"]],
            "broadcast_growth": hi["broadcast_s"] / lo["broadcast_s"],
            "end_to_end_growth": hi["end_to_end_s"] / lo["end_to_end_s"],
            "floor_broadcast_growth": (hi["floor_broadcast_s"] / lo["floor_broadcast_s"]
                                       if lo.get("floor_broadcast_s") else None),
            "broadcast_over_floor": [lo.get("broadcast_over_floor"),
                                     hi.get("broadcast_over_floor")],
        })
    return out


def _skip_reason(mode_cls, payload: int, copies: int, tp: int, max_mem: int | None,
                 directory: str) -> tuple[str | None, int, int]:
    mem, shm = mode_cls.estimate(payload, copies, tp)
    why = _unavailable(mode_cls)
    if why is not None:
        return why, mem, shm
    if max_mem is None:
        avail = mem_available_bytes()
        budget = max(0, avail - HEADROOM_BYTES) if avail else None
    else:
        budget = max_mem
    if budget is not None and mem > budget:
        return (f"estimated peak memory {mem / 1e9:.1f} GB exceeds the "
                f"{budget / 1e9:.1f} GB available"), mem, shm
    size, free = _dir_space(directory)
    if shm > free:
        from mmshm.operations.doctor import shm_size_advice, size_fix

        mib = 1 << 20
        # exact sizes (a 64 MiB /dev/shm and 90 MiB of segments are both "0.1 GB"),
        # and the fix in mmshm doctor's words, for this load and what else is there now
        return (f"its segments need {shm} bytes ({shm / mib:.1f} MiB), more than the {free} "
                f"bytes ({free / mib:.1f} MiB) free in {directory}; fix: "
                f"{size_fix(shm_size_advice(shm, size - free))}"), mem, shm
    return None, mem, shm


_UNAVAILABLE: dict[type, str | None] = {}


def _unavailable(mode_cls) -> str | None:
    """``mode_cls.unavailable()``, asked once per mode class."""
    if mode_cls not in _UNAVAILABLE:
        check = getattr(mode_cls, "unavailable", None)
        _UNAVAILABLE[mode_cls] = check() if check is not None else None
    return _UNAVAILABLE[mode_cls]


BENCH_POOL_IDLE_S = 600  # seconds; MMSHM_POOL_IDLE_S for the bench's producer unless set


def run_bench(cfg: BenchConfig, reporter: Reporter | None = None,
              on_run: Callable[[dict], None] | None = None) -> dict:
    """Run the bench and return ``{"runs": [...], "floors": [...], ...}`` (times
    in seconds, sizes in bytes; see the module docstring).

    Every spawned process is joined (or terminated) before this returns or
    raises, and segment files left by this bench's processes are reported in
    the runs' ``leftover_segments`` and in the result's ``leftover_segments``,
    then removed.

    Raises:
        ValueError: invalid configuration.
        BenchError: a TP rank failed, died or timed out.
    """
    from .photos import photos
    from .requests import build_request, payload_bytes

    cfg.validate()
    reporter = reporter or Reporter()
    t_begin = time.perf_counter()
    old_env = {k: os.environ.get(k) for k in ("MMSHM_DIR", "MMSHM_NODE_ID",
                                              "MMSHM_POOL_IDLE_S")}
    if cfg.shm_dir is not None:
        os.environ["MMSHM_DIR"] = cfg.shm_dir  # inherited by the spawned ranks
    if not os.environ.get("MMSHM_POOL_IDLE_S"):
        # The other modes run between two of mmshm's repetitions (inline takes
        # 20 s and more at 32 images); a server under steady traffic reuses
        # its pooled segments within the default 10 s. Keep them for the run.
        os.environ["MMSHM_POOL_IDLE_S"] = str(BENCH_POOL_IDLE_S)
    config.reload()
    settings = config.get()
    directory = settings.dir
    unusable = config.dir_problem(directory, create=False)
    if unusable is not None:
        raise ValueError(unusable.message())
    existed = {rel for rel in node_dirs(directory, cfg.nodes)
               if os.path.isdir(os.path.join(directory, rel))}
    if cfg.nodes > 1:
        node.simulate(directory, 0)  # the producer is on the source rank's node
    remove_fresh_dirs(directory, dead_only=True)  # left by a bench that was killed
    before = all_segments(directory, cfg.nodes, {os.getpid()})
    runs: list[dict] = []
    floors: list[dict] = []
    pics: dict[str, list] = {}
    rss: dict[str, int] = {}
    pids: set[int] = {os.getpid()}
    final_left: list[str] = []
    sess = None
    completed = False
    n_configs = len(cfg.configs())
    reporter.start(n_configs * (len(cfg.modes) + 1) * cfg.repeat)
    try:
        for tp in cfg.tp:
            reporter.stage(f"starting {tp} TP ranks")
            sess = _Session(cfg, tp, directory, reporter)
            sess.spawn()
            for res in cfg.resolution:  # while the ranks start
                if res not in pics:
                    reporter.stage(f"processing photos at {res} (Qwen2-VL image processor)")
                    pics[res] = photos(min(max(cfg.images), 8), res)
            reporter.stage(f"waiting for the TP group of {tp}")
            sess.wait_ready()
            pids |= sess.pids
            if cfg.warmup:
                reporter.stage("warm-up")
                req = build_request("warmup", pics[cfg.resolution[0]], 1, cfg.n[0])
                for m in cfg.modes:
                    if ((cfg.nodes == 1 or m not in SINGLE_NODE_MODES)
                            and _unavailable(MODES[m]) is None):
                        # twice: a file a group sets up over its first broadcast(s)
                        # (the one-node agreement's) is unlinked by then, not a leftover
                        for _ in range(2):
                            sess.run_once(m, req, 1, cfg.n[0])
                del req
                found = sess.leftovers(before)
                if found:
                    reporter.warn(f"warm-up: {len(found)} segment(s) left behind: "
                                  f"{', '.join(found[:3])}")
                    _remove(directory, found)
            for res in cfg.resolution:
                for n in cfg.n:
                    for k in cfg.images:
                        _run_config(sess, cfg, tp, res, n, k, pics[res], before, runs, floors,
                                    reporter, on_run, build_request, payload_bytes)
            for r, v in sorted(sess.rank_rss.items()):
                rss[f"tp{tp}.rank{r}"] = v
            sess.close(grace_s=10.0)
            sess = None
        completed = True
    finally:
        try:
            if sess is not None:  # on an error or Ctrl-C the ranks get 1 s, not 10
                pids |= sess.pids
                sess.close(grace_s=10.0 if completed else 1.0)
        finally:
            gc.collect()
            _trim_pool()
            final_left = sorted(all_segments(directory, cfg.nodes, pids) - before)
            if final_left:
                reporter.warn(f"{len(final_left)} segment file(s) left in {directory} by the "
                              f"bench's processes; removing them")
                _remove(directory, final_left)
            remove_fresh_dirs(directory, pids)
            for rel in node_dirs(directory, cfg.nodes):
                if rel and rel not in existed:  # the node directories this bench made
                    try:
                        os.rmdir(os.path.join(directory, rel))
                    except OSError:
                        pass
            for key, v in old_env.items():
                if v is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = v
            config.reload()
    _add_ratios(runs)
    return {
        "runs": runs,
        "floors": floors,
        "summary": summarize(runs),
        "config": {**dataclasses.asdict(cfg), "shm_dir": directory,
                   "pool": getattr(settings, "pool", None),
                   "pool_idle_s": getattr(settings, "pool_idle_s", None),
                   "min_bytes_effective": (cfg.min_bytes if cfg.min_bytes is not None
                                           else settings.min_bytes),
                   "copy_threads": copy_threads(),
                   "copy_threads_setting": getattr(settings, "copy_threads", None)},
        "photos": {res: [p.name for p in ps] for res, ps in pics.items()},
        "leftover_segments": final_left,
        "peak_rss_bytes": {"producer": _peak_rss_bytes(), **rss},
        "elapsed_s": time.perf_counter() - t_begin,
        "versions": _versions(),
        "host": {"cpus": os.cpu_count(), "cpus_affinity": len(os.sched_getaffinity(0)),
                 "mem_available_bytes": mem_available_bytes()},
    }


def _run_config(sess: _Session, cfg: BenchConfig, tp: int, res: str, n: int, k: int,
                pics: list, before: set[str], runs: list, floors: list, reporter: Reporter,
                on_run, build_request, payload_bytes) -> None:
    """The floor and every mode for one (tp, resolution, n, images)."""
    label = f"TP={tp} n={n} {res} x{k}"
    reporter.stage(label)
    gc.collect()
    TABLE.sweep()
    req = build_request(f"req-{k}", pics, k, n)
    payload = payload_bytes(req)
    shape = tuple(req.mm_inputs.mm_items[0].feature.shape)
    bases: dict[str, dict] = {}
    active: list[str] = []
    for m in cfg.modes:
        copies = sess.modes[m].copies(n)
        bases[m] = _base_run(m, tp, n, copies, k, res, payload, shape, cfg.nodes)
        why, mem, shm = _skip_reason(MODES[m], payload, copies, tp, cfg.max_mem_bytes, sess.dir)
        if cfg.nodes > 1 and m in SINGLE_NODE_MODES:
            why = _single_node_note(m)
        bases[m]["est_peak_bytes"], bases[m]["est_shm_bytes"] = mem, shm
        if why is None:
            active.append(m)
        else:
            reporter.warn(f"{label}: {m} skipped: {why}")
            bases[m]["skipped"] = why
            reporter.step(f"{m} skipped", advance=cfg.repeat)
    floor_samples: list[dict] = []
    samples: dict[str, list] = {m: [] for m in active}
    spent: dict[str, float] = {m: 0.0 for m in active}
    left: dict[str, set] = {m: set() for m in active}
    for m in active:
        if MODES[m].warm_up_per_config:  # its pool / arena warm, as in steady traffic
            s = sess.run_once(m, req, k, n)
            found = set(sess.leftovers(before)) | set(s["mode_leftovers"])
            if found:
                left[m].update(found)
                _remove(sess.dir, found)
            reporter.step(f"{m} x{k} warm-up", advance=0)
    for rep in range(cfg.repeat):
        floor_samples.append(sess.floor_once(req, n, k))
        reporter.step(f"floor x{k} rep {rep + 1}")
        for m in active:  # modes interleaved: drift hits all of them alike
            if samples[m] and spent[m] >= cfg.budget_s:
                reporter.step(f"{m} x{k}: budget spent")
                continue
            s = sess.run_once(m, req, k, n)
            spent[m] += s["end_to_end_s"]  # measured time only, not the ranks' checks
            samples[m].append(s)
            found = set(sess.leftovers(before)) | set(s["mode_leftovers"])
            if found:
                reporter.warn(f"{m}, {label}: {len(found)} segment(s) left behind: "
                              f"{', '.join(sorted(found)[:3])}")
                left[m].update(found)
                _remove(sess.dir, found)
            reporter.step(f"{m} x{k} rep {rep + 1}/{cfg.repeat}")
            gc.collect()
    del req
    gc.collect()
    floor = _floor_summary(floor_samples, payload)
    floor_problems = [p for s in floor_samples for p in s["problems"]]
    floors.append({"tp": tp, "n": n, "images": k, "resolution": res, "payload_bytes": payload,
                   **floor, "repeat": len(floor_samples), "problems": floor_problems[:10],
                   "samples": {"floor_s": [s["floor_s"] for s in floor_samples]}})
    for m in cfg.modes:
        if m in samples:
            run = _aggregate(bases[m], samples[m], sorted(left[m]), floor)
        else:
            run = {**bases[m], **floor, "correct": None, "leftover_segments": [],
                   "problems": [], "repeat": 0}
        runs.append(run)
        if on_run is not None:
            on_run(run)


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("mmshm", "torch", "transformers", "pyzmq", "msgspec"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out
