"""Instrumentors: one module per server, glue only.

Each server's module (``sglang.py``, ``vllm.py``) subclasses
:class:`mmshm.hooks.instrumentor.Instrumentor` and declares only what is its own:
the import package and distribution names, the supported release range (a
PEP 440 specifier), its :class:`~mmshm.hooks.instrumentor.Target` list, and the
wrappers that connect the server's call sites to the core. The machinery they
share is in the core, where a third server's integration uses it as is:

- :mod:`mmshm.hooks.instrumentor`: the version gate, the check of every target in
  the server's source before anything is imported, wrapt post-import hooks,
  ``instrument()`` / ``uninstrument()`` (all or nothing, idempotent);
- :mod:`mmshm.transport.sending`: one message's references (``sending()`` and its
  ``Outbox``), parallel sampling's shared segments (``fanning_out()``,
  ``fanned_out()``), the tensor-to-segment memo and content hashes;
- :mod:`mmshm.transport.receiving`: materializing in a decoder, an unpickler or a
  batch of requests, with each failure turned into that request's error;
- :mod:`mmshm.transport.broadcast`: the deferred unwrap around a ``broadcast_pyobj``.

On an unsupported version, or a symbol that moved, ``instrument()`` refuses
with :class:`UnsupportedVersionError` and patches nothing.

Instrumentors are found through entry points, as OpenTelemetry finds its
own: the ``mmshm.instrumentors`` group (mmshm's ``pyproject.toml`` registers
``sglang`` and ``vllm``; a third server's package registers its own, named
after the server's top-level import package). :func:`get` loads one by name.
"""

from __future__ import annotations

from mmshm.hooks.instrumentor import (  # noqa: F401 - the integrations' shared machinery
    Instrumentor,
    Target,
    UnsupportedVersionError,
    check_version,
    find_distribution,
    installed_version,
    load,
    registered,
)
from packaging.specifiers import SpecifierSet  # noqa: F401
from packaging.version import Version  # noqa: F401

_instances: dict[str, Instrumentor] = {}


def get(name: str) -> Instrumentor:
    """The (singleton) instrumentor registered as ``name`` (see
    :func:`mmshm.hooks.instrumentor.registered`: the ``mmshm.instrumentors`` entry
    points).

    Raises:
        ValueError: no instrumentor is registered as ``name`` (or it is
            registered inconsistently, see :func:`mmshm.hooks.instrumentor.load`).
        ImportError: its module cannot be imported.
    """
    if name not in _instances:
        _instances[name] = load(name)()
    return _instances[name]


def available() -> list[str]:
    """Names of the registered instrumentors whose server package is installed."""
    out = []
    for name in registered():
        try:
            if get(name).is_installed():
                out.append(name)
        except (ImportError, ValueError):
            continue
    return out
