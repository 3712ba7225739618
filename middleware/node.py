"""Node identity, and the node layout of a process group.

Shared memory stops at the node. Two processes are on the same node only if
they can open each other's segments, so a node's identity is made of:

* the host's boot (``/proc/sys/kernel/random/boot_id``; the host name where
  that file is missing),
* the IPC and mount namespaces (the inode numbers of ``/proc/self/ns/ipc``
  and ``/proc/self/ns/mnt``),
* the segment directory itself (``st_dev``/``st_ino`` of ``MMSHM_DIR``).

:func:`identity` is that description as a string; :func:`node_id` hashes it
(BLAKE3) to a compact 32-bit id, which every handle carries on the wire
(:attr:`mmshm.codec.HandleMeta.node`). Opening a handle whose node id is not
this process's raises :class:`~mmshm.errors.WrongNodeError`.

``MMSHM_NODE_ID`` overrides the system identity (tests, and simulating several
nodes on one machine): ranks with equal values are one node, ranks with
different values are different nodes. A decimal integer below 2**32 is the
node id itself; any other string is hashed.

:func:`layout` tells which ranks of a process group share a node. Ranks learn
each other's identities once per group (one ``all_gather_object``, on the
first call, which is therefore collective) and the answer is cached; a group
whose ranks are all on one node takes the single-node path of
:func:`mmshm.deferred_unwrap` with no further collective.

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

Simulating ``K`` nodes on one machine (``mmshm bench --nodes K``): give each
simulated node its own segment directory and node id with :func:`simulate`
(in the rank process, before anything else of mmshm runs) or pass
:func:`simulated_env` to the child; :func:`node_of_rank` assigns ranks to nodes
in contiguous blocks. :func:`internode_bytes` is the payload bytes this process
sent to other nodes (also ``mmshm_internode_bytes_total``).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import blake3
import msgspec
import torch.distributed as dist

from . import config
from .metrics import INTERNODE_BYTES

log = logging.getLogger("mmshm")

#: Version of what ranks of one group exchange (the broadcast's metadata,
#: the layout's gather, the failure agreement, the multi-node transfers); a
#: peer announcing another one makes the group go inline (:func:`handshake`).
#: 2: the layout carries each rank's process (:func:`process_id`), the
#: agreement the lost flags and each rank's opens.
PROTOCOL = 2

NODE_ID_BITS = 32
_BOOT_ID = "/proc/sys/kernel/random/boot_id"

# (directory, override) -> (identity, node id). The boot and the namespaces do
# not change during a process's life; a directory that cannot be stat'ed
# (yet) is not cached.
_IDS: dict[tuple[str, str | None], tuple[str, int]] = {}


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _ns_inode(kind: str) -> int:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0


def _hash32(text: str) -> int:
    return int.from_bytes(blake3.blake3(text.encode()).digest(4), "little")


def _compute(directory: str, override: str | None) -> tuple[tuple[str, int], bool]:
    if override is not None:
        if override.isdecimal() and int(override) < 1 << NODE_ID_BITS:
            nid = int(override)
        else:
            nid = _hash32("override=" + override)
        return (f"override={override}", nid), True
    boot = _boot()
    where, cacheable = _where(directory)
    ident = f"boot={boot};ipc={_ns_inode('ipc')};mnt={_ns_inode('mnt')};dir={where}"
    return (ident, _hash32(ident)), cacheable


def _boot() -> str:
    return _read(_BOOT_ID) or f"host:{socket.gethostname()}"


def _where(directory: str) -> tuple[str, bool]:
    """The directory's ``st_dev:st_ino`` (cacheable), or its path when it
    cannot be stat'ed (yet: not cacheable)."""
    try:
        st = os.stat(directory)
        return f"{st.st_dev}:{st.st_ino}", True
    except OSError:
        return f"path:{os.path.abspath(directory)}", False


def _lookup(directory: str | None) -> tuple[str, int]:
    cfg = config.get()
    d = directory if directory is not None else cfg.dir
    key = (d, cfg.node_id)
    hit = _IDS.get(key)
    if hit is not None:
        return hit
    value, cacheable = _compute(d, cfg.node_id)
    if cacheable:
        _IDS[key] = value
    return value


def system_facts(directory: str | None = None) -> str:
    """What the system says of this process's node, whatever
    ``MMSHM_NODE_ID`` says: the boot and the segment directory's file system
    and inode (``boot=<boot id>;dir=<st_dev>:<st_ino>``). The namespaces are
    left out: processes in two mount namespaces that bind-mount one /dev/shm
    can share segments, and may be declared one node with ``MMSHM_NODE_ID``;
    two boots or two directories never can."""
    d = directory if directory is not None else config.get().dir
    return f"boot={_boot()};dir={_where(d)[0]}"


def identity(directory: str | None = None) -> str:
    """This process's node identity for segment directory ``directory``
    (default ``MMSHM_DIR``): ``override=<MMSHM_NODE_ID>``, or
    ``boot=<boot id>;ipc=<inode>;mnt=<inode>;dir=<st_dev>:<st_ino>``."""
    return _lookup(directory)[0]


def node_id(directory: str | None = None) -> int:
    """The compact (32-bit) id of this process's node for ``directory``
    (default ``MMSHM_DIR``), as carried by handles. Cached: one dict lookup."""
    return _lookup(directory)[1]


def is_local(node: int, directory: str | None = None) -> bool:
    """Whether a handle carrying node id ``node`` was made on this node."""
    return node == _lookup(directory)[1]


def clear_cache() -> None:
    """Forget the cached identities (after changing ``MMSHM_DIR`` or
    ``MMSHM_NODE_ID``; :func:`mmshm.config.reload` alone is enough, since the
    cache is keyed by both). Group layouts stay cached: all ranks must agree
    on when to gather them again."""
    _IDS.clear()


class NodeInfo(msgspec.Struct, frozen=True):
    """This process's node, as ``mmshm status`` and ``doctor`` show it:
    ``id`` (what handles carry), the ``host`` name and the ``identity`` it
    is derived from (:func:`identity`). Processes that show the same id are
    one node: they open the same segments."""

    id: int
    host: str
    identity: str


def describe(directory: str | None = None) -> NodeInfo:
    """This process's :class:`NodeInfo` for segment directory ``directory``
    (default ``MMSHM_DIR``)."""
    ident, nid = _lookup(directory)
    return NodeInfo(nid, socket.gethostname(), ident)


def describe_text(info: NodeInfo) -> str:
    """One line for the CLI: the id, the host and what makes the node."""
    return (f"0x{info.id:08x} on {info.host} ({info.identity}); the processes that show this "
            f"id are one node (they open the same segments); a TP group across nodes sends "
            f"each payload once to every other node")


# -- the layout of a process group -------------------------------------------------
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
    #: the node id each rank's handles carry (:func:`node_id`); empty when
    #: built from identities alone
    ids: tuple[int, ...] = ()

    #: per rank, what the system says whatever ``MMSHM_NODE_ID`` says: the
    #: boot and the segment directory's file system (:func:`system_facts`);
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
    rank's :func:`identity`): every rank of the group must make it, which
    :func:`mmshm.deferred_unwrap` guarantees by calling it at the start of
    each broadcast on every rank. Later calls are a dict lookup.
    """
    pg = _group_key(group)
    hit = _LAYOUTS.get(id(pg))
    if hit is not None and hit[0] is pg:
        return hit[1]
    world = dist.get_world_size(group=group)
    pairs: list = [None] * world
    dist.all_gather_object(pairs, (*_lookup(None), system_facts(), process_id()), group=group)
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
    raw = _read(f"/proc/{pid}/stat")
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
    return os.getpid(), st[1] if st else 0, _ns_inode("pid")


def process_gone(proc: tuple[int, int, int]) -> bool | None:
    """Whether the process :func:`process_id` returned (in a process of
    this node) has exited: True (gone, or a zombie), False (it runs), None
    (cannot be told: another pid namespace, or /proc does not say)."""
    pid, start, pidns = proc
    if not start or pidns != _ns_inode("pid"):
        return None
    st = _stat_start(pid)
    if st is None or st[1] != start:
        return True  # no such pid any more, or reused by another process
    return st[0] in ("Z", "X")


def forget_layouts() -> None:
    """Drop every cached layout (after destroying process groups)."""
    _LAYOUTS.clear()


# -- the handshake: is every rank of a group running the same mmshm? ---------------
_HELLO = "mmshm/hello/"
_VERDICT = "mmshm/verdict/"


class Hello(msgspec.Struct, frozen=True):
    """What a rank announces: mmshm's ``version``, the wire ``protocol``,
    the ``host`` name and its node ``identity`` (:func:`identity`)."""

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
    from . import __version__

    return Hello(__version__, PROTOCOL, socket.gethostname(), identity())


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


def forget_handshakes() -> None:
    """Drop every cached verdict (after destroying process groups)."""
    _VERDICTS.clear()


# -- inter-node traffic ------------------------------------------------------------
_STATS = {"sent_bytes": 0, "received_bytes": 0, "payloads_sent": 0, "payloads_received": 0}


def count_sent(nbytes: int) -> None:
    """Record one payload of ``nbytes`` sent to a rank on another node."""
    _STATS["sent_bytes"] += nbytes
    _STATS["payloads_sent"] += 1
    INTERNODE_BYTES.inc(nbytes)


def count_received(nbytes: int) -> None:
    """Record one payload of ``nbytes`` received from a rank on another node."""
    _STATS["received_bytes"] += nbytes
    _STATS["payloads_received"] += 1


def internode_bytes() -> int:
    """Payload bytes this process has sent to ranks on other nodes (the
    process-local value of ``mmshm_internode_bytes_total``). Summed over the
    ranks of a run, it is the run's inter-node payload traffic."""
    return _STATS["sent_bytes"]


def internode_stats() -> dict[str, int]:
    """This process's inter-node payload counters: ``sent_bytes``,
    ``received_bytes``, ``payloads_sent``, ``payloads_received``."""
    return dict(_STATS)


def reset_internode_stats() -> None:
    """Zero the process-local counters (the Prometheus counter is kept)."""
    for k in _STATS:
        _STATS[k] = 0


# -- simulating nodes on one machine -----------------------------------------------
def node_of_rank(rank: int, world: int, nodes: int) -> int:
    """The simulated node of ``rank`` when ``world`` ranks are spread over
    ``nodes`` nodes in contiguous, balanced blocks."""
    if not 1 <= nodes <= world:
        raise ValueError(f"cannot spread {world} ranks over {nodes} nodes")
    return rank * nodes // world


def simulated_dir(base_dir: str, node: int) -> str:
    """The segment directory of simulated node ``node`` under ``base_dir``."""
    return os.path.join(base_dir, f"node{node}")


def simulated_env(base_dir: str, node: int) -> dict[str, str]:
    """Environment of a process on simulated node ``node``: its own segment
    directory (so opening another node's segment really fails) and its own
    ``MMSHM_NODE_ID``. Creates the directory (mode 0700)."""
    d = simulated_dir(base_dir, node)
    os.makedirs(d, mode=0o700, exist_ok=True)
    return {"MMSHM_DIR": d, "MMSHM_NODE_ID": str(node)}


def simulate(base_dir: str, node: int) -> dict[str, str]:
    """Make this process part of simulated node ``node``: sets
    :func:`simulated_env` in ``os.environ`` and reloads the configuration.
    Call it in each rank process before any segment, handle or broadcast.
    Returns the variables set."""
    env = simulated_env(base_dir, node)
    os.environ.update(env)
    config.reload()
    return env
