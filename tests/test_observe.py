"""Observe mode's core (:mod:`mmshm.hooks.observe`): one observation per message
with the bytes it serialized, the same bytes on the wire as pyzmq's own
``send_pyobj``, nothing recorded for what raised, and a failed timing counted
without touching the message. The hops in the real servers are tested by the
e2e tests (tests/e2e)."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch
import zmq
from mmshm import config
from mmshm.hooks import observe

from tests.harness.metrics import metric


@pytest.fixture
def taps():
    assert observe.install_taps() == []
    yield
    observe.remove_taps()


def _labels(hop, transport="server", server="test"):
    return {"server": server, "hop": hop, "transport": transport}


def test_a_hop_records_seconds_and_bytes_under_its_transport(mode):
    mode("observe")
    before = metric("mmshm_ipc_bytes_sum", **_labels("h1"))
    with observe.hop("test", "h1") as t:
        t.add(1000)
        observe.add_bytes(234)
    assert metric("mmshm_ipc_bytes_sum", **_labels("h1")) - before == 1234
    assert metric("mmshm_ipc_seconds_count", **_labels("h1")) >= 1
    mode("shm")
    with observe.hop("test", "h1"):
        observe.add_bytes(5)
    assert metric("mmshm_ipc_bytes_sum", **_labels("h1", "mmshm")) == 5


def test_what_raised_or_was_skipped_records_nothing(mode):
    mode("observe")
    n0 = metric("mmshm_ipc_seconds_count", **_labels("h2"))
    with pytest.raises(KeyError):  # the server's exception goes on unchanged
        with observe.hop("test", "h2") as t:
            t.add(10)
            raise KeyError("the server's")
    with observe.hop("test", "h2") as t:
        t.skip = True
    assert metric("mmshm_ipc_seconds_count", **_labels("h2")) == n0
    assert observe.current() is None
    observe.add_bytes(7)  # no hop open: nothing, no error


def test_a_joined_hop_counts_into_the_open_one_and_records_once(mode):
    """``hop(..., join=True)`` inside the same hop adds to it (SGLang 0.5.15+'s
    unwrap inside its timed finalize: one observation per batch); alone, or
    inside another hop, it is a message of its own."""
    mode("observe")
    n = lambda h: metric("mmshm_ipc_seconds_count", **_labels(h))  # noqa: E731
    b = lambda h: metric("mmshm_ipc_bytes_sum", **_labels(h))  # noqa: E731
    n0, b0 = n("j1"), b("j1")
    with observe.hop("test", "j1") as outer:
        for size in (100, 200):
            with observe.hop("test", "j1", join=True) as t:
                assert t is outer
                t.add(size)
        assert observe.current() is outer
    assert (n("j1") - n0, b("j1") - b0) == (1, 300)
    with observe.hop("test", "j1", join=True) as t:  # nothing open: its own message
        t.add(5)
    with observe.hop("test", "other"):
        with observe.hop("test", "j1", join=True) as t:  # another hop open: its own too
            t.add(7)
    assert (n("j1") - n0, b("j1") - b0) == (3, 312)
    with pytest.raises(ValueError):  # a raise inside a joined block goes on unchanged
        with observe.hop("test", "j1") as outer:
            with observe.hop("test", "j1", join=True):
                raise ValueError("the server's")
    assert n("j1") - n0 == 3 and observe.current() is None


def test_send_pyobj_puts_the_same_bytes_on_the_wire_and_counts_them(mode, taps):
    mode("observe")
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://mmshm-observe-test")
        b.connect("inproc://mmshm-observe-test")
        obj = {"pixel_values": torch.arange(100_000, dtype=torch.float32), "rid": "r1"}
        want = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        s0 = metric("mmshm_ipc_bytes_sum", **_labels("send"))
        r0 = metric("mmshm_ipc_bytes_sum", **_labels("recv"))
        with observe.zmq_hop("test", "send"):
            a.send_pyobj(obj, protocol=pickle.HIGHEST_PROTOCOL)
        raw = b.recv()
        assert raw == want  # byte for byte what pyzmq's own send_pyobj sends
        assert metric("mmshm_ipc_bytes_sum", **_labels("send")) - s0 == len(want)
        # outside a zmq hop: pyzmq's own function, nothing recorded
        a.send_pyobj(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with observe.zmq_hop("test", "recv"):
            got = b.recv_pyobj()
            with pytest.raises(zmq.Again):  # nothing queued: no message, nothing recorded
                b.recv_pyobj(zmq.NOBLOCK)
        assert torch.equal(got["pixel_values"], obj["pixel_values"]) and got["rid"] == "r1"
        assert metric("mmshm_ipc_bytes_sum", **_labels("send")) - s0 == len(want)
        assert metric("mmshm_ipc_bytes_sum", **_labels("recv")) - r0 == len(want)
        assert metric("mmshm_ipc_bytes_count", **_labels("recv")) >= 1
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_a_failed_timing_is_counted_and_the_message_goes_through(mode, taps, monkeypatch):
    mode("observe")
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)

    class Broken:
        def labels(self, **kw):
            raise RuntimeError("metrics store unwritable")

    try:
        a.bind("inproc://mmshm-observe-broken")
        b.connect("inproc://mmshm-observe-broken")
        e0 = metric("mmshm_observe_errors_total", server="test", hop="broken")
        monkeypatch.setattr(observe, "IPC_SECONDS", Broken())
        with observe.zmq_hop("test", "broken"):
            a.send_pyobj([1, 2, 3])
        assert b.recv_pyobj() == [1, 2, 3]
        assert metric("mmshm_observe_errors_total", server="test", hop="broken") - e0 == 1
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_the_broadcast_tap_counts_what_torch_distributed_sends(mode, taps, tmp_path):
    import torch.distributed as dist

    mode("observe")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        data = torch.zeros(12345, dtype=torch.uint8)
        b0 = metric("mmshm_ipc_bytes_sum", **_labels("bcast"))
        with observe.hop("test", "bcast") as t:
            t.count_broadcasts = True
            dist.broadcast(torch.tensor([12345], dtype=torch.long), src=0)
            dist.broadcast(data, src=0)
        dist.broadcast(data, src=0)  # no hop asked: not counted
        assert metric("mmshm_ipc_bytes_sum", **_labels("bcast")) - b0 == 12345 + 8
        # a receiver's clock starts once the size broadcast has returned
        with observe.hop("test", "bcast") as t:
            t.count_broadcasts = t.clock_at_first_broadcast = True
            t0 = t.t0
            dist.broadcast(torch.tensor([1], dtype=torch.long), src=0)
            t1 = t.t0
            dist.broadcast(data, src=0)
            assert t1 > t0 and t.t0 == t1 and not t.clock_at_first_broadcast
    finally:
        dist.destroy_process_group()


def test_the_taps_come_off(taps):
    assert isinstance(zmq.Socket.send_pyobj, object)
    observe.remove_taps()
    import torch.distributed as dist
    from zmq.sugar.socket import Socket

    assert "FunctionWrapper" not in type(vars(Socket)["send_pyobj"]).__name__
    assert "FunctionWrapper" not in type(dist.broadcast).__name__
    assert observe.install_taps() == []  # and go back on (the fixture removes them)


def test_a_bad_mode_warns_and_keeps_shm(monkeypatch, caplog):
    monkeypatch.setenv("MMSHM_MODE", "watch")
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        s = config.reload()
    assert s.mode == "shm" and not s.observe
    assert any("MMSHM_MODE" in r.getMessage() and "shm or observe" in r.getMessage()
               for r in caplog.records)
    monkeypatch.delenv("MMSHM_MODE")
    config.reload()


# -- stamps: a hop whose two ends are in two processes ---------------------------------
def test_a_stamp_from_another_process_times_the_gap_on_one_clock(mode, tmp_path):
    """A stamp sent by another process (its ``time.monotonic_ns()``) reaches
    the receiver before the sender exits, and the gap recorded lies within
    the time the parent saw the child run: one CLOCK_MONOTONIC for both."""
    import subprocess
    import sys
    import time

    mode("observe")
    addr = observe.stamp_address("test", str(tmp_path))
    rx = observe.StampReceiver("test", "stamp_hop", [addr])
    try:
        n0 = metric("mmshm_ipc_seconds_count", **_labels("stamp_hop"))
        t0 = time.monotonic_ns()
        subprocess.run([sys.executable, "-c",
                        "import sys; from mmshm.hooks import observe; "
                        "assert observe.send_stamp('test', 'stamp_hop', bytes.fromhex("
                        "sys.argv[1]), 'req-9')", addr.hex()], check=True, timeout=60)
        t1 = time.monotonic_ns()
        assert rx.take("other") is None  # read, kept for its own key
        seconds = rx.observe("req-9", t1, 1234)
        assert seconds is not None and 0 <= seconds <= (t1 - t0) / 1e9
        assert metric("mmshm_ipc_seconds_count", **_labels("stamp_hop")) == n0 + 1
        assert metric("mmshm_ipc_bytes_sum", **_labels("stamp_hop")) >= 1234
        assert rx.observe("req-9", t1, 1) is None  # taken once: no second observation
    finally:
        rx.close()


def test_a_stamp_that_cannot_go_or_makes_no_sense_is_no_observation(mode, tmp_path, caplog):
    """No receiver: send_stamp returns False, counts a failed timing and says
    it at WARNING; a stamp from the future (another clock) is counted, not
    recorded; the keys kept for undecoded messages are bounded."""
    mode("shm")
    errs = metric("mmshm_observe_errors_total", server="test", hop="stamp_gone")
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        assert not observe.send_stamp("test", "stamp_gone", observe.stamp_address("nobody"),
                                      "r")
    assert metric("mmshm_observe_errors_total", server="test", hop="stamp_gone") == errs + 1
    addr = observe.stamp_address("test-2", str(tmp_path))
    rx = observe.StampReceiver("test", "stamp_odd", [addr])
    try:
        # a second receiver on the same channel cannot bind: said, left out
        with caplog.at_level(logging.WARNING, logger="mmshm"):
            rx2 = observe.StampReceiver("test", "stamp_odd", [addr])
        assert rx2.socks == [] and "stamp channel could not be opened" in caplog.text
        assert observe.send_stamp("test", "stamp_odd", addr, "future", ns=10**18)
        n = metric("mmshm_ipc_seconds_count", **_labels("stamp_odd", "mmshm"))
        e = metric("mmshm_observe_errors_total", server="test", hop="stamp_odd")
        assert rx.observe("future", 5, 1) is None
        assert metric("mmshm_ipc_seconds_count", **_labels("stamp_odd", "mmshm")) == n
        assert metric("mmshm_observe_errors_total", server="test", hop="stamp_odd") == e + 1
        for i in range(observe.STAMPS_KEPT + 5):
            rx.pending[f"k{i}"] = i
        assert rx.take("k0") is None and rx.take(f"k{observe.STAMPS_KEPT + 4}") is not None
        assert len(rx.pending) < observe.STAMPS_KEPT
    finally:
        rx.close()
