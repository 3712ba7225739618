"""Multi-node tensor parallelism: node identity, handles that carry
their node, and the node-aware deferred unwrap over gloo.

Simulated nodes live on this machine: each gets its own segment directory
under the test's private ``MMSHM_DIR`` (so opening another node's segment
really fails) and its own ``MMSHM_NODE_ID`` (:func:`mmshm.segments.node.simulate`).
The rank functions live here, at top level, so that spawned children can
import them.
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil

import mmshm
import msgspec
import pytest
import torch
from mmshm import config
from mmshm.segments import codec, node, segfile
from mmshm.transport import handshake
from mmshm.transport import multinode
from mmshm.transport import topology
from mmshm.segments.codec import HandleMeta

from tests.harness.procs import run_group
from tests.harness.segments import header, refcount, seg_dir, segment_files
from tests.harness.metrics import fallbacks_total, metric
from tests.harness.tensors import make_tensor, same
from tests.harness import children

NODES = 2
WORLD = 4  # 2 nodes x 2 ranks


# -- helpers (parent and children) -------------------------------------------------
def _enter_node(rank: int, world: int, base: str, nodes: int = NODES, env=None) -> int:
    k = node.node_of_rank(rank, world, nodes)
    node.simulate(base, k)
    if env:
        os.environ.update(env)
        config.reload()
    return k


def _live_files(directory: str | None = None) -> list[str]:
    """Segments in the directory that are in use (not idle in a warm pool)."""
    d = directory or seg_dir()
    out = []
    for n in segment_files(d):
        try:
            if header(n, d)[2] == segfile.STATE_LIVE:
                out.append(n)
        except OSError:
            pass
    return out


def _errors(out) -> dict:
    return {i: (r.reason, list(r.ranks)) for i, r in enumerate(out)
            if isinstance(r, mmshm.MaterializeError)}


def _item(seed: int, nbytes: int):
    return {"modality": "image", "feature": make_tensor(seed, (nbytes // 1024, 256))}


def _sized_request(i: int, seed: int, nbytes: int):
    return {"rid": f"req-{i}", "mm_inputs": {"mm_items": [_item(seed * 100 + i, nbytes)]}}


def _check_sized(got, i: int, seed: int, nbytes: int) -> None:
    want = _sized_request(i, seed, nbytes)["mm_inputs"]["mm_items"][0]["feature"]
    assert same(got["mm_inputs"]["mm_items"][0]["feature"], want), f"request {i}"


def _assert_nodes_empty(base: str, nodes: int = NODES) -> None:
    for k in range(nodes):
        d = node.simulated_dir(base, k)
        assert segment_files(d) == [], f"left over on node {k}: {segment_files(d)}"


# -- children ------------------------------------------------------------------------
def rank_nodes(rank: int, world: int, base: str, seed: int, rounds: int, nodes: int,
               fanout: bool = False, grouped: bool = False) -> dict:
    """Deferred unwrap over ``nodes`` simulated nodes: bytes, references and
    the inter-node payload traffic of each round. With ``fanout`` the batch is
    the 4 copies of one 2-image request (``mmshm.fan_out``). Each tensor gets
    its own segment here (the figures are per segment, and a remote node's
    copies are made per tensor); grouped requests across nodes:
    :func:`test_a_grouped_request_crosses_nodes_with_its_bytes`."""
    import torch.distributed as dist

    from mmshm.transport import wrapping

    if not grouped:
        wrapping.to_shm_group = lambda ts, hashes=None, directory=None, hash_now=None: [
            wrapping.to_shm(t, directory=directory) for t in ts]
    k = _enter_node(rank, world, base, nodes)
    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    res: dict = {"node": k, "node_id": node.node_id(), "rounds": []}
    for rnd in range(rounds):
        s = seed + rnd
        before = multinode.internode_stats()
        metric0 = metric("mmshm_internode_bytes_total")
        created0 = metric("mmshm_segments_created_total")
        info: dict = {}
        if rank == 0:
            if fanout:
                one = mmshm.wrap(children.request(1, s), min_bytes=1024)
                reqs = mmshm.fan_out(one, 4, min_bytes=1024)
                mmshm.release(one)
                del one
            else:
                reqs = [mmshm.wrap(children.request(i, s), min_bytes=1024) for i in range(4)]
            segs = {(h.name, h.meta.offset): h.nbytes for h in mmshm.handles(reqs)}
            info["payload"] = sum(segs.values())
            info["handles"] = len(segs)
            out = bcast(reqs, rank, None, 0)
            del reqs
        else:
            out = bcast(None, rank, None, 0)
        assert len(out) == 4
        for i, req in enumerate(out):
            if fanout:
                req = {**req, "rid": "req-1"}
            children.check_request(req, 1 if fanout else i, s)
        del req  # holds views
        assert not mmshm.handles(out)
        # while every rank holds its views: each node's segments count its 2 ranks
        live = _live_files()
        info["live"] = len(live)
        info["counts"] = sorted({refcount(n) for n in live})
        dist.barrier()  # verification only (not part of the transport)
        del out
        gc.collect()
        dist.barrier()
        after = multinode.internode_stats()
        info["stats"] = {key: after[key] - before[key] for key in after}
        info["metric"] = metric("mmshm_internode_bytes_total") - metric0
        info["created"] = metric("mmshm_segments_created_total") - created0
        info["live_after"] = _live_files()
        dist.barrier()  # before the source rank makes the next round's segments
        res["rounds"].append(info)
    return res


def rank_foreign_handle(rank: int, world: int, base: str, seed: int) -> dict:
    """A handle made on node 0 reaches every rank directly (no deferred
    unwrap): node 0 opens it, node 1 gets WrongNodeError, even when node 1's
    directory holds a segment file of the same name."""
    import torch.distributed as dist

    k = _enter_node(rank, world, base)
    t = make_tensor(seed, (128, 1024))
    res: dict = {"node": k}
    if rank == 0:
        h = mmshm.ShmTensor.from_tensor(t)
        h.share(1)  # rank 1's reference; none is handed to another node
        name = h.name
        mmshm.broadcast_pyobj([h], rank, None, 0)
    else:
        [h] = mmshm.broadcast_pyobj(None, rank, None, 0)
        name = h.name
    if rank == 2:  # a decoy: the same name in node 1's directory
        shutil.copyfile(os.path.join(node.simulated_dir(base, 0), name),
                        os.path.join(node.simulated_dir(base, 1), name))
    dist.barrier()
    if rank == 1:
        v = h.materialize()
        res["ok"] = same(v, t)
        del v
        gc.collect()
    elif k == 1:
        res["is_local"] = h.is_local()
        for copy in (False, True):
            try:
                h.materialize(copy=copy)
                res[f"copy={copy}"] = "no error"
            except mmshm.HandleError as exc:
                res[f"copy={copy}"] = type(exc).__name__
        try:
            h.share(1)
            res["share"] = "no error"
        except mmshm.HandleError as exc:
            res["share"] = type(exc).__name__
        res["owns"] = h.owns_reference  # a failed materialize keeps it
        h.release()  # only dropped: the segment is not reachable from here
        res["owns_after"] = h.owns_reference
    dist.barrier()
    if rank == 2:
        decoy = os.path.join(node.simulated_dir(base, 1), name)
        res["decoy_count"] = refcount(name)  # the copy was never touched
        os.unlink(decoy)
    if rank == 0:
        res["count"] = refcount(name)  # rank 1's reference came back
        h.release()
    dist.barrier()
    return res


def rank_wrong_node_request(rank: int, world: int, base: str, seed: int) -> dict:
    """The source rank's batch holds a handle of node 1: that request fails as
    ``wrong_node`` on all 4 ranks; the others arrive."""
    k = _enter_node(rank, world, base)
    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    if rank == 0:
        reqs = [mmshm.wrap(children.request(i, seed), min_bytes=1024) for i in range(3)]
        other = 1  # node 1's id (simulate() sets MMSHM_NODE_ID to the node's index)
        assert other != node.node_id()
        for item in reqs[1]["mm_inputs"]["mm_items"]:
            m = item["feature"].meta
            item["feature"].release()
            item["feature"] = mmshm.ShmTensor(msgspec.structs.replace(m, node=other))
        out = bcast(reqs, rank, None, 0)
    else:
        out = bcast(None, rank, None, 0)
    errors = _errors(out)
    for i, r in enumerate(out):
        if i not in errors:
            children.check_request(r, i, seed)
        else:
            assert not any(h.owns_reference for h in mmshm.handles(r.request))
    del out, r
    gc.collect()
    return {"node": k, "errors": errors}


SIZES = (64 << 10, 1 << 20, 64 << 10, 64 << 10, 64 << 10)


def rank_node_failures(rank: int, world: int, base: str, seed: int) -> dict:
    """Per-request failures on one node are agreed by all 4 ranks.

    * request 1: node 1's leader cannot make the segment (its budget,
      MMSHM_MAX_BYTES, holds requests 0, 2, 3, 4 but not 1): node 1 gets it
      inline (one fallback on the leader, the bytes on to rank 3), and it
      arrives everywhere;
    * request 3: its segment is gone (on the source node): not_found everywhere;
    * request 4: broken on rank 1 only (node 0): malformed on [1];
    * requests 0 and 2 arrive everywhere.
    """
    env = {"MMSHM_MAX_BYTES": str(512 << 10)} if rank == 2 else None
    k = _enter_node(rank, world, base, env=env)

    def one_rank_breaks(data, rank_, group=None, src=0):
        out = mmshm.broadcast_pyobj(data, rank_, group, src)
        if rank_ == 1:
            item = out[4]["mm_inputs"]["mm_items"][0]
            item["feature"].release()
            item["feature"] = mmshm.ShmTensor(None, error=mmshm.HandleError("corrupted here"))
        return out

    bcast = mmshm.deferred_unwrap(one_rank_breaks)
    sent0 = multinode.internode_bytes()
    payload = 0
    if rank == 0:
        reqs = [mmshm.wrap(_sized_request(i, seed, n), min_bytes=1024)
                for i, n in enumerate(SIZES)]
        item = reqs[3]["mm_inputs"]["mm_items"][0]
        item["feature"].release()
        item["feature"] = children.missing_handle()  # names a segment that is gone
        payload = sum(SIZES) - SIZES[3]
        out = bcast(reqs, rank, None, 0)
    else:
        out = bcast(None, rank, None, 0)
    errors = _errors(out)
    for i, r in enumerate(out):
        if i in errors:
            assert not any(h.owns_reference for h in mmshm.handles(r.request))
        else:
            _check_sized(r, i, seed, SIZES[i])
    del out, r
    gc.collect()
    import torch.distributed as dist

    dist.barrier()
    return {"node": k, "errors": errors, "sent": multinode.internode_bytes() - sent0,
            "payload": payload, "live": _live_files(),
            "received": multinode.internode_stats()["received_bytes"],
            "fallbacks": fallbacks_total()}


def rank_one_node(rank: int, world: int, seed: int, dirs: list | None) -> dict:
    """Two ranks, no MMSHM_NODE_ID: one shared directory is one node (one
    all_gather_object for the group, then no collective and no point-to-point
    message beyond the single-node path: the agreement's two messages per
    call); two directories are two nodes."""
    import torch.distributed as dist
    from mmshm.transport.broadcast import AGREE_TAG

    if dirs is not None:
        os.environ["MMSHM_DIR"] = dirs[rank]
        config.reload()
    calls = {"gather": 0, "p2p": 0, "agree": 0}
    real_gather = dist.all_gather_object

    def gather(*a, **kw):
        calls["gather"] += 1
        return real_gather(*a, **kw)

    dist.all_gather_object = gather
    if dirs is None:
        def only_agreement(real):
            def p2p(*a, **kw):
                if kw.get("tag") == AGREE_TAG:
                    calls["agree"] += 1
                    return real(*a, **kw)
                calls["p2p"] += 1
                raise AssertionError("point-to-point payload message on one node")
            return p2p

        dist.isend, dist.irecv = only_agreement(dist.isend), only_agreement(dist.irecv)
        dist.send, dist.recv = only_agreement(dist.send), only_agreement(dist.recv)
    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    sent0 = multinode.internode_bytes()
    payload = 0
    for rnd in range(3):
        if rank == 0:
            reqs = [mmshm.wrap(children.request(i, seed + rnd), min_bytes=1024) for i in range(2)]
            payload += sum(h.nbytes for h in mmshm.handles(reqs))
            out = bcast(reqs, rank, None, 0)
        else:
            out = bcast(None, rank, None, 0)
        for i, r in enumerate(out):
            children.check_request(r, i, seed + rnd)
        del out, r
        gc.collect()
    lay = topology.layout()
    return {"calls": calls, "single": lay.single, "nodes": [list(n) for n in lay.nodes],
            "sent": multinode.internode_bytes() - sent0, "payload": payload}


def rank_skew(rank: int, world: int, base: str, seed: int, peer: str) -> dict:
    """2 simulated nodes, one rank each; rank 1 runs no mmshm (``peer ==
    "plain"``: SGLang's own ``broadcast_pyobj``) or another mmshm version
    (``"other"``). Rank 0 broadcasts wrapped requests under the deferred
    unwrap: the handshake finds the skew and both ranks get the tensors
    inline, bytes equal, for two rounds."""
    import logging

    _enter_node(rank, world, base, 2)
    if rank == 1 and peer == "other":
        mmshm.__version__ = "0.0.9"
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("mmshm").addHandler(Keep())
    plain = rank == 1 and peer == "plain"
    bcast = mmshm.broadcast_pyobj if plain else mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    res: dict = {"rounds": []}
    for rnd in range(2):
        if rank == 0:
            reqs = [mmshm.wrap(children.request(i, seed + rnd), min_bytes=1024) for i in range(2)]
            out = bcast(reqs, rank, None, 0)
            del reqs
        else:
            out = bcast(None, rank, None, 0)
        res["rounds"].append({"handles": len(mmshm.handles(out)), "n": len(out)})
        for i, req in enumerate(out):
            children.check_request(req, i, seed + rnd)
        del out, req
        gc.collect()
    if not plain:
        v = handshake.handshake()
        res["verdict"] = (v.ok, v.reason)
    res["warnings"] = [m for m in records if "inline" in m]
    res["sent"] = multinode.internode_bytes()
    res["group_fallbacks"] = metric("mmshm_inline_fallbacks_total", reason="group")
    res["live"] = _live_files()
    return res


def rank_dead_peer(rank: int, world: int, base: str, seed: int) -> dict:
    """2 simulated nodes, one rank each: node 1's rank goes away right after
    the broadcast's metadata reached it (its process group torn down, so its
    sockets close as a killed process's do). The source rank gets a typed
    PeerLostError, soon, and keeps nothing in its node's directory."""
    import time as _time

    import torch.distributed as dist

    _enter_node(rank, world, base, 2)

    def dies_after(data, rank_, group=None, src=0):
        out = mmshm.broadcast_pyobj(data, rank_, group, src)
        if rank_ == 1:
            dist.destroy_process_group()
            raise SystemExit("gone")
        return out

    bcast = mmshm.deferred_unwrap(dies_after)
    if rank == 1:
        try:
            bcast(None, rank, None, 0)
        except SystemExit:
            return {}
        return {"error": "did not die"}
    reqs = [mmshm.wrap(children.request(i, seed), min_bytes=1024) for i in range(2)]
    t0 = _time.monotonic()
    try:
        bcast(reqs, rank, None, 0)
        res = {"raised": None}
    except Exception as exc:  # noqa: BLE001
        res = {"raised": type(exc).__name__, "ranks": getattr(exc, "ranks", None),
               "runtime": isinstance(exc, RuntimeError), "cause": repr(exc.__cause__)}
    res["s"] = _time.monotonic() - t0
    mmshm.release(reqs)
    del reqs
    gc.collect()
    res["live"] = _live_files()
    return res


def rank_id_collision(rank: int, world: int, base: str, seed: int, how: str) -> dict:
    """2 simulated nodes (a segment directory each) that would be taken for
    one: ``how == "override"``, both given ``MMSHM_NODE_ID=7`` (as two
    machines given one value); ``"hash"``, two identities whose ids clash.
    The layout finds it, and the group goes inline, bytes equal."""
    import logging

    if how == "override":
        _enter_node(rank, world, base, 2, env={"MMSHM_NODE_ID": "7"})
    else:
        _enter_node(rank, world, base, 2)
        real = node._lookup
        node._lookup = lambda directory=None: (real(directory)[0], 7)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("mmshm").addHandler(Keep())
    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    if rank == 0:
        reqs = [mmshm.wrap(children.request(i, seed), min_bytes=1024) for i in range(2)]
        out = bcast(reqs, rank, None, 0)
        del reqs
    else:
        out = bcast(None, rank, None, 0)
    res = {"handles": len(mmshm.handles(out)), "collision": topology.layout().id_collision,
           "warnings": [m for m in records if "same node id" in m],
           "sent": multinode.internode_bytes(),
           "group_fallbacks": metric("mmshm_inline_fallbacks_total", reason="group")}
    for i, req in enumerate(out):
        children.check_request(req, i, seed)
    del out, req
    gc.collect()
    res["live"] = _live_files()
    return res


# -- multi-process tests ------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("nodes,pool,fanout", [(2, "0", False), (2, "1", False),
                                               (3, "0", False), (2, "1", True)])
def test_nodes_bytes_references_and_internode_traffic(shm_dir, monkeypatch, nodes, pool,
                                                      fanout):
    """2 nodes x 2 ranks (and 3 nodes: [0, 1], [2], [3]): the bytes are right
    on every rank, each payload crosses to every other node once, each node's
    copies count one reference per rank of that node, nothing is left over.
    With ``fanout`` the batch is 4 fan-out copies of one request: each
    segment's payload still crosses once, not once per copy."""
    monkeypatch.setenv("MMSHM_POOL", pool)
    monkeypatch.setenv("MMSHM_POOL_IDLE_S", "60")
    rounds = 2
    res = run_group(rank_nodes, WORLD, shm_dir, 21, rounds, nodes, fanout, timeout=180)
    node_of = [node.node_of_rank(r, WORLD, nodes) for r in range(WORLD)]
    assert [res[r]["node"] for r in range(WORLD)] == node_of
    ids = [res[r]["node_id"] for r in range(WORLD)]
    assert all((ids[a] == ids[b]) == (node_of[a] == node_of[b])
               for a in range(WORLD) for b in range(WORLD))
    members = {k: [r for r in range(WORLD) if node_of[r] == k] for k in range(nodes)}
    leaders = [members[k][0] for k in range(1, nodes)]
    for rnd in range(rounds):
        info = {r: res[r]["rounds"][rnd] for r in range(WORLD)}
        payload, nh = info[0]["payload"], info[0]["handles"]
        assert nh == (2 if fanout else 6) and payload > 0
        # each payload crossed to every other node once: payload x (nodes - 1),
        # not payload x (ranks - 1)
        sent = sum(info[r]["stats"]["sent_bytes"] for r in range(WORLD))
        assert sent == payload * (nodes - 1)
        assert info[0]["stats"]["sent_bytes"] == payload * (nodes - 1)
        assert info[0]["stats"]["payloads_sent"] == nh * (nodes - 1)
        assert info[0]["metric"] == payload * (nodes - 1)  # mmshm_internode_bytes_total
        for r in range(1, WORLD):
            st = info[r]["stats"]
            assert st["sent_bytes"] == 0
            assert st["received_bytes"] == (payload if r in leaders else 0), (r, st)
            # a leader makes its node's copies (from its warm pool after the first
            # round, when the pool is on); the other ranks only open segments
            made = nh if r in leaders and (rnd == 0 or pool == "0") else 0
            assert info[r]["created"] == made, (r, info[r])
        for r in range(WORLD):
            # each node's segments: one reference per rank of that node
            want = len(members[node_of[r]])
            assert info[r]["live"] == nh and info[r]["counts"] == [want], (r, info[r])
            assert info[r]["live_after"] == [], (r, info[r])
    _assert_nodes_empty(shm_dir, nodes)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.timeout(200)
def test_a_grouped_request_crosses_nodes_with_its_bytes(shm_dir):
    """Requests whose tensors share one segment (offsets), 2 nodes x 2 ranks: every
    rank reads each tensor's own bytes (checked in the rank), each tensor's
    payload crosses to the other node once, nothing is left over."""
    res = run_group(rank_nodes, WORLD, shm_dir, 41, 1, 2, False, True, timeout=180)
    info = {r: res[r]["rounds"][0] for r in range(WORLD)}
    payload, nh = info[0]["payload"], info[0]["handles"]
    assert nh == 6 and info[0]["live"] == 4  # 6 tensors in 4 segments on node 0
    assert sum(info[r]["stats"]["sent_bytes"] for r in range(WORLD)) == payload
    assert all(info[r]["live_after"] == [] for r in range(WORLD))
    _assert_nodes_empty(shm_dir, 2)


def test_foreign_handle_is_wrong_node(shm_dir):
    res = run_group(rank_foreign_handle, WORLD, shm_dir, 22, timeout=180)
    assert res[1]["ok"] is True
    for r in (2, 3):
        assert res[r]["is_local"] is False
        assert res[r]["copy=False"] == res[r]["copy=True"] == "WrongNodeError", res[r]
        assert res[r]["share"] == "WrongNodeError"
        assert res[r]["owns"] is True and res[r]["owns_after"] is False
    assert res[2]["decoy_count"] == 2  # never opened, never changed
    assert res[0]["count"] == 1
    _assert_nodes_empty(shm_dir)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_wrong_node_request_fails_on_every_rank(shm_dir):
    res = run_group(rank_wrong_node_request, WORLD, shm_dir, 23, timeout=180)
    for r in range(WORLD):
        assert res[r]["errors"] == {1: ("wrong_node", [0, 1, 2, 3])}, (r, res[r])
    _assert_nodes_empty(shm_dir)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_failures_on_one_node_agreed_by_all_ranks(shm_dir):
    res = run_group(rank_node_failures, WORLD, shm_dir, 24, timeout=180)
    expected = {3: ("not_found", [0, 1, 2, 3]), 4: ("malformed", [1])}
    for r in range(WORLD):
        assert res[r]["errors"] == expected, (r, res[r]["errors"])
        assert res[r]["live"] == [], (r, res[r])
    # node 1's full directory: inline there only, counted once, on its leader
    assert [res[r]["fallbacks"] for r in range(WORLD)] == [0, 0, 1, 0]
    # what the source could read went to node 1 once (request 3's segment was gone)
    assert res[0]["sent"] == res[0]["payload"]
    assert res[2]["received"] == res[0]["payload"]
    # and request 1's payload on from the leader to its node's other rank
    assert res[3]["received"] == SIZES[1]
    assert sum(res[r]["sent"] for r in (1, 2, 3)) == 0
    _assert_nodes_empty(shm_dir)


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_one_node_pays_one_gather_and_nothing_else(shm_dir):
    res = run_group(rank_one_node, 2, 25, None, timeout=120)
    for r in range(2):
        assert res[r]["single"] is True and res[r]["nodes"] == [[0, 1]]
        # 3 calls: only the first one's agreement crosses gloo (the other rank's
        # vector to rank 0 and the maximum back), and it sets up the shared-memory
        # agreement (mmshm.transport.shmagree) that the next two use: no gloo message at all
        assert res[r]["calls"] == {"gather": 1, "p2p": 0, "agree": 2}, res[r]
        assert res[r]["sent"] == 0
    assert segment_files() == []


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_two_segment_directories_are_two_nodes(shm_dir):
    """Without any override, ranks that cannot open each other's segments
    (different directories) are different nodes: the payload crosses once."""
    dirs = [os.path.join(shm_dir, "a"), os.path.join(shm_dir, "b")]
    for d in dirs:
        os.mkdir(d, 0o700)
    res = run_group(rank_one_node, 2, 26, dirs, timeout=120)
    for r in range(2):
        assert res[r]["single"] is False and res[r]["nodes"] == [[0], [1]]
        assert res[r]["calls"]["gather"] == 1
    assert res[0]["sent"] == res[0]["payload"] > 0 and res[1]["sent"] == 0
    for d in dirs:
        assert segment_files(d) == []


# -- in-process: identity, wire, handles --------------------------------------------
def test_system_identity_parts(shm_dir, monkeypatch):
    monkeypatch.delenv("MMSHM_NODE_ID", raising=False)
    config.reload()
    ident = node.identity()
    st = os.stat(shm_dir)
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert ident == (f"boot={boot};ipc={os.stat('/proc/self/ns/ipc').st_ino};"
                     f"mnt={os.stat('/proc/self/ns/mnt').st_ino};dir={st.st_dev}:{st.st_ino}")
    nid = node.node_id()
    assert 0 <= nid < 2**32 and node.node_id() == nid and node.node_id(shm_dir) == nid
    other = os.path.join(shm_dir, "other")
    os.mkdir(other)
    assert node.node_id(other) != nid  # another directory is another node


def test_node_id_override(shm_dir, monkeypatch):
    monkeypatch.setenv("MMSHM_NODE_ID", "5")
    config.reload()
    assert node.node_id() == 5 and node.identity() == "override=5"
    other = os.path.join(shm_dir, "other")
    os.mkdir(other)
    assert node.node_id(other) == 5  # the override is the whole identity
    monkeypatch.setenv("MMSHM_NODE_ID", "rack3-host7")
    config.reload()
    nid = node.node_id()
    assert 0 <= nid < 2**32 and nid == node.node_id()
    monkeypatch.setenv("MMSHM_NODE_ID", str(2**32))  # too large to be an id: hashed
    config.reload()
    assert node.node_id() < 2**32


def test_status_and_doctor_show_this_node(shm_dir, monkeypatch):
    """`mmshm status` and `doctor` say which node they see: on each node of a
    multi-node server, each shows its own id (the one its handles carry)."""
    from click.testing import CliRunner
    from mmshm.cli import main

    other = os.path.join(shm_dir, "other")
    os.mkdir(other)
    seen = {}
    for d in (shm_dir, other):
        monkeypatch.setenv("MMSHM_DIR", d)
        config.reload()
        for cmd in ("status", "doctor"):
            r = CliRunner().invoke(main, [cmd, "--json"])
            got = msgspec.json.decode(r.output)["node"]
            assert got["id"] == node.node_id(d) and got["identity"] == node.identity(d), got
            seen[(d, cmd)] = got["id"]
        r = CliRunner().invoke(main, ["status"])
        assert f"node: 0x{node.node_id(d):08x} on " in r.output, r.output
    # two segment directories are two nodes, and both commands agree on each
    assert seen[(shm_dir, "status")] == seen[(shm_dir, "doctor")]
    assert seen[(shm_dir, "status")] != seen[(other, "status")]


def test_layout_and_rank_blocks():
    lay = topology.Layout.from_identities(["b", "b", "a", "a", "b"])
    assert lay.nodes == ((0, 1, 4), (2, 3)) and lay.node_of == (0, 0, 1, 1, 0)
    assert not lay.single and lay.num_nodes == 2
    assert lay.leader(1, 0) == 2 and lay.leader(0, 4) == 4 and lay.leader(0, 2) == 0
    assert topology.Layout.from_identities(["x"] * 3).single
    assert [node.node_of_rank(r, 4, 2) for r in range(4)] == [0, 0, 1, 1]
    assert [node.node_of_rank(r, 5, 2) for r in range(5)] == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError):
        node.node_of_rank(0, 2, 3)


def test_simulated_env(shm_dir, monkeypatch):
    env = node.simulated_env(shm_dir, 1)
    assert env == {"MMSHM_DIR": os.path.join(shm_dir, "node1"), "MMSHM_NODE_ID": "1"}
    assert os.path.isdir(env["MMSHM_DIR"])
    for var in env:
        monkeypatch.setenv(var, os.environ.get(var, ""))  # restored after the test
    node.simulate(shm_dir, 1)
    assert config.get().dir == env["MMSHM_DIR"] and node.node_id() == 1


def test_handle_carries_its_node_on_the_wire(shm_dir):
    t = torch.arange(50_000, dtype=torch.float32)
    h = mmshm.ShmTensor.from_tensor(t)
    assert h.node == node.node_id() and h.is_local()
    wire = h.encode()
    fields = msgspec.msgpack.decode(wire)
    assert fields[0] == h.name[len("mmshm-"):] and fields[-1] == h.node
    assert codec.decode(wire) == h.meta
    # an older six-field wire (full name, no node) decodes as this node's
    legacy = msgspec.msgpack.encode([h.name, h.nbytes, 0, [50_000], h.hash, h.meta.gen])
    assert codec.decode(legacy) == h.meta
    with pytest.raises(mmshm.HandleError):
        codec.decode(msgspec.msgpack.encode([h.name, h.nbytes, 0, [50_000], h.hash, 0, -1]))
    with pytest.raises(mmshm.HandleError):
        codec.decode(msgspec.msgpack.encode([h.name, h.nbytes, 0, [50_000], h.hash, 0, 2**32]))
    again = pickle.loads(pickle.dumps(h))  # no share(): the unpickled one is not owned
    again.disown()
    assert again.node == h.node
    h.release()


def test_wire_size_of_a_720p_handle_with_its_node():
    meta = HandleMeta(f"mmshm-{2**22}-0123456789abcdef", 4784 * 1176 * 4, 0, (4784, 1176),
                      b"\x01" * 16, 3, 2**32 - 1)
    data = codec.encode(meta)
    assert codec.decode(data) == meta
    assert len(data) == 63


def test_foreign_handle_in_process_is_never_opened(shm_dir):
    t = torch.arange(50_000, dtype=torch.float32)
    h = mmshm.ShmTensor.from_tensor(t)
    foreign = mmshm.ShmTensor(msgspec.structs.replace(h.meta, node=(h.node + 1) % 2**32))
    assert not foreign.is_local()
    for copy in (False, True):
        with pytest.raises(mmshm.WrongNodeError) as ei:
            foreign.materialize(copy=copy)
        assert isinstance(ei.value, mmshm.HandleError)
        assert mmshm.errors.failure_reason(ei.value) == "wrong_node"
    with pytest.raises(mmshm.WrongNodeError):
        foreign.share(1)
    foreign.release()  # dropped without touching this node's segment of that name
    assert refcount(h.name) == 1
    assert torch.equal(h.materialize(copy=True), t)
    assert segment_files() == []


def test_from_writer(shm_dir):
    t = make_tensor(27, (64, 512))

    def write(dst):
        dst.copy_(t.reshape(-1).view(torch.uint8))

    h = mmshm.ShmTensor.from_writer(t.numel() * 4, torch.float32, tuple(t.shape), write)
    assert h.hash == mmshm.content_hash(t)
    assert same(h.materialize(copy=True), t)
    with pytest.raises(mmshm.HandleError):
        mmshm.ShmTensor.from_writer(10, torch.float32, (3,), write)

    def fail(dst):
        raise ConnectionError("peer went away")

    with pytest.raises(ConnectionError):
        mmshm.ShmTensor.from_writer(4096, torch.uint8, (4096,), fail)
    z = mmshm.ShmTensor.from_writer(0, torch.float16, (0, 3), fail)  # not called
    assert z.materialize().shape == (0, 3)
    gc.collect()
    assert segment_files() == []


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("peer", ["plain", "other"])
def test_version_skew_goes_inline_never_wrong_bytes(shm_dir, monkeypatch, peer):
    """A node without mmshm, or with another version, is found by the
    handshake before any of mmshm's collectives: the group carries its
    tensors inline (bytes equal on both ranks), with a WARNING naming the
    rank, and nothing is left in either node's directory."""
    monkeypatch.setenv("MMSHM_HANDSHAKE_S", "3")
    res = run_group(rank_skew, 2, shm_dir, 31, peer, timeout=150)
    for r in (0, 1):
        assert res[r]["rounds"] == [{"handles": 0, "n": 2}] * 2, (r, res[r])
        assert res[r]["sent"] == 0  # no payload went over the multi-node path
        assert res[r]["live"] == [], (r, res[r])
    ok, reason = res[0]["verdict"]
    assert ok is False
    if peer == "plain":
        assert "rank(s) [1] announced no mmshm within 3 s" in reason, reason
    else:
        assert "the ranks run different mmshm: rank 0 on " in reason, reason
        assert f": mmshm 0.0.9 (protocol {handshake.PROTOCOL})" in reason, reason
        assert mmshm.__version__ in reason, reason
        assert res[1]["verdict"] == res[0]["verdict"]  # one verdict for the group
        assert len(res[1]["warnings"]) == 1
    assert len(res[0]["warnings"]) == 1 and "ranks [0, 1]" in res[0]["warnings"][0]
    # counted where they went inline: the source's 3 handles a round, 2 rounds
    assert res[0]["group_fallbacks"] == 6 and res[1].get("group_fallbacks", 0) == 0
    _assert_nodes_empty(shm_dir, 2)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_dead_remote_rank_is_a_bounded_typed_failure(shm_dir):
    """A remote rank that dies after the broadcast: PeerLostError (a
    RuntimeError, as the torch.distributed error it wraps) within the
    process group's timeout, and the source node keeps no segment."""
    res = run_group(rank_dead_peer, 2, shm_dir, 41, timeout=90)
    assert res[1] == {}
    r = res[0]
    assert r["raised"] == "PeerLostError" and r["runtime"] and r["ranks"] == [1], r
    assert r["s"] < 30, r  # run_group's groups time out after 30 s; a closed socket is at once
    assert r["live"] == [], r
    _assert_nodes_empty(shm_dir, 2)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["override", "hash"])
def test_node_id_collision_goes_inline(shm_dir, how):
    """Two nodes taken for one could not tell each other's handles apart:
    one MMSHM_NODE_ID over two segment directories (the system's facts
    differ), or two identities with one id. The layout finds it on every
    rank and the group carries its tensors inline, counted, with a WARNING
    naming the fix; before, the override case failed every request with
    ``not_found`` on the other node."""
    res = run_group(rank_id_collision, 2, shm_dir, 51, how, timeout=90)
    for r in (0, 1):
        assert res[r]["collision"] is True and res[r]["handles"] == 0, res[r]
        assert res[r]["sent"] == 0 and res[r]["live"] == [], res[r]
        assert len(res[r]["warnings"]) == 1 and "MMSHM_NODE_ID" in res[r]["warnings"][0]
    assert res[0]["group_fallbacks"] == 3  # the 2 requests' 3 handles, inline
    _assert_nodes_empty(shm_dir, 2)
    lay = topology.Layout.from_identities(["a", "b", "a"], [1, 2, 1])
    assert not lay.id_collision and lay.nodes == ((0, 2), (1,))
    assert topology.Layout.from_identities(["a", "b"], [3, 3]).id_collision


@pytest.mark.parametrize("raw, want", [("5", 5.0), ("3600", 3600.0), ("1e14", 60.0),
                                       ("abc", 60.0), ("0", 60.0), ("-1", 60.0)])
def test_handshake_wait_is_bounded(monkeypatch, raw, want):
    """MMSHM_HANDSHAKE_S takes seconds above 0 and at most an hour: a value
    past what a store wait can hold (1e14 s overflows its timedelta) would
    have turned the wait into none; it gets the default and a WARNING."""
    monkeypatch.setenv("MMSHM_HANDSHAKE_S", raw)
    assert config.reload().handshake_s == want
    bad = raw in ("1e14", "abc", "0", "-1")
    assert bool(config.problems()) == bad, config.problems()
