"""The real-server modules, collected where they do not run (the main
suite's environment), leave nothing in the temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.servers import ROOT

MODULES = ["tests/e2e/test_matrix.py", "tests/e2e/test_vllm_epd.py",
           "tests/e2e/test_vllm_server.py", "tests/e2e/test_vllm_shapes.py"]


@pytest.mark.timeout(120)
def test_collecting_the_e2e_modules_makes_no_temporary_directory(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMSHM_E2E")}
    env["TMPDIR"] = str(tmp)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                          "--collect-only", "-q", *MODULES], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert sorted(p.name for p in Path(tmp).iterdir()) == []


def test_the_logs_directory_is_made_only_for_a_run_of_its_servers(tmp_path, monkeypatch):
    from tests.harness.servers import e2e_logs

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # TMPDIR read anew
    monkeypatch.delenv("MMSHM_E2E_LOGS", raising=False)
    monkeypatch.delenv("MMSHM_E2E", raising=False)
    assert not e2e_logs("x-", "vllm").exists()
    monkeypatch.setenv("MMSHM_E2E", "sglang")
    assert not e2e_logs("x-", "vllm").exists()  # another server's run
    made = e2e_logs("x-")  # a module of either server's
    assert made.is_dir() and made.parent == tmp_path
    monkeypatch.setenv("MMSHM_E2E_LOGS", str(tmp_path / "given"))
    assert e2e_logs("x-", "vllm") == tmp_path / "given"
