"""``mmshm bench``: inline transport against shared memory on the real request path.

A producer (the tokenizer's role) turns bundled photos into Qwen2-VL
``pixel_values``, fans each request out into ``n`` copies and sends them over
ZMQ to TP rank 0 of a gloo TP group of spawned processes, which broadcasts
them to the other ranks. Each run is set against the floor measured in the
same run (a warm memcpy of the payload plus a metadata-only broadcast). See
:mod:`mmshm.bench.runner` for what is timed and :mod:`mmshm.bench.modes` for
the transports.
"""

from .modes import MODES, Mode, get_mode, register
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
