"""The copy (and the hash) split across threads (``MMSHM_COPY_THREADS``,
:func:`mmshm.segments.shmtensor.parallel_fill`): the same bytes and the same digest as
one thread, at and around the chunk boundaries, into new and pooled
segments; a failed write typed and leaving nothing, with no thread still
writing; the setting's bounds; the process's affinity as the cap."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import blake3
import numpy as np
import pytest
import torch

import mmshm
from mmshm import config
from mmshm.segments import shmtensor
from mmshm.segments.table import TABLE

from tests.harness.segments import segment_files

MIB = 1 << 20
CHUNK = shmtensor.PARALLEL_CHUNK
SIZES = [shmtensor.PARALLEL_MIN_BYTES - 1, shmtensor.PARALLEL_MIN_BYTES, CHUNK + 1,
         2 * CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 1, 3 * CHUNK + 12345]


def _threads(monkeypatch, n: int, cpus: int = 8) -> None:
    """``MMSHM_COPY_THREADS=n`` on a process that may use ``cpus`` CPUs."""
    monkeypatch.setattr(shmtensor, "_cpus", lambda: cpus)
    monkeypatch.setenv("MMSHM_COPY_THREADS", str(n))
    config.reload()


def _data(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_chunk_constants_as_documented():
    assert CHUNK == 4 * MIB and shmtensor.PARALLEL_MIN_BYTES == 4 * MIB
    assert shmtensor.COPY_CHUNK == 256 << 10  # the one-thread pass is unchanged


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_same_bytes_and_digest_on_any_thread_count_new_and_pooled(pool, monkeypatch, threads):
    """Every size around the chunk boundaries, hash asked for now or not:
    the segment holds the tensor's bytes and the digest is BLAKE3-128 of
    them, as on one thread; the second round reuses the pooled segment
    (copied through the mapping) after the first wrote a new file (pwrite)."""
    _threads(monkeypatch, threads)
    assert shmtensor.copy_threads() == threads
    for nbytes in SIZES:
        names = []
        for seed in (nbytes, nbytes + 1):
            t = _data(nbytes, seed)
            want = blake3.blake3(t.numpy().tobytes()).digest(16)
            h = mmshm.ShmTensor.from_tensor(t, hash_now=True)
            lazy = mmshm.ShmTensor.from_tensor(t)
            names.append({h.name, lazy.name})
            assert h.meta.hash == want, (threads, nbytes)
            assert torch.equal(h.materialize(copy=True), t)
            assert lazy.hash == want
            assert torch.equal(lazy.materialize(copy=True), t)
            assert mmshm.content_hash(t) == want
            del h, lazy
            gc.collect()
        assert names[0] == names[1], "the second round reused the pooled segments"
    TABLE.trim_pool()


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("into", ["mapping", "file"])
def test_parallel_fill_directly(tmp_path, threads, into):
    n = 3 * CHUNK + 777
    src = _data(n, threads).numpy()
    want = blake3.blake3(src).digest(16)
    if into == "mapping":
        dst = np.zeros(n, dtype=np.uint8)
        assert shmtensor.parallel_fill(src, threads, dst=dst, hash=True) == want
        assert np.array_equal(dst, src)
        dst[:] = 0
        assert shmtensor.parallel_fill(src, threads, dst=dst) is None
        assert np.array_equal(dst, src)
    else:
        path = tmp_path / "f"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 100 + n)
            assert shmtensor.parallel_fill(src, threads, fd=fd, offset=100, hash=True) == want
        finally:
            os.close(fd)
        assert path.read_bytes()[100:] == src.tobytes()


def test_a_failed_pwrite_in_the_third_chunk_is_typed_leaves_nothing_and_no_writer(
        shm_dir, monkeypatch):
    """The third pwrite of a new segment's copy fails (EIO): SegmentError
    with the errno, the segment unlinked, and no helper writes afterwards."""
    _threads(monkeypatch, 4)
    calls = []
    lock = threading.Lock()
    real = os.pwrite

    def flaky(fd, data, offset):
        with lock:
            calls.append(offset)
            third = len(calls) == 3
        if third:
            raise OSError(5, "Input/output error")
        time.sleep(0.002)
        return real(fd, data, offset)

    monkeypatch.setattr(shmtensor, "_pwrite", flaky)
    t = _data(6 * CHUNK, 3)
    with pytest.raises(mmshm.SegmentError) as ei:
        mmshm.ShmTensor.from_tensor(t, hash_now=True)
    assert ei.value.errno == 5
    seen = len(calls)
    assert 3 <= seen < 6, "no chunk starts after the failure"
    time.sleep(0.05)
    assert len(calls) == seen, "a helper wrote after from_tensor returned"
    monkeypatch.undo()
    gc.collect()
    assert segment_files() == []


def test_the_caller_returns_only_when_no_helper_runs_a_task():
    """A task on the calling thread fails (an interrupt included) while a
    helper is still copying: the error comes out only once the helper is done."""
    gate = threading.Event()
    finished = []

    def slow():
        gate.set()
        time.sleep(0.1)
        finished.append(True)

    def interrupted():
        gate.wait(5)
        raise KeyboardInterrupt

    # the helper takes tasks from the front, the caller from the back
    with pytest.raises(KeyboardInterrupt):
        shmtensor._HELPERS.run([slow, interrupted], helpers=1)
    assert finished == [True]


def test_a_job_still_queued_for_busy_helpers_holds_nothing_once_done():
    """Every helper is busy: the calling thread runs the whole job itself, and
    once it returns the queued job holds no task (no view of a segment keeps
    its mapping alive) and runs nothing when a helper gets to it."""
    import weakref

    helpers = shmtensor._HELPERS
    helpers.run([lambda: None] * 3, helpers=2)
    n = len(helpers.threads)
    release, started = threading.Event(), threading.Semaphore(0)

    def block():
        started.release()
        release.wait(10)

    blocker = threading.Thread(target=helpers.run, args=([block] * (n + 1), n))
    blocker.start()
    try:
        for _ in range(n + 1):
            assert started.acquire(timeout=10)
        view = np.zeros(16)
        ref = weakref.ref(view)
        ran = []
        helpers.run([lambda v=view: ran.append(v.size) for _ in range(4)], helpers=n)
        assert ran == [16] * 4
        del view, ran
        gc.collect()
        assert ref() is None
    finally:
        release.set()
        blocker.join(10)
    assert not blocker.is_alive()


def test_helper_threads_are_kept_not_made_per_call(monkeypatch):
    _threads(monkeypatch, 3)
    src = _data(3 * CHUNK, 1).numpy()
    dst = np.empty_like(src)
    shmtensor.parallel_fill(src, 3, dst=dst)
    before = {t.ident for t in threading.enumerate() if t.name.startswith("mmshm-copy-")}
    assert len(before) >= 2
    for _ in range(5):
        shmtensor.parallel_fill(src, 3, dst=dst, hash=True)
    after = {t.ident for t in threading.enumerate() if t.name.startswith("mmshm-copy-")}
    assert after == before


@pytest.mark.parametrize("bad", ["-1", "two", "1.5", "1025"])
def test_bad_copy_threads_values_are_rejected(monkeypatch, caplog, bad):
    monkeypatch.setenv("MMSHM_COPY_THREADS", bad)
    with pytest.raises(config.SettingError, match="MMSHM_COPY_THREADS") as ei:
        config.check()
    assert ei.value.variable == "MMSHM_COPY_THREADS"
    assert "an integer >= 0, at most 1024" in ei.value.allowed
    monkeypatch.setattr(config, "_warned", set())
    with caplog.at_level("WARNING", logger="mmshm"):
        assert config.reload().copy_threads == 0  # a server keeps running: automatic
    assert f"MMSHM_COPY_THREADS={bad!r} is not valid" in caplog.text


def test_automatic_threads_follow_the_cpus(monkeypatch):
    assert [shmtensor.auto_copy_threads(c) for c in (1, 2, 3, 4, 8, 16, 64, 128)] == \
        [1, 1, 1, 2, 4, 8, 8, 8]
    monkeypatch.delenv("MMSHM_COPY_THREADS", raising=False)
    config.reload()
    monkeypatch.setattr(shmtensor, "_cpus", lambda: 16)
    assert shmtensor.copy_threads() == 8
    _threads(monkeypatch, 1, cpus=16)
    assert shmtensor.copy_threads() == 1
    _threads(monkeypatch, 12, cpus=4)
    assert shmtensor.copy_threads() == 4  # capped by the affinity


AFFINITY = """
import os, sys
cpu = sorted(os.sched_getaffinity(0))[0]
os.sched_setaffinity(0, {cpu})
os.environ["MMSHM_COPY_THREADS"] = sys.argv[1]
from mmshm import config
from mmshm.segments import shmtensor
config.reload()
print(shmtensor.copy_threads())
"""


@pytest.mark.parametrize("setting", ["0", "4"])
def test_affinity_of_one_cpu_gives_one_thread(setting):
    out = subprocess.run([sys.executable, "-c", AFFINITY, setting], capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == "1", out.stderr


def test_after_fork_the_child_copies_with_fresh_helpers(monkeypatch):
    """The parent's helper threads and BLAKE3 pools do not exist in a forked
    child; the child makes its own and gets the same bytes and digest."""
    _threads(monkeypatch, 3)
    src = _data(3 * CHUNK, 9).numpy()
    dst = np.empty_like(src)
    want = shmtensor.parallel_fill(src, 3, dst=dst, hash=True)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = False
        try:
            d2 = np.zeros_like(src)
            ok = (shmtensor.parallel_fill(src, 3, dst=d2, hash=True) == want
                  and np.array_equal(d2, src) and shmtensor.content_hash(src) == want)
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_the_sweeper_maps_a_pooled_segment_written_with_pwrite_before_its_reuse(pool):
    """A new segment is written with pwrite: its pages are not in this
    process's mapping, and its first reuse from the pool would fault each of
    them. ``warm_pooled`` (the sweeper, between requests) maps them first:
    the reuse then faults (almost) none, and gets the right bytes."""
    from mmshm.segments.segment import Segment  # noqa: F401 - the slot is there

    pages = (4 * MIB) // 4096
    for warm in (False, True):
        t = _data(4 * MIB, 5 + warm)
        h = mmshm.ShmTensor.from_tensor(t)
        name = h.name
        seg = TABLE.get(name)
        assert seg.cold, "written with pwrite, never through the mapping"
        del h
        gc.collect()
        TABLE.sweep()
        assert name in TABLE.pooled_names()
        if warm:
            assert TABLE.warm_pooled() == 1
            assert not seg.cold and TABLE.warm_pooled() == 0  # once
        t2 = _data(4 * MIB, 7 + warm)
        before = _minor_faults()
        h = mmshm.ShmTensor.from_tensor(t2)
        faults = _minor_faults() - before
        assert h.name == name, "reused from the pool"
        if warm:
            assert faults < pages // 8, faults
        else:
            assert faults >= pages // 2, faults
        assert not seg.cold  # written through the mapping now
        assert torch.equal(h.materialize(copy=True), t2)
        del h
        gc.collect()
        TABLE.sweep()
        assert TABLE.warm_pooled() == 0  # nothing cold left
        TABLE.trim_pool()
