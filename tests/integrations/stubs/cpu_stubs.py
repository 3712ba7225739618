"""The CPU stand-ins on the path, in one place: used by the integration tests
(``tests/integrations/sglang_env.py``) and by ``mmshm bench``'s ``sglang``
mode (``mmshm.bench.modes``) to import SGLang on a host without a GPU."""

from __future__ import annotations

import os
import sys

#: The stubs directory (triton, torchvision, sgl_kernel, torchaudio).
HERE = os.path.dirname(os.path.abspath(__file__))


def use(export: bool = False) -> None:
    """Put the stub packages first on ``sys.path`` (and, with ``export``, on
    ``PYTHONPATH`` for child processes), and keep torch from believing triton
    exists: ``torch.utils._triton.has_triton_package()`` is cached, so it is
    called once while ``triton`` is hidden, and torch's compiler never
    imports the stub."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    if export:
        pp = os.environ.get("PYTHONPATH", "")
        if HERE not in pp.split(os.pathsep):
            os.environ["PYTHONPATH"] = HERE + (os.pathsep + pp if pp else "")
    import torch.utils._triton as tt

    saved = sys.modules.get("triton", False)
    sys.modules["triton"] = None  # type: ignore[assignment]
    try:
        tt.has_triton_package()  # functools.cache: False from now on
    finally:
        if saved is False:
            del sys.modules["triton"]
        else:
            sys.modules["triton"] = saved


# -- a real server on a host without CUDA (the server environments' .pth) ------------
#: The SGLang module whose host KV pool allocator :func:`install_hooks` replaces.
HOST_POOL = "sglang.srt.mem_cache.pool_host.common"


def host_pool_alloc(dims: tuple, dtype, device: str, pin_memory: bool, allocator,
                    registration_granularity_bytes: int | None = None):
    """SGLang's ``alloc_with_host_register`` without its page pinning: the
    host KV pool's buffer (shape ``dims``, ``dtype``, in CPU memory) from
    the pool's own allocator. Pinning (``cudaHostRegister`` through
    ``torch.cuda.cudart()``) only makes CUDA copies faster, and a torch
    built without CUDA raises ``AssertionError: Torch not compiled with CUDA
    enabled`` there: SGLang 0.5.23's PD decode instance builds this pool
    for KV kept across a retraction (``--disaggregation-decode-retraction-backup
    host_pool``, the default), so ``--disaggregation-mode decode`` stops at
    start-up on CPU without this."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def _patch_host_pool(module) -> None:
    import torch

    if not torch.cuda.is_available():
        # ALLOC_MEMORY_FUNCS is a defaultdict keyed by the transfer device's
        # type, imported by name into the pool modules: one entry for "cpu"
        module.ALLOC_MEMORY_FUNCS["cpu"] = host_pool_alloc


def install_hooks() -> None:
    """Post-import hooks (wrapt) for the SGLang code a CPU-only server cannot
    run as it is; called at interpreter start by ``zzz_cpu_stubs.pth`` in
    the server environments (``python -m tests.run sglang``).
    Only :data:`HOST_POOL`: its host KV pool allocator, on a host without
    CUDA, becomes :func:`host_pool_alloc`."""
    import wrapt

    wrapt.register_post_import_hook(_patch_host_pool, HOST_POOL)
