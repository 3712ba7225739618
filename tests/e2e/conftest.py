"""End-to-end tests against real servers.

They run only from their runners, in the server's own virtual environment,
with ``MMSHM_E2E`` naming the server (``tests.harness.servers.needs_e2e``);
elsewhere (the main suite's environment has no server) they skip with that
reason. The harness they share (servers, faults, the model matrix, the tiny
models) is ``tests/harness``.

Servers are shared by the tests of a module (a start costs 25-130 s on two
cores), so the main suite's per-test private segment directory does not
apply here: each server gets a private segment directory of its own, which
the tests check is empty after a stop.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def shm_dir():
    """Overrides the main suite's per-test segment directory (see above)."""
    yield None
