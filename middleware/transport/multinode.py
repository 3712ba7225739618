"""Several nodes: a broadcast's payloads cross each node boundary once.

When the TP group spans nodes (:func:`mmshm.transport.topology.layout`, learnt once per
group), the source rank hands out references only for the ranks of its own
node. After its own walk it sends each tensor's payload once to a *leader*
rank on every other node (its lowest rank), point to point through
``torch.distributed`` as a ``uint8`` tensor, never pickled. The leader
receives it straight into a new segment of its own directory, hands out one
reference per rank of its node and sends them the handles' metadata; those
ranks drop the foreign handles that came with the broadcast (no reference was
handed out for them) and materialize the local ones.

Invariants:

- a group on one node never gets here: :mod:`mmshm.transport.broadcast` builds a
  :class:`_NodePlan` only when the layout is not single, so the one-node path
  sends no message with :data:`P2P_TAG`;
- every rank indexes the batch's handles in the same walk order, and the
  codes and payloads travel in that order;
- failures (the source could not read a payload, the leader could not make a
  segment) travel with the metadata as reason codes
  (:mod:`mmshm.transport.agreement`), so the MAX agreement is the same as on one node;
- a reference is given back by the rank that handed it out: stranded
  references come back to the source rank on its node, to the leader on the
  others (:meth:`_NodePlan.give_back_stranded`); on a transport failure the
  leader takes back what reached no one and releases the segments it made;
- a payload the leader has no room for (its node's /dev/shm is full, a
  budget, EMFILE) lands in its private memory and follows the metadata
  inline to the node's other ranks (:data:`INLINE`, counted in
  ``mmshm_inline_fallbacks_total``): that node only goes inline, and the
  request goes on;
- a payload the leader cannot take for any other reason is still taken off
  the wire, so the stream stays in step.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from mmshm.errors import DescriptorLimitError, MmshmError, ShmSpaceError, failure_reason
from mmshm.metrics import INTERNODE_BYTES
from mmshm.segments import codec
from mmshm.segments.shmtensor import ShmTensor
from mmshm.transport import topology
from mmshm.transport.agreement import _OTHER, _REASON_CODE, _remote
from mmshm.transport.wrapping import handles, record_fallback

# -- inter-node traffic (also mmshm_internode_bytes_total) -------------------------
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


# tag of the point-to-point messages of the multi-node path
P2P_TAG = 0x6D6D


#: A handle's code from a node's leader to its other ranks: the leader could
#: not make a segment (its node's /dev/shm is full, a budget, EMFILE), so the
#: payload follows the metadata inline (counted in mmshm_inline_fallbacks_total
#: on the leader). Not a reason code: the request goes on.
INLINE = -1


def _received_inline(meta, nbytes: int, src: int, group) -> torch.Tensor:
    """Receive one payload of ``nbytes`` from global rank ``src`` into
    private memory: the tensor of ``meta``'s dtype and shape."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        dist.recv(buf, src=src, group=group, tag=P2P_TAG)
        count_received(nbytes)
    return buf.view(codec.DTYPES[meta.dtype]).reshape(meta.shape)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class HandleIndex:
    """The interface between :mod:`mmshm.transport.broadcast`'s walker and this module:
    a broadcast batch's handles indexed in walk order (the same on every
    rank). The broadcast's ``_Unwrapper`` is one; :class:`_NodePlan` reads
    and replaces entries through these names only, and never imports the
    broadcast.

    Attributes:
        order: the handles, by index (a plan swaps in this node's copies).
        state: per index: the materialized tensor, the exception that
            handle fails with, or None (not reached yet).
    """

    order: list[ShmTensor]
    state: list

    def index(self, h: ShmTensor) -> int:
        """The index of handle object ``h``, appended if new."""
        raise NotImplementedError


class _NodePlan:
    """One broadcast's transfers when the TP group spans nodes.

    Every rank indexes the batch's handles in walk order (identical on every
    rank). Then, on the source rank's node, nothing changes. On another node:

    1. the leader receives from the source rank a code per handle (0: the
       payload follows; else the reason code of the source's failure) and each
       payload's size, then each payload in index order, received straight
       into a new segment (:meth:`ShmTensor.from_writer`); a payload it has no
       room for is taken off the wire and its handle fails here;
    2. it hands out one reference per other rank of its node and sends them
       (point to point, within the node) the codes and the new handles' wire
       metadata;
    3. every rank of the node replaces the foreign handles by the local ones
       before walking; failed handles raise their forwarded reason.

    Each method's ``unw`` is the broadcast's walker, a :class:`HandleIndex`
    (:class:`mmshm.transport.broadcast._Unwrapper`).
    """

    def __init__(self, lay: topology.Layout, group, group_rank: int, src: int):
        self.lay = lay
        self.group = group
        self.me = group_rank
        self.src = src
        self.src_node = lay.node_of[src]
        self.my_node = lay.node_of[group_rank]
        self.on_src_node = self.my_node == self.src_node
        self.leader = lay.leader(self.my_node, src)
        self.leaders = [lay.leader(k, src) for k in range(lay.num_nodes) if k != self.src_node]

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def issuer(self, group_rank: int) -> int:
        """The rank that handed out ``group_rank``'s references."""
        return self.lay.leader(self.lay.node_of[group_rank], self.src)

    # -- before the walk -------------------------------------------------------------
    def prepare(self, unw, out: list) -> None:
        for req in out:
            for h in handles(req):
                unw.index(h)
        if self.on_src_node or not unw.order:
            return
        for h in unw.order:
            h.disown()  # the source rank handed out no reference for this node
        if self.me == self.leader:
            self._lead(unw)
        else:
            self._follow(unw)

    def _lead(self, unw) -> None:
        nh = len(unw.order)
        src = self._global(self.src)
        head = torch.zeros(2 * nh, dtype=torch.int64)  # codes, then payload sizes
        dist.recv(head, src=src, group=self.group, tag=P2P_TAG)
        codes = head[:nh].numpy().astype(np.int32)
        sizes = head[nh:].tolist()
        made: list[ShmTensor] = []
        shared: list[ShmTensor] = []
        posted = False
        members = [r for r in self.lay.nodes[self.my_node] if r != self.me]
        try:
            for idx in range(nh):
                if codes[idx]:
                    unw.state[idx] = _remote(int(codes[idx]), "the source rank")
                    continue
                started = False

                def receive(dst, _src=src):
                    nonlocal started
                    started = True
                    dist.recv(dst, src=_src, group=self.group, tag=P2P_TAG)

                try:
                    meta = unw.order[idx].meta
                    if meta.nbytes != sizes[idx]:
                        raise MmshmError(f"handle {meta.name}: {meta.nbytes} bytes here, "
                                         f"{sizes[idx]} sent")
                    local = ShmTensor.from_writer(meta.nbytes, meta.dtype, meta.shape, receive,
                                                  hash=meta.hash)
                except (ShmSpaceError, DescriptorLimitError) as exc:
                    if started:
                        raise
                    # no room on this node: the payload lands in private memory
                    # here and travels inline to this node's other ranks
                    record_fallback(exc)
                    unw.state[idx] = _received_inline(meta, sizes[idx], src, self.group)
                    codes[idx] = INLINE
                    continue
                except (MmshmError, OSError) as exc:
                    if started:
                        raise  # the transport failed mid-payload: not a per-request failure
                    if sizes[idx]:  # the payload is on its way: take it off the wire
                        dist.recv(torch.empty(sizes[idx], dtype=torch.uint8), src=src,
                                  group=self.group, tag=P2P_TAG)
                        count_received(sizes[idx])
                    unw.state[idx] = exc
                    codes[idx] = _REASON_CODE.get(failure_reason(exc), _OTHER)
                    continue
                if sizes[idx]:
                    count_received(sizes[idx])
                made.append(local)
                unw.order[idx] = local
            wires: list[bytes | None] = [None] * nh
            for idx in range(nh):
                if codes[idx]:  # failed, or inline
                    continue
                local = unw.order[idx]
                try:
                    local.share(len(members))  # hand out before handing over
                except (MmshmError, OSError) as exc:
                    unw.state[idx] = exc
                    codes[idx] = _REASON_CODE.get(failure_reason(exc), _OTHER)
                    continue
                shared.append(local)
                wires[idx] = local.encode()
            if members:
                posted = True
                blob = np.frombuffer(msgspec.msgpack.encode([codes.tolist(), wires]),
                                     dtype=np.uint8)
                size = torch.tensor([blob.size], dtype=torch.int64)
                payload = torch.from_numpy(blob.copy())
                works = []
                inline = [_flat_bytes(unw.state[idx]) for idx in range(nh)
                          if codes[idx] == INLINE and sizes[idx]]
                for r in members:
                    dst = self._global(r)
                    works.append(dist.isend(size, dst=dst, group=self.group, tag=P2P_TAG))
                    works.append(dist.isend(payload, dst=dst, group=self.group, tag=P2P_TAG))
                    for t in inline:  # after the metadata, in index order
                        works.append(dist.isend(t, dst=dst, group=self.group, tag=P2P_TAG))
                for w in works:
                    w.wait()
        except BaseException:
            # a transport failure: take back what did not reach anyone
            if not posted:
                for h in shared:
                    try:
                        h.ref.add(-len(members))
                    except (MmshmError, OSError):
                        pass
            for h in made:
                h.release()
            raise

    def _follow(self, unw) -> None:
        leader = self._global(self.leader)
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src=leader, group=self.group, tag=P2P_TAG)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(buf, src=leader, group=self.group, tag=P2P_TAG)
        codes, wires = msgspec.msgpack.decode(buf.numpy().tobytes())
        for idx, (code, wire) in enumerate(zip(codes, wires)):
            if code == INLINE:  # the leader had no room: the bytes follow
                meta = unw.order[idx].meta
                unw.state[idx] = _received_inline(meta, meta.nbytes, leader, self.group)
                continue
            if code:
                unw.state[idx] = _remote(int(code), "the source rank or this node's leader")
                continue
            try:
                unw.order[idx] = ShmTensor.decode(wire)
            except MmshmError as exc:
                unw.state[idx] = exc

    # -- after the walk ------------------------------------------------------------
    def send_payloads(self, unw) -> None:
        """On the source rank: each payload once to every other node's leader."""
        if self.me != self.src or not self.leaders or not unw.order:
            return
        nh = len(unw.order)
        head = np.zeros(2 * nh, dtype=np.int64)  # codes, then payload sizes
        codes = head[:nh]
        tensors: list[torch.Tensor] = []
        for idx, st in enumerate(unw.state):
            if isinstance(st, torch.Tensor):
                if st.numel():
                    flat = st.reshape(-1).view(torch.uint8)
                    head[nh + idx] = flat.numel()
                    tensors.append(flat)
            elif isinstance(st, BaseException):
                codes[idx] = _REASON_CODE.get(failure_reason(st), _OTHER)
            else:
                # never reached: every request holding it failed earlier in the walk,
                # on every rank (the walk order and the failures sent are the same)
                codes[idx] = _OTHER
        head_t = torch.from_numpy(head)
        works = []
        for leader in self.leaders:
            dst = self._global(leader)
            works.append(dist.isend(head_t, dst=dst, group=self.group, tag=P2P_TAG))
            for t in tensors:
                works.append(dist.isend(t, dst=dst, group=self.group, tag=P2P_TAG))
                count_sent(t.numel())
        for w in works:
            w.wait()

    def give_back_stranded(self, unw, stranded: np.ndarray) -> None:
        """References handed out to ranks of this rank's node that could not
        give them back come back here (the source rank, or a leader)."""
        mine = [r for r in range(stranded.shape[1]) if self.issuer(r) == self.me]
        if not mine:
            return
        counts = stranded[:, mine].sum(axis=1)
        for idx in np.nonzero(counts)[0].tolist():
            h = unw.order[idx]
            if h.error is not None or not h.is_local():
                continue
            try:
                h.ref.add(-int(counts[idx]))
            except (MmshmError, OSError):
                pass
