"""tests/run.py's environments built in the background (``Background``): each
build's result reaches the part that needs it, a failed build fails that part
with its reason and log, and a part waits for the builds before it goes on."""

from __future__ import annotations

import time
from pathlib import Path

from tests import run


def test_a_built_environment_and_a_failed_one_reach_their_parts(tmp_path):
    def slow(log):
        time.sleep(0.3)
        print("pip output", file=log)
        return tmp_path / "venv-a"

    def broken(log):
        raise run.SetupError("pip failed in venv-b")

    bg = run.Background({"a": slow, "b": broken}, tmp_path / "bg.log")
    venv, waited, failed = bg.take("a")
    assert venv == tmp_path / "venv-a" and failed is None
    assert waited > 0.1  # it waited for the build still running
    venv, _, failed = bg.take("b")
    assert venv is None and failed is not None and failed.rc == 1
    assert "pip failed in venv-b" in failed.summary and str(tmp_path / "bg.log") in failed.summary
    assert "pip output" in Path(tmp_path / "bg.log").read_text()
    assert not bg.thread.is_alive()


def test_only_a_run_with_the_sglang_module_tests_and_vllm_builds_in_the_background(
        monkeypatch, tmp_path):
    monkeypatch.setattr(run, "VENVS", tmp_path)
    monkeypatch.setattr(run, "BACKGROUND", None)
    made = []
    monkeypatch.setattr(run, "vllm_venv", lambda log=None: made.append("vllm") or tmp_path)
    monkeypatch.setattr(run, "vllm_cpu_venv", lambda log=None: made.append("cpu") or tmp_path)
    run.start_background(run.parse(["sglang", "--setup-only"]))
    assert run.BACKGROUND is None  # no vllm part, or set-up only: nothing in the background
    run.start_background(run.parse(["vllm", "--no-e2e"]))
    assert run.BACKGROUND is not None and list(run.BACKGROUND.builds) == [f"vllm {run.VLLM_VERSION}"]
    run.BACKGROUND.wait()
    assert made == ["vllm"]
