"""mmshm against real SGLang servers (0.5.9, 0.5.23) on CPU, TP=2, with the
real OpenAI client sending real photos (720p, 22.5 MB of pixel_values each).

Run by ``python -m tests.run sglang`` (after the module-level tests) in
``.venvs/sglang-<version>-server`` with ``MMSHM_E2E=sglang`` and
``MMSHM_SGLANG_RELEASE``; skipped anywhere else.

Each server start costs about a minute on two cores, so the tests are phases
that share state and run in file order, each starting one server and running
many cases against it:

1. SGLang's own transport under ``mmshm run --observe`` (observe mode: it
   is only timed, hop by hop): the greedy baseline (n=1), no segment made,
   per-hop bytes that match the pixels; then n=2 with an image, which 0.5.9
   dies of (``FileNotFoundError: '/psm_...'`` in the scheduler: observe mode
   leaves SGLang's bug as it is) and 0.5.23 answers.
2. plain, 64 MiB /dev/shm (0.5.9): one greedy request answered exactly as
   under observe mode; then a burst of photos kills it with SIGBUS.
3. under ``mmshm run`` (with ``--dist-init-addr``, which turns SGLang
   0.5.9-0.5.12's own shared memory off even on one node, and not mmshm's):
   every request answered, greedy texts equal to
   plain's, the TP broadcast carries metadata only, n=2 writes each image
   once; a burst in a 64 MiB /dev/shm is answered in full (inline
   fallbacks); then the server's process group is SIGKILLed mid-request.
4. under ``mmshm run`` again, on the same segment directory, with the arena
   on (``MMSHM_ARENA_BYTES``; off by default on a host without CUDA): the
   killed server's segments are reclaimed before its first request; the
   greedy requests twice, the second time through the arena segments of the
   first (reused, already mapped by both TP ranks), answered as plain
   answered them; a graceful stop leaves nothing.

Faults under load (``tests/harness/faults.py``), on servers already running: an
abort storm (30 streamed requests of 1-3 small photos, n 1-4, 4 at a time,
the client closing them at random points), then rejected requests (too many
images, over the context length, corrupt or non-image data URLs), then the
checks: the fixed request answered as before, after the pool's idle time
nothing in the segment directory that ``mmshm status`` does not explain,
``mmshm gc --dry-run`` finds no orphan, mmshm's counters agree with the
events. Under mmshm in phase 3 (before its SIGKILL); on 0.5.9's plain server
in phase 2 (before its burst), where SGLang's own ``psm_*`` segments are
counted beside mmshm's. Each phase records, a test after it asserts.

As root (with ``unshare``), every server runs in a private mount namespace
whose /dev/shm is one 64 MiB tmpfs that the test mounted and watches (Docker's
default size); otherwise /dev/shm is the host's, mmshm's segment directory a
private one in it, and the small-/dev/shm cases skip with that reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.harness.servers import needs_e2e

pytestmark = needs_e2e("sglang")

RELEASE = os.environ.get("MMSHM_SGLANG_RELEASE", "0.0.0")
V = tuple(int(x) for x in RELEASE.split("."))
HAS_FANOUT_BUG = V <= (0, 5, 12)
HAS_SIGBUS = V <= (0, 5, 15)

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".venvs" / "tiny-qwen2-vl"  # models.model_dir("qwen2-vl")
SMALL_SHM = os.geteuid() == 0 and shutil.which("unshare") is not None
NO_SMALL_SHM = "needs root and unshare for a private 64 MiB /dev/shm"
TP = 2
MAX_TOKENS = 8
BURST = 4  # 4 x 22.5 MB photos in flight: more than a 64 MiB /dev/shm holds
#: The plain server's burst, after one warm-up request: SGLang's own segments
#: are unlinked as the scheduler receives them, so only those made while it is
#: busy with a prefill pile up; 8 photos make that pile outgrow 64 MiB.
PLAIN_BURST = 8
#: The faults under load (tests/harness/faults.py): storm requests, 4 at a time;
#: images per request the servers allow (--limit-mm-data-per-request); the
#: pool's idle time the servers run with (MMSHM_POOL_IDLE_S).
STORM_SHOTS, STORM_CONCURRENCY, MAX_IMAGES, POOL_IDLE_S = 30, 4, 3, 2.0
#: SGLang 0.5.9 answers an image it cannot load (corrupt base64, an SVG...)
#: with HTTP 500 "Internal server error: ..." (0.5.23: 400); its plain
#: server does the same (asserted below).
BAD_IMAGE_500 = V <= (0, 5, 9)
#: The model's context length (max_position_embeddings of tests/harness/models.py)
#: and the tiny tokenizer's tokens per " hello".
CONTEXT, TOKENS_PER_WORD = 32768, 3
#: The arena of phase 4 (the restart): two photos' segments (22.5 MB each),
#: within the 64 MiB /dev/shm that server runs in as root.
ARENA_BYTES = 48 << 20

S: dict = {}  # state shared by the phases (file order)
#: The faults' records by phase ("records"), what broke them ("errors"), the
#: storm's photo URLs ("urls"): kept out of S, whose items are all printed.
FAULTS: dict = {"records": {}, "errors": {}, "urls": None}
#: Phase 4's arena record (answers, expositions, segments): out of S too; its
#: figures go to S["arena"].
ARENA: dict = {}


# -- the servers -------------------------------------------------------------------
def _import_server():
    from tests.harness import servers  # process group, bounded, killed on every path

    return servers


@pytest.fixture(scope="module")
def env(request):
    """The model, the log folder and the segment directory of this module."""
    from tests.harness import models

    models.build(MODEL_DIR)
    logs = Path(tempfile.mkdtemp(prefix=f"sglang-e2e-{RELEASE}-"))
    shm = None
    server = _import_server()
    if SMALL_SHM:
        shm = server.mount_tmpfs("mmshm-e2e-shm-", "64m")
        seg_dir = shm  # /dev/shm itself, inside the servers' namespace
    else:
        seg_dir = Path(tempfile.mkdtemp(prefix="mmshm-e2e-", dir="/dev/shm"))
    info = {"logs": logs, "shm": shm, "seg_dir": seg_dir}
    print(f"\nSGLang {RELEASE} e2e: logs in {logs}", flush=True)
    yield info
    server.report_figures(request, f"SGLang {RELEASE} e2e", S, logs)
    server._kill_all()
    if shm is not None:
        server.unmount_tmpfs(shm)
    else:
        shutil.rmtree(seg_dir, ignore_errors=True)


def _argv(port: int) -> list[str]:
    return _import_server().sglang_argv(MODEL_DIR, port, TP, V, limit_images=MAX_IMAGES)


def _server(env, name: str, mmshm: bool, small_shm: bool = SMALL_SHM, observe: bool = False,
            dist_init: bool = False, **extra_env: str):
    server = _import_server()
    port = server.free_port()
    argv = _argv(port)
    if dist_init:
        # one node, but a rendezvous address: SGLang 0.5.9-0.5.12 then turn
        # their own shared memory off ("cross node"); mmshm goes by the node
        # layout and stays on
        argv += ["--dist-init-addr", f"127.0.0.1:{server.free_port()}"]
    e = server.sglang_env(MMSHM_POOL_IDLE_S=f"{POOL_IDLE_S:g}", MMSHM_REAP_INTERVAL_S="60",
                          **extra_env)
    if observe:
        e["MMSHM_MODE"] = "observe"
        mmshm = True
    prefix = None
    if small_shm:
        # a private mount namespace whose /dev/shm is the test's 64 MiB tmpfs
        e["MMSHM_DIR"] = "/dev/shm"
        prefix = ["unshare", "-m", "sh", "-c",
                  (f"mount --make-rprivate / && mount --bind {env['shm']} /dev/shm && "
                   'exec "$0" "$@"')]
    else:
        e["MMSHM_DIR"] = str(env["seg_dir"])
    srv = server.Server(argv, port, env["logs"] / f"{name}.log", env=e, mmshm_run=mmshm,
                        prefix=prefix, ready_timeout_s=400)
    srv.start()
    print(f"  {name}: ready in {srv.startup_s:.0f} s", flush=True)
    S.setdefault("startup_s", {})[name] = srv.startup_s
    return srv


def _clear(env) -> None:
    """Empty the test's tmpfs between servers (what a plain server left)."""
    if env["shm"] is not None:
        for p in env["shm"].iterdir():
            if p.is_file():
                p.unlink(missing_ok=True)


# -- requests ------------------------------------------------------------------------
def _photo_url(i: int) -> str:
    return _import_server().photo_url(i)


def _ask(srv, photo: int, n: int = 1, text: str = "Describe the picture."):
    """One chat request with one photo: greedy for n=1, seeded sampling for n>1."""
    r = srv.client(timeout_s=600).chat.completions.create(
        model="default", max_tokens=MAX_TOKENS, n=n, seed=7,
        temperature=0.0 if n == 1 else 0.8,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _photo_url(photo)}},
            {"type": "text", "text": text}]}])
    assert len(r.choices) == n
    return [c.message.content for c in r.choices]


def _metrics(srv) -> str:
    return srv.metrics_text()


def _m(text: str, name: str, **labels) -> float:
    return _import_server().metric(text, name, **labels)


def _segs(env) -> list[str]:
    return _import_server().segments(env["seg_dir"])


def _arena_segs(env) -> list[str]:
    """The arena segments (``FLAG_ARENA`` in the header) in the segment directory."""
    from mmshm.segments.segfile import FLAG_ARENA
    from tests.harness.segments import header

    out = []
    for n in _segs(env):
        try:
            if header(n, str(env["seg_dir"]))[8] & FLAG_ARENA:
                out.append(n)
        except FileNotFoundError:  # unlinked meanwhile (an idle plain segment)
            pass
    return out


def _rank_mappings(log: str, names: list[str]) -> dict:
    """Per TP rank (its pid from its "on:" line): how many mappings of each
    segment in ``names`` its /proc/<pid>/maps holds."""
    out = {}
    for rank, pid in re.findall(r"scheduler \(TP rank (\d+)\) \(pid (\d+)\)", log):
        maps = Path(f"/proc/{pid}/maps").read_text()
        out[int(rank)] = {n: len(re.findall(rf"/{re.escape(n)}(?: \(deleted\))?$", maps, re.M))
                          for n in names}
    return out


GREEDY = [(0, "Describe the picture."), (1, "Describe the picture."), (0, "What is in it?")]
#: pixel_values of one 720p photo through Qwen2-VL's processor: [4784, 1176] float32.
IMAGE_BYTES = 4784 * 1176 * 4
#: SGLang's hops (mmshm.integrations.sglang.HOPS).
HOPS = ("tokenizer_wrap", "tokenizer_send", "scheduler_recv", "broadcast_src",
        "broadcast_dst", "materialize")


def _hops(m0: str, m1: str, transport: str) -> dict:
    """Per hop: (messages, bytes, seconds) between two expositions."""
    out = {}
    for h in HOPS:
        lab = {"server": "sglang", "hop": h, "transport": transport}
        out[h] = tuple(round(_m(m1, f"mmshm_ipc_{k}", **lab) - _m(m0, f"mmshm_ipc_{k}", **lab), 6)
                       for k in ("bytes_count", "bytes_sum", "seconds_sum"))
    return out


# -- faults under load (tests/harness/faults.py) -------------------------------------------
def _faults(env, srv, name: str, mmshm: bool, fixed) -> None:
    """The abort storm, the rejects and the checks on the running ``srv``;
    the record goes to ``S["faults"][name]`` (its summary to the figures, the
    per-request detail to the log folder), or what broke to
    ``S["faults_error"][name]``: the phase goes on, the test after it
    asserts. ``fixed()`` sends the fixed request (its greedy text).

    Under mmshm the storm has n 1-4 (SGLang itself refuses n > 1 with several
    images); plain 0.5.9 only n=1 (its n>1 bug kills the scheduler, phase 1).
    ``mmshm status`` and ``gc`` run in the server's mount namespace (its
    /dev/shm is the test's tmpfs) or on the private segment directory."""
    from tests.harness import faults

    try:
        if FAULTS["urls"] is None:
            FAULTS["urls"] = faults.small_photo_urls(4)
        urls = FAULTS["urls"]
        shots = faults.plan(STORM_SHOTS, photos=len(urls),
                            max_n=4 if mmshm or not HAS_FANOUT_BUG else 1, max_n_multi=1)
        cases = faults.reject_cases(urls[0], MAX_IMAGES, CONTEXT, TOKENS_PER_WORD)
        mm = None
        if mmshm:
            mm = (faults.Mmshm("/dev/shm", ns_pid=srv.proc.pid) if SMALL_SHM
                  else faults.Mmshm(env["seg_dir"]))
        rec = faults.run_faults(
            srv.client(timeout_s=300), "default", urls, shots, cases, fixed, mm=mm,
            list_segments=lambda: _segs(env), idle_s=POOL_IDLE_S, metrics=srv.metrics_text,
            shm_root=env["shm"], pgid=None if SMALL_SHM else srv.proc.pid,
            concurrency=STORM_CONCURRENCY, detail_path=env["logs"] / f"faults-{name}.json")
        rec["alive"] = srv.proc.poll() is None
        FAULTS["records"][name] = rec
        S.setdefault("faults", {})[name] = faults.summary(rec)
    except Exception:  # noqa: BLE001 - recorded; the test after the phase fails with it
        FAULTS["errors"][name] = traceback.format_exc()[-6000:]
        S.setdefault("faults", {})[name] = "failed: see the test after the phase"


def _fault_record(name: str) -> dict:
    err = FAULTS["errors"].get(name)
    assert err is None, err
    if name not in FAULTS["records"]:
        pytest.skip(f"the {name} phase did not run its faults")
    return FAULTS["records"][name]


def _assert_refusals(rec: dict, plain: dict | None) -> None:
    """Every reject refused: HTTP 4xx, or 0.5.9's own 500 for an image it
    cannot load; with the plain server's record, the same status per case."""
    from tests.harness import faults

    for r in rec["rejects"]:
        ok = faults.refused(r) or (BAD_IMAGE_500 and r["status"] == 500
                                   and "Internal server error" in r["error"])
        assert ok, r
    if plain is not None:
        assert {r["case"]: r["status"] for r in rec["rejects"]} == \
            {r["case"]: r["status"] for r in plain["rejects"]}


# -- 1. SGLang's own transport, observed --------------------------------------------
@pytest.mark.timeout(900)
def test_plain_server(env):
    t0 = time.monotonic()
    srv = _server(env, "observe", mmshm=False, observe=True)
    try:
        log = srv.log_text()
        roles = ["tokenizer"] + [f"scheduler (TP rank {r})" for r in range(TP)]
        for role in roles:
            assert re.search(rf"mmshm\[\d+\] sglang {re.escape(RELEASE)}, "
                             rf"{re.escape(role)} \(pid \d+\): on: observe mode: ", log), role
        assert "mmshm run: observe mode" in log
        m0 = _metrics(srv)
        S["plain"] = [_ask(srv, p, 1, t)[0] for p, t in GREEDY]
        m1 = _metrics(srv)
        hops = _hops(m0, m1, "server")
        S["observe_hops"] = hops
        # observe mode made no segment and carried nothing
        assert _segs(env) == []
        assert _m(m1, "mmshm_segments_created_total") == 0
        assert _m(m1, "mmshm_ipc_seconds_count", transport="mmshm") == 0
        assert _m(m1, "mmshm_observe_errors_total") == 0
        # every hop timed; SGLang's own shared memory took each photo's pixels
        # once, the rest carried pointers (or, on 0.5.9, the broadcast the pixels)
        n = len(GREEDY)
        count, nbytes, secs = hops["tokenizer_wrap"]
        assert count == n and nbytes == pytest.approx(n * IMAGE_BYTES, rel=0.001), hops
        for h in ("tokenizer_send", "scheduler_recv", "broadcast_src", "broadcast_dst",
                  "materialize"):
            assert hops[h][0] >= n and hops[h][1] > 0 and hops[h][2] > 0, (h, hops)
        if HAS_FANOUT_BUG:
            # the fan-out copies share mm_items: the first receiver unlinks the
            # segment the next copy names; the scheduler dies of it
            import openai

            with pytest.raises(openai.OpenAIError):
                _ask(srv, 0, n=2)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and "FileNotFoundError" not in srv.log_text():
                time.sleep(1)
            log = srv.log_text()
            assert re.search(r"FileNotFoundError: .*'/psm_\w+'", log), srv.log_tail()
            assert "recv_requests" in log
        else:
            S["plain_n2"] = _ask(srv, 0, n=2)
    finally:
        srv.kill()
        _clear(env)
    S.setdefault("phase_s", {})["plain"] = time.monotonic() - t0


# -- 2. plain, 64 MiB /dev/shm -----------------------------------------------------
@pytest.mark.timeout(900)
def test_plain_server_small_shm_burst(env):
    if not SMALL_SHM:
        pytest.skip(NO_SMALL_SHM)
    if not HAS_SIGBUS:
        pytest.skip(f"SGLang {RELEASE} reserves with posix_fallocate (no SIGBUS to show); "
                    "the burst runs under mmshm below")
    t0 = time.monotonic()
    srv = _server(env, "plain-small-shm", mmshm=False)
    try:
        # the one truly plain server of this release: observe mode answered the same
        S["plain_unobserved"] = _ask(srv, GREEDY[0][0], 1, GREEDY[0][1])[0]
        assert S["plain_unobserved"] == S["plain"][0]
        # the abort storm and the rejects on the plain server (asserted below):
        # what SGLang's own psm_* segments do
        _faults(env, srv, "plain", mmshm=False,
                fixed=lambda: _ask(srv, GREEDY[0][0], 1, GREEDY[0][1])[0])
        with ThreadPoolExecutor(PLAIN_BURST) as ex:
            futs = [ex.submit(_ask, srv, i) for i in range(PLAIN_BURST)]
            errors = [f.exception(timeout=600) for f in futs]
        assert any(errors), "every request of the burst was answered"
        srv.proc.wait(timeout=120)
        # tmpfs allocates pages lazily: the copy into the segment faults
        assert srv.proc.returncode == -signal.SIGBUS, (srv.proc.returncode, srv.log_tail())
    finally:
        srv.kill()
        _clear(env)
    S["phase_s"]["plain-small-shm"] = time.monotonic() - t0


def test_plain_server_faults_under_load(env):
    """Phase 2's storm and rejects: plain 0.5.9 answered every storm request
    until the client closed it, refused every reject, answered the fixed
    request as before and stayed up; its own psm_* segments are counted."""
    rec = _fault_record("plain")
    assert not rec["storm"]["errors"], rec["storm"]["errors"]
    _assert_refusals(rec, None)
    assert rec["fixed_equal"] and rec["fixed_after"] == S["plain"][0], rec
    assert rec["alive"]
    # SGLang's own transport carried the storm's images: psm_* segments made
    # (one per image that reached the tokenizer); what is left is the figure
    w = rec["watch"]["psm_*"]
    assert w["made"] >= 1, w
    assert rec["watch"]["mmshm-*"]["made"] == 0


# -- 3. under mmshm run --------------------------------------------------------------
@pytest.mark.timeout(1200)
def test_mmshm_server(env):
    assert "plain" in S, "the plain phase did not run"
    t0 = time.monotonic()
    srv = _server(env, "mmshm", mmshm=True, dist_init=True)
    try:
        log = srv.log_text()
        # every process says what it turned on: the tokenizer, each TP rank
        roles = ["tokenizer"] + [f"scheduler (TP rank {r})" for r in range(TP)]
        for role in roles:
            assert re.search(rf"mmshm\[\d+\] sglang {re.escape(RELEASE)}, "
                             rf"{re.escape(role)} \(pid \d+\): on: ", log), (role, log[-4000:])
        assert " is OFF: " not in log
        on = {(lab["role"], lab["path"]) for lab, v in
              _import_server().series(_metrics(srv), "mmshm_path_enabled") if v == 1}
        assert {r for r, _ in on} == set(roles), on
        # greedy texts equal to plain's, every request answered
        m0 = _metrics(srv)
        texts = [_ask(srv, p, 1, t)[0] for p, t in GREEDY]
        assert texts == S["plain"]
        m1 = _metrics(srv)
        written = _m(m1, "mmshm_shm_written_bytes_total") - \
            _m(m0, "mmshm_shm_written_bytes_total")
        payload = written / len(GREEDY)
        assert payload > 20e6, f"each photo is 22.5 MB of pixels, wrote {written}"
        S["payload"] = payload

        # n=2: answered, each image written once for the warm-up and samples
        out = _ask(srv, 2, n=2)
        assert len(out) == 2
        m2 = _metrics(srv)
        w2 = _m(m2, "mmshm_shm_written_bytes_total") - _m(m1, "mmshm_shm_written_bytes_total")
        copies = _m(m2, "mmshm_fanout_copies_total") - _m(m1, "mmshm_fanout_copies_total")
        S["n2_written"], S["n2_copies"] = w2, copies
        assert w2 == pytest.approx(payload, rel=0.02), f"n=2 wrote {w2 / payload:.2f} payloads"
        assert copies == 3  # the warm-up and the two samples

        # the TP broadcast carried metadata only: every broadcast under 100 kB
        # (token ids and 0.5.9's inline mrope positions), against 22.5 MB of
        # pixels per photo
        count = _m(m2, "mmshm_broadcast_bytes_count", role="src")
        small = _m(m2, "mmshm_broadcast_bytes_bucket", role="src", le="100000.0")
        total = _m(m2, "mmshm_broadcast_bytes_sum", role="src")
        S["bcast"] = {"broadcasts": count, "bytes": total, "under_100kB": small}
        assert count >= len(GREEDY) and small == count, S["bcast"]
        assert total < payload / 10, S["bcast"]
        assert _m(m2, "mmshm_inline_fallbacks_total") == 0
        # the same hops timed under mmshm: metadata only past the tokenizer
        hops = _hops(m0, m1, "mmshm")
        S["mmshm_hops"] = hops
        assert hops["tokenizer_wrap"][0] == len(GREEDY), hops
        assert hops["tokenizer_wrap"][1] == pytest.approx(written, rel=0.001), hops
        for h in ("tokenizer_send", "scheduler_recv", "broadcast_src", "broadcast_dst"):
            assert hops[h][0] >= len(GREEDY) and 0 < hops[h][1] < 2e5 * hops[h][0], (h, hops)
        assert hops["materialize"][0] == 0, hops  # mmshm materializes inside the broadcast
        assert _m(m2, "mmshm_ipc_seconds_count", transport="server") == 0

        if SMALL_SHM:
            # a burst in a 64 MiB /dev/shm: ENOSPC (or the budget), then inline
            with ThreadPoolExecutor(BURST) as ex:
                answers = list(ex.map(lambda i: _ask(srv, i), range(BURST)))
            assert len(answers) == BURST and all(len(a) == 1 for a in answers)
            m3 = _metrics(srv)
            S["fallbacks"] = _m(m3, "mmshm_inline_fallbacks_total")
            assert S["fallbacks"] >= 1
            assert "Bus error" not in srv.log_text()[len(log):]

        # the abort storm, the rejects and the checks (asserted below)
        _faults(env, srv, "mmshm", mmshm=True,
                fixed=lambda: _ask(srv, GREEDY[0][0], 1, GREEDY[0][1])[0])

        # the idle pooled segments go after MMSHM_POOL_IDLE_S (2 s): wait for
        # them, so that the next request's segment is a fresh one
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _segs(env):
            time.sleep(0.2)
        S["held_when_idle"] = _segs(env)

        # SIGKILL the process group while a request is in flight: at the moment
        # a second process (a TP rank) opens the segment the tokenizer created
        # (inotify, so no poll can miss a short-lived segment)
        from inotify_simple import INotify, flags

        with INotify() as ino:
            ino.add_watch(str(env["seg_dir"]), flags.OPEN)
            opens: dict[str, int] = {}
            t = threading.Thread(target=lambda: _swallow(_ask, srv, 3), daemon=True)
            t.start()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and max(opens.values(), default=0) < 2:
                for ev in ino.read(timeout=1000):
                    if ev.name.startswith("mmshm-"):
                        opens[ev.name] = opens.get(ev.name, 0) + 1
            os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.kill()
        t.join(30)
        S["opens_at_kill"] = opens
        S["left_after_kill"] = _segs(env)
        assert S["left_after_kill"], ("no segment was in flight when the server was killed", opens)
    finally:
        srv.kill()
    S["phase_s"]["mmshm"] = time.monotonic() - t0


def test_mmshm_server_faults_under_load(env):
    """Phase 3's storm and rejects under mmshm: every storm request answered
    until the client closed it, every reject refused as plain refuses it,
    the fixed request answered as plain answered it; after the pool's idle
    time nothing in the segment directory that ``mmshm status`` does not
    explain, no orphan for ``mmshm gc --dry-run``, the directory empty; the
    counters agree (segments in use == files, pool misses == creations,
    nothing reaped, no failure)."""
    from tests.harness import faults

    rec = _fault_record("mmshm")
    plain = FAULTS["records"].get("plain")
    assert not rec["storm"]["errors"], rec["storm"]["errors"]
    _assert_refusals(rec, plain)
    assert rec["fixed_equal"] and rec["fixed_after"] == S["plain"][0], rec
    assert rec["alive"]
    # the storm went through mmshm: segments made (or reused) for its photos,
    # each file made counted once, and none of SGLang's own psm_* (0.5.9) or
    # sgl_shm_mm_* (0.5.23) segments
    assert rec["counters"]["created"] + rec["counters"]["pool_hits"] >= 1, rec["counters"]
    if "watch" in rec:  # the servers' /dev/shm is the test's tmpfs
        assert rec["watch"]["mmshm-*"]["made"] == rec["counters"]["created"], \
            (rec["watch"], rec["counters"])
        assert rec["watch"]["psm_*"]["made"] == 0, rec["watch"]
        assert rec["watch"]["sgl_shm_mm_*"]["made"] == 0, rec["watch"]  # 0.5.23's own
    problems = [p for p in faults.problems(rec)
                if not p.startswith(("reject ", "storm request "))]  # judged above
    assert not problems, problems


def _swallow(fn, *a):
    import contextlib

    import openai

    with contextlib.suppress(openai.OpenAIError):  # the server is killed under it
        fn(*a)


# -- 4. restart: reclaim, then a clean stop ------------------------------------------
@pytest.mark.timeout(900)
def test_mmshm_restart_reclaims_and_stops_clean(env):
    left = S.get("left_after_kill")
    if not left:
        pytest.skip("the mmshm phase left nothing to reclaim")
    t0 = time.monotonic()
    srv = _server(env, "mmshm-restart", mmshm=True, MMSHM_ARENA_BYTES=str(ARENA_BYTES))
    try:
        # reclaimed as the server's processes started, before its first request
        assert not set(_segs(env)) & set(left), "the killed server's segments are still there"
        m0 = _metrics(srv)
        S["reaped_at_start"] = _m(m0, "mmshm_reaped_segments_total")
        assert S["reaped_at_start"] >= len(left), S["reaped_at_start"]
        assert _ask(srv, 0, 1)[0] == S["plain"][0]
        m1 = _metrics(srv)
        S["reaped"] = _m(m1, "mmshm_reaped_segments_total")
        assert not set(_segs(env)) & set(left), "the killed server's segments are still there"
        assert S["reaped"] >= len(left)
        # the arena: the greedy requests twice, the second time through the
        # arena segments of the first, reused (next generation) and already
        # mapped by both TP ranks (recorded; asserted in the test below)
        arena = ARENA
        arena.update(answers=[], metrics=[m1], seconds=[])
        for _ in range(2):
            t1 = time.monotonic()
            arena["answers"].append([_ask(srv, p, 1, t)[0] for p, t in GREEDY])
            arena["seconds"].append(round(time.monotonic() - t1, 2))
            arena["metrics"].append(_metrics(srv))
        # nothing held once the answers are in but the arena's segments (idle
        # plain pooled segments go after 2 s; arena segments stay pooled for good)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and set(_segs(env)) - set(_arena_segs(env)):
            time.sleep(0.5)
        arena["before_stop"] = _segs(env)
        arena["segments"] = _arena_segs(env)
        arena["rank_mappings"] = _rank_mappings(srv.log_text(), arena["segments"])
        srv.stop(signal.SIGTERM, timeout_s=90)
        S["left_after_stop"] = _segs(env)
        assert S["left_after_stop"] == []
    finally:
        srv.kill()
        S["phase_s"]["mmshm-restart"] = time.monotonic() - t0


def test_arena_answers_as_plain_from_warm_mapped_segments(env):
    """Phase 4 with the arena on (``MMSHM_ARENA_BYTES``) in the real TP=2
    server: the greedy requests answered as plain answered them, the first
    time and the second (every segment then a reused arena segment that both
    TP ranks had mapped already: no segment made, one mapping per rank and
    segment); served unregistered (no CUDA on this host); arena segments in the
    directory while it ran, none after its stop."""
    arena = ARENA
    if not arena:
        pytest.skip("the restart phase did not run its arena requests")
    assert len(arena["answers"]) == 2, "the restart phase stopped before its second pass"
    for answers in arena["answers"]:
        assert answers == S["plain"]
    m0, m1, m2 = arena["metrics"]
    d = {k: [_m(b, k) - _m(a, k) for a, b in ((m0, m1), (m1, m2))]
         for k in ("mmshm_segments_created_total", "mmshm_inline_fallbacks_total")}
    views = [_m(b, "mmshm_arena_views_total", registered="no")
             - _m(a, "mmshm_arena_views_total", registered="no") for a, b in ((m0, m1), (m1, m2))]
    hits = [_m(b, "mmshm_pool_requests_total", result="hit")
            - _m(a, "mmshm_pool_requests_total", result="hit") for a, b in ((m0, m1), (m1, m2))]
    wrap = [_hops(a, b, "mmshm")["tokenizer_wrap"] for a, b in ((m0, m1), (m1, m2))]
    S["arena"] = fig = {
        "arena_bytes": _m(m2, "mmshm_arena_bytes"), "pass_seconds": arena["seconds"],
        "views_per_pass": views, "created_per_pass": d["mmshm_segments_created_total"],
        "pool_hits_per_pass": hits,
        "inline_fallbacks_per_pass": d["mmshm_inline_fallbacks_total"],
        "arena_fallbacks": _m(m2, "mmshm_arena_fallbacks_total"),
        "wrap_ms_per_request": [round(1000 * w[2] / max(w[0], 1), 2) for w in wrap],
        "arena_segments": len(arena["segments"]), "rank_mappings": arena["rank_mappings"]}
    assert _m(m2, "mmshm_arena_bytes") == ARENA_BYTES
    # every photo of both passes handed to both TP ranks from the arena's
    # mappings, unregistered: no CUDA in this host, nothing registered
    assert views == [TP * len(GREEDY)] * 2, fig
    assert _m(m2, "mmshm_arena_views_total", registered="yes") == 0
    assert _m(m2, "mmshm_arena_registrations_total") == 0
    assert _m(m2, "mmshm_arena_registered_bytes") == 0
    # the second pass made no segment: each photo went into a reused arena segment
    assert d["mmshm_segments_created_total"][1] == 0, fig
    assert hits[1] == len(GREEDY), fig
    assert d["mmshm_inline_fallbacks_total"] == [0, 0], fig
    # arena segments present while it ran, each mapped once by each TP rank
    # (a persistent mapping kept across requests and generations)
    assert arena["segments"] and arena["segments"] == arena["before_stop"], \
        (arena["segments"], arena["before_stop"])
    assert sorted(arena["rank_mappings"]) == list(range(TP)), arena["rank_mappings"]
    for rank, per in arena["rank_mappings"].items():
        assert set(per.values()) == {1}, (rank, per)
    # and none left after its stop
    assert S.get("left_after_stop") == []
