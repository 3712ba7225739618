"""Frontend -> EngineCore: vLLM's out-of-band tensor hooks carry handles (docs/vllm.md)."""

from __future__ import annotations

import contextlib
import weakref

import torch
from mmshm import config
from mmshm.hooks import observe
from mmshm.hooks.instrumentor import Role
from mmshm.transport import receiving, sending, views, wrapping

from . import pd
from .server import (FIX_RELEASE, KEY_PIXELS, PATH_FANOUT, PATH_REQUESTS, WIRE_KEY,
                     input_endpoint, is_add, key_mode, me, tensors)

_ATTACHED: weakref.WeakSet = weakref.WeakSet()  # encoders given a consumer
_PROVIDED: weakref.WeakSet = weakref.WeakSet()  # EngineCoreProcs given a provider
#: Tensors in a segment (views of a frontend's, or this process's copies):
#: tensor -> (wire bytes, HandleMeta); see mmshm.transport.sending.SEGMENTS.
VIEWS = sending.SEGMENTS
HOPS = ("frontend_encode", "zmq_transfer's start")
#: This frontend's engines run an EC connector (encoder disaggregation): each
#: tensor's BLAKE3 digest is computed in the copy's pass (where items are keyed
#: by their tensors, not by vLLM's mm_hash), here in the API
#: server, so that the EngineCore keys items without reading their bytes
#: (:func:`mmshm.transport.ec_keys.tensor_digest`).
DIGEST_FOR_EC = False
PATH_EC_DIGEST = ("encoder disaggregation: each tensor hashed (BLAKE3) in its copy's pass, "
                  "so the EngineCore keys items without reading them")


class ShmTensorConsumer:
    """``OOBTensorConsumer`` of ``MPClient.encoder``: in an ``ADD``, a large CPU
    tensor becomes ``{"mmshm": <handle metadata>}``; else vLLM's consumer or frames.
    A large tensor already on a device is left to vLLM and counted once per
    message in ``mmshm_device_tensors_total{kind="cuda"}``."""

    __slots__ = ("__weakref__", "inner", "seen")

    def __init__(self, inner=None):
        self.inner = inner
        self.seen: set[int] = set()

    def new_message(self) -> None:
        self.seen = set()
        if self.inner is not None:
            self.inner.new_message()

    def __call__(self, tensor):
        box = sending.current_outbox()
        if box is not None and box.path == "send" and not config.get().disable \
                and wrapping.left_on_device(tensor, self.seen, config.get().min_bytes):
            return self.inner(tensor) if self.inner is not None else None
        if box is not None and box.path == "send" and not config.get().disable \
                and sending.eligible(tensor):
            withheld = pd.WITHHOLDING.get()
            if withheld is not None:  # a decode instance's request: no payload
                withheld[0] += 1
                withheld[1] += tensor.nbytes
                return {pd.WITHHELD_KEY: tensor.nbytes}
            h = box.put(tensor, hash_now=True if DIGEST_FOR_EC else None)
            if h is not None:
                return {WIRE_KEY: h.encode()}
        return self.inner(tensor) if self.inner is not None else None


class ShmTensorProvider:
    """``OOBTensorProvider`` of the EngineCore's decoders: mmshm's placeholders
    materialized zero-copy, any other to vLLM's provider."""

    __slots__ = ("__weakref__", "inner")

    def __init__(self, inner=None):
        self.inner = inner

    def __call__(self, dtype, shape, meta):
        wire = meta.get(WIRE_KEY) if isinstance(meta, dict) else None
        if wire is None and isinstance(meta, dict) and pd.WITHHELD_KEY in meta:
            return pd.withheld_tensor(dtype, shape)
        if wire is None:
            if self.inner is None:
                raise ValueError("received an out-of-band tensor but no tensor provider is set")
            return self.inner(dtype, shape, meta)
        return materialize_request_tensor(wire, dtype, shape)


def materialize_request_tensor(wire, dtype: str, shape) -> torch.Tensor:
    """The tensor behind a placeholder (zero-copy); on failure an empty one, the
    reference given back: the request fails in ``preprocess_add_request``."""
    return receiving.materialize_wire(wire, dtype, shape)


def attach_encoder(client) -> bool:
    """Give an ``MPClient``'s encoder mmshm's consumer unless its engines may be
    remote; says the frontend's line (a WARNING if not). Returns whether it has it."""
    enc = getattr(client, "encoder", None)
    if enc is None or not hasattr(enc, "oob_tensor_consumer"):
        me().path_off("frontend", PATH_REQUESTS, "the client has no MsgpackEncoder "
                      "with out-of-band tensor hooks", FIX_RELEASE)
        return False
    if isinstance(enc.oob_tensor_consumer, ShmTensorConsumer):
        return True
    addr = input_endpoint(client)
    if not views.is_local_endpoint(addr):
        me().path_off(
            "frontend", PATH_REQUESTS,
            f"the engines' input endpoint {addr or '(unknown)'} may be on another node, so "
            f"tensors travel on vLLM's own path",
            "nothing to do for engines on other nodes; on one node, keep vLLM's default "
            "(ipc://) engine addresses")
        return False
    enc.oob_tensor_consumer = ShmTensorConsumer(enc.oob_tensor_consumer)
    _ATTACHED.add(enc)
    vllm_config = getattr(client, "vllm_config", None)
    decode = pd.decode_payload_policy(vllm_config)
    pd.DECODE_WITHHOLDS = None if decode is None else decode[0]
    global DIGEST_FOR_EC
    DIGEST_FOR_EC = (getattr(vllm_config, "ec_transfer_config", None) is not None
                     and key_mode(vllm_config) == KEY_PIXELS)
    me().say(Role("frontend", [f"{PATH_REQUESTS} ({addr})", PATH_FANOUT]
                  + ([] if decode is None else [decode[1]])
                  + ([PATH_EC_DIGEST] if DIGEST_FOR_EC else []), hops=HOPS))
    return True


def attach_provider(engine) -> None:
    """Give an ``EngineCoreProc`` mmshm's provider (wrapping vLLM's, if any)."""
    inner = getattr(engine, "tensor_ipc_receiver", None)
    if not isinstance(inner, ShmTensorProvider):
        engine.tensor_ipc_receiver = ShmTensorProvider(inner)
        with contextlib.suppress(TypeError):
            _PROVIDED.add(engine)


def send_input(wrapped, instance, args, kwargs):
    """``_send_input`` of an ``ADD``: one message's references; a decode
    instance's request prefilled elsewhere has its payload withheld."""
    if not is_add(args[0] if args else kwargs.get("request_type")):
        return wrapped(*args, **kwargs)
    request = args[1] if len(args) > 1 else kwargs.get("request")
    token = pd.WITHHOLDING.set(
        [0, 0] if pd.DECODE_WITHHOLDS and pd.remote_prefilled(request) else None)
    try:
        with sending.sending() as box:
            if pd.WITHHOLDING.get() is None:
                prepare_request(box, request)
            return wrapped(*args, **kwargs)
    finally:
        pd.WITHHOLDING.reset(token)


def prepare_request(box, request) -> int:
    """Write the request's large CPU tensors (its ``mm_features``, its
    ``prompt_embeds``) into one segment before vLLM's encoder meets them one
    by one (:meth:`mmshm.transport.sending.Outbox.prepare_tree`;
    :class:`ShmTensorConsumer` then takes each one's handle). Returns how many
    tensors were written; never raises."""
    if config.get().disable or request is None:
        return 0
    return box.prepare_tree(request, True if DIGEST_FOR_EC else None)


#: ``LLMEngine.add_request``, ``AsyncLLM.add_request``: its ``n`` children share a
#: segment per tensor.
add_request = add_request_async = observe.within(lambda inst, a, kw: sending.fanning_out())


def preprocess_add_request(wrapped, instance, args, kwargs):
    """A request whose handles did not materialize fails here (vLLM's error
    output); a failed one drops its views; the receiver cache's are marked."""
    request = args[0] if args else kwargs.get("request")
    if receiving.has_failures():
        err = receiving.failure_in(
            request, f"request {getattr(request, 'request_id', '?')}, in the EngineCore")
        if err is not None:
            drop_views(request)  # never scheduled: nothing frees it later
            raise err  # vLLM turns it into this request's error output
    try:
        out = wrapped(*args, **kwargs)
    except BaseException:
        drop_views(request)  # vLLM answers it with an error; its views go now
        raise
    cache = getattr(instance, "mm_receiver_cache", None)
    if cache is not None:
        mark_cached_views(cache, request)
    return out


def _views(request):
    """``(feature, [its tensors])`` of each feature of ``request`` with data."""
    for feature in getattr(request, "mm_features", None) or ():
        data = getattr(feature, "data", None)
        if data is not None:
            yield feature, [t for elem in data.values() for t in tensors(getattr(elem, "data",
                                                                                None))]


def drop_views(request) -> int:
    """``feature.data = None`` for each feature of ``request`` whose data holds
    :data:`VIEWS`, so no stale reference (vLLM's input thread keeps the last
    request) keeps a segment alive (:func:`mmshm.transport.views.drop`).
    Returns the views let go. Never raises."""
    return views.drop((feature, "data", ts) for feature, ts in _views(request))


def free_request(wrapped, instance, args, kwargs):
    """``Scheduler._free_request`` (finished or aborted), then :func:`drop_views`."""
    request = args[0] if args else kwargs.get("request")
    try:
        return wrapped(*args, **kwargs)
    finally:
        drop_views(request)


def mark_cached_views(cache, request) -> int:
    """Mark the segments of the views vLLM's receiver ``cache`` keeps of
    ``request`` (:func:`mmshm.transport.views.mark_cached`; one it did not
    take, or evicted already, is left). Returns the segments marked. Never raises."""
    held = getattr(cache, "_cache", None)

    def kept(feature) -> bool:
        key = getattr(feature, "mm_hash", None) or getattr(feature, "identifier", None)
        return held is None or key is None or key in held

    return views.mark_cached(ts for feature, ts in _views(request) if kept(feature))
