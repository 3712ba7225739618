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
