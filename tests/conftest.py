"""Every test runs with a private segment directory and must leave it empty.

The autouse fixture points ``MMSHM_DIR`` at a fresh directory under /dev/shm
(a tmpfs, like production), turns the automatic reaper off (so that a leak is
seen, not silently reclaimed) and the warm pool off (so that "the last release
unlinks" can be asserted; the pool's own tests turn it on with the ``pool``
fixture), and after the test runs ``gc.collect()``, empties the pool and
asserts that:

* the private directory holds no ``mmshm-*`` entry,
* this process has no segment open any more,
* /dev/shm itself gained no ``mmshm-*`` file created by this process or one of
  the children the tests started.
"""

from __future__ import annotations

import gc
import os
import secrets
import shutil

import pytest

from mmshm import config
from mmshm.segments.table import TABLE

from tests.harness.procs import SPAWNED_PIDS
from tests.harness.segments import SHM_ROOT, created_by, segment_files


def _our_shm_files() -> set[str]:
    return created_by({os.getpid()} | SPAWNED_PIDS, SHM_ROOT)


@pytest.fixture(autouse=True)
def shm_dir(monkeypatch):
    """The private segment directory of this test (also in ``MMSHM_DIR``)."""
    # Everything alive now survived the previous test's teardown collection:
    # freezing it keeps each gc.collect() below cheap (torch's heap is large).
    gc.freeze()
    before = _our_shm_files()
    d = os.path.join(SHM_ROOT, f"pytest-mmshm-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(d, 0o700)
    monkeypatch.setenv("MMSHM_DIR", d)
    monkeypatch.setenv("MMSHM_REAP_INTERVAL_S", "0")
    monkeypatch.setenv("MMSHM_POOL", "0")
    for var in ("MMSHM_MIN_BYTES", "MMSHM_DISABLE", "MMSHM_MAX_BYTES", "MMSHM_MIN_FREE_BYTES",
                "MMSHM_POOL_IDLE_S", "MMSHM_POOL_MAX_BYTES", "MMSHM_NODE_ID",
                "MMSHM_HASH", "MMSHM_MODE", "MMSHM_ARENA_BYTES"):
        monkeypatch.delenv(var, raising=False)
    config.reload()
    try:
        yield d
    finally:
        gc.collect()
        TABLE.sweep()
        TABLE.trim_pool()
        problems = []
        left = segment_files(d)
        if left:
            problems.append(f"segments left in MMSHM_DIR: {left}")
        still_open = [n for n in TABLE.names()]
        if still_open:
            problems.append(f"segments still open in this process: {still_open}")
        new_in_shm = _our_shm_files() - before
        if new_in_shm:
            problems.append(f"new segments in /dev/shm: {sorted(new_in_shm)}")
        # clean up whatever is left so that one failure does not cascade
        with TABLE.lock:
            for seg in list(TABLE.segments.values()):
                TABLE.forget(seg)
        shutil.rmtree(d, ignore_errors=True)
        for n in new_in_shm:
            try:
                os.unlink(os.path.join(SHM_ROOT, n))
            except OSError:
                pass
        monkeypatch.undo()
        config.reload()
        if problems:
            pytest.fail("; ".join(problems), pytrace=False)



@pytest.fixture
def mode(monkeypatch):
    """``mode("observe")`` / ``mode("shm")`` sets ``MMSHM_MODE`` for one test and re-reads
    the settings; the variable is removed and the settings re-read after it."""
    def set_mode(value: str):
        monkeypatch.setenv("MMSHM_MODE", value)
        config.reload()

    yield set_mode
    monkeypatch.delenv("MMSHM_MODE", raising=False)
    config.reload()


@pytest.fixture
def pool(monkeypatch, shm_dir):
    """Turn the warm segment pool on for this test (the directory is ``shm_dir``)."""
    monkeypatch.setenv("MMSHM_POOL", "1")
    monkeypatch.setenv("MMSHM_POOL_IDLE_S", "60")
    config.reload()
    yield shm_dir


@pytest.fixture
def no_bench(monkeypatch):
    """run_bench recorded, never run."""
    from mmshm import bench

    seen = []

    def fake_run_bench(cfg, reporter=None, on_run=None):
        seen.append(cfg)
        return {"runs": [], "floors": [], "summary": [], "leftover_segments": [],
                "config": {"shm_dir": "/dev/shm"}, "elapsed_s": 0.0}

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    return seen


@pytest.fixture
def arena_on(monkeypatch, shm_dir):
    """The pool and a 32 MiB arena (MMSHM_ARENA_BYTES, off by default on a host
    without CUDA) in this test's private segment directory, inherited by spawned
    children through the environment; the arena's registrar and mappings are
    put back afterwards."""
    from mmshm.segments import arena

    monkeypatch.setenv("MMSHM_POOL", "1")
    monkeypatch.setenv("MMSHM_POOL_IDLE_S", "60")
    monkeypatch.setenv("MMSHM_ARENA_BYTES", str(32 << 20))
    config.reload()
    yield shm_dir
    arena.set_registrar(None)
    gc.collect()
    arena.VIEWS.settled()
    TABLE.trim_pool()
    arena.VIEWS.sweep()


@pytest.fixture
def store(monkeypatch):
    """The Mooncake Store leg on a stand-in engine (tests/harness/store_leg.py):
    ``(engine, tier(timeout_s, keep_s, **extra))``, started clients of one
    stand-in Store for server ``vllm``."""
    from tests.harness.store_leg import stand_in_store

    with stand_in_store(monkeypatch, "vllm") as s:
        yield s


@pytest.fixture
def nodes(tmp_path):
    """``cache(name, keep_s=60)``: an encoder cache on simulated node
    ``name``'s segment directory (tests/harness/store_leg.py)."""
    from tests.harness.store_leg import node_caches

    with node_caches(tmp_path, "vllm") as cache:
        yield cache
