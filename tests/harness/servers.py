"""Real servers for the end-to-end tests: start, wait, query, stop, always kill.

The server starter itself is the product's (:mod:`mmshm.bench.serve.servers`,
which ``mmshm bench serve`` starts its servers with); this module re-exports
it and adds what only the tests need. A :class:`Server` runs one server command line (optionally under
``mmshm run``) in a process group of its own, bound to 127.0.0.1, with its
output in a log file. Every way out kills the whole group by its pid
(``os.killpg``): a normal :meth:`Server.stop` sends the stop signal and waits
up to a bound, then SIGKILLs what is left; ``__exit__`` and the module's
``atexit`` hook do the same if a test failed half way, so no server outlives
the test session.

Helpers for the requests: :func:`data_url` turns a ``PIL.Image`` into a
base64 data URL the OpenAI client sends, :func:`metric` reads one series
from a Prometheus exposition, :func:`segments` lists mmshm's segment files.

Sharing the two cores: :func:`start_all` starts several servers side by
side (a start is mostly one process at a time importing Python and loading
a model, so two take little more than one), :func:`in_parallel` runs their
requests side by side; :func:`private_shm_prefix` gives a server a private
/dev/shm (a tmpfs of :func:`mount_tmpfs`), and :func:`host_shm_new` says what
servers left in the host's /dev/shm. :func:`needs_e2e` marks a test that
needs a real server.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

# The server starter is the product's (``mmshm bench serve`` starts its servers
# with it): one Server, one atexit hook that kills every live group, one _LIVE set.
from mmshm.bench.serve import servers as _product
from mmshm.bench.serve.servers import (  # noqa: E402,F401 - re-exported for the tests
    ROOT,
    _LIVE,
    Server,
    ServerDied,
    _kill_all,
    data_url,
    free_port,
    mapped_shm_names,
    metric,
    series,
    sglang_env,
    vllm_argv,
    vllm_env,
)


#: The start-up dummy image of the tests' vLLM servers (``vllm_argv``'s
#: ``dummy_image``): 720p, the largest photo they are sent.
DUMMY_720P = (1280, 720)


#: SGLang releases whose real servers keep SGLang's default idle loop (the
#: scheduler spinning on its sockets): 0.5.9's one-node run, so that mmshm's
#: scheduler hooks stay covered under the default as well.
SPINNING_RELEASES = {(0, 5, 9)}


def sglang_argv(model: str, port: int, tp: int, version: tuple[int, ...], **kw) -> list[str]:
    """The product's :func:`~mmshm.bench.serve.servers.sglang_argv` with
    SGLang's ``--sleep-on-idle`` on, except for :data:`SPINNING_RELEASES`.
    The tests run several servers at once on two cores (a family's baseline
    and mmshm server, PD and EPD pairs, two nodes), and an idle SGLang TP=2
    server's spinning schedulers keep about 1.5 cores busy (0.5.23: 74% of
    the host idle, 2% with the flag), slowing whatever else runs: the
    matrix's LLaVA-NeXT baseline answered its cases in 26.6 s beside the
    idle mmshm server, and in 8.7 s with the flag."""
    kw.setdefault("sleep_on_idle", tuple(version) not in SPINNING_RELEASES)
    return _product.sglang_argv(model, port, tp, version, **kw)


def vllm_argv_720p(model: str, port: int, tp: int, **kw) -> list[str]:
    """:func:`vllm_argv` with the start-up dummy image at :data:`DUMMY_720P`
    (for the tiny Qwen2-VL, whose encoder budget comes from its processor)."""
    return vllm_argv(model, port, tp, dummy_image=DUMMY_720P, **kw)


def mount_tmpfs(prefix: str, size: str) -> Path:
    """A fresh directory with a tmpfs of ``size`` (mount's syntax: ``64m``)
    mounted on it, mode 1777: a server's private /dev/shm once bind-mounted
    in its mount namespace, and visible to the test from outside."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix=prefix))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(d)],
                   check=True)
    return d


def unmount_tmpfs(d: Path) -> None:
    """Undo :func:`mount_tmpfs` (lazily: a straggler may still hold it)."""
    import shutil

    subprocess.run(["umount", "-l", str(d)], check=False)
    shutil.rmtree(d, ignore_errors=True)


def report_figures(request, title: str, figures: dict, logs: Path) -> None:
    """Write ``figures`` to ``logs/figures.json`` and print them past
    pytest's output capture, for the record."""
    (logs / "figures.json").write_text(json.dumps(figures, indent=1, default=str))
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{title} figures (also in {logs}/figures.json):")
        for k, v in figures.items():
            print(f"  {k}: {v}")


_PHOTOS: dict[int, str] = {}


def photo_url(i: int) -> str:
    """Photo ``i`` of scikit-image's bundled set, at 720p, as a PNG data URL
    (cached: each is encoded once per test session)."""
    if i not in _PHOTOS:
        from mmshm.bench.photos import _load_rgb, available_photos

        names = available_photos()
        _PHOTOS[i] = data_url(_load_rgb(names[i % len(names)], (1280, 720)))
    return _PHOTOS[i]


def segments(directory: str | os.PathLike) -> list[str]:
    """mmshm's segment files in ``directory`` (``mmshm-<pid>-<hex>``)."""
    try:
        return sorted(n for n in os.listdir(directory) if n.startswith("mmshm-"))
    except FileNotFoundError:
        return []


def start_all(*servers: Server) -> tuple[Server, ...]:
    """Launch every server of ``servers`` at once, then wait for each to be
    ready: a start is mostly one process at a time importing Python and
    loading a model (one core of two busy), so two starts side by side take
    far less than two in a row. If one fails, every one of them is killed
    and its :class:`ServerDied` raised."""
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.kill()
        raise
    return servers


def in_parallel(*calls, return_exceptions: bool = False) -> list:
    """Run the zero-argument callables ``calls`` in threads of their own and
    return their results in order, once all are done (e.g. the cases of a
    plain and an mmshm server, each one request at a time, against two
    servers side by side). The first exception raised by one of them is
    raised then; with ``return_exceptions`` it takes that call's place in
    the list instead (see :func:`result`)."""
    from concurrent.futures import ThreadPoolExecutor

    # openai imports httpx lazily on its first client: two threads racing on
    # that import see a partly initialized module, so it happens here first
    import openai

    openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="none", max_retries=0).close()
    with ThreadPoolExecutor(len(calls)) as ex:
        futures = [ex.submit(c) for c in calls]
        if not return_exceptions:
            return [f.result() for f in futures]
        return [f.exception() or f.result() for f in futures]


def result(value):
    """``value`` of :func:`in_parallel` with ``return_exceptions``: raised if
    it is an exception, else returned."""
    if isinstance(value, BaseException):
        raise value
    return value


def private_shm_prefix(shm_dir: str | os.PathLike) -> list[str]:
    """Words that run a command in a private mount namespace whose /dev/shm
    is ``shm_dir`` (bind-mounted; a tmpfs of :func:`mount_tmpfs` or a
    directory of the host's): what the server makes there, its own files
    included (SGLang's ``sgl_shm_mq_*`` and ``sglang_loads_*``, which a TP=2
    server leaves after a clean stop), never reaches the host's /dev/shm.
    Needs root and ``unshare`` (see :data:`PRIVATE_SHM`). The one
    implementation is :func:`tests.harness.shm.private_shm_prefix`."""
    from tests.harness.shm import private_shm_prefix as prefix

    return prefix(bind=shm_dir)


#: Whether :func:`private_shm_prefix` can work here.
PRIVATE_SHM = os.geteuid() == 0 and __import__("shutil").which("unshare") is not None
#: /dev/shm files the servers (and mmshm) make: what must never be left in
#: the host's /dev/shm by a test (see :func:`host_shm_new`).
SERVER_SHM_PATTERNS = ("sgl_shm_*", "sglang_loads_*", "psm_*", "vllm_dist_*", "mmshm-*")


def host_shm_files(patterns: tuple[str, ...] = SERVER_SHM_PATTERNS) -> set[str]:
    """Names of the regular files directly under the host's /dev/shm that
    match ``patterns`` (directories, such as a test's segment directory,
    are not listed)."""
    import fnmatch

    out = set()
    for n in os.listdir("/dev/shm"):
        if any(fnmatch.fnmatchcase(n, p) for p in patterns) and \
                os.path.isfile(os.path.join("/dev/shm", n)):
            out.add(n)
    return out


def host_shm_new(before: set[str], patterns: tuple[str, ...] = SERVER_SHM_PATTERNS) -> list[str]:
    """The files of :func:`host_shm_files` that were not there ``before``:
    what servers started since then left in the host's /dev/shm (under the
    heavy-run lock no other server runs beside them)."""
    return sorted(host_shm_files(patterns) - before)


#: The SGLang release the runner names (``MMSHM_SGLANG_RELEASE``; ``"0.0.0"``
#: outside the runner) and its version tuple.
SGLANG_RELEASE = os.environ.get("MMSHM_SGLANG_RELEASE", "0.0.0")
SGLANG_VERSION = tuple(int(x) for x in SGLANG_RELEASE.split("."))


def needs_sglang(least: tuple[int, ...], what: str):
    """A skip mark for a real-server SGLang test that needs release ``least``
    or newer (``what`` says what needs it); outside the runner (no release
    named) it does not skip: :func:`needs_e2e` does."""
    import pytest

    old = SGLANG_VERSION != (0, 0, 0) and SGLANG_VERSION < least
    return pytest.mark.skipif(old, reason=f"{what} runs on SGLang "
                                          f"{'.'.join(map(str, least))} here (not {SGLANG_RELEASE})")


def e2e_logs(prefix: str, server: str | None = None) -> Path:
    """The logs directory of an e2e module: ``MMSHM_E2E_LOGS`` when set (the
    runner's), a new temporary directory named ``prefix...`` when this run
    starts real servers (``MMSHM_E2E`` set; naming ``server`` when given),
    else a path that is never made: the module's tests skip, and a main-suite
    run that only collects them leaves nothing in the temporary directory."""
    import tempfile

    if os.environ.get("MMSHM_E2E_LOGS"):
        return Path(os.environ["MMSHM_E2E_LOGS"])
    e2e = os.environ.get("MMSHM_E2E", "")
    if e2e and server in (None, e2e):
        return Path(tempfile.mkdtemp(prefix=prefix))
    return Path(tempfile.gettempdir()) / f"{prefix}not-run"


def needs_e2e(server: str):
    """A skip mark for a real-server test of ``server`` (``sglang``,
    ``vllm``): it runs only from its runner, in the server's own environment
    with ``MMSHM_E2E`` naming the server; elsewhere (the main suite's
    environment has no server) it skips with that reason."""
    import pytest

    return pytest.mark.skipif(os.environ.get("MMSHM_E2E") != server,
                              reason=f"real-server e2e test: run by its runner script with "
                                     f"MMSHM_E2E={server} in the server's environment")
