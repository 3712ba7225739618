"""A private /dev/shm: a small tmpfs in a mount namespace of its own.

``unshare -m`` gives a command its own mount namespace (propagation
private: nothing it mounts is seen outside), and a tmpfs mounted on
/dev/shm there is that command's whole /dev/shm, sized like Docker's default
(64 MiB). Needs root and util-linux's ``unshare``; :func:`unshare_reason`
says why not when they are missing, and tests skip with that reason.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess


def private_shm_prefix(size: str = "64m", bind: str | os.PathLike | None = None) -> list[str]:
    """Words that run a command (``prefix + argv``) in a mount namespace of
    its own whose /dev/shm is a fresh tmpfs of ``size`` (mount's syntax:
    ``64m``), or, with ``bind``, the directory ``bind`` bind-mounted (a tmpfs
    the test mounted and watches from outside, see the e2e servers): what the
    command makes there never reaches the host's /dev/shm. Mount propagation
    is made private first (nothing mounted inside is seen outside). The shell
    execs the command, so a signal that kills it shows as a negative return
    code."""
    mount = (f"mount --bind {shlex.quote(os.fspath(bind))} /dev/shm" if bind is not None
             else f"mount -t tmpfs -o size={shlex.quote(size)} tmpfs /dev/shm")
    return ["unshare", "-m", "sh", "-c", f'mount --make-rprivate / && {mount} && exec "$0" "$@"']


@functools.lru_cache(maxsize=1)
def unshare_reason() -> str | None:
    """None if :func:`private_shm_prefix` works here (root, util-linux's
    ``unshare``, mounts allowed), else why not."""
    if os.geteuid() != 0:
        return "needs root for a private tmpfs (unshare -m)"
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    r = subprocess.run(private_shm_prefix("1m") + ["true"], check=False, capture_output=True,
                       timeout=30)
    if r.returncode != 0:
        return f"unshare -m / mount tmpfs failed: {r.stderr.decode(errors='replace').strip()}"
    return None


def skip_without_unshare() -> None:
    """Skip the calling test when a private tmpfs cannot be had (see
    :func:`unshare_reason`)."""
    why = unshare_reason()
    if why:
        import pytest

        pytest.skip(why)


def run_in_tmpfs(argv: list[str], size: str = "64m", env: dict | None = None,
                 timeout: float = 120, cwd: str | os.PathLike | None = None
                 ) -> subprocess.CompletedProcess:
    """Run ``argv`` under :func:`private_shm_prefix` from the repository root
    (``cwd``), with no ``MMSHM_*`` variable of the caller's but those of
    ``env``; its pid is tracked (:func:`tests.harness.procs.track`). Returns
    the completed process (text output); raises AssertionError with its
    stderr when it runs past ``timeout`` seconds (it is killed)."""
    from tests.harness import ROOT
    from tests.harness.procs import track

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MMSHM_")}
    full_env.update(env or {})
    p = subprocess.Popen(private_shm_prefix(size) + argv, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=full_env, cwd=cwd or ROOT)
    track(p.pid)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"{argv} ran past {timeout}s:\n{err.decode(errors='replace')}")
    return subprocess.CompletedProcess(argv, p.returncode, out.decode(), err.decode())


def run_script(name: str, *args: str, size: str = "64m", timeout: float = 120) -> dict:
    """``python -m tests.scripts.<name> ARGS`` under :func:`run_in_tmpfs` with
    a private tmpfs of ``size`` (skips where one cannot be had); asserts that
    it exited 0 and returns the JSON object its last line of output holds."""
    import json
    import sys

    skip_without_unshare()
    r = run_in_tmpfs([sys.executable, "-m", f"tests.scripts.{name}", *args], size=size,
                     timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
