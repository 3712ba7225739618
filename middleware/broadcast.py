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

from .errors import MaterializeError, MmshmError, failure_reason
from .handle import ShmTensor
from .metrics import (
    BROADCAST_BYTES,
    BROADCAST_SECONDS,
    MATERIALIZE_FAILURES,
    MATERIALIZE_SECONDS,
    REQUEST_FAILURES,
)
from .walker import handles, inline_tensor_bytes, transform, unwrap

REASONS = ("ok", "malformed", "not_found", "corrupt", "wrong_node", "emfile", "released",
           "enospc", "other")
_REASON_CODE = {r: i for i, r in enumerate(REASONS)}


def _world(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group=group), dist.get_rank(group=group)


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


def _share_for_broadcast(data: list, k: int) -> tuple[list, list[tuple[ShmTensor, int]]]:
    """Add ``k`` references to every handle of every request; a request whose
    handles cannot be shared is poisoned instead. Returns the (possibly
    rebuilt) list and the handles shared, for rollback."""
    shared: list[tuple[ShmTensor, int]] = []
    out = list(data)
    for i, req in enumerate(data):
        hs = handles(req)
        done = []
        try:
            for h in hs:
                h.share(k)
                done.append(h)
        except MmshmError as exc:
            for h in done:
                from . import segment
                segment.update_refcount(h.name, -k, h._dir)
            out[i] = _poison(req, exc)
            continue
        shared.extend((h, k) for h in done)
    return out, shared


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
        shared: list[tuple[ShmTensor, int]] = []
        if is_src and world > 1 and data:
            data, shared = _share_for_broadcast(data, world - 1)
        t0 = time.perf_counter()
        try:
            out = broadcast_fn(data, rank, dist_group, src, *args, **kwargs)
        except BaseException:
            from . import segment
            for h, k in shared:
                try:
                    segment.update_refcount(h.name, -k, h._dir)
                except MmshmError:
                    pass
            raise
        BROADCAST_SECONDS.labels(role=role).observe(time.perf_counter() - t0)
        if out:
            BROADCAST_BYTES.labels(role=role).observe(_estimate_bytes(out))
        return _unwrap_all(out, dist_group, world, group_rank, copy, on_failure)

    wrapper.__mmshm_deferred__ = True  # type: ignore[attr-defined]
    return wrapper


def _estimate_bytes(data: list) -> int:
    inline = inline_tensor_bytes(data)
    if inline:
        return inline + 256 * len(data)
    try:
        return len(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001
        return 0


def _unwrap_all(out: list, group, world: int, group_rank: int, copy: bool, on_failure) -> list:
    if not out:
        return out
    results = list(out)
    n = len(out)
    # column 0: failure reason code, column 1 + r: 1 if group rank r failed
    flags = np.zeros((n, 1 + world), dtype=np.int32)
    any_handles = False
    t0 = time.perf_counter()
    for i, req in enumerate(out):
        if not handles(req):
            continue
        any_handles = True
        try:
            results[i] = unwrap(req, copy=copy)
        except (MmshmError, OSError) as exc:
            reason = failure_reason(exc)
            MATERIALIZE_FAILURES.labels(reason=reason).inc()
            flags[i, 0] = _REASON_CODE.get(reason, _REASON_CODE["other"])
            flags[i, 1 + group_rank] = 1
            results[i] = None
    if not any_handles:  # identical on every rank: the data is the same
        return results
    MATERIALIZE_SECONDS.observe(time.perf_counter() - t0)
    if world > 1:
        t = torch.from_numpy(flags)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        flags = t.numpy()
    for i in np.nonzero(flags[:, 0])[0].tolist():
        reason = REASONS[int(flags[i, 0])]
        ranks = [r for r in range(world) if flags[i, 1 + r]]
        results[i] = None  # drops this rank's views, giving back their references
        for h in handles(out[i]):
            h.release()
        err = MaterializeError(
            f"request {i}: shared-memory tensors could not be materialized on TP rank(s) "
            f"{ranks} ({reason})", request=out[i], reason=reason, ranks=ranks)
        REQUEST_FAILURES.labels(reason=reason).inc()
        results[i] = on_failure(out[i], err) if on_failure is not None else err
    return results
