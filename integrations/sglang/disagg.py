"""PD disaggregation: a decode instance's tokenizer withholds the pixels (docs/sglang.md)."""

from __future__ import annotations

import sys

from mmshm.errors import PayloadWithheldError

from .server import items, log, on_failure, set_item_hashes, tensors

DECODE_WITHHOLDS = False  # this tokenizer's decode_payload_policy: True withholds
SCHEDULER = None  # this process's Scheduler (weak): its disaggregation_mode
#: Item fields that hold a payload only the vision (or audio) encoder reads.
PAYLOAD_FIELDS = ("feature", "precomputed_embeddings")
PATH_DECODE_WITHHOLD = (
    "PD decode instance (--disaggregation-mode decode): multimodal items reach the "
    "scheduler without their pixels (hashes, pad values and token layout kept; the KV "
    "comes from the prefill instance, the vision encoder never runs here)")
PATH_DECODE_KEEP = "PD decode instance: pixels kept ({})"


class WithheldPayload:
    """An item's tensor on its way to a decode scheduler: ``shape`` (ints),
    ``dtype`` (torch's name, ``"float32"``), ``nbytes``; no data. The decode
    scheduler hands SGLang ``None`` (as upstream's open PR 14832); any other
    fails the request with :class:`PayloadWithheldError`."""

    __slots__ = ("shape", "dtype", "nbytes")

    def __init__(self, shape: tuple, dtype: str, nbytes: int):
        self.shape, self.dtype, self.nbytes = tuple(shape), dtype, int(nbytes)

    @classmethod
    def of(cls, t) -> WithheldPayload:
        return cls(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.nbytes)

    def __repr__(self) -> str:
        return f"WithheldPayload({self.dtype}{list(self.shape)}, {self.nbytes} bytes)"


def decode_payload_policy(tokenizer_manager) -> tuple[bool, str] | None:
    """``(True, line)``: withhold the pixels; ``(False, line)``: keep them (why:
    ``--enable-pd-role-switch``); None: not a PD decode instance."""
    mode = getattr(getattr(tokenizer_manager, "disaggregation_mode", None), "value", None)
    if mode != "decode":
        return None
    if getattr(getattr(tokenizer_manager, "server_args", None), "enable_pd_role_switch",
               False):
        return False, PATH_DECODE_KEEP.format(
            "--enable-pd-role-switch: this instance may become a prefill instance, "
            "which needs them")
    return True, PATH_DECODE_WITHHOLD


def withhold_payloads(mm_inputs):
    """A copy of ``mm_inputs`` with :class:`WithheldPayload` for the payload of
    each item hashed first (BLAKE3, as a prefill instance under mmshm hashes
    it); an item that cannot be hashed keeps its tensors."""
    from mmshm.transport.wrapping import transform

    set_item_hashes(mm_inputs)
    withheld = {id(t): t for item in items(mm_inputs) if getattr(item, "hash", None)
                is not None for name in PAYLOAD_FIELDS
                for t in tensors(getattr(item, name, None))}
    if not withheld:
        return mm_inputs
    return transform(mm_inputs, lambda x: WithheldPayload.of(x) if id(x) in withheld else x)


def _has_withheld(value) -> bool:
    if isinstance(value, WithheldPayload):
        return True
    return isinstance(value, (list, tuple)) and any(_has_withheld(v) for v in value)


def settle_withheld(reqs):
    """``None`` for each withheld payload in ``reqs`` (decode mode), else the
    request fails with :class:`PayloadWithheldError`; alike on every TP
    rank. ``reqs`` (a list) is updated in place and returned."""
    if not reqs:
        return reqs
    scheduler = SCHEDULER() if SCHEDULER is not None else None
    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", None)
    for i, req in enumerate(reqs):
        for r in (getattr(req, "batch", None) or [req]):
            mm = getattr(r, "mm_inputs", None)
            found = [(item, name) for item in (items(mm) if mm else ())
                     for name in PAYLOAD_FIELDS if _has_withheld(getattr(item, name, None))]
            if not found:
                continue
            if mode == "decode":
                for item, name in found:
                    setattr(item, name, None)
                continue
            from mmshm.metrics import REQUEST_FAILURES

            REQUEST_FAILURES.labels(reason=PayloadWithheldError.reason).inc()
            err = PayloadWithheldError(
                f"request {getattr(r, 'rid', '?')}: {len(found)} multimodal tensor(s) were "
                "withheld by a PD decode instance's tokenizer, and this scheduler is "
                f"in {mode or 'unknown'} mode, where the vision encoder may need them")
            out = on_failure(r, err)
            if r is req and out is not r and isinstance(reqs, list):
                reqs[i] = out
    return reqs


# -- EPD: encoder disaggregation (--encoder-only / --language-only) ----------------------
# SGLang 0.5.23, transfer backend zmq_to_scheduler (the default). The encoder's
# ``MMEncoder._send`` pushes pickled ``EmbeddingData`` metadata plus the raw
# embedding as a second zmq frame, once per TP rank of the language instance
# (``receive_count = tp_size``); every rank's ``WaitingZmqRequest.
# _extract_embedding_from_buffer`` copies it (``torch.frombuffer(...).clone()``).
# Under mmshm the encoder writes the embedding once into a segment and each of
# those sends carries the handle (about 60 bytes) in the second frame, with
# ``mmshm_epd = "handle"`` on the metadata; each rank maps it zero-copy.
EPD_MARK = "mmshm_epd"
EPD_HANDLE = "handle"
PATH_EPD_SEND = ("encoder outputs to the language instance as shared-memory handles (one "
                 "write per item, one reference per TP rank; the language instance must "
                 "run under mmshm run too)")
PATH_EPD_RECV = "encoder outputs mapped zero-copy from shared memory on every TP rank"
PATH_EPD_FAULTS = ("a failed encode (encoder error, encoder gone) fails only its request, "
                   "counted by reason")
FIX_EPD_BACKEND = ("leave --encoder-transfer-backend at zmq_to_scheduler (the default) to "
                   "carry encoder outputs through shared memory")
FIX_EPD_RELEASE = ("use SGLang 0.5.23, whose encoder code mmshm carries; otherwise nothing "
                   "is needed: SGLang's own TCP path carries the encoder outputs")
#: Warnings said once per process, by reason.
_epd_warned: set[str] = set()
#: this process's sends: EmbeddingData (weak) -> its anchor handle, or None: tensor path
_EPD_SENT = None
_local_hosts: dict[str, bool] = {}
_TLS = None


def epd_count(family: str, n: float = 1, **labels) -> None:
    """Add ``n`` to an EPD metric of ``mmshm.metrics`` (``EPD_SAVES``,
    ``EPD_LOADS``, ``EPD_BYTES``, ``EPD_FALLBACKS``; ``EPD_TRANSFER_SECONDS``
    observed), ``server="sglang"``; nothing where mmshm has no such family."""
    from mmshm import metrics

    m = getattr(metrics, family, None)
    if m is None:
        return
    try:
        child = m.labels(server="sglang", **labels)
        (child.observe if family.endswith("SECONDS") else child.inc)(n)
    except Exception as exc:  # noqa: BLE001 - a metric never breaks a request
        log.debug("mmshm: EPD metric %s: %s", family, exc)


def epd_warn_once(reason: str, message: str, *args) -> None:
    """``message`` at WARNING, the first time ``reason`` happens in this process."""
    if reason in _epd_warned:
        return
    _epd_warned.add(reason)
    log.warning(message, *args)


def _is_local_host(host: str) -> bool:
    """Whether ``host`` is an address of this node (a socket can bind it)."""
    import socket

    known = _local_hosts.get(host)
    if known is None:
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((host.strip("[]"), 0))
            known = True
        except OSError:
            known = False
        _local_hosts[host] = known
    return known


def _destination_host(args, kwargs) -> str | None:
    """The host of ``MMEncoder._send``'s destination (``url`` "host:port", or
    ``prefill_host``)."""
    url = kwargs.get("url", args[6] if len(args) > 6 else None)
    if url is not None:
        host = str(url).rsplit(":", 1)[0]
        return host.split("//")[-1]
    return kwargs.get("prefill_host", args[4] if len(args) > 4 else None)


def _anchor(mm_data):
    """The segment of ``mm_data``'s embedding, written at its first send (the
    encoder's anchor reference); None: the tensor path (unsupported or no room,
    the fallback counted)."""
    global _EPD_SENT
    import weakref

    from mmshm import MmshmError
    from mmshm.segments.shmtensor import ShmTensor
    from mmshm.transport.wrapping import record_fallback

    if _EPD_SENT is None:
        _EPD_SENT = weakref.WeakKeyDictionary()
    if mm_data in _EPD_SENT:
        return _EPD_SENT[mm_data]
    import time

    emb = mm_data.embedding
    t0 = time.perf_counter()
    try:
        h = ShmTensor.from_tensor(emb.cpu() if emb.device.type != "cpu" else emb, hash=b"")
    except TypeError:
        h = None  # a dtype or layout mmshm does not carry: SGLang's path, silently
    except (OSError, MmshmError) as exc:
        reason = {"enospc": "no_space", "budget": "over_budget"}.get(
            record_fallback(exc), "other")
        epd_count("EPD_FALLBACKS", reason=reason)
        h = None
    else:
        epd_count("EPD_SAVES")
        epd_count("EPD_BYTES", h.nbytes, direction="saved")
        epd_count("EPD_TRANSFER_SECONDS", time.perf_counter() - t0)
        # the anchor goes when SGLang lets go of the embedding (its release_request)
        weakref.finalize(mm_data, h.release)
    _EPD_SENT[mm_data] = h
    return h


async def encoder_send(wrapped, instance, args, kwargs):
    """``MMEncoder._send`` (0.5.23; args ``embedding, mm_data, session_id,
    buffer_address, prefill_host, embedding_port, url``): on the
    zmq_to_scheduler backend, to a language instance on this node, the
    embedding (any dtype, ``[tokens, hidden]``) is written once into a segment
    at its first send and each send carries a handle owning one reference
    (added here, given back if the send raises) in place of the tensor's bytes.
    Elsewhere (mooncake, zmq_to_tokenizer, another node, an error message, no
    room: ``mmshm_epd_fallbacks_total{reason}``) SGLang's own send runs."""
    mm_data = args[1] if len(args) > 1 else kwargs.get("mm_data")
    host = _destination_host(args, kwargs)
    if (getattr(instance, "transfer_backend", None) != "zmq_to_scheduler"
            or mm_data is None or getattr(mm_data, "error_msg", None) is not None
            or getattr(mm_data, "embedding", None) is None
            or host is None or not _is_local_host(host)):
        return await wrapped(*args, **kwargs)
    h = _anchor(mm_data)
    if h is None:
        return await wrapped(*args, **kwargs)
    import torch

    from mmshm import MmshmError
    from mmshm.segments.shmtensor import ShmTensor

    try:
        h.share(1)  # this send's reference: the receiving rank owns it
    except (MmshmError, OSError) as exc:  # the anchor's segment is gone: SGLang's bytes
        epd_count("EPD_FALLBACKS", reason="segment_gone")
        epd_warn_once("segment_gone_send", "mmshm: an encoder output's segment vanished "
                      "before its send (%s); SGLang's own bytes carry it. Fix: nothing may "
                      "remove mmshm's segments while the encoder runs", exc)
        return await wrapped(*args, **kwargs)
    wire = h.encode()
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
        ShmTensor.decode(wire).release()  # not delivered: give its reference back
        raise


class _Recorder:
    """A zmq socket whose ``recv_multipart`` results are kept (``got``)."""

    def __init__(self, sock):
        self._sock, self.got, self.consumed = sock, [], set()

    def recv_multipart(self, *a, **kw):
        parts = self._sock.recv_multipart(*a, **kw)
        self.got.append(parts)
        return parts

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _loads(frame):
    mod = sys.modules.get("sglang.srt.utils.common")
    loads = getattr(mod, "safe_pickle_loads", None)
    if loads is None:
        import pickle

        return pickle.loads(bytes(memoryview(getattr(frame, "buffer", frame))))
    return loads(frame)


def _frame_bytes(frame) -> bytes:
    return bytes(frame.buffer if hasattr(frame, "buffer") else frame)


def _release_unconsumed(rec: _Recorder) -> int:
    """Give back the reference of each handle message SGLang received but did
    not map (a request aborted, failed or timed out, a stale part); returns how many."""
    from mmshm.segments.shmtensor import ShmTensor

    n = 0
    for parts in rec.got:
        if id(parts) in rec.consumed or len(parts) < 2:
            continue
        try:
            if getattr(_loads(parts[0]), EPD_MARK, None) != EPD_HANDLE:
                continue
            ShmTensor.decode(_frame_bytes(parts[1])).release()
            n += 1
        except Exception as exc:  # noqa: BLE001 - a bad message never breaks the loop
            log.warning("mmshm: could not give back an unread encoder-output handle: %s", exc)
    return n


def _recording(instance, attr: str, wrapped, args, kwargs):
    """Run ``wrapped`` with ``instance.<attr>`` (a zmq socket) recorded;
    afterwards the handles it received and did not map are given back."""
    import threading

    global _TLS
    sock = getattr(instance, attr, None)
    if sock is None:
        return wrapped(*args, **kwargs)
    if _TLS is None:
        _TLS = threading.local()
    rec = _Recorder(sock)
    prev = getattr(_TLS, "rec", None)
    setattr(instance, attr, rec)
    _TLS.rec = rec
    try:
        return wrapped(*args, **kwargs)
    finally:
        _TLS.rec = prev
        if getattr(instance, attr, None) is rec:
            setattr(instance, attr, sock)
        _release_unconsumed(rec)


def drain_embeddings(wrapped, instance, args, kwargs):
    """``MMReceiverBase._drain_scheduler_embeddings`` (0.5.23, the TP rank's
    shared receive socket): handles SGLang drops (inactive request, stale
    part) are given back."""
    return _recording(instance, "scheduler_recv_socket", wrapped, args, kwargs)


def try_recv(wrapped, instance, args, kwargs):
    """``WaitingMMRequestBase._try_recv_mm_data`` (a per-request socket): as
    :func:`drain_embeddings`."""
    return _recording(instance, "recv_socket", wrapped, args, kwargs)


def extract_embedding(wrapped, instance, args, kwargs):
    """``WaitingZmqRequest._extract_embedding_from_buffer(recv_obj, parts)``:
    a handle message's embedding is the zero-copy (copy-on-write) view of its
    segment, which holds the reference until SGLang frees the tensor; the
    dtype and shape are checked against the metadata's. A handle that cannot
    be mapped raises :class:`~mmshm.errors.MaterializeError`, which SGLang's
    ``consume_parts`` turns into this request's failure (reference given
    back, ``mmshm_epd_fallbacks_total{reason="segment_gone"}``). Other
    messages: SGLang's copy."""
    recv_obj = args[0] if args else kwargs["recv_obj"]
    parts = args[1] if len(args) > 1 else kwargs["parts"]
    if getattr(recv_obj, EPD_MARK, None) != EPD_HANDLE:
        return wrapped(*args, **kwargs)
    import time

    from mmshm import MaterializeError, MmshmError
    from mmshm.errors import HandleError, failure_reason
    from mmshm.segments.shmtensor import ShmTensor

    rec = getattr(_TLS, "rec", None) if _TLS is not None else None
    if rec is not None:
        rec.consumed.add(id(parts))
    t0 = time.perf_counter()
    h = None
    try:
        h = ShmTensor.decode(_frame_bytes(parts[1]))
        if (list(h.shape) != [int(x) for x in recv_obj.shape]
                or (recv_obj.dtype is not None and h.dtype != recv_obj.dtype)):
            raise HandleError(f"handle {h.name} is {h.dtype}{list(h.shape)}, the encoder's "
                              f"message says {recv_obj.dtype}{list(recv_obj.shape)}")
        recv_obj.embedding = h.materialize()
    except (MmshmError, OSError) as exc:
        if h is not None:
            h.release()
        epd_count("EPD_FALLBACKS", reason="segment_gone")
        epd_warn_once("segment_gone",
                      "mmshm: an encoder output's shared-memory segment could not be mapped "
                      "(%s); its request fails with this error, the server keeps serving. "
                      "Fix: the encoder instance was restarted or its segments removed; "
                      "resend the request", exc)
        raise MaterializeError(f"encoder output of {getattr(recv_obj, 'req_id', '?')}: {exc}",
                               reason=failure_reason(exc)) from exc
    epd_count("EPD_LOADS")
    epd_count("EPD_BYTES", h.nbytes, direction="loaded")
    epd_count("EPD_TRANSFER_SECONDS", time.perf_counter() - t0)
    return None


def delivery_release(wrapped, instance, args, kwargs):
    """``ZmqDelivery.release(state)`` (0.5.23, after the request's last send):
    the encoder's anchor reference on the segment goes; the TP ranks' own
    references keep it until they are done with the embedding."""
    state = args[0] if args else kwargs.get("state")
    mm_data = getattr(state, "embedding_data", None)
    if mm_data is not None and _EPD_SENT is not None:
        h = _EPD_SENT.pop(mm_data, None)
        if h is not None:
            h.release()
    return wrapped(*args, **kwargs)


def _epd_failure_reason(msg, code) -> str | None:
    """The ``mmshm_epd_fallbacks_total`` reason of a failed waiting request
    (None: a user's abort)."""
    if msg == "Aborted by user":
        return None
    try:
        code = int(code) if code is not None else 500
    except (TypeError, ValueError):
        code = 500
    return "encoder_error" if 400 <= code < 500 and code != 408 else "encoder_gone"


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
        reason = _epd_failure_reason(msg, code)
        if reason is None or getattr(instance, "tp_rank", 0) not in (0, None):
            continue
        epd_count("EPD_FALLBACKS", reason=reason)
        if reason == "encoder_error":
            epd_warn_once(reason, "mmshm: the encoder rejected a request's multimodal input "
                          "(HTTP %s: %s): that request fails with this error and the language "
                          "instance keeps serving (plain SGLang 0.5.23 exits here, TypeError in "
                          "output_streamer.accept). Fix: none needed for a bad input; check "
                          "the encoder's log if good inputs fail", code, msg)
        else:
            epd_warn_once(reason, "mmshm: the encoder did not deliver a request's encoder "
                          "output (HTTP %s: %s): that request fails with this error and the "
                          "language instance keeps serving (plain SGLang 0.5.23 exits here). "
                          "Fix: restart the encoder instance, or check --encoder-urls and "
                          "SGLANG_HOST_IP on both instances", code, msg)
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
            epd_count("EPD_FALLBACKS", reason="encoder_dropped")
            epd_warn_once("encoder_dropped",
                          "mmshm: no encoder is registered with this language instance, so "
                          "request %s's images are encoded here, by the language instance "
                          "(SGLang's registry drops an encoder after 3 missed /health probes "
                          "of SGLANG_ENCODER_BOOTSTRAP_HEALTH_CHECK_TIMEOUT s, default 2, "
                          "every ..._INTERVAL s, default 10: a busy encoder misses them). "
                          "Fix: raise SGLANG_ENCODER_BOOTSTRAP_HEALTH_CHECK_TIMEOUT on the "
                          "language instance, or restart the encoder",
                          getattr(obj, "rid", "?"))
    return result
