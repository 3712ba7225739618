"""Layer 2, the hooks: how mmshm places itself in a server and says what it does.

In dependency order:

- :mod:`~mmshm.hooks.report`: the one "on:" line per process and role, a WARNING
  per path left off, ``mmshm_path_enabled``;
- :mod:`~mmshm.hooks.observe`: the hop timer (seconds and bytes per IPC hop, for
  the server's transport and for mmshm's) and the byte taps;
- :mod:`~mmshm.hooks.instrumentor`: the :class:`Instrumentor` base class, its
  target table (one row per patched function) and the registry of installed
  instrumentors (the ``mmshm.instrumentors`` entry points).

May import: :mod:`mmshm.errors`, :mod:`mmshm.config`, :mod:`mmshm.metrics`, and
modules listed before it here.
Knows no transport: it never imports :mod:`mmshm.segments` or
:mod:`mmshm.transport` (the transport reports its bytes to the hop timer).
"""
