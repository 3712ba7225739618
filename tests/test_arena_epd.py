"""The encoder cache (EPD) on the arena: one D2H into the producer's mapping, one
persistent (registered) mapping per consumer whatever the number of outputs.

The producer is a spawned process (an encoder instance); the consumer is this
test process (the prefill instance's worker), with a
:class:`~tests.harness.registrar.FakeRegistrar` recording what would be
registered with CUDA. There is no GPU here, so a producer's "GPU" output is
:class:`FakeCuda`: a CPU tensor whose ``device`` reads ``cuda:0``. mmshm's
device branch runs exactly as on a GPU host (``EncoderCache.save`` takes it
for any non-CPU tensor, ``arena.copy_from_device`` registers the creator's
mapping and counts ``mmshm_gpu_copy_*{direction="d2h"}``); only the copy
itself is a memcpy instead of CUDA's DMA.

Covered without a GPU: which branch runs, where the bytes land (the segment's
mapping, never a private ``.cpu()`` copy first; bytes equal, bf16 included),
what is registered and how often (the producer's writable mapping, the
consumer's read-only one), the counters, the arena's fallback. Not covered:
a real ``cudaMemcpy`` into memory registered with ``cudaHostRegister``, what
the driver does with the registration flags, and the speed (pinned against
pageable): those need a GPU host (benchmarks/gpu_arena.py).
"""

from __future__ import annotations

import gc
import multiprocessing as mp

import pytest
import torch

from mmshm import config
from mmshm.segments import arena, segfile
from mmshm.transport import encoder_cache as ec

from tests.harness.metrics import metric
from tests.harness.registrar import FakeRegistrar
from tests.harness.procs import spawn, spawn_ctx, stop_all
from tests.harness.segments import header, segment_files

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20
ROWS, WIDTH = 512, 1024  # a bf16 output of 1 MiB


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:0`` (what mmshm checks to take its
    device path), recording the methods called on it in :attr:`CALLS` (a
    ``.cpu()`` or ``.to()`` would be the private copy the device path avoids)."""

    CALLS: list[str] = []

    @property
    def device(self):
        return torch.device("cuda", 0)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.CALLS.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def _item(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(64, 48, generator=g)}


def _key(seed: int) -> bytes:
    return ec.content_key(_item(seed), "m")


def _output(seed: int, rows: int = ROWS) -> torch.Tensor:
    g = torch.Generator().manual_seed(20_000 + seed)
    return torch.randn(rows, WIDTH, generator=g).to(torch.bfloat16)


# -- the producer: a spawned process --------------------------------------------------
def producer(conn, on_gpu: bool) -> None:
    """Commands: ("save", seed, rows) -> (published, name, nbytes, arena flag);
    ("evict", seed) -> True; ("report",) -> what its registrar saw and its
    d2h counter; None: exit (a clean exit gives its references back)."""
    fake = FakeRegistrar()
    arena.set_registrar(fake)
    d2h0 = metric("mmshm_gpu_copy_bytes_total", direction="d2h")
    store = ec.EncoderCache(keep_s=60)
    while True:
        msg = conn.recv()
        if msg is None:
            store.close()
            return
        if msg[0] == "save":
            _, seed, rows = msg
            out = _output(seed, rows)
            if on_gpu:
                out = out.as_subclass(FakeCuda)
            res = store.save(_key(seed), out, f"img-{seed}")
            flags = header(res.name)[8] if res.published else 0
            conn.send((res.published, res.name, res.nbytes,
                       bool(flags & segfile.FLAG_ARENA)))
        elif msg[0] == "evict":
            conn.send(store.evict(_key(msg[1])))
        elif msg[0] == "report":
            conn.send({"calls": fake.calls, "registrations": fake.registrations(),
                       "d2h_bytes": metric("mmshm_gpu_copy_bytes_total", direction="d2h")
                       - d2h0,
                       "private_copies": [c for c in FakeCuda.CALLS if c in ("cpu", "to")]})


class Producer:
    def __init__(self, on_gpu: bool):
        # the CUDA fakes in a fresh interpreter, as before the fork servers
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = spawn(producer, child, on_gpu, ctx=spawn_ctx())

    def ask(self, *msg, timeout: float = 60):
        self.conn.send(msg)
        assert self.conn.poll(timeout), f"the producer did not answer {msg[0]}"
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
        stop_all([self.proc], timeout=90)  # a loaded host (CI) may take long to exit
        assert self.proc.exitcode == 0, f"the producer did not exit cleanly: {self.proc.exitcode}"


def _round_trips(p: Producer, seeds, rows: int = ROWS) -> tuple[list, list]:
    """Each seed's output saved by the producer, looked up, loaded and checked
    here, let go (the view settled), then evicted by the producer, so that the
    next save of the size class reuses the same warm segment. Returns the
    producer's answers and the loaded views' addresses."""
    store = ec.EncoderCache()
    saves, addrs = [], []
    for s in seeds:
        saves.append(p.ask("save", s, rows))
        assert saves[-1][0], f"output {s} was not published: {saves[-1]}"
        entry = store.lookup(_key(s), torch.bfloat16, rows)
        assert entry is not None and entry.name == saves[-1][1]
        t = entry.handle().load()
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == (rows, WIDTH)
        assert torch.equal(t.view(torch.uint8), _output(s, rows).view(torch.uint8))
        addrs.append(t.data_ptr())
        del t
        gc.collect()
        assert arena.VIEWS.settled()  # a registered view goes back once the GPU settles
        entry.release()
        assert p.ask("evict", s) is True
    return saves, addrs


# -- tests ---------------------------------------------------------------------------
@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu-output", "gpu-output"])
def test_a_consumer_maps_and_registers_once_for_n_outputs(arena_on, on_gpu):
    """N outputs of one size, each published under its own name, reach the
    consumer through one persistent mapping, registered once."""
    fake = FakeRegistrar()
    arena.set_registrar(fake)
    views0 = metric("mmshm_arena_views_total", registered="yes")
    p = Producer(on_gpu)
    try:
        saves, addrs = _round_trips(p, range(5))
        # before the producer's exit (its pool unlinked, our mapping goes with it
        # at the next sweep, the sweeping thread's included)
        st = arena.VIEWS.status()
    finally:
        p.stop()
    assert all(s[3] for s in saves)  # every output went to an arena segment
    assert len({s[1] for s in saves}) == 5  # a new published name each time
    assert fake.registrations() == 1  # one registration for five loads
    assert [c[3] for c in fake.calls if c[0] == "register"] == [True]  # read-only
    assert len(set(addrs)) == 1  # the same mapping every time
    assert metric("mmshm_arena_views_total", registered="yes") - views0 == 5
    assert st["mappings"] == 1 and st["registered"] == 1 and st["views"] == 0, st
    gc.collect()
    arena.VIEWS.sweep()  # the producer's exit unlinked its pool: our mapping goes too
    assert arena.VIEWS.status()["mappings"] == 0
    assert ("unregister", addrs[0], 0) in fake.calls  # on the device it was mapped on
    assert segment_files() == []


def test_a_gpu_output_is_copied_once_into_the_arena_and_its_mapping_registered_once(
        arena_on):
    """The producer's side: one D2H per output into the reused arena segment,
    whose creator mapping is registered once although each output is published
    under a new name."""
    p = Producer(on_gpu=True)
    try:
        saves, _ = _round_trips(p, range(4))
        rep = p.ask("report")
    finally:
        p.stop()
    nbytes = ROWS * WIDTH * 2
    assert [s[2] for s in saves] == [nbytes] * 4 and all(s[3] for s in saves)
    assert rep["private_copies"] == []  # no .cpu()/.to(): one copy, into the segment
    assert rep["d2h_bytes"] == 4 * nbytes  # counted as a device-to-host copy each time
    regs = [c for c in rep["calls"] if c[0] == "register"]
    # the creator's writable mapping (header + payload), once for four outputs
    assert len(regs) == 1 and regs[0][3] is False and regs[0][2] >= nbytes


def test_without_the_arena_a_gpu_output_goes_straight_into_each_new_file(shm_dir):
    """No pool, no arena (a CPU host's default): every output is a new file,
    written by one D2H through its mapping (not pwrite), counted, bytes equal,
    nothing registered on either side."""
    fake = FakeRegistrar()
    arena.set_registrar(fake)
    p = Producer(on_gpu=True)
    try:
        saves, _ = _round_trips(p, range(3))
        rep = p.ask("report")
    finally:
        p.stop()
        arena.set_registrar(None)
    nbytes = ROWS * WIDTH * 2
    assert [s[2] for s in saves] == [nbytes] * 3 and not any(s[3] for s in saves)
    assert rep["private_copies"] == []
    assert rep["d2h_bytes"] == 3 * nbytes
    assert rep["registrations"] == 0 and fake.registrations() == 0
    assert segment_files() == []


def test_a_gpu_output_too_big_for_the_arena_goes_to_a_plain_segment(arena_on, monkeypatch):
    """An output larger than the arena: a plain segment, no registration, the
    same single D2H, the fallback counted by the producer."""
    monkeypatch.setenv("MMSHM_ARENA_BYTES", str(MiB // 2))
    config.reload()
    fake = FakeRegistrar()
    arena.set_registrar(fake)
    p = Producer(on_gpu=True)
    try:
        saves, _ = _round_trips(p, [1])
        rep = p.ask("report")
    finally:
        p.stop()
    assert saves[0][3] is False  # not an arena segment
    assert rep["registrations"] == 0 and rep["private_copies"] == []
    assert rep["d2h_bytes"] == ROWS * WIDTH * 2
    assert fake.registrations() == 0  # a plain segment's view: copy-on-write, unregistered
    assert segment_files() == []


def test_a_cpu_output_counts_no_gpu_copy_and_registers_nothing(arena_on):
    """The CPU path is today's: no device copy counted, nothing registered by
    the producer (its consumer still maps the arena segment once)."""
    p = Producer(on_gpu=False)
    try:
        _round_trips(p, range(2))
        rep = p.ask("report")
    finally:
        p.stop()
    assert rep["d2h_bytes"] == 0 and rep["registrations"] == 0
