"""The model matrix on both real servers, plain and under ``mmshm run``:
SGLang 0.5.23 and vLLM 0.32 CPU, each at TP=2, one parametrized file.

For each family of ``matrix.FAMILIES`` (LLaVA-NeXT: anyres tiles with
``image_sizes``; Qwen2.5-VL: images, a video, a video and an image in one
request; Qwen2-Audio: ``input_features``), its tiny random-weight model
(``tests/harness/models.py``) is served twice, one start each, every case
of the family sharing it (1 and 2 items, n=1 and n=2; n=2 seeded, one
request at a time on each server):

- the baseline: plain vLLM (the reference answers, with logprobs), or
  SGLang under ``mmshm run --observe`` (SGLang's own transport, its
  ``ShmPointerMMData`` segments, only timed; per request the bytes SGLang
  put into its own shared memory: the ``tokenizer_wrap`` hop of
  ``mmshm_ipc_bytes``);
- under ``mmshm run``, with a private segment directory: per request the
  metric deltas around it (``matrix.deltas``).

The two servers of a family start side by side (``servers.start_all``: a
start is mostly one process at a time importing Python, so two take little
more than one on two cores), then run their cases one server after the
other (two servers computing at once, each TP rank's threads bound to a
core, slow each other down more than they gain), the baseline's graceful
stop beside the mmshm server's cases. As root each runs
in a private mount namespace whose /dev/shm is a tmpfs of its own (what the
server itself leaves there, SGLang's ``sgl_shm_mq_*`` and
``sglang_loads_*`` after a clean TP=2 stop included, goes with the tmpfs);
the host's /dev/shm must hold no new server file after the family.

Asserted per server and family (the same names for both servers where the
behaviour is the same):

- answers equal to the baseline's (vLLM: chosen-token logprobs
  bit-identical; SGLang: texts, and a case SGLang refuses by itself refused
  alike, see :data:`SGLANG_REFUSED`); they depend on the inputs;
- per request one segment per tensor the HF processor makes
  (``matrix.expected_tensors``, offline), made or taken warm from the pool,
  its bytes written once whatever n is, one send reference per tensor and
  message, the fan-out copies counted (vLLM: n child requests; SGLang: a
  warm-up copy and n samples, and its own transport took the bytes n + 1
  times);
- vLLM: the EngineCore re-shares each tensor to both TP workers; SGLang:
  every TP broadcast carries metadata only, the baseline made no segment;
- no inline fallback, no materialize or request failure; every process
  says it is on, with no mmshm WARNING; the segment directory is empty after
  a graceful stop.

Cases SGLang 0.5.23 cannot run at all (:data:`SGLANG_BROKEN`) are not sent,
and are reported as skipped with the reason.

Run by the runners in the server's own environment with ``MMSHM_E2E`` naming
the server (SGLang: for 0.5.23 only); skipped anywhere else. Figures (start
seconds, per request seconds and bytes) go to ``$MMSHM_E2E_LOGS/figures.txt``
and ``matrix-<server>.json``.
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
import time
from pathlib import Path

import pytest

from tests.harness import matrix
from tests.harness.servers import (
    PRIVATE_SHM, Server, e2e_logs, free_port, host_shm_files, host_shm_new, in_parallel, metric,
    mount_tmpfs, private_shm_prefix, segments, sglang_argv, sglang_env, start_all, unmount_tmpfs,
    vllm_argv, vllm_env)

SERVERS = ("sglang", "vllm")
E2E = os.environ.get("MMSHM_E2E", "")
pytestmark = pytest.mark.timeout(1800)

RELEASE = os.environ.get("MMSHM_SGLANG_RELEASE", "0.0.0")
V = tuple(int(x) for x in RELEASE.split("."))
TP = 2
#: The SGLang release whose real server runs the matrix.
MATRIX_RELEASE = (0, 5, 23)
#: Seconds a start may take: 40-130 s on an idle 2-core machine, several
#: times that on a busy one (two at once here).
READY_TIMEOUT_S = 600
#: Each server's private /dev/shm (a video request's tensors are a few MB;
#: the size only bounds the tmpfs).
SHM_SIZE = "2g"
LOGS = e2e_logs(f"mmshm-e2e-{E2E}-")
_FIGURES: dict = {}


def _say(msg: str) -> None:
    print(msg, flush=True)
    with open(LOGS / "figures.txt", "a") as f:
        f.write(msg + "\n")


def _record(server: str, family: str, key: str, value) -> None:
    _FIGURES.setdefault(family, {})[key] = value
    (LOGS / f"matrix-{server}.json").write_text(json.dumps(_FIGURES, indent=1, default=str))


# -- SGLang ---------------------------------------------------------------------------------
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


class Sglang:
    """SGLang's side of the matrix: its baseline is ``mmshm run --observe``."""

    name = "sglang"
    baseline = "baseline (observe)"

    def argv(self, family: str, port: int) -> list[str]:
        # the most tokens a case takes: 2 LLaVA-NeXT photos, about 3900
        return sglang_argv(matrix.model(family), port, TP, V)

    def env(self, mmshm: bool, seg_dir: str) -> tuple[dict, bool]:
        env = sglang_env(MMSHM_DIR=seg_dir, MMSHM_POOL_IDLE_S="2")
        if not mmshm:
            env["MMSHM_MODE"] = "observe"
        return env, True  # both under mmshm run

    def sent(self, family: str) -> list[matrix.Case]:
        return [c for c in matrix.FAMILIES[family].cases if (family, c.key) not in SGLANG_BROKEN]

    def answered(self, family: str) -> list[matrix.Case]:
        return [c for c in self.sent(family) if (family, c.key) not in SGLANG_REFUSED]

    def content(self, case: matrix.Case) -> list[dict]:
        """``matrix.content`` of the case (audio as ``audio_url`` data URLs,
        which SGLang's chat template path also takes as ``input_audio``), with
        videos as :func:`video_gif_url`."""
        parts = []
        for item in case.items:
            if item.kind == "video":
                parts.append({"type": "video_url",
                              "video_url": {"url": video_gif_url(item.name)}})
            else:
                parts.append(matrix.item_part(item, audio_style="audio_url"))
        return parts + [{"type": "text", "text": matrix.PROMPT}]

    def ask(self, srv: Server, case: matrix.Case) -> list[str] | str:
        """The choices' texts of one chat completion of ``case`` (n=1 greedy;
        n > 1 seeded sampling), or ``"refused: <message>"`` for an HTTP 400."""
        import openai

        kwargs = dict(temperature=1.0, seed=matrix.SEED) if case.n > 1 else dict(temperature=0.0)
        try:
            r = srv.client(timeout_s=600).chat.completions.create(
                model="default", messages=[{"role": "user", "content": self.content(case)}],
                n=case.n, max_tokens=matrix.MAX_TOKENS, **kwargs)
        except openai.BadRequestError as exc:
            return f"refused: {exc}"
        out = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
        assert len(out) == case.n, out
        return out

    def tensors(self, family: str, case: matrix.Case) -> list[int]:
        """The bytes of each tensor SGLang's items carry through shared memory
        for ``case``: ``matrix.expected_tensors`` per item, or all of them as
        one tensor for a family of :data:`SGLANG_BUNDLED`."""
        flat = [b for per_item in matrix.expected_tensors(family, case.items) for b in per_item]
        return [sum(flat)] if family in SGLANG_BUNDLED and flat else flat

    def request_problems(self, d: dict, family: str, case: matrix.Case) -> list[str]:
        """``matrix.request_problems`` of one request: one segment per tensor
        of :meth:`tensors`, written once whatever n is; for n > 1 SGLang sends
        a warm-up copy, then the n samples: n + 1 messages and fan-out copies."""
        messages = case.n + 1 if case.n > 1 else 1
        return matrix.request_problems(d, self.tensors(family, case), messages=messages,
                                       fanout=messages if case.n > 1 else 0)

    @staticmethod
    def wrap_bytes(text: str, transport: str) -> float:
        return metric(text, "mmshm_ipc_bytes_sum", server="sglang", hop="tokenizer_wrap",
                      transport=transport)


class Vllm:
    """vLLM's side of the matrix: its baseline is the plain server."""

    name = "vllm"
    baseline = "plain"
    #: vLLM's shape per family: --limit-mm-per-prompt (the most items a case
    #: sends; a video's dummy options keep the start-up profiling at the
    #: matrix's 4 frames of 448x252), --max-model-len, --mm-processor-kwargs.
    SHAPES = {
        "llava-next": {"limit_mm": {"image": 2}, "max_model_len": 8192},
        "qwen2.5-vl": {"limit_mm": {"image": 2, "video": {
            "count": 1, "num_frames": matrix.VIDEO_FRAMES, "width": matrix.VIDEO_SIZE[0],
            "height": matrix.VIDEO_SIZE[1]}}, "max_model_len": 8192},
        "qwen2-audio": {"limit_mm": {"audio": 2}, "processor_kwargs": {},
                        "max_model_len": 4096},
    }
    #: vLLM 0.32 sends a Qwen video's pixel_values_videos as uint8 (its
    #: ``mm_device_do_normalize``, on by default for Qwen2-VL/Qwen2.5-VL: the
    #: model rescales and normalizes; images on the PIL processor stay float32).
    UINT8_VIDEOS = True

    def argv(self, family: str, port: int) -> list[str]:
        return vllm_argv(matrix.model(family), port, TP, **self.SHAPES[family])

    def env(self, mmshm: bool, seg_dir: str) -> tuple[dict, bool]:
        return vllm_env(TP, **({"MMSHM_DIR": seg_dir} if mmshm else {})), mmshm

    def sent(self, family: str) -> list[matrix.Case]:
        return list(matrix.FAMILIES[family].cases)

    answered = sent

    def ask(self, srv: Server, case: matrix.Case) -> list[dict]:
        """One chat completion of ``case``; per choice its text, tokens and
        the chosen tokens' logprobs."""
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

    def tensors(self, family: str, case: matrix.Case) -> list[int]:
        return [b for per_item in matrix.expected_tensors(family, case.items,
                                                          uint8_videos=self.UINT8_VIDEOS)
                for b in per_item]

    def request_problems(self, d: dict, family: str, case: matrix.Case) -> list[str]:
        """Each of the n child requests is its own message to the EngineCore
        (one send reference per tensor), n fan-out copies for n > 1."""
        return matrix.request_problems(d, self.tensors(family, case), messages=case.n,
                                       fanout=case.n if case.n > 1 else 0)


ADAPTERS = {"sglang": Sglang(), "vllm": Vllm()}


# -- the servers ----------------------------------------------------------------------------
def _run_cases(a, family: str, srv: Server, mmshm: bool, seg_host: Path) -> dict:
    """The family's cases one at a time on the running ``srv``. Returns
    answers, per request seconds and metric deltas (and, on SGLang, the
    bytes of the ``tokenizer_wrap`` hop), the final metrics and the segments
    held before the stop (:func:`_stop` adds the rest)."""
    rec: dict = {"answers": {}, "deltas": {}, "seconds": {}, "wrap_bytes": {}}
    deltas = mmshm or a.name == "sglang"
    transport = "mmshm" if mmshm else "server"
    for case in a.sent(family):
        before = srv.metrics_text() if deltas else ""
        t0 = time.monotonic()
        rec["answers"][case.key] = a.ask(srv, case)
        rec["seconds"][case.key] = round(time.monotonic() - t0, 2)
        if deltas:
            after = srv.metrics_text()
            rec["deltas"][case.key] = matrix.deltas(before, after)
            if a.name == "sglang":
                rec["wrap_bytes"][case.key] = (Sglang.wrap_bytes(after, transport)
                                               - Sglang.wrap_bytes(before, transport))
    rec["metrics"] = srv.metrics_text()
    rec["segments_before_stop"] = segments(seg_host)
    return rec


def _stop(srv: Server, rec: dict, seg_host: Path) -> None:
    """A graceful stop of ``srv``; adds its exit status, its seconds and what
    the segment directory holds after it to ``rec``."""
    t0 = time.monotonic()
    rec["rc"] = srv.stop()
    rec["stop_s"] = round(time.monotonic() - t0, 1)
    rec["left"] = sorted(os.listdir(seg_host)) if seg_host.exists() else []


def serve_pair(a, family: str, parent: Path) -> dict:
    """The baseline and the mmshm server of ``family``, started side by side,
    their cases run one server after the other, each stopped; returns both
    records."""
    names = {False: f"matrix-{family}-{'observe' if a.name == 'sglang' else 'plain'}",
             True: f"matrix-{family}-mmshm"}
    srvs, seg_host, shms = {}, {}, []
    for mmshm in (False, True):
        prefix = None
        if PRIVATE_SHM:
            shm = mount_tmpfs(f"mmshm-matrix-{a.name}-", SHM_SIZE)
            shms.append(shm)
            seg_host[mmshm], seg_inside = shm / "segs", "/dev/shm/segs"
            prefix = private_shm_prefix(shm)
        else:
            seg_host[mmshm] = seg_inside = parent / names[mmshm]
            seg_inside = str(seg_inside)
        port = free_port()
        env, under_mmshm = a.env(mmshm, seg_inside)
        srvs[mmshm] = Server(a.argv(family, port), port, LOGS / f"{names[mmshm]}.log",
                             env=env, mmshm_run=under_mmshm, prefix=prefix,
                             ready_timeout_s=READY_TIMEOUT_S)
    try:
        t0 = time.monotonic()
        start_all(srvs[False], srvs[True])
        both_s = round(time.monotonic() - t0, 1)
        # the cases one server at a time: two servers computing at once on two
        # cores (each TP rank's threads bound to a core) slow each other down
        # far more than running one after the other. The baseline's graceful
        # stop runs beside the mmshm server's cases: it is mostly waiting
        # (SGLang's SIGTERM watchdog sleeps in 5 s steps)
        recs = {False: _run_cases(a, family, srvs[False], False, seg_host[False])}

        def mmshm_side() -> dict:
            rec = _run_cases(a, family, srvs[True], True, seg_host[True])
            _stop(srvs[True], rec, seg_host[True])
            return rec

        _, recs[True] = in_parallel(lambda: _stop(srvs[False], recs[False], seg_host[False]),
                                    mmshm_side)
    finally:
        for s in srvs.values():
            s.kill()
        for shm in shms:
            unmount_tmpfs(shm)
    for mmshm, rec in recs.items():
        srv = srvs[mmshm]
        rec["startup_s"] = round(srv.startup_s, 1)
        rec["log"] = srv.log_text()
        what = "mmshm run" if mmshm else a.baseline
        _say(f"{a.name} matrix, {family}, {what}: ready in {rec['startup_s']:.0f} s (both "
             f"servers started side by side in {both_s:.0f} s), {len(rec['seconds'])} requests "
             f"in {sum(rec['seconds'].values()):.1f} s ({rec['seconds']}), stopped in "
             f"{rec['stop_s']:.1f} s")
        _record(a.name, family, what, {k: rec[k] for k in (
            "startup_s", "seconds", "stop_s", "deltas", "wrap_bytes", "left", "answers")})
    return {"plain": recs[False], "shm": recs[True]}


@pytest.fixture(scope="module", params=[E2E] if E2E in SERVERS else list(SERVERS))
def server(request):
    """The server adapter (:class:`Sglang`, :class:`Vllm`) of this run."""
    name = request.param
    if E2E != name:
        pytest.skip(f"real-server e2e test: run by its runner with MMSHM_E2E={name} in the "
                    f"server's environment")
    if name == "sglang" and V != MATRIX_RELEASE:
        pytest.skip(f"the model matrix runs on SGLang {'.'.join(map(str, MATRIX_RELEASE))} "
                    f"only (the runner lists it for that release), not {RELEASE}")
    return ADAPTERS[name]


@pytest.fixture(scope="module", params=list(matrix.FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def pair(server, family) -> dict:
    parent = Path("/dev/shm") / f"mmshm-e2e-matrix-{os.getpid()}-{secrets.token_hex(4)}"
    parent.mkdir(mode=0o700)
    host_before = host_shm_files()
    try:
        recs = serve_pair(server, family, parent)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    recs["host_left"] = host_shm_new(host_before)
    fam = matrix.FAMILIES[family]
    uint8 = getattr(server, "UINT8_VIDEOS", False)
    _record(server.name, family, "expected", {
        c.key: {"tensor_bytes": matrix.expected_tensors(family, c.items, uint8_videos=uint8),
                "shapes": matrix.tensor_shapes(family, c.items)} for c in fam.cases})
    plain, shm = recs["plain"], recs["shm"]
    for c in server.sent(family):
        d = shm["deltas"][c.key]
        own = (f"SGLang's own transport: {plain['wrap_bytes'][c.key]:.0f}"
               if server.name == "sglang" else "once")
        _say(f"  {family} {c.key}: {d['created']:.0f} segment(s) made + {d['pool_hits']:.0f} "
             f"pooled, {d['written']:.0f} bytes written ({own}), {d['sent_refs']:.0f} send + "
             f"{d['bcast_refs']:.0f} broadcast references, {d['fanout']:.0f} fan-out copies")
    return recs


@pytest.fixture(scope="module")
def plain(pair) -> dict:
    return pair["plain"]


@pytest.fixture(scope="module")
def shm(pair) -> dict:
    return pair["shm"]


# -- both servers -----------------------------------------------------------------------------
def test_answers_equal_plain(server, family, plain, shm):
    """vLLM: tokens and chosen-token logprobs bit-identical, case by case.
    SGLang: texts identical, case by case and choice by choice; refusals alike."""
    for case in server.sent(family):
        want, got = plain["answers"][case.key], shm["answers"][case.key]
        if server.name == "vllm":
            assert len(got) == len(want) == case.n, case.key
            for i, (a, b) in enumerate(zip(want, got, strict=True)):
                assert b["tokens"] == a["tokens"], (case.key, i)
                assert b["logprobs"] == a["logprobs"], (case.key, i)  # bit-identical floats
            continue
        refused = SGLANG_REFUSED.get((family, case.key))
        if refused:
            for a in (want, got):
                assert isinstance(a, str) and refused in a, (case.key, a)
            continue
        assert isinstance(want, list) and len(want) == case.n, (case.key, want)
        assert got == want, case.key
    what = "logprobs bit-identical" if server.name == "vllm" else "texts equal"
    _say(f"  {server.name} {family}: {what} with and without mmshm: "
         f"{sum(c.n for c in server.answered(family))} choices")


def test_answers_depend_on_the_inputs(server, family, plain):
    """Without this, equal answers would prove nothing about the bytes."""
    if server.name == "vllm":
        firsts = {tuple(plain["answers"][c.key][0]["logprobs"][:2])
                  for c in server.answered(family)}
    else:
        firsts = {plain["answers"][c.key][0] for c in server.answered(family)}
    assert len(firsts) > 1, firsts


def test_each_item_written_once_per_fan_out(server, family, plain, shm):
    """One segment per tensor, its bytes once whatever n is, one send
    reference per tensor and message, the fan-out copies counted (see the
    adapters' ``request_problems``); on SGLang its own transport took the
    same bytes n + 1 times (the warm-up copy and each sample), and a request
    it refuses made no segment."""
    problems = {}
    for c in server.sent(family):
        d = dict(shm["deltas"][c.key])
        if (family, c.key) in SGLANG_REFUSED and server.name == "sglang":
            p = [f"{k} {d[k]:.0f}" for k in ("created", "pool_hits", "written", "fanout") if d[k]]
        else:
            p = server.request_problems(d, family, c)
        if server.name == "sglang" and (family, c.key) not in SGLANG_REFUSED:
            nbytes = sum(server.tensors(family, c))
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


def test_no_fallback_no_failure(server, family, shm):
    text = shm["metrics"]
    assert metric(text, "mmshm_inline_fallbacks_total") == 0
    assert metric(text, "mmshm_materialize_failures_total") == 0
    assert metric(text, "mmshm_request_failures_total") == 0


def test_every_process_says_it_is_on(server, family, shm):
    log = shm["log"]
    if server.name == "vllm":
        for role in ("frontend", "EngineCore", r"worker \(rank 0\)", r"worker \(rank 1\)"):
            assert re.search(rf"mmshm\[\d+\] vllm 0\.32\.\d+, {role} \(pid \d+\): on: ", log), role
        assert "scheduler outputs to the TP workers through shared memory (2 readers)" in log
        assert "WARNING" not in "\n".join(line for line in log.splitlines() if "mmshm" in line), log
        return
    roles = ["tokenizer"] + [f"scheduler (TP rank {r})" for r in range(TP)]
    for role in roles:
        assert re.search(rf"mmshm\[\d+\] sglang {re.escape(RELEASE)}, {re.escape(role)} "
                         rf"\(pid \d+\): on: ", log), role
    assert " is OFF: " not in log
    warnings = [line for line in log.splitlines() if "mmshm" in line and "WARNING" in line]
    assert not warnings, warnings


def test_nothing_left_after_the_stop(server, family, shm):
    if server.name == "vllm":
        assert shm["segments_before_stop"], "nothing held before the stop: the test proves nothing"
    else:
        assert sum(d["created"] for d in shm["deltas"].values()) > 0, "no segment was made"
    assert shm["left"] == [], shm["log"][-4000:]


def test_nothing_left_in_the_hosts_dev_shm(server, family, pair):
    """Neither server left a file of its own (SGLang's ``sgl_shm_mq_*``,
    ``sglang_loads_*``; ``psm_*``, ``vllm_dist_*``, mmshm's segments) in the
    host's /dev/shm: each ran on a private one, gone with it."""
    if not PRIVATE_SHM:
        pytest.skip("needs root and unshare for a private /dev/shm per server")
    assert pair["host_left"] == [], pair["host_left"]


# -- one server ---------------------------------------------------------------------------------
def test_sglang_cannot_run(server, family):
    """What SGLang 0.5.23 cannot run of this family, said as a skip."""
    if server.name != "sglang":
        pytest.skip("SGLang's cases only")
    broken = {k: why for (f, k), why in SGLANG_BROKEN.items() if f == family}
    if broken:
        pytest.skip("; ".join(f"{k}: {why}" for k, why in broken.items()))


def test_broadcast_carries_metadata_only(server, family, shm):
    """SGLang: every TP broadcast under 100 kB (token ids, mrope positions),
    against megabytes of features per item."""
    if server.name != "sglang":
        pytest.skip("SGLang's TP broadcast (vLLM's workers: "
                    "test_engine_core_reshares_to_both_workers)")
    text = shm["metrics"]
    count = metric(text, "mmshm_broadcast_bytes_count", role="src")
    small = metric(text, "mmshm_broadcast_bytes_bucket", role="src", le="100000.0")
    assert count >= len(server.answered(family)) and small == count, (count, small)


def test_baseline_made_no_segment(server, family, plain):
    """SGLang's baseline runs under ``mmshm run --observe``: no segment of
    mmshm's (vLLM's baseline is plain vLLM, without mmshm)."""
    if server.name != "sglang":
        pytest.skip("vLLM's baseline runs without mmshm")
    assert metric(plain["metrics"], "mmshm_segments_created_total") == 0
    assert plain["segments_before_stop"] == [] and plain["left"] == []


def test_engine_core_reshares_to_both_workers(server, family, shm):
    """vLLM: the EngineCore made no segment of its own: each tensor of a
    scheduled child request went to the 2 TP workers as one more reference
    each."""
    if server.name != "vllm":
        pytest.skip("vLLM's EngineCore (SGLang: test_broadcast_carries_metadata_only)")
    for c in matrix.FAMILIES[family].cases:
        d = shm["deltas"][c.key]
        k = len(server.tensors(family, c))
        assert d["bcast_refs"] >= 2 * k, (c.key, d)
