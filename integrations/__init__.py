"""Instrumentors: one package per server, glue only, all of one shape.

``sglang/`` and ``vllm/`` (a third server copies them) each hold the same files:
``__init__.py`` (the :class:`~mmshm.hooks.instrumentor.Instrumentor` subclass,
its one table of :class:`~mmshm.hooks.instrumentor.Target` rows, each naming the
shm-mode wrapper, the observe-mode wrapper and the hop timer, and an index of
the hooks), ``server.py`` (the server's own names), ``requests.py`` (frontend ->
scheduler/engine), ``workers.py`` (the TP/worker path), ``pd.py`` (PD
disaggregation), ``epd.py`` (encoder disaggregation, on
:mod:`mmshm.transport.handoff` and :mod:`mmshm.transport.encoder_cache`),
``timing.py`` (the hops, :func:`mmshm.hooks.observe.timed`)
and ``roles.py`` (each process's "on:" line, one
:class:`~mmshm.hooks.instrumentor.Role` record). The machinery they share is in
the core: :mod:`mmshm.hooks` (the version gate, the source check, wrapt
post-import hooks, the mode dispatch, the hop timer, the "on:" line) and
:mod:`mmshm.transport` (references, fan-out, materializing, the deferred unwrap).
Per-server notes: docs/sglang.md, docs/vllm.md.

On an unsupported version, or a symbol that moved, ``instrument()`` refuses
with :class:`UnsupportedVersionError` and patches nothing.

Instrumentors are found through entry points, as OpenTelemetry finds its
own: the ``mmshm.instrumentors`` group (mmshm's ``pyproject.toml`` registers
``sglang`` and ``vllm``; a third server's package registers its own, named
after the server's top-level import package). :func:`get` loads one by name
(:func:`mmshm.hooks.instrumentor.get`).
"""

from __future__ import annotations

from mmshm.hooks.instrumentor import (  # noqa: F401 - the integrations' shared machinery
    Instrumentor,
    Target,
    UnsupportedVersionError,
    _instances,
    available,
    check_version,
    find_distribution,
    get,
    installed_version,
    load,
    registered,
)
from packaging.specifiers import SpecifierSet  # noqa: F401
from packaging.version import Version  # noqa: F401
