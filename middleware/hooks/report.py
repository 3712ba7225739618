"""What mmshm does in this process, said where the user sees it.

Every process that an instrumentor patches says once, per role it plays, one
line naming the server, its version, the process's role (``frontend``,
``EngineCore``, ``worker``, ``tokenizer``, ``scheduler``...) and the transport
paths that are on; every path left off is a WARNING of its own with the reason
and the fix. The same facts are exported as ``mmshm_path_enabled{server,
role,path}`` (1 on, 0 off), so a dashboard or a test can read them too.

Lines go to the ``mmshm`` logger. Under ``mmshm run`` that logger gets its own
stderr handler at INFO (:func:`configure_logging`), because a server's logging
set-up normally shows nothing of a library's INFO lines; embedded with
``mmshm.instrument()``, the application's logging configuration decides.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("mmshm")

#: Set by ``mmshm run`` in the environment of the command it runs.
ENV_RUN = "MMSHM_RUN"

_LOCK = threading.Lock()
_said: set[tuple[str, str]] = set()
_warned: set[tuple[str, str, str]] = set()
_configured = False


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        msg = msg.removeprefix("mmshm: ")
        level = "" if record.levelno == logging.INFO else f"{record.levelname} "
        return f"mmshm[{record.process}] {level}{msg}"


def configure_logging(force: bool = False) -> None:
    """Under ``mmshm run`` (``MMSHM_RUN`` set) or with ``force``, give the
    ``mmshm`` logger a stderr handler at INFO, unless the application already
    gave it one. Idempotent."""
    global _configured
    with _LOCK:
        if _configured or not (force or os.environ.get(ENV_RUN)):
            return
        _configured = True
        if log.handlers:
            return
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(_Formatter())
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def _gauge(server: str, role: str, path: str, value: int) -> None:
    try:
        from mmshm.metrics import PATH_ENABLED

        PATH_ENABLED.labels(server=server, role=role, path=path).set(value)
    except Exception as exc:  # noqa: BLE001 - reporting never breaks a server
        log.debug("mmshm: path gauge not set: %s", exc)


def paths(server: str, version, role: str, on: list[str] | tuple[str, ...],
          off: list[tuple[str, str, str]] | tuple = ()) -> bool:
    """Say, once per ``(server, role)`` in this process, which paths are on.

    Args:
        server: ``"vllm"``, ``"sglang"``.
        version: the server's version (anything with ``str()``).
        role: this process's role for the server (``"frontend"``,
            ``"EngineCore"``, ``"worker"``...).
        on: descriptions of the paths turned on (short phrases).
        off: ``(path, reason, fix)`` for each path left off; each is a WARNING.
    Returns:
        Whether the line was written now (False: said before).
    """
    key = (server, role)
    with _LOCK:
        if key in _said:
            return False
        _said.add(key)
    head = f"mmshm: {server} {version}, {role} (pid {os.getpid()})"
    if on:
        log.info("%s: on: %s", head, "; ".join(on))
    for path in on:
        _gauge(server, role, path, 1)
    for path, reason, fix in off:
        path_off(server, version, role, path, reason, fix)
    if not on and not off:
        log.info("%s: instrumented, no path active in this process", head)
    return True


def path_off(server: str, version, role: str, path: str, reason: str, fix: str) -> None:
    """A WARNING (once per path and process) that ``path`` is off, why, and
    the fix; ``mmshm_path_enabled`` is set to 0 for it."""
    key = (server, role, path)
    with _LOCK:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("mmshm: %s %s, %s (pid %d): %s is OFF: %s. Fix: %s", server, version, role,
                os.getpid(), path, reason, fix)
    _gauge(server, role, path, 0)


def not_instrumented(server: str, reason: str) -> None:
    """A WARNING that ``server`` runs uninstrumented in this process."""
    log.warning("mmshm: %s is not instrumented in this process (pid %d, %s): %s", server,
                os.getpid(), sys.executable, reason)


def _reset_for_tests() -> None:
    with _LOCK:
        _said.clear()
        _warned.clear()
