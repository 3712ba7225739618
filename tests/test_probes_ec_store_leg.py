"""Probes of the EC connector's Mooncake Store leg (:mod:`mmshm.transport.ec_connector`'s
``Holdings``/``StoreFetches``/``save``/``open_tier``, :mod:`mmshm.transport.ec_store`'s
``StoreTier``/``fetch_local``, and vLLM's ``MmshmECConnector`` where vLLM is
importable), read as a vLLM maintainer would: several requests of one content
while its fetch is in flight, requests aborted while deferred, requests asked
again, a master that is down, goes down or hangs, Store objects that disagree
with what the consumer expects, the counts of every miss, removal racing a
read, CUDA on the Store's threads, the reader at interpreter exit, and bad
``ec_connector_extra_config`` values.

Module level, no real server: the Store is the real
:class:`~mmshm.transport.ec_store.StoreTier` on tests/test_ec_store.py's
stand-in engine (a dict). Each node is a segment directory of its own. Ten of
them found defects, each fixed since (the probe failed before its fix).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
from mmshm.metrics import EPD_FALLBACKS
from mmshm.transport import ec_connector, ec_store
from mmshm.transport.ec_connector import PENDING, Counts, Holdings
from mmshm.transport.ec_keys import setting
from mmshm.transport.encoder_cache import EncoderCache, content_key

from tests.harness.store_leg import Engine
from tests.harness.vllm_request import vllm_request

pytestmark = pytest.mark.timeout(120)

ROWS, WIDTH = 32, 48
SERVER = "vllm"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def output(i: int, dtype=torch.bfloat16, rows: int = ROWS, width: int = WIDTH) -> torch.Tensor:
    g = torch.Generator().manual_seed(900 + i)
    return torch.randn(rows, width, generator=g).to(dtype)


def key(i: int) -> bytes:
    return content_key(f"probe photo {i}", "model")


def fallbacks(reason: str) -> float:
    return EPD_FALLBACKS.labels(server=SERVER, reason=reason)._value.get()


def mmshm_files(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("mmshm"))


def publish(cache_a: EncoderCache, tier_a, items, dtype=torch.bfloat16, **shape) -> None:
    """Node A's encoder saves (and so puts) ``items``; node A's cache is then closed."""
    counts = Counts(SERVER)
    for i in items:
        assert ec_connector.save(cache_a, key(i), output(i, dtype, **shape), f"img-{i}",
                                 counts, tier_a).published
    assert tier_a.flush(10)
    cache_a.close()


def look(holds: Holdings, rid: str, index: int, ident: str, i: int, rows=ROWS, width=WIDTH,
         dtype=torch.bfloat16):
    return holds.look(rid, index, ident, key(i), rows=rows, dtype=dtype, width=width)


def until_ready(holds: Holdings, asks, limit_s: float = 5.0, every: float = 0.01):
    """vLLM's calls step by step: each ``(rid, index, ident, i)`` of ``asks``
    looked at every step until none is in transit: ``({(rid, index): entry},
    steps deferred)``."""
    got = {(rid, n): PENDING for rid, n, _, _ in asks}
    end, steps = time.monotonic() + limit_s, 0
    while True:
        for rid, n, ident, i in asks:
            g = look(holds, rid, n, ident, i)
            if got[(rid, n)] is PENDING:
                got[(rid, n)] = g
        if not any(g is PENDING for g in got.values()):
            return got, steps
        steps += 1
        assert time.monotonic() < end, "still in transit"
        time.sleep(every)


def fetched(holds: Holdings, i: int, limit_s: float = 5.0) -> str:
    """Wait for the reader's outcome of content ``i`` (without asking anew)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        f = holds.fetches._by_key.get(key(i))
        if f is not None and f.state == "done":
            return f.reason
        time.sleep(0.01)
    raise AssertionError("the fetch did not finish")


# -- several requests of one content while its fetch is in flight ---------------------------
def test_two_requests_of_one_content_under_two_names_share_one_read_and_load_equal_bytes(
        store, nodes):
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    publish(a, tier(), [0])
    counts = Counts(SERVER)
    holds = Holdings(b, counts, tier())
    eng.gate.clear()  # the read hangs until both requests asked
    assert look(holds, "r1", 0, "img-x", 0) is PENDING
    assert look(holds, "r2", 0, "img-y", 0) is PENDING
    eng.gate.set()
    got, _ = until_ready(holds, [("r1", 0, "img-x", 0), ("r2", 0, "img-y", 0)])
    assert all(e is not None for e in got.values())
    assert eng.gets == 1, "one Store read for one content"
    cache: dict = {}
    ec_connector.load([("r1", "img-x", holds.hit("img-x")), ("r2", "img-y", holds.hit("img-y"))],
                      cache, "cpu", counts, {}, "")
    assert torch.equal(cache["img-x"], output(0)) and torch.equal(cache["img-y"], output(0))
    assert counts["hits"] == 2 and counts["loads"] == 2
    del cache
    holds.finish("r1")
    holds.finish("r2")
    assert not b.held() and not holds.waiting and not holds.held
    holds.close()


def test_two_requests_of_one_item_name_in_flight_one_holds_nothing_leaks(store, nodes):
    """vLLM dedups one ``mm_hash``: the second request is ready once the first
    holds the item (``has_cache_item``), reads nothing more, and once both
    finish nothing is held nor waited on."""
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    publish(a, tier(), [1])
    holds = Holdings(b, Counts(SERVER), tier())
    eng.gate.clear()
    assert look(holds, "r1", 0, "img-1", 1) is PENDING
    assert look(holds, "r2", 0, "img-1", 1) is PENDING
    eng.gate.set()
    got, _ = until_ready(holds, [("r1", 0, "img-1", 1), ("r2", 0, "img-1", 1)])
    held = [e for e in got.values() if e is not None]
    assert len(held) == 1 and holds.has("img-1") and eng.gets == 1
    holds.finish("r1")
    holds.finish("r2")
    assert not b.held() and not holds.waiting and not holds.by_id
    holds.close()


# -- a request aborted while deferred -----------------------------------------------------
def test_a_request_aborted_while_deferred_holds_nothing_and_the_fetch_goes_after_keep_s(
        store, nodes):
    eng, tier = store
    a = nodes("node-a")
    b = nodes("node-b", keep_s=0.3)
    publish(a, tier(), [2])
    holds = Holdings(b, Counts(SERVER), tier())
    eng.gate.clear()
    assert look(holds, "r1", 0, "img-2", 2) is PENDING
    holds.finish("r1")  # aborted while its item is in transit
    eng.gate.set()
    assert fetched(holds, 2) == ""
    assert not holds.waiting and not holds.held and not b.held()
    assert len(b.published()) == 1, "the fetched output is published on node B"
    end = time.monotonic() + 5
    while mmshm_files(b.directory) and time.monotonic() < end:
        time.sleep(0.05)
    assert mmshm_files(b.directory) == [], "the fetched segment outlived keep_s"
    holds.close()


# -- a request asked again (RUNNING, chunked prefill) --------------------------------------
def test_a_request_asked_again_reads_nothing_more_and_counts_nothing_more(store, nodes):
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    publish(a, tier(), [3, 4])
    counts = Counts(SERVER)
    holds = Holdings(b, counts, tier())
    asks = [("r1", 0, "img-3", 3), ("r1", 1, "img-4", 4)]
    got, steps = until_ready(holds, asks)
    assert steps >= 1 and all(e is not None for e in got.values())
    gets, before = eng.gets, dict(counts)
    for _ in range(3):  # the next chunks: vLLM asks again each step
        assert [look(holds, r, n, ident, i) for r, n, ident, i in asks] == [None, None]
    assert eng.gets == gets and dict(counts) == before and not holds.waiting
    holds.free("r1", 0)  # the first image's tokens are computed: vLLM frees it
    assert not holds.has("img-3") and holds.has("img-4")
    holds.finish("r1")
    assert not b.held()
    holds.close()


def test_a_deferred_request_not_asked_for_longer_than_the_outcome_is_kept_reads_no_more(
        store, nodes):
    """vLLM may not reach a waiting request for a while: once the outcome is
    forgotten the item is asked anew, but it is on this node by now: no second
    Store read."""
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    publish(a, tier(), [5])
    holds = Holdings(b, Counts(SERVER), tier(timeout_s=0.2))
    with holds.looking():  # as vLLM's pass: the fetch starts once the pass is over
        assert look(holds, "r1", 0, "img-5", 5) is PENDING
    assert fetched(holds, 5) == ""
    time.sleep(0.3)  # longer than store_timeout_s: the outcome is forgotten
    got, _ = until_ready(holds, [("r1", 0, "img-5", 5)])
    assert got[("r1", 0)] is not None and eng.gets == 1
    holds.finish("r1")
    holds.close()


# -- the master down, going down, hanging ---------------------------------------------------
def test_a_master_down_at_start_is_one_counted_miss_per_item_within_the_bound(
        monkeypatch, nodes):
    monkeypatch.setattr(ec_store, "_probe_http", lambda url, timeout: None)
    monkeypatch.setattr(ec_store, "load_engine", lambda: Engine)
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed below: nothing listens there
    tier_b = ec_connector.open_tier({"master_server_address": f"127.0.0.1:{port}",
                                     "local_hostname": "127.0.0.1",
                                     "local_buffer_size": "1MB",
                                     "store_read_buffer_bytes": "1MB",
                                     "store_timeout_s": 0.3}, SERVER)
    try:
        b = nodes("node-b")
        counts = Counts(SERVER)
        holds = Holdings(b, counts, tier_b)
        before = fallbacks("store_unreachable")
        t0 = time.monotonic()
        got, _ = until_ready(holds, [("r1", 0, "img-6", 6)])
        assert time.monotonic() - t0 < 2 * 0.3 + 0.2
        assert got == {("r1", 0): None}
        holds.miss("r1", "img-6", key(6), ROWS)
        assert counts["fallback_store_unreachable"] == 1
        assert fallbacks("store_unreachable") - before == 1
        holds.close()
    finally:
        tier_b.close(timeout=2)


def test_a_master_gone_between_steps_is_a_counted_miss_and_nothing_partial(store, nodes):
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    publish(a, tier(), [7, 8])
    counts = Counts(SERVER)
    holds = Holdings(b, counts, tier(timeout_s=0.3))
    got, _ = until_ready(holds, [("r1", 0, "img-7", 7)])
    assert got[("r1", 0)] is not None
    eng.healthy = False  # the master goes away before the next request's step
    before = fallbacks("store_unreachable")
    t0 = time.monotonic()
    got, _ = until_ready(holds, [("r2", 0, "img-8", 8)])
    assert time.monotonic() - t0 < 2 * 0.3 + 0.2 and got == {("r2", 0): None}
    holds.miss("r2", "img-8", key(8), ROWS)
    assert counts["fallback_store_unreachable"] == 1
    assert fallbacks("store_unreachable") - before == 1
    assert len(b.published()) == 1, "only the first output was published on node B"
    holds.finish("r1")
    holds.finish("r2")
    holds.close()


def test_a_hanging_master_bounds_two_requests_each_from_its_own_first_ask(store, nodes):
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    publish(a, tier(), [10, 11, 12, 13])
    eng.gate.clear()
    holds = Holdings(b, Counts(SERVER), tier(timeout_s=0.3))
    first = {"r1": time.monotonic()}
    asks = [("r1", 0, "img-10", 10), ("r1", 1, "img-11", 11)]
    for r, n, ident, i in asks:
        assert look(holds, r, n, ident, i) is PENDING
    time.sleep(0.15)
    first["r2"] = time.monotonic()
    asks += [("r2", 0, "img-12", 12), ("r2", 1, "img-13", 13)]
    done: dict = {}
    end = time.monotonic() + 5
    while len(done) < 2 and time.monotonic() < end:
        for rid in ("r1", "r2"):
            mine = [look(holds, r, n, ident, i) for r, n, ident, i in asks if r == rid]
            if rid not in done and not any(g is PENDING for g in mine):
                done[rid] = time.monotonic() - first[rid]
        time.sleep(0.01)
    assert set(done) == {"r1", "r2"}
    assert max(done.values()) < 2 * 0.3 + 0.1, done
    eng.gate.set()
    holds.close()


@pytest.fixture
def starts(monkeypatch):
    """``[(content key, seconds past its deadline)]`` of each fetch the reader starts."""
    got: list = []
    real = ec_store.fetch_local_many

    def spy(cache, tier, items):
        for k, *_ in items:
            holds_f = spy.fetches._by_key.get(k) if spy.fetches is not None else None
            late = time.monotonic() - holds_f.deadline if holds_f is not None else None
            got.append((k, late))
        return real(cache, tier, items)

    spy.fetches = None
    monkeypatch.setattr(ec_store, "fetch_local_many", spy)  # the reader imports it when it starts
    return got, spy


def test_a_fetch_past_its_deadline_is_never_started_even_when_nobody_looked_meanwhile(
        store, nodes, starts):
    eng, tier = store
    got, spy = starts
    a, b = nodes("node-a"), nodes("node-b")
    publish(a, tier(), [14, 15, 16])
    eng.gate.clear()
    holds = Holdings(b, Counts(SERVER), tier(timeout_s=0.3))
    spy.fetches = holds.fetches
    for n, i in enumerate((14, 15, 16)):
        assert look(holds, "r1", n, f"img-{i}", i) is PENDING
    time.sleep(2 * 0.3 + 0.15)  # one long step: nobody looks
    eng.gate.set()
    holds.close()
    assert len(got) >= 1  # the first one; the others were never started
    late = [(k.hex()[:8], round(t, 3)) for k, t in got if t > 0]
    assert late == [], f"fetches started past their deadline (s): {late}"


def test_a_deferred_request_reached_late_takes_its_fetchs_outcome(store, nodes, starts):
    _, tier = store
    got, _ = starts
    b = nodes("node-b")
    holds = Holdings(b, Counts(SERVER), tier(timeout_s=0.2))
    with holds.looking():  # as vLLM's pass: the fetch starts once the pass is over
        assert look(holds, "r1", 0, "img-17", 17) is PENDING  # never put: a miss
    assert fetched(holds, 17) == "store_absent"
    time.sleep(0.3)  # the scheduler's batch is full: r1 is not reached
    again = look(holds, "r1", 0, "img-17", 17)
    holds.close()
    assert again is None and len(got) == 1, (again, len(got))


# -- a Store object that disagrees with what the consumer expects --------------------------
@pytest.mark.parametrize("case", ["dtype", "rows", "width", "digest"])
def test_a_store_object_that_disagrees_is_a_counted_miss_and_leaves_no_segment(
        store, nodes, case):
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    tier_a = tier()
    if case == "dtype":
        publish(a, tier_a, [20], dtype=torch.float16)
    elif case == "rows":
        publish(a, tier_a, [20], rows=ROWS + 1)
    elif case == "width":
        publish(a, tier_a, [20], width=WIDTH * 2)
    else:
        publish(a, tier_a, [20])
        skey = tier_a.store_key(key(20))
        raw = bytearray(eng.objects[skey])
        raw[ec_store.RECORD_BYTES] ^= 0xFF  # the first page is always sampled
        eng.objects[skey] = bytes(raw)
    reason = "store_digest" if case == "digest" else "store_record_mismatch"
    counts = Counts(SERVER)
    holds = Holdings(b, counts, tier())
    before = fallbacks(reason)
    got, _ = until_ready(holds, [("r1", 0, "img-20", 20)])
    assert got == {("r1", 0): None}
    holds.miss("r1", "img-20", key(20), ROWS)
    assert counts[f"fallback_{reason}"] == 1 and fallbacks(reason) - before == 1
    assert mmshm_files(b.directory) == [] and not b.held()
    holds.close()


# -- counts: each miss once in the metric and once in the connector's stats ---------------
def test_one_store_miss_is_counted_once_in_the_metric_and_once_in_the_stats(store, nodes):
    _, tier = store
    b = nodes("node-b")
    counts = Counts(SERVER)
    holds = Holdings(b, counts, tier())
    before = (fallbacks("store_absent"), fallbacks("missing"))
    got, _ = until_ready(holds, [("r1", 0, "img-21", 21)])
    assert got == {("r1", 0): None}
    holds.miss("r1", "img-21", key(21), ROWS)
    assert counts["fallback_store_absent"] == 1
    assert (fallbacks("store_absent") - before[0], fallbacks("missing") - before[1]) == (1, 0)
    holds.close()


def test_two_requests_that_miss_one_content_in_the_store_count_two_in_metric_and_stats(
        store, nodes):
    _, tier = store
    b = nodes("node-b")
    counts = Counts(SERVER)
    holds = Holdings(b, counts, tier())
    before = fallbacks("store_absent")
    got, _ = until_ready(holds, [("r1", 0, "img-22a", 22), ("r2", 0, "img-22b", 22)])
    assert list(got.values()) == [None, None]
    holds.miss("r1", "img-22a", key(22), ROWS)  # each request encodes its item here
    holds.miss("r2", "img-22b", key(22), ROWS)
    holds.close()
    assert counts["fallback_store_absent"] == 2
    assert fallbacks("store_absent") - before == 2


def test_a_fetch_the_consumers_cache_refuses_is_counted_once(store, nodes, tmp_path):
    _, tier = store
    a = nodes("node-a")
    publish(a, tier(), [27])
    d = tmp_path / "node-b-small"
    d.mkdir()
    b = EncoderCache(str(d), server=SERVER, keep_s=60, max_bytes=1024, namespace="model")
    counts = Counts(SERVER)
    holds = Holdings(b, counts, tier())
    before = fallbacks("over_budget")
    try:
        got, _ = until_ready(holds, [("r1", 0, "img-27", 27)])
        assert got == {("r1", 0): None}
        holds.miss("r1", "img-27", key(27), ROWS)
        assert counts["fallback_over_budget"] == 1
        assert fallbacks("over_budget") - before == 1
    finally:
        holds.close()
        b.close()
    assert mmshm_files(str(d)) == []


def test_a_full_put_queue_drops_counted_and_gives_every_hold_back(store, nodes):
    eng, tier = store
    a = nodes("node-a")
    tier_a = tier(store_max_pending_items=1)
    before = fallbacks("store_queue_full")
    eng.gate.clear()  # the first put waits: the queue is full
    counts = Counts(SERVER)
    for i in (28, 29, 30):
        assert ec_connector.save(a, key(i), output(i), f"img-{i}", counts, tier_a).published
    assert [h.holder for h in a.held()] == ["Mooncake Store put"]
    eng.gate.set()
    assert tier_a.flush(5) and not a.held()
    assert tier_a.stats["drop_queue_full"] == 2 and fallbacks("store_queue_full") - before == 2
    assert [tier_a.store_key(key(i)) in eng.objects for i in (28, 29, 30)] == [True, False, False]
    assert counts["saves"] == 3


# -- keep_s removal racing a consumer's read ------------------------------------------------
@pytest.mark.parametrize("how", ["removed", "cut short"])
def test_a_removal_racing_a_read_never_publishes_partial_bytes(store, nodes, how):
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    tier_a = tier()
    publish(a, tier_a, [23])
    skey = tier_a.store_key(key(23))

    def race(k):
        if how == "removed":
            eng.remove(k)  # the encoder's keep_s removal between get_size and the get
        else:
            eng.objects[k] = eng.objects[k][: ec_store.RECORD_BYTES + 100]

    eng.between = race
    counts = Counts(SERVER)
    holds = Holdings(b, counts, tier())
    got, _ = until_ready(holds, [("r1", 0, "img-23", 23)])
    assert got == {("r1", 0): None} and eng.between is None
    reason = "store_absent" if how == "removed" else "store_short"
    assert holds.missed["r1"]["img-23"] == reason
    assert mmshm_files(b.directory) == [] and b.lookup(key(23)) is None
    assert skey not in eng.objects or how != "removed"
    holds.close()


def test_the_producers_keep_s_removal_leaves_a_fetched_copy_intact(store, nodes):
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    tier_a = tier(keep_s=0.2)
    publish(a, tier_a, [24])
    holds = Holdings(b, Counts(SERVER), tier())
    got, _ = until_ready(holds, [("r1", 0, "img-24", 24)])
    assert got[("r1", 0)] is not None
    end = time.monotonic() + 5
    while tier_a.store_key(key(24)) in eng.objects and time.monotonic() < end:
        time.sleep(0.05)
    assert tier_a.store_key(key(24)) not in eng.objects
    t = holds.hit("img-24").load(SERVER)
    assert torch.equal(t, output(24))
    del t
    holds.finish("r1")
    holds.close()


def test_content_saved_again_stays_in_the_store_while_the_encoder_keeps_it(store, nodes):
    eng, tier = store
    a = nodes("node-a", keep_s=0.3)
    tier_a = tier(keep_s=0.3)
    counts = Counts(SERVER)
    skey = tier_a.store_key(key(25))
    end = time.monotonic() + 1.4  # the put thread removes what expired once a second
    while time.monotonic() < end:  # the encoder sees the photo again every 0.1 s
        assert ec_connector.save(a, key(25), output(25), "img-25", counts, tier_a).published
        assert tier_a.flush(5)
        time.sleep(0.1)
    assert a.published(), "the encoder's node still serves it"
    assert skey in eng.objects, "removed from the Store while node A still keeps it"


def test_a_removal_refused_once_is_tried_again(store, nodes):
    eng, tier = store
    a = nodes("node-a")
    tier_a = tier(keep_s=0.2)
    refused = []
    real = eng.remove

    def remove(k):
        if not refused:
            refused.append(k)
            return -706  # OBJECT_HAS_LEASE: a reader holds the object's lease
        return real(k)

    eng.remove = remove
    assert ec_connector.save(a, key(31), output(31), "img-31", Counts(SERVER), tier_a).published
    assert tier_a.flush(5)
    skey = tier_a.store_key(key(31))
    # the put thread removes what expired once a second: asked about 1 s after the put,
    # refused, asked again about 1 s later (slack for a loaded host)
    end = time.monotonic() + 4.0
    while (not refused or skey in eng.objects) and time.monotonic() < end:
        time.sleep(0.05)
    assert refused == [skey], "the removal was asked"
    assert skey not in eng.objects, "still in the Store 3 s after its refused removal"


def test_an_entry_evicted_while_its_put_waits_puts_the_published_bytes(store, nodes):
    eng, tier = store
    a = nodes("node-a")
    tier_a = tier()
    eng.gate.clear()
    assert ec_connector.save(a, key(32), output(32), "img-32", Counts(SERVER), tier_a).published
    assert a.evict(key(32))  # the encoder's keep time or budget lets it go meanwhile
    assert mmshm_files(a.directory), "the put's hold keeps the segment"
    eng.gate.set()
    assert tier_a.flush(5) and not a.held()
    payload = eng.objects[tier_a.store_key(key(32))][ec_store.RECORD_BYTES:]
    assert payload == output(32).view(torch.uint8).numpy().tobytes()
    assert mmshm_files(a.directory) == [], "the last release unlinked it"


def test_a_read_that_outlived_its_deadline_publishes_checked_bytes_for_the_next_request(
        store, nodes):
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    publish(a, tier(), [33])
    eng.gate.clear()
    counts = Counts(SERVER)
    holds = Holdings(b, counts, tier(timeout_s=0.2))
    got, _ = until_ready(holds, [("r1", 0, "img-33", 33)])
    assert got == {("r1", 0): None} and holds.missed["r1"]["img-33"] == "store_timeout"
    eng.gate.set()  # the abandoned read now completes on the reader thread
    end = time.monotonic() + 5
    while not b.published() and time.monotonic() < end:
        time.sleep(0.02)
    time.sleep(0.25)  # the timeout outcome is forgotten
    gets = eng.gets
    got, steps = until_ready(holds, [("r2", 0, "img-33", 33)])
    assert got[("r2", 0)] is not None and steps == 0 and eng.gets == gets
    assert torch.equal(holds.hit("img-33").load(SERVER), output(33))
    holds.finish("r1")
    holds.finish("r2")
    holds.close()


# -- CUDA on the Store's threads -------------------------------------------------------------
def test_the_store_threads_never_touch_cuda(store, nodes, monkeypatch):
    touched: list[str] = []

    def spy(name):
        def f(*args, **kwargs):
            touched.append(f"{threading.current_thread().name}: torch.cuda.{name}")
            raise RuntimeError("no CUDA here")
        return f

    for name in ("_lazy_init", "init", "current_device", "set_device", "synchronize",
                 "current_stream", "device_count", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, spy(name))
    _, tier = store
    a, b = nodes("node-a", keep_s=0.2), nodes("node-b", keep_s=0.2)
    publish(a, tier(keep_s=0.2), [26])
    holds = Holdings(b, Counts(SERVER), tier())
    got, _ = until_ready(holds, [("r1", 0, "img-26", 26)])
    assert got[("r1", 0)] is not None
    assert torch.equal(holds.hit("img-26").load(SERVER), output(26))
    time.sleep(1.1)  # the put thread's keep_s removal ran (it looks once a second)
    holds.finish("r1")
    holds.close()
    assert touched == []


# -- the reader thread and interpreter exit -------------------------------------------------
CHILD = textwrap.dedent(r"""
    import socket, sys, time
    sys.path.insert(0, sys.argv[1])
    import torch
    from mmshm.transport import ec_connector, ec_store
    from mmshm.transport.ec_connector import PENDING, Counts, Holdings
    from mmshm.transport.encoder_cache import EncoderCache, content_key
    from tests.test_ec_store import FakeEngine
    srv = socket.create_server(("127.0.0.1", 0))
    ec_store._probe_http = lambda url, timeout: None
    eng = FakeEngine()
    ec_store.load_engine = lambda: (lambda: eng)
    extra = {"master_server_address": f"127.0.0.1:{srv.getsockname()[1]}",
             "local_hostname": "127.0.0.1", "local_buffer_size": "1MB",
             "store_read_buffer_bytes": "1MB", "store_timeout_s": 0.3}
    ta, tb = ec_connector.open_tier(extra, "vllm"), ec_connector.open_tier(extra, "vllm")
    assert ta.wait_connected(5) and tb.wait_connected(5)
    k = content_key("exit", "model")
    assert ta.put(k, torch.ones(8, 8)) and ta.flush(5)
    eng.gate.clear()  # every read hangs: the reader thread is inside the engine at exit
    b = EncoderCache(sys.argv[2], keep_s=60, namespace="model")
    holds = Holdings(b, Counts("vllm"), tb)
    assert holds.look("r1", 0, "x", k, rows=8, dtype=torch.float32, width=8) is PENDING
    time.sleep(0.2)
    print("EXITING", flush=True)
    if sys.argv[3] == "close":
        holds.close()
        tb.close(timeout=1)
        ta.close(timeout=1)
        b.close()
""")


@pytest.fixture(scope="module")
def hung_exit(tmp_path_factory):
    """One child: a Store read hangs (inside the engine) when the connector
    shuts down (Holdings.close, StoreTier.close) and the interpreter exits:
    ``(completed process, seconds, segment directory)``."""
    d = tmp_path_factory.mktemp("hung-exit") / "node-b"
    d.mkdir()
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", CHILD, REPO, str(d), "close"], check=False,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "MMSHM_DIR": str(d), "MMSHM_REAP_INTERVAL_S": "0"})
    yield out, time.monotonic() - t0, str(d)
    for n in mmshm_files(str(d)):  # what a regression would leave: not to the next test
        os.unlink(os.path.join(str(d), n))


def test_a_read_hanging_at_shutdown_neither_blocks_shutdown_nor_the_exit(hung_exit):
    out, took, _ = hung_exit
    assert out.returncode == 0 and "EXITING" in out.stdout, out.stderr[-3000:]
    assert took < 20, f"the child took {took:.1f} s (imports included) to shut down and exit"


def test_a_read_hanging_at_shutdown_leaves_no_segment(hung_exit):
    out, _, d = hung_exit
    assert out.returncode == 0, out.stderr[-3000:]
    assert mmshm_files(d) == []


# -- bad ec_connector_extra_config values ----------------------------------------------------
BASE = {"master_server_address": "127.0.0.1:1"}


@pytest.mark.parametrize("k,v", [
    ("master_server_address", "nohost"), ("master_server_address", 5),
    ("master_server_address", "h:99999"), ("store_timeout_s", "abc"),
    ("store_timeout_s", -1), ("store_timeout_s", float("nan")), ("store_timeout_s", True),
    ("store_timeout_s", float("inf")), ("local_buffer_size", "4 GiB"),
    ("local_buffer_size", 100), ("global_segment_size", 0), ("store_max_pending_items", 1.5),
    ("store_max_pending_bytes", "lots"), ("store_read_buffer_bytes", None),
    ("store_key_prefix", ""), ("store_key_prefix", 7), ("mooncake_protocol", "udp"),
    ("metadata_server", 42), ("mooncake_config_path", "/nonexistent/mooncake.json"),
])
def test_a_bad_store_setting_is_one_warning_naming_the_key_and_no_leg(caplog, k, v):
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        tier = ec_connector.open_tier({**BASE, k: v}, SERVER)
    assert tier is None
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and k in said[0] and "Fix" in said[0], said


@pytest.mark.parametrize("k,v", [
    ("mooncake_config_path", ["a.json"]), ("mooncake_config_path", {"path": "a.json"}),
    ("store_max_pending_items", float("inf")), ("store_max_pending_items", 10 ** 400),
    ("store_timeout_s", 10 ** 400),
], ids=["path-list", "path-dict", "items-inf", "items-huge-int", "timeout-huge-int"])
def test_a_bad_store_setting_of_the_wrong_type_never_raises(k, v):
    assert ec_connector.open_tier({**BASE, k: v}, SERVER) is None


def test_a_config_path_that_is_a_number_closes_no_descriptor_of_the_server():
    with tempfile.TemporaryFile() as f:
        fd = f.fileno()
        with contextlib.suppress(Exception):  # that defect is the probe above's
            ec_connector.open_tier({**BASE, "mooncake_config_path": fd}, SERVER)
        try:
            os.fstat(fd)
        except OSError:
            pytest.fail(f"descriptor {fd} was closed by open_tier")


def test_an_infinite_max_bytes_setting_warns_and_never_raises():
    assert setting({"max_bytes": float("inf")}, "max_bytes", 0, int) == 0


# -- vLLM's connector (where vLLM is importable: the vllm part of tests.run) --------------
try:
    import vllm  # noqa: F401
    VLLM = None
except ImportError as exc:
    VLLM = f"vLLM is not importable here ({exc})"
needs_vllm = pytest.mark.skipif(VLLM is not None, reason=str(VLLM))


def _vllm_config(role: str, extra: dict):
    from types import SimpleNamespace

    from vllm.config import ECTransferConfig

    tc = ECTransferConfig(ec_connector="MmshmECConnector",
                          ec_connector_module_path="mmshm.integrations.vllm.epd",
                          ec_role=role, ec_connector_extra_config=extra)
    return SimpleNamespace(ec_transfer_config=tc, model_config=SimpleNamespace(
        model="tiny-qwen2-vl", dtype=torch.float32))


def _connector(role: str, extra: dict, sched: bool):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    vc = _vllm_config(role, extra)
    return ECConnectorFactory.create_connector(
        vc, ECConnectorRole.SCHEDULER if sched else ECConnectorRole.WORKER)


@needs_vllm
@pytest.mark.parametrize("rank", [0, 1])
def test_with_tp_only_rank_0s_worker_starts_a_client_and_puts(store, shm_dir, monkeypatch,
                                                              rank):
    import vllm.distributed.parallel_state as ps

    eng, tier = store
    extra = {**tier().config.extra, "directory": shm_dir}
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: rank)
    w = _connector("ec_producer", extra, sched=False)
    try:
        assert (w._tier is not None) == (rank == 0)
        w._keys.put("img-30", key(30))
        w.save_caches({"img-30": output(30, torch.float32)}, "img-30")
        if w._tier is not None:
            assert w._tier.flush(5)
        assert (tier().store_key(key(30)) in eng.objects) == (rank == 0)
    finally:
        w.shutdown()


@needs_vllm
def test_ec_both_puts_on_its_worker_and_fetches_on_its_scheduler(store, tmp_path):
    """An ``ec_both`` instance's worker (node A) puts what it publishes; an
    ``ec_both`` scheduler of node B defers, fetches and holds it."""
    eng, tier = store
    base = tier().config.extra
    dirs = {n: tmp_path / n for n in ("node-a", "node-b")}
    for d in dirs.values():
        d.mkdir()
    w = _connector("ec_both", {**base, "directory": str(dirs["node-a"])}, sched=False)
    s = _connector("ec_both", {**base, "directory": str(dirs["node-b"])}, sched=True)
    try:
        assert w._tier is not None and s._tier is not None and s._holds.fetches is not None
        req = _request("both-1", ["img-b"])
        k = s._keys_of(req)[0]
        w._keys.put("img-b", k)
        w.save_caches({"img-b": output(43, torch.float32)}, "img-b")
        assert w._tier.flush(5) and w._tier.store_key(k) in eng.objects
        w._store.close()  # node A's segments are not node B's
        assert _until_available(s, req) >= 1 and s.has_cache_item("img-b")
        assert torch.equal(s._holds.hit("img-b").load(SERVER), output(43, torch.float32))
        s.request_finished(req)
    finally:
        s.shutdown()
        w.shutdown()
    assert [mmshm_files(str(d)) for d in dirs.values()] == [[], []]


@needs_vllm
def test_a_typoed_key_is_one_warning_and_the_connector_starts(store, shm_dir, caplog):
    _, tier = store
    extra = {**tier().config.extra, "directory": shm_dir, "store_timout_s": 1}
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        s = _connector("ec_consumer", extra, sched=True)
    try:
        said = [r.getMessage() for r in caplog.records if "store_timout_s" in r.getMessage()]
        assert len(said) == 1 and s._tier is not None
    finally:
        s.shutdown()


def _request(rid: str, idents):
    """A real vLLM ``Request`` with one image per item name of ``idents``."""
    return vllm_request(rid, [(ident, _pixels(ident)) for ident in idents], ROWS)


def _pixels(ident: str) -> dict:
    g = torch.Generator().manual_seed(sum(map(ord, ident)))
    return {"pixel_values": torch.randn(ROWS * 4, 64, generator=g),
            "image_grid_thw": torch.tensor([[1, 8, 16]])}


def _until_available(sched, req, computed: int = 0, limit_s: float = 5.0) -> int:
    steps, end = 0, time.monotonic() + limit_s
    while not sched.ensure_cache_available(req, computed):
        steps += 1
        assert time.monotonic() < end, "still in transit"
        time.sleep(0.01)
    return steps


@needs_vllm
def test_vllm_a_request_aborted_in_transit_holds_nothing_and_the_next_hits_locally(
        store, shm_dir):
    eng, tier = store
    extra = {**tier().config.extra, "directory": shm_dir}
    encoder = tier()
    s = _connector("ec_consumer", extra, sched=True)
    try:
        req = _request("pd-1", ["img-p"])
        k = s._keys_of(req)[0]
        assert encoder.put(k, output(40, torch.float32)) and encoder.flush(5)
        eng.gate.clear()
        assert s.ensure_cache_available(req, 0) is False
        s.request_finished(req)  # aborted while its image is in transit
        eng.gate.set()
        end = time.monotonic() + 5
        while s._holds.fetches._by_key[k].state != "done" and time.monotonic() < end:
            time.sleep(0.01)
        assert not s._holds.held and not s._holds.waiting and not s._store.held()
        req2 = _request("pd-2", ["img-p"])
        assert s.ensure_cache_available(req2, 0) is True and s.has_cache_item("img-p")
        assert eng.gets == 1
        s.request_finished(req2)
        assert not s._store.held()
    finally:
        s.shutdown()


@needs_vllm
def test_vllm_a_running_request_asked_again_per_chunk_loads_each_image_once(store, shm_dir):
    from types import SimpleNamespace

    from vllm.distributed.ec_transfer import ec_transfer_state
    from vllm.v1.worker.ec_connector_model_runner_mixin import (
        ECConnectorModelRunnerMixin as Mixin,
    )

    eng, tier = store
    extra = {**tier().config.extra, "directory": shm_dir}
    encoder = tier()
    s = _connector("ec_consumer", extra, sched=True)
    ec_transfer_state.ensure_ec_transfer_initialized(_vllm_config("ec_consumer", extra))
    try:
        req = _request("pd-3", ["img-q", "img-r"])
        keys = s._keys_of(req)
        for n, k in enumerate(keys):
            assert encoder.put(k, output(41 + n, torch.float32))
        assert encoder.flush(5)
        assert _until_available(s, req) >= 1
        assert [s.has_cache_item(f.identifier) for f in req.mm_features] == [True, True]
        s.update_state_after_alloc(req, 0)  # the first chunk reaches the first image only
        out = SimpleNamespace(ec_connector_metadata=s.build_connector_meta(None),
                              finished_req_ids=set())
        cache: dict = {}
        with Mixin.maybe_get_ec_connector_output(out, encoder_cache=cache):
            pass
        gets = eng.gets
        for computed in (2 + ROWS, 2 + ROWS + 2):  # RUNNING: vLLM asks again each chunk
            assert s.ensure_cache_available(req, computed) is True
        s.update_state_after_free(req, 0)
        s.update_state_after_alloc(req, 1)
        out = SimpleNamespace(ec_connector_metadata=s.build_connector_meta(None),
                              finished_req_ids=set())
        with Mixin.maybe_get_ec_connector_output(out, encoder_cache=cache):
            pass
        assert torch.equal(cache["img-q"], output(41, torch.float32))
        assert torch.equal(cache["img-r"], output(42, torch.float32))
        assert eng.gets == gets == 2
        stats = s.get_ec_connector_stats().data
        assert stats.get("hits") == 2 and not [k for k, v in stats.items()
                                               if k.startswith("fallback_") and v], stats
        del cache
        s.request_finished(req)
        assert not s._store.held()
    finally:
        s.shutdown()
        ec_transfer_state.ensure_ec_transfer_shutdown()


# -- a request's items: one batch ---------------------------------------------------------------
def test_a_requests_items_asked_in_one_pass_are_fetched_in_one_batch(store, nodes, monkeypatch):
    """The items one scheduler pass asks for (``Holdings.looking``, as vLLM's
    ``ensure_cache_available`` asks for a request's items) wake the reader
    once, and it reads them in one scattered get: one ``fetch_local_many``
    call with all three, though the pass is slow between its asks."""
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    publish(a, tier(), [20, 21, 22])
    calls: list[list[bytes]] = []
    real = ec_store.fetch_local_many

    def spy(cache, tier_, items):
        calls.append([k for k, *_ in items])
        return real(cache, tier_, items)

    monkeypatch.setattr(ec_store, "fetch_local_many", spy)
    holds = Holdings(b, Counts(SERVER), tier())
    with holds.looking():
        for n, i in enumerate((20, 21, 22)):
            assert look(holds, "r1", n, f"img-{i}", i) is PENDING
            time.sleep(0.05)  # time enough for a woken reader to take the first alone
    got, _ = until_ready(holds, [("r1", n, f"img-{i}", i) for n, i in enumerate((20, 21, 22))])
    assert calls == [[key(20), key(21), key(22)]]
    assert eng.batches == [[holds.fetches.tier.store_key(key(i)) for i in (20, 21, 22)]]
    for (_, n), e in sorted(got.items()):
        assert e is not None and torch.equal(e.load(), output(20 + n))
    holds.close()


def test_a_batch_is_bounded_by_the_bytes_its_items_expect(store, nodes, monkeypatch):
    """A batch stops growing once its items expect :data:`MAX_BATCH_BYTES`
    (one ``store_timeout_s`` bounds a whole batch): three items of
    ``ROWS x WIDTH`` bf16 under a bound of two items' bytes read in two
    batches, every byte equal."""
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    publish(a, tier(), [23, 24, 25])
    monkeypatch.setattr(ec_connector, "MAX_BATCH_BYTES", 2 * ROWS * WIDTH * 2)
    holds = Holdings(b, Counts(SERVER), tier())
    asks = [("r1", n, f"img-{i}", i) for n, i in enumerate((23, 24, 25))]
    with holds.looking():
        for ask in asks:
            assert look(holds, *ask) is PENDING
    got, _ = until_ready(holds, asks)
    assert [len(k) for k in eng.batches] == [2, 1]
    for (_, n), e in sorted(got.items()):
        assert e is not None and torch.equal(e.load(), output(23 + n))
    holds.close()
