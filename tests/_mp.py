"""Helpers shared by the core tests, and the child-process entry points.

Children are started from the ``spawn`` context, so every function a child
runs lives here, at top level, importable by name. Children inherit
``MMSHM_DIR`` (and the other ``MMSHM_*`` settings) through ``os.environ``.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback
from datetime import timedelta

SHM_ROOT = "/dev/shm"

# pids of every child the tests started (the conftest's /dev/shm check uses them)
SPAWNED_PIDS: set[int] = set()


# -- inspection helpers (parent and children) ----------------------------------
def seg_dir() -> str:
    from mmshm import config

    return config.get().dir


def seg_files(directory: str | None = None) -> list[str]:
    """Names of ``mmshm-*`` entries (files, links, anything) in ``directory``."""
    d = directory or seg_dir()
    try:
        return sorted(n for n in os.listdir(d) if n.startswith("mmshm-"))
    except FileNotFoundError:
        return []


def header(name: str, directory: str | None = None) -> tuple:
    """The decoded header of segment ``name``: (magic, version, state,
    payload size, refcount, creator pid, created ns, reserved)."""
    from mmshm.segments import segfile

    path = os.path.join(directory or seg_dir(), name)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return segfile.read_header(fd, path)
    finally:
        os.close(fd)  # OFD locks: closing this descriptor drops nobody's lock


def refcount(name: str, directory: str | None = None) -> int:
    """The reference count stored in the segment's header."""
    return header(name, directory)[4]


def metric(name: str, **labels) -> float:
    """Current value of a Prometheus sample in the default registry (0 if unset)."""
    from prometheus_client import REGISTRY

    v = REGISTRY.get_sample_value(name, labels or None)
    return 0.0 if v is None else v


def fallbacks_total() -> float:
    """Sum of ``mmshm_inline_fallbacks_total`` over every reason."""
    from prometheus_client import REGISTRY

    total = 0.0
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if s.name == "mmshm_inline_fallbacks_total":
                total += s.value
    return total


def as_bytes(t):
    """A tensor's bytes in C order as a flat uint8 tensor (NaN-safe compare)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same(a, b) -> bool:
    """Same shape, dtype and bytes."""
    import torch

    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(as_bytes(a), as_bytes(b)))


def make_tensor(seed: int, shape=(64, 300), dtype=None):
    """A deterministic tensor; every process rebuilds the same one from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)


def signal_name(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# -- process management (parent) ----------------------------------------------
def ctx():
    return mp.get_context("spawn")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(target, *args) -> mp.Process:
    p = ctx().Process(target=target, args=args, daemon=True)
    p.start()
    SPAWNED_PIDS.add(p.pid)
    return p


def stop_all(procs, timeout: float = 10.0) -> None:
    """Join every process; kill the ones that do not exit in time."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def collect(q, n: int, timeout: float, procs=(), killed=()) -> list:
    """Read ``n`` results ``(key, status, payload)`` from ``q``; fail with the
    child's traceback on an error, or with the exit codes on a timeout.
    ``killed``: processes expected to die by SIGKILL (not a failure)."""
    import queue

    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        try:
            item = q.get(timeout=0.25)
        except queue.Empty:
            dead = [p for p in procs
                    if p.exitcode not in (None, 0) and not (p in killed and p.exitcode == -9)]
            if dead or time.monotonic() > deadline:
                states = ", ".join(f"pid {p.pid}: {signal_name(p.exitcode)}" for p in procs)
                raise AssertionError(f"children did not report ({len(out)}/{n}): {states}")
            continue
        key, status, payload = item
        if status != "ok":
            raise AssertionError(f"child {key} failed:\n{payload}")
        out.append((key, payload))
    return out


def run_group(target, world: int, *args, timeout: float = 90.0, killed=()) -> dict:
    """Run ``target(rank, world, *args)`` on ``world`` spawned processes joined
    in a gloo process group on 127.0.0.1; return ``{rank: result}``.

    Asserts that every child reported success and exited with code 0, but
    the ranks in ``killed``, which must die by SIGKILL (report nothing)."""
    c = ctx()
    q = c.Queue()
    port = free_port()
    procs = [c.Process(target=_rank_main, args=(target, rank, world, port, q, args), daemon=True)
             for rank in range(world)]
    dying = [procs[r] for r in killed]
    try:
        for p in procs:
            p.start()
            SPAWNED_PIDS.add(p.pid)
        res = dict(collect(q, world - len(dying), timeout, procs, dying))
    finally:
        stop_all(procs)
    for r, p in enumerate(procs):
        want = -signal.SIGKILL if r in killed else 0
        assert p.exitcode == want, f"rank {r} pid {p.pid}: {signal_name(p.exitcode)}"
    return res


def _rank_main(target, rank, world, port, q, args) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=30))
        try:
            result = target(rank, world, *args)
        finally:
            gc.collect()
        q.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_children(target, arglist, timeout: float = 60.0) -> list:
    """Run ``target(*args)`` for each ``args`` of ``arglist``, each in its own
    spawned process, all at once; return the results in order. Asserts that
    every child reported success and exited with code 0."""
    c = ctx()
    q = c.Queue()
    procs = [c.Process(target=_keyed_main, args=(i, target, q, args), daemon=True)
             for i, args in enumerate(arglist)]
    try:
        for p in procs:
            p.start()
            SPAWNED_PIDS.add(p.pid)
        res = dict(collect(q, len(procs), timeout, procs))
    finally:
        stop_all(procs)
    for p in procs:
        assert p.exitcode == 0, f"child pid {p.pid}: {signal_name(p.exitcode)}"
    return [res[i] for i in range(len(procs))]


def _keyed_main(key, target, q, args) -> None:
    try:
        q.put((key, "ok", target(*args)))
    except BaseException:  # noqa: BLE001
        q.put((key, "error", traceback.format_exc()))


def run_child(target, *args, timeout: float = 60.0):
    """Run ``target(*args)`` in one spawned process and return
    ``(result, exitcode)``; result is None if the child died before reporting."""
    import queue

    c = ctx()
    q = c.Queue()
    p = c.Process(target=_child_main, args=(target, q, args), daemon=True)
    p.start()
    SPAWNED_PIDS.add(p.pid)
    result = None
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, payload = q.get(timeout=0.25)
                if status != "ok":
                    raise AssertionError(f"child failed:\n{payload}")
                result = payload
                break
            except queue.Empty:
                if p.exitcode is not None or time.monotonic() > deadline:
                    break
    finally:
        stop_all([p])
    return result, p.exitcode


def _child_main(target, q, args) -> None:
    try:
        q.put(("ok", target(*args)))
    except BaseException:  # noqa: BLE001
        q.put(("error", traceback.format_exc()))


# -- children: TP ranks ------------------------------------------------------------
def _request(i: int, seed: int):
    """A request shaped like SGLang's: mm_inputs.mm_items[j].feature."""
    import torch

    dtypes = (torch.float32, torch.bfloat16, torch.uint8, torch.float16)
    items = [{"modality": "image", "feature": make_tensor(seed * 100 + i * 10 + j,
                                                       (32 + j, 257), dtypes[(i + j) % 4])}
             for j in range(1 + i % 2)]
    return {"rid": f"req-{i}", "input_ids": list(range(8)),
            "mm_inputs": {"mm_items": items, "small": torch.arange(4)}}


def _check_request(got, i: int, seed: int) -> None:
    import torch

    want = _request(i, seed)
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
        reqs = [mmshm.wrap(_request(i, seed), min_bytes=1024) for i in range(n_req)]
        names = [h.name for h in mmshm.handles(reqs)]
        assert len(names) == sum(1 + i % 2 for i in range(n_req))
        assert all(refcount(n) == 1 for n in names)
        out = bcast(reqs, rank, None, 0)
    else:
        out = bcast(None, rank, None, 0)
    assert len(out) == n_req
    for i, req in enumerate(out):
        _check_request(req, i, seed)
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
            while any(refcount(n) != world - 1 for n in names):
                assert time.monotonic() < deadline, [refcount(n) for n in names]
                time.sleep(0.01)
            waited["count_seen"] = [refcount(n) for n in names]
        return out

    bcast = mmshm.deferred_unwrap(slow_broadcast, copy=(rank == 0))
    if rank == 0:
        reqs = [mmshm.wrap(_request(i, seed), min_bytes=1024) for i in range(3)]
        names = [h.name for h in mmshm.handles(reqs)]
        out = bcast(reqs, rank, None, 0)
    else:
        names = []
        out = bcast(None, rank, None, 0)
    for i, req in enumerate(out):
        _check_request(req, i, seed)
    del out
    gc.collect()
    return {"names": names, "count_seen": waited["count_seen"]}


def _missing_handle():
    """A handle naming a segment that does not exist (well-formed metadata)."""
    import mmshm
    from mmshm.segments.codec import HandleMeta

    meta = HandleMeta(f"mmshm-{os.getpid()}-00000000deadbeef", 4096, 0, (1024,), b"\0" * 16)
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
        reqs = [mmshm.wrap(_request(i, seed), min_bytes=1024) for i in range(5)]
        # request 1: its handles name a segment that is gone
        for item in reqs[1]["mm_inputs"]["mm_items"]:
            item["feature"].release()
            item["feature"] = _missing_handle()
        # request 3: everything inline (below the threshold)
        reqs[3] = _request(3, seed)
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
            _check_request(r, i, seed)
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
        reqs = [mmshm.wrap(_request(0, seed), min_bytes=1024), _request(1, seed)]
        out = bcast(reqs, rank, None, 0)
    else:
        out = bcast(None, rank, None, 0)
    errors = {}
    for i, r in enumerate(out):
        if isinstance(r, mmshm.MaterializeError):
            errors[i] = (r.reason, list(r.ranks) if r.ranks is not None else None)
        else:
            _check_request(r, i, seed)
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
        info = {"stage": stage, "name": h.name, "files": seg_files(),
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
    out["left"] = seg_files()
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
        req = mmshm.wrap(_request(1, seed), min_bytes=1024)
        twin = copy.copy(req)  # shares mm_inputs, hence the handle objects
        names = [h.name for h in mmshm.handles(req)]
        out = bcast([req, twin], rank, None, 0)
    else:
        out = bcast(None, rank, None, 0)
    kinds = [type(r).__name__ for r in out]
    for r in out:
        if not isinstance(r, mmshm.MaterializeError):
            _check_request(r, 1, seed)
    del out
    gc.collect()
    return {"kinds": kinds, "names": names}


def _mappings_of(name: str) -> int:
    """How many mappings of segment file ``name`` this process has."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith("/" + name))


def rank_fanout_one_mapping(rank: int, world: int, seed: int, n: int) -> dict:
    """A request fanned out into ``n`` copies (each sent with its own handles)
    is broadcast in one batch: each rank maps each segment once, gives every
    copy its own tensor object, and holds one reference per segment."""
    import mmshm

    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    if rank == 0:
        req = mmshm.wrap(_request(1, seed), min_bytes=1024)
        copies = mmshm.fan_out(req, n, min_bytes=1024)
        mmshm.release(req)
        out = bcast(copies, rank, None, 0)
        del copies, req
    else:
        out = bcast(None, rank, None, 0)
    for r in out:
        _check_request(r, 1, seed)
    feats = [[it["feature"] for it in r["mm_inputs"]["mm_items"]] for r in out]
    ptrs = [[f.data_ptr() for f in fs] for fs in feats]
    tensors = len({id(f) for fs in feats for f in fs})
    segs = sorted(n_ for n_ in os.listdir(seg_dir()) if n_.startswith("mmshm-"))
    maps = {s_: _mappings_of(s_) for s_ in segs}
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
            reqs = [mmshm.wrap(_request(i, s), min_bytes=1024) for i in range(3)]
            out = bcast(reqs, rank, mine, src)
            del reqs
        else:
            out = bcast(None, rank, mine, src)
        for i, r in enumerate(out):
            if isinstance(r, mmshm.MaterializeError):
                failures.append((rnd, i, r.reason, r.ranks))
            else:
                _check_request(r, i, s)
        del out
        gc.collect()
        dist.barrier(group=mine)  # verification only: both ranks dropped their views
    return {"failures": failures}
