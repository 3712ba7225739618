"""Shared-memory segments: create, attach, reference-count, release, unlink.

A segment is one file in the segment directory (``MMSHM_DIR``, default
``/dev/shm``), named ``mmshm-<creator pid>-<64 random bits as 16 hex>``. It is
opened by path with ``os.open`` and mapped with ``mmap``; the
``multiprocessing`` resource tracker never sees it.

File layout (little-endian)::

    [0, 4096)           header: magic, version, state, payload size (bytes),
                        reference count, creator pid, creation time (ns),
                        generation, flags; at 64 the holder count, at 72
                        the last clean detach (CLOCK_BOOTTIME ns)
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

**The warm pool.** Copying into a fresh tmpfs segment runs at page-fault speed
(about 1.3 GB/s here: allocation and zeroing); into warm pages at memcpy speed.
So a producing process keeps the segments it created, in size classes (eight
per power of two, at most 12.5% slack), and reuses one whose count came back to
zero instead of creating a file. Every reuse bumps the segment's *generation*;
a handle carries the generation it was made for, and attach and every
reference update check it, so a stale handle can never read a reused segment's
new bytes. A pooled segment is never reused while any holder in any process
has a view: views hold references, and only a count of zero is pooled. Idle
pooled segments are unlinked after ``MMSHM_POOL_IDLE_S``, beyond
``MMSHM_POOL_MAX_BYTES``, when the budget guard needs the room, and when the
owner exits; after a SIGKILL the reaper reclaims them (nobody holds them).

Space is reserved with ``posix_fallocate`` before any byte is written, so a
full tmpfs gives :class:`~mmshm.errors.ShmSpaceError` (ENOSPC) instead of a
SIGBUS in the middle of a copy.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import fcntl
import logging
import mmap
import multiprocessing.util  # noqa: F401 - its Finalize runs at a child's exit
import os
import re
import resource
import secrets
import stat
import struct
import sys
import threading
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
from .metrics import (
    BYTES_IN_USE,
    FREE_BYTES,
    POOL_REQUESTS,
    SEGMENTS_CREATED,
    SEGMENTS_IN_USE,
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
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")

PREFIX = "mmshm-"
NAME_RE = re.compile(r"mmshm-([0-9]{1,10})-([0-9a-f]{16})\Z")

_MUTEX_BYTE, _LIVE_BYTE, _OWNER_BYTE = 0, 1, 2
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


class Segment:
    """One segment as seen by this process: an open descriptor (holding the
    liveness lock) and, for the creator, a shared writable mapping.

    Instances are process-local and cached by name; use :func:`create` and
    :func:`attach`, never the constructor.
    """

    __slots__ = ("digest", "directory", "fd", "gen", "idle_since", "name", "owned", "path",
                 "payload_size", "pins", "shared_map")

    def __init__(self, name: str, path: str, fd: int, payload_size: int, owned: bool,
                 gen: int = 0):
        self.name = name
        self.path = path
        self.directory = os.path.dirname(path)
        self.fd = fd
        self.payload_size = payload_size  # capacity in bytes
        self.owned = owned
        self.gen = gen
        self.pins = 0
        self.idle_since: float | None = None
        self.shared_map: ctypes.Array | None = None  # the creator's (see _map)
        # (generation, content hash) once computed in this process (lazy hashing)
        self.digest: tuple[int, bytes] | None = None

    # -- reference count -------------------------------------------------
    def update_refcount(self, delta: int, gen: int | None = None) -> int:
        """Add ``delta`` to the reference count under the segment mutex and
        return the new count. At zero the segment goes back to its owner's
        pool, or is marked freed and unlinked while the mutex is still held,
        so no later ``share`` can resurrect it. Raises
        :class:`SegmentNotFoundError` if the segment was already freed, or
        reused (``gen`` given and different)."""
        # OFD locks do not exclude threads sharing this descriptor: the
        # process lock serialises them; the file lock serialises processes.
        with _LOCK:
            if self.fd < 0:
                raise SegmentNotFoundError(
                    errno.EBADF, "segment was closed in this process", self.path)
            return _update_refcount(self.fd, self.path, delta, gen, owner_here=self.owned)

    def refcount(self) -> int:
        """Current reference count (a racy read without the mutex)."""
        return _read_header(self.fd, self.path)[4]

    def close(self) -> None:
        # unmapped once no view exported from it is left (see _map)
        self.shared_map = None
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1

    def status(self) -> int:
        """``STATE_LIVE``, ``STATE_POOLED`` or ``STATE_FREED``. A file that a
        third party unlinked or truncated counts as freed: no one can attach or
        release through it any more, and holding it open would only keep its
        tmpfs pages allocated. One ``fstat``; the state word is read from the
        creator's mapping only once the file is known to be large enough (a
        truncated mapping would SIGBUS)."""
        if self.fd < 0:
            return STATE_FREED
        try:
            st = os.fstat(self.fd)
        except OSError:
            return STATE_FREED
        if st.st_nlink == 0 or st.st_size < HEADER_SIZE:
            return STATE_FREED
        if self.shared_map is not None:
            return _U32.unpack_from(self.shared_map, _OFF_STATE)[0]
        try:
            return _read_header(self.fd, self.path)[2]
        except SegmentError:
            return STATE_FREED

    def freed(self) -> bool:
        """Whether the segment is gone for good (see :meth:`status`)."""
        return self.status() == STATE_FREED

    def payload_view(self) -> memoryview:
        """Writable view of the payload in the creator's shared mapping."""
        assert self.shared_map is not None, "only the creator writes the payload"
        # ctypes exports format "<B"; consumers such as blake3 want "B"
        return memoryview(self.shared_map).cast("B")[HEADER_SIZE : HEADER_SIZE + self.payload_size]

    def check_size(self) -> None:
        """Raise :class:`SegmentCorruptError` if the file is now shorter than
        its header says (truncated by a third party)."""
        size = os.fstat(self.fd).st_size
        if size < HEADER_SIZE + self.payload_size:
            raise SegmentCorruptError(
                errno.EINVAL, f"segment is truncated: {size} bytes on disk, header says "
                f"{HEADER_SIZE + self.payload_size}", self.path)

    def map_private(self, nbytes: int | None = None) -> ctypes.Array:
        """A fresh copy-on-write mapping of the payload. Reads share the
        segment's pages; a write by the consumer stays private, so it can
        never change the bytes another holder sees (and cannot SIGSEGV).

        The file size is checked first (a mapping past the end of a truncated
        file would SIGBUS on access). Raises :class:`SegmentCorruptError`."""
        try:
            self.check_size()
            return _map(self.fd, self.payload_size if nbytes is None else nbytes,
                        HEADER_SIZE, shared=False)
        except SegmentError:
            raise
        except (OSError, ValueError) as exc:
            raise SegmentCorruptError(errno.EINVAL, f"cannot map segment: {exc}",
                                      self.path) from exc


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


def _add_holder(fd: int, path: str) -> None:
    """This process now has the segment open (after the liveness lock)."""
    _lock(fd, fcntl.F_WRLCK, _MUTEX_BYTE)
    try:
        n = _I64.unpack(os.pread(fd, 8, _OFF_HOLDERS))[0]
        os.pwrite(fd, _I64.pack(max(n, 0) + 1), _OFF_HOLDERS)
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


def _owner_alive(fd: int) -> bool:
    """Whether another open file description holds the owner lock."""
    return lock_holders_present(fd, _OWNER_BYTE)


def _update_refcount(fd: int, path: str, delta: int, gen: int | None = None,
                     owner_here: bool = False) -> int:
    _lock(fd, fcntl.F_WRLCK, _MUTEX_BYTE)
    try:
        hdr = _read_header(fd, path)
        if hdr[2] != STATE_LIVE:
            raise SegmentNotFoundError(errno.ENOENT, "segment was already freed", path)
        if gen is not None and hdr[7] != gen:
            raise SegmentNotFoundError(
                errno.ENOENT, f"segment was reused (generation {hdr[7]}, handle {gen})", path)
        new = hdr[4] + delta
        if new < 0:
            log.error("mmshm: reference count of %s would go negative (%d); "
                      "a handle was pickled without share()", path, new)
            new = 0
        os.pwrite(fd, _I64.pack(new), _OFF_REFCOUNT)
        if new == 0:
            if hdr[8] & FLAG_POOLABLE and (owner_here or _owner_alive(fd)):
                os.pwrite(fd, _U32.pack(STATE_POOLED), _OFF_STATE)
            else:
                os.pwrite(fd, _U32.pack(STATE_FREED), _OFF_STATE)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        return new
    finally:
        _lock(fd, fcntl.F_UNLCK, _MUTEX_BYTE)


# -- process-local registry ------------------------------------------------
_LOCK = threading.RLock()
_REGISTRY: dict[str, Segment] = {}
_sweeper: threading.Thread | None = None
_owned_bytes = 0
_reaped_dirs: set[str] = set()


def _forget(seg: Segment) -> None:
    global _owned_bytes
    if _REGISTRY.get(seg.name) is seg:
        del _REGISTRY[seg.name]
        _detach(seg.fd)
        if seg.owned:
            _owned_bytes -= HEADER_SIZE + seg.payload_size
            SEGMENTS_IN_USE.dec()
            BYTES_IN_USE.dec(HEADER_SIZE + seg.payload_size)
    seg.close()


def owned_bytes() -> int:
    """Bytes (header included) of this process's created, not yet closed segments."""
    return _owned_bytes


def check_budget(directory: str, total: int) -> None:
    """The budget guard: raise :class:`ShmSpaceError` (reason ``budget``) if a
    new segment of ``total`` bytes would leave less than the reserve
    (``MMSHM_MIN_FREE_BYTES``) free in ``directory``, or push this process
    over ``MMSHM_MAX_BYTES``. One ``statvfs`` call."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    FREE_BYTES.set(free)
    reserve = config.min_free_bytes(st.f_blocks * st.f_frsize)
    if total > free:
        raise ShmSpaceError(
            f"a {total}-byte segment does not fit in the {free} bytes free in {directory}")
    if free - total < reserve:
        raise ShmSpaceError(
            f"budget: a {total}-byte segment would leave {max(free - total, 0)} bytes free in "
            f"{directory}, below the reserve of {reserve} bytes (MMSHM_MIN_FREE_BYTES)",
            reason="budget")
    cap = config.get().max_bytes
    if cap and _owned_bytes + total > cap:
        raise ShmSpaceError(
            f"budget: this process would hold {_owned_bytes + total} bytes of shared memory, "
            f"above MMSHM_MAX_BYTES={cap}", reason="budget")


def _check_fd(fd: int, path: str) -> None:
    """Refuse descriptors too close to RLIMIT_NOFILE (the kernel hands out the
    lowest free number, so the number tracks how many are open)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and fd >= soft - config.get().fd_reserve:
        os.close(fd)
        raise DescriptorLimitError(
            errno.EMFILE, f"descriptor {fd} is within MMSHM_FD_RESERVE of RLIMIT_NOFILE={soft}",
            path)


def size_class(total: int) -> int:
    """Round a segment size (bytes, header included) up to its pool class:
    whole pages up to 64 KiB, then eight classes per power of two: a size in
    [2**k, 2**(k+1)) rounds up to a multiple of 2**(k-3), so the slack is
    below 12.5% of the size (an 8 MiB tensor plus its header takes 9 MiB)."""
    if total <= 1 << 16:
        return -(-total // 4096) * 4096
    step = (1 << (total.bit_length() - 1)) // 8
    return -(-total // step) * step


def _revive(seg: Segment) -> bool:
    """Take a pooled segment back into use: count 1, next generation."""
    _lock(seg.fd, fcntl.F_WRLCK, _MUTEX_BYTE)
    try:
        hdr = _read_header(seg.fd, seg.path)
        if hdr[2] != STATE_POOLED or hdr[4] != 0 or os.fstat(seg.fd).st_nlink == 0:
            return False
        gen = hdr[7] + 1
        os.pwrite(seg.fd, _U64.pack(gen), _OFF_GEN)
        os.pwrite(seg.fd, _I64.pack(1), _OFF_REFCOUNT)
        os.pwrite(seg.fd, _U32.pack(STATE_LIVE), _OFF_STATE)
    except OSError:
        return False
    finally:
        _lock(seg.fd, fcntl.F_UNLCK, _MUTEX_BYTE)
    seg.gen = gen
    seg.idle_since = None
    return True


def _pool_take(directory: str, total: int) -> Segment | None:
    """An idle pooled segment of this size class, revived (count 1). A
    segment taken moves to the end of the registry, so the scan meets the
    longest-idle segments first and under steady traffic stops at the first
    candidate (one ``fstat``), not after every busy one."""
    for seg in list(_REGISTRY.values()):
        if (seg.owned and seg.pins == 0 and seg.directory == directory
                and HEADER_SIZE + seg.payload_size == total
                and seg.status() == STATE_POOLED and _revive(seg)):
            del _REGISTRY[seg.name]
            _REGISTRY[seg.name] = seg
            return seg
    return None


def _unlink_pooled(seg: Segment) -> None:
    """Unlink an idle pooled segment (the owner's decision) and let go of it."""
    try:
        _lock(seg.fd, fcntl.F_WRLCK, _MUTEX_BYTE)
        try:
            hdr = _read_header(seg.fd, seg.path)
            if hdr[2] == STATE_POOLED and hdr[4] == 0:
                os.pwrite(seg.fd, _U32.pack(STATE_FREED), _OFF_STATE)
                try:
                    os.unlink(seg.path)
                except FileNotFoundError:
                    pass
            elif hdr[2] == STATE_LIVE:
                return  # cannot happen: only the owner revives
        finally:
            _lock(seg.fd, fcntl.F_UNLCK, _MUTEX_BYTE)
    except OSError:
        pass
    _forget(seg)


def trim_pool(directory: str | None = None) -> int:
    """Unlink every idle pooled segment of this process (in ``directory``, or
    all). Returns the bytes given back."""
    freed = 0
    with _LOCK:
        for seg in list(_REGISTRY.values()):
            if (seg.owned and seg.pins == 0 and (directory is None or seg.directory == directory)
                    and seg.status() == STATE_POOLED):
                freed += HEADER_SIZE + seg.payload_size
                _unlink_pooled(seg)
    return freed


def create(nbytes: int, directory: str | None = None) -> Segment:
    """Get a segment with room for ``nbytes`` payload bytes: a warm one from
    this process's pool when one of the right size class is idle, else a new
    file.

    A new file is made with O_CREAT|O_EXCL|O_NOFOLLOW and mode 0600, sized with
    ``ftruncate`` and reserved with ``posix_fallocate`` before anything is
    written. The caller owns one reference; ``Segment.gen`` is the generation
    its handles must carry.

    Raises:
        ShmSpaceError: ENOSPC while reserving space, or the budget guard
            (reason ``budget``); nothing is left behind.
        DescriptorLimitError: EMFILE/ENFILE.
        SegmentError: any other OS failure (the errno is kept).
    """
    global _owned_bytes
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    d = segment_dir(directory)
    cfg = config.get()
    total = size_class(HEADER_SIZE + nbytes) if cfg.pool else HEADER_SIZE + nbytes
    if d not in _reaped_dirs:
        _reaped_dirs.add(d)
        ensure_dir(d)
        from .reaper import maybe_reap
        maybe_reap(d)
    _ensure_exit_hook()
    with _LOCK:
        if cfg.pool:
            # a hit needs no sweep: the segment's state is read from its header,
            # and the background sweeper trims the pool
            seg = _pool_take(d, total)
            if seg is not None:
                POOL_REQUESTS.labels(result="hit").inc()
                return seg
            POOL_REQUESTS.labels(result="miss").inc()
        sweep()  # let go of segments freed elsewhere before counting what is in use
    try:
        check_budget(d, total)
    except ShmSpaceError:
        if not trim_pool(d):
            raise
        check_budget(d, total)
    for _ in range(8):
        name = new_name()
        path = os.path.join(d, name)
        try:
            fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        except OSError as exc:
            raise _os_error(exc, "create", path) from None
        try:
            _check_fd(fd, path)
        except DescriptorLimitError:
            os.unlink(path)
            raise
        try:
            _lock(fd, fcntl.F_RDLCK, _LIVE_BYTE, wait=False)
            _lock(fd, fcntl.F_WRLCK, _OWNER_BYTE, wait=False)
            if os.fstat(fd).st_nlink > 0:
                break
        except OSError:
            pass
        # a reaper judged the file in the instant between open and lock: pick again
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
    else:
        raise SegmentError(errno.EEXIST, "could not find a free segment name", d)
    try:
        os.ftruncate(fd, total)
        os.posix_fallocate(fd, 0, total)
        mm = _map(fd, total, 0, shared=True)
        _HDR.pack_into(mm, 0, MAGIC, VERSION, STATE_LIVE, total - HEADER_SIZE, 1, os.getpid(),
                       time.time_ns(), 0, FLAG_POOLABLE if cfg.pool else 0)
        _I64.pack_into(mm, _OFF_HOLDERS, 1)
    except OSError as exc:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)
        raise _os_error(exc, "create", path) from None
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)
        raise
    seg = Segment(name, path, fd, total - HEADER_SIZE, owned=True)
    seg.shared_map = mm
    SEGMENTS_CREATED.inc()
    SEGMENTS_IN_USE.inc()
    BYTES_IN_USE.inc(total)
    with _LOCK:
        sweep()
        _REGISTRY[name] = seg
        _owned_bytes += total
        _ensure_sweeper()
    return seg


def attach(name: str, directory: str | None = None, gen: int | None = None) -> Segment:
    """Open an existing segment (or return this process's open one) and
    validate its header, generation and file size before anything is mapped.

    Raises:
        SegmentNotFoundError: the file is gone, unlinked, already freed, or
            reused since the handle was made (``gen`` differs).
        SegmentCorruptError: bad magic/version, a truncated file, a symbolic
            link, or a file owned by another user.
        DescriptorLimitError: EMFILE/ENFILE.
    """
    with _LOCK:
        seg = _REGISTRY.get(name)
        if seg is not None:
            if gen is not None and gen != (seg.gen if seg.owned else _read_header(
                    seg.fd, seg.path)[7]):
                raise SegmentNotFoundError(errno.ENOENT, "segment was reused", seg.path)
            # its last reference is gone (a third party's unlink alone does not
            # stop holders that have it open); pread: a truncated file cannot SIGBUS
            if _read_header(seg.fd, seg.path)[2] != STATE_LIVE:
                raise SegmentNotFoundError(errno.ENOENT, "segment was already freed", seg.path)
            return seg
        path = os.path.join(segment_dir(directory), name)
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            raise _os_error(exc, "attach", path) from None
        _check_fd(fd, path)
        try:
            # Blocks only while a reaper holds the exclusive liveness lock.
            _lock(fd, fcntl.F_RDLCK, _LIVE_BYTE)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink == 0:
                raise SegmentNotFoundError(errno.ENOENT, "segment was unlinked", path)
            if st.st_uid != os.geteuid():
                raise SegmentCorruptError(errno.EPERM, "segment belongs to another user", path)
            hdr = _read_header(fd, path)
            if hdr[2] != STATE_LIVE or hdr[4] <= 0:
                raise SegmentNotFoundError(errno.ENOENT, "segment was already freed", path)
            if gen is not None and hdr[7] != gen:
                raise SegmentNotFoundError(errno.ENOENT, "segment was reused", path)
            size = hdr[3]
            if st.st_size < HEADER_SIZE + size:
                raise SegmentCorruptError(
                    errno.EINVAL,
                    f"segment is truncated: {st.st_size} bytes on disk, header says "
                    f"{HEADER_SIZE + size}",
                    path,
                )
            _add_holder(fd, path)
        except OSError as exc:
            os.close(fd)
            if isinstance(exc, SegmentError):
                raise
            raise _os_error(exc, "attach", path) from None
        seg = Segment(name, path, fd, size, owned=False, gen=hdr[7])
        _REGISTRY[name] = seg
        _ensure_exit_hook()
        return seg


def pin(seg: Segment) -> None:
    """Record that a view in this process depends on ``seg``'s descriptor."""
    with _LOCK:
        seg.pins += 1


def unpin(seg: Segment) -> None:
    """Drop a pin; closes the descriptor once nothing in this process needs it."""
    with _LOCK:
        seg.pins -= 1
        _maybe_close(seg)


def _maybe_close(seg: Segment) -> None:
    if seg.pins > 0:
        return
    if seg.owned and not seg.freed():
        return  # creator keeps it: in use elsewhere (liveness lock) or pooled
    _forget(seg)


def update_refcount(name: str, delta: int, directory: str | None = None,
                    gen: int | None = None) -> int:
    """Add ``delta`` references to segment ``name`` (opening it briefly if this
    process has no descriptor). Returns the new count.

    Raises:
        SegmentNotFoundError: the segment is gone, already freed, or reused
            (``gen`` given and different).
        SegmentCorruptError, DescriptorLimitError: as for :func:`attach`.
    """
    with _LOCK:
        seg = _REGISTRY.get(name)
        if seg is not None:
            new = seg.update_refcount(delta, gen)
            if new == 0:
                _maybe_close(seg)
            return new
    path = os.path.join(segment_dir(directory), name)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise _os_error(exc, "update", path) from None
    try:
        return _update_refcount(fd, path, delta, gen)
    finally:
        os.close(fd)


def sweep() -> int:
    """Let go of this process's created segments whose last reference is gone
    (closing them, or keeping them pooled), and trim the pool: idle segments
    older than ``MMSHM_POOL_IDLE_S``, or beyond ``MMSHM_POOL_MAX_BYTES``, are
    unlinked. Returns how many segments were closed. Cheap: an ``fstat`` and a
    memory read per segment."""
    n = 0
    cfg = config.get()
    now = time.monotonic()
    idle: list[Segment] = []
    with _LOCK:
        for seg in list(_REGISTRY.values()):
            if not seg.owned or seg.pins:
                continue
            st = seg.status()
            if st == STATE_FREED:
                _forget(seg)
                n += 1
            elif st == STATE_POOLED:
                if seg.idle_since is None:
                    seg.idle_since = now
                if not cfg.pool or now - seg.idle_since >= cfg.pool_idle_s:
                    _unlink_pooled(seg)
                    n += 1
                else:
                    idle.append(seg)
        if idle:
            cap = config.pool_max_bytes(_fs_size(idle[0].directory))
            total = sum(HEADER_SIZE + s.payload_size for s in idle)
            for seg in sorted(idle, key=lambda s: s.idle_since or 0.0):
                if total <= cap:
                    break
                total -= HEADER_SIZE + seg.payload_size
                _unlink_pooled(seg)
                n += 1
    return n


_FS_SIZE: dict[str, int] = {}


def _fs_size(directory: str) -> int:
    size = _FS_SIZE.get(directory)
    if size is None:
        try:
            st = os.statvfs(directory)
            size = _FS_SIZE[directory] = st.f_blocks * st.f_frsize
        except OSError:
            return 0
    return size


def _sweep_loop() -> None:
    global _sweeper
    from .reaper import maybe_reap
    while True:
        time.sleep(config.get().sweep_interval_s)
        for d in list(_reaped_dirs):
            try:
                maybe_reap(d)
            except Exception as exc:  # noqa: BLE001 - never kill the sweeper
                log.warning("mmshm: periodic reap of %s failed: %s", d, exc)
        with _LOCK:
            sweep()
            if not any(s.owned for s in _REGISTRY.values()):
                _sweeper = None
                return


def _ensure_sweeper() -> None:
    global _sweeper
    if _sweeper is None:
        _sweeper = threading.Thread(target=_sweep_loop, name="mmshm-sweep", daemon=True)
        _sweeper.start()


def open_segments() -> list[str]:
    """Names of the segments this process currently has open."""
    with _LOCK:
        return list(_REGISTRY)


def iter_segment_files(directory: str | None = None) -> Iterator[str]:
    """Names of mmshm segment files in the directory (any creator)."""
    d = segment_dir(directory)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return iter(())
    return (n for n in names if NAME_RE.match(n))


def _disown_for_exit(seg: Segment) -> None:
    """The owner is leaving: a segment still in use elsewhere must be unlinked
    by its last release instead of going back to a pool nobody will empty."""
    try:
        _lock(seg.fd, fcntl.F_WRLCK, _MUTEX_BYTE)
        try:
            hdr = _read_header(seg.fd, seg.path)
            os.pwrite(seg.fd, _U32.pack(hdr[8] & ~FLAG_POOLABLE), _OFF_FLAGS)
        finally:
            _lock(seg.fd, fcntl.F_UNLCK, _MUTEX_BYTE)
    except OSError:
        pass


#: called first thing at exit (mmshm.refdebug's report)
_exit_reporters: list = []


def _close_all() -> None:
    # Segments pinned by live views are left to the views' finalizers, which
    # weakref runs at exit too and which give their references back.
    for report in list(_exit_reporters):
        try:
            report()
        except Exception as exc:  # noqa: BLE001 - never stop the exit path
            log.debug("mmshm: exit report failed: %s", exc)
    with _LOCK:
        for seg in list(_REGISTRY.values()):
            if seg.owned:
                st = seg.status()
                if st == STATE_POOLED:
                    _unlink_pooled(seg)
                    continue
                if st == STATE_LIVE:
                    _disown_for_exit(seg)
            if seg.pins == 0:
                _forget(seg)


def _after_fork_in_child() -> None:
    global _LOCK, _sweeper, _owned_bytes
    _LOCK = threading.RLock()
    _sweeper = None
    _owned_bytes = 0
    for seg in list(_REGISTRY.values()):
        seg.close()
    _REGISTRY.clear()


_exit_hook_pid = 0
_exit_hook_utils: set[str] = set()
#: modules whose ``Finalize`` runs at a child's exit: the standard library's,
#: and that of the third-party ``multiprocess`` package (dill-based), whose
#: children run only its own finalizers before ``os._exit``
_MP_UTILS = ("multiprocessing.util", "multiprocess.util")


def _ensure_exit_hook() -> None:
    """multiprocessing children (SGLang's scheduler, tokenizer, detokenizer)
    leave through ``os._exit``, which skips ``atexit``: their exit runs
    multiprocessing's finalizers instead. A child clears that registry when it
    starts, so the hook is registered on the process's first segment (created
    or attached), with ``multiprocessing.util`` and, when the ``multiprocess``
    package is imported (it is never imported here), ``multiprocess.util``."""
    global _exit_hook_pid
    pid = os.getpid()
    if _exit_hook_pid != pid:
        _exit_hook_pid = pid
        _exit_hook_utils.clear()
    if len(_exit_hook_utils) < len(_MP_UTILS):
        for name in _MP_UTILS:
            util = sys.modules.get(name)
            if util is not None and name not in _exit_hook_utils:
                util.Finalize(None, _close_all, exitpriority=0)
                _exit_hook_utils.add(name)


atexit.register(_close_all)
os.register_at_fork(after_in_child=_after_fork_in_child)
