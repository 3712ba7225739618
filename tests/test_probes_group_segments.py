"""Probes of one segment per request: forged and stale handles of a group, one
tensor of a group released many times, a killed consumer of a fanned-out group,
odd tensors in one group, a full tmpfs, truncation at each tensor's boundary,
and the arena's views of a group released on other threads.

Each probe asserts what the product promises: a typed error (never a crash or
another tensor's bytes), every tensor's own bytes, every reference counted
once, and the segment pooled or unlinked exactly once after its last holder.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import signal
import sys
import threading

import mmshm
import msgspec
import pytest
import torch
from mmshm import config
from mmshm.errors import HandleError, HandleStateError, SegmentCorruptError, SegmentNotFoundError
from mmshm.segments import arena, reaper, segfile
from mmshm.segments.shmtensor import ShmTensor, _rebuild, content_hash, group_layout
from mmshm.segments.table import TABLE

from tests.harness.metrics import fallbacks_total
from tests.harness.procs import run_child, spawn_ctx, track
from tests.harness.registrar import FakeRegistrar
from tests.harness.segments import header, refcount, segment_files


def _group(seed: int = 0, rows=(700, 301, 1500)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(r, 1176, generator=g) for r in rows]


def _wire(meta, **change) -> bytes:
    """The 8-element wire of ``meta`` with ``change`` applied, bypassing encode's checks."""
    m = msgspec.structs.replace(meta, **change)
    return msgspec.msgpack.encode([m.name[6:], m.nbytes, m.dtype, list(m.shape), m.hash,
                                   m.gen, m.node, m.offset])


# -- forged handles --------------------------------------------------------------------------
@pytest.mark.parametrize("offset", [
    "past_capacity", "last_tensor_plus_page", 1 << 40, (1 << 63) - 4096, (1 << 64) - 4096])
@pytest.mark.parametrize("hashed", [True, False])
def test_a_forged_offset_past_the_groups_payload_is_a_handle_error(shm_dir, offset, hashed):
    ts = _group(1)
    hs = ShmTensor.from_tensors(ts, hashes=None if hashed else [b""] * 3, hash_now=hashed)
    last = hs[-1]
    payload = header(last.name)[3]
    if offset == "past_capacity":
        offset = -(-payload // 4096) * 4096
    elif offset == "last_tensor_plus_page":
        offset = last.meta.offset + 4096
    for copy in (False, True):
        last.share(1)
        forged = _rebuild(_wire(last.meta, offset=offset))
        assert forged.error is None
        with pytest.raises(HandleError):
            forged.materialize(copy=copy)
        if not hashed:
            with pytest.raises(HandleError):
                _ = forged.hash
        forged.release()
    assert refcount(last.name) == 3
    for t, h in zip(ts, hs):
        assert torch.equal(h.materialize(copy=True), t)
    assert segment_files(shm_dir) == []


def _child_forged(blobs):
    """In a spawned consumer: materialize each forged handle, return the error type
    names (or 'ok' with the bytes' sum)."""
    out = []
    for blob in blobs:
        h = pickle.loads(blob)
        try:
            t = h.materialize(copy=False)
            out.append(("ok", float(t.double().sum())))
            del t
        except Exception as exc:  # noqa: BLE001
            out.append((type(exc).__name__, 0.0))
            h.release()
    gc.collect()
    return out


def test_forged_offsets_read_in_a_consumer_are_typed_errors(shm_dir):
    """A consumer that has the group open (a view of its first tensor) and one that
    has not: an offset past the payload is a HandleError, never a crash."""
    ts = _group(2)
    hs = ShmTensor.from_tensors(ts)
    h0 = hs[0]
    blobs = []
    h0.share(1)
    blobs.append(pickle.dumps(h0))  # a good one first: the consumer attaches the segment
    for off in (hs[-1].meta.offset + 4096, 1 << 40, (1 << 64) - 4096):
        hs[-1].share(1)
        blobs.append(_wire(hs[-1].meta, offset=off))
    forged = [_rebuild(b) for b in blobs[1:]]
    blobs = [blobs[0]] + [pickle.dumps(f) for f in forged]
    for f in forged:
        f.hand_over()  # each pickled copy owns its reference now
    res, code = run_child(_child_forged, blobs, timeout=90)
    assert code == 0
    assert res[0] == ("ok", float(ts[0].double().sum()))
    assert [r[0] for r in res[1:]] == ["HandleError"] * 3
    gc.collect()
    assert refcount(hs[0].name) == 3
    del hs, h0
    gc.collect()
    assert segment_files(shm_dir) == []


# -- stale handles -----------------------------------------------------------------------------
def _child_stale(blob):
    h = pickle.loads(blob)
    out = {}
    for copy in (False, True):
        try:
            h.materialize(copy=copy)
            out[str(copy)] = "ok"
        except Exception as exc:  # noqa: BLE001
            out[str(copy)] = type(exc).__name__
    try:
        _ = h.hash
        out["hash"] = "ok"
    except Exception as exc:  # noqa: BLE001
        out["hash"] = type(exc).__name__
    h.release()
    return out


def test_a_stale_handle_after_the_pool_reused_the_group_with_another_layout(pool):
    """Generation N's handle of the group's second tensor, after the segment went
    back to the pool and was taken by a group of another layout (generation N+1):
    every read is SegmentNotFoundError, its release does not touch the new count,
    and the new group reads its own bytes."""
    ts = _group(3, rows=(900, 333))
    hs = ShmTensor.from_tensors(ts, hashes=[b""] * 2, hash_now=False)
    name, stale_meta = hs[1].name, hs[1].meta
    del hs
    gc.collect()
    assert header(name)[2] == segfile.STATE_POOLED
    new = _group(4, rows=(100, 1100))  # another layout: the stale offset is inside tensor 1
    hs2 = ShmTensor.from_tensors(new)
    assert hs2[0].name == name and hs2[0].meta.gen != stale_meta.gen
    assert stale_meta.offset < hs2[1].meta.offset + hs2[1].meta.nbytes
    stale = ShmTensor(stale_meta)  # as if a duplicate of the old handle turned up
    for copy in (False, True):
        with pytest.raises(SegmentNotFoundError):
            stale.materialize(copy=copy)
    with pytest.raises(SegmentNotFoundError):
        _ = stale.hash
    stale.release()
    stale.release()
    assert refcount(name) == 2
    blob_owner = _rebuild(_wire(stale_meta))
    blob = pickle.dumps(blob_owner)
    blob_owner.hand_over()
    res, code = run_child(_child_stale, blob, timeout=90)
    assert code == 0 and res == {"False": "SegmentNotFoundError", "True": "SegmentNotFoundError",
                                 "hash": "SegmentNotFoundError"}
    assert refcount(name) == 2
    for t, h in zip(new, hs2):
        assert h.hash == content_hash(t)
        assert torch.equal(h.materialize(copy=True), t)


def test_an_old_seven_element_handle_of_a_grouped_tensor_reads_the_first_tensors_bytes(shm_dir):
    """A wire array without the offset says offset 0: for a grouped tensor that
    is the first tensor's place. With the hash carried, the bytes read there do
    not hash to it: the mismatch is visible (the product does not check it on
    read; what it promises is that a 7-element handle is offset 0)."""
    ts = [torch.rand(100, 1176), torch.rand(100, 1176)]
    hs = ShmTensor.from_tensors(ts, hash_now=True)
    m = hs[1].meta
    hs[1].share(1)
    old = msgspec.msgpack.encode([m.name[6:], m.nbytes, m.dtype, list(m.shape), m.hash, m.gen,
                                  m.node])
    h = ShmTensor.decode(old)
    assert h.meta.offset == 0
    got = h.materialize(copy=True)
    assert torch.equal(got, ts[0]) and content_hash(got) != m.hash


# -- one tensor released many times -------------------------------------------------------------
def test_one_tensor_released_and_materialized_many_times_pools_the_group_once(pool):
    ts = _group(5)
    hs = ShmTensor.from_tensors(ts)
    name = hs[0].name
    for _ in range(5):
        hs[0].release()
    with pytest.raises(HandleStateError):
        hs[0].materialize()
    with pytest.raises(HandleStateError):
        hs[0].share(1)
    assert refcount(name) == 2 and header(name)[2] == segfile.STATE_LIVE
    views = []
    for _ in range(20):
        views.append(hs[1].clone().materialize())
    clones = [hs[1].clone() for _ in range(7)]
    for c in clones:
        c.release()
        c.release()
    assert refcount(name) == 22
    with pytest.raises(HandleStateError):
        c.materialize(copy=True)
    v = hs[1].materialize()
    with pytest.raises(HandleStateError):
        hs[1].materialize()
    hs[1].release()  # no longer its reference: the view's
    assert refcount(name) == 22
    del views
    gc.collect()
    assert refcount(name) == 2 and torch.equal(v, ts[1])
    del v
    gc.collect()
    assert refcount(name) == 1 and header(name)[2] == segfile.STATE_LIVE
    assert torch.equal(hs[2].clone().materialize(copy=True), ts[2])
    hs[2].release()
    assert refcount(name) == 0 and header(name)[2] == segfile.STATE_POOLED
    hs[2].release()
    for h in hs:
        h.release()
    assert refcount(name) == 0
    # pooled exactly once: two groups of that size now take two different segments
    a = ShmTensor.from_tensors(ts)
    b = ShmTensor.from_tensors(ts)
    assert a[0].name == name and b[0].name != name
    for t, x, y in zip(ts, a, b):
        assert torch.equal(x.materialize(copy=True), t) and torch.equal(y.materialize(copy=True), t)


# -- a fanned-out group and a consumer killed holding a view ---------------------------------------
def _consumer_holds_and_waits(blobs, conn):
    hs = [pickle.loads(b) for b in blobs]
    v = hs[1].materialize()
    conn.send(float(v.double().sum()))
    threading.Event().wait(120)  # killed here


def test_a_consumer_killed_holding_one_tensors_view_of_a_fanned_out_group(shm_dir):
    ts = _group(6, rows=(200, 300, 100))
    copies = mmshm.fan_out({"f": ts}, 2, min_bytes=1)
    hs = [mmshm.handles(c) for c in copies]
    name = hs[0][0].name
    assert {h.name for c in hs for h in c} == {name} and refcount(name) == 6
    blobs = [pickle.dumps(h) for h in hs[1]]
    for h in hs[1]:
        h.hand_over()
    ctx = spawn_ctx()
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_consumer_holds_and_waits, args=(blobs, child), daemon=True)
    p.start()
    track(p.pid)
    try:
        assert parent.poll(90)
        assert parent.recv() == float(ts[1].double().sum())
        # both alive: nothing is reclaimed
        rep = reaper.reap(grace_s=0, quiet=True)
        assert name not in getattr(rep, "names", []) and name in segment_files(shm_dir)
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
        # the parent still holds its copy: still nothing reclaimed, its views read right
        views = [h.materialize() for h in hs[0]]
        reaper.reap(grace_s=0, quiet=True)
        assert name in segment_files(shm_dir)
        assert all(torch.equal(v, t) for v, t in zip(views, ts))
        assert refcount(name) == 6  # the killed consumer's three are never given back
        del views, copies, hs
        gc.collect()
        assert refcount(name) == 3
        # the creator still has it open (its last reference is not given back): the
        # reaper leaves it, and so does the creator's sweep
        TABLE.sweep()
        rep = reaper.reap(grace_s=0, quiet=True)
        assert rep.reclaimed == 0 and name in segment_files(shm_dir)
        assert header(name)[2] == segfile.STATE_LIVE
        # the creator lets go (as at its exit): nothing holds it now, the reaper takes it,
        # for the killed consumer's references (it had attached the segment)
        with TABLE.lock:
            TABLE.forget(TABLE.get(name))
        rep = reaper.reap(grace_s=3600, quiet=True)
        assert rep.names == [name] and rep.reasons["killed"] == 1, rep
        assert segment_files(shm_dir) == []
    finally:
        if p.is_alive():
            p.kill()
            p.join(10)


# -- odd tensors in one group ----------------------------------------------------------------------
def _odd_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    base = torch.rand(4000, 64, generator=g)
    c = torch.randn(3000, 8, generator=g, dtype=torch.complex64)
    return [
        base,
        base,                                # the same tensor twice
        base[100:2100],                      # a view of the same storage
        base[1000:3000],                     # overlapping it
        base[::3],                           # strided
        base.t(),                            # not contiguous
        base[:, 5],                          # a column
        torch.tensor(3.5),                   # 0-dim
        torch.empty(0, 1176),                # 0 elements
        torch.empty(0),
        base[0:64].to(torch.bfloat16),
        torch.rand(50000, generator=g) > 0.5,  # bool
        c,                                   # complex64
        c.conj(),                            # conjugate bit set
        torch.randn(700, 9, generator=g, dtype=torch.float64).to(torch.complex128),
        torch.rand(1, 64, generator=g).expand(3000, 64),  # stride 0
        torch.arange(10000, dtype=torch.int64)[5:],   # storage offset
        torch.rand(1000, 10, generator=g, requires_grad=True),
        torch.rand(900, 7, generator=g).to(torch.float16)._neg_view(),  # negative bit set
    ]


@pytest.mark.parametrize("hash_mode", ["lazy", "eager"])
def test_odd_tensors_in_one_group_each_read_back_their_own_values(monkeypatch, shm_dir,
                                                                   hash_mode):
    monkeypatch.setenv("MMSHM_HASH", hash_mode)
    config.reload()
    ts = _odd_tensors()
    hs = ShmTensor.from_tensors(ts)
    assert len({h.name for h in hs}) == 1
    offsets = [h.meta.offset for h in hs]
    assert offsets == group_layout(t.numel() * t.element_size() for t in ts)[0]
    for i, (t, h) in enumerate(zip(ts, hs)):
        want = t.detach().resolve_conj().resolve_neg()
        assert h.shape == t.shape and h.dtype == t.dtype, i
        got = h.clone().materialize(copy=True)
        assert torch.equal(got, want), i
        h.share(1)
        v = pickle.loads(pickle.dumps(h)).materialize()
        assert torch.equal(v, want), i
        assert h.hash == content_hash(want.contiguous()), i
        del v
    del hs, h, got
    gc.collect()
    assert segment_files(shm_dir) == []


def test_wrap_of_odd_tensors_reads_back_every_value(shm_dir):
    ts = _odd_tensors()
    w = mmshm.wrap({"t": ts}, min_bytes=1)
    out = mmshm.unwrap(w, copy=True)
    for i, (t, o) in enumerate(zip(ts, out["t"])):
        assert torch.equal(o, t.detach().resolve_conj().resolve_neg()), i
    del w, out
    gc.collect()
    assert segment_files(shm_dir) == []


def test_a_tensor_over_max_bytes_in_a_group_stays_inline_the_others_share_memory(monkeypatch,
                                                                                    shm_dir):
    small = [torch.rand(100, 1176), torch.rand(50, 1176)]
    big = torch.rand(2000, 1176)
    monkeypatch.setenv("MMSHM_MAX_BYTES", str(2 << 20))
    config.reload()
    before = fallbacks_total()
    w = mmshm.wrap({"a": small[0], "big": big, "b": small[1]}, min_bytes=1)
    assert isinstance(w["big"], torch.Tensor) and w["big"] is big
    assert isinstance(w["a"], ShmTensor) and isinstance(w["b"], ShmTensor)
    assert fallbacks_total() - before == 1
    out = mmshm.unwrap(w)
    assert torch.equal(out["a"], small[0]) and torch.equal(out["b"], small[1])
    assert torch.equal(out["big"], big)
    del w, out
    gc.collect()
    assert segment_files(shm_dir) == []


# -- a full tmpfs ---------------------------------------------------------------------------------
_ENOSPC_SCRIPT = r"""
import gc, json, os, sys
import torch
import mmshm
from mmshm.segments.shmtensor import ShmTensor
from mmshm.transport import wrapping
from tests.harness.metrics import fallbacks_total
from tests.harness.segments import segment_files
d = "/dev/shm/probe"
os.makedirs(d, exist_ok=True)
g = torch.Generator().manual_seed(11)
ts = [torch.rand(3 << 18, generator=g) for _ in range(3)]  # 3 MiB each, 9 MiB together
before = fallbacks_total()
hs = wrapping.to_shm_group(ts)
out = {"kinds": ["inline" if h is None else "shm" for h in hs],
       "names": len({h.name for h in hs if h is not None}),
       "files": len(segment_files(d)),
       "fallbacks": fallbacks_total() - before}
w = mmshm.wrap({"t": ts}, min_bytes=1)
out["wrap_kinds"] = ["shm" if isinstance(x, ShmTensor) else "inline" for x in w["t"]]
got = mmshm.unwrap(w, copy=True)["t"]
out["wrap_equal"] = [bool(torch.equal(a, b)) for a, b in zip(got, ts)]
out["equal"] = [bool(torch.equal(h.materialize(copy=True), t)) for h, t in zip(hs, ts)
                if h is not None]
del hs, w, got
gc.collect()
from mmshm.segments.table import TABLE
TABLE.sweep(); TABLE.trim_pool()
out["left"] = segment_files(d)
print(json.dumps(out))
"""


@pytest.mark.parametrize("pool_on", ["0", "1"])
def test_a_group_that_hits_enospc_falls_back_per_tensor_with_every_tensors_bytes(pool_on):
    from tests.harness.shm import run_in_tmpfs, skip_without_unshare

    skip_without_unshare()
    env = {"MMSHM_DIR": "/dev/shm/probe", "MMSHM_POOL": pool_on, "MMSHM_MIN_FREE_BYTES": "0",
           "MMSHM_REAP_INTERVAL_S": "0"}
    r = run_in_tmpfs([sys.executable, "-c", _ENOSPC_SCRIPT], size="8m", env=env, timeout=110)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    n_shm = out["kinds"].count("shm")
    assert 1 <= n_shm < 3 and out["names"] == n_shm and out["files"] == n_shm
    assert out["fallbacks"] == 3 - n_shm  # counted once per inline tensor
    assert out["equal"] == [True] * n_shm
    assert out["wrap_equal"] == [True] * 3
    assert out["left"] == []


# -- truncated by a third party at each tensor's boundary ------------------------------------------
def _child_reads_truncated(blobs, sums):
    """In a spawned consumer: attach the group through its first handle, then
    read every other handle after the parent truncated the file (the parent
    waits for the first read). Returns per handle 'ok'/'wrong'/error name."""
    out = []
    for blob, want in zip(blobs, sums):
        h = pickle.loads(blob)
        for copy in (True, False):
            try:
                t = h.clone().materialize(copy=copy) if not copy else h.clone().materialize(True)
                out.append("ok" if float(t.double().sum()) == want else "wrong")
                del t
            except Exception as exc:  # noqa: BLE001
                out.append(type(exc).__name__)
        try:
            _ = h.hash
            out.append("hash")
        except Exception as exc:  # noqa: BLE001
            out.append(type(exc).__name__)
        h.release()
    gc.collect()
    return out


@pytest.mark.parametrize("cut", ["at", "inside"])
def test_a_group_truncated_at_each_tensors_boundary_is_a_typed_error_everywhere(shm_dir, cut):
    ts = _group(8, rows=(10, 700, 3, 1200))
    for k in range(1, len(ts)):
        hs = ShmTensor.from_tensors(ts, hashes=[b""] * len(ts), hash_now=False)
        m = hs[k].meta
        path = os.path.join(shm_dir, m.name)
        keep = m.offset + (0 if cut == "at" else m.nbytes // 2)
        os.truncate(path, segfile.HEADER_SIZE + keep)
        blobs = []
        for h in hs:
            h.share(1)
            blobs.append(pickle.dumps(h))
            h.hand_over()
        res, code = run_child(_child_reads_truncated, blobs,
                              [float(t.double().sum()) for t in ts], timeout=90)
        assert code == 0, f"consumer died with {code} (k={k})"
        assert "wrong" not in res
        assert set(res) <= {"ok", "hash", "SegmentCorruptError"}, res
        for h, t in zip(hs, ts):  # and in the creator
            h.reclaim()
            for copy in (True, False):
                try:
                    got = h.clone().materialize(copy=copy)
                    assert torch.equal(got, t)
                    del got
                except SegmentCorruptError:
                    pass
            try:
                assert h.hash == content_hash(t)
            except SegmentCorruptError:
                pass
            # the child gave back what it was handed
        del hs, h
        gc.collect()
        assert segment_files(shm_dir) == [], k


# -- the arena ----------------------------------------------------------------------------------
def test_views_of_one_arena_group_released_on_other_threads(arena_on):
    fake = FakeRegistrar()
    arena.set_registrar(fake)
    ts = _group(9, rows=(400, 800, 50, 300))
    hs = ShmTensor.from_tensors(ts)
    name = hs[0].name
    for h in hs:
        h.share(8)
    views = [[pickle.loads(pickle.dumps(h)).materialize() for _ in range(8)] for h in hs]
    for h in hs:
        h.release()
    assert refcount(name) == 32
    assert arena.VIEWS.status()["mappings"] == 1 and fake.registrations() == 1
    start = threading.Barrier(len(ts))
    errors = []

    def drop(i):
        try:
            start.wait(10)
            mine = views[i]
            views[i] = None
            for v in mine:
                if not torch.equal(v, ts[i]):
                    errors.append(i)
            del mine, v
            gc.collect()
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=drop, args=(i,)) for i in range(len(ts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    gc.collect()
    assert arena.VIEWS.settled()  # registered views are given back by the settling thread
    assert refcount(name) == 0 and header(name)[2] == segfile.STATE_POOLED
    assert fake.registrations() == 1
    # the next group reuses the one registered mapping
    hs2 = ShmTensor.from_tensors(ts[:2])
    assert hs2[0].name == name
    for h in hs2:
        h.share(1)
    vs = [pickle.loads(pickle.dumps(h)).materialize() for h in hs2]
    assert all(torch.equal(v, t) for v, t in zip(vs, ts[:2])) and fake.registrations() == 1
    del vs
    gc.collect()
    for h in hs2:
        h.release()


# -- a write that fails part-way, and releases racing on threads -------------------------------------
def test_a_group_whose_third_write_fails_is_given_back_once(pool, monkeypatch):
    from mmshm.segments import shmtensor

    real = shmtensor._fill_one
    calls = []

    def fails_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(5, "injected write failure")
        return real(*a, **k)

    ts = _group(10, rows=(300, 200, 100, 50))
    monkeypatch.setattr(shmtensor, "_fill_one", fails_third)
    with pytest.raises(OSError):
        ShmTensor.from_tensors(ts)
    monkeypatch.setattr(shmtensor, "_fill_one", real)
    names = segment_files()
    assert len(names) == 1 and header(names[0])[2] == segfile.STATE_POOLED
    assert refcount(names[0]) == 0
    # given back once: two groups of that size now take two segments
    a = ShmTensor.from_tensors(ts)
    b = ShmTensor.from_tensors(ts)
    assert a[0].name == names[0] and b[0].name != names[0]
    for t, x, y in zip(ts, a, b):
        assert torch.equal(x.materialize(copy=True), t) and torch.equal(y.materialize(copy=True), t)


def test_clones_of_a_groups_tensors_released_on_many_threads_are_counted_once_each(pool):
    ts = _group(11, rows=(100, 200, 300, 400))
    hs = ShmTensor.from_tensors(ts)
    name = hs[0].name
    per = 50
    clones = [[h.clone() for _ in range(per)] for h in hs]
    views = [[c.clone().materialize() for c in cs[:5]] for cs in clones]
    assert refcount(name) == len(ts) * (1 + per + 5)
    start = threading.Barrier(len(ts))
    bad = []

    def run(i):
        start.wait(10)
        for c in clones[i]:
            c.release()
        vs = views[i]
        views[i] = None
        bad.extend(i for v in vs if not torch.equal(v, ts[i]))
        del vs
        gc.collect()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    gc.collect()
    assert bad == [] and refcount(name) == len(ts)
    for h in hs:
        h.release()
    assert refcount(name) == 0 and header(name)[2] == segfile.STATE_POOLED


# -- the send path ---------------------------------------------------------------------------------
def test_a_tensor_changed_between_prepare_and_put_travels_with_its_new_bytes(shm_dir):
    from mmshm.transport import sending

    a, b = torch.rand(100, 1176), torch.rand(200, 1176)
    with sending.sending(hops=1) as box:
        assert box.prepare([a, b]) == 2
        a.add_(1.0)  # changed in place after it was written
        ha, hb = box.put(a), box.put(b)
    for h, t in ((ha, a), (hb, b)):
        h.reclaim()
        h.share(0)
        assert torch.equal(h.clone().materialize(copy=True), t)
        h.ref.release(1)
        h.release()
    sending.SEGMENTS.drop(a)
    sending.SEGMENTS.drop(b)
    del ha, hb, h
    gc.collect()
    assert segment_files(shm_dir) == []


# -- version skew ----------------------------------------------------------------------------------
class _WireBeforeOffsets(msgspec.Struct, array_like=True, frozen=True):
    """The handle wire array as mmshm decoded it before handles carried offsets."""

    name: str
    nbytes: int
    dtype: int
    shape: tuple
    hash: bytes
    gen: int = 0
    node: int | None = None


def test_a_rank_that_predates_offsets_is_caught_by_the_handshake(shm_dir):
    """A decoder that predates offsets ignores the 8th wire element (msgspec
    drops trailing array elements) and would read a grouped tensor at offset
    0, the first tensor's bytes: the TP handshake's protocol tells such a rank
    apart (it makes the group go inline). Handles that cross processes
    without a handshake (frontend to engine: one install) have no guard."""
    from mmshm.transport import handshake

    ts = [torch.rand(100, 1176), torch.rand(100, 1176)]
    hs = ShmTensor.from_tensors(ts)
    old = msgspec.msgpack.decode(hs[1].encode(), type=_WireBeforeOffsets)
    nbytes = hs[1].nbytes
    del hs  # (a failing assertion below keeps this frame's handles alive)
    assert old.nbytes == nbytes  # an old rank decodes it, silently at offset 0
    assert handshake.PROTOCOL > 2  # so the handshake must tell the versions apart


@pytest.mark.parametrize("kw", [{"hashes": [None, None]}, {"hash_now": [True]},
                                {"hashes": [None] * 4}])
def test_to_shm_group_with_a_hash_list_of_another_length_is_a_value_error(shm_dir, kw):
    """One handle or None per tensor, always: a list of hashes or hash_now of another
    length is the caller's error, never fewer handles than tensors (from_tensors raises
    the same ValueError, and its per-tensor fallback must not zip the lists short)."""
    from mmshm.transport import wrapping

    ts = [torch.rand(1000) for _ in range(3)]
    with pytest.raises(ValueError):
        wrapping.to_shm_group(ts, **kw)
    gc.collect()
    assert segment_files(shm_dir) == []


@pytest.mark.parametrize("copy", [False, True])
def test_a_message_with_one_forged_handle_of_a_group_leaks_nothing(shm_dir, copy):
    """A received message whose grouped handles include one forged past the payload:
    unwrap raises the typed error, and once the message is dropped every reference
    it carried is given back (the segment is gone)."""
    ts = _group(12, rows=(100, 200, 300))
    hs = ShmTensor.from_tensors(ts)
    name = hs[0].name
    hs[2].share(1)
    forged = _rebuild(_wire(hs[2].meta, offset=hs[2].meta.offset + 4096))
    msg = {"items": [{"f": hs[0]}, {"f": forged}, {"f": hs[1]}, {"f": hs[2]}]}
    blob = pickle.dumps(msg)
    for h in (*hs, forged):
        h.hand_over()
    del msg, hs, forged, h
    assert refcount(name) == 4
    got = pickle.loads(blob)
    with pytest.raises(HandleError):
        mmshm.unwrap(got, copy=copy)
    del got
    gc.collect()
    assert segment_files(shm_dir) == []
