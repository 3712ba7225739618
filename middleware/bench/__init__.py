"""``mmshm bench``: inline transport against shared memory on the real request path.

A producer (the tokenizer's role) turns bundled photos into Qwen2-VL
``pixel_values``, fans each request out into ``n`` copies and sends them over
ZMQ to TP rank 0 of a gloo TP group of spawned processes, which broadcasts
them to the other ranks. See :mod:`mmshm.bench.runner` for what is timed.
"""

from .modes import MODES, Mode, get_mode, register
from .runner import DEFAULT_IMAGES, DEFAULT_MODES, BenchConfig, BenchError, Reporter, run_bench

__all__ = [
           "DEFAULT_IMAGES",
           "DEFAULT_MODES",
           "MODES",
           "BenchConfig",
           "BenchError",
           "Mode",
           "Reporter",
           "get_mode",
           "register",
           "run_bench",
]
