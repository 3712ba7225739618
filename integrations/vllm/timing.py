"""vLLM's hops (:func:`mmshm.hooks.observe.timed`), alike in both modes, and the
``zmq_transfer`` stamp beside the message (docs/vllm.md, "zmq_transfer")."""

import time

from mmshm.hooks import observe
from mmshm.transport import mqhops

from .server import SERVER, input_endpoint, is_add, me

#: The hops timed, in the order a request takes them.
HOPS = ("frontend_encode", "zmq_transfer", "engine_decode", "mq_enqueue", "mq_dequeue")
#: ``zmq_transfer``: a stamp from the ``ADD``'s ``_send_input`` to its
#: engine's input thread (:class:`mmshm.hooks.observe.StampedHop`).
ZMQ_TRANSFER = observe.StampedHop(SERVER, "zmq_transfer")


def stamp_address(endpoint: str, identity) -> bytes:
    """The ``zmq_transfer`` stamp channel of the EngineCore ``identity`` (its
    index, 2 bytes little-endian) reading input ``endpoint``
    (:func:`mmshm.hooks.observe.endpoint_key`: ``tcp://`` by its port alone)."""
    return observe.stamp_address("vllm-engine-input", observe.endpoint_key(endpoint),
                                 bytes(identity).hex())


def _stamp_destination(client, args, kwargs) -> bytes | None:
    """The stamp channel of the ``ADD``'s engine (``engine``, else the client's
    ``core_engine``); None when unknown."""
    engine = args[2] if len(args) > 2 else kwargs.get("engine")
    if engine is None:
        engine = getattr(client, "core_engine", None)
    endpoint = input_endpoint(client)
    return None if engine is None or not endpoint else stamp_address(endpoint, engine)


def adding(inner=observe.passthrough):
    """``_send_input`` of an ``ADD``: its encode is a hop (:func:`encode`)."""

    def wrapper(wrapped, instance, args, kwargs):
        if not is_add(args[0] if args else kwargs.get("request_type")):
            return inner(wrapped, instance, args, kwargs)
        with ZMQ_TRANSFER.sending(lambda: _stamp_destination(instance, args, kwargs)):
            return inner(wrapped, instance, args, kwargs)

    return wrapper


_encode = observe.timed(SERVER, "frontend_encode",
                       nbytes=lambda out, a, kw: observe.frames_bytes(out))()


def encode(wrapped, instance, args, kwargs):
    """An ``ADD`` with multimodal features: ``frontend_encode`` (every frame's
    bytes), then the ``zmq_transfer`` stamp goes to the engine."""
    dest = ZMQ_TRANSFER.take()
    request = args[0] if args else kwargs.get("obj")
    if not dest or not getattr(request, "mm_features", None):
        return wrapped(*args, **kwargs)  # not an ADD, or text only: not a multimodal hop
    frames = _encode(wrapped, instance, args, kwargs)
    ZMQ_TRANSFER.stamp(dest, lambda: str(request.request_id))  # zmq_transfer starts
    return frames


def _mm_request(obj) -> bool:
    return type(obj).__name__ == "EngineCoreRequest" and bool(getattr(obj, "mm_features", None))


def _bufs_bytes(args, kwargs) -> int:
    return observe.frames_bytes(args[0] if args else kwargs.get("bufs"))


_decode = observe.timed(SERVER, "engine_decode", skip=lambda out, t: not _mm_request(out),
                        nbytes=lambda out, a, kw: _bufs_bytes(a, kw) if _mm_request(out) else 0)()


def decode(wrapped, instance, args, kwargs):
    """An ``EngineCoreRequest`` with multimodal features: ``engine_decode``
    (the frames' bytes); ``zmq_transfer`` ended when it was called."""
    received = time.monotonic_ns()
    obj = _decode(wrapped, instance, args, kwargs)
    ZMQ_TRANSFER.arrived(received, lambda: (str(getattr(obj, "request_id", "")), _bufs_bytes(
        args, kwargs)) if _mm_request(obj) else None)
    return obj


def _stamp_channels(args, kwargs) -> list[bytes] | None:
    addresses = args[0] if args else kwargs.get("input_addresses")
    identity = args[2] if len(args) > 2 else kwargs.get("identity")
    if addresses and identity is not None:
        return [stamp_address(str(a), identity) for a in addresses]
    return None


def stamps_in(inner=observe.passthrough):
    """``process_input_sockets`` (the input thread's life): the ``zmq_transfer``
    stamp channels of its endpoints, open until the loop ends."""

    def wrapper(wrapped, instance, args, kwargs):
        with ZMQ_TRANSFER.receiving(lambda: _stamp_channels(args, kwargs)):
            return inner(wrapped, instance, args, kwargs)

    return wrapper


#: The scheduler-output queue's hops (:class:`mmshm.transport.mqhops.QueueHops`).
QUEUE = mqhops.QueueHops(SERVER)
TIMED_QUEUES, MQ_ENQUEUE, MQ_DEQUEUE = QUEUE.queues, QUEUE.enqueue, QUEUE.dequeue
acquire_read, count_reduced = QUEUE.acquire_read, QUEUE.count_reduced


def time_queue(mq, role: str) -> None:
    """Time ``mq``'s messages (a reader: the pyzmq tap too, a WARNING if not)."""
    QUEUE.queues.add(mq)
    if not getattr(mq, "_is_writer", False):
        me().tap(role, ("zmq",), lambda failed: "mq_dequeue (messages over the ring's size)",
                 "pyzmq version")
