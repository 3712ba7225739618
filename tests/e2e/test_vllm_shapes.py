"""vLLM's deployment shapes, launched for real: data parallelism and 1P1D
prefill/decode disaggregation, plain and under ``mmshm run``.

One shape per start, started twice (plain, then under ``mmshm run``), every
case against it:

- **P**, the prefill instance: ``--data-parallel-size 2`` (TP=1: two
  EngineCores, each with its worker, one CPU core each), and a KV producer
  (``--kv-transfer-config``: vLLM's ``ExampleConnector``, which stores each
  prompt's KV in a private temporary directory);
- **D**, the decode instance: TP=1, a KV consumer on the same directory
  (``kv_load_failure_policy`` ``fail``, vLLM 0.32's default), on its own port.

Cases, in order, on both starts:

1. **DP**: requests pinned to each DP rank (vLLM's ``X-data-parallel-rank``
   header), 1 and 3 photos, n=1 and n=2: chosen-token logprobs bit-identical
   plain vs mmshm; both engines answered (vLLM's
   ``vllm:request_success_total{engine}``); under mmshm each photo written
   once whatever n is (:func:`matrix.request_problems`), and the "on:" lines
   name the DP rank of each EngineCore and worker.
2. **PD**, as vLLM's toy proxy does it: the request to P with
   ``max_tokens=1`` and ``kv_transfer_params.do_remote_decode``, then to D
   with ``do_remote_prefill``; the unified answer is P's own (the same
   request answered by P). D's greedy tokens equal it, plain and under
   mmshm (D's logprobs are bit-identical plain vs mmshm; against P's they
   differ in the last float bits, since D computes the prompt's tail on
   loaded KV). The prompt's text after the photos is longer than the block
   size (``--block-size 32``), so the tail D computes holds no image
   placeholder: D loads the KV of every image token and never runs the
   vision encoder.
3. **A decode instance writes no pixels**: under mmshm, D's frontend says
   it withholds the pixel payload of requests prefilled elsewhere, and D
   writes 0 bytes into shared memory for them with answers unchanged
   (``integrations/vllm.py``: :func:`decode_payload_policy`). A request sent
   to D directly (no ``kv_transfer_params``) keeps its pixels (D computes
   it): the same answer as plain D, its photo written once.
4. **Bad input**: a request marked ``do_remote_prefill`` whose KV never
   arrived (P never saw it): plain D recomputes and answers; under mmshm D
   fails it with ``PayloadWithheldError`` (an error answer, D alive), never
   running the encoder on a stand-in; nothing is left behind.
5. **Nothing left**: after the pool's idle time neither segment directory
   holds anything ``mmshm status`` does not explain, ``mmshm gc --dry-run``
   finds no orphan, and both are empty (``faults.settle``).
6. **A DP rank killed mid-request** (mmshm only, ending that start): one
   streamed request decoding on DP rank 1, whose EngineCore is SIGKILLed,
   and at once the whole group, ``mmshm run`` included (when only the
   engine dies, vLLM stops and ``mmshm run`` reclaims what it held as it
   exits); what the dead processes held is left, and the code a restart
   runs on that directory (the reaper, through ``mmshm gc``) reclaims it
   all with reason ``killed``. D stops normally and leaves nothing.

Seeded sampling (n=2) is only ever sent one request at a time: vLLM 0.32's
CPU engine dies under concurrent seeded sampling.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.harness import faults, matrix, models
from tests.harness.servers import (
    PRIVATE_SHM, Server, data_url, e2e_logs, free_port, metric, mount_tmpfs, needs_e2e,
    private_shm_prefix, report_figures, segments, series, unmount_tmpfs, vllm_argv_720p, vllm_env)

pytestmark = [needs_e2e("vllm"), pytest.mark.timeout(2400)]

#: pixel_values of one 720p photo through Qwen2-VL's processor: [4784, 1176] float32.
IMAGE_BYTES = 4784 * 1176 * 4
#: Text after the photos: more tokens than a KV block, so that the prompt's
#: tail a decode instance computes itself (ExampleConnector loads whole
#: blocks of all but the last token) holds no image placeholder.
PROMPT = "Describe what you see in the pictures. " * 8
BLOCK_SIZE = 32
MAX_TOKENS = 6
SEED = 1234
#: (key, photos, n, DP rank).
DP_REQUESTS = (
    ("1 image, n=1, DP rank 0", ("astronaut",), 1, 0),
    ("3 images, n=1, DP rank 1", ("coffee", "chelsea", "rocket"), 1, 1),
    ("1 image, n=2, DP rank 0", ("motorcycle",), 2, 0),
    ("1 image, n=2, DP rank 1", ("hubble_deep_field",), 2, 1),
)
#: (key, photos): prefilled on P, decoded on D. One photo each: a prompt of
#: two 720p photos (2564 tokens) prefilled on P is not found by D's
#: ExampleConnector (D recomputes it; under mmshm it fails as a KV that
#: never arrived), which is vLLM's toy connector, not mmshm.
PD_REQUESTS = (
    ("photo 1", ("retina",)),
    ("photo 2", ("immunohistochemistry",)),
)
#: A photo D sees without P (direct, and as a KV that never arrives).
DIRECT = ("coffee",)
POOL_IDLE_S = 10.0
LEAKS = ("vllm_dist_", "psm_")
LOGS = e2e_logs("mmshm-e2e-vllm-", "vllm")


def _say(msg: str) -> None:
    with open(LOGS / "figures.txt", "a") as f:
        f.write(msg + "\n")


@pytest.fixture(scope="module")
def model() -> str:
    return models.build(models.model_dir("qwen2-vl"))


@pytest.fixture(scope="module")
def photos() -> dict[str, str]:
    from mmshm.bench import photos as ph

    names = {p for _, ps, _, _ in DP_REQUESTS for p in ps} | {
        p for _, ps in PD_REQUESTS for p in ps} | set(DIRECT)
    return {name: data_url(ph.rgb(name, "720p")) for name in names}


def ask(srv: Server, urls: list[str], n: int = 1, max_tokens: int = MAX_TOKENS,
        dp_rank: int | None = None, kv: dict | None = None, text: str = PROMPT,
        uuids: list[str] | None = None, load_kv: bool = True) -> list[dict]:
    """One chat completion (greedy at n=1, seeded at n>1); per choice the
    chosen tokens and their logprobs. ``dp_rank``: vLLM's
    ``X-data-parallel-rank`` header; ``kv``: the request's
    ``kv_transfer_params``; ``uuids``: each image's ``uuid`` (vLLM then
    names the item by it, the same on every instance); ``load_kv=False``:
    no KV from the connector (``prompt_logprobs`` makes vLLM skip reading
    cached KV: on P, whose ExampleConnector also loads, a second child of
    n=2 would otherwise load its sibling's stored KV or not, as the steps
    fall, and its logprobs would differ in the last bits, with or without
    mmshm)."""
    content = [{"type": "image_url", "image_url": {"url": u},
                **({"uuid": uuids[i]} if uuids else {})} for i, u in enumerate(urls)]
    content.append({"type": "text", "text": text})
    kwargs = dict(temperature=1.0, seed=SEED) if n > 1 else dict(temperature=0.0)
    if dp_rank is not None:
        kwargs["extra_headers"] = {"X-data-parallel-rank": str(dp_rank)}
    extra = {**({} if kv is None else {"kv_transfer_params": kv}),
             **({} if load_kv else {"prompt_logprobs": 0})}
    if extra:
        kwargs["extra_body"] = extra
    r = srv.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], n=n,
        max_tokens=max_tokens, logprobs=True, **kwargs)
    out = []
    for c in sorted(r.choices, key=lambda c: c.index):
        toks = c.logprobs.content if c.logprobs is not None else []
        out.append({"tokens": [t.token for t in toks], "logprobs": [t.logprob for t in toks],
                    "prompt_tokens": r.usage.prompt_tokens})
    assert len(out) == n and all(o["tokens"] for o in out), out
    return out


def kv_config(role: str, kv_dir: Path) -> str:
    return json.dumps({"kv_connector": "ExampleConnector", "kv_role": role,
                       "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": {"shared_storage_path": str(kv_dir)}})


def engine_requests(text: str) -> dict[str, float]:
    """Requests each DP engine finished (``vllm:request_success_total`` by its
    ``engine`` label)."""
    out: dict[str, float] = {}
    for labels, v in series(text, "vllm:request_success_total"):
        out[labels.get("engine", "")] = out.get(labels.get("engine", ""), 0.0) + v
    return out


def group_pid(pgid: int, title: str) -> int | None:
    """The pid of the process of group ``pgid`` whose command line (vLLM's
    process title) contains ``title``."""
    import psutil

    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getpgid(p.pid) == pgid and title in " ".join(p.info["cmdline"] or ()):
                return p.pid
        except (OSError, psutil.Error):
            continue
    return None


def stream_until_decoding(srv: Server, url: str, dp_rank: int):
    """Start a long greedy streamed request on ``dp_rank`` and return the
    open stream once its first token has come (the EngineCore is decoding
    it, holding its photo)."""
    stream = srv.client(timeout_s=120).chat.completions.create(
        model="tiny", stream=True, temperature=0.0, max_tokens=2500,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": PROMPT}]}],
        extra_headers={"X-data-parallel-rank": str(dp_rank)}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return stream
    raise AssertionError("the stream ended before its first token")


def run_shape(model: str, photos: dict, name: str, mmshm_run: bool) -> dict:
    """Start P (DP=2, KV producer) and D (KV consumer), run the cases of the
    module docstring, stop both (under mmshm: SIGKILL of DP rank 1's
    EngineCore first, then the reaper), and return what was seen.

    As root both servers run on a private /dev/shm (one tmpfs of their own,
    ``private_shm_prefix``), so that what the SIGKILLed P leaves of vLLM's
    and Python's own (``sem.mp-*`` semaphores, ``psm_*`` rings) never
    reaches the host's /dev/shm; their segment directories are then on
    another tmpfs, outside /dev/shm, at the same path inside and out."""
    own_shm = mount_tmpfs(f"mmshm-e2e-shapes-{name}-shm-", "1g") if PRIVATE_SHM else None
    prefix = private_shm_prefix(own_shm) if own_shm else None
    parent = (mount_tmpfs(f"mmshm-e2e-shapes-{name}-", "2g") if PRIVATE_SHM else
              Path(tempfile.mkdtemp(prefix=f"mmshm-e2e-shapes-{name}-", dir="/dev/shm")))
    kv_dir = Path(tempfile.mkdtemp(prefix=f"mmshm-e2e-kv-{name}-"))
    dirs = {"P": parent / "P", "D": parent / "D"}
    for d in dirs.values():
        d.mkdir(mode=0o700)
    port_p, port_d = free_port(), free_port()
    extra = lambda role: dict(MMSHM_DIR=str(dirs[role])) if mmshm_run else {}  # noqa: E731
    common = ["--block-size", str(BLOCK_SIZE)]
    P = Server(vllm_argv_720p(model, port_p, 1) + common + [
        "--data-parallel-size", "2", "--kv-transfer-config", kv_config("kv_producer", kv_dir)],
        port_p, LOGS / f"shapes-{name}-P.log", env=vllm_env(2, **extra("P")),
        mmshm_run=mmshm_run, leaks=LEAKS, ready_timeout_s=900, prefix=prefix)
    D = Server(vllm_argv_720p(model, port_d, 1) + common + [
        "--kv-transfer-config", kv_config("kv_consumer", kv_dir)],
        port_d, LOGS / f"shapes-{name}-D.log",
        env=vllm_env(1, VLLM_CPU_OMP_THREADS_BIND="1", **extra("D")),
        mmshm_run=mmshm_run, leaks=LEAKS, ready_timeout_s=900, prefix=prefix)
    rec: dict = {"dp": {}, "dp_deltas": {}, "unified": {}, "decode": {}, "decode_deltas": {},
                 "dirs": dirs}
    t0 = time.monotonic()
    try:
        P.launch()
        D.launch()
        P.wait_ready()
        D.wait_ready()
        rec["startup_s"] = time.monotonic() - t0
        rec["metrics_at_start"] = P.metrics_text()
        # 1. DP
        for key, ps, n, rank in DP_REQUESTS:
            before = P.metrics_text()
            rec["dp"][key] = ask(P, [photos[p] for p in ps], n, dp_rank=rank, load_kv=False)
            rec["dp_deltas"][key] = matrix.deltas(before, P.metrics_text())
        rec["engines"] = engine_requests(P.metrics_text())
        # the prompt's tokens without photos: the text after them, and the template's
        rec["text_only_tokens"] = ask(P, [])[0]["prompt_tokens"]
        # 2-3. PD: the proxy's two requests in sequence, then the unified answer
        for key, ps in PD_REQUESTS:
            # as a proxy sends them: the same request to P and to D, its
            # images named (uuid), its text its own (ExampleConnector keys
            # the stored KV by the prompt's tokens and the items' names)
            pd = dict(urls=[photos[p] for p in ps], uuids=list(ps), text=f"{key}. {PROMPT}")
            ask(P, **pd, max_tokens=1, dp_rank=0, kv={"do_remote_decode": True})
            before = D.metrics_text()
            try:
                rec["decode"][key] = ask(D, **pd, kv={"do_remote_prefill": True})
            except Exception as exc:  # noqa: BLE001 - recorded: the PD test says it
                rec["decode"][key] = [{"error": f"{type(exc).__name__}: {exc}",
                                       "tokens": None, "logprobs": [], "prompt_tokens": 0}]
            rec["decode_deltas"][key] = matrix.deltas(before, D.metrics_text())
            rec["unified"][key] = ask(P, **pd, dp_rank=0)
        before = D.metrics_text()
        rec["direct"] = ask(D, [photos[p] for p in DIRECT])
        rec["direct_deltas"] = matrix.deltas(before, D.metrics_text())
        # 4. a KV that never arrives (P never saw this prompt)
        before = D.metrics_text()
        try:
            rec["miss"] = ask(D, [photos[p] for p in DIRECT], kv={"do_remote_prefill": True},
                              text="Something else entirely. " * 8)
        except Exception as exc:  # noqa: BLE001 - recorded: the tests say what it must be
            rec["miss"] = {"error": type(exc).__name__, "status": getattr(exc, "status_code",
                                                                          None)}
        after = D.metrics_text()
        rec["miss_failures"] = (metric(after, "mmshm_request_failures_total")
                                - metric(before, "mmshm_request_failures_total"))
        rec["d_alive_after_miss"] = D.proc.poll() is None
        rec["check"] = ask(D, [photos[p] for p in DIRECT])  # D still answers right
        # 5. nothing left after the pool's idle time
        if mmshm_run:
            rec["settle"] = {role: faults.settle(faults.Mmshm(d), lambda d=d: segments(d),
                                                 POOL_IDLE_S) for role, d in dirs.items()}
        # 6. a DP rank killed mid-request, then the reaper (mmshm only)
        if mmshm_run:
            dp1 = group_pid(P.proc.pid, "EngineCore_DP1")
            assert dp1 is not None, "no EngineCore_DP1 process in P's group"
            stream = stream_until_decoding(P, photos[DIRECT[0]], 1)
            rec["held_at_kill"] = segments(dirs["P"])
            # the DP rank's engine, then the whole server at once (mmshm run
            # included, before its exit pass could reclaim what the engine
            # held, as when a node agent kills it): a restart must reclaim
            os.kill(dp1, signal.SIGKILL)
            P.kill()
            with contextlib.suppress(Exception):
                stream.close()
            rec["left_by_kill"] = segments(dirs["P"])
            # the reaper, as a restart runs it on its directory's first segment
            out = subprocess.run(faults.Mmshm(dirs["P"]).argv("gc"), capture_output=True,
                                 text=True, timeout=120, check=True).stdout
            gc = json.loads(out)
            rec["gc"] = {k: gc[k] for k in ("reclaimed", "reclaimed_bytes", "reasons", "live")}
            rec["left_after_gc"] = segments(dirs["P"])
        else:
            P.stop(timeout_s=60)
        rec["d_before_stop"] = segments(dirs["D"])
        D.stop(timeout_s=60)
        rec["d_left"] = segments(dirs["D"])
    finally:
        P.kill()
        D.kill()
        rec["p_log"], rec["d_log"] = P.log_text(), D.log_text()
        rec["kv_files"] = sum(1 for _ in kv_dir.rglob("*.safetensors"))
        shutil.rmtree(kv_dir, ignore_errors=True)
        rec["parent_left"] = sorted(str(p.relative_to(parent)) for p in parent.rglob("*")
                                    if p.is_file())
        if PRIVATE_SHM:
            unmount_tmpfs(parent)
        else:
            subprocess.run(["rm", "-rf", str(parent)], check=False)
        if own_shm is not None:
            rec["own_shm_left"] = sorted(os.listdir(own_shm))
            unmount_tmpfs(own_shm)
            _say(f"{name} P + D left in their private /dev/shm (dropped with it): "
                 f"{len(rec['own_shm_left'])} file(s) {rec['own_shm_left']}")
    rec["wall_s"] = time.monotonic() - t0
    keep = ("dp", "unified", "decode", "direct", "miss", "check", "engines", "dp_deltas",
            "decode_deltas", "direct_deltas", "gc", "left_by_kill", "held_at_kill")
    (_figures_dir() / f"records-{name}.json").write_text(
        json.dumps({k: rec.get(k) for k in keep}, indent=1, default=str))
    return rec


@pytest.fixture(scope="module")
def plain(model, photos) -> dict:
    rec = run_shape(model, photos, "plain", mmshm_run=False)
    _say(f"plain vLLM P (DP=2, KV producer) + D (KV consumer): started in "
         f"{rec['startup_s']:.0f} s, {rec['wall_s']:.0f} s in all; engines' requests "
         f"{rec['engines']}")
    return rec


@pytest.fixture(scope="module")
def instrumented(model, photos, plain, request) -> dict:
    rec = run_shape(model, photos, "mmshm", mmshm_run=True)
    figures = {
        "starts (plain, mmshm), s": (round(plain["startup_s"]), round(rec["startup_s"])),
        "wall (plain, mmshm), s": (round(plain["wall_s"]), round(rec["wall_s"])),
        "engines' requests (plain, mmshm)": (plain["engines"], rec["engines"]),
        "DP bytes written per request": {k: d["written"] for k, d in rec["dp_deltas"].items()},
        "decode instance bytes written per prefilled request (pixels withheld)": {
            k: d["written"] for k, d in rec["decode_deltas"].items()},
        "decode instance bytes written, request sent to it directly (pixels kept)":
            rec["direct_deltas"]["written"],
        "decode vs unified max |logprob diff| (plain)": max_diff(plain),
        "KV that never arrived (plain, mmshm)": (
            "answered" if isinstance(plain["miss"], list) else plain["miss"], rec["miss"]),
        "DP rank 1 SIGKILLed mid-request: segments left, reclaimed by the reaper": (
            len(rec.get("left_by_kill", [])), rec.get("gc")),
    }
    report_figures(request, "vLLM deployment shapes (DP=2 P + D)", figures,
                   _figures_dir())
    for k, v in figures.items():
        _say(f"shapes: {k}: {v}")
    return rec


def _figures_dir() -> Path:
    d = LOGS / "shapes"
    d.mkdir(exist_ok=True)
    return d


def max_diff(rec: dict) -> float | None:
    """The largest |logprob| difference between D's and P's answers (None:
    no decode answered)."""
    return max((abs(a - b) for key, _ in PD_REQUESTS if rec["decode"][key][0]["tokens"]
                for a, b in zip(rec["decode"][key][0]["logprobs"],
                                rec["unified"][key][0]["logprobs"], strict=True)),
               default=None)


def same(a: list[dict], b: list[dict]) -> bool:
    return [(c["tokens"], c["logprobs"]) for c in a] == [(c["tokens"], c["logprobs"]) for c in b]


# -- 1. data parallelism ------------------------------------------------------------
def test_dp_answers_bit_identical_plain_vs_mmshm(plain, instrumented):
    for key, _, n, _ in DP_REQUESTS:
        assert len(instrumented["dp"][key]) == n, key
        assert same(plain["dp"][key], instrumented["dp"][key]), key
    firsts = {tuple(plain["dp"][k][0]["logprobs"][:1]) for k, _, _, _ in DP_REQUESTS}
    assert len(firsts) > 1  # the answers depend on the pixels


def test_dp_requests_reach_both_engines(plain, instrumented):
    want = {str(r): sum(1 for *_, rank in DP_REQUESTS if rank == r) for r in (0, 1)}
    for rec in (plain, instrumented):
        got = rec["engines"]
        for rank, k in want.items():
            assert got.get(rank, 0) >= k, got


def test_dp_each_photo_written_once_whatever_n(instrumented):
    for key, ps, n, _ in DP_REQUESTS:
        d = instrumented["dp_deltas"][key]
        problems = matrix.request_problems(d, [IMAGE_BYTES] * len(ps), n, n if n > 1 else 0)
        assert problems == [], (key, problems, d)


def test_dp_every_process_names_its_dp_rank(instrumented):
    log = instrumented["p_log"]
    assert "WARNING" not in "\n".join(l for l in log.splitlines() if "mmshm[" in l), log[-4000:]
    for role in ("frontend", r"EngineCore \(DP rank 0\)", r"EngineCore \(DP rank 1\)",
                 r"worker \(DP rank 0, rank 0\)", r"worker \(DP rank 1, rank 0\)"):
        assert re.search(rf"mmshm\[\d+\] vllm 0\.32\.\d+, {role} \(pid \d+\): on: ", log), role
    roles = {lab["role"] for lab, v in series(instrumented["metrics_at_start"],
                                              "mmshm_path_enabled") if v == 1}
    assert {"EngineCore (DP rank 0)", "EngineCore (DP rank 1)"} <= roles, roles


def test_dp_rank_killed_mid_request_is_reclaimed_by_the_reaper(instrumented):
    rec = instrumented
    assert rec["held_at_kill"], "nothing held when the engine was killed: proves nothing"
    assert rec["left_by_kill"], "the kill left nothing: the test proves nothing"
    gc = rec["gc"]
    assert gc["reclaimed"] == len(rec["left_by_kill"]), gc
    assert gc["reasons"]["killed"] >= 1, gc
    assert rec["left_after_gc"] == [], rec["left_after_gc"]


# -- 2. prefill/decode ------------------------------------------------------------------
def test_pd_decode_answer_equals_the_unified_answer(plain, instrumented):
    for rec in (plain, instrumented):
        for key, _ in PD_REQUESTS:
            assert rec["decode"][key][0]["tokens"] == rec["unified"][key][0]["tokens"], (
                key, rec["decode"][key][0].get("error"))
    assert max_diff(plain) < 1e-4
    for key, _ in PD_REQUESTS:
        assert same(plain["decode"][key], instrumented["decode"][key]), key
        assert same(plain["unified"][key], instrumented["unified"][key]), key


def test_pd_decode_instance_loaded_the_kv_of_every_image_token(plain, instrumented):
    """D injected KV for each prefilled request (its first requests; the
    ExampleConnector also stores what D computes itself, so the repeated
    direct request loads it later), up to within a block and a token of the
    prompt's end, and the prompt's text after the photo is longer than
    that: no image placeholder is in the tail D computes, so it never needs
    an encoder."""
    for rec in (plain, instrumented):
        # the text after the photos: the text-only prompt less its opening
        # ("<|im_start|>user\n": 3 tokens at most with the tiny tokenizer)
        text_tokens = rec["text_only_tokens"] - 3
        injected = [int(n) for n in re.findall(r"Inject KV cache of (\d+) tokens", rec["d_log"])]
        assert len(injected) >= len(PD_REQUESTS), injected
        for n, (key, _) in zip(injected, PD_REQUESTS):
            prompt = rec["decode"][key][0]["prompt_tokens"]
            assert prompt - n <= BLOCK_SIZE + 1 < text_tokens, (key, n, prompt, text_tokens)
        assert rec["kv_files"] > 0


# -- 3. a decode instance writes no pixels -------------------------------------------------
def test_decode_instance_writes_no_pixels_for_prefilled_requests(instrumented):
    for key, _ in PD_REQUESTS:
        d = instrumented["decode_deltas"][key]
        assert d["written"] == 0 and d["created"] + d["pool_hits"] == 0, (key, d)
        assert d["failures"] == d["fallbacks"] == 0, (key, d)


def test_decode_instance_keeps_pixels_of_a_request_it_computes(plain, instrumented):
    d = instrumented["direct_deltas"]
    assert d["written"] == len(DIRECT) * IMAGE_BYTES, d
    assert same(plain["direct"], instrumented["direct"])


def test_decode_instance_says_what_it_does_with_the_pixels(instrumented):
    d_front = [l for l in instrumented["d_log"].splitlines() if "frontend (pid" in l and "on:" in l]
    assert len(d_front) == 1 and ("decode instance (kv_consumer, kv_load_failure_policy=fail): "
                                  "requests prefilled elsewhere") in d_front[0], d_front
    assert "decode instance" not in instrumented["p_log"]


# -- 4. bad input ------------------------------------------------------------------------
def test_kv_that_never_arrives(plain, instrumented):
    """Plain D recomputes the prompt; under mmshm the request fails with a
    typed error, D lives on and answers the next request right."""
    assert isinstance(plain["miss"], list), plain["miss"]
    miss = instrumented["miss"]
    assert isinstance(miss, dict) and miss["status"] == 500, miss
    assert re.search(r"PayloadWithheldError: request \S+: the decode instance would run the "
                     r"encoder for 1 item\(s\) whose pixels mmshm withheld",
                     instrumented["d_log"])
    assert instrumented["miss_failures"] == 1
    assert instrumented["d_alive_after_miss"]
    assert same(plain["check"], instrumented["check"])


# -- 5. nothing left ---------------------------------------------------------------------
def test_nothing_left_after_the_pools_idle_time(instrumented):
    for role, rec in instrumented["settle"].items():
        assert faults.settle_problems(rec) == [], (role, rec)
    assert instrumented["d_left"] == []
    assert instrumented["parent_left"] == [], instrumented["parent_left"]
