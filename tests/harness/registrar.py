"""A recording registrar for CPU tests of the arena (:mod:`mmshm.segments.arena`).

No CUDA here: :class:`FakeRegistrar` stands where :class:`~mmshm.segments.arena.CudaRegistrar`
would, installed with :func:`mmshm.segments.arena.set_registrar`, and records what CUDA
would be asked. (:mod:`tests.harness.fakecuda` goes one step further: a fake CUDA
runtime under the real ``CudaRegistrar``.)
"""

from __future__ import annotations

import threading

from mmshm.errors import RegistrationError

#: what :class:`FakeRegistrar` raises for each ``fail`` mode: (CUDA error number, message)
FAILURES = {
    "memlock": (2, "cudaHostRegister failed: cudaErrorMemoryAllocation: out of memory"),
    "driver": (801, "cudaHostRegister failed: cudaErrorNotSupported: operation not supported"),
}


class FakeRegistrar:
    """Records ``("register", addr, nbytes, read_only, device)``,
    ``("unregister", addr, device)`` and ``("settle", devices)`` (a sorted
    tuple) in :attr:`calls`. With ``fail`` (a key of :data:`FAILURES`) every
    registration is refused as CUDA refuses it (:class:`RegistrationError`
    with CUDA's error name and number). ``hold`` (a :class:`threading.Event`)
    makes :meth:`settle` wait until it is set (at most 30 s), as a copy still
    running on the GPU would. ``device`` is what :meth:`current_device`
    answers (the device a new mapping is recorded on)."""

    name = "fake"

    def __init__(self, fail: str | None = None, hold: threading.Event | None = None,
                 device: int | None = 0):
        self.fail = fail
        self.hold = hold
        self.device = device
        self.calls: list[tuple] = []
        self._lock = threading.Lock()

    def current_device(self) -> int | None:
        return self.device

    def register(self, addr: int, nbytes: int, read_only: bool, device: int | None = None
                 ) -> None:
        with self._lock:
            self.calls.append(("register", addr, nbytes, read_only, device))
        if self.fail:
            code, text = FAILURES.get(self.fail, (1, f"cudaHostRegister failed: {self.fail}"))
            raise RegistrationError(text, code)

    def unregister(self, addr: int, device: int | None = None) -> None:
        with self._lock:
            self.calls.append(("unregister", addr, device))

    def settle(self, devices=()) -> None:
        if self.hold is not None:
            self.hold.wait(30)
        with self._lock:
            self.calls.append(("settle", tuple(sorted(d for d in devices if d is not None))))

    def registrations(self) -> int:
        """How many registrations were asked for."""
        return sum(1 for c in self.calls if c[0] == "register")
