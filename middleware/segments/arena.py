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
  view waits for the GPU (the settle, below, on a background thread) so
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

**Every CUDA call on its own device.** A thread that never called
``cudaSetDevice`` has device 0 current, and the runtime makes GPU 0's primary
context (0.3-0.5 GiB) at the first call there: a TP rank on ``cuda:k`` whose
sweeping thread, finalizers or exit unregistered a mapping without a guard
would put a context on GPU 0, whose KV cache took about 90% of its memory. So
each mapping records the device current in the thread that maps it (the
rank's ``torch.cuda.current_device()``; the producer's registration records its
copy's source device), and the registrar runs register, unregister and settle
under ``torch.cuda.device(that device)``, whatever thread runs them (the
``mmshm-arena-sweep`` and ``mmshm-arena-settle`` threads, weakref finalizers,
an eviction or ``trim_pool`` in the producer, the exit). torch's guard makes
no context on the device it restores when that device has none
(``c10::cuda::MaybeExchangeDevice``). ``tests/test_arena_cuda.py`` runs the
product's :class:`CudaRegistrar` over a fake runtime that makes contexts as
CUDA does and finds none on GPU 0 for a rank on ``cuda:1``.

**The rank's device seen from another thread.** A server may materialize on
a thread that never set the device: vLLM's EngineCore decodes requests on its
input thread, where device 0 is current whatever GPU the engine runs on. So
the device recorded for a new mapping is the calling thread's current device
only where that device already has a primary context; where it has none and
exactly one device of the process has one (the rank's own GPU), that device
is recorded (:meth:`CudaRegistrar.current_device`: the driver's
``cuDevicePrimaryCtxGetState``, which makes no context, about 1 us a device,
once per new mapping). A process with no context yet, or with contexts on
several devices, records the current device as before.

**No lock in a finalizer.** A registered view's finalizer only puts the view
on a :class:`queue.SimpleQueue` (its ``put`` takes no lock a finalizer's own
thread could hold, which is what it was made for); the settling thread,
started where a mapping is registered (never from a finalizer: starting a
thread takes locks), does the rest. An unregistered view's finalizer takes
only re-entrant locks (:attr:`ArenaViews.lock`, the table's).

**The settle** (unmeasured on a GPU). The server queued its copy from the view
(``.to(device, non_blocking=True)``) on *its* stream, which mmshm cannot see
from a finalizer, and the view may be released on another thread than the
copy's. A wait that covers that copy whatever its stream must be device-wide:
an event recorded on the legacy default stream waits for the blocking streams
too, but not for ``cudaStreamNonBlocking`` streams, and torch's side streams
(``torch.cuda.Stream()``; SGLang's overlap scheduler runs its forward on one)
are non-blocking (``c10/cuda/CUDAStream.cpp``: ``kDefaultFlags``). So the
settling thread takes every view released meanwhile as one batch and, for each
device of the batch's mappings (each mapping's own, not one captured once),
runs ``cudaDeviceSynchronize`` under that device's guard
(:data:`SETTLE_MODE` ``"device"``, the default): correct for every stream, at
the cost that CUDA's default scheduling spins the settling thread's core while
the device drains what was queued before the call (once per batch, not per
view). :data:`SETTLE_MODE` ``"event"`` waits without spinning (an event made
with ``cudaEventBlockingSync``, recorded on the device's legacy default stream,
polled with a sleep of 0.2-4 ms) and is correct only where the server copies
on the default stream or a blocking stream; which to make the default is for a
GPU host's measurement (``benchmarks/gpu_arena.py``'s race check), not this
module. Changing the context's scheduling to blocking sync would stop the spin
but change every wait of the server's own, so mmshm does not. The time from a
view's release to its give-back is observed in ``mmshm_arena_settle_seconds``.
A device that fails or went away (a rank on its way out) runs no more copies:
its views are given back all the same, said once at WARNING; at exit
(:meth:`ArenaViews.drain`) what is queued or stuck in a settle is given back,
each view once.

**A refused registration** is said once per process at WARNING with CUDA's
own error name and text (``cudaGetErrorName``/``cudaGetErrorString``) and the
fix for that error, counted in ``mmshm_arena_registrations_total{result="failed"}``,
and this process then maps every new arena segment unregistered without asking
CUDA again for :data:`REFUSAL_RETRY_S` (an hour): the causes seen last, and a
retry per new mapping would put a refused ``cudaHostRegister`` on the request
path of every request that brings a new size.

May import: :mod:`mmshm.errors`, :mod:`mmshm.config`, :mod:`mmshm.metrics` and
the segment modules below it (:mod:`~mmshm.segments.segfile`,
:mod:`~mmshm.segments.table`, :mod:`~mmshm.segments.segment`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from mmshm import config
from mmshm.errors import RegistrationError, SegmentCorruptError, SegmentNotFoundError
from mmshm.metrics import (
    ARENA_REGISTERED_BYTES,
    ARENA_REGISTRATIONS,
    ARENA_SETTLE_SECONDS,
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
#: seconds between two sweeps of the mappings on the ``mmshm-arena-sweep`` thread
SWEEP_EVERY_S = 5.0
#: at exit, how long the settling thread may take to settle what is queued
#: before the exiting thread gives those views back itself (:meth:`ArenaViews.drain`)
EXIT_SETTLE_S = 5.0


# -- the registrar seam --------------------------------------------------------
class Registrar(Protocol):
    """What registers host memory with a GPU runtime (CUDA), once per mapping,
    each call on the device the mapping belongs to.

    ``current_device()`` is the device current in the calling thread (an
    ``int``; None where the runtime has none): the device recorded for a new
    mapping. ``register(addr, nbytes, read_only, device)`` raises
    :class:`RegistrationError`; ``unregister(addr, device)`` never raises;
    ``settle(devices)`` blocks until each device in ``devices`` has finished
    every copy queued on it so far (called on the settling thread before a
    registered view's pages may be reused; raises what the runtime raises).
    ``device`` None: the calling thread's current device."""

    name: str

    def current_device(self) -> int | None: ...

    def register(self, addr: int, nbytes: int, read_only: bool, device: int | None) -> None: ...

    def unregister(self, addr: int, device: int | None) -> None: ...

    def settle(self, devices: Iterable[int | None]) -> None: ...


def _libcudart():
    """libcudart as this process loaded it (torch's), found in
    /proc/self/maps, as a :class:`ctypes.CDLL`; None if none is loaded."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcudart" in line})
        return ctypes.CDLL(paths[0]) if paths else None
    except Exception:  # noqa: BLE001 - best effort
        return None


_LIBCUDA: list = []  # [ctypes.CDLL | None], loaded once


def _libcuda():
    """The CUDA driver (``libcuda.so.1``) as a :class:`ctypes.CDLL`, with
    ``cuInit`` called; None where it cannot be loaded (no driver)."""
    if not _LIBCUDA:
        lib = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            if int(lib.cuInit(0)) != 0:
                lib = None
        except Exception:  # noqa: BLE001 - no driver: nothing to ask
            lib = None
        _LIBCUDA.append(lib)
    return _LIBCUDA[0]


def _active_devices(count: int) -> list[int] | None:
    """The devices (ordinals as this process sees them, ``0 <= d < count``)
    whose primary context is active in this process, from the driver's
    ``cuDevicePrimaryCtxGetState`` (which makes no context); None where the
    driver cannot be asked."""
    lib = _libcuda()
    if lib is None:
        return None
    active = []
    try:
        for ordinal in range(count):
            dev = ctypes.c_int()
            flags = ctypes.c_uint()
            on = ctypes.c_int()
            if int(lib.cuDeviceGet(ctypes.byref(dev), ordinal)) != 0:
                return None
            if int(lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags),
                                                  ctypes.byref(on))) != 0:
                return None
            if on.value:
                active.append(ordinal)
    except Exception:  # noqa: BLE001 - an old driver without the call
        return None
    return active


def _cudart_last_error_reset() -> None:
    """Clear CUDA's last-error word (per thread) after a refused registration,
    so that the server's next kernel launch check does not report it as its
    own."""
    try:
        lib = _libcudart()
        if lib is not None:
            lib.cudaGetLastError()
    except Exception as exc:  # noqa: BLE001 - best effort
        log.debug("mmshm: clearing CUDA's last error failed: %s", exc)


def cuda_error_text(code: int, cudart=None) -> tuple[str, str]:
    """CUDA's own name and text of runtime error ``code`` (an ``int``, a
    ``cudaError_t``), e.g. ``("cudaErrorMemoryAllocation", "out of memory")``:
    ``cudaGetErrorName``/``cudaGetErrorString`` of the loaded libcudart
    (ctypes), else ``cudaGetErrorString`` of torch's binding ``cudart``, which
    takes its ``cudaError`` enum, not an int. Never raises: an unknown
    name is ``"cudaError <code>"``."""
    name = text = None
    lib = _libcudart()
    if lib is not None:
        try:
            for fn in (lib.cudaGetErrorName, lib.cudaGetErrorString):
                fn.restype = ctypes.c_char_p
                fn.argtypes = (ctypes.c_int,)
            name = lib.cudaGetErrorName(int(code)).decode(errors="replace")
            text = lib.cudaGetErrorString(int(code)).decode(errors="replace")
        except Exception:  # noqa: BLE001 - no such symbol: the binding below
            name = text = None
    if text is None and cudart is not None:
        try:
            enum = getattr(cudart, "cudaError", None)
            text = str(cudart.cudaGetErrorString(enum(int(code)) if enum else int(code)))
        except Exception:  # noqa: BLE001
            text = None
    return name or f"cudaError {int(code)}", text or "no text from the CUDA runtime"


#: how the settling thread waits for a device before giving released
#: registered views back: ``"device"`` (``cudaDeviceSynchronize`` under the
#: device's guard: every stream; CUDA's default scheduling spins a core while
#: it waits) or ``"event"`` (an event made with ``cudaEventBlockingSync``,
#: recorded on the device's legacy default stream and polled with a sleep: no
#: spinning, but it covers only the legacy default stream and the *blocking*
#: streams, not torch's side streams, which are ``cudaStreamNonBlocking``).
#: See the module docstring, "The settle".
SETTLE_MODE = "device"
#: the settle's poll interval in ``"event"`` mode (seconds, doubling up to 4 ms)
_POLL_S = 0.0002


class CudaRegistrar:
    """Registers mappings with CUDA through torch's binding of the runtime
    (``torch.cuda.cudart().cudaHostRegister``, as ``torch.cuda._pin_memory_utils``
    does), with ``cudaHostRegisterPortable`` and, for a consumer's read-only
    view, ``cudaHostRegisterReadOnly``. Every call runs under
    ``torch.cuda.device(device)``, torch's device guard, whatever the thread:
    a thread that never set its device has device 0 current, and a runtime
    call there would create a context on GPU 0 (leaving the guard never
    creates one: torch restores a device without a context lazily)."""

    name = "cuda"

    def __init__(self):
        import torch

        self._torch = torch
        self._cudart = torch.cuda.cudart()

    def current_device(self) -> int:
        """The device a new mapping made on this thread belongs to: the
        thread's current device where it has a primary context, else the one
        device of the process that has one (a rank's GPU, seen from a thread
        that never set it: vLLM's EngineCore input thread), else the current
        device. Makes no context. See the module docstring."""
        dev = int(self._torch.cuda.current_device())
        active = _active_devices(int(self._torch.cuda.device_count()))
        if active is None or dev in active or len(active) != 1:
            return dev
        return active[0]

    def _guard(self, device: int | None):
        if device is None:
            return contextlib.nullcontext()
        return self._torch.cuda.device(int(device))

    def register(self, addr: int, nbytes: int, read_only: bool, device: int | None) -> None:
        with self._guard(device):
            code = int(self._cudart.cudaHostRegister(
                addr, nbytes, _FLAGS_READ_ONLY if read_only else _FLAGS_WRITABLE))
            if code != 0:
                _cudart_last_error_reset()
        if code != 0:
            name, text = cuda_error_text(code, self._cudart)
            where = "" if device is None else f" on cuda:{device}"
            raise RegistrationError(
                f"cudaHostRegister of {nbytes} bytes{where}"
                f"{' (read-only)' if read_only else ''} failed: {name}: {text}", code)

    def unregister(self, addr: int, device: int | None) -> None:
        try:
            with self._guard(device):
                code = int(self._cudart.cudaHostUnregister(addr))
                if code != 0:
                    _cudart_last_error_reset()
        except Exception as exc:  # noqa: BLE001 - a device gone: the pages go with the mapping
            log.debug("mmshm: unregistering an arena mapping on cuda:%s failed: %s", device, exc)

    def settle(self, devices: Iterable[int | None]) -> None:
        errors = []
        for d in sorted({d for d in devices if d is not None}) or [None]:
            try:
                with self._guard(d):
                    if SETTLE_MODE == "event":
                        self._wait_event()
                    else:
                        self._torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - the other devices still settle
                errors.append(f"cuda:{d}: {exc}")
        if errors:
            raise RuntimeError("; ".join(errors))

    def _wait_event(self) -> None:
        """Wait, without spinning, until the current device's legacy default
        stream (and the blocking streams it waits for) has run what was queued
        so far."""
        torch = self._torch
        ev = torch.cuda.Event(blocking=True)
        ev.record(torch.cuda.default_stream())
        pause = _POLL_S
        while not ev.query():
            time.sleep(pause)
            pause = min(pause * 2, 0.004)


_registrar: Registrar | None = None
_registrar_set = False
_registrar_pid = 0


def set_registrar(registrar: Registrar | None) -> None:
    """Install ``registrar`` for this process (tests: the harness's recording
    registrar); ``None`` goes back to the automatic choice (:func:`registrar`).
    Forgets an earlier refusal (:func:`refused`)."""
    global _registrar, _registrar_set, _registrar_pid, _refused_until
    _registrar = registrar
    _registrar_set = registrar is not None
    _registrar_pid = os.getpid()
    _refused_until = 0.0


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


#: after CUDA refused a registration, this process maps arena segments
#: unregistered, without asking CUDA again, until this :func:`time.monotonic`
_refused_until = 0.0
#: how long after a refusal this process asks CUDA again (seconds): the causes
#: seen (no read-only registration on this platform, confidential computing,
#: WSL, the driver out of page-lockable memory) last, and a retry per new
#: mapping would put a refused ``cudaHostRegister`` on the request path of
#: every request that brings a new size; one try an hour costs nothing and
#: lets a transient cause heal
REFUSAL_RETRY_S = 3600.0

_FIXES = {
    2: "the driver could not page-lock the memory: lower MMSHM_ARENA_BYTES or give the host "
       "more memory; whether RLIMIT_MEMLOCK (ulimit -l) plays a part is not measured "
       "(docs/gpu.md)",
    1: "this driver or platform refuses the registration's flags (read-only registration "
       "needs CUDA 11.1+; WSL and confidential computing refuse host registration): set "
       "MMSHM_ARENA_BYTES=0 to turn the arena off",
    801: "this driver or platform does not support host registration (WSL, confidential "
         "computing): set MMSHM_ARENA_BYTES=0 to turn the arena off",
    712: "the memory was registered already by someone else in this process: report it "
         "(docs/gpu.md)",
}


def refused() -> bool:
    """Whether CUDA refused a registration in this process less than
    :data:`REFUSAL_RETRY_S` ago: new mappings are then served unregistered
    without asking CUDA again."""
    return time.monotonic() < _refused_until


def _register(reg: Registrar, addr: int, nbytes: int, read_only: bool, device: int | None,
              what: str) -> bool:
    """Register one mapping through ``reg``, counted in
    ``mmshm_arena_registrations_total{result}``. A refusal is said at WARNING
    once per process, with CUDA's error name and text and the fix for that
    error, and starts the :data:`REFUSAL_RETRY_S` during which nothing more is
    registered here. Returns whether the mapping is registered; never raises."""
    global _refused_until
    try:
        reg.register(addr, nbytes, read_only, device)
    except Exception as exc:  # noqa: BLE001 - RegistrationError, or the runtime's own
        ARENA_REGISTRATIONS.labels(result="failed").inc()
        _refused_until = time.monotonic() + REFUSAL_RETRY_S
        if "register" in _warned:
            log.debug("mmshm: CUDA refused to register %s again: %s", what, exc)
        else:
            _warn_once(
                "register", "mmshm: CUDA refused to register %s (%s): this process (pid %d) "
                "serves the arena unregistered from now on and asks CUDA again in %d "
                "minutes, so copies between its arena memory and the GPU run at pageable "
                "speed; fix: %s (said once; mmshm_arena_registrations_total"
                "{result=\"failed\"} counts each refusal)", what, str(exc), os.getpid(),
                REFUSAL_RETRY_S // 60,
                _FIXES.get(getattr(exc, "code", 0), "see docs/gpu.md, 'Registration'; "
                           "MMSHM_ARENA_BYTES=0 turns the arena off"))
        return False
    ARENA_REGISTRATIONS.labels(result="ok").inc()
    return True


def _current_device(reg: Registrar) -> int | None:
    """The device current in this thread as ``reg`` tells it (None: unknown)."""
    try:
        return reg.current_device()
    except Exception as exc:  # noqa: BLE001 - a runtime without devices
        log.debug("mmshm: no current CUDA device: %s", exc)
        return None


# -- the consumer's persistent mappings ----------------------------------------
class _Mapping:
    """One arena segment's payload as this process keeps it mapped."""

    __slots__ = ("addr", "buf", "device", "directory", "ino", "name", "pfd", "registered", "size",
                 "used", "views")

    def __init__(self, name: str, directory: str, ino: tuple[int, int], pfd: int,
                 buf: ctypes.Array, size: int, registered: bool, device: int | None = None):
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
        #: the CUDA device current in the thread that mapped it (the rank's
        #: device): its registration, unregistration and settle run there
        self.device = device
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
        #: released registered views, ``(mapping, segment, gen, released at)``:
        #: a finalizer only puts (SimpleQueue.put takes no lock a finalizer's
        #: own thread could hold); the settling thread does the rest
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        #: views taken from the queue and not given back yet, by id: whoever
        #: pops one (dict.pop, atomic) gives it back, so that an exit that
        #: cannot wait for a stuck settling thread gives its views back once
        self._inflight: dict[int, tuple] = {}
        #: set by drain() at exit: views released after it settle on their own thread
        self._exiting = False
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
    def view(self, seg: segment.Segment, gen: int, nbytes: int, offset: int = 0) -> np.ndarray:
        """A uint8 array of ``nbytes`` from ``offset`` (bytes from the payload's
        start) over arena segment ``seg`` (attached by the caller, holding one
        reference for generation ``gen``), from this process's persistent
        mapping of it; the array's finalizer gives the reference back. Raises
        :class:`SegmentCorruptError` (the file cannot be mapped, or is shorter
        than its header says or than ``offset + nbytes``)."""
        self._check_pid()
        seg.check_size(offset + nbytes)
        st = os.fstat(seg.fd)
        with self.lock:
            key = (st.st_dev, st.st_ino)
            m = self.mappings.get(key)
            if m is None:
                m = self._map(seg, key)
            if offset + nbytes > m.size:
                raise SegmentCorruptError(errno.EINVAL, f"a view of {nbytes} bytes at {offset} "
                                          f"ends past the {m.size}-byte mapping", seg.path)
            m.views += 1
            m.used = time.monotonic()
        ARENA_VIEWS.labels(registered="yes" if m.registered else "no").inc()
        if m.registered:
            # started here, never from a finalizer (starting a thread takes locks)
            self._ensure_settler()
        arr = np.frombuffer(m.buf, dtype=np.uint8, count=nbytes, offset=offset)
        segment.pin(seg)  # the view holds the descriptor (its liveness lock) until released
        weakref.finalize(arr, self._release, m, seg, gen, nbytes)
        self.maybe_sweep()
        return arr

    def _map(self, seg: segment.Segment, ino: tuple[int, int]) -> _Mapping:
        """Map ``seg``'s payload for good, registered if this process can (on
        the device current in this thread, recorded in the mapping)."""
        reg = registrar()
        asked = reg is not None and not refused()
        device = _current_device(reg) if asked else None
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
            if asked:
                buf = map_fd(fd, size, HEADER_SIZE, shared=True, writable=False)
                registered = _register(reg, ctypes.addressof(buf), size, True, device,
                                       "the arena's memory")
                if registered:
                    ARENA_REGISTERED_BYTES.inc(size)
                else:
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
        m = _Mapping(seg.name, seg.directory, ino, pfd, buf, size, registered,
                     device if registered else None)
        self.mappings[ino] = m
        if "mapped" not in _warned:
            _warned.add("mapped")
            log.info("mmshm: arena segments are mapped once in this process (pid %d) and kept; "
                     "%s", os.getpid(),
                     "registered with CUDA (page-locked: copies to the GPU at pinned speed)"
                     if registered else "not registered with CUDA (%s): copy-on-write views of "
                     "warm pages" % ("refused: see the WARNING" if reg is not None else
                                     "CUDA is not initialized in this process"))
        if registered:
            self._ensure_settler()
        self._ensure_sweeper()
        self._trim()
        return m

    def _release(self, m: _Mapping, seg: segment.Segment, gen: int, nbytes: int) -> None:
        """Finalizer of a view. A registered one only goes on the settling
        queue (``SimpleQueue.put``: no lock that this thread could hold when a
        collection runs the finalizer), and the settling thread gives its
        reference back once the GPU has run the copies queued from it; at
        the interpreter's exit (weakref runs the finalizers of live views
        then) after :meth:`drain` it is settled and given back here. The last unregistered view of
        a mapping in this process drops the pages written through the mapping
        (views of one segment in one process share it, as views of one tensor
        do); then the reference goes back."""
        if m.registered:
            if self._exiting:  # after drain() at exit: no settling thread to rely on
                item = (m, seg, gen, time.monotonic())
                self._inflight[id(item)] = item
                self._settle([item])
            else:
                self._queue.put((m, seg, gen, time.monotonic()))
            return
        with self.lock:  # re-entrant: a collection in a thread holding it goes on
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
        """Start the settling thread if it is not running (called where a
        mapping is registered and a registered view made, never from a
        finalizer: starting a thread takes locks)."""
        if self._settler is None or not self._settler.is_alive():
            with self.lock:
                self._settler = self._running(self._settler, self._settle_loop,
                                              "mmshm-arena-settle")

    def _take(self) -> list:
        """What is queued now, without waiting, marked in flight."""
        batch = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch
            self._inflight[id(item)] = item
            batch.append(item)

    def _settle_loop(self) -> None:
        q = self._queue
        while True:
            item = q.get()
            self._inflight[id(item)] = item
            self._settle([item, *self._take()])

    def _settle(self, batch: list) -> None:
        """Wait for the devices of ``batch``'s mappings (each on its own device,
        :meth:`Registrar.settle`), then give the views' references back, each
        view's time from release to give-back observed in
        ``mmshm_arena_settle_seconds``. A device that fails or went away (a
        rank on its way out) runs no more copies from the pages: the
        references are given back all the same, said once at WARNING; nothing
        is raised."""
        reg = registrar()
        try:
            if reg is not None:
                reg.settle({m.device for m, *_ in batch})
        except Exception as exc:  # noqa: BLE001 - a device error: still give back
            if "settle" in _warned:
                log.debug("mmshm: waiting for the GPU before reusing arena pages failed: %s",
                          exc)
            _warn_once("settle", "mmshm: waiting for the GPU before reusing arena pages "
                       "failed (%s): the released views are given back all the same (a device "
                       "that failed runs no more copies from them)", exc)
        now = time.monotonic()
        for item in batch:
            if self._inflight.pop(id(item), None) is None:
                continue  # given back already (drain() at exit)
            m, seg, gen, released = item
            self._give_back(m, seg, gen)
            try:
                ARENA_SETTLE_SECONDS.observe(now - released)
            except Exception:  # noqa: BLE001 - never stop giving back for a metric
                pass

    def drained(self, timeout: float = 10.0) -> bool:
        """Wait until every registered view released so far has been settled
        and given back (views still alive are not waited for). Returns False
        on timeout. The settle runs on its own thread, so a producer in this
        process may otherwise find a just-released segment still held."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self._queue.empty() and not self._inflight:
                return True
            time.sleep(0.001)
        return False

    def settled(self, timeout: float = 10.0) -> bool:
        """Wait until every released registered view has been given back
        (tests, and a clean exit). Returns False on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if (self._queue.empty() and not self._inflight
                    and all(m.views == 0 or not m.registered
                            for m in list(self.mappings.values()))):
                return True
            time.sleep(0.005)
        return False

    def drain(self, timeout: float | None = None) -> int:
        """At exit (:data:`mmshm.segments.segment.exit_reporters`): give the
        references of released registered views back. The settling thread
        has up to ``timeout`` seconds (:data:`EXIT_SETTLE_S`) to settle what
        is queued; then what is still queued or in its hands (a device that
        hangs) is settled once more on this thread and given back, each view
        once, a device that fails or went away included. Returns how many
        were given back here. Never raises."""
        if self._pid != os.getpid():
            return 0
        self._exiting = True
        end = time.monotonic() + (EXIT_SETTLE_S if timeout is None else timeout)
        while (not self._queue.empty() or self._inflight) and time.monotonic() < end:
            if self._settler is None or not self._settler.is_alive():
                break
            time.sleep(0.005)
        batch = self._take() + [it for it in list(self._inflight.values())]
        batch = list({id(it): it for it in batch}.values())
        if batch:
            try:
                self._settle(batch)
            except Exception as exc:  # noqa: BLE001 - the exit goes on
                log.debug("mmshm: giving arena views back at exit failed: %s", exc)
        return len(batch)

    # -- sweeping ---------------------------------------------------------------
    def _drop(self, m: _Mapping) -> None:
        """Forget ``m`` (call under :attr:`lock`): unregister it (on its
        device, whatever thread this is); the pages are unmapped once no view
        of them is left (see segfile.map_fd)."""
        if self.mappings.get(m.ino) is m:
            del self.mappings[m.ino]
        if m.pfd >= 0:
            os.close(m.pfd)
            m.pfd = -1
        if m.registered:
            reg = registrar()
            if reg is not None and m.views == 0:
                try:
                    reg.unregister(m.addr, m.device)
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
            time.sleep(SWEEP_EVERY_S)
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
#: released registered views still queued at exit are settled and given back
segment.exit_reporters.append(lambda: VIEWS.drain())


# -- copies mmshm makes itself ----------------------------------------------------
#: (address of a creator mapping, pid) -> (bytes registered, its device); keyed by
#: the mapping, not the name: the encoder cache publishes a reused segment under
#: a new name per output
_producer_registered: dict[tuple[int, int], tuple[int, int | None]] = {}


def _register_producer(seg: segment.Segment, device: int | None = None) -> bool:
    """Register the creator's writable mapping of arena segment ``seg`` with
    CUDA once (for a D2H straight into it), on ``device`` (the copy's source
    device; None: the device current in this thread), which is recorded for
    its unregistration. Nothing is asked while an earlier refusal holds
    (:func:`refused`). Returns whether it is registered."""
    reg = registrar()
    if reg is None or seg.shared_map is None or not seg.arena:
        return False
    key = (ctypes.addressof(seg.shared_map), os.getpid())
    if key in _producer_registered:
        return True
    if refused():
        return False
    buf = seg.shared_map
    if device is None:
        device = _current_device(reg)
    if not _register(reg, ctypes.addressof(buf), ctypes.sizeof(buf), False, device,
                     "an arena segment for copies from the GPU"):
        return False
    ARENA_REGISTERED_BYTES.inc(ctypes.sizeof(buf))
    _producer_registered[key] = (ctypes.sizeof(buf), device)
    # a segment's creator mapping lives as long as the segment in this process
    weakref.finalize(buf, _unregister_producer, key, ctypes.addressof(buf))
    return True


def _unregister_producer(key: tuple[int, int], addr: int) -> None:
    """Finalizer of a registered creator mapping (it runs in whichever thread
    lets go of the segment: an eviction, ``trim_pool``, the sweeper, the
    exit): unregistered on the device it was registered on, before the pages
    are unmapped (a later mapping at the same address must not find it
    registered). Takes no lock of mmshm's."""
    size, device = _producer_registered.pop(key, (0, None))
    if size:
        reg = registrar()
        if reg is not None:
            try:
                reg.unregister(addr, device)
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
        _register_producer(seg, src.device.index)
    t0 = time.perf_counter()
    dst.copy_(src)  # blocking, on src's device (torch guards it): the bytes are in place
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
