"""Spawn targets of the core tests: TP ranks, hand-overs, faults.

Each runs in a child started by :mod:`tests.harness.procs` (``run_group``
for the ranks of a gloo group: ``target(rank, world, *args)``;
``run_child``/``run_children``/``spawn`` for the others), so each lives at
the top level of this module, importable by name. The requests are shaped
like SGLang's (``mm_inputs.mm_items[j].feature``) and rebuilt alike in every
process from a seed (:func:`request`, :func:`check_request`).
"""

from __future__ import annotations

import gc
import os
import pickle
import time
import traceback

from tests.harness.metrics import metric
from tests.harness.segments import header, refcount, seg_dir, segment_files
from tests.harness.tensors import make_tensor, same


# -- children: TP ranks ------------------------------------------------------------
def request(i: int, seed: int):
    """A request shaped like SGLang's: mm_inputs.mm_items[j].feature."""
    import torch

    dtypes = (torch.float32, torch.bfloat16, torch.uint8, torch.float16)
    items = [{"modality": "image", "feature": make_tensor(seed * 100 + i * 10 + j,
                                                       (32 + j, 257), dtypes[(i + j) % 4])}
             for j in range(1 + i % 2)]
    return {"rid": f"req-{i}", "input_ids": list(range(8)),
            "mm_inputs": {"mm_items": items, "small": torch.arange(4)}}


def check_request(got, i: int, seed: int) -> None:
    import torch

    want = request(i, seed)
    assert got["rid"] == want["rid"]
    assert len(got["mm_inputs"]["mm_items"]) == len(want["mm_inputs"]["mm_items"])
    for a, b in zip(got["mm_inputs"]["mm_items"], want["mm_inputs"]["mm_items"]):
        assert isinstance(a["feature"], torch.Tensor), type(a["feature"])
        assert same(a["feature"], b["feature"]), f"request {i}: wrong bytes"
    assert torch.equal(got["mm_inputs"]["small"], want["mm_inputs"]["small"])


def rank_broadcast(rank: int, world: int, n_req: int, seed: int) -> dict:
    """TP broadcast with deferred unwrap: bytes correct on every rank, and the
    header count equals ``world`` while every rank holds its views."""
    import mmshm
    import torch.distributed as dist

    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    names: list[str] = []
    handed = metric("mmshm_references_handed_total", path="broadcast")
    if rank == 0:
        reqs = [mmshm.wrap(request(i, seed), min_bytes=1024) for i in range(n_req)]
        names = [h.name for h in mmshm.handles(reqs)]
        assert len(names) == sum(1 + i % 2 for i in range(n_req))
        # a request's items share one segment: one reference per handle
        assert all(refcount(n) == names.count(n) for n in names)
        out = bcast(reqs, rank, None, 0)
    else:
        out = bcast(None, rank, None, 0)
    assert len(out) == n_req
    for i, req in enumerate(out):
        check_request(req, i, seed)
    assert not mmshm.handles(out)
    # verification only (not part of the transport): all ranks hold their views
    dist.barrier()
    counts = [refcount(n) for n in names]
    dist.barrier()
    del out
    gc.collect()
    handed = metric("mmshm_references_handed_total", path="broadcast") - handed
    return {"counts": counts, "names": names, "handed": handed}


def rank_early_unlink(rank: int, world: int, seed: int, delay_s: float) -> dict:
    """Rank 0 materializes with copy=True (its reference is released at once,
    inside the wrapper) while rank 1 sleeps, then waits until rank 0's release is
    visible in the header before it opens: no barrier anywhere."""
    import mmshm

    waited = {"count_seen": None}

    def slow_broadcast(data, rank_, group=None, src=0):
        out = mmshm.broadcast_pyobj(data, rank_, group, src)
        if rank_ == 1:
            time.sleep(delay_s)
            names = [h.name for h in mmshm.handles(out)]
            deadline = time.monotonic() + 20
            # rank 0 has released its reference: only the references handed
            # out for the other ranks keep the segment alive now
            # (a request's items share one segment: one reference per handle)
            while any(refcount(n) != (world - 1) * names.count(n) for n in names):
                assert time.monotonic() < deadline, [refcount(n) for n in names]
                time.sleep(0.01)
            waited["count_seen"] = [refcount(n) for n in names]
        return out

    bcast = mmshm.deferred_unwrap(slow_broadcast, copy=(rank == 0))
    if rank == 0:
        reqs = [mmshm.wrap(request(i, seed), min_bytes=1024) for i in range(3)]
        names = [h.name for h in mmshm.handles(reqs)]
        out = bcast(reqs, rank, None, 0)
    else:
        names = []
        out = bcast(None, rank, None, 0)
    for i, req in enumerate(out):
        check_request(req, i, seed)
    del out
    gc.collect()
    return {"names": names, "count_seen": waited["count_seen"]}


def missing_handle():
    """A handle naming a segment that does not exist (well-formed metadata)."""
    import mmshm
    from mmshm.segments.codec import HandleMeta
    from mmshm.segments.segfile import PREFIX

    meta = HandleMeta(f"{PREFIX}{os.getpid()}-00000000deadbeef", 4096, 0, (1024,), b"\0" * 16)
    return mmshm.ShmTensor(meta)


def rank_failures(rank: int, world: int, seed: int, bad_rank: int) -> dict:
    """Requests: 0 good, 1 names a missing segment (fails everywhere), 2 good,
    3 inline only, 4 broken on ``bad_rank`` only. Every rank must return the
    same MaterializeErrors at 1 and 4 and correct tensors elsewhere."""
    import mmshm

    def one_rank_breaks(data, rank_, group=None, src=0):
        out = mmshm.broadcast_pyobj(data, rank_, group, src)
        if rank_ == bad_rank:
            req = out[4]
            for item in req["mm_inputs"]["mm_items"]:
                item["feature"].release()  # give back this rank's reference
                item["feature"] = mmshm.ShmTensor(
                    None, error=mmshm.HandleError("corrupted in transit on this rank"))
        return out

    bcast = mmshm.deferred_unwrap(one_rank_breaks)
    names: list[str] = []
    if rank == 0:
        reqs = [mmshm.wrap(request(i, seed), min_bytes=1024) for i in range(5)]
        # request 1: its handles name a segment that is gone
        for item in reqs[1]["mm_inputs"]["mm_items"]:
            item["feature"].release()
            item["feature"] = missing_handle()
        # request 3: everything inline (below the threshold)
        reqs[3] = request(3, seed)
        names = [h.name for i in (0, 2, 4) for h in mmshm.handles(reqs[i])]
        # a broadcast that fails gives back the references it handed out
        def broken_broadcast(*args, **kwargs):
            raise ConnectionError("peer went away")

        try:
            mmshm.deferred_unwrap(broken_broadcast)([reqs[0], reqs[2], reqs[4]], rank, None, 0)
        except ConnectionError:
            pass
        else:
            raise AssertionError("the broadcast error was swallowed")
        assert [refcount(n) for n in names] == [1] * len(names)
        assert all(h.owns_reference for i in (0, 2, 4) for h in mmshm.handles(reqs[i]))
        out = bcast(reqs, rank, None, 0)
    else:
        out = bcast(None, rank, None, 0)
    assert len(out) == 5
    errors = {}
    for i, r in enumerate(out):
        if isinstance(r, mmshm.MaterializeError):
            errors[i] = (r.reason, list(r.ranks) if r.ranks is not None else None)
            assert not any(h.owns_reference for h in mmshm.handles(r.request))
        else:
            check_request(r, i, seed)
    del out
    gc.collect()
    return {"errors": errors, "names": names}


def rank_wrong_dir(rank: int, world: int, seed: int, dirs: list) -> dict:
    """Rank r uses MMSHM_DIR=dirs[r]: a rank that cannot see the segments."""
    import mmshm
    from mmshm import config
    from mmshm.segments import node

    os.environ["MMSHM_DIR"] = dirs[rank]
    config.reload()
    # the ranks are told they are one node (MMSHM_NODE_ID) and the system's
    # facts are made to agree, so that the layout cannot see the two
    # directories (it would make the group go inline: tests/test_multinode.py)
    node.system_facts = lambda directory=None: "one node"
    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    if rank == 0:
        reqs = [mmshm.wrap(request(0, seed), min_bytes=1024), request(1, seed)]
        out = bcast(reqs, rank, None, 0)
    else:
        out = bcast(None, rank, None, 0)
    errors = {}
    for i, r in enumerate(out):
        if isinstance(r, mmshm.MaterializeError):
            errors[i] = (r.reason, list(r.ranks) if r.ranks is not None else None)
        else:
            check_request(r, i, seed)
    del out
    gc.collect()
    return {"errors": errors}


# -- children: hand-overs without torch.distributed ------------------------------
def open_pickled(blob: bytes, seed: int, shape, dtype_name: str, churn: int = 0) -> dict:
    """Unpickle a handle (its reference was handed out by the giver), add and
    drop ``churn`` references (concurrently with the other holders), then
    materialize it; report whether the bytes are right."""
    import mmshm  # noqa: F401 - the unpickler needs it anyway
    import torch

    h = pickle.loads(blob)
    name = h.name
    for _ in range(churn):
        h.clone().release()
    t = h.materialize()
    ok = same(t, make_tensor(seed, tuple(shape), getattr(torch, dtype_name)))
    del t
    gc.collect()
    return {"name": name, "ok": ok}


def hash_pickled(blob: bytes) -> dict:
    """Unpickle a handle that carries no hash, read its hash (computed here
    from the segment), then materialize it; report both hashes."""
    import mmshm

    h = pickle.loads(blob)
    carried = h.meta.hash
    digest = h.hash
    t = h.materialize()
    out = {"carried": carried, "hash": digest, "of_view": mmshm.content_hash(t)}
    del t
    gc.collect()
    return out


def chain_stage(inq, outq, resq, stage: int, seed: int, shape, dtype_name: str) -> None:
    """One hop of a hand-over chain: receive pickled bytes, hand out one
    reference for the next holder, pass the bytes on, drop this holder's
    handle. The last stage materializes and checks the bytes."""
    import mmshm
    import torch

    try:
        blob = inq.get(timeout=60)
        h = pickle.loads(blob)
        info = {"stage": stage, "name": h.name, "files": segment_files(),
                "created": metric("mmshm_segments_created_total")}
        if outq is not None:
            h.share(1)
            info["count_after_share"] = refcount(h.name)
            outq.put(pickle.dumps(h))
            del h
            gc.collect()
        else:
            info["count_before_materialize"] = refcount(h.name)
            t = h.materialize()
            info["ok"] = same(t, make_tensor(seed, tuple(shape), getattr(torch, dtype_name)))
            info["handle_owns"] = h.owns_reference
            del t, h
            gc.collect()
        info["created_at_end"] = metric("mmshm_segments_created_total")
        info["mmshm_version"] = mmshm.__version__
        resq.put((stage, "ok", info))
    except BaseException:  # noqa: BLE001
        resq.put((stage, "error", traceback.format_exc()))


# -- children: faults ----------------------------------------------------------------
def consume_truncated(blob: bytes) -> dict:
    """Open a handle whose segment was truncated by a third party (this
    process is not the creator, so attach validates the file)."""
    import mmshm

    h = pickle.loads(blob)
    out = {}
    for copy in (False, True):
        try:
            t = h.materialize(copy=copy)
            out[copy] = f"no error: sum={float(t.double().sum())}"
        except Exception as exc:  # noqa: BLE001
            out[copy] = type(exc).__name__
            out[f"{copy}-is-corrupt"] = isinstance(exc, mmshm.SegmentCorruptError)
    out["owns_after"] = h.owns_reference
    h.release()
    return out


def truncate_in_creator(keep_bytes: int) -> dict:
    """The creating process materializes its own, truncated segment."""
    import mmshm
    import torch
    from mmshm.segments import segfile

    t = torch.arange(100_000, dtype=torch.float32)
    out = {}
    for copy in (False, True):
        h = mmshm.ShmTensor.from_tensor(t)
        os.truncate(os.path.join(seg_dir(), h.name), segfile.HEADER_SIZE + keep_bytes)
        try:
            v = h.materialize(copy=copy)
            out[copy] = f"no error: equal={torch.equal(v, t)}"
            del v
        except Exception as exc:  # noqa: BLE001
            out[copy] = type(exc).__name__
        h.release()
        gc.collect()
    out["left"] = segment_files()
    return out


def truncate_header_then_sweep() -> dict:
    """A third party truncates a live segment to 0 bytes; the creator then
    runs its periodic sweep and creates another segment. Must not SIGBUS."""
    import mmshm
    import torch
    from mmshm.segments.table import TABLE

    t = torch.arange(100_000, dtype=torch.float32)
    h = mmshm.ShmTensor.from_tensor(t)
    os.truncate(os.path.join(seg_dir(), h.name), 0)
    TABLE.sweep()
    h2 = mmshm.ShmTensor.from_tensor(t)  # create() sweeps too
    back = h2.materialize(copy=True)
    h.release()
    return {"ok": bool(torch.equal(back, t))}


def rank_shared_handles(rank: int, world: int, seed: int) -> dict:
    """Two requests of one batch share their handle objects, as copies made
    with ``copy.copy`` (SGLang's parallel sampling) share ``mm_items``."""
    import copy

    import mmshm

    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    names: list[str] = []
    if rank == 0:
        req = mmshm.wrap(request(1, seed), min_bytes=1024)
        twin = copy.copy(req)  # shares mm_inputs, hence the handle objects
        names = [h.name for h in mmshm.handles(req)]
        out = bcast([req, twin], rank, None, 0)
    else:
        out = bcast(None, rank, None, 0)
    kinds = [type(r).__name__ for r in out]
    for r in out:
        if not isinstance(r, mmshm.MaterializeError):
            check_request(r, 1, seed)
    del out
    gc.collect()
    return {"kinds": kinds, "names": names}


def mappings_of(name: str) -> int:
    """How many mappings of segment file ``name`` this process has."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith("/" + name))


def _is_data_segment(name: str) -> bool:
    from mmshm.errors import SegmentError

    try:
        header(name)
    except (OSError, SegmentError):
        return False
    return True


def rank_fanout_one_mapping(rank: int, world: int, seed: int, n: int) -> dict:
    """A request fanned out into ``n`` copies (each sent with its own handles)
    is broadcast in one batch: each rank maps each segment once, gives every
    copy its own tensor object, and holds one reference per segment."""
    import mmshm

    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    if rank == 0:
        req = mmshm.wrap(request(1, seed), min_bytes=1024)
        copies = mmshm.fan_out(req, n, min_bytes=1024)
        mmshm.release(req)
        out = bcast(copies, rank, None, 0)
        del copies, req
    else:
        out = bcast(None, rank, None, 0)
    for r in out:
        check_request(r, 1, seed)
    feats = [[it["feature"] for it in r["mm_inputs"]["mm_items"]] for r in out]
    ptrs = [[f.data_ptr() for f in fs] for fs in feats]
    tensors = len({id(f) for fs in feats for f in fs})
    # the data segments only: the deferred unwrap's agreement file (mmshm.transport.shmagree)
    # sits in the same directory under the same prefix while an agreement runs
    segs = [s_ for s_ in segment_files() if _is_data_segment(s_)]
    maps = {s_: mappings_of(s_) for s_ in segs}
    refs = {s_: refcount(s_) for s_ in segs}
    # a write by one copy is seen by its twins on this rank, and by no other rank
    before = float(feats[0][0].view(-1)[0])
    feats[0][0].view(-1)[0] += 1
    seen = [float(fs[0].view(-1)[0]) != before for fs in feats]
    del out, feats
    gc.collect()
    return {"ptrs": ptrs, "tensors": tensors, "maps": maps, "refs": refs, "seen": seen}


def rank_subgroups(rank: int, world: int, seed: int) -> dict:
    """Two TP groups of two ranks ([0, 1] and [2, 3], as with DP=2), each
    broadcasting from its lowest global rank. In group [2, 3], rank 3 cannot
    materialize request 0 in round 0: both of its ranks fail that request
    (the agreement names group rank 1), group [0, 1] is untouched, and no
    segment is left."""
    import mmshm
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    g = rank // 2
    mine, src = groups[g], 2 * g

    def breaks_on_rank_3(data, rank_, group=None, src_=0):
        out = mmshm.broadcast_pyobj(data, rank_, group, src_)
        if rank_ == 3 and breaks_on_rank_3.armed:
            for item in out[0]["mm_inputs"]["mm_items"]:
                item["feature"].release()
                item["feature"] = mmshm.ShmTensor(
                    None, error=mmshm.HandleError("corrupted in transit on rank 3"))
        return out

    bcast = mmshm.deferred_unwrap(breaks_on_rank_3)
    failures = []
    for rnd in range(2):
        breaks_on_rank_3.armed = rnd == 0
        s = seed + rnd + 10 * g
        if rank == src:
            reqs = [mmshm.wrap(request(i, s), min_bytes=1024) for i in range(3)]
            out = bcast(reqs, rank, mine, src)
            del reqs
        else:
            out = bcast(None, rank, mine, src)
        for i, r in enumerate(out):
            if isinstance(r, mmshm.MaterializeError):
                failures.append((rnd, i, r.reason, r.ranks))
            else:
                check_request(r, i, s)
        del out
        gc.collect()
        dist.barrier(group=mine)  # verification only: both ranks dropped their views
    return {"failures": failures}
