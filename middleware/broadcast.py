"""Scheduler boundary, one node: deferred unwrap around a ``broadcast_pyobj``-like function.

The source TP rank hands out ``world - 1`` references per handle *before* the
broadcast, so only metadata crosses the TP group and no rank can drop a count to
zero while another rank has not opened the segment yet, whatever the timing or
process group. Every rank materializes after the broadcast; per-request
failures are combined by the failure agreement (:mod:`mmshm.agreement`:
element-wise MAX, point to point to the source rank and back) so that all
ranks turn the same requests into errors. No barrier is used.

Invariants:

- references are handed out before the broadcast and never after: a rank
  drops a count only for a reference the source rank added for it, and what
  was added is taken back if ``broadcast_fn`` raises;
- the batch's handles are indexed in walk order, identical on every rank
  (pickle keeps object identity within the batch), so per-handle flags line
  up across ranks;
- the wrapper raises only what ``broadcast_fn`` raises; a per-request failure
  becomes ``on_failure(request, error)`` on every rank;
- a reference a rank cannot give back (its segment is invisible from there)
  is given back by the rank that handed it out.

**Several nodes.** When the TP group spans nodes (:func:`mmshm.node.layout`,
learnt once per group) the payloads cross each node boundary once, through
each other node's leader: :mod:`mmshm.multinode`. A group on one node runs
exactly the path of this module, with no message beyond the agreement's.
"""
from __future__ import annotations

import functools
import logging
import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import node
from .agreement import (  # noqa: F401 - re-exported: the wire codes and tags
    _OTHER,
    _REASON_CODE,
    AGREE_TAG,
    REASONS,
    _agree_max,
)
from .codec import HandleMeta
from .errors import (
    HandleStateError,
    MaterializeError,
    MmshmError,
    PeerLostError,
    WrongNodeError,
    failure_reason,
)
from .handle import ShmTensor
from .metrics import (
    BROADCAST_BYTES,
    FALLBACKS,
    BROADCAST_SECONDS,
    MATERIALIZE_FAILURES,
    MATERIALIZE_SECONDS,
    REFERENCES_HANDED,
    REQUEST_FAILURES,
)
from .multinode import P2P_TAG, HandleIndex, _NodePlan  # noqa: F401 - P2P_TAG re-exported
from .receiving import unwrap_each
from .segment import SegmentRef
from .walker import handles, transform

log = logging.getLogger("mmshm")

# Estimates for mmshm_broadcast_bytes, so that nothing is pickled twice: a
# handle's pickled size and a request's own pickled overhead (bytes).
_HANDLE_WIRE_BYTES = 110
_REQUEST_WIRE_BYTES = 256


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


def _take_back(added: dict[SegmentRef, int]) -> None:
    """Undo ``{segment: references added}`` (best effort: a segment that is
    gone has nothing to give back to)."""
    for key, refs in added.items():
        key.release(refs)


def _share_for_broadcast(data: list, k: int
                         ) -> tuple[list, dict[SegmentRef, int], list[ShmTensor]]:
    """Hand out ``k`` references per segment of the batch for the other
    ranks, sending one handle per segment.

    The ``n`` copies of a fan-out reach the source rank each with its own
    handle objects over the same segments. In one walk, every later handle
    object equal to an earlier one (same metadata, same directory) is
    replaced by the earlier (the requests on the path are shallow-copied;
    ``data`` is not changed), so the batch pickles one handle per segment: the
    TP ranks unpickle and index ``n`` times fewer handles, and a multi-node
    broadcast sends each payload once. A replaced object's own reference goes
    to the other ranks; each segment gets ``k`` per handle sent less the
    replaced ones, in one locked update per segment.

    If a handle owns no reference or an update fails, what was updated is
    taken back and :func:`_share_each` takes over (no collapsing; per-request
    poisoning). Returns the list to broadcast, {segment: net references
    added} and the replaced handle objects, for rollback (the caller makes
    them owners again if the broadcast fails)."""
    canon: dict[tuple, ShmTensor] = {}
    dups: list[ShmTensor] = []
    seen: set[int] = set()
    sent: dict[SegmentRef, int] = {}   # handle objects sent, per segment
    spent: dict[SegmentRef, int] = {}  # replaced handle objects, per segment
    usable = True

    def leaf(x):
        nonlocal usable
        if not isinstance(x, ShmTensor):
            return x
        if not x.owns_reference:  # released, handed over, or broken
            usable = False
            return x
        c = canon.setdefault(x.identity, x)
        if id(x) not in seen:
            seen.add(id(x))
            key = x.ref
            if c is x:
                sent[key] = sent.get(key, 0) + 1
            else:
                spent[key] = spent.get(key, 0) + 1
                dups.append(x)
        return c

    out = [transform(req, leaf) for req in data]
    if not usable:
        return (*_share_each(data, k), [])
    added: dict[SegmentRef, int] = {}
    for key, n_sent in sent.items():
        delta = k * n_sent - spent.get(key, 0)
        if not delta:
            continue
        try:
            key.add(delta)
        except MmshmError:
            _take_back(added)
            return (*_share_each(data, k), [])
        added[key] = delta
    for h in dups:
        h.disown()  # its reference now stands for another rank's
    # one reference per handle sent and reader, as vLLM's broadcast counts them
    REFERENCES_HANDED.labels(path="broadcast").inc(k * sum(sent.values()))
    return out, added, dups


def _share_each(data: list, k: int) -> tuple[list, dict[SegmentRef, int]]:
    """Add ``k`` references per handle object of the batch, in one locked
    update per segment for the whole batch (fan-out copies share segments). A
    handle object that appears in several requests (``copy.copy``'d requests
    share ``mm_items``) is pickled once for the whole batch, so it gets ``k``
    once. A request whose handles cannot be shared is poisoned instead (and so
    is every request sharing a handle object with it), and what was added for
    it is taken back. Returns the (possibly rebuilt) list and {segment:
    references added}, for rollback."""
    out = list(data)
    owner: dict[int, int] = {}                # handle object -> first request holding it
    per_req: dict[int, dict[SegmentRef, int]] = {}
    hs_of: dict[int, list[ShmTensor]] = {}
    poison: dict[int, Exception] = {}
    for i, req in enumerate(data):
        hs = handles(req)
        if not hs:
            continue
        hs_of[i] = hs
        counts: dict[SegmentRef, int] = {}
        for h in hs:
            if owner.setdefault(id(h), i) != i:
                continue
            if not h.owns_reference:
                poison[i] = HandleStateError(f"handle {h.name} no longer owns a reference")
                break
            key = h.ref
            counts[key] = counts.get(key, 0) + k
        per_req[i] = counts
    batch: dict[SegmentRef, int] = {}
    for i, counts in per_req.items():
        if i not in poison:
            for key, refs in counts.items():
                batch[key] = batch.get(key, 0) + refs
    failed: dict[SegmentRef, Exception] = {}
    for key, refs in batch.items():
        try:
            key.add(refs)
        except MmshmError as exc:
            failed[key] = exc
    for i, counts in per_req.items():
        bad = next((failed[key] for key in counts if key in failed), None)
        if bad is not None and i not in poison:
            poison[i] = _foreign_error(data[i]) or bad
    # a request sharing a handle object with a poisoned one is poisoned too
    changed = bool(poison)
    while changed:
        changed = False
        bad_ids = {id(h) for i in poison for h in hs_of.get(i, ())}
        for i, hs in hs_of.items():
            if i not in poison and any(id(h) in bad_ids for h in hs):
                poison[i] = poison[owner[next(id(h) for h in hs if id(h) in bad_ids)]]
                changed = True
    added = {key: refs for key, refs in batch.items() if key not in failed}
    for i, exc in poison.items():
        for key, refs in per_req.get(i, {}).items():
            if key in added:  # give back what was added for the poisoned request
                added[key] -= refs
                key.release(refs)
    for i, exc in poison.items():
        out[i] = _poison(data[i], exc)
    added = {key: refs for key, refs in added.items() if refs}
    REFERENCES_HANDED.labels(path="broadcast").inc(sum(added.values()))
    return out, added


def _foreign_error(req) -> WrongNodeError | None:
    """A WrongNodeError if ``req`` holds a handle of another node (only
    looked at once sharing failed: the happy path pays nothing for it)."""
    for h in handles(req):
        if h.error is None and not h.is_local():
            return WrongNodeError(f"handle {h.name} names a segment on node {h.node}, "
                                  f"not on the source rank's node {node.node_id(h.directory)}")
    return None


def deferred_unwrap(broadcast_fn: Callable[..., list], *, copy: bool = False,
                    on_failure: Callable[[Any, MaterializeError], Any] | None = None
                    ) -> Callable[..., list]:
    """Wrap a function with the contract of SGLang's
    ``broadcast_pyobj(data: list, rank, dist_group, src) -> list``.

    On the source rank (``rank == src``) every handle in ``data`` gets
    ``world - 1`` more references, then ``broadcast_fn`` runs (carrying only
    handle metadata). After it returns, every rank unwraps each request
    (zero-copy views unless ``copy=True``). If a request's handles fail to open
    on any rank, the failure flags are combined (MAX over ``dist_group``) and
    every rank replaces that request with ``on_failure(request, error)`` (by
    default the :class:`~mmshm.errors.MaterializeError` itself). The wrapper
    never raises for a per-request failure; it re-raises what
    ``broadcast_fn`` itself raises (after giving back the references it
    added), and raises :class:`~mmshm.errors.PeerLostError` when a rank of
    the group dies after the broadcast (the group cannot go on).

    When ``dist_group`` spans several nodes, payloads cross each node
    boundary once (see the module docstring); within a node only metadata
    travels. The first call on a group learns its layout with one collective
    (``all_gather_object``); a group on one node then runs exactly the
    single-node path.

    Records ``mmshm_broadcast_seconds{role}`` and ``mmshm_broadcast_bytes{role}``
    (``role`` is ``src`` or ``dst``), and ``mmshm_internode_bytes_total``.
    """

    @functools.wraps(broadcast_fn)
    def wrapper(data, rank, dist_group=None, src=0, *args, **kwargs):
        world, group_rank = _world(dist_group)
        is_src = rank == src
        role = "src" if is_src else "dst"
        src_group_rank = _group_rank_of(src, dist_group, world)
        plan: _NodePlan | None = None
        receivers = world - 1
        if world > 1:
            # both a dict lookup after the first call; the handshake first, since
            # the layout is a collective that a peer without mmshm never makes
            if (not node.handshake(dist_group).ok
                    or (lay := node.layout(dist_group)).id_collision):
                return _inline_broadcast(broadcast_fn, data, rank, dist_group, src, on_failure,
                                         role, args, kwargs)
            if not lay.single and src_group_rank is not None:
                plan = _NodePlan(lay, dist_group, group_rank, src_group_rank)
                receivers = len(lay.ranks_on_node_of(src_group_rank)) - 1
        added: dict[SegmentRef, int] = {}
        collapsed: list[ShmTensor] = []
        t0 = time.perf_counter()
        if is_src and world > 1 and data:
            data, added, collapsed = _share_for_broadcast(data, receivers)
        try:
            out = broadcast_fn(data, rank, dist_group, src, *args, **kwargs)
        except BaseException:
            _take_back(added)
            for h in collapsed:  # their references are back in the count
                h.reclaim()
            raise
        BROADCAST_SECONDS.labels(role=role).observe(time.perf_counter() - t0)
        try:
            return _unwrap_all(out, dist_group, world, group_rank, copy, on_failure, role,
                               src_group_rank, plan, src)
        except RuntimeError as exc:
            if isinstance(exc, MmshmError):
                raise
            # only mmshm's own messages (the multi-node payloads, the
            # agreement) talk to the other ranks in there
            raise PeerLostError(
                f"mmshm: TP rank {group_rank} lost a peer after a broadcast ({exc}); the "
                f"group cannot go on, so the server's own failure handling takes over",
                ranks=[r for r in range(world) if r != group_rank]) from exc

    wrapper.__mmshm_deferred__ = True  # type: ignore[attr-defined]
    return wrapper


def _inline_broadcast(broadcast_fn, data, rank, dist_group, src, on_failure, role, args,
                      kwargs) -> list:
    """The broadcast of a group whose ranks do not all run this mmshm
    (:func:`mmshm.node.handshake`), or whose nodes cannot be told apart
    (:attr:`mmshm.node.Layout.id_collision`): the source rank counts each of
    its handles in ``mmshm_inline_fallbacks_total{reason="group"}``,
    materializes every handle
    into a private tensor first (a request whose handles cannot be read
    becomes ``on_failure(request, error)`` before it is sent, so every rank
    gets the same), then ``broadcast_fn`` carries the tensors as the server's
    own transport would; the other ranks receive tensors and unwrap nothing."""
    if rank == src and data:
        n = sum(len(handles(req)) for req in data)
        if n:
            FALLBACKS.labels(reason="group").inc(n)
        data = unwrap_each(list(data), on_failure or (lambda req, err: err))
    t0 = time.perf_counter()
    out = broadcast_fn(data, rank, dist_group, src, *args, **kwargs)
    BROADCAST_SECONDS.labels(role=role).observe(time.perf_counter() - t0)
    return out


class _Unwrapper(HandleIndex):
    """Materializes the batch's handles, one walk per request.

    Handle objects are indexed batch-wide in order of first appearance; the
    order is the same on every rank (pickle keeps object identity within the
    batch), so per-handle flags can be combined across ranks. A handle object
    met more than once (shared by ``copy.copy``'d requests, or sent once for
    all the copies of a fan-out) is materialized once; every further
    occurrence gets its own tensor object over the same memory.

    Zero-copy (``copy=False``): the handles of one segment (the ``n`` copies
    of a fan-out, each sent with its own handle) share one copy-on-write
    mapping per rank; each gets its own tensor object over it, and their
    extra references go back in one locked update per segment
    (:meth:`give_back_duplicates`). One mapping per segment means one
    page-table walk, and the rank's RSS grows by the payload once, not ``n``
    times. The copies' tensors alias one another within the rank, as the
    copies' ``mm_items`` share one object in the producer after SGLang's
    ``copy.copy`` fan-out; another process's bytes are never affected."""

    def __init__(self, copy: bool):
        self.copy = copy
        self._positions: dict[int, int] = {}  # id(handle) -> index
        self.order: list[ShmTensor] = []
        self.state: list = []  # per handle: tensor, exception, or None
        self.current: list[int] = []
        self.wire_bytes = 0
        # zero-copy: the first view of each segment, by (metadata, directory)
        self.mapped: dict[tuple[HandleMeta, str | None], torch.Tensor] = {}
        self.duplicates: dict[SegmentRef, int] = {}  # references to give back per segment

    def index(self, h: ShmTensor) -> int:
        idx = self._positions.get(id(h))
        if idx is None:
            idx = self._positions[id(h)] = len(self.order)
            self.order.append(h)
            self.state.append(None)
            self.wire_bytes += _HANDLE_WIRE_BYTES
        return idx

    def __call__(self, x):
        if not isinstance(x, ShmTensor):
            self.wire_bytes += x.numel() * x.element_size()
            return x
        idx = self.index(x)
        self.current.append(idx)
        st = self.state[idx]
        if isinstance(st, BaseException):
            raise st
        if st is not None:
            # a handle object met again: the source rank sends one per segment
            # for all the copies of a fan-out, and each copy gets its own tensor
            return st.view(st.shape)
        h = self.order[idx]  # x, or (multi-node) the copy on this node
        first = None if self.copy else self.mapped.get(h.identity)
        if first is not None and h.owns_reference:
            h.disown()  # its reference goes back in give_back_duplicates
            key = h.ref
            self.duplicates[key] = self.duplicates.get(key, 0) + 1
            st = self.state[idx] = first.view(first.shape)
            return st
        try:
            st = self.state[idx] = h.materialize(copy=self.copy)
        except Exception as exc:
            self.state[idx] = exc
            raise
        if not self.copy:
            self.mapped[h.identity] = st
        return st

    def give_back_duplicates(self) -> None:
        """Release the references of the handles that reuse another handle's
        mapping (the mapping holds one reference for all of them)."""
        for key, refs in self.duplicates.items():
            try:
                key.add(-refs)
            except (MmshmError, OSError) as exc:
                # cannot happen while the mapping holds a reference, unless a
                # third party removed the file: the reaper reclaims it then
                log.warning("mmshm: giving back %d reference(s) of %s failed: %s",
                            refs, key.name, exc)
        self.duplicates = {}
        self.mapped = {}

    def request_handles(self, req) -> list[int]:
        """Indices of every handle in ``req`` (after a walk that stopped early)."""
        return list(dict.fromkeys(self.index(h) for h in handles(req)))


def _give_back(unw: _Unwrapper, idxs: list[int], stranded: np.ndarray, col: int) -> None:
    """Release the references a failed request's handles still own on this
    rank; mark in ``stranded`` those this rank cannot reach (segment invisible
    from here), for the source rank to give back."""
    for idx in idxs:
        h = unw.order[idx]
        if not h.owns_reference:
            continue  # materialized (the view holds it) or already given back
        h.disown()
        try:
            h.ref.add(-1)
        except (MmshmError, OSError):
            stranded[idx, col] = 1




def _unwrap_all(out: list, group, world: int, group_rank: int, copy: bool, on_failure,
                role: str, src_group_rank: int | None, plan: _NodePlan | None = None,
                src: int | None = None) -> list:
    if not out:
        return out
    results = list(out)
    n = len(out)
    reasons = np.zeros(n, dtype=np.int32)
    failed = np.zeros((n, world), dtype=np.int32)
    req_idxs: list[list[int]] = []
    t0 = time.perf_counter()
    unw = _Unwrapper(copy)
    if plan is not None:
        plan.prepare(unw, out)  # on other nodes: swap in this node's copies
    for i, req in enumerate(out):
        unw.current = []
        try:
            results[i] = transform(req, unw)
            req_idxs.append(list(dict.fromkeys(unw.current)))
        except Exception as exc:  # noqa: BLE001 - any failure must reach the agreement
            # (a rank that raised here would leave the others waiting in it)
            req_idxs.append(unw.request_handles(req))
            reason = failure_reason(exc)
            MATERIALIZE_FAILURES.labels(reason=reason).inc()
            reasons[i] = _REASON_CODE.get(reason, _OTHER)
            failed[i, group_rank] = 1
            results[i] = None
    unw.give_back_duplicates()
    if plan is not None:
        plan.send_payloads(unw)  # the source rank, to the other nodes' leaders
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
        flat = _agree_max(flat, group, world, group_rank, src_group_rank, src).numpy()
        reasons = flat[:n]
        failed = flat[n:n + n * world].reshape(n, world)
        stranded = flat[n + n * world:].reshape(nh, world)
    for i in np.nonzero(reasons)[0].tolist():
        results[i] = None  # drops this rank's views, giving back their references
        if i not in local:
            _give_back(unw, req_idxs[i], stranded, group_rank)
    unw.state = []
    if plan is not None:
        plan.give_back_stranded(unw, stranded)
    elif src_group_rank is not None and group_rank == src_group_rank:
        # references handed out to ranks that cannot reach the segment come back here
        for idx in np.nonzero(stranded.sum(axis=1))[0].tolist():
            h = unw.order[idx]
            try:
                h.ref.add(-int(stranded[idx].sum()))
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




