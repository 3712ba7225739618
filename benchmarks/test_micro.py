"""Microbenchmarks (pytest-benchmark): handle codec, reference operations, and
wrap/unwrap of a 32-image request, beside the physical baselines (warm
memcpy, fresh tmpfs segments, the content hash); observe mode's cost on the
hop it times (one 720p image through pyzmq). Run with

    python -m pytest benchmarks --benchmark-only

They report; they assert only correctness and the wire size. The default
``pytest`` run does not collect them (testpaths is ``tests/``). Compare
ratios within one run (``--benchmark-columns=min,median``), never absolute
times across runs on a shared host.
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import tempfile

import mmshm
import pytest
import torch
from mmshm import config
from mmshm.hooks import observe
from mmshm.segments.segfile import PREFIX
from mmshm.segments.table import TABLE
from mmshm.bench.modes import FRESH_PREFIX, FreshShmPointer, write_fresh_segment

QWEN2VL_720P = (4784, 1176)  # pixel_values of one 720p photo, float32 (22.5 MB)
IMAGES = 32


def _trim() -> None:
    TABLE.trim_pool()
    TABLE.sweep()


@pytest.fixture(autouse=True)
def private_dir(monkeypatch):
    # not "mmshm-*": the test suite's /dev/shm leak check must not see this directory
    d = tempfile.mkdtemp(prefix="pytest-mmshm-micro-", dir="/dev/shm")
    monkeypatch.setenv("MMSHM_DIR", d)
    monkeypatch.setenv("MMSHM_REAP_INTERVAL_S", "0")
    config.reload()
    yield d
    gc.collect()
    _trim()
    left = [n for n in os.listdir(d) if n.startswith(PREFIX)]
    shutil.rmtree(d, ignore_errors=True)
    monkeypatch.undo()
    config.reload()
    assert not left, left


@pytest.fixture(scope="module")
def request_32():
    """A 32-image request shaped like SGLang's: ``mm_items[i]["feature"]``."""
    g = torch.Generator().manual_seed(0)
    return {"rid": "r", "mm_items": [{"feature": torch.rand(*QWEN2VL_720P, generator=g)}
                                     for _ in range(IMAGES)]}


def _payload(req) -> int:
    return sum(it["feature"].numel() * it["feature"].element_size() for it in req["mm_items"])


@pytest.fixture
def handle():
    h = mmshm.ShmTensor.from_tensor(torch.zeros(1024))
    yield h
    h.release()


# -- handle codec ---------------------------------------------------------------
def test_encode(benchmark, handle):
    data = benchmark(handle.encode)
    assert len(data) <= 64


def test_decode(benchmark, handle):
    data = handle.encode()

    def decode():
        h = mmshm.ShmTensor.decode(data)
        h.disown()  # no reference was handed out for it
        return h

    assert benchmark(decode).name == handle.name


def test_encode_decode(benchmark, handle):
    """The per-handle goal: encode plus decode <= 2 us."""

    def roundtrip():
        h = mmshm.ShmTensor.decode(handle.encode())
        h.disown()
        return h

    assert benchmark(roundtrip).name == handle.name


def test_pickled_handle_size(benchmark, handle):
    """What one handle adds to a pickled request (``__reduce__`` has no side effect)."""
    data = benchmark(pickle.dumps, handle, pickle.HIGHEST_PROTOCOL)
    benchmark.extra_info["pickled_bytes"] = len(data)
    benchmark.extra_info["wire_bytes"] = len(handle.encode())


# -- reference operations -------------------------------------------------------
def test_share_release(benchmark, handle):
    """One reference handed out and given back (two locked updates of the count)."""

    def op():
        handle.clone().release()

    benchmark(op)
    clone = handle.clone()
    clone.release()  # the count is back where it was: the handle still releases cleanly


@pytest.mark.parametrize("debug_refs", ["off", "on"])
def test_send_receive_release(benchmark, handle, debug_refs):
    """share(1), pickle, unpickle, release: every path MMSHM_DEBUG_REFS wraps.
    ``off`` runs ShmTensor's own methods (nothing is installed): it is the
    cost without the feature; ``on`` adds the recording (stacks)."""
    from mmshm.segments import refdebug

    if debug_refs == "on":
        refdebug.install()
    assert refdebug.installed() == (debug_refs == "on")

    def op():
        handle.share(1)
        pickle.loads(pickle.dumps(handle, pickle.HIGHEST_PROTOCOL)).release()

    try:
        benchmark(op)
    finally:
        refdebug.uninstall()


def test_share_8(benchmark, handle):
    """The fan-out of n=8 hands out 7 references in one locked update."""

    def op():
        handle.share(7)
        for _ in range(7):
            handle.twin().release()

    benchmark(op)


# -- a 32-image request -----------------------------------------------------------
def _release_all(state: list) -> None:
    while state:
        mmshm.release(state.pop())


@pytest.mark.parametrize("hashing", ["lazy", "eager"])
def test_wrap_32_images(benchmark, request_32, hashing):
    """The producer's write of 32 720p images (720 MB) into shared memory;
    after the warm-up round the segments come from the warm pool. ``lazy``
    (the default, ``MMSHM_HASH=lazy``) computes no hash; ``eager`` reads every
    handle's BLAKE3 hash right after the wrap, the cost of ``MMSHM_HASH=eager``."""
    state: list = []

    def setup():
        _release_all(state)
        TABLE.sweep()

    def wrap():
        w = mmshm.wrap(request_32)
        if hashing == "eager":
            for h in mmshm.handles(w):
                h.hash  # noqa: B018 - computes it
        state.append(w)
        return w

    w = benchmark.pedantic(wrap, setup=setup, rounds=3, warmup_rounds=1, iterations=1)
    hs = mmshm.handles(w)
    assert len(hs) == IMAGES
    assert all(len(h.meta.hash) == (16 if hashing == "eager" else 0) for h in hs)
    benchmark.extra_info["bytes"] = _payload(request_32)
    _release_all(state)


def test_wrap_32_images_hash_given(benchmark, request_32):
    """What :func:`test_wrap_32_images` would cost if wrap took the hashes the
    request already carries (SGLang's ``item.hash``): 32 ``from_tensor(hash=...)``
    into warm pooled segments, no BLAKE3 pass over the payload."""
    hashes = [mmshm.content_hash(it["feature"]) for it in request_32["mm_items"]]
    state: list = []

    def setup():
        while state:
            state.pop().release()
        TABLE.sweep()

    def wrap():
        for it, h in zip(request_32["mm_items"], hashes, strict=True):
            state.append(mmshm.ShmTensor.from_tensor(it["feature"], hash=h))

    benchmark.pedantic(wrap, setup=setup, rounds=3, warmup_rounds=1, iterations=1)
    benchmark.extra_info["bytes"] = _payload(request_32)
    setup()


def test_pickle_request_32_handles(benchmark, request_32):
    """A 32-image request through a metadata-only broadcast, per receiver: the
    giver's ``share(1)`` per handle, pickle.dumps and pickle.loads of the
    wrapped request (handles unpickle without I/O), and the receiver's release."""
    w = mmshm.wrap(request_32)
    hs = mmshm.handles(w)

    def roundtrip():
        for h in hs:
            h.share(1)  # the reference the unpickled copy will own
        out = pickle.loads(pickle.dumps(w, pickle.HIGHEST_PROTOCOL))
        mmshm.release(out)
        return out

    benchmark(roundtrip)
    benchmark.extra_info["pickled_bytes"] = len(pickle.dumps(w, pickle.HIGHEST_PROTOCOL))
    mmshm.release(w)


def test_unwrap_32_images(benchmark, request_32):
    """Every TP rank's side: 32 zero-copy views of the segments."""
    wrapped: list = []

    def setup():
        _release_all(wrapped)
        gc.collect()
        wrapped.append(mmshm.wrap(request_32))
        return (wrapped[-1],), {}

    out = benchmark.pedantic(mmshm.unwrap, setup=setup, rounds=3, warmup_rounds=1,
                             iterations=1)
    assert torch.equal(out["mm_items"][5]["feature"], request_32["mm_items"][5]["feature"])
    del out
    _release_all(wrapped)


def test_wrap_unwrap_32_images(benchmark, request_32):
    def roundtrip():
        w = mmshm.wrap(request_32)
        out = mmshm.unwrap(w)
        del w
        return out

    out = benchmark.pedantic(roundtrip, rounds=3, warmup_rounds=1, iterations=1)
    assert torch.equal(out["mm_items"][5]["feature"], request_32["mm_items"][5]["feature"])


# -- physical baselines for the same 32 images ---------------------------------------
def test_memcpy_32_images_warm(benchmark, request_32):
    """The floor: the payload copied into warm (pre-faulted) memory."""
    dst = torch.empty(_payload(request_32), dtype=torch.uint8)
    dst.fill_(0)

    def copy():
        off = 0
        for it in request_32["mm_items"]:
            f = it["feature"].reshape(-1).view(torch.uint8)
            dst[off:off + f.numel()].copy_(f)
            off += f.numel()

    benchmark.pedantic(copy, rounds=5, warmup_rounds=1, iterations=1)
    benchmark.extra_info["bytes"] = dst.numel()


def test_fresh_segments_32_images(benchmark, request_32, private_dir):
    """SGLang 0.5.23's per-request cost, once (the fresh-segment mode pays it
    n+1 times): create, fallocate, map and copy into fresh tmpfs pages."""

    def fresh():
        names = [write_fresh_segment(it["feature"], private_dir) for it in request_32["mm_items"]]
        for name in names:
            os.unlink(os.path.join(private_dir, name))

    benchmark.pedantic(fresh, rounds=3, iterations=1)
    assert not [n for n in os.listdir(private_dir) if n.startswith(FRESH_PREFIX)]


def test_content_hash_32_images(benchmark, request_32):
    """BLAKE3-128 of the 32 images: what wrap pays per byte besides the copy
    when the caller does not pass the hash it already has."""
    hashes = benchmark.pedantic(
        lambda: [mmshm.content_hash(it["feature"]) for it in request_32["mm_items"]],
        rounds=3, iterations=1)
    assert len(set(hashes)) == IMAGES


@pytest.mark.parametrize("hashing", ["lazy", "eager", "now", "given"])
def test_from_tensor_one_image(benchmark, request_32, hashing):
    """One 720p image into a (warm, pooled) segment: no hash (lazy), the
    content hash read from the segment right after (eager), computed in the
    copy's pass (now: ``hash_now=True``, what SGLang's tokenizer asks), or
    handed in by the caller."""
    t = request_32["mm_items"][0]["feature"]
    h = mmshm.content_hash(t) if hashing == "given" else None

    def make():
        s = mmshm.ShmTensor.from_tensor(t, hash=h, hash_now=hashing == "now")
        if hashing in ("eager", "now"):
            assert s.hash  # "eager" computes it here
        s.release()

    benchmark.pedantic(make, rounds=5, warmup_rounds=1, iterations=1)


@pytest.mark.parametrize("hash_now", [False, True], ids=["copy", "copy+hash"])
@pytest.mark.parametrize("threads", ["1", "2", "4"])
def test_from_tensor_8_images_copy_threads(benchmark, request_32, monkeypatch, threads, hash_now):
    """Eight 720p images (180 MB) into warm pooled segments on ``threads``
    copy threads (``MMSHM_COPY_THREADS``, capped by the affinity: the test
    id is the setting, ``extra_info`` the threads used), the hash asked for
    now or not: how the copy and the hash scale with the host's cores (a
    2-CPU host caps 4 at 2). The digest is the same on any thread count."""
    from mmshm.segments import shmtensor

    monkeypatch.setenv("MMSHM_COPY_THREADS", threads)
    config.reload()
    benchmark.extra_info["threads"] = shmtensor.copy_threads()
    ts = [it["feature"] for it in request_32["mm_items"][:8]]
    digests = []

    def make():
        hs = [mmshm.ShmTensor.from_tensor(t, hash_now=hash_now) for t in ts]
        digests.append([h.meta.hash for h in hs])
        for h in hs:
            h.release()

    benchmark.pedantic(make, rounds=5, warmup_rounds=1, iterations=1)
    if hash_now:
        assert digests[-1] == [mmshm.content_hash(t) for t in ts]


def test_fresh_pointer_materialize_copy_on_write(private_dir):
    """Not a benchmark: the baseline's pointer is copy-on-write and unlinks."""
    t = torch.arange(1000, dtype=torch.float32)
    name = write_fresh_segment(t, private_dir)
    p = pickle.loads(pickle.dumps(FreshShmPointer(name, t.shape, t.dtype, private_dir)))
    out = p.materialize()
    out[0] = -1.0
    assert torch.equal(out[1:], t[1:]) and not os.listdir(private_dir)


# -- observe mode: what timing a hop adds to it ---------------------------------------
@pytest.fixture
def zmq_pair():
    """A pyzmq PAIR pair over ``ipc://`` in a private directory: the transport
    of SGLang's tokenizer-to-scheduler messages."""
    zmq = pytest.importorskip("zmq")
    d = tempfile.mkdtemp(prefix="pytest-mmshm-zmq-")
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        b.bind(f"ipc://{d}/pair")
        a.connect(f"ipc://{d}/pair")
        yield a, b
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def pixel_values_720p():
    """One message of one 720p photo: Qwen2-VL's pixel_values, float32 (22.5 MB)."""
    g = torch.Generator().manual_seed(1)
    return {"rid": "r", "pixel_values": torch.rand(*QWEN2VL_720P, generator=g)}


def _observe_mode(monkeypatch) -> None:
    monkeypatch.setenv("MMSHM_MODE", "observe")  # undone (and reloaded) by private_dir
    config.reload()
    assert observe.observing()


def _ipc(sample: str, hop_name: str) -> float:
    """``mmshm_ipc_<sample>{server="bench",hop=hop_name,transport="server"}``, 0 if none."""
    from prometheus_client import REGISTRY

    labels = {"server": "bench", "hop": hop_name, "transport": observe.SERVER}
    return REGISTRY.get_sample_value(f"mmshm_ipc_{sample}", labels) or 0.0


@pytest.mark.parametrize("mode", ["plain", "observe"])
def test_observe_zmq_720p(benchmark, zmq_pair, pixel_values_720p, monkeypatch, mode):
    """``send_pyobj`` and ``recv_pyobj`` of one 720p message over ``ipc://``, in
    one thread. ``plain``: pyzmq alone (nothing is installed); ``observe``: the
    same calls, each inside ``zmq_hop`` with the taps installed and
    ``MMSHM_MODE=observe``, as SGLang's ``tokenizer_send`` and
    ``scheduler_recv`` are timed: their ratio is observe mode's overhead on the
    hops it times."""
    a, b = zmq_pair
    msg = pixel_values_720p
    if mode == "observe":
        _observe_mode(monkeypatch)
        assert observe.install_taps() == []

        def op():
            with observe.zmq_hop("bench", "send"):
                a.send_pyobj(msg)
            with observe.zmq_hop("bench", "recv"):
                return b.recv_pyobj()
    else:
        def op():
            a.send_pyobj(msg)
            return b.recv_pyobj()

    sent, received = _ipc("seconds_count", "send"), _ipc("seconds_count", "recv")
    nbytes = _ipc("bytes_sum", "send")
    try:
        out = benchmark.pedantic(op, rounds=30, warmup_rounds=3, iterations=1)
    finally:
        observe.remove_taps()
    assert torch.equal(out["pixel_values"], msg["pixel_values"])
    n = _ipc("seconds_count", "send") - sent
    wire = len(pickle.dumps(msg, pickle.DEFAULT_PROTOCOL))
    assert _ipc("seconds_count", "recv") - received == n and (n >= 1) == (mode == "observe")
    assert _ipc("bytes_sum", "send") - nbytes == n * wire  # pyzmq's own bytes, once a message
    benchmark.extra_info["pickled_bytes"] = wire


def test_observe_empty_hop(benchmark, monkeypatch):
    """The fixed cost of timing one message: an empty ``with observe.hop(...)``
    (two ``perf_counter`` calls, a context variable set and reset, and the two
    histogram observations)."""
    _observe_mode(monkeypatch)

    def op():
        with observe.hop("bench", "empty"):
            pass

    before = _ipc("seconds_count", "empty")
    benchmark(op)
    assert _ipc("seconds_count", "empty") > before
