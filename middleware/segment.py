"""Shared-memory segments: create, attach, reference-count, release, unlink.

A segment is one file in the segment directory (``MMSHM_DIR``, default
``/dev/shm``), named ``mmshm-<creator pid>-<64 random bits as 16 hex>``. It is
opened by path with ``os.open`` and mapped with libc's ``mmap``; the
``multiprocessing`` resource tracker never sees it. This module is the
segment layer's interface (:func:`create`, :func:`attach`,
:func:`update_refcount`, :func:`pin`/:func:`unpin`, :class:`Segment`) and its
reference counting; what it builds on is in modules of their own, imported in
one direction (each uses only those below it):

- :mod:`mmshm.segfile`: the file format, the OFD locks (mutex, liveness,
  owner), header fields, the descriptor-free mapping;
- :mod:`mmshm.registry`: this process's open segments and the bytes it owns;
- :mod:`mmshm.pool`: the warm pool (size classes, reuse with a new
  generation);
- :mod:`mmshm.reaper`: reclaiming segments no live process holds (it uses
  :mod:`mmshm.segfile` only);
- :mod:`mmshm.sweeper`: letting go of segments freed elsewhere, trimming the
  pool, the periodic reaper.

Their names used elsewhere stay importable from here.

Invariants:

- every reference count change is one read-modify-write under the segment
  mutex, serialised across threads by the registry lock as well (OFD locks do
  not exclude threads sharing a descriptor); at zero the segment goes back to
  its owner's pool or is marked freed and unlinked before the mutex is let go,
  so no later ``share`` can resurrect it;
- a handle carries the generation it was made for; attach and every update
  check it;
- the creator holds one reference from :func:`create`; a process holds one
  descriptor per segment, however many views it has;
- space is reserved with ``posix_fallocate`` before any byte is written, so a
  full tmpfs gives :class:`~mmshm.errors.ShmSpaceError` (ENOSPC) instead of a
  SIGBUS in the middle of a copy.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import fcntl
import logging
import multiprocessing.util  # noqa: F401 - its Finalize runs at a child's exit
import os
import resource
import stat
import sys
import time

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
from .pool import _pool_take, _revive, _unlink_pooled, size_class, trim_pool  # noqa: F401
from .reaper import maybe_reap
from .registry import _LOCK, _REGISTRY, _forget, add_owned, open_segments, owned_bytes  # noqa: F401
from .segfile import (  # noqa: F401 - the file format, importable from here as before
    _FLOCK,
    _HDR,
    _I64,
    _LIVE_BYTE,
    _MUTEX_BYTE,
    _OFF_DETACHED,
    _OFF_FLAGS,
    _OFF_GEN,
    _OFF_HOLDERS,
    _OFF_REFCOUNT,
    _OFF_STATE,
    _OPEN_FLAGS,
    _OWNER_BYTE,
    _U32,
    _U64,
    FLAG_POOLABLE,
    HEADER_SIZE,
    MAGIC,
    NAME_RE,
    PREFIX,
    STATE_FREED,
    STATE_LIVE,
    STATE_POOLED,
    VERSION,
    _add_holder,
    _detach,
    _dir_checked,
    _disown_for_exit,
    _lock,
    _map,
    _os_error,
    _owner_alive,
    _read_header,
    _record_hand_out,
    boottime_ns,
    ensure_dir,
    holders,
    iter_segment_files,
    lock_holders_present,
    new_name,
    segment_dir,
)
from .segfile import mark_cached as _mark_cached
from .sweeper import _ensure_sweeper, _fs_size, _reaped_dirs, sweep  # noqa: F401

log = logging.getLogger("mmshm")


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
        if delta > 0:
            _record_hand_out(fd, delta)
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
    owned = owned_bytes()
    if cap and owned + total > cap:
        raise ShmSpaceError(
            f"budget: this process would hold {owned + total} bytes of shared memory, "
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
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    d = segment_dir(directory)
    cfg = config.get()
    total = size_class(HEADER_SIZE + nbytes) if cfg.pool else HEADER_SIZE + nbytes
    if d not in _reaped_dirs:
        _reaped_dirs.add(d)
        ensure_dir(d)
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
        add_owned(total)
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


def mark_cached(name: str) -> bool:
    """Record that a cache of this process (vLLM's multimodal processor cache
    in the EngineCore) keeps views of segment ``name``, so that ``mmshm
    status`` shows the segment as held by that cache, not as a leak. Takes
    the shared lock on the segment's byte 3 (:func:`mmshm.segfile.mark_cached`),
    which lasts until this process closes the segment. Returns False when
    this process does not have the segment open. Never raises."""
    with _LOCK:
        seg = _REGISTRY.get(name)
        if seg is None or seg.fd < 0:
            return False
        try:
            _mark_cached(seg.fd)
        except OSError as exc:
            log.debug("mmshm: marking %s as cached failed: %s", name, exc)
            return False
        return True


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
# a forked child's registry and sweeper are reset by mmshm.registry and mmshm.sweeper
