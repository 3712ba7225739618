"""Node identity: which processes can open each other's segments.

Shared memory stops at the node. Two processes are on the same node only if
they can open each other's segments, so a node's identity is made of:

* the host's boot (``/proc/sys/kernel/random/boot_id``; the host name where
  that file is missing),
* the IPC and mount namespaces (the inode numbers of ``/proc/self/ns/ipc``
  and ``/proc/self/ns/mnt``),
* the segment directory itself (``st_dev``/``st_ino`` of ``MMSHM_DIR``).

:func:`identity` is that description as a string; :func:`node_id` hashes it
(BLAKE3) to a compact 32-bit id, which every handle carries on the wire
(:attr:`mmshm.segments.codec.HandleMeta.node`). Opening a handle whose node id is not
this process's raises :class:`~mmshm.errors.WrongNodeError`.

``MMSHM_NODE_ID`` overrides the system identity (tests, and simulating several
nodes on one machine): ranks with equal values are one node, ranks with
different values are different nodes. A decimal integer below 2**32 is the
node id itself; any other string is hashed.

Simulating ``K`` nodes on one machine (``mmshm bench --nodes K``): give each
simulated node its own segment directory and node id with :func:`simulate`
(in the rank process, before anything else of mmshm runs) or pass
:func:`simulated_env` to the child; :func:`node_of_rank` assigns ranks to nodes
in contiguous blocks.

The node layout of a process group is :mod:`mmshm.transport.topology`, the
version handshake between its ranks :mod:`mmshm.transport.handshake`.
"""

from __future__ import annotations

import os
import socket

import blake3
import msgspec

from mmshm import config

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
