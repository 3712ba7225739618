"""Several tensors in one segment: handles with an offset, ``ShmTensor.from_tensors``,
and the walker and the send path putting one request's tensors in one segment.

A request of many photos takes one pooled segment (and one mapping per TP rank,
registered once on a GPU host) instead of one per photo; every tensor's bytes,
views, copies, hashes and references stay its own.
"""

from __future__ import annotations

import gc
import os
import pickle

import msgspec
import pytest
import torch

import mmshm
from mmshm import config
from mmshm.errors import HandleError, SegmentCorruptError
from mmshm.segments import arena, codec, segfile
from mmshm.segments.codec import HandleMeta
from mmshm.segments.shmtensor import ShmTensor, content_hash, group_layout
from mmshm.transport import sending, wrapping

from tests.harness.procs import run_child
from tests.harness.registrar import FakeRegistrar
from tests.harness.segments import header, refcount, segment_files

NAME = f"mmshm-{2**22}-0123456789abcdef"
H16 = b"\x01" * 16


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    """Tensors of several dtypes and layouts, sizes not multiples of 4 KiB."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.rand(1000, 1176, generator=g),                       # a photo's pixel_values
        torch.randint(0, 255, (12345,), dtype=torch.uint8, generator=g),
        torch.rand(30, 70, generator=g).t(),                       # not contiguous
        torch.empty(0),                                            # no bytes
        torch.rand(2, 3, generator=g, dtype=torch.float64),
        torch.rand(2000, 1176, generator=g).to(torch.bfloat16),
    ]


# -- the wire ------------------------------------------------------------------------------
def test_an_offset_travels_as_an_eighth_element_and_zero_keeps_the_old_wire():
    meta = HandleMeta(NAME, 4784 * 1176 * 4, 0, (4784, 1176), H16, 3, 5)
    plain = codec.encode(meta)
    assert len(msgspec.msgpack.decode(plain)) == 7  # offset 0: the wire of before
    at = msgspec.structs.replace(meta, offset=150 * 4096 * 1024)
    data = codec.encode(at)
    assert msgspec.msgpack.decode(data)[7] == 150 * 4096 * 1024
    assert codec.decode(data) == at and codec.decode(plain).offset == 0
    assert len(data) - len(plain) <= 5  # a msgpack uint32
    # a handle made before offsets existed (7, 6 or 5 elements) decodes with offset 0
    for n in (7, 6, 5):
        old = msgspec.msgpack.encode([NAME[6:], 40, 0, [10], H16, 1, 5][:n])
        assert codec.decode(old).offset == 0


@pytest.mark.parametrize("offset", [-4096, 1, 100, 4095, 4096 + 64])
def test_a_negative_or_unaligned_offset_is_a_handle_error(offset):
    wire = msgspec.msgpack.encode([NAME[6:], 40, 0, [10], H16, 0, 5, offset])
    with pytest.raises(HandleError):
        codec.decode(wire)
    with pytest.raises(HandleError):
        codec.encode(HandleMeta(NAME, 40, 0, (10,), H16, 0, 5, offset))
    # and pickled, it becomes a broken handle (never an exception in the unpickler)
    from mmshm.segments.shmtensor import _rebuild
    h = _rebuild(wire)
    assert isinstance(h.error, HandleError)


def test_group_layout_aligns_every_tensor_to_4_kib():
    offsets, total = group_layout([10, 0, 4096, 5000, 1])
    assert offsets == [0, 4096, 4096, 8192, 16384] and total == 16385
    assert all(o % codec.OFFSET_ALIGN == 0 for o in offsets)


# -- one segment, many tensors -------------------------------------------------------------
@pytest.mark.parametrize("hash_mode", ["lazy", "eager"])
def test_every_tensor_of_a_group_reads_back_its_own_bytes(monkeypatch, shm_dir, hash_mode):
    monkeypatch.setenv("MMSHM_HASH", hash_mode)
    config.reload()
    ts = _tensors(1)
    hs = ShmTensor.from_tensors(ts)
    assert len(hs) == len(ts) and len({h.name for h in hs}) == 1
    assert len(segment_files(shm_dir)) == 1
    name = hs[0].name
    assert refcount(name) == len(ts)  # one reference per handle
    offsets = [h.meta.offset for h in hs]
    assert offsets == group_layout(t.numel() * t.element_size() for t in ts)[0]
    for t, h in zip(ts, hs):
        assert h.shape == t.shape and h.dtype == t.dtype
        assert h.hash == content_hash(t)
        c = h.clone()
        assert torch.equal(c.materialize(copy=True), t)
        # through a pickle, as a receiver gets it
        h.share(1)
        view = pickle.loads(pickle.dumps(h)).materialize()
        assert torch.equal(view, t)
        del view
        assert torch.equal(h.materialize(), t)
    gc.collect()
    assert segment_files(shm_dir) == []


def test_a_group_goes_back_to_the_pool_only_after_its_last_reference(pool):
    ts = _tensors(2)
    hs = ShmTensor.from_tensors(ts)
    name = hs[0].name
    views = [h.materialize() for h in hs[:2]]
    for h in hs[2:]:
        h.release()
    assert header(name)[2] == segfile.STATE_LIVE and refcount(name) == 2
    del views[0]
    gc.collect()
    assert header(name)[2] == segfile.STATE_LIVE and refcount(name) == 1
    assert torch.equal(views[0], ts[1])  # the last one still reads its bytes
    del views
    gc.collect()
    assert header(name)[2] == segfile.STATE_POOLED and refcount(name) == 0
    # reused whole by the next group that fits
    again = ShmTensor.from_tensors(ts[:2])
    assert again[0].name == name
    for t, h in zip(ts[:2], again):
        assert torch.equal(h.materialize(copy=True), t)


def test_a_group_truncated_by_a_third_party_is_a_typed_error(shm_dir):
    ts = _tensors(3)
    hs = ShmTensor.from_tensors(ts)
    path = os.path.join(shm_dir, hs[0].name)
    last = hs[-1]
    first = hs[0]
    v = first.clone().materialize()  # the segment is open in this process now
    os.truncate(path, segfile.HEADER_SIZE + last.meta.offset + 4096)
    for h in (last, first):
        with pytest.raises(SegmentCorruptError):
            h.clone().materialize()
        with pytest.raises(SegmentCorruptError):
            h.clone().materialize(copy=True)
    with pytest.raises(SegmentCorruptError):
        _ = last.hash  # lazy: read from the segment
    del v, hs, first, last
    gc.collect()


def test_an_offset_past_the_payload_is_a_handle_error(shm_dir):
    t = torch.rand(1000)
    h = ShmTensor.from_tensor(t)
    h.share(1)
    forged = ShmTensor(msgspec.structs.replace(h.meta, offset=16 * 4096))
    with pytest.raises(HandleError):
        forged.materialize()
    with pytest.raises(HandleError):
        forged.materialize(copy=True)
    forged.release()
    assert torch.equal(h.materialize(copy=True), t)


def _child_reads(blobs, sums):
    """In a spawned process: unpickle each handle of the group, check its
    bytes against the parent's checksum, and let it go."""
    out = []
    for blob, want in zip(blobs, sums):
        h = pickle.loads(blob)
        t = h.materialize()
        out.append((h.meta.offset, float(t.double().sum()) == want))
        del t, h
    gc.collect()
    return out


def test_pickled_handles_of_a_group_are_read_and_released_in_another_process(shm_dir):
    ts = [torch.rand(n, 1176) for n in (100, 333, 7)]
    hs = ShmTensor.from_tensors(ts)
    name = hs[0].name
    for h in hs:
        h.share(1)
    blobs = [pickle.dumps(h) for h in hs]
    for h in hs:
        h.hand_over()  # each pickled copy owns one reference
    res, code = run_child(_child_reads, blobs, [float(t.double().sum()) for t in ts],
                          timeout=60)
    assert code == 0 and [ok for _o, ok in res] == [True] * 3
    assert [o for o, _ok in res] == [h.meta.offset for h in hs]
    assert refcount(name) == 3  # the parent's own three
    for h in hs:
        h.reclaim()
        h.release()
    assert segment_files(shm_dir) == []


def test_arena_views_of_a_group_are_one_mapping_registered_once(arena_on):
    fake = FakeRegistrar()
    arena.set_registrar(fake)
    ts = [torch.rand(n, 1176) for n in (500, 1500, 250)]
    hs = ShmTensor.from_tensors(ts)
    for h in hs:
        h.share(1)
    views = [pickle.loads(pickle.dumps(h)).materialize() for h in hs]
    for t, v in zip(ts, views):
        assert torch.equal(v, t)
    assert arena.VIEWS.status()["mappings"] == 1 and fake.registrations() == 1
    # copies to a device go through the view, cut at its offset and size
    for t, v in zip(ts, views):
        assert torch.equal(arena.to_device(v, "cpu"), t)
    del views, v
    gc.collect()
    assert arena.VIEWS.settled()
    for h in hs:
        h.release()


# -- the walker and the send path ----------------------------------------------------------
def test_wrap_puts_a_requests_tensors_in_one_segment(shm_dir):
    a, b = torch.rand(300, 1176), torch.rand(200, 1176)
    req = {"items": [{"feature": a}, {"feature": b}, {"feature": a}], "ids": [1, 2]}
    w = mmshm.wrap(req, min_bytes=1024)
    hs = mmshm.handles(w)
    assert len(hs) == 3 and len({h.name for h in hs}) == 1
    assert hs[0].meta.offset == hs[2].meta.offset  # the same tensor twice: one copy
    assert refcount(hs[0].name) == 3
    out = mmshm.unwrap(w)
    assert torch.equal(out["items"][0]["feature"], a)
    assert torch.equal(out["items"][1]["feature"], b)
    assert torch.equal(out["items"][2]["feature"], a)
    del out, w, hs
    gc.collect()
    assert segment_files(shm_dir) == []


def test_fan_out_writes_a_groups_pixels_once(shm_dir):
    from mmshm.metrics import SHM_WRITTEN_BYTES

    ts = [torch.rand(100, 1176), torch.rand(50, 1176)]
    before = SHM_WRITTEN_BYTES._value.get()
    copies = mmshm.fan_out({"f": ts}, 3, min_bytes=1)
    assert SHM_WRITTEN_BYTES._value.get() - before == sum(t.nbytes for t in ts)
    names = {h.name for c in copies for h in mmshm.handles(c)}
    assert len(names) == 1 and refcount(names.pop()) == 6
    for c in copies:
        out = mmshm.unwrap(c, copy=True)
        assert all(torch.equal(x, t) for x, t in zip(out["f"], ts))
    del copies
    gc.collect()
    assert segment_files(shm_dir) == []


def test_a_group_that_does_not_fit_falls_back_per_tensor(monkeypatch, shm_dir):
    """Over the budget as one segment, each tensor alone fits: each gets its own
    segment; none travels inline."""
    from tests.harness.metrics import fallbacks_total

    ts = [torch.rand(256 * 1024) for _ in range(3)]  # 1 MiB each
    monkeypatch.setenv("MMSHM_MAX_BYTES", str((1 << 20) + (1 << 19)))
    config.reload()
    before = fallbacks_total()
    hs = wrapping.to_shm_group(ts)
    assert all(h is not None for h in hs[:1])
    assert fallbacks_total() - before == sum(1 for h in hs if h is None)
    got = [h for h in hs if h is not None]
    assert got and len({h.name for h in got}) == len(got)  # one segment each
    for t, h in zip(ts, hs):
        if h is not None:
            assert h.meta.offset == 0 and torch.equal(h.materialize(copy=True), t)


def test_the_outbox_writes_a_messages_tensors_into_one_segment(shm_dir):
    a, b, c = torch.rand(100, 1176), torch.rand(200, 1176), torch.rand(10, 1176)
    with sending.sending(hops=1) as box:
        assert box.prepare([a, b, a, c]) == 3
        ha, hb = box.put(a), box.put(b)
        ha2 = box.put(a)  # the same tensor again: shared, not written again
        names = {ha.name, hb.name, ha2.name}
        # c was prepared and never put: given back when the message leaves
    assert len(names) == 1
    name = names.pop()
    # a: (1 + 1 hop) twice; b: 1 + 1 hop; c given back
    assert refcount(name) == 6
    for h, t in ((ha, a), (hb, b), (ha2, a)):
        h.reclaim()
        h.share(0)
        assert torch.equal(h.clone().materialize(copy=True), t)
        h.ref.release(1)
        h.release()
    sending.SEGMENTS.drop(a)
    sending.SEGMENTS.drop(b)
    gc.collect()
    assert segment_files(shm_dir) == []


def test_a_message_whose_tensors_all_travel_inline_counts_each_fallback_once(shm_dir,
                                                                            monkeypatch):
    """No room for the group nor for any tensor alone (a read-only or full
    directory, the budget): each tensor travels inline and its fallback is
    counted once, in :meth:`Outbox.prepare`; the :meth:`Outbox.put` that
    follows does not try it again (a real vLLM server counted 11 fallbacks
    for 4 images over 2 hops before)."""
    from tests.harness.metrics import fallbacks_total

    ts = [torch.rand(256 * 1024) for _ in range(3)]  # 1 MiB each
    monkeypatch.setenv("MMSHM_MAX_BYTES", str(1 << 19))
    config.reload()
    before = fallbacks_total()
    with sending.sending(hops=1) as box:
        assert box.prepare(ts) == 0
        assert [box.put(t) for t in ts] == [None, None, None]
    assert fallbacks_total() - before == 3
    assert segment_files(shm_dir) == []


def test_refdebug_tracks_every_handle_of_a_group(shm_dir):
    """``MMSHM_DEBUG_REFS``: each handle of a group is a holder of its own (one
    reference each, on the one segment), so a handle dropped by hand_over
    without a receiver is reported, and none once every one is given back."""
    from mmshm.segments import refdebug

    refdebug.install()
    try:
        hs = ShmTensor.from_tensors([torch.rand(100, 1176), torch.rand(30, 1176)])
        held = [r for r in refdebug.held() if r.name == hs[0].name]
        assert len(held) == 2
        views = [h.materialize() for h in hs]
        assert len([r for r in refdebug.held() if r.name == hs[0].name]) == 2
        del views
        gc.collect()
        assert [r for r in refdebug.held() if r.name == hs[0].name] == []
        assert refdebug.leaks() == []
    finally:
        refdebug.uninstall()
