"""Scheduler boundary: deferred unwrap around a ``broadcast_pyobj``-like function.

The source TP rank hands out ``world - 1`` references per handle *before* the
broadcast, so only metadata crosses the TP group and no rank can drop a count to
zero while another rank has not opened the segment yet, whatever the timing or
process group. Every rank materializes after the broadcast; per-request
failures are all-reduced so that all ranks turn the same requests into errors.
No barrier is used.
"""

from __future__ import annotations

import functools
import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import segment
from .errors import HandleStateError, MaterializeError, MmshmError, failure_reason
from .handle import ShmTensor
from .metrics import (
    BROADCAST_BYTES,
    BROADCAST_SECONDS,
    MATERIALIZE_FAILURES,
    MATERIALIZE_SECONDS,
    REQUEST_FAILURES,
)
from .walker import handles, transform

# Estimates for mmshm_broadcast_bytes, so that nothing is pickled twice: a
# handle's pickled size and a request's own pickled overhead (bytes).
_HANDLE_WIRE_BYTES = 110
_REQUEST_WIRE_BYTES = 256

REASONS = ("ok", "malformed", "not_found", "corrupt", "wrong_node", "emfile", "released",
           "enospc", "other")
_REASON_CODE = {r: i for i, r in enumerate(REASONS)}


def _world(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group=group), dist.get_rank(group=group)


def _group_rank_of(global_rank: int, group, world: int) -> int | None:
    """The group rank of global rank ``global_rank`` (None outside the group)."""
    if world == 1:
        return 0
    try:
        return dist.get_group_rank(group, global_rank) if group is not None else global_rank
    except (ValueError, RuntimeError):
        return None


def broadcast_pyobj(data: list, rank: int, dist_group=None, src: int = 0) -> list:
    """Broadcast a picklable list from global rank ``src`` to ``dist_group``.

    Mirrors SGLang's ``sglang.srt.utils.broadcast_pyobj`` (CPU/gloo path):
    pickle, broadcast the size as an int64 tensor, then the bytes as a uint8
    tensor, unpickle. Returns ``data`` itself on the source rank, and when
    torch.distributed is not initialized (a single process).
    """
    if _world(dist_group)[0] == 1:
        return data
    if rank == src:
        if not data:
            dist.broadcast(torch.tensor([0], dtype=torch.long), src=src, group=dist_group)
            return data
        payload = np.frombuffer(pickle.dumps(data), dtype=np.uint8)
        dist.broadcast(torch.tensor([payload.size], dtype=torch.long), src=src, group=dist_group)
        dist.broadcast(torch.from_numpy(payload.copy()), src=src, group=dist_group)
        return data
    size = torch.tensor([0], dtype=torch.long)
    dist.broadcast(size, src=src, group=dist_group)
    if size.item() == 0:
        return []
    buf = torch.empty(size.item(), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=dist_group)
    return pickle.loads(buf.numpy().tobytes())


def _poison(req, exc: BaseException):
    """Replace every handle of ``req`` by a broken handle carrying ``exc``
    (and release the originals): every rank then fails this request."""
    def leaf(x):
        if isinstance(x, ShmTensor):
            x.release()
            return ShmTensor(None, error=exc if isinstance(exc, Exception) else None)
        return x
    return transform(req, leaf)


SegKey = tuple  # (name, directory, generation)


def _key(h: ShmTensor) -> SegKey:
    return (h.name, h._dir, h.meta.gen)


def _update(key: SegKey, delta: int) -> int:
    return segment.update_refcount(key[0], delta, key[1], key[2])


def _share_for_broadcast(data: list, k: int) -> tuple[list, dict[SegKey, int]]:
    """Add ``k`` references per handle object of the batch, in one locked
    update per segment (fan-out copies share segments). A handle object that
    appears in several requests (``copy.copy``'d requests share ``mm_items``)
    is pickled once for the whole batch, so it gets ``k`` once. A request whose
    handles cannot be shared is poisoned instead. Returns the (possibly
    rebuilt) list and {segment: references added}, for rollback."""
    added: dict[SegKey, int] = {}
    seen: set[int] = set()
    out = list(data)
    for i, req in enumerate(data):
        per_seg: dict[SegKey, int] = {}
        poisoned: MmshmError | None = None
        for h in handles(req):
            if id(h) in seen:
                continue
            if not h.owns_reference:
                poisoned = HandleStateError(f"handle {h.name} no longer owns a reference")
                break
            key = _key(h)
            per_seg[key] = per_seg.get(key, 0) + k
        done: list[SegKey] = []
        if poisoned is None:
            try:
                for key, refs in per_seg.items():
                    _update(key, refs)
                    done.append(key)
            except MmshmError as exc:
                for key in done:
                    _update(key, -per_seg[key])
                done = []
                poisoned = exc
        if poisoned is not None:
            out[i] = _poison(req, poisoned)
            continue
        seen.update(id(h) for h in handles(req))
        for key in done:
            added[key] = added.get(key, 0) + per_seg[key]
    return out, added


def deferred_unwrap(broadcast_fn: Callable[..., list], *, copy: bool = False,
                    on_failure: Callable[[Any, MaterializeError], Any] | None = None
                    ) -> Callable[..., list]:
    """Wrap a function with the contract of SGLang's
    ``broadcast_pyobj(data: list, rank, dist_group, src) -> list``.

    On the source rank (``rank == src``) every handle in ``data`` gets
    ``world - 1`` more references, then ``broadcast_fn`` runs (carrying only
    handle metadata). After it returns, every rank unwraps each request
    (zero-copy views unless ``copy=True``). If a request's handles fail to open
    on any rank, the failure flags are all-reduced (MAX over ``dist_group``) and
    every rank replaces that request with ``on_failure(request, error)`` (by
    default the :class:`~mmshm.errors.MaterializeError` itself). The wrapper
    never raises for a per-request failure; it re-raises only what
    ``broadcast_fn`` itself raises (after giving back the references it
    added).

    Records ``mmshm_broadcast_seconds{role}`` and ``mmshm_broadcast_bytes{role}``
    (``role`` is ``src`` or ``dst``).
    """

    @functools.wraps(broadcast_fn)
    def wrapper(data, rank, dist_group=None, src=0, *args, **kwargs):
        world, group_rank = _world(dist_group)
        is_src = rank == src
        role = "src" if is_src else "dst"
        added: dict[SegKey, int] = {}
        t0 = time.perf_counter()
        if is_src and world > 1 and data:
            data, added = _share_for_broadcast(data, world - 1)
        try:
            out = broadcast_fn(data, rank, dist_group, src, *args, **kwargs)
        except BaseException:
            for key, refs in added.items():
                try:
                    _update(key, -refs)
                except MmshmError:
                    pass
            raise
        BROADCAST_SECONDS.labels(role=role).observe(time.perf_counter() - t0)
        return _unwrap_all(out, dist_group, world, group_rank, copy, on_failure, role,
                           _group_rank_of(src, dist_group, world))

    wrapper.__mmshm_deferred__ = True  # type: ignore[attr-defined]
    return wrapper


class _Unwrapper:
    """Materializes the batch's handles, one walk per request.

    Handle objects are indexed batch-wide in order of first appearance; the
    order is the same on every rank (pickle keeps object identity within the
    batch), so per-handle flags can be all-reduced. A handle object shared by
    several requests is materialized once and its tensor reused."""

    def __init__(self, copy: bool):
        self.copy = copy
        self.index: dict[int, int] = {}
        self.order: list[ShmTensor] = []
        self.state: list = []  # per handle: tensor, exception, or None
        self.current: list[int] = []
        self.wire_bytes = 0

    def _idx(self, h: ShmTensor) -> int:
        idx = self.index.get(id(h))
        if idx is None:
            idx = self.index[id(h)] = len(self.order)
            self.order.append(h)
            self.state.append(None)
            self.wire_bytes += _HANDLE_WIRE_BYTES
        return idx

    def __call__(self, x):
        if not isinstance(x, ShmTensor):
            self.wire_bytes += x.numel() * x.element_size()
            return x
        idx = self._idx(x)
        self.current.append(idx)
        st = self.state[idx]
        if isinstance(st, BaseException):
            raise st
        if st is None:
            try:
                st = self.state[idx] = x.materialize(copy=self.copy)
            except Exception as exc:
                self.state[idx] = exc
                raise
        return st

    def request_handles(self, req) -> list[int]:
        """Indices of every handle in ``req`` (after a walk that stopped early)."""
        return list(dict.fromkeys(self._idx(h) for h in handles(req)))


def _give_back(unw: _Unwrapper, idxs: list[int], stranded: np.ndarray, col: int) -> None:
    """Release the references a failed request's handles still own on this
    rank; mark in ``stranded`` those this rank cannot reach (segment invisible
    from here), for the source rank to give back."""
    for idx in idxs:
        h = unw.order[idx]
        if not h.owns_reference:
            continue  # materialized (the view holds it) or already given back
        h._disown()
        try:
            _update(_key(h), -1)
        except (MmshmError, OSError):
            stranded[idx, col] = 1


def _unwrap_all(out: list, group, world: int, group_rank: int, copy: bool, on_failure,
                role: str, src_group_rank: int | None) -> list:
    if not out:
        return out
    results = list(out)
    n = len(out)
    reasons = np.zeros(n, dtype=np.int32)
    failed = np.zeros((n, world), dtype=np.int32)
    req_idxs: list[list[int]] = []
    t0 = time.perf_counter()
    unw = _Unwrapper(copy)
    for i, req in enumerate(out):
        unw.current = []
        try:
            results[i] = transform(req, unw)
            req_idxs.append(list(dict.fromkeys(unw.current)))
        except Exception as exc:  # noqa: BLE001 - any failure must reach the all-reduce
            # (a rank that raised here would leave the others waiting in it)
            req_idxs.append(unw.request_handles(req))
            reason = failure_reason(exc)
            MATERIALIZE_FAILURES.labels(reason=reason).inc()
            reasons[i] = _REASON_CODE.get(reason, _REASON_CODE["other"])
            failed[i, group_rank] = 1
            results[i] = None
    BROADCAST_BYTES.labels(role=role).observe(unw.wire_bytes + _REQUEST_WIRE_BYTES * n)
    nh = len(unw.order)
    if not nh:  # identical on every rank: the data is the same
        return results
    MATERIALIZE_SECONDS.observe(time.perf_counter() - t0)
    stranded = np.zeros((nh, world), dtype=np.int32)
    local = np.nonzero(reasons)[0].tolist()
    for i in local:
        _give_back(unw, req_idxs[i], stranded, group_rank)
    if world > 1:
        flat = torch.from_numpy(np.concatenate([reasons, failed.ravel(), stranded.ravel()]))
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        flat = flat.numpy()
        reasons = flat[:n]
        failed = flat[n:n + n * world].reshape(n, world)
        stranded = flat[n + n * world:].reshape(nh, world)
    for i in np.nonzero(reasons)[0].tolist():
        results[i] = None  # drops this rank's views, giving back their references
        if i not in local:
            _give_back(unw, req_idxs[i], stranded, group_rank)
    unw.state = []
    if src_group_rank is not None and group_rank == src_group_rank:
        # references handed out to ranks that cannot reach the segment come back here
        for idx in np.nonzero(stranded.sum(axis=1))[0].tolist():
            h = unw.order[idx]
            try:
                _update(_key(h), -int(stranded[idx].sum()))
            except (MmshmError, OSError):
                pass
    for i in np.nonzero(reasons)[0].tolist():
        reason = REASONS[int(reasons[i])]
        ranks = [r for r in range(world) if failed[i, r]]
        err = MaterializeError(
            f"request {i}: shared-memory tensors could not be materialized on TP rank(s) "
            f"{ranks} ({reason})", request=out[i], reason=reason, ranks=ranks)
        REQUEST_FAILURES.labels(reason=reason).inc()
        results[i] = on_failure(out[i], err) if on_failure is not None else err
    return results
