"""Parallel sampling (n > 1): copies share segments, never containers."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import mmshm
import msgspec
import pytest
import torch
from mmshm.segments.codec import HandleMeta

from tests.harness.segments import refcount, segment_files
from tests.harness.metrics import metric
from tests.harness.tensors import make_tensor, same


class MMItem(msgspec.Struct):
    feature: Any
    modality: str = "image"


@dataclasses.dataclass
class MMInputs:
    mm_items: list
    im_token_id: int = 151655


@dataclasses.dataclass
class GenerateReq:
    rid: str
    mm_inputs: MMInputs
    sampling_params: dict


@pytest.fixture(autouse=True)
def one_segment_per_tensor(monkeypatch):
    """This module checks fan-out's reference arithmetic segment by segment, so
    each tensor gets its own segment here (as before requests were grouped);
    a request's tensors in one segment, fanned out: tests/test_group_segments.py."""
    from mmshm.transport import wrapping

    monkeypatch.setattr(wrapping, "to_shm_group", lambda ts, hashes=None, directory=None,
                        hash_now=None: [wrapping.to_shm(t, directory=directory) for t in ts])


def make_req(seeds=(1, 2)) -> tuple[GenerateReq, list[torch.Tensor]]:
    ts = [make_tensor(s, (128, 256)) for s in seeds]  # 128 KiB each
    req = GenerateReq("rid", MMInputs([MMItem(t) for t in ts]), {"n": 4, "temperature": 0.7})
    return req, ts


def features(req) -> list:
    return [it.feature for it in req.mm_inputs.mm_items]


def test_fan_out_four_first_copy_consumed_before_the_others(shm_dir):
    req, ts = make_req()
    created = metric("mmshm_segments_created_total")
    written = metric("mmshm_shm_written_bytes_total")
    fan = metric("mmshm_fanout_copies_total")
    copies = mmshm.fan_out(req, 4, min_bytes=1024)
    assert len(copies) == 4
    # the payload was written once: one segment per tensor
    assert metric("mmshm_segments_created_total") - created == len(ts)
    assert metric("mmshm_shm_written_bytes_total") - written == sum(t.nbytes for t in ts)
    assert metric("mmshm_fanout_copies_total") - fan == 4
    names = [h.name for h in features(copies[0])]
    assert sorted(names) == segment_files()
    for c in copies:
        assert [h.name for h in features(c)] == names
    # exactly n - 1 references were added: the count is n
    assert [refcount(n) for n in names] == [4, 4]
    # copy 1 is consumed (unwrap + del) and released before copies 2-4 are opened
    first = mmshm.unwrap(copies[0])
    assert all(same(a, b) for a, b in zip(features(first), ts))
    del first
    gc.collect()
    assert mmshm.release(copies[0]) == 2  # already spent: changes nothing
    assert [refcount(n) for n in names] == [3, 3]
    for i in (1, 2, 3):
        got = mmshm.unwrap(copies[i])
        assert all(same(a, b) for a, b in zip(features(got), ts)), f"copy {i + 1}"
        del got
        gc.collect()
        if i < 3:
            assert [refcount(n) for n in names] == [3 - i, 3 - i]
    assert segment_files() == []
    # the caller's request still holds its tensors
    assert all(a is b for a, b in zip(features(req), ts))


def test_copies_are_independent(shm_dir):
    req, ts = make_req()
    copies = mmshm.fan_out(req, 4, min_bytes=1024)
    c0, c1 = copies[0], copies[1]
    assert c0 is not c1
    assert c0.mm_inputs is not c1.mm_inputs
    assert c0.mm_inputs.mm_items is not c1.mm_inputs.mm_items
    assert c0.sampling_params is not c1.sampling_params
    for a, b in zip(c0.mm_inputs.mm_items, c1.mm_inputs.mm_items):
        assert a is not b and a.feature is not b.feature
    del a, b
    ids = [id(h) for c in copies for h in mmshm.handles(c)]
    assert len(set(ids)) == len(ids)  # every copy has its own handle objects
    # mutate copy 0 in every way a scheduler does
    c0.mm_inputs.mm_items.append(MMItem(torch.zeros(3), "audio"))
    c0.mm_inputs.mm_items[0].modality = "video"
    c0.mm_inputs.mm_items[1] = MMItem(None)
    c0.mm_inputs.im_token_id = -1
    c0.sampling_params["temperature"] = 0.0
    c0.rid = "rid-0"
    for c in copies[1:]:
        assert len(c.mm_inputs.mm_items) == 2
        assert [it.modality for it in c.mm_inputs.mm_items] == ["image", "image"]
        assert all(isinstance(h, mmshm.ShmTensor) for h in features(c))
        assert c.mm_inputs.im_token_id == 151655
        assert c.sampling_params["temperature"] == 0.7
        assert c.rid == "rid"
    # the request that was fanned out is untouched too
    assert len(req.mm_inputs.mm_items) == 2 and req.mm_inputs.mm_items[0].modality == "image"
    assert req.sampling_params["temperature"] == 0.7
    # c0 dropped its second item's handle (replaced above): its reference went with it
    gc.collect()
    names = [h.name for h in features(copies[1])]
    assert [refcount(n) for n in names] == [4, 3]
    for c in copies[1:]:
        got = mmshm.unwrap(c)
        assert all(same(a, b) for a, b in zip(features(got), ts))
    del got, c, c0, c1, copies
    gc.collect()
    assert segment_files() == []


def test_dropping_unconsumed_copies_releases_everything(shm_dir):
    req, _ = make_req()
    copies = mmshm.fan_out(req, 4, min_bytes=1024)
    assert len(segment_files()) == 2
    del copies[2]
    gc.collect()
    assert [refcount(n) for n in segment_files()] == [3, 3]
    del copies
    gc.collect()
    assert segment_files() == []


def test_fan_out_of_a_wrapped_request_adds_n_minus_1(shm_dir):
    req, ts = make_req()
    wrapped = mmshm.wrap(req, min_bytes=1024)
    names = [h.name for h in features(wrapped)]
    created = metric("mmshm_segments_created_total")
    copies = mmshm.fan_out(wrapped, 3)
    assert metric("mmshm_segments_created_total") == created  # nothing new
    assert [refcount(n) for n in names] == [3, 3]
    # the originals handed their reference to the copies
    assert not any(h.owns_reference for h in features(wrapped))
    for c in copies:
        got = mmshm.unwrap(c, copy=True)
        assert all(same(a, b) for a, b in zip(features(got), ts))
    assert segment_files() == []


def test_fan_out_one(shm_dir):
    req, ts = make_req()
    (only,) = mmshm.fan_out(req, 1, min_bytes=1024)
    assert [refcount(n) for n in segment_files()] == [1, 1]
    got = mmshm.unwrap(only, copy=True)
    assert all(same(a, b) for a, b in zip(features(got), ts))
    assert segment_files() == []


def test_same_tensor_in_two_items(shm_dir):
    t = make_tensor(9, (128, 256))
    req = GenerateReq("rid", MMInputs([MMItem(t), MMItem(t)]), {})
    copies = mmshm.fan_out(req, 3, min_bytes=1024)
    (name,) = segment_files()
    assert refcount(name) == 6  # two handle objects per copy
    for c in copies:
        got = mmshm.unwrap(c, copy=True)
        assert all(same(x, t) for x in features(got))
    assert segment_files() == []


def test_invalid_n(shm_dir):
    req, _ = make_req()
    for n in (0, -1):
        with pytest.raises(ValueError):
            mmshm.fan_out(req, n, min_bytes=1024)
    assert segment_files() == []


def test_missing_segment_rolls_back(shm_dir):
    good = mmshm.ShmTensor.from_tensor(make_tensor(10, (64, 64)))
    missing = mmshm.ShmTensor(HandleMeta("mmshm-1-00000000deadbeef", 4, 0, (1,), b"\0" * 16))
    req = GenerateReq("rid", MMInputs([MMItem(good), MMItem(missing)]), {})
    with pytest.raises(mmshm.SegmentNotFoundError):
        mmshm.fan_out(req, 4)
    assert refcount(good.name) == 1  # the n - 1 added to `good` were taken back
    assert good.owns_reference
    missing.release()
    good.release()
    assert segment_files() == []


def _fake_tp_group(monkeypatch, world: int) -> None:
    """deferred_unwrap on TP rank 0 of a one-node group of ``world`` ranks,
    without peers: enough for what happens before and around the inner
    broadcast (which the test supplies)."""
    from mmshm.transport import broadcast

    monkeypatch.setattr(broadcast, "_world", lambda group: (world, 0))
    one_node = broadcast.topology.Layout.from_identities(["this node"] * world, [1] * world)
    monkeypatch.setattr(broadcast.topology, "layout", lambda group: one_node)


def _fanned_copies(monkeypatch, world: int):
    """On TP rank 0 of a fake group of ``world``: the 4 fan-out copies of a
    2-image request, the names of its 2 segments, and the original tensors."""
    _fake_tp_group(monkeypatch, world)
    req, ts = make_req()
    wrapped = mmshm.wrap(req, min_bytes=1024)
    copies = mmshm.fan_out(wrapped, 4, min_bytes=1024)
    mmshm.release(wrapped)
    names = sorted({h.name for h in mmshm.handles(copies)})
    return copies, names, ts


def test_source_rank_sends_one_handle_per_segment_and_rolls_back(shm_dir, monkeypatch):
    """The 4 copies of a 2-image fan-out reach the source rank with 8 handle
    objects; the batch it broadcasts carries 2 (one per segment), each
    counting the source's reference plus one per other rank. If the
    broadcast raises, every copy owns its reference again and the counts are
    what they were; releasing the copies then frees everything."""
    copies, names, _ = _fanned_copies(monkeypatch, world=3)
    assert len(names) == 2 and len(mmshm.handles(copies)) == 8
    assert [refcount(n) for n in names] == [4, 4]
    seen: dict = {}

    def failing_broadcast(data, rank, group, src):
        hs = mmshm.handles(data)
        seen["objects"] = len({id(h) for h in hs})
        seen["counts"] = [refcount(n) for n in names]
        seen["distinct_items"] = len({id(r.mm_inputs.mm_items[0]) for r in data})
        raise RuntimeError("the TP group went away")

    with pytest.raises(RuntimeError, match="went away"):
        mmshm.deferred_unwrap(failing_broadcast)(copies, 0, None, 0)
    assert seen["objects"] == 2            # not 8
    assert seen["counts"] == [3, 3]        # the source's view-to-be + 2 other ranks
    assert seen["distinct_items"] == 4     # the copies' containers stay their own
    assert [refcount(n) for n in names] == [4, 4]
    assert all(h.owns_reference for h in mmshm.handles(copies))
    mmshm.release(copies)
    gc.collect()
    assert segment_files() == []


def test_source_rank_collapse_then_materialize(shm_dir, monkeypatch):
    """The same batch through an inner broadcast that returns it (what the
    source rank gets back): every copy holds the right bytes in its own
    tensor object, over one mapping per segment, and dropping them frees the
    segments once the other ranks' references (handed out, never used here)
    are given back."""
    copies, names, ts = _fanned_copies(monkeypatch, world=2)
    monkeypatch.setattr("mmshm.transport.broadcast._agree_max", lambda flat, *a: flat)
    out = mmshm.deferred_unwrap(lambda data, *a: data)(copies, 0, None, 0)
    del copies
    feats = [[it.feature for it in r.mm_inputs.mm_items] for r in out]
    assert len({id(f) for fs in feats for f in fs}) == 8
    for fs in feats:
        assert all(same(f, t) for f, t in zip(fs, ts))
    assert len({fs[0].data_ptr() for fs in feats}) == 1
    assert [refcount(n) for n in names] == [2, 2]  # this rank's mapping + rank 1's
    del out, feats, fs
    gc.collect()
    for n in names:
        mmshm.segments.segment.update_refcount(n, -1)  # rank 1's, never used
    assert segment_files() == []
