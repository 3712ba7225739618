"""A ``mooncake_master`` on 127.0.0.1 for the encoder cache's Mooncake Store
leg (docs/epd-nodes.md), shared by ``mmshm bench epd``'s cross-node row
(:mod:`mmshm.bench.epd_nodes`) and the tests (``tests/harness/mooncake.py``):
find the binary the engine's wheel ships, start it on free ports in a process
group of its own, hand out the connector settings that name it, SIGKILL the
group on every way out.

A started master is registered with the server starter's atexit hook
(:data:`mmshm.bench.serve.servers._LIVE`), so a run that fails half way
leaves no master listening. Importing this module loads no torch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

#: How long the master may take to listen on its RPC and metadata ports, s.
START_TIMEOUT_S = 15.0


def master_binary() -> str | None:
    """The ``mooncake_master`` of the engine's wheel (beside ``mooncake/``),
    else the one on PATH; None when there is none."""
    try:
        import mooncake
    except ImportError:
        return shutil.which("mooncake_master")
    path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    return path if os.access(path, os.X_OK) else shutil.which("mooncake_master")


def wait_port(port: int, deadline: float, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` accepts a TCP connection before ``deadline``
    (``time.monotonic()``)."""
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


def kill_group(p: subprocess.Popen | None) -> None:
    """SIGKILL ``p``'s process group (``p`` started with
    ``start_new_session=True``) and reap it within 10 s; None, a gone group or
    one that is not ours is a no-op."""
    if p is None:
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _free_port() -> int:
    from mmshm.bench.serve.servers import free_port

    return free_port()


class Master:
    """One ``mooncake_master`` bound to 127.0.0.1: RPC, HTTP metadata and
    metrics each on a free port, its output in ``log_path`` (default: none),
    ``binary`` the executable (default: :func:`master_binary`).
    Use as a context manager, or :meth:`start` then :meth:`kill` in a
    ``finally``."""

    def __init__(self, log_path: str | os.PathLike | None = None,
                 binary: str | None = None):
        self.rpc, self.meta, self.metrics_port = _free_port(), _free_port(), _free_port()
        self.log_path = Path(log_path) if log_path else None
        self.binary = binary
        self.proc: subprocess.Popen | None = None
        self.killed_at: float | None = None

    def argv(self) -> list[str]:
        """The command line. Raises FileNotFoundError when there is no binary."""
        binary = self.binary or master_binary()
        if binary is None:
            raise FileNotFoundError("no mooncake_master binary (the Mooncake engine's wheel)")
        return [binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc}",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.meta}", "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}"]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Master:
        """Start the master and wait until its RPC and metadata ports accept
        connections. Raises RuntimeError (the group killed first) when it
        exits or does not listen within ``timeout_s``, FileNotFoundError when
        there is no binary."""
        from mmshm.bench.serve.servers import _LIVE

        argv = self.argv()
        with (open(self.log_path, "ab") if self.log_path
              else contextlib.nullcontext(subprocess.DEVNULL)) as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        _LIVE.add(self.proc.pid)
        end = time.monotonic() + timeout_s
        if not (wait_port(self.rpc, end) and wait_port(self.meta, end)):
            rc = self.proc.poll()
            self.kill()
            raise RuntimeError(f"mooncake_master did not listen within {timeout_s} s "
                               f"(exit status {rc}; log {self.log_path})")
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the master's whole process group and reap it (idempotent)."""
        if self.proc is None:
            return
        from mmshm.bench.serve.servers import _LIVE

        kill_group(self.proc)
        if self.killed_at is None:
            self.killed_at = time.monotonic()
        _LIVE.discard(self.proc.pid)

    def extra(self, **kw) -> dict:
        """The connector's Store settings naming this master (TCP on
        127.0.0.1, small segments; ``kw`` adds or overrides):
        ``ec_connector_extra_config`` keys of docs/epd-nodes.md."""
        return {"master_server_address": f"127.0.0.1:{self.rpc}",
                "metadata_server": f"http://127.0.0.1:{self.meta}/metadata",
                "mooncake_protocol": "tcp", "local_hostname": "127.0.0.1",
                "global_segment_size": "64MB", "local_buffer_size": "32MB",
                "store_read_buffer_bytes": "16MB", "store_timeout_s": 2.0, **kw}

    def __enter__(self):  # -> Master
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
