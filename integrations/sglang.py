"""SGLang instrumentor: glue between SGLang's multimodal transport and mmshm.

Supported releases: 0.5.9 through 0.5.23. This module holds SGLang's targets
and the glue between their call sites and the core: :mod:`mmshm.hooks.instrumentor`
checks and patches the targets (wrapt post-import hooks, when SGLang's modules
are imported, by the names under which the consumers call them),
:mod:`mmshm.transport.sending` keeps each message's references and the fan-out's,
:mod:`mmshm.transport.receiving` and :func:`mmshm.deferred_unwrap` materialize.

Tokenizer process
    ``wrap_shm_features`` as imported into ``tokenizer_manager`` (and in
    ``mm_utils``): the request's ``mm_inputs`` tensors become
    :class:`mmshm.ShmTensor` handles in a *new* request object; the shared
    ``mm_items`` of fan-out copies are never mutated. A tensor sent again
    (parallel sampling, the warm-up copy) reuses its live segment with one
    more reference instead of a new segment; a full ``/dev/shm`` gives
    ENOSPC and inline transport, never SIGBUS. Items without a hash get the
    content hash the handle carries.
    ``TokenizerManager._send_one_request``: the handles' references travel
    with the message once it is sent (one more per hop through SGLang's
    data-parallel controller); if dispatch fails they are released.
    ``TokenizerManager._handle_batch_request`` with parallel sampling
    (``n > 1``): SGLang sends a warm-up copy, awaits its answer, then sends
    the n samples. For that whole scope the tokenizer holds one reference
    per tensor it put in shared memory, released when the scope ends, so
    the scheduler's release of the warm-up never frees the segment and the
    samples reuse it: the payload is written once per fan-out. Each copy
    sent in the scope with handles counts in ``mmshm_fanout_copies_total``
    (n + 1 per prompt: the warm-up and the samples).
    ``hash_feature`` in ``mm_utils``: handles, CPU tensors and lists mixing
    both hash to an int derived from BLAKE3-128 of the bytes, the hash the
    handle already carries, so the value never depends on how a tensor
    travelled and nothing re-hashes pixels the tokenizer already hashed.

Scheduler process
    ``broadcast_pyobj`` as imported into the scheduler (<= 0.5.12) or into
    ``scheduler_components/request_receiver`` (>= 0.5.15), wrapped in
    :func:`mmshm.deferred_unwrap`: metadata-only broadcast, references handed
    out before it, unwrap after it on every rank, per-request failures agreed
    across the TP group, no barrier. ``attn_cp_tp_broadcast_pyobj`` (0.5.23,
    DP attention) likewise on the attention-TP group (with context parallel
    the handles are materialized first and travel inline). ``recv_requests``
    (patched on the class: ``SchedulerRequestReceiver`` is a frozen, slotted
    dataclass) unwraps what no broadcast unwrapped (TP size 1).

Data-parallel controller (``--dp-size`` > 1)
    The tokenizer adds one reference per handle for the controller, which
    unpickles each request and forwards it to one DP rank's scheduler;
    ``DataParallelController.__init__`` wraps its ``_request_dispatcher`` so
    the controller gives its references back once the request is forwarded.
    Each scheduler says its DP rank: ``scheduler (DP rank 1, TP rank 0)``.

PD decode instance (``--disaggregation-mode decode``)
    Its scheduler takes each request's KV from the prefill instance and
    never runs the vision encoder, so the tokenizer withholds the items'
    pixels (:func:`decode_payload_policy`): each item is hashed first
    (the BLAKE3 value mmshm gives the same pixels anywhere), its
    ``feature`` / ``precomputed_embeddings`` travel as
    :class:`WithheldPayload` (shape, dtype, size) and nothing is written
    into shared memory; the schedulers hand SGLang ``None`` for them, as
    upstream's open ``--enable-clear-mm-features-for-decode`` (PR 14832)
    does. A scheduler not in decode mode fails such a request with
    :class:`PayloadWithheldError`. With ``--enable-pd-role-switch`` the
    pixels are kept. The tokenizer's "on:" line says which.

Observe mode (``MMSHM_MODE=observe``, ``mmshm run --observe``)
    The same boundaries are patched, but only timed (:mod:`mmshm.hooks.observe`):
    SGLang's own functions run with the same arguments and its own transport
    (``ShmPointerMMData`` and its ``psm_*`` segments, or the pickled pixels
    across nodes) carries the tensors. Hops, in ``mmshm_ipc_seconds`` and
    ``mmshm_ipc_bytes{server="sglang",hop,transport}`` (``transport`` is
    ``mmshm`` in shm mode, where the same hops are timed around mmshm):
    ``tokenizer_wrap`` (``wrap_shm_features``: bytes put into shared memory),
    ``tokenizer_send`` (the tokenizer's ``send_pyobj``: pickled bytes),
    ``scheduler_recv`` (TP rank 0's ``recv_pyobj`` in ``recv_requests``:
    received bytes, the unpickle included), ``broadcast_src`` /
    ``broadcast_dst`` (a non-empty ``broadcast_pyobj``: the bytes
    ``torch.distributed.broadcast`` carries; a receiving rank's clock starts
    once the message's size has arrived, so waiting for the source is left
    out; mmshm's materialize is inside it), ``materialize``
    (``unwrap_shm_features``: bytes of SGLang's shared-memory pointers turned
    back into tensors; on 0.5.15+ the whole ``_finalize_shm_features``, its
    TP barrier and all-reduce of failures included) and ``mm_inputs`` (each
    TP rank's ``Scheduler._get_multimodal_inputs``: ``MultimodalInputs`` made
    from the processor output, SGLang's hash of every item included: the
    bytes of the items' tensors). The last two are timed alike in both modes.

Several nodes (``--nnodes > 1``)
    SGLang's own transport is then ``default``: the tokenizer pickles the
    pixels into its message and ``broadcast_pyobj`` sends that pickle to every
    rank. Under mmshm the tokenizer -> TP rank 0 hop (one node) goes through
    shared memory, and the broadcast carries metadata to the ranks of rank
    0's node and each payload once to every other node, where one rank puts
    it in a segment of its own node for its peers (:mod:`mmshm.transport.multinode`).
    The node layout decides, not SGLang's flag: 0.5.9-0.5.12 on one node with
    ``--dist-init-addr`` keep shared memory. A node whose ranks run no mmshm
    or another version is found on the first broadcast
    (:func:`mmshm.transport.handshake.handshake`): the group then carries its tensors
    inline, with a WARNING naming the ranks.

SGLang's own ``ShmPointerMMData`` is then never created, so its early
unlink, barriers and n+1 segments play no part. mmshm is used with pickle IPC
(``SGLANG_USE_PICKLE_IPC``, the default) and a tokenizer process; otherwise
SGLang's functions run unchanged.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import sys

from mmshm.hooks import observe
from mmshm.transport import sending
from mmshm.errors import PayloadWithheldError
from mmshm.hooks.instrumentor import Instrumentor, Target, source_file
from mmshm.transport.receiving import unwrap_each
from mmshm.transport.sending import digest_of

log = logging.getLogger("mmshm")

SUPPORTED = ">=0.5.9,<=0.5.23"

MM_UTILS = "sglang.srt.managers.mm_utils"
IO_STRUCT = "sglang.srt.managers.io_struct"
TOKENIZER = "sglang.srt.managers.tokenizer_manager"
SCHEDULER = "sglang.srt.managers.scheduler"
RECEIVER = "sglang.srt.managers.scheduler_components.request_receiver"
DP_CONTROLLER = "sglang.srt.managers.data_parallel_controller"

#: Transport paths as :mod:`mmshm.hooks.report` names them (``mmshm_path_enabled``).
PATH_REQUESTS = "multimodal tensors to the scheduler through shared memory"
PATH_FANOUT = "parallel sampling (n>1) writes each tensor once"
PATH_SCHED_IN = "requests materialized zero-copy on every TP rank"
PATH_BROADCAST = "TP broadcast carries metadata only"
PATH_MULTINODE = "multi-node: payload once per node"
PATH_DP_FORWARD = "requests forwarded to the DP ranks, their references given back at once"
PATH_DECODE_WITHHOLD = (
    "PD decode instance (--disaggregation-mode decode): multimodal items reach the "
    "scheduler without their pixels (hashes, pad values and token layout kept; the KV "
    "comes from the prefill instance, the vision encoder never runs here)")
PATH_DECODE_KEEP = "PD decode instance: pixels kept ({})"
PATH_OBSERVE = ("observe mode: SGLang's own transport carries the tensors; timing each hop "
                "(mmshm_ipc_seconds, transport=\"server\")")


def hash_int(digest: bytes) -> int:
    """SGLang's hashes are unsigned 64-bit ints: the first 8 bytes of the
    carried BLAKE3-128 digest, big-endian."""
    return int.from_bytes(digest[:8], "big", signed=False)


# -- SGLang's own decisions ---------------------------------------------------------
def _server_args(mm):
    """SGLang's server args (``get_global_server_args`` or, on some
    releases, ``get_serving``); None where neither is published."""
    for accessor in ("get_global_server_args", "get_serving"):
        fn = getattr(mm, accessor, None)
        if fn is not None:
            return fn()
    return None


def _transport_off_reason() -> tuple[str, str] | None:
    """``(reason, fix)`` when mmshm cannot carry the tensors here (no
    tokenizer, no pickle IPC); None when it can.

    SGLang's own transport mode is not asked: it is ``default`` (pixels
    pickled into the message and broadcast to every rank) whenever TP spans
    nodes, and on 0.5.9-0.5.12 whenever ``--dist-init-addr`` is given, even on
    one node. mmshm decides from the node layout instead: the tokenizer and
    TP rank 0's scheduler are started together on node rank 0 by SGLang's
    launcher (one node: shared memory), and :func:`mmshm.deferred_unwrap`
    learns the TP group's nodes on its first broadcast (several nodes: each
    payload crosses the network once per node, :mod:`mmshm.transport.multinode`)."""
    mm = sys.modules.get(MM_UTILS)
    if mm is None:
        return ("sglang's mm_utils is not imported in this process",
                "report this as an mmshm bug with the SGLang version")
    try:
        if getattr(_server_args(mm), "skip_tokenizer_init", False):
            return ("--skip-tokenizer-init: the tokenizer process sends no tensors",
                    "none needed")
    except Exception:  # noqa: BLE001 - server args not set yet: judged later
        pass
    if not bool(getattr(sys.modules.get(IO_STRUCT), "_USE_PICKLE_IPC", True)):
        return ("SGLANG_USE_PICKLE_IPC is off: requests are not pickled, so handles "
                "cannot ride in them", "unset SGLANG_USE_PICKLE_IPC (pickle IPC is the default)")
    return None


# -- tokenizer side -------------------------------------------------------------
def _items(mm_inputs):
    items = mm_inputs.get("mm_items") if isinstance(mm_inputs, dict) else getattr(
        mm_inputs, "mm_items", None)
    return items or []


def _feature(item):
    feature = getattr(item, "feature", None)
    return getattr(item, "precomputed_embeddings", None) if feature is None else feature


def _unhashed_features(mm_inputs) -> set[int]:
    """``id()`` of the tensors (possibly in nested lists) of the items
    without a hash (the ones :func:`_set_item_hashes` hashes)."""
    import torch

    ids: set[int] = set()
    stack = [_feature(item) for item in _items(mm_inputs)
             if getattr(item, "hash", 0) is None]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            ids.add(id(x))
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return ids


def _set_item_hashes(mm_inputs) -> None:
    """Give every item without a hash the int of its feature's content hash
    (carried by the handle, or computed once for an inline tensor), so the
    scheduler never hashes pixels. Deterministic, so setting it on an item
    that fan-out copies share is harmless. A handle's hash is computed here
    from its segment if it carries none yet (``MMSHM_HASH=lazy``)."""
    from mmshm import MmshmError

    for item in _items(mm_inputs):
        if getattr(item, "hash", 0) is not None:
            continue
        feature = _feature(item)
        try:
            d = digest_of(feature) if feature is not None else None
        except (MmshmError, OSError) as exc:
            # the segment vanished under us (MMSHM_HASH=lazy reads it here):
            # leave the item unhashed; the scheduler's unwrap reports the loss
            log.warning("mmshm: could not hash a multimodal item: %s", exc)
            continue
        if d is not None:
            item.hash = hash_int(d)


_numpy_warned: set[str] = set()


def _warn_numpy_features(mm_inputs, min_bytes: int) -> None:
    """Say once per process, at WARNING, that a feature or precomputed
    embedding of at least ``min_bytes`` bytes is a numpy array: mmshm (like
    SGLang's own shared memory) carries torch tensors only, so the array is
    pickled into the request. SGLang's ``LlavaImageProcessor`` (LLaVA-1.5 /
    NeXT / OneVision checkpoints in their original format, e.g.
    ``LlavaQwenForCausalLM``) returns float16 numpy pixel values."""
    np = sys.modules.get("numpy")
    if np is None or "numpy" in _numpy_warned:
        return
    for item in _items(mm_inputs):
        for name in ("feature", "precomputed_embeddings"):
            value = getattr(item, name, None)
            for x in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(x, np.ndarray) and x.nbytes >= min_bytes:
                    _numpy_warned.add("numpy")
                    log.warning(
                        "mmshm: a multimodal %s of %d bytes is a numpy array (%s %s), not a "
                        "torch tensor: it travels inline, pickled into the request, not "
                        "through shared memory (said once). SGLang's processor for this "
                        "model returns numpy arrays (its LlavaImageProcessor does, for "
                        "LLaVA checkpoints in their original format); the Hugging Face "
                        "format of the checkpoint (e.g. LlavaNextForConditionalGeneration) "
                        "gives tensors", name, x.nbytes, x.dtype, tuple(x.shape))
                    return


def _wrap_shm_features(wrapped, instance, args, kwargs):
    """``wrap_shm_features(obj)``: a copy of ``obj`` whose ``mm_inputs``
    carry handles from this send's outbox (the input, and the ``mm_items``
    fan-out copies share, are not modified)."""
    from mmshm import config
    from mmshm.transport.wrapping import transform

    box = sending.current_outbox()
    if box is None or config.get().disable or _transport_off_reason() is not None:
        return wrapped(*args, **kwargs)
    obj = args[0] if args else kwargs["obj"]
    mm_inputs = getattr(obj, "mm_inputs", None)
    if not mm_inputs or not _items(mm_inputs):
        return obj
    min_bytes = config.get().min_bytes
    # a PD decode instance's items lose their pixels first (what is left:
    # items whose content could not be hashed)
    kept = _withhold_payloads(mm_inputs) if _DECODE_WITHHOLDS else mm_inputs
    # the features of items SGLang's processor did not hash: their hash is
    # read next (_set_item_hashes), so it is computed in the copy's pass
    unhashed = _unhashed_features(kept)

    def leaf(x):
        if not sending.eligible(x, min_bytes):
            return x
        h = box.put(x, hash_now=id(x) in unhashed)
        return x if h is None else h

    new_mm = transform(kept, leaf)
    _warn_numpy_features(new_mm, min_bytes)
    _set_item_hashes(new_mm)
    if new_mm is mm_inputs:
        return obj
    new_obj = copy.copy(obj)
    new_obj.mm_inputs = new_mm
    return new_obj


def _dp_hops(tokenizer_manager) -> int:
    """References to add per handle for the data-parallel controller, which
    unpickles each request (one holder) and forwards it to a scheduler."""
    args = getattr(tokenizer_manager, "server_args", None)
    return 1 if getattr(args, "dp_size", 1) and getattr(args, "dp_size", 1) > 1 else 0


def _send_one_request(wrapped, instance, args, kwargs):
    """One message to the scheduler: the handles' references travel with it,
    or are given back if dispatch fails."""
    if inspect.iscoroutinefunction(wrapped):  # async since 0.5.2x
        return _send_one_request_async(wrapped, instance, args, kwargs)
    with sending.sending(hops=_dp_hops(instance)):
        return wrapped(*args, **kwargs)


async def _send_one_request_async(wrapped, instance, args, kwargs):
    with sending.sending(hops=_dp_hops(instance)):  # this task's context only
        return await wrapped(*args, **kwargs)


# -- data-parallel controller ----------------------------------------------------
def _controller_ready(wrapped, instance, args, kwargs):
    """``DataParallelController.__init__``: the controller gives its own
    references back as soon as it has forwarded a request.

    The controller unpickles each request from the tokenizer (its handles
    own the reference :func:`_dp_hops` added for it) and sends it on to one
    DP rank's scheduler (or to all) from ``_request_dispatcher``, which
    pickles it there and then (0.5.9-0.5.23: ``send_pyobj`` / ``sock_send``).
    Left to garbage collection, the references of the last request would
    stay: the controller's event loop keeps it in a local variable until the
    next request arrives, so its segments outlived the pool's idle time on
    an idle server."""
    result = wrapped(*args, **kwargs)
    dispatcher = getattr(instance, "_request_dispatcher", None)
    if not callable(dispatcher):
        SGLangInstrumentor().path_off(
            "data-parallel controller", PATH_DP_FORWARD,
            "this SGLang release's DataParallelController has no _request_dispatcher, so the "
            "references of the last request it forwarded are given back only when the next "
            "one arrives", "report this as an mmshm bug with the SGLang version")
        return result
    import wrapt

    instance._request_dispatcher = wrapt.FunctionWrapper(dispatcher, _forward_then_release)
    _say("data-parallel controller", [PATH_DP_FORWARD], [PATH_DP_FORWARD])
    return result


def _forward_then_release(wrapped, instance, args, kwargs):
    """One message through the controller's dispatcher: forwarded (pickled
    and sent), then the controller's own references on its handles given
    back (:func:`mmshm.transport.wrapping.release`); the receivers' references travel
    in the message. If dispatch raises, the controller's are given back all
    the same."""
    from mmshm.transport import wrapping

    try:
        return wrapped(*args, **kwargs)
    finally:
        if args:
            wrapping.release(args[0])


def _handle_batch_request(wrapped, instance, args, kwargs):
    """Parallel sampling: one fan-out for the whole call (an async generator,
    see :func:`mmshm.transport.sending.fanned_out`)."""
    obj = args[0] if args else kwargs.get("obj")
    if getattr(obj, "parallel_sample_num", 1) in (None, 0, 1):
        return wrapped(*args, **kwargs)
    return sending.fanned_out(wrapped(*args, **kwargs))


def _hash_feature(wrapped, instance, args, kwargs):
    f = args[0] if args else kwargs.get("f")
    d = digest_of(f)
    return wrapped(*args, **kwargs) if d is None else hash_int(d)


# -- PD decode instances (--disaggregation-mode decode) ---------------------------------
#: This tokenizer's decision (set by :func:`_tokenizer_ready` from
#: :func:`decode_payload_policy`): True withholds the items' pixels.
_DECODE_WITHHOLDS = False
#: This process's ``Scheduler`` (weak), whose ``disaggregation_mode`` says
#: whether an item without its pixels may be handed to SGLang.
_SCHEDULER = None
#: Item fields that hold a payload only the vision (or audio) encoder reads.
PAYLOAD_FIELDS = ("feature", "precomputed_embeddings")


class WithheldPayload:
    """What travels to a PD decode instance's scheduler in place of an
    item's tensor (``feature``, ``precomputed_embeddings``): its ``shape``
    (tuple of ints), ``dtype`` (torch's name, e.g. ``"float32"``) and
    ``nbytes``, no data. A decode scheduler receives ``None`` instead, as
    upstream's ``--enable-clear-mm-features-for-decode`` (PR 14832, open)
    gives it; any other scheduler fails the request with
    :class:`PayloadWithheldError`."""

    __slots__ = ("shape", "dtype", "nbytes")

    def __init__(self, shape: tuple, dtype: str, nbytes: int):
        self.shape, self.dtype, self.nbytes = tuple(shape), dtype, int(nbytes)

    @classmethod
    def of(cls, t) -> WithheldPayload:
        return cls(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.nbytes)

    def __repr__(self) -> str:
        return f"WithheldPayload({self.dtype}{list(self.shape)}, {self.nbytes} bytes)"


def decode_payload_policy(tokenizer_manager) -> tuple[bool, str] | None:
    """What this tokenizer does with the pixels of its requests: ``(True,
    line)`` withholds them, ``(False, line)`` keeps them (the line says
    why), None: not a PD decode instance.

    SGLang's decode scheduler takes each request's KV from the prefill
    instance (a retraction keeps it in host memory, or bootstraps it again)
    and never runs the vision encoder; it needs each item's hash (its pad
    value, hence the prefix-cache key and ``input_ids``), the token layout
    (offsets, mrope positions) and the grids, all of which stay. Pixels are
    kept where the instance may turn into a prefill instance
    (``--enable-pd-role-switch``)."""
    mode = getattr(getattr(tokenizer_manager, "disaggregation_mode", None), "value", None)
    if mode != "decode":
        return None
    if getattr(getattr(tokenizer_manager, "server_args", None), "enable_pd_role_switch",
               False):
        return False, PATH_DECODE_KEEP.format(
            "--enable-pd-role-switch: this instance may become a prefill instance, "
            "which needs them")
    return True, PATH_DECODE_WITHHOLD


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _withhold_payloads(mm_inputs):
    """A copy of ``mm_inputs`` whose items' payload tensors
    (:data:`PAYLOAD_FIELDS`) are :class:`WithheldPayload` stand-ins, each
    item's hash set first from the content (:func:`_set_item_hashes`:
    the BLAKE3 value a prefill instance under mmshm gives the same pixels).
    An item whose content cannot be hashed keeps its tensors: the scheduler
    would hash them. The input, and the items fan-out copies share, are not
    modified (the hash aside, which is deterministic)."""
    from mmshm.transport.wrapping import transform

    _set_item_hashes(mm_inputs)
    withheld = {id(t): t for item in _items(mm_inputs) if getattr(item, "hash", None)
                is not None for name in PAYLOAD_FIELDS
                for t in _tensors(getattr(item, name, None))}
    if not withheld:
        return mm_inputs
    return transform(mm_inputs, lambda x: WithheldPayload.of(x) if id(x) in withheld else x)


def _has_withheld(value) -> bool:
    if isinstance(value, WithheldPayload):
        return True
    return isinstance(value, (list, tuple)) and any(_has_withheld(v) for v in value)


def _settle_withheld(reqs):
    """On a scheduler: hand SGLang ``None`` for each withheld payload in
    ``reqs`` (decode mode), or fail each request that has one with
    :class:`PayloadWithheldError` (any other mode, judged when the request
    arrives: ``--enable-pd-role-switch`` may change it). Identical on every
    TP rank. ``reqs`` (a list) is updated in place and returned."""
    if not reqs:
        return reqs
    scheduler = _SCHEDULER() if _SCHEDULER is not None else None
    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", None)
    for i, req in enumerate(reqs):
        for r in (getattr(req, "batch", None) or [req]):
            mm = getattr(r, "mm_inputs", None)
            found = [(item, name) for item in (_items(mm) if mm else ())
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


# -- scheduler side ------------------------------------------------------------
def on_failure(req, err):
    """What a request whose handles could not be materialized becomes, on
    every rank: SGLang's own per-request error where the release has one
    (``MMInputsProcessError``, 0.5.23); on older releases the scheduler's
    abort path for an unknown session, whose message carries the reason."""
    io = sys.modules.get(IO_STRUCT)
    message = f"mmshm: {err}"
    log.error("%s", message)
    error_cls = getattr(io, "MMInputsProcessError", None)
    try:
        if error_cls is not None:
            req.mm_inputs = error_cls(message)
        else:
            req.mm_inputs = None
            session_cls = getattr(io, "SessionParams", None)
            if session_cls is not None and hasattr(req, "session_params"):
                req.session_params = session_cls(id=message)
    except (AttributeError, TypeError):
        return err
    return req


#: Unwrap what no broadcast unwrapped (TP size 1: nothing to agree on).
_local_unwrap = functools.partial(unwrap_each, on_failure=on_failure)


def _recv_requests(wrapped, instance, args, kwargs):
    return _settle_withheld(_local_unwrap(wrapped(*args, **kwargs)))


def _make_broadcast(original):
    from mmshm import deferred_unwrap

    deferred = deferred_unwrap(original, on_failure=on_failure)

    def wrapper(wrapped, instance, args, kwargs):
        return deferred(*args, **kwargs)

    return wrapper


def _make_timed_broadcast(original):
    """mmshm's deferred unwrap of ``broadcast_pyobj``, timed per hop."""
    return _timed_broadcast(_make_broadcast(original))


def _make_attn_broadcast(original):
    """``attn_cp_tp_broadcast_pyobj`` (0.5.23, DP attention): deferred unwrap
    on the attention-TP group; with context parallel (two hops, mmshm's
    handles travel one) the handles are materialized first, inline."""
    from mmshm import MaterializeError, MmshmError, deferred_unwrap, unwrap
    from mmshm.errors import failure_reason

    module = sys.modules[original.__module__]
    deferred = deferred_unwrap(module.broadcast_pyobj, on_failure=on_failure)

    def inline(req):
        try:
            return unwrap(req, copy=True)
        except (MmshmError, OSError) as exc:
            return on_failure(req, MaterializeError(str(exc), request=req,
                                                    reason=failure_reason(exc)))

    def wrapper(wrapped, instance, args, kwargs):
        data = args[0] if args else kwargs["data"]
        tp, cp = module.get_attn_tp_group(), module.get_attn_cp_group()
        if cp.world_size > 1:
            if data:
                data = [inline(r) for r in data]
            return wrapped(data)
        if tp.world_size == 1:
            return wrapped(*args, **kwargs)
        return deferred(data, tp.rank, tp.cpu_group, src=tp.ranks[0])

    return wrapper


# -- per-hop timing (mmshm.hooks.observe) -----------------------------------------------------
SERVER = "sglang"
#: The hops timed, in the order a request takes them.
HOPS = ("tokenizer_wrap", "tokenizer_send", "scheduler_recv", "broadcast_src",
        "broadcast_dst", "materialize", "mm_inputs")


def _pointer_bytes(mm_inputs, tensors: bool = False) -> int:
    """Bytes of the tensors that SGLang's shared-memory pointers
    (``ShmPointerMMData``: neither tensors nor mmshm's handles, with a
    ``shape`` and a ``dtype``) stand for in ``mm_inputs``'s items, or with
    ``tensors`` the bytes of the items' ``torch.Tensor`` features; reads no
    data."""
    import torch
    from mmshm import ShmTensor

    total = 0
    for item in _items(mm_inputs):
        for name in ("feature", "precomputed_embeddings"):
            v = getattr(item, name, None)
            for x in (v if isinstance(v, (list, tuple)) else (v,)):
                if x is None or isinstance(x, (torch.Tensor, ShmTensor)):  # not SGLang's
                    total += observe.tensor_bytes(x) if tensors else 0
                    continue
                shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
                if shape is not None and isinstance(dtype, torch.dtype):
                    n = 1
                    for d in shape:
                        n *= int(d)
                    total += n * dtype.itemsize
    return total


def _timed_wrap(inner):
    """``wrap_shm_features`` timed as ``tokenizer_wrap``: the bytes put into
    shared memory (SGLang's pointers, or the bytes mmshm copied into
    segments for this message)."""

    def wrapper(wrapped, instance, args, kwargs):
        with observe.hop(SERVER, "tokenizer_wrap") as t:
            box = sending.current_outbox()
            before = box.written if box is not None else 0
            out = inner(wrapped, instance, args, kwargs)
            try:
                if observe.observing():
                    t.add(_pointer_bytes(getattr(out, "mm_inputs", None)))
                elif box is not None:
                    t.add(box.written - before)
                mm = getattr(out, "mm_inputs", None)
                t.skip = not mm or not _items(mm)
            except Exception as exc:  # noqa: BLE001 - timing never breaks a request
                t.skip = True
                observe.error(SERVER, "tokenizer_wrap", exc)
            return out

    return wrapper


def _timed_send(inner):
    """``_send_one_request``: its ``send_pyobj`` is one ``tokenizer_send``."""

    def wrapper(wrapped, instance, args, kwargs):
        if inspect.iscoroutinefunction(wrapped):
            return _timed_send_async(inner, wrapped, instance, args, kwargs)
        with observe.zmq_hop(SERVER, "tokenizer_send"):
            return inner(wrapped, instance, args, kwargs)

    return wrapper


async def _timed_send_async(inner, wrapped, instance, args, kwargs):
    with observe.zmq_hop(SERVER, "tokenizer_send"):  # this task's context only
        out = inner(wrapped, instance, args, kwargs)
        return await out if inspect.isawaitable(out) else out


def _timed_recv(inner):
    """``recv_requests``: each ``recv_pyobj`` in it is one ``scheduler_recv``."""

    def wrapper(wrapped, instance, args, kwargs):
        with observe.zmq_hop(SERVER, "scheduler_recv"):
            return inner(wrapped, instance, args, kwargs)

    return wrapper


def _timed_broadcast(inner):
    """``broadcast_pyobj`` (or mmshm's deferred unwrap of it): one
    ``broadcast_src`` or ``broadcast_dst`` per non-empty broadcast."""

    def wrapper(wrapped, instance, args, kwargs):
        rank = args[1] if len(args) > 1 else kwargs.get("rank")
        src = args[3] if len(args) > 3 else kwargs.get("src", 0)
        with observe.hop(SERVER, "broadcast_src" if rank == src else "broadcast_dst") as t:
            t.count_broadcasts = True
            # a receiver waits for the source rank in the size broadcast: its
            # clock starts once the size is there
            t.clock_at_first_broadcast = rank != src
            out = inner(wrapped, instance, args, kwargs)
            t.skip = not out
            return out

    return wrapper


def _timed_unwrap(wrapped, instance, args, kwargs):
    """``unwrap_shm_features`` as ``materialize``: the bytes of SGLang's
    pointers it turns back into tensors (none under mmshm: skipped). Inside
    a timed ``_finalize_shm_features`` it only adds them to that hop."""
    obj = args[0] if args else kwargs.get("obj")
    with observe.hop(SERVER, "materialize", join=True) as t:
        try:
            reqs = getattr(obj, "batch", None) or [obj]
            t.add(sum(_pointer_bytes(getattr(r, "mm_inputs", None)) for r in reqs))
        except Exception as exc:  # noqa: BLE001
            observe.error(SERVER, "materialize", exc)
        t.skip = t.nbytes == 0
        return wrapped(*args, **kwargs)


def _timed_finalize(wrapped, instance, args, kwargs):
    """``_finalize_shm_features`` (0.5.15+) as one ``materialize``: the TP
    barrier, every ``unwrap_shm_features`` and the all-reduce of failures."""
    with observe.hop(SERVER, "materialize") as t:
        t.skip = True  # until an unwrap inside counts SGLang's pointers
        return wrapped(*args, **kwargs)


def _timed_mm_inputs(wrapped, instance, args, kwargs):
    """``Scheduler._get_multimodal_inputs`` as ``mm_inputs``, on every TP
    rank: the processor output made into ``MultimodalInputs``, SGLang's
    SHA-256 of each item's pixels included (mmshm's BLAKE3 hash is handed
    over instead); bytes: the items' tensors."""
    with observe.hop(SERVER, "mm_inputs") as t:
        out = wrapped(*args, **kwargs)
        try:
            t.add(_pointer_bytes(out, tensors=True))
            t.skip = not _items(out)
        except Exception as exc:  # noqa: BLE001 - timing never breaks a request
            t.skip = True
            observe.error(SERVER, "mm_inputs", exc)
        return out


def _untimed_hops(hops: tuple[str, ...]) -> list[tuple[tuple[str, ...], str, str]]:
    """``(hops, reason, fix)`` for what observe mode cannot time in this
    process (said at WARNING, hop by hop)."""
    out = []
    zmq_hops = tuple(h for h in hops if h in ("tokenizer_send", "scheduler_recv"))
    if zmq_hops and not bool(getattr(sys.modules.get(IO_STRUCT), "_USE_PICKLE_IPC", True)):
        out.append((zmq_hops, "SGLANG_USE_PICKLE_IPC is off: messages are msgpack-encoded, "
                    "not sent with send_pyobj, which is what mmshm times",
                    "unset SGLANG_USE_PICKLE_IPC (pickle IPC is the default)"))
    if "materialize" in hops:
        mod = sys.modules.get(RECEIVER) or sys.modules.get(SCHEDULER)
        if mod is not None and not hasattr(mod, "unwrap_shm_features"):
            out.append((("materialize",), "this SGLang release has no unwrap_shm_features in "
                        f"{mod.__name__}", "report this as an mmshm bug with the SGLang version"))
    return out


def _install_taps(role: str) -> None:
    """The pyzmq and torch.distributed byte taps; a tap that cannot be
    installed leaves its hops untimed, with a WARNING naming them."""
    for failed in observe.install_taps():
        hops = "tokenizer_send, scheduler_recv" if failed.startswith("zmq") else \
            "broadcast_src, broadcast_dst (their bytes)"
        SGLangInstrumentor().path_off(
            role, f"timing of {hops}", f"mmshm cannot tap {failed}",
            "report this as an mmshm bug with the pyzmq and torch versions")


# -- what this process says (mmshm.hooks.report) ---------------------------------------------
def _say(role: str, on: list[str], offs: list[str], hops: tuple[str, ...] = ()) -> None:
    try:
        _install_taps(role)
    except Exception as exc:  # noqa: BLE001 - never break a server's start-up
        log.warning("mmshm: per-hop timing taps failed: %s", exc)
    if observe.observing():
        untimed = _untimed_hops(hops)
        timed = [h for h in hops if h not in {x for xs, _, _ in untimed for x in xs}]
        SGLangInstrumentor().say(
            role, [f"{PATH_OBSERVE} ({', '.join(timed)})"] if timed else [],
            [(f"timing of {', '.join(xs)}", reason, fix) for xs, reason, fix in untimed])
        return
    off = _transport_off_reason()
    if off is None:
        SGLangInstrumentor().say(role, on)
    else:
        SGLangInstrumentor().say(role, [], [(p, *off) for p in offs])


def _tokenizer_ready(wrapped, instance, args, kwargs):
    """``TokenizerManager.__init__``: say what this tokenizer process does."""
    global _DECODE_WITHHOLDS
    result = wrapped(*args, **kwargs)
    dp = _dp_hops(instance)
    paths = [PATH_REQUESTS + (" (via the data-parallel controller)" if dp else ""),
             PATH_FANOUT]
    decode = decode_payload_policy(instance)
    _DECODE_WITHHOLDS = decode is not None and decode[0]
    if decode is not None:
        paths.append(decode[1])
    _say("tokenizer", paths, [PATH_REQUESTS, PATH_FANOUT],
         ("tokenizer_wrap", "tokenizer_send"))
    return result


def _tp_rank_size(scheduler) -> tuple[int | str, int]:
    """This scheduler's (TP rank, TP size).

    SGLang up to about 0.5.2x keeps them on the ``Scheduler`` (``tp_rank``,
    ``tp_size``); 0.5.23 keeps only ``tp_size`` there and the rank in
    ``sglang.srt.runtime_context.get_parallel()``. The rank is ``"?"`` where
    neither answers (the report then says so rather than claiming rank 0).
    """
    rank = getattr(scheduler, "tp_rank", None)
    size = getattr(scheduler, "tp_size", None)
    if rank is None or size is None:
        try:
            from sglang.srt.runtime_context import get_parallel

            parallel = get_parallel()
            rank = parallel.tp_rank if rank is None else rank
            size = parallel.tp_size if size is None else size
        except Exception:  # noqa: BLE001 - moved or not published: say "?" below
            pass
    return ("?" if rank is None else rank), (1 if size is None else size)


def _dp_rank(scheduler) -> int | None:
    """The data-parallel rank this scheduler serves, or None without data
    parallelism (``--dp-size 1``).

    SGLang's DP controller starts one scheduler per DP rank with
    ``run_scheduler_process(..., dp_rank, ...)`` (``SGLANG_DP_RANK`` when a
    router starts it); up to about 0.5.2x the ``Scheduler`` keeps it as
    ``dp_rank``, 0.5.23 in ``sglang.srt.runtime_context.get_parallel()``.
    None there too: a single replica, as SGLang's own process title
    (``sglang::scheduler_DP1``) also leaves it out.
    """
    rank = getattr(scheduler, "dp_rank", None)
    if rank is None:
        try:
            from sglang.srt.runtime_context import get_parallel

            rank = get_parallel().dp_rank
        except Exception:  # noqa: BLE001 - moved or not published: no DP rank said
            rank = None
    return rank if isinstance(rank, int) else None


def scheduler_role(tp_rank: int | str, dp_rank: int | None = None) -> str:
    """The role a scheduler says in its "on:" line and in
    ``mmshm_path_enabled{role}``: ``scheduler (TP rank 0)``, or under data
    parallelism ``scheduler (DP rank 1, TP rank 0)``."""
    dp = "" if dp_rank is None else f"DP rank {dp_rank}, "
    return f"scheduler ({dp}TP rank {tp_rank})"


def _nnodes(scheduler) -> int:
    """The nodes SGLang was started on (``--nnodes``; 1 where unknown)."""
    try:
        return int(getattr(getattr(scheduler, "server_args", None), "nnodes", 1) or 1)
    except (TypeError, ValueError):
        return 1


def _scheduler_ready(wrapped, instance, args, kwargs):
    """``Scheduler.__init__``: say what this scheduler (DP rank, TP rank) does."""
    global _SCHEDULER
    import weakref

    result = wrapped(*args, **kwargs)
    _SCHEDULER = weakref.ref(instance)
    rank, size = _tp_rank_size(instance)
    on = [PATH_SCHED_IN] + ([f"{PATH_BROADCAST} ({size} ranks)"] if size > 1 else [])
    nnodes = _nnodes(instance)
    if size > 1 and nnodes > 1:
        on.append(f"{PATH_MULTINODE} ({nnodes} nodes)")
    if size == 1:
        hops = ("scheduler_recv", "materialize", "mm_inputs")
    elif rank == 0:
        hops = ("scheduler_recv", "broadcast_src", "materialize", "mm_inputs")
    else:
        hops = ("broadcast_dst", "materialize", "mm_inputs")
    _say(scheduler_role(rank, _dp_rank(instance)), on, [PATH_SCHED_IN], hops)
    return result


# -- the instrumentor --------------------------------------------------------------
class SGLangInstrumentor(Instrumentor):
    """mmshm's instrumentor for SGLang (see the module docstring)."""

    name = "sglang"
    package = "sglang"
    supported = SUPPORTED

    def on_uninstrument(self) -> None:
        """Take the per-hop timing taps off (pyzmq, torch.distributed)."""
        observe.remove_taps()

    def targets(self) -> list[Target]:
        # 0.5.15 moved the scheduler's receive path into request_receiver
        receiver = source_file(RECEIVER) is not None
        sched = RECEIVER if receiver else SCHEDULER
        sched_cls = "SchedulerRequestReceiver" if receiver else "Scheduler"
        from mmshm import config

        obs = config.get().observe  # the same boundaries, timed only: SGLang's transport runs

        def w(shm):  # inside a timed hop: mmshm's glue, or SGLang's own function
            return observe.passthrough if obs else shm

        out = [
            Target(MM_UTILS, "_get_is_default_transport"),
            Target(MM_UTILS, "wrap_shm_features", _timed_wrap(w(_wrap_shm_features))),
            Target(TOKENIZER, "wrap_shm_features", _timed_wrap(w(_wrap_shm_features))),
            Target(TOKENIZER, "TokenizerManager._send_one_request",
                   _timed_send(w(_send_one_request))),
            Target(TOKENIZER, "TokenizerManager.__init__", _tokenizer_ready, optional=True),
            Target(SCHEDULER, "Scheduler.__init__", _scheduler_ready, optional=True),
            Target(sched, "broadcast_pyobj", _timed_broadcast(observe.passthrough)) if obs else
            Target(sched, "broadcast_pyobj", _make_timed_broadcast, factory=True),
            Target(sched, f"{sched_cls}.recv_requests", _timed_recv(w(_recv_requests))),
            # timed alike in both modes: SGLang's unwrap, the TP barrier and
            # all-reduce around it (0.5.15+), each rank's MultimodalInputs
            Target(sched, "unwrap_shm_features", _timed_unwrap, optional=True),
            Target(sched, f"{sched_cls}._finalize_shm_features", _timed_finalize, optional=True),
            Target(SCHEDULER, "Scheduler._get_multimodal_inputs", _timed_mm_inputs,
                   optional=True),
        ]
        if obs:
            return out
        out += [
            Target(MM_UTILS, "hash_feature", _hash_feature),
            Target(TOKENIZER, "TokenizerManager._handle_batch_request", _handle_batch_request),
            Target(DP_CONTROLLER, "DataParallelController.__init__", _controller_ready,
                   optional=True),
        ]
        if receiver:
            out.append(Target(RECEIVER, "attn_cp_tp_broadcast_pyobj", _make_attn_broadcast,
                              optional=True, factory=True))
        return out
