"""The segment file: its format, its locks, its header fields, its mapping.

The lowest layer of the segment code: functions of one open descriptor and
path, with no process-local state (no registry, no pool, no thread). The
reaper (:mod:`mmshm.segments.reaper`) and ``mmshm status`` read files through it; the
segment table (:mod:`mmshm.segments.table`) and :mod:`mmshm.segments.segment` build on it. It
imports nothing of mmshm but the configuration and the errors. Every
read-modify-write of a header runs inside :func:`mutex`, and reads its fields
through :class:`Header`.

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
mapped with libc's ``mmap`` through ctypes instead (:func:`map_fd`), which
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
from contextlib import contextmanager
from typing import NamedTuple

from mmshm import config
from mmshm.errors import (
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
# an arena segment (mmshm.segments.arena): kept in its owner's pool for good, and
# mapped once (and registered with CUDA once) by each consumer
FLAG_ARENA = 2
# magic, version, state, capacity (payload bytes), refcount, creator pid,
# created ns, generation (bumped on every reuse), flags
_HDR = struct.Struct("<8sIIQqQQQI")


class Header(NamedTuple):
    """The fixed fields of a segment's header (the first 60 bytes), as
    :func:`read_header` decodes them."""

    magic: bytes
    version: int
    #: ``STATE_LIVE``, ``STATE_FREED`` or ``STATE_POOLED``
    state: int
    #: payload capacity in bytes (the file is ``HEADER_SIZE + size`` long)
    size: int
    #: references counted on the segment
    refcount: int
    creator_pid: int
    #: creation time, ``time.time_ns()`` (ns since the epoch)
    created_ns: int
    #: bumped by every reuse from the pool; a handle carries the one it was made for
    gen: int
    #: ``FLAG_POOLABLE``, ``FLAG_ARENA``, or'ed, or 0
    flags: int


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

#: The name prefix of every segment file: spelled here only (NAME_RE, the wire codec,
#: status's glob, the bench and the tests derive from it).
PREFIX = "mmshm-"
NAME_RE = re.compile(re.escape(PREFIX) + r"([0-9]{1,10})-([0-9a-f]{16})\Z")

MUTEX_BYTE, LIVE_BYTE, OWNER_BYTE, CACHE_BYTE = 0, 1, 2, 3
# struct flock on Linux (x86_64, aarch64): short, short, off_t, off_t, pid_t
_FLOCK = struct.Struct("hhqqi4x")
OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def _lock(fd: int, kind: int, byte: int, wait: bool = True) -> None:
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))


def lock_holders_present(fd: int, byte: int = LIVE_BYTE) -> bool:
    """True if another open file description holds a lock on ``byte``."""
    out = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    return _FLOCK.unpack(out)[0] != fcntl.F_UNLCK


def segment_dir(directory: str | None = None) -> str:
    return directory if directory is not None else config.get().dir


def new_name() -> str:
    """A fresh segment name: creator pid plus 64 random bits."""
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def os_error(exc: OSError, what: str, path: str) -> SegmentError:
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


def map_fd(fd: int, length: int, offset: int, shared: bool,
           writable: bool = True) -> ctypes.Array:
    """Map ``length`` bytes of ``fd`` from ``offset`` (a page multiple),
    read-write (read-only without ``writable``: a write through it is a
    SIGSEGV), ``MAP_SHARED`` or copy-on-write ``MAP_PRIVATE``, without
    duplicating the descriptor (Python's ``mmap`` would). Returns a ctypes
    byte array over the mapping (it exports the buffer protocol); the mapping
    is removed when that array is collected, i.e. once nothing exported from
    it (a memoryview, a numpy array, a tensor) is left, so a view can never
    outlive its pages. The kernel's mapping keeps the open file description,
    and with it the liveness lock, until then. Raises :class:`OSError`."""
    if length <= 0:
        raise ValueError(f"cannot map {length} bytes")
    addr = _libc.mmap(None, length, mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0),
                      mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")
    buf = (ctypes.c_ubyte * length).from_address(addr)
    # at exit the process unmaps everything anyway: never earlier than a view
    weakref.finalize(buf, _libc.munmap, addr, length).atexit = False
    return buf


def peek_header(fd: int) -> Header | None:
    """The header of the file open on ``fd`` (a racy read, any version),
    None if it is too short or not an mmshm header (bad magic). Raises
    :class:`OSError` if ``pread`` fails."""
    raw = os.pread(fd, _HDR.size, 0)
    if len(raw) < _HDR.size or raw[:8] != MAGIC:
        return None
    return Header._make(_HDR.unpack(raw))


def read_header(fd: int, path: str) -> Header:
    """The header of the segment open on ``fd`` (a racy read unless the
    caller holds :func:`mutex`). Raises :class:`SegmentCorruptError` for a
    truncated header, a bad magic or an unsupported version, and
    :class:`OSError` if ``pread`` fails."""
    raw = os.pread(fd, _HDR.size, 0)
    if len(raw) < _HDR.size:
        raise SegmentCorruptError(errno.EINVAL, "segment header is truncated", path)
    hdr = Header._make(_HDR.unpack(raw))
    if hdr.magic != MAGIC:
        raise SegmentCorruptError(errno.EINVAL, "not an mmshm segment (bad magic)", path)
    if hdr.version != VERSION:
        raise SegmentCorruptError(errno.EINVAL, f"unsupported segment version {hdr.version}",
                                  path)
    return hdr


def write_new_header(buf, size: int, poolable: bool, arena: bool = False) -> None:
    """Write the header of a segment just created by this process into its
    mapping ``buf``: live, ``size`` payload bytes, one reference (the
    creator's), generation 0, one holder; ``FLAG_ARENA`` with ``arena``."""
    _HDR.pack_into(buf, 0, MAGIC, VERSION, STATE_LIVE, size, 1, os.getpid(), time.time_ns(), 0,
                   (FLAG_POOLABLE if poolable else 0) | (FLAG_ARENA if arena else 0))
    _I64.pack_into(buf, _OFF_HOLDERS, 1)


def mapped_state(buf) -> int:
    """The state word of a segment from its creator's mapping ``buf`` (a
    racy read; the file must be at least ``HEADER_SIZE`` long)."""
    return _U32.unpack_from(buf, _OFF_STATE)[0]


def state_on_disk(fd: int) -> int | None:
    """The state word of the segment open on ``fd`` (a racy read), None if
    the file is too short to hold one. Raises :class:`OSError`."""
    raw = os.pread(fd, 4, _OFF_STATE)
    return _U32.unpack(raw)[0] if len(raw) == 4 else None


@contextmanager
def mutex(fd: int) -> Iterator[None]:
    """Hold the segment's mutex (byte 0, exclusive, waiting for it) for the
    block: every read-modify-write of the count, the state, the generation,
    the holders and the hand-out record runs inside one. OFD locks do not
    exclude threads sharing ``fd``: the caller serialises those. Raises
    :class:`OSError` if the lock cannot be taken."""
    _lock(fd, fcntl.F_WRLCK, MUTEX_BYTE)
    try:
        yield
    finally:
        _lock(fd, fcntl.F_UNLCK, MUTEX_BYTE)


def hold_live(fd: int, wait: bool = True) -> None:
    """Take the shared liveness lock (byte 1) on ``fd``: this process holds
    the segment until the descriptor and every mapping of it are gone. With
    ``wait``, blocks while a reaper holds the exclusive one. Raises
    :class:`OSError` (EAGAIN/EACCES without ``wait`` if it is taken)."""
    _lock(fd, fcntl.F_RDLCK, LIVE_BYTE, wait=wait)


def take_owner(fd: int) -> None:
    """Take the exclusive owner lock (byte 2) on ``fd`` of a segment this
    process just created, without waiting. Raises :class:`OSError`."""
    _lock(fd, fcntl.F_WRLCK, OWNER_BYTE, wait=False)


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


def hand_out_record(fd: int) -> tuple[int, int, int]:
    """``(references the last hand-out added, attaches since by other
    processes, the pid that made the hand-out)`` from a segment's header;
    ``(0, 0, 0)`` for a short header. A plain read: take :func:`mutex`
    around it for a consistent one."""
    raw = os.pread(fd, _HAND_OUT.size, _OFF_HANDED)
    if len(raw) < _HAND_OUT.size:
        return 0, 0, 0
    return _HAND_OUT.unpack(raw)


def hand_out(fd: int) -> tuple[int, int]:
    """``(references the last hand-out added, attaches since by other
    processes)`` from a segment's header (a racy read, without the mutex)."""
    handed, attached, _pid = hand_out_record(fd)
    return handed, attached


def delivered(handed: int, attached: int) -> bool:
    """Whether the references of the last hand-out (``handed``, or the one
    reference a creator hands over without a count change when 0) have
    all been attached by readers (``attached`` attaches since): a reference
    counted on a segment nobody holds then belongs to a process that opened
    it and is gone, not to a message still in flight (see
    :mod:`mmshm.segments.reaper`)."""
    return attached >= max(handed, 1)


def update_count(fd: int, path: str, delta: int, gen: int | None = None,
                 owner_here: bool = False) -> int:
    """Add ``delta`` to the reference count of the segment open on ``fd``
    (at ``path``) under its mutex and return the new count. A positive
    ``delta`` is recorded as the last hand-out. At zero the segment goes
    back to its owner's pool (``FLAG_POOLABLE`` and the owner alive: this
    process, ``owner_here``, or another that holds the owner lock), or is
    marked freed and unlinked while the mutex is still held, so no later
    ``share`` can resurrect it. A count that would go negative is logged
    and kept at 0.

    Raises:
        SegmentNotFoundError: the segment was already freed, or reused
            (``gen`` given and different).
        SegmentCorruptError, OSError: the header cannot be read.
    """
    with mutex(fd):
        hdr = read_header(fd, path)
        if hdr.state != STATE_LIVE:
            raise SegmentNotFoundError(errno.ENOENT, "segment was already freed", path)
        if gen is not None and hdr.gen != gen:
            raise SegmentNotFoundError(
                errno.ENOENT, f"segment was reused (generation {hdr.gen}, handle {gen})", path)
        new = hdr.refcount + delta
        if new < 0:
            log.error("mmshm: reference count of %s would go negative (%d); "
                      "a handle was pickled without share()", path, new)
            new = 0
        os.pwrite(fd, _I64.pack(new), _OFF_REFCOUNT)
        if delta > 0:
            # a new hand-out, attached by nobody yet
            os.pwrite(fd, _HAND_OUT.pack(min(delta, 0xFFFFFFFF), 0, os.getpid() & 0xFFFFFFFF),
                      _OFF_HANDED)
        if new == 0:
            if hdr.flags & FLAG_POOLABLE and (owner_here or lock_holders_present(fd, OWNER_BYTE)):
                os.pwrite(fd, _U32.pack(STATE_POOLED), _OFF_STATE)
            else:
                os.pwrite(fd, _U32.pack(STATE_FREED), _OFF_STATE)
                _unlink(path)
        return new


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def revive(fd: int, path: str) -> int | None:
    """Take a pooled segment back into use (its owner only): count 1, the
    next generation, no hand-out yet, in one locked update. Returns the new
    generation, or None if the segment is not idle in the pool (state
    ``POOLED`` at count 0, still linked), its file is shorter than its
    header says (``HEADER_SIZE`` + payload size: a third party truncated
    it, and a write through a mapping would SIGBUS) or it cannot be read."""
    try:
        with mutex(fd):
            hdr = read_header(fd, path)
            st = os.fstat(fd)
            if (hdr.state != STATE_POOLED or hdr.refcount != 0 or st.st_nlink == 0
                    or st.st_size < HEADER_SIZE + hdr.size):
                return None
            gen = hdr.gen + 1
            os.pwrite(fd, _U64.pack(gen), _OFF_GEN)
            os.pwrite(fd, _I64.pack(1), _OFF_REFCOUNT)
            os.pwrite(fd, _U32.pack(STATE_LIVE), _OFF_STATE)
            os.pwrite(fd, _HAND_OUT.pack(0, 0, 0), _OFF_HANDED)  # a new life
    except OSError:
        return None
    return gen


def unlink_pooled(fd: int, path: str) -> None:
    """Mark an idle pooled segment (count 0) freed and unlink it, under its
    mutex (the owner's decision). A live one is left alone (only the owner
    revives it, so that cannot happen). Never raises."""
    try:
        with mutex(fd):
            hdr = read_header(fd, path)
            if hdr.state == STATE_POOLED and hdr.refcount == 0:
                os.pwrite(fd, _U32.pack(STATE_FREED), _OFF_STATE)
                _unlink(path)
    except OSError:
        pass


def add_holder(fd: int) -> None:
    """This process now has the segment open (after the liveness lock): one
    holder more and, unless it made the last hand-out itself, one attach of
    that hand-out's references. Raises :class:`OSError`."""
    with mutex(fd):
        n = _I64.unpack(os.pread(fd, 8, _OFF_HOLDERS))[0]
        os.pwrite(fd, _I64.pack(max(n, 0) + 1), _OFF_HOLDERS)
        raw = os.pread(fd, _HAND_OUT.size, _OFF_HANDED)
        if len(raw) == _HAND_OUT.size:
            handed, attached, pid = _HAND_OUT.unpack(raw)
            if pid != os.getpid() & 0xFFFFFFFF and attached < 0xFFFFFFFF:
                os.pwrite(fd, _HAND_OUT.pack(handed, attached + 1, pid), _OFF_HANDED)


def detach(fd: int) -> None:
    """This process closes the segment cleanly: one holder fewer, and the
    time, from which references still in flight get their grace period
    (``MMSHM_IN_FLIGHT_GRACE_S``, see :mod:`mmshm.segments.reaper`). A file already
    unlinked or truncated, or ``fd`` < 0, is left alone. Never raises."""
    if fd < 0:
        return
    try:
        st = os.fstat(fd)
        if st.st_nlink == 0 or st.st_size < HEADER_SIZE:
            return
        with mutex(fd):
            n = _I64.unpack(os.pread(fd, 8, _OFF_HOLDERS))[0]
            os.pwrite(fd, _I64.pack(max(n - 1, 0)) + _U64.pack(boottime_ns()), _OFF_HOLDERS)
    except OSError as exc:
        log.debug("mmshm: detach failed: %s", exc)


def disown_for_exit(fd: int, path: str) -> None:
    """The owner is leaving: a segment still in use elsewhere must be unlinked
    by its last release instead of going back to a pool nobody will empty
    (clears ``FLAG_POOLABLE`` under the mutex). Never raises."""
    try:
        with mutex(fd):
            hdr = read_header(fd, path)
            os.pwrite(fd, _U32.pack(hdr.flags & ~FLAG_POOLABLE), _OFF_FLAGS)
    except OSError:
        pass


def mark_cached(fd: int) -> None:
    """Record that a cache of this process keeps views of the segment open
    on ``fd``: the shared lock on byte 3, held until the descriptor closes.
    Raises :class:`OSError` if ``fcntl`` fails."""
    _lock(fd, fcntl.F_RDLCK, CACHE_BYTE, wait=False)


def iter_segment_files(directory: str | None = None) -> Iterator[str]:
    """Names of mmshm segment files in the directory (any creator)."""
    d = segment_dir(directory)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return iter(())
    return (n for n in names if NAME_RE.match(n))


# -- the reaper's interface --------------------------------------------------
def try_lock_unheld(fd: int) -> bool:
    """Take the exclusive liveness lock (byte 1) of the segment open on
    ``fd`` without waiting. True: no process holds the segment, and none can
    attach it while this open file description keeps the lock (attach blocks
    on it, then sees the file unlinked). False: some process holds it. Raises
    :class:`OSError` for any other failure of ``fcntl``."""
    try:
        _lock(fd, fcntl.F_WRLCK, LIVE_BYTE, wait=False)
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
    with mutex(fd):  # only brief updates by path can hold it
        try:
            hdr = read_header(fd, path)
        except OSError:
            return None
        n, detached = holders(fd)
        handed, attached = hand_out(fd)
    return hdr.state, hdr.refcount, n, detached, delivered(handed, attached)
