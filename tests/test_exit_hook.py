"""The exit hook in children of the third-party ``multiprocess`` package
: they leave through ``os._exit`` after running only
``multiprocess.util``'s finalizers, so mmshm's hook must be registered there
too (mmshm never imports the package itself)."""

from __future__ import annotations

import pytest

from mmshm.segments import segment

from tests.harness.procs import track
from tests.harness.segments import segment_files
from tests.harness import workers

multiprocess = pytest.importorskip("multiprocess")


def _child_leaves_a_pooled_segment(directory: str) -> None:
    # no torch here: a fork child must not meet the parent's OpenMP pool
    workers.use_dir(directory, MMSHM_POOL="1", MMSHM_POOL_IDLE_S="600")
    seg = segment.create(1 << 20)
    # back to this process's pool: only its exit hook unlinks it
    assert segment.update_refcount(seg.name, -1) == 0


@pytest.mark.timeout(60)
def test_a_multiprocess_child_runs_the_exit_hook(shm_dir):
    assert "multiprocess" not in segment.__dict__  # no dependency: looked up in sys.modules
    p = multiprocess.get_context("fork").Process(target=_child_leaves_a_pooled_segment,
                                                 args=(shm_dir,))
    p.start()
    track(p.pid)
    p.join(30)
    assert p.exitcode == 0
    assert segment_files(shm_dir) == []  # without the hook: the pooled segment stays
