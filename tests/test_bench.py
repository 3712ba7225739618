"""``mmshm bench`` end to end, small: TP=2, n=2, 1 and 2 images, one repetition.

The bench runs as the real console entry point (``python -m mmshm.cli``) in a
subprocess, inheriting the test's private ``MMSHM_DIR`` from the conftest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("zmq")
pytest.importorskip("transformers")
pytest.importorskip("skimage")

RUN_KEYS = {
    "mode": str, "tp": int, "n": int, "images": int, "resolution": str, "payload_bytes": int,
    "broadcast_s": float, "end_to_end_s": float, "correct": bool, "broadcast_bytes": int,
    "leftover_segments": list, "materialize_s": float,
}


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmshm.cli", *args], capture_output=True,
                          check=False, text=True, timeout=timeout, env=dict(os.environ))


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_bench_small_run_is_correct_and_leaves_nothing(shm_dir, tmp_path):
    out = tmp_path / "out.json"
    proc = _cli("bench", "--tp", "2", "--n", "2", "--images", "1,2", "--repeat", "1",
                "--timeout", "60", "--json", str(out), timeout=85)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())

    runs = result["runs"]
    assert {(r["mode"], r["images"]) for r in runs} == {
        (m, k) for m in ("inline", "mmshm") for k in (1, 2)}
    for r in runs:
        for key, typ in RUN_KEYS.items():
            assert isinstance(r[key], typ), (key, r)
        assert r["correct"] is True, r["problems"]
        assert r["leftover_segments"] == []
        assert (r["tp"], r["n"], r["resolution"]) == (2, 2, "720p")
        assert r["broadcast_s"] > 0 and r["end_to_end_s"] >= r["broadcast_s"]
    by = {(r["mode"], r["images"]): r for r in runs}
    # a 720p photo through Qwen2-VL: [4784, 1176] float32 per image
    assert by["inline", 1]["payload_bytes"] == 4784 * 1176 * 4
    assert by["mmshm", 2]["payload_bytes"] == 2 * 4784 * 1176 * 4
    for k in (1, 2):
        # inline pickles the pixels of the n copies into the broadcast; mmshm only metadata
        assert by["inline", k]["broadcast_bytes"] >= 2 * by["inline", k]["payload_bytes"]
        assert by["mmshm", k]["broadcast_bytes"] < 64 * 1024
        assert by["mmshm", k]["broadcast_speedup_vs_inline"] > 1
    assert result["leftover_segments"] == []
    assert result["config"]["shm_dir"] == shm_dir
    assert not [n for n in os.listdir(shm_dir) if n.startswith("mmshm-")]


def test_cli_lists_bench_and_rejects_unknown_mode():
    proc = _cli("--help", timeout=30)
    assert proc.returncode == 0 and "bench" in proc.stdout
    proc = _cli("bench", "--modes", "inline,bogus", timeout=30)
    assert proc.returncode == 2 and "bogus" in proc.stderr


def test_modes_registry_and_verify():
    import mmshm
    import torch
    from mmshm.bench import MODES, Mode, get_mode, register
    from mmshm.bench.requests import MultimodalDataItem, MultimodalInputs, Req, verify

    assert {"inline", "mmshm"} <= set(MODES)

    @register
    class Dummy(Mode):
        name = "dummy-test"

    try:
        assert isinstance(get_mode("dummy-test"), Dummy)
    finally:
        del MODES["dummy-test"]
    with pytest.raises(KeyError):
        get_mode("nope")

    f = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    item = MultimodalDataItem("image", mmshm.content_hash(f), f, (1, 2, 2))
    req = Req("r", MultimodalInputs([item]), [1, 2, 3])
    assert verify([req, req], 2, 1) == []
    bad = MultimodalDataItem("image", mmshm.content_hash(f), f + 1, (1, 2, 2))
    assert verify([Req("b", MultimodalInputs([bad]), [])], 1, 1)
    assert verify([req], 2, 1)
