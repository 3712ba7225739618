"""Failure agreement: after a broadcast, every rank of the TP group turns the
same requests into errors.

Holds the reason codes (an index into :data:`REASONS`; 0 is ``ok``),
:class:`_RemoteFailure` (a failure that happened on another rank
and reached this one as a code) and :func:`_agree_max`, the element-wise MAX
over the group.

Invariants:

- every rank of the group calls :func:`_agree_max` exactly once per broadcast
  that carried handles, with an ``int32`` vector of the same length (the
  handles are indexed in walk order, identical on every rank); a rank that
  skipped it would leave the others waiting until the group's timeout;
- the result is the same on every rank: a code or flag set by any rank is set
  on all of them, so the per-request outcome is agreed whatever rank failed;
- the agreement's messages are point to point with tag :data:`AGREE_TAG`, two
  hops around the broadcast's source rank (``all_reduce`` only when the source
  is not in the group); no barrier, no other collective;
- every receive is posted (:func:`_agree_post`) before the walk that the
  message it receives waits for: gloo delivers a point-to-point message
  that finds its receive posted in one hop, and one that arrives first only
  after a hand-shake that costs about 4 ms on a loaded host (measured, TP=2,
  2 cores: 0.09 ms against 4 ms for a round trip);
- the vector ends with one element per group rank, the *lost* flags: the
  source sets those of the ranks whose vector never came (they died, or their
  link did, before the end of their walk) and sends the result to every other
  rank, so that the survivors learn the same lost ranks and the source knows
  that every survivor has finished its walk;
- on one node (:mod:`mmshm.transport.shmagree`) the same star runs through shared
  memory when the caller passes the group's :class:`~mmshm.transport.shmagree.ShmAgreement`
  and the vector fits its slots (both the same on every rank): no gloo
  message then, the same result, lost and late flags, and the same
  exceptions (a receiver that cannot get the result raises a
  ``RuntimeError``);
- this module imports nothing of mmshm above the segment layer, the node
  layer and the errors: the one-node protocol (:mod:`mmshm.transport.broadcast`) and
  the multi-node path (:mod:`mmshm.transport.multinode`) use it, never the other way
  round.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmshm.errors import MmshmError
from mmshm.transport.shmagree import ShmAgreement

# wire codes of the failure reasons: REASONS[code]; 0 is "ok"
REASONS = ("ok", "malformed", "not_found", "corrupt", "wrong_node", "emfile", "released",
           "enospc", "other", "withheld")
_REASON_CODE = {r: i for i, r in enumerate(REASONS)}
_OTHER = _REASON_CODE["other"]
# tag of the agreement's point-to-point messages
AGREE_TAG = 0x6D6E
# values of the lost flags (the vector's last ``world`` elements)
LOST, LATE = 1, 2



class _RemoteFailure(MmshmError):
    """A handle that failed before it reached this node (on the source rank,
    or on this node's leader); ``reason`` is the original failure's."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _remote(code: int, where: str) -> _RemoteFailure:
    reason = REASONS[code] if 0 < code < len(REASONS) else "other"
    return _RemoteFailure(reason, f"the tensor could not be materialized on {where} ({reason})")


class _ShmPosted:
    """The agreement of one broadcast through shared memory: nothing to post
    (see :mod:`mmshm.transport.shmagree`)."""

    __slots__ = ("agr", "size")

    def __init__(self, agr: ShmAgreement, size: int):
        self.agr = agr
        self.size = size


class _Posted:
    """The agreement's receives of one broadcast, posted by :func:`_agree_post`
    before the walk: on the source rank one per other rank, on another rank
    the one for the result."""

    __slots__ = ("parts", "size", "works", "setup")

    def __init__(self, size: int, parts: dict, works: dict):
        self.size = size
        self.parts = parts  # group rank -> int32 buffer
        self.works = works  # group rank -> the posted receive
        # the group's shared-memory agreement while it is being set up
        # (stages create and probe: mmshm.transport.shmagree), else None
        self.setup: ShmAgreement | None = None


def _glob(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def _agree_post(size: int, group, world: int, group_rank: int, src_group_rank: int | None,
                src: int | None, shm: ShmAgreement | None = None) -> _Posted | _ShmPosted | None:
    """Post this rank's receives of the agreement over an ``int32`` vector of
    ``size`` elements (identical on every rank), before the walk whose
    outcome the peers send: the messages then find their receive posted
    (see the module docstring). :func:`_agree_max` waits for them; every
    rank that posts must call it. None when there is nothing to post (the
    source is not in the group: ``all_reduce``; no process group). Raises
    what ``torch.distributed`` raises. A rank that leaves between the two
    (an exception out of its walk) leaves its receives posted: its peers
    then wait in the agreement until the group's timeout, and the group
    cannot go on, as before.

    ``shm``: the group's shared-memory agreement (one node). Once set up
    (stage ``on``) and when the vector fits it
    (:meth:`~mmshm.transport.shmagree.ShmAgreement.fits`, the same on every rank),
    nothing is posted and :func:`_agree_max` agrees through it. Its first
    agreement (stage ``new``) goes over gloo and sets it up: the vector
    carries one more element, first, the probe
    (:meth:`~mmshm.transport.shmagree.ShmAgreement.setup_code`: whether the source
    made the file and every other rank could open it), so that the group
    takes shared memory only if every rank can; :func:`_agree_max` settles
    it."""
    if src is None or src_group_rank is None or not dist.is_initialized():
        return None
    setup = None
    if shm is not None:
        if shm.stage == "on":
            if shm.fits(size):
                return _ShmPosted(shm, size)
        elif shm.stage == "new":
            size += 1  # first element: the setup's probe (ShmAgreement.setup_code)
            setup = shm
    posted = _post_gloo(size, group, world, group_rank, src_group_rank, src)
    posted.setup = setup
    return posted


def _post_gloo(size: int, group, world: int, group_rank: int, src_group_rank: int,
               src: int) -> _Posted:
    if group_rank == src_group_rank:
        others = [r for r in range(world) if r != group_rank]
        parts = {r: torch.empty(size, dtype=torch.int32) for r in others}
        works = {r: dist.irecv(parts[r], src=_glob(group, r), group=group, tag=AGREE_TAG)
                 for r in others}
        return _Posted(size, parts, works)
    out = torch.empty(size, dtype=torch.int32)
    got = dist.irecv(out, src=src, group=group, tag=AGREE_TAG)
    return _Posted(size, {src_group_rank: out}, {src_group_rank: got})


def _agree_max(flat: torch.Tensor, group, world: int, group_rank: int,
               src_group_rank: int | None, src: int | None,
               posted: _Posted | None = None) -> torch.Tensor:
    """Element-wise MAX of the int32 vector ``flat`` over ``group``, known to
    every rank afterwards; its last ``world`` elements are the lost flags
    (zero from every rank; see the module docstring): :data:`LOST` for a
    rank whose vector never came (the survivors still get the result), and,
    in the source rank's own copy only, :data:`LATE` for a rank whose vector
    came but which the result could not be sent back to (lost after its
    walk). Raises what ``torch.distributed`` raises on a broken link, on the
    other ranks, and with ``all_reduce``.

    A star around the broadcast's source rank, point to point: every other
    rank sends its vector to the source and waits for the maximum, which the
    source sends back once it has them all. Two hops whatever the group's
    size, where gloo's ``all_reduce`` takes ``2 (world - 1)`` dependent steps,
    and no hand-off to gloo's collective worker thread: on a 2-core host with
    TP=4, medians of 0.5 ms against 0.9 ms for a gather and a broadcast and
    3.7 ms for ``all_reduce`` (``dist.all_reduce`` is used only when the
    source is not in the group). Waits are bounded by the group's timeout.

    ``posted``: this rank's receives, posted by :func:`_agree_post` for a
    vector of the same size (posted here when None); a shared-memory
    agreement there (one node) runs :meth:`mmshm.transport.shmagree.ShmAgreement.agree`
    instead, with the same result and flags and no message (a receiver
    raises :class:`mmshm.transport.shmagree.AgreementLost`, a ``RuntimeError``)."""
    if isinstance(posted, _ShmPosted) and src_group_rank is not None:
        if posted.size != flat.numel():
            raise RuntimeError(f"mmshm: agreement prepared for {posted.size} elements, the "
                               f"vector has {flat.numel()}")
        return posted.agr.agree(flat, src_group_rank, LOST, LATE)
    if src is None or src_group_rank is None:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        return flat
    if posted is None:
        posted = _agree_post(flat.numel(), group, world, group_rank, src_group_rank, src)
    setup = getattr(posted, "setup", None)
    if setup is not None:
        code = setup.setup_code(src_group_rank)
        flat = torch.cat([torch.tensor([code], dtype=torch.int32), flat])
    try:
        out = _agree_gloo(flat, group, world, group_rank, src_group_rank, src, posted)
    except BaseException:
        if setup is not None:
            setup.abort()
        raise
    if setup is not None:
        if out[len(out) - world:].any():  # a rank lost: the group cannot go on
            setup.abort()
        else:
            setup.settle(int(out[0]))
        out = out[1:]
    return out


def _agree_gloo(flat: torch.Tensor, group, world: int, group_rank: int, src_group_rank: int,
                src: int, posted: _Posted | None) -> torch.Tensor:
    """The star of :func:`_agree_max` over gloo."""
    if posted is None or posted.size != flat.numel():
        raise RuntimeError(f"mmshm: agreement receives posted for {getattr(posted, 'size', 0)} "
                           f"elements, the vector has {flat.numel()}")
    if group_rank == src_group_rank:
        others = [r for r in range(world) if r != group_rank]
        parts, works = posted.parts, posted.works
        lost = []
        for r, w in works.items():  # every one, so that the survivors all get the result
            try:
                w.wait()
            except RuntimeError:  # that rank's vector never came: it is lost
                lost.append(r)
        live = [r for r in others if r not in lost]
        flat = torch.stack([flat, *(parts[r] for r in live)]).amax(dim=0)
        for r in lost:
            flat[len(flat) - world + r] = LOST
        sends = {r: dist.isend(flat, dst=_glob(group, r), group=group, tag=AGREE_TAG)
                 for r in live}
        late = []
        for r, w in sends.items():
            try:
                w.wait()
            except RuntimeError:
                late.append(r)
        if late:
            flat = flat.clone()  # the vector sent stays as it was
            for r in late:
                flat[len(flat) - world + r] = LATE
        return flat
    sent = dist.isend(flat, dst=src, group=group, tag=AGREE_TAG)
    sent.wait()
    posted.works[src_group_rank].wait()
    return posted.parts[src_group_rank]
