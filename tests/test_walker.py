"""wrap / unwrap over every container shape a request object can take."""

from __future__ import annotations

import collections
import dataclasses
import gc
from typing import Any, NamedTuple

import mmshm
import msgspec
import pytest
import torch
from mmshm import config

from tests.harness.segments import refcount, segment_files
from tests.harness.metrics import fallbacks_total
from tests.harness.tensors import make_tensor, same

BIG = 64 * 1024  # bytes; tensors below are wrapped with min_bytes=BIG


@pytest.fixture(autouse=True)
def _one_segment_per_tensor(monkeypatch):
    """The walk is checked per leaf: each tensor its own segment here (a
    request's tensors in one segment: tests/test_group_segments.py)."""
    from tests.harness.segments import one_segment_per_tensor

    one_segment_per_tensor(monkeypatch)


def big(seed: int, dtype=torch.float32) -> torch.Tensor:
    return make_tensor(seed, (64, 1024 // dtype.itemsize), dtype)  # 64 KiB


class ItemStruct(msgspec.Struct):
    feature: Any
    modality: str = "image"
    offsets: list = msgspec.field(default_factory=list)


class ItemArrayLike(msgspec.Struct, array_like=True, frozen=True):
    feature: Any
    precomputed_embeddings: Any = None
    modality: str = "image"


@dataclasses.dataclass
class Item:
    feature: Any
    modality: str = "image"


@dataclasses.dataclass(frozen=True)
class FrozenItem:
    feature: Any
    extra: dict


@dataclasses.dataclass(slots=True)
class SlotsItem:
    feature: Any
    hash: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenSlotsItem:
    feature: Any
    hash: int = 0


class NT(NamedTuple):
    feature: Any
    audio: Any


class Plain:
    def __init__(self, feature, audio=None):
        self.feature = feature
        self.audio = audio
        self.tag = "plain"


class Slotted:
    __slots__ = ("feature", "tag")

    def __init__(self, feature):
        self.feature = feature
        self.tag = "slotted"


class SlottedChild(Slotted):
    __slots__ = ("more",)

    def __init__(self, feature, more):
        super().__init__(feature)
        self.more = more


class Mixed(Slotted):
    """Slots from the base class, a __dict__ of its own."""


class ListSub(list):
    pass


class TupleSub(tuple):
    pass


@dataclasses.dataclass
class Req:
    rid: str
    mm_items: list
    extra: dict = dataclasses.field(default_factory=dict)


def _mixed(a, b):
    m = Mixed(a)
    m.extra = b
    return m


# each case: (builder(t1, t2) -> obj, getter(obj) -> [leaf1, leaf2])
CASES = {
    "dict": (lambda a, b: {"x": a, "y": {"z": b}}, lambda o: [o["x"], o["y"]["z"]]),
    "list": (lambda a, b: [a, [b]], lambda o: [o[0], o[1][0]]),
    "tuple": (lambda a, b: (a, (1, b)), lambda o: [o[0], o[1][1]]),
    "namedtuple": (lambda a, b: NT(a, b), lambda o: [o.feature, o.audio]),
    "struct": (lambda a, b: ItemStruct(a, offsets=[b]), lambda o: [o.feature, o.offsets[0]]),
    "struct_array_like_frozen": (lambda a, b: ItemArrayLike(a, b),
                                 lambda o: [o.feature, o.precomputed_embeddings]),
    "dataclass": (lambda a, b: Item({"pv": a, "emb": b}),
                  lambda o: [o.feature["pv"], o.feature["emb"]]),
    "dataclass_frozen": (lambda a, b: FrozenItem(a, {"b": b}),
                         lambda o: [o.feature, o.extra["b"]]),
    "dataclass_slots": (lambda a, b: SlotsItem([a, b]), lambda o: o.feature),
    "dataclass_frozen_slots": (lambda a, b: FrozenSlotsItem((a, b)), lambda o: list(o.feature)),
    "plain_dict_object": (lambda a, b: Plain(a, b), lambda o: [o.feature, o.audio]),
    "plain_slots_object": (lambda a, b: SlottedChild(a, b), lambda o: [o.feature, o.more]),
    "slots_and_dict_object": (lambda a, b: _mixed(a, b), lambda o: [o.feature, o.extra]),
    "ordered_dict": (lambda a, b: collections.OrderedDict(x=a, y=b), lambda o: [o["x"], o["y"]]),
    "defaultdict": (lambda a, b: collections.defaultdict(list, x=a, y=b),
                    lambda o: [o["x"], o["y"]]),
    "list_subclass": (lambda a, b: ListSub([a, b]), lambda o: [o[0], o[1]]),
    "tuple_subclass": (lambda a, b: TupleSub([a, b]), lambda o: [o[0], o[1]]),
    "nested": (lambda a, b: Req("r1", [ItemStruct(Plain(NT(a, [SlotsItem(b)])))],
                                {"k": FrozenItem(None, {})}),
               lambda o: [o.mm_items[0].feature.feature.feature,
                          o.mm_items[0].feature.feature.audio[0].feature]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_wrap_unwrap_roundtrip(shm_dir, case):
    build, leaves = CASES[case]
    a, b = big(1), big(2, torch.bfloat16)
    obj = build(a, b)
    wrapped = mmshm.wrap(obj, min_bytes=BIG)
    assert type(wrapped) is type(obj)
    hs = leaves(wrapped)
    assert all(isinstance(h, mmshm.ShmTensor) for h in hs), hs
    assert len(segment_files()) == 2
    assert sorted(h.name for h in mmshm.handles(wrapped)) == sorted(h.name for h in hs)
    # the input is untouched
    got = leaves(obj)
    assert got[0] is a and got[1] is b
    if isinstance(obj, dict):
        assert type(wrapped) is type(obj) and set(wrapped) == set(obj)
    back = mmshm.unwrap(wrapped)
    assert type(back) is type(obj)
    out = leaves(back)
    assert all(isinstance(x, torch.Tensor) for x in out)
    assert same(out[0], a) and same(out[1], b)
    assert out[0] is not a
    # the handles inside `wrapped` gave their references to the tensors
    assert not any(h.owns_reference for h in hs)
    del back, out, wrapped, hs
    gc.collect()
    assert segment_files() == []


def test_unwrap_copy_true_releases_at_once(shm_dir):
    a = big(3)
    wrapped = mmshm.wrap({"a": a, "l": [a + 1]}, min_bytes=BIG)
    back = mmshm.unwrap(wrapped, copy=True)
    assert segment_files() == []
    assert same(back["a"], a) and same(back["l"][0], a + 1)


def test_other_fields_are_preserved(shm_dir):
    obj = Req("rid-7", [ItemStruct(big(4), "video", [1, 2])], {"n": 3, "s": "x"})
    w = mmshm.wrap(obj, min_bytes=BIG)
    assert w.rid == "rid-7" and w.extra == {"n": 3, "s": "x"}
    assert w.mm_items[0].modality == "video" and w.mm_items[0].offsets == [1, 2]
    back = mmshm.unwrap(w)
    assert back.mm_items[0].modality == "video"
    assert same(back.mm_items[0].feature, obj.mm_items[0].feature)


def test_min_bytes_threshold(shm_dir, monkeypatch):
    below = torch.zeros(999, dtype=torch.uint8)
    at = torch.zeros(1000, dtype=torch.uint8)
    above = torch.zeros(251, dtype=torch.float32)  # 1004 bytes
    obj = {"below": below, "at": at, "above": above}
    w = mmshm.wrap(obj, min_bytes=1000)
    assert w["below"] is below
    assert isinstance(w["at"], mmshm.ShmTensor)
    assert isinstance(w["above"], mmshm.ShmTensor)
    assert len(segment_files()) == 2
    mmshm.release(w)
    assert segment_files() == []
    # the default comes from MMSHM_MIN_BYTES
    monkeypatch.setenv("MMSHM_MIN_BYTES", "1001")
    config.reload()
    w = mmshm.wrap(obj)
    assert w["below"] is below and w["at"] is at
    assert isinstance(w["above"], mmshm.ShmTensor)
    mmshm.release(w)
    monkeypatch.delenv("MMSHM_MIN_BYTES")
    config.reload()
    assert config.get().min_bytes == 65536
    w = mmshm.wrap({"small": torch.zeros(65535, dtype=torch.uint8),
                    "big": torch.zeros(65536, dtype=torch.uint8)})
    assert isinstance(w["small"], torch.Tensor)
    assert isinstance(w["big"], mmshm.ShmTensor)
    mmshm.release(w)
    assert segment_files() == []


def test_nothing_to_wrap_returns_the_same_object(shm_dir):
    obj = Req("r", [ItemStruct(torch.zeros(3))], {"x": [1, 2]})
    assert mmshm.wrap(obj, min_bytes=BIG) is obj
    assert segment_files() == []


def test_input_is_not_mutated(shm_dir):
    a, b = big(5), big(6)
    shared_items = [ItemStruct(a), Item(b)]
    req1 = Req("r1", shared_items, {"meta": Plain(a)})
    req2 = Req("r2", shared_items)  # copy.copy(req) shares mm_items in SGLang
    snapshot = (list(shared_items), shared_items[0].feature, shared_items[1].feature,
                req1.extra["meta"].feature, dict(req1.extra))
    w = mmshm.wrap(req1, min_bytes=BIG)
    assert w is not req1 and w.mm_items is not shared_items
    assert shared_items == snapshot[0] and all(x is y for x, y in zip(shared_items, snapshot[0]))
    assert shared_items[0].feature is a and shared_items[1].feature is b
    assert req1.extra["meta"].feature is a and req1.extra == snapshot[4]
    assert req2.mm_items is shared_items and req2.mm_items[0].feature is a
    assert isinstance(w.mm_items[0].feature, mmshm.ShmTensor)
    assert isinstance(w.extra["meta"].feature, mmshm.ShmTensor)
    back = mmshm.unwrap(w)
    assert isinstance(w.mm_items[0].feature, mmshm.ShmTensor)  # unwrap does not mutate
    assert same(back.mm_items[0].feature, a)
    assert same(back.extra["meta"].feature, a)


def test_same_tensor_twice_gives_two_valid_handles(shm_dir):
    t = big(7)
    w = mmshm.wrap({"a": t, "b": [t]}, min_bytes=BIG)
    h1, h2 = w["a"], w["b"][0]
    assert isinstance(h1, mmshm.ShmTensor) and isinstance(h2, mmshm.ShmTensor)
    assert h1 is not h2
    assert h1.name == h2.name  # one segment
    assert segment_files() == [h1.name]
    assert refcount(h1.name) == 2  # one reference per handle object
    v1 = h1.materialize()
    del w, h1
    gc.collect()
    v2 = h2.materialize()
    assert same(v1, t) and same(v2, t)
    del v1
    gc.collect()
    assert segment_files() == [h2.name]
    del v2
    gc.collect()
    assert segment_files() == []


def test_handles_and_release(shm_dir):
    w = mmshm.wrap([big(8), {"x": big(9)}, (big(10),)], min_bytes=BIG)
    hs = mmshm.handles(w)
    assert len(hs) == 3 and all(isinstance(h, mmshm.ShmTensor) for h in hs)
    assert mmshm.release(w) == 3
    assert segment_files() == []
    assert not any(h.owns_reference for h in hs)


def test_unwrap_failure_releases_every_handle(shm_dir):
    from mmshm.segments.codec import HandleMeta

    good = mmshm.ShmTensor.from_tensor(big(11))
    missing = mmshm.ShmTensor(HandleMeta("mmshm-1-00000000deadbeef", 4, 0, (1,), b"\0" * 16))
    good2 = mmshm.ShmTensor.from_tensor(big(12))
    with pytest.raises(mmshm.SegmentNotFoundError):
        mmshm.unwrap([good, missing, good2])
    gc.collect()
    assert segment_files() == []


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_unsupported_tensors_stay_inline_silently(shm_dir):
    q = torch.quantize_per_tensor(torch.randn(1 << 16), 0.1, 0, torch.qint8)
    s = torch.randn(256, 256).to_sparse()
    m = torch.empty(1 << 16, device="meta")
    before = fallbacks_total()
    w = mmshm.wrap({"q": q, "s": s, "m": m}, min_bytes=1)
    assert w["q"] is q and w["s"] is s and w["m"] is m
    assert fallbacks_total() == before
    assert segment_files() == []


def test_unsupported_dtype_stays_inline(shm_dir):
    t = torch.empty(1 << 17, dtype=torch.uint4)
    other = big(13)
    w = mmshm.wrap({"u4": t, "ok": other}, min_bytes=BIG)
    assert w["u4"] is t
    assert isinstance(w["ok"], mmshm.ShmTensor)
    mmshm.release(w)


def test_disabled_transport_leaves_everything_inline(shm_dir, monkeypatch):
    monkeypatch.setenv("MMSHM_DISABLE", "1")
    config.reload()
    obj = {"a": big(14)}
    assert mmshm.wrap(obj, min_bytes=1) is obj
    assert segment_files() == []


def test_unwrap_leaves_plain_tensors_alone(shm_dir):
    small = torch.arange(10)
    w = mmshm.wrap({"small": small, "big": big(15)}, min_bytes=BIG)
    back = mmshm.unwrap(w)
    assert back["small"] is small


def test_instances_of_one_class_with_different_attributes(shm_dir):
    """The walker may cache per type, but attributes live per instance."""
    first = Plain(None)
    second = Plain(big(16))
    second.late = big(17)  # an attribute the first instance does not have
    first.other = big(18)
    w1, w2 = mmshm.wrap([first, second], min_bytes=BIG)
    assert isinstance(w1.other, mmshm.ShmTensor)
    assert isinstance(w2.feature, mmshm.ShmTensor) and isinstance(w2.late, mmshm.ShmTensor)
    assert not hasattr(w2, "other") and not hasattr(w1, "late")
    b1, b2 = mmshm.unwrap([w1, w2])
    assert same(b1.other, first.other)
    assert same(b2.feature, second.feature) and same(b2.late, second.late)


def test_sequences_of_scalars_are_kept_and_a_tensor_among_them_is_found(shm_dir):
    """Lists and tuples of scalars (token ids, grids) come back as the same
    objects; a tensor anywhere in a long list of ints, or in a namedtuple, is
    still wrapped, and unwrapping gives its bytes back."""
    from mmshm.transport.wrapping import transform

    class Grid(NamedTuple):
        t: int
        h: int
        w: int

    ids = list(range(100_000))
    grid = Grid(1, 52, 92)
    t1, t2 = big(1), big(2)
    req = {"input_ids": ids, "grid": grid, "thw": (1, 2.0, "x", None, b"", True),
           "mixed": [*range(50_000), t1, *range(10)], "nt": (7, t2)}
    out = transform(req, lambda x: x)
    assert out is req
    w = mmshm.wrap(req, min_bytes=BIG)
    assert w["input_ids"] is ids and w["grid"] is grid and w["thw"] is req["thw"]
    assert isinstance(w["mixed"][50_000], mmshm.ShmTensor) and w["mixed"][:3] == [0, 1, 2]
    assert isinstance(w["nt"][1], mmshm.ShmTensor)
    back = mmshm.unwrap(w)
    assert same(back["mixed"][50_000], t1) and same(back["nt"][1], t2)
    assert req["mixed"][50_000] is t1  # the input is not mutated
    del back, w
    gc.collect()
    assert segment_files() == []
