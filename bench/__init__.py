"""``mmshm bench``: inline transport against shared memory on the real request path.

A producer (the tokenizer's role) turns bundled photos into Qwen2-VL
``pixel_values``, fans each request out into ``n`` copies and sends them over
ZMQ to TP rank 0 of a gloo TP group of spawned processes, which broadcasts
them to the other ranks. Each run is set against the floor measured in the
same run (a warm memcpy of the payload plus a metadata-only broadcast). See
:mod:`mmshm.bench.runner` for what is timed and :mod:`mmshm.bench.modes` for
the transports.
"""

import contextlib

from .modes import MODES, Mode, get_mode, register

# vllm, vllm-arena: vLLM's own transport code (imports vllm only when run), registered
# here, after mmshm.bench.modes (which it imports) has loaded; importing any module
# of mmshm.bench runs this first
with contextlib.suppress(Exception):  # a broken optional module must not break the others
    from . import vllm_modes  # noqa: F401 - registers its modes
from .runner import (
    DEFAULT_IMAGES,
    DEFAULT_MODES,
    SWEEP,
    BenchConfig,
    BenchError,
    Reporter,
    run_bench,
)

__all__ = [
    "DEFAULT_IMAGES",
    "DEFAULT_MODES",
    "MODES",
    "SWEEP",
    "BenchConfig",
    "BenchError",
    "Mode",
    "Reporter",
    "get_mode",
    "register",
    "run_bench",
]
