"""mmshm against a real SGLang 0.5.23 server with data parallelism on CPU:
``--dp-size 2 --tp 1``, SGLang's data-parallel controller between the
tokenizer and one scheduler per DP rank (each bound to a core of its own),
the tiny Qwen2-VL of ``tests/harness/models.py``, the real OpenAI client.

Run by ``python -m tests.run sglang`` for 0.5.23 (its ``E2E_SGLANG``), in
``.venvs/sglang-0.5.23-server`` with ``MMSHM_E2E=sglang``; skipped anywhere
else.

Two server starts in all, each shared by the cases of its class: plain, then
under ``mmshm run``. Every request of the plain phase is sent again under
mmshm in the same order: greedy requests with one or two photos, pinned to
each DP rank (SGLang's ``routed_dp_rank``) and left to the controller's
round robin, then one ``n=2`` request. Under mmshm, in file order:

1. the "on:" lines, ``mmshm status --json`` and ``mmshm_path_enabled{role}``
   name each scheduler's DP rank, and the controller says what it does;
2. the greedy texts equal plain's, and both DP ranks served requests (the
   schedulers' ``[... DP<n>] Prefill batch`` log lines);
3. ``n=2`` writes each tensor once;
4. the references handed through the DP controller come back: after the
   pool's idle time (``MMSHM_POOL_IDLE_S``) the segment directory is empty,
   ``mmshm status`` explains nothing left and ``mmshm gc --dry-run`` finds
   nothing;
5. last, as it ends the server: SIGKILL of DP rank 1's scheduler
   (``sglang::scheduler_DP1``) while it holds a request's segments. SGLang
   neither restarts nor stops on it (the scheduler stays a zombie of the
   controller; the tokenizer, the controller and DP rank 0 go on), so DP rank
   0 still answers and no segment of its own is left; the killed rank's
   segments stay held by the live tokenizer (their references died with the
   rank). The fixture then SIGKILLs the process group, and the start-up
   reaper a restarted server runs on its first segment
   (:meth:`mmshm.segments.table.SegmentTable.maybe_reap`) reclaims them: the
   directory is empty after it, no restart needed.

As root (with ``unshare``), each server runs in a private mount namespace
whose /dev/shm is a tmpfs the test mounted: SGLang's own ``sgl_shm_*`` segments
(plain) and mmshm's are counted there with inotify, apart from any other
program's. Otherwise mmshm's segment directory is a private one under the
host's /dev/shm and SGLang's own segments go uncounted.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.harness.servers import needs_e2e

RELEASE = os.environ.get("MMSHM_SGLANG_RELEASE", "0.0.0")
V = tuple(int(x) for x in RELEASE.split("."))

pytestmark = [
    needs_e2e("sglang"),
    pytest.mark.skipif(V < (0, 5, 23), reason="the DP e2e runs on SGLang 0.5.23 only "
                                               "(python -m tests.run sglang)"),
]

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".venvs" / "tiny-qwen2-vl"  # models.model_dir("qwen2-vl")
PRIVATE_SHM = os.geteuid() == 0 and shutil.which("unshare") is not None
DP = 2
MAX_TOKENS = 8
#: The pool's idle time the mmshm server runs with (MMSHM_POOL_IDLE_S), seconds.
POOL_IDLE_S = 2.0
#: The greedy requests, in order: (photos, routed DP rank or None for the
#: controller's round robin).
GREEDY = [((0,), 0), ((1,), 1), ((0, 1), 0), ((2, 3), 1), ((2,), None), ((3, 0), None),
          ((1,), None), ((2,), None)]
N2_PHOTOS = (3,)
#: A scheduler's prefill log line (``[time DP1] Prefill batch, #new-seq: 1,
#: #new-token: 97, #cached-token: 0, ...``).
PREFILL_RE = re.compile(r"\bDP(\d+)\] Prefill batch.*?#new-token: (\d+), #cached-token: (\d+)")
#: Fewer prompt tokens than this: SGLang's own health check (a one-token
#: request), not a request with a photo (96 image tokens each).
MIN_PROMPT_TOKENS = 64

S: dict = {}  # figures, printed at the end of the module
STATE: dict = {}  # what the cases hand on (not printed)


def _server_mod():
    from tests.harness import servers  # process group, bounded, killed on every path

    return servers


def _faults_mod():
    from tests.harness import faults

    return faults


@pytest.fixture(scope="module")
def env(request):
    """The model, the photos, the log folder and the segment directory."""
    from tests.harness import models

    models.build(MODEL_DIR)
    server = _server_mod()
    logs = Path(tempfile.mkdtemp(prefix=f"sglang-dp-e2e-{RELEASE}-"))
    shm = server.mount_tmpfs("mmshm-dp-e2e-shm-", "1g") if PRIVATE_SHM else None
    seg_dir = shm if shm is not None else Path(
        tempfile.mkdtemp(prefix="mmshm-dp-e2e-", dir="/dev/shm"))
    info = {"logs": logs, "shm": shm, "seg_dir": seg_dir,
            "urls": _faults_mod().small_photo_urls(4)}
    print(f"\nSGLang {RELEASE} DP e2e: logs in {logs}", flush=True)
    yield info
    server.report_figures(request, f"SGLang {RELEASE} DP={DP} e2e", S, logs)
    server._kill_all()
    if shm is not None:
        server.unmount_tmpfs(shm)
    else:
        shutil.rmtree(seg_dir, ignore_errors=True)


def _start(env, name: str, mmshm: bool):
    """One DP=2 server (plain or under ``mmshm run``), ready; its start time
    goes to the figures."""
    server = _server_mod()
    port = server.free_port()
    argv = server.sglang_argv(MODEL_DIR, port, 1, V, limit_images=2) + ["--dp-size", str(DP)]
    # one core per DP rank's scheduler (SGLang's CPU binding, as for TP=2)
    e = server.sglang_env(MMSHM_POOL_IDLE_S=f"{POOL_IDLE_S:g}", MMSHM_REAP_INTERVAL_S="60")
    prefix = None
    if env["shm"] is not None:
        e["MMSHM_DIR"] = "/dev/shm"
        prefix = ["unshare", "-m", "sh", "-c",
                  (f"mount --make-rprivate / && mount --bind {env['shm']} /dev/shm && "
                   'exec "$0" "$@"')]
    else:
        e["MMSHM_DIR"] = str(env["seg_dir"])
    srv = server.Server(argv, port, env["logs"] / f"{name}.log", env=e, mmshm_run=mmshm,
                        prefix=prefix, ready_timeout_s=600)
    srv.start()
    print(f"  {name}: ready in {srv.startup_s:.0f} s", flush=True)
    S.setdefault("startup_s", {})[name] = round(srv.startup_s, 1)
    return srv


def _clear(env) -> None:
    """Empty the test's tmpfs between servers (what the plain server left)."""
    if env["shm"] is not None:
        for p in env["shm"].iterdir():
            if p.is_file():
                p.unlink(missing_ok=True)


def _serving(env, name: str, mmshm: bool):
    """A class's server: started once, SIGKILLed (the process group, by
    pid) when the class is done, whatever happened."""
    srv = _start(env, name, mmshm)
    try:
        yield srv
    finally:
        srv.kill()
        _clear(env)


@pytest.fixture(scope="class")
def plain(env):
    yield from _serving(env, "plain", mmshm=False)


@pytest.fixture(scope="class")
def shm_server(env):
    yield from _serving(env, "mmshm", mmshm=True)


# -- requests -------------------------------------------------------------------------
def _ask(env, srv, photos, rank=None, n: int = 1) -> list[str]:
    """One chat request with ``photos`` (indexes into the small photos):
    greedy for n=1, seeded sampling for n>1; ``rank``: SGLang's
    ``routed_dp_rank`` (None: the controller chooses)."""
    r = srv.client(timeout_s=600).chat.completions.create(
        model="default", max_tokens=MAX_TOKENS, n=n, seed=7,
        temperature=0.0 if n == 1 else 0.8,
        messages=[{"role": "user", "content": [
            *({"type": "image_url", "image_url": {"url": env["urls"][p]}} for p in photos),
            {"type": "text", "text": "Describe the pictures."}]}],
        extra_body={} if rank is None else {"routed_dp_rank": rank})
    assert len(r.choices) == n
    return [c.message.content for c in r.choices]


def _m(text: str, name: str, **labels) -> float:
    return _server_mod().metric(text, name, **labels)


def _segs(env) -> list[str]:
    return _server_mod().segments(env["seg_dir"])


def _mm(env, srv):
    """``mmshm status`` / ``gc`` where the server's processes run."""
    faults = _faults_mod()
    if env["shm"] is not None:
        return faults.Mmshm("/dev/shm", ns_pid=srv.proc.pid)
    return faults.Mmshm(env["seg_dir"])


def _served(log: str) -> dict[int, int]:
    """Prefill batches of requests with photos, per DP rank, in a slice of
    a server's log (prompt tokens: new plus cached by the radix cache)."""
    out = dict.fromkeys(range(DP), 0)
    for m in PREFILL_RE.finditer(log):
        rank, new, cached = map(int, m.groups())
        if new + cached >= MIN_PROMPT_TOKENS:
            out[rank] = out.get(rank, 0) + 1
    return out


#: SGLang's own shared-memory segments: ``sgl_shm_mm_<pid>_<hex>`` (0.5.23),
#: ``psm_*`` (Python's shared_memory, earlier releases).
SGLANG_SEGMENTS = ("sgl_shm_*", "psm_*")


class _Files:
    """SGLang's own segments (:data:`SGLANG_SEGMENTS`) and mmshm's
    ``mmshm-*`` made in the servers' private /dev/shm during the block
    (inotify: a file that lives a millisecond counts too); ``own``/``mmshm``
    stay None without one."""

    def __init__(self, env):
        self.shm = env["shm"]
        self.own = self.mmshm = None

    def __enter__(self) -> _Files:
        self._stack = contextlib.ExitStack()
        if self.shm is not None:
            faults = _faults_mod()
            self._w = [self._stack.enter_context(faults.ShmWatch(self.shm, p))
                       for p in (SGLANG_SEGMENTS, ("mmshm-*",))]
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        if self.shm is not None:
            self.own, self.mmshm = (w.made for w in self._w)


def _workload(env, srv, name: str) -> dict:
    """The greedy requests, then the n=2 request; kept in ``STATE[name]``
    (answers, prefills per DP rank, the expositions before, between and
    after, the files made), summed up in the figures."""
    log0 = len(srv.log_text())
    m0 = srv.metrics_text()
    with _Files(env) as f1:
        greedy = [_ask(env, srv, photos, rank)[0] for photos, rank in GREEDY]
    m1 = srv.metrics_text()
    with _Files(env) as f2:
        n2 = _ask(env, srv, N2_PHOTOS, n=2)
    m2 = srv.metrics_text()
    rec = {"greedy": greedy, "n2": n2, "served": _served(srv.log_text()[log0:]),
           "metrics": (m0, m1, m2), "files": (f1, f2)}
    STATE[name] = rec
    n = len(GREEDY)
    fig = {"requests": n, "images": IMAGES, "prefills_by_dp_rank": rec["served"]}
    if f1.own is not None:
        fig["sglang_segments_per_request"] = round(f1.own / n, 2)
        fig["mmshm_segments_per_request"] = round(f1.mmshm / n, 2)
        fig["n2_segments"] = {"sglang": f2.own, "mmshm": f2.mmshm}
    S.setdefault("workload", {})[name] = fig
    return rec


def _group(srv) -> list:
    """The server's processes (psutil), the ``mmshm run`` wrapper's children
    and theirs."""
    import psutil

    return psutil.Process(srv.proc.pid).children(recursive=True)


def _held_by(pid: int) -> set[str]:
    """mmshm's segments that process ``pid`` maps or has open (a zero-copy
    view keeps the mapping, not necessarily a descriptor)."""
    names = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            names.update(os.path.basename(line.split()[-1]) for line in f
                         if "/mmshm-" in line)
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                names.add(os.path.basename(os.readlink(f"/proc/{pid}/fd/{fd}")))
    except OSError:  # gone
        pass
    return {n for n in names if n.startswith("mmshm-")}


def _swallow(fn, *a, **kw):
    import openai

    with contextlib.suppress(openai.OpenAIError):  # the server is killed under it
        fn(*a, **kw)


#: pixel_values of one small photo (336 x 224) through Qwen2-VL's processor:
#: [384, 1176] float32; two photos of one request travel as one tensor.
PHOTO_BYTES = 384 * 1176 * 4
IMAGES = sum(len(p) for p, _ in GREEDY)


# -- plain -------------------------------------------------------------------------------
class TestPlain:
    @pytest.mark.timeout(1500)
    def test_plain_answers_on_both_dp_ranks(self, env, plain):
        t0 = time.monotonic()
        rec = _workload(env, plain, "plain")
        assert all(rec["served"][r] >= 1 for r in range(DP)), rec["served"]
        assert len(rec["n2"]) == 2
        if env["shm"] is not None:
            # SGLang's own transport carried the pixels (a segment per
            # tensor sent), mmshm none
            f1, _ = rec["files"]
            assert f1.own >= len(GREEDY) and f1.mmshm == 0, (f1.own, f1.mmshm)
        S.setdefault("phase_s", {})["plain"] = round(time.monotonic() - t0, 1)


# -- under mmshm run ------------------------------------------------------------------------
class TestMmshm:
    @pytest.mark.timeout(1500)
    def test_on_lines_status_and_metrics_name_the_dp_rank(self, env, shm_server):
        srv = shm_server
        log = srv.log_text()
        scheds = [f"scheduler (DP rank {r}, TP rank 0)" for r in range(DP)]
        roles = ["tokenizer", "data-parallel controller", *scheds]
        for role in roles:
            assert re.search(rf"mmshm\[\d+\] sglang {re.escape(RELEASE)}, "
                             rf"{re.escape(role)} \(pid \d+\): on: ", log), (role, log[-4000:])
        assert " is OFF: " not in log
        assert "(TP rank 0) (pid" not in log  # no scheduler without its DP rank
        on = {lab["role"] for lab, v in
              _server_mod().series(srv.metrics_text(), "mmshm_path_enabled") if v == 1}
        assert on == set(roles), on
        # mmshm status: each scheduler's row names its DP rank
        pids = {p.pid for p in _group(srv)}
        st = _mm(env, srv).status()
        rows = {p["dp_rank"]: p["role"] for p in st["processes"]
                if p["pid"] in pids and p.get("dp_rank") is not None}
        assert rows == {r: f"SGLang scheduler DP{r}" for r in range(DP)}, st["processes"]
        S["roles"] = {"on_lines": roles, "status": rows}

    @pytest.mark.timeout(900)
    def test_answers_equal_plain_on_both_dp_ranks(self, env, shm_server):
        plain = STATE.get("plain")
        assert plain is not None, "the plain phase did not run"
        t0 = time.monotonic()
        rec = _workload(env, shm_server, "mmshm")
        S["answers_equal"] = rec["greedy"] == plain["greedy"]
        assert rec["greedy"] == plain["greedy"]
        assert all(rec["served"][r] >= 1 for r in range(DP)), rec["served"]
        m0, m1, _ = rec["metrics"]
        d = {k: _m(m1, name) - _m(m0, name) for k, name in (
            ("created", "mmshm_segments_created_total"),
            ("written", "mmshm_shm_written_bytes_total"),
            ("fallbacks", "mmshm_inline_fallbacks_total"),
            ("failures", "mmshm_request_failures_total"),
            ("materialize_failures", "mmshm_materialize_failures_total"))}
        fig = S["workload"]["mmshm"]
        fig["segments_created_per_request"] = round(d["created"] / len(GREEDY), 2)
        fig["bytes_written_per_request"] = round(d["written"] / len(GREEDY))
        # every photo's pixels went through shared memory, once per request
        assert d["written"] == pytest.approx(IMAGES * PHOTO_BYTES, rel=0.01), d
        assert d["fallbacks"] == d["failures"] == d["materialize_failures"] == 0, d
        assert 1 <= d["created"] <= len(GREEDY), d
        f1, _ = rec["files"]
        if f1.own is not None:
            assert f1.own == 0, "SGLang's own shared memory carried pixels under mmshm"
            assert f1.mmshm == d["created"], (f1.mmshm, d)  # each creation counted once
        S.setdefault("phase_s", {})["mmshm"] = round(time.monotonic() - t0, 1)

    def test_n2_writes_each_tensor_once(self, env, shm_server):
        rec = STATE.get("mmshm")
        assert rec is not None, "the mmshm workload did not run"
        _, m1, m2 = rec["metrics"]
        written = _m(m2, "mmshm_shm_written_bytes_total") - \
            _m(m1, "mmshm_shm_written_bytes_total")
        copies = _m(m2, "mmshm_fanout_copies_total") - _m(m1, "mmshm_fanout_copies_total")
        _, f2 = rec["files"]
        _, pf2 = STATE["plain"]["files"]
        S["n2"] = {"payload_bytes": len(N2_PHOTOS) * PHOTO_BYTES, "written_bytes": written,
                   "copies": copies, "mmshm_segments": f2.mmshm,
                   "plain_sglang_segments": pf2.own}
        assert len(rec["n2"]) == 2
        # the warm-up and the two samples, each forwarded by the DP controller,
        # share one segment: written once
        assert written == pytest.approx(len(N2_PHOTOS) * PHOTO_BYTES, rel=0.01), S["n2"]
        assert copies == 3, S["n2"]
        if f2.mmshm is not None:
            assert f2.mmshm <= 1, S["n2"]

    @pytest.mark.timeout(300)
    def test_references_through_the_controller_come_back(self, env, shm_server):
        """After the pool's idle time nothing is left: the DP controller
        gave back the references of every request it forwarded, the last
        one included."""
        faults = _faults_mod()
        rec = faults.settle(_mm(env, shm_server), lambda: _segs(env), POOL_IDLE_S)
        m = shm_server.metrics_text()
        S["after_idle"] = {"at_idle": len(rec["at_idle"]), "left": rec["left"],
                           "empty_after_s": rec["empty_after_s"],
                           "gc_would_reclaim": rec["gc"]["would_reclaim"],
                           "segments_in_use": _m(m, "mmshm_segments_in_use")}
        assert not faults.settle_problems(rec), (faults.settle_problems(rec), rec)
        assert _segs(env) == []
        assert _m(m, "mmshm_segments_in_use") == 0

    @pytest.mark.timeout(600)
    def test_sigkill_of_a_dp_rank_is_reclaimed_at_restart(self, env, shm_server):
        """Last: it ends the server. DP rank 1's scheduler is SIGKILLed while
        it holds a request's segment; DP rank 0 goes on and strands nothing;
        the killed rank's segments are reclaimed by what a restart runs."""
        srv = shm_server
        group = _group(srv)
        [dp1] = [p for p in group if "sglang::scheduler_DP1" in " ".join(p.cmdline())]
        before = set(_segs(env))
        t = threading.Thread(target=_swallow, args=(_ask, env, srv, (0, 1), 1), daemon=True)
        t.start()
        held: set[str] = set()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not held and t.is_alive():
            held = _held_by(dp1.pid)
            if not held:
                time.sleep(0.005)
        assert held, "DP rank 1 never held a segment of the request routed to it"
        os.kill(dp1.pid, signal.SIGKILL)
        # the request's segments: references handed to DP rank 1, opened by it
        # before the kill or not yet (it maps one photo's segment at a time)
        routed = held | (set(_segs(env)) - before)
        rec = S["sigkill_dp1"] = {"held_by_dp1": sorted(held), "routed_to_dp1": sorted(routed)}
        # SGLang neither stops nor restarts on it: the rest of the server runs
        time.sleep(2.0)
        rec["server_alive"] = srv.proc.poll() is None
        rec["dp1"] = dp1.status() if dp1.is_running() else "gone"
        assert rec["server_alive"], srv.log_tail()
        # DP rank 0 answers as before, and strands none of its references
        assert _ask(env, srv, GREEDY[0][0], 0)[0] == STATE["plain"]["greedy"][0]
        deadline = time.monotonic() + POOL_IDLE_S + 60
        while time.monotonic() < deadline and not set(_segs(env)) <= routed:
            time.sleep(0.5)
        left = set(_segs(env))
        rec["left_while_up"] = sorted(left)
        assert held <= left, ("a segment DP rank 1 held went while it was dead", left, held)
        assert left <= routed, ("segments beyond the killed rank's request", left, routed)
        assert left, "the killed rank's segments went without a restart"
        rec["gc_while_up"] = _mm(env, srv).gc_dry_run()["reclaimed"]  # the tokenizer holds them
        # the end of the server (the fixture's own kill: the process group by pid)
        srv.kill()
        t.join(30)
        assert set(_segs(env)) >= left
        # what a restart runs: the start-up reaper of a process's first segment
        rep = _startup_reap(env["seg_dir"])
        rec["reclaimed_at_restart"] = rep["reclaimed"]
        rec["reasons"] = rep["reasons"]
        assert set(rep["names"]) >= left, rep
        assert rep["reasons"]["killed"] == rep["reclaimed"], rep
        assert _segs(env) == []
        assert _faults_mod().Mmshm(env["seg_dir"]).gc_dry_run()["reclaimed"] == 0


def _startup_reap(seg_dir) -> dict:
    """Run, in a fresh process, the reaper pass that each process of a
    (re)started server runs on its first segment in a directory
    (:meth:`mmshm.segments.table.SegmentTable.maybe_reap`); its
    :class:`mmshm.segments.reaper.ReapReport` as a dict."""
    import json

    code = ("import sys, msgspec; from mmshm.segments.table import TABLE; "
            "print(msgspec.json.encode(TABLE.maybe_reap(sys.argv[1])).decode())")
    e = {k: v for k, v in os.environ.items() if not k.startswith("MMSHM_")}
    p = subprocess.run([sys.executable, "-c", code, str(seg_dir)], capture_output=True,
                       text=True, timeout=120, env=e, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])
