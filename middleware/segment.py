"""Shared-memory segments: create, attach, reference-count, release, unlink.

A segment is one file in the segment directory (``MMSHM_DIR``, default
``/dev/shm``), named ``mmshm-<creator pid>-<64 random bits as 16 hex>``. It is
opened by path with ``os.open`` and mapped with ``mmap``; the
``multiprocessing`` resource tracker never sees it.

File layout (little-endian)::

    [0, 4096)           header: magic, version, state, payload size (bytes),
                        reference count, creator pid, creation time (ns)
    [4096, 4096+size)   payload, page aligned

Cross-process locking uses Linux open-file-description (OFD) byte-range locks
on the segment file, one byte each:

* byte 0, the **mutex**: an exclusive lock held only while the reference count
  is read, changed and written back (and, at zero, while the file is
  unlinked). Every ``share``/``release`` is therefore serialised per segment
  whatever process or thread performs it.
* byte 1, **liveness**: a shared lock held by every process that has the
  segment open (its creator until the count reaches zero, every process with
  a materialized view). The lock belongs to the open file description, which
  ``mmap`` duplicates, so it lives exactly as long as a mapping does and the
  kernel drops it when the process dies. The reaper treats a segment as an
  orphan only if it can take an exclusive lock on this byte: liveness comes
  from locks, never from pids, so pid reuse cannot fool it.
* byte 2, **owner**: an exclusive lock held by the creating process.

Space is reserved with ``posix_fallocate`` before any byte is written, so a
full tmpfs gives :class:`~mmshm.errors.ShmSpaceError` (ENOSPC) instead of a
SIGBUS in the middle of a copy.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import mmap
import os
import re
import resource
import secrets
import stat
import struct
import threading
import time
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
    SEGMENTS_CREATED,
    SEGMENTS_IN_USE,
    SHM_WRITTEN_BYTES,
)

log = logging.getLogger("mmshm")

HEADER_SIZE = 4096
MAGIC = b"MMSHMSG\x01"
VERSION = 1
STATE_LIVE = 1
STATE_FREED = 2
# magic, version, state, payload size, refcount, creator pid, created ns, reserved
_HDR = struct.Struct("<8sIIQqQQQ")
_OFF_STATE = 12
_OFF_REFCOUNT = 24
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

    __slots__ = ("fd", "name", "owned", "path", "payload_size", "pins", "shared_map")

    def __init__(self, name: str, path: str, fd: int, payload_size: int, owned: bool):
        self.name = name
        self.path = path
        self.fd = fd
        self.payload_size = payload_size
        self.owned = owned
        self.pins = 0
        self.shared_map: mmap.mmap | None = None

    # -- reference count -------------------------------------------------
    def update_refcount(self, delta: int) -> int:
        """Add ``delta`` to the reference count under the segment mutex and
        return the new count. At zero the segment is marked freed and
        unlinked while the mutex is still held, so no later ``share`` can
        resurrect it. Raises :class:`SegmentNotFoundError` if the segment
        was already freed."""
        # OFD locks do not exclude threads sharing this descriptor: the
        # process lock serialises them; the file lock serialises processes.
        with _LOCK:
            if self.fd < 0:
                raise SegmentNotFoundError(
                    errno.EBADF, "segment was closed in this process", self.path)
            return _update_refcount(self.fd, self.path, delta)

    def refcount(self) -> int:
        """Current reference count (a racy read without the mutex)."""
        return _read_header(self.fd, self.path)[4]

    def close(self) -> None:
        if self.shared_map is not None:
            try:
                self.shared_map.close()
            except BufferError:  # a view is still exported; the GC unmaps it
                pass
            self.shared_map = None
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1

    def freed(self) -> bool:
        """Whether this process can let go of the segment: its last reference
        is gone, or a third party unlinked or truncated the file (then no one
        can attach or release through it any more, and holding it open would
        only keep its tmpfs pages allocated). One ``fstat``; the state word is
        read from the creator's mapping only once the file is known to be
        large enough (a truncated mapping would SIGBUS)."""
        if self.fd < 0:
            return True
        try:
            st = os.fstat(self.fd)
        except OSError:
            return True
        if st.st_nlink == 0 or st.st_size < HEADER_SIZE:
            return True
        if self.shared_map is not None:
            return _U32.unpack_from(self.shared_map, _OFF_STATE)[0] != STATE_LIVE
        try:
            return _read_header(self.fd, self.path)[2] != STATE_LIVE
        except SegmentError:
            return True

    def payload_view(self) -> memoryview:
        """Writable view of the payload in the creator's shared mapping."""
        assert self.shared_map is not None, "only the creator writes the payload"
        return memoryview(self.shared_map)[HEADER_SIZE : HEADER_SIZE + self.payload_size]

    def check_size(self) -> None:
        """Raise :class:`SegmentCorruptError` if the file is now shorter than
        its header says (truncated by a third party)."""
        size = os.fstat(self.fd).st_size
        if size < HEADER_SIZE + self.payload_size:
            raise SegmentCorruptError(
                errno.EINVAL, f"segment is truncated: {size} bytes on disk, header says "
                f"{HEADER_SIZE + self.payload_size}", self.path)

    def map_private(self) -> mmap.mmap:
        """A fresh copy-on-write mapping of the payload. Reads share the
        segment's pages; a write by the consumer stays private, so it can
        never change the bytes another holder sees (and cannot SIGSEGV).

        The file size is checked first (a mapping past the end of a truncated
        file would SIGBUS on access). Raises :class:`SegmentCorruptError`."""
        try:
            self.check_size()
            return mmap.mmap(
                self.fd,
                self.payload_size,
                flags=mmap.MAP_PRIVATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=HEADER_SIZE,
            )
        except SegmentError:
            raise
        except (OSError, ValueError) as exc:
            raise SegmentCorruptError(errno.EINVAL, f"cannot map segment: {exc}",
                                      self.path) from exc


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


def _update_refcount(fd: int, path: str, delta: int) -> int:
    _lock(fd, fcntl.F_WRLCK, _MUTEX_BYTE)
    try:
        hdr = _read_header(fd, path)
        if hdr[2] != STATE_LIVE:
            raise SegmentNotFoundError(errno.ENOENT, "segment was already freed", path)
        new = hdr[4] + delta
        if new < 0:
            log.error("mmshm: reference count of %s would go negative (%d); "
                      "a handle was pickled without share()", path, new)
            new = 0
        os.pwrite(fd, _I64.pack(new), _OFF_REFCOUNT)
        if new == 0:
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


def create(nbytes: int, directory: str | None = None) -> Segment:
    """Create a segment with room for ``nbytes`` payload bytes.

    The file is made with O_CREAT|O_EXCL|O_NOFOLLOW and mode 0600, sized with
    ``ftruncate`` and reserved with ``posix_fallocate`` before anything is
    written. The caller owns one reference.

    Raises:
        ShmSpaceError: ENOSPC while reserving space (nothing is left behind).
        DescriptorLimitError: EMFILE/ENFILE.
        SegmentError: any other OS failure (the errno is kept).
    """
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    global _owned_bytes
    d = segment_dir(directory)
    total = HEADER_SIZE + nbytes
    if d not in _reaped_dirs:
        _reaped_dirs.add(d)
        from .reaper import maybe_reap
        maybe_reap(d)
    sweep()  # let go of segments freed elsewhere before counting what is in use
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
        mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        _HDR.pack_into(mm, 0, MAGIC, VERSION, STATE_LIVE, nbytes, 1, os.getpid(), time.time_ns(), 0)
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
    seg = Segment(name, path, fd, nbytes, owned=True)
    seg.shared_map = mm
    SEGMENTS_CREATED.inc()
    SHM_WRITTEN_BYTES.inc(nbytes)
    SEGMENTS_IN_USE.inc()
    BYTES_IN_USE.inc(total)
    with _LOCK:
        sweep()
        _REGISTRY[name] = seg
        _owned_bytes += total
        _ensure_sweeper()
    return seg


def attach(name: str, directory: str | None = None) -> Segment:
    """Open an existing segment (or return this process's open one) and
    validate its header and file size before anything is mapped.

    Raises:
        SegmentNotFoundError: the file is gone, unlinked, or already freed.
        SegmentCorruptError: bad magic/version, a truncated file, a symbolic
            link, or a file owned by another user.
        DescriptorLimitError: EMFILE/ENFILE.
    """
    with _LOCK:
        seg = _REGISTRY.get(name)
        if seg is not None:
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
            size = hdr[3]
            if st.st_size < HEADER_SIZE + size:
                raise SegmentCorruptError(
                    errno.EINVAL,
                    f"segment is truncated: {st.st_size} bytes on disk, header says "
                    f"{HEADER_SIZE + size}",
                    path,
                )
        except OSError as exc:
            os.close(fd)
            if isinstance(exc, SegmentError):
                raise
            raise _os_error(exc, "attach", path) from None
        seg = Segment(name, path, fd, size, owned=False)
        _REGISTRY[name] = seg
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
        return  # creator keeps its liveness lock until the last holder lets go
    _forget(seg)


def update_refcount(name: str, delta: int, directory: str | None = None) -> int:
    """Add ``delta`` references to segment ``name`` (opening it briefly if this
    process has no descriptor). Returns the new count.

    Raises:
        SegmentNotFoundError: the segment is gone or already freed.
        SegmentCorruptError, DescriptorLimitError: as for :func:`attach`.
    """
    with _LOCK:
        seg = _REGISTRY.get(name)
        if seg is not None:
            new = seg.update_refcount(delta)
            if new == 0:
                _maybe_close(seg)
            return new
    path = os.path.join(segment_dir(directory), name)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise _os_error(exc, "update", path) from None
    try:
        return _update_refcount(fd, path, delta)
    finally:
        os.close(fd)


def sweep() -> int:
    """Close this process's created segments whose last reference is gone.
    Returns how many were closed. Cheap: a memory read per segment."""
    n = 0
    with _LOCK:
        for seg in list(_REGISTRY.values()):
            if seg.owned and seg.pins == 0 and seg.freed():
                _forget(seg)
                n += 1
    return n


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


def _close_all() -> None:
    # Segments pinned by live views are left to the views' finalizers, which
    # weakref runs at exit too and which give their references back.
    with _LOCK:
        for seg in list(_REGISTRY.values()):
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


atexit.register(_close_all)
os.register_at_fork(after_in_child=_after_fork_in_child)
