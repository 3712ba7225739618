"""tests/run.py's environments built in the background (``Background``): each
build's result reaches the part that needs it (waiting for that build only),
a failed build fails that part with its reason and log, a part that starts
servers waits for every build, and pip runs at nice 10."""

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

    def last(log):
        time.sleep(1.0)
        return tmp_path / "venv-c"

    bg = run.Background({"a": slow, "b": broken, "c": last}, tmp_path / "bg.log")
    venv, waited, failed = bg.take("a")
    assert venv == tmp_path / "venv-a" and failed is None
    assert waited > 0.1  # it waited for the build still running
    venv, _, failed = bg.take("b")
    assert venv is None and failed is not None and failed.rc == 1
    assert "pip failed in venv-b" in failed.summary and str(tmp_path / "bg.log") in failed.summary
    assert "pip output" in Path(tmp_path / "bg.log").read_text()
    # a part takes its own environment without waiting for the builds after it
    assert bg.thread.is_alive() and bg.has("c") and not bg.has("a")
    assert bg.wait() > 0.3  # a part that starts servers waits for every build
    assert not bg.thread.is_alive() and bg.take("c")[0] == tmp_path / "venv-c"


def test_the_builds_run_below_the_tests_cpu_priority(tmp_path):
    import os

    bg = run.Background({"a": lambda log: os.getpriority(os.PRIO_PROCESS, 0)},
                        tmp_path / "bg.log")
    niceness, _, failed = bg.take("a")
    assert failed is None and niceness == os.getpriority(os.PRIO_PROCESS, 0) + 10


def test_the_sglang_and_vllm_environments_build_in_the_background_in_order(monkeypatch,
                                                                           tmp_path):
    monkeypatch.setattr(run, "VENVS", tmp_path)
    monkeypatch.setattr(run, "BACKGROUND", None)
    made = []
    monkeypatch.setattr(run, "vllm_venv", lambda log=None: made.append("vllm") or tmp_path)
    monkeypatch.setattr(run, "vllm_cpu_venv", lambda log=None: made.append("cpu") or tmp_path)
    monkeypatch.setattr(run, "sglang_venv", lambda rel, log: made.append(f"lean {rel}") or tmp_path)
    monkeypatch.setattr(run, "sglang_server_venv",
                        lambda rel, log: made.append(f"server {rel}") or tmp_path)
    run.start_background(run.parse(["sglang", "--setup-only"]))
    assert run.BACKGROUND is None  # set-up only: nothing in the background
    run.start_background(run.parse(["main"]))
    assert run.BACKGROUND is None  # the main suite alone: nothing to build
    run.start_background(run.parse(["vllm", "--no-e2e"]))
    assert run.BACKGROUND is not None and list(run.BACKGROUND.builds) == [f"vllm {run.VLLM_VERSION}"]
    run.BACKGROUND.wait()
    assert made == ["vllm"]
    monkeypatch.setattr(run, "BACKGROUND", None)
    made.clear()
    # SGLang with its e2e, then vLLM: the lean environments first (the module tests
    # come first), then each release with real-server tests gets its server one
    run.start_background(run.parse(["sglang", "vllm", "--release", "0.5.23",
                                    "--release", "0.5.12"]))
    run.BACKGROUND.wait()
    assert made == ["lean 0.5.23", "lean 0.5.12", "server 0.5.23", "vllm", "cpu"]
    venv, _, failed = run.BACKGROUND.take("sglang 0.5.23 e2e")
    assert venv == tmp_path and failed is None


def test_one_layered_environment_is_built_once_when_two_threads_want_it(monkeypatch, tmp_path):
    """A release's lean environment wanted at once by its module tests and by
    the background build of its server environment: pip runs once."""
    import threading

    pips = []

    def pip(venv, args, log):
        pips.append(list(args))
        time.sleep(0.2)

    monkeypatch.setattr(run, "_pip", pip)
    venv = tmp_path / "lean"
    threads = [threading.Thread(target=run._make_layered_venv,
                                args=(venv, [], ["pkg==1"], [], None)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pips == [["pkg==1"]]
