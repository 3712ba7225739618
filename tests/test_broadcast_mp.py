"""Multi-process: the TP broadcast (gloo on 127.0.0.1) with deferred unwrap,
the early-unlink race without barriers, per-request failures, and hand-overs
of pickled handles between plain processes."""

from __future__ import annotations

import gc
import os
import pickle
import secrets
import shutil

import mmshm
import pytest
import torch

from tests.harness.procs import collect, run_children, run_group, signal_name, spawn, spawn_ctx, stop_all
from tests.harness.segments import SHM_ROOT, refcount, segment_files
from tests.harness.metrics import metric
from tests.harness.tensors import make_tensor
from tests.harness import children

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


@pytest.mark.parametrize("world", [2, 4])
def test_tp_broadcast_bytes_correct_on_every_rank(shm_dir, world):
    res = run_group(children.rank_broadcast, world, 4, 11)
    names = res[0]["names"]
    assert len(names) == 6  # requests 0..3 carry 1, 2, 1, 2 items
    # while every rank held its views, each segment had one reference per rank and
    # handle (a request's items share one segment)
    assert len(set(names)) == 4 and res[0]["counts"] == [world * names.count(n) for n in names]
    # the source rank counts the references it handed out, one per segment and reader
    assert res[0]["handed"] == (world - 1) * len(names)
    assert segment_files() == []


def test_early_unlink_race_without_barrier(shm_dir):
    """Rank 0 materializes (copy=True: released at once) while rank 1 sleeps
    300 ms and opens only after rank 0's release is visible in the header."""
    res = run_group(children.rank_early_unlink, 2, 12, 0.3)
    names = res[0]["names"]
    assert len(names) == 4  # requests 0..2 carry 1, 2, 1 items
    # rank 1 opened the segments after rank 0 had given its reference back:
    # only the reference handed out for rank 1 kept them alive
    assert res[1]["count_seen"] == [names.count(n) for n in names]
    assert segment_files() == []


def test_per_request_failures_are_identical_on_every_rank(shm_dir):
    world = 3
    res = run_group(children.rank_failures, world, 13, 1)
    expected = {
        1: ("not_found", list(range(world))),  # its segment does not exist anywhere
        4: ("malformed", [1]),                 # broken on rank 1 only
    }
    for rank in range(world):
        assert res[rank]["errors"] == expected, (rank, res[rank]["errors"])
    assert len(res[0]["names"]) == 3  # requests 0, 2 and 4 carry one item each
    assert segment_files() == []


def test_rank_that_cannot_see_the_segments_does_not_leak(shm_dir, monkeypatch):
    """Rank 1 looks in another directory (a different tmpfs, or node): its
    request fails on every rank, the inline request is fine, nothing leaks."""
    # told that both ranks are on one node (otherwise the multi-node path would
    # carry the payload across: tests/test_multinode.py)
    monkeypatch.setenv("MMSHM_NODE_ID", "7")
    other = os.path.join(SHM_ROOT, f"pytest-mmshm-other-{secrets.token_hex(4)}")
    os.mkdir(other, 0o700)
    try:
        res = run_group(children.rank_wrong_dir, 2, 14, [shm_dir, other])
        for rank in range(2):
            assert res[rank]["errors"] == {0: ("not_found", [1])}, res
        assert segment_files(other) == []
        assert segment_files() == []  # the references handed out for rank 1 came back
    finally:
        for n in segment_files():
            os.unlink(os.path.join(shm_dir, n))
        shutil.rmtree(other, ignore_errors=True)


def test_share_three_pickle_once_open_in_three_processes(shm_dir):
    shape, seed = (300, 500), 15
    t = make_tensor(seed, shape, torch.float16)
    h = mmshm.ShmTensor.from_tensor(t)
    name = h.name
    h.share(3)
    blob = pickle.dumps(h)
    assert refcount(name) == 4
    # each process also adds and drops 300 references, all at the same time:
    # the locked count must come out exact
    res = run_children(children.open_pickled, [(blob, seed, shape, "float16", 300)] * 3)
    assert [r["name"] for r in res] == [name] * 3
    assert [r["ok"] for r in res] == [True] * 3
    assert refcount(name) == 1  # every process gave its reference back
    assert segment_files() == [name]
    del h
    gc.collect()
    assert segment_files() == []


def test_chain_of_hand_overs_through_three_processes(shm_dir):
    shape, seed = (256, 1024), 16
    t = make_tensor(seed, shape)
    created = metric("mmshm_segments_created_total")
    h = mmshm.ShmTensor.from_tensor(t)
    name = h.name
    assert metric("mmshm_segments_created_total") - created == 1
    c = spawn_ctx()
    q01, q12, q23, resq = c.Queue(), c.Queue(), c.Queue(), c.Queue()
    procs = [spawn(children.chain_stage, q01, q12, resq, 1, seed, shape, "float32"),
             spawn(children.chain_stage, q12, q23, resq, 2, seed, shape, "float32"),
             spawn(children.chain_stage, q23, None, resq, 3, seed, shape, "float32")]
    try:
        h.share(1)  # hand out before handing over
        q01.put(pickle.dumps(h))
        del h  # the parent drops its own
        gc.collect()
        res = dict(collect(resq, 3, 90, procs))
    finally:
        stop_all(procs)
    for p in procs:
        assert p.exitcode == 0, signal_name(p.exitcode)
    for stage in (1, 2, 3):
        info = res[stage]
        assert info["name"] == name, (stage, info)  # same segment end to end
        assert info["files"] == [name], (stage, info)  # never re-created or copied
        assert info["created"] == 0 and info["created_at_end"] == 0, (stage, info)
    for stage in (1, 2):
        # own + the one handed out, + earlier holders that have not dropped theirs yet
        assert 2 <= res[stage]["count_after_share"] <= 2 + stage, res[stage]
    assert res[3]["ok"] is True
    assert res[3]["count_before_materialize"] >= 1
    assert res[3]["handle_owns"] is False
    assert metric("mmshm_segments_created_total") - created == 1
    assert segment_files() == []


def test_requests_sharing_handle_objects(shm_dir):
    """copy.copy'd requests in one batch share their mm_items' handle objects:
    both must arrive on every rank, and nothing may leak."""
    try:
        res = run_group(children.rank_shared_handles, 2, 17)
        for rank in range(2):
            assert res[rank]["kinds"] == ["dict", "dict"], (rank, res[rank])
        assert segment_files() == []
    finally:
        for n in segment_files():
            os.unlink(os.path.join(shm_dir, n))


@pytest.mark.timeout(120)
def test_fanout_copies_share_one_mapping_per_rank(shm_dir):
    """n=4 copies of a 2-image request in one batch, TP=2: every rank maps each
    image once (RSS grows by the payload once), every copy gets its own
    tensor object over it with the right bytes, each rank's mapping holds
    exactly one reference, a write stays on its rank, and nothing leaks."""
    n, world = 4, 2
    try:
        res = run_group(children.rank_fanout_one_mapping, world, 23, n)
        for rank in range(world):
            r = res[rank]
            assert r["tensors"] == n * 2, r
            for j in range(2):  # copy i's item j: one address for all copies
                assert len({p[j] for p in r["ptrs"]}) == 1, r["ptrs"]
            # the request's two images share one segment: one copy-on-write view per
            # image (rank 0 made the segment: + its writable map)
            want = 2 + (rank == 0)
            assert len(r["maps"]) == 1 and set(r["maps"].values()) == {want}, (rank, r["maps"])
            # both ranks' views are alive when each rank counts (agreement);
            # rank 0 may count before or after rank 1 has dropped its views
            assert all(2 <= c <= 2 * world for c in r["refs"].values()), r["refs"]
            assert r["seen"] == [True] * n  # aliasing within the rank
        assert segment_files() == []
    finally:
        for name in segment_files():
            os.unlink(os.path.join(shm_dir, name))


def test_tp_subgroups_broadcast_and_agree_within_their_group(shm_dir):
    """DP=2 x TP=2: the deferred unwrap runs on each TP subgroup with global
    source ranks 0 and 2; a failure on global rank 3 fails that request on
    both of its group's ranks (and names group rank 1) and nowhere else."""
    res = run_group(children.rank_subgroups, 4, 31, timeout=120)
    assert res[0]["failures"] == res[1]["failures"] == []
    assert res[2]["failures"] == res[3]["failures"] == [(0, 0, "malformed", [1])]
    assert segment_files() == []
