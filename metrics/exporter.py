"""Exposition of mmshm's metrics: :func:`render` and a standalone HTTP exporter.

Which registry is exposed:

* single-process mode: prometheus-client's default ``REGISTRY`` (mmshm's
  families plus whatever else the process registered, and the process/GC
  collectors);
* multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set before prometheus-client
  was imported): a private registry holding a ``MultiProcessCollector`` over
  that directory, i.e. the series of every process that writes there, merged.
  mmshm's ``mmshm_dir_*`` gauges are refreshed in this process right before
  each collection.

When a server already exposes ``/metrics`` with a ``MultiProcessCollector``
(SGLang with ``--enable-metrics``), no exporter is needed: mmshm's series are
in that output.
"""

from __future__ import annotations

import errno
import logging
import os
import threading

log = logging.getLogger("mmshm")

DEFAULT_ADDR = "127.0.0.1"

# prometheus_client is imported inside the functions: importing it fixes the
# process's storage mode (see mmshm.metrics), which must wait for init().
_lock = threading.Lock()
_mp_registry = None  # CollectorRegistry with the multiprocess collector
_server = None  # (httpd, thread) of this process's exporter
#: the mmshm.metrics package, handed over once its metrics exist (:func:`attach`):
#: what a scrape refreshes, and the storage mode. This module imports nothing of
#: the package (the package imports it).
_package = None


def attach(package) -> None:
    """Called by :mod:`mmshm.metrics` at its import, with itself."""
    global _package
    _package = package


class _RefreshingMultiProcessCollector:
    """``MultiProcessCollector`` that refreshes this process's scrape-time
    gauges first."""

    def __init__(self, path: str):
        from prometheus_client import multiprocess

        self._inner = multiprocess.MultiProcessCollector(None, path=path)

    def collect(self):
        try:
            _package.refresh()
        except Exception as exc:  # noqa: BLE001 - never fail a scrape over this
            log.debug("mmshm: refreshing metrics failed: %s", exc)
        return self._inner.collect()


def _multiproc_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")


def registry():
    """The registry mmshm exposes in this process (see the module docstring).
    Creates mmshm's metrics if they do not exist yet."""
    global _mp_registry
    from prometheus_client import REGISTRY, CollectorRegistry

    if not _package.multiprocess_enabled():
        return REGISTRY
    with _lock:
        if _mp_registry is None:
            reg = CollectorRegistry(auto_describe=False)
            reg.register(_RefreshingMultiProcessCollector(_multiproc_dir()))
            _mp_registry = reg
        return _mp_registry


def render() -> bytes:
    """Text exposition (format 0.0.4) of :func:`registry`, as an exporter
    scrape would return it."""
    from prometheus_client import generate_latest

    return generate_latest(registry())


def start_exporter(port: int, addr: str = DEFAULT_ADDR):
    """Serve :func:`registry` over HTTP at ``http://addr:port/metrics`` from a
    daemon thread of this process.

    ``port`` 0 picks a free port; read it from the returned server's
    ``server_port``. Starting it again in the same process returns the running
    server (whatever the arguments). Binds to loopback unless ``addr`` says
    otherwise (``0.0.0.0`` to let a Prometheus on another host scrape it).

    Returns:
        The ``wsgiref`` server object (``server_port``, ``shutdown()``).
    Raises:
        OSError: the address is in use or cannot be bound.
    """
    global _server
    from prometheus_client import start_http_server

    with _lock:
        if _server is not None:
            return _server[0]
    httpd, thread = start_http_server(int(port), addr=addr, registry=registry())
    with _lock:
        if _server is None:
            _server = (httpd, thread)
            log.info("mmshm: metrics exporter listening on http://%s:%d/metrics",
                     addr, httpd.server_port)
            return httpd
    httpd.shutdown()  # lost a race with another thread
    httpd.server_close()
    return _server[0]


def stop_exporter() -> None:
    """Stop this process's exporter, if any (tests)."""
    global _server
    with _lock:
        srv, _server = _server, None
    if srv is not None:
        srv[0].shutdown()
        srv[0].server_close()


def maybe_start_exporter_from_env():
    """Start the exporter if ``MMSHM_METRICS_PORT`` is set (``0`` = any free
    port), on ``MMSHM_METRICS_ADDR`` (default ``127.0.0.1``).

    Meant for a process start-up hook: it never raises. If the port is taken
    (typically: another process of the same server got it first) it logs and
    returns None; with ``PROMETHEUS_MULTIPROC_DIR`` set, the process that holds
    the port serves every process's series anyway.

    Returns:
        The server (see :func:`start_exporter`) or None.
    """
    raw = os.environ.get("MMSHM_METRICS_PORT", "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
        if not 0 <= port <= 65535:
            raise ValueError(raw)
    except ValueError:
        log.warning("mmshm: ignoring MMSHM_METRICS_PORT=%r (not a port number)", raw)
        return None
    addr = os.environ.get("MMSHM_METRICS_ADDR", "").strip() or DEFAULT_ADDR
    try:
        return start_exporter(port, addr)
    except OSError as exc:
        if _multiproc_dir() and exc.errno == errno.EADDRINUSE:
            # the usual case: another process of this server bound it first, and
            # it serves every process's series (one PROMETHEUS_MULTIPROC_DIR)
            log.info("mmshm: metrics on %s:%s are served by another process of this server "
                     "(the port is taken; they share PROMETHEUS_MULTIPROC_DIR)", addr, port)
        else:
            level = logging.INFO if _multiproc_dir() else logging.WARNING
            log.log(level, "mmshm: metrics exporter not started on %s:%s: %s", addr, port, exc)
        return None
