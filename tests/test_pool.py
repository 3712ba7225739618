"""The warm segment pool: reuse, generations, trimming, owner exit, SIGKILL."""

from __future__ import annotations

import gc
import os
import pickle
import signal

import pytest
import torch

import mmshm
from mmshm import config
from mmshm.segments import reaper, segfile, table
from mmshm.segments.table import TABLE
from mmshm.errors import SegmentNotFoundError

from tests.harness.procs import run_child, spawn_ctx
from tests.harness.segments import header, refcount, segment_files
from tests.harness.metrics import metric
from tests.harness.shm import run_script

MiB = 1 << 20


def _hits() -> float:
    return metric("mmshm_pool_requests_total", result="hit")


def test_released_segment_returns_to_the_pool_and_is_reused(pool):
    a = mmshm.ShmTensor.from_tensor(torch.full((MiB,), 1.0))
    name = a.name
    a.release()
    assert segment_files() == [name]  # pooled, not unlinked
    assert header(name)[2] == segfile.STATE_POOLED
    hits = _hits()
    b = mmshm.ShmTensor.from_tensor(torch.full((MiB,), 2.0))
    assert b.name == name and b.meta.gen == 1
    assert _hits() - hits == 1
    assert torch.equal(b.materialize(copy=True), torch.full((MiB,), 2.0))
    assert segment_files() == [name]


def test_size_classes_bound_the_slack():
    for n in (1, 4096, 65536, 22503936, 4784 * 1176 * 4 + 4096, 3 << 30):
        c = table.size_class(n)
        assert c >= n and (c - n) <= max(4095, n // 8)


def test_size_classes_keep_the_slack_below_an_eighth_as_documented():
    """Before size classes, an 8 MiB tensor took a 10 MiB segment (25% slack)."""
    hdr = segfile.HEADER_SIZE
    assert table.size_class(8 * MiB + hdr) == 9 * MiB
    assert table.size_class(90_000_000 + hdr) == 88 * MiB
    worst = 0.0
    for k in range(17, 33):  # every class boundary from 64 KiB to 4 GiB, and around it
        for n in (1 << k, (1 << k) + 1, (1 << k) + hdr, (3 << k) // 2 + 1, (2 << k) - 1):
            c = table.size_class(n)
            assert c >= n and c % 4096 == 0
            worst = max(worst, (c - n) / n)
    assert 0.12 < worst < 0.125
    assert len({table.size_class(n) for n in range((1 << 24) + 1, (1 << 25) + 1, 4096)}) == 8


@pytest.mark.fault
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("size", "tensor", "count", "reserve"), [
    ("64m", 8 * MiB, 7, "0"),              # Docker's default /dev/shm, no reserve
    ("300m", 90_000_000, 3, "-"),         # the default reserve (15 MiB)
])
def test_a_small_tmpfs_holds_as_many_pooled_tensors_as_the_slack_allows(size, tensor, count,
                                                                         reserve):
    res = run_script("pool_fit", str(tensor), str(count), reserve, size=size, timeout=110)
    assert (res["shm"], res["inline"]) == (count, 0), res
    assert sum(res["fallbacks"].values()) == 0 and res["bytes_equal"]
    assert res["left"] == []


def test_a_materialized_view_never_changes_while_the_pool_is_reused_around_it(pool):
    first = torch.arange(MiB, dtype=torch.float32)
    h = mmshm.ShmTensor.from_tensor(first)
    name = h.name
    h.share(1)
    remote = pickle.loads(pickle.dumps(h))  # a second holder, as a receiver would
    h.release()
    view = remote.materialize()  # holds the last reference
    names = set()
    for i in range(20):  # later requests churn the pool of the same size class
        x = mmshm.ShmTensor.from_tensor(torch.full((MiB,), float(i)))
        names.add(x.name)
        x.release()
    assert name not in names  # never handed out while the view lives
    assert torch.equal(view, first)
    del view
    gc.collect()
    y = mmshm.ShmTensor.from_tensor(torch.zeros(MiB))
    assert y.name in names | {name}  # and it came back once the view was gone
    y.release()


def test_a_stale_handle_cannot_read_a_reused_segment(pool):
    h = mmshm.ShmTensor.from_tensor(torch.ones(MiB))
    stale = mmshm.ShmTensor(h.meta, owns=True)  # a protocol violation: no share()
    h.release()
    again = mmshm.ShmTensor.from_tensor(torch.full((MiB,), 7.0))
    assert again.name == h.name and again.meta.gen == h.meta.gen + 1
    with pytest.raises(SegmentNotFoundError):
        stale.materialize()
    with pytest.raises(SegmentNotFoundError):
        stale.share(1)
    stale.disown()
    assert refcount(again.name) == 1  # the stale handle touched nothing
    again.release()


def test_idle_segments_are_trimmed(pool, monkeypatch):
    h = mmshm.ShmTensor.from_tensor(torch.ones(MiB))
    h.release()
    assert len(segment_files()) == 1
    monkeypatch.setenv("MMSHM_POOL_IDLE_S", "0")
    config.reload()
    TABLE.sweep()  # first sweep stamps idle_since, idle 0 s: gone
    assert segment_files() == []
    assert TABLE.names() == []


def test_pool_respects_its_byte_cap(pool, monkeypatch):
    monkeypatch.setenv("MMSHM_POOL_MAX_BYTES", str(3 * MiB))
    config.reload()
    hs = [mmshm.ShmTensor.from_tensor(torch.ones(MiB // 16 * 3)) for _ in range(4)]  # 0.75 MiB
    for h in hs:
        h.release()
    TABLE.sweep()
    kept = segment_files()
    assert 1 <= len(kept) <= 3
    assert sum(os.path.getsize(os.path.join(pool, n)) for n in kept) <= 3 * MiB


def test_budget_guard_trims_the_pool_before_falling_back(pool, monkeypatch):
    h = mmshm.ShmTensor.from_tensor(torch.ones(MiB))  # 4 MiB class with header
    h.release()
    assert len(segment_files()) == 1
    monkeypatch.setenv("MMSHM_MAX_BYTES", str(5 * MiB))
    config.reload()
    before = metric("mmshm_inline_fallbacks_total", reason="budget")
    big = torch.ones(2 * MiB)  # an 8 MiB+ class: does not fit beside the pooled one
    w = mmshm.wrap([big], min_bytes=1)
    assert isinstance(w[0], torch.Tensor)  # over the cap even alone: inline
    assert metric("mmshm_inline_fallbacks_total", reason="budget") - before == 1
    monkeypatch.setenv("MMSHM_MAX_BYTES", str(12 * MiB))
    config.reload()
    w = mmshm.wrap([big], min_bytes=1)  # fits once the idle pooled segment is trimmed
    assert isinstance(w[0], mmshm.ShmTensor)
    assert h.name not in segment_files()
    del w
    gc.collect()


def test_fan_out_of_8_writes_the_payload_once(pool):
    t = torch.rand(512, 1024)
    written = metric("mmshm_shm_written_bytes_total")
    copies = mmshm.fan_out({"mm_items": [{"feature": t}]}, 8, min_bytes=1)
    assert metric("mmshm_shm_written_bytes_total") - written == t.numel() * 4
    views = [mmshm.unwrap(c)["mm_items"][0]["feature"] for c in copies]
    assert all(torch.equal(v, t) for v in views)
    del copies, views
    gc.collect()


def _owner_then_exit(d, q):
    _mp_use(d)
    h = mmshm.ShmTensor.from_tensor(torch.ones(MiB))
    h.share(1)
    q.put(pickle.dumps(h))  # one reference travels to the parent
    p = mmshm.ShmTensor.from_tensor(torch.ones(MiB // 2))
    q.put(p.name)
    p.release()  # pooled in this process
    h.release()


def _mp_use(d):
    os.environ.update({"MMSHM_DIR": d, "MMSHM_POOL": "1", "MMSHM_REAP_INTERVAL_S": "0"})
    config.reload()


@pytest.mark.timeout(120)
def test_owner_exit_unlinks_its_pool_and_hands_live_segments_to_their_last_release(pool):
    c = spawn_ctx()
    q = c.Queue()
    p = c.Process(target=_owner_then_exit, args=(pool, q))
    p.start()
    blob, pooled = q.get(timeout=60), q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert pooled not in segment_files()  # the owner emptied its pool on the way out
    h = pickle.loads(blob)
    assert torch.equal(h.materialize(copy=True), torch.ones(MiB))  # released: last ref
    assert segment_files() == []  # owner gone: the last release unlinked, no pool


def _owner_killed(d, conn):
    _mp_use(d)
    h = mmshm.ShmTensor.from_tensor(torch.ones(MiB))
    h.release()  # pooled
    conn.send(h.name)  # a pipe sends synchronously (a Queue's feeder thread might not)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_sigkilled_owners_pool_is_reclaimed_by_the_reaper(pool):
    c = spawn_ctx()
    a, b = c.Pipe()
    p = c.Process(target=_owner_killed, args=(pool, b))
    p.start()
    assert a.poll(60)
    name = a.recv()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    assert segment_files() == [name]
    rep = reaper.reap(pool)
    assert rep.names == [name]
    assert segment_files() == []


# -- a pooled file truncated by a third party ------------------------------------------------
def _truncated_then_reused(d: str, cut: int) -> dict:
    """In a child (a SIGBUS kills only it): pool one 1 MiB segment, truncate
    its file to ``cut`` bytes, then make a tensor of the same size class."""
    import logging

    from prometheus_client import REGISTRY

    _mp_use(d)
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    logging.getLogger("mmshm").addHandler(_Keep())
    h = mmshm.ShmTensor.from_tensor(torch.full((MiB,), 1.0))
    name = h.name
    h.release()
    path = os.path.join(d, name)
    os.truncate(path, cut)
    x = torch.arange(MiB, dtype=torch.float32)
    g = mmshm.ShmTensor.from_tensor(x)  # the pool's only segment of that class is short
    y = torch.arange(MiB, dtype=torch.float32) * 2
    k = mmshm.ShmTensor.from_tensor(y)  # a second one: nothing said or counted again
    out = {"old": name, "new": g.name, "old_exists": os.path.exists(path),
           "equal": bool(torch.equal(g.materialize(copy=True), x))
           and bool(torch.equal(k.materialize(copy=True), y)),
           "dropped": REGISTRY.get_sample_value("mmshm_pool_dropped_total",
                                                {"reason": "truncated"}),
           "warnings": [m for m in records if "truncated" in m]}
    return out


@pytest.mark.fault
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cut", [segfile.HEADER_SIZE + 8192, segfile.HEADER_SIZE + MiB])
def test_a_pooled_segment_truncated_by_a_third_party_is_dropped_never_written(pool, cut):
    """A tmpfs cleaner or an operator shortened an idle pooled file (header
    intact, payload short): the next tensor of its size class must not be
    written through the creator's mapping (SIGBUS); the file is unlinked,
    counted once, said once at WARNING, and the new tensor's bytes are right."""
    res, code = run_child(_truncated_then_reused, pool, cut, timeout=100)
    assert code == 0, f"the producer died: exit code {code} (-7: SIGBUS)"
    assert res["equal"], res
    assert res["new"] != res["old"] and not res["old_exists"], res
    assert res["dropped"] == 1.0, res
    assert len(res["warnings"]) == 1 and "MMSHM_DIR" in res["warnings"][0], res
    assert segment_files() == []


def test_the_sweep_drops_an_idle_segment_truncated_by_a_third_party(pool):
    h = mmshm.ShmTensor.from_tensor(torch.ones(MiB))
    h.release()
    dropped = metric("mmshm_pool_dropped_total", reason="truncated")
    os.truncate(os.path.join(pool, h.name), segfile.HEADER_SIZE + 4096)
    TABLE.sweep()
    assert segment_files() == [] and h.name not in TABLE.names()
    assert metric("mmshm_pool_dropped_total", reason="truncated") - dropped == 1


# -- best fit: a larger idle segment serves a smaller tensor --------------------------------
def test_an_idle_segment_up_to_four_times_the_size_serves_a_smaller_tensor(pool):
    big = mmshm.ShmTensor.from_tensor(torch.ones(MiB))  # 4 MiB + header
    name = big.name
    big.release()
    hits = _hits()
    t = torch.arange(300 * 1024, dtype=torch.float32)  # 1.17 MiB: within 4x
    h = mmshm.ShmTensor.from_tensor(t)
    assert h.name == name and _hits() - hits == 1
    assert h.nbytes == t.numel() * 4
    # every consumer sees the tensor's bytes only, never the slack behind them
    remote = pickle.loads(pickle.dumps(h.share(1) or h))
    view = remote.materialize()
    assert view.shape == t.shape and torch.equal(view, t)
    copied = h.materialize(copy=True)
    assert copied.shape == t.shape and torch.equal(copied, t)
    del view
    gc.collect()
    small = mmshm.ShmTensor.from_tensor(torch.ones(128 * 1024))  # 0.5 MiB: beyond 4x, a miss
    assert small.name != name and _hits() - hits == 1
    small.release()


def test_best_fit_takes_the_smallest_idle_segment_that_holds_the_tensor(pool):
    a = mmshm.ShmTensor.from_tensor(torch.ones(3 * MiB // 4))  # 3 MiB class
    b = mmshm.ShmTensor.from_tensor(torch.ones(MiB))  # 4 MiB class
    c = mmshm.ShmTensor.from_tensor(torch.ones(3 * MiB // 2))  # 6 MiB class
    names = (a.name, b.name, c.name)
    for x in (c, a, b):
        x.release()
    t = torch.full(((3 * MiB + 300 * 1024) // 4,), 5.0)  # above the first one's size class
    h = mmshm.ShmTensor.from_tensor(t)
    got = h.name
    assert torch.equal(h.materialize(copy=True), t)
    assert got == names[1]  # the 4 MiB one, not the larger 6 MiB one


def test_the_exact_size_class_rule_misses_where_best_fit_hits(pool, monkeypatch):
    """The rule before (a segment only at its size class) is FIT_RATIO 1:
    the same sequence misses."""
    monkeypatch.setattr(table, "FIT_RATIO", 1.0)
    big = mmshm.ShmTensor.from_tensor(torch.ones(MiB))
    big.release()
    h = mmshm.ShmTensor.from_tensor(torch.ones(600 * 1024))
    assert h.name != big.name
    h.release()


def test_an_idle_arena_segment_of_any_larger_size_serves_and_its_views_stop_at_the_tensor(
        pool, monkeypatch):
    """Arena segments are reused whatever their size (the arena bounds the
    waste): no eviction, no new mapping; the consumer's view from the
    persistent mapping is the tensor's bytes only."""
    from mmshm.segments import arena

    monkeypatch.setenv("MMSHM_ARENA_BYTES", str(64 * MiB))
    config.reload()
    big = mmshm.ShmTensor.from_tensor(torch.ones(4 * MiB))  # 16 MiB + header
    name = big.name
    big.release()
    hits = _hits()
    t = torch.arange(MiB // 2, dtype=torch.float32)  # 2 MiB: an eighth of the segment
    h = mmshm.ShmTensor.from_tensor(t)
    assert h.name == name and _hits() - hits == 1
    h.share(1)
    remote = pickle.loads(pickle.dumps(h))
    h.release()
    view = remote.materialize()  # through this process's persistent arena mapping
    assert view.shape == t.shape and torch.equal(view, t)
    assert view.untyped_storage().nbytes() == t.numel() * 4  # nothing past the tensor
    assert arena.VIEWS.status()["mappings"] == 1
    del view
    gc.collect()
