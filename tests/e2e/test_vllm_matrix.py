"""The model matrix on the real vLLM 0.32 CPU server at TP=2, plain and under ``mmshm run``.

For each family of ``matrix.FAMILIES`` (LLaVA-NeXT: anyres tiles with
``image_sizes``; Qwen2.5-VL: images, a video, a video and an image in one
request; Qwen2-Audio: ``input_features``), its tiny random-weight model
(``tiny_model.py``) is served twice, one start each: plain vLLM (the
reference answers), then under ``mmshm run`` with a private segment
directory. Each runs the family's cases one at a time (1 and 2 items, n=1
and n=2; n=2 seeded, which vLLM 0.32 CPU supports only without concurrency),
with logprobs; under mmshm the metric deltas around each request.

Asserted per family: chosen-token logprobs bit-identical to plain's; the
answers depend on the inputs; per request one segment per item tensor the
HF processor makes (``matrix.expected_tensors``, computed offline), its
bytes written once whatever n is, n fan-out copies, one send reference per
tensor and child, the EngineCore re-sharing them to both TP workers; no
inline fallback and no failure; every process says it is on, without a
WARNING; the segment directory empty after the stop.

Figures (start seconds, request seconds, bytes) go to
``$MMSHM_E2E_LOGS/figures.txt`` and ``matrix-vllm.json``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import tempfile
import time
from pathlib import Path

import matrix
import pytest
from conftest import needs_e2e

pytestmark = [needs_e2e("vllm"), pytest.mark.timeout(1500)]

from server import Server, free_port, metric, segments, vllm_argv, vllm_env

#: vLLM's shape per family: --limit-mm-per-prompt (the most items a case
#: sends; a video's dummy options keep the start-up profiling at the
#: matrix's 4 frames of 448x252), --max-model-len, --mm-processor-kwargs.
VLLM = {
    "llava-next": {"limit_mm": {"image": 2}, "max_model_len": 8192},
    "qwen2.5-vl": {"limit_mm": {"image": 2, "video": {
        "count": 1, "num_frames": matrix.VIDEO_FRAMES, "width": matrix.VIDEO_SIZE[0],
        "height": matrix.VIDEO_SIZE[1]}}, "max_model_len": 8192},
    "qwen2-audio": {"limit_mm": {"audio": 2}, "processor_kwargs": {}, "max_model_len": 4096},
}
#: vLLM 0.32 sends a Qwen video's pixel_values_videos as uint8 (its
#: ``mm_device_do_normalize``, on by default for Qwen2-VL/Qwen2.5-VL: the
#: model rescales and normalizes; images on the PIL processor stay float32).
UINT8_VIDEOS = True
#: What vLLM CPU itself leaves in /dev/shm (see test_vllm_server.py).
LEAKS = ("vllm_dist_", "psm_")
#: Seconds a start may take: 40-130 s on an idle 2-core machine, several
#: times that on a busy one.
READY_TIMEOUT_S = 600
LOGS = Path(os.environ.get("MMSHM_E2E_LOGS") or tempfile.mkdtemp(prefix="mmshm-e2e-vllm-"))
_FIGURES: dict = {}


def _say(msg: str) -> None:
    with open(LOGS / "figures.txt", "a") as f:
        f.write(msg + "\n")


def _record(family: str, key: str, value) -> None:
    _FIGURES.setdefault(family, {})[key] = value
    (LOGS / "matrix-vllm.json").write_text(json.dumps(_FIGURES, indent=1, default=str))


def ask(srv: Server, case: matrix.Case) -> list[dict]:
    """One chat completion of ``case``; per choice its text, tokens and the
    chosen tokens' logprobs."""
    kwargs = {"temperature": 1.0, "seed": matrix.SEED} if case.n > 1 else {"temperature": 0.0}
    r = srv.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": matrix.content(case.items)}],
        n=case.n, max_tokens=matrix.MAX_TOKENS, logprobs=True, **kwargs)
    out = []
    for c in sorted(r.choices, key=lambda c: c.index):
        toks = c.logprobs.content if c.logprobs is not None else []
        out.append({"text": c.message.content, "tokens": [t.token for t in toks],
                    "logprobs": [t.logprob for t in toks]})
    assert len(out) == case.n and all(o["tokens"] for o in out), out
    return out


def serve(family: str, mmshm: bool, seg_dir: Path | None = None) -> dict:
    """One server of ``family`` (under ``mmshm run`` with ``seg_dir``), the
    family's cases one at a time, then a normal stop. Returns answers, per
    request seconds and (under mmshm) metric deltas, the final metrics, the
    log, the start and stop seconds, the segments held before the stop and
    what the directory holds after it."""
    fam = matrix.FAMILIES[family]
    model = matrix.model(family)
    port = free_port()
    env = vllm_env(2, **({"MMSHM_DIR": str(seg_dir)} if mmshm else {}))
    name = f"matrix-{family}-{'mmshm' if mmshm else 'plain'}"
    srv = Server(vllm_argv(model, port, 2, **VLLM[family]), port, LOGS / f"{name}.log", env=env,
                 mmshm_run=mmshm, leaks=LEAKS, ready_timeout_s=READY_TIMEOUT_S)
    rec: dict = {"answers": {}, "deltas": {}, "seconds": {}}
    with srv:
        for case in fam.cases:
            before = srv.metrics_text() if mmshm else ""
            t0 = time.monotonic()
            rec["answers"][case.key] = ask(srv, case)
            rec["seconds"][case.key] = round(time.monotonic() - t0, 2)
            if mmshm:
                rec["deltas"][case.key] = matrix.deltas(before, srv.metrics_text())
        rec["metrics"] = srv.metrics_text()
        rec["segments_before_stop"] = segments(seg_dir) if mmshm else []
        t0 = time.monotonic()
        rec["rc"] = srv.stop()
        rec["stop_s"] = round(time.monotonic() - t0, 1)
    rec["startup_s"] = round(srv.startup_s, 1)
    rec["log"] = srv.log_text()
    rec["left"] = sorted(os.listdir(seg_dir)) if mmshm else []
    what = "mmshm run" if mmshm else "plain"
    _say(f"vLLM matrix, {family}, {what}: started in {rec['startup_s']:.0f} s, "
         f"{len(fam.cases)} requests in {sum(rec['seconds'].values()):.1f} s "
         f"({rec['seconds']}), stopped in {rec['stop_s']:.1f} s")
    _record(family, what, {k: rec[k] for k in ("startup_s", "seconds", "stop_s", "deltas",
                                                "left")})
    return rec


@pytest.fixture(scope="module", params=list(VLLM))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def plain(family) -> dict:
    return serve(family, mmshm=False)


@pytest.fixture(scope="module")
def shm(family, plain) -> dict:
    """The mmshm run of ``family`` (after its plain run: one server at a time)."""
    parent = Path("/dev/shm") / f"mmshm-e2e-matrix-{os.getpid()}-{secrets.token_hex(4)}"
    parent.mkdir(mode=0o700)
    try:
        rec = serve(family, mmshm=True, seg_dir=parent / "segs")
    finally:
        subprocess.run(["rm", "-rf", str(parent)], check=False)
    fam = matrix.FAMILIES[family]
    _record(family, "expected", {
        c.key: {"tensor_bytes": matrix.expected_tensors(family, c.items,
                                                        uint8_videos=UINT8_VIDEOS),
                "shapes": matrix.tensor_shapes(family, c.items)} for c in fam.cases})
    for c in fam.cases:
        d = rec["deltas"][c.key]
        _say(f"  {family} {c.key}: {d['created']:.0f} segment(s) made + {d['pool_hits']:.0f} "
             f"pooled, {d['written']:.0f} bytes written once, {d['sent_refs']:.0f} send + "
             f"{d['bcast_refs']:.0f} broadcast references, {d['fanout']:.0f} fan-out copies")
    return rec


def test_answers_equal_plain(family, plain, shm):
    """Tokens and chosen-token logprobs bit-identical, case by case."""
    for case in matrix.FAMILIES[family].cases:
        want, got = plain["answers"][case.key], shm["answers"][case.key]
        assert len(got) == len(want) == case.n, case.key
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            assert b["tokens"] == a["tokens"], (case.key, i)
            assert b["logprobs"] == a["logprobs"], (case.key, i)  # bit-identical floats
    _say(f"  {family}: logprobs bit-identical with and without mmshm: "
         f"{sum(c.n for c in matrix.FAMILIES[family].cases)} choices")


def test_answers_depend_on_the_inputs(family, plain):
    """Without this, identical logprobs would prove nothing about the bytes."""
    firsts = {tuple(plain["answers"][c.key][0]["logprobs"][:2])
              for c in matrix.FAMILIES[family].cases}
    assert len(firsts) > 1, firsts


def test_each_item_written_once_per_fan_out(family, shm):
    """One segment per tensor, written once; each of the n child requests is
    its own message to the EngineCore (one send reference per tensor), n
    fan-out copies for n > 1."""
    problems = {}
    for c in matrix.FAMILIES[family].cases:
        tensors = [b for per_item in matrix.expected_tensors(family, c.items,
                                                             uint8_videos=UINT8_VIDEOS)
                   for b in per_item]
        p = matrix.request_problems(shm["deltas"][c.key], tensors, messages=c.n,
                                    fanout=c.n if c.n > 1 else 0)
        if p:
            problems[c.key] = p
    assert not problems, (problems, shm["deltas"])


def test_engine_core_reshares_to_both_workers(family, shm):
    """The EngineCore made no segment of its own: each tensor of a scheduled
    child request went to the 2 TP workers as one more reference each."""
    for c in matrix.FAMILIES[family].cases:
        d = shm["deltas"][c.key]
        k = sum(len(e) for e in matrix.expected_tensors(family, c.items,
                                                        uint8_videos=UINT8_VIDEOS))
        assert d["bcast_refs"] >= 2 * k, (c.key, d)


def test_no_fallback_no_failure(family, shm):
    text = shm["metrics"]
    assert metric(text, "mmshm_inline_fallbacks_total") == 0
    assert metric(text, "mmshm_materialize_failures_total") == 0
    assert metric(text, "mmshm_request_failures_total") == 0


def test_every_process_says_it_is_on(family, shm):
    log = shm["log"]
    for role in ("frontend", "EngineCore", r"worker \(rank 0\)", r"worker \(rank 1\)"):
        assert re.search(rf"mmshm\[\d+\] vllm 0\.32\.\d+, {role} \(pid \d+\): on: ", log), role
    assert "scheduler outputs to the TP workers through shared memory (2 readers)" in log
    assert "WARNING" not in "\n".join(l for l in log.splitlines() if "mmshm" in l), log


def test_nothing_left_after_the_stop(family, shm):
    assert shm["segments_before_stop"], "nothing held before the stop: the test proves nothing"
    assert shm["left"] == [], shm["log"][-4000:]
