"""The segment file: its format, its locks, its header fields, its mapping.

The lowest layer of the segment code: functions of one open descriptor and
path, with no process-local state (no registry, no pool, no thread). The
reaper (:mod:`mmshm.reaper`) and ``mmshm status`` read files through it; the
registry, the pool and :mod:`mmshm.segment` build on it. It imports nothing of
mmshm but the configuration and the errors.

A segment is one file in the segment directory (``MMSHM_DIR``, default
``/dev/shm``), named ``mmshm-<creator pid>-<64 random bits as 16 hex>``. It is
opened by path with ``os.open`` and mapped with ``mmap``; the
``multiprocessing`` resource tracker never sees it.

File layout (little-endian)::

    [0, 4096)           header: magic, version, state, payload size (bytes),
                        reference count, creator pid, creation time (ns),
                        generation, flags; at 64 the holder count, at 72
                        the last clean detach (CLOCK_BOOTTIME ns); at 80
                        the last hand-out: references it added, readers
                        that attached since, the pid that made it
    [4096, 4096+size)   payload, page aligned

Cross-process locking uses Linux open-file-description (OFD) byte-range locks
on the segment file, one byte each:

* byte 0, the **mutex**: an exclusive lock held only while the reference count
  is read, changed and written back (and, at zero, while the file is
  unlinked). Every ``share``/``release`` is therefore serialised per segment
  whatever process or thread performs it.
* byte 1, **liveness**: a shared lock held by every process that has the
  segment open (its creator until the count reaches zero, every process with
  a materialized view). The lock belongs to the open file description, and
  a mapping holds a reference to the description in the kernel, so the lock
  lives as long as the descriptor or any mapping does, and the kernel drops
  it when the process dies. The reaper treats a segment as an orphan only if
  it can take an exclusive lock on this byte: liveness comes from locks,
  never from pids, so pid reuse cannot fool it.

**One descriptor per segment.** Python's ``mmap`` duplicates the descriptor
it maps (two per mapped segment, three with a second view); segments are
mapped with libc's ``mmap`` through ctypes instead (:func:`_map`), which
takes no descriptor. A process holds exactly one descriptor per segment it
has open, however many views it has of it: a producer with 1000 segments
holds 1000, and a reader under ``ulimit -n 256`` holds about twice as many
views as before (``tests/scripts/fd_views.py`` measures both).
* byte 2, **owner**: an exclusive lock held by the creating process. The last
  release looks at it: while the owner lives, a poolable segment goes back to
  the owner's warm pool (state ``POOLED``, pages kept); otherwise it is
  unlinked.
* byte 3, **cached**: a shared lock that a process takes when a cache of its
  own keeps views of the segment (vLLM's multimodal processor cache in the
  EngineCore), until it closes the segment; only ``mmshm status`` reads it
  (``/proc/<pid>/fdinfo``), so that such a segment is shown as held on purpose.

Invariants:

- the reference count, the state and the generation are read and changed
  only under the mutex (byte 0); the holder count, the last detach and the
  hand-out record too;
- a segment is an orphan only if an exclusive lock on byte 1 can be taken
  (:func:`try_lock_unheld`); liveness never comes from pids;
- every header read checks the magic and the version
  (:class:`~mmshm.errors.SegmentCorruptError` otherwise), and nothing is
  mapped past the size the file has (a truncated file would SIGBUS).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import struct
import time
import weakref
from collections.abc import Iterator

from . import config
from .errors import (
    DescriptorLimitError,
    SegmentCorruptError,
    SegmentError,
    SegmentNotFoundError,
    ShmSpaceError,
)

log = logging.getLogger("mmshm")

HEADER_SIZE = 4096
MAGIC = b"MMSHMSG\x01"
VERSION = 2
STATE_LIVE = 1     # count > 0
STATE_FREED = 2    # count reached 0 and the file was unlinked
STATE_POOLED = 3   # count reached 0; the owner reuses it (warm pages)
FLAG_POOLABLE = 1  # the owner's pool takes the segment back at count 0
# magic, version, state, capacity (payload bytes), refcount, creator pid,
# created ns, generation (bumped on every reuse), flags
_HDR = struct.Struct("<8sIIQqQQQI")
_OFF_STATE = 12
_OFF_REFCOUNT = 24
_OFF_GEN = 48
_OFF_FLAGS = 56
# Holders: processes with the segment open (the creator, each attached
# reader), incremented on open and decremented by a clean close, which also
# stamps the time. Zero-filled by posix_fallocate in segments of earlier
# releases, which the reaper then treats as left by a killed process.
_OFF_HOLDERS = 64
_OFF_DETACHED = 72
# The last hand-out (a reference count increase: ``share``), for the reaper's
# in-flight grace: u32 references it added, u32 attaches since by processes
# other than the one that made it, u32 that process's pid. Reset by every
# hand-out and by a reuse from the pool; zero in segments of earlier releases
# (then nothing is known to have been delivered: the grace applies, as before).
_OFF_HANDED = 80
_HAND_OUT = struct.Struct("<III")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")

PREFIX = "mmshm-"
NAME_RE = re.compile(r"mmshm-([0-9]{1,10})-([0-9a-f]{16})\Z")

_MUTEX_BYTE, _LIVE_BYTE, _OWNER_BYTE, _CACHE_BYTE = 0, 1, 2, 3
# struct flock on Linux (x86_64, aarch64): short, short, off_t, off_t, pid_t
_FLOCK = struct.Struct("hhqqi4x")
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def _lock(fd: int, kind: int, byte: int, wait: bool = True) -> None:
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))


def lock_holders_present(fd: int, byte: int = _LIVE_BYTE) -> bool:
    """True if another open file description holds a lock on ``byte``."""
    out = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    return _FLOCK.unpack(out)[0] != fcntl.F_UNLCK


def segment_dir(directory: str | None = None) -> str:
    return directory if directory is not None else config.get().dir


_dir_checked: dict[str, str | None] = {}


def ensure_dir(directory: str) -> bool:
    """Make the segment directory usable, once per process and directory.

    A missing directory whose parent exists is created with mode 0700 (the
    example launch scripts point ``MMSHM_DIR`` at one that does not exist
    yet). A directory that cannot hold segments (parent missing, not a
    directory, not writable, read-only) gets one WARNING naming it, the
    reason and the fix; tensors then travel inline, each fallback counted.
    Returns whether the directory was created now. Never raises.
    """
    if directory in _dir_checked:
        return False
    made = False
    problem = None
    try:
        os.mkdir(directory, 0o700)
        made = True
        log.info("mmshm: created the segment directory %s (mode 0700)", directory)
    except FileExistsError:
        pass
    except FileNotFoundError:
        problem = f"its parent {os.path.dirname(directory.rstrip('/')) or '/'} does not exist"
    except OSError as exc:
        problem = f"it cannot be created ({exc.strerror})"
    if problem is None:
        if not os.path.isdir(directory):
            problem = "it is not a directory"
        elif not os.access(directory, os.W_OK | os.X_OK):
            problem = "this process cannot write to it (permissions or a read-only mount)"
    _dir_checked[directory] = problem
    if problem is not None and os.environ.get("MMSHM_DIR_PROBLEM_SAID") == directory:
        # ``mmshm run`` said it once for every process of the server
        log.info("mmshm: MMSHM_DIR=%s is unusable (%s); tensors travel inline, as "
                 "mmshm run said", directory, problem)
    elif problem is not None:
        log.warning("mmshm: the segment directory MMSHM_DIR=%s cannot hold segments: %s; "
                    "every tensor travels inline (correct, but without shared memory). Fix: "
                    "point MMSHM_DIR at a writable directory on a tmpfs, e.g. /dev/shm or "
                    "a directory under it", directory, problem)
    return made


def new_name() -> str:
    """A fresh segment name: creator pid plus 64 random bits."""
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def _os_error(exc: OSError, what: str, path: str) -> SegmentError:
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        e: SegmentError = DescriptorLimitError(exc.errno, f"{what}: out of file descriptors", path)
    elif exc.errno == errno.ENOENT:
        e = SegmentNotFoundError(errno.ENOENT, f"{what}: segment is gone", path)
    elif exc.errno == errno.ENOSPC:
        e = ShmSpaceError(f"{what}: no space left in {os.path.dirname(path)}")
        e.filename = path
    elif exc.errno == errno.ELOOP:
        e = SegmentCorruptError(errno.ELOOP, f"{what}: refusing a symbolic link", path)
    else:
        e = SegmentError(exc.errno, f"{what}: {exc.strerror}", path)
    e.__cause__ = exc
    return e


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map(fd: int, length: int, offset: int, shared: bool) -> ctypes.Array:
    """Map ``length`` bytes of ``fd`` from ``offset`` (a page multiple),
    read-write, ``MAP_SHARED`` or copy-on-write ``MAP_PRIVATE``, without
    duplicating the descriptor (Python's ``mmap`` would). Returns a ctypes
    byte array over the mapping (it exports the buffer protocol); the mapping
    is removed when that array is collected, i.e. once nothing exported from
    it (a memoryview, a numpy array, a tensor) is left, so a view can never
    outlive its pages. The kernel's mapping keeps the open file description,
    and with it the liveness lock, until then. Raises :class:`OSError`."""
    if length <= 0:
        raise ValueError(f"cannot map {length} bytes")
    addr = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")
    buf = (ctypes.c_ubyte * length).from_address(addr)
    # at exit the process unmaps everything anyway: never earlier than a view
    weakref.finalize(buf, _libc.munmap, addr, length).atexit = False
    return buf


def _read_header(fd: int, path: str) -> tuple:
    raw = os.pread(fd, _HDR.size, 0)
    if len(raw) < _HDR.size:
        raise SegmentCorruptError(errno.EINVAL, "segment header is truncated", path)
    hdr = _HDR.unpack(raw)
    if hdr[0] != MAGIC:
        raise SegmentCorruptError(errno.EINVAL, "not an mmshm segment (bad magic)", path)
    if hdr[1] != VERSION:
        raise SegmentCorruptError(errno.EINVAL, f"unsupported segment version {hdr[1]}", path)
    return hdr


def boottime_ns() -> int:
    """CLOCK_BOOTTIME in ns: one clock for every process of the host, never
    set back (segments do not outlive a boot)."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def holders(fd: int) -> tuple[int, int]:
    """``(holders, last clean detach in boottime ns)`` from a segment's header
    (a racy read, without the mutex)."""
    raw = os.pread(fd, 16, _OFF_HOLDERS)
    if len(raw) < 16:
        return 0, 0
    return _I64.unpack_from(raw, 0)[0], _U64.unpack_from(raw, 8)[0]


def hand_out(fd: int) -> tuple[int, int]:
    """``(references the last hand-out added, attaches since by other
    processes)`` from a segment's header (a racy read, without the mutex)."""
    raw = os.pread(fd, _HAND_OUT.size, _OFF_HANDED)
    if len(raw) < _HAND_OUT.size:
        return 0, 0
    handed, attached, _pid = _HAND_OUT.unpack(raw)
    return handed, attached


def delivered(handed: int, attached: int) -> bool:
    """Whether the references of the last hand-out (``handed``, or the one
    reference a creator hands over without a count change when 0) have
    all been attached by readers (``attached`` attaches since): a reference
    counted on a segment nobody holds then belongs to a process that opened
    it and is gone, not to a message still in flight (see
    :mod:`mmshm.reaper`)."""
    return attached >= max(handed, 1)


def _record_hand_out(fd: int, k: int) -> None:
    """``k`` references were just added by this process (under the mutex):
    a new hand-out, attached by nobody yet."""
    os.pwrite(fd, _HAND_OUT.pack(min(k, 0xFFFFFFFF), 0, os.getpid() & 0xFFFFFFFF), _OFF_HANDED)


def _clear_hand_out(fd: int) -> None:
    """No hand-out yet (a segment reused from the pool; under the mutex)."""
    os.pwrite(fd, _HAND_OUT.pack(0, 0, 0), _OFF_HANDED)


def _add_holder(fd: int, path: str) -> None:
    """This process now has the segment open (after the liveness lock): one
    holder more and, unless it made the last hand-out itself, one attach of
    that hand-out's references."""
    _lock(fd, fcntl.F_WRLCK, _MUTEX_BYTE)
    try:
        n = _I64.unpack(os.pread(fd, 8, _OFF_HOLDERS))[0]
        os.pwrite(fd, _I64.pack(max(n, 0) + 1), _OFF_HOLDERS)
        raw = os.pread(fd, _HAND_OUT.size, _OFF_HANDED)
        if len(raw) == _HAND_OUT.size:
            handed, attached, pid = _HAND_OUT.unpack(raw)
            if pid != os.getpid() & 0xFFFFFFFF and attached < 0xFFFFFFFF:
                os.pwrite(fd, _HAND_OUT.pack(handed, attached + 1, pid), _OFF_HANDED)
    finally:
        _lock(fd, fcntl.F_UNLCK, _MUTEX_BYTE)


def _detach(fd: int) -> None:
    """This process closes the segment cleanly: one holder fewer, and the
    time, from which references still in flight get their grace period
    (``MMSHM_IN_FLIGHT_GRACE_S``, see :mod:`mmshm.reaper`). A file already
    unlinked or truncated is left alone."""
    if fd < 0:
        return
    try:
        st = os.fstat(fd)
        if st.st_nlink == 0 or st.st_size < HEADER_SIZE:
            return
        _lock(fd, fcntl.F_WRLCK, _MUTEX_BYTE)
        try:
            n = _I64.unpack(os.pread(fd, 8, _OFF_HOLDERS))[0]
            os.pwrite(fd, _I64.pack(max(n - 1, 0)) + _U64.pack(boottime_ns()), _OFF_HOLDERS)
        finally:
            _lock(fd, fcntl.F_UNLCK, _MUTEX_BYTE)
    except OSError as exc:
        log.debug("mmshm: detach failed: %s", exc)


def mark_cached(fd: int) -> None:
    """Record that a cache of this process keeps views of the segment open
    on ``fd``: the shared lock on byte 3, held until the descriptor closes.
    Raises :class:`OSError` if ``fcntl`` fails."""
    _lock(fd, fcntl.F_RDLCK, _CACHE_BYTE, wait=False)


def _owner_alive(fd: int) -> bool:
    """Whether another open file description holds the owner lock."""
    return lock_holders_present(fd, _OWNER_BYTE)


def iter_segment_files(directory: str | None = None) -> Iterator[str]:
    """Names of mmshm segment files in the directory (any creator)."""
    d = segment_dir(directory)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return iter(())
    return (n for n in names if NAME_RE.match(n))


def _disown_for_exit(seg) -> None:
    """The owner is leaving: a segment still in use elsewhere must be unlinked
    by its last release instead of going back to a pool nobody will empty
    (clears ``FLAG_POOLABLE`` of ``seg``, a :class:`mmshm.segment.Segment`,
    under its mutex; never raises)."""
    try:
        _lock(seg.fd, fcntl.F_WRLCK, _MUTEX_BYTE)
        try:
            hdr = _read_header(seg.fd, seg.path)
            os.pwrite(seg.fd, _U32.pack(hdr[8] & ~FLAG_POOLABLE), _OFF_FLAGS)
        finally:
            _lock(seg.fd, fcntl.F_UNLCK, _MUTEX_BYTE)
    except OSError:
        pass


# -- the reaper's interface --------------------------------------------------
def try_lock_unheld(fd: int) -> bool:
    """Take the exclusive liveness lock (byte 1) of the segment open on
    ``fd`` without waiting. True: no process holds the segment, and none can
    attach it while this open file description keeps the lock (attach blocks
    on it, then sees the file unlinked). False: some process holds it. Raises
    :class:`OSError` for any other failure of ``fcntl``."""
    try:
        _lock(fd, fcntl.F_WRLCK, _LIVE_BYTE, wait=False)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def read_state(fd: int, path: str) -> tuple[int, int, int, int, bool] | None:
    """``(state, reference count, holders, last clean detach in boottime
    ns, delivered)`` of the segment open on ``fd``, read under its mutex
    (byte 0); ``delivered``: readers attached every reference of the last
    hand-out (:func:`delivered`). None if its header cannot be read (a
    process died before writing it, a bad magic or version, a short file).
    Raises :class:`OSError` if the mutex cannot be taken."""
    _lock(fd, fcntl.F_WRLCK, _MUTEX_BYTE)  # only brief updates by path can hold it
    try:
        try:
            hdr = _read_header(fd, path)
        except OSError:
            return None
        n, detached = holders(fd)
        handed, attached = hand_out(fd)
    finally:
        _lock(fd, fcntl.F_UNLCK, _MUTEX_BYTE)
    return hdr[2], hdr[4], n, detached, delivered(handed, attached)
