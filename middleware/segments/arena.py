"""The arena: shared memory each consumer maps once and registers with CUDA once.

**Why.** A GPU copies from page-locked ("pinned") host memory at full PCIe speed
(about 53 GB/s on an H200 host) and from ordinary pageable memory at a few GB/s
(3-4 GB/s from a fresh copy-on-write view of a segment). Registering memory
with CUDA (``cudaHostRegister``) makes it page-locked, but costs about 21 ms per
180 MB: done per request, it loses more than it wins. So the memory a TP rank
copies pixels from must be the *same* mapping, request after request,
registered once.

**Design: the warm pool made persistent and registered** (rather than a fixed
slab with a slot allocator, as SGLang's ``MmItemMemoryPool`` and vLLM's
``ECCPUConnector`` are): the arena is not a new kind of memory but a property of
segments.

- A producing process (the tokenizer, an EPD encoder) marks the first
  ``MMSHM_ARENA_BYTES`` of the segments it creates as arena segments
  (``FLAG_ARENA``, :func:`mmshm.segments.segment.create`). At their last release
  they go back to the producer's warm pool as every poolable segment does, but
  are never idle-unlinked (:meth:`mmshm.segments.table.SegmentTable.sweep`): the
  producer writes the next request into the same warm pages. An arena full of
  segments of another size gives its idle ones back to make room.
- A consuming process (a TP rank, the EPD consumer) maps an arena segment's
  payload **once** (:class:`ArenaViews`), keeps the mapping across requests
  and generations, and, when CUDA is initialized in that process, registers it
  with CUDA **once** (``cudaHostRegisterReadOnly``), through a registrar
  (:func:`set_registrar`; the seam lets CPU tests record the calls).
- Every ownership rule of segments holds unchanged, because arena segments
  *are* segments: references per holder and rank, the budget and reserve,
  reclaim after a SIGKILL through the liveness locks, generations (a handle of
  another generation is :class:`~mmshm.errors.SegmentNotFoundError`, "segment
  was reused"), typed errors and the counters. A tensor that does not fit in
  the arena gets a plain segment, then goes inline, each fallback counted.

Why not a slab: a slab needs its own allocator, its own per-slot reference
counts, liveness locks and reaper, all of which segments already have and which
the fault corpus tests; and a slab fixes the arena's size at start-up, where a
pool of segments takes room from the segment directory only as requests need
it, under the same budget guard.

**The views a consumer gets.**

- *Registered* (CUDA initialized in the process, registration accepted): a
  read-only ``MAP_SHARED`` view of the segment's pages. The copy to the GPU
  runs at pinned speed. A write in place into the tensor is a SIGSEGV (the
  kernel refuses writes through a read-only mapping): it can never change the
  bytes another rank reads, but it kills the process that tries. SGLang's and
  vLLM's model paths never write pixel values in place (they move them to the
  GPU first). Before the producer may reuse the pages, a released registered
  view waits for the GPU (a device synchronize, on a background thread) so
  that an asynchronous copy (``non_blocking=True``, which from page-locked
  memory really is asynchronous) has read them.
- *Unregistered* (no CUDA, or the driver refused): a copy-on-write
  ``MAP_PRIVATE`` view, as segments give today, safe against writes in place:
  a page the server writes becomes its own. When the view is released, the
  pages it wrote (read from ``/proc/self/pagemap``) are dropped
  (``MADV_DONTNEED``) so that the next request reads the producer's new bytes.
  The mapping and its page tables stay, so a warm request takes no page
  faults.

A consumer's persistent mapping is made from a descriptor of its own that
holds no lock: it does not keep the segment alive for the reaper. A mapping of
a segment that was unlinked (its producer died and the reaper reclaimed it, or
the arena gave it back) is unregistered and unmapped by :meth:`ArenaViews.sweep`,
which runs on each view and every few seconds on a daemon thread.

May import: :mod:`mmshm.errors`, :mod:`mmshm.config`, :mod:`mmshm.metrics` and
the segment modules below it (:mod:`~mmshm.segments.segfile`,
:mod:`~mmshm.segments.table`, :mod:`~mmshm.segments.segment`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
import weakref
from typing import Protocol

import numpy as np

from mmshm import config
from mmshm.errors import RegistrationError, SegmentCorruptError, SegmentNotFoundError
from mmshm.metrics import (
    ARENA_REGISTERED_BYTES,
    ARENA_REGISTRATIONS,
    ARENA_VIEWS,
    GPU_COPY_BYTES,
    GPU_COPY_SECONDS,
)
from mmshm.segments import segment
from mmshm.segments.segfile import HEADER_SIZE, map_fd
from mmshm.segments.table import TABLE, cuda_host

log = logging.getLogger("mmshm")

#: cudaHostRegisterPortable | cudaHostRegisterReadOnly (CUDA 11.1+)
_FLAGS_READ_ONLY = 0x01 | 0x08
#: cudaHostRegisterPortable
_FLAGS_WRITABLE = 0x01

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PM_PRESENT = 1 << 63
_PM_FILE = 1 << 61


# -- the registrar seam --------------------------------------------------------
class Registrar(Protocol):
    """What registers host memory with a GPU runtime (CUDA), once per mapping.

    ``register(addr, nbytes, read_only)`` raises :class:`RegistrationError`;
    ``unregister(addr)`` never raises; ``settle()`` blocks until the device has
    finished every copy queued so far (called on a background thread before
    a registered view's pages may be reused)."""

    name: str

    def register(self, addr: int, nbytes: int, read_only: bool) -> None: ...

    def unregister(self, addr: int) -> None: ...

    def settle(self) -> None: ...


def _cudart_last_error_reset() -> None:
    """Clear CUDA's last-error word after a refused registration, so that
    the server's next kernel launch check does not report it as its own.
    libcudart as the process loaded it (torch's), found in /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except Exception as exc:  # noqa: BLE001 - best effort
        log.debug("mmshm: clearing CUDA's last error failed: %s", exc)


class CudaRegistrar:
    """Registers mappings with CUDA through torch's binding of the runtime
    (``torch.cuda.cudart().cudaHostRegister``, as ``torch.cuda._pin_memory_utils``
    does), with ``cudaHostRegisterPortable`` and, for a consumer's read-only
    view, ``cudaHostRegisterReadOnly``."""

    name = "cuda"

    def __init__(self):
        import torch

        self._torch = torch
        self._cudart = torch.cuda.cudart()
        self._device = torch.cuda.current_device()

    def register(self, addr: int, nbytes: int, read_only: bool) -> None:
        code = int(self._cudart.cudaHostRegister(
            addr, nbytes, _FLAGS_READ_ONLY if read_only else _FLAGS_WRITABLE))
        if code != 0:
            _cudart_last_error_reset()
            try:
                text = self._cudart.cudaGetErrorString(code)
            except Exception:  # noqa: BLE001
                text = "unknown"
            raise RegistrationError(f"cudaHostRegister of {nbytes} bytes failed: CUDA error "
                                    f"{code} ({text})", code)

    def unregister(self, addr: int) -> None:
        if int(self._cudart.cudaHostUnregister(addr)) != 0:
            _cudart_last_error_reset()

    def settle(self) -> None:
        self._torch.cuda.synchronize(self._device)


class FakeRegistrar:
    """A registrar for CPU tests: records ``("register", addr, nbytes,
    read_only)``, ``("unregister", addr)`` and ``("settle",)`` in
    :attr:`calls`. With ``fail`` (``"memlock"``, ``"driver"``) every
    registration is refused as CUDA refuses it. ``hold`` (a
    :class:`threading.Event`) makes :meth:`settle` wait until it is set, as a
    copy still running on the GPU would."""

    name = "fake"

    def __init__(self, fail: str | None = None, hold: threading.Event | None = None):
        self.fail = fail
        self.hold = hold
        self.calls: list[tuple] = []
        self._lock = threading.Lock()

    def register(self, addr: int, nbytes: int, read_only: bool) -> None:
        with self._lock:
            self.calls.append(("register", addr, nbytes, read_only))
        if self.fail == "memlock":
            raise RegistrationError("cudaHostRegister failed: CUDA error 2 (out of memory)", 2)
        if self.fail:
            raise RegistrationError(f"cudaHostRegister failed: {self.fail}", 1)

    def unregister(self, addr: int) -> None:
        with self._lock:
            self.calls.append(("unregister", addr))

    def settle(self) -> None:
        if self.hold is not None:
            self.hold.wait(30)
        with self._lock:
            self.calls.append(("settle",))

    def registrations(self) -> int:
        """How many registrations were asked for."""
        return sum(1 for c in self.calls if c[0] == "register")


_registrar: Registrar | None = None
_registrar_set = False
_registrar_pid = 0


def set_registrar(registrar: Registrar | None) -> None:
    """Install ``registrar`` for this process (tests: a :class:`FakeRegistrar`);
    ``None`` goes back to the automatic choice (:func:`registrar`)."""
    global _registrar, _registrar_set, _registrar_pid
    _registrar = registrar
    _registrar_set = registrar is not None
    _registrar_pid = os.getpid()


def registrar() -> Registrar | None:
    """The registrar of this process: the one installed, else a
    :class:`CudaRegistrar` once CUDA is initialized here (a TP rank's is by its
    first request; checking never initializes it), else None (the arena is
    then served unregistered)."""
    global _registrar, _registrar_pid
    if _registrar_set and _registrar_pid == os.getpid():
        return _registrar
    if _registrar_pid != os.getpid():
        _registrar, _registrar_pid = None, os.getpid()
    if _registrar is None and cuda_host():
        import torch

        if torch.cuda.is_initialized():
            try:
                _registrar = CudaRegistrar()
            except Exception as exc:  # noqa: BLE001 - no usable runtime binding
                _warn_once("no-cudart", "mmshm: the arena cannot register memory with CUDA in "
                           "this process (%s): it is served unregistered, copies to the GPU "
                           "run at pageable speed; fix: a torch build with CUDA", exc)
                _registrar = None
    return _registrar


_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


# -- the consumer's persistent mappings ----------------------------------------
class _Mapping:
    """One arena segment's payload as this process keeps it mapped."""

    __slots__ = ("addr", "buf", "directory", "ino", "name", "pfd", "registered", "size", "used",
                 "views")

    def __init__(self, name: str, directory: str, ino: tuple[int, int], pfd: int,
                 buf: ctypes.Array, size: int, registered: bool):
        self.name = name
        self.directory = directory
        self.ino = ino
        #: an O_PATH descriptor of the file (it can hold no lock): fstat tells
        #: when the file was unlinked, whatever names it was linked under
        self.pfd = pfd
        self.buf = buf
        self.addr = ctypes.addressof(buf)
        self.size = size
        self.registered = registered
        self.views = 0
        self.used = time.monotonic()


class ArenaViews:
    """This process's persistent mappings of arena segments (one instance,
    :data:`VIEWS`): one per segment file (keyed by device and inode: the
    encoder cache links a reused segment under a new name for each output),
    made at its first view, registered
    with CUDA at most once, kept across requests and generations until the
    file is unlinked or the mappings exceed twice the arena's size (the
    longest unused go first)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.mappings: dict[tuple[int, int], _Mapping] = {}  # (st_dev, st_ino) -> mapping
        self._pid = os.getpid()
        self._sweeper: threading.Thread | None = None
        self._last_sweep = 0.0
        self._pending: list = []
        self._pending_cv = threading.Condition(threading.Lock())
        self._settler: threading.Thread | None = None

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's mappings are not ours
            for m in self.mappings.values():
                try:
                    os.close(m.pfd)
                except OSError:
                    pass
            self.__init__()

    # -- views ------------------------------------------------------------------
    def view(self, seg: segment.Segment, gen: int, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` over arena segment ``seg`` (attached by the
        caller, holding one reference for generation ``gen``), from this
        process's persistent mapping of it; the array's finalizer gives the
        reference back. Raises :class:`SegmentCorruptError` (the file cannot be
        mapped, or is shorter than its header says)."""
        self._check_pid()
        seg.check_size()
        st = os.fstat(seg.fd)
        with self.lock:
            key = (st.st_dev, st.st_ino)
            m = self.mappings.get(key)
            if m is None:
                m = self._map(seg, key)
            m.views += 1
            m.used = time.monotonic()
        ARENA_VIEWS.labels(registered="yes" if m.registered else "no").inc()
        arr = np.frombuffer(m.buf, dtype=np.uint8, count=nbytes)
        segment.pin(seg)  # the view holds the descriptor (its liveness lock) until released
        weakref.finalize(arr, self._release, m, seg, gen, nbytes)
        self.maybe_sweep()
        return arr

    def _map(self, seg: segment.Segment, ino: tuple[int, int]) -> _Mapping:
        """Map ``seg``'s payload for good, registered if this process can."""
        reg = registrar()
        # a descriptor of our own, holding no lock: the mapping must not keep
        # the segment alive for the reaper (segment.attach's descriptor holds
        # the liveness lock, and a mapping would keep its description)
        try:
            fd = os.open(seg.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise SegmentNotFoundError(errno.ENOENT, f"cannot open arena segment: {exc}",
                                       seg.path) from exc
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != ino:
                raise SegmentNotFoundError(errno.ENOENT, "segment was replaced", seg.path)
            size = seg.payload_size
            buf = None
            registered = False
            if reg is not None:
                buf = map_fd(fd, size, HEADER_SIZE, shared=True, writable=False)
                try:
                    reg.register(ctypes.addressof(buf), size, True)
                    registered = True
                    ARENA_REGISTRATIONS.labels(result="ok").inc()
                    ARENA_REGISTERED_BYTES.inc(size)
                except Exception as exc:  # noqa: BLE001 - RegistrationError, or the runtime's own
                    ARENA_REGISTRATIONS.labels(result="failed").inc()
                    _warn_once(
                        "register", "mmshm: CUDA refused to register the arena's memory "
                        "(%s): the arena is served unregistered in this process (pid %d), "
                        "copies to the GPU run at pageable speed; fix: raise the locked-memory "
                        "limit (docker run --ulimit memlock=-1, systemd LimitMEMLOCK=infinity, "
                        "ulimit -l unlimited) or lower MMSHM_ARENA_BYTES (said once; "
                        "mmshm_arena_registrations_total{result=\"failed\"} counts each)",
                        str(exc), os.getpid())
                    buf = None
            if buf is None:
                buf = map_fd(fd, size, HEADER_SIZE, shared=False)
            pfd = os.open(f"/proc/self/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
        except OSError as exc:
            if isinstance(exc, (SegmentNotFoundError, SegmentCorruptError)):
                raise
            raise SegmentCorruptError(errno.EINVAL, f"cannot map arena segment: {exc}",
                                      seg.path) from exc
        finally:
            os.close(fd)
        m = _Mapping(seg.name, seg.directory, ino, pfd, buf, size, registered)
        self.mappings[ino] = m
        if "mapped" not in _warned:
            _warned.add("mapped")
            log.info("mmshm: arena segments are mapped once in this process (pid %d) and kept; "
                     "%s", os.getpid(),
                     "registered with CUDA (page-locked: copies to the GPU at pinned speed)"
                     if registered else "not registered with CUDA (%s): copy-on-write views of "
                     "warm pages" % ("refused: see the WARNING" if reg is not None else
                                     "CUDA is not initialized in this process"))
        self._ensure_sweeper()
        self._trim()
        return m

    def _release(self, m: _Mapping, seg: segment.Segment, gen: int, nbytes: int) -> None:
        """Finalizer of a view: a registered one waits for the GPU first (on the
        settling thread); the last unregistered view of a mapping in this
        process drops the pages written through the mapping (views of one
        segment in one process share it, as views of one tensor do); then the
        reference goes back."""
        if m.registered:
            with self._pending_cv:
                self._pending.append((m, seg, gen))
                self._pending_cv.notify()
                self._ensure_settler()
            return
        with self.lock:
            if m.views == 1:
                try:
                    _drop_written(m.addr, m.size)
                except Exception as exc:  # noqa: BLE001 - a finalizer must not raise
                    log.warning("mmshm: dropping the written pages of %s failed (%s): the "
                                "whole mapping is dropped instead", m.name, exc)
                    _madvise(m.addr, m.size, _MADV_DONTNEED)
        self._give_back(m, seg, gen)

    def _give_back(self, m: _Mapping, seg: segment.Segment, gen: int) -> None:
        try:
            seg.update_refcount(-1, gen)
        except SegmentNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001 - a finalizer must not raise
            log.warning("mmshm: releasing %s failed: %s", m.name, exc)
        finally:
            segment.unpin(seg)
            with self.lock:
                m.views -= 1

    # -- the settling thread (registered views) ---------------------------------
    @staticmethod
    def _running(thread: threading.Thread | None, target, name: str) -> threading.Thread:
        """``thread`` if it is alive, else a new daemon thread running ``target``."""
        if thread is None or not thread.is_alive():
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
        return thread

    def _ensure_settler(self) -> None:
        self._settler = self._running(self._settler, self._settle_loop, "mmshm-arena-settle")

    def _settle_loop(self) -> None:
        while True:
            with self._pending_cv:
                while not self._pending:
                    self._pending_cv.wait()
                batch, self._pending = self._pending, []
            reg = registrar()
            try:
                if reg is not None:
                    reg.settle()
            except Exception as exc:  # noqa: BLE001 - a device error: still give back
                log.warning("mmshm: waiting for the GPU before reusing arena pages failed: %s",
                            exc)
            for m, seg, gen in batch:
                self._give_back(m, seg, gen)

    def settled(self, timeout: float = 10.0) -> bool:
        """Wait until every released registered view has been given back
        (tests, and a clean exit). Returns False on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._pending_cv:
                busy = bool(self._pending)
            if not busy and all(m.views == 0 or not m.registered
                                for m in list(self.mappings.values())):
                return True
            time.sleep(0.005)
        return False

    # -- sweeping ---------------------------------------------------------------
    def _drop(self, m: _Mapping) -> None:
        """Forget ``m`` (call under :attr:`lock`): unregister it; the pages are
        unmapped once no view of them is left (see segfile.map_fd)."""
        if self.mappings.get(m.ino) is m:
            del self.mappings[m.ino]
        if m.pfd >= 0:
            os.close(m.pfd)
            m.pfd = -1
        if m.registered:
            reg = registrar()
            if reg is not None and m.views == 0:
                try:
                    reg.unregister(m.addr)
                except Exception as exc:  # noqa: BLE001 - the pages go with the mapping anyway
                    log.debug("mmshm: unregistering an arena mapping failed: %s", exc)
            m.registered = False
            ARENA_REGISTERED_BYTES.dec(m.size)

    def _trim(self) -> None:
        """Keep the idle mappings under twice the arena's size (the longest
        unused go first; call under :attr:`lock`)."""
        if not self.mappings:
            return
        fs = TABLE.fs_size(next(iter(self.mappings.values())).directory)
        cap = 2 * max(config.arena_bytes(fs, True), config.default_arena_bytes(fs))
        total = sum(m.size for m in self.mappings.values())
        for m in sorted(self.mappings.values(), key=lambda m: m.used):
            if total <= cap:
                break
            if m.views == 0:
                total -= m.size
                self._drop(m)

    def sweep(self) -> int:
        """Let go of the mappings of segments that were unlinked (their producer
        died and the reaper took them, or the arena gave them back). Returns
        how many were dropped."""
        self._check_pid()
        n = 0
        with self.lock:
            self._last_sweep = time.monotonic()
            for m in list(self.mappings.values()):
                if m.views:
                    continue
                try:
                    gone = os.fstat(m.pfd).st_nlink == 0
                except OSError:
                    gone = True
                if gone:
                    self._drop(m)
                    n += 1
        return n

    def maybe_sweep(self, every: float = 1.0) -> None:
        if time.monotonic() - self._last_sweep >= every:
            self.sweep()

    def _ensure_sweeper(self) -> None:
        self._sweeper = self._running(self._sweeper, self._sweep_loop, "mmshm-arena-sweep")

    def _sweep_loop(self) -> None:
        me = self
        while True:
            time.sleep(5.0)
            if VIEWS is not me or me._pid != os.getpid():
                return
            try:
                me.sweep()
            except Exception as exc:  # noqa: BLE001 - keep sweeping
                log.debug("mmshm: arena sweep failed: %s", exc)

    def status(self) -> dict:
        """This process's mappings: how many, their bytes, how many registered."""
        with self.lock:
            ms = list(self.mappings.values())
        return {"mappings": len(ms), "mapped_bytes": sum(m.size for m in ms),
                "registered": sum(1 for m in ms if m.registered),
                "registered_bytes": sum(m.size for m in ms if m.registered),
                "views": sum(m.views for m in ms)}


def _drop_written(addr: int, nbytes: int) -> int:
    """Drop the pages of ``[addr, addr + nbytes)`` in a private file mapping
    that this process wrote (anonymous copies, read from /proc/self/pagemap),
    so that the next read sees the file again. Returns the pages dropped.
    Raises :class:`OSError` if pagemap cannot be read."""
    npages = -(-nbytes // _PAGE)
    first = addr // _PAGE
    fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        raw = os.pread(fd, npages * 8, first * 8)
    finally:
        os.close(fd)
    entries = np.frombuffer(raw, dtype=np.uint64)
    written = (entries & np.uint64(_PM_PRESENT)).astype(bool) & \
        ~(entries & np.uint64(_PM_FILE)).astype(bool)
    idx = np.flatnonzero(written)
    if not idx.size:
        return 0
    # runs of consecutive written pages, one madvise each
    breaks = np.flatnonzero(np.diff(idx) != 1)
    starts = np.concatenate(([idx[0]], idx[breaks + 1]))
    ends = np.concatenate((idx[breaks], [idx[-1]])) + 1
    for s, e in zip(starts.tolist(), ends.tolist()):
        if _madvise(addr + s * _PAGE, (e - s) * _PAGE, _MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise: {os.strerror(err)}")
    return int(idx.size)


#: this process's persistent mappings of arena segments
VIEWS = ArenaViews()


# -- copies mmshm makes itself ----------------------------------------------------
#: (address of a creator mapping, pid) -> bytes registered; keyed by the mapping,
#: not the name: the encoder cache publishes a reused segment under a new name per output
_producer_registered: dict[tuple[int, int], int] = {}


def _register_producer(seg: segment.Segment) -> bool:
    """Register the creator's writable mapping of arena segment ``seg`` with
    CUDA once (for a D2H straight into it). Returns whether it is registered."""
    reg = registrar()
    if reg is None or seg.shared_map is None or not seg.arena:
        return False
    key = (ctypes.addressof(seg.shared_map), os.getpid())
    if key in _producer_registered:
        return bool(_producer_registered[key])  # 0: refused once, not asked again
    buf = seg.shared_map
    try:
        reg.register(ctypes.addressof(buf), ctypes.sizeof(buf), False)
    except Exception as exc:  # noqa: BLE001 - RegistrationError, or the runtime's own
        ARENA_REGISTRATIONS.labels(result="failed").inc()
        _warn_once("register-producer", "mmshm: CUDA refused to register an arena segment "
                   "for copies from the GPU (%s): they run at pageable speed; fix: raise "
                   "the locked-memory limit (docker run --ulimit memlock=-1) or lower "
                   "MMSHM_ARENA_BYTES", str(exc))
        _producer_registered[key] = 0
        return False
    ARENA_REGISTRATIONS.labels(result="ok").inc()
    ARENA_REGISTERED_BYTES.inc(ctypes.sizeof(buf))
    _producer_registered[key] = ctypes.sizeof(buf)
    # a segment's creator mapping lives as long as the segment in this process
    weakref.finalize(buf, _unregister_producer, key, ctypes.addressof(buf))
    return True


def _unregister_producer(key: tuple[int, int], addr: int) -> None:
    size = _producer_registered.pop(key, 0)
    if size:
        reg = registrar()
        if reg is not None:
            try:
                reg.unregister(addr)
            except Exception as exc:  # noqa: BLE001 - a finalizer must not raise
                log.debug("mmshm: unregistering an arena segment failed: %s", exc)
        ARENA_REGISTERED_BYTES.dec(size)


def copy_from_device(dst, src, seg: segment.Segment | None = None) -> None:
    """Copy ``src`` (a tensor on a GPU) into ``dst`` (a CPU tensor of the same
    shape and dtype, in the creator's mapping of ``seg``: a D2H, blocking),
    registering ``seg``'s mapping with CUDA first, once, when it is an arena
    segment, so that the copy runs at pinned speed. Counted in
    ``mmshm_gpu_copy_bytes_total{direction="d2h"}`` and timed in
    ``mmshm_gpu_copy_seconds``. A CPU ``src`` is a plain copy, not counted."""
    if src.device.type == "cpu":
        dst.copy_(src)
        return
    if seg is not None:
        _register_producer(seg)
    t0 = time.perf_counter()
    dst.copy_(src)  # blocking: the bytes are in place when it returns
    GPU_COPY_SECONDS.labels(direction="d2h").observe(time.perf_counter() - t0)
    GPU_COPY_BYTES.labels(direction="d2h").inc(src.numel() * src.element_size())


def to_device(t, device, non_blocking: bool = False):
    """``t.to(device)``: a copy to the GPU (H2D) counted in
    ``mmshm_gpu_copy_bytes_total{direction="h2d"}`` and timed in
    ``mmshm_gpu_copy_seconds`` (synchronized when timed). ``t`` from an arena
    view that is registered copies at pinned speed. A CPU ``device`` is a plain
    ``t.to(device)``, not counted."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return t.to(dev)
    t0 = time.perf_counter()
    out = t.to(dev, non_blocking=non_blocking)
    if not non_blocking:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        GPU_COPY_SECONDS.labels(direction="h2d").observe(time.perf_counter() - t0)
    GPU_COPY_BYTES.labels(direction="h2d").inc(t.numel() * t.element_size())
    return out


def status(directory: str | None = None) -> dict:
    """The arena as this process sees it, for ``mmshm status``: its size in
    ``directory`` (``MMSHM_ARENA_BYTES``, 0: off), the bytes of this process's
    arena segments (``owned``) and of those in use, the registration state
    (``registered``, ``unregistered``: no CUDA in this process, ``failed``),
    and this process's mappings (:meth:`ArenaViews.status`)."""
    from mmshm.segments.segfile import STATE_POOLED, segment_dir

    d = segment_dir(directory)
    try:
        fs = TABLE.fs_size(d)
    except OSError:
        fs = 0
    cuda = cuda_host()
    size = config.arena_bytes(fs, cuda)
    with TABLE.lock:
        owned = [s for s in TABLE.segments.values() if s.owned and s.arena]
        idle = sum(HEADER_SIZE + s.payload_size for s in owned if s.status() == STATE_POOLED)
        total = TABLE.arena_bytes
    views = VIEWS.status()
    state = ("failed" if "register" in _warned else
             "registered" if views["registered"] else
             "unregistered")
    return {"bytes": size, "cuda_host": cuda, "owned_bytes": total,
            "in_use_bytes": max(total - idle, 0), "registration": state, **views}
