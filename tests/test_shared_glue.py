"""What both integrations share, in the core: the request views
(:mod:`mmshm.transport.views`), the queue hops (:mod:`mmshm.transport.mqhops`),
an EC connector's item keys and stats arithmetic (:mod:`mmshm.transport.ec_items`),
the stamped hop, the byte adder and the context wrapper
(:mod:`mmshm.hooks.observe`), and the registry (:mod:`mmshm.hooks.instrumentor`).
The servers' own use of them is tested against their code (tests/integrations)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import threading
import time
import types

import numpy as np
import pytest
import torch
from mmshm import ShmTensor
from mmshm.hooks import instrumentor, observe
from mmshm.transport import ec_items, mqhops, receiving, views
from mmshm.transport.ec_connector import Counts

from tests.harness.metrics import metric


def _view(n: int = 64):
    """A zero-copy view of a segment, as a receiver holds one (and its handle's name)."""
    h = ShmTensor.from_tensor(torch.arange(n, dtype=torch.float32))
    name, wire = h.name, h.encode()
    h.hand_over()  # its reference travels with the "message"
    return receiving.materialize_wire(wire, "float32", (n,)), name


def test_tensors_finds_them_in_nested_lists_in_order():
    a, b, c = torch.zeros(1), torch.ones(2), torch.zeros(3)
    assert [t.shape for t in views.tensors([a, (b, [c, "x"]), None])] == \
        [t.shape for t in (a, b, c)]
    assert views.tensors(a)[0] is a and views.tensors("text") == [] and views.tensors(None) == []


def test_drop_lets_go_of_the_views_of_segments_only(shm_dir):
    view, name = _view()
    holders = [types.SimpleNamespace(data=[view]), types.SimpleNamespace(data=[torch.ones(4)])]
    assert views.drop((h, "data", h.data) for h in holders) == 1
    assert holders[0].data is None and holders[1].data is not None  # a plain tensor is kept
    del view
    import gc

    gc.collect()
    assert not any(name in f for f in os.listdir(shm_dir))  # the segment went with its view

    def broken():
        yield types.SimpleNamespace(), "data", [object()]
        raise RuntimeError("a request that cannot be read")

    assert views.drop(broken()) == 0  # never raises


def test_mark_cached_marks_the_segments_of_views(shm_dir):
    from mmshm.operations import status
    from mmshm.segments.table import TABLE

    view, name = _view()
    seg = TABLE.segments[name]
    assert status.lock_marks(os.getpid(), seg.fd)[1] is False
    assert views.mark_cached([[torch.ones(2)]]) == 0
    assert views.mark_cached([[view]]) == 1
    assert status.lock_marks(os.getpid(), seg.fd)[1] is True
    del view, seg


@pytest.mark.parametrize("addr, local", [
    ("ipc:///tmp/x", True), ("inproc://a", True), ("tcp://127.0.0.1:5555", True),
    ("tcp://[::1]:5555", True), ("tcp://localhost:1", True), ("tcp://10.0.0.2:5555", False),
    ("tcp://0.0.0.0:5555", False), ("", False)])
def test_is_local_endpoint(addr, local):
    assert views.is_local_endpoint(addr) is local


def test_socket_endpoint_reads_a_zmq_socket_or_says_unknown():
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    try:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        assert views.socket_endpoint(sock) == f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(0)
        ctx.term()
    assert views.socket_endpoint(None) == "" and views.socket_endpoint(object()) == ""


def test_warn_numpy_says_a_large_array_once(caplog):
    said: set[str] = set()
    small, big = np.zeros(4, np.float16), np.zeros((2, 600), np.float16)
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        assert not views.warn_numpy([("feature", small), ("feature", torch.zeros(9999))],
                                    1024, said, "why")
        assert views.warn_numpy([("feature", [small, big])], 1024, said, "the reason")
        assert not views.warn_numpy([("feature", big)], 1024, said, "again")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "feature of 2400 bytes is a numpy array" in lines[0] \
        and lines[0].endswith("(said once). the reason"), lines


def test_unwrap_or_fail_copies_or_turns_the_request_into_its_failure(shm_dir, monkeypatch):
    from mmshm import MaterializeError
    from mmshm.errors import failure_reason
    from mmshm.transport import wrapping

    req = types.SimpleNamespace(x=torch.arange(4096, dtype=torch.float32))
    wrapped = wrapping.wrap(req, min_bytes=0)
    assert isinstance(wrapped.x, ShmTensor)
    out = views.unwrap_or_fail(wrapped, lambda r, e: pytest.fail(str(e)))
    assert torch.equal(out.x, torch.arange(4096, dtype=torch.float32))
    gone = FileNotFoundError(2, "No such file or directory")

    def lost(obj, copy=False):
        raise gone

    monkeypatch.setattr(wrapping, "unwrap", lost)
    seen = []
    assert views.unwrap_or_fail(req, lambda r, e: seen.append((r, e)) or "failed") == "failed"
    assert seen[0][0] is req and isinstance(seen[0][1], MaterializeError)
    assert seen[0][1].reason == failure_reason(gone)
    monkeypatch.setattr(wrapping, "unwrap", lambda obj, copy=False: 1 // 0)
    with pytest.raises(ZeroDivisionError):  # not a transport failure: not the request's
        views.unwrap_or_fail(req, lambda r, e: "failed")


# -- the hooks ----------------------------------------------------------------------------
def test_a_stamped_hop_is_timed_from_its_stamp_to_its_arrival(mode):
    mode("observe")
    hop = observe.StampedHop("shape", "s1")
    address = observe.stamp_address("test-shared-glue", str(os.getpid()), str(time.time()))
    n = lambda: metric("mmshm_ipc_seconds_count", server="shape", hop="s1",  # noqa: E731
                       transport="server")
    errors = lambda: metric("mmshm_observe_errors_total", server="shape", hop="s1")  # noqa: E731
    n0, e0 = n(), errors()
    assert hop.take() is False  # outside a send
    with hop.receiving(lambda: [address]):
        with hop.sending(lambda: address):
            to = hop.take()
            assert to == address and hop.take() is False  # once per message
            hop.stamp(to, lambda: "req-1")
        assert hop.arrived(time.monotonic_ns(), lambda: ("req-1", 10)) >= 0
        assert hop.arrived(time.monotonic_ns(), lambda: None) is None  # not a message of it
        assert hop.arrived(time.monotonic_ns(), lambda: 1 // 0) is None  # counted
    assert hop.arrived(time.monotonic_ns(), lambda: ("req-1", 10)) is None  # closed
    assert n() - n0 == 1 and errors() - e0 == 1
    with hop.sending(lambda: None):  # an unknown channel: timed, no stamp
        assert hop.take() is True
    with hop.sending(lambda: {}["x"]):  # a failure is counted, the send goes on
        assert hop.take() is True
    assert errors() - e0 == 2


def test_endpoint_key_and_frames_bytes():
    assert observe.endpoint_key("tcp://0.0.0.0:5555") == observe.endpoint_key(
        "tcp://10.1.2.3:5555") == "tcp:5555"
    assert observe.endpoint_key("ipc:///a/b") == "ipc:///a/b"
    assert observe.frames_bytes(b"abc") == 3
    assert observe.frames_bytes([b"ab", bytearray(5), memoryview(b"x")]) == 8


def test_adds_counts_into_the_open_hop_only(mode):
    mode("observe")
    adder = observe.adds("shape", lambda out, a, kw: out * 2)()
    assert adder(lambda: 5, None, (), {}) == 5  # no hop open: nothing
    with observe.hop("shape", "a1") as t:
        assert adder(lambda: 5, None, (), {}) == 5 and t.nbytes == 10
        e0 = metric("mmshm_observe_errors_total", server="shape", hop="a1")
        assert observe.adds("shape", lambda *a: 1 // 0)()(lambda: 3, None, (), {}) == 3
        assert metric("mmshm_observe_errors_total", server="shape", hop="a1") - e0 == 1


def test_within_runs_sync_and_async_calls_inside_the_context():
    log = []

    @contextlib.contextmanager
    def ctx(instance, args, kwargs):
        log.append(("in", instance, args))
        yield
        log.append("out")

    wrapper = observe.within(ctx)

    def sync(x):
        log.append("call")
        return x

    async def coro(x):
        log.append("call")
        return x

    assert wrapper(sync, "i", (1,), {}) == 1
    assert asyncio.run(wrapper(coro, "i", (2,), {})) == 2
    assert log == [("in", "i", (1,)), "call", "out", ("in", "i", (2,)), "call", "out"]


def test_shape_bytes_of_a_pointer():
    assert observe.shape_bytes(types.SimpleNamespace(shape=(2, 3), dtype=torch.float16)) == 12
    assert observe.shape_bytes(types.SimpleNamespace(shape=(2, 3), dtype=np.float16)) == 0
    assert observe.shape_bytes(object()) == 0


def test_queue_hops_time_a_named_queue_only(mode):
    mode("observe")
    hops = mqhops.QueueHops("shape")
    lab = {"server": "shape", "hop": "mq_enqueue", "transport": "server"}
    n0 = metric("mmshm_ipc_seconds_count", **lab)

    class Queue:
        pass

    q, other = Queue(), Queue()
    hops.queues.add(q)
    send = hops.enqueue(lambda wrapped, inst, a, kw: (observe.add_bytes(7), wrapped())[1])
    assert send(lambda: "sent", other, (), {}) == "sent"
    assert metric("mmshm_ipc_seconds_count", **lab) == n0  # not a timed queue
    assert send(lambda: "sent", q, (), {}) == "sent"
    assert metric("mmshm_ipc_seconds_count", **lab) - n0 == 1
    assert metric("mmshm_ipc_bytes_sum", **lab) >= 7


def test_title_match_reads_this_process_or_its_parent():
    assert instrumentor.title_match(re.compile(r"no such title \d{40}")) is None
    m = instrumentor.title_match(re.compile(r"python\S*"))
    assert m is not None and "python" in m.group(0)


def test_get_and_available_are_the_registry():
    from mmshm import integrations

    assert integrations.get is instrumentor.get and integrations.available is instrumentor.available
    assert set(instrumentor.available()) <= set(instrumentor.registered())
    with pytest.raises(ValueError, match="unknown instrumentor"):
        instrumentor.get("no-such-server")


# -- an EC connector's item keys -------------------------------------------------------------
def test_item_keys_are_computed_once_per_request_and_refusals_counted(caplog):
    counts = Counts("shape")
    calls = []

    def key(item):
        calls.append(item)
        return (None, "no data") if item == "bad" else (item.encode() * 2, "")

    producer = ec_items.ItemKeys(counts, True, "Toy")
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        assert producer.of("r1", ["a", "bad"], key, str.upper) == [b"aa", None]
        assert producer.of("r1", ["a", "bad"], key, str.upper) == [b"aa", None]
    assert calls == ["a", "bad"] and counts["fallback_unkeyed"] == 1
    assert producer.take_out() == {"A": b"aa"} and producer.take_out() == {}
    producer.forget("r1")
    assert producer.by_request == {}
    consumer = ec_items.ItemKeys(Counts("shape"), False, "Toy")
    assert consumer.of("r2", ["b"], key, str.upper) == [b"bb"] and consumer.take_out() == {}


def test_count_stats_and_worker_metadata_arithmetic():
    import dataclasses

    @dataclasses.dataclass
    class Stats(ec_items.CountStats):
        data: dict = dataclasses.field(default_factory=dict)

    @dataclasses.dataclass
    class Meta(ec_items.CountsAndFailures):
        counts: dict = dataclasses.field(default_factory=dict)
        failed: dict = dataclasses.field(default_factory=dict)

    s = Stats({"loads": 1, "hash_seconds": 0.1234567}).aggregate(Stats({"loads": 2, "saves": 0}))
    assert isinstance(s, Stats) and s.reduce() == {"hash_seconds": 0.123457, "loads": 3}
    assert not s.is_empty()
    s.reset()
    assert s.is_empty() and s.data == {}
    m = Meta({"loads": 1}, {"r1": "a"}).aggregate(Meta({"loads": 2}, {"r2": "b"}))
    assert m == Meta({"loads": 3}, {"r1": "a", "r2": "b"})


def test_the_namespace_and_the_line():
    ns = ec_items.namespace("org/model", "abc", torch.bfloat16, None, {"a": 1}, None, "pixels")
    assert ns.startswith("weights=") and " dtype=bfloat16 quant=- rev=abc hf_overrides=" in ns
    assert ns.endswith(" mm_kwargs=- key=pixels")
    assert ns != ec_items.namespace("org/model", "abc", torch.float16, None, {"a": 1}, None,
                                    "pixels")
    line = ec_items.connector_line("ec_producer", True, "the store")
    assert line.startswith("encoder outputs published through shared memory (ec_producer), "
                           "keyed by content and LoRA adapter; the store")
