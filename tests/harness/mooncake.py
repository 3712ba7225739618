"""A test-owned ``mooncake_master`` on 127.0.0.1 for the Mooncake Store leg of
the encoder cache (docs/epd-nodes.md). The one implementation is the
product's, :mod:`mmshm.bench.mooncake_master` (``mmshm bench epd``'s
cross-node row starts its master with it; importing it loads no torch):
find the binary the engine's wheel ships, start it on free ports in a process
group of its own, hand out the connector settings that name it, SIGKILL the
group on every way out.

The master is killed with the test session too (it is registered with the
server harness's atexit hook, :data:`mmshm.bench.serve.servers._LIVE`), so a
test that fails half way leaves no master listening. What is the tests' own:
:func:`engine_missing`, the reason a test skips.
"""

from __future__ import annotations

import sys

from mmshm.bench.mooncake_master import (  # noqa: F401  (the harness's names)
    START_TIMEOUT_S,
    Master,
    kill_group,
    master_binary,
    wait_port,
)


def engine_missing() -> str | None:
    """Why this interpreter cannot run the Store leg (None: it can): the
    Mooncake engine does not load (the wheel, or Debian's libibverbs1,
    libnl-3-200, libnl-route-3-200), or its wheel has no ``mooncake_master``."""
    from mmshm.transport import ec_store

    try:
        ec_store.load_engine()
    except (ImportError, OSError) as exc:
        return (f"the Mooncake engine cannot be loaded in {sys.executable} ({exc}): "
                f"{ec_store._FIX_ENGINE}")
    if master_binary() is None:
        return "no mooncake_master binary (the engine's wheel, or PATH)"
    return None
