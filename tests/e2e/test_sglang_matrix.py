"""The model matrix on the real SGLang 0.5.23 server on CPU at TP=2, as a
baseline and under ``mmshm run`` (issue 21, item 2).

For each family of ``matrix.FAMILIES`` (LLaVA-NeXT: anyres tiles with
``image_sizes``; Qwen2.5-VL: images, a video, a video and an image in one
request; Qwen2-Audio: ``input_features``), its tiny random-weight model
(``tiny_model.py``) is served twice, one start each, every case of the
family sharing it (1 and 2 items, n=1 and n=2, one request at a time):

1. the baseline, under ``mmshm run --observe``: SGLang's own transport
   (its ``ShmPointerMMData`` segments), only timed, as in
   ``test_sglang_e2e.py``; per request the answers and the bytes SGLang
   put into its own shared memory (the ``tokenizer_wrap`` hop of
   ``mmshm_ipc_bytes``);
2. under ``mmshm run``, with a private segment directory: per request the
   metric deltas around it (``matrix.deltas``).

Answers: n=1 greedy; n=2 seeded sampling (``seed=matrix.SEED``, temperature
1.0; one request at a time, so no concurrency meets the seed). Asserted per
family: the texts equal the baseline's, case by case and choice by choice;
they depend on the inputs; per request one segment per tensor the HF
processor makes (``matrix.expected_tensors``, offline; LLaVA-NeXT's images
of one request are one tensor in SGLang, see :data:`SGLANG_BUNDLED`), made
or taken warm from the pool, its bytes written once whatever n is (SGLang's
own transport took them n + 1 times: the warm-up copy and each sample), n + 1
fan-out copies for n > 1 (SGLang sends a warm-up copy first); no inline fallback,
no materialize or request failure; the TP broadcast carries metadata only;
every process says it is on, with no mmshm WARNING; the segment directory
is empty after a graceful stop, and the baseline made no mmshm segment.

A case SGLang 0.5.23 refuses by itself (several images with n > 1: "The
length of image_data should be equal to the batch size", HTTP 400) must be
refused the same way under mmshm, with no segment made. Cases SGLang cannot
run at all (see :data:`SGLANG_BROKEN`) are not sent, and are reported as
skipped with the reason.

Run by ``tests/integrations/run_sglang.py`` for 0.5.23 only (its
``E2E_TESTS_BY_RELEASE``), in ``.venvs/sglang-0.5.23-server`` with
``MMSHM_E2E=sglang``; skipped anywhere else. Figures (start seconds, per
request seconds and bytes) are printed at the end and written to
``matrix-sglang.json`` in the log folder.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import matrix
import pytest
from conftest import needs_e2e

pytestmark = [needs_e2e("sglang"), pytest.mark.timeout(1800)]

from server import Server, free_port, metric, segments, sglang_argv, sglang_env  # noqa: E402

RELEASE = os.environ.get("MMSHM_SGLANG_RELEASE", "0.0.0")
V = tuple(int(x) for x in RELEASE.split("."))
TP = 2
#: The release whose real server runs the matrix.
MATRIX_RELEASE = (0, 5, 23)

#: Cases SGLang 0.5.23 itself cannot run on CPU (plain as under mmshm):
#: (family, case key) -> why. They are not sent (each would kill the server).
SGLANG_BROKEN = {
    ("qwen2-audio", "2 audios, n=1"): (
        "SGLang 0.5.23 bug: Qwen2AudioMultimodalProcessor sets audio_feature_lens on "
        "mm_items[0] only, after get_new_expanded_mm_items split the clips into one item "
        "each; the scheduler's Qwen2AudioForConditionalGeneration.get_audio_feature then "
        "raises AttributeError: 'MultimodalDataItem' object has no attribute "
        "'audio_feature_lens', and the server exits"),
}
#: Cases SGLang 0.5.23 refuses with HTTP 400 (plain as under mmshm): the
#: message its GenerateReqInput normalization gives.
SGLANG_REFUSED = {
    ("llava-next", "2 images, n=2"): "The length of image_data should be equal to the batch size",
    ("qwen2.5-vl", "2 images, n=2"): "The length of image_data should be equal to the batch size",
    # SGLang 0.5.23 bug: GenerateReqInput repeats audio_data n times and hands
    # sample i the i-th clip, so each sample of a 2-clip prompt gets one clip
    ("qwen2-audio", "2 audios, n=2"): "Prompt has 2 audio placeholders but 1 audio inputs",
}

#: Families whose SGLang processor keeps every item of a request in one
#: MultimodalDataItem: LLaVA-NeXT runs on SGLang's Transformers backend (SGLang
#: has no LlavaNextForConditionalGeneration of its own: "has no SGLang
#: implementation, falling back to Transformers implementation"), whose
#: TransformersAutoMultimodalProcessor does not split the HF processor's
#: pixel_values [images, tiles, 3, 336, 336] per image. One tensor: one segment.
SGLANG_BUNDLED = {"llava-next"}


def sglang_tensors(family: str, case: matrix.Case) -> list[int]:
    """The bytes of each tensor SGLang's items carry through shared memory
    for ``case``: ``matrix.expected_tensors`` per item, or all of them as one
    tensor for a family of :data:`SGLANG_BUNDLED`."""
    flat = [b for per_item in matrix.expected_tensors(family, case.items) for b in per_item]
    return [sum(flat)] if family in SGLANG_BUNDLED and flat else flat


def request_problems(d: dict, family: str, case: matrix.Case) -> list[str]:
    """What is wrong with one SGLang request's ``matrix.deltas`` ``d``
    (``matrix.request_problems``): one segment per tensor of
    :func:`sglang_tensors`, written once whatever n is; for n > 1 SGLang
    sends a warm-up copy, then the n samples: n + 1 messages and fan-out
    copies."""
    messages = case.n + 1 if case.n > 1 else 1
    return matrix.request_problems(d, sglang_tensors(family, case), messages=messages,
                                   fanout=messages if case.n > 1 else 0)


LOGS = Path(os.environ.get("MMSHM_E2E_LOGS") or tempfile.mkdtemp(prefix="mmshm-e2e-sglang-"))
_FIGURES: dict = {}


def _say(msg: str) -> None:
    print(msg, flush=True)
    with open(LOGS / "figures.txt", "a") as f:
        f.write(msg + "\n")


def _record(family: str, key: str, value) -> None:
    _FIGURES.setdefault(family, {})[key] = value
    (LOGS / "matrix-sglang.json").write_text(json.dumps(_FIGURES, indent=1, default=str))


# -- media SGLang's venv can make ----------------------------------------------------------
@functools.lru_cache(maxsize=None)
def video_gif_url(name: str) -> str:
    """``matrix.video_frames(name)`` (4 frames of 448x252) as an animated
    GIF at ``matrix.VIDEO_FPS``, a data URL. SGLang's server venv has no
    OpenCV to write ``matrix.video_url``'s MPEG-4; decord (FFmpeg) reads the
    GIF as the same 4 frames at 2 fps, so the processor's tensors have the
    shapes ``matrix.expected_tensors`` computes (the pixels differ by the
    GIF palette, which no assertion depends on: both runs send this file).
    The frames differ (the window pans), so Pillow keeps all four."""
    from PIL import Image

    frames = [Image.fromarray(f) for f in matrix.video_frames(name)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:],
                   duration=int(1000 / matrix.VIDEO_FPS), loop=0)
    return "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()


def content(case: matrix.Case) -> list[dict]:
    """``matrix.content`` of the case (audio as ``audio_url`` data URLs, which
    SGLang's chat template path also takes as ``input_audio``), with videos
    as :func:`video_gif_url`."""
    parts = []
    for item in case.items:
        if item.kind == "video":
            parts.append({"type": "video_url", "video_url": {"url": video_gif_url(item.name)}})
        else:
            parts.append(matrix.item_part(item, audio_style="audio_url"))
    return parts + [{"type": "text", "text": matrix.PROMPT}]


# -- the servers ---------------------------------------------------------------------------
def _argv(family: str, port: int) -> list[str]:
    # the most tokens a case takes: 2 LLaVA-NeXT photos, about 3900
    return sglang_argv(matrix.model(family), port, TP, V)


def ask(srv: Server, case: matrix.Case) -> list[str] | str:
    """The choices' texts of one chat completion of ``case`` (n=1 greedy;
    n > 1 seeded sampling), or ``"refused: <message>"`` for an HTTP 400."""
    import openai

    kwargs = dict(temperature=1.0, seed=matrix.SEED) if case.n > 1 else dict(temperature=0.0)
    try:
        r = srv.client(timeout_s=600).chat.completions.create(
            model="default", messages=[{"role": "user", "content": content(case)}],
            n=case.n, max_tokens=matrix.MAX_TOKENS, **kwargs)
    except openai.BadRequestError as exc:
        return f"refused: {exc}"
    out = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(out) == case.n, out
    return out


def _wrap_bytes(text: str, transport: str) -> float:
    return metric(text, "mmshm_ipc_bytes_sum", server="sglang", hop="tokenizer_wrap",
                  transport=transport)


def serve(family: str, mmshm: bool, seg_dir: Path) -> dict:
    """One server of ``family``: under ``mmshm run --observe`` (the baseline)
    or ``mmshm run``, segments in ``seg_dir``; the family's cases one at a
    time, then a graceful stop. Returns answers, per request seconds, metric
    deltas and the bytes of the ``tokenizer_wrap`` hop, the final metrics,
    the log, the start and stop seconds, the segments held before the stop
    and what ``seg_dir`` holds after it."""
    fam = matrix.FAMILIES[family]
    port = free_port()
    env = sglang_env(MMSHM_DIR=str(seg_dir), MMSHM_POOL_IDLE_S="2")
    if not mmshm:
        env["MMSHM_MODE"] = "observe"
    what = "mmshm run" if mmshm else "baseline (observe)"
    name = f"matrix-{family}-{'mmshm' if mmshm else 'observe'}"
    srv = Server(_argv(family, port), port, LOGS / f"{name}.log", env=env, mmshm_run=True,
                 ready_timeout_s=600)
    rec: dict = {"answers": {}, "deltas": {}, "seconds": {}, "wrap_bytes": {}}
    transport = "mmshm" if mmshm else "server"
    with srv:
        for case in fam.cases:
            if (family, case.key) in SGLANG_BROKEN:
                continue
            before = srv.metrics_text()
            t0 = time.monotonic()
            rec["answers"][case.key] = ask(srv, case)
            rec["seconds"][case.key] = round(time.monotonic() - t0, 2)
            after = srv.metrics_text()
            rec["deltas"][case.key] = matrix.deltas(before, after)
            rec["wrap_bytes"][case.key] = _wrap_bytes(after, transport) - _wrap_bytes(
                before, transport)
        rec["metrics"] = srv.metrics_text()
        rec["segments_before_stop"] = segments(seg_dir)
        # idle pooled segments go after MMSHM_POOL_IDLE_S; then a graceful stop
        t0 = time.monotonic()
        rec["rc"] = srv.stop()
        rec["stop_s"] = round(time.monotonic() - t0, 1)
    rec["startup_s"] = round(srv.startup_s, 1)
    rec["log"] = srv.log_text()
    rec["left"] = sorted(os.listdir(seg_dir)) if seg_dir.exists() else []
    _say(f"SGLang {RELEASE} matrix, {family}, {what}: started in {rec['startup_s']:.0f} s, "
         f"{len(rec['seconds'])} requests in {sum(rec['seconds'].values()):.1f} s "
         f"({rec['seconds']}), stopped in {rec['stop_s']:.1f} s")
    _record(family, what, {k: rec[k] for k in ("startup_s", "seconds", "stop_s", "deltas",
                                                "wrap_bytes", "left", "answers")})
    return rec


@pytest.fixture(scope="module", params=list(matrix.FAMILIES))
def family(request) -> str:
    if V != MATRIX_RELEASE:
        pytest.skip(f"the model matrix runs on SGLang {'.'.join(map(str, MATRIX_RELEASE))} "
                    f"only (run_sglang.py lists it for that release), not {RELEASE}")
    return request.param


@pytest.fixture(scope="module")
def seg_parent():
    parent = Path("/dev/shm") / f"mmshm-e2e-sglang-matrix-{os.getpid()}-{secrets.token_hex(4)}"
    parent.mkdir(mode=0o700)
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(scope="module")
def plain(family, seg_parent) -> dict:
    return serve(family, mmshm=False, seg_dir=seg_parent / f"{family}-observe")


@pytest.fixture(scope="module")
def shm(family, plain, seg_parent) -> dict:
    """The mmshm run of ``family`` (after its baseline: one server at a time)."""
    rec = serve(family, mmshm=True, seg_dir=seg_parent / f"{family}-mmshm")
    fam = matrix.FAMILIES[family]
    _record(family, "expected", {
        c.key: {"tensor_bytes": matrix.expected_tensors(family, c.items),
                "shapes": matrix.tensor_shapes(family, c.items)} for c in fam.cases})
    for c in fam.cases:
        if c.key not in rec["deltas"]:
            continue
        d = rec["deltas"][c.key]
        _say(f"  {family} {c.key}: {d['created']:.0f} segment(s) made + {d['pool_hits']:.0f} "
             f"pooled, {d['written']:.0f} bytes written (SGLang's own transport: "
             f"{plain['wrap_bytes'][c.key]:.0f}), {d['fanout']:.0f} fan-out copies")
    return rec


def _sent(family: str) -> list[matrix.Case]:
    return [c for c in matrix.FAMILIES[family].cases if (family, c.key) not in SGLANG_BROKEN]


def _answered(family: str) -> list[matrix.Case]:
    return [c for c in _sent(family) if (family, c.key) not in SGLANG_REFUSED]


def test_sglang_cannot_run(family):
    """What SGLang 0.5.23 cannot run of this family, said as a skip."""
    broken = {k: why for (f, k), why in SGLANG_BROKEN.items() if f == family}
    if broken:
        pytest.skip("; ".join(f"{k}: {why}" for k, why in broken.items()))


def test_answers_equal_plain(family, plain, shm):
    """Texts identical, case by case and choice by choice; refusals alike."""
    for case in _sent(family):
        want, got = plain["answers"][case.key], shm["answers"][case.key]
        refused = SGLANG_REFUSED.get((family, case.key))
        if refused:
            for a in (want, got):
                assert isinstance(a, str) and refused in a, (case.key, a)
            continue
        assert isinstance(want, list) and len(want) == case.n, (case.key, want)
        assert got == want, case.key
    _say(f"  {family}: texts equal with and without mmshm: "
         f"{sum(c.n for c in _answered(family))} choices")


def test_answers_depend_on_the_inputs(family, plain):
    """Without this, equal texts would prove nothing about the bytes."""
    firsts = {plain["answers"][c.key][0] for c in _answered(family)}
    assert len(firsts) > 1, firsts


def test_each_item_written_once_per_fan_out(family, plain, shm):
    """One segment per tensor, its bytes once whatever n is (see
    :func:`request_problems`); SGLang's own transport took the same bytes
    n + 1 times (the warm-up copy and each sample)."""
    problems = {}
    for c in _sent(family):
        d = dict(shm["deltas"][c.key])
        if (family, c.key) in SGLANG_REFUSED:
            p = [f"{k} {d[k]:.0f}" for k in ("created", "pool_hits", "written", "fanout") if d[k]]
        else:
            p = request_problems(d, family, c)
            nbytes = sum(sglang_tensors(family, c))
            own = plain["wrap_bytes"][c.key]
            copies = c.n + 1 if c.n > 1 else 1
            if own != copies * nbytes:
                p.append(f"SGLang's own transport took {own:.0f} bytes, want {copies} x {nbytes}")
            if shm["wrap_bytes"][c.key] != nbytes:
                p.append(f"mmshm's tokenizer_wrap hop took {shm['wrap_bytes'][c.key]:.0f} "
                         f"bytes, want {nbytes}")
        if p:
            problems[c.key] = p
    assert not problems, (problems, shm["deltas"])


def test_no_fallback_no_failure(family, shm):
    text = shm["metrics"]
    assert metric(text, "mmshm_inline_fallbacks_total") == 0
    assert metric(text, "mmshm_materialize_failures_total") == 0
    assert metric(text, "mmshm_request_failures_total") == 0


def test_broadcast_carries_metadata_only(family, shm):
    """Every TP broadcast under 100 kB (token ids, mrope positions), against
    megabytes of features per item."""
    text = shm["metrics"]
    count = metric(text, "mmshm_broadcast_bytes_count", role="src")
    small = metric(text, "mmshm_broadcast_bytes_bucket", role="src", le="100000.0")
    assert count >= len(_answered(family)) and small == count, (count, small)


def test_every_process_says_it_is_on(family, shm):
    log = shm["log"]
    roles = ["tokenizer"] + [f"scheduler (TP rank {r})" for r in range(TP)]
    for role in roles:
        assert re.search(rf"mmshm\[\d+\] sglang {re.escape(RELEASE)}, {re.escape(role)} "
                         rf"\(pid \d+\): on: ", log), role
    assert " is OFF: " not in log
    warnings = [line for line in log.splitlines() if "mmshm" in line and "WARNING" in line]
    assert not warnings, warnings


def test_baseline_made_no_segment(family, plain):
    assert metric(plain["metrics"], "mmshm_segments_created_total") == 0
    assert plain["segments_before_stop"] == [] and plain["left"] == []


def test_nothing_left_after_the_stop(family, shm):
    assert sum(d["created"] for d in shm["deltas"].values()) > 0, "no segment was made"
    assert shm["left"] == [], shm["log"][-4000:]
