"""What an EC consumer's scheduler pays per item on the EngineCore's loop
(:class:`mmshm.transport.ec_connector.Holdings` on
:class:`mmshm.transport.encoder_cache.EncoderCache`): a burst of eight
4-photo requests, counted in syscalls.

A miss is one failed ``open`` per published name (:data:`SLOTS`) and
nothing else: no directory listing, no ``lstat``, no second lookup. A hit
opens the name, reads the header and the record, takes its reference, and
reads no payload page (each worker's load checks the digest) and writes
nothing for ``mmshm status`` on the loop (the holders' memfd is written
within :data:`~mmshm.transport.ec_holders.FLUSH_S`). A payload that went
bad after the scheduler's "probably there" fails its request in the
worker (returned by ``take_unavailable``), never wrong bytes.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from mmshm.transport import ec_connector as ecc
from mmshm.transport import encoder_cache as ec

from tests.harness.segments import segment_files
from tests.test_encoder_cache import _finish, _item, _output, _start_producer

pytestmark = pytest.mark.timeout(120)
REQUESTS, PHOTOS, ROWS = 8, 4, 64


class Calls:
    """Counts of the calls into ``os`` a scheduler might make, by name."""

    NAMES = ("open", "lstat", "stat", "fstat", "listdir", "scandir", "pread", "pwrite",
             "ftruncate", "memfd_create")

    def __init__(self, monkeypatch):
        self.n = dict.fromkeys(self.NAMES, 0)
        self.on = False
        for name in self.NAMES:
            real = getattr(os, name)

            def spy(*a, _real=real, _name=name, **kw):
                if self.on:
                    self.n[_name] += 1
                return _real(*a, **kw)
            monkeypatch.setattr(os, name, spy)


def _burst(holds: ecc.Holdings, keys: list[bytes]) -> list[tuple[str, str]]:
    """vLLM's scheduler calls for the burst: look every item up, ask whether
    each is held, then take the hit or count the miss. Returns the
    (request id, item name) of each hit."""
    items = [(f"r{r}", i, f"img-{r}-{i}", keys[r * PHOTOS + i])
             for r in range(REQUESTS) for i in range(PHOTOS)]
    for rid, i, ident, key in items:
        holds.look(rid, i, ident, key, rows=ROWS, dtype=torch.float32, width=96)
    hits = []
    for rid, _i, ident, key in items:
        if holds.has(ident) and holds.hit(ident) is not None:
            hits.append((rid, ident))
        else:
            holds.miss(rid, ident, key, ROWS)
    return hits


def test_a_burst_of_misses_is_one_failed_open_per_name(shm_dir, monkeypatch):
    store = ec.EncoderCache()
    counts = ecc.Counts("vllm")
    holds = ecc.Holdings(store, counts)
    assert store.lookup(b"w" * 32, count=False) is None  # the process's first use (its reap)
    calls = Calls(monkeypatch)
    calls.on = True
    hits = _burst(holds, [ec.content_key(_item(s), "m") for s in range(REQUESTS * PHOTOS)])
    calls.on = False
    n = REQUESTS * PHOTOS
    assert hits == [] and counts["fallback_missing"] == n
    assert calls.n == {**dict.fromkeys(Calls.NAMES, 0), "open": n * ec.SLOTS}, calls.n
    for r in range(REQUESTS):
        holds.finish(f"r{r}")
    assert holds.looked == {} and holds.missed == {}
    store.close()


def test_a_burst_of_hits_reads_no_payload_and_writes_only_references(shm_dir, monkeypatch):
    n = REQUESTS * PHOTOS
    p, conn, published = _start_producer(range(n))
    try:
        assert all(ok for ok, _, _ in published)
        store = ec.EncoderCache()
        counts = ecc.Counts("vllm")
        holds = ecc.Holdings(store, counts)
        assert store.lookup(b"w" * 32, count=False) is None  # the process's first use
        calls = Calls(monkeypatch)
        monkeypatch.setattr(ec, "payload_digest", lambda *a: pytest.fail("a payload read"))
        calls.on = True
        hits = _burst(holds, [ec.content_key(_item(s), "m") for s in range(n)])
        calls.on = False
        assert len(hits) == n and counts["hits"] == n
        assert not any(k.startswith("fallback_") and v for k, v in counts.items())
        # per hit: open the name; the segment core's attach (header, holder
        # count, hand-out: 3 preads, 2 pwrites, 1 fstat), the record (1 pread:
        # the generation is attach's), the reference under its lock (1 pread, 2
        # pwrites); has(): fstat + stat (the name still leads to the file).
        # No payload page (the digest's 4+ preads), no holders' memfd write.
        assert calls.n["open"] == n and calls.n["pread"] == 5 * n, calls.n
        assert calls.n["pwrite"] == 4 * n and calls.n["ftruncate"] == 0, calls.n
        assert calls.n["memfd_create"] == 0, calls.n
        assert calls.n["stat"] == n and calls.n["fstat"] == 2 * n and calls.n["lstat"] == 0
        assert calls.n["listdir"] == 0 and calls.n["scandir"] == 0
        # mmshm status still sees every holder (read back: written now)
        held = ec.read_holders(os.getpid(), shm_dir)
        assert sorted(h.holder for h in held) == sorted(f"request r{r}" for r in
                                                        range(REQUESTS) for _ in range(PHOTOS))
        for r in range(REQUESTS):
            holds.finish(f"r{r}")
        assert holds.held == {} and holds.by_id == {} and holds.name_of == {}
        assert ec.read_holders(os.getpid(), shm_dir) == []
        store.close()
    finally:
        _finish(p, conn)
    gc.collect()
    assert segment_files(shm_dir) == []


def test_a_payload_bad_after_the_schedulers_check_fails_its_request_never_bytes(shm_dir):
    from mmshm.segments.segfile import HEADER_SIZE

    p, conn, _ = _start_producer([1, 2])
    try:
        store = ec.EncoderCache()
        counts = ecc.Counts("vllm")
        holds = ecc.Holdings(store, counts)
        k1, k2 = ec.content_key(_item(1), "m"), ec.content_key(_item(2), "m")
        # another photo's output under item 1's record: the scheduler reads no
        # payload page, so it still says "probably there"
        fd = os.open(os.path.join(shm_dir, ec.published_name(k1)), os.O_RDWR)
        try:
            os.pwrite(fd, _output(2).view(torch.uint8).numpy().tobytes(), HEADER_SIZE)
        finally:
            os.close(fd)
        for rid, ident, key in (("bad", "img-1", k1), ("next", "img-2", k2)):
            assert holds.look(rid, 0, ident, key, rows=ROWS, dtype=torch.float32,
                              width=96) is not None
            assert holds.has(ident)
        loads = [("bad", "img-1", holds.hit("img-1")), ("next", "img-2", holds.hit("img-2"))]
        cache, failed = {}, {}
        ecc.load(loads, cache, "cpu", counts, failed, "the request is failed")
        assert failed == {"bad": "img-1"} and counts["load_failed"] == 1
        assert torch.equal(cache["img-2"], _output(2))  # the next request is served
        assert not cache["img-1"].any()  # zeros in the failed request's slot, never img-2's
        holds.failed(failed)
        assert holds.take_unavailable() == {"bad"}
        assert holds.fails("again", ["img-1"])  # a later request naming the item: failed too
        del cache
        for rid in ("bad", "next"):
            holds.finish(rid)
        gc.collect()
        store.close()
    finally:
        _finish(p, conn)
    gc.collect()
    assert segment_files(shm_dir) == []


def test_a_change_during_a_flush_of_the_holders_list_never_deadlocks():
    """An entry given back while the holders' list is being written (the
    garbage collector freeing one in the middle of the flush) only queues
    another write."""
    import threading

    from mmshm.transport import ec_holders as eh

    h = eh._Holders()

    def source():
        h.update(2, lambda: None)  # what an entry's release does, from inside the flush
        return ("vllm", "/dev/shm", [])

    h.update(1, source)
    t = threading.Thread(target=h.flush, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the flush deadlocked"
    h.flush()  # the change made during the first flush is written too
    assert h.pending == {} and h.parts == {}
    if h.timer is not None:
        h.timer.cancel()
