"""The reaper: reclaim segments that no live process holds.

A segment is an orphan exactly when no process holds the shared liveness lock
on its byte 1 (see :mod:`mmshm.segments.segfile`). Every holder (the creator until the
last reference is gone, every process with a materialized view) holds that
lock through its open file description, and the kernel drops it when the
process dies, however it dies. The reaper takes the *exclusive* lock without
waiting: if it gets it, nobody holds the segment, and while the reaper holds
it a process that tries to attach blocks, then sees the file unlinked and gets
:class:`~mmshm.errors.SegmentNotFoundError`. Creator pids are reported but
never used to decide: pids are reused, locks are not.

The reaper never touches a file outside the naming scheme, a file of another
user, or a segment some process holds, so it is safe beside another live
server on the same host.

**Why a segment nobody holds is reclaimed** (the ``reason`` of the log line,
of ``mmshm_reaped_segments_total{reason}`` and of :attr:`ReapReport.reasons`):

* ``killed``: some process had the segment open and never closed it cleanly
  (the segment's holder count, see :mod:`mmshm.segments.segfile`, is above zero with
  no lock held): it was killed, or left without mmshm's exit hook. Or the
  references still counted were *delivered*: readers attached the segment
  for every reference of its last hand-out (the header's hand-out record),
  so they belong to processes that opened it and are gone (a reader killed
  after it read the handle's hash and closed the segment, or in the instant
  between its open and its holder count). Reclaimed at the first pass,
  whatever the references say: nobody can give them back.
* ``in_flight_expired``: every process that had it open closed it cleanly, but
  references are still counted that no reader has attached yet: handles
  pickled for receivers that have not opened them (a writer that exits with
  requests still queued). Those
  are kept for ``MMSHM_IN_FLIGHT_GRACE_S`` (default 300 s) from the last
  clean close, so that late readers find them (:attr:`ReapReport.in_flight`
  counts them), and reclaimed with this reason after that.

When a pass reclaims a killed holder's segments, the live gauges of every
process that no longer runs are dropped from ``PROMETHEUS_MULTIPROC_DIR``
(:func:`mmshm.metrics.mark_dead_processes`), so that the merged
``mmshm_segments_in_use`` and ``mmshm_shm_in_use_bytes`` stop counting them.

The reaper reads segment files only through the public interface of the
file layer (:func:`~mmshm.segments.segfile.try_lock_unheld`,
:func:`~mmshm.segments.segfile.read_state`, :func:`~mmshm.segments.segfile.iter_segment_files`);
the segment table calls it (:meth:`mmshm.segments.table.SegmentTable.maybe_reap`: on
a directory's first segment, then from the sweeper thread) and it never
calls back.
"""

from __future__ import annotations

import logging
import os
import stat
import time

import msgspec

from mmshm import config
from mmshm.metrics import REAP_REASONS, REAPED_BYTES, REAPED_SEGMENTS, mark_dead_processes
from mmshm.segments.segfile import (
    STATE_LIVE,
    boottime_ns,
    iter_segment_files,
    peek_header,
    read_state,
    segment_dir,
    try_lock_unheld,
)

log = logging.getLogger("mmshm")

class SegmentInfo(msgspec.Struct):
    """One segment file as seen by :func:`scan`.

    Attributes:
        name: file name.
        bytes: file size in bytes (header included).
        creator_pid: pid from the name.
        creator_alive: whether *some* process has that pid (informational only:
            pids are reused).
        orphan: the reaper would reclaim it now: no live process holds it,
            and it is not within its in-flight grace period.
        age_s: seconds since the file was last modified.
        reason: why it is (or would be) reclaimed, ``killed`` or
            ``in_flight_expired``; ``in_flight`` for a segment kept for its
            grace period; empty for a held segment.
    """

    name: str
    bytes: int
    creator_pid: int
    creator_alive: bool
    orphan: bool
    age_s: float
    reason: str = ""


#: ``reason`` label values of the reaper's counters (see the module docstring).
REASONS = REAP_REASONS


class ReapReport(msgspec.Struct):
    """What a reaper pass did. ``reclaimed``/``reclaimed_bytes`` count what was
    (or, with ``dry_run``, would be) unlinked, ``reasons`` splits that count
    by reason (every key of :data:`REASONS`); ``in_flight`` counts segments
    nobody holds that were kept for their grace period; ``live`` counts held
    segments."""

    directory: str
    dry_run: bool
    reclaimed: int = 0
    reclaimed_bytes: int = 0
    live: int = 0
    live_bytes: int = 0
    names: list[str] = msgspec.field(default_factory=list)
    reasons: dict[str, int] = msgspec.field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    in_flight: int = 0
    in_flight_bytes: int = 0


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (it may be an unrelated one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _why(fd: int, path: str, grace_s: float) -> str:
    """Why a segment nobody holds (we hold its exclusive liveness lock) goes:
    a reason of :data:`REASONS`, or ``in_flight`` if it is kept."""
    state = read_state(fd, path)
    if state is None:
        return "killed"  # died before writing a header, or not readable
    st, refs, n, detached, delivered = state
    if st != STATE_LIVE or refs <= 0 or n > 0 or detached == 0 or delivered:
        return "killed"
    return "in_flight" if boottime_ns() - detached < grace_s * 1e9 else "in_flight_expired"


def _probe(path: str, unlink: bool, grace_s: float) -> tuple[str, int] | None:
    """Return (reason, size) for one file: ``""`` if held, ``in_flight`` if
    nobody holds it but it is within its grace period, else a reason of
    :data:`REASONS`, unlinking it if ``unlink``; None if it is not ours to
    judge (gone, not a regular file, another user's)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        if not try_lock_unheld(fd):
            return "", st.st_size
        why = _why(fd, path, grace_s)
        if unlink and why != "in_flight":
            try:
                os.unlink(path)
            except FileNotFoundError:
                return None
        return why, st.st_size
    finally:
        os.close(fd)  # drops our exclusive lock; blocked attachers see nlink == 0


def creator_of(directory: str, name: str) -> int:
    """The pid that created segment ``name``: the name's pid field, or, for a
    name whose field is 0 (an encoder output published under a name derived
    from its content, :func:`mmshm.transport.encoder_cache.published_name`),
    the creator pid in its header (0 if it cannot be read)."""
    try:
        pid = int(name.split("-")[1])
    except (IndexError, ValueError):
        return 0
    if pid:
        return pid
    try:
        fd = os.open(os.path.join(directory, name),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return 0
    try:
        hdr = peek_header(fd)
        return hdr.creator_pid if hdr is not None else 0
    except OSError:
        return 0
    finally:
        os.close(fd)


def _grace(grace_s: float | None) -> float:
    return config.get().in_flight_grace_s if grace_s is None else grace_s


def scan(directory: str | None = None, grace_s: float | None = None) -> list[SegmentInfo]:
    """List mmshm segment files with their liveness and, for those nobody
    holds, the reason they would be reclaimed, changing nothing. ``grace_s``:
    the in-flight grace period in seconds (default
    ``MMSHM_IN_FLIGHT_GRACE_S``)."""
    d = segment_dir(directory)
    grace = _grace(grace_s)
    out = []
    now = time.time()
    for name in sorted(iter_segment_files(d)):
        path = os.path.join(d, name)
        r = _probe(path, unlink=False, grace_s=grace)
        if r is None:
            continue
        try:
            age = now - os.stat(path, follow_symlinks=False).st_mtime
        except OSError:
            age = 0.0
        pid = creator_of(d, name)
        out.append(SegmentInfo(name, r[1], pid, pid_alive(pid), r[0] in REASONS, age, r[0]))
    return out


_EXPLAIN = {
    "killed": "a process that had them open died without closing them (killed)",
    "in_flight_expired": "references in flight past MMSHM_IN_FLIGHT_GRACE_S={grace:g}s after "
                         "every holder closed them cleanly",
}


def _pass(d: str, dry_run: bool, grace: float, creators: set[int] | None = None,
          say: bool = True, level: int = logging.WARNING) -> ReapReport:
    """Probe (and unless ``dry_run`` unlink) the segments of ``d`` nobody
    holds, only those created by ``creators`` when given; count what was
    reclaimed by reason and, with ``say``, log one line per reason at
    ``level``."""
    rep = ReapReport(directory=d, dry_run=dry_run)
    nbytes = dict.fromkeys(REASONS, 0)
    for name in sorted(iter_segment_files(d)):
        if creators is not None and creator_of(d, name) not in creators:
            continue
        r = _probe(os.path.join(d, name), unlink=not dry_run, grace_s=grace)
        if r is None:
            continue
        why, size = r
        if why in REASONS:
            rep.reclaimed += 1
            rep.reclaimed_bytes += size
            rep.names.append(name)
            rep.reasons[why] += 1
            nbytes[why] += size
        elif why == "in_flight":
            rep.in_flight += 1
            rep.in_flight_bytes += size
        else:
            rep.live += 1
            rep.live_bytes += size
    if not dry_run:
        for why in REASONS:
            if rep.reasons[why]:
                REAPED_SEGMENTS.labels(reason=why).inc(rep.reasons[why])
                REAPED_BYTES.labels(reason=why).inc(nbytes[why])
                if say:
                    log.log(level, "mmshm: reclaimed %d segment(s), %d bytes, in %s, reason=%s: %s",
                                rep.reasons[why], nbytes[why], d, why,
                                _EXPLAIN[why].format(grace=grace))
        if rep.reasons["killed"]:
            # a holder died: its live gauges (segments and bytes in use) must
            # leave the merged exposition of PROMETHEUS_MULTIPROC_DIR
            mark_dead_processes()
    return rep


def reap(directory: str | None = None, dry_run: bool = False,
         grace_s: float | None = None, quiet: bool = False) -> ReapReport:
    """Reclaim every segment in ``directory`` (default ``MMSHM_DIR``) that no
    live process holds, except those whose references are in flight within
    ``grace_s`` seconds (default ``MMSHM_IN_FLIGHT_GRACE_S``) of their last
    clean close (see the module docstring for the reasons).

    Returns a :class:`ReapReport`. Outside a dry run, counts
    ``mmshm_reaped_segments_total{reason}`` and
    ``mmshm_reaped_bytes_total{reason}`` and logs one warning per reason
    (at DEBUG with ``quiet``: ``mmshm gc`` prints its own summary).
    Raises :class:`OSError` only if the directory cannot be listed.
    """
    return _pass(segment_dir(directory), dry_run, _grace(grace_s),
                 level=logging.DEBUG if quiet else logging.WARNING)


def reclaim_left_by(pids: set[int] | frozenset[int], directory: str | None = None
                    ) -> ReapReport:
    """Reclaim the segments in ``directory`` (default ``MMSHM_DIR``) that
    processes ``pids`` created and that no live process holds.

    For ``mmshm run`` once the server it ran has exited: all of the server's
    processes are gone, so references still counted on their segments can
    never be given back, and the in-flight grace period does not apply.
    Segments of other processes are not looked at; a segment some live
    process still holds is kept (counted in ``live``). Counts
    ``mmshm_reaped_segments_total{reason}`` and ``mmshm_reaped_bytes_total{reason}``;
    the caller says what was reclaimed.
    """
    return _pass(segment_dir(directory), False, 0.0, {int(p) for p in pids}, say=False)
