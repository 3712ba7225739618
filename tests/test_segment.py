"""Segments: naming, permissions, O_EXCL, header, reference count, and what
happens when a third party truncates, unlinks or replaces a segment file."""

from __future__ import annotations

import errno
import gc
import os
import pickle
import re
import stat

import mmshm
import pytest
import torch
from mmshm.segments import segfile, segment
from mmshm.segments.table import TABLE
from mmshm.segments.codec import HandleMeta

from tests.harness.procs import run_child, signal_name
from tests.harness.segments import header, refcount, seg_dir, segment_files
from tests.harness.metrics import fallbacks_total
from tests.harness.tensors import make_tensor, same
from tests.harness import children


def _path(name: str) -> str:
    return os.path.join(seg_dir(), name)


def test_created_with_mode_0600_and_naming_scheme(shm_dir):
    old = os.umask(0)  # a permissive umask must not widen the mode
    try:
        h = mmshm.ShmTensor.from_tensor(torch.arange(1000, dtype=torch.float32))
    finally:
        os.umask(old)
    assert re.fullmatch(rf"mmshm-{os.getpid()}-[0-9a-f]{{16}}", h.name), h.name
    assert segfile.NAME_RE.match(h.name)
    st = os.lstat(_path(h.name))
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    assert segment_files() == [h.name]
    h.release()
    assert segment_files() == []


def test_header_size_and_space_reserved(shm_dir):
    nbytes = 3 * 1000 * 1000 + 7
    seg = segment.create(nbytes)
    try:
        st = os.stat(seg.path)
        assert st.st_size == segfile.HEADER_SIZE + nbytes
        # posix_fallocate reserved every page before anything was written
        assert st.st_blocks * 512 >= segfile.HEADER_SIZE + nbytes
        magic, version, state, size, count, pid, created_ns, gen, flags = header(seg.name)
        assert magic == segfile.MAGIC
        assert version == segfile.VERSION
        assert state == segfile.STATE_LIVE
        assert size == nbytes
        assert count == 1
        assert pid == os.getpid()
        assert created_ns > 0
        assert gen == 0 and flags == 0  # pool off: a fresh segment, unlinked at zero
        assert seg.refcount() == 1
    finally:
        assert segment.update_refcount(seg.name, -1) == 0
    assert segment_files() == []


def test_names_are_unique(shm_dir):
    hs = [mmshm.ShmTensor.from_tensor(torch.zeros(10)) for _ in range(64)]
    names = {h.name for h in hs}
    assert len(names) == 64
    assert len({n.rsplit("-", 1)[1] for n in names}) == 64
    assert sorted(names) == segment_files()
    del hs
    gc.collect()
    assert segment_files() == []


def test_o_excl_skips_an_existing_name(shm_dir, monkeypatch):
    taken = f"mmshm-{os.getpid()}-{'a' * 16}"
    fresh = f"mmshm-{os.getpid()}-{'b' * 16}"
    with open(_path(taken), "wb") as f:
        f.write(b"precious bytes of somebody else")
    names = iter([taken, fresh])
    monkeypatch.setattr(segment, "new_name", lambda: next(names))
    h = mmshm.ShmTensor.from_tensor(torch.ones(100))
    try:
        assert h.name == fresh
        with open(_path(taken), "rb") as f:
            assert f.read() == b"precious bytes of somebody else"
    finally:
        h.release()
        os.unlink(_path(taken))
    assert segment_files() == []


def test_o_excl_does_not_follow_a_symlink_at_the_new_name(shm_dir, monkeypatch, tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"do not touch")
    trap = f"mmshm-{os.getpid()}-{'c' * 16}"
    fresh = f"mmshm-{os.getpid()}-{'d' * 16}"
    os.symlink(target, _path(trap))
    names = iter([trap, fresh])
    monkeypatch.setattr(segment, "new_name", lambda: next(names))
    h = mmshm.ShmTensor.from_tensor(torch.ones(100))
    try:
        assert h.name == fresh
        assert target.read_bytes() == b"do not touch"
        assert os.path.islink(_path(trap))
    finally:
        h.release()
        os.unlink(_path(trap))


def test_every_name_taken_gives_segment_error_and_inline_fallback(shm_dir, monkeypatch):
    taken = f"mmshm-{os.getpid()}-{'e' * 16}"
    with open(_path(taken), "wb") as f:
        f.write(b"x")
    monkeypatch.setattr(segment, "new_name", lambda: taken)
    try:
        with pytest.raises(mmshm.SegmentError) as ei:
            segment.create(100)
        assert ei.value.errno == errno.EEXIST
        t = torch.ones(1000)
        before = fallbacks_total()
        out = mmshm.wrap({"x": t}, min_bytes=1)
        assert out["x"] is t
        assert fallbacks_total() - before == 1
        with open(_path(taken), "rb") as f:
            assert f.read() == b"x"
    finally:
        os.unlink(_path(taken))


def test_refcount_updates_and_last_release_unlinks(shm_dir):
    seg = segment.create(4096)
    name = seg.name
    assert segment.update_refcount(name, 2) == 3
    assert refcount(name) == 3
    assert segment.update_refcount(name, -1) == 2
    assert segment.update_refcount(name, -1) == 1
    assert segment_files() == [name]
    assert segment.update_refcount(name, -1) == 0
    assert segment_files() == []
    # a freed segment cannot be resurrected, and nothing is re-created
    with pytest.raises(mmshm.SegmentNotFoundError):
        segment.update_refcount(name, 1)
    assert segment_files() == []


def test_creator_keeps_descriptor_until_last_release(shm_dir):
    seg = segment.create(100)
    segment.update_refcount(seg.name, 1)
    assert seg.name in TABLE.names()
    segment.update_refcount(seg.name, -1)
    assert seg.name in TABLE.names()  # one reference still out
    segment.update_refcount(seg.name, -1)
    assert seg.name not in TABLE.names()
    assert seg.fd == -1


# -- third parties ------------------------------------------------------------------
def test_truncated_segment_gives_corrupt_error_in_consumer(shm_dir):
    """Truncated before the consumer attaches: SegmentCorruptError, in the
    consumer process, for copy=False and copy=True, and never SIGBUS."""
    t = make_tensor(7, (100, 400))
    h = mmshm.ShmTensor.from_tensor(t)
    h.share(1)
    blob = pickle.dumps(h)
    os.truncate(_path(h.name), segfile.HEADER_SIZE + 100)
    res, code = run_child(children.consume_truncated, blob)
    assert code == 0, signal_name(code)
    assert res[False] == "SegmentCorruptError" and res["False-is-corrupt"], res
    assert res[True] == "SegmentCorruptError" and res["True-is-corrupt"], res
    assert res["owns_after"] is True  # a failed materialize keeps the reference
    assert refcount(h.name) == 1  # the consumer gave its reference back
    h.release()
    assert segment_files() == []


@pytest.mark.parametrize("copy", [False, True])
def test_unlinked_by_third_party_while_view_is_mapped(shm_dir, copy):
    t = make_tensor(3, (256, 256))
    h = mmshm.ShmTensor.from_tensor(t)
    other = h.clone()
    v = h.materialize()
    os.unlink(_path(h.name))  # e.g. an operator's rm /dev/shm/mmshm-*
    assert same(v, t)  # the mapping keeps the pages
    part = v[10:20]
    del v
    gc.collect()
    assert same(part, t[10:20])
    # the other holder's bytes are still reachable through this process's descriptor,
    # and releasing tolerates the missing file
    got = other.materialize(copy=copy)
    assert same(got, t)
    del got, part
    gc.collect()
    other.release()
    h.release()
    assert TABLE.names() == []


def test_release_tolerates_enoent(shm_dir, caplog):
    meta = HandleMeta(f"mmshm-{os.getpid()}-{'0' * 16}", 16, 0, (4,), b"\0" * 16)
    h = mmshm.ShmTensor(meta)
    assert h.owns_reference
    h.release()
    h.release()
    assert not h.owns_reference
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


def test_symlink_in_place_of_a_segment_is_refused(shm_dir):
    t = torch.arange(5000, dtype=torch.float32)
    real = mmshm.ShmTensor.from_tensor(t)
    fake_name = f"mmshm-{os.getpid()}-{'f' * 16}"
    os.symlink(_path(real.name), _path(fake_name))
    try:
        wire = HandleMeta(fake_name, real.nbytes, 0, tuple(real.shape), real.hash)
        fake = mmshm.ShmTensor(wire)
        with pytest.raises(mmshm.SegmentCorruptError) as ei:
            fake.materialize()
        assert ei.value.errno == errno.ELOOP
        with pytest.raises(mmshm.SegmentCorruptError):
            fake.materialize(copy=True)
        with pytest.raises(mmshm.SegmentCorruptError):
            fake.share(1)
        with pytest.raises(mmshm.SegmentCorruptError):
            segment.attach(fake_name)
        fake.release()  # refused too: it must not touch the real segment
        assert not fake.owns_reference
        assert refcount(real.name) == 1
        assert torch.equal(real.materialize(copy=True), t)
    finally:
        os.unlink(_path(fake_name))
    assert segment_files() == []


def test_foreign_file_with_a_valid_name_is_corrupt(shm_dir):
    name = f"mmshm-{os.getpid()}-{'1' * 16}"
    with open(_path(name), "wb") as f:
        f.write(b"\0" * (segfile.HEADER_SIZE + 64))
    try:
        h = mmshm.ShmTensor(HandleMeta(name, 64, 4, (64,), b"\0" * 16))
        with pytest.raises(mmshm.SegmentCorruptError):
            h.materialize()
        h.release()
        with open(_path(name), "rb") as f:
            assert f.read() == b"\0" * (segfile.HEADER_SIZE + 64)
    finally:
        os.unlink(_path(name))


def test_short_header_is_corrupt(shm_dir):
    name = f"mmshm-{os.getpid()}-{'2' * 16}"
    with open(_path(name), "wb") as f:
        f.write(segfile.MAGIC)
    try:
        with pytest.raises(mmshm.SegmentCorruptError):
            segment.attach(name)
    finally:
        os.unlink(_path(name))
