"""Find and replace tensors inside arbitrary request objects.

Request objects are msgspec Structs (``array_like=True`` included),
dataclasses (frozen and slotted included), dicts, lists, tuples and named
tuples, and plain objects with ``__dict__`` or ``__slots__``. The walk never
mutates its input: every container on the path to a replaced leaf is
shallow-copied (or, with ``copy_all``, every container is), so request copies
that share ``mm_items`` never see each other's changes.
"""

from __future__ import annotations

import copy as _copy
import dataclasses
import enum
import logging
import types
from collections.abc import Callable
from operator import is_not
from typing import Any

import msgspec
import torch

from mmshm import config
from mmshm.errors import FALLBACK_REASONS, MmshmError, failure_reason
from mmshm.metrics import DEVICE_TENSORS, FALLBACKS
from mmshm.segments.shmtensor import ShmTensor, per_tensor
from mmshm.segments.table import TABLE

log = logging.getLogger("mmshm")

MAX_DEPTH = 64
_ATOMIC_TYPES = (str, bytes, bytearray, memoryview, int, float, complex, bool, type(None), range,
           type, enum.Enum, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.ModuleType)
_OPAQUE_MODULES = ("torch", "numpy", "PIL", "zmq", "threading", "socket", "logging", "asyncio",
                   "multiprocessing", "_io", "io")
_warned: set[str] = set()

Leaf = Callable[[Any], Any]


def _slot_names(cls) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        names.extend(s for s in slots if s not in ("__dict__", "__weakref__"))
    return names


# Exact types skipped without a call (the common case inside requests).
_SCALARS = frozenset((str, int, float, bool, type(None), bytes))
# Per-type dispatch, computed once per type.
_ATOMIC, _LEAF, _LIST, _TUPLE, _NAMEDTUPLE, _DICT, _STRUCT, _OBJECT = range(8)
_KINDS: dict[type, tuple[int, tuple[str, ...]]] = {}


def _kind(tp: type) -> tuple[int, tuple[str, ...]]:
    k = _KINDS.get(tp)
    if k is not None:
        return k
    names: tuple[str, ...] = ()
    if issubclass(tp, (torch.Tensor, ShmTensor)):
        kind = _LEAF
    elif issubclass(tp, _ATOMIC_TYPES):
        kind = _ATOMIC
    elif issubclass(tp, list):
        kind = _LIST
    elif issubclass(tp, tuple):
        kind = _NAMEDTUPLE if hasattr(tp, "_fields") else _TUPLE
    elif issubclass(tp, dict):
        kind = _DICT
    elif issubclass(tp, msgspec.Struct):
        kind, names = _STRUCT, tuple(tp.__struct_fields__)
    elif (tp.__module__ or "").split(".", 1)[0] in _OPAQUE_MODULES:
        kind = _ATOMIC
    elif dataclasses.is_dataclass(tp) or "__dict__" in dir(tp) or _slot_names(tp):
        kind = _OBJECT
        fields = [f.name for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else []
        names = tuple(dict.fromkeys(fields + _slot_names(tp)))
    else:
        kind = _ATOMIC
    _KINDS[tp] = (kind, names)
    return kind, names


class _Walk:
    def __init__(self, leaf: Leaf, copy_all: bool, leaves: tuple[type, ...] = ()):
        self.leaf = leaf
        self.copy_all = copy_all
        self.leaves = leaves
        self.memo: dict[int, Any] = {}

    def visit(self, obj, depth: int = 0):
        if self.leaves and isinstance(obj, self.leaves):
            return self.leaf(obj)
        kind, names = _kind(type(obj))
        if kind == _ATOMIC:
            return obj
        if kind == _LEAF:
            return self.leaf(obj)
        if depth > MAX_DEPTH:
            return obj
        if (kind <= _NAMEDTUPLE and (kind != _LIST or not self.copy_all)
                and _SCALARS.issuperset(map(type, obj))):
            # a list or tuple of scalars (token ids, a grid): one pass in C; an
            # immutable tuple of scalars is kept even by copy_all
            return obj
        key = id(obj)
        memo = self.memo
        if key in memo:
            return memo[key]
        memo[key] = obj  # a cycle re-entering here sees the original
        new = self._container(obj, kind, names, depth + 1)
        memo[key] = new
        return new

    def _items(self, values, depth):
        visit = self.visit
        scalar = _SCALARS
        out = [v if type(v) in scalar else visit(v, depth) for v in values]
        return out, any(map(is_not, out, values))

    def _container(self, obj, kind, names, depth):
        if kind == _LIST:
            items, changed = self._items(obj, depth)
            if not (changed or self.copy_all):
                return obj
            if type(obj) is list:
                return items
            new = _copy.copy(obj)
            new[:] = items
            return new
        if kind in (_TUPLE, _NAMEDTUPLE):
            items, changed = self._items(obj, depth)
            if not (changed or self.copy_all):
                return obj
            if type(obj) is tuple:
                return tuple(items)
            return type(obj)(*items) if kind == _NAMEDTUPLE else type(obj)(items)
        if kind == _DICT:
            keys = list(obj)
            items, changed = self._items([obj[k] for k in keys], depth)
            if not (changed or self.copy_all):
                return obj
            if type(obj) is dict:
                return dict(zip(keys, items))
            new = _copy.copy(obj)
            new.update(zip(keys, items))
            return new
        if kind == _STRUCT:
            values = msgspec.structs.astuple(obj)
            items, changed = self._items(values, depth)
            if not (changed or self.copy_all):
                return obj
            new = msgspec.structs.replace(
                obj, **{n: v for n, v, old in zip(names, items, values) if v is not old})
            extra = getattr(obj, "__dict__", None)  # Struct(dict=True) extra attributes
            if extra:
                new.__dict__.update(extra)
            return new
        # _OBJECT: dataclasses and plain objects (__dict__ and/or __slots__)
        d = getattr(obj, "__dict__", None)
        if d is not None:
            all_names = list(d) + [n for n in names if n not in d and hasattr(obj, n)]
        else:
            all_names = [n for n in names if hasattr(obj, n)]
        values = [getattr(obj, n) for n in all_names]
        items, changed = self._items(values, depth)
        if not (changed or self.copy_all):
            return obj
        try:
            new = _copy.copy(obj)
        except Exception as exc:
            raise TypeError(f"cannot copy {type(obj).__name__} while walking: {exc}") from exc
        for n, v, old in zip(all_names, items, values):
            if v is not old or self.copy_all:
                object.__setattr__(new, n, v)
        return new


def transform(obj, leaf: Leaf, copy_all: bool = False, leaves: tuple[type, ...] = ()):
    """Rebuild ``obj`` with every tensor / handle leaf replaced by ``leaf(x)``.

    ``leaf`` returns its argument to leave it in place. Containers on the path
    to a changed leaf are shallow copies; with ``copy_all`` every mutable
    container is copied (a tuple of scalars, which no one can change, is
    kept). The input is never mutated. Instances of ``leaves`` (an
    integration's opaque types, e.g. SGLang's CUDA-IPC proxies) go to
    ``leaf`` whole instead of being walked into.
    """
    return _Walk(leaf, copy_all, leaves).visit(obj)


def left_on_device(x, seen: set[int], min_bytes: int = 0) -> bool:
    """Whether ``x`` is a torch tensor that lives on a device
    (``x.device.type != "cpu"``: CUDA, or any other, ``meta`` included):
    mmshm leaves it to the server as it is (a handle carries CPU bytes; a copy
    to the host and back would only add a D2H and an H2D). A tensor of at
    least ``min_bytes`` bytes counts once per request in
    ``mmshm_device_tensors_total{kind="cuda"}``; ``seen`` holds the ``id()``
    of those counted in this request (updated). Raises nothing."""
    if not isinstance(x, torch.Tensor) or x.device.type == "cpu":
        return False
    if id(x) not in seen and x.numel() * x.element_size() >= min_bytes:
        seen.add(id(x))
        DEVICE_TENSORS.labels(kind="cuda").inc()
    return True


def handles(obj) -> list[ShmTensor]:
    """Every :class:`ShmTensor` reachable from ``obj`` (in walk order)."""
    found: list[ShmTensor] = []

    def leaf(x):
        if isinstance(x, ShmTensor):
            found.append(x)
        return x

    transform(obj, leaf)
    return found


_ADVICE = {
    "enospc": "the segment directory is full: give the container more shared memory "
              "(docker run --shm-size=2g or --ipc=host; a larger Kubernetes emptyDir "
              "with medium: Memory) or set MMSHM_DIR",
    "budget": "mmshm's budget guard kept the reserve free: raise --shm-size / the emptyDir, "
              "or lower MMSHM_MIN_FREE_BYTES",
    "emfile": "the process is out of file descriptors: raise the limit (ulimit -n)",
    "other": "see the error above",
}


def record_fallback(exc: BaseException) -> str:
    """Count one inline fallback and log a warning once per reason."""
    reason = failure_reason(exc, FALLBACK_REASONS)
    FALLBACKS.labels(reason=reason).inc()
    if reason not in _warned and not TABLE.dir_problem(config.get().dir):
        # (a directory that cannot hold segments was warned about once already)
        _warned.add(reason)
        log.warning("mmshm: a tensor travels inline instead of through shared memory "
                    "(%s: %s). Fix: %s", reason, exc, _ADVICE.get(reason, ""))
    return reason


def to_shm(t: torch.Tensor, hash: bytes | None = None,
           directory: str | None = None, hash_now: bool | None = None) -> ShmTensor | None:
    """:meth:`ShmTensor.from_tensor` (``hash_now`` as there), or None when the tensor must travel
    inline: unsupported (GPU, sparse, quantized: silently) or no segment could
    be made (ENOSPC, budget, EMFILE, other: counted in
    ``mmshm_inline_fallbacks_total{reason}`` and warned about once per reason).
    The one place wrap and the instrumentors turn a tensor into a handle."""
    try:
        return ShmTensor.from_tensor(t, hash=hash, directory=directory, hash_now=hash_now)
    except TypeError:
        return None
    except (OSError, MmshmError) as exc:
        record_fallback(exc)
        return None


_group_said: set[str] = set()


def to_shm_group(tensors, hashes=None, directory: str | None = None,
                 hash_now=None) -> list[ShmTensor | None]:
    """One request's tensors in **one** segment (:meth:`ShmTensor.from_tensors`):
    one handle per tensor, in order, or None for a tensor that travels inline.

    A group that cannot be made in one segment (ENOSPC, the budget guard,
    EMFILE, any other OS failure: the pool or /dev/shm has no room for all
    of it at once) falls back **per tensor**, each through :func:`to_shm`
    as a single tensor goes today: its own segment where it fits, else
    inline, counted in ``mmshm_inline_fallbacks_total{reason}`` and warned
    about once per reason. That the group was split is said once at INFO
    (nothing is lost: the tensors still go through shared memory where they
    fit). ``hashes`` and ``hash_now``: one per tensor, or None, as for
    :meth:`ShmTensor.from_tensors`. Unsupported tensors (GPU, sparse,
    quantized) get None silently. Raises ValueError when ``hashes`` or
    ``hash_now`` does not give one value per tensor (never fewer handles than
    tensors)."""
    tensors, hashes, nows = per_tensor(tensors, hashes, hash_now)
    n = len(tensors)
    if n == 1:
        return [to_shm(tensors[0], hash=hashes[0], directory=directory, hash_now=nows[0])]
    try:
        return list(ShmTensor.from_tensors(tensors, hashes, directory, hash_now=nows))
    except (TypeError, ValueError):
        pass  # one tensor cannot travel: the others still can, each alone
    except (OSError, MmshmError) as exc:
        if "split" not in _group_said:
            _group_said.add("split")
            log.info("mmshm: %d tensors of one request did not fit in one segment (%s): "
                     "each gets its own segment, or travels inline (said once)", n, exc)
    return [to_shm(t, hash=h, directory=directory, hash_now=now)
            for t, h, now in zip(tensors, hashes, nows)]


def wrap(obj, min_bytes: int | None = None, directory: str | None = None):
    """Return ``obj`` with every CPU tensor of at least ``min_bytes`` bytes
    replaced by a :class:`ShmTensor`, all of them in **one** segment
    (:func:`to_shm_group`: one pooled segment per request, so a TP rank maps
    and registers one mapping per request however many photos it holds).

    Args:
        obj: any request object (see module docstring).
        min_bytes: size threshold in bytes (default ``MMSHM_MIN_BYTES``).
        directory: segment directory (default ``MMSHM_DIR``).
    Returns:
        A new object; ``obj`` is not modified. Tensors whose shared segment
        cannot be made (ENOSPC, budget, EMFILE, other OSError) get one
        segment each; a tensor whose own segment cannot be made either stays
        inline and the fallback is counted in
        ``mmshm_inline_fallbacks_total{reason}``.
        Unsupported tensors (sparse, quantized) stay inline silently; a
        tensor on a device (GPU) stays too, counted (:func:`left_on_device`).
    """
    cfg = config.get()
    if cfg.disable:
        return obj
    threshold = cfg.min_bytes if min_bytes is None else min_bytes
    on_device: set[int] = set()
    found: dict[int, torch.Tensor] = {}

    def collect(x):
        if not isinstance(x, torch.Tensor) or left_on_device(x, on_device, threshold):
            return x
        nbytes = x.numel() * x.element_size()
        if nbytes >= threshold and x.layout == torch.strided and not x.is_quantized:
            found.setdefault(id(x), x)
        return x

    transform(obj, collect)
    if not found:
        return obj
    made: dict[int, ShmTensor | None] = dict(
        zip(found, to_shm_group(list(found.values()), directory=directory)))
    used: set[int] = set()

    def leaf(x):
        h = made.get(id(x)) if isinstance(x, torch.Tensor) else None
        if h is None:
            return x
        if id(x) not in used:
            used.add(id(x))
            return h
        try:  # the same tensor twice: one copy, two handles
            return h.clone()
        except MmshmError:
            return x

    try:
        return transform(obj, leaf)
    except BaseException:
        for h in made.values():
            if h is not None:
                h.release()
        raise


def unwrap(obj, copy: bool = False):
    """Return ``obj`` with every :class:`ShmTensor` materialized.

    With ``copy=False`` the tensors are zero-copy views that hold the
    handles' references until freed. On failure every handle in ``obj`` is
    released (so nothing leaks) and the typed error is raised:
    :class:`~mmshm.errors.HandleError`, :class:`~mmshm.errors.SegmentNotFoundError`,
    :class:`~mmshm.errors.SegmentCorruptError` or
    :class:`~mmshm.errors.DescriptorLimitError`.
    """
    try:
        return transform(obj, lambda x: x.materialize(copy=copy) if isinstance(x, ShmTensor) else x)
    except BaseException:
        for h in handles(obj):
            h.release()
        raise


def release(obj) -> int:
    """Release every handle reachable from ``obj``; returns how many."""
    hs = handles(obj)
    for h in hs:
        h.release()
    return len(hs)
