"""The arena (mmshm.segments.arena): segments each consumer maps once and registers once.

The producer is this test process; the consumers are spawned processes with a
:class:`~tests.harness.registrar.FakeRegistrar` (no CUDA here) that records every
registration. Bytes are compared in the consumer, registrations counted there,
and segments looked at in the private segment directory.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import threading

import pytest
import torch

import mmshm
from mmshm import config
from mmshm.errors import SegmentNotFoundError
from mmshm.segments import arena, reaper, segfile
from mmshm.segments.table import TABLE

from tests.harness.metrics import metric
from tests.harness.registrar import FakeRegistrar
from tests.harness.procs import join, recv, spawn_ctx, track
from tests.harness.segments import header, segment_files

MiB = 1 << 20


def _flags(name: str) -> int:
    return header(name)[8]


def _photo(seed: int, n: int = MiB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n // 4, generator=g)


# -- the consumer: a spawned process ---------------------------------------------------
def _consumer(conn, fail: str | None, write: bool) -> None:
    """Materialize each handle it is sent, check its bytes, optionally write
    into it, drop it, and report what the registrar saw."""
    from mmshm.segments import arena as a

    fake = FakeRegistrar(fail=fail)
    a.set_registrar(fake)
    seen = []
    while True:
        msg = conn.recv()
        if msg is None:
            break
        blob, seed, n = msg
        h = pickle.loads(blob)
        t = h.materialize()
        ok = torch.equal(t, _photo(seed, n))
        if write:
            t.fill_(-1.0)  # a write in place: private to this process
        addr = t.data_ptr()
        del t, h
        gc.collect()
        a.VIEWS.settled()
        seen.append((ok, addr))
        conn.send(("done", ok))
    conn.send(("report", {"seen": seen, "registrations": fake.registrations(),
                          "calls": fake.calls, "status": a.VIEWS.status()}))


def _start_consumer(fail: str | None = None, write: bool = False):
    c = spawn_ctx()
    ours, theirs = c.Pipe()
    p = c.Process(target=_consumer, args=(theirs, fail, write), daemon=True)
    p.start()
    track(p.pid)
    return p, ours


def _send(conn, h: mmshm.ShmTensor, seed: int, n: int) -> bool:
    h.share(1)
    conn.send((pickle.dumps(h), seed, n))
    status, ok = recv(conn, 60)
    assert status == "done"
    return ok


def _finish(p, conn) -> dict:
    conn.send(None)
    status, rep = recv(conn, 60)
    assert status == "report"
    assert join(p, 30) == 0
    return rep


# -- the producer's side ---------------------------------------------------------------
def test_arena_segments_are_flagged_kept_and_reused(arena_on, monkeypatch):
    h = mmshm.ShmTensor.from_tensor(_photo(1))
    name = h.name
    assert _flags(name) & segfile.FLAG_ARENA
    h.release()
    # idle for longer than MMSHM_POOL_IDLE_S: a plain pooled segment would go
    monkeypatch.setenv("MMSHM_POOL_IDLE_S", "0")
    config.reload()
    TABLE.sweep()
    TABLE.sweep()
    assert segment_files() == [name]
    assert header(name)[2] == segfile.STATE_POOLED
    h2 = mmshm.ShmTensor.from_tensor(_photo(2))
    assert h2.name == name and h2.meta.gen == 1  # the same warm pages, the next generation
    assert torch.equal(h2.materialize(copy=True), _photo(2))
    assert TABLE.arena_bytes == segfile.HEADER_SIZE + h2.meta.nbytes + (
        TABLE.arena_bytes - segfile.HEADER_SIZE - h2.meta.nbytes)  # one segment's class
    assert len([s for s in TABLE.segments.values() if s.arena]) == 1


def test_a_full_arena_falls_back_to_plain_segments_counted(arena_on, monkeypatch):
    monkeypatch.setenv("MMSHM_ARENA_BYTES", str(3 * MiB))
    config.reload()
    full0 = metric("mmshm_arena_fallbacks_total", reason="full")
    big0 = metric("mmshm_arena_fallbacks_total", reason="too_big")
    held = [mmshm.ShmTensor.from_tensor(_photo(i)) for i in range(3)]  # ~1 MiB + header each
    flags = [_flags(h.name) & segfile.FLAG_ARENA for h in held]
    assert flags[:2] == [segfile.FLAG_ARENA] * 2 and flags[2] == 0
    assert metric("mmshm_arena_fallbacks_total", reason="full") - full0 == 1
    big = mmshm.ShmTensor.from_tensor(_photo(9, 4 * MiB))
    assert not _flags(big.name) & segfile.FLAG_ARENA
    assert metric("mmshm_arena_fallbacks_total", reason="too_big") - big0 == 1
    assert torch.equal(big.materialize(copy=True), _photo(9, 4 * MiB))
    for h in held:
        assert torch.equal(h.materialize(copy=True), _photo(held.index(h)))


def test_an_arena_of_another_size_gives_its_idle_segments_back(arena_on, monkeypatch):
    monkeypatch.setenv("MMSHM_ARENA_BYTES", str(3 * MiB))
    config.reload()
    small = [mmshm.ShmTensor.from_tensor(_photo(i)) for i in range(2)]
    names = [h.name for h in small]
    for h in small:
        h.release()
    big = mmshm.ShmTensor.from_tensor(_photo(7, 2 * MiB))
    assert _flags(big.name) & segfile.FLAG_ARENA
    assert not set(names) & set(segment_files())  # the idle small ones were given back
    big.release()


def test_over_budget_goes_inline_as_before(arena_on, monkeypatch):
    monkeypatch.setenv("MMSHM_MAX_BYTES", str(MiB // 2))
    config.reload()
    budget0 = metric("mmshm_inline_fallbacks_total", reason="budget")
    t = _photo(3)
    out = mmshm.wrap({"feature": t})
    assert out["feature"] is t  # inline
    assert metric("mmshm_inline_fallbacks_total", reason="budget") - budget0 == 1
    assert segment_files() == []


# -- the consumer's side ---------------------------------------------------------------
def test_one_consumer_registers_once_whatever_the_number_of_requests(arena_on):
    p, conn = _start_consumer()
    try:
        for i in range(6):
            h = mmshm.ShmTensor.from_tensor(_photo(10 + i))
            assert _send(conn, h, 10 + i, MiB)
            h.release()
        rep = _finish(p, conn)
    finally:
        if p.is_alive():
            p.kill()
    assert all(ok for ok, _ in rep["seen"])
    assert rep["registrations"] == 1  # one arena segment, mapped and registered once
    assert len({addr for _, addr in rep["seen"]}) == 1  # the same mapping every time
    assert [c[3] for c in rep["calls"] if c[0] == "register"] == [True]  # read-only
    assert sum(1 for c in rep["calls"] if c[0] == "settle") >= 1
    assert len([s for s in TABLE.segments.values() if s.arena]) == 1


def test_a_refused_registration_serves_unregistered_and_is_not_retried(arena_on):
    p, conn = _start_consumer(fail="memlock", write=True)
    try:
        for i in range(3):
            h = mmshm.ShmTensor.from_tensor(_photo(20 + i))
            # the consumer wrote -1 into the previous view: the next sees the new bytes
            assert _send(conn, h, 20 + i, MiB)
            h.release()
        rep = _finish(p, conn)
    finally:
        if p.is_alive():
            p.kill()
    assert rep["registrations"] == 1  # tried once, refused, not retried per request
    assert rep["status"]["registered"] == 0 and rep["status"]["mappings"] == 1
    # the producer's bytes were never touched by the consumer's writes
    h = mmshm.ShmTensor.from_tensor(_photo(5))
    assert torch.equal(h.materialize(copy=True), _photo(5))


def test_registered_views_are_held_until_the_gpu_settles(arena_on):
    """A released registered view gives its reference back only after the
    device has finished its copies (an async H2D from pinned memory)."""
    hold = threading.Event()
    fake = FakeRegistrar(hold=hold)
    arena.set_registrar(fake)
    h = mmshm.ShmTensor.from_tensor(_photo(30))
    name = h.name
    h.share(1)
    view = pickle.loads(pickle.dumps(h)).materialize()
    assert torch.equal(view, _photo(30))
    h.release()
    del view
    gc.collect()
    assert header(name)[4] == 1  # still held: the GPU has not settled
    hold.set()
    assert arena.VIEWS.settled()
    assert header(name)[4] == 0 and header(name)[2] == segfile.STATE_POOLED
    assert ("settle", (0,)) in fake.calls  # the device the mapping was made on


def test_writes_in_place_stay_private_and_are_dropped_at_release(arena_on):
    arena.set_registrar(None)  # no CUDA here: a copy-on-write view
    h = mmshm.ShmTensor.from_tensor(_photo(40))
    name = h.name
    h.share(1)
    view = pickle.loads(pickle.dumps(h)).materialize()
    view.fill_(7.0)
    assert torch.equal(h.materialize(copy=True), _photo(40))  # the segment is unchanged
    del view
    gc.collect()
    h2 = mmshm.ShmTensor.from_tensor(_photo(41))
    assert h2.name == name
    h2.share(1)
    again = pickle.loads(pickle.dumps(h2)).materialize()
    assert torch.equal(again, _photo(41))  # not the 7.0 this process wrote before
    assert arena.VIEWS.status()["mappings"] == 1
    del again
    h2.release()


_RO_SCRIPT = r"""
import os, sys, pickle, torch
os.environ["MMSHM_DIR"] = sys.argv[1]
from mmshm.segments import arena
from tests.harness.registrar import FakeRegistrar
arena.set_registrar(FakeRegistrar())
h = pickle.loads(bytes.fromhex(sys.stdin.read()))
t = h.materialize()
print("read", float(t[0]), flush=True)
t[0] = 5.0
print("wrote", flush=True)
"""


def test_a_write_into_a_registered_view_kills_only_the_writer(arena_on):
    """Registered views are read-only MAP_SHARED: a write in place is a
    SIGSEGV in the process that tries, and never reaches the bytes others read
    (documented in docs/gpu.md)."""
    import subprocess
    import sys

    h = mmshm.ShmTensor.from_tensor(_photo(50))
    h.share(1)
    blob = pickle.dumps(h).hex()
    ref = h.ref
    proc = subprocess.run([sys.executable, "-c", _RO_SCRIPT, arena_on], input=blob,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONFAULTHANDLER": ""})
    assert "read" in proc.stdout and "wrote" not in proc.stdout
    assert proc.returncode == -signal.SIGSEGV
    assert torch.equal(h.materialize(copy=True), _photo(50))
    # the dead writer's reference stays counted, as a dead rank's does on a segment
    # (reclaimed once the producer is gone too); given back by hand here
    assert header(ref.name)[4] == 1  # ours went with the copy
    ref.add(-1)


def test_a_handle_of_another_generation_is_a_stale_segment(arena_on):
    h = mmshm.ShmTensor.from_tensor(_photo(60))
    h.share(1)
    stale = pickle.loads(pickle.dumps(h))
    meta = h.meta
    h.release()
    stale.release()  # pooled now
    h2 = mmshm.ShmTensor.from_tensor(_photo(61))
    assert h2.name == meta.name and h2.meta.gen == meta.gen + 1
    old = mmshm.ShmTensor(meta, owns=True)
    with pytest.raises(SegmentNotFoundError, match="reused"):
        old.materialize()
    old.disown()
    h2.release()


def _producer_killed(d, conn):
    os.environ["MMSHM_DIR"] = d
    from mmshm import config as c

    c.reload()
    h = mmshm.ShmTensor.from_tensor(_photo(70))
    h.share(1)
    conn.send(pickle.dumps(h))
    conn.recv()  # killed here


def test_a_killed_producer_s_arena_is_reclaimed_and_consumers_let_go(arena_on):
    c = spawn_ctx()
    ours, theirs = c.Pipe()
    p = c.Process(target=_producer_killed, args=(arena_on, theirs), daemon=True)
    p.start()
    track(p.pid)
    try:
        arena.set_registrar(FakeRegistrar())
        t = pickle.loads(recv(ours, 60)).materialize()
        assert torch.equal(t, _photo(70))
        name = segment_files()[0]
        assert _flags(name) & segfile.FLAG_ARENA
        os.kill(p.pid, signal.SIGKILL)
        join(p, 10)
        del t
        gc.collect()
        assert arena.VIEWS.settled()
    finally:
        if p.is_alive():
            p.kill()
    # our reference went back; the dead producer's segment was idle in its pool or
    # unlinked by our last release: nobody holds it, the reaper takes what is left
    reaper.reap()
    assert segment_files() == []
    assert arena.VIEWS.sweep() == 1  # our mapping of it goes too
    assert arena.VIEWS.status()["mappings"] == 0


def test_the_metrics_count_registrations_and_views(arena_on):
    ok0 = metric("mmshm_arena_registrations_total", result="ok")
    yes0 = metric("mmshm_arena_views_total", registered="yes")
    arena.set_registrar(FakeRegistrar())
    h = mmshm.ShmTensor.from_tensor(_photo(80))
    for _ in range(3):
        h.share(1)
        v = pickle.loads(pickle.dumps(h)).materialize()
        del v
        gc.collect()
        assert arena.VIEWS.settled()
    assert metric("mmshm_arena_registrations_total", result="ok") - ok0 == 1
    assert metric("mmshm_arena_views_total", registered="yes") - yes0 == 3
    st = arena.status()
    assert st["bytes"] == 32 * MiB and st["registration"] == "registered"
    assert st["in_use_bytes"] > 0
    h.release()
    TABLE.sweep()
    assert arena.status()["in_use_bytes"] == 0


def test_arena_is_off_by_default_without_cuda(shm_dir, monkeypatch):
    monkeypatch.setenv("MMSHM_POOL", "1")
    config.reload()
    h = mmshm.ShmTensor.from_tensor(_photo(90))
    assert not _flags(h.name) & segfile.FLAG_ARENA
    assert arena.status()["bytes"] == 0
    h.release()


def test_a_refused_registration_is_said_once_at_warning_and_not_retried_per_mapping(
        arena_on, caplog, monkeypatch):
    """One WARNING with CUDA's own error name and text (no memlock advice: that
    is not measured), one refusal counted, and the next new mapping is served
    unregistered without asking CUDA again."""
    monkeypatch.setattr(arena, "_warned", set())
    fake = FakeRegistrar(fail="memlock")
    arena.set_registrar(fake)
    failed0 = metric("mmshm_arena_registrations_total", result="failed")
    hs = [mmshm.ShmTensor.from_tensor(_photo(100 + i)) for i in range(3)]  # three segments
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        for i, h in enumerate(hs):
            h.share(1)
            v = pickle.loads(pickle.dumps(h)).materialize()
            assert torch.equal(v, _photo(100 + i))
            del v
            gc.collect()
    warnings = [r for r in caplog.records if "refused to register" in r.getMessage()]
    assert len(warnings) == 1
    said = warnings[0].getMessage()
    assert "cudaErrorMemoryAllocation: out of memory" in said and "fix:" in said
    assert "--ulimit memlock" not in said
    assert fake.registrations() == 1  # three new mappings, CUDA asked once
    assert metric("mmshm_arena_registrations_total", result="failed") - failed0 == 1
    st = arena.VIEWS.status()
    assert st["mappings"] == 3 and st["registered"] == 0
    assert arena.status()["registration"] == "failed" and arena.refused()
    # after REFUSAL_RETRY_S, CUDA is asked again (once)
    monkeypatch.setattr(arena, "_refused_until", 0.0)
    h = mmshm.ShmTensor.from_tensor(_photo(104, 2 * MiB))
    h.share(1)
    v = pickle.loads(pickle.dumps(h)).materialize()
    assert fake.registrations() == 2
    del v
    gc.collect()
    h.release()
    for h in hs:
        h.release()


def test_the_arena_is_preferred_to_plain_segments_pooled_while_it_was_full(arena_on,
                                                                           monkeypatch):
    monkeypatch.setenv("MMSHM_ARENA_BYTES", "0")
    config.reload()
    plain = mmshm.ShmTensor.from_tensor(_photo(110))
    plain_name = plain.name
    plain.release()  # pooled, plain
    monkeypatch.setenv("MMSHM_ARENA_BYTES", str(32 * MiB))
    config.reload()
    a = mmshm.ShmTensor.from_tensor(_photo(111))
    assert a.name != plain_name and _flags(a.name) & segfile.FLAG_ARENA
    a.release()
    b = mmshm.ShmTensor.from_tensor(_photo(112))
    assert b.name == a.name  # the idle arena segment, not the plain one
    assert header(plain_name)[2] == segfile.STATE_POOLED
    b.release()


def test_an_arena_turned_off_by_mmshm_pool_0_is_said(shm_dir, monkeypatch, caplog):
    from mmshm.segments import segment

    monkeypatch.setattr(segment, "_arena_said", set())
    monkeypatch.setenv("MMSHM_POOL", "0")
    monkeypatch.setenv("MMSHM_ARENA_BYTES", str(32 * MiB))
    config.reload()
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        hs = [mmshm.ShmTensor.from_tensor(_photo(120 + i)) for i in range(2)]
    assert not any(_flags(h.name) & segfile.FLAG_ARENA for h in hs)
    said = [r for r in caplog.records if "MMSHM_POOL=0" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    for h in hs:
        h.release()
