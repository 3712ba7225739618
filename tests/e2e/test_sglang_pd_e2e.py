"""mmshm in a SGLang 0.5.23 PD decode instance on CPU (prefill/decode
disaggregation, ``--disaggregation-mode decode``), TP=2, under ``mmshm run``.

Run by ``python -m tests.run sglang --release 0.5.23 --e2e-only`` in
``.venvs/sglang-0.5.23-server`` with ``MMSHM_E2E=sglang``; skipped anywhere
else.

How a decode instance runs here:

- **The host KV pool.** A decode instance keeps the KV of a retracted
  request in a host pool whose allocator pins pages with
  ``cudaHostRegister`` (``torch.cuda.cudart()``: a CPU build of torch
  raises). The server environment's start-up hook
  (``tests/integrations/stubs/cpu_stubs.py``, ``install_hooks``) makes
  that allocator hand out plain CPU memory on a host without CUDA.
- **The fake transfer backend** (``--disaggregation-transfer-backend
  fake``): no prefill instance; each request's KV "arrives" at once
  (``FakeKVReceiver``) and the first output token is drawn from the request
  id, so the text means nothing. A request must carry the bootstrap fields
  a PD router adds (``bootstrap_host`` = SGLang's ``FAKE_BOOTSTRAP_HOST``,
  ``2.2.2.2``, ``bootstrap_port``, ``bootstrap_room``): without
  ``bootstrap_host`` SGLang 0.5.23's decode scheduler dies of an
  ``AttributeError`` in ``NetworkAddress`` (SGLang's own, plain or under
  mmshm), so every request here carries them.

One server start (under ``mmshm run``, in a private mount namespace whose
/dev/shm is a tmpfs the test mounted, as tests/e2e/test_sglang_e2e.py does
as root), shared by the cases, in file order:

1. image requests (one photo, two photos, n=2, a text-only one) are
   answered (HTTP 200, every token); the tokenizer's "on:" line says it
   withholds the pixels; mmshm wrote 0 bytes into shared memory and made no
   segment for them, and each message to the scheduler stayed small (the
   pixels did not go inline instead);
2. after the pool's idle time nothing is left: the directory is empty,
   ``mmshm gc --dry-run`` finds no orphan;
3. the process group is SIGKILLed while image requests are in flight
   (past the tokenizer): ``mmshm gc``, the reclaim a restart runs, finds
   nothing to reclaim, and the tmpfs holds no segment (mmshm's or SGLang's
   ``psm_*``).

A module-level case (no server) drives the real SGLang 0.5.23 classes: a
request whose pixels were withheld gives the scheduler the same pad values,
padded ``input_ids`` and mrope positions as the one that carried them, and a
scheduler not in decode mode fails it with ``PayloadWithheldError``.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.harness.servers import SGLANG_RELEASE as RELEASE, SGLANG_VERSION as V
from tests.harness.servers import needs_e2e, needs_sglang

pytestmark = [needs_e2e("sglang"), needs_sglang((0, 5, 23), "the PD decode instance")]

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".venvs" / "tiny-qwen2-vl"  # models.model_dir("qwen2-vl")
SMALL_SHM = os.geteuid() == 0 and shutil.which("unshare") is not None
TP = 2
MAX_TOKENS = 8
POOL_IDLE_S = 2.0
#: SGLang's ``FAKE_BOOTSTRAP_HOST`` (sglang.srt.disaggregation.utils).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
#: A message to the scheduler carries token ids, offsets, mrope positions
#: and grids: tens of kB. One 720p photo's pixel_values are 22.5 MB.
MESSAGE_BOUND = 1_000_000

S: dict = {}  # figures and state shared by the cases (file order)


def _server_mod():
    from tests.harness import servers

    return servers


@pytest.fixture(scope="module")
def decode(request):
    """One decode instance under ``mmshm run`` (TP=2, fake transfer
    backend); killed on every way out."""
    from tests.harness import models

    server = _server_mod()
    models.build(MODEL_DIR)
    logs = Path(tempfile.mkdtemp(prefix=f"sglang-pd-e2e-{RELEASE}-"))
    shm = server.mount_tmpfs("mmshm-pd-shm-", "256m") if SMALL_SHM else None
    seg_dir = shm if shm is not None else Path(
        tempfile.mkdtemp(prefix="mmshm-pd-", dir="/dev/shm"))
    port = server.free_port()
    # --hicache-ratio: the host KV pool as a fraction of the device pool,
    # SGLang's own choice for a pool that only backs retractions (0.2);
    # unset, SGLang sizes it from the host memory free past a 10 GiB reserve,
    # and refuses to start when other servers on the host leave none
    argv = server.sglang_argv(MODEL_DIR, port, TP, V, limit_images=2) + [
        "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
        "--hicache-ratio", "0.2"]
    env = server.sglang_env(MMSHM_POOL_IDLE_S=f"{POOL_IDLE_S:g}", MMSHM_REAP_INTERVAL_S="60")
    prefix = None
    if shm is not None:
        env["MMSHM_DIR"] = "/dev/shm"
        prefix = ["unshare", "-m", "sh", "-c",
                  (f"mount --make-rprivate / && mount --bind {shm} /dev/shm && "
                   'exec "$0" "$@"')]
    else:
        env["MMSHM_DIR"] = str(seg_dir)
    srv = server.Server(argv, port, logs / "decode.log", env=env, mmshm_run=True,
                        prefix=prefix, ready_timeout_s=400)
    print(f"\nSGLang {RELEASE} PD decode e2e: logs in {logs}", flush=True)
    try:
        srv.start()
        S["startup_s"] = round(srv.startup_s, 1)
        yield {"srv": srv, "seg_dir": seg_dir, "shm": shm, "logs": logs}
    finally:
        srv.kill()
        server.report_figures(request, f"SGLang {RELEASE} PD decode e2e", S, logs)
        if shm is not None:
            server.unmount_tmpfs(shm)
        else:
            shutil.rmtree(seg_dir, ignore_errors=True)


_ROOMS = iter(range(1000, 10**6))


def _ask(srv, photos: list[int], n: int = 1, timeout_s: float = 600.0):
    """One chat request with ``photos`` as a PD router sends it to a decode
    instance (the bootstrap fields); returns the completion. ``ignore_eos``:
    the fake backend's KV is whatever the pool holds, so the first token
    may be EOS (CI saw one answer end after 1 token); every answer is
    :data:`MAX_TOKENS` long."""
    server = _server_mod()
    content = [{"type": "image_url", "image_url": {"url": server.photo_url(i)}}
               for i in photos] + [{"type": "text", "text": "Describe the picture."}]
    return srv.client(timeout_s=timeout_s).chat.completions.create(
        model="default", max_tokens=MAX_TOKENS, n=n, seed=7,
        temperature=0.0 if n == 1 else 0.8, messages=[{"role": "user", "content": content}],
        extra_body={"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_port": 8998,
                    "bootstrap_room": next(_ROOMS), "ignore_eos": True})


def _m(text: str, name: str, **labels) -> float:
    return _server_mod().metric(text, name, **labels)


def _hop(text: str, hop: str) -> tuple[float, float]:
    """(count, bytes) of one of mmshm's timed hops."""
    return (_m(text, "mmshm_ipc_seconds_count", server="sglang", hop=hop),
            _m(text, "mmshm_ipc_bytes_sum", server="sglang", hop=hop))


def _segments(d: Path) -> list[str]:
    """Segment files in ``d``: mmshm's and SGLang's own (``psm_*``)."""
    try:
        return sorted(n for n in os.listdir(d) if n.startswith(("mmshm-", "psm_")))
    except FileNotFoundError:
        return []


# -- 1. image requests answered, no pixels written -----------------------------------------
@pytest.mark.timeout(900)
def test_decode_answers_images_and_writes_no_pixels(decode):
    import re

    srv = decode["srv"]
    log = srv.log_text()
    roles = ["tokenizer"] + [f"scheduler (TP rank {r})" for r in range(TP)]
    for role in roles:
        assert re.search(rf"mmshm\[\d+\] sglang {re.escape(RELEASE)}, {re.escape(role)} "
                         rf"\(pid \d+\): on: ", log), (role, log[-4000:])
    from mmshm.integrations.sglang.pd import PATH_DECODE_WITHHOLD

    tok = re.search(r"tokenizer \(pid \d+\): on: (.*)", log).group(1)
    assert PATH_DECODE_WITHHOLD in tok, tok
    m0 = srv.metrics_text()
    cases = {"one photo": ([0], 1), "two photos": ([1, 2], 1), "n=2": ([3], 2)}
    for name, (photos, n) in cases.items():
        r = _ask(srv, photos, n)
        assert len(r.choices) == n, name
        assert r.usage.completion_tokens == n * MAX_TOKENS, (name, r.usage)
        assert all(c.finish_reason == "length" for c in r.choices), (name, r.choices)
        assert r.usage.prompt_tokens > 1196 * len(photos), (name, r.usage)  # the image tokens
    text = srv.client().chat.completions.create(
        model="default", max_tokens=MAX_TOKENS, temperature=0.0,
        messages=[{"role": "user", "content": "Say hello."}],
        extra_body={"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_port": 8998,
                    "bootstrap_room": next(_ROOMS), "ignore_eos": True})
    assert text.usage.completion_tokens == MAX_TOKENS
    m1 = srv.metrics_text()

    def delta(name, **labels):
        return _m(m1, name, **labels) - _m(m0, name, **labels)

    written = delta("mmshm_shm_written_bytes_total")
    wraps = _hop(m1, "tokenizer_wrap")[0] - _hop(m0, "tokenizer_wrap")[0]
    sends, sent = (a - b for a, b in zip(_hop(m1, "tokenizer_send"), _hop(m0, "tokenizer_send")))
    S["image_requests"] = len(cases)
    S["bytes_written_per_decode_request"] = written / len(cases)
    S["tokenizer_wraps"] = wraps
    S["bytes_per_message_to_scheduler"] = round(sent / max(sends, 1))
    # every image request went through mmshm's wrap (n=2: the warm-up and two
    # samples), and none wrote a byte or made a segment
    assert wraps >= len(cases), S
    assert written == 0, S
    assert delta("mmshm_segments_created_total") == 0
    assert delta("mmshm_inline_fallbacks_total") == 0
    assert delta("mmshm_request_failures_total") == 0
    # the pixels did not travel inline instead: every message stayed small
    assert sends >= len(cases) and sent / sends < MESSAGE_BOUND, S
    assert "PayloadWithheldError" not in srv.log_text()


# -- 2. nothing left after the pool's idle time ---------------------------------------------
@pytest.mark.timeout(300)
def test_decode_leaves_nothing_when_idle(decode):
    from tests.harness import faults

    srv = decode["srv"]
    mm = (faults.Mmshm("/dev/shm", ns_pid=srv.proc.pid) if decode["shm"] is not None
          else faults.Mmshm(decode["seg_dir"]))
    deadline = time.monotonic() + 10 * POOL_IDLE_S
    while time.monotonic() < deadline and _segments(decode["seg_dir"]):
        time.sleep(0.2)
    S["left_when_idle"] = _segments(decode["seg_dir"])
    assert S["left_when_idle"] == []
    report = mm.gc_dry_run()
    assert report["reclaimed"] == 0 and report["names"] == [], report
    assert report["live"] == 0 and report["in_flight"] == 0, report
    status = mm.status()
    assert status["segments"] == [] and status["orphans"] == 0, status


# -- 3. killed mid-request: nothing for a restart to reclaim ----------------------------------
@pytest.mark.timeout(600)
def test_decode_killed_mid_request_leaves_nothing(decode):
    import contextlib

    import openai

    srv = decode["srv"]
    wraps0 = _hop(srv.metrics_text(), "tokenizer_wrap")[0]
    threads = []
    for i in range(3):
        def ask(i=i):
            with contextlib.suppress(openai.OpenAIError):  # the server dies under it
                _ask(srv, [i], timeout_s=120)
        threads.append(threading.Thread(target=ask, daemon=True))
        threads[-1].start()
    # past the tokenizer: the requests' items were wrapped and sent
    deadline = time.monotonic() + 120
    wraps = wraps0
    while time.monotonic() < deadline and wraps < wraps0 + 1:
        time.sleep(0.05)
        wraps = _hop(srv.metrics_text(), "tokenizer_wrap")[0]
    assert wraps > wraps0, "no request reached the tokenizer's wrap in 120 s"
    os.killpg(srv.proc.pid, signal.SIGKILL)
    srv.kill()
    for t in threads:
        t.join(30)
    S["in_flight_at_kill"] = wraps - wraps0
    # what a restart's start-up reclaim runs (mmshm.segments.reaper.reap), from here:
    # the server's processes are gone, its tmpfs is still mounted here
    from tests.harness import faults

    mm = faults.Mmshm(decode["seg_dir"])
    dry = mm.gc_dry_run()
    done = mm._json("gc")
    S["reclaimed_after_kill"] = done["reclaimed"]
    assert dry["reclaimed"] == 0 and done["reclaimed"] == 0, (dry, done)
    assert dry["live"] == 0 and dry["in_flight"] == 0 and done["names"] == [], (dry, done)
    assert _segments(decode["seg_dir"]) == []


# -- module level: the scheduler's view of a withheld request (real SGLang classes) -----------
def test_withheld_request_keeps_what_the_scheduler_needs():
    """What a decode scheduler builds from a request whose pixels were
    withheld equals what it builds from the same request with its pixels:
    pad values, padded ``input_ids`` (the prefix-cache key), mrope
    positions. The message is a small fraction of the pixels; the tokenizer's
    request (shared with fan-out copies) keeps its tensors. A scheduler not
    in decode mode fails the request with ``PayloadWithheldError``."""
    import types
    import weakref

    import torch

    from tests.integrations import sglang_env
    from mmshm.integrations.sglang import pd as glue
    from mmshm.integrations.sglang import server as sgl

    ns = sglang_env.load(scheduler=False)
    features = [sglang_env.expected_feature(i) for i in range(2)]
    req = sglang_env.make_request(ns, features)
    items = sglang_env.items(req)
    for k, item in enumerate(items):
        item.offsets = [(4 + 8 * k, 7 + 8 * k)]
    req.input_ids = list(range(100, 124))
    req.mm_inputs.input_ids = req.input_ids
    req.mm_inputs.mrope_positions = torch.arange(72).reshape(3, 24)

    def scheduler_view(mm):
        out = ns.sb.MultimodalInputs.from_processor_output(mm)
        padded = ns.sb.MultimodalProcessorOutput.build_padded_input_ids(
            req.input_ids, out.mm_items)
        return ([(it.hash, it.pad_value) for it in out.mm_items], padded,
                out.mrope_positions.tolist())

    # with its pixels: the hashes mmshm gives any instance (BLAKE3 of the bytes)
    import copy as copy_mod

    full = copy_mod.deepcopy(req.mm_inputs)
    sgl.set_item_hashes(full)
    want = scheduler_view(pickle.loads(pickle.dumps(full)))

    withheld = glue.withhold_payloads(req.mm_inputs)
    assert all(isinstance(it.feature, glue.WithheldPayload) for it in withheld.mm_items)
    assert all(isinstance(it.feature, torch.Tensor) for it in items)  # input untouched
    wire = pickle.dumps(withheld)
    assert len(wire) < sum(f.nbytes for f in features) / 100, len(wire)

    class Sched:
        disaggregation_mode = types.SimpleNamespace(value="decode")

    sched = Sched()
    old = glue.SCHEDULER
    try:
        glue.SCHEDULER = weakref.ref(sched)
        got_req = copy_mod.copy(req)
        got_req.mm_inputs = pickle.loads(wire)
        [out] = glue.settle_withheld([got_req])
        assert all(it.feature is None for it in out.mm_inputs.mm_items)
        assert scheduler_view(out.mm_inputs) == want

        sched.disaggregation_mode = types.SimpleNamespace(value="prefill")
        bad = copy_mod.copy(req)
        bad.mm_inputs = pickle.loads(wire)
        [failed] = glue.settle_withheld([bad])
        assert isinstance(failed.mm_inputs, ns.io.MMInputsProcessError), failed.mm_inputs
        assert "withheld by a PD decode instance" in str(failed.mm_inputs), failed.mm_inputs
    finally:
        glue.SCHEDULER = old

    # the tokenizer's decision: only a decode instance, and not one that may
    # turn into a prefill instance, withholds
    def manager(mode, role_switch=False):
        return types.SimpleNamespace(
            disaggregation_mode=types.SimpleNamespace(value=mode),
            server_args=types.SimpleNamespace(enable_pd_role_switch=role_switch))

    assert glue.decode_payload_policy(manager("decode")) == (True, glue.PATH_DECODE_WITHHOLD)
    keeps, line = glue.decode_payload_policy(manager("decode", role_switch=True))
    assert not keeps and "--enable-pd-role-switch" in line, line
    assert glue.decode_payload_policy(manager("prefill")) is None
    assert glue.decode_payload_policy(manager("null")) is None
