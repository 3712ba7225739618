"""The node layout of a process group: which of its ranks share a node.

:func:`layout` tells which ranks of a process group share a node. Ranks learn
each other's identities once per group (one ``all_gather_object``, on the
first call, which is therefore collective) and the answer is cached; a group
whose ranks are all on one node takes the single-node path of
:func:`mmshm.deferred_unwrap` with no further collective.

A rank's process (:func:`process_id`) travels with the layout, so that the
failure agreement can tell a peer that is gone (:func:`process_gone`).
Node identity itself is :mod:`mmshm.segments.node`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch.distributed as dist

from mmshm.segments import node as _node

log = logging.getLogger("mmshm")


@dataclass(frozen=True)
class Layout:
    """Which ranks of a process group share a node.

    Attributes:
        identities: the node identity of each group rank.
        node_of: group rank -> node index (nodes numbered in order of their
            lowest rank).
        nodes: node index -> the group ranks on that node, ascending.
    """

    identities: tuple[str, ...]
    node_of: tuple[int, ...]
    nodes: tuple[tuple[int, ...], ...]
    #: the node id each rank's handles carry (:func:`mmshm.segments.node.node_id`); empty when
    #: built from identities alone
    ids: tuple[int, ...] = ()

    #: per rank, what the system says whatever ``MMSHM_NODE_ID`` says: the
    #: boot and the segment directory's file system (:func:`mmshm.segments.node.system_facts`);
    #: empty when not gathered
    facts: tuple[str, ...] = ()

    #: per rank, its process (:func:`process_id`); empty when not gathered
    procs: tuple[tuple[int, int, int], ...] = ()

    @property
    def id_collision(self) -> bool:
        """Whether two nodes of the group would be taken for one: two
        identities with one node id (a clash of the 32-bit hash), or one
        identity (one ``MMSHM_NODE_ID`` given to two machines, or to two
        segment directories) over different boots or directories. Their
        handles could not be told apart, so the group must go inline."""
        by_id: dict[int, str] = {}
        for ident, nid in zip(self.identities, self.ids):
            if by_id.setdefault(nid, ident) != ident:
                return True
        by_ident: dict[str, str] = {}
        for ident, fact in zip(self.identities, self.facts):
            if by_ident.setdefault(ident, fact) != fact:
                return True
        return False

    @classmethod
    def from_identities(cls, identities, ids=(), facts=(), procs=()) -> Layout:
        index: dict[str, int] = {}
        members: list[list[int]] = []
        node_of = []
        for r, ident in enumerate(identities):
            k = index.get(ident)
            if k is None:
                k = index[ident] = len(members)
                members.append([])
            members[k].append(r)
            node_of.append(k)
        return cls(tuple(identities), tuple(node_of), tuple(tuple(m) for m in members),
                   tuple(ids), tuple(facts), tuple(procs))

    @property
    def single(self) -> bool:
        """Whether every rank of the group is on one node."""
        return len(self.nodes) == 1

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def ranks_on_node_of(self, group_rank: int) -> tuple[int, ...]:
        return self.nodes[self.node_of[group_rank]]

    def leader(self, node: int, src: int) -> int:
        """The rank of node ``node`` that receives payloads from source rank
        ``src``: ``src`` itself on its own node, else the node's lowest rank."""
        ranks = self.nodes[node]
        return src if src in ranks else ranks[0]


# id(process group) -> (process group, layout); the group object is kept so
# that its id cannot be reused by another group while the entry exists.
_LAYOUTS: dict[int, tuple[object, Layout]] = {}


def _group_key(group):
    return group if group is not None else dist.group.WORLD


def layout(group=None) -> Layout:
    """The node layout of ``group`` (default: the default process group).

    The first call for a group is a collective (``all_gather_object`` of every
    rank's :func:`mmshm.segments.node.identity`): every rank of the group must
    make it, which :func:`mmshm.deferred_unwrap` guarantees by calling it at
    the start of each broadcast on every rank. Later calls are a dict lookup.
    """
    pg = _group_key(group)
    hit = _LAYOUTS.get(id(pg))
    if hit is not None and hit[0] is pg:
        return hit[1]
    world = dist.get_world_size(group=group)
    pairs: list = [None] * world
    mine = (*_node._lookup(None), _node.system_facts(), process_id())
    dist.all_gather_object(pairs, mine, group=group)
    lay = Layout.from_identities([p[0] for p in pairs], [p[1] for p in pairs],
                                 [p[2] for p in pairs], [p[3] for p in pairs])
    _LAYOUTS[id(pg)] = (pg, lay)
    if lay.id_collision:
        log.warning("mmshm: two nodes of the process group of %d ranks have the same node id "
                    "(%s): their handles cannot be told apart, so the group carries its "
                    "multimodal tensors inline. Fix: give each node its own MMSHM_NODE_ID (or "
                    "unset it)", world, ", ".join(f"rank {r}: 0x{i:08x} ({n}; {f})"
                                                for r, (n, i, f, _) in enumerate(pairs)))
    if not lay.single:
        log.info("mmshm: the process group of %d ranks spans %d nodes (group ranks by node: "
                 "%s): each payload crosses to every other node once",
                 world, lay.num_nodes, [list(m) for m in lay.nodes])
    return lay


def _stat_start(pid: int | str) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks after boot) of process
    ``pid`` from /proc, or None where /proc does not show it."""
    raw = _node._read(f"/proc/{pid}/stat")
    try:
        fields = raw[raw.rindex(")") + 2:].split()
        return fields[0], int(fields[19])
    except ValueError:
        return None


def process_id() -> tuple[int, int, int]:
    """This process as another process of its node can find it again, pid
    reuse notwithstanding: ``(pid, start time in clock ticks after boot,
    inode of its pid namespace)``; start 0 where /proc does not say."""
    st = _stat_start("self")
    return os.getpid(), st[1] if st else 0, _node._ns_inode("pid")


def process_gone(proc: tuple[int, int, int]) -> bool | None:
    """Whether the process :func:`process_id` returned (in a process of
    this node) has exited: True (gone, or a zombie), False (it runs), None
    (cannot be told: another pid namespace, or /proc does not say)."""
    pid, start, pidns = proc
    if not start or pidns != _node._ns_inode("pid"):
        return None
    st = _stat_start(pid)
    if st is None or st[1] != start:
        return True  # no such pid any more, or reused by another process
    return st[0] in ("Z", "X")
