"""Reliability under a small or full /dev/shm and under OS failures.

* container burst: TP=2, n=4, 200 real-photo requests in a 64 MiB tmpfs;
* foreign fill and the budget guard (``MMSHM_MAX_BYTES``, ``MMSHM_MIN_FREE_BYTES``);
* resource-tracker independence;
* a segment unlinked under us, or truncated before attach;
* descriptor exhaustion (``MMSHM_FD_RESERVE``, then a real EMFILE).

Tests that need a private tmpfs run a script under ``unshare -m`` and skip
cleanly when that is not possible (not root, no unshare).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys

import pytest
import torch

import mmshm
from mmshm import config
from mmshm.segments import segfile, segment
from mmshm.segments.table import TABLE

from tests.harness.procs import fork_ctx, fork_start, join, recv, track
from tests.harness.segments import segment_files
from tests.harness.metrics import delta, fallbacks
from tests.harness.shm import run_in_tmpfs, run_script, skip_without_unshare
from tests.harness.tensors import pattern
from tests.harness import workers

log = logging.getLogger("tests.figures")

MiB = 1 << 20


@pytest.fixture
def segdir(shm_dir):
    """The private segment directory the project conftest gives every test
    (also ``MMSHM_DIR``; checked empty, with nothing left open, afterwards)."""
    return shm_dir


def _set_env(monkeypatch, **kv):
    for k, v in kv.items():
        monkeypatch.setenv(k, str(v))
    config.reload()


# -- container burst ---------------------------------------------------------------
@pytest.mark.fault
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_container_burst_tp2_n4_200_photos_in_64mib(tmp_path):
    """The container burst. The summary line is meant to be quoted."""
    skip_without_unshare()
    pytest.importorskip("transformers")
    pytest.importorskip("skimage")
    out = tmp_path / "burst.json"
    r = run_in_tmpfs([sys.executable, "-m", "tests.scripts.burst", "--requests", "200",
                      "--n", "4", "--tp", "2", "--out", str(out), "--timeout", "120"],
                     size="64m", timeout=280)
    assert out.exists(), f"the driver died (rc {r.returncode}):\n{r.stderr[-4000:]}"
    res = json.loads(out.read_text())
    # diagnostic figures go to the log (pytest -o log_cli=true --log-cli-level=INFO);
    # fallbacks are expected here: a 64 MiB tmpfs cannot hold every image
    log.info("burst: requests=%s inline fallbacks by reason (expected in 64 MiB)=%s "
             "crashes=%s leftovers=%d segments=%s pool_hits=%s seconds=%s", res["requests"],
             res["fallbacks"], res["crashes"], len(res["leftovers"]), res["segments_created"],
             res["pool_hits"], res["seconds"])
    # no process dies: the producer and both TP ranks exit 0, no signal
    assert res["error"] is None, res["error"]
    assert r.returncode == 0, r.stderr[-4000:]
    assert res["exitcodes"] == {"tp0": 0, "tp1": 0}
    assert res["crashes"] == 0
    assert res["fs_size"] == 64 * MiB
    # every request's bytes correct on every rank, every copy of the fan-out
    assert res["requests"] == 200
    for st in res["ranks"]:
        assert st is not None
        assert st["failures"] == 0 and st["copies_bad"] == 0, st
        assert st["copies_ok"] == 200 * 4, st
        assert st["rids"] == list(range(200))
    # the fallback counters equal the tensors that went inline, all for lack of
    # room (`budget`: the reserve would be crossed; `enospc`: it does not fit)
    fb = res["fallbacks"]
    assert sum(fb.values()) == res["inline_tensors"]
    assert fb["emfile"] == fb["other"] == 0
    assert res["inline_tensors"] + res["shm_tensors"] == 200
    # one segment per request (n=4 copies share it): a new file, or one from the
    # producer's warm pool (a segment the ranks let go of is reused at once)
    assert res["segments_created"] + res["pool_hits"] == res["shm_tensors"]
    assert res["pool_hits"] > 0
    # segments and the inline fallback mixed
    assert res["shm_tensors"] > 0 and res["inline_tensors"] > 0
    # exactly what fits: in 64 MiB with the default 16 MiB reserve two 21.5 MiB
    # segments fit at once, so a burst of b requests sends max(0, b - 2) inline
    # (segments freed by the ranks are let go before the next burst is counted)
    assert res["inline_tensors"] == res["expected_inline"]
    for st in res["ranks"]:
        assert st["zero_copy"] == 4 * res["shm_tensors"]
        assert st["inline"] == 4 * res["inline_tensors"]
    # the directory is empty at the end
    assert res["leftovers"] == []


# -- foreign fill and the budget guard ------------------------------------------------
@pytest.mark.fault
@pytest.mark.timeout(120)
def test_foreign_fill_gives_budget_fallbacks_not_errors():
    res = run_script("tmpfs_scenarios", size="64m", timeout=110)
    fill = res["fill"]
    assert res["free_after_fill"] < 0.11 * res["fs_size"]
    assert fill["errors"] == []
    # every wrap of the burst (and the fan-out) went inline for `budget`, and
    # the 1 MiB tensors would have fit in the raw free space: it is the guard
    assert fill["inline"] == fill["wraps"] == 25
    assert fill["fallbacks"] == {"enospc": 0, "budget": 25, "emfile": 0, "other": 0}
    assert fill["fanout_inline_copies"] == 4 and fill["fanout_equal"]
    assert fill["segments"] == []
    assert fill["foreign_size"] == int(res["fs_size"] * 0.9)  # the unrelated file untouched
    assert fill["foreign_reaped"] == 0
    # once the foreign file is gone, the same tensors go through segments again
    assert res["recovered"] == {"handles": 8, "fallbacks": {
        "enospc": 0, "budget": 0, "emfile": 0, "other": 0}}
    # MMSHM_MIN_FREE_BYTES=40 MiB in an empty 64 MiB tmpfs: two 10 MiB segments fit
    mf = res["min_free"]
    assert (mf["handles"], mf["inline"]) == (2, 2)
    assert mf["fallbacks"] == {"enospc": 0, "budget": 2, "emfile": 0, "other": 0}
    assert mf["bytes_equal"]
    assert res["leftovers"] == [] and res["other_files"] == []


def _wrap_burst(tensors, d):
    before = fallbacks()
    w = mmshm.wrap({"mm_items": [{"feature": t} for t in tensors]}, directory=d)
    feats = [it["feature"] for it in w["mm_items"]]
    return w, feats, delta(before, fallbacks())


@pytest.mark.timeout(60)
def test_budget_max_bytes_cap(segdir, monkeypatch):
    _set_env(monkeypatch, MMSHM_MAX_BYTES=3 * MiB, MMSHM_MIN_FREE_BYTES=0)
    tensors = [pattern(MiB, i) for i in range(5)]
    w, feats, d = _wrap_burst(tensors, segdir)
    kinds = [type(f).__name__ for f in feats]
    # 1 MiB + one 4 KiB header each: two fit under 3 MiB, the third would not
    assert kinds == ["ShmTensor", "ShmTensor", "Tensor", "Tensor", "Tensor"]
    assert d == {"enospc": 0, "budget": 3, "emfile": 0, "other": 0}
    assert all(torch.equal(f, t) for f, t in zip(feats[2:], tensors[2:]))
    assert len(segment_files(segdir)) == 2
    mmshm.release(w)
    del w, feats
    # released in this process: the budget is free again at once
    w, feats, d = _wrap_burst(tensors[:2], segdir)
    assert [type(f).__name__ for f in feats] == ["ShmTensor", "ShmTensor"]
    assert sum(d.values()) == 0
    mmshm.release(w)


@pytest.mark.timeout(60)
def test_budget_min_free_bytes(segdir, monkeypatch):
    st = os.statvfs(segdir)
    free = st.f_bavail * st.f_frsize
    tensors = [pattern(256 << 10, i) for i in range(3)]
    _set_env(monkeypatch, MMSHM_MIN_FREE_BYTES=free + (1 << 30))  # reserve > free space
    w, feats, d = _wrap_burst(tensors, segdir)
    assert all(isinstance(f, torch.Tensor) for f in feats)
    assert d == {"enospc": 0, "budget": 3, "emfile": 0, "other": 0}
    assert segment_files(segdir) == []
    _set_env(monkeypatch, MMSHM_MIN_FREE_BYTES=0)
    w, feats, d = _wrap_burst(tensors, segdir)
    assert all(isinstance(f, mmshm.ShmTensor) for f in feats)
    assert sum(d.values()) == 0
    assert [mmshm.content_hash(f.materialize()) for f in feats] == [
        mmshm.content_hash(t) for t in tensors]
    del w, feats


@pytest.mark.timeout(60)
def test_budget_ignores_segments_freed_by_another_process(segdir, monkeypatch):
    """A consumer in another process gives back the last reference; the
    producer's next segment of the same size must not be refused."""
    _set_env(monkeypatch, MMSHM_MAX_BYTES=3 * MiB, MMSHM_MIN_FREE_BYTES=0,
             MMSHM_SWEEP_INTERVAL_S=3600)
    t = pattern(2 * MiB, 1)
    h = mmshm.ShmTensor.from_tensor(t, directory=segdir)
    h.share(1)
    data = pickle.dumps(h)
    h.release()
    a, b = fork_ctx().Pipe()
    consumer = fork_start(workers.w_release_on_command, segdir, b)
    a.send(data)
    assert recv(a, 30) == "ready"
    a.send("release")  # the last reference goes away in the other process
    assert recv(a, 30)[0] is None
    assert join(consumer) == 0
    assert segment_files(segdir) == []
    w, feats, d = _wrap_burst([t], segdir)
    try:
        assert isinstance(feats[0], mmshm.ShmTensor), d
        assert sum(d.values()) == 0
    finally:
        mmshm.release(w)
        TABLE.sweep()


# -- resource tracker ------------------------------------------------------------------
_CHILD = r"""
import pickle, sys
from multiprocessing import resource_tracker
resource_tracker.ensure_running()   # a running tracker must not get involved
import mmshm
h = pickle.loads(bytes.fromhex(sys.argv[1]))
v = h.materialize()
ok = mmshm.content_hash(v) == bytes.fromhex(sys.argv[2])
print("OK" if ok else "BAD", flush=True)
"""


@pytest.mark.timeout(120)
def test_resource_tracker_independence(segdir):
    t = pattern(3 * MiB + 5, 11)
    h = mmshm.ShmTensor.from_tensor(t, directory=segdir)
    h.share(1)
    env = dict(os.environ, MMSHM_DIR=segdir, PYTHONWARNINGS="default")
    p = subprocess.Popen([sys.executable, "-c", _CHILD, pickle.dumps(h).hex(), h.hash.hex()],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    track(p.pid)
    out, err = p.communicate(timeout=100)
    assert p.returncode == 0, err
    assert out.strip() == "OK"
    assert "resource_tracker" not in err and "leaked shared_memory" not in err, err
    # the unrelated process attached, exited, and gave its reference back
    assert os.path.exists(os.path.join(segdir, h.name))
    assert segment.update_refcount(h.name, 0, segdir) == 1
    assert torch.equal(h.clone().materialize(copy=True), t)
    h.release()
    assert segment_files(segdir) == []


# -- a segment that disappears or shrinks under us -------------------------------------
@pytest.mark.timeout(60)
def test_unlinked_while_mapped_views_survive_and_release_tolerates_enoent(segdir, caplog):
    caplog.set_level(logging.WARNING, logger="mmshm")
    t = pattern(2 * MiB, 21).view(512, -1)
    h = mmshm.ShmTensor.from_tensor(t, directory=segdir)
    h.share(2)
    data = pickle.dumps(h)
    path = os.path.join(segdir, h.name)
    a, b = fork_ctx().Pipe()
    other = fork_start(workers.w_release_on_command, segdir, b)  # holds a never-attached handle
    a.send(data)
    assert recv(a, 30) == "ready"
    v = pickle.loads(data).materialize()
    assert torch.equal(v, t)
    os.unlink(path)  # a third party (systemd's RemoveIPC) removes the file
    assert torch.equal(v, t)  # existing views keep working
    v2 = v.clone()
    a.send("release")
    err, records, still_owns = recv(a, 30)
    assert join(other) == 0
    assert err is None and not still_owns
    assert records == [], records  # ENOENT is not worth a warning
    h.release()
    del v  # the last reference: unlinking an already unlinked file is fine
    assert torch.equal(v2, t)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    # the other process's reference could not be given back (the file is gone);
    # the creator must still let go of it, or its tmpfs pages stay allocated
    TABLE.sweep()
    assert h.name not in TABLE.names()


@pytest.mark.timeout(60)
def test_creator_lets_go_of_a_segment_unlinked_by_a_third_party(segdir):
    h = mmshm.ShmTensor.from_tensor(pattern(2 * MiB, 22), directory=segdir)
    h.share(1)
    a, b = fork_ctx().Pipe()
    other = fork_start(workers.w_release_on_command, segdir, b)
    a.send(pickle.dumps(h))
    assert recv(a, 30) == "ready"
    os.unlink(os.path.join(segdir, h.name))  # RemoveIPC
    a.send("release")
    assert recv(a, 30)[0] is None
    assert join(other) == 0
    h.release()
    TABLE.sweep()
    assert h.name not in TABLE.names()


@pytest.mark.timeout(60)
def test_truncated_before_attach_is_a_typed_error_not_sigbus(segdir):
    t = pattern(4 * MiB, 31)
    h = mmshm.ShmTensor.from_tensor(t, directory=segdir)
    h.share(2)  # the worker unpickles the handle twice
    os.truncate(os.path.join(segdir, h.name), segfile.HEADER_SIZE + 100)
    a, b = fork_ctx().Pipe()
    p = fork_start(workers.w_truncated_attach, segdir, pickle.dumps(h), b)
    res = recv(a, 30)
    assert join(p) == 0  # never SIGBUS (-7)
    assert res["direct"].startswith("SegmentCorruptError"), res
    assert "truncated" in res["direct"]
    assert res["copy"].startswith("SegmentCorruptError"), res
    assert res["deferred"] == ("MaterializeError", "corrupt")
    h.release()
    assert segment_files(segdir) == []


# -- descriptor exhaustion ---------------------------------------------------------------
@pytest.mark.timeout(60)
def test_descriptor_exhaustion_falls_back_inline_with_emfile(segdir):
    fh = mmshm.ShmTensor.from_tensor(pattern(MiB, 41), directory=segdir)
    try:
        fh.share(1)
        a, b = fork_ctx().Pipe()
        p = fork_start(workers.w_emfile, segdir, 10, 256 << 10, pickle.dumps(fh), b)
        res = recv(a, 30)
        assert join(p) == 0
        assert res["fd_reserve"] == 64
        # RLIMIT_NOFILE lowered to leave at most three descriptors below
        # MMSHM_FD_RESERVE: some tensors got segments, the rest went inline
        # with `emfile`, one count per tensor, none dropped
        r1 = res["reserve"]
        assert 1 <= r1["handles"] <= 3 and r1["other_types"] == 0, r1
        assert r1["handles"] + r1["inline"] == 10
        assert r1["fallbacks"] == {"enospc": 0, "budget": 0, "emfile": r1["inline"], "other": 0}
        assert r1["inline_bytes_equal"] and r1["handle_hashes_equal"]
        # attach inside the reserve: a typed per-request error, not a crash
        assert tuple(res["attach"]) == ("MaterializeError", "emfile")
        # at the hard limit (a real EMFILE from open): everything inline, counted
        r2 = res["hard"]
        assert (r2["handles"], r2["inline"], r2["other_types"]) == (0, 10, 0), r2
        assert r2["fallbacks"] == {"enospc": 0, "budget": 0, "emfile": 10, "other": 0}
        assert r2["inline_bytes_equal"]
        assert res["handles_materialize"]  # every handle made still has its bytes
        assert res["left"] == [fh.name]  # the worker's segments are all gone
        # the worker gave back the foreign handle's reference despite the failure
        assert segment.update_refcount(fh.name, 0, segdir) == 1
    finally:
        fh.release()
