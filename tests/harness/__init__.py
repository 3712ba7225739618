"""One harness for every test: what used to be copied between test files.

Modules (each light to import: torch and mmshm are imported where used):

* :mod:`~tests.harness.ports` — a free TCP port on 127.0.0.1.
* :mod:`~tests.harness.segments` — listing and reading mmshm's segment files,
  files live processes map, waiting for files to go.
* :mod:`~tests.harness.metrics` — reading Prometheus samples from the
  default registry, another registry or an exposition's text.
* :mod:`~tests.harness.shm` — a private /dev/shm: ``unshare -m`` with a small
  tmpfs mounted on /dev/shm (Docker's 64 MiB), and whether this host can.
* :mod:`~tests.harness.procs` — child processes: spawned gloo process groups
  on 127.0.0.1 with bounded timeouts, single children, forkserver workers,
  and the pids the conftest's /dev/shm check covers.
* :mod:`~tests.harness.tensors` — deterministic tensors and byte-exact compares.
* :mod:`~tests.harness.children` — spawn targets of the core tests (TP ranks,
  hand-overs, faults).
* :mod:`~tests.harness.workers` — forkserver workers of the fault tests.
* ``servers``, ``models``, ``faults``, ``matrix`` — the e2e tests' real
  servers, tiny models, server faults and model matrix.

:data:`ROOT` is the repository root (the runner and the scripts run from it).
"""

from __future__ import annotations

from pathlib import Path

#: The repository root.
ROOT = Path(__file__).resolve().parents[2]
