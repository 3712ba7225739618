"""The failure agreement of a group on one node, through shared memory
(:mod:`mmshm.transport.shmagree`): the same outcome as the gloo agreement, no gloo
message, and every fault typed, within the group's timeout, nothing left.

Multi-process tests: gloo on 127.0.0.1 (``tests/children.py``), groups with a
short timeout, a private segment directory.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from datetime import timedelta

import pytest

import mmshm
from mmshm.segments import node
from mmshm.transport import shmagree
from mmshm.transport import topology

from tests.harness.procs import run_group, spawn
from tests.harness.segments import SHM_ROOT, seg_dir, segment_files
from tests.harness import children

GROUP_TIMEOUT_S = 6.0  # the timeout of the process group under test


def _wait_empty(timeout: float = 5.0) -> tuple[list[str], float]:
    t0 = time.monotonic()
    while os.listdir(seg_dir()) and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    return sorted(os.listdir(seg_dir())), time.monotonic() - t0


def _count_agreement_messages() -> dict:
    """Count the gloo messages of the agreement (tag AGREE_TAG) in this process."""
    import torch.distributed as dist
    from mmshm.transport.agreement import AGREE_TAG

    calls = {"agree": 0}

    def counted(real):
        def p2p(*a, **kw):
            if kw.get("tag") == AGREE_TAG:
                calls["agree"] += 1
            return real(*a, **kw)
        return p2p

    dist.isend, dist.irecv = counted(dist.isend), counted(dist.irecv)
    return calls


def _agr(group=None):
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    hit = shmagree._GROUPS.get(id(pg))
    return None if hit is None else hit[1]


def _rounds(group=None) -> int | None:
    """Rounds agreed through shared memory on this group."""
    agr = _agr(group)
    return None if agr is None else agr.round


def _setup_messages(rank: int, src: int, world: int = 3) -> int:
    """The agreement's gloo messages of this rank in the group's first
    broadcast with handles (source ``src``), which sets the shared memory
    up: the source posts a receive and a send per other rank, a receiver
    one each."""
    return 2 * (world - 1) if rank == src else 2


# -- the same outcome as the gloo agreement ---------------------------------------------
def rank_same_errors(rank: int, world: int, seed: int, bad_rank: int, capacity: int | None
                     ) -> dict:
    if capacity is not None:  # vectors longer than this take the gloo agreement
        shmagree.CAPACITY = capacity
    calls = _count_agreement_messages()
    runs = [children.rank_failures(rank, world, seed + k, bad_rank) for k in range(3)]
    return {"errors": [r["errors"] for r in runs], "calls": calls, "rounds": _rounds(),
            "stage": _agr().stage, "files": sorted(os.listdir(seg_dir())),
            "names": [n for r in runs for n in r["names"]]}


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", ["shm", "gloo"])
def test_same_errors_on_every_rank_with_no_gloo_message(shm_dir, path):
    """Request 1 fails on every rank, request 4 on rank 2 only, three
    broadcasts: every rank returns the same MaterializeErrors every time.
    The first agrees over gloo (it sets the shared memory up), the others
    through shared memory with no gloo message of the agreement, or over gloo
    when the vector does not fit a slot (decided from its size, alike on
    every rank)."""
    res = run_group(rank_same_errors, 3, 61, 2, None if path == "shm" else 4,
                    timeout=200)
    for r in range(3):
        assert res[r]["errors"] == [{1: ("not_found", [0, 1, 2]), 4: ("malformed", [2])}] * 3, \
            res[r]
        assert res[r]["stage"] == "on", res[r]
        setup = _setup_messages(r, 0)
        if path == "shm":
            assert res[r]["calls"] == {"agree": setup}, res[r]
            assert res[r]["rounds"] == 2, res[r]
        else:
            assert res[r]["calls"] == {"agree": setup * 3}, res[r]
            assert res[r]["rounds"] == 0, res[r]
        # nothing but the segments rank 0 still held when it looked
        assert set(res[r]["files"]) <= set(res[0]["names"]), res[r]
    assert os.listdir(shm_dir) == []


def _broadcast_rounds(rank: int, world: int, seed: int, rounds: int, group=None,
            moving_src: bool = False) -> None:
    """``rounds`` broadcasts of two wrapped requests through
    ``deferred_unwrap``, bytes checked on every rank; the source is rank 0,
    or changes from round to round with ``moving_src``."""
    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    for rnd in range(rounds):
        src = rnd % world if moving_src else 0
        reqs = ([mmshm.wrap(children.request(i, seed + rnd), min_bytes=1024) for i in range(2)]
                if rank == src else None)
        out = bcast(reqs, rank, group, src)
        for i, r in enumerate(out):
            children.check_request(r, i, seed + rnd)
        del out, reqs, r
        gc.collect()


def rank_many_rounds(rank: int, world: int, seed: int) -> dict:
    calls = _count_agreement_messages()
    _broadcast_rounds(rank, world, seed, 12, moving_src=True)  # the source changes each round
    import torch.distributed as dist

    dist.barrier()
    return {"calls": calls, "rounds": _rounds(), "files": sorted(os.listdir(seg_dir()))}


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_rounds_with_changing_sources(shm_dir):
    """Twelve broadcasts, each from another source rank: the bytes are right
    on every rank; after the first, which sets it up, every agreement goes
    through shared memory (no gloo message), and nothing is left in the
    segment directory (the agreement file went at the end of the setup)."""
    res = run_group(rank_many_rounds, 3, 62, timeout=150)
    for r in range(3):
        assert res[r]["calls"] == {"agree": _setup_messages(r, 0)}, res[r]
        assert res[r]["rounds"] == 11, res[r]
        assert res[r]["files"] == [], res[r]
    assert os.listdir(shm_dir) == []


# -- a rank killed ----------------------------------------------------------------------
def rank_killed(rank: int, world: int, seed: int, victim: int, src: int) -> dict:
    """Three ranks, source ``src``. Rounds 1 (it sets the shared memory up)
    and 2 are clean; in round 3, through shared memory, ``victim`` is
    SIGKILLed right after the broadcast's metadata reached it, before it
    wrote its slot (a receiver) or read any slot (the source)."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    survivors = dist.new_group([r for r in range(world) if r != victim])
    rnd = [0]

    def dies_in_round_2(data, rank_, group_=None, src=0):
        out = mmshm.broadcast_pyobj(data, rank_, group_, src)
        if rank_ == victim and rnd[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    bcast = mmshm.deferred_unwrap(dies_in_round_2)
    res: dict = {}
    names: list[str] = []
    for rnd[0] in range(3):
        reqs = None
        if rank == src:
            reqs = [mmshm.wrap(children.request(i, seed + rnd[0]), min_bytes=1024)
                    for i in range(3)]
            names = [h.name for h in mmshm.handles(reqs)]
        t0 = time.monotonic()
        try:
            out = bcast(reqs, rank, group, src)
            for i, r in enumerate(out):
                children.check_request(r, i, seed + rnd[0])
            res["raised"] = None
            del out, r
        except Exception as exc:  # noqa: BLE001
            res.update(raised=type(exc).__name__, ranks=getattr(exc, "ranks", None),
                       runtime=isinstance(exc, RuntimeError), message=str(exc))
        res["s"] = time.monotonic() - t0
        del reqs
        gc.collect()
    res["rounds"] = _rounds(group)
    dist.barrier(group=survivors)  # every survivor dropped what it held
    if rank == src:
        res["names"] = names
        res["left"], res["waited"] = _wait_empty(3.0)
    dist.barrier(group=survivors)
    return res


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_receiver_killed_before_its_slot(shm_dir):
    """A receiver SIGKILLed before it wrote its slot (its liveness lock
    tells): the survivors get a PeerLostError naming it within the group's
    timeout (long before it: the lock is tested every few milliseconds),
    and the references handed to it are given back at once: the directory
    is empty within seconds."""
    res = run_group(rank_killed, 3, 63, 2, 0, timeout=100, killed=(2,))
    for r in (0, 1):
        assert res[r]["raised"] == "PeerLostError" and res[r]["runtime"], res[r]
        assert res[r]["ranks"] == [2], res[r]
        assert res[r]["s"] < GROUP_TIMEOUT_S / 2, res[r]
        assert res[r]["rounds"] == 2, res[r]
    assert len(res[0]["names"]) == 4
    assert res[0]["left"] == [] and res[0]["waited"] < 3.0, res[0]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_source_killed_before_the_result(shm_dir):
    """The source (group rank 1; rank 0 hosts the store) SIGKILLed after its
    broadcast, before it read any slot: both receivers get a PeerLostError
    within the group's timeout (its lock is gone); the segments it made are
    reclaimed by the reaper's first pass (their creator was killed), and
    nothing else is left."""
    res = run_group(rank_killed, 3, 64, 1, 1, timeout=100, killed=(1,))
    for r in (0, 2):
        assert res[r]["raised"] == "PeerLostError" and res[r]["runtime"], res[r]
        assert res[r]["s"] < GROUP_TIMEOUT_S, res[r]
        assert "source" in res[r]["message"], res[r]
    from mmshm.segments.reaper import reap

    reap(shm_dir, grace_s=0)
    assert os.listdir(shm_dir) == []


# -- the agreement file removed or changed ------------------------------------------------
def rank_file_fault(rank: int, world: int, seed: int, fault: str) -> dict:
    """The source (group rank 0) makes the agreement file, then removes it
    (``gone``) or overwrites its header (``corrupt``) before the other ranks
    open it; four broadcasts."""
    import logging

    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    if rank == 0:
        real = shmagree.ShmAgreement._create

        def create_then_break(self):
            real(self)
            if fault == "gone":
                os.unlink(self.path)
            else:
                with open(self.path, "r+b") as f:
                    f.write(b"NOTOURS!")

        shmagree.ShmAgreement._create = create_then_break
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                said.append(record.getMessage())

    logging.getLogger("mmshm").addHandler(Keep())
    calls = _count_agreement_messages()
    _broadcast_rounds(rank, world, seed, 4, group)
    dist.barrier(group=group)
    agr = _agr(group)
    return {"stage": agr.stage, "fd": agr.fd, "calls": calls, "said": said,
            "files": sorted(os.listdir(seg_dir()))}


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", ["gone", "corrupt"])
def test_agreement_file_gone_or_changed_keeps_gloo(shm_dir, fault):
    """The agreement file removed, or its header overwritten, before the
    other ranks open it: they say so at WARNING, the probe tells every rank
    alike, and the group keeps the gloo agreement (every broadcast right,
    its messages counted), nothing left behind."""
    res = run_group(rank_file_fault, 3, 65, fault, timeout=120)
    for r in range(3):
        assert res[r]["stage"] == "off" and res[r]["fd"] is None, res[r]
        assert res[r]["calls"] == {"agree": 4 * (4 if r == 0 else 2)}, res[r]
        assert res[r]["files"] == [], res[r]
    for r in (1, 2):
        assert any("cannot open the group's shared-memory failure agreement file" in m
                   for m in res[r]["said"]), res[r]
    assert os.listdir(shm_dir) == []


# -- across nodes: the gloo agreement -----------------------------------------------------
def rank_two_nodes(rank: int, world: int, base: str, seed: int) -> dict:
    node.simulate(base, rank * 2 // world)
    calls = _count_agreement_messages()
    _broadcast_rounds(rank, world, seed, 2)
    import torch.distributed as dist

    dist.barrier()
    return {"calls": calls, "shm": shmagree._GROUPS.get(id(dist.group.WORLD)),
            "single": topology.layout().single}


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_simulated_nodes_keep_the_gloo_agreement(shm_dir):
    """Four ranks on two simulated nodes (node.simulate): no shared-memory
    agreement is made, and every round's agreement goes over gloo."""
    res = run_group(rank_two_nodes, 4, shm_dir, 66, timeout=150)
    for r in range(4):
        assert res[r]["single"] is False and res[r]["shm"] is None, res[r]
        assert res[r]["calls"]["agree"] == (2 * 3 * 2 if r == 0 else 2 * 2), res[r]
    for k in range(2):
        assert segment_files(node.simulated_dir(shm_dir, k)) == []


# -- a file left by processes all killed inside the first round ------------------------
def _make_and_die(directory: str) -> None:
    os.environ["MMSHM_DIR"] = directory
    agr = shmagree.ShmAgreement(2, 0, [topology.process_id(), topology.process_id()], 5.0, directory,
                                "group|2")
    agr.path = agr._path_for(0)
    agr._create()
    os.kill(os.getpid(), signal.SIGKILL)


def test_reaper_reclaims_a_file_whose_ranks_were_killed(shm_dir):
    """Every rank killed inside the setup round (before the source unlinks
    the file): the name is a segment name nobody holds, and the reaper's first
    pass reclaims it as ``killed``."""
    p = spawn(_make_and_die, shm_dir)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    left = os.listdir(shm_dir)
    assert len(left) == 1 and left[0].startswith(f"mmshm-{p.pid}-"), left
    from mmshm.segments.reaper import reap

    rep = reap(shm_dir)
    assert {k: v for k, v in rep.reasons.items() if v} == {"killed": 1}, rep
    assert os.listdir(shm_dir) == []


def test_decision_is_the_layouts(shm_dir, monkeypatch):
    """No group, several nodes or no process ids: no shared-memory agreement."""
    lay = topology.Layout.from_identities(["a", "b"], procs=[topology.process_id()] * 2)
    assert shmagree.for_group(None, 2, 0, lay) is None  # not initialized / two nodes
    assert shmagree.for_group(None, 2, 0, None) is None
    assert shmagree.usable() == (os.uname().machine == "x86_64")


# -- ranks that the layout calls one node but that do not share a directory ------------
def rank_disagree(rank: int, world: int, seed: int, dirs: list) -> dict:
    calls = _count_agreement_messages()
    res = children.rank_wrong_dir(rank, world, seed, dirs)
    agr = _agr()
    res.update(calls=calls, stage=agr.stage, fd=agr.fd)
    return res


def test_ranks_that_do_not_share_a_directory_keep_gloo(shm_dir, monkeypatch):
    """The layout calls both ranks one node (MMSHM_NODE_ID, same facts), but
    rank 1 looks in another directory: it cannot open the agreement file,
    says so, and the probe makes both ranks keep the gloo agreement; the
    request that rank 1 cannot open fails alike on both, nothing is left."""
    import secrets
    import shutil

    monkeypatch.setenv("MMSHM_NODE_ID", "7")
    other = os.path.join(SHM_ROOT, f"pytest-mmshm-other-{secrets.token_hex(4)}")
    os.mkdir(other, 0o700)
    try:
        res = run_group(rank_disagree, 2, 67, [shm_dir, other], timeout=120)
        for r in range(2):
            assert res[r]["errors"] == {0: ("not_found", [1])}, res[r]
            assert res[r]["stage"] == "off" and res[r]["fd"] is None, res[r]
            assert res[r]["calls"] == {"agree": 2}, res[r]
        assert os.listdir(other) == []
        assert os.listdir(shm_dir) == []
    finally:
        shutil.rmtree(other, ignore_errors=True)


# -- fan-out copies that add no net reference still set the shared memory up ------------
def rank_fanned_out(rank: int, world: int, seed: int) -> dict:
    """Three broadcasts of one request fanned out into ``world`` copies: the
    copies collapse onto one handle per segment for the ``world - 1``
    receivers, so the batch adds no net reference, yet it carries handles."""
    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    for rnd in range(3):
        reqs = (mmshm.fan_out(mmshm.wrap(children.request(0, seed + rnd), min_bytes=1024), world)
                if rank == 0 else None)
        out = bcast(reqs, rank, None, 0)
        assert len(out) == world
        for r in out:
            children.check_request(r, 0, seed + rnd)
        del out, reqs, r
        gc.collect()
    import torch.distributed as dist

    dist.barrier()
    return {"stage": _agr().stage, "rounds": _rounds(), "files": sorted(os.listdir(seg_dir()))}


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_fan_out_copies_that_add_no_reference_set_the_agreement_up(shm_dir):
    """Before the fix the source made the agreement file only when the batch
    added references, so the receivers of a fanned-out batch found no file,
    said so at WARNING and agreed over gloo at every broadcast."""
    res = run_group(rank_fanned_out, 3, 71, timeout=150)
    for r in range(3):
        assert res[r]["stage"] == "on", res[r]
        assert res[r]["rounds"] == 2, res[r]
        assert res[r]["files"] == [], res[r]
    assert os.listdir(shm_dir) == []
