"""Encoder disaggregation (EPD) through mmshm, against SGLang 0.5.23's real
encoder code, on CPU (``python -m tests.run sglang --release 0.5.23``).

The encoder side is SGLang's ``MMEncoder.send_with_url`` -> ``ZmqDelivery.send``
-> ``MMEncoder._send`` -> ``release_request`` (zmq PUSH on 127.0.0.1), the
receive side two TP ranks' ``MMReceiverHTTP._drain_scheduler_embeddings`` ->
``WaitingZmqRequest.consume_parts`` (their own PULL sockets), in one process.
Only the model's multimodal processor (``get_validated_mm_data``) is a stand-in.
Each case runs plain (SGLang's bytes over TCP) and under mmshm (a handle).
"""

from __future__ import annotations

import asyncio
import gc
import os
import types

import pytest

RELEASE = os.environ.get("MMSHM_SGLANG_RELEASE")
if not RELEASE:
    pytest.skip("SGLang integration tests run in `python -m tests.run sglang`'s venvs",
                allow_module_level=True)
V = tuple(int(x) for x in RELEASE.split("."))

import mmshm  # noqa: E402
import torch  # noqa: E402

from tests.harness.metrics import metric  # noqa: E402
from tests.harness.segments import segment_files  # noqa: E402
from tests.integrations import sglang_env as E  # noqa: E402

HAS_ENCODER_PACKAGE = V >= (0, 5, 23)
TP = 2
HIDDEN = 64


@pytest.fixture(scope="module")
def mods():
    E.load()
    if not HAS_ENCODER_PACKAGE:
        return None
    import importlib

    return types.SimpleNamespace(
        server=importlib.import_module("sglang.srt.disaggregation.encoder.server"),
        receiver=importlib.import_module("sglang.srt.disaggregation.encoder.receiver"))


@pytest.fixture(params=["plain", "mmshm"])
def mode(request, monkeypatch):
    mmshm.uninstrument("sglang")
    monkeypatch.setenv("MMSHM_MODE", "shm")
    mmshm.config.reload()
    if request.param == "mmshm":
        mmshm.instrument("sglang")
    yield request.param
    mmshm.uninstrument("sglang")
    gc.collect()


@pytest.fixture(autouse=True)
def epd_state():
    """mmshm's EPD state (the encoder's outputs, the ranks' cards) given back
    after each test, before the private segment directory is checked."""
    yield
    from mmshm.integrations.sglang import epd

    for part in list(epd._STATE.values()):
        if hasattr(part, "close"):
            part.close()
    epd._STATE.clear()
    gc.collect()


def _cards() -> set[str]:
    """The published names of this process's rank cards."""
    from mmshm.integrations.sglang import epd

    cards = epd._STATE.get("cards")
    return set(cards._store.published()) if cards is not None else set()


def _outputs() -> list[str]:
    """The segment files that are no rank's card."""
    return [n for n in segment_files() if n not in _cards()]


needs_package = pytest.mark.skipif(not HAS_ENCODER_PACKAGE,
                                   reason="SGLang's encoder package is 0.5.23's")


# -- SGLang's objects -------------------------------------------------------------------------
class _Processor:
    """The model's multimodal processor: records the embeddings it is given."""

    prefer_tokenized_input = False

    def __init__(self):
        self.got = []

    def get_validated_mm_data(self, prompt, embedding, **meta):
        self.got.append(embedding)
        return types.SimpleNamespace(input_ids=[1, 2, 3], mm_items=[])


def _encoder(mods, monkeypatch):
    """A bare ``MMEncoder`` with what its zmq_to_scheduler send path reads."""
    import zmq.asyncio

    s = mods.server
    monkeypatch.setattr(s, "get_disagg", lambda: types.SimpleNamespace(
        encoder_transfer_backend="zmq_to_scheduler"))
    enc = object.__new__(s.MMEncoder)
    enc.transfer_backend = "zmq_to_scheduler"
    enc.context = zmq.asyncio.Context()
    enc.scheduler_send_locks, enc.scheduler_send_sockets = {}, {}
    enc.send_timeout = 10
    enc.req_states = {}
    enc.delivery = s.ZmqDelivery(enc, cleanup_receive_state=True)
    return enc


def _rank(mods, processor, rid, card=True):
    """One TP rank of the language instance: ``MMReceiverHTTP`` with its shared
    PULL socket, and the ``WaitingZmqRequest`` of ``rid``; with ``card``,
    under mmshm, the rank's card published (what ``MMReceiverBase.__init__``
    does: the handshake)."""
    import zmq

    r = mods.receiver
    recv = object.__new__(r.MMReceiverHTTP)
    recv.scheduler_context = zmq.Context()
    recv.scheduler_recv_socket = recv.scheduler_context.socket(zmq.PULL)
    port = recv.scheduler_recv_socket.bind_to_random_port("tcp://127.0.0.1")
    recv.hostname, recv.scheduler_embedding_port = "127.0.0.1", port
    if card:
        from mmshm.integrations.sglang import epd

        epd.publish_card(recv)
    recv.waiting_by_rid, recv.waiting_list = {}, []
    recv.tp_rank, recv.tp_size = None, TP
    req = types.SimpleNamespace(rid=rid, input_ids=None, input_text="<image>",
                                num_items_assigned={}, mm_inputs=None)
    w = r.WaitingZmqRequest(rid=rid, recv_req=req, mm_processor=processor,
                            encoder_urls=[], model_type="qwen2_vl", host_name="127.0.0.1",
                            receive_count=TP, embedding_port=port)
    recv.waiting_by_rid[rid] = w
    return recv, w, f"127.0.0.1:{port}"


def _staged(mods, enc, rid, embedding=None, error=None):
    """The encoder's result for ``rid`` (one part), staged as ``encode`` leaves it."""
    data = mods.receiver.EmbeddingData(
        req_id=rid, num_parts=1, part_idx=0, grid_dim=torch.tensor([[1, 4, 4]]),
        modality=mods.receiver.Modality.IMAGE, embedding=embedding, error_msg=error,
        error_code=400 if error else None)
    if embedding is None:
        data.shape, data.dtype = [4, HIDDEN], torch.bfloat16
    state = mods.server.ReqState(req_id=rid, embedding_data=data)
    state.embedding_ready.set()
    enc.req_states[rid] = state
    return data


def _send(mods, enc, rid, urls):
    """SGLang's zmq_to_scheduler delivery: the ranks register, the encoder sends
    to each and releases the request."""
    s = mods.server

    async def go():
        s.rid_to_receive_endpoint[rid] = set(urls)
        s.rid_to_receive_count[rid] = len(urls)
        await enc.send_with_url(rid)

    asyncio.run(go())


def _drain(ranks, timeout=10.0):
    """Each rank's receive tick until its request is no longer pending."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for recv, w, _ in ranks:
            recv._drain_scheduler_embeddings()
        if all(w.status != 0 for _, w, _ in ranks):
            return
        time.sleep(0.01)
    raise AssertionError("the ranks never received the encoder output")


def _close(enc, ranks):
    for recv, _, _ in ranks:
        recv.scheduler_recv_socket.close(linger=0)
    for sock in enc.scheduler_send_sockets.values():
        sock.close(linger=0)


def _only(got):
    """The one modality's tensor of what the processor got ({Modality: tensor})."""
    (t,) = got.values()
    return t


def _epd(family, **labels):
    return metric(f"mmshm_epd_{family}", server="sglang", **labels)


# -- tests ------------------------------------------------------------------------------------
@needs_package
def test_each_rank_gets_the_encoder_output(mods, mode, monkeypatch):
    """Bytes equal on every rank; under mmshm one segment, written once, with a
    reference per rank, mapped (not copied) by each, gone once both are done."""
    emb = torch.randn(16, HIDDEN).to(torch.bfloat16)
    procs = [_Processor() for _ in range(TP)]
    ranks = [_rank(mods, p, "r1") for p in procs]
    enc = _encoder(mods, monkeypatch)
    data = _staged(mods, enc, "r1", emb.clone())
    loads, saves = _epd("loads_total"), _epd("saves_total")
    saved, loaded = (_epd("bytes_total", direction=d) for d in ("saved", "loaded"))
    seen_refs = []
    if mode == "mmshm":
        from mmshm.segments import segfile

        real = mods.server.MMEncoder._send

        async def watch(self, *a, **kw):  # the segment's count as each send leaves
            out = await real(self, *a, **kw)
            for name in _outputs():
                path = os.path.join(mmshm.config.get().dir, name)
                fd = os.open(path, os.O_RDWR)
                try:
                    seen_refs.append(segfile.read_state(fd, path)[1])
                finally:
                    os.close(fd)
            return out

        monkeypatch.setattr(mods.server.MMEncoder, "_send", watch)
    _send(mods, enc, "r1", [u for _, _, u in ranks])
    del data
    _drain(ranks)
    try:
        for (_, w, _), p in zip(ranks, procs):
            assert w.status == 1, w.error_msg
            (got,) = p.got
            assert torch.equal(_only(got), emb)
        if mode == "mmshm":
            assert len(_outputs()) == 1
            assert seen_refs[-1] == TP + 1  # the encoder's own + one per rank
            assert _epd("loads_total") - loads == TP and _epd("saves_total") - saves == 1
            assert _epd("bytes_total", direction="saved") - saved == emb.nbytes
            assert _epd("bytes_total", direction="loaded") - loaded == TP * emb.nbytes
        else:
            assert _outputs() == []
    finally:
        _close(enc, ranks)
    del ranks, procs, w, p, got
    gc.collect()
    assert _outputs() == []  # the encoder released, both ranks freed their views


@needs_package
def test_only_a_rank_that_proved_it_gets_a_handle(mods, monkeypatch, caplog):
    """The handshake. Three language ranks: one published its card (under
    mmshm, in the encoder's directory, of the encoder's node id), one
    published none (not under mmshm run, or another /dev/shm), one a card of
    another node id (another IPC or mount namespace). Bytes equal on all
    three; only the first got a handle (one load), the other two SGLang's
    bytes, counted ``unproven`` (one per send) and said once at WARNING;
    nothing left."""
    import logging

    from mmshm.integrations.sglang import epd
    from mmshm.transport import encoder_cache

    encoder_cache._WARNED.discard("unproven")  # said once per process: this test's
    mmshm.uninstrument("sglang")
    mmshm.instrument("sglang")
    emb = torch.randn(16, HIDDEN).to(torch.bfloat16)
    procs = [_Processor() for _ in range(3)]
    ranks = [_rank(mods, procs[0], "r7"), _rank(mods, procs[1], "r7", card=False)]
    monkeypatch.setenv("MMSHM_NODE_ID", "7")  # the third rank's node: another one
    mmshm.config.reload()
    ranks.append(_rank(mods, procs[2], "r7"))
    monkeypatch.delenv("MMSHM_NODE_ID")
    mmshm.config.reload()
    loads, saves = _epd("loads_total"), _epd("saves_total")
    unproven = _epd("fallbacks_total", reason="unproven")
    try:
        enc = _encoder(mods, monkeypatch)
        _staged(mods, enc, "r7", emb.clone())
        with caplog.at_level(logging.WARNING, logger="mmshm"):
            _send(mods, enc, "r7", [u for _, _, u in ranks])
            _drain(ranks)
        for (_, w, _), p in zip(ranks, procs):
            assert w.status == 1, w.error_msg
            assert torch.equal(_only(p.got[0]), emb)
        assert _epd("saves_total") - saves == 1 and _epd("loads_total") - loads == 1
        assert _epd("fallbacks_total", reason="unproven") - unproven == 2
        said = [r.getMessage() for r in caplog.records if "reason=unproven" in r.getMessage()]
        assert len(said) == 1 and "gets SGLang's own bytes" in said[0], said
        assert len(epd.cards()._store._own) == 2  # the cards stay while the ranks live
    finally:
        _close(enc, ranks)
        mmshm.uninstrument("sglang")
    del ranks, procs, p, w
    gc.collect()
    assert _outputs() == []


@needs_package
def test_handle_message_is_small(mods, monkeypatch):
    """The frame that carried the tensor carries about 60 bytes under mmshm."""
    import zmq

    mmshm.uninstrument("sglang")
    mmshm.instrument("sglang")
    try:
        enc = _encoder(mods, monkeypatch)
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        from mmshm.integrations.sglang import epd
        from mmshm.transport import handoff

        assert epd.cards().publish(f"127.0.0.1:{port}")
        emb = torch.randn(256, HIDDEN)
        _staged(mods, enc, "r2", emb)
        _send(mods, enc, "r2", [f"127.0.0.1:{port}"])
        parts = pull.recv_multipart()
        assert len(parts[1]) < 100 < emb.nbytes
        assert handoff.give_back(parts[1])  # nobody maps it: give it back
        pull.close(linger=0)
        for sock in enc.scheduler_send_sockets.values():
            sock.close(linger=0)
        gc.collect()
        assert _outputs() == []
    finally:
        mmshm.uninstrument("sglang")


@needs_package
def test_unread_handles_are_given_back(mods, monkeypatch):
    """Handles for a request the rank no longer waits for (aborted) are
    dropped by SGLang's drain; mmshm gives their references back."""
    mmshm.uninstrument("sglang")
    mmshm.instrument("sglang")
    try:
        ranks = [_rank(mods, _Processor(), "r3") for _ in range(TP)]
        for recv, _, _ in ranks:
            recv.waiting_by_rid.clear()  # the request was aborted on both ranks
        enc = _encoder(mods, monkeypatch)
        _staged(mods, enc, "r3", torch.randn(8, HIDDEN))
        _send(mods, enc, "r3", [u for _, _, u in ranks])
        import time

        deadline = time.monotonic() + 10
        while _outputs() and time.monotonic() < deadline:
            for recv, _, _ in ranks:
                recv._drain_scheduler_embeddings()
            gc.collect()
            time.sleep(0.01)
        assert _outputs() == []
        _close(enc, ranks)
    finally:
        mmshm.uninstrument("sglang")


@needs_package
def test_no_room_falls_back_to_the_tensor_path(mods, monkeypatch):
    """A segment over mmshm's byte cap (the budget guard, MMSHM_MAX_BYTES):
    SGLang's own bytes travel, counted by reason."""
    mmshm.uninstrument("sglang")
    mmshm.instrument("sglang")
    procs = [_Processor() for _ in range(TP)]
    ranks = [_rank(mods, p, "r4") for p in procs]  # their cards before the cap
    monkeypatch.setenv("MMSHM_MAX_BYTES", "1024")
    mmshm.config.reload()
    before = _epd("fallbacks_total", reason="over_budget")
    try:
        enc = _encoder(mods, monkeypatch)
        emb = torch.randn(8, HIDDEN)  # 2048 bytes
        saves = _epd("saves_total")
        _staged(mods, enc, "r4", emb.clone())
        _send(mods, enc, "r4", [u for _, _, u in ranks])
        _drain(ranks)
        for (_, w, _), p in zip(ranks, procs):
            assert w.status == 1
            got = p.got[0]
            assert torch.equal(_only(got), emb)
        assert _epd("fallbacks_total", reason="over_budget") - before == 1
        assert _epd("saves_total") == saves
        assert _outputs() == []
        _close(enc, ranks)
        assert _outputs() == []
    finally:
        mmshm.uninstrument("sglang")
        monkeypatch.delenv("MMSHM_MAX_BYTES")
        mmshm.config.reload()


@needs_package
def test_a_vanished_segment_fails_only_its_request(mods, monkeypatch):
    """The segment is gone before the rank maps it (its reference given back
    by someone else: what a reaper or a hand-removed segment leaves): that
    request fails cleanly on that rank with the typed error, counted; the
    receive loop goes on."""
    from mmshm.transport import handoff

    wires = []
    handle = handoff.Handoff.handle

    def spy(self, pub):
        wires.append(handle(self, pub))
        return wires[-1]

    monkeypatch.setattr(handoff.Handoff, "handle", spy)
    mmshm.uninstrument("sglang")
    mmshm.instrument("sglang")
    before = _epd("fallbacks_total", reason="segment_gone")
    try:
        recv, w, url = _rank(mods, _Processor(), "r5")
        enc = _encoder(mods, monkeypatch)
        _staged(mods, enc, "r5", torch.randn(8, HIDDEN))
        _send(mods, enc, "r5", [url])
        gc.collect()
        (wire,) = wires
        assert handoff.give_back(wire)  # the rank's reference: the segment is freed
        _drain([(recv, w, url)])
        assert w.status == -1
        assert "Failed to decode embedding message" in w.error_msg
        assert "could not" in w.error_msg or "not found" in w.error_msg.lower() or \
            "gone" in w.error_msg
        assert _epd("fallbacks_total", reason="segment_gone") - before == 1
        recv.scheduler_recv_socket.close(linger=0)
        for sock in enc.scheduler_send_sockets.values():
            sock.close(linger=0)
    finally:
        mmshm.uninstrument("sglang")


def _abort_path(mods, monkeypatch, error_code):
    """A waiting request the encoder failed (``error_code``), through the real
    ``MMReceiverBase._process_waiting_requests`` at TP size 1 (gloo) and
    ``create_req``; returns the aborted ``Req``."""
    import torch.distributed as dist

    from tests.harness.ports import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    recv, w, url = _rank(mods, _Processor(), "r6")
    recv.tp_size, recv.tp_rank = 1, 0
    recv.tp_group = types.SimpleNamespace(cpu_group=dist.group.WORLD)
    recv.wait_timeout = 60
    recv.waiting_list = [w]
    enc = _encoder(mods, monkeypatch)
    _staged(mods, enc, "r6", None, error="cannot identify image file")
    enc.req_states["r6"].embedding_data.error_code = error_code
    _send(mods, enc, "r6", [url])
    model_config = types.SimpleNamespace(hf_eos_token_id=None, vocab_size=32000)
    recv.scheduler = types.SimpleNamespace(
        model_config=model_config, disaggregation_mode=None, dllm_config=None,
        metrics_reporter=types.SimpleNamespace(enable_metrics=False), tokenizer=None)
    w.recv_req = _tokenized(mods, "r6")
    import time

    deadline = time.monotonic() + 10
    aborts = []
    try:
        while not aborts and time.monotonic() < deadline:
            _, aborts = recv._process_waiting_requests([], mods.receiver.WaitingZmqRequest)
            time.sleep(0.01)
    finally:
        dist.destroy_process_group()
    recv.scheduler_recv_socket.close(linger=0)
    for sock in enc.scheduler_send_sockets.values():
        sock.close(linger=0)
    (req, msg, code), = aborts
    return req, msg, code


def _tokenized(mods, rid):
    """The language tokenizer's request as the scheduler gets it: a real
    ``TokenizedGenerateReqInput``, ``input_ids=None`` (the encoder makes them)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = E.make_request(E.load(), [], rid=rid)
    req.input_ids, req.mm_inputs = None, None
    req.sampling_params = SamplingParams(max_new_tokens=4)
    return req


@needs_package
@pytest.mark.parametrize("code,reason", [(400, "encoder_error"), (502, "encoder_gone")])
def test_failed_encode_is_a_clean_error(mods, mode, monkeypatch, code, reason):
    """The encoder rejects an image (400) or is gone (502): plain 0.5.23 builds
    the aborted request with ``input_ids=None`` and its output streamer's
    ``len(req.origin_input_ids)`` raises TypeError (the server exits); under
    mmshm the request carries an empty prompt, SGLang's abort answers it with
    the encoder's status, counted by reason."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    before = _epd("fallbacks_total", reason=reason)
    req, msg, got_code = _abort_path(mods, monkeypatch, code)
    assert int(got_code) == code and "cannot identify" in msg
    if mode == "plain":
        assert req.origin_input_ids is None
        with pytest.raises(TypeError, match="NoneType"):
            len(req.origin_input_ids)  # output_streamer.accept's prompt_tokens
        return
    req.finished_reason = FINISH_ABORT(msg, status_code=code)
    assert len(req.origin_input_ids) == 0
    req.init_incremental_detokenize()  # what accept calls next
    assert _epd("fallbacks_total", reason=reason) - before == 1


@pytest.mark.skipif(HAS_ENCODER_PACKAGE, reason="0.5.9-0.5.15 only")
def test_older_release_says_epd_is_off(mods, caplog):
    """0.5.9-0.5.15: the encoder's "on:" line says mmshm does not carry it."""
    import importlib
    import logging

    mmshm.uninstrument("sglang")
    mmshm.instrument("sglang")
    try:
        mod = importlib.import_module("sglang.srt.disaggregation.encode_server")
        with caplog.at_level(logging.WARNING, logger="mmshm"):
            try:
                mod.MMEncoder.__init__(object.__new__(mod.MMEncoder))
            except Exception:  # noqa: BLE001 - a bare encoder cannot start here
                pass
        assert "mmshm does not recognize this SGLang release's encoder code" in caplog.text
    finally:
        mmshm.uninstrument("sglang")
