"""Shared-memory segments: create, attach, reference-count, release, unlink.

A segment is one file in the segment directory (``MMSHM_DIR``, default
``/dev/shm``), named ``mmshm-<creator pid>-<64 random bits as 16 hex>``. It is
opened by path with ``os.open`` and mapped with libc's ``mmap``; the
``multiprocessing`` resource tracker never sees it. This module is the
segment layer's interface (:func:`create`, :func:`attach`,
:func:`update_refcount`, :func:`pin`/:func:`unpin`, :class:`Segment`) and its
reference counting; what it builds on is in modules of their own, imported in
one direction (each uses only those below it):

- :mod:`mmshm.segments.segfile`: the file format, the OFD locks (mutex, liveness,
  owner), header fields, the descriptor-free mapping;
- :mod:`mmshm.segments.reaper`: reclaiming segments no live process holds (it uses
  :mod:`mmshm.segments.segfile` only);
- :mod:`mmshm.segments.table`: this process's segment table (:data:`~mmshm.segments.table.TABLE`):
  its open segments and the bytes it owns, the warm pool, the sweeper, what
  it knows of each directory.

Callers import a name from the module that defines it.

Invariants:

- every reference count change is one read-modify-write under the segment
  mutex (:func:`mmshm.segments.segfile.update_count`), serialised across threads by
  the table's lock as well (OFD locks do
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
import logging
import multiprocessing.util  # noqa: F401 - its Finalize runs at a child's exit
import os
import resource
import stat
import sys
from typing import NamedTuple

from mmshm import config
from mmshm.errors import (
    DescriptorLimitError,
    MmshmError,
    SegmentCorruptError,
    SegmentError,
    SegmentNotFoundError,
    ShmSpaceError,
)
from mmshm.metrics import (
    ARENA_BYTES,
    ARENA_FALLBACKS,
    BYTES_IN_USE,
    FREE_BYTES,
    POOL_REQUESTS,
    SEGMENTS_CREATED,
    SEGMENTS_IN_USE,
)
from mmshm.segments import segfile
from mmshm.segments.segfile import (
    FLAG_ARENA,
    HEADER_SIZE,
    OPEN_FLAGS,
    STATE_FREED,
    STATE_LIVE,
    STATE_POOLED,
    add_holder,
    disown_for_exit,
    hold_live,
    map_fd,
    mapped_state,
    new_name,
    os_error,
    read_header,
    segment_dir,
    take_owner,
    write_new_header,
)
from mmshm.segments.table import TABLE, cuda_host, size_class

log = logging.getLogger("mmshm")


class Segment:
    """One segment as seen by this process: an open descriptor (holding the
    liveness lock) and, for the creator, a shared writable mapping.

    Instances are process-local and cached by name; use :func:`create` and
    :func:`attach`, never the constructor.
    """

    __slots__ = ("arena", "blank", "cold", "digest", "directory", "fd", "gen", "idle_since", "name",
                 "owned", "path", "payload_size", "pins", "shared_map")

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
        self.shared_map: ctypes.Array | None = None  # the creator's (see segfile.map_fd)
        # content hashes computed in this process (lazy hashing), by
        # (generation, offset, nbytes): the tensors of one segment each have
        # their own; entries of an older generation are dropped on a new one
        self.digest: dict[tuple[int, int, int], bytes] = {}
        # a file this process just created, its payload reserved but never
        # written nor mapped: the first fill writes it with pwrite (see
        # mmshm.segments.shmtensor), which spares the kernel's zeroing of its pages
        self.blank = False
        # its payload written with pwrite and never touched through
        # shared_map: a reuse from the pool would fault every page into this
        # process's mapping, unless the sweeper maps them first
        # (mmshm.segments.table.SegmentTable.warm_pooled)
        self.cold = False
        # an arena segment (FLAG_ARENA): its owner keeps it pooled for good and
        # a consumer maps it once (mmshm.segments.arena)
        self.arena = False

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
        with TABLE.lock:
            if self.fd < 0:
                raise SegmentNotFoundError(
                    errno.EBADF, "segment was closed in this process", self.path)
            return segfile.update_count(self.fd, self.path, delta, gen, owner_here=self.owned)

    def refcount(self) -> int:
        """Current reference count (a racy read without the mutex)."""
        return read_header(self.fd, self.path).refcount

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
            return mapped_state(self.shared_map)
        try:
            return read_header(self.fd, self.path).state
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

    def payload_span(self) -> tuple[int, int] | None:
        """``(address, nbytes)`` of the whole payload (its capacity,
        :attr:`payload_size`) in the creator's shared mapping, the same for
        every generation while this process keeps the segment mapped; None
        without that mapping (an attached segment, or one let go)."""
        buf = self.shared_map
        if buf is None:
            return None
        return ctypes.addressof(buf) + HEADER_SIZE, self.payload_size

    def check_size(self, end: int = 0) -> None:
        """Raise :class:`SegmentCorruptError` if the file is now shorter than
        its header says (truncated by a third party), or than
        ``HEADER_SIZE + end`` (``end``: the last payload byte a view or copy
        reaches, plus one)."""
        size = os.fstat(self.fd).st_size
        need = HEADER_SIZE + max(self.payload_size, end)
        if size < need:
            raise SegmentCorruptError(
                errno.EINVAL, f"segment is truncated: {size} bytes on disk, header says "
                f"{need}", self.path)

    def map_private(self, nbytes: int | None = None, offset: int = 0) -> ctypes.Array:
        """A fresh copy-on-write mapping of ``nbytes`` payload bytes (default:
        all of it) from ``offset`` (bytes from the payload's start, a page
        multiple). Reads share the segment's pages; a write by the consumer
        stays private, so it can never change the bytes another holder sees
        (and cannot SIGSEGV).

        The file size is checked first (a mapping past the end of a truncated
        file would SIGBUS on access), against ``HEADER_SIZE + offset + nbytes``
        as well as the header's payload size. Raises :class:`SegmentCorruptError`."""
        length = self.payload_size - offset if nbytes is None else nbytes
        try:
            self.check_size(offset + length)
            return map_fd(self.fd, length, HEADER_SIZE + offset, shared=False)
        except SegmentError:
            raise
        except (OSError, ValueError) as exc:
            raise SegmentCorruptError(errno.EINVAL, f"cannot map segment: {exc}",
                                      self.path) from exc


def check_budget(directory: str, total: int) -> None:
    """The budget guard: raise :class:`ShmSpaceError` (reason ``budget``) if a
    new segment of ``total`` bytes would leave less than the reserve
    (``MMSHM_MIN_FREE_BYTES``) free in ``directory``, or push this process
    over ``MMSHM_MAX_BYTES``. One ``statvfs`` call. A directory that cannot
    be read (missing, its parent missing: a typo in a store's ``directory``
    setting) raises :class:`SegmentError` with the errno, never a bare
    :class:`OSError`."""
    try:
        st = os.statvfs(directory)
    except OSError as exc:
        raise SegmentError(exc.errno, f"the segment directory cannot be used: {exc.strerror}",
                           directory) from exc
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
    owned = TABLE.owned_bytes
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
    """Get a segment with room for ``nbytes`` payload bytes: the warm idle
    segment of this process's pool that fits best (at least ``nbytes``' size
    class; a plain segment at most four times it, an arena segment of any size:
    :meth:`~mmshm.segments.table.SegmentTable.pool_take`),
    else a new file. ``Segment.payload_size`` is the capacity, which may
    exceed ``nbytes``: the caller writes ``nbytes`` and its handles say
    ``nbytes``, so no consumer sees the bytes past them. A pooled file that a
    third party truncated is dropped (counted), never written.

    A new file is made with O_CREAT|O_EXCL|O_NOFOLLOW and mode 0600, sized with
    ``ftruncate`` and reserved with ``posix_fallocate`` before anything is
    written. The caller owns one reference; ``Segment.gen`` is the generation
    its handles must carry.

    While this process's arena (``MMSHM_ARENA_BYTES``, see
    :mod:`mmshm.segments.arena`) has room, a new file is an arena segment
    (``FLAG_ARENA``): its last release returns it to the pool for good. When
    it has none and no idle arena segment fits, idle arena segments of other
    sizes are unlinked to make room;
    a tensor that still does not fit gets a plain segment, counted in
    ``mmshm_arena_fallbacks_total{reason}`` (``full``, ``too_big``).

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
    TABLE.first_use(d)
    _ensure_exit_hook()
    arena = False
    with TABLE.lock:
        if cfg.pool:
            # a hit needs no sweep: the segment's state is read from its header,
            # and the background sweeper trims the pool. An idle arena segment
            # first; then a new arena segment while the arena has room, rather
            # than a plain one pooled while it was full (which then idles out)
            seg = TABLE.pool_take(d, total, arena=True)
            if seg is None:
                arena = _arena_room(d, total)
                if not arena:
                    seg = TABLE.pool_take(d, total, arena=False)
            if seg is not None:
                POOL_REQUESTS.labels(result="hit").inc()
                return seg
            POOL_REQUESTS.labels(result="miss").inc()
        elif "pool_off" not in _arena_said and config.arena_bytes(TABLE.fs_size(d), cuda_host()):
            _arena_said.add("pool_off")
            log.warning("mmshm: the arena (MMSHM_ARENA_BYTES) is off in this process because "
                        "MMSHM_POOL=0: arena segments live in the warm pool; fix: unset "
                        "MMSHM_POOL (or set MMSHM_ARENA_BYTES=0 to say the arena is off)")
        TABLE.sweep()  # let go of segments freed elsewhere before counting what is in use
    try:
        check_budget(d, total)
    except ShmSpaceError:
        if not TABLE.trim_pool(d):
            raise
        check_budget(d, total)
    for _ in range(8):
        name = new_name()
        path = os.path.join(d, name)
        try:
            fd = os.open(path, OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        except OSError as exc:
            raise os_error(exc, "create", path) from None
        try:
            _check_fd(fd, path)
        except DescriptorLimitError:
            os.unlink(path)
            raise
        try:
            hold_live(fd, wait=False)
            take_owner(fd)
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
        mm = map_fd(fd, total, 0, shared=True)
        write_new_header(mm, total - HEADER_SIZE, poolable=cfg.pool, arena=arena)
    except OSError as exc:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)
        raise os_error(exc, "create", path) from None
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)
        raise
    seg = Segment(name, path, fd, total - HEADER_SIZE, owned=True)
    seg.shared_map = mm
    seg.blank = True
    seg.arena = arena
    SEGMENTS_CREATED.inc()
    SEGMENTS_IN_USE.inc()
    BYTES_IN_USE.inc(total)
    with TABLE.lock:
        TABLE.sweep()
        TABLE.register(seg)
    return seg


_arena_said: set[str] = set()


def _arena_fallback(reason: str, message: str) -> bool:
    """Count an arena fallback (``mmshm_arena_fallbacks_total{reason}``) and say
    its first one of each reason at WARNING. Returns False (no arena room)."""
    ARENA_FALLBACKS.labels(reason=reason).inc()
    if reason not in _arena_said:
        _arena_said.add(reason)
        log.warning("mmshm: %s (said once; mmshm_arena_fallbacks_total{reason=\"%s\"} counts "
                    "each)", message, reason)
    return False


def _arena_room(directory: str, total: int) -> bool:
    """Whether a new segment of ``total`` bytes joins this process's arena in
    ``directory`` (call under the table's lock): the arena is on and has room,
    after unlinking idle arena segments of other sizes if need be. Counts the
    fallback otherwise."""
    cap = config.arena_bytes(TABLE.fs_size(directory), cuda_host())
    ARENA_BYTES.set(cap)
    if not cap:
        return False
    if "on" not in _arena_said:
        _arena_said.add("on")
        log.info("mmshm: the arena is on in this process (pid %d): up to %d MiB of segments "
                 "in %s kept warm for good, each mapped once (and registered with CUDA once) "
                 "by its consumers (MMSHM_ARENA_BYTES; docs/gpu.md)", os.getpid(), cap >> 20,
                 directory)
    if total > cap:
        return _arena_fallback(
            "too_big", f"a tensor needing a {total}-byte segment (its size class, header "
            f"included) is larger than the whole arena "
            f"(MMSHM_ARENA_BYTES={cap} in {directory}): it goes to a plain segment, mapped and "
            f"copied to the GPU at pageable speed; fix: raise MMSHM_ARENA_BYTES above the "
            f"largest request's tensors")
    over = TABLE.arena_bytes + total - cap
    if over > 0 and TABLE.evict_arena(directory, over) < over:
        return _arena_fallback(
            "full", f"the arena (MMSHM_ARENA_BYTES={cap} in {directory}) is full of tensors "
            f"still in use: this one goes to a plain segment; fix: raise MMSHM_ARENA_BYTES to "
            f"cover the tensors of the requests in flight")
    return True


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
    with TABLE.lock:
        seg = TABLE.get(name)
        if seg is not None:
            if gen is not None and gen != (seg.gen if seg.owned else read_header(
                    seg.fd, seg.path).gen):
                raise SegmentNotFoundError(errno.ENOENT, "segment was reused", seg.path)
            # its last reference is gone (a third party's unlink alone does not
            # stop holders that have it open); pread: a truncated file cannot SIGBUS
            if read_header(seg.fd, seg.path).state != STATE_LIVE:
                raise SegmentNotFoundError(errno.ENOENT, "segment was already freed", seg.path)
            return seg
        path = os.path.join(segment_dir(directory), name)
        try:
            fd = os.open(path, OPEN_FLAGS)
        except OSError as exc:
            raise os_error(exc, "attach", path) from None
        _check_fd(fd, path)
        try:
            # Blocks only while a reaper holds the exclusive liveness lock.
            hold_live(fd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink == 0:
                raise SegmentNotFoundError(errno.ENOENT, "segment was unlinked", path)
            if st.st_uid != os.geteuid():
                raise SegmentCorruptError(errno.EPERM, "segment belongs to another user", path)
            hdr = read_header(fd, path)
            if hdr.state != STATE_LIVE or hdr.refcount <= 0:
                raise SegmentNotFoundError(errno.ENOENT, "segment was already freed", path)
            if gen is not None and hdr.gen != gen:
                raise SegmentNotFoundError(errno.ENOENT, "segment was reused", path)
            size = hdr.size
            if st.st_size < HEADER_SIZE + size:
                raise SegmentCorruptError(
                    errno.EINVAL,
                    f"segment is truncated: {st.st_size} bytes on disk, header says "
                    f"{HEADER_SIZE + size}",
                    path,
                )
            add_holder(fd)
        except OSError as exc:
            os.close(fd)
            if isinstance(exc, SegmentError):
                raise
            raise os_error(exc, "attach", path) from None
        seg = Segment(name, path, fd, size, owned=False, gen=hdr.gen)
        seg.arena = bool(hdr.flags & FLAG_ARENA)
        TABLE.register(seg)
        _ensure_exit_hook()
        return seg


def pin(seg: Segment) -> None:
    """Record that a view in this process depends on ``seg``'s descriptor."""
    with TABLE.lock:
        seg.pins += 1


def unpin(seg: Segment) -> None:
    """Drop a pin; closes the descriptor once nothing in this process needs it."""
    with TABLE.lock:
        seg.pins -= 1
        _maybe_close(seg)


def _maybe_close(seg: Segment) -> None:
    if seg.pins > 0:
        return
    if seg.owned and not seg.freed():
        return  # creator keeps it: in use elsewhere (liveness lock) or pooled
    TABLE.forget(seg)


def mark_cached(name: str) -> bool:
    """Record that a cache of this process (vLLM's multimodal processor cache
    in the EngineCore) keeps views of segment ``name``, so that ``mmshm
    status`` shows the segment as held by that cache, not as a leak. Takes
    the shared lock on the segment's byte 3 (:func:`mmshm.segments.segfile.mark_cached`),
    which lasts until this process closes the segment. Returns False when
    this process does not have the segment open. Never raises."""
    with TABLE.lock:
        seg = TABLE.get(name)
        if seg is None or seg.fd < 0:
            return False
        try:
            segfile.mark_cached(seg.fd)
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
    with TABLE.lock:
        seg = TABLE.get(name)
        if seg is not None:
            new = seg.update_refcount(delta, gen)
            if new == 0:
                _maybe_close(seg)
            return new
    path = os.path.join(segment_dir(directory), name)
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as exc:
        raise os_error(exc, "update", path) from None
    try:
        return segfile.update_count(fd, path, delta, gen)
    finally:
        os.close(fd)


class SegmentRef(NamedTuple):
    """A segment as a handle names it: the unit references are counted in.
    Hashable, so it keys "references added per segment".

    Attributes:
        name: the segment's file name.
        directory: its segment directory (None: ``MMSHM_DIR`` at the time of
            each use).
        gen: the generation the references were made for; an update of a
            segment reused since then is refused.
    """

    name: str
    directory: str | None
    gen: int

    def add(self, k: int) -> int:
        """Add ``k`` references (a negative ``k`` gives ``-k`` back) in one
        locked update; returns the new count.

        Raises:
            SegmentNotFoundError: the segment is gone, already freed, or
                reused since ``gen``.
            SegmentCorruptError, DescriptorLimitError: as for :func:`attach`.
        """
        return update_refcount(self.name, k, self.directory, self.gen)

    def release(self, k: int = 1) -> bool:
        """Give back ``k`` references this process holds on the segment
        (handed out for a message that never left, or held by a scope that
        ends). Never raises: returns False if the segment could not be
        updated (gone already: nothing to give back to), logged at DEBUG."""
        if not k:
            return True
        try:
            self.add(-k)
        except (MmshmError, OSError) as exc:
            log.debug("mmshm: giving back %d reference(s) of %s failed: %s", k, self.name, exc)
            return False
        return True


#: called first thing at exit (mmshm.segments.refdebug's report)
exit_reporters: list = []


def _close_all() -> None:
    # Segments pinned by live views are left to the views' finalizers, which
    # weakref runs at exit too and which give their references back.
    for report in list(exit_reporters):
        try:
            report()
        except Exception as exc:  # noqa: BLE001 - never stop the exit path
            log.debug("mmshm: exit report failed: %s", exc)
    with TABLE.lock:
        for seg in list(TABLE.segments.values()):
            if seg.owned:
                st = seg.status()
                if st == STATE_POOLED:
                    TABLE.unlink_pooled(seg)
                    continue
                if st == STATE_LIVE:
                    disown_for_exit(seg.fd, seg.path)
            if seg.pins == 0:
                TABLE.forget(seg)


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
# a forked child's table is reset by mmshm.segments.table
