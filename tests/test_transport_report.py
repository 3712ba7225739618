"""``mmshm bench serve transport``'s report, on synthetic expositions: the
hops' per-request figures, the like-for-like TOTAL and the server's own
latency histograms read beside them (no server is started here)."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")
from mmshm.bench.serve import transport as ts  # noqa: E402


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


def _vllm_exposition(scale: float, transport: str, stamped: float = 1.0) -> str:
    """One vLLM TP=2 server's /metrics after ``scale`` requests: every hop,
    the frontend -> EngineCore ``zmq_transfer`` included (``stamped``: the
    share of requests it observed)."""
    out = ""
    for hop, sec, msgs, nbytes in (("frontend_encode", 0.004, 1, 2e7),
                                   ("zmq_transfer", 0.006, stamped, 2e7),
                                   ("engine_decode", 0.002, 1, 2e7),
                                   ("mq_enqueue", 0.003, 1, 2e7),
                                   ("mq_dequeue", 0.001, 2, 2e7)):
        lab = {"server": "vllm", "hop": hop, "transport": transport}
        out += _hist("mmshm_ipc_seconds", sec * msgs * scale, msgs * scale, **lab)
        out += _hist("mmshm_ipc_bytes", nbytes * msgs * scale, msgs * scale, **lab)
    return out


def _vllm_results(stamped: float = 1.0) -> list[dict]:
    return [{"config": c, "transport": tr,
             "hops": {1: ts.deltas(_vllm_exposition(1, tr, s), _vllm_exposition(3, tr, s),
                                   "vllm", tr, 2)}}
            for c, tr, s in (("observe", "server", stamped), ("mmshm", "mmshm", 1.0))]


def test_vllm_frontend_to_engine_hop_is_in_the_total_and_every_hop_has_its_floor_ratio():
    """vLLM's zmq_transfer is a hop of the table, second in a request's order,
    counted in TOTAL (4 + 6 + 2 + 3 + 2 x 1 = 17 ms per request); each hop
    and the TOTAL come with their multiple of the floor (here 2 ms), in the
    table and in floor_ratios (the report's ``x_memcpy``); no untimed note."""
    assert ts.HOPS["vllm"][:3] == ("frontend_encode", "zmq_transfer", "engine_decode")
    assert ts.INVISIBLE["vllm"] == ""
    results = _vllm_results()
    lines = ts.table(1, results, "vllm", floor_ms=2.0)
    assert "x floor" in lines[0]
    rows = {ln.split()[0]: ln.split() for ln in lines[2:]}
    assert list(rows)[:3] == ["frontend_encode", "zmq_transfer", "engine_decode"]
    # hop, server msg, bytes (2 tokens), ms, x floor, mmshm msg, bytes, ms, x floor, ratio
    assert rows["zmq_transfer"][1] == "1.0"
    assert rows["zmq_transfer"][4:6] == ["6.00", "3.00"]
    assert rows["TOTAL"][4:6] == ["17.00", "8.50"]
    assert rows["TOTAL"][9:11] == ["17.00", "8.50"]
    assert rows["TOTAL"][11] == "1.0x"
    x = ts.floor_ratios(1, results, 2.0)
    assert x["server"]["zmq_transfer"] == pytest.approx(3.0)
    assert x["mmshm"]["mq_dequeue"] == pytest.approx(1.0)  # 2 messages of 1 ms
    assert x["server"]["TOTAL"] == pytest.approx(8.5)
    assert set(x["server"]) == {*ts.HOPS["vllm"], "TOTAL"}
    assert ts.unpaired(1, results, "vllm") == []
    # without a floor the columns say so, and nothing else changes
    assert ts.table(1, results, "vllm")[2].split()[5] == "—"


def test_missing_zmq_transfer_observations_are_said():
    """A zmq_transfer observed for half the requests (stamps that did not
    reach the EngineCore) is a WARNING under the table, naming the mode."""
    results = _vllm_results(stamped=0.5)
    warn = ts.unpaired(1, results, "vllm")
    assert len(warn) == 1 and warn[0].startswith("WARNING: observe: zmq_transfer observed 0.50")
