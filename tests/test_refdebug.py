"""``MMSHM_DEBUG_REFS=1`` : where references were taken and
given back, leaks reported, a use after the last release names the release.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import mmshm
from mmshm.segments import shmtensor, reaper, refdebug, segfile, segment
from mmshm.segments.table import TABLE

from tests.harness.segments import segment_files
from tests.harness.tensors import pattern


@pytest.fixture
def debug_refs():
    refdebug.install()
    try:
        yield
    finally:
        refdebug.uninstall()


def _line_of(text: str) -> str:
    """``test_refdebug.py", line N`` of the line containing ``text`` in this file."""
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if text in line and "_line_of" not in line:
                return f'test_refdebug.py", line {i}'
    raise AssertionError(text)


def test_off_by_default_nothing_is_wrapped(shm_dir):
    assert not refdebug.installed()
    for attr in ("share", "release", "hand_over", "materialize", "__reduce__"):
        assert not hasattr(vars(shmtensor.ShmTensor)[attr], "__wrapped__")
    assert not hasattr(shmtensor._adopt, "__wrapped__")
    assert not hasattr(segfile.update_count, "__wrapped__")


def test_hand_over_after_share_is_reported_as_a_leak(shm_dir, debug_refs, caplog):
    h = mmshm.ShmTensor.from_tensor(pattern(1 << 17, 1))
    h.share(1)  # share-here
    data = pickle.dumps(h)
    with caplog.at_level(logging.ERROR, logger="mmshm"):
        h.hand_over()  # hand-over-here
    (leak,) = refdebug.leaks()
    assert leak.startswith(f"1 reference(s) to {h.name} leak")
    assert _line_of("# share-here") in leak and _line_of("# hand-over-here") in leak
    assert any(leak in r.getMessage() for r in caplog.records)
    assert segment.update_refcount(h.name, 0) == 2  # the leak is real: one receiver, two refs
    pickle.loads(data).release()
    assert segment.update_refcount(h.name, -1) == 0  # give the leaked one back by hand
    assert segment_files(shm_dir) == []


def test_two_pickles_then_share_and_hand_over_is_not_a_leak(shm_dir, debug_refs):
    h = mmshm.ShmTensor.from_tensor(pattern(1 << 17, 2))
    h.share(1)
    a, b = pickle.dumps(h), pickle.dumps(h)
    h.hand_over()
    assert refdebug.leaks() == []
    pickle.loads(a).release()
    pickle.loads(b).release()


def test_a_use_after_release_names_the_release(shm_dir, debug_refs):
    h = mmshm.ShmTensor.from_tensor(pattern(1 << 17, 3))
    h.release()  # released-here
    with pytest.raises(mmshm.HandleStateError) as ei:
        h.materialize()
    assert "given back by release() at" in str(ei.value)
    assert _line_of("# released-here") in str(ei.value)


def test_references_held_are_listed_with_where_they_were_taken(shm_dir, debug_refs):
    h = mmshm.ShmTensor.from_tensor(pattern(1 << 17, 4))  # taken-here
    v = h.clone().materialize()  # view-here
    refs = refdebug.held()
    assert sorted(r.kind for r in refs) == ["handle", "view"]
    by_kind = {r.kind: r for r in refs}
    assert _line_of("# taken-here") in by_kind["handle"].taken_at
    assert _line_of("# view-here") in by_kind["view"].taken_at
    assert "never given back" in refdebug.report()
    del v
    h.release()
    assert refdebug.held() == [] and refdebug.report() == ""


_RECEIVER = textwrap.dedent("""
    import pickle, sys
    import mmshm
    h = pickle.loads(sys.stdin.buffer.read())
    h.materialize(copy=True)  # the receiver that was handed the only reference
""")

_EXITER = textwrap.dedent("""
    import mmshm, torch
    KEPT = mmshm.ShmTensor.from_tensor(torch.ones(1 << 16))  # kept-at-exit
""")


def _run(code: str, shm_dir: str, stdin: bytes = b"", debug: str = "1"):
    env = dict(os.environ, MMSHM_DIR=shm_dir, MMSHM_DEBUG_REFS=debug)
    return subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True,
                          timeout=60, env=env)


@pytest.mark.timeout(120)
def test_a_forgotten_share_names_the_release_in_the_other_process(shm_dir, debug_refs):
    """The leak it was made for: two sends, one reference: the first receiver frees
    the segment; the second gets SegmentNotFoundError naming that call."""
    h = mmshm.ShmTensor.from_tensor(pattern(1 << 17, 5))
    first, second = pickle.dumps(h), pickle.dumps(h)  # share(1) forgotten
    h.hand_over()
    r = _run(_RECEIVER, shm_dir, first)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    late = pickle.loads(second)
    with pytest.raises(mmshm.SegmentNotFoundError) as ei:
        late.materialize()
    msg = str(ei.value)
    assert "its last reference was given back by pid" in msg
    assert '"<string>", line 5, in <module>' in msg  # the receiver's materialize(copy=True)
    late.release()


@pytest.mark.timeout(120)
def test_references_still_held_at_exit_are_reported_with_their_stacks(shm_dir):
    r = _run(_EXITER, shm_dir)
    assert r.returncode == 0
    err = r.stderr.decode()
    assert "1 reference(s) never given back" in err
    assert '"<string>", line 3, in <module>' in err  # where KEPT was taken
    reaper.reap(shm_dir, grace_s=0)  # whatever the interpreter's shutdown left


@pytest.mark.timeout(120)
def test_the_creator_cannot_read_a_segment_freed_in_another_process(shm_dir, monkeypatch):
    """Without debugging too: the creator still has the segment open (until
    its next sweep), but its last reference is gone: a late handle must fail,
    not read a freed segment. The background sweeper is held off meanwhile
    (on a loaded host it could run while the receiver does)."""
    with monkeypatch.context() as mp:
        mp.setattr(TABLE, "sweep", lambda: 0)  # the background thread's
        h = mmshm.ShmTensor.from_tensor(pattern(1 << 17, 6))
        first, second = pickle.dumps(h), pickle.dumps(h)  # share(1) forgotten
        h.hand_over()
        r = _run(_RECEIVER, shm_dir, first, debug="0")
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        assert h.name in TABLE.names()  # not swept yet
        late = pickle.loads(second)
        with pytest.raises(mmshm.SegmentNotFoundError, match="already freed"):
            late.materialize()
    late.release()
