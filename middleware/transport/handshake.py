"""The version handshake: does every rank of a process group run this mmshm?

:func:`handshake` finds version skew between the ranks of a group before any
of mmshm's collectives: on its first broadcast on a group, every rank
announces itself (mmshm's version, wire protocol, host and node identity)
under its global rank in the default process group's key-value store and
waits for every peer's announcement. A peer with no mmshm (it never
announces) or another version makes the group carry its tensors inline:
the first rank to decide stores the verdict (``compare_set``) and every rank
follows the stored one, so no two ranks of a group ever disagree. The wait is
``MMSHM_HANDSHAKE_S``, at most half the group's own timeout
(:func:`group_timeout`), so that a broadcast to a peer that died before it
still fails, typed, within the group's timeout. A store that cannot be
reached (its host, global rank 0, has exited; it refuses) means what no store
means: one WARNING, and the group goes on as if every rank ran this mmshm.
"""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass

import msgspec
import torch.distributed as dist

from mmshm import config
from mmshm.segments import node as _node
from mmshm.transport.topology import _group_key

log = logging.getLogger("mmshm")

#: Version of what ranks of one group exchange (the broadcast's metadata,
#: the layout's gather, the failure agreement, the multi-node transfers); a
#: peer announcing another one makes the group go inline (:func:`handshake`).
#: 2: the layout carries each rank's process
#: (:func:`mmshm.transport.topology.process_id`), the
#: agreement the lost flags and each rank's opens.
#: 3: a handle carries its tensor's offset in the segment (one segment per
#: request, :meth:`mmshm.ShmTensor.from_tensors`); a rank of protocol 2 would
#: drop that element and read every grouped tensor at offset 0 (the first
#: tensor's bytes), so it must not share a group with one of protocol 3.
PROTOCOL = 3

_HELLO = "mmshm/hello/"
_VERDICT = "mmshm/verdict/"


class Hello(msgspec.Struct, frozen=True):
    """What a rank announces: mmshm's ``version``, the wire ``protocol``,
    the ``host`` name and its node ``identity``
    (:func:`mmshm.segments.node.identity`)."""

    version: str
    protocol: int
    host: str
    identity: str


@dataclass(frozen=True)
class Verdict:
    """A group's handshake result, the same on every rank of the group.

    Attributes:
        ok: every rank runs this mmshm (same version and protocol), or it
            could not be checked (no store, or a store that cannot be
            reached: ``checked`` is False).
        reason: why not, naming the ranks and their hosts ("" when ok).
        missing: the group ranks that announced nothing within the wait, as
            this rank judged it: peers without mmshm, or peers that died
            before the group's first broadcast (a broadcast that then fails
            raises :class:`~mmshm.errors.PeerLostError` naming them).
        checked: whether the store could be asked.
    """

    ok: bool
    reason: str = ""
    missing: tuple[int, ...] = ()
    checked: bool = True


_VERDICTS: dict[int, tuple[object, Verdict]] = {}


def _hello() -> Hello:
    from mmshm import __version__

    return Hello(__version__, PROTOCOL, socket.gethostname(), _node.identity())


def _default_store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or moved: no handshake
        return None


def _group_ranks(group) -> list[int]:
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def group_timeout(group=None) -> float | None:
    """The timeout of process group ``group`` (default: the default group)
    in seconds, as given to ``init_process_group``/``new_group`` (torch
    keeps it in the group's CPU backend options); None where torch does
    not say."""
    pg = _group_key(group)
    try:
        import torch

        return float(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 - not a gloo/CPU group, or torch moved it
        return None


def handshake_wait(group=None) -> float:
    """How long the handshake waits for the peers' announcements:
    ``MMSHM_HANDSHAKE_S``, at most half the group's timeout
    (:func:`group_timeout`), so that the broadcast that follows a peer lost
    before it still fails within the group's timeout."""
    wait = config.get().handshake_s
    timeout = group_timeout(group)
    return min(wait, timeout / 2) if timeout else wait


def _judge(store, ranks: list[int], mine: Hello, wait_s: float) -> Verdict:
    keys = [f"{_HELLO}{r}" for r in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=wait_s))
    except Exception:  # noqa: BLE001 - timed out: someone never announced
        pass
    missing, seen = [], []
    for r, key in zip(ranks, keys):
        if not store.check([key]):
            missing.append(r)
            continue
        try:
            theirs = msgspec.msgpack.decode(store.get(key), type=Hello)
            seen.append((r, theirs.host, f"mmshm {theirs.version} (protocol {theirs.protocol})"))
        except msgspec.MsgspecError:
            seen.append((r, "?", "an announcement this mmshm cannot read"))
    versions = {v for _, _, v in seen}
    if not missing and versions == {f"mmshm {mine.version} (protocol {mine.protocol})"}:
        return Verdict(True)
    parts = []
    if missing:
        parts.append(f"rank(s) {missing} announced no mmshm within {wait_s:g} s "
                     f"(MMSHM_HANDSHAKE_S, at most half the group's timeout): mmshm is not "
                     f"running there, or the rank is gone")
    if len(versions) > 1:  # the same text whichever rank judges
        parts.append("the ranks run different mmshm: " +
                     ", ".join(f"rank {r} on {host}: {v}" for r, host, v in seen))
    return Verdict(False, "; ".join(parts), tuple(ranks.index(r) for r in missing))


def _unchecked(ranks: list[int], why: str) -> Verdict:
    """The verdict where the store cannot tell: as if every rank ran this
    mmshm (what the ranks did before there was a handshake), with one
    WARNING. Every rank that cannot ask the store takes it; a rank that can
    ask finds every peer announced (then it goes on too) unless a peer could
    not announce, which takes the store failing for that peer alone and
    before this rank's own wait ended."""
    log.warning("mmshm: the ranks' mmshm versions cannot be checked for the TP group%s: "
                "%s; a peer without this mmshm would not be found, and the group "
                "goes on through shared memory as if every rank ran this mmshm. Fix: keep "
                "global rank 0 (it hosts torch.distributed's store) running while other "
                "groups broadcast, and start every node's server under `mmshm run` with the "
                "same mmshm", f" of ranks {ranks}" if ranks else "", why)
    return Verdict(True, checked=False)


def handshake(group=None) -> Verdict:
    """Whether every rank of ``group`` (default: the default group) runs this
    mmshm, judged once per group and the same on every rank.

    The first call on a group announces this rank (:class:`Hello`, under its
    global rank in the default group's store) and waits up to
    :func:`handshake_wait` (``MMSHM_HANDSHAKE_S``, at most half the group's
    timeout) for every peer's announcement; the verdict goes into the store
    with ``compare_set`` and every rank returns the stored one. It is not a
    collective: a peer without mmshm never takes part, and the wait bounds
    what that costs (once per group). Where the default group has no store,
    or its store cannot be reached (its host, global rank 0, has exited, or
    it refuses), the ranks cannot be checked: one WARNING, and the verdict
    is ok (``checked`` False), as before there was a handshake. Later calls
    are a dict lookup. Never raises.

    Returns:
        :class:`Verdict`; a group whose verdict is not ok must carry its
        tensors inline (:func:`mmshm.deferred_unwrap` does).
    """
    pg = _group_key(group)
    hit = _VERDICTS.get(id(pg))
    if hit is not None and hit[0] is pg:
        return hit[1]
    store = _default_store()
    if store is None:
        # nothing to check against: every rank goes on as if the others ran
        # this mmshm, as before there was a handshake
        verdict = _unchecked([], "torch.distributed has no default store here (report "
                                 "this as an mmshm bug with the torch version)")
    else:
        ranks = _group_ranks(group)
        try:
            verdict = _ask(store, ranks, handshake_wait(group))
        except Exception as exc:  # noqa: BLE001 - gone, refusing, broken: as no store
            verdict = _unchecked(ranks, f"the default process group's store cannot be "
                                        f"reached ({type(exc).__name__}: "
                                        f"{str(exc).splitlines()[0] if str(exc) else ''})")
        if not verdict.ok:
            log.warning("mmshm: the TP group of ranks %s carries its multimodal tensors "
                        "inline: %s. Fix: install the same mmshm on every node and start "
                        "each node's server under `mmshm run`", ranks, verdict.reason)
    _VERDICTS[id(pg)] = (pg, verdict)
    return verdict


def _ask(store, ranks: list[int], wait_s: float) -> Verdict:
    """Announce this rank, judge the group, and return the group's stored
    verdict (the first rank to decide stores it). Raises what the store
    raises."""
    mine = _hello()
    store.set(f"{_HELLO}{dist.get_rank()}", msgspec.msgpack.encode(mine))
    judged = _judge(store, ranks, mine, wait_s)
    key = _VERDICT + ",".join(map(str, ranks))
    raw = judged.reason.encode() if not judged.ok else b"ok"
    stored = store.compare_set(key, "", raw)
    stored = bytes(stored) if not isinstance(stored, bytes) else stored
    if stored == b"ok":
        return Verdict(True)
    return Verdict(False, stored.decode(), judged.missing)
