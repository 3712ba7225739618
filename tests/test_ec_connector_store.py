"""An EC connector's Mooncake Store leg (:mod:`mmshm.transport.ec_connector`):
a producer's save also puts the published entry's bytes into the Store; a
consumer's scheduler that misses on its own node answers "still in transit"
(:data:`~mmshm.transport.ec_connector.PENDING`) while one reader thread
fetches the object into its node's shared memory, then holds and loads it as
a local entry; a fetch that misses is counted once by its reason and the item
is encoded locally; a Store that hangs bounds the request's wait.

Both nodes are segment directories of their own in this process (an
:class:`~mmshm.transport.encoder_cache.EncoderCache` each; node A's is closed
once it has put its outputs, as one process's segment table would otherwise
find them by name); the Store is the real
:class:`~mmshm.transport.ec_store.StoreTier` on a stand-in engine (a dict,
tests/test_ec_store.py's ``FakeEngine``). The real master and real servers:
tests/test_ec_store.py and tests/e2e/test_vllm_epd.py."""

from __future__ import annotations

import time

import pytest
import torch
from mmshm.metrics import EPD_FALLBACKS
from mmshm.transport import ec_connector, ec_store
from mmshm.transport.ec_connector import PENDING, Counts, Holdings
from mmshm.transport.encoder_cache import EncoderCache, content_key

ROWS, WIDTH = 64, 96
SERVER = "vllm"


def output(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + i)
    return torch.randn(ROWS, WIDTH, generator=g).to(torch.bfloat16)


def key(i: int) -> bytes:
    return content_key(f"photo {i}", "model")


def fallbacks(reason: str) -> float:
    return EPD_FALLBACKS.labels(server=SERVER, reason=reason)._value.get()


def publish(cache_a: EncoderCache, tier_a, items) -> Counts:
    counts = Counts(SERVER)
    for i in items:
        res = ec_connector.save(cache_a, key(i), output(i), f"img-{i}", counts, tier_a)
        assert res.published
    assert tier_a.flush(10)
    assert not cache_a.held(), "the puts gave their holds back"
    cache_a.close()  # node A's segments are not node B's
    return counts


def look_until_ready(holds: Holdings, rid: str, items, limit_s: float = 10.0):
    """The scheduler's calls, step by step, until no item is in transit:
    ``(entries, steps deferred)``."""
    end, steps = time.monotonic() + limit_s, 0
    got = [PENDING] * len(items)
    while True:
        for n, i in enumerate(items):  # as the server asks: every item not yet computed
            g = holds.look(rid, n, f"item-{i}", key(i), rows=ROWS, dtype=torch.bfloat16,
                           width=WIDTH)
            if got[n] is PENDING:
                got[n] = g
        if not any(g is PENDING for g in got):
            return got, steps
        steps += 1
        assert time.monotonic() < end, "still in transit"
        time.sleep(0.01)


def test_pd_on_another_node_defers_then_loads_equal_bytes_and_a_second_pd_hits_locally(
        store, nodes):
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    tier_a, tier_b = tier(), tier()
    made = publish(a, tier_a, [0, 1, 2])
    assert made["saves"] == 3 and tier_a.stats["puts"] == 3
    counts = Counts(SERVER)
    holds = Holdings(b, counts, tier_b)
    got, steps = look_until_ready(holds, "r1", [0, 1, 2])
    assert steps >= 1, "the first look is a miss on node B: the request is deferred"
    assert all(e is not None and e is not PENDING for e in got), (got, tier_b.stats, holds.missed)
    cache: dict = {}
    loads = [("r1", f"item-{i}", holds.hit(f"item-{i}")) for i in range(3)]
    ec_connector.load(loads, cache, "cpu", counts, {}, "")
    for i in range(3):
        assert torch.equal(cache[f"item-{i}"], output(i))
    assert tier_b.stats["gets"] == 3 and counts["hits"] == 3 and counts["loads"] == 3
    assert not [k for k in counts if k.startswith("fallback_") and counts[k]]
    # a second PD of node B finds them in node B's shared memory: no Store read
    gets = eng.gets
    holds2 = Holdings(nodes("node-b"), Counts(SERVER), tier())
    got2, steps2 = look_until_ready(holds2, "r2", [0, 1, 2])
    assert steps2 == 0 and all(e is not None for e in got2) and eng.gets == gets
    del cache, loads
    holds.finish("r1")
    holds2.finish("r2")
    holds.close()
    holds2.close()


def test_a_store_miss_is_counted_once_by_its_reason_and_encoded_locally(store, nodes):
    _, tier = store
    b = nodes("node-b")
    counts = Counts(SERVER)
    holds = Holdings(b, counts, tier())
    before = (fallbacks("store_absent"), fallbacks("missing"))
    got, steps = look_until_ready(holds, "r1", [7])  # never put
    assert got == [None] and steps >= 1
    holds.miss("r1", "item-7", key(7), ROWS)  # the server encodes it
    assert counts["fallback_store_absent"] == 1
    assert (fallbacks("store_absent") - before[0], fallbacks("missing") - before[1]) == (1, 0)
    # another request for the same content at once reuses the outcome: no second read
    got, steps = look_until_ready(holds, "r2", [7])
    assert got == [None] and steps == 0
    holds.close()


def test_a_hung_store_bounds_the_wait_and_counts_each_item_once(store, nodes):
    eng, tier = store
    a, b = nodes("node-a"), nodes("node-b")
    tier_a, tier_b = tier(0.3), tier(0.3)
    publish(a, tier_a, [0, 1, 2])
    eng.gate.clear()  # every read hangs from now on
    counts = Counts(SERVER)
    holds = Holdings(b, counts, tier_b)
    before = fallbacks("store_timeout")
    t0 = time.monotonic()
    got, _ = look_until_ready(holds, "r1", [0, 1, 2])
    waited = time.monotonic() - t0
    assert got == [None, None, None]
    assert waited < 2 * 0.3 + 0.1, f"waited {waited:.2f} s (bound: twice store_timeout_s)"
    for i in range(3):
        holds.miss("r1", f"item-{i}", key(i), ROWS)
    assert counts["fallback_store_timeout"] == 3
    assert fallbacks("store_timeout") - before == 3
    eng.gate.set()
    holds.close()


def test_a_bad_store_setting_is_one_warning_and_no_leg(caplog):
    with caplog.at_level("WARNING", logger="mmshm"):
        tier = ec_connector.open_tier({"master_server_address": "127.0.0.1:notaport"}, SERVER)
    assert tier is None
    assert "master_server_address" in caplog.text and "Fix" in caplog.text


def test_the_put_reads_the_published_entry_and_gives_its_hold_back(store, nodes):
    eng, tier = store
    a = nodes("node-a")
    tier_a = tier()
    eng.gate.clear()  # the put waits: the entry is held meanwhile
    ec_connector.save(a, key(3), output(3), "img-3", Counts(SERVER), tier_a)
    time.sleep(0.1)
    assert [h.holder for h in a.held()] == ["Mooncake Store put"]
    eng.gate.set()
    assert tier_a.flush(5)
    assert not a.held()
    obj = eng.objects[tier_a.store_key(key(3))]
    payload = obj[ec_store.RECORD_BYTES:]
    assert payload == output(3).view(torch.uint8).numpy().tobytes()


def test_an_object_leaves_the_store_after_the_keep_time(store, nodes):
    eng, tier = store
    a = nodes("node-a")
    tier_a = tier(keep_s=0.3)
    ec_connector.save(a, key(4), output(4), "img-4", Counts(SERVER), tier_a)
    assert tier_a.flush(5) and tier_a.store_key(key(4)) in eng.objects
    end = time.monotonic() + 5
    while tier_a.store_key(key(4)) in eng.objects and time.monotonic() < end:
        time.sleep(0.05)
    assert tier_a.store_key(key(4)) not in eng.objects, "still in the Store after 5 s"
    assert tier_a.stats["removes"] == 1
