"""One descriptor per mapped segment.

Python's ``mmap`` duplicated every descriptor it mapped: a producer held two
per segment, a reader two per view. Segments are now mapped without a
duplicate, and the liveness lock still lasts exactly as long as a descriptor
or a mapping of the segment does.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import subprocess
import sys

import pytest

import mmshm
from mmshm.segments import reaper, segfile
from mmshm.segments.table import TABLE

from tests.harness import ROOT
from tests.harness.segments import segment_files
from tests.harness.tensors import pattern


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_producer_holds_one_descriptor_per_segment(shm_dir):
    before = _fds()
    hs = [mmshm.ShmTensor.from_tensor(pattern(1 << 16, i)) for i in range(50)]
    assert _fds() - before == 50
    for h in hs:
        h.release()
    assert _fds() == before


def test_views_of_one_segment_share_its_descriptor(shm_dir):
    t = pattern(1 << 18, 2)
    h = mmshm.ShmTensor.from_tensor(t)
    before = _fds()
    views = [h.clone().materialize() for _ in range(10)]
    assert _fds() == before  # the creator's descriptor serves every view
    assert all(bytes(v.numpy()) == bytes(t.numpy()) for v in views)
    del views
    h.release()


@pytest.mark.timeout(120)
def test_a_reader_under_ulimit_256_holds_twice_the_views(shm_dir):
    """The figure of the note: 94 views before, 188 after (RLIMIT_NOFILE 256,
    MMSHM_FD_RESERVE 64): one descriptor per view."""
    r = subprocess.run([sys.executable, "-m", "tests.scripts.fd_views", "300", "256"],
                       capture_output=True, text=True, timeout=110,
                       env=dict(os.environ, MMSHM_DIR=shm_dir), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert "error" not in res, res
    assert res["producer_fds"] == 300
    assert res["views_equal"]
    # every descriptor number below 256 - 64 is usable; a few are the interpreter's
    assert 180 <= res["reader_views"] <= 192 - 3
    assert res["reader_fds"] <= res["reader_views"] + 10
    assert segment_files(shm_dir) == []


def test_the_liveness_lock_lasts_while_a_mapping_does_without_any_descriptor(shm_dir):
    """What the design relies on: a mapping keeps the open file description,
    and with it the shared liveness lock, after its descriptor is closed."""
    t = pattern(1 << 16, 4)
    h = mmshm.ShmTensor.from_tensor(t)
    h.share(1)  # the reference the mapping below stands for
    fd = os.open(os.path.join(shm_dir, h.name), os.O_RDWR)
    segfile._lock(fd, fcntl.F_RDLCK, segfile.LIVE_BYTE)
    buf = segfile.map_fd(fd, 1 << 16, segfile.HEADER_SIZE, shared=False)
    os.close(fd)
    h.release()
    with TABLE.lock:  # the creator lets go of its descriptor and mapping
        TABLE.forget(TABLE.segments[h.name])
    gc.collect()
    (info,) = reaper.scan(shm_dir, grace_s=0)
    assert (info.orphan, info.reason) == (False, "")  # held by the mapping alone
    assert bytes(buf) == bytes(t.numpy())
    del buf
    gc.collect()
    (info,) = reaper.scan(shm_dir, grace_s=0)
    assert (info.orphan, info.reason) == (True, "in_flight_expired")
    assert reaper.reap(shm_dir, grace_s=0).reclaimed == 1
