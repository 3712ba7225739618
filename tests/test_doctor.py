"""``mmshm doctor`` and ``mmshm gc``.

* in a 64 MiB tmpfs (Docker's default, ``unshare -m``) ``mmshm doctor`` exits
  non-zero and names the problem and the fix (--shm-size / --ipc=host /
  emptyDir); ``--json`` parses;
* orphans are reported with ``mmshm gc`` as the fix; ``mmshm gc --dry-run``
  lists them without removing anything; ``mmshm gc`` removes them and says
  what it freed; live segments are never touched.
"""

from __future__ import annotations

import json
import os
import sys

import msgspec
import pytest
from click.testing import CliRunner

import mmshm
from mmshm.operations import doctor
from mmshm.segments import reaper

from tests.harness.procs import fork_start, join
from tests.harness.segments import segment_files
from tests.harness.metrics import metric
from tests.harness.shm import run_in_tmpfs, unshare_reason
from tests.harness.tensors import pattern
from tests.harness import workers

MiB = 1 << 20
CLI = [sys.executable, "-c", "import sys; from mmshm.cli import main; sys.exit(main())"]


@pytest.fixture
def segdir(shm_dir):
    """The private segment directory the project conftest gives every test."""
    return shm_dir


def _cli():
    cli = pytest.importorskip("mmshm.cli")
    if "doctor" not in cli.main.commands or "gc" not in cli.main.commands:
        pytest.fail("mmshm.cli has no doctor/gc subcommands")
    return cli.main


def _invoke(*args):
    return CliRunner().invoke(_cli(), list(args), catch_exceptions=False)


def _flat(text: str) -> str:
    return " ".join(text.split())


def _orphans(d: str, sizes: list[int]) -> dict[str, int]:
    before = set(segment_files(d))
    p = fork_start(workers.w_orphan_maker, d, sizes)
    assert join(p, 30) == 0
    names = set(segment_files(d)) - before
    return {n: os.path.getsize(os.path.join(d, n)) for n in names}


# -- doctor ------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_doctor_says_segments_of_another_directory_whose_processes_are_gone_are_left(segdir):
    """mmshm segments in another directory of the mount: left by a process that
    no longer runs, doctor says so and names `mmshm gc --dir` (not "a process
    runs with another MMSHM_DIR", which sent a new user looking for one)."""
    other = os.path.join(segdir, "left-by-a-dead-process")
    os.mkdir(other)
    try:
        _orphans(other, [1 << 20])
        notes = [n for n in doctor.diagnose(segdir, expected_bytes=MiB).notes
                 if f" in {other}, " in n]
        assert len(notes) == 1, notes
        assert notes[0].endswith(f"left by processes that no longer run; reclaim them with "
                                 f"`mmshm gc --dir {other}`"), notes
    finally:
        assert reaper.reap(other).reclaimed == 1
        os.rmdir(other)


@pytest.mark.fault
@pytest.mark.timeout(120)
def test_doctor_in_a_64mib_tmpfs_names_the_problem_and_the_fix():
    why = unshare_reason()
    if why:
        pytest.skip(why)
    _cli()
    script = ('out=$("$@" doctor 2>&1); rc=$?; echo "rc=$rc"; printf "%s\n" "$out"; '
              'echo ----; "$@" doctor --json; echo "rc=$?"')
    r = run_in_tmpfs(["sh", "-c", script, "sh", *CLI], size="64m", timeout=110)
    assert r.returncode == 0, r.stderr
    human, machine = r.stdout.split("----\n")
    rc_line, human = human.split("\n", 1)
    assert rc_line == "rc=1", r.stdout  # something needs fixing
    text = _flat(human)
    assert "64 MiB" in text
    for fix in ("--shm-size", "--ipc=host", "emptyDir"):
        assert fix in text, text
    body, rc_line = machine.rstrip("\n").rsplit("\n", 1)
    assert rc_line == "rc=1"
    rep = json.loads(body)
    assert rep["directory"] == "/dev/shm"
    assert rep["fs_size_bytes"] == 64 * MiB
    assert rep["fs_type"] == "tmpfs"
    assert rep["segments"] == 0 and rep["orphans"] == 0
    assert rep["problems"], rep
    fixes = " ".join(p["fix"] for p in rep["problems"])
    assert "--shm-size" in fixes and "--ipc=host" in fixes and "emptyDir" in fixes
    # the same report as the library's
    msgspec.json.decode(body.encode(), type=doctor.DoctorReport)


@pytest.mark.timeout(60)
def test_doctor_healthy_directory_exits_zero(segdir):
    r = _invoke("doctor", "--dir", segdir, "--expected-bytes", str(MiB))
    assert r.exit_code == 0, r.output
    assert segdir in _flat(r.output)
    r = _invoke("doctor", "--dir", segdir, "--expected-bytes", str(MiB), "--json")
    assert r.exit_code == 0
    rep = json.loads(r.stdout)
    assert rep["problems"] == [] and rep["orphans"] == 0
    assert rep["expected_bytes"] == MiB


@pytest.mark.timeout(60)
def test_doctor_reports_orphans_with_gc_as_the_fix(segdir):
    sizes = _orphans(segdir, [1 << 16, 1 << 20])
    rep = doctor.diagnose(segdir, expected_bytes=MiB)
    assert (rep.orphans, rep.orphan_bytes) == (2, sum(sizes.values()))
    r = _invoke("doctor", "--dir", segdir, "--expected-bytes", str(MiB))
    assert r.exit_code == 1, r.output
    text = _flat(r.output)
    assert "orphan" in text and "mmshm gc" in text
    r = _invoke("doctor", "--dir", segdir, "--expected-bytes", str(MiB), "--json")
    assert r.exit_code == 1
    js = json.loads(r.stdout)
    assert (js["orphans"], js["orphan_bytes"]) == (2, sum(sizes.values()))
    assert any("mmshm gc" in p["fix"] for p in js["problems"])
    assert reaper.reap(segdir).reclaimed == 2


@pytest.mark.timeout(60)
def test_doctor_missing_directory(tmp_path):
    missing = str(tmp_path / "nope")
    r = _invoke("doctor", "--dir", missing, "--json")
    assert r.exit_code == 1
    js = json.loads(r.stdout)
    assert js["problems"] and "MMSHM_DIR" in js["problems"][0]["fix"]



@pytest.mark.timeout(60)
def test_doctor_missing_directory_still_reports_the_host(tmp_path, monkeypatch):
    """The descriptor limits do not depend on the directory; its size is
    unknown, not 0 B; the fix names --dir when --dir was given."""
    import re
    import resource

    missing = str(tmp_path / "nope")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (20000, 20000))
    rep = doctor.diagnose(missing)
    assert (rep.fd_soft_limit, rep.fd_hard_limit) == (20000, 20000) and rep.fd_needed > 0
    assert "--dir" in rep.problems[0].fix
    r = _invoke("doctor", "--dir", missing)
    assert r.exit_code == 1
    text = _flat(r.output)
    assert f"ulimit -n 20000 (hard 20000); a full batch needs about {rep.fd_needed} " in text
    assert re.search(r"\bsize\s+unknown\b", text), text
    assert "size 0 B" not in text
    assert "--dir" in text


# -- gc ------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_gc_dry_run_lists_orphans_then_gc_removes_them(segdir):
    sizes = _orphans(segdir, [1 << 16, 1 << 18, 1 << 20])
    live = mmshm.ShmTensor.from_tensor(pattern(1 << 17, 3), directory=segdir)
    total = sum(sizes.values())
    try:
        r = _invoke("gc", "--dir", segdir, "--dry-run")
        assert r.exit_code == 0, r.output
        text = _flat(r.output)
        for n in sizes:
            assert n in text
        assert live.name not in text
        assert "3" in text and str(total) in text
        assert set(segment_files(segdir)) == set(sizes) | {live.name}  # nothing removed

        r = _invoke("gc", "--dir", segdir, "--dry-run", "--json")
        js = json.loads(r.stdout)
        assert js["dry_run"] is True
        assert (js["reclaimed"], js["reclaimed_bytes"], js["live"]) == (3, total, 1)
        assert sorted(js["names"]) == sorted(sizes)

        segs0 = metric("mmshm_reaped_segments_total")
        r = _invoke("gc", "--dir", segdir)
        assert r.exit_code == 0, r.output
        text = _flat(r.output)
        for n in sizes:
            assert n in text
        assert str(total) in text
        assert segment_files(segdir) == [live.name]  # the live one is kept
        assert metric("mmshm_reaped_segments_total") - segs0 == 3
        assert torch_equal_bytes(live, pattern(1 << 17, 3))

        r = _invoke("gc", "--dir", segdir, "--json")
        js = json.loads(r.stdout)
        assert (js["reclaimed"], js["live"], js["dry_run"]) == (0, 1, False)
    finally:
        live.release()


def torch_equal_bytes(h, t) -> bool:
    return mmshm.content_hash(h.clone().materialize(copy=True)) == mmshm.content_hash(t)


@pytest.mark.timeout(120)
def test_gc_console_script_in_a_subprocess(segdir):
    """The installed entry point, as an operator runs it."""
    _cli()
    sizes = _orphans(segdir, [1 << 16])
    import subprocess

    r = subprocess.run([*CLI, "gc", "--dir", segdir], capture_output=True, text=True,
                       timeout=100, check=False)
    assert r.returncode == 0, r.stderr
    assert next(iter(sizes)) in _flat(r.stdout)
    assert segment_files(segdir) == []



@pytest.mark.timeout(120)
def test_gc_prints_one_summary_per_reclaim_and_the_reaper_still_warns(segdir):
    """`mmshm gc` says what it reclaimed once (its own line, not also the
    reaper's log line); a reaper pass elsewhere (servers) still logs its
    WARNING, which the e2e tests look for in the server logs."""
    import logging
    import subprocess

    _cli()
    _orphans(segdir, [1 << 16])
    r = subprocess.run([*CLI, "gc", "--dir", segdir], capture_output=True, text=True,
                       timeout=100, check=False)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "reclaimed" in ln]
    assert len(lines) == 1 and lines[0].startswith("mmshm gc: reclaimed 1 "), lines
    assert segment_files(segdir) == []
    _orphans(segdir, [1 << 16])
    records: list[logging.LogRecord] = []
    h = logging.Handler()
    h.emit = records.append
    logger = logging.getLogger("mmshm")
    logger.addHandler(h)
    try:
        assert reaper.reap(segdir).reclaimed == 1
    finally:
        logger.removeHandler(h)
    import re

    assert [rec.levelno for rec in records] == [logging.WARNING]
    assert re.search(r"reclaimed \d+ segment\(s\), \d+ bytes, in .*, reason=killed",
                     records[0].getMessage())


# -- the arena ---------------------------------------------------------------------------
GiB = 1 << 30


@pytest.fixture
def cuda_host(monkeypatch):
    """This process as on a CUDA host (CUDA available, as a server's producer
    decides it), with ``ulimit -l`` of 64 MiB; MMSHM_ARENA_BYTES unset."""
    from mmshm import config
    from mmshm.operations import status

    monkeypatch.setattr(status, "cuda_available", lambda: True)
    monkeypatch.setattr(doctor, "memlock_limits", lambda: (64 * MiB, 64 * MiB))
    monkeypatch.delenv("MMSHM_ARENA_BYTES", raising=False)
    config.reload()
    yield config
    config.reload()


def _arena(fs_size: int) -> tuple[tuple, list, list]:
    problems, notes = [], []
    out = doctor.arena_check(fs_size, 16 * MiB, problems, notes)
    return out, problems, notes


def test_doctor_arena_on_a_cuda_host_too_small_a_dev_shm_and_memlock(cuda_host, monkeypatch):
    # Docker's 64 MiB /dev/shm: the default arena is 16 MiB, below one 8-photo request
    (size, source, cuda, soft, _), problems, notes = _arena(64 * MiB)
    assert (size, cuda, soft) == (16 * MiB, True, 64 * MiB) and "CUDA is available" in source
    (p,) = problems
    assert "below one request of 8 Qwen2-VL 720p photos (180 MB)" in p.problem
    assert "--shm-size=1g" in p.fix and notes == []
    # 16 GiB: a 1 GiB arena fits; a 64 MiB memlock limit is information, not a
    # problem (whether it limits a registration with CUDA is not measured)
    (size, *_), problems, notes = _arena(16 * GiB)
    assert size == GiB and problems == []
    (note,) = notes
    assert "RLIMIT_MEMLOCK" in note and "64 MiB" in note and "1.0 GiB" in note
    assert "for information only" in note and "pin_user_pages" in note
    assert "memlock=-1" not in note
    monkeypatch.setattr(doctor, "memlock_limits", lambda: (None, None))
    assert _arena(16 * GiB)[1:] == ([], [])
    # set too small by hand: raise it; set to 0: a note, no problem
    monkeypatch.setenv("MMSHM_ARENA_BYTES", "100M")
    cuda_host.reload()
    (size, source, *_), (p,), _ = _arena(16 * GiB)
    assert (size, source) == (100 * MiB, "MMSHM_ARENA_BYTES")
    assert "raise MMSHM_ARENA_BYTES to at least 172M" in p.fix
    # larger than the directory can hold beside the reserve
    monkeypatch.setenv("MMSHM_ARENA_BYTES", "2G")
    cuda_host.reload()
    (size, *_), (p,), _ = _arena(GiB)
    assert size == 2 * GiB and "larger than" in p.problem and "--shm-size=" in p.fix
    monkeypatch.setenv("MMSHM_ARENA_BYTES", "0")
    cuda_host.reload()
    (size, *_), problems, (note,) = _arena(16 * GiB)
    assert size == 0 and problems == [] and "arena is off" in note


def test_doctor_arena_without_cuda_is_off_and_only_notes(monkeypatch):
    from mmshm import config
    from mmshm.operations import status

    monkeypatch.setattr(status, "cuda_available", lambda: False)
    monkeypatch.setattr(doctor, "memlock_limits", lambda: (8 * MiB, 8 * MiB))
    monkeypatch.delenv("MMSHM_ARENA_BYTES", raising=False)
    config.reload()
    (size, source, cuda, *_), problems, notes = _arena(64 * MiB)
    assert (size, cuda, problems, notes) == (0, False, [], []) and "not available" in source
    monkeypatch.setenv("MMSHM_ARENA_BYTES", "100M")
    config.reload()
    try:
        (size, *_), problems, notes = _arena(16 * GiB)
        assert size == 100 * MiB and problems == []
        assert len(notes) == 2 and "no CUDA" in notes[0] and "RLIMIT_MEMLOCK" in notes[1]
    finally:
        monkeypatch.delenv("MMSHM_ARENA_BYTES")
        config.reload()


@pytest.mark.timeout(60)
def test_doctor_cli_says_the_arena_and_memlock_as_information(segdir, cuda_host):
    rep = json.loads(_invoke("doctor", "--dir", segdir, "--expected-bytes", str(MiB),
                             "--json").stdout)
    assert rep["cuda_host"] is True and rep["memlock_soft_limit"] == 64 * MiB
    assert rep["arena_bytes"] == min(GiB, rep["fs_size_bytes"] // 4)
    assert not any("MEMLOCK" in p["problem"] or "memlock" in p["fix"] for p in rep["problems"])
    r = _invoke("doctor", "--dir", segdir, "--expected-bytes", str(MiB))
    text = _flat(r.output)
    assert "arena" in text and "ulimit -l 64 MiB" in text and "CUDA is available here" in text
    if rep["arena_bytes"] * 2 > 64 * MiB:
        assert "RLIMIT_MEMLOCK" in text and "for information only" in text
    assert "--ulimit memlock=-1" not in text
