"""Forkserver workers of the fault tests: servers' processes that
create, hold, hand over and die.

Workers are plain module-level functions so that a ``forkserver`` context
(:func:`tests.harness.procs.fork_ctx`, whose server imported torch and mmshm) can
start them cheaply: ``fork_start(workers.w_holder, directory, ...)``. They
talk to the test over ``multiprocessing`` pipes and never touch the test's
segments except through pickled handles; each starts with :func:`use_dir`.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import resource

import mmshm
import torch
from mmshm.segments import segment
from mmshm.segments.table import TABLE

from tests.harness.metrics import delta, fallbacks
from tests.harness.segments import segment_files
from tests.harness.tensors import pattern


# -- workers ----------------------------------------------------------------------
def use_dir(directory: str, **env: str) -> None:
    """Point this worker's mmshm at ``directory`` (handles carry no directory:
    every process of a server shares ``MMSHM_DIR``) with default settings
    plus ``env``: the fork server keeps the environment of whichever test
    started it, so every ``MMSHM_*`` variable is reset here. The start-up
    reaper and the warm pool are off unless ``env`` turns them on."""
    from mmshm import config

    for k in [k for k in os.environ if k.startswith("MMSHM_")]:
        del os.environ[k]
    os.environ["MMSHM_DIR"] = directory
    os.environ["MMSHM_REAP_INTERVAL_S"] = "0"
    os.environ["MMSHM_POOL"] = "0"  # as in conftest: the last release unlinks
    os.environ.update(env)
    config.reload()


def w_producer_loop(directory: str, seed: int, conn) -> None:
    """Producer killed mid-copy: creates big segments in a loop (keeping the two
    most recent), announcing itself first. Exits by itself after 400 creations."""
    use_dir(directory)
    rnd = random.Random(seed)
    src = pattern(48 << 20, seed)
    keep: list = []
    conn.send("started")
    for _ in range(400):
        n = rnd.randrange(1 << 20, 48 << 20)
        keep.append(mmshm.ShmTensor.from_tensor(src[:n], directory=directory))
        if len(keep) > 2:
            keep.pop(0).release()
    conn.send("finished")


def w_holder(directory: str, nbytes: int, seed: int, receivers: int, conn) -> None:
    """Creates one segment, hands ``receivers`` pickled references to the test,
    then waits for ``"exit"`` and leaves normally (its own reference released)."""
    use_dir(directory)
    t = pattern(nbytes, seed)
    h = mmshm.ShmTensor.from_tensor(t, directory=directory)
    h.share(receivers)
    conn.send((pickle.dumps(h), h.hash, h.name))
    assert conn.recv() == "exit"
    h.release()
    conn.send("bye")


def w_consumer(directory: str, conn) -> None:
    """Consumer killed after materialize and before release: materializes a
    pickled handle (zero-copy view), checks its hash, reports, then waits."""
    use_dir(directory)
    data, expected = conn.recv()
    v = pickle.loads(data).materialize()
    conn.send(("materialized", mmshm.content_hash(v) == expected))
    conn.recv()  # never comes: killed here, the view and its reference still held
    del v


def w_hash_reader(directory: str, conn) -> None:
    """A reader killed after it opened a segment and closed it again: reads
    a pickled handle's content hash from its segment (``MMSHM_HASH=lazy``:
    attach, hash, close), reports it, then waits, still owning the reference."""
    use_dir(directory)
    h = pickle.loads(conn.recv())
    conn.send(h.hash)
    conn.recv()  # never comes: killed here, the reference never given back
    h.release()


def w_cache_holder(directory: str, conn) -> None:
    """A reader whose cache keeps a zero-copy view (as vLLM's EngineCore
    keeps one in its multimodal processor cache), its segment marked as
    such; answers ``"exit"``, dropping the view."""
    use_dir(directory)
    from mmshm.segments import segment

    h = pickle.loads(conn.recv())
    name = h.name
    cache = {"item": h.materialize()}
    conn.send(segment.mark_cached(name))
    assert conn.recv() == "exit"
    cache.clear()
    conn.send("bye")


def w_tp_producer(directory: str, seed: int, conn_r0) -> None:
    """Tokenizer of a simulated TP group: wraps a two-tensor request, hands one
    reference to rank 0, waits for its verdict and leaves normally."""
    use_dir(directory)
    rnd = random.Random(seed)
    req = {"rid": seed, "mm_items": [{"feature": pattern(rnd.randrange(1 << 18, 8 << 20), seed)},
                                     {"feature": pattern(rnd.randrange(1 << 18, 8 << 20), ~seed)}]}
    hashes = [mmshm.content_hash(it["feature"]) for it in req["mm_items"]]
    w = mmshm.wrap(req, directory=directory)
    for h in mmshm.handles(w):
        h.share(1)
    conn_r0.send((pickle.dumps(w), hashes))
    mmshm.release(w)
    conn_r0.recv()  # rank 0 done


def w_tp_rank0(directory: str, conn_p, conn_r1, conn_test) -> None:
    """Rank 0: receives the request, adds world-1 references and "broadcasts"
    the pickled metadata to rank 1, then materializes and checks its copy."""
    use_dir(directory)
    data, hashes = conn_p.recv()
    req = pickle.loads(data)
    for h in mmshm.handles(req):
        h.share(1)
    conn_r1.send((pickle.dumps(req), hashes))
    out = mmshm.unwrap(req)
    ok = [mmshm.content_hash(it["feature"]) for it in out["mm_items"]] == hashes
    del out
    conn_test.send(("rank0", ok))
    conn_p.send("done")


def w_tp_rank1(directory: str, materialize: bool, conn_r0, conn_test) -> None:
    """Rank 1, killed right after the broadcast: unpickles (and optionally
    materializes) the request, reports, then waits to be killed."""
    use_dir(directory)
    data, hashes = conn_r0.recv()
    req = pickle.loads(data)
    ok = True
    if materialize:
        req = mmshm.unwrap(req)
        ok = [mmshm.content_hash(it["feature"]) for it in req["mm_items"]] == hashes
    conn_test.send(("rank1", ok))
    conn_test.recv()  # never comes
    del req


def w_live_instance(directory: str, conn) -> None:
    """A second live mmshm instance beside the chaos: holds three segments (one
    through a zero-copy view) and hands a pickled handle "in flight" to the
    test. Answers ``"verify"`` with whether every byte is still right."""
    use_dir(directory)
    tensors = [pattern(n, 1000 + i) for i, n in enumerate((3 << 20, 1 << 20, 5 << 20))]
    hashes = [mmshm.content_hash(t) for t in tensors]
    hs = [mmshm.ShmTensor.from_tensor(t, directory=directory) for t in tensors]
    del tensors
    view_handle = hs[2].clone()
    view = view_handle.materialize()
    hs[1].share(1)  # in flight: owned by the pickled bytes the test keeps
    conn.send({"names": [h.name for h in hs], "in_flight": pickle.dumps(hs[1]),
               "in_flight_hash": hashes[1]})
    while True:
        cmd = conn.recv()
        if cmd == "verify":
            ok = [mmshm.content_hash(h.clone().materialize(copy=True)) == hh
                  for h, hh in zip(hs, hashes)]
            ok.append(mmshm.content_hash(view) == hashes[2])
            conn.send(all(ok))
        elif cmd == "exit":
            del view
            for h in hs:
                h.release()
            conn.send("bye")
            return


def w_orphan_maker(directory: str, sizes: list[int]) -> None:
    """Creates segments and dies without releasing them (no atexit, no finalizers)."""
    use_dir(directory)
    hs = [mmshm.ShmTensor.from_tensor(pattern(n, n), directory=directory) for n in sizes]
    assert len(hs) == len(sizes)
    os._exit(0)


def w_segment_holder(directory: str, nbytes: int, reap_interval_s: str, conn) -> None:
    """A live server's segment: creates one (its first creation runs the
    start-up reaper when ``reap_interval_s`` is not 0) and holds it until told
    to exit; answers ``"verify"`` with whether its bytes are intact."""
    use_dir(directory, MMSHM_REAP_INTERVAL_S=reap_interval_s)
    t = pattern(nbytes, 7)
    h = mmshm.ShmTensor.from_tensor(t, directory=directory)
    conn.send((h.name, h.hash))
    while True:
        cmd = conn.recv()
        if cmd == "verify":
            conn.send(torch.equal(h.clone().materialize(copy=True), t))
        else:
            h.release()
            conn.send("bye")
            return


def w_pool_owner(directory: str, conn) -> None:
    """A producer with the warm pool on: one live segment (count 2: one
    reference handed out) and one released into its pool; sends both names,
    then on any command releases everything and exits."""
    use_dir(directory, MMSHM_POOL="1", MMSHM_POOL_IDLE_S="600")
    live = mmshm.ShmTensor.from_tensor(pattern(1 << 20, 1))
    live.share(1)
    pooled = mmshm.ShmTensor.from_tensor(pattern(1 << 19, 2))
    pooled_name = pooled.name
    pooled.release()
    conn.send((live.name, pooled_name))
    conn.recv()
    segment.update_refcount(live.name, -1)
    live.release()
    TABLE.trim_pool()
    conn.send("bye")


def w_release_on_command(directory: str, conn) -> None:
    """Holds an unpickled (never attached) handle; on command releases it (by
    path: this process has no descriptor) and reports raised errors and the
    warnings mmshm logged."""
    use_dir(directory)
    records: list[str] = []

    class H(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("mmshm").addHandler(H(level=logging.WARNING))
    h = pickle.loads(conn.recv())
    conn.send("ready")
    assert conn.recv() == "release"
    err = None
    try:
        h.release()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        err = repr(exc)
    conn.send((err, records, h.owns_reference))


def w_truncated_attach(directory: str, data: bytes, conn) -> None:
    """Materializes a handle whose segment was truncated before attach: must be
    a typed error (never SIGBUS), both directly and through deferred_unwrap."""
    use_dir(directory)
    res = {}
    h = pickle.loads(data)
    try:
        h.materialize()
        res["direct"] = "no error"
    except mmshm.SegmentCorruptError as exc:
        res["direct"] = "SegmentCorruptError: " + str(exc)
    except Exception as exc:  # noqa: BLE001
        res["direct"] = "wrong type: " + repr(exc)
    try:
        h.materialize(copy=True)
        res["copy"] = "no error"
    except mmshm.SegmentCorruptError as exc:
        res["copy"] = "SegmentCorruptError: " + str(exc)
    except Exception as exc:  # noqa: BLE001
        res["copy"] = "wrong type: " + repr(exc)
    h.release()
    req = {"mm_items": [{"feature": pickle.loads(data)}]}
    out = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)([req], 0)
    res["deferred"] = (type(out[0]).__name__, getattr(out[0], "reason", None))
    conn.send(res)


def w_emfile(directory: str, ntensors: int, nbytes: int, foreign: bytes, conn) -> None:
    """Descriptor exhaustion: lowers RLIMIT_NOFILE so that MMSHM_FD_RESERVE is
    crossed after a few segments, wraps a request, then drops the limit to the
    next free descriptor (real EMFILE) and wraps again; also attaches a
    foreign handle at the limit. Reports everything to the test. Each tensor
    gets its own segment (a descriptor each), as the figures count them."""
    from mmshm import config

    from tests.harness.segments import one_segment_per_tensor

    one_segment_per_tensor()

    use_dir(directory)
    fds = [int(x) for x in os.listdir("/proc/self/fd")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    reserve = config.get().fd_reserve
    # allow exactly 3 more descriptors below the reserve
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)
    res: dict = {"fd_reserve": reserve, "open_fds": len(fds), "lowest_free": probe}
    tensors = [pattern(nbytes, i) for i in range(ntensors)]
    hashes = [mmshm.content_hash(t) for t in tensors]

    def wrap_round(tag: str):
        before = fallbacks()
        w = mmshm.wrap({"mm_items": [{"feature": t} for t in tensors]}, directory=directory)
        d = delta(before, fallbacks())
        feats = [it["feature"] for it in w["mm_items"]]
        inline = [f for f in feats if isinstance(f, torch.Tensor)]
        handles = [f for f in feats if isinstance(f, mmshm.ShmTensor)]
        res[tag] = {
            "fallbacks": d, "inline": len(inline), "handles": len(handles),
            "other_types": len(feats) - len(inline) - len(handles),
            "inline_bytes_equal": all(mmshm.content_hash(f) == hashes[i]
                                      for i, f in enumerate(feats)
                                      if isinstance(f, torch.Tensor)),
            "handle_hashes_equal": all(f.hash == hashes[i] for i, f in enumerate(feats)
                                       if isinstance(f, mmshm.ShmTensor)),
        }
        return w

    resource.setrlimit(resource.RLIMIT_NOFILE, (probe + reserve + 3, hard))
    w1 = wrap_round("reserve")
    # attach inside the reserve: a typed per-request error (the handle's
    # reference is given back: opening by path is still possible there)
    req = [{"mm_items": [{"feature": pickle.loads(foreign)}]}]
    out = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)(req, 0)
    res["attach"] = (type(out[0]).__name__, getattr(out[0], "reason", None))
    # real EMFILE: no descriptor can be opened at all
    probe2 = os.open(os.devnull, os.O_RDONLY)
    os.close(probe2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (probe2, hard))
    w2 = wrap_round("hard")
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # every handle still materializes to the right bytes
    ok = True
    for w in (w1, w2):
        for i, it in enumerate(w["mm_items"]):
            f = it["feature"]
            if isinstance(f, mmshm.ShmTensor):
                ok &= mmshm.content_hash(f.materialize(copy=True)) == hashes[i]
    res["handles_materialize"] = ok
    del w1, w2, out, req
    res["left"] = segment_files(directory)
    res["open_segments"] = TABLE.names()
    conn.send(res)
