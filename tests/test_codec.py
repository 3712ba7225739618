"""Handle metadata on the wire: every kind of malformed metadata gives a typed
HandleError, and a malformed pickled handle becomes a broken handle instead of
an exception in the unpickler."""

from __future__ import annotations

import pickle
import random

import mmshm
import msgspec
import pytest
import torch
from mmshm.segments import codec
from mmshm.segments.codec import HandleMeta
from mmshm.segments.shmtensor import _rebuild

from tests.harness.segments import refcount, segment_files

# fixed (not this process's pid): parameters must be equal in every collecting process
# (pytest-xdist's workers collect the suite each)
GOOD_NAME = "mmshm-4242-0123456789abcdef"
H16 = b"\x01" * 16


def wire(name=GOOD_NAME, nbytes=40, dtype=0, shape=(10,), hash=H16) -> bytes:
    return msgspec.msgpack.encode([name, nbytes, dtype, list(shape), hash])


class _Raw:
    """Pickles as the handle rebuild call with arbitrary wire bytes."""

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return (_rebuild, (self.data,))


def test_wire_roundtrip_and_size():
    meta = HandleMeta(f"mmshm-{2**22}-0123456789abcdef", 4784 * 1176 * 4, 0, (4784, 1176), H16)
    data = codec.encode(meta)
    assert codec.decode(data) == meta
    # the name travels without its constant "mmshm-" prefix; the last field is the node id
    assert msgspec.msgpack.decode(data) == [meta.name[len("mmshm-"):], meta.nbytes, 0,
                                            [4784, 1176], H16, 0, meta.node]
    assert len(data) <= 64  # a Qwen2-VL pixel_values handle is tiny


def test_dtype_codes_are_stable():
    # append-only wire table: these positions must never change
    expected = ["float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16",
                "int32", "int64", "bool", "complex64", "complex128", "complex32", "uint16",
                "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"]
    for code, name in enumerate(expected):
        assert codec.DTYPES[code] == getattr(torch, name), (code, name)
        assert codec.DTYPE_CODES[getattr(torch, name)] == code


BAD_NAMES = [
    "mmshm-1-0123456789abcdef/x",
    "mmshm-1-0123456789abcdef/../../../etc/passwd",
    "../mmshm-1-0123456789abcdef",
    "..",
    "/dev/shm/mmshm-1-0123456789abcdef",
    "sub/mmshm-1-0123456789abcdef",
    "mmshm-1-0123456789ABCDEF",
    "mmshm-1-0123456789abcde",
    "mmshm-1-0123456789abcdef0",
    "mmshm-x-0123456789abcdef",
    "mmshm--0123456789abcdef",
    "mmshm-12345678901-0123456789abcdef",
    "mmshm-1-0123456789abcdef\n",
    "mmshm-1-0123456789abcdef\x00",
    "psm_1234abcd",
    "",
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_name(name):
    with pytest.raises(mmshm.HandleError):
        mmshm.ShmTensor.decode(wire(name=name))


@pytest.mark.parametrize("nbytes,dtype,shape", [
    (41, 0, (10,)),          # float32: 10 x 4 != 41
    (39, 0, (10,)),
    (40, 3, (10,)),          # float64: 10 x 8 != 40
    (0, 0, (10,)),
    (40, 0, (10, 0)),        # 0 elements but 40 bytes
    (40, 0, (2, 5, 2)),
    (-4, 0, (-1,)),          # negative dimension
    (4, 0, (-1, -1)),
    (0, 0, (0,) * 40),       # too many dimensions
])
def test_shape_times_itemsize_must_equal_nbytes(nbytes, dtype, shape):
    with pytest.raises(mmshm.HandleError):
        mmshm.ShmTensor.decode(wire(nbytes=nbytes, dtype=dtype, shape=shape))


@pytest.mark.parametrize("code", [-1, len(codec.DTYPES), 999, 2**40])
def test_unknown_dtype_code(code):
    with pytest.raises(mmshm.HandleError):
        mmshm.ShmTensor.decode(wire(dtype=code))


@pytest.mark.parametrize("n", [1, 15, 33, 64])
def test_bad_hash_length(n):
    with pytest.raises(mmshm.HandleError):
        mmshm.ShmTensor.decode(wire(hash=b"\x02" * n))


@pytest.mark.parametrize("n", [16, 20, 32])
def test_good_hash_lengths(n):
    h = mmshm.ShmTensor.decode(wire(hash=b"\x02" * n))
    assert h.hash == b"\x02" * n
    h.release()  # it names no segment: the release tolerates ENOENT


def test_empty_hash_is_not_computed_yet():
    """An empty hash means "not computed before encoding" (MMSHM_HASH=lazy):
    it decodes, and reading .hash then needs the segment (here: none)."""
    h = mmshm.ShmTensor.decode(wire(hash=b""))
    assert h.meta.hash == b""
    with pytest.raises(mmshm.SegmentNotFoundError):
        h.hash  # noqa: B018 - the property opens the segment
    assert h.owns_reference  # a failed hash does not give the reference away
    h.release()


@pytest.mark.parametrize("data", [
    b"",
    b"\xc1",
    b"\x00",
    b"\xff" * 40,
    random.Random(3).randbytes(3) + b"\xc1" + random.Random(60).randbytes(60),
    b"garbage that is not msgpack at all",
    wire() + b"\x00",                                        # trailing bytes
    wire()[:-3],                                             # truncated
    msgspec.msgpack.encode({"name": GOOD_NAME, "nbytes": 40}),  # a map
    msgspec.msgpack.encode([GOOD_NAME, 40, 0, [10]]),        # missing field
    msgspec.msgpack.encode([GOOD_NAME, "40", 0, [10], H16]),  # wrong types
    msgspec.msgpack.encode([GOOD_NAME, 40, 0, [10.0], H16]),
    msgspec.msgpack.encode([GOOD_NAME, 40, True, [10], H16]),
    msgspec.msgpack.encode([GOOD_NAME, 40, 0, [10], "0123456789abcdef"]),
    msgspec.msgpack.encode([123, 40, 0, [10], H16]),
    msgspec.msgpack.encode(None),
])
def test_garbage_bytes(data):
    with pytest.raises(mmshm.HandleError) as ei:
        mmshm.ShmTensor.decode(data)
    assert isinstance(ei.value, ValueError)  # HandleError is a ValueError too


@pytest.mark.parametrize("copy", [False, True])
def test_size_larger_than_the_segment(shm_dir, copy):
    t = torch.arange(1000, dtype=torch.float32)
    h = mmshm.ShmTensor.from_tensor(t)
    m = h.meta
    h.share(1)  # the reference the lying handle owns
    lie = mmshm.ShmTensor.decode(wire(name=m.name, nbytes=8000, dtype=0, shape=(2000,),
                                      hash=m.hash))
    with pytest.raises(mmshm.HandleError):
        lie.materialize(copy=copy)
    assert lie.owns_reference  # a failed materialize keeps the reference
    assert refcount(m.name) == 2
    lie.release()
    assert refcount(m.name) == 1
    assert torch.equal(h.materialize(copy=True), t)  # the segment is unharmed
    assert segment_files() == []


def test_bigger_dtype_same_count_is_larger_than_the_segment(shm_dir):
    t = torch.arange(1000, dtype=torch.float32)
    h = mmshm.ShmTensor.from_tensor(t)
    m = h.meta
    h.share(1)
    lie = mmshm.ShmTensor.decode(wire(name=m.name, nbytes=8000, dtype=3, shape=(1000,),
                                      hash=m.hash))
    with pytest.raises(mmshm.HandleError):
        lie.materialize()
    del lie
    assert refcount(m.name) == 1
    h.release()


@pytest.mark.parametrize("data", [
    wire(name="../../etc/passwd"),
    wire(nbytes=41),
    wire(dtype=999),
    wire(hash=b"x"),
    b"\xc1garbage",
    b"",
])
def test_unpickling_malformed_handle_gives_broken_handle(shm_dir, data):
    blob = pickle.dumps([_Raw(data), "other payload"])
    out = pickle.loads(blob)  # must not raise: a broadcast carries other requests too
    broken = out[0]
    assert isinstance(broken, mmshm.ShmTensor)
    assert out[1] == "other payload"
    assert not broken.owns_reference
    for copy in (False, True):
        with pytest.raises(mmshm.HandleError):
            broken.materialize(copy=copy)
    with pytest.raises(mmshm.HandleError):
        broken.share(1)
    with pytest.raises(mmshm.HandleError):
        broken.encode()
    broken.release()  # nothing to give back; no error
    # a broken handle stays broken (and harmless) through another pickle round trip
    again = pickle.loads(pickle.dumps(broken))
    with pytest.raises(mmshm.HandleError):
        again.materialize()
    assert "broken" in repr(again)
    assert segment_files() == []


def test_unpickling_malformed_handle_inside_a_request(shm_dir):
    t = torch.randn(100, 100)
    good = mmshm.ShmTensor.from_tensor(t)
    good.share(1)
    blob = pickle.dumps({"good": good, "bad": _Raw(wire(name="mmshm-1-xyz"))})
    good.release()
    req = pickle.loads(blob)
    with pytest.raises(mmshm.HandleError):
        req["bad"].materialize()
    assert torch.equal(req["good"].materialize(copy=True), t)
    assert segment_files() == []
