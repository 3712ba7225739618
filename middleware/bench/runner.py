"""Orchestration of ``mmshm bench``: producer, TP ranks, timing, leftovers.

The calling process is the producer (the tokenizer's role). It binds a ZMQ
PUSH socket on an ``ipc://`` endpoint (as SGLang's tokenizer does), spawns
``tp`` TP ranks (see :mod:`mmshm.bench.worker`) and, for every image count,
repetition and mode, fans one request out into ``n`` copies and sends each
to TP rank 0.

Measured per run (``time.perf_counter``, seconds):

* ``end_to_end_s``: from the producer starting to fan out / pickle the
  request until the last TP rank holds all its tensors (max over ranks). It
  includes the barrier the ranks meet at before the broadcast (sub-millisecond).
* ``broadcast_s``: the broadcast step after that barrier: for ``inline``,
  ``broadcast_pyobj`` with its pickling and unpickling; for ``mmshm``, the
  deferred unwrap's sharing plus the metadata broadcast and unpickling
  (max over ranks). ``share_s`` is the part before the inner broadcast
  starts (mmshm: TP rank 0 adding ``world - 1`` references per handle).
* ``materialize_s``: what follows the inner broadcast (mmshm: mapping the
  segments, zero-copy, and all-reducing the failure flags; max over ranks).
  ``broadcast_total_s`` is the sum as seen by each rank (max over ranks).

Reported values are medians over the repetitions. Bytes are checked against
the producer's hashes on every rank, outside the measured region.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import resource
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from mmshm import config, segment

from .modes import MODES, get_mode

DEFAULT_IMAGES = (1, 8, 32)
DEFAULT_MODES = ("inline", "mmshm")


class BenchError(RuntimeError):
    """The bench could not complete (a rank failed, timed out or died)."""


@dataclasses.dataclass
class BenchConfig:
    """Settings of one bench invocation.

    Attributes:
        tp: TP ranks (spawned processes).
        n: parallel-sampling copies per request.
        images: image counts per request, one set of runs each.
        resolution: ``"720p"`` or ``"1080p"``.
        modes: transport modes (see :data:`mmshm.bench.modes.MODES`).
        repeat: repetitions per (images, mode); medians are reported.
        min_bytes: shared-memory threshold in bytes (default ``MMSHM_MIN_BYTES``).
        timeout_s: bound in seconds on start-up, every collective and every wait.
        warmup: run each mode once on a 1-image request first (not reported).
        shm_dir: segment directory (default ``MMSHM_DIR``, else ``/dev/shm``).
    """

    tp: int = 2
    n: int = 2
    images: tuple[int, ...] = DEFAULT_IMAGES
    resolution: str = "720p"
    modes: tuple[str, ...] = DEFAULT_MODES
    repeat: int = 3
    min_bytes: int | None = None
    timeout_s: float = 300.0
    warmup: bool = True
    shm_dir: str | None = None

    def validate(self) -> None:
        from .photos import RESOLUTIONS

        if self.tp < 1 or self.n < 1 or self.repeat < 1:
            raise ValueError("tp, n and repeat must be >= 1")
        if not self.images or any(k < 1 for k in self.images):
            raise ValueError("images must be a non-empty list of counts >= 1")
        if self.resolution not in RESOLUTIONS:
            raise ValueError(f"resolution must be one of {', '.join(RESOLUTIONS)}")
        if not self.modes:
            raise ValueError("at least one mode is needed")
        for m in self.modes:
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
        if self.shm_dir is not None and not os.path.isdir(self.shm_dir):
            raise ValueError(f"segment directory {self.shm_dir} does not exist")


class Reporter:
    """Progress callbacks of :func:`run_bench` (no-op; the CLI shows them with rich)."""

    def start(self, total_steps: int) -> None:
        """``total_steps`` measured runs are coming."""

    def stage(self, text: str) -> None:
        """A new phase begins (start-up, warm-up, an image count)."""

    def step(self, text: str) -> None:
        """One measured run finished."""

    def warn(self, text: str) -> None:
        """Something the user should see."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def our_segments(directory: str, pids: set[int]) -> set[str]:
    """Segment files in ``directory`` created by one of ``pids``."""
    out = set()
    for name in segment.iter_segment_files(directory):
        m = segment.NAME_RE.match(name)
        if m and int(m.group(1)) in pids:
            out.add(name)
    return out


class _Session:
    """The producer side: ZMQ socket, spawned ranks and their pipes."""

    def __init__(self, cfg: BenchConfig, directory: str, reporter: Reporter):
        import zmq

        self.cfg = cfg
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

    # -- ranks -----------------------------------------------------------------
    def spawn(self) -> None:
        from .worker import rank_main

        ctx = mp.get_context("spawn")
        port = _free_port()
        wcfg = {"timeout_s": self.cfg.timeout_s, "min_bytes": self.cfg.min_bytes,
                "parent_pid": os.getpid()}
        for r in range(self.cfg.tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, name=f"mmshm-bench-tp{r}", daemon=True,
                            args=(r, self.cfg.tp, port, self.endpoint, child, wcfg))
            p.start()
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

    # -- one measured run ------------------------------------------------------
    def run_once(self, mode_name: str, req, images: int) -> dict:
        """Send ``n`` copies of ``req`` with ``mode_name`` and time the broadcast."""
        mode = self.modes[mode_name]
        n = self.cfg.n
        for c in self.conns:
            c.send({"op": "run", "mode": mode_name, "n": n, "images": images})
        t_start = time.perf_counter()
        copies = mode.fan_out(req, n)
        zmq_bytes = 0
        try:
            for i in range(n):
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
                    mode.after_send(c)
            del copies
        t_sent = time.perf_counter()
        res = sorted(self.gather(), key=lambda m: m["rank"])
        # Unmap this producer's freed segments now, outside any measured region,
        # rather than in the next run's first segment.create() or in the sweeper.
        segment.sweep()
        problems = [f"rank {m['rank']}: {p}" for m in res for p in m["problems"]]
        return {
            "broadcast_s": max(m["t_broadcast_end"] - m["t_broadcast_start"] for m in res),
            "share_s": max(m["t_inner_start"] - m["t_broadcast_start"] for m in res),
            "materialize_s": max(m["t_done"] - m["t_broadcast_end"] for m in res),
            "broadcast_total_s": max(m["t_done"] - m["t_broadcast_start"] for m in res),
            "end_to_end_s": max(m["t_done"] for m in res) - t_start,
            "produce_s": t_sent - t_start,
            "recv_s": res[0]["t_recv"] - t_start,
            "broadcast_bytes": res[0]["broadcast_bytes"],
            "zmq_bytes": zmq_bytes,
            "problems": problems,
            "rank_open_segments": sum(m["open_segments"] for m in res),
        }

    def leftovers(self, before: set[str], settle_s: float = 1.0) -> list[str]:
        """Our segment files still present (waiting up to ``settle_s`` seconds)."""
        deadline = time.monotonic() + settle_s
        while True:
            left = our_segments(self.dir, self.pids) - before
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


def _aggregate(cfg: BenchConfig, mode: str, images: int, payload: int, shape, samples: list,
               leftovers: list[str]) -> dict:
    run: dict[str, Any] = {
        "mode": mode, "tp": cfg.tp, "n": cfg.n, "images": images,
        "resolution": cfg.resolution, "payload_bytes": payload,
        "image_shape": list(shape),
    }
    for k in _METRICS:
        run[k] = statistics.median(s[k] for s in samples)
    run["broadcast_bytes"] = int(statistics.median(s["broadcast_bytes"] for s in samples))
    run["zmq_bytes"] = int(statistics.median(s["zmq_bytes"] for s in samples))
    problems = [p for s in samples for p in s["problems"]]
    run["correct"] = not problems
    run["problems"] = problems[:10]
    run["leftover_segments"] = leftovers
    run["rank_open_segments"] = max(s["rank_open_segments"] for s in samples)
    run["repeat"] = len(samples)
    run["samples"] = {k: [s[k] for s in samples] for k in ("broadcast_s", "end_to_end_s")}
    return run


def _add_ratios(runs: list[dict]) -> None:
    base = {r["images"]: r for r in runs if r["mode"] == "inline"}
    for r in runs:
        b = base.get(r["images"])
        if b is None or r is b:
            continue
        for k in ("broadcast_s", "end_to_end_s"):
            r[f"{k.removesuffix('_s')}_speedup_vs_inline"] = (
                b[k] / r[k] if r[k] > 0 else float("inf"))


def run_bench(cfg: BenchConfig, reporter: Reporter | None = None,
              on_run: Callable[[dict], None] | None = None) -> dict:
    """Run the bench and return ``{"runs": [...], ...}`` (times in seconds,
    sizes in bytes; see the module docstring).

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
    old_dir = os.environ.get("MMSHM_DIR")
    if cfg.shm_dir is not None:
        os.environ["MMSHM_DIR"] = cfg.shm_dir  # inherited by the spawned ranks
    config.reload()
    directory = config.get().dir
    if not os.path.isdir(directory):
        raise ValueError(f"segment directory {directory} does not exist (MMSHM_DIR)")
    before = our_segments(directory, {os.getpid()})
    runs: list[dict] = []
    final_left: list[str] = []
    sess = None
    completed = False
    try:
        reporter.stage(f"starting {cfg.tp} TP ranks")
        sess = _Session(cfg, directory, reporter)
        sess.spawn()
        reporter.stage(f"processing photos at {cfg.resolution} (Qwen2-VL image processor)")
        pics = photos(min(max(cfg.images), 8), cfg.resolution)  # while the ranks start
        reporter.stage("waiting for the TP group")
        sess.wait_ready()
        reporter.start(len(cfg.images) * cfg.repeat * len(cfg.modes))
        if cfg.warmup:
            reporter.stage("warm-up")
            req = build_request("warmup", pics, 1, cfg.n)
            for m in cfg.modes:
                sess.run_once(m, req, 1)
            del req
            found = sess.leftovers(before)
            if found:
                reporter.warn(f"warm-up: {len(found)} segment(s) left behind: "
                              f"{', '.join(found[:3])}")
                _remove(directory, found)
        for k in cfg.images:
            reporter.stage(f"{k} image(s) per request")
            req = build_request(f"req-{k}", pics, k, cfg.n)
            payload = payload_bytes(req)
            shape = tuple(req.mm_inputs.mm_items[0].feature.shape)
            samples: dict[str, list] = {m: [] for m in cfg.modes}
            left: dict[str, set] = {m: set() for m in cfg.modes}
            for rep in range(cfg.repeat):
                for m in cfg.modes:  # modes interleaved: drift hits all of them alike
                    samples[m].append(sess.run_once(m, req, k))
                    found = sess.leftovers(before)
                    if found:
                        reporter.warn(f"{m}, {k} image(s): {len(found)} segment(s) left "
                                      f"behind: {', '.join(found[:3])}")
                        left[m].update(found)
                        _remove(directory, found)
                    reporter.step(f"{m} x{k} rep {rep + 1}/{cfg.repeat}")
            del req
            gc.collect()
            for m in cfg.modes:
                run = _aggregate(cfg, m, k, payload, shape, samples[m], sorted(left[m]))
                runs.append(run)
                if on_run is not None:
                    on_run(run)
        completed = True
    finally:
        try:
            if sess is not None:  # on an error or Ctrl-C the ranks get 1 s, not 10
                sess.close(grace_s=10.0 if completed else 1.0)
        finally:
            pids = sess.pids if sess is not None else {os.getpid()}
            final_left = sorted(our_segments(directory, pids) - before)
            if final_left:
                reporter.warn(f"{len(final_left)} segment file(s) left in {directory} by the "
                              f"bench's processes; removing them")
                _remove(directory, final_left)
            if cfg.shm_dir is not None:
                if old_dir is None:
                    os.environ.pop("MMSHM_DIR", None)
                else:
                    os.environ["MMSHM_DIR"] = old_dir
                config.reload()
    _add_ratios(runs)
    return {
        "runs": runs,
        "config": {**dataclasses.asdict(cfg), "shm_dir": directory},
        "photos": [p.name for p in pics],
        "leftover_segments": final_left,
        "peak_rss_bytes": {"producer": _peak_rss_bytes(),
                           **{f"rank{r}": v for r, v in sorted(sess.rank_rss.items())}},
        "elapsed_s": time.perf_counter() - t_begin,
        "versions": _versions(),
        "host": {"cpus": os.cpu_count()},
    }


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("mmshm", "torch", "transformers", "pyzmq", "msgspec"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out
