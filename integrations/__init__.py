"""Instrumentors: one module per server, glue only.

Each server's module (``sglang.py``, ``vllm.py``) subclasses
:class:`mmshm.instrumentor.Instrumentor` and declares only what is its own:
the import package and distribution names, the supported release range (a
PEP 440 specifier), its :class:`~mmshm.instrumentor.Target` list, and the
wrappers that connect the server's call sites to the core. The machinery they
share is in the core, where a third server's integration uses it as is:

- :mod:`mmshm.instrumentor`: the version gate, the check of every target in
  the server's source before anything is imported, wrapt post-import hooks,
  ``instrument()`` / ``uninstrument()`` (all or nothing, idempotent);
- :mod:`mmshm.sending`: one message's references (``sending()`` and its
  ``Outbox``), parallel sampling's shared segments (``fanning_out()``,
  ``fanned_out()``), the tensor-to-segment memo and content hashes;
- :mod:`mmshm.receiving`: materializing in a decoder, an unpickler or a
  batch of requests, with each failure turned into that request's error;
- :mod:`mmshm.broadcast`: the deferred unwrap around a ``broadcast_pyobj``.

On an unsupported version, or a symbol that moved, ``instrument()`` refuses
with :class:`UnsupportedVersionError` and patches nothing.
"""

from __future__ import annotations

import importlib

from mmshm.instrumentor import (  # noqa: F401 - the integrations' shared machinery
    Instrumentor,
    Target,
    UnsupportedVersionError,
    check_version,
    find_distribution,
    installed_version,
)
from packaging.specifiers import SpecifierSet  # noqa: F401
from packaging.version import Version  # noqa: F401

REGISTRY: dict[str, str] = {
    "sglang": "mmshm.integrations.sglang:SGLangInstrumentor",
    "vllm": "mmshm.integrations.vllm:VLLMInstrumentor",
}
_instances: dict[str, object] = {}


def get(name: str):
    """The (singleton) instrumentor called ``name``."""
    if name not in _instances:
        try:
            target = REGISTRY[name]
        except KeyError:
            raise ValueError(f"unknown instrumentor {name!r}; known: {sorted(REGISTRY)}") from None
        mod, cls = target.split(":")
        _instances[name] = getattr(importlib.import_module(mod), cls)()
    return _instances[name]


def available() -> list[str]:
    """Names of instrumentors whose server package is installed."""
    out = []
    for name in REGISTRY:
        try:
            if get(name).is_installed():
                out.append(name)
        except ImportError:
            continue
    return out
