"""EPD (``--encoder-only`` / ``--language-only``): SGLang's glue on
:mod:`mmshm.transport.handoff` (docs/sglang.md).

SGLang 0.5.23, transfer backend ``zmq_to_scheduler`` (the default): the
encoder's ``MMEncoder._send`` pushes pickled ``EmbeddingData`` metadata plus
the raw embedding as a second zmq frame, once per TP rank of the language
instance, and every rank's ``WaitingZmqRequest._extract_embedding_from_buffer``
copies it. Under mmshm the encoder publishes the embedding once and each send
to a rank that proved it can open the encoder's segments (its card,
:class:`~mmshm.transport.handoff.Cards`, published as the rank opens its
receive socket) carries a handle owning one reference in that frame, with
``mmshm_epd = "handle"`` on the metadata; each rank maps it zero-copy.
"""

from __future__ import annotations

from mmshm.transport import handoff

from .server import SERVER, log

EPD_MARK = "mmshm_epd"
EPD_HANDLE = "handle"
PATH_EPD_SEND = ("encoder outputs to the language instance as shared-memory handles (one "
                 "write per item, one reference per TP rank; only to language TP ranks that "
                 "proved they can open this encoder's segments, SGLang's bytes to the others)")
PATH_EPD_RECV = "encoder outputs mapped zero-copy from shared memory on every TP rank"
PATH_EPD_FAULTS = ("a failed encode (encoder error, encoder gone) fails only its request, "
                   "counted by reason")
FIX_EPD_BACKEND = ("leave --encoder-transfer-backend at zmq_to_scheduler (the default) to "
                   "carry encoder outputs through shared memory")
FIX_EPD_RELEASE = ("use SGLang 0.5.23, whose encoder code mmshm carries; otherwise nothing "
                   "is needed: SGLang's own TCP path carries the encoder outputs")
FIX_UNPROVEN = ("run the language instance under mmshm run too, in the encoder's IPC and "
                "mount namespaces with the same MMSHM_DIR (one host or pod sharing /dev/shm); "
                "otherwise nothing: SGLang's bytes carry the outputs")
_STATE: dict = {}  # "handoff", "cards": this process's, made at first use
endpoint = handoff.endpoint


def _handoff() -> handoff.Handoff:
    if "handoff" not in _STATE:
        _STATE["handoff"] = handoff.Handoff(SERVER)
    return _STATE["handoff"]


def cards() -> handoff.Cards:
    """This process's :class:`~mmshm.transport.handoff.Cards`."""
    if "cards" not in _STATE:
        _STATE["cards"] = handoff.Cards(SERVER)
    return _STATE["cards"]


def publish_card(receiver) -> None:
    """A language TP rank's receiver (``MMReceiverBase`` with its shared
    ``scheduler_recv_socket``): its card, so that the encoder sends it handles."""
    port = getattr(receiver, "scheduler_embedding_port", None)
    host = getattr(receiver, "hostname", None)
    if port is None or host is None:
        return
    where = endpoint(host, port)
    if not cards().publish(where):
        log.warning("mmshm: this language TP rank (%s) could not publish its card in the "
                    "segment directory, so the encoder sends it SGLang's own bytes. Fix: give "
                    "MMSHM_DIR room", where)


def _destination(args, kwargs) -> str | None:
    """``MMEncoder._send``'s destination (args ``embedding, mm_data, session_id,
    buffer_address, prefill_host, embedding_port, url``) as ``host:port``."""
    url = kwargs.get("url", args[6] if len(args) > 6 else None)
    if url is not None:
        return str(url).split("//")[-1]
    host = kwargs.get("prefill_host", args[4] if len(args) > 4 else None)
    port = kwargs.get("embedding_port", args[5] if len(args) > 5 else None)
    return None if host is None or port is None else endpoint(host, port)


async def encoder_send(wrapped, instance, args, kwargs):
    """``MMEncoder._send`` (0.5.23): on the zmq_to_scheduler backend, to a
    language TP rank whose card this encoder finds (:class:`~mmshm.transport.
    handoff.Cards`), the embedding (any dtype, ``[tokens, hidden]``) is
    published once at its first send and each send carries a handle owning
    one reference (given back if the send raises) in place of its bytes. A
    rank without a proven card gets SGLang's own send, counted
    (``mmshm_epd_fallbacks_total{reason="unproven"}``, one per send); so do
    other backends, error messages and outputs with no room (counted by the
    store: ``over_budget``, ``no_space``)."""
    mm_data = args[1] if len(args) > 1 else kwargs.get("mm_data")
    dest = _destination(args, kwargs)
    if (getattr(instance, "transfer_backend", None) != "zmq_to_scheduler"
            or mm_data is None or getattr(mm_data, "error_msg", None) is not None
            or getattr(mm_data, "embedding", None) is None or dest is None):
        return await wrapped(*args, **kwargs)
    wire = _handoff().wire_for(mm_data, mm_data.embedding, str(getattr(mm_data, "req_id", "")),
                               cards(), dest, f"the language TP rank at {dest}",
                               "SGLang's own bytes", FIX_UNPROVEN)
    if wire is None:
        return await wrapped(*args, **kwargs)
    import torch

    sub = mm_data.copy_without_embedding()
    sub.embedding = torch.frombuffer(bytearray(wire), dtype=torch.uint8)
    setattr(sub, EPD_MARK, EPD_HANDLE)
    args = list(args)
    if len(args) > 1:
        args[1] = sub
    else:
        kwargs["mm_data"] = sub
    try:
        return await wrapped(*args, **kwargs)
    except BaseException:
        handoff.give_back(wire)  # not delivered
        raise


def delivery_release(wrapped, instance, args, kwargs):
    """``ZmqDelivery.release(state)`` (0.5.23, after the request's last
    send): the encoder's own reference goes; the TP ranks' keep the output."""
    state = args[0] if args else kwargs.get("state")
    mm_data = getattr(state, "embedding_data", None)
    if mm_data is not None and "handoff" in _STATE:
        _STATE["handoff"].finish(mm_data)
    return wrapped(*args, **kwargs)


def drain_embeddings(wrapped, instance, args, kwargs):
    """``MMReceiverBase._drain_scheduler_embeddings`` (0.5.23, the TP rank's
    shared receive socket): handles SGLang drops (inactive request, stale
    part) are given back."""
    return handoff.Inbox.around(instance, "scheduler_recv_socket",
                                lambda: wrapped(*args, **kwargs))


def try_recv(wrapped, instance, args, kwargs):
    """``WaitingMMRequestBase._try_recv_mm_data`` (a per-request socket): as
    :func:`drain_embeddings`."""
    return handoff.Inbox.around(instance, "recv_socket", lambda: wrapped(*args, **kwargs))


def extract_embedding(wrapped, instance, args, kwargs):
    """``WaitingZmqRequest._extract_embedding_from_buffer(recv_obj, parts)``:
    a handle message's embedding is the zero-copy view of its segment
    (:func:`mmshm.transport.handoff.take`: dtype and shape checked against
    the metadata's), which holds the reference until SGLang frees the
    tensor. A handle that cannot be mapped raises
    :class:`~mmshm.errors.MaterializeError`, which SGLang's ``consume_parts``
    turns into this request's failure, counted by reason (``segment_gone``,
    ``torn``, ``incompatible``). Other messages: SGLang's copy."""
    recv_obj = args[0] if args else kwargs["recv_obj"]
    parts = args[1] if len(args) > 1 else kwargs["parts"]
    if getattr(recv_obj, EPD_MARK, None) != EPD_HANDLE:
        return wrapped(*args, **kwargs)
    recv_obj.embedding = handoff.take_noted(parts[1], recv_obj.dtype, recv_obj.shape, SERVER,
                                            f"encoder output of "
                                            f"{getattr(recv_obj, 'req_id', '?')}")
    return None


_ABORT_SAYS = {
    "encoder_error": ("the encoder rejected a request's multimodal input (HTTP {code}: {msg}): "
                      "that request fails with this error and the language instance keeps "
                      "serving (plain SGLang 0.5.23 exits here, TypeError in "
                      "output_streamer.accept)",
                      "none needed for a bad input; check the encoder's log if good inputs "
                      "fail"),
    "encoder_gone": ("the encoder did not deliver a request's encoder output (HTTP {code}: "
                     "{msg}): that request fails with this error and the language instance "
                     "keeps serving (plain SGLang 0.5.23 exits here)",
                     "restart the encoder instance, or check --encoder-urls and "
                     "SGLANG_HOST_IP on both instances"),
}


def process_waiting(wrapped, instance, args, kwargs):
    """``MMReceiverBase._process_waiting_requests`` (0.5.23): each request it
    aborts (an encoder error, an encoder gone, a timeout) gets an empty
    prompt instead of ``input_ids=None``, so SGLang's abort path answers it
    with its error and status while the scheduler keeps serving (plain 0.5.23
    exits: ``TypeError: object of type 'NoneType' has no len()`` in
    ``output_streamer.accept``, ``create_req`` building the aborted ``Req``
    from the tokenizer's ``input_ids=None``). Counted on TP rank 0 in
    ``mmshm_epd_fallbacks_total{reason="encoder_error"|"encoder_gone"}``
    and said once per reason."""
    result = wrapped(*args, **kwargs)
    try:
        aborts = result[1]
    except (TypeError, IndexError, KeyError):
        return result
    from array import array

    for entry in aborts or ():
        try:
            req, msg, code = entry
        except (TypeError, ValueError):
            continue
        if getattr(req, "origin_input_ids", ()) is None:
            req.origin_input_ids = array("q")
            if getattr(req, "origin_input_ids_unpadded", ()) is None:
                req.origin_input_ids_unpadded = req.origin_input_ids
        reason = handoff.encode_failure(msg, code)
        if reason is None or getattr(instance, "tp_rank", 0) not in (0, None):
            continue
        says, fix = _ABORT_SAYS[reason]
        handoff.count(SERVER, reason, says.format(code=code, msg=msg), fix)
    return result


def send_encode_request(wrapped, instance, args, kwargs):
    """``MMReceiverBase._send_encode_request(obj)`` (0.5.23, the tokenizer): a
    multimodal request that finds no encoder registered (the registry drops
    one after 3 missed health probes, which a busy encoder misses) is
    encoded inside the language instance: counted
    (``mmshm_epd_fallbacks_total{reason="encoder_dropped"}``) and said once."""
    result = wrapped(*args, **kwargs)
    obj = args[0] if args else kwargs.get("obj")
    if result is None and getattr(obj, "need_wait_for_mm_inputs", None) is False:
        try:
            has_mm = bool(obj.contains_mm_input())
        except Exception:  # noqa: BLE001 - judged by SGLang's own call above
            has_mm = True
        if has_mm:
            handoff.count(
                SERVER, "encoder_dropped",
                f"no encoder is registered with this language instance, so request "
                f"{getattr(obj, 'rid', '?')}'s images are encoded here, by the language "
                "instance (SGLang's registry drops an encoder after 3 missed /health probes "
                "of SGLANG_ENCODER_BOOTSTRAP_HEALTH_CHECK_TIMEOUT s, default 2, every "
                "..._INTERVAL s, default 10: a busy encoder misses them)",
                "raise SGLANG_ENCODER_BOOTSTRAP_HEALTH_CHECK_TIMEOUT on the language "
                "instance, or restart the encoder")
    return result
