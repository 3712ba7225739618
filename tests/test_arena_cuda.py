"""The arena's CUDA calls on a host with several GPUs, on CPU: the product's own
:class:`~mmshm.segments.arena.CudaRegistrar` over a fake CUDA runtime
(:mod:`tests.harness.fakecuda`) that behaves as CUDA does: a current device per
thread, 0 in a thread that never set one, and a primary context made on a
device by the first call that needs one while it is current.

What a GPU host would show and these tests cannot: the driver's real answers,
the memory a context takes, the speed of the settle.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import mmshm
from mmshm.segments import arena, reaper
from mmshm.segments.table import TABLE

from tests.harness.fakecuda import FakeCuda
from tests.harness.metrics import metric
from tests.harness.procs import join, recv, spawn_ctx, track
from tests.harness.segments import header, segment_files

pytestmark = pytest.mark.timeout(180)
MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _photo(seed: int, n: int = MiB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n // 4, generator=g)


def _run_rank(script: str, d: str, tmp_path, timeout: float = 120, **env) -> tuple[dict, str]:
    """Run ``script`` as a rank process (``python -c``, the repository as its
    working directory); it writes its fake runtime's report to the file named
    by its ``argv[2]`` as the last thing at exit. Returns (report, stderr)."""
    out = tmp_path / "report.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, d, str(out)], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "MMSHM_DIR": d, "MMSHM_POOL": "1", "PYTHONFAULTHANDLER": "1",
             **env})
    track(proc.pid)
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, f"the rank failed ({proc.returncode}):\n{err[-4000:]}"
    return json.loads(out.read_text()), err


# -- a TP rank on cuda:1 ----------------------------------------------------------------
_RANK_ON_CUDA_1 = r"""
import atexit, json, sys
_state = {}
def _report():  # registered first: runs last at exit, after mmshm's exit hooks
    json.dump(_state["fake"].report(), open(sys.argv[2], "w"))
atexit.register(_report)

import gc, pickle, threading, time
import torch
import mmshm
from mmshm.segments import arena
from mmshm.segments.table import TABLE
from tests.harness.fakecuda import FakeCuda

MiB = 1 << 20
fake = _state["fake"] = FakeCuda(devices=2).patch()
arena.SWEEP_EVERY_S = 0.05
torch.cuda.set_device(1)  # the rank's device, set in its main thread


class OnCuda1(torch.Tensor):
    # a CPU tensor that says it is on cuda:1 (the source of a D2H)
    @property
    def device(self):
        return torch.device("cuda", 1)


def on_thread(name, fn, *args):
    # fn(*args) on a fresh thread (device 0 current there, as in any new thread)
    t = threading.Thread(target=fn, args=args, name=name)
    t.start()
    t.join(60)
    assert not t.is_alive(), name


def produce(seed, n, out):
    # the producer's side: a segment of its arena, written by a D2H from cuda:1
    h = mmshm.ShmTensor.from_tensor(torch.zeros(n // 4))
    seg = TABLE.get(h.name)
    assert seg.arena
    dst = torch.frombuffer(seg.payload_view(), dtype=torch.uint8, count=n)
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g).as_subclass(OnCuda1)
    arena.copy_from_device(dst, src, seg)
    del dst, seg
    out.append(h)


def view(h):
    h.share(1)
    return pickle.loads(pickle.dumps(h)).materialize()


# 1. the producer's D2H on a thread of its own: its mapping registered on cuda:1
made = []
on_thread("producer", produce, 1, MiB, made)
on_thread("producer", produce, 2, MiB, made)
on_thread("producer", produce, 3, 2 * MiB, made)
hA, hB, hC = made
assert len(fake.registered) == 3, fake.registered

# 2. the rank's views, mapped and registered in its main thread
vA, vB, vC = view(hA), view(hB), view(hC)
assert arena.VIEWS.status()["registered"] == 3
for h in made:
    h.release()

# 3. views released by finalizers: here, on another thread, and in a cycle
#    collected on a third thread
del vA
gc.collect()
box = [vB]
del vB
on_thread("dropper", box.clear)
cycle = [vC]
cycle.append(cycle)
del vC, cycle
on_thread("collector", gc.collect)
assert arena.VIEWS.settled(30), "the views were not given back"

# 4. an eviction: a bigger tensor on the producer's thread makes the arena give its
#    idle segments back (their registered creator mappings go with them)
on_thread("producer", produce, 4, 3 * MiB, made)
hD = made[-1]
# 5. the sweeper thread lets go of the rank's mappings of the unlinked files
end = time.monotonic() + 30
while arena.VIEWS.status()["mappings"] > 1 and time.monotonic() < end:
    time.sleep(0.05)
assert arena.VIEWS.status()["mappings"] <= 1, arena.VIEWS.status()
# 6. a view of the new one, then the producer trims its pool on another thread
vD = view(hD)
hD.release()
del vD
gc.collect()
assert arena.VIEWS.settled(30)
on_thread("trimmer", TABLE.trim_pool)
end = time.monotonic() + 30
while arena.VIEWS.status()["mappings"] and time.monotonic() < end:
    time.sleep(0.05)
assert arena.VIEWS.status()["mappings"] == 0, arena.VIEWS.status()
# 7. one more, produced here and viewed until the exit (the producer's
#    registration and the view are let go by the exit's finalizers)
produce(5, MiB, made)
hE = made[-1]
vE = view(hE)
hE.release()
print("done", flush=True)
"""


def test_a_rank_on_cuda_1_makes_no_context_on_gpu_0(arena_on, tmp_path):
    """Over a run that registers producer and rank mappings, releases views
    through finalizers on other threads, settles, evicts, sweeps on the
    sweeper thread, trims and exits, every CUDA call of a rank on ``cuda:1``
    runs on device 1: no context on device 0."""
    rep, err = _run_rank(_RANK_ON_CUDA_1, arena_on, tmp_path, MMSHM_ARENA_BYTES=str(6 * MiB))
    contexts = [tuple(c) for c in rep["contexts"]]
    on0 = [(c, s) for c, s in zip(contexts, rep["stacks"]) if c[0] == 0]
    assert not on0, "contexts made on GPU 0 by:\n" + "\n".join(
        f"{c[2]} on thread {c[1]}:\n{s}" for c, s in on0)
    assert contexts == [(1, "MainThread", "cudaSetDevice")]
    # the run did reach every path it is meant to cover
    calls = {(c[0], c[2]) for c in rep["calls"]}
    for want in [("cudaHostRegister", "producer"), ("cudaHostRegister", "MainThread"),
                 ("cudaDeviceSynchronize", "mmshm-arena-settle"),
                 ("cudaHostUnregister", "producer"),  # eviction: the creator mappings
                 ("cudaHostUnregister", "mmshm-arena-sweep"),
                 ("cudaHostUnregister", "trimmer"),
                 ("cudaHostUnregister", "MainThread")]:  # the exit: the producer's
        assert want in calls, (want, sorted(calls))
    assert all(c[1] == 1 for c in rep["calls"]), "a call on another device than cuda:1"
    # at exit every producer registration (writable, flags 0x1) was undone; the
    # rank's own mapping (read-only) goes with the process
    assert [r for r in rep["registered"].values() if r[1] == 0x1] == []
    assert "Traceback" not in err


# -- in this process, through the fake runtime ------------------------------------------
@pytest.fixture
def fake_cuda(arena_on, monkeypatch):
    fake = FakeCuda(devices=2).install(monkeypatch)
    monkeypatch.setattr(arena, "_warned", set())
    yield fake
    if fake.hold is not None:
        fake.hold.set()
    fake.gone.clear()
    gc.collect()
    arena.VIEWS.settled()
    arena.set_registrar(None)


def _shared_view(h: mmshm.ShmTensor):
    h.share(1)
    return pickle.loads(pickle.dumps(h)).materialize()


def test_the_settle_waits_on_each_view_s_own_device_and_is_timed(fake_cuda):
    """Views of mappings made on two devices, released together: the settle
    synchronizes both devices (not one captured once), on the settling thread,
    and holds each view until then, counted in mmshm_arena_settle_seconds."""
    fake = fake_cuda
    fake.hold = threading.Event()
    n0 = metric("mmshm_arena_settle_seconds_count")
    fake.set_device(1)
    h1 = mmshm.ShmTensor.from_tensor(_photo(1))
    v1 = _shared_view(h1)
    fake.set_device(0)
    h0 = mmshm.ShmTensor.from_tensor(_photo(2))
    v0 = _shared_view(h0)
    assert {r[2] for r in fake.registered.values()} == {0, 1}
    names = [h1.name, h0.name]
    h1.release()
    h0.release()
    del v1, v0
    gc.collect()
    time.sleep(0.2)
    assert [header(n)[4] for n in names] == [1, 1]  # held: the GPU has not settled
    fake.hold.set()
    assert arena.VIEWS.settled()
    assert [header(n)[4] for n in names] == [0, 0]
    syncs = {(c[1], c[2]) for c in fake.calls if c[0] == "cudaDeviceSynchronize"}
    assert syncs == {(0, "mmshm-arena-settle"), (1, "mmshm-arena-settle")}
    assert metric("mmshm_arena_settle_seconds_count") - n0 == 2
    assert metric("mmshm_arena_settle_seconds_sum") >= 0.2 * 2 * 0.9


def test_the_event_settle_waits_without_synchronizing_the_device(fake_cuda, monkeypatch):
    """SETTLE_MODE "event": a blocking-sync event recorded on the legacy default
    stream of each view's device, polled; no device synchronize."""
    fake = fake_cuda
    monkeypatch.setattr(arena, "SETTLE_MODE", "event")
    fake.hold = threading.Event()
    fake.set_device(1)
    h = mmshm.ShmTensor.from_tensor(_photo(3))
    v = _shared_view(h)
    h.release()
    del v
    gc.collect()
    time.sleep(0.1)
    assert header(h.name)[4] == 1
    fake.hold.set()
    assert arena.VIEWS.settled()
    assert header(h.name)[4] == 0
    assert fake.events and set(fake.events) == {(1, True)}
    assert not [c for c in fake.calls if c[0] == "cudaDeviceSynchronize"]


@pytest.mark.parametrize("lib", [True, False], ids=["libcudart", "torch-binding"])
def test_a_refusal_says_cuda_s_error_once_and_is_not_retried(fake_cuda, caplog, monkeypatch,
                                                             lib):
    """CUDA refuses (cudaErrorMemoryAllocation): one WARNING with CUDA's own
    name and text, through libcudart's cudaGetErrorName or, without it, torch's
    cudaGetErrorString with its enum (an int would be a TypeError); the next
    new mappings are served unregistered without asking CUDA again."""
    fake = fake_cuda
    fake.refuse = 2
    if not lib:
        monkeypatch.setattr(arena, "_libcudart", lambda: None)
    failed0 = metric("mmshm_arena_registrations_total", result="failed")
    fake.set_device(1)
    hs = [mmshm.ShmTensor.from_tensor(_photo(10 + i, (i + 1) * MiB)) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        for i, h in enumerate(hs):
            v = _shared_view(h)
            assert torch.equal(v, _photo(10 + i, (i + 1) * MiB))
            del v
            gc.collect()
    said = [r.getMessage() for r in caplog.records if "refused to register" in r.getMessage()]
    assert len(said) == 1, said
    assert "out of memory" in said[0] and "on cuda:1" in said[0]
    assert ("cudaErrorMemoryAllocation" if lib else "cudaError 2") in said[0]
    assert "memlock=-1" not in said[0] and "fix:" in said[0]
    asked = [c for c in fake.calls if c[0] == "cudaHostRegister"]
    assert len(asked) == 1
    assert metric("mmshm_arena_registrations_total", result="failed") - failed0 == 1
    assert arena.VIEWS.status()["registered"] == 0
    for h in hs:
        h.release()


def _locks_of(*objs) -> list:
    """Every lock held as an attribute of ``objs`` (the arena's objects)."""
    kinds = (type(threading.Lock()), type(threading.RLock()), threading.Condition)
    found = []
    for o in objs:
        for v in vars(o).values():
            if isinstance(v, kinds):
                found.append(v)
    return found


def _collect_holding_locks(make_garbage) -> bool:
    """On a fresh thread: take every lock of the arena's objects, make a
    registered view garbage in a reference cycle, and collect it. Returns
    whether that finished in 10 s (a finalizer taking a lock its thread holds
    hangs it)."""
    done = threading.Event()

    def work():
        locks = _locks_of(arena.VIEWS, TABLE)
        for lk in locks:
            lk.acquire()
        try:
            make_garbage()
            gc.collect()
        finally:
            for lk in reversed(locks):
                lk.release()
        done.set()

    threading.Thread(target=work, daemon=True, name="collector").start()
    return done.wait(10)


def test_a_collection_with_the_arena_s_locks_held_does_not_hang(fake_cuda, monkeypatch):
    """A registered view freed by a garbage collection in a thread that holds
    the arena's locks (as a thread allocating under them may): its finalizer
    only queues it, the thread goes on, and the view is given back; the same
    on the settling thread itself, mid-settle."""
    fake = fake_cuda
    fake.set_device(1)
    h = mmshm.ShmTensor.from_tensor(_photo(20))
    holder = {}  # "done": the settling thread's collection ran

    def in_a_cycle():
        v = _shared_view(h)
        cyc = [v]
        cyc.append(cyc)

    assert _collect_holding_locks(in_a_cycle), "a collection hung in the view's finalizer"
    assert arena.VIEWS.settled()
    assert header(h.name)[4] == 1  # ours only: the view's reference went back
    # now from the settling thread's side: a collection there, mid-settle
    h2 = mmshm.ShmTensor.from_tensor(_photo(21))
    real_sync = fake.synchronize
    hung = []

    def sync_collecting(device=None):
        real_sync(device)
        if "done" not in holder:
            holder["done"] = True
            hung.append(not _collect_holding_locks(in_a_cycle))
            # and on this very thread, holding the locks
            locks = _locks_of(arena.VIEWS, TABLE)
            for lk in locks:
                lk.acquire()
            try:
                v = _shared_view(h2)
                cyc = [v]
                cyc.append(cyc)
                del v, cyc
                gc.collect()
            finally:
                for lk in reversed(locks):
                    lk.release()

    monkeypatch.setattr(torch.cuda, "synchronize", sync_collecting)
    v = _shared_view(h)
    del v
    gc.collect()
    assert arena.VIEWS.settled(20), "the settling thread hung in a collection"
    assert hung == [False]
    assert header(h.name)[4] == 1 and header(h2.name)[4] == 1
    h.release()
    h2.release()


# -- bad input ---------------------------------------------------------------------------
_RANK_EXITS_WITH_VIEWS_QUEUED = r"""
import atexit, json, sys
_state = {}
def _report():
    json.dump(_state["fake"].report(), open(sys.argv[2], "w"))
atexit.register(_report)

import gc, pickle, threading, time
import torch
from mmshm.segments import arena
from tests.harness.fakecuda import FakeCuda

fake = _state["fake"] = FakeCuda(devices=2).patch()
arena.EXIT_SETTLE_S = 0.5
torch.cuda.set_device(1)
handles = [pickle.loads(bytes.fromhex(line)) for line in sys.stdin.read().split()]
views = [h.materialize() for h in handles]
assert arena.VIEWS.status()["registered"] == 3
fake.hold = threading.Event()  # a copy that never ends: the settle hangs
v1, v2, v3 = views
del views, handles
del v1
gc.collect()
time.sleep(0.2)  # the settling thread is stuck on v1
del v2  # queued behind it
gc.collect()
fake.gone.add(1)  # then the device goes away; v3 is still held at exit
print("exiting", flush=True)
"""


def test_a_rank_that_exits_with_views_queued_gives_their_references_back(arena_on, tmp_path):
    """A rank exits with one released view stuck in the settle (a device that
    hangs), one queued behind it and one alive, and its device has gone
    away: every reference comes back, one WARNING, nothing raised."""
    hs = [mmshm.ShmTensor.from_tensor(_photo(30 + i)) for i in range(3)]
    for h in hs:
        h.share(1)
    blob = "\n".join(pickle.dumps(h).hex() for h in hs)
    out = tmp_path / "report.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", _RANK_EXITS_WITH_VIEWS_QUEUED, arena_on, str(out)], cwd=ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "MMSHM_DIR": arena_on, "MMSHM_POOL": "1"})
    track(proc.pid)
    try:
        outs, err = proc.communicate(blob, timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0 and "exiting" in outs, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    assert err.count("waiting for the GPU before reusing arena pages failed") == 1, err[-4000:]
    assert [header(h.name)[4] for h in hs] == [1, 1, 1]  # ours only: the rank's came back
    rep = json.loads(out.read_text())
    assert {c[0] for c in rep["contexts"]} == {1}
    for h in hs:
        h.release()


def _producer_killed(d, conn):
    os.environ["MMSHM_DIR"] = d
    from mmshm import config as c

    c.reload()
    h = mmshm.ShmTensor.from_tensor(_photo(40))
    h.share(1)
    conn.send(pickle.dumps(h))
    conn.recv()  # killed here


def test_a_producer_that_dies_with_a_copy_in_flight_is_reclaimed_after_the_settle(fake_cuda):
    """The producer is SIGKILLed while this rank's released view waits for the
    GPU (a copy in flight): the reaper leaves its segment (bytes unchanged)
    until the settle gives the reference back, then takes it."""
    fake = fake_cuda
    fake.hold = threading.Event()
    fake.set_device(1)
    c = spawn_ctx()
    ours, theirs = c.Pipe()
    p = c.Process(target=_producer_killed, args=(os.environ["MMSHM_DIR"], theirs), daemon=True)
    p.start()
    track(p.pid)
    try:
        t = pickle.loads(recv(ours, 60)).materialize()
        assert torch.equal(t, _photo(40))
        (name,) = segment_files()
        os.kill(p.pid, signal.SIGKILL)
        join(p, 10)
        del t
        gc.collect()  # released: queued, the settle held
        time.sleep(0.1)
        reaper.reap()
        assert segment_files() == [name]  # not reclaimed under the copy
        assert header(name)[4] >= 1
        fake.hold.set()
        assert arena.VIEWS.settled()
    finally:
        if p.is_alive():
            p.kill()
    reaper.reap()
    assert segment_files() == []
    assert arena.VIEWS.sweep() == 1
    unregs = [c for c in fake.calls if c[0] == "cudaHostUnregister"]
    assert unregs and all(c[1] == 1 for c in unregs)
