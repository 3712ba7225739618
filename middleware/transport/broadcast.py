"""Scheduler boundary, one node: deferred unwrap around a ``broadcast_pyobj``-like function.

The source TP rank hands out ``world - 1`` references per handle *before* the
broadcast, so only metadata crosses the TP group and no rank can drop a count to
zero while another rank has not opened the segment yet, whatever the timing or
process group. Every rank materializes after the broadcast; per-request
failures are combined by the failure agreement (:mod:`mmshm.transport.agreement`:
element-wise MAX, point to point to the source rank and back; on one node,
once the group's first broadcast with handles has set it up, through shared
memory with no message at all, :mod:`mmshm.transport.shmagree`) so that all ranks turn the
same requests into errors. No barrier is used.

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
  is given back by the rank that handed it out;
- on one node, a receiving rank gives back no reference of the batch before
  the agreement is over, and none it has not opened when the broadcast ends
  in an error: so the references handed to a rank that was lost before the
  end of its walk (its agreement vector never came) are still counted for
  it, and the source gives them back at once where it can prove that rank
  never opened them (:func:`_give_back_lost`); else the reaper's in-flight
  grace (``MMSHM_IN_FLIGHT_GRACE_S``) does;
- the handshake (:func:`mmshm.transport.handshake.handshake`) never raises: a store that
  cannot be reached is as no store; a peer that announced nothing and then
  breaks the broadcast makes a :class:`~mmshm.errors.PeerLostError`.

**Several nodes.** When the TP group spans nodes (:func:`mmshm.transport.topology.layout`,
learnt once per group) the payloads cross each node boundary once, through
each other node's leader: :mod:`mmshm.transport.multinode`. A group on one node runs
exactly the path of this module, with no message beyond the agreement's
(none once its shared memory is set up).
"""
from __future__ import annotations

import functools
import logging
import os
import pickle
import time
from collections import OrderedDict
from struct import error as struct_error
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mmshm.errors import (
    HandleStateError,
    MaterializeError,
    MmshmError,
    PeerLostError,
    WrongNodeError,
    failure_reason,
)
from mmshm.metrics import (
    BROADCAST_BYTES,
    FALLBACKS,
    BROADCAST_SECONDS,
    MATERIALIZE_FAILURES,
    MATERIALIZE_SECONDS,
    REFERENCES_HANDED,
    REQUEST_FAILURES,
)
from mmshm.segments import node, segfile
from mmshm.segments.codec import HandleMeta
from mmshm.segments.segment import SegmentRef
from mmshm.segments.shmtensor import ShmTensor
from mmshm.segments.table import TABLE
from mmshm.transport import handshake, shmagree, topology
from mmshm.transport.agreement import (  # noqa: F401 - re-exported: the wire codes and tags
    _OTHER,
    _REASON_CODE,
    AGREE_TAG,
    LATE,
    LOST,
    REASONS,
    _agree_max,
    _agree_post,
)
from mmshm.transport.multinode import (  # noqa: F401 - P2P_TAG re-exported
    P2P_TAG,
    HandleIndex,
    _NodePlan,
)
from mmshm.transport.receiving import unwrap_each
from mmshm.transport.wrapping import handles, transform

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
    the group is lost (the group cannot go on): before the group's first
    broadcast (within the group's timeout: the handshake waits at most half
    of it, :func:`mmshm.transport.handshake.handshake_wait`), or after a broadcast (on the
    source rank and every surviving rank, naming the lost ranks; the
    references handed to a rank lost before its walk ended are given back
    at once where provably unused, see :func:`_give_back_lost`).

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
        lay = None
        if world > 1:
            # both a dict lookup after the first call; the handshake first, since
            # the layout is a collective that a peer without mmshm never makes
            verdict = handshake.handshake(dist_group)
            try:
                if verdict.ok:
                    lay = topology.layout(dist_group)
            except RuntimeError as exc:
                if isinstance(exc, MmshmError):
                    raise
                raise PeerLostError(
                    f"mmshm: TP rank {group_rank} lost a peer before the group's first "
                    f"broadcast ({exc}); the group cannot go on, so the server's own failure "
                    f"handling takes over",
                    ranks=[r for r in range(world) if r != group_rank]) from exc
            if lay is None or lay.id_collision:
                return _inline_broadcast(broadcast_fn, data, rank, dist_group, src, on_failure,
                                         role, args, kwargs, verdict.missing)
            if not lay.single and src_group_rank is not None:
                plan = _NodePlan(lay, dist_group, group_rank, src_group_rank)
                receivers = len(lay.ranks_on_node_of(src_group_rank)) - 1
        # one node: the failure agreement through shared memory (mmshm.transport.shmagree)
        shm = None
        if world > 1 and plan is None and src_group_rank is not None:
            shm = shmagree.for_group(dist_group, world, group_rank, lay)
        added: dict[SegmentRef, int] = {}
        collapsed: list[ShmTensor] = []
        t0 = time.perf_counter()
        if is_src and world > 1 and data:
            data, added, collapsed = _share_for_broadcast(data, receivers)
            # a batch of fan-out copies can add no net reference (k copies collapsed
            # onto one handle for k receivers) and still carry handles: prepare then too
            if shm is not None and (added or collapsed):
                shm.prepare(src_group_rank)  # its first: the receivers open it after
        try:
            out = broadcast_fn(data, rank, dist_group, src, *args, **kwargs)
        except BaseException:
            _take_back(added)
            for h in collapsed:  # their references are back in the count
                h.reclaim()
            if shm is not None:
                shm.discard()
            raise
        BROADCAST_SECONDS.labels(role=role).observe(time.perf_counter() - t0)
        try:
            return _unwrap_all(out, dist_group, world, group_rank, copy, on_failure, role,
                               src_group_rank, plan, src, added, lay, shm)
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
                      kwargs, missing=()) -> list:
    """The broadcast of a group whose ranks do not all run this mmshm
    (:func:`mmshm.transport.handshake.handshake`), or whose nodes cannot be told apart
    (:attr:`mmshm.transport.topology.Layout.id_collision`): the source rank counts each of
    its handles in ``mmshm_inline_fallbacks_total{reason="group"}``,
    materializes every handle
    into a private tensor first (a request whose handles cannot be read
    becomes ``on_failure(request, error)`` before it is sent, so every rank
    gets the same), then ``broadcast_fn`` carries the tensors as the server's
    own transport would; the other ranks receive tensors and unwrap nothing.

    ``missing``: the group ranks the handshake found silent (no mmshm, or
    gone); if ``broadcast_fn`` then fails on a broken link, the error is a
    :class:`~mmshm.errors.PeerLostError` naming them (the ``RuntimeError``
    of ``torch.distributed`` as its ``__cause__``)."""
    if rank == src and data:
        n = sum(len(handles(req)) for req in data)
        if n:
            FALLBACKS.labels(reason="group").inc(n)
        data = unwrap_each(list(data), on_failure or (lambda req, err: err))
    t0 = time.perf_counter()
    try:
        out = broadcast_fn(data, rank, dist_group, src, *args, **kwargs)
    except RuntimeError as exc:
        if not missing or isinstance(exc, MmshmError):
            raise
        raise PeerLostError(
            f"mmshm: the TP group's first broadcast failed ({exc}) after rank(s) "
            f"{list(missing)} announced nothing within the handshake's wait: they are gone; "
            f"the group cannot go on, so the server's own failure handling takes over",
            ranks=list(missing)) from exc
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

    def __init__(self, copy: bool, hold: bool = False):
        self.copy = copy
        self._positions: dict[int, int] = {}  # id(handle) -> index
        self.order: list[ShmTensor] = []
        self.state: list = []  # per handle: tensor, exception, or None
        # per handle: 1 if this walk opened its segment in this process (an
        # attach the segment's hand-out record counts), else 0
        self.opened: list[int] = []
        # hold: a receiver keeps every reference of the batch until the
        # agreement is over (copy=True views are dropped after it), so that a
        # rank lost before then has given back none (see _give_back_lost)
        self.held: list[torch.Tensor] | None = [] if hold else None
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
            self.opened.append(0)
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
        fresh = h.error is None and TABLE.get(h.name) is None
        try:
            if self.copy and self.held is not None:
                view = h.materialize()
                self.held.append(view)  # its reference goes back after the agreement
                st = self.state[idx] = view.clone()
            else:
                st = self.state[idx] = h.materialize(copy=self.copy)
        except Exception as exc:
            self.state[idx] = exc
            raise
        if fresh:
            self.opened[idx] = 1
        if not self.copy:
            self.mapped[h.identity] = st
        return st

    def abandon(self) -> None:
        """A receiver's broadcast ends without the agreement: keep no claim
        on the references not yet opened (the source gives back those of a
        rank it found lost, :func:`_give_back_lost`) and give back none of
        the duplicates'."""
        for h in self.order:
            if h.owns_reference:
                h.disown()
        self.duplicates = {}
        self.mapped = {}

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


def _probe(unw: _Unwrapper, idxs: list[int], stranded: np.ndarray, col: int) -> None:
    """A receiver's :func:`_give_back` before the agreement, which gives back
    nothing yet: marks in ``stranded`` the references this rank cannot reach
    (and gives up its claim on them: the source gives them back); the others
    are given back after the agreement."""
    for idx in idxs:
        h = unw.order[idx]
        if not h.owns_reference:
            continue
        try:
            h.ref.add(0)
        except (MmshmError, OSError):
            h.disown()
            stranded[idx, col] = 1


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




def _agree_size(n: int, nh: int, world: int) -> int:
    """Length of the agreement's vector for ``n`` requests and ``nh`` handles:
    reasons, failed, stranded, opened, lost flags."""
    return n + n * world + 2 * nh * world + world


def _unwrap_all(out: list, group, world: int, group_rank: int, copy: bool, on_failure,
                role: str, src_group_rank: int | None, plan: _NodePlan | None = None,
                src: int | None = None, added: dict[SegmentRef, int] | None = None,
                lay: topology.Layout | None = None,
                shm: shmagree.ShmAgreement | None = None) -> list:
    if not out:
        if shm is not None:
            shm.discard()
        return out
    results = list(out)
    n = len(out)
    reasons = np.zeros(n, dtype=np.int32)
    failed = np.zeros((n, world), dtype=np.int32)
    req_idxs: list[list[int]] = []
    t0 = time.perf_counter()
    is_src = src_group_rank is not None and group_rank == src_group_rank
    # one node: a receiver gives back nothing of the batch before the agreement
    defer = plan is None and world > 1 and src_group_rank is not None and not is_src
    unw = _Unwrapper(copy, hold=defer)
    if plan is not None:
        plan.prepare(unw, out)  # indexes; on other nodes: swaps in this node's copies
    else:
        for req in out:  # walk order, the same on every rank
            for h in handles(req):
                unw.index(h)
    nh = len(unw.order)
    posted = None
    try:
        if world > 1 and nh:
            # one node: through shared memory once set up (mmshm.transport.shmagree),
            # else over gloo with the receives posted before the walk, so
            # that the peers' messages find them waiting
            posted = _agree_post(_agree_size(n, nh, world), group, world, group_rank,
                                 src_group_rank, src, shm)
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
        if not defer:
            unw.give_back_duplicates()
        if plan is not None:
            plan.send_payloads(unw)  # the source rank, to the other nodes' leaders
        BROADCAST_BYTES.labels(role=role).observe(unw.wire_bytes + _REQUEST_WIRE_BYTES * n)
        if not nh:  # identical on every rank: the data is the same
            if shm is not None:
                shm.discard()
            return results
        MATERIALIZE_SECONDS.observe(time.perf_counter() - t0)
        stranded = np.zeros((nh, world), dtype=np.int32)
        opened = np.zeros((nh, world), dtype=np.int32)
        opened[:, group_rank] = unw.opened
        local = np.nonzero(reasons)[0].tolist()
        for i in local:
            (_probe if defer else _give_back)(unw, req_idxs[i], stranded, group_rank)
        lost: list[int] = []
        late: list[int] = []
        if world > 1:  # the lost flags last (mmshm.transport.agreement)
            flat = torch.from_numpy(np.concatenate([reasons, failed.ravel(), stranded.ravel(),
                                                    opened.ravel(),
                                                    np.zeros(world, dtype=np.int32)]))
            flat = _agree_max(flat, group, world, group_rank, src_group_rank, src,
                              posted).numpy()
            reasons = flat[:n]
            failed = flat[n:n + n * world].reshape(n, world)
            at = n + n * world
            stranded = flat[at:at + nh * world].reshape(nh, world)
            opened = flat[at + nh * world:at + 2 * nh * world].reshape(nh, world)
            flags = flat[len(flat) - world:]
            lost = np.nonzero(flags == LOST)[0].tolist()
            late = np.nonzero(flags == LATE)[0].tolist()
    except BaseException:
        if defer:
            unw.abandon()
        if shm is not None:
            shm.discard()
        raise
    if defer:
        unw.give_back_duplicates()
        unw.held = []
    for i in np.nonzero(reasons)[0].tolist():
        results[i] = None  # drops this rank's views, giving back their references
        if i not in local or defer:
            _give_back(unw, req_idxs[i], stranded, group_rank)
    unw.state = []
    if plan is not None:
        plan.give_back_stranded(unw, stranded)
    elif is_src:
        # references handed out to ranks that cannot reach the segment come back here
        for idx in np.nonzero(stranded.sum(axis=1))[0].tolist():
            h = unw.order[idx]
            try:
                h.ref.add(-int(stranded[idx].sum()))
            except (MmshmError, OSError):
                pass
        if lost:
            _give_back_lost(unw, added or {}, opened, lost, group_rank, lay)
        _remember_handed(added or {})
    if lost or late:
        gone = sorted(lost + late)
        raise PeerLostError(
            f"mmshm: TP rank(s) {gone} of the group stopped answering during a broadcast "
            f"(TP rank {group_rank} found it in the failure agreement); the group cannot go "
            f"on, so the server's own failure handling takes over", ranks=gone)
    for i in np.nonzero(reasons)[0].tolist():
        reason = REASONS[int(reasons[i])]
        ranks = [r for r in range(world) if failed[i, r]]
        err = MaterializeError(
            f"request {i}: shared-memory tensors could not be materialized on TP rank(s) "
            f"{ranks} ({reason})", request=out[i], reason=reason, ranks=ranks)
        REQUEST_FAILURES.labels(reason=reason).inc()
        results[i] = on_failure(out[i], err) if on_failure is not None else err
    return results


# Segments this process handed out in earlier broadcasts (most recent last,
# bounded): a receiver may have one of them open from then, so its attach
# now would not show in the hand-out record (_give_back_lost skips them).
_HANDED: OrderedDict[SegmentRef, None] = OrderedDict()
_HANDED_MAX = 4096


def _remember_handed(added: dict[SegmentRef, int]) -> None:
    for key in added:
        _HANDED[key] = None
        _HANDED.move_to_end(key)
    while len(_HANDED) > _HANDED_MAX:
        _HANDED.popitem(last=False)


def _hand_out_record(key: SegmentRef) -> tuple[int, int, int] | None:
    """The segment's last hand-out, read under its mutex: (references it
    added, attaches since by processes other than the one that made it,
    that process's pid), or None if the segment is gone or was reused."""
    path = os.path.join(segfile.segment_dir(key.directory), key.name)
    try:
        fd = os.open(path, segfile.OPEN_FLAGS)
    except OSError:
        return None
    try:
        with segfile.mutex(fd):
            hdr = segfile.read_header(fd, path)
            record = segfile.hand_out_record(fd)
        if hdr.state != segfile.STATE_LIVE or hdr.gen != key.gen:
            return None
        return record
    except (OSError, ValueError, struct_error):
        return None
    finally:
        os.close(fd)  # OFD locks: closing this descriptor drops nobody's lock


#: how long the source waits for a lost rank's process to be gone (a killed
#: process closes its sockets before it is reaped), in seconds
_GONE_WAIT_S = 2.0


def _wait_gone(ranks: list[int], procs) -> list[int]:
    """The ranks of ``ranks`` whose process is gone, waiting up to
    :data:`_GONE_WAIT_S` for all of them."""
    deadline = time.monotonic() + _GONE_WAIT_S
    while True:
        gone = [r for r in ranks if topology.process_gone(procs[r])]
        if len(gone) == len(ranks) or time.monotonic() > deadline:
            return gone
        time.sleep(0.01)


def _give_back_lost(unw: _Unwrapper, added: dict[SegmentRef, int], opened: np.ndarray,
                    lost: list[int], me: int, lay: topology.Layout | None) -> None:
    """On the source rank, one node: give back the references handed out in
    this broadcast to the ranks whose agreement vector never came (``lost``),
    where they can be proved never given back by those ranks, and keep them
    for the reaper's grace where not (said at WARNING).

    A lost rank's references for segment S are given back (``len(handles of
    S)`` each) only if all of these hold:

    - the rank's process is gone (:func:`mmshm.transport.topology.process_gone`, from the
      pid and start time it gave in the layout): a rank that is only hung
      could still open S later, and give back its reference itself;
    - S's last hand-out is this broadcast's (this pid, the count added here):
      its attach count then counts the opens of S since;
    - that count equals the opens the survivors reported in the agreement:
      the lost rank never opened S in this walk;
    - this process did not hand S out in an earlier broadcast: the lost rank
      cannot have had S open from then (an open the count would not show).

    A receiver gives back no reference of an unopened handle before the
    agreement is over, nor when its broadcast ends in an error
    (:meth:`_Unwrapper.abandon`), and a lost rank never got the agreement's
    result: so a reference that meets these conditions is still counted for
    it, and is given back exactly once, here."""
    per: dict[SegmentRef, list[int]] = {}
    for idx, h in enumerate(unw.order):
        if h.error is None and h.is_local():
            per.setdefault(h.ref, []).append(idx)
    procs = lay.procs if lay is not None else ()
    gone = _wait_gone([r for r in lost if r < len(procs)], procs)
    survivors = [r for r in range(opened.shape[1]) if r != me and r not in lost]
    pid = os.getpid() & 0xFFFFFFFF
    given = kept = 0
    for key, idxs in per.items():
        handed = added.get(key, 0)
        refs = len(idxs) * len(gone)
        ok = bool(refs) and handed > 0 and key not in _HANDED
        if ok:
            fresh = int(opened[np.ix_(idxs, survivors)].sum()) if survivors else 0
            ok = _hand_out_record(key) == (handed, fresh, pid)
        if ok and key.release(refs):
            given += refs
        kept += len(idxs) * len(lost) - (refs if ok else 0)
    if kept:
        log.warning("mmshm: %d reference(s) handed out to lost TP rank(s) %s (gone: %s) cannot "
                    "be proved unused there, so they are left to the reaper, which reclaims "
                    "them after MMSHM_IN_FLIGHT_GRACE_S; %d given back at once", kept, lost,
                    gone, given)
    elif given:
        log.info("mmshm: gave back %d reference(s) handed out to lost TP rank(s) %s", given,
                 lost)
