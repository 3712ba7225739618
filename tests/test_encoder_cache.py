"""The content-keyed encoder-output store (:mod:`mmshm.transport.encoder_cache`).

Producers and consumers are separate processes (spawned), as an encoder
instance and a prefill instance are; every test runs in the private segment
directory of the conftest and leaves it empty.
"""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch

from mmshm import config
from mmshm.segments import reaper
from mmshm.segments.segfile import NAME_RE
from mmshm.transport import encoder_cache as ec

from tests.harness.metrics import metric
from tests.harness.procs import spawn, stop_all
from tests.harness.segments import segment_files

pytestmark = pytest.mark.timeout(120)


def _item(seed: int, rows: int = 64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(rows * 4, 48, generator=g),
            "image_grid_thw": torch.tensor([[1, rows // 2, 8]])}


def _output(seed: int, rows: int = 64, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randn(rows, 96, generator=g).to(dtype)


def _fallbacks(reason: str) -> float:
    return metric("mmshm_epd_fallbacks_total", server="vllm", reason=reason)


# -- children (spawned: importable by name) ---------------------------------------------
def producer(conn, seeds, dtype_name: str, keep_s: float) -> None:
    """Publish the output of each seed's item, report the names, wait for
    "exit" (a clean exit gives every reference back)."""
    dtype = getattr(torch, dtype_name)
    store = ec.EncoderCache(keep_s=keep_s)
    names = []
    for s in seeds:
        res = store.save(ec.content_key(_item(s), "m"), _output(s, dtype=dtype), f"img-{s}")
        names.append((res.published, res.name, res.nbytes))
    conn.send(names)
    conn.recv()


def producer_killed_mid_write(conn, seed: int) -> None:
    """Write half of the payload, then SIGKILL itself (a producer killed
    in the middle of a write)."""
    def half_then_die(fd, offset, src, hasher=None):
        os.pwrite(fd, memoryview(src)[: len(src) // 2], offset)
        conn.send(os.getpid())
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    ec.write_and_hash = half_then_die
    ec.EncoderCache().save(ec.content_key(_item(seed), "m"), _output(seed), "img")


def _start_producer(seeds, dtype_name="float32", keep_s=60.0):
    import multiprocessing as mp

    a, b = mp.get_context("spawn").Pipe()
    p = spawn(producer, b, list(seeds), dtype_name, keep_s)
    assert a.poll(60), "the producer did not report"
    return p, a, a.recv()


def _finish(p, conn) -> None:
    conn.send("exit")
    stop_all([p], timeout=20)
    assert p.exitcode == 0


# -- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_round_trip_across_processes_is_zero_copy_and_byte_equal(shm_dir, dtype_name):
    dtype = getattr(torch, dtype_name)
    p, conn, names = _start_producer([1, 2], dtype_name)
    try:
        assert [n[0] for n in names] == [True, True]
        for (_, name, nbytes), s in zip(names, [1, 2]):
            # the name is the key's alone: a consumer opens it without listing
            assert NAME_RE.match(name) and name.split("-")[1] == str(ec.PUBLISHED_PID)
            assert name.endswith(ec.content_key(_item(s), "m").hex()[:16])
            assert nbytes == _output(s, dtype=dtype).numel() * dtype.itemsize
        # only the two published names: no temporary name is left behind
        assert sorted(segment_files(shm_dir)) == sorted(n[1] for n in names)
        store = ec.EncoderCache()
        loads0 = metric("mmshm_epd_loads_total", server="vllm")
        bytes0 = metric("mmshm_epd_bytes_total", server="vllm", direction="loaded")
        for s in (1, 2):
            entry = store.lookup(ec.content_key(_item(s), "m"), dtype, 64)
            assert entry is not None and entry.label == f"img-{s}"
            t = entry.handle().load()
            want = _output(s, dtype=dtype)
            assert t.dtype == dtype and t.shape == want.shape
            assert torch.equal(t.view(torch.uint8), want.view(torch.uint8))
            t.add_(1)  # copy-on-write: a consumer's write never reaches the segment
            again = entry.load()
            assert torch.equal(again.view(torch.uint8), want.view(torch.uint8))
            del t, again
            entry.release()
        assert metric("mmshm_epd_loads_total", server="vllm") - loads0 == 4
        assert (metric("mmshm_epd_bytes_total", server="vllm", direction="loaded") - bytes0
                == 2 * sum(n[2] for n in names))
    finally:
        _finish(p, conn)
    gc.collect()
    assert segment_files(shm_dir) == []  # the clean exit gave the creator's references back


def test_same_content_is_written_once_and_other_content_is_never_found(shm_dir):
    saves0 = metric("mmshm_epd_saves_total", server="vllm")
    missing0 = _fallbacks("missing")
    store = ec.EncoderCache()
    k1, k2 = ec.content_key(_item(1), "m"), ec.content_key(_item(2), "m")
    r1 = store.save(k1, _output(1), "renderer0-mm-0-image-0")
    again = store.save(k1, _output(1), "renderer0-mm-5-image-0")  # the same photo, new name
    assert r1.published and again.published and again.name == r1.name and again.nbytes == 0
    assert metric("mmshm_epd_saves_total", server="vllm") - saves0 == 1
    assert len(segment_files(shm_dir)) == 1
    # keys depend on every byte, the field names and the namespace
    assert ec.content_key(_item(1), "other model") != k1
    moved = _item(1)
    moved["pixel_values"][0, 0] += 1
    assert ec.content_key(moved, "m") != k1
    assert store.lookup(k2) is None and store.lookup(ec.content_key(moved, "m")) is None
    assert _fallbacks("missing") - missing0 == 2
    store.close()
    assert segment_files(shm_dir) == []


def test_a_name_holding_other_content_is_a_counted_miss(shm_dir):
    store = ec.EncoderCache()
    k1 = ec.content_key(_item(1), "m")
    store.save(k1, _output(1), "img-1")
    # another key with the same 64 bits of name: it resolves to k1's segment
    k_same_name = k1[:8] + bytes(b ^ 0xFF for b in k1[8:])
    assert ec.published_name(k_same_name) == ec.published_name(k1)
    before = _fallbacks("content_mismatch")
    assert store.lookup(k_same_name) is None
    assert _fallbacks("content_mismatch") - before == 1
    store.close()


def test_incompatible_dtype_or_rows_is_a_counted_miss(shm_dir):
    store = ec.EncoderCache()
    k = ec.content_key(_item(1), "m")
    store.save(k, _output(1), "img-1")
    before = _fallbacks("incompatible")
    assert store.lookup(k, torch.float16, 64) is None
    assert store.lookup(k, torch.float32, 65) is None
    assert _fallbacks("incompatible") - before == 2
    e = store.lookup(k, torch.float32, 64)
    assert e is not None
    e.release()
    store.close()


def test_a_producer_killed_mid_write_leaves_nothing_loadable_and_is_reclaimed(shm_dir):
    import multiprocessing as mp

    a, b = mp.get_context("spawn").Pipe()
    p = spawn(producer_killed_mid_write, b, 3)
    assert a.poll(60)
    a.recv()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    left = segment_files(shm_dir)
    assert len(left) == 1 and not left[0].endswith(
        ec.content_key(_item(3), "m").hex()[:16])  # only its temporary name
    before = _fallbacks("missing")
    assert ec.EncoderCache().lookup(ec.content_key(_item(3), "m")) is None
    assert _fallbacks("missing") - before == 1
    rep = reaper.reap(shm_dir)
    assert rep.reasons["killed"] == 1 and segment_files(shm_dir) == []


def test_an_entry_survives_its_producer_while_held_and_goes_with_the_last_holder(shm_dir):
    p, conn, names = _start_producer([4])
    k = ec.content_key(_item(4), "m")
    store = ec.EncoderCache()
    entry = store.lookup(k, torch.float32, 64)
    assert entry is not None
    t = entry.load()
    os.kill(p.pid, signal.SIGKILL)
    p.join(20)
    assert reaper.reap(shm_dir).reclaimed == 0  # held here: never reclaimed
    assert torch.equal(t, _output(4))
    # a complete entry of a dead producer is still the right bytes for a new holder
    second = store.lookup(k, torch.float32, 64)
    assert second is not None and torch.equal(second.load(), _output(4))
    second.release()
    entry.release()
    del t
    gc.collect()
    rep = reaper.reap(shm_dir)
    assert rep.reasons["killed"] == 1 and segment_files(shm_dir) == []
    before = _fallbacks("missing")
    assert store.lookup(k) is None  # gone: the consumer encodes it itself
    assert _fallbacks("missing") - before == 1


def test_keep_time_then_the_last_holder_frees_the_segment(shm_dir):
    store = ec.EncoderCache(keep_s=0.3)
    k1, k2 = ec.content_key(_item(1), "m"), ec.content_key(_item(2), "m")
    store.save(k1, _output(1), "a")
    store.save(k2, _output(2), "b")
    held = store.lookup(k1)
    view = held.load()
    deadline = time.monotonic() + 10
    while store.published() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.published() == []
    # k2 nobody held: gone; k1 is held (scheduler reference + the view's): still there
    gc.collect()
    assert segment_files(shm_dir) == [ec.published_name(k1)]
    held.release()
    assert segment_files(shm_dir) == [ec.published_name(k1)]  # the view still holds it
    assert torch.equal(view, _output(1))
    del view
    gc.collect()
    assert segment_files(shm_dir) == []
    assert store.lookup(k1, count=False) is None


def test_over_budget_is_not_published_and_counted_then_evicts_oldest(shm_dir, monkeypatch):
    one = _output(1).numel() * 4 + ec.RECORD_SIZE + 4096
    monkeypatch.setenv("MMSHM_MAX_BYTES", str(one + one // 2))
    config.reload()
    store = ec.EncoderCache()
    before = _fallbacks("over_budget")
    big = store.save(ec.content_key(_item(9), "m"), torch.zeros(1 << 20), "too big")
    assert not big.published and big.reason == "over_budget"
    assert _fallbacks("over_budget") - before == 1
    assert segment_files(shm_dir) == []
    k1, k2 = ec.content_key(_item(1), "m"), ec.content_key(_item(2), "m")
    assert store.save(k1, _output(1), "a").published
    r2 = store.save(k2, _output(2), "b")  # does not fit beside the first: evicts it
    assert r2.published and _fallbacks("over_budget") - before == 1
    assert store.lookup(k1, count=False) is None
    e = store.lookup(k2)
    assert e is not None
    e.release()
    store.close()
    assert segment_files(shm_dir) == []


def test_a_torn_or_foreign_file_under_the_name_is_a_miss_not_a_crash(shm_dir):
    k = ec.content_key(_item(5), "m")
    path = os.path.join(shm_dir, ec.published_name(k))
    with open(path, "wb") as f:
        f.write(b"MMSHMSG\x01" + b"\0" * 100)  # a truncated header
    before = _fallbacks("torn")
    assert ec.EncoderCache().lookup(k) is None
    assert _fallbacks("torn") - before == 1
    os.unlink(path)


def test_counters_equal_the_events(shm_dir):
    saves0 = metric("mmshm_epd_saves_total", server="vllm")
    bytes0 = metric("mmshm_epd_bytes_total", server="vllm", direction="saved")
    secs0 = metric("mmshm_epd_transfer_seconds_count", server="vllm")
    d2h0 = metric("mmshm_gpu_copy_bytes_total", direction="d2h")
    store = ec.EncoderCache()
    n = 0
    for s in range(3):
        r = store.save(ec.content_key(_item(s), "m"), _output(s), str(s))
        n += r.nbytes
    store.save(ec.content_key(_item(0), "m"), _output(0), "again")
    assert metric("mmshm_epd_saves_total", server="vllm") - saves0 == 3
    assert metric("mmshm_epd_bytes_total", server="vllm", direction="saved") - bytes0 == n
    assert metric("mmshm_epd_transfer_seconds_count", server="vllm") - secs0 == 3
    # CPU outputs: no device copy counted (a GPU output's D2H: tests/test_arena_epd.py)
    assert metric("mmshm_gpu_copy_bytes_total", direction="d2h") == d2h0
    store.close()


def test_max_bytes_caps_only_the_encoder_cache(shm_dir):
    one = _output(1).numel() * 4 + ec.RECORD_SIZE
    store = ec.EncoderCache(max_bytes=one + one // 2)
    before = _fallbacks("over_budget")
    big = store.save(ec.content_key(_item(9), "m"), torch.zeros(1 << 16), "too big")
    assert not big.published and big.reason == "over_budget"
    assert _fallbacks("over_budget") - before == 1
    k1, k2 = ec.content_key(_item(1), "m"), ec.content_key(_item(2), "m")
    assert store.save(k1, _output(1), "a").published
    assert store.save(k2, _output(2), "b").published  # the oldest made room
    assert store.published() == [ec.published_name(k2)]
    assert store.lookup(k1, count=False) is None
    store.close()
    assert segment_files(shm_dir) == []


def test_the_warm_pool_reuses_entries_and_a_stale_record_is_never_loaded(shm_dir, pool):
    from mmshm.segments.shmtensor import ShmTensor

    hits0 = metric("mmshm_pool_requests_total", result="hit")
    store = ec.EncoderCache()
    k1, k2, k3 = (ec.content_key(_item(s), "m") for s in (1, 2, 3))
    assert store.save(k1, _output(1), "a").published
    assert store.evict(k1)  # count 0: back to the pool, pages kept, name still there
    gone0 = _fallbacks("segment_gone")
    assert store.lookup(k1) is None  # pooled: not live, a miss
    assert _fallbacks("segment_gone") - gone0 == 1
    r2 = store.save(k2, _output(2), "b")  # the pooled segment again, renamed
    assert r2.published and metric("mmshm_pool_requests_total", result="hit") - hits0 == 1
    assert segment_files(shm_dir) == [ec.published_name(k2)]
    e = store.lookup(k2)
    assert torch.equal(e.load(), _output(2))
    e.release()
    gc.collect()
    # reused by other traffic of the process: the name and the old record stay,
    # the generation moves on, so the old entry is a miss, never the new bytes.
    # (A segment of 1600 rows: its size class has room for a shorter tensor
    # that leaves the record at the payload's end untouched.)
    big = _output(4, rows=1600)
    k4 = ec.content_key(_item(4), "big")
    assert store.save(k4, big, "d").published
    assert store.evict(k4)
    other = ShmTensor.from_tensor(torch.full((150_000,), 7.0))
    assert metric("mmshm_pool_requests_total", result="hit") - hits0 == 2
    assert ec.published_name(k4) in segment_files(shm_dir)
    assert store.lookup(k4) is None
    assert _fallbacks("segment_gone") - gone0 == 2
    other.release()
    assert store.save(k3, _output(3), "c").published
    e = store.lookup(k3)
    assert torch.equal(e.load(), _output(3))
    e.release()
    store.close()


@pytest.mark.parametrize("use_pool", [False, True])
def test_a_large_output_fresh_and_pooled_is_byte_equal(shm_dir, monkeypatch, use_pool):
    monkeypatch.setenv("MMSHM_POOL", "1" if use_pool else "0")
    config.reload()
    store = ec.EncoderCache()
    for s in (1, 2):  # the second one reuses the first's segment from the pool
        k, want = ec.content_key(_item(s), "big"), _output(s, rows=24_000, dtype=torch.bfloat16)
        assert want.nbytes >= ec.PARALLEL_MIN_BYTES  # the threaded copy
        assert store.save(k, want, str(s)).published
        e = store.lookup(k, torch.bfloat16, 24_000)
        got = e.load()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        del got
        e.release()
        gc.collect()
        store.evict(k)
    store.close()
    from mmshm.segments.table import TABLE

    TABLE.trim_pool()


# -- the directory setting: handles name the node of their own directory --------------------
@pytest.fixture
def other_dir():
    """A second segment directory (another node id than MMSHM_DIR's: the
    directory is part of a node's identity), removed after the test."""
    import secrets
    import shutil

    d = os.path.join("/dev/shm", f"pytest-ec-other-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(d, 0o700)
    try:
        yield d
    finally:
        left = segment_files(d)
        shutil.rmtree(d, ignore_errors=True)
        assert left == [], left


def test_a_store_in_another_directory_than_mmshm_dir_loads_its_own_handles(shm_dir, other_dir):
    from mmshm.segments import node

    assert node.node_id(other_dir) != node.node_id(None)  # two directories, two node ids
    p, conn, names = _start_producer_in([7], other_dir)
    try:
        assert names[0][0] and segment_files(other_dir) == [names[0][1]]
        assert segment_files(shm_dir) == []
        store = ec.EncoderCache(other_dir)
        entry = store.lookup(ec.content_key(_item(7), "m"), torch.float32, 64)
        assert entry is not None
        h = entry.handle()
        t = h.load()  # as a worker does with the handle its scheduler sent
        assert torch.equal(t, _output(7))
        del t
        gc.collect()
        entry.release()
        store.close()
    finally:
        _finish(p, conn)
    assert segment_files(other_dir) == []  # no reference leaked


def producer_in(conn, seeds, directory, keep_s: float) -> None:
    store = ec.EncoderCache(directory, keep_s=keep_s)
    out = []
    for s in seeds:
        r = store.save(ec.content_key(_item(s), "m"), _output(s), f"img-{s}")
        out.append((r.published, r.name, r.nbytes))
    conn.send(out)
    while True:
        cmd = conn.recv()
        if cmd == "exit":
            return
        if cmd[0] == "evict":
            conn.send(store.evict(ec.content_key(_item(cmd[1]), "m")))
        elif cmd[0] == "save":
            r = store.save(ec.content_key(_item(cmd[1]), "m"), _output(cmd[1]), "again")
            conn.send((r.published, r.name, r.nbytes))
        elif cmd[0] == "published":
            conn.send(store.published())


def _start_producer_in(seeds, directory=None, keep_s=60.0):
    import multiprocessing as mp

    a, b = mp.get_context("spawn").Pipe()
    p = spawn(producer_in, b, list(seeds), directory, keep_s)
    assert a.poll(60), "the producer did not report"
    return p, a, a.recv()


def _ask(conn, *cmd):
    conn.send(cmd)
    assert conn.poll(30), cmd
    return conn.recv()


# -- the warm pool: the same content again after the keep time --------------------------------
def test_content_saved_again_after_its_keep_time_is_published_and_found(shm_dir, pool):
    store = ec.EncoderCache(keep_s=0.2)
    k1, k2 = ec.content_key(_item(1), "m"), ec.content_key(_item(2), "m")
    # k2 first, so that its idle segment is the pool's first candidate for k1
    assert store.save(k2, _output(2), "b").published
    assert store.save(k1, _output(1), "a").published
    deadline = time.monotonic() + 10
    while store.published() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.published() == []
    # both idle in the pool, under their published names
    assert sorted(segment_files(shm_dir)) == sorted([ec.published_name(k1),
                                                     ec.published_name(k2)])
    before = {r: _fallbacks(r) for r in ("no_space", "name_taken")}
    again = store.save(k1, _output(1), "a again")
    assert again.published and again.name == ec.published_name(k1) and again.nbytes > 0
    assert {r: _fallbacks(r) for r in before} == before
    e = store.lookup(k1, torch.float32, 64)
    assert e is not None and torch.equal(e.load(), _output(1))
    e.release()
    gc.collect()
    store.close()
    assert segment_files(shm_dir) == []


def test_another_producers_idle_segment_under_the_name_is_replaced(shm_dir, pool):
    p, conn, names = _start_producer_in([3], keep_s=0.2)
    try:
        deadline = time.monotonic() + 10
        while _ask(conn, "published") and time.monotonic() < deadline:
            time.sleep(0.05)
        k = ec.content_key(_item(3), "m")
        assert segment_files(shm_dir) == [ec.published_name(k)]  # idle in its pool
        store = ec.EncoderCache()
        r = store.save(k, _output(3), "mine now")
        assert r.published and r.nbytes > 0 and r.name == ec.published_name(k)
        e = store.lookup(k, torch.float32, 64)
        assert e is not None and e.label == "mine now" and torch.equal(e.load(), _output(3))
        e.release()
        gc.collect()
        # the other producer's pool let go of the segment it no longer names
        assert _ask(conn, "save", 4)[0]
        store.close()
    finally:
        _finish(p, conn)
    assert segment_files(shm_dir) == []


# -- a second producer keeps a reference -------------------------------------------------------
def test_a_second_producer_keeps_the_entry_alive_for_its_own_keep_time(shm_dir):
    p, conn, names = _start_producer_in([5], keep_s=60.0)
    k = ec.content_key(_item(5), "m")
    second = ec.EncoderCache(keep_s=60.0)
    try:
        r = second.save(k, _output(5), "second encoder")
        assert r.published and r.nbytes == 0 and r.name == names[0][1]
        assert second.published() == [r.name]
        assert _ask(conn, "evict", 5)  # the first producer lets go
        e = second.lookup(k, torch.float32, 64)
        assert e is not None and torch.equal(e.load(), _output(5))  # kept for the second
        e.release()
        gc.collect()
    finally:
        _finish(p, conn)
    assert segment_files(shm_dir) == [names[0][1]]  # still kept after the first exited
    second.keep_s = 0.1
    assert second.save(k, _output(5), "again").nbytes == 0  # refreshes its keep time
    deadline = time.monotonic() + 10
    while second.published() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert second.published() == [] and segment_files(shm_dir) == []  # gone with it
    second.close()


# -- the payload digest, dtype and shape --------------------------------------------------------
def test_another_items_bytes_under_a_valid_record_are_never_loaded(shm_dir):
    from mmshm.segments.segfile import HEADER_SIZE

    store = ec.EncoderCache()
    k1, k2 = ec.content_key(_item(1), "m"), ec.content_key(_item(2), "m")
    store.save(k1, _output(1, rows=2048), "a")
    store.save(k2, _output(2, rows=2048), "b")
    held = store.lookup(k1, torch.float32, 2048)  # a scheduler's entry, before the swap
    handle = held.handle()
    swapped = _output(2, rows=2048).view(torch.uint8).numpy().tobytes()
    fd = os.open(os.path.join(shm_dir, ec.published_name(k1)), os.O_RDWR)
    try:
        os.pwrite(fd, swapped, HEADER_SIZE)  # the other photo's output, record left alone
    finally:
        os.close(fd)
    before = _fallbacks("digest")
    assert store.lookup(k1, torch.float32, 2048) is None  # a miss, counted
    assert _fallbacks("digest") - before == 1
    loads0 = metric("mmshm_epd_loads_total", server="vllm")
    with pytest.raises(ec.EncoderCacheError) as ei:
        handle.load()  # a worker's load after the swap: one failed load, never the bytes
    assert ei.value.reason == "digest" and isinstance(ei.value, OSError)
    assert _fallbacks("digest") - before == 2
    assert metric("mmshm_epd_loads_total", server="vllm") == loads0
    held.release()
    gc.collect()
    store.close()
    assert segment_files(shm_dir) == []


def test_the_digest_samples_pages_drawn_from_the_key():
    k1, k2 = ec.content_key(_item(1), "m"), ec.content_key(_item(2), "m")
    n = 8_573_952  # one 720p photo's Qwen2-VL-7B output, [1196, 3584] bf16
    p1, p2 = ec.sampled_pages(k1, n), ec.sampled_pages(k2, n)
    pages = -(-n // 4096)
    assert len(p1) == ec.SAMPLE_PAGES + 2 and p1[0] == 0 and p1[-1] == pages - 1
    assert p1 == sorted(p1) and p1 != p2 and p1 == ec.sampled_pages(k1, n)
    assert ec.sampled_pages(k1, 3 * 4096) == [0, 1, 2]  # small payloads: every page


def test_another_dtype_or_width_is_a_counted_miss(shm_dir):
    store = ec.EncoderCache()
    k = ec.content_key(_item(1), "m")
    store.save(k, _output(1), "img-1")  # [64, 96] float32
    before = _fallbacks("incompatible")
    assert store.lookup(k, torch.bfloat16, 64, shape=(64, 96)) is None
    assert store.lookup(k, torch.float32, 64, shape=(64, 95)) is None  # another hidden size
    assert store.lookup(k, torch.float32, 64, shape=(64, 96, 1)) is None
    assert _fallbacks("incompatible") - before == 3
    for shape in ((64, 96), (None, 96), (-1, 96), None):
        e = store.lookup(k, torch.float32, 64, shape=shape)
        assert e is not None, shape
        e.release()
    store.close()


# -- lookups and saves open names, never list the directory --------------------------------------
def test_saves_and_lookups_never_list_the_segment_directory(shm_dir, pool, monkeypatch):
    store = ec.EncoderCache(keep_s=0.1)
    store.save(ec.content_key(_item(0), "m"), _output(0), "first")  # the first use's reap
    listed = []
    real = os.listdir

    def spy(path="."):
        listed.append(path)
        return real(path)

    monkeypatch.setattr(os, "listdir", spy)
    monkeypatch.setattr(os, "scandir", lambda *a: pytest.fail("scandir"))
    for s in range(1, 6):
        assert store.save(ec.content_key(_item(s), "m"), _output(s), str(s)).published
    for s in range(0, 8):
        e = store.lookup(ec.content_key(_item(s), "m"), count=False)
        assert (e is not None) == (s < 6)
        if e is not None:
            e.release()
    assert [p for p in listed if os.path.realpath(p) == os.path.realpath(shm_dir)] == []
    monkeypatch.undo()
    store.close()


# -- operators: a full producer queue, a pair that cannot meet, the hit ratio --------------------
def test_a_producer_queue_past_its_limit_says_so_once_and_counts(caplog):
    q = ec.KeyQueue(limit=4)
    before = _fallbacks("queue_full")
    for i in range(4):
        q.put(f"item-{i}", bytes([i]) * 32)
    assert q.get("item-0") == bytes(32)  # taken: its output is being published
    with caplog.at_level("DEBUG", logger="mmshm"):
        for i in range(4, 7):
            q.put(f"item-{i}", bytes([i]) * 32)
    # item-0 (taken) and item-1, item-2 (never taken) dropped: two outputs never published
    assert q.dropped == 2 and _fallbacks("queue_full") - before == 2
    assert "item-0" not in q and q.get("item-6") == bytes([6]) * 32 and len(q) == 4
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "queue_full" in
              r.getMessage()]
    assert len(warned) <= 1  # once per process (maybe said by an earlier test)
    assert all("fix:" in r.getMessage() for r in warned)


def test_a_consumer_that_never_hits_says_once_that_the_pair_cannot_meet(shm_dir, caplog):
    store = ec.EncoderCache(namespace="Qwen/Qwen2-VL-7B-Instruct|bfloat16")
    assert "Qwen/Qwen2-VL-7B-Instruct|bfloat16" in store.describe()
    assert shm_dir in store.describe() and "node" in store.describe()
    hits0 = metric("mmshm_epd_lookups_total", server="vllm", result="hit")
    miss0 = metric("mmshm_epd_lookups_total", server="vllm", result="miss")
    with caplog.at_level("WARNING", logger="mmshm"):
        for s in range(ec.MISSES_BEFORE_WARNING + 5):
            assert store.lookup(ec.content_key(_item(s), "m"), count=False) is None
    said = [r.getMessage() for r in caplog.records if "cannot meet" in r.getMessage()]
    assert len(said) == 1
    assert shm_dir in said[0] and "MMSHM_DIR" in said[0] and "same node" in said[0]
    assert "Qwen/Qwen2-VL-7B-Instruct|bfloat16" in said[0]
    assert metric("mmshm_epd_lookups_total", server="vllm", result="miss") - miss0 == \
        ec.MISSES_BEFORE_WARNING + 5
    store.save(ec.content_key(_item(1), "m"), _output(1), "x")
    e = store.lookup(ec.content_key(_item(1), "m"))
    e.release()
    assert metric("mmshm_epd_lookups_total", server="vllm", result="hit") - hits0 == 1
    store.close()


def test_a_consumer_that_hits_does_not_warn(shm_dir, caplog):
    store = ec.EncoderCache()
    store.save(ec.content_key(_item(1), "m"), _output(1), "x")
    store.lookup(ec.content_key(_item(1), "m")).release()
    with caplog.at_level("WARNING", logger="mmshm"):
        for s in range(2, ec.MISSES_BEFORE_WARNING + 4):
            store.lookup(ec.content_key(_item(s), "m"), count=False)
    assert not [r for r in caplog.records if "cannot meet" in r.getMessage()]
    store.close()


# -- what a consumer holds, and a clean stop leaves nothing ---------------------------------------
def test_held_entries_have_holders_count_against_max_bytes_and_go_at_close(shm_dir):
    producer_store = ec.EncoderCache()
    keys = [ec.content_key(_item(s), "m") for s in range(3)]
    for s, k in enumerate(keys):
        producer_store.save(k, _output(s), f"img-{s}")
    one = _output(0).nbytes
    consumer = ec.EncoderCache(max_bytes=2 * one)
    held0 = metric("mmshm_epd_held_bytes", server="vllm")
    a = consumer.lookup(keys[0], holder="vLLM encoder cache")
    b = consumer.lookup(keys[1], holder="request r-1")
    before = _fallbacks("over_budget")
    assert consumer.lookup(keys[2]) is None  # a third would pass its max_bytes
    assert _fallbacks("over_budget") - before == 1
    assert sorted((h.name, h.holder) for h in consumer.held()) == sorted(
        [(a.name, "vLLM encoder cache"), (b.name, "request r-1")])
    assert consumer.held_bytes() == 2 * one
    assert metric("mmshm_epd_held_bytes", server="vllm") - held0 == 2 * one
    got = {h.holder for h in ec.read_holders(os.getpid(), shm_dir)}
    assert got == {"vLLM encoder cache", "request r-1"}  # what mmshm status reads
    producer_store.close()
    assert sorted(segment_files(shm_dir)) == sorted([a.name, b.name])  # held: kept
    consumer.close()  # gives back what it holds
    assert a.released and b.released and consumer.held() == []
    assert metric("mmshm_epd_held_bytes", server="vllm") == held0
    assert ec.read_holders(os.getpid(), shm_dir) == []
    assert segment_files(shm_dir) == []


def consumer_then_exit(conn, seeds, how: str) -> None:
    """Look up and load each seed's entry, report, then leave as ``how``
    says: "return" (a clean exit), "views" (a worker: its entries given
    back, the loaded views kept in its cache, a clean exit), "os_exit" (no
    exit code at all runs). A clean exit is a forked multiprocessing
    child's, as vLLM's EngineCore and workers leave: multiprocessing's
    finalizers, then ``os._exit`` (no ``atexit``, so no ``weakref``
    finalizer: a spawned child's ``sys.exit`` would run them)."""
    import multiprocessing.util

    store = ec.EncoderCache()
    entries = [store.lookup(ec.content_key(_item(s), "m"), holder="vLLM encoder cache")
               for s in seeds]
    views = [e.load() for e in entries if e is not None]
    if how == "views":
        for e in entries:
            e.release()
    conn.send(len(views))
    conn.recv()
    if how != "os_exit":
        multiprocessing.util._exit_function()
    os._exit(0)


@pytest.mark.parametrize(("how", "first"), [("return", "producer"), ("views", "producer"),
                                           ("os_exit", "consumer")])
def test_a_clean_stop_of_both_instances_leaves_nothing(shm_dir, pool, how, first):
    """(A consumer gone without running any exit code after its producer
    leaves its references counted: only the reaper, ``mmshm gc`` or the
    next start, can reclaim what it held.)"""
    import multiprocessing as mp

    seeds = list(range(6))
    p, pconn, names = _start_producer_in(seeds)
    a, b = mp.get_context("spawn").Pipe()
    c = spawn(consumer_then_exit, b, seeds, how)
    assert a.poll(60) and a.recv() == 6
    order = [(pconn, p), (a, c)] if first == "producer" else [(a, c), (pconn, p)]
    for conn, proc in order:
        conn.send("exit")
        stop_all([proc], timeout=20)
        assert proc.exitcode == 0
    assert segment_files(shm_dir) == []


# -- faults between publication and load: a table -------------------------------------------------
#: fault -> (reason of the lookup's miss after the fault, reason of the load's failure
#: when the fault comes after the lookup, while the consumer holds the entry)
FAULTS = {
    "torn": ("digest", "digest"),              # the payload's second half overwritten
    "truncated": ("torn", "torn"),             # the file cut to half its payload
    "swapped": ("digest", "digest"),           # another item's payload under this record
    "header_zeroed": ("torn", "torn"),         # the segment header zeroed
    "removed": ("missing", "segment_gone"),    # the file unlinked (an rm, RemoveIPC=yes)
}
_ROWS = 2048  # [2048, 96] float32: 768 KiB, 192 pages (the digest samples 18)


def _fault(path: str, fault: str, donor: bytes) -> None:
    from mmshm.segments.segfile import HEADER_SIZE

    n = len(donor)
    if fault == "removed":
        os.unlink(path)
        return
    fd = os.open(path, os.O_RDWR)
    try:
        if fault == "torn":
            os.pwrite(fd, os.urandom(n // 2), HEADER_SIZE + n // 2)
        elif fault == "truncated":
            os.ftruncate(fd, HEADER_SIZE + n // 2)
        elif fault == "swapped":
            os.pwrite(fd, donor, HEADER_SIZE)
        elif fault == "header_zeroed":
            os.pwrite(fd, bytes(HEADER_SIZE), 0)
    finally:
        os.close(fd)


def producer_for_faults(conn, seeds) -> None:
    """Publish each seed's output ([_ROWS, 96] float32); on "churn" give every
    entry back and publish new ones (its warm pool reuses what it can: never a
    truncated file), then report; "exit": a clean exit."""
    store = ec.EncoderCache(keep_s=60)
    out = []
    for s in seeds:
        r = store.save(ec.content_key(_item(s), "m"), _output(s, rows=_ROWS), f"img-{s}")
        out.append((r.published, r.name))
    conn.send(out)
    assert conn.recv() == "churn"
    for s in seeds:
        store.evict(ec.content_key(_item(s), "m"))
    again = [store.save(ec.content_key(_item(100 + s), "m"), _output(100 + s, rows=_ROWS),
                        "new").published for s in seeds]
    for s in seeds:  # and the faulted content once more (its names may hold wrecks)
        again.append(store.save(ec.content_key(_item(s), "m"), _output(s, rows=_ROWS),
                                "again").published)
    conn.send(again)
    assert conn.recv() == "exit"


def _load_in_a_worker(handle, want: torch.Tensor, reason: str) -> tuple[str, float]:
    """Load ``handle`` in a forked child (another process, as vLLM's worker is
    to its scheduler: it opens the segment by name). Returns the failure's
    reason, or "loaded" (after checking the bytes: never other ones), and
    what the child counted in ``mmshm_epd_fallbacks_total{reason}``."""
    import pickle

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's exit code
        try:
            before = _fallbacks(reason)
            try:
                t = handle.load()
            except ec.EncoderCacheError as exc:
                out = exc.reason
            else:
                out = "loaded" if torch.equal(t, want) else "WRONG BYTES"
                del t
            os.write(w, pickle.dumps((out, _fallbacks(reason) - before)))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the worker died (a SIGBUS?)"
    return pickle.loads(data)


@pytest.mark.parametrize("moment", ["published", "held"])
def test_a_faulted_entry_is_a_counted_miss_or_one_failed_load_never_wrong_bytes(
        shm_dir, pool, moment):
    import multiprocessing as mp

    faults = list(FAULTS)
    seeds = list(range(20, 20 + len(faults)))
    donor = _output(99, rows=_ROWS).view(torch.uint8).numpy().tobytes()
    a, b = mp.get_context("spawn").Pipe()
    p = spawn(producer_for_faults, b, seeds)
    try:
        assert a.poll(60)
        assert all(ok for ok, _ in a.recv())
        store = ec.EncoderCache()
        keys = {f: ec.content_key(_item(s), "m") for f, s in zip(faults, seeds)}
        held = {}
        if moment == "held":  # the consumer's scheduler holds each entry, then the fault
            held = {f: store.lookup(keys[f], torch.float32, _ROWS) for f in faults}
            assert all(held.values())
        for f in faults:
            _fault(os.path.join(shm_dir, ec.published_name(keys[f])), f, donor)
        seen = {}
        for f, s in zip(faults, seeds):
            want = FAULTS[f][0] if moment == "published" else FAULTS[f][1]
            before = _fallbacks(want)
            if moment == "published":
                got = store.lookup(keys[f], torch.float32, _ROWS)
                seen[f] = "hit" if got is not None else "miss"
            else:  # a worker of the consumer loads the handle its scheduler sent
                seen[f], counted = _load_in_a_worker(held[f].handle(), _output(s, rows=_ROWS),
                                                     want)
                before -= counted  # counted in the worker's process
            assert _fallbacks(want) - before == 1, (f, want)
        expect = {f: ("miss" if moment == "published" else FAULTS[f][1]) for f in faults}
        assert seen == expect
        for e in held.values():
            e.release()
        gc.collect()
        a.send("churn")  # the producer gives its wrecks back and publishes again: no SIGBUS
        assert a.poll(60)
        assert all(a.recv())
        a.send("exit")
        stop_all([p], timeout=30)
        assert p.exitcode == 0  # never a SIGBUS in the producer
        store.close()
    finally:
        if p.exitcode is None:
            stop_all([p], timeout=10)
    # what the faults left that no process can give back: the reaper's business, or
    # a zeroed header it cannot read (removed here)
    reaper.reap(shm_dir, grace_s=0)
    for n in segment_files(shm_dir):
        fd = os.open(os.path.join(shm_dir, n), os.O_RDONLY)
        try:
            assert os.pread(fd, 8, 0) == bytes(8), n  # only the zeroed header's file
        finally:
            os.close(fd)
        os.unlink(os.path.join(shm_dir, n))


def test_mmshm_runs_exit_reclaim_covers_a_killed_producers_published_entries(shm_dir):
    """Published names carry no pid; ``mmshm run``'s reclaim of the server's
    pids reads the creator from the header."""
    p, conn, names = _start_producer([8])
    os.kill(p.pid, signal.SIGKILL)
    p.join(20)
    assert segment_files(shm_dir) == [names[0][1]]
    assert reaper.reclaim_left_by({p.pid + 1}, shm_dir).reclaimed == 0  # another pid's
    assert reaper.creator_of(shm_dir, names[0][1]) == p.pid
    rep = reaper.reclaim_left_by({p.pid}, shm_dir)
    assert rep.reclaimed == 1 and segment_files(shm_dir) == []


def test_a_fallback_line_quoting_a_rejected_image_stays_short(caplog, monkeypatch):
    """SGLang's encoder quotes a rejected request's whole data URL in its
    error (hundreds of KB of base64 on a real pair): the fallback's WARNING
    gives its head and length, never the payload, and is still counted."""
    import base64
    import logging

    from mmshm.metrics import EPD_FALLBACKS

    monkeypatch.setattr(ec, "_WARNED", set())
    b64 = base64.b64encode(os.urandom(300_000)).decode()
    msg = (f"Encoder preprocessing failed: Error while loading data data:image/png;base64,{b64}"
           f": Could not decode image")
    before = EPD_FALLBACKS.labels(server="sglang", reason="encoder_error")._value.get()
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        ec.count_fallback("sglang", "encoder_error", f"HTTP 400: {msg}", "none needed")
    (rec,) = [r for r in caplog.records if "encoder_error" in r.getMessage()]
    line = rec.getMessage()
    assert b64[:100] not in line and len(line) < 2 * ec.DETAIL_CHARS, len(line)
    assert f"data:image/png;base64,<{len(b64)} base64 chars>" in line
    assert "Could not decode image" in line
    assert EPD_FALLBACKS.labels(server="sglang", reason="encoder_error")._value.get() == before + 1
    long = "x" * 5000
    assert ec.bounded_detail(long) == "x" * ec.DETAIL_CHARS + "... <4000 more chars>"
