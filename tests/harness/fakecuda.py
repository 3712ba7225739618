"""A fake CUDA runtime for CPU tests: the calls mmshm's arena makes, as a host with
several GPUs answers them.

It behaves as CUDA 12's runtime and torch's binding of it do, in what matters for
which GPU a call lands on:

- a **current device per thread**, 0 in a thread that never set one
  (``cudaGetDevice``; no context is made by asking);
- a device's **primary context** is made by the first runtime call that needs one
  while that device is current: ``cudaSetDevice`` (since CUDA 12),
  ``cudaHostRegister``, ``cudaHostUnregister``, a synchronize, an event's record,
  query or synchronize, a copy; :attr:`FakeCuda.contexts` records each one made,
  with the thread and the call that made it;
- ``torch.cuda.device(i)`` is torch's guard: entering makes ``i`` current (its
  context made if need be); leaving gives the previous device back without making
  a context on it when it has none (``c10::cuda::MaybeExchangeDevice``);
- ``torch.cuda.cudart()`` has ``cudaHostRegister(ptr, size, flags)`` and
  ``cudaHostUnregister(ptr)`` returning a :class:`cudaError` (int-like, as
  pybind11's enum), ``cudaGetErrorString`` that takes only that enum (torch's
  binding raises TypeError for an int), and the ``cudaError`` type itself;
  :meth:`FakeCuda.libcudart` stands for the loaded libcudart through ctypes
  (``cudaGetErrorName``/``cudaGetErrorString``/``cudaGetLastError`` taking ints);
- ``torch.cuda.synchronize(device=None)``, ``torch.cuda.Event`` (``record``,
  ``query``, ``synchronize``), ``torch.cuda.default_stream``/``current_stream``,
  ``torch.cuda.set_device``, ``current_device``, ``is_initialized``,
  ``device_count``;
- the driver's ``cuDevicePrimaryCtxGetState`` (with ``cuInit`` and
  ``cuDeviceGet``, as mmshm calls them through ctypes): whether a device's
  primary context is active, from the contexts made (asking makes none).

:meth:`FakeCuda.install` puts it in place with a pytest ``monkeypatch`` (or
:meth:`FakeCuda.patch` without one, for a child process), and makes the arena see a
CUDA host, so that :class:`mmshm.segments.arena.CudaRegistrar`, the product's own
code, runs against it. ``hold`` (a :class:`threading.Event`) makes every
synchronize and event wait until it is set, as a copy still running on the GPU
would; ``refuse`` (a CUDA error number) makes every ``cudaHostRegister`` fail with
it; ``gone`` (a set of devices) makes every call on those devices fail with
``cudaErrorDevicesUnavailable``, as a device that went away does.
"""

from __future__ import annotations

import contextlib
import threading
import traceback

#: CUDA's names and texts of the errors the fake returns
ERRORS = {
    0: ("cudaSuccess", "no error"),
    1: ("cudaErrorInvalidValue", "invalid argument"),
    2: ("cudaErrorMemoryAllocation", "out of memory"),
    46: ("cudaErrorDevicesUnavailable", "CUDA-capable device(s) is/are busy or unavailable"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    712: ("cudaErrorHostMemoryAlreadyRegistered",
          "part or all of the requested memory range is already mapped"),
    713: ("cudaErrorHostMemoryNotRegistered",
          "pointer does not correspond to a registered memory region"),
    801: ("cudaErrorNotSupported", "operation not supported"),
}


class cudaError(int):  # noqa: N801 - torch's binding's name
    """As ``torch._C._cudart.cudaError``: a pybind11 enum of CUDA's error
    numbers (``int()`` gives the number; made from an int by calling it)."""


class _Cudart:
    """``torch.cuda.cudart()``: torch's binding of the runtime."""

    cudaError = cudaError

    def __init__(self, cuda: FakeCuda):
        self._cuda = cuda

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> cudaError:  # noqa: N802
        return cudaError(self._cuda._host_register(int(ptr), int(size), int(flags)))

    def cudaHostUnregister(self, ptr: int) -> cudaError:  # noqa: N802
        return cudaError(self._cuda._host_unregister(int(ptr)))

    def cudaGetErrorString(self, error) -> str:  # noqa: N802
        if not isinstance(error, cudaError):
            raise TypeError("cudaGetErrorString(): incompatible function arguments. The "
                            "following argument types are supported: "
                            "(arg0: torch._C._cudart.cudaError) -> str")
        return ERRORS.get(int(error), ("", "unrecognized error code"))[1]


class _LibCudart:
    """libcudart through ctypes (what :func:`mmshm.segments.arena._libcudart`
    loads): the functions taking a plain int."""

    def __init__(self, cuda: FakeCuda):
        self._cuda = cuda
        self.cudaGetErrorName = self._name  # noqa: N815
        self.cudaGetErrorString = self._text  # noqa: N815
        self.cudaGetLastError = self._last  # noqa: N815

    @staticmethod
    def _name(code: int) -> bytes:
        return ERRORS.get(int(code), ("cudaErrorUnknown", ""))[0].encode()

    @staticmethod
    def _text(code: int) -> bytes:
        return ERRORS.get(int(code), ("", "unrecognized error code"))[1].encode()

    def _last(self) -> int:
        return self._cuda._pop_last_error()


class _LibCuda:
    """The driver calls mmshm makes through ctypes (``libcuda.so.1``):
    ``cuInit``, ``cuDeviceGet`` and ``cuDevicePrimaryCtxGetState``, answered
    from the fake's contexts (asking makes none, as in CUDA)."""

    def __init__(self, cuda: FakeCuda):
        self._cuda = cuda

    def cuInit(self, flags: int) -> int:  # noqa: N802 - the driver's name
        return 0

    def cuDeviceGet(self, dev, ordinal: int) -> int:  # noqa: N802
        if not 0 <= ordinal < self._cuda.devices:
            return 101  # CUDA_ERROR_INVALID_DEVICE
        dev._obj.value = ordinal
        return 0

    def cuDevicePrimaryCtxGetState(self, dev, flags, active) -> int:  # noqa: N802
        flags._obj.value = 0
        active._obj.value = int(dev.value in self._cuda._active)
        return 0


class _Stream:
    def __init__(self, device: int, stream_id: int = 0):
        self.device = device
        self.stream_id = stream_id


class _Event:
    """``torch.cuda.Event``: recorded on a stream's device."""

    def __init__(self, cuda: FakeCuda, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self._cuda = cuda
        self.blocking = blocking
        self.device: int | None = None

    def record(self, stream: _Stream | None = None) -> None:
        device = stream.device if stream is not None else self._cuda.current_device()
        with self._cuda.device(device):
            self._cuda._use("cudaEventRecord")
        self.device = device
        self._cuda.events.append((device, self.blocking))

    def query(self) -> bool:
        if self.device is not None:
            with self._cuda.device(self.device):
                self._cuda._use("cudaEventQuery")
        hold = self._cuda.hold
        return hold is None or hold.is_set()

    def synchronize(self) -> None:
        if self.device is not None:
            with self._cuda.device(self.device):
                self._cuda._use("cudaEventSynchronize")
        if self._cuda.hold is not None:
            self._cuda.hold.wait(30)


class FakeCuda:
    """One process's fake CUDA runtime with ``devices`` GPUs (see the module
    docstring). :attr:`contexts` lists ``(device, thread name, call)`` for
    each primary context made; :meth:`contexts_on` counts one device's;
    :attr:`registered` maps each registered address to ``(size, flags,
    device)``; :attr:`calls` lists ``(call, device, thread name)``."""

    def __init__(self, devices: int = 2, hold: threading.Event | None = None,
                 refuse: int = 0):
        self.devices = devices
        self.hold = hold
        self.refuse = refuse
        self.gone: set[int] = set()
        self.contexts: list[tuple[int, str, str]] = []
        self.stacks: list[str] = []
        self.registered: dict[int, tuple[int, int, int]] = {}
        self.calls: list[tuple[str, int, str]] = []
        self.events: list[tuple[int, bool]] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._active: set[int] = set()
        self._cudart = _Cudart(self)
        self._lib = _LibCudart(self)
        self._driver = _LibCuda(self)

    # -- the runtime's state ----------------------------------------------------
    def current_device(self) -> int:
        """``cudaGetDevice`` in this thread: 0 until the thread sets one."""
        return getattr(self._local, "device", 0)

    def _set_current(self, device: int, make_context: bool) -> None:
        if not 0 <= device < self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal ({device})")
        self._local.device = device
        if make_context:
            self._use("cudaSetDevice")

    def _use(self, call: str) -> int:
        """A runtime call on this thread's current device: its primary context
        is made if it has none. Returns the device."""
        device = self.current_device()
        name = threading.current_thread().name
        with self._lock:
            self.calls.append((call, device, name))
            if device not in self._active:
                self._active.add(device)
                self.contexts.append((device, name, call))
                self.stacks.append("".join(traceback.format_stack(limit=14)))
        if device in self.gone:
            raise RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable "
                               f"(cudaErrorDevicesUnavailable) on cuda:{device}")
        return device

    def _pop_last_error(self) -> int:
        code = getattr(self._local, "last_error", 0)
        self._local.last_error = 0
        return code

    def contexts_on(self, device: int) -> int:
        """How many primary contexts were made on ``device`` (0 or 1)."""
        return sum(1 for d, _, _ in self.contexts if d == device)

    def report(self) -> dict:
        """What happened, as plain data (for a child process to send back)."""
        return {"contexts": list(self.contexts), "stacks": list(self.stacks),
                "calls": list(self.calls), "registered": dict(self.registered),
                "events": list(self.events)}

    # -- cudaHostRegister / Unregister --------------------------------------------
    def _host_register(self, ptr: int, size: int, flags: int) -> int:
        try:
            device = self._use("cudaHostRegister")
        except RuntimeError:
            self._local.last_error = 46
            return 46
        if self.refuse:
            self._local.last_error = self.refuse
            return self.refuse
        with self._lock:
            if ptr in self.registered:
                self._local.last_error = 712
                return 712
            self.registered[ptr] = (size, flags, device)
        return 0

    def _host_unregister(self, ptr: int) -> int:
        try:
            self._use("cudaHostUnregister")
        except RuntimeError:
            self._local.last_error = 46
            return 46
        with self._lock:
            if self.registered.pop(ptr, None) is None:
                self._local.last_error = 713
                return 713
        return 0

    # -- torch.cuda ---------------------------------------------------------------
    def cudart(self) -> _Cudart:
        return self._cudart

    def libcudart(self) -> _LibCudart:
        return self._lib

    @contextlib.contextmanager
    def device(self, device):
        """``torch.cuda.device(device)``: torch's guard (see the module docstring)."""
        idx = _index(device)
        if idx is None or idx < 0:
            yield
            return
        prev = self.current_device()
        if idx != prev:
            self._set_current(idx, make_context=True)
        try:
            yield
        finally:
            if idx != prev:
                # MaybeExchangeDevice: back to prev, making no context there
                self._set_current(prev, make_context=False)

    def set_device(self, device) -> None:
        self._set_current(_index(device), make_context=True)

    def synchronize(self, device=None) -> None:
        with self.device(device):
            self._use("cudaDeviceSynchronize")
            if self.hold is not None:
                self.hold.wait(30)

    def event(self, enable_timing: bool = False, blocking: bool = False,
              interprocess: bool = False) -> _Event:
        return _Event(self, enable_timing, blocking, interprocess)

    def default_stream(self, device=None) -> _Stream:
        idx = _index(device)
        return _Stream(self.current_device() if idx is None else idx)

    # -- installing it --------------------------------------------------------------
    def _targets(self) -> list[tuple[object, str, object]]:
        import torch

        from mmshm.segments import arena, table

        return [
            (torch.cuda, "cudart", self.cudart),
            (torch.cuda, "current_device", self.current_device),
            (torch.cuda, "device", self.device),
            (torch.cuda, "set_device", self.set_device),
            (torch.cuda, "synchronize", self.synchronize),
            (torch.cuda, "Event", self.event),
            (torch.cuda, "default_stream", self.default_stream),
            (torch.cuda, "current_stream", self.default_stream),
            (torch.cuda, "is_initialized", lambda: True),
            (torch.cuda, "is_available", lambda: True),
            (torch.cuda, "device_count", lambda: self.devices),
            (arena, "cuda_host", lambda: True),
            (table, "_CUDA_HOST", True),
            (arena, "_libcudart", self.libcudart),
            (arena, "_libcuda", lambda: self._driver),
        ]

    def install(self, monkeypatch) -> FakeCuda:
        """Put this runtime in place for one test (undone by ``monkeypatch``);
        the arena's registrar goes back to the automatic choice, which is then
        the product's :class:`~mmshm.segments.arena.CudaRegistrar` over it."""
        from mmshm.segments import arena

        for obj, name, value in self._targets():
            monkeypatch.setattr(obj, name, value)
        arena.set_registrar(None)
        return self

    def patch(self) -> FakeCuda:
        """:meth:`install` for good (a child process that exits afterwards)."""
        from mmshm.segments import arena

        for obj, name, value in self._targets():
            setattr(obj, name, value)
        arena.set_registrar(None)
        return self


def _index(device) -> int | None:
    """A device index from an int, a ``torch.device``, ``"cuda:1"`` or None."""
    if device is None:
        return None
    if isinstance(device, int):
        return device
    idx = getattr(device, "index", None)
    if idx is not None or hasattr(device, "type"):
        return idx
    text = str(device)
    return int(text.split(":", 1)[1]) if ":" in text else None
