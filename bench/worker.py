"""A TP rank of the bench's scheduler (runs in a spawned process).

All ranks form a gloo group on 127.0.0.1. Rank 0 receives the ``n`` copies of
a request from the producer over ZMQ (PULL), all ranks meet at a barrier
(outside the measured region), then rank 0 broadcasts the batch with the
mode's ``broadcast_pyobj``-like function and every rank checks the bytes it
holds against the hashes carried in the requests (outside the measured
region). Commands and results travel over a ``multiprocessing`` pipe.

Times are ``time.perf_counter()`` readings (CLOCK_MONOTONIC on Linux, hence
comparable across the processes of one host), in seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import resource
import signal
import socket
import time
import traceback


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    """Resident set size now (``/proc/self/statm``); shared pages count once
    per mapping that has them resident."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


_CURRENT: _Rank | None = None  # this process's TP rank, once set up


def count_broadcast_bytes(nbytes: int) -> None:
    """Add ``nbytes`` to this TP rank's ``broadcast_bytes``: for modes whose
    broadcast does not go through ``torch.distributed.broadcast`` (which is
    counted by itself), such as vLLM's ``MessageQueue``. Outside a bench TP
    rank nothing happens."""
    if _CURRENT is not None:
        _CURRENT.bytes_broadcast += nbytes


class _Rank:
    def __init__(self, rank: int, tp: int, port: int, endpoint: str, cfg: dict):
        import torch.distributed as dist
        import zmq

        self.rank = rank
        self.tp = tp
        self.cfg = cfg
        self.timeout_s = float(cfg["timeout_s"])
        self.dist = dist
        self.modes: dict = {}
        self.bytes_broadcast = 0
        self.t_inner_start: float | None = None
        self.t_inner_end: float | None = None

        if "GLOO_SOCKET_IFNAME" not in os.environ and any(
                name == "lo" for _, name in socket.if_nameindex()):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        timeout = datetime.timedelta(seconds=self.timeout_s)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=tp, timeout=timeout)
        # the TP CPU group, as SGLang's tp_cpu_group
        self.group = dist.new_group(list(range(tp)), backend="gloo", timeout=timeout)
        self._count_broadcast_bytes()
        global _CURRENT
        _CURRENT = self

        self.zmq_ctx = zmq.Context()
        self.pull = None
        if rank == 0:
            self.pull = self.zmq_ctx.socket(zmq.PULL)
            self.pull.setsockopt(zmq.LINGER, 0)
            self.pull.setsockopt(zmq.RCVHWM, 0)
            self.pull.connect(endpoint)

    def _count_broadcast_bytes(self) -> None:
        """Count the bytes this process passes to ``torch.distributed.broadcast``
        (the bench's own process only): what TP rank 0 broadcasts. Point-to-point
        messages are not counted (mmshm's failure agreement, a vector of
        ``n + n * tp + handles * tp`` int32 per rank, and the multi-node
        payloads, which ``internode_bytes`` reports)."""
        dist = self.dist
        orig = dist.broadcast

        def counting_broadcast(tensor, *args, **kwargs):
            self.bytes_broadcast += tensor.numel() * tensor.element_size()
            return orig(tensor, *args, **kwargs)

        dist.broadcast = counting_broadcast

    def _mode(self, name: str):
        from .modes import get_mode

        m = self.modes.get(name)
        if m is None:
            cls = self.cfg.get("mode_classes", {}).get(name)  # the producer's registry
            m = (cls(min_bytes=self.cfg.get("min_bytes")) if cls is not None
                 else get_mode(name, min_bytes=self.cfg.get("min_bytes")))

            def inner(fn):
                def timed(*args, **kwargs):
                    self.t_inner_start = time.perf_counter()
                    out = fn(*args, **kwargs)
                    self.t_inner_end = time.perf_counter()
                    return out
                return timed

            m.instrument_broadcast(inner)
            self.modes[name] = m
        return m

    def run(self, cmd: dict) -> dict:
        from mmshm.segments.table import TABLE
        from mmshm.transport import multinode

        from .requests import verify

        mode = self._mode(cmd["mode"])
        n, images = int(cmd["n"]), int(cmd["images"])
        data = None
        t_recv = None
        if self.rank == 0:
            data = []
            for _ in range(n):
                if not self.pull.poll(int(self.timeout_s * 1000)):
                    raise TimeoutError(f"rank 0 received {len(data)} of {n} requests "
                                       f"within {self.timeout_s} s")
                data.append(mode.loads(self.pull.recv()))  # recv_pyobj by default
            t_recv = time.perf_counter()
        self.dist.barrier(group=self.group)  # outside the measured region
        rss0 = _rss_bytes()
        self.bytes_broadcast = 0
        self.t_inner_start = self.t_inner_end = None
        sent0 = multinode.internode_bytes()
        t0 = time.perf_counter()
        out = mode.broadcast(data, self.rank, self.group, 0)
        t1 = time.perf_counter()
        internode = multinode.internode_bytes() - sent0
        t_inner = self.t_inner_end if self.t_inner_end is not None else t1
        t_inner_start = self.t_inner_start if self.t_inner_start is not None else t0
        nbytes = self.bytes_broadcast
        problems = verify(out, n, images)  # outside the measured region (reads every byte)
        rss_growth = _rss_bytes() - rss0
        h2d: dict = {}
        if self.cfg.get("device") == "cuda":  # outside the measured region too
            from . import h2d as h2d_mod

            h2d = h2d_mod.measure(h2d_mod.distinct_features(out), self.rank)
        del out, data
        gc.collect()  # drops the views: every reference of this rank goes back
        return {
            "op": "result", "rank": self.rank, "pid": os.getpid(),
            "t_recv": t_recv, "t_broadcast_start": t0, "t_inner_start": t_inner_start,
            "t_broadcast_end": t_inner,
            "t_done": t1, "broadcast_bytes": nbytes, "internode_bytes": internode,
            "problems": problems[:10],
            "open_segments": len(TABLE.names()),
            "peak_rss_bytes": _peak_rss_bytes(),
            "rss_growth_bytes": rss_growth,
            **h2d,
        }

    def floor(self, cmd: dict) -> dict:
        """The floor's broadcast: ``n`` requests of ``images`` items whose
        features are 64-byte stand-ins (a handle's size on the wire), sent with
        the plain ``broadcast_pyobj`` over the same TP group and timed as a run."""
        from mmshm import broadcast_pyobj

        from .requests import metadata_only_batch

        n, images = int(cmd["n"]), int(cmd["images"])
        data = metadata_only_batch(n, images) if self.rank == 0 else None
        gc.collect()
        self.dist.barrier(group=self.group)
        self.bytes_broadcast = 0
        t0 = time.perf_counter()
        out = broadcast_pyobj(data, self.rank, self.group, 0)
        t1 = time.perf_counter()
        problems = [] if len(out) == n else [f"floor: {len(out)} of {n} requests"]
        link = self._link(int(cmd.get("link_bytes") or 0), cmd.get("link_dst"))
        return {"op": "floor", "rank": self.rank, "pid": os.getpid(), "t_start": t0,
                "t_done": t1, "broadcast_bytes": self.bytes_broadcast, "problems": problems,
                "peak_rss_bytes": _peak_rss_bytes(), **link}

    def _link(self, nbytes: int, dst: int | None) -> dict:
        """The link's floor with simulated nodes: one send of ``nbytes``
        (the payload) from rank 0 to rank ``dst`` on another node, point to
        point over the same gloo group, into a pre-faulted buffer. Returns
        ``t_link_start`` (rank 0) or ``t_link_done`` (``dst``)."""
        if not nbytes or dst is None:
            return {}
        import torch

        dst = int(dst)
        buf = None
        if self.rank in (0, dst):
            buf = torch.empty(nbytes, dtype=torch.uint8)
            buf.fill_(1)  # fault every page in outside the timing
        self.dist.barrier(group=self.group)
        t0 = time.perf_counter()
        if self.rank == 0:
            self.dist.send(buf, dst=dst, group=self.group)
            return {"t_link_start": t0}
        if self.rank == dst:
            self.dist.recv(buf, src=0, group=self.group)
            return {"t_link_done": time.perf_counter()}
        return {}

    def close(self) -> None:
        if self.pull is not None:
            self.pull.close(0)
        self.zmq_ctx.term()
        with contextlib.suppress(Exception):
            self.dist.destroy_process_group()


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the parent dies, even by SIGKILL."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def rank_main(rank: int, tp: int, port: int, endpoint: str, conn, cfg: dict) -> None:
    """Entry point of TP rank ``rank`` (a spawned process).

    Protocol on ``conn``: the rank sends ``{"op": "ready"}``, then answers each
    ``{"op": "run", mode, n, images}`` with ``{"op": "armed"}`` (once it is idle,
    its garbage collected) and then ``{"op": "result", ...}``, and each
    ``{"op": "floor", n, images}`` with ``{"op": "floor", ...}`` until it gets
    ``{"op": "stop"}``. Any exception is sent as ``{"op": "error"}``.
    """
    # Ctrl-C goes to the whole process group: only the parent handles it, and
    # it stops (or terminates) the ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if os.getppid() != cfg.get("parent_pid", os.getppid()):
        return  # the parent died before the death signal was armed
    r = None
    try:
        if cfg.get("node") is not None:
            # this rank's simulated node, before anything of mmshm runs (the
            # spawned process already inherited it; this makes it explicit)
            from mmshm.segments import node

            node.simulate(cfg["node_base_dir"], int(cfg["node"]))
        r = _Rank(rank, tp, port, endpoint, cfg)
        from . import modes, requests  # noqa: F401 - imported before gc.freeze()

        gc.collect()
        gc.freeze()  # as SGLang's scheduler: start-up objects leave the collector's scans
        conn.send({"op": "ready", "rank": rank, "pid": os.getpid()})
        while True:
            cmd = conn.recv()
            op = cmd.get("op")
            if op == "stop":
                break
            if op == "run":
                # the collector runs before the producer starts its clock, and
                # the producer waits for every rank to say so: no rank competes
                # for the CPU with the measured wrap
                gc.collect()
                conn.send({"op": "armed", "rank": rank})
            conn.send(r.floor(cmd) if op == "floor" else r.run(cmd))
    except EOFError:  # the parent went away
        pass
    except BaseException:  # noqa: BLE001
        with contextlib.suppress(Exception):
            conn.send({"op": "error", "rank": rank, "error": traceback.format_exc()})
    finally:
        if r is not None:
            r.close()
        conn.close()
