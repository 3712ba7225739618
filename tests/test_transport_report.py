"""benchmarks/transport_server.py's report, on synthetic expositions: the
hops' per-request figures, the like-for-like TOTAL and the server's own
latency histograms read beside them (no server is started here)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "tests", "e2e")]
pytest.importorskip("prometheus_client")
ts = pytest.importorskip("transport_server")


def _hist(name: str, s: float, n: float, **labels) -> str:
    lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return (f"# TYPE {name} histogram\n{name}_sum{{{lab}}} {s}\n{name}_count{{{lab}}} {n}\n")


def _exposition(scale: float, transport: str) -> str:
    """One SGLang TP=2 process group's /metrics after ``scale`` requests."""
    out = ""
    for hop, sec, msgs, nbytes in (("tokenizer_wrap", 0.010, 1, 5e6),
                                   ("mm_inputs", 0.040, 2, 1e7)):
        lab = {"server": "sglang", "hop": hop, "transport": transport}
        out += _hist("mmshm_ipc_seconds", sec * scale, msgs * scale, **lab)
        out += _hist("mmshm_ipc_bytes", nbytes * scale, msgs * scale, **lab)
    for rank, sec in (("0", 0.030), ("1", 0.020)):
        for stage, mult in (("request_process", 1), ("prefill_forward", 10)):
            out += _hist("sglang:per_stage_req_latency_seconds", sec * mult * scale, scale,
                         model_name="tiny", tp_rank=rank, stage=stage)
    return out


def test_hops_total_and_own_stages_per_request():
    before, after = _exposition(2, "server"), _exposition(7, "server")  # 5 requests
    hops = ts.deltas(before, after, "sglang", "server", 5)
    assert hops["tokenizer_wrap"]["messages"] == pytest.approx(1)
    assert hops["mm_inputs"]["messages"] == pytest.approx(2)  # one per TP rank
    assert hops["mm_inputs"]["ms"] == pytest.approx(40)
    assert hops["tokenizer_wrap"]["bytes"] == pytest.approx(5e6)
    own = ts.own_stages(before, after, "sglang", 5)
    assert set(own) == {"request_process", "prefill_forward"}
    assert own["request_process"]["0"] == pytest.approx({"ms": 30, "n": 1})
    assert own["prefill_forward"]["1"]["ms"] == pytest.approx(200)
    # the other transport's run: mm_inputs cheap (the carried hash)
    m_before, m_after = _exposition(2, "mmshm"), _exposition(7, "mmshm")
    results = [{"transport": "server", "hops": {8: hops}, "own": {8: own}},
               {"transport": "mmshm", "hops": {8: ts.deltas(m_before, m_after, "sglang",
                                                            "mmshm", 5)},
                "own": {8: ts.own_stages(m_before, m_after, "sglang", 5)}}]
    total = next(line for line in ts.table(8, results, "sglang") if line.startswith("TOTAL"))
    assert total.split()[1:4] == ["3.0", "15.00", "MB"] and "50.00" in total
    lines = ts.own_table(8, results, "sglang")
    assert [ln.split()[:2] for ln in lines[2:]] == [
        ["request_process", "0"], ["request_process", "1"],
        ["prefill_forward", "0"], ["prefill_forward", "1"]]
    assert lines[2].split()[2:] == ["30.00", "30.00", "1.0x"]


def test_nothing_recorded_says_so():
    text = _exposition(1, "server")
    assert ts.own_stages(text, text, "sglang", 3) == {}
    assert "recorded nothing" in ts.own_table(1, [{"transport": "server", "own": {1: {}}}],
                                              "sglang")[0]
