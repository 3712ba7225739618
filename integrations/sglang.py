"""SGLang instrumentor: glue between SGLang's multimodal transport and mmshm.

Supported releases: 0.5.9 through 0.5.23. Everything is patched with wrapt
post-import hooks, when SGLang's modules are imported (or at once if they
already are), by the names under which the consumers call them:

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

SGLang's own ``ShmPointerMMData`` is then never created, so its early
unlink, barriers and n+1 segments play no part. mmshm is used only where
SGLang itself would use shared memory (transport mode not ``default``, so not
for multi-node TP) and with pickle IPC (``SGLANG_USE_PICKLE_IPC``, the
default); otherwise SGLang's functions run unchanged.
"""

from __future__ import annotations

import ast
import contextvars
import copy
import importlib.util
import inspect
import logging
import sys
import threading
import weakref
from importlib import metadata

import wrapt

from . import UnsupportedVersionError, check_version, installed_version

log = logging.getLogger("mmshm")

SUPPORTED = ">=0.5.9,<=0.5.23"

MM_UTILS = "sglang.srt.managers.mm_utils"
IO_STRUCT = "sglang.srt.managers.io_struct"
TOKENIZER = "sglang.srt.managers.tokenizer_manager"
SCHEDULER = "sglang.srt.managers.scheduler"
RECEIVER = "sglang.srt.managers.scheduler_components.request_receiver"


#: Transport paths as :mod:`mmshm.report` names them (``mmshm_path_enabled``).
PATH_REQUESTS = "multimodal tensors to the scheduler through shared memory"
PATH_FANOUT = "parallel sampling (n>1) writes each tensor once"
PATH_SCHED_IN = "requests materialized zero-copy on every TP rank"
PATH_BROADCAST = "TP broadcast carries metadata only"
_VERSION = "?"  # the instrumented release, for what this process says


def _path(module: str) -> str:
    return module.replace(".", "/") + ".py"


# -- content hashes ----------------------------------------------------------
class _TensorMemo:
    """Per-tensor values keyed by identity, dropped when the tensor dies or is
    modified in place (torch's version counter). Never compares tensors."""

    def __init__(self):
        self._d: dict[int, tuple] = {}
        self._lock = threading.Lock()

    def get(self, t):
        e = self._d.get(id(t))
        if e is None or e[0]() is not t or e[1] != t._version:
            return None
        return e[2]

    def put(self, t, value) -> None:
        key = id(t)

        def gone(_ref, key=key, d=self._d):
            e = d.get(key)
            if e is not None and e[0] is _ref:
                d.pop(key, None)

        with self._lock:
            self._d[key] = (weakref.ref(t, gone), t._version, value)

    def drop(self, t) -> None:
        with self._lock:
            e = self._d.get(id(t))
            if e is not None and e[0]() is t:
                del self._d[id(t)]


_DIGESTS = _TensorMemo()  # tensor -> BLAKE3-128 digest
_SEGMENTS = _TensorMemo()  # tensor -> HandleMeta of a segment holding its bytes


def hash_int(digest: bytes) -> int:
    """SGLang's hashes are unsigned 64-bit ints: the first 8 bytes of the
    carried BLAKE3-128 digest, big-endian."""
    return int.from_bytes(digest[:8], "big", signed=False)


def _flatten(xs):
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from _flatten(x)
        else:
            yield x


def digest_of(f) -> bytes | None:
    """BLAKE3-128 digest of a feature: a handle (the carried hash), a CPU
    tensor (computed once per tensor), or a list of those, possibly mixed
    (digest of the elements' digests). None for anything else."""
    import blake3
    import torch
    from mmshm import ShmTensor, content_hash

    if isinstance(f, ShmTensor):
        return f.hash
    if isinstance(f, torch.Tensor):
        if f.device.type != "cpu":
            return None
        d = _DIGESTS.get(f)
        if d is None:
            d = content_hash(f)
            _DIGESTS.put(f, d)
        return d
    if isinstance(f, (list, tuple)) and f:
        flat = list(_flatten(f))
        if not flat or not all(isinstance(x, (ShmTensor, torch.Tensor)) for x in flat):
            return None
        parts = [digest_of(x) for x in flat]
        if any(p is None for p in parts):
            return None
        return blake3.blake3(b"".join(parts)).digest(16)
    return None


# -- tokenizer side -------------------------------------------------------------
class _Send:
    """The handles made for one ``_send_one_request`` call."""

    __slots__ = ("extra", "handles")

    def __init__(self, extra: int):
        self.extra = extra  # references per handle for intermediate hops
        self.handles: list = []


_SENDING: contextvars.ContextVar[_Send | None] = contextvars.ContextVar(
    "mmshm_sglang_send", default=None)


class _FanOut:
    """One parallel-sampling ``_handle_batch_request``: the tokenizer's own
    reference on every segment made in it, by tensor (the tensor is kept too,
    so its id cannot be reused while the entry lives)."""

    __slots__ = ("copies", "held")

    def __init__(self):
        self.held: dict[int, tuple] = {}  # id(tensor) -> (tensor, ShmTensor)
        self.copies = 0

    def hold(self, t, h) -> None:
        """Keep one reference on ``h``'s segment for ``t`` (once per tensor)."""
        from mmshm import MmshmError

        if id(t) in self.held:
            return
        try:
            self.held[id(t)] = (t, h.clone())
        except (MmshmError, OSError):  # gone already: the samples write it again
            pass

    def close(self) -> None:
        held, self.held = self.held, {}
        for _t, h in held.values():
            h.release()


_FANOUT: contextvars.ContextVar[_FanOut | None] = contextvars.ContextVar(
    "mmshm_sglang_fanout", default=None)


def _mm_module():
    return sys.modules.get(MM_UTILS)


def _transport_enabled() -> bool:
    """SGLang's own decision (shared memory only off the ``default`` transport
    mode and with a tokenizer), and pickle IPC."""
    mm = _mm_module()
    if mm is None or mm._get_is_default_transport():
        return False
    for accessor in ("get_global_server_args", "get_serving"):
        fn = getattr(mm, accessor, None)
        if fn is not None:
            if getattr(fn(), "skip_tokenizer_init", False):
                return False
            break
    io = sys.modules.get(IO_STRUCT)
    return bool(getattr(io, "_USE_PICKLE_IPC", True))


def _share_segment(t):
    """A new handle on the live segment that already holds ``t``'s bytes (one
    more reference), or None if there is none or it was freed meanwhile."""
    from mmshm import MmshmError, ShmTensor, segment

    meta = _SEGMENTS.get(t)
    if meta is None:
        return None
    try:
        # the generation check refuses a segment the pool has since reused
        segment.update_refcount(meta.name, 1, None, meta.gen)
    except (MmshmError, OSError):
        _SEGMENTS.drop(t)
        return None
    return ShmTensor(meta, owns=True)


def _wrap_features(mm_inputs, send: _Send):
    """``mm_inputs`` with CPU tensors of at least ``MMSHM_MIN_BYTES`` replaced
    by handles (a new object; the input is not modified)."""
    import torch
    from mmshm import config
    from mmshm.walker import to_shm, transform

    cfg = config.get()
    if cfg.disable:
        return mm_inputs
    made: dict[int, object] = {}

    def leaf(x):
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
            return x
        if x.numel() * x.element_size() < cfg.min_bytes or x.layout != torch.strided:
            return x
        first = made.get(id(x))
        h = first.clone() if first is not None else _share_segment(x)
        if h is None:
            h = to_shm(x, hash=_DIGESTS.get(x))
            if h is None:
                return x
            # the hash is left to _set_item_hashes, for items SGLang's
            # processor did not hash (MMSHM_HASH=lazy: computed only if needed)
            _SEGMENTS.put(x, h.meta)
        made.setdefault(id(x), h)
        scope = _FANOUT.get()
        if scope is not None:
            scope.hold(x, h)
        if send.extra:
            h.share(send.extra)
        send.handles.append(h)
        return h

    return transform(mm_inputs, leaf)


def _items(mm_inputs):
    items = mm_inputs.get("mm_items") if isinstance(mm_inputs, dict) else getattr(
        mm_inputs, "mm_items", None)
    return items or []


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
        feature = getattr(item, "feature", None)
        if feature is None:
            feature = getattr(item, "precomputed_embeddings", None)
        try:
            d = digest_of(feature) if feature is not None else None
        except (MmshmError, OSError) as exc:
            # the segment vanished under us (MMSHM_HASH=lazy reads it here):
            # leave the item unhashed; the scheduler's unwrap reports the loss
            log.warning("mmshm: could not hash a multimodal item: %s", exc)
            continue
        if d is not None:
            item.hash = hash_int(d)


def _wrap_shm_features(wrapped, instance, args, kwargs):
    send = _SENDING.get()
    if send is None or not _transport_enabled():
        return wrapped(*args, **kwargs)
    obj = args[0] if args else kwargs["obj"]
    mm_inputs = getattr(obj, "mm_inputs", None)
    if not mm_inputs or not _items(mm_inputs):
        return obj
    n_handles = len(send.handles)
    new_mm = _wrap_features(mm_inputs, send)
    _set_item_hashes(new_mm)
    scope = _FANOUT.get()
    if scope is not None and len(send.handles) > n_handles:
        from mmshm.metrics import FANOUT_COPIES

        scope.copies += 1
        FANOUT_COPIES.inc()
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
    if inspect.iscoroutinefunction(wrapped):  # async since 0.5.2x
        return _send_one_request_async(wrapped, instance, args, kwargs)
    send = _Send(_dp_hops(instance))
    token = _SENDING.set(send)
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        _abandon(send)
        raise
    finally:
        _SENDING.reset(token)
    _sent(send)
    return result


async def _send_one_request_async(wrapped, instance, args, kwargs):
    send = _Send(_dp_hops(instance))
    token = _SENDING.set(send)  # this task's context only
    try:
        result = await wrapped(*args, **kwargs)
    except BaseException:
        _abandon(send)
        raise
    finally:
        _SENDING.reset(token)
    _sent(send)
    return result


def _handle_batch_request(wrapped, instance, args, kwargs):
    """Parallel sampling: one :class:`_FanOut` scope for the whole call (an
    async generator). The scope is visible to the wrapped generator whenever
    it runs (set and reset around each step, in the caller's context) and its
    references are released when the generator ends, fails or is closed."""
    obj = args[0] if args else kwargs.get("obj")
    if getattr(obj, "parallel_sample_num", 1) in (None, 0, 1):
        return wrapped(*args, **kwargs)
    return _fan_out_scope(wrapped(*args, **kwargs))


async def _fan_out_scope(agen):
    scope = _FanOut()
    try:
        while True:
            token = _FANOUT.set(scope)
            try:
                item = await agen.__anext__()
            except StopAsyncIteration:
                return
            finally:
                _FANOUT.reset(token)
            yield item
    finally:
        try:
            await agen.aclose()
        finally:
            scope.close()


def _sent(send: _Send) -> None:
    """The message left: its handles' references travelled with it. (``send``
    kept the handle objects alive past the request copy that held them, so no
    finalizer released them meanwhile.)"""
    for h in send.handles:
        h._disown()


def _abandon(send: _Send) -> None:
    """Dispatch failed: give back every reference made for this send."""
    from mmshm import MmshmError, segment

    for h in send.handles:
        if send.extra:
            try:
                segment.update_refcount(h.name, -send.extra, None, h.meta.gen)
            except (MmshmError, OSError):
                pass
        h.release()


def _hash_feature(wrapped, instance, args, kwargs):
    f = args[0] if args else kwargs.get("f")
    d = digest_of(f)
    return wrapped(*args, **kwargs) if d is None else hash_int(d)


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


def _local_unwrap(reqs):
    """Unwrap what no broadcast unwrapped (TP size 1: nothing to agree on)."""
    from mmshm import MaterializeError, MmshmError, handles, unwrap
    from mmshm.errors import failure_reason

    if not reqs:
        return reqs
    out = None
    for i, req in enumerate(reqs):
        if not handles(req):
            continue
        try:
            new = unwrap(req)
        except (MmshmError, OSError) as exc:
            new = on_failure(req, MaterializeError(
                f"shared-memory tensors could not be materialized: {exc}", request=req,
                reason=failure_reason(exc)))
        if out is None:
            out = list(reqs)
        out[i] = new
    if out is None:
        return reqs
    if isinstance(reqs, list):
        reqs[:] = out
        return reqs
    return out


def _recv_requests(wrapped, instance, args, kwargs):
    return _local_unwrap(wrapped(*args, **kwargs))


def _make_broadcast(original):
    from mmshm import deferred_unwrap

    deferred = deferred_unwrap(original, on_failure=on_failure)

    def wrapper(wrapped, instance, args, kwargs):
        return deferred(*args, **kwargs)

    return wrapper


def _make_attn_broadcast(original):
    module = sys.modules[original.__module__]
    from mmshm import MaterializeError, MmshmError, deferred_unwrap, unwrap
    from mmshm.errors import failure_reason

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
        if cp.world_size > 1:  # two hops: mmshm's handles travel one; send inline
            if data:
                data = [inline(r) for r in data]
            return wrapped(data)
        if tp.world_size == 1:
            return wrapped(*args, **kwargs)
        return deferred(data, tp.rank, tp.cpu_group, src=tp.ranks[0])

    return wrapper


# -- what this process says (mmshm.report) ---------------------------------------------
def _transport_off_reason() -> tuple[str, str] | None:
    """``(reason, fix)`` when SGLang itself would not use shared memory here,
    so neither does mmshm; None when it would."""
    mm = _mm_module()
    if mm is None:
        return ("sglang's mm_utils is not imported in this process",
                "report this as an mmshm bug with the SGLang version")
    try:
        if mm._get_is_default_transport():
            return ("SGLang's tensor transport is 'default' here (a multi-node deployment, or "
                    "--dist-init-addr on 0.5.9-0.5.12): tensors are pickled into the message",
                    "nothing to do across nodes; on one node, drop --dist-init-addr")
    except Exception as exc:  # noqa: BLE001 - reporting never breaks a server
        return (f"SGLang's transport mode could not be read ({exc})",
                "report this as an mmshm bug with the SGLang version")
    for accessor in ("get_global_server_args", "get_serving"):
        fn = getattr(mm, accessor, None)
        if fn is not None:
            try:
                if getattr(fn(), "skip_tokenizer_init", False):
                    return ("--skip-tokenizer-init: the tokenizer process sends no tensors",
                            "none needed")
            except Exception:  # noqa: BLE001 - server args not set yet: judged later
                pass
            break
    io = sys.modules.get(IO_STRUCT)
    if not bool(getattr(io, "_USE_PICKLE_IPC", True)):
        return ("SGLANG_USE_PICKLE_IPC is off: requests are not pickled, so handles "
                "cannot ride in them", "unset SGLANG_USE_PICKLE_IPC (pickle IPC is the default)")
    return None


def _say(role: str, on: list[str], offs: list[str]) -> None:
    from mmshm import report

    off = _transport_off_reason()
    if off is None:
        report.paths("sglang", _VERSION, role, on)
    else:
        report.paths("sglang", _VERSION, role, [], [(p, *off) for p in offs])


def _tokenizer_ready(wrapped, instance, args, kwargs):
    """``TokenizerManager.__init__``: say what this tokenizer process does."""
    result = wrapped(*args, **kwargs)
    dp = _dp_hops(instance)
    paths = [PATH_REQUESTS + (" (via the data-parallel controller)" if dp else ""),
             PATH_FANOUT]
    _say("tokenizer", paths, [PATH_REQUESTS, PATH_FANOUT])
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


def _scheduler_ready(wrapped, instance, args, kwargs):
    """``Scheduler.__init__``: say what this scheduler (TP rank) does."""
    result = wrapped(*args, **kwargs)
    rank, size = _tp_rank_size(instance)
    on = [PATH_SCHED_IN] + ([f"{PATH_BROADCAST} ({size} ranks)"] if size > 1 else [])
    _say(f"scheduler (TP rank {rank})", on, [PATH_SCHED_IN])
    return result


# -- the instrumentor --------------------------------------------------------------
class _Patch:
    __slots__ = ("attr", "factory", "module", "optional")

    def __init__(self, module: str, attr: str, factory, optional: bool = False):
        self.module, self.attr, self.factory, self.optional = module, attr, factory, optional


def _static(func):
    return lambda original: func


class SGLangInstrumentor:
    """mmshm's instrumentor for SGLang (see the module docstring)."""

    name = "sglang"
    package = "sglang"
    import_name = "sglang"
    supported = SUPPORTED

    def __init__(self):
        self._lock = threading.RLock()
        self._active = False
        self._hooked: set[str] = set()
        self._applied: list[tuple[object, str, object]] = []  # (owner, attr, original)
        self._plan: list[_Patch] = []
        self.version = None
        self.refused: str | None = None

    # -- public ------------------------------------------------------------------
    def is_installed(self) -> bool:
        return installed_version(self.package) is not None and \
            importlib.util.find_spec(self.import_name) is not None

    @property
    def instrumented(self) -> bool:
        return self._active

    def preflight(self) -> list[str]:
        """Why :meth:`instrument` would refuse, without importing SGLang or
        patching anything (empty: it would instrument)."""
        with self._lock:
            try:
                self.version = check_version(self.package, self.supported)
                self._make_plan()
            except UnsupportedVersionError as exc:
                return [str(exc)]
        return []

    def instrument(self) -> None:
        """Register the post-import hooks (patching what is already imported).
        Idempotent. Raises :class:`UnsupportedVersionError` (patching nothing)
        on a version outside :attr:`supported` or a symbol that moved."""
        with self._lock:
            if self._active:
                return
            global _VERSION
            self.version = check_version(self.package, self.supported)
            _VERSION = str(self.version)
            self._plan = self._make_plan()
            self.refused = None
            self._active = True
            for module in dict.fromkeys(p.module for p in self._plan):
                if module in self._hooked:
                    if module in sys.modules:
                        self._on_import(sys.modules[module])
                    continue
                self._hooked.add(module)
                wrapt.register_post_import_hook(self._on_import, module)
                if not self._active:  # a hook that fired at once refused
                    raise UnsupportedVersionError(self.refused or "refused")

    def uninstrument(self) -> None:
        """Restore every original (the hooks stay registered but do nothing)."""
        with self._lock:
            self._active = False
            self._restore()

    # -- plan and checks ---------------------------------------------------------
    def _source(self, module: str) -> str | None:
        try:
            path = metadata.distribution(self.package).locate_file(_path(module))
            return open(path, encoding="utf-8").read()
        except (OSError, metadata.PackageNotFoundError):
            return None

    def _make_plan(self) -> list[_Patch]:
        receiver = self._source(RECEIVER) is not None
        sched = RECEIVER if receiver else SCHEDULER
        sched_cls = "SchedulerRequestReceiver" if receiver else "Scheduler"
        plan = [
            _Patch(MM_UTILS, "hash_feature", _static(_hash_feature)),
            _Patch(MM_UTILS, "_get_is_default_transport", None),
            _Patch(MM_UTILS, "wrap_shm_features", _static(_wrap_shm_features)),
            _Patch(TOKENIZER, "wrap_shm_features", _static(_wrap_shm_features)),
            _Patch(TOKENIZER, "TokenizerManager._send_one_request", _static(_send_one_request)),
            _Patch(TOKENIZER, "TokenizerManager._handle_batch_request",
                   _static(_handle_batch_request)),
            _Patch(TOKENIZER, "TokenizerManager.__init__", _static(_tokenizer_ready),
                   optional=True),
            _Patch(SCHEDULER, "Scheduler.__init__", _static(_scheduler_ready), optional=True),
            _Patch(sched, "broadcast_pyobj", _make_broadcast),
            _Patch(sched, f"{sched_cls}.recv_requests", _static(_recv_requests)),
        ]
        if receiver:
            plan.append(_Patch(RECEIVER, "attn_cp_tp_broadcast_pyobj", _make_attn_broadcast,
                               optional=True))
        missing = []
        for p in plan:
            src = self._source(p.module)
            if src is None:
                missing.append(f"module {p.module}")
                continue
            if not _defines(src, p.attr):
                if not p.optional:
                    missing.append(f"{p.module}.{p.attr}")
                else:
                    plan = [q for q in plan if q is not p]
        if missing:
            raise UnsupportedVersionError(
                f"sglang {self.version}: mmshm cannot find {', '.join(missing)} (moved or "
                f"renamed); nothing was patched (set MMSHM_INSTRUMENT to skip sglang)")
        return plan

    # -- patching --------------------------------------------------------------------
    def _on_import(self, module) -> None:
        with self._lock:
            if not self._active:
                return
            try:
                for p in self._plan:
                    if p.module == module.__name__ and p.factory is not None:
                        self._apply(module, p)
            except UnsupportedVersionError as exc:
                self.refused = str(exc)
                log.error("mmshm: %s", exc)
                self._active = False
                self._restore()

    def _apply(self, module, p: _Patch) -> None:
        owner = module
        *parents, attr = p.attr.split(".")
        for part in parents:
            owner = getattr(owner, part, None)
        current = getattr(owner, attr, None) if owner is not None else None
        if current is None:
            if p.optional:
                return
            raise UnsupportedVersionError(
                f"sglang {self.version}: {module.__name__}.{p.attr} is missing at import; "
                f"nothing was patched")
        if getattr(current, "_self_mmshm", False):
            return  # already ours
        original = owner.__dict__[attr] if isinstance(owner, type) else current
        wrapper = wrapt.FunctionWrapper(original, p.factory(current))
        wrapper._self_mmshm = True
        setattr(owner, attr, wrapper)
        self._applied.append((owner, attr, original))

    def _restore(self) -> None:
        while self._applied:
            owner, attr, original = self._applied.pop()
            setattr(owner, attr, original)


def _defines(source: str, attr: str) -> bool:
    """Whether ``source`` defines (or imports) ``attr`` at top level; for
    ``Class.method``, whether the class defines that method."""
    tree = ast.parse(source)
    if "." in attr:
        cls_name, meth = attr.split(".", 1)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == cls_name:
                return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and n.name == meth for n in node.body)
        return False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == attr:
                return True
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name) == attr for a in node.names):
                return True
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == attr for t in node.targets):
            return True
    return False
