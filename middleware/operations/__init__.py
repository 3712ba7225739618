"""Layer 6, operations: what a person runs around a server.

- :mod:`~mmshm.operations.status`: ``mmshm status`` (segments, processes, space);
- :mod:`~mmshm.operations.doctor`: ``mmshm doctor`` (what is wrong, and the fix);
- :mod:`~mmshm.operations.autopatch`: ``mmshm run`` (the start-up hook that
  instruments a server) and ``mmshm.instrument()``.

May import: every lower layer, :mod:`mmshm.integrations` included; never
:mod:`mmshm.cli`. :mod:`mmshm.bench` is its peer on the same layer.
"""
