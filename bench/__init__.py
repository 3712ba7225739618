"""``mmshm bench``: inline transport against shared memory on the real request path.

A producer (the tokenizer's role) turns bundled photos into Qwen2-VL
``pixel_values``, fans each request out into ``n`` copies and sends them over
ZMQ to TP rank 0 of a gloo TP group of spawned processes, which broadcasts
them to the other ranks. Each run is set against the floor measured in the
same run (a warm memcpy of the payload plus a metadata-only broadcast). See
:mod:`mmshm.bench.runner` for what is timed, :mod:`mmshm.bench.modes` for
the transports and :mod:`mmshm.bench.mixed` for the mixed-size workload.

The package's names load on first use (PEP 562), so that importing one of
its modules that needs no torch (:mod:`mmshm.bench.serve` and its server
starter, which the test harness imports) loads no torch. The first use of a
name of :mod:`mmshm.bench.modes` or :mod:`mmshm.bench.runner` also registers
the modes that run vLLM's own transport code (:mod:`mmshm.bench.vllm_modes`,
which imports vLLM only when one runs); the bench hands its TP ranks the mode
classes it runs, so a spawned rank loads the module of each.
"""

from __future__ import annotations

import contextlib

#: public name -> the module of this package that defines it
_LAZY = {
    "MODES": "modes",
    "Mode": "modes",
    "get_mode": "modes",
    "register": "modes",
    "DEFAULT_IMAGES": "runner",
    "DEFAULT_MODES": "runner",
    "SWEEP": "runner",
    "BenchConfig": "runner",
    "BenchError": "runner",
    "Reporter": "runner",
    "run_bench": "runner",
}

__all__ = sorted(_LAZY)

_registered = False


def _register_optional_modes() -> None:
    """Import the modules that register optional modes (once per process);
    a broken optional module must not break the others."""
    global _registered
    if not _registered:
        _registered = True
        with contextlib.suppress(Exception):
            from . import vllm_modes  # noqa: F401 - registers its modes


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module == "modes":
        from . import modes as mod
    else:
        from . import runner as mod
    value = getattr(mod, name)
    _register_optional_modes()
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
