"""The frictions a new user met, each pinned by a test.

* ``mmshm bench`` in a small /dev/shm skips the shared-memory modes with the
  exact sizes (bytes and MiB, not "0.1 GB exceed the 0.1 GB free") and the
  fix ``mmshm doctor`` gives (its own words: :func:`mmshm.operations.doctor.size_fix`);
* ``mmshm config`` never cuts a variable's name, at 80 columns or 60 (the
  column a user copies): the value and the meaning wrap instead;
* the read-only commands (``status``, ``doctor``, ``config``) start without
  importing torch;
* a missing or unusable segment directory is worded one way
  (:func:`mmshm.config.dir_problem`) by the library, ``doctor``, ``status``,
  ``gc``, ``config`` and ``bench``: the directory, where it came from, the
  reason and the fix.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from mmshm import config

from tests.harness.shm import run_in_tmpfs, skip_without_unshare

MiB = 1 << 20
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _main():
    from mmshm.cli import main

    return main


def _invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(_main(), list(args), env=env, catch_exceptions=False)


def _flat(text: str) -> str:
    return " ".join(text.split())


# -- bench in a small /dev/shm -------------------------------------------------------------
def test_bench_skip_for_space_gives_exact_sizes_and_doctors_fix(monkeypatch, shm_dir):
    """A 64 MiB /dev/shm and the --quick run's segments (about 90 MiB): the
    reason names both sizes exactly and carries doctor's fix."""
    pytest.importorskip("zmq")
    from mmshm.bench import runner
    from mmshm.bench.modes import MODES
    from mmshm.operations import doctor

    size, free = 64 * MiB, 63 * MiB + 12345
    monkeypatch.setattr(runner, "_dir_space", lambda d: (size, free))
    payload = 2 * 4784 * 1176 * 4  # --quick: 2 photos at 720p
    why, _mem, shm = runner._skip_reason(MODES["mmshm"], payload, 2, 2, 1 << 50, shm_dir)
    assert why is not None and shm > free
    flat = _flat(why)
    assert f"{shm} bytes ({shm / MiB:.1f} MiB)" in flat, flat
    assert f"{free} bytes ({free / MiB:.1f} MiB) free in {shm_dir}" in flat, flat
    fix = doctor.size_fix(doctor.shm_size_advice(shm, size - free))
    assert fix in flat and "--shm-size=" in fix and "MMSHM_DIR" in fix, flat
    assert "GB" not in flat.replace("GiB", "")  # no rounding to tenths of a GB


@pytest.mark.fault
@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_bench_quick_in_a_64mib_shm_says_sizes_and_fix():
    """The reproduction of the friction: ``mmshm bench --quick`` in a private
    64 MiB tmpfs on /dev/shm (``unshare -m``, root only) still exits 0 and
    says, for each skipped shared-memory mode, the sizes and the fix."""
    skip_without_unshare()
    r = run_in_tmpfs([sys.executable, "-m", "mmshm.cli", "bench", "--quick", "--modes",
                      "inline,mmshm", "--timeout", "60"], size="64m", timeout=110)
    out = _flat(r.stdout + r.stderr)
    assert r.returncode == 0, out
    assert "mmshm TP=2 n=2 720p x2 skipped:" in out, out
    assert re.search(r"its segments need \d+ bytes \(\d+\.\d MiB\)", out), out
    assert "67108864 bytes (64.0 MiB)" in out or re.search(r"\d+ bytes \(6\d\.\d MiB\) free", out)
    assert "--shm-size=1g" in out and "point MMSHM_DIR at a larger tmpfs" in out, out
    assert "0.1 GB" not in out


# -- config at 80 and 60 columns ------------------------------------------------------------
@pytest.mark.parametrize("columns", [80, 60])
def test_config_never_cuts_a_variable_name(columns, shm_dir):
    """On a terminal of 80 or 60 columns every MMSHM_* name is printed whole
    on one line (the column a user copies); no line is wider than the
    terminal; the meanings are all there, wrapped."""
    env = dict(os.environ, COLUMNS=str(columns), LINES="50", TTY_COMPATIBLE="1",
               TERM="xterm")
    r = subprocess.run([sys.executable, "-m", "mmshm.cli", "config"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    lines = [ANSI.sub("", ln) for ln in r.stdout.splitlines()]
    table = [ln for ln in lines[1:] if not ln.startswith("note: ")]  # the title is prose
    assert "…" not in "\n".join(table)
    assert all(len(ln) <= columns for ln in table), [ln for ln in table if len(ln) > columns]
    starts = [ln.split()[0] for ln in table if ln.startswith("  MMSHM_")]
    assert starts == [v.name for v in config.VARIABLES], starts
    # the meanings wrap, whole words kept (a word too long for its column folds)
    words = set(" ".join(table).split())
    short = {w for v in config.VARIABLES for w in v.doc.split() if len(w) <= 12}
    assert short <= words, sorted(short - words)


# -- read-only commands without torch --------------------------------------------------------
@pytest.mark.parametrize("command", ["status", "doctor", "config"])
def test_read_only_commands_start_without_torch(command, shm_dir):
    code = ("import sys; from click.testing import CliRunner; from mmshm.cli import main; "
            f"r = CliRunner().invoke(main, [{command!r}]); "
            "print(r.exit_code, 'torch' in sys.modules, repr(r.output[-300:]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ))
    exit_code, torch_loaded, _ = r.stdout.split(" ", 2)
    assert exit_code in ("0", "1"), r.stdout + r.stderr  # doctor: 1 = problems found
    assert torch_loaded == "False", f"mmshm {command} imported torch"


# -- one wording for a missing or unusable MMSHM_DIR -----------------------------------------
@pytest.fixture(params=["missing-parent", "a-file"])
def bad_dir(request, tmp_path) -> str:
    if request.param == "a-file":
        (tmp_path / "a-file").write_text("")
        return str(tmp_path / "a-file")
    return str(tmp_path / "no-parent" / "segs")


def _said(text: str, problem) -> None:
    flat = _flat(text)
    assert problem.problem in flat and problem.fix in flat, flat


def test_dir_problem_reasons(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("")
    p = config.dir_problem(str(tmp_path / "x" / "y"))
    assert p.reason == f"its parent {tmp_path / 'x'} does not exist"
    assert p.problem == (f"the segment directory MMSHM_DIR={tmp_path / 'x' / 'y'} cannot hold "
                         f"segments: {p.reason}")
    assert "MMSHM_DIR" in p.fix and "tmpfs" in p.fix
    assert config.dir_problem(str(f)).reason == "it is not a directory"
    assert config.dir_problem(str(tmp_path)) is None
    # a missing directory whose parent exists: the library creates it; a reader does not
    assert config.dir_problem(str(tmp_path / "new")) is None
    assert config.dir_problem(str(tmp_path / "new"), create=False).reason == "it does not exist"
    d = config.dir_problem(str(f), where="--dir")
    assert d.problem.startswith(f"the segment directory --dir={f} ") and "--dir" in d.fix
    assert "MMSHM_DIR" in d.fix  # servers read MMSHM_DIR, not --dir
    assert "Fix: " + d.fix in d.message("x")


def test_library_words_a_bad_directory_so(bad_dir, caplog):
    from mmshm.segments.table import TABLE

    with caplog.at_level(logging.WARNING, logger="mmshm"):
        TABLE.ensure_dir(bad_dir)
    [msg] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    _said(msg, config.dir_problem(bad_dir))
    assert "travels inline" in msg


def test_doctor_words_a_bad_directory_so(bad_dir, monkeypatch):
    r = _invoke("doctor", "--dir", bad_dir, "--json")
    assert r.exit_code == 1
    [first] = json.loads(r.stdout)["problems"][:1]
    p = config.dir_problem(bad_dir, create=False, where="--dir")
    assert (first["problem"], first["fix"]) == (p.problem, p.fix)
    monkeypatch.setenv("MMSHM_DIR", bad_dir)
    r = _invoke("doctor")
    assert r.exit_code == 1
    _said(r.output, config.dir_problem(bad_dir, create=False))


@pytest.mark.parametrize("command", ["status", "gc"])
def test_status_and_gc_word_a_bad_directory_so(command, bad_dir, monkeypatch):
    r = _invoke(command, "--dir", bad_dir)
    assert r.exit_code == 5
    assert r.output.startswith(f"mmshm {command}: error: the segment directory --dir=")
    _said(r.output, config.dir_problem(bad_dir, create=False, where="--dir"))
    monkeypatch.setenv("MMSHM_DIR", bad_dir)
    r = _invoke(command)
    assert r.exit_code == 5
    _said(r.output, config.dir_problem(bad_dir, create=False))


def test_config_words_a_bad_directory_so(bad_dir, monkeypatch):
    monkeypatch.setenv("MMSHM_DIR", bad_dir)
    r = _invoke("config")
    assert r.exit_code == 0  # a note, not a bad value: servers run, inline
    _said(r.output, config.dir_problem(bad_dir))
    js = json.loads(_invoke("config", "--json").stdout)
    assert js["dir_problem"] == config.dir_problem(bad_dir).message()


def test_config_says_nothing_of_a_good_directory(shm_dir):
    r = _invoke("config")
    assert "cannot hold segments" not in r.output
    assert json.loads(_invoke("config", "--json").stdout)["dir_problem"] is None


def test_bench_words_a_bad_directory_so(bad_dir, monkeypatch):
    """Both ways of naming it are a usage error (exit 2) before anything runs."""
    r = CliRunner().invoke(_main(), ["bench", "--shm-dir", bad_dir])
    assert r.exit_code == 2
    _said(r.output, config.dir_problem(bad_dir, create=False, where="--shm-dir"))
    monkeypatch.setenv("MMSHM_DIR", bad_dir)
    r = CliRunner().invoke(_main(), ["bench"])
    assert r.exit_code == 2
    _said(r.output, config.dir_problem(bad_dir, create=False))
