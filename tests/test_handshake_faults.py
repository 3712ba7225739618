"""The handshake never breaks a broadcast: whatever the store or a
peer does, a broadcast completes on the safe path or raises a typed
:class:`mmshm.PeerLostError` within the group's own timeout, and the
references handed to a peer the broadcast found lost are given back at once.

Each case runs real gloo process groups on 127.0.0.1 (``run_group``); the
rank functions live here, at top level, so that spawned children can import
them.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
from datetime import timedelta

import mmshm
import pytest

from tests.harness.procs import run_group
from tests.harness.segments import refcount, segment_files
from tests.harness import children

GROUP_TIMEOUT_S = 10.0  # the timeout of the process group under test


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _keep_warnings() -> _Keep:
    keep = _Keep()
    logging.getLogger("mmshm").addHandler(keep)
    return keep


def _wait_gone(timeout: float = 5.0) -> tuple[list[str], float]:
    """Poll the segment directory until it is empty (or ``timeout``):
    (what is left, seconds waited)."""
    t0 = time.monotonic()
    while segment_files() and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    return segment_files(), time.monotonic() - t0


# -- children ------------------------------------------------------------------------
def rank_store_gone(rank: int, world: int, seed: int) -> dict:
    """Four ranks, two reader groups ([0, 1] and [2, 3], as with DP=2), which
    take copies of one fanned-out request. Rank 0 (which hosts the default
    group's store) fans it out, hands copy 1 to rank 2, broadcasts copy 0 to
    group [0, 1] and exits. Only then does group [2, 3] make its first
    broadcast: it must complete (bytes equal) on the safe path, with one
    WARNING per rank and no exception."""
    import pickle

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    keep = _keep_warnings()
    res: dict = {}
    if rank == 0:
        one = mmshm.wrap(children.request(1, seed), min_bytes=1024)
        copies = mmshm.fan_out(one, 2, min_bytes=1024)
        blob = pickle.dumps(copies[1])
        for h in mmshm.handles(copies[1]):
            h.disown()  # its reference travels to rank 2
        size = torch.tensor([len(blob)], dtype=torch.int64)
        dist.send(size, dst=2)
        dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=2)
        out = bcast([copies[0]], rank, mine, 0)
        del copies, one
    elif rank == 2:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src=0)
        buf = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(buf, src=0)
        req = pickle.loads(buf.numpy().tobytes())
    if rank in (0, 1):
        if rank == 1:
            out = bcast(None, rank, mine, 0)
        children.check_request(out[0], 1, seed)
        del out
        gc.collect()
        return {}
    # group [2, 3]: wait until the store's host (rank 0) is gone
    store = _get_default_store()
    deadline = time.monotonic() + 30
    while True:
        try:
            store.check(["mmshm/never-set"])
        except Exception:  # noqa: BLE001 - the store cannot be reached: rank 0 exited
            break
        assert time.monotonic() < deadline, "rank 0 did not exit"
        time.sleep(0.1)
    t0 = time.monotonic()
    try:
        out = bcast([req] if rank == 2 else None, rank, mine, 2)
        res["raised"] = None
    except Exception as exc:  # noqa: BLE001 - the bug: the store's error reaches the caller
        res["raised"] = f"{type(exc).__name__}: {exc}"
        out = None
    res["s"] = time.monotonic() - t0
    if rank == 2:
        del req
    if out is not None:
        children.check_request(out[0], 1, seed)
        res["handles"] = len(mmshm.handles(out))
        del out
    gc.collect()
    res["warnings"] = keep.messages
    return res


def rank_dies_first(rank: int, world: int, seed: int) -> dict:
    """Three ranks in a group with a short timeout; rank 2 is SIGKILLed
    before the group's first broadcast. Ranks 0 (the source) and 1 must get
    a PeerLostError naming group rank 2 within the group's timeout, not
    after MMSHM_HANDSHAKE_S."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    dist.barrier(group=group)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)  # rank 2 is gone (its sockets closed at once)
    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    reqs = [mmshm.wrap(children.request(0, seed), min_bytes=1024)] if rank == 0 else None
    t0 = time.monotonic()
    try:
        bcast(reqs, rank, group, 0)
        res = {"raised": None}
    except Exception as exc:  # noqa: BLE001
        res = {"raised": type(exc).__name__, "ranks": getattr(exc, "ranks", None),
               "message": str(exc)}
    res["s"] = time.monotonic() - t0
    if reqs is not None:
        mmshm.release(reqs)
        del reqs
    gc.collect()
    res["left"] = _wait_gone()[0] if rank == 0 else []
    return res


def rank_killed_after_receive(rank: int, world: int, seed: int, opened: bool) -> dict:
    """Three ranks; rank 2 is SIGKILLed right after the broadcast's metadata
    reached it: before it opened anything (``opened`` False), or after it
    mapped one of the segments (True). Ranks 0 and 1 get a PeerLostError
    naming group rank 2. Not opened: the source gives rank 2's references
    back at once, so the segments go as soon as the survivors drop their
    views. Opened: rank 2 may have given that segment's reference back
    itself, so nobody gives it back for it; the reaper reclaims that segment
    (its holder was killed) at its first pass, and only that one."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    survivors = dist.new_group([0, 1])  # verification only: a group without the dead rank
    keep_views = []

    def dies_after(data, rank_, group_=None, src=0):
        out = mmshm.broadcast_pyobj(data, rank_, group_, src)
        if rank_ == 2:
            if opened:
                keep_views.append(mmshm.handles(out)[0].materialize())
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    bcast = mmshm.deferred_unwrap(dies_after)
    names: list[str] = []
    res: dict = {}
    reqs = None
    if rank == 0:
        reqs = [mmshm.wrap(children.request(i, seed), min_bytes=1024) for i in range(3)]
        names = [h.name for h in mmshm.handles(reqs)]
    t0 = time.monotonic()
    try:
        bcast(reqs, rank, group, 0)
        res["raised"] = None
    except Exception as exc:  # noqa: BLE001
        res.update(raised=type(exc).__name__, ranks=getattr(exc, "ranks", None),
                   runtime=isinstance(exc, RuntimeError))
    res["s"] = time.monotonic() - t0
    del reqs
    gc.collect()
    dist.barrier(group=survivors)  # both survivors dropped everything they held
    if rank == 0:
        res["names"] = names
        res["left"], res["waited"] = _wait_gone(3.0)
        res["counts"] = {n: refcount(n) for n in res["left"]}
    dist.barrier(group=survivors)
    return res


# -- tests ---------------------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_store_host_gone_before_another_groups_first_broadcast(shm_dir):
    """Group [2, 3] makes its first broadcast after rank 0, the host of the
    default group's store, has exited: the handshake cannot reach the store,
    which means what "no store" means (one WARNING, the shared-memory path,
    agreed by both ranks), never an exception into the server."""
    res = run_group(rank_store_gone, 4, 61, timeout=100)
    for r in (2, 3):
        assert res[r]["raised"] is None, res[r]
        assert res[r]["handles"] == 0, res[r]  # materialized: tensors, bytes checked
        warned = [m for m in res[r]["warnings"] if "store" in m]
        assert len(warned) == 1, res[r]["warnings"]
        assert "cannot be reached" in warned[0] and "Fix:" in warned[0], warned[0]
        assert res[r]["s"] < GROUP_TIMEOUT_S, res[r]
    assert segment_files(shm_dir) == []


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_rank_dies_before_first_broadcast_is_typed_and_bounded(shm_dir, monkeypatch):
    """A rank that dies before a group's first broadcast: the others get a
    PeerLostError naming it within the group's own timeout (10 s here), not
    after MMSHM_HANDSHAKE_S (60 s), and nothing is left."""
    monkeypatch.setenv("MMSHM_HANDSHAKE_S", "60")
    res = run_group(rank_dies_first, 3, 71, timeout=100, killed=(2,))
    assert set(res) == {0, 1}
    for r in (0, 1):
        assert res[r]["raised"] == "PeerLostError", res[r]
        assert res[r]["ranks"] == [2], res[r]
        assert res[r]["s"] < GROUP_TIMEOUT_S + 2, res[r]
    assert res[0]["left"] == []


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("opened", [False, True], ids=["unopened", "opened"])
def test_rank_killed_after_receive_gives_its_references_back(shm_dir, opened):
    """A rank SIGKILLed right after a broadcast reached it: the survivors get
    a PeerLostError naming it, and the references handed to it are given
    back at once (the segments go within seconds, not after the in-flight
    grace of MMSHM_IN_FLIGHT_GRACE_S = 300 s), never twice."""
    res = run_group(rank_killed_after_receive, 3, 81, opened, timeout=100, killed=(2,))
    assert set(res) == {0, 1}
    for r in (0, 1):
        assert res[r]["raised"] == "PeerLostError" and res[r]["runtime"], res[r]
        assert res[r]["ranks"] == [2], res[r]
        assert res[r]["s"] < GROUP_TIMEOUT_S, res[r]
    r0 = res[0]
    assert len(r0["names"]) == 4
    if not opened:
        assert r0["left"] == [], r0
        assert r0["waited"] < 3.0, r0
        return
    # the segment rank 2 opened keeps rank 2's reference (count 1, its holder
    # killed); the others are gone. Once its creator (rank 0) has exited too,
    # the reaper's first pass reclaims it as killed, at once
    first = r0["names"][0]
    assert r0["left"] == [first] and r0["counts"] == {first: 1}, r0
    from mmshm.segments.reaper import reap

    rep = reap(shm_dir)
    assert {k: v for k, v in rep.reasons.items() if v} == {"killed": 1}, rep
    assert segment_files(shm_dir) == []
