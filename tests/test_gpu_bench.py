"""The GPU benchmark, ``benchmarks/gpu_arena.py``, without a GPU.

The script runs on a GPU host that cannot reach PyPI (``benchmarks/gpu_h2d.sh``);
no GPU is lent to the tests, so they run its CPU dry run end to end (spawned
producer and consumers, the same messages and paths, tiny payloads) and check
what the GPU run relies on: every row ran with equal bytes, the paths that need
CUDA are listed as skipped, the arena path really went through the arena
(the consumers' arena counters), no segment or file is left, a consumer that
hangs is killed and its segments reclaimed within the time limits, the byte
check sees a stale page, and ``gpu_h2d.sh`` runs the script within its time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_arena.py"
SHELL = ROOT / "benchmarks" / "gpu_h2d.sh"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_arena", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(tmp_path, shm_dir, *extra, timeout=120):
    out = tmp_path / "arena.json"
    env = dict(os.environ, MMSHM_DIR=shm_dir)
    env.pop("MMSHM_ARENA_BYTES", None)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    took = time.monotonic() - t0
    data = json.loads(out.read_text()) if out.exists() else None
    return proc, data, took


def test_the_cpu_dry_run_runs_every_path_with_equal_bytes_and_leaves_nothing(tmp_path, shm_dir):
    proc, data, _ = _run(tmp_path, shm_dir, "--skip-mixed")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    mod = _load()
    rows = {(r["path"], r["consumers"], r["photos"]): r for r in data["rows"]}
    want = [(p, c, k) for p in (mod.PATH_A, mod.PATH_C, mod.PATH_D) for c in (1, 2)
            for k in (1, 8, 32)]
    want += [(mod.PATH_E, 0, k) for k in (1, 8, 32)]
    want += [(mod.EPD_FLOOR, 0, 8), (mod.EPD_ARENA, 1, 8), (mod.EPD_TODAY, 1, 8)]
    try:
        import safetensors.torch  # noqa: F401
        want.append((mod.EPD_ST, 1, 8))
    except ImportError:
        assert any(s["path"] == mod.EPD_ST for s in data["skipped"])
    assert sorted(set(want) - set(rows)) == []
    for key in want:
        r = rows[key]
        assert r["bytes_ok"] and r["error"] is None and r["reps"] == 3, r
        assert r["median_s"] > 0 and r["first_s"] > 0 and r["x_floor"] > 0
    # the 720p shapes scaled down, each request concatenating its photos
    assert rows[(mod.PATH_A, 1, 32)]["bytes"] == 32 * 64 * 1176 * 4
    # the paths that need CUDA are named, not silently missing
    skipped = {s["path"]: s["why"] for s in data["skipped"]}
    assert skipped[mod.PATH_B_MINI] == skipped[mod.PATH_B_REAL] == "needs CUDA"
    # path d went through the arena (unregistered on a CPU host), path c did not
    arena = data["reports"]["arena"]
    for who in ("consumer 0", "consumer 1"):
        assert arena[who]["arena"]["bytes"] == 2 << 30
        assert arena[who]["counters"]["mmshm_arena_views_total{registered=no}"] > 0
        assert arena[who]["arena"]["registration"] == "unregistered"
    today = data["reports"]["today"]
    assert today["consumer 0"]["arena"]["bytes"] == 0
    assert today["consumer 0"]["counters"]["mmshm_arena_views_total{registered=no}"] == 0
    # nothing left: the JSON says so, the private directory is gone
    assert data["segments_left"] == [] and data["files_left"] == [] and data["errors"] == []
    assert os.listdir(shm_dir) == []
    # the table has the rows and says what was skipped and what the host was
    for label in (mod.PATH_A, mod.PATH_C, mod.PATH_D, mod.PATH_E, mod.EPD_ARENA, mod.EPD_FLOOR):
        assert label in proc.stdout
    assert "skipped: b. cuda_ipc (re-creation): needs CUDA" in proc.stdout
    assert "CPU dry run: plumbing only, not speed" in proc.stdout
    assert "segments left: none" in proc.stdout
    assert "arena, 8 photo(s), 1 consumer(s): the first request" in proc.stdout


def test_a_consumer_that_hangs_is_killed_and_its_segments_reclaimed(tmp_path, shm_dir):
    """Consumer 0 of the arena set never answers its first handle: the producer
    gives up after --request-timeout, the set's processes are killed once
    --exit-grace has passed, what they held is reclaimed, the other set still
    runs, and the exit status says so."""
    proc, data, took = _run(tmp_path, shm_dir, "--request-timeout", "3", "--exit-grace", "5",
                            "--hang-for-test", "--skip-mixed")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert took < 90
    errors = "\n".join(data["errors"])
    assert "no answer from a consumer in 3.0 s" in errors
    assert "killed processes" in errors
    mod = _load()
    assert not any(r["path"] == mod.PATH_D for r in data["rows"])
    assert any(r["path"] == mod.PATH_C and r["bytes_ok"] for r in data["rows"])
    assert data["segments_left"] == [] and os.listdir(shm_dir) == []


def test_the_byte_check_sees_a_stale_page():
    """Before each request one word in every 4 KiB page changes: a copy taken
    before the change (a stale page anywhere) no longer matches the checksum."""
    import torch

    mod = _load()
    p = mod.Payload(torch.rand(64, 1176).repeat(3, 1))
    for _ in range(3):
        before = p.t.clone()
        s = p.bump()
        assert mod.checksum(p.t) == s and mod.checksum(before) != s
        pages = (p.t.reshape(-1).view(torch.uint8) != before.reshape(-1).view(torch.uint8))
        changed = pages.reshape(-1, 4096).any(dim=1) if p.nbytes % 4096 == 0 else None
        assert changed is None or bool(changed.all())
        # one stale page in the middle is seen too
        stale = p.t.clone()
        mid = (p.nbytes // 2) // 4096 * 4096
        stale.reshape(-1).view(torch.uint8)[mid:mid + 4096] = \
            before.reshape(-1).view(torch.uint8)[mid:mid + 4096]
        assert mod.checksum(stale) != s


def _timeouts(text: str) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(2)) for m in
            re.finditer(r"^timeout (\d+) (.*)$", text, re.M)]


def test_gpu_h2d_sh_runs_the_arena_benchmark_within_its_time():
    text = SHELL.read_text()
    subprocess.run(["bash", "-n", str(SHELL)], check=True, timeout=30)
    runs = _timeouts(text)
    arena = [t for t, cmd in runs if cmd.startswith("python3 benchmarks/gpu_arena.py")]
    assert arena and arena[0] <= 300, runs
    # the script's own limit is below the shell's, so its table is always printed
    m = re.search(r"gpu_arena\.py .*--timeout (\d+)", text)
    assert m and int(m.group(1)) < arena[0]
    # the whole script fits about 9 minutes of device time (installs take seconds)
    assert sum(t for t, _ in runs) <= 510, runs


@pytest.mark.parametrize("bad", ["--warmup 0", "--reps 0", "--mixed-requests 0",
                                 "--skip-mixed --only-mixed"])
def test_bad_arguments_are_refused(bad):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *bad.split()],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "must be >= 1" in proc.stderr or "exclude each other" in proc.stderr


@pytest.mark.timeout(300)
def test_the_mixed_workload_race_check_passes_and_its_control_tears(tmp_path, shm_dir):
    """Part 3 on CPU: mixed photo sizes, each consumer's copy queued on a
    stand-in stream (run later, from the mapping's address, as a DMA) and
    the view dropped at once, the producer rewriting released segments at
    once. With the arena's settle on, every copy has its bytes; with the
    settle switched off (the control) the check sees torn photos, so the
    check can fail. Registrations (simulated on a CPU host) are counted."""
    proc, data, _ = _run(tmp_path, shm_dir, "--only-mixed", timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    mod = _load()
    by = {r["path"]: r for r in data["mixed"]}
    on, off = by[mod.MIXED], by[mod.RACE_CONTROL]
    assert on["error"] is None and off["error"] is None, (on, off)
    assert on["requests"] == 8 and on["photos_checked"] == 2 * on["photos"] and on["torn"] == 0
    assert off["requests"] == 4 and off["torn"] > 0
    assert on["hits"] > 0 and all(r > 0 for r in on["registrations"])
    assert "race check (settle on): passed" in proc.stdout
    assert "the check saw" in proc.stdout and "it can fail" in proc.stdout
    assert "registrations per request per consumer" in proc.stdout
    assert data["segments_left"] == [] and os.listdir(shm_dir) == []
