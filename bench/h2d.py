"""Host-to-device copies for ``mmshm bench --device cuda`` (runs in a TP rank).

After a run's bytes are checked, each TP rank copies the distinct tensors it
holds to its GPU (``cuda:<rank % device_count>``) twice: from pageable memory
as they are, then after registering each tensor's memory with the driver
(``cudaHostRegister`` through ``torch.cuda.cudart()``), asynchronously. The
registration uses ``cudaHostRegisterReadOnly``: a zero-copy view is a
copy-on-write (``MAP_PRIVATE``) mapping, and pinning it writable would make
the kernel copy every page. Times are seconds (``time.perf_counter`` around
``torch.cuda.synchronize``), sizes bytes. Outside the end-to-end timing.
"""

from __future__ import annotations

import time

#: cudaHostRegisterReadOnly (CUDA >= 11.1): pin without write access
HOST_REGISTER_READ_ONLY = 8


def unavailable() -> str | None:
    """Why ``--device cuda`` cannot run in this interpreter, or None."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return "torch is not importable"
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} sees no CUDA device "
                f"(built with CUDA {torch.version.cuda or 'none'})")
    return None


def distinct_features(reqs) -> list:
    """The CPU tensors under ``mm_inputs.mm_items[*].feature`` of ``reqs``,
    one per memory block (the copies of a fan-out share theirs)."""
    import torch

    seen: dict[int, torch.Tensor] = {}
    for r in reqs or []:
        items = getattr(getattr(r, "mm_inputs", None), "mm_items", None) or []
        for it in items:
            f = getattr(it, "feature", None)
            if isinstance(f, torch.Tensor) and f.device.type == "cpu" and f.numel():
                seen.setdefault(f.data_ptr(), f)
    return list(seen.values())


def measure(tensors: list, rank: int) -> dict:
    """Copy ``tensors`` to this rank's GPU from pageable, then registered
    memory. Returns ``h2d_bytes``, ``h2d_pageable_s``, ``h2d_pinned_s``
    (None if registration failed), ``host_register_s``,
    ``host_unregister_s`` and ``h2d_error`` (the driver's error, or None)."""
    import torch

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    torch.ones(1, device=dev)  # the context, outside the timing
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    out = [t.to(dev) for t in tensors]
    torch.cuda.synchronize(dev)
    pageable = time.perf_counter() - t0
    del out
    cudart = torch.cuda.cudart()
    registered: list = []
    error = None
    t0 = time.perf_counter()
    for t in tensors:
        rc = int(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(),
                                         HOST_REGISTER_READ_ONLY))
        if rc:
            error = f"cudaHostRegister returned error {rc}"
            break
        registered.append(t)
    register = time.perf_counter() - t0
    pinned = None
    try:
        if error is None:
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            out = [t.to(dev, non_blocking=True) for t in tensors]
            torch.cuda.synchronize(dev)
            pinned = time.perf_counter() - t0
            del out
    finally:
        t0 = time.perf_counter()
        for t in registered:
            cudart.cudaHostUnregister(t.data_ptr())
        unregister = time.perf_counter() - t0
    return {"h2d_bytes": nbytes, "h2d_pageable_s": pageable, "h2d_pinned_s": pinned,
            "host_register_s": register, "host_unregister_s": unregister, "h2d_error": error}
