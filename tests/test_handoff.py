"""mmshm.transport.handoff: encoder outputs handed to readers, and the handshake.

The producer and the readers are one process here (the segment directory
is the test's private one); the real servers' use is in
tests/integrations/test_sglang_epd.py and tests/e2e/test_sglang_epd.py.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import mmshm
from mmshm.errors import HandleError, WrongNodeError
from mmshm.transport import encoder_cache, handoff
from tests.harness.metrics import metric
from tests.harness.segments import segment_files

SERVER = "sglang"


def _fallbacks(reason: str) -> float:
    return metric("mmshm_epd_fallbacks_total", server=SERVER, reason=reason)


def _refcount(name: str) -> int:
    import os

    from mmshm.segments import segfile

    path = os.path.join(mmshm.config.get().dir, name)
    fd = os.open(path, os.O_RDWR)
    try:
        return segfile.read_state(fd, path)[1]
    finally:
        os.close(fd)


@pytest.fixture
def ho():
    h = handoff.Handoff(SERVER)
    yield h
    h.close()
    gc.collect()


def test_one_write_a_reference_per_reader_gone_after_the_last(ho):
    """Published once; each handle owns one reference added before its send;
    each reader's view holds its own and gives the handle's back; the
    segment goes when the producer is done and the last view is collected."""
    t = torch.randn(16, 8).to(torch.bfloat16)
    saves = metric("mmshm_epd_saves_total", server=SERVER)
    loads = metric("mmshm_epd_loads_total", server=SERVER)
    pub = ho.publish(t, label="r1")
    assert pub is not None and pub.nbytes == t.nbytes
    wires = [ho.handle(pub) for _ in range(3)]
    assert all(handoff.is_handle(w) and len(w) < 100 for w in wires)
    assert _refcount(pub.name) == 4  # the producer's + one per reader
    views = [handoff.take(w, t.dtype, t.shape, SERVER) for w in wires[:2]]
    assert all(torch.equal(v, t) for v in views)
    assert _refcount(pub.name) == 4  # two views (their own) + one unread + the producer's
    assert handoff.give_back(wires[2])
    ho.done(pub)
    assert segment_files() == [pub.name]  # the views keep it
    assert metric("mmshm_epd_saves_total", server=SERVER) - saves == 1
    assert metric("mmshm_epd_loads_total", server=SERVER) - loads == 2
    del views
    gc.collect()
    assert segment_files() == []


def test_a_handle_of_another_dtype_or_shape_is_refused_and_given_back(ho):
    t = torch.randn(4, 8)
    pub = ho.publish(t)
    before = _fallbacks("incompatible")
    with pytest.raises(HandleError, match="the message says"):
        handoff.take(ho.handle(pub), torch.float16, t.shape, SERVER)
    with pytest.raises(HandleError, match="the message says"):
        handoff.take(ho.handle(pub), t.dtype, (8, 4), SERVER)
    assert _fallbacks("incompatible") - before == 2
    assert _refcount(pub.name) == 1  # only the producer's: both handles given back
    ho.done(pub)
    assert segment_files() == []


def test_a_vanished_output_fails_the_take_typed_and_counted(ho):
    t = torch.randn(4, 8)
    pub = ho.publish(t)
    wire = ho.handle(pub)
    ho.done(pub)
    assert handoff.give_back(wire)  # someone else gave the reader's reference back
    assert segment_files() == []
    with pytest.raises(OSError):
        handoff.take(wire, t.dtype, t.shape, SERVER)
    assert not handoff.give_back(wire)  # nothing left to give back to


@pytest.mark.parametrize("wire", [b"", b"garbage", handoff.MAGIC + b"\x93\x01",
                                  handoff.Wire("mmshm-1-0123456789abcdef", 0, 6, (2, 2), 99,
                                               0).encode(),
                                  handoff.Wire("../etc/passwd", 0, 6, (1,), 4, 0).encode()])
def test_a_malformed_handle_is_a_typed_error(wire):
    with pytest.raises(HandleError):
        handoff.take(wire, None, None, SERVER)
    assert not handoff.give_back(wire)


def test_a_handle_of_another_node_is_refused(ho, monkeypatch):
    t = torch.randn(2, 2)
    pub = ho.publish(t)
    wire = ho.handle(pub)
    monkeypatch.setenv("MMSHM_NODE_ID", "7")
    mmshm.config.reload()
    try:
        with pytest.raises(WrongNodeError):
            handoff.take(wire, t.dtype, t.shape, SERVER)
    finally:
        monkeypatch.delenv("MMSHM_NODE_ID")
        mmshm.config.reload()
    assert handoff.give_back(wire)
    ho.done(pub)
    assert segment_files() == []


def test_an_inbox_gives_back_what_was_not_taken(ho):
    """Handles seen in a scope and not taken get their references back at its
    end; a taken one is the view's; other frames are not handles."""
    t = torch.randn(4, 4)
    pub = ho.publish(t)
    a, b = ho.handle(pub), ho.handle(pub)
    with handoff.Inbox() as box:
        assert handoff.Inbox.current() is box
        for frame in (a, b, t.numpy().tobytes()):
            box.saw(frame)
        box.took(a)
        view = handoff.take(a, t.dtype, t.shape, SERVER)
    assert handoff.Inbox.current() is None
    ho.done(pub)
    assert _refcount(pub.name) == 1  # the view's only: b given back
    del view
    gc.collect()
    assert segment_files() == []


def test_cards_prove_a_reader_of_this_node_only(monkeypatch, caplog):
    """A card of this node proves its endpoint; no card, or a card of another
    node id (another IPC or mount namespace), does not, with the reason;
    withdrawn cards leave nothing."""
    reader, producer = handoff.Cards(SERVER), handoff.Cards(SERVER)
    assert reader.publish("127.0.0.1:5001")
    monkeypatch.setenv("MMSHM_NODE_ID", "7")
    mmshm.config.reload()
    assert reader.publish("127.0.0.1:5003")
    monkeypatch.delenv("MMSHM_NODE_ID")
    mmshm.config.reload()
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        assert producer.check("127.0.0.1:5001") is None
        assert "no card" in producer.check("127.0.0.1:5002")
        assert "on node 7" in producer.check("127.0.0.1:5003")
    assert not any("cannot meet" in r.getMessage() for r in caplog.records)
    reader.withdraw("127.0.0.1:5001")
    assert producer.check("127.0.0.1:5001") is None  # cached for CARD_TTL_S
    producer.forget()
    assert producer.check("127.0.0.1:5001") is not None
    reader.close()
    producer.close()
    assert segment_files() == []


def test_count_is_the_metrics_objects(caplog):
    encoder_cache._WARNED.discard("unproven")
    before = _fallbacks("unproven")
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        handoff.count(SERVER, "unproven", "a reader at x", "fix it")
        handoff.count(SERVER, "unproven", "a reader at y", "fix it")
    assert _fallbacks("unproven") - before == 2
    said = [r.getMessage() for r in caplog.records if "reason=unproven" in r.getMessage()]
    assert len(said) == 1 and "a reader at x" in said[0] and "fix it" in said[0]
