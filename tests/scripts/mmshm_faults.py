"""Shared helpers for the fault tests (issue 3): process workers, counters, hygiene.

Workers are plain module-level functions so that a ``forkserver`` context can
start them: the fork server imports this module (and with it torch and mmshm)
once, and every worker is then a cheap fork of it. Workers talk to the test
over ``multiprocessing`` pipes and never touch the test's segments except
through pickled handles.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import pickle
import random
import re
import resource
import shutil
import subprocess
import sys
import time

import mmshm
import torch
from mmshm.segments import segment
from mmshm.segments.table import TABLE
from prometheus_client import REGISTRY

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
NAME_RE = re.compile(r"mmshm-([0-9]{1,10})-([0-9a-f]{16})\Z")
FALLBACK_REASONS = ("enospc", "budget", "emfile", "other")  # a tensor's own reasons

#: pids of every process a test started (their segments are the test's business)
TRACKED_PIDS: set[int] = {os.getpid()}


# -- hygiene -------------------------------------------------------------------
def segment_files(directory: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(directory) if NAME_RE.match(n))
    except FileNotFoundError:
        return []


def ours_in_dev_shm() -> set[str]:
    """``mmshm-*`` files in /dev/shm created by this test process or one it started."""
    return {n for n in segment_files("/dev/shm") if int(NAME_RE.match(n).group(1)) in TRACKED_PIDS}


def track(pid: int) -> None:
    """Record a child's pid (its ``mmshm-*`` files are the tests' business);
    the project conftest checks /dev/shm against ``_mp.SPAWNED_PIDS``."""
    TRACKED_PIDS.add(pid)
    mp_helpers = sys.modules.get("_mp")
    if mp_helpers is not None:
        mp_helpers.SPAWNED_PIDS.add(pid)


@functools.lru_cache(maxsize=1)
def unshare_reason() -> str | None:
    """None if ``unshare -m`` plus a tmpfs mount works here, else why not."""
    if os.geteuid() != 0:
        return "needs root for a private tmpfs (unshare -m)"
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                       check=False, capture_output=True, timeout=30)
    if r.returncode != 0:
        return f"unshare -m / mount tmpfs failed: {r.stderr.decode(errors='replace').strip()}"
    return None


def skip_without_unshare() -> None:
    """Skip the calling test when a private tmpfs cannot be had (see
    :func:`unshare_reason`)."""
    why = unshare_reason()
    if why:
        import pytest

        pytest.skip(why)


def run_in_tmpfs(argv: list[str], size: str = "64m", env: dict | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``argv`` with a private ``size`` tmpfs mounted on /dev/shm (Docker's
    default is 64m), in a new mount namespace; returns the completed process."""
    cmd = ("mount -t tmpfs -o size=" + size + " tmpfs /dev/shm && exec \"$@\"")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MMSHM_")}
    full_env.update(env or {})
    p = subprocess.Popen(["unshare", "-m", "sh", "-c", cmd, "sh", *argv],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env, cwd=REPO)
    track(p.pid)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"{argv} ran past {timeout}s:\n{err.decode(errors='replace')}")
    return subprocess.CompletedProcess(argv, p.returncode, out.decode(), err.decode())


# -- metrics -------------------------------------------------------------------
def fallbacks() -> dict[str, float]:
    return {r: REGISTRY.get_sample_value("mmshm_inline_fallbacks_total", {"reason": r}) or 0.0
            for r in FALLBACK_REASONS}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: int(after[k] - before[k]) for k in before}


def sample(name: str, labels: dict | None = None) -> float:
    """One sample's value; without ``labels``, the sum over every label set."""
    if labels is None:
        return sum(s.value for m in REGISTRY.collect() for s in m.samples if s.name == name)
    return REGISTRY.get_sample_value(name, labels) or 0.0


# -- process plumbing -----------------------------------------------------------
_CTX = None


def ctx():
    """A forkserver context that preloads torch and mmshm (Python 3.11's fork
    server ignores the parent's sys.path when preloading, so this module
    itself is imported by each child, cheaply, from the sys.path it gets)."""
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        _CTX.set_forkserver_preload(["torch", "prometheus_client", "blake3", "msgspec", "mmshm",
                                     "mmshm.segments.reaper"])
    return _CTX


def start(target, *args, name: str | None = None):
    p = ctx().Process(target=target, args=args, name=name, daemon=True)
    p.start()
    track(p.pid)
    return p


def recv(conn, timeout: float = 10.0):
    if not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout}s")
    return conn.recv()


def join(p, timeout: float = 10.0) -> int:
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        p.join(5)
        raise TimeoutError(f"{p.name} (pid {p.pid}) did not finish within {timeout}s")
    return p.exitcode


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """A reproducible uint8 tensor of ``nbytes`` bytes (cheap to make)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    reps = -(-nbytes // 4096)
    return base.repeat(reps)[:nbytes].clone()


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
    foreign handle at the limit. Reports everything to the test."""
    from mmshm import config

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


def wait_gone(paths, timeout: float = 5.0) -> bool:
    """Poll until none of ``paths`` exists (for finalizers in other processes)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(os.path.exists(p) for p in paths):
            return True
        time.sleep(0.01)
    return not any(os.path.exists(p) for p in paths)
