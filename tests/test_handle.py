"""ShmTensor: every dtype and layout round-trips, and the ownership protocol
(one object, one reference) holds exactly, as read from the segment header."""

from __future__ import annotations

import copy
import gc
import os
import pickle

import mmshm
import pytest
import torch
from mmshm.segments import codec, segfile
from mmshm.segments.table import TABLE

from tests.harness.procs import run_child, signal_name
from tests.harness.segments import refcount, seg_dir, segment_files
from tests.harness.tensors import as_bytes, make_tensor
from tests.harness import children

# the dtypes servers send; each must be supported
REQUIRED_DTYPES = (
    "float32", "bfloat16", "float16", "float64", "int8", "int16", "int32", "int64", "uint8",
    "uint16", "uint32", "uint64", "bool", "complex64", "complex128", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
)
ALL_DTYPES = [dt for dt in codec.DTYPES if dt is not None]


def _raw(dtype: torch.dtype, rows: int = 6, cols: int = 10) -> torch.Tensor:
    """A [rows, cols] tensor of ``dtype`` with random bytes (valid bools)."""
    g = torch.Generator().manual_seed(hash(str(dtype)) % 2**31)
    raw = torch.randint(0, 256, (rows, cols * dtype.itemsize), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw %= 2
    return raw.view(dtype)


LAYOUTS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.t(),
    "sliced": lambda t: t[::2, 1:7],
    "offset": lambda t: t[2:],
    "expanded": lambda t: t[:1].expand(4, -1),
    "zero_dim": lambda t: t[1, 3],
    "zero_element": lambda t: t[:0],
    "zero_element_2": lambda t: t[:, :0].t(),
}


def test_required_dtypes_are_supported():
    for name in REQUIRED_DTYPES:
        assert getattr(torch, name) in codec.DTYPE_CODES, name


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_roundtrip_every_dtype_and_layout(shm_dir, dtype, layout):
    t = LAYOUTS[layout](_raw(dtype))
    if layout in ("transposed", "sliced", "expanded"):
        assert not t.is_contiguous()
    h_view = mmshm.ShmTensor.from_tensor(t)
    h_copy = mmshm.ShmTensor.from_tensor(t)
    assert h_view.shape == t.shape
    assert h_view.dtype == dtype
    assert h_view.nbytes == t.numel() * t.element_size()
    assert h_view.hash == mmshm.content_hash(t)
    view = h_view.materialize(copy=False)
    private = h_copy.materialize(copy=True)
    for got in (view, private):
        assert isinstance(got, torch.Tensor)
        assert got.shape == t.shape
        assert got.dtype == dtype
        assert got.device.type == "cpu"
        assert torch.equal(as_bytes(got), as_bytes(t))
    assert torch.equal(as_bytes(view), as_bytes(private))
    assert len(segment_files()) <= 1  # only the view's segment may still exist
    del view
    gc.collect()
    assert segment_files() == []


def test_large_tensor_roundtrip(shm_dir):
    t = torch.randn(2048, 4096)  # 32 MiB
    h = mmshm.ShmTensor.from_tensor(t)
    assert torch.equal(h.materialize(), t)


@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.quantize_per_tensor(torch.randn(64), 0.1, 0, torch.qint8),
                 id="quantized"),
    pytest.param(lambda: torch.randn(8, 8).to_sparse(), id="sparse_coo"),
    pytest.param(lambda: torch.randn(8, 8).to_sparse_csr(), id="sparse_csr"),
    pytest.param(lambda: torch.empty(64, device="meta"), id="meta_device"),
    pytest.param(lambda: [1.0, 2.0], id="not_a_tensor"),
])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_unsupported_tensors_raise_type_error(shm_dir, make):
    with pytest.raises(TypeError):
        mmshm.ShmTensor.from_tensor(make())
    assert segment_files() == []


def test_unsupported_dtype_raises_type_error(shm_dir):
    t = torch.empty(1024, dtype=torch.uint4)
    assert t.dtype not in codec.DTYPE_CODES
    try:
        with pytest.raises(TypeError):
            mmshm.ShmTensor.from_tensor(t)
    finally:
        assert segment_files() == []


def test_hash_argument_and_validation(shm_dir):
    t = torch.arange(100, dtype=torch.int64)
    h = mmshm.ShmTensor.from_tensor(t, hash=b"h" * 20)
    assert h.hash == b"h" * 20
    h.release()
    for bad in (b"x" * 15, b"x" * 33):
        with pytest.raises(ValueError):
            mmshm.ShmTensor.from_tensor(t, hash=bad)
    assert segment_files() == []
    # content_hash does not depend on the layout
    m = torch.randn(30, 40)
    assert mmshm.content_hash(m.t()) == mmshm.content_hash(m.t().contiguous())
    assert mmshm.content_hash(m) != mmshm.content_hash(m + 1)


# -- ownership ----------------------------------------------------------------------------
def test_dropped_unmaterialized_handle_releases(shm_dir):
    h = mmshm.ShmTensor.from_tensor(torch.ones(1000))
    assert segment_files() == [h.name]
    assert refcount(h.name) == 1
    del h
    gc.collect()
    assert segment_files() == []
    assert TABLE.names() == []


def test_materialize_moves_reference_to_tensor_and_views(shm_dir):
    t = torch.randn(64, 128)
    h = mmshm.ShmTensor.from_tensor(t)
    name = h.name
    v = h.materialize(copy=False)
    assert not h.owns_reference
    assert refcount(name) == 1
    views = [v[3:9], v.t(), v.reshape(-1), v[0]]
    del h  # the handle no longer owns anything: dropping it changes nothing
    gc.collect()
    assert refcount(name) == 1
    del v
    gc.collect()
    # views of the tensor keep the reference alive
    assert segment_files() == [name]
    assert torch.equal(views[0], t[3:9])
    assert torch.equal(views[1], t.t())
    last = views.pop()
    del views
    gc.collect()
    assert segment_files() == [name]
    assert torch.equal(last, t[0])
    del last
    gc.collect()
    assert segment_files() == []


def test_materialize_copy_releases_at_once(shm_dir):
    t = torch.randn(100, 100)
    h = mmshm.ShmTensor.from_tensor(t)
    other = h.clone()
    assert refcount(h.name) == 2
    c = h.materialize(copy=True)
    assert torch.equal(c, t)
    assert not h.owns_reference
    assert refcount(h.name) == 1  # released immediately, no gc needed
    c2 = other.materialize(copy=True)
    assert segment_files() == []  # the last copy unlinked it
    assert torch.equal(c2, t)


def test_release_is_idempotent(shm_dir):
    h = mmshm.ShmTensor.from_tensor(torch.ones(1000))
    keep = h.clone()
    assert refcount(h.name) == 2
    h.release()
    assert refcount(h.name) == 1
    h.release()
    h.release()
    assert refcount(h.name) == 1
    del h
    gc.collect()
    assert refcount(keep.name) == 1
    keep.release()
    keep.release()
    assert segment_files() == []


@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_share_adds_exactly_k(shm_dir, k):
    h = mmshm.ShmTensor.from_tensor(torch.ones(1000))
    h.share(k)
    assert refcount(h.name) == 1 + k
    h.share(2)
    assert refcount(h.name) == 3 + k
    with pytest.raises(ValueError):
        h.share(-1)
    assert refcount(h.name) == 3 + k
    # hand the extra references to handle objects, as receivers would
    blob = pickle.dumps(h)
    receivers = [pickle.loads(blob) for _ in range(k + 2)]
    assert all(r.owns_reference for r in receivers)
    del receivers
    gc.collect()
    assert refcount(h.name) == 1
    h.release()
    assert segment_files() == []


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_pickling_has_no_side_effect(shm_dir, protocol):
    t = torch.randn(256, 256)  # 256 KiB payload
    h = mmshm.ShmTensor.from_tensor(t)
    before = refcount(h.name)
    blobs = [pickle.dumps(h, protocol=protocol) for _ in range(5)]
    assert refcount(h.name) == before == 1
    assert all(len(b) < 256 for b in blobs)  # metadata only
    assert h.owns_reference
    h.share(1)
    r = pickle.loads(blobs[0])
    assert r.name == h.name and r.shape == h.shape and r.dtype == h.dtype
    assert r.hash == h.hash
    assert torch.equal(r.materialize(), t)
    assert torch.equal(h.materialize(), t)


def test_materializing_a_released_handle_raises(shm_dir):
    h = mmshm.ShmTensor.from_tensor(torch.ones(1000))
    keep = h.clone()
    h.release()
    for c in (False, True):
        with pytest.raises(mmshm.HandleStateError):
            h.materialize(copy=c)
    with pytest.raises(mmshm.HandleStateError):
        h.share(1)
    with pytest.raises(mmshm.HandleStateError):
        pickle.dumps(h)
    # a materialized handle is spent too
    v = keep.materialize()
    with pytest.raises(mmshm.HandleStateError):
        keep.materialize()
    with pytest.raises(mmshm.HandleStateError):
        keep.materialize(copy=True)
    assert refcount(keep.name) == 1
    del v


def test_copy_and_deepcopy_add_a_reference(shm_dir):
    t = torch.randn(100, 100)
    h = mmshm.ShmTensor.from_tensor(t)
    c = copy.copy(h)
    assert c is not h and c.owns_reference
    assert refcount(h.name) == 2
    d = copy.deepcopy(h)
    assert refcount(h.name) == 3
    nested = copy.deepcopy({"items": [h, h]})  # the memo makes it one copy
    extra = refcount(h.name) - 3
    assert extra == len({id(x) for x in nested["items"]})
    assert all(x.owns_reference for x in nested["items"])
    for x in (c, d, h):
        assert torch.equal(x.materialize(copy=True), t)
    del nested
    gc.collect()
    assert segment_files() == []


def test_copy_on_write(shm_dir):
    t = torch.randn(128, 128)
    a = mmshm.ShmTensor.from_tensor(t)
    b = a.clone()
    c = a.clone()
    name = a.name
    seen_before = b.materialize()  # mapped before the write
    va = a.materialize()
    va.fill_(-1.0)
    va[0, 0] = 42.0
    assert va[0, 0].item() == 42.0  # the writer sees its own write
    seen_after = c.materialize()  # mapped after the write
    assert torch.equal(seen_before, t)
    assert torch.equal(seen_after, t)
    # and the segment's bytes are untouched
    fd = os.open(os.path.join(seg_dir(), name), os.O_RDONLY)
    try:
        raw = os.pread(fd, t.numel() * 4, segfile.HEADER_SIZE)
    finally:
        os.close(fd)
    assert raw == t.numpy().tobytes()
    del va, seen_before, seen_after
    gc.collect()
    assert segment_files() == []


def test_encode_decode_roundtrip(shm_dir):
    t = torch.randn(10, 20).to(torch.bfloat16)
    h = mmshm.ShmTensor.from_tensor(t)
    wire = h.encode()
    assert isinstance(wire, bytes) and len(wire) < 100
    assert refcount(h.name) == 1  # encode has no side effect
    h.share(1)
    r = mmshm.ShmTensor.decode(wire)
    assert r.meta == h.meta
    assert torch.equal(r.materialize(copy=True), t)
    assert torch.equal(h.materialize(copy=True), t)
    assert segment_files() == []


def test_zero_element_handle(shm_dir):
    t = torch.empty(0, 5, dtype=torch.float16)
    h = mmshm.ShmTensor.from_tensor(t)
    assert h.nbytes == 0
    v = h.materialize()
    assert v.shape == (0, 5) and v.dtype == torch.float16
    assert segment_files() == []  # nothing to map: released at once


def test_repr_does_not_raise(shm_dir):
    h = mmshm.ShmTensor.from_tensor(torch.ones(10))
    assert h.name in repr(h)
    h.release()
    assert "released" in repr(h)


def _lazy_views():
    c = torch.randn(50, 60, dtype=torch.complex64).conj()
    assert c.is_conj()
    n = c.imag  # the imaginary part of a conjugate view carries the negative bit
    assert n.is_neg()
    return {"conj": (c, c.resolve_conj()), "neg": (n, n.resolve_neg())}


@pytest.mark.parametrize("kind", ["conj", "neg"])
def test_conjugate_and_negative_views_roundtrip(shm_dir, kind):
    lazy, resolved = _lazy_views()[kind]
    h = mmshm.ShmTensor.from_tensor(lazy)
    got = h.materialize(copy=True)
    assert torch.equal(got, resolved)
    assert not got.is_conj() and not got.is_neg()


def test_content_hash_of_a_conjugate_view(shm_dir):
    lazy, resolved = _lazy_views()["conj"]
    assert lazy.is_contiguous()
    h = mmshm.ShmTensor.from_tensor(lazy)
    try:
        assert mmshm.content_hash(lazy) == mmshm.content_hash(resolved) == h.hash
    finally:
        h.release()


def test_threads_sharing_one_descriptor_are_serialized(shm_dir, monkeypatch):
    """Threads of one process update the count through the same descriptor,
    and OFD locks do not exclude threads sharing it: the updates must still be
    serialized. A delay inside the read-modify-write makes a race certain."""
    import threading
    import time

    read_header = segfile.read_header

    def slow_read_header(fd, path):
        hdr = read_header(fd, path)
        time.sleep(0.0005)
        return hdr

    monkeypatch.setattr(segfile, "read_header", slow_read_header)
    h = mmshm.ShmTensor.from_tensor(torch.ones(1000))
    errors = []

    def churn():
        try:
            for _ in range(50):
                v = h.clone().materialize()  # share, then the view's finalizer releases
                del v
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    gc.collect()
    assert refcount(h.name) == 1
    h.release()
    assert segment_files() == []


# -- content hash: lazy by default, eager on request --------------------------------
def _count_blake3(monkeypatch) -> list:
    import blake3

    calls = []
    real = blake3.blake3

    def counting(*args, **kwargs):
        if args and memoryview(args[0]).nbytes > 4096:  # a payload, not a node id
            calls.append(1)
        return real(*args, **kwargs)

    counting.AUTO = real.AUTO
    monkeypatch.setattr(blake3, "blake3", counting)
    return calls


def test_hash_is_lazy_computed_once_per_segment_and_then_carried(shm_dir, monkeypatch):
    t = make_tensor(41, (300, 300))
    calls = _count_blake3(monkeypatch)
    h = mmshm.ShmTensor.from_tensor(t)
    assert calls == []  # nothing hashed while wrapping
    other = h.clone()
    bare = h.encode()
    assert codec.decode(bare).hash == b""
    assert h.hash == mmshm.content_hash(t)
    n = len(calls)
    assert n == 2  # the lazy hash and content_hash just above
    assert codec.decode(h.encode()).hash == h.hash  # carried from now on
    assert pickle.loads(pickle.dumps(h)).meta.hash == h.hash
    assert other.meta.hash == b""  # a clone made before the hash was computed
    assert other.hash == h.hash and len(calls) == n  # memoized on the segment
    other.share(1)
    res, code = run_child(children.hash_pickled, pickle.dumps(other))
    assert code == 0, signal_name(code)
    assert res["carried"] == res["hash"] == h.hash  # it travelled: not recomputed there
    h.release()
    other.release()


def test_receiver_computes_a_hash_that_was_not_carried(shm_dir):
    t = make_tensor(42, (256, 512))
    h = mmshm.ShmTensor.from_tensor(t)
    h.share(1)
    res, code = run_child(children.hash_pickled, pickle.dumps(h))
    assert code == 0, signal_name(code)
    assert res["carried"] == b""
    assert res["hash"] == res["of_view"] == mmshm.content_hash(t)
    h.release()
    gc.collect()
    assert segment_files() == []


def test_eager_hash_is_computed_at_creation(shm_dir, monkeypatch):
    monkeypatch.setenv("MMSHM_HASH", "eager")
    mmshm.config.reload()
    t = make_tensor(43, (128, 128))
    h = mmshm.ShmTensor.from_tensor(t)
    assert h.meta.hash == mmshm.content_hash(t)
    assert codec.decode(h.encode()).hash == h.meta.hash
    given = mmshm.ShmTensor.from_tensor(t, hash=b"\x07" * 16)
    assert given.hash == b"\x07" * 16  # a given hash is never recomputed
    deferred = mmshm.ShmTensor.from_tensor(t, hash=b"")
    assert deferred.meta.hash == b"" and deferred.hash == h.hash
    for x in (h, given, deferred):
        x.release()


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "offset", "zero_dim",
                                    "zero_element", "conj", "neg"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.uint8,
                                   torch.complex64, torch.float8_e4m3fn],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_hash_now_is_the_hash_of_the_bytes(shm_dir, dtype, layout):
    """hash_now=True: the digest computed in the copy's pass equals BLAKE3
    of the tensor's bytes in C order (what a lazy read computes from the
    segment), for every layout the copy may take (memcpy or torch's)."""
    if layout in ("conj", "neg"):
        if not dtype.is_complex:
            pytest.skip("conjugate and negative bits are for complex tensors")
        base = _raw(dtype)
        t = base.conj() if layout == "conj" else base.conj().imag  # imag of a conj: neg bit
        assert t.is_conj() if layout == "conj" else t.is_neg()
    else:
        t = LAYOUTS[layout](_raw(dtype))
    h = mmshm.ShmTensor.from_tensor(t, hash_now=True)
    assert h.meta.hash == mmshm.content_hash(t)
    assert len(h.meta.hash) == codec.HASH_BYTES
    lazy = mmshm.ShmTensor.from_tensor(t)  # MMSHM_HASH=lazy: nothing computed here
    assert lazy.meta.hash == (b"" if t.numel() else h.meta.hash)  # 0 bytes: known
    assert lazy.hash == h.meta.hash  # read back from the segment
    def raw(x):
        return x.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)

    assert torch.equal(raw(h.clone().materialize(copy=True)), raw(t))
    for x in (h, lazy):
        x.release()


@pytest.mark.parametrize("nbytes", [1, 1023, 1024, 4096 + 7, (256 << 10) - 1, 256 << 10,
                                    (256 << 10) + 1, 3 * (256 << 10) + 12345])
def test_hash_now_across_copy_chunks(pool, nbytes):
    """The chunked copy-and-hash gives BLAKE3 of the whole payload, and the
    exact bytes, at and around the chunk boundaries: into a new file (written
    with pwrite) and into the same segment again from the warm pool (copied
    through the mapping)."""
    import blake3
    from mmshm.segments import shmtensor

    assert shmtensor.COPY_CHUNK == 256 << 10
    names = []
    for seed in (nbytes, nbytes + 1):
        t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed))
        h = mmshm.ShmTensor.from_tensor(t, hash_now=True)
        names.append(h.name)
        assert h.meta.hash == blake3.blake3(t.numpy().tobytes()).digest(16)
        lazy = mmshm.ShmTensor.from_tensor(t)
        assert lazy.hash == h.meta.hash
        assert torch.equal(h.materialize(copy=True), t)
        assert torch.equal(lazy.materialize(copy=True), t)
        del h, lazy
        gc.collect()
    assert names[0] == names[1], "the second round reused the pooled segment"
    TABLE.trim_pool()


def test_a_failed_write_into_a_new_file_is_typed_and_leaves_nothing(shm_dir, monkeypatch):
    """pwrite into a new segment failing (EIO here) raises a SegmentError
    with the errno kept; the segment is given back (unlinked)."""
    from mmshm.segments import shmtensor

    def broken(fd, data, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(shmtensor, "_pwrite", broken)
    with pytest.raises(mmshm.SegmentError) as ei:
        mmshm.ShmTensor.from_tensor(torch.ones(4096), hash_now=True)
    assert ei.value.errno == 5
    monkeypatch.undo()
    gc.collect()
    assert segment_files() == []


def test_hash_now_false_and_given_hashes_win_over_eager(shm_dir, monkeypatch):
    monkeypatch.setenv("MMSHM_HASH", "eager")
    mmshm.config.reload()
    t = make_tensor(44, (64, 64))
    off = mmshm.ShmTensor.from_tensor(t, hash_now=False)
    assert off.meta.hash == b"" and off.hash == mmshm.content_hash(t)
    given = mmshm.ShmTensor.from_tensor(t, hash=b"\x05" * 16, hash_now=True)
    assert given.meta.hash == b"\x05" * 16
    for x in (off, given):
        x.release()


def test_bad_hash_setting_warns_and_uses_the_default(monkeypatch, caplog):
    monkeypatch.setenv("MMSHM_HASH", "sometimes")
    monkeypatch.setattr(mmshm.config, "_warned", set())
    with caplog.at_level("WARNING", logger="mmshm"):
        assert mmshm.config.reload().hash == "lazy"  # a server keeps running
    assert "MMSHM_HASH='sometimes' is not valid: expected lazy or eager" in caplog.text
    with pytest.raises(mmshm.config.SettingError, match="MMSHM_HASH"):
        mmshm.config.check()
    monkeypatch.delenv("MMSHM_HASH")
    mmshm.config.reload()


def test_lazy_hash_needs_the_reference(shm_dir):
    h = mmshm.ShmTensor.from_tensor(make_tensor(44, (64, 64)))
    v = h.materialize()
    with pytest.raises(mmshm.HandleStateError):
        h.hash  # noqa: B018 - the view holds the reference now
    del v
    gc.collect()
    empty = mmshm.ShmTensor.from_tensor(torch.empty(0, 3))
    assert empty.hash == mmshm.content_hash(torch.empty(0, 3))
    empty.release()


def test_lazy_hash_of_a_reused_pool_segment_is_of_the_new_bytes(pool):
    a = make_tensor(45, (256, 256))
    b = make_tensor(46, (256, 256))
    h = mmshm.ShmTensor.from_tensor(a)
    assert h.hash == mmshm.content_hash(a)
    name = h.name
    h.release()  # back to the pool, its digest memoized for the old generation
    h2 = mmshm.ShmTensor.from_tensor(b)
    assert h2.name == name and h2.meta.gen != h.meta.gen  # the same segment, reused
    assert h2.hash == mmshm.content_hash(b) != mmshm.content_hash(a)
    h2.release()
