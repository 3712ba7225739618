"""The Mooncake Store leg on a stand-in engine, for the module-level tests of
the EC connector's Store leg (tests/test_ec_connector_store.py,
tests/test_probes_ec_store_leg.py): the real
:class:`~mmshm.transport.ec_store.StoreTier` on tests/test_ec_store.py's
``FakeEngine`` (a dict), and one segment directory per simulated node, each
with its :class:`~mmshm.transport.encoder_cache.EncoderCache`.

Unlike the rest of the harness this module loads torch at import (through
``mmshm.transport``): tests/conftest.py's ``store`` and ``nodes`` fixtures
import it when a test asks for them."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from mmshm.transport import ec_connector, ec_store
from mmshm.transport.encoder_cache import EncoderCache

from tests.test_ec_store import FakeEngine


class Engine(FakeEngine):
    """The stand-in engine with ``remove``, a health switch (``healthy``), and
    a hook run between a read's ``get_size`` and its get (``between``, called
    once with the key: a removal racing the read)."""

    def __init__(self):
        super().__init__()
        self.healthy = True
        self.between = None

    def health_check(self):
        return 0 if self.healthy else -1

    def remove(self, k):
        return 0 if self.objects.pop(k, None) is not None else -704

    def batch_get_into_multi_buffers(self, keys, all_ptrs, all_sizes):
        if self.between is not None:
            hook, self.between = self.between, None
            hook(keys[0])
        return super().batch_get_into_multi_buffers(keys, all_ptrs, all_sizes)


@contextlib.contextmanager
def stand_in_store(monkeypatch, server: str) -> Iterator[tuple[Engine, Callable]]:
    """``(engine, tier(timeout_s=0.5, keep_s=None, **extra))``: ``tier()``
    opens a started client of one stand-in Store through
    :func:`mmshm.transport.ec_connector.open_tier` for ``server`` (``extra``
    adds or overrides ``ec_connector_extra_config`` keys); every client is
    closed on the way out, the engine's gate opened first. A listening socket
    stands for the master's TCP port; the HTTP probe and the engine's loading
    are patched through ``monkeypatch``."""
    srv = socket.create_server(("127.0.0.1", 0))  # the tier's TCP probe of the "master"
    monkeypatch.setattr(ec_store, "_probe_http", lambda url, timeout: None)
    eng = Engine()
    monkeypatch.setattr(ec_store, "load_engine", lambda: (lambda: eng))
    tiers = []

    def tier(timeout_s: float = 0.5, keep_s: float | None = None, **more):
        extra = {"master_server_address": f"127.0.0.1:{srv.getsockname()[1]}",
                 "local_hostname": "127.0.0.1", "local_buffer_size": "1MB",
                 "store_read_buffer_bytes": "1MB", "store_timeout_s": timeout_s, **more}
        t = ec_connector.open_tier(extra, server, keep_s)
        assert t is not None
        tiers.append(t)
        assert t.wait_connected(5)
        return t

    try:
        yield eng, tier
    finally:
        eng.gate.set()
        eng.healthy = True
        for t in tiers:
            t.close(timeout=5)
        srv.close()


@contextlib.contextmanager
def node_caches(tmp_path: Path, server: str) -> Iterator[Callable[..., EncoderCache]]:
    """``cache(name, keep_s=60)``: an encoder cache (namespace ``model``) on
    node ``name``'s segment directory under ``tmp_path``. On the way out every
    cache is closed and no ``mmshm*`` segment may be left in any node's
    directory (AssertionError naming them)."""
    caches = []

    def cache(name: str, keep_s: float = 60.0) -> EncoderCache:
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        c = EncoderCache(str(d), server=server, keep_s=keep_s, namespace="model")
        caches.append(c)
        return c

    yield cache
    for c in caches:
        c.close()
    left = [p.name for d in tmp_path.iterdir() if d.is_dir() for p in d.iterdir()
            if p.name.startswith("mmshm")]
    assert left == [], f"segments left: {left}"
