"""Child processes of the tests: gloo process groups, single children,
forkserver workers, and the pids whose segments are the tests' business.

The start helpers (:func:`spawn`, :func:`run_group`, :func:`run_children`,
:func:`run_child`) fork their children from :func:`start_ctx`, a fork server
that imported torch and mmshm once per session, unless given ``ctx=``
(:func:`spawn_ctx` where a fresh interpreter is the test's subject). Every
function a child runs lives at the top level of an importable module
(:mod:`tests.harness.children`, :mod:`tests.harness.workers`, or the test
module itself). Children get the test's ``os.environ`` (``MMSHM_DIR`` and
the other ``MMSHM_*`` settings: inherited from spawn, handed over by
:func:`env_process` from a fork server, mmshm's settings re-read), and the
parent's ``sys.path`` through multiprocessing's preparation data (the
repository root, where pytest put it). A forked child leaves through
``os._exit`` (multiprocessing's finalizers, not ``atexit``).
Every wait is bounded: a child that does not report in time fails the test
with every child's exit state, and is killed.
"""

from __future__ import annotations

import atexit
import gc
import io
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing import forkserver, popen_forkserver, reduction
from multiprocessing import spawn as mp_spawn
from multiprocessing import util as mp_util
from multiprocessing.context import ForkServerContext, ForkServerProcess, set_spawning_popen

from tests.harness.ports import free_port

#: pids of every child the tests started: the conftest's /dev/shm check
#: covers the segments they create (see :func:`track`).
SPAWNED_PIDS: set[int] = set()


def track(pid: int) -> None:
    """Record a child's pid: its ``mmshm-*`` files in /dev/shm are the tests'
    business (the conftest fails a test that leaves one)."""
    SPAWNED_PIDS.add(pid)


def signal_name(code: int | None) -> str:
    """A process's exit code in words (``killed by SIGKILL``, ``exit code 1``)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# -- spawned children ------------------------------------------------------------------
def spawn_ctx():
    """The ``spawn`` multiprocessing context."""
    return mp.get_context("spawn")


def start_ctx():
    """The start helpers' default context: a fork server of its own
    (:func:`preload_ctx`) that imported torch, torch.distributed, mmshm and
    the harness's children once; start its children with :func:`env_process`."""
    return preload_ctx(_START_KEY, _START_PRELOAD)


#: what :func:`start_ctx`'s server imports (the key names its server)
_START_KEY = "tests.harness.children"
_START_PRELOAD = ["torch", "torch.distributed", "prometheus_client", "blake3", "msgspec",
                  "mmshm", "mmshm.segments.reaper", "tests.harness.workers", _START_KEY]


def spawn(target, *args, ctx=None) -> mp.Process:
    """Start ``target(*args)`` in a daemon process (tracked), forked from
    :func:`start_ctx` with this process's environment (:func:`env_process`);
    ``ctx=spawn_ctx()`` for a fresh interpreter."""
    p = env_process(start_ctx() if ctx is None else ctx, target, *args, daemon=True)
    p.start()
    track(p.pid)
    return p


def stop_all(procs, timeout: float = 10.0) -> None:
    """Join every process; kill the ones that do not exit in ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def collect(q, n: int, timeout: float, procs=(), killed=()) -> list:
    """Read ``n`` results ``(key, status, payload)`` from ``q``; fail with the
    child's traceback on an error, or with the exit codes on a timeout.
    ``killed``: processes expected to die by SIGKILL (not a failure)."""
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        try:
            item = q.get(timeout=0.25)
        except queue.Empty:
            dead = [p for p in procs
                    if p.exitcode not in (None, 0) and not (p in killed and p.exitcode == -9)]
            if dead or time.monotonic() > deadline:
                states = ", ".join(f"pid {p.pid}: {signal_name(p.exitcode)}" for p in procs)
                raise AssertionError(f"children did not report ({len(out)}/{n}): {states}")
            continue
        key, status, payload = item
        if status != "ok":
            raise AssertionError(f"child {key} failed:\n{payload}")
        out.append((key, payload))
    return out


def run_group(target, world: int, *args, timeout: float = 90.0, killed=(), ctx=None) -> dict:
    """Run ``target(rank, world, *args)`` on ``world`` processes joined
    in a gloo process group on 127.0.0.1 (30 s collective timeout); return
    ``{rank: result}``. The ranks fork from ``ctx`` (default :func:`start_ctx`;
    a :func:`preload_ctx`, or :func:`spawn_ctx` for fresh interpreters), with
    this process's environment handed over (:func:`env_process`).

    Asserts that every child reported success within ``timeout`` seconds and
    exited with code 0, but the ranks in ``killed``, which must die by
    SIGKILL (report nothing)."""
    c = start_ctx() if ctx is None else ctx
    q = c.Queue()
    port = free_port()
    procs = [env_process(c, _rank_main, target, rank, world, port, q, args, daemon=True)
             for rank in range(world)]
    dying = [procs[r] for r in killed]
    try:
        for p in procs:
            p.start()
            track(p.pid)
        res = dict(collect(q, world - len(dying), timeout, procs, dying))
    finally:
        stop_all(procs)
    for r, p in enumerate(procs):
        want = -signal.SIGKILL if r in killed else 0
        assert p.exitcode == want, f"rank {r} pid {p.pid}: {signal_name(p.exitcode)}"
    return res


def _rank_main(target, rank, world, port, q, args) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=30))
        try:
            result = target(rank, world, *args)
        finally:
            gc.collect()
        q.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_children(target, arglist, timeout: float = 60.0, ctx=None) -> list:
    """Run ``target(*args)`` for each ``args`` of ``arglist``, each in its own
    process of ``ctx`` (default :func:`start_ctx`, :func:`env_process`), all at
    once; return the results in order. Asserts that every child reported
    success and exited with code 0."""
    c = start_ctx() if ctx is None else ctx
    q = c.Queue()
    procs = [env_process(c, _keyed_main, i, target, q, args, daemon=True)
             for i, args in enumerate(arglist)]
    try:
        for p in procs:
            p.start()
            track(p.pid)
        res = dict(collect(q, len(procs), timeout, procs))
    finally:
        stop_all(procs)
    for p in procs:
        assert p.exitcode == 0, f"child pid {p.pid}: {signal_name(p.exitcode)}"
    return [res[i] for i in range(len(procs))]


def _keyed_main(key, target, q, args) -> None:
    try:
        q.put((key, "ok", target(*args)))
    except BaseException:  # noqa: BLE001
        q.put((key, "error", traceback.format_exc()))


def run_child(target, *args, timeout: float = 60.0, ctx=None):
    """Run ``target(*args)`` in one process of ``ctx`` (default
    :func:`start_ctx`, :func:`env_process`) and return ``(result, exitcode)``;
    result is None if the child died before reporting."""
    c = start_ctx() if ctx is None else ctx
    q = c.Queue()
    p = env_process(c, _child_main, target, q, args, daemon=True)
    p.start()
    track(p.pid)
    result = None
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                status, payload = q.get(timeout=0.25)
                if status != "ok":
                    raise AssertionError(f"child failed:\n{payload}")
                result = payload
                break
            except queue.Empty:
                if p.exitcode is not None or time.monotonic() > deadline:
                    break
    finally:
        stop_all([p])
    return result, p.exitcode


def _child_main(target, q, args) -> None:
    try:
        q.put(("ok", target(*args)))
    except BaseException:  # noqa: BLE001
        q.put(("error", traceback.format_exc()))


# -- forkserver workers ------------------------------------------------------------------
def fork_ctx():
    """The fault workers' context: :func:`start_ctx`'s fork server (torch,
    mmshm and :mod:`tests.harness.workers` imported once), for their pipes
    and for :func:`fork_start`."""
    return start_ctx()


def fork_start(target, *args, name: str | None = None):
    """Start ``target(*args)`` as a forkserver daemon worker (tracked)."""
    p = env_process(start_ctx(), target, *args, daemon=True, name=name)
    p.start()
    track(p.pid)
    return p


# -- fork servers of their own, preloading a test's heavy imports ------------------------
class _Environ(dict):
    """``os.environ`` in a child's arguments: unpickling it in the child (before
    the target and its module) makes it the child's whole environment."""

    def __reduce__(self):
        return _apply_environ, (dict(self),)


def _apply_environ(env: dict) -> dict:
    os.environ.clear()
    os.environ.update(env)
    config = sys.modules.get("mmshm.config")
    if config is not None:  # settings the fork server read at import: re-read, as a
        config._warned.clear()  # fresh interpreter would (each bad value said once)
        on = config.reload().debug_refs
        refdebug = sys.modules.get("mmshm.segments.refdebug")
        if refdebug is not None and "mmshm.segments.shmtensor" in sys.modules:
            (refdebug.install if on else refdebug.uninstall)()  # MMSHM_DEBUG_REFS
    return env


def _environ_main(env, target, *args) -> None:
    """``target(*args)``: ``env`` was applied as it was unpickled (:class:`_Environ`)."""
    target(*args)


def env_process(ctx, target, *args, daemon: bool | None = None,
                name: str | None = None) -> mp.Process:
    """An unstarted process of ``ctx`` running ``target(*args)``; from a
    fork server, with this process's ``os.environ`` as its whole environment,
    set before the target's module is imported there (a forked child keeps
    the server's: that of the test that started it). :func:`spawn_ctx`:
    a plain process (a spawned child inherits the environment)."""
    if ctx.get_start_method() != "forkserver":
        return ctx.Process(target=target, args=args, daemon=daemon, name=name)
    return ctx.Process(target=_environ_main, args=(_Environ(os.environ), target, *args),
                       daemon=daemon, name=name)


class _ServerPopen(popen_forkserver.Popen):
    """multiprocessing's forkserver ``Popen``, asking the child's own
    :func:`preload_ctx` server (not the module's one fork server)."""

    def _launch(self, process_obj):  # Popen._launch, with the context's server
        prep_data = mp_spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        server = _PRELOADED[process_obj.preload].server
        self.sentinel, w = server.connect_to_new_process(self._fds)
        parent_w = os.dup(w)
        self.finalizer = mp_util.Finalize(self, mp_util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _PreloadProcess(ForkServerProcess):
    preload = ""  # the module its server preloaded

    @staticmethod
    def _Popen(process_obj):
        return _ServerPopen(process_obj)


class _PreloadContext(ForkServerContext):
    """A forkserver context with a server of its own (:func:`preload_ctx`)."""

    def __init__(self, module: str, modules: list[str] | None = None):
        self.module = module
        self.server = forkserver.ForkServer()
        self.server.set_forkserver_preload(modules or [module])

    def Process(self, *args, **kwargs) -> _PreloadProcess:
        p = _PreloadProcess(*args, **kwargs)
        p.preload = self.module
        return p


_PRELOADED: dict[str, _PreloadContext] = {}


def preload_ctx(module: str, modules: list[str] | None = None) -> ForkServerContext:
    """A forkserver context with a fork server of its own (one per ``module``
    and test session), which imports ``module`` (or the list ``modules``,
    on the first call) once: every child is a fork
    of it. Start children with :func:`env_process` (or ``run_group(ctx=)``),
    which hands them this process's environment. The server is stopped at
    exit. If ``module`` raises ImportError there, multiprocessing ignores it
    and each child imports what it needs (slower, not wrong); any other
    error kills the server, and every start fails."""
    ctx = _PRELOADED.get(module)
    if ctx is None:
        ctx = _PRELOADED[module] = _PreloadContext(module, modules)
        atexit.register(_stop_server, ctx.server)
    return ctx


def _stop_server(server: forkserver.ForkServer, timeout: float = 10.0) -> None:
    """Close the server's "alive" pipe (it exits once no child holds it);
    kill it if it has not after ``timeout`` seconds."""
    pid = server._forkserver_pid
    if pid is None:
        return
    os.close(server._forkserver_alive_fd)
    server._forkserver_pid = server._forkserver_alive_fd = None
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.05)


def recv(conn, timeout: float = 10.0):
    """The next message on ``conn``; TimeoutError after ``timeout`` seconds."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout}s")
    return conn.recv()


def join(p, timeout: float = 10.0) -> int:
    """Wait for ``p`` and return its exit code; kill it and raise
    TimeoutError if it does not finish within ``timeout`` seconds."""
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        p.join(5)
        raise TimeoutError(f"{p.name} (pid {p.pid}) did not finish within {timeout}s")
    return p.exitcode
