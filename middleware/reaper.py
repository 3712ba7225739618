"""The reaper: reclaim segments that no live process holds.

A segment is an orphan exactly when no process holds the shared liveness lock
on its byte 1 (see :mod:`mmshm.segment`). Every holder (the creator until the
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
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time

import msgspec

from . import config
from .metrics import REAPED_BYTES, REAPED_SEGMENTS
from .segment import _LIVE_BYTE, _lock, iter_segment_files, segment_dir

log = logging.getLogger("mmshm")

class SegmentInfo(msgspec.Struct):
    """One segment file as seen by :func:`scan`.

    Attributes:
        name: file name.
        bytes: file size in bytes (header included).
        creator_pid: pid from the name.
        creator_alive: whether *some* process has that pid (informational only:
            pids are reused).
        orphan: no live process holds the segment.
        age_s: seconds since the file was last modified.
    """

    name: str
    bytes: int
    creator_pid: int
    creator_alive: bool
    orphan: bool
    age_s: float


class ReapReport(msgspec.Struct):
    """What a reaper pass did. ``reclaimed``/``reclaimed_bytes`` count what was
    (or, with ``dry_run``, would be) unlinked; ``live`` counts held segments."""

    directory: str
    dry_run: bool
    reclaimed: int = 0
    reclaimed_bytes: int = 0
    live: int = 0
    live_bytes: int = 0
    names: list[str] = msgspec.field(default_factory=list)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (it may be an unrelated one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _probe(path: str, unlink: bool) -> tuple[bool, int] | None:
    """Return (orphan, size) for one file, unlinking it if orphaned and
    ``unlink``; None if it is not ours to judge (gone, not a regular file,
    another user's)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        try:
            _lock(fd, fcntl.F_WRLCK, _LIVE_BYTE, wait=False)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False, st.st_size
            raise
        if unlink:
            try:
                os.unlink(path)
            except FileNotFoundError:
                return None
        return True, st.st_size
    finally:
        os.close(fd)  # drops our exclusive lock; blocked attachers see nlink == 0


def scan(directory: str | None = None) -> list[SegmentInfo]:
    """List mmshm segment files with their liveness, changing nothing."""
    d = segment_dir(directory)
    out = []
    now = time.time()
    for name in sorted(iter_segment_files(d)):
        path = os.path.join(d, name)
        r = _probe(path, unlink=False)
        if r is None:
            continue
        try:
            age = now - os.stat(path, follow_symlinks=False).st_mtime
        except OSError:
            age = 0.0
        pid = int(name.split("-")[1])
        out.append(SegmentInfo(name, r[1], pid, pid_alive(pid), r[0], age))
    return out


def _pass(d: str, dry_run: bool, creators: set[int] | None = None) -> ReapReport:
    """Probe (and unless ``dry_run`` unlink) the orphans of ``d``, only those
    created by ``creators`` when given; count the reclaimed ones."""
    rep = ReapReport(directory=d, dry_run=dry_run)
    for name in sorted(iter_segment_files(d)):
        if creators is not None:
            try:
                if int(name.split("-")[1]) not in creators:
                    continue
            except (IndexError, ValueError):
                continue
        r = _probe(os.path.join(d, name), unlink=not dry_run)
        if r is None:
            continue
        orphan, size = r
        if orphan:
            rep.reclaimed += 1
            rep.reclaimed_bytes += size
            rep.names.append(name)
        else:
            rep.live += 1
            rep.live_bytes += size
    if rep.reclaimed and not dry_run:
        REAPED_SEGMENTS.inc(rep.reclaimed)
        REAPED_BYTES.inc(rep.reclaimed_bytes)
    return rep


def reap(directory: str | None = None, dry_run: bool = False) -> ReapReport:
    """Reclaim every orphaned segment in ``directory`` (default ``MMSHM_DIR``).

    Returns a :class:`ReapReport`; counts ``mmshm_reaped_segments_total`` and
    ``mmshm_reaped_bytes_total`` (not in a dry run).
    """
    d = segment_dir(directory)
    rep = _pass(d, dry_run)
    if rep.reclaimed and not dry_run:
        log.warning("mmshm: reclaimed %d orphaned segment(s), %d bytes, in %s "
                    "(left by crashed processes)", rep.reclaimed, rep.reclaimed_bytes, d)
    return rep


_last_run: dict[str, float] = {}


def maybe_reap(directory: str | None = None) -> ReapReport | None:
    """Run :func:`reap` unless this process ran it on ``directory`` less than
    ``MMSHM_REAP_INTERVAL_S`` ago (0 disables). Called on a process's first
    segment creation (start-up) and by the producer's sweeper thread."""
    interval = config.get().reap_interval_s
    if interval <= 0:
        return None
    d = segment_dir(directory)
    now = time.monotonic()
    if now - _last_run.get(d, -interval) < interval:
        return None
    _last_run[d] = now
    try:
        return reap(d)
    except OSError as exc:
        log.warning("mmshm: reaper pass over %s failed: %s", d, exc)
        return None


def reclaim_left_by(pids: set[int] | frozenset[int], directory: str | None = None
                    ) -> ReapReport:
    """Reclaim the segments in ``directory`` (default ``MMSHM_DIR``) that
    processes ``pids`` created and that no live process holds.

    For ``mmshm run`` once the server it ran has exited: all of the server's
    processes are gone, so none of their segments can still be in flight.
    Segments of other processes are not looked at; a segment some live
    process still holds is kept (counted in ``live``). Counts
    ``mmshm_reaped_segments_total`` and ``mmshm_reaped_bytes_total``.
    """
    return _pass(segment_dir(directory), False, {int(p) for p in pids})
