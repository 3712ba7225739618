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
