"""End-to-end tests against real servers.

They run only from their runner scripts (``tests/e2e/run_vllm_e2e.sh``, which
``tests/integrations/run_vllm.sh`` calls), in the server's own virtual
environment, with ``MMSHM_E2E`` naming the server; elsewhere (the main
suite's environment has no server) they skip with that reason.

Servers are shared by the tests of a module (a start costs 40-130 s on two
cores), so the main suite's per-test private segment directory does not
apply here: each server gets a private segment directory of its own, which
the tests check is empty after a stop.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def shm_dir():
    """Overrides the main suite's per-test segment directory (see above)."""
    yield None


def needs_e2e(server: str):
    return pytest.mark.skipif(os.environ.get("MMSHM_E2E") != server,
                              reason=f"real-server e2e test: run by its runner script with "
                                     f"MMSHM_E2E={server} in the server's environment")
