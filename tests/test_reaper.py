"""The reaper: liveness from locks, never from pids.

* pid reuse, both directions, with the reaper's pid view faked
  (``mmshm.segments.reaper.pid_alive``) and once for real;
* foreign, malformed, linked and other users' files are never touched;
* ``dry_run``, the reclaimed counters, the start-up pass and its throttle;
* a reaper pass racing a creation;
* references in flight after a writer's clean exit are kept for the grace
  period, a killed holder's segments are reclaimed at once, and the reason is
  logged, counted and reported, by ``mmshm gc`` too.
"""

from __future__ import annotations

import os
import pickle
import signal
import time

import msgspec
import pytest

import mmshm
from mmshm import config
from mmshm.segments import reaper, segment
from mmshm.segments.table import TABLE
from mmshm.segments import segfile

from tests.harness.procs import fork_ctx, fork_start, join, recv
from tests.harness.segments import segment_files
from tests.harness.metrics import delta, metric
from tests.harness.tensors import pattern
from tests.harness import workers

KILLED = -signal.SIGKILL
HDR = segfile.HEADER_SIZE


@pytest.fixture
def segdir(shm_dir):
    """The private segment directory the project conftest gives every test."""
    return shm_dir


def _orphans(d: str, sizes: list[int]) -> dict[str, int]:
    """Segments whose creator exited without releasing: name -> file size."""
    before = set(segment_files(d))
    p = fork_start(workers.w_orphan_maker, d, sizes)
    assert join(p, 30) == 0
    names = set(segment_files(d)) - before
    assert len(names) == len(sizes)
    return {n: os.path.getsize(os.path.join(d, n)) for n in names}


def _reaped_counters() -> tuple[float, float]:
    return metric("mmshm_reaped_segments_total"), metric("mmshm_reaped_bytes_total")


# -- pid reuse ------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_live_segment_whose_creator_pid_looks_dead_is_never_reclaimed(segdir, monkeypatch):
    """(a) another server's live segment; its creator pid is reported dead (as
    if the pid had been reused or the view were wrong): never reclaimed."""
    monkeypatch.setattr(reaper, "pid_alive", lambda pid: False)
    a, b = fork_ctx().Pipe()
    server = fork_start(workers.w_segment_holder, segdir, 3 << 20, "0", b)
    name, _ = recv(a, 30)
    (info,) = reaper.scan(segdir)
    assert (info.name, info.creator_alive, info.orphan) == (name, False, False)
    rep = reaper.reap(segdir)
    assert (rep.reclaimed, rep.live, rep.names) == (0, 1, [])
    assert reaper.reap(segdir, dry_run=True).reclaimed == 0
    a.send("verify")
    assert recv(a) is True  # intact and readable
    a.send("exit")
    assert recv(a) == "bye"
    assert join(server) == 0
    assert segment_files(segdir) == []


@pytest.mark.timeout(60)
def test_segment_held_after_its_creator_was_killed_is_not_reclaimed(segdir, monkeypatch):
    """The creator is SIGKILLed (its pid is free for reuse) while a consumer
    still holds a view: live until the consumer goes too."""
    monkeypatch.setattr(reaper, "pid_alive", lambda pid: False)
    ha, hb = fork_ctx().Pipe()
    creator = fork_start(workers.w_holder, segdir, 2 << 20, 5, 1, hb)
    data, digest, name = recv(ha, 30)
    ca, cb = fork_ctx().Pipe()
    consumer = fork_start(workers.w_consumer, segdir, cb)
    ca.send((data, digest))
    assert recv(ca, 30) == ("materialized", True)
    creator.kill()
    assert join(creator) == KILLED
    rep = reaper.reap(segdir)
    assert (rep.reclaimed, rep.live) == (0, 1)
    assert segment_files(segdir) == [name]
    consumer.kill()
    assert join(consumer) == KILLED
    rep = reaper.reap(segdir)
    assert (rep.reclaimed, rep.names) == (1, [name])
    assert segment_files(segdir) == []


@pytest.mark.timeout(60)
def test_orphan_whose_creator_pid_looks_alive_is_reclaimed(segdir, monkeypatch):
    """(b) no holder, but the creator pid is reported alive (an unrelated
    process reusing it): reclaimed, and counted."""
    monkeypatch.setattr(reaper, "pid_alive", lambda pid: True)
    sizes = _orphans(segdir, [1 << 16, 1 << 20, 3 << 20])
    infos = reaper.scan(segdir)
    assert {i.name for i in infos} == set(sizes)
    assert all(i.orphan and i.creator_alive for i in infos)
    assert {i.name: i.bytes for i in infos} == sizes
    segs0, bytes0 = _reaped_counters()
    rep = reaper.reap(segdir)
    assert (rep.reclaimed, rep.live) == (3, 0)
    assert sorted(rep.names) == sorted(sizes)
    assert rep.reclaimed_bytes == sum(sizes.values()) == HDR * 3 + (1 << 16) + (1 << 20) + (3 << 20)
    segs1, bytes1 = _reaped_counters()
    assert (segs1 - segs0, bytes1 - bytes0) == (3, rep.reclaimed_bytes)
    assert segment_files(segdir) == []


@pytest.mark.timeout(60)
def test_orphan_named_after_a_live_unrelated_pid_is_reclaimed(segdir):
    """The same without faking: the name carries the pid of a live process
    that has nothing to do with the segment (this test process)."""
    (name,) = _orphans(segdir, [1 << 18])
    reused = f"mmshm-{os.getpid()}-{name.rsplit('-', 1)[1]}"
    os.rename(os.path.join(segdir, name), os.path.join(segdir, reused))
    (info,) = reaper.scan(segdir)
    assert (info.name, info.creator_pid, info.creator_alive, info.orphan) == (
        reused, os.getpid(), True, True)
    rep = reaper.reap(segdir)
    assert (rep.reclaimed, rep.names) == (1, [reused])
    assert segment_files(segdir) == []


# -- what the reaper must never touch ---------------------------------------------------
@pytest.mark.timeout(60)
def test_foreign_malformed_linked_and_other_users_files_are_left_alone(segdir, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a file owned by another user")
    hexname = "0123456789abcdef"

    def make(name: str, size: int = 1 << 16) -> str:
        path = os.path.join(segdir, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.posix_fallocate(fd, 0, size)
        os.close(fd)
        return path

    make("nccl-shm-foreign")
    make("mmshm-12-notahex")
    make(f"mmshm-123-{hexname}.tmp")
    other_user = make(f"mmshm-4242-{hexname}")
    os.chown(other_user, 65534, 65534)
    target = tmp_path / "precious"
    target.write_bytes(b"x" * 4096)
    os.symlink(target, os.path.join(segdir, f"mmshm-4243-{hexname}"))
    listing = sorted(os.listdir(segdir))
    try:
        rep = reaper.reap(segdir)
        assert (rep.reclaimed, rep.names) == (0, [])
        assert reaper.scan(segdir) == []
        assert sorted(os.listdir(segdir)) == listing
        assert target.read_bytes() == b"x" * 4096
    finally:
        for n in listing:
            os.unlink(os.path.join(segdir, n))


# -- dry run, start-up pass, throttle ----------------------------------------------------
@pytest.mark.timeout(60)
def test_dry_run_reports_without_unlinking_or_counting(segdir):
    sizes = _orphans(segdir, [1 << 17, 1 << 19])
    segs0, bytes0 = _reaped_counters()
    rep = reaper.reap(segdir, dry_run=True)
    assert rep.dry_run and (rep.reclaimed, rep.reclaimed_bytes) == (2, sum(sizes.values()))
    assert sorted(rep.names) == sorted(sizes)
    assert sorted(segment_files(segdir)) == sorted(sizes)
    assert _reaped_counters() == (segs0, bytes0)
    rep = reaper.reap(segdir)
    assert rep.reclaimed == 2 and segment_files(segdir) == []


@pytest.mark.timeout(60)
def test_a_new_process_reaps_on_start_up_and_keeps_live_segments(segdir):
    sizes = _orphans(segdir, [1 << 16, 1 << 16])
    a, b = fork_ctx().Pipe()
    live = fork_start(workers.w_segment_holder, segdir, 1 << 16, "0", b)
    live_name, _ = recv(a, 30)
    assert set(segment_files(segdir)) == set(sizes) | {live_name}
    c, d = fork_ctx().Pipe()
    starter = fork_start(workers.w_segment_holder, segdir, 1 << 16, "60", d)  # reaper on
    new_name, _ = recv(c, 30)  # its first creation ran the start-up pass
    assert set(segment_files(segdir)) == {live_name, new_name}
    for conn, p in ((a, live), (c, starter)):
        conn.send("verify")
        assert recv(conn) is True
        conn.send("exit")
        assert recv(conn) == "bye"
        assert join(p) == 0
    assert segment_files(segdir) == []


@pytest.mark.timeout(30)
def test_maybe_reap_is_throttled_and_can_be_disabled(segdir, monkeypatch):
    monkeypatch.setenv("MMSHM_REAP_INTERVAL_S", "0")
    config.reload()
    assert TABLE.maybe_reap(segdir) is None
    monkeypatch.setenv("MMSHM_REAP_INTERVAL_S", "3600")
    config.reload()
    first = TABLE.maybe_reap(segdir)
    assert first is not None and first.directory == segdir
    _orphans(segdir, [1 << 16])
    assert TABLE.maybe_reap(segdir) is None  # within the interval: no pass
    assert len(segment_files(segdir)) == 1
    assert reaper.reap(segdir).reclaimed == 1


# -- a reaper pass racing a creation ------------------------------------------------------
@pytest.mark.timeout(30)
def test_reaper_racing_a_creation_never_leaves_a_live_segment_unlinked(segdir, monkeypatch):
    real_check_fd = segment._check_fd
    raced = []

    def check_fd_then_reap(fd, path):  # runs between the O_EXCL open and the locks
        real_check_fd(fd, path)
        if not raced:
            raced.append(reaper.reap(segdir).names)

    monkeypatch.setattr(segment, "_check_fd", check_fd_then_reap)
    t = pattern(1 << 20, 9)
    h = mmshm.ShmTensor.from_tensor(t, directory=segdir)
    monkeypatch.setattr(segment, "_check_fd", real_check_fd)
    try:
        assert raced, "the race window was not hit"
        # the handle must name a file another process can open
        assert os.path.exists(os.path.join(segdir, h.name))
        c, d = fork_ctx().Pipe()
        p = fork_start(workers.w_consumer, segdir, d)
        h.share(1)
        c.send((pickle.dumps(h), h.hash))
        assert recv(c, 30) == ("materialized", True)
        p.kill()
        assert join(p) == KILLED
        segment.update_refcount(h.name, -1, segdir)  # the consumer's reference
    finally:
        h.release()


# -- references in flight after a clean exit ------------------------------------------------
def _writer_exits_cleanly(d: str, nbytes: int, seed: int) -> tuple[bytes, bytes, str]:
    """A writer hands one reference to a pickled handle (in flight: nobody
    opened it yet), releases its own and exits normally."""
    a, b = fork_ctx().Pipe()
    p = fork_start(workers.w_holder, d, nbytes, seed, 1, b)
    data, digest, name = recv(a, 30)
    a.send("exit")
    assert recv(a) == "bye"
    assert join(p) == 0
    return data, digest, name


class _Records:
    def __init__(self):
        import logging

        self.messages: list[str] = []
        self.handler = logging.Handler(level=logging.WARNING)
        self.handler.emit = lambda r: self.messages.append(r.getMessage())

    def __enter__(self):
        import logging

        logging.getLogger("mmshm").addHandler(self.handler)
        return self.messages

    def __exit__(self, *exc):
        import logging

        logging.getLogger("mmshm").removeHandler(self.handler)


def _by_reason() -> dict[str, float]:
    return {r: metric("mmshm_reaped_segments_total", reason=r)
            for r in reaper.REASONS}


@pytest.mark.timeout(60)
def test_references_in_flight_survive_the_writers_clean_exit(segdir):
    data, digest, name = _writer_exits_cleanly(segdir, 3 << 20, 21)
    before = _by_reason()
    with _Records() as logged:
        rep = reaper.reap(segdir)
    assert (rep.reclaimed, rep.in_flight, rep.live, rep.names) == (0, 1, 0, [])
    assert rep.in_flight_bytes == HDR + (3 << 20)
    assert _by_reason() == before and logged == []
    (info,) = reaper.scan(segdir)
    assert (info.name, info.orphan, info.reason) == (name, False, "in_flight")
    late = pickle.loads(data)  # the late reader finds every byte
    assert mmshm.content_hash(late.materialize(copy=True)) == digest
    assert segment_files(segdir) == []  # its release was the last


@pytest.mark.timeout(60)
def test_references_in_flight_are_reclaimed_once_the_grace_period_is_over(segdir, monkeypatch):
    monkeypatch.setenv("MMSHM_IN_FLIGHT_GRACE_S", "0.5")
    config.reload()
    data, _, name = _writer_exits_cleanly(segdir, 1 << 20, 22)
    assert reaper.reap(segdir).in_flight == 1
    time.sleep(0.6)
    before, bytes0 = _by_reason(), metric("mmshm_reaped_bytes_total", reason="in_flight_expired")
    with _Records() as logged:
        rep = reaper.reap(segdir)
    assert (rep.reclaimed, rep.names, rep.in_flight) == (1, [name], 0)
    assert rep.reasons == {"killed": 0, "in_flight_expired": 1}
    after = _by_reason()
    assert {r: after[r] - before[r] for r in after} == {"killed": 0, "in_flight_expired": 1}
    assert metric("mmshm_reaped_bytes_total", reason="in_flight_expired") - bytes0 == HDR + (1 << 20)
    assert len(logged) == 1 and "reason=in_flight_expired" in logged[0]
    assert "MMSHM_IN_FLIGHT_GRACE_S=0.5s" in logged[0] and "crashed" not in logged[0]
    late = pickle.loads(data)
    with pytest.raises(mmshm.SegmentNotFoundError):
        late.materialize()
    late.release()


@pytest.mark.timeout(60)
def test_a_killed_writer_with_references_in_flight_is_reclaimed_at_once(segdir):
    a, b = fork_ctx().Pipe()
    p = fork_start(workers.w_holder, segdir, 1 << 20, 23, 1, b)
    data, _, name = recv(a, 30)
    p.kill()
    assert join(p) == KILLED
    before = _by_reason()
    with _Records() as logged:
        rep = reaper.reap(segdir)  # the default grace period: it does not apply
    assert (rep.reclaimed, rep.names, rep.in_flight) == (1, [name], 0)
    assert rep.reasons == {"killed": 1, "in_flight_expired": 0}
    after = _by_reason()
    assert {r: after[r] - before[r] for r in after} == {"killed": 1, "in_flight_expired": 0}
    assert len(logged) == 1 and "reason=killed" in logged[0]
    pickle.loads(data).release()  # tolerated: the segment is gone


@pytest.mark.timeout(60)
def test_a_reader_killed_after_the_writers_clean_exit_is_reclaimed_at_once(segdir):
    data, digest, name = _writer_exits_cleanly(segdir, 1 << 20, 24)
    ca, cb = fork_ctx().Pipe()
    consumer = fork_start(workers.w_consumer, segdir, cb)
    ca.send((data, digest))
    assert recv(ca, 30) == ("materialized", True)
    assert reaper.reap(segdir).live == 1
    consumer.kill()
    assert join(consumer) == KILLED
    rep = reaper.reap(segdir)
    assert (rep.names, rep.reasons["killed"]) == ([name], 1)


@pytest.mark.timeout(90)
def test_mmshm_gc_keeps_references_in_flight_and_reclaims_the_killed(segdir):
    from click.testing import CliRunner
    from mmshm import cli

    (killed,) = _orphans(segdir, [1 << 16])  # its creator left through os._exit
    data, digest, in_flight = _writer_exits_cleanly(segdir, 1 << 18, 25)
    run = CliRunner().invoke
    r = run(cli.main, ["gc", "--dir", segdir, "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    rep = msgspec.json.decode(r.output)
    assert (rep["names"], rep["reasons"], rep["in_flight"]) == (
        [killed], {"killed": 1, "in_flight_expired": 0}, 1)
    r = run(cli.main, ["gc", "--dir", segdir])
    assert r.exit_code == 0, r.output
    assert "reclaimed 1 orphaned segment(s)" in r.output and "1 killed" in r.output
    assert "1 with references in flight" in r.output
    assert segment_files(segdir) == [in_flight]
    # a new process's start-up pass keeps it too
    c, d = fork_ctx().Pipe()
    starter = fork_start(workers.w_segment_holder, segdir, 1 << 16, "60", d)
    new_name, _ = recv(c, 30)
    assert sorted(segment_files(segdir)) == sorted([in_flight, new_name])
    c.send("exit")
    assert recv(c) == "bye"
    assert join(starter) == 0
    late = pickle.loads(data)
    assert mmshm.content_hash(late.clone().materialize(copy=True)) == digest
    # --grace 0: the operator's way to let them go now
    r = run(cli.main, ["gc", "--dir", segdir, "--grace", "0", "--json"])
    rep = msgspec.json.decode(r.output)
    assert (rep["names"], rep["reasons"]) == ([in_flight], {"killed": 0, "in_flight_expired": 1})
    with pytest.raises(mmshm.SegmentNotFoundError):
        late.materialize()
    late.release()
    assert segment_files(segdir) == []


@pytest.mark.parametrize("bad", ["abc", "-5", "nan", "inf"])
def test_a_bad_grace_period_is_logged_and_the_default_used(segdir, monkeypatch, bad):
    monkeypatch.setenv("MMSHM_IN_FLIGHT_GRACE_S", bad)
    with _Records() as logged:
        assert config.reload().in_flight_grace_s == 300.0
    assert len(logged) == 1 and "MMSHM_IN_FLIGHT_GRACE_S" in logged[0]
    monkeypatch.setenv("MMSHM_IN_FLIGHT_GRACE_S", "61.5")
    assert config.reload().in_flight_grace_s == 61.5


@pytest.mark.timeout(60)
def test_status_counts_references_in_flight_apart_from_orphans(segdir):
    from mmshm.operations.status import status

    data, digest, name = _writer_exits_cleanly(segdir, 1 << 20, 23)
    rep = status(segdir)
    (seg,) = [s for s in rep.segments if s.name == name]
    assert (seg.held, seg.in_flight, seg.orphan) == (False, True, False)
    assert (rep.orphans, rep.in_flight, rep.in_flight_bytes) == (0, 1, HDR + (1 << 20))
    late = pickle.loads(data)  # the late reader takes the last reference
    assert mmshm.content_hash(late.materialize(copy=True)) == digest
    assert segment_files(segdir) == []


@pytest.mark.timeout(60)
def test_a_reference_a_killed_reader_had_opened_is_reclaimed_at_once(segdir):
    """The in-flight grace protects only references nobody opened.
    A reader that opened its segment (and closed it again: it read the
    content hash) is SIGKILLed owning its reference, the writer exits
    cleanly: reclaimed at the first pass, reason ``killed``. A reference
    handed out that nobody ever opened is still kept for the grace."""
    a, b = fork_ctx().Pipe()
    writer = fork_start(workers.w_holder, segdir, 1 << 20, 31, 1, b)
    data, digest, name = recv(a, 30)
    ra, rb = fork_ctx().Pipe()
    reader = fork_start(workers.w_hash_reader, segdir, rb)
    ra.send(data)
    assert recv(ra, 30) == digest  # it opened the segment and read every byte
    reader.kill()
    assert join(reader) == KILLED
    a.send("exit")
    assert recv(a) == "bye"
    assert join(writer) == 0
    kept_data, kept_digest, kept = _writer_exits_cleanly(segdir, 1 << 18, 32)
    from mmshm.operations import status

    assert status.read_segment(os.path.join(segdir, name)).orphan
    assert status.read_segment(os.path.join(segdir, kept)).in_flight
    before = _by_reason()
    rep = reaper.reap(segdir)
    assert (rep.names, rep.reasons) == ([name], {"killed": 1, "in_flight_expired": 0}), rep
    assert (rep.in_flight, rep.in_flight_bytes) == (1, HDR + (1 << 18))
    assert delta(before, _by_reason()) == {"killed": 1, "in_flight_expired": 0}
    (info,) = reaper.scan(segdir)
    assert (info.name, info.orphan, info.reason) == (kept, False, "in_flight")
    late = pickle.loads(kept_data)  # the late reader of the other one finds every byte
    assert mmshm.content_hash(late.materialize(copy=True)) == kept_digest
    assert segment_files(segdir) == []
