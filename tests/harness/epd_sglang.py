"""SGLang encoder disaggregation (EPD) pairs for the real-server e2e tests.

One pair is two :class:`~tests.harness.servers.Server` process groups:

* the **encoder**: ``--encoder-only --encoder-transfer-backend
  zmq_to_scheduler`` at TP=1 (SGLang 0.5.23's default backend: it pushes
  each item's embedding to every TP rank of the language instance);
* the **language** instance: ``--language-only --encoder-urls <encoder>
  --encoder-bootstrap-port <free port>`` at TP=2, the one the client talks to.

Both run with ``SGLANG_HOST_IP=127.0.0.1`` (the encoder pushes to the address
SGLang detects for the host otherwise) and, as root with ``unshare`` and
``nsenter``, in ONE private mount namespace of the pair whose /dev/shm is a
tmpfs of the pair (:class:`MountNamespace`): the two instances are one node
for mmshm (its node identity includes the mount namespace, so two
``unshare -m`` namespaces that bind-mount one tmpfs would be two nodes, and
a handle of one is refused by the other: ``WrongNodeError``), and SGLang's
own leftovers of a TP=2 stop (``sgl_shm_mq_*``, ``sglang_loads_*``) never
reach the host's /dev/shm. Under ``mmshm run`` mmshm's segment directory is
that /dev/shm (``MMSHM_DIR=/dev/shm``).

The language instance's registry of encoders probes them every 10 s with a 2 s
timeout and drops one after 3 misses (``EncoderBootstrapServer``). The pairs
run with SGLang's defaults, so that a busy encoder dropped shows
(:class:`Pair`'s ``probe_timeout_s`` sets
``SGLANG_ENCODER_BOOTSTRAP_HEALTH_CHECK_TIMEOUT`` where a test wants another).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from tests.harness import servers

#: The language instance's TP size.
TP = 2


def encoder_argv(model, port: int, version: tuple[int, ...]) -> list[str]:
    """The encoder instance's command line: the CPU flags of
    :func:`~tests.harness.servers.sglang_argv` at TP=1, encoder only, the
    ``zmq_to_scheduler`` transfer backend."""
    return servers.sglang_argv(model, port, 1, version) + [
        "--encoder-only", "--encoder-transfer-backend", "zmq_to_scheduler"]


def language_argv(model, port: int, encoder_port: int, bootstrap_port: int,
                  version: tuple[int, ...], tp: int = TP) -> list[str]:
    """The language instance's command line at ``tp`` ranks, fed by the
    encoder on 127.0.0.1:``encoder_port``."""
    return servers.sglang_argv(model, port, tp, version) + [
        "--language-only", "--encoder-urls", f"http://127.0.0.1:{encoder_port}",
        "--encoder-bootstrap-port", str(bootstrap_port)]


class MountNamespace:
    """A private mount namespace whose /dev/shm is ``shm_dir`` (bind-mounted),
    held open by a ``sleep`` process of its own (its process group killed by
    :meth:`close`); :attr:`prefix` runs a command in it (``nsenter -m``), so
    that several process groups share it. Needs root, ``unshare`` and
    ``nsenter``."""

    def __init__(self, shm_dir: str | os.PathLike, timeout_s: float = 30.0):
        import subprocess

        from tests.harness.shm import private_shm_prefix

        self.proc = subprocess.Popen(
            private_shm_prefix(bind=shm_dir) + ["sleep", "86400"],
            start_new_session=True, stdin=subprocess.DEVNULL)
        servers._LIVE.add(self.proc.pid)  # killed at exit if a test fails half way
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # the exec happens after the mount
            try:
                with open(f"/proc/{self.proc.pid}/cmdline", "rb") as f:
                    if f.read().startswith(b"sleep"):
                        break
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"the mount namespace's holder exited with "
                                   f"{self.proc.returncode}")
            time.sleep(0.05)
        else:
            self.close()
            raise RuntimeError("the mount namespace's holder did not mount /dev/shm in time")
        self.prefix = ["nsenter", "-t", str(self.proc.pid), "-m", "--"]

    def close(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        servers._LIVE.discard(self.proc.pid)


#: Whether :class:`MountNamespace` can work here.
PRIVATE_SHM = servers.PRIVATE_SHM and shutil.which("nsenter") is not None


class Pair:
    """An encoder and a language instance, not started yet.

    Args:
        name: ``plain`` or ``mmshm``: the log files' and figures' prefix.
        model: the model directory.
        version: SGLang's release, as a tuple.
        logs: the folder of the logs (``<name>-encoder.log``,
            ``<name>-language.log``).
        mmshm: run both under ``mmshm run``.
        shm_size: the pair's private /dev/shm (tmpfs size, mount's syntax).
        extra_env: more environment for both instances (``MMSHM_*`` ...).
        probe_timeout_s: the language instance's encoder probe timeout
            (None: SGLang's default, 2 s).
    """

    def __init__(self, name: str, model, version: tuple[int, ...], logs: Path,
                 mmshm: bool, shm_size: str = "512m", extra_env: dict | None = None,
                 probe_timeout_s: float | None = None):
        self.name, self.mmshm = name, mmshm
        self.private = PRIVATE_SHM
        self.ns = None
        if self.private:
            self.shm = servers.mount_tmpfs(f"mmshm-epd-{name}-shm-", shm_size)
            seg_dir = "/dev/shm"
            try:
                self.ns = MountNamespace(self.shm)
            except BaseException:
                servers.unmount_tmpfs(self.shm)
                raise
        else:  # the host's /dev/shm: a private segment directory in it
            self.shm = Path(tempfile.mkdtemp(prefix=f"mmshm-epd-{name}-", dir="/dev/shm"))
            seg_dir = str(self.shm)
        prefix = self.ns.prefix if self.ns is not None else None
        self.encoder_port, lang_port = servers.free_port(), servers.free_port()
        self.bootstrap_port = servers.free_port()
        env = dict(SGLANG_HOST_IP="127.0.0.1", **(extra_env or {}))
        if probe_timeout_s is not None:
            env["SGLANG_ENCODER_BOOTSTRAP_HEALTH_CHECK_TIMEOUT"] = f"{probe_timeout_s:g}"
        if mmshm:
            env["MMSHM_DIR"] = seg_dir
        self.encoder = servers.Server(
            encoder_argv(model, self.encoder_port, version), self.encoder_port,
            logs / f"{name}-encoder.log", env=servers.sglang_env(**env), mmshm_run=mmshm,
            prefix=prefix, ready_timeout_s=400)
        self.language = servers.Server(
            language_argv(model, lang_port, self.encoder_port, self.bootstrap_port, version),
            lang_port, logs / f"{name}-language.log", env=servers.sglang_env(**env),
            mmshm_run=mmshm, prefix=prefix, ready_timeout_s=400)

    @property
    def servers(self) -> tuple:
        return (self.encoder, self.language)

    def encoder_url(self) -> str:
        return f"http://127.0.0.1:{self.encoder_port}"

    def wait_encoder_registered(self, timeout_s: float = 60.0) -> None:
        """Wait until the language instance's registry lists the encoder
        (``GET /list`` of its bootstrap server): one that was evicted while
        both were starting comes back at the next probe."""
        import json
        import urllib.request

        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{self.bootstrap_port}/list_encoder_urls", timeout=5) as r:
                    last = json.loads(r.read())
                if self.encoder_url() in json.dumps(last):
                    return
            except OSError as e:
                last = repr(e)
            time.sleep(1.0)
        raise AssertionError(f"the language instance does not list the encoder: {last}")

    def kill(self) -> None:
        for s in self.servers:
            s.kill()

    def files(self, patterns=("*",)) -> list[str]:
        """The regular files in the pair's /dev/shm matching ``patterns``."""
        import fnmatch

        try:
            names = os.listdir(self.shm)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)
                      and os.path.isfile(os.path.join(self.shm, n)))

    def clean_up(self) -> None:
        """Close the pair's mount namespace, unmount (or remove) its /dev/shm;
        the servers must be gone."""
        if self.ns is not None:
            self.ns.close()
        if self.private:
            servers.unmount_tmpfs(self.shm)
        else:
            shutil.rmtree(self.shm, ignore_errors=True)


def start_pairs(*pairs: Pair) -> None:
    """Start every instance of ``pairs`` side by side (encoders first), then
    wait for each language instance to list its encoder. On failure every
    instance is killed and the error raised."""
    every = [p.encoder for p in pairs] + [p.language for p in pairs]
    servers.start_all(*every)
    try:
        for p in pairs:
            p.wait_encoder_registered()
    except BaseException:
        for s in every:
            s.kill()
        raise


def log_count(server, pattern: str, since: int = 0) -> int:
    """How many times the regex ``pattern`` occurs in ``server``'s log past
    character ``since``."""
    return len(re.findall(pattern, server.log_text()[since:]))
