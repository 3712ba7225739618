"""vLLM's hops (:func:`mmshm.hooks.observe.timed`), alike in both modes, and the
``zmq_transfer`` stamp beside the message (docs/vllm.md, "zmq_transfer")."""

import contextvars
import threading
import time
import weakref

from mmshm.hooks import observe
from mmshm.transport import mqueue

from .server import SERVER, input_endpoint, is_add, me

#: The hops timed, in the order a request takes them.
HOPS = ("frontend_encode", "zmq_transfer", "engine_decode", "mq_enqueue", "mq_dequeue")
#: In an ``ADD``'s ``_send_input``: the stamp channel of its engine
#: (:func:`stamp_address`), or True where unknown (no ``zmq_transfer`` stamp).
_ADDING: contextvars.ContextVar[bytes | bool] = contextvars.ContextVar("mmshm_vllm_add",
                                                                      default=False)
#: The EngineCore input thread's end of the ``zmq_transfer`` stamp channels.
_STAMPS_IN = threading.local()
TIMED_QUEUES: weakref.WeakSet = weakref.WeakSet()


def frames_bytes(frames) -> int:
    if isinstance(frames, (bytes, bytearray, memoryview)):
        return memoryview(frames).nbytes
    total = 0
    for f in frames:
        try:
            total += memoryview(f).nbytes
        except TypeError:  # a zmq.Frame without the buffer protocol
            total += len(f)
    return total


def stamp_address(endpoint: str, identity) -> bytes:
    """The ``zmq_transfer`` stamp channel of the EngineCore ``identity`` (its
    index, 2 bytes little-endian) reading input ``endpoint``: ``tcp://`` by its
    port alone (bound 0.0.0.0 here, an address there), ``ipc://`` by its path."""
    scheme, sep, rest = endpoint.partition("://")
    key = "tcp:" + rest.rsplit(":", 1)[1] if sep and scheme == "tcp" and ":" in rest \
        else endpoint
    return observe.stamp_address("vllm-engine-input", key, bytes(identity).hex())


def _stamp_destination(client, args, kwargs) -> bytes | bool:
    """The stamp channel of the ``ADD``'s engine (``engine``, else the client's
    ``core_engine``); True when unknown."""
    try:
        engine = args[2] if len(args) > 2 else kwargs.get("engine")
        if engine is None:
            engine = getattr(client, "core_engine", None)
        endpoint = input_endpoint(client)
        if engine is None or not endpoint:
            return True
        return stamp_address(endpoint, engine)
    except Exception as exc:  # noqa: BLE001 - timing never breaks a request
        observe.error(SERVER, "zmq_transfer", exc)
        return True


def adding(inner=observe.passthrough):
    """``_send_input`` of an ``ADD``: its encode is a hop (:func:`encode`)."""

    def wrapper(wrapped, instance, args, kwargs):
        if not is_add(args[0] if args else kwargs.get("request_type")):
            return inner(wrapped, instance, args, kwargs)
        token = _ADDING.set(_stamp_destination(instance, args, kwargs))
        try:
            return inner(wrapped, instance, args, kwargs)
        finally:
            _ADDING.reset(token)

    return wrapper


_encode = observe.timed(SERVER, "frontend_encode", nbytes=lambda out, a, kw: frames_bytes(out))()


def encode(wrapped, instance, args, kwargs):
    """An ``ADD`` with multimodal features: ``frontend_encode`` (every frame's
    bytes), then the ``zmq_transfer`` stamp goes to the engine."""
    dest = _ADDING.get()
    if not dest:
        return wrapped(*args, **kwargs)
    _ADDING.set(False)  # one encode per request; nested encodes are not hops
    request = args[0] if args else kwargs.get("obj")
    if not getattr(request, "mm_features", None):
        return wrapped(*args, **kwargs)  # a text-only request: not a multimodal hop
    frames = _encode(wrapped, instance, args, kwargs)
    if dest is not True:  # the frames go to zmq now: zmq_transfer starts
        try:
            observe.send_stamp(SERVER, "zmq_transfer", dest, str(request.request_id))
        except Exception as exc:  # noqa: BLE001
            observe.error(SERVER, "zmq_transfer", exc)
    return frames


def _mm_request(obj) -> bool:
    return type(obj).__name__ == "EngineCoreRequest" and bool(getattr(obj, "mm_features", None))


_decode = observe.timed(SERVER, "engine_decode", skip=lambda out, t: not _mm_request(out),
                        nbytes=lambda out, a, kw: frames_bytes(a[0] if a else kw.get("bufs"))
                        if _mm_request(out) else 0)()


def decode(wrapped, instance, args, kwargs):
    """An ``EngineCoreRequest`` with multimodal features: ``engine_decode``
    (the frames' bytes); ``zmq_transfer`` ended when it was called."""
    received = time.monotonic_ns()
    obj = _decode(wrapped, instance, args, kwargs)
    stamps = getattr(_STAMPS_IN, "receiver", None)
    if stamps is not None:
        try:
            if _mm_request(obj):
                stamps.observe(str(getattr(obj, "request_id", "")), received,
                               frames_bytes(args[0] if args else kwargs.get("bufs")))
        except Exception as exc:  # noqa: BLE001
            observe.error(SERVER, "zmq_transfer", exc)
    return obj


def stamps_in(inner=observe.passthrough):
    """``process_input_sockets`` (the input thread's life): the ``zmq_transfer``
    stamp channels of its endpoints, open until the loop ends (one that
    cannot be opened is a WARNING; the thread runs regardless)."""

    def wrapper(wrapped, instance, args, kwargs):
        receiver = None
        try:
            addresses = args[0] if args else kwargs.get("input_addresses")
            identity = args[2] if len(args) > 2 else kwargs.get("identity")
            if addresses and identity is not None:
                receiver = observe.StampReceiver(
                    SERVER, "zmq_transfer", [stamp_address(str(a), identity)
                                             for a in addresses])
                _STAMPS_IN.receiver = receiver
        except Exception as exc:  # noqa: BLE001 - never break the input thread
            observe.error(SERVER, "zmq_transfer", exc)
        try:
            return inner(wrapped, instance, args, kwargs)
        finally:
            if receiver is not None:
                if getattr(_STAMPS_IN, "receiver", None) is receiver:
                    _STAMPS_IN.receiver = None
                receiver.close()

    return wrapper


def _timed_queue(instance, args, kwargs) -> bool:
    return instance in TIMED_QUEUES


#: A timed queue's ``enqueue`` / ``dequeue`` of a message with tensors (their
#: bytes counted while pickled or unpickled; one too big for the ring: zmq).
MQ_ENQUEUE, MQ_DEQUEUE = (observe.timed(SERVER, hop, when=_timed_queue, count_frames=True,
                                        skip=lambda out, t: t.nbytes == 0)
                          for hop in ("mq_enqueue", "mq_dequeue"))


def acquire_read(wrapped, instance, args, kwargs):
    """``acquire_read`` in a timed dequeue (:class:`~mmshm.transport.mqueue.ClockAtMessage`)."""
    cm = wrapped(*args, **kwargs)
    return mqueue.ClockAtMessage(cm, SERVER) if observe.current() is not None else cm


def count_reduced(inner=observe.passthrough):
    """``_reduce_tensor``: the open hop counts what vLLM sends out of band, or
    mmshm's handles' bytes."""

    def wrapper(wrapped, instance, args, kwargs):
        t = observe.current()
        if t is None:
            return inner(wrapped, instance, args, kwargs)
        out = inner(wrapped, instance, args, kwargs)
        try:
            t.add(mqueue.reduced_bytes(out, args))
        except Exception as exc:  # noqa: BLE001 - timing never breaks a message
            observe.error(SERVER, t.hop, exc)
        return out

    return wrapper


def time_queue(mq, role: str) -> None:
    """Time ``mq``'s messages (a reader: the pyzmq tap too, a WARNING if not)."""
    TIMED_QUEUES.add(mq)
    if getattr(mq, "_is_writer", False):
        return
    for failed in observe.install_taps(("zmq",)):
        me().path_off(role, "timing of mq_dequeue (messages over the ring's size)",
                      f"mmshm cannot tap {failed}",
                      "report this as an mmshm bug with the pyzmq version")
