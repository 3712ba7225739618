"""SGLang 0.5.23 encoder disaggregation (EPD) on CPU, plain beside
``mmshm run``: one ``--encoder-only`` instance (TP=1, ``zmq_to_scheduler``)
and one ``--language-only`` instance (TP=2) per pair, the client talking to
the language instance alone (``tests/harness/epd_sglang.py``).

Run by ``python -m tests.run sglang --release 0.5.23 --e2e-only`` in
``.venvs/sglang-0.5.23-server`` with ``MMSHM_E2E=sglang``; skipped anywhere
else.

Two pairs, started side by side once for the module (4 instances, about 25 s
on two cores), each in a private /dev/shm (a tmpfs of the pair: SGLang's own
``sgl_shm_mq_*`` / ``sglang_loads_*`` leftovers of a TP=2 stop stay out of
the host's /dev/shm): ``plain`` and ``mmshm`` (both instances under ``mmshm
run``, mmshm's segment directory that /dev/shm). Both run with SGLang's
default encoder probe (2 s, every 10 s, dropped after 3 misses), so a busy
encoder dropped shows; one 720p request per pair warms the encoders up first
(their first 720p forward takes about 30 s here). The cases share them, in
file order, faults last:

1. greedy answers: the plain pair's equal the mmshm pair's, and a unified
   TP=2 server's (``tests/e2e/test_sglang_e2e.py``'s greedy baseline, the
   same model, photos, prompts and ``max_tokens``, when that file ran
   earlier in the session; no extra server start for it).
2. where each answer's encoder output came from, from the servers' own
   logs and metrics: the language instance's ``Dispatching 1 mm items to 1
   encoder(s)`` per request and no ``No encoder URLs available``; plain:
   ``sglang:encoder_requests_total`` +1 and
   ``sglang:encoder_transfer_seconds_count`` +tp_size (one TCP send per TP
   rank) per request; mmshm: the encoder saved each item once
   (``mmshm_epd_saves_total``, one segment), each TP rank mapped it
   (``mmshm_epd_loads_total`` +tp_size), the language instance wrote no
   pixels (``mmshm_shm_written_bytes_total`` +0).
2b. a burst: 8 concurrent requests (small photos) per pair, every one
   dispatched to the encoder (none encoded locally: the busy encoder was not
   dropped), answers equal on both pairs; mmshm: 8 saves, 16 loads, no
   fallback.
2c. a language instance that cannot open the encoder's segments: the plain
   pair's (not under ``mmshm run``, another mount namespace and /dev/shm),
   pointed at the mmshm pair's encoder through its own encoder registry (no
   start): answers equal to plain's, 0 failed, the encoder counted
   ``unproven`` per send (the handshake: no card) and published nothing.
3. a corrupt image (a PNG cut in half), which the encoder rejects: plain
   0.5.23's language server dies (``TypeError`` in ``output_streamer.
   accept``: the baseline, recorded, not asserted); under mmshm the request
   gets a clean HTTP error, the reason is counted
   (``mmshm_epd_fallbacks_total{reason="encoder_error"}``) and said once,
   and the next request is answered as before. The plain language instance
   is then started again (one more instance start, counted in the figures).
4. the encoder SIGKILLed while requests wait for it: plain's language server
   dies again (baseline); under mmshm every affected request is a clean
   error or an answer equal to the reference, the language instance keeps
   serving, the local encodes once the registry dropped the dead encoder are
   counted (``reason="encoder_dropped"``, SGLang's own ``No encoder URLs
   available`` line per request) and each reason said once at WARNING.
5. after a graceful stop of both language instances and ``mmshm gc`` (what a
   restart runs): no mmshm segment in the mmshm pair's /dev/shm; SGLang's own
   files (``sgl_shm_*``, ``sglang_loads_*``, ``psm_*``), read in each pair's
   private /dev/shm, no more in the mmshm pair's than in the plain pair's;
   none of them new in the host's /dev/shm.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.harness.servers import SGLANG_RELEASE as RELEASE, SGLANG_VERSION as V
from tests.harness.servers import needs_e2e, needs_sglang

pytestmark = [needs_e2e("sglang"), needs_sglang((0, 5, 23), "the EPD pair")]

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".venvs" / "tiny-qwen2-vl"  # models.model_dir("qwen2-vl")
TP = 2
#: test_sglang_e2e.py's greedy cases and max_tokens (its S["plain"]: the
#: unified TP=2 server's answers).
GREEDY = [(0, "Describe the picture."), (1, "Describe the picture."), (0, "What is in it?")]
MAX_TOKENS = 8
POOL_IDLE_S = 2.0
DISPATCH = r"Dispatching 1 mm items to 1 encoder\(s\)"
NO_ENCODER = r"No encoder URLs available for request"
#: mmshm's own log lines at WARNING ("mmshm[<pid>] WARNING <message>")
WARN = r"mmshm\[\d+\] WARNING .*"
#: plain 0.5.23's crash of a failed encode
PLAIN_CRASH = "TypeError: object of type 'NoneType' has no len()"

S: dict = {"starts": {}}  # figures shared by the cases (file order), all printed
#: state shared by the cases that is no figure: readings, the host's /dev/shm before
STATE: dict = {}


def _mmshm_epd() -> str | None:
    """Why the mmshm pair cannot run here (None: it can): mmshm's SGLang
    encoder transport must be in this checkout."""
    try:
        from mmshm.integrations.sglang import epd
    except ImportError as exc:
        return f"mmshm's SGLang integration does not import: {exc}"
    if not all(hasattr(epd, n) for n in ("encoder_send", "extract_embedding",
                                         "process_waiting", "publish_card")):
        return "mmshm's SGLang EPD transport (integrations/sglang/epd.py) is not in this tree"
    return None


NO_MMSHM_EPD = _mmshm_epd()


def _harness():
    from tests.harness import epd_sglang, servers

    return epd_sglang, servers


@pytest.fixture(scope="module")
def pairs(request):
    """The plain pair and (when mmshm's transport is here) the mmshm pair,
    started side by side; every instance killed on every way out, the
    private /dev/shm of each pair unmounted."""
    from tests.harness import models

    epd, servers = _harness()
    models.build(MODEL_DIR)
    logs = Path(os.environ.get("MMSHM_E2E_LOGS") or tempfile.gettempdir())
    logs = Path(tempfile.mkdtemp(prefix=f"sglang-epd-{RELEASE}-", dir=logs))
    STATE["host_shm_before"] = servers.host_shm_files()
    made = {"plain": epd.Pair("plain", MODEL_DIR, V, logs, mmshm=False)}
    if NO_MMSHM_EPD is None:
        made["mmshm"] = epd.Pair("mmshm", MODEL_DIR, V, logs, mmshm=True, extra_env=dict(
            MMSHM_POOL_IDLE_S=f"{POOL_IDLE_S:g}", MMSHM_REAP_INTERVAL_S="60"))
    print(f"\nSGLang {RELEASE} EPD e2e: logs in {logs}", flush=True)
    t0 = time.monotonic()
    try:
        epd.start_pairs(*made.values())
        S["start_pairs_s"] = round(time.monotonic() - t0, 1)
        for name, p in made.items():
            S["starts"][name] = 2
            S.setdefault("startup_s", {})[name] = {
                "encoder": round(p.encoder.startup_s, 1),
                "language": round(p.language.startup_s, 1)}
        t0 = time.monotonic()
        S["warmup"] = servers.in_parallel(*[lambda p=p: _warm_up(p) for p in made.values()])
        S["warmup_s"] = round(time.monotonic() - t0, 1)
        yield {"logs": logs, **made}
    finally:
        for p in made.values():
            p.kill()
        for name, p in made.items():
            S.setdefault("left_in_private_shm", {})[name] = p.files()
            # SGLang's registry dropping the busy encoder (its default probe)
            S.setdefault("encoder_evicted_by_registry", {})[name] = len(re.findall(
                r"Health check evicted", p.language.log_text()))
            p.clean_up()
        S["host_shm_new"] = servers.host_shm_new(STATE["host_shm_before"])
        servers.report_figures(request, f"SGLang {RELEASE} EPD e2e", S, logs)


#: the photo of the warm-up request (none of GREEDY's)
WARMUP_PHOTO = 3


def _warm_up(pair) -> dict:
    """One 720p request, not counted by any case: an encoder's first 720p
    forward on these two cores takes about 30 s (its kernels' first run, the
    other pair's beside it), long enough for the language instance's registry
    (SGLang's defaults: a 2 s probe every 10 s, dropped after 3 misses) to
    drop it, which every case after it would see. Then the encoder listed
    again. Its outcome, whether it was encoded locally, and the seconds."""
    t0 = time.monotonic()
    n0 = len(re.findall(NO_ENCODER, pair.language.log_text()))
    out = _outcome(pair.language, _photo(WARMUP_PHOTO), timeout_s=300)
    pair.wait_encoder_registered(timeout_s=120)
    return {"outcome": out[0], "s": round(time.monotonic() - t0, 1),
            "local": len(re.findall(NO_ENCODER, pair.language.log_text())) - n0}


def _mmshm(pairs):
    if "mmshm" not in pairs:
        pytest.skip(NO_MMSHM_EPD or "no mmshm pair")
    return pairs["mmshm"]


# -- requests and readings ------------------------------------------------------------------
def _ask(srv, photo_url: str, text: str = "Describe the picture.", timeout_s: float = 300):
    """One greedy chat request with one image; its text."""
    r = srv.client(timeout_s=timeout_s).chat.completions.create(
        model="default", max_tokens=MAX_TOKENS, temperature=0.0,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": photo_url}},
            {"type": "text", "text": text}]}])
    assert len(r.choices) == 1 and r.usage.completion_tokens == MAX_TOKENS, r
    return r.choices[0].message.content


def _outcome(srv, photo_url: str, text: str = "Describe the picture.", timeout_s: float = 120):
    """``("answer", text)``, ``("http", status, message)`` for a clean HTTP
    error, or ``("broken", what)`` for a connection that failed."""
    import openai

    def short(exc) -> str:  # the figures keep no base64 image
        return re.sub(r"base64,[A-Za-z0-9+/=]+", "base64,...", str(exc))[:200]

    try:
        return ("answer", _ask(srv, photo_url, text, timeout_s))
    except openai.APIStatusError as exc:
        return ("http", exc.status_code, short(exc))
    except openai.APIError as exc:
        return ("broken", f"{type(exc).__name__}: {short(exc)}")


def _photo(i: int) -> str:
    return _harness()[1].photo_url(i)


def _m(text: str, name: str, **labels) -> float:
    return _harness()[1].metric(text, name, **labels)


class Reading:
    """Both instances' metrics and log lengths of a pair at one moment."""

    def __init__(self, pair):
        self.pair = pair
        self.enc = pair.encoder.metrics_text() if pair.encoder.proc.poll() is None else ""
        self.lang = pair.language.metrics_text()
        self.enc_log = len(pair.encoder.log_text())
        self.lang_log = len(pair.language.log_text())

    def delta(self, later: Reading, side: str, name: str, **labels) -> float:
        a, b = getattr(self, side), getattr(later, side)
        return _m(b, name, **labels) - _m(a, name, **labels)

    def lang_lines(self, pattern: str) -> int:
        return len(re.findall(pattern, self.pair.language.log_text()[self.lang_log:]))


def _unified_reference() -> list[str] | None:
    """The unified TP=2 server's greedy answers of GREEDY, if
    tests/e2e/test_sglang_e2e.py ran earlier in this session."""
    mod = sys.modules.get("tests.e2e.test_sglang_e2e")
    got = getattr(mod, "S", {}).get("plain") if mod is not None else None
    return list(got) if got else None


def _flow(pair) -> dict:
    """GREEDY on ``pair``, one request at a time; the answers and the
    readings before and after."""
    r0 = Reading(pair)
    answers = [_ask(pair.language, _photo(p), t) for p, t in GREEDY]
    r1 = Reading(pair)
    return {"answers": answers, "r0": r0, "r1": r1}


# -- 1. greedy answers ----------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_answers_plain_pair_and_mmshm_pair(pairs):
    _, servers = _harness()
    names = [n for n in ("plain", "mmshm") if n in pairs]
    t0 = time.monotonic()
    flows = servers.in_parallel(*[lambda n=n: _flow(pairs[n]) for n in names])
    S["flow_s"] = round(time.monotonic() - t0, 1)
    for n, f in zip(names, flows):
        STATE[f"flow_{n}"] = f
        S[f"answers_{n}"] = f["answers"]
    # the answers depend on the image (else equal answers prove nothing)
    assert S["answers_plain"][0] != S["answers_plain"][1], S["answers_plain"]
    if "mmshm" in pairs:
        assert S["answers_mmshm"] == S["answers_plain"]
    else:
        pytest.skip(f"plain pair only: {NO_MMSHM_EPD}")


def test_answers_equal_a_unified_servers():
    """The plain pair's greedy answers equal a unified TP=2 server's (same
    model, photos, prompts, max_tokens; test_sglang_e2e.py's baseline)."""
    want = _unified_reference()
    if want is None:
        pytest.skip("the unified server's answers come from tests/e2e/test_sglang_e2e.py's "
                    "first phase, which did not run earlier in this session")
    if "answers_plain" not in S:
        pytest.skip("the pairs answered nothing")
    S["answers_unified"] = want
    assert S["answers_plain"] == want


# -- 2. where the encoder outputs came from ---------------------------------------------------
def _flow_of(name: str) -> dict:
    f = STATE.get(f"flow_{name}")
    if f is None:
        pytest.skip(f"the {name} pair's greedy flow did not run")
    return f


def _where(r0) -> tuple[int, int]:
    """(requests dispatched to the encoder, requests encoded by the language
    instance because its registry had dropped the encoder: SGLang's default
    probe, 2 s, misses an encoder whose 720p forward holds its dispatch lock
    for 20-35 s on these loaded cores; plain and mmshm alike) since ``r0``."""
    return r0.lang_lines(DISPATCH), r0.lang_lines(NO_ENCODER)


def test_plain_each_request_encoded_by_the_encoder():
    """Per request: one dispatch to the encoder in the language log, or
    (encoder dropped) SGLang's ``No encoder URLs available`` line; per
    dispatched request ``sglang:encoder_requests_total`` +1 and
    ``sglang:encoder_transfer_seconds_count`` +tp_size (one TCP send of the
    embedding per TP rank) on the encoder."""
    f = _flow_of("plain")
    r0, r1, n = f["r0"], f["r1"], len(GREEDY)
    reqs = r0.delta(r1, "enc", "sglang:encoder_requests_total", status="success")
    sends = r0.delta(r1, "enc", "sglang:encoder_transfer_seconds_count",
                     backend="zmq_to_scheduler")
    dispatched, local = _where(r0)
    S["plain_per_request"] = {"dispatched": dispatched, "encoded_locally": local,
                              "tcp_sends": sends / max(dispatched, 1)}
    assert dispatched + local == n and dispatched >= 1, S["plain_per_request"]
    assert reqs == dispatched and sends == TP * dispatched, S["plain_per_request"]


def test_mmshm_each_item_written_once_and_mapped_by_every_rank():
    """Under mmshm, per request: one dispatch, no local encode; the encoder
    wrote the embedding once into one segment (``mmshm_epd_saves_total``
    +1, ``mmshm_segments_created_total`` +1) and sent no tensor over TCP's
    way to the ranks; each TP rank mapped it (``mmshm_epd_loads_total``
    +tp_size, the bytes loaded tp_size times the bytes saved: the same
    segment); the language instance wrote no pixels and made no segment. A
    request encoded by the language instance because its registry had dropped
    the encoder (SGLang's own line) is counted ``encoder_dropped``, and the
    per-request figures are per dispatched request."""
    f = _flow_of("mmshm")
    r0, r1 = f["r0"], f["r1"]
    n, local = _where(r0)
    assert n + local == len(GREEDY) and n >= 1, (n, local)

    def d(side, name, **lab):
        return r0.delta(r1, side, name, **lab)

    saved = d("enc", "mmshm_epd_bytes_total", server="sglang", direction="saved")
    loaded = d("lang", "mmshm_epd_bytes_total", server="sglang", direction="loaded")
    fig = {
        "encoder_requests": d("enc", "sglang:encoder_requests_total", status="success") / n,
        "encoder_saves": d("enc", "mmshm_epd_saves_total", server="sglang") / n,
        "encoder_segments_made": d("enc", "mmshm_segments_created_total") / n,
        "encoder_pool_hits": d("enc", "mmshm_pool_requests_total", result="hit") / n,
        "encoder_bytes_written": d("enc", "mmshm_shm_written_bytes_total") / n,
        "encoder_epd_bytes_saved": saved / n,
        "language_loads": d("lang", "mmshm_epd_loads_total", server="sglang") / n,
        "language_epd_bytes_loaded": loaded / n,
        "language_bytes_written": d("lang", "mmshm_shm_written_bytes_total") / n,
        "language_segments_made": d("lang", "mmshm_segments_created_total") / n,
        "language_epd_saves": d("lang", "mmshm_epd_saves_total", server="sglang") / n,
        "fallbacks": d("lang", "mmshm_epd_fallbacks_total", server="sglang")
        + d("enc", "mmshm_epd_fallbacks_total", server="sglang"),
        "encoded_locally": local,
        "encoder_dropped": d("lang", "mmshm_epd_fallbacks_total", server="sglang",
                             reason="encoder_dropped"),
    }
    S["mmshm_per_request"] = fig
    assert fig["encoder_dropped"] == local and fig["fallbacks"] == local, fig
    assert fig["encoder_requests"] == 1 and fig["encoder_saves"] == 1, fig
    # one segment per item: a new one, or a warm one of the pool (best fit reuses
    # an idle segment of another size; the store may also reuse its own pooled
    # segment of the key without a pool lookup), never two
    assert 0 < fig["encoder_segments_made"] + fig["encoder_pool_hits"] <= 1, fig
    assert saved > 0, fig
    assert fig["language_loads"] == TP, fig  # every rank mapped it
    assert loaded == pytest.approx(TP * saved), fig  # the same bytes, on each rank
    # the language instance wrote no pixels for the items the encoder served
    # (a local encode sends its pixels through mmshm's own transport)
    if not local:
        assert fig["language_bytes_written"] == 0 and fig["language_segments_made"] == 0, fig
    assert fig["language_epd_saves"] == 0, fig
    # plain's TCP path for the same embeddings: tp_size sends of every byte,
    # each copied on its rank (the embedding's size from the encoder's save)
    plain = S.get("plain_per_request")
    if plain is not None:
        S["plain_tcp_bytes_per_request"] = plain["tcp_sends"] * saved / n


def test_every_instance_says_what_it_turned_on(pairs):
    """The encoder and each language TP rank print mmshm's "on:" line with
    the EPD path."""
    pair = _mmshm(pairs)
    from mmshm.integrations.sglang import epd

    enc, lang = pair.encoder.log_text(), pair.language.log_text()
    assert re.search(rf"sglang {re.escape(RELEASE)}, encoder \(pid \d+\): on: .*"
                     rf"{re.escape(epd.PATH_EPD_SEND[:40])}", enc), enc[-3000:]
    recv = re.findall(rf"\(pid \d+\): on: .*{re.escape(epd.PATH_EPD_RECV[:40])}", lang)
    assert len(recv) == TP, lang[-3000:]
    assert " is OFF: " not in enc + lang


# -- 2b. a burst --------------------------------------------------------------------------------
#: concurrent requests of the burst, each with one small photo (the tiny encoder
#: takes seconds per 720p photo on CPU)
BURST = 8
SMALL = (224, 224)
SMALL_PHOTOS: dict[int, str] = {}


def _small_photo(i: int) -> str:
    if i not in SMALL_PHOTOS:
        from mmshm.bench.photos import _load_rgb, available_photos

        names = available_photos()
        SMALL_PHOTOS[i] = _harness()[1].data_url(_load_rgb(names[i % len(names)], SMALL))
    return SMALL_PHOTOS[i]


def _burst(pair) -> dict:
    """:data:`BURST` requests at once, photos 0, 1, 2, 3, 0, 1, 2, 3: their
    outcomes and the readings before and after."""
    r0 = Reading(pair)
    out: dict = {}
    threads = [threading.Thread(target=lambda k=k: out.__setitem__(
        k, _outcome(pair.language, _small_photo(k % 4))), daemon=True) for k in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(400)
    return {"outcomes": [out.get(k, ("no outcome",)) for k in range(BURST)], "r0": r0,
            "r1": Reading(pair)}


@pytest.mark.timeout(900)
def test_burst_keeps_the_encoder_registered(pairs):
    """:data:`BURST` concurrent requests on each pair, SGLang's default probe
    timeout (2 s): every request answered, equal on both pairs (and equal for
    equal photos), every one encoded by the encoder (no ``No encoder URLs
    available``: the busy encoder was not dropped), under mmshm one save per
    request and ``tp_size`` loads, no fallback. The plain pair's dispatches
    are recorded, not asserted: on a loaded 2-core host plain SGLang's own
    2 s probe can drop its busy encoder (seen once: all 8 encoded by the
    language instance itself, answers still right), which says nothing of
    mmshm; the mmshm pair must keep its encoder whatever plain does."""
    _, servers = _harness()
    names = [n for n in ("plain", "mmshm") if n in pairs]
    runs = dict(zip(names, servers.in_parallel(*[lambda n=n: _burst(pairs[n])
                                                 for n in names])))
    fig = {}
    for n, r in runs.items():
        fig[n] = {"outcomes": r["outcomes"], "local_encodes": r["r0"].lang_lines(NO_ENCODER),
                  "dispatched": r["r0"].lang_lines(DISPATCH)}
    S["burst"] = fig
    for n in names:
        assert all(o[0] == "answer" for o in runs[n]["outcomes"]), (n, fig[n])
    if "mmshm" in fig:
        assert fig["mmshm"]["local_encodes"] == 0 and fig["mmshm"]["dispatched"] == BURST, fig
    got = runs["plain"]["outcomes"]
    assert got[:4] == got[4:], got  # one photo, one answer
    if "mmshm" not in pairs:
        pytest.skip(NO_MMSHM_EPD)
    r = runs["mmshm"]
    assert r["outcomes"] == got, (got, r["outcomes"])

    def d(side, name, **lab):
        return r["r0"].delta(r["r1"], side, name, server="sglang", **lab)

    fig["mmshm"].update(saves=d("enc", "mmshm_epd_saves_total"),
                        loads=d("lang", "mmshm_epd_loads_total"),
                        fallbacks=d("lang", "mmshm_epd_fallbacks_total")
                        + d("enc", "mmshm_epd_fallbacks_total"))
    assert fig["mmshm"]["saves"] == BURST and fig["mmshm"]["loads"] == TP * BURST, fig
    assert fig["mmshm"]["fallbacks"] == 0, fig


# -- 2c. a language instance that cannot open the encoder's segments ----------------------------
def _bootstrap(pair, method: str, path: str, url: str | None = None):
    """One call to ``pair``'s language instance's encoder registry
    (SGLang's ``EncoderBootstrapServer``)."""
    import json
    import urllib.request

    data = json.dumps({"url": url}).encode() if url is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{pair.bootstrap_port}{path}", data=data,
                                 method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read()) if method == "GET" else r.read()


def _point_language_at(pair, encoder_url: str, instead_of: str) -> None:
    """``pair``'s language instance asks ``encoder_url`` alone from now on."""
    _bootstrap(pair, "POST", "/register_encoder_url", encoder_url)
    _bootstrap(pair, "DELETE", "/unregister_encoder_url", instead_of)
    urls = _bootstrap(pair, "GET", "/list_encoder_urls")["encoder_urls"]
    assert urls == [encoder_url], urls


@pytest.mark.timeout(600)
def test_a_language_instance_that_cannot_open_the_segments(pairs):
    """The plain pair's language instance (not under ``mmshm run``, in
    another mount namespace with its own /dev/shm) is pointed at the mmshm
    pair's encoder, through its own encoder registry (no start): it cannot
    open the encoder's segments and published no card, so the encoder sends
    it SGLang's own bytes. The burst's four small photos: answers equal the
    plain pair's, 0 failed requests; the encoder counted ``unproven`` once
    per send (``tp_size`` per dispatched request), published nothing for
    them, and said it once at WARNING.
    Then the plain language instance gets its own encoder back. (Without the
    handshake the encoder sends it handles, which plain SGLang cannot read:
    every request fails.)"""
    if "mmshm" not in pairs:
        pytest.skip(NO_MMSHM_EPD)
    want = [o[1] for o in S.get("burst", {}).get("plain", {}).get("outcomes", [])[:4]
            if o[0] == "answer"]
    if len(want) != 4:
        pytest.skip("the plain pair's burst gave no reference answers")
    plain, pair = pairs["plain"], pairs["mmshm"]
    r0, p0 = Reading(pair), Reading(plain)
    enc_log = len(pair.encoder.log_text())
    _point_language_at(plain, pair.encoder_url(), plain.encoder_url())
    try:
        outs = [_outcome(plain.language, _small_photo(i)) for i in range(4)]
    finally:
        _point_language_at(plain, plain.encoder_url(), pair.encoder_url())
    r1 = Reading(pair)
    dispatched, local = _where(p0)

    def d(name, **lab):
        return r0.delta(r1, "enc", name, server="sglang", **lab)

    fig = {"outcomes": outs, "unproven": d("mmshm_epd_fallbacks_total", reason="unproven"),
           "saves": d("mmshm_epd_saves_total"),
           "encoder_requests": r0.delta(r1, "enc", "sglang:encoder_requests_total",
                                        status="success"),
           "warnings": len(re.findall(WARN + r".*reason=unproven",
                                      pair.encoder.log_text()[enc_log:])),
           "dispatched": dispatched, "encoded_locally": local}
    S["unproven_language"] = fig
    assert [o[1] if o[0] == "answer" else o for o in outs] == want, fig
    assert dispatched + local == 4 and dispatched >= 1, fig
    assert fig["encoder_requests"] == dispatched, fig  # the mmshm encoder encoded them
    assert fig["unproven"] == TP * dispatched and fig["saves"] == 0, fig
    assert fig["warnings"] <= 1, fig  # said once per process (maybe earlier)
    assert plain.language.proc.poll() is None


# -- 3. a corrupt image ------------------------------------------------------------------------
def _dies(srv, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.timeout(600)
def test_corrupt_image(pairs):
    """A PNG cut in half, which the encoder rejects. Plain: the outcome and
    whether the language server died (the baseline: it dies, TypeError in
    output_streamer.accept), then its language instance is started again.
    mmshm: a clean HTTP error, the language instance alive, the reason
    counted and said once, the next request answered as before."""
    from tests.harness import faults

    epd, servers = _harness()
    bad = faults._truncated_png(_photo(0))
    ref = S.get("answers_plain", [None])[0]
    names = [n for n in ("plain", "mmshm") if n in pairs]
    readings = {n: Reading(pairs[n]) for n in names}
    outs = dict(zip(names, servers.in_parallel(
        *[lambda n=n: _outcome(pairs[n].language, bad) for n in names])))
    # plain: the baseline
    plain = pairs["plain"]
    died = _dies(plain.language)
    log = plain.language.log_text()[readings["plain"].lang_log:]
    S["corrupt_image_plain"] = {"outcome": outs["plain"], "language_died": died,
                                "TypeError": PLAIN_CRASH in log}
    if died:  # start it again for the encoder-kill case: one more instance start, waited
        # for there (_plain_encoder_killed), while the mmshm pair runs its cases
        plain.language.kill()
        plain.language.launch()
        STATE["plain_language_restarting"] = True
        S["starts"]["plain"] += 1
    if "mmshm" not in pairs:
        pytest.skip(NO_MMSHM_EPD)
    pair = pairs["mmshm"]
    out = outs["mmshm"]
    after = _outcome(pair.language, _photo(GREEDY[0][0]), GREEDY[0][1])
    r1 = Reading(pair)
    r0 = readings["mmshm"]
    fb = r0.delta(r1, "lang", "mmshm_epd_fallbacks_total", server="sglang",
                  reason="encoder_error")
    # said once per process: in the whole log (a scheduler's line)
    warned = len(re.findall(WARN + r"the encoder rejected a request's multimodal input",
                            pair.language.log_text()))
    S["corrupt_image_mmshm"] = {"outcome": out, "next": after, "fallbacks_encoder_error": fb,
                                "warnings": warned}
    assert out[0] == "http" and 400 <= out[1] < 600, out
    assert pair.language.proc.poll() is None, pair.language.log_tail()
    assert PLAIN_CRASH not in pair.language.log_text()
    assert after == ("answer", ref), after
    assert fb == 1 and warned == 1, S["corrupt_image_mmshm"]


# -- 4. the encoder SIGKILLed while requests wait for it ----------------------------------------
def _kill_encoder_mid_burst(pair, photos=(0, 1, 0)) -> dict:
    """Send one greedy request per photo at once, SIGKILL the encoder's
    process group once the language instance has dispatched all of them
    (they wait for their encoder outputs), and collect their outcomes."""
    out: dict = {}
    r0 = Reading(pair)
    photos = list(enumerate(photos))
    n0 = len(re.findall(DISPATCH, pair.language.log_text()))
    threads = [threading.Thread(target=lambda k=k, i=i: out.__setitem__(
        k, _outcome(pair.language, _photo(i))), daemon=True) for k, i in photos]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and \
            len(re.findall(DISPATCH, pair.language.log_text())) < n0 + len(photos):
        time.sleep(0.02)
    waiting = len(photos) - len(out)
    os.killpg(pair.encoder.proc.pid, signal.SIGKILL)
    pair.encoder.kill()
    for t in threads:
        t.join(180)
    return {"r0": r0, "photos": [i for _, i in photos],
            "outcomes": [out.get(k, ("no outcome",)) for k, _ in photos],
            "waiting_at_kill": waiting,
            "dispatched": len(re.findall(DISPATCH, pair.language.log_text())) - n0}


def _plain_encoder_killed(pair) -> dict:
    """The plain pair's encoder-kill case, once its language instance, started
    again after the corrupt image (:func:`test_corrupt_image`), is ready and
    lists the encoder."""
    if STATE.pop("plain_language_restarting", False):
        pair.language.wait_ready()
        pair.wait_encoder_registered()
        S["startup_s"]["plain"]["language_again"] = round(pair.language.startup_s, 1)
    return _kill_encoder_mid_burst(pair)


@pytest.mark.timeout(900)
def test_encoder_killed_while_requests_wait(pairs):
    """Plain: the outcomes and whether the language server died (the
    baseline). mmshm: each affected request a clean HTTP error or an answer
    equal to the reference; the language instance keeps serving: normal
    requests sent until one is answered (the registry drops the dead encoder
    after 3 probes, 10 s apart), each a clean error or the reference answer,
    the answered ones encoded locally (SGLang's own ``No encoder URLs
    available`` line each) and counted (``reason="encoder_dropped"``); the
    failed ones counted (``encoder_gone``); each reason said once."""
    from concurrent.futures import ThreadPoolExecutor

    # the reference answers of photos 0 and 1 ("Describe the picture.")
    want = dict(zip((0, 1), S.get("answers_plain", [None, None])[:2]))
    follow: list = []

    def mmshm_case() -> dict:
        """The mmshm pair's burst and encoder kill, then normal requests until
        one is answered (the local encode), each a clean error or the
        reference answer: the language instance keeps serving."""
        run = _kill_encoder_mid_burst(pairs["mmshm"])
        if run["waiting_at_kill"] < 1:
            return run  # asserted below
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            o = _outcome(pairs["mmshm"].language, _photo(0))
            follow.append(o)
            if o[0] != "http":  # the answer (or what the assertion below names)
                break
            time.sleep(3)
        return run

    # the plain pair's case (its language instance's restart first) beside the
    # mmshm pair's, whose follow-up requests mostly wait for SGLang's registry
    with ThreadPoolExecutor(1) as ex:
        plain_run = ex.submit(_plain_encoder_killed, pairs["plain"])
        try:
            runs = {"mmshm": mmshm_case()} if "mmshm" in pairs else {}
        finally:
            runs["plain"] = plain_run.result()
    plain = pairs["plain"]
    died = _dies(plain.language)
    r = runs["plain"]
    S["encoder_killed_plain"] = {
        "outcomes": r["outcomes"], "waiting_at_kill": r["waiting_at_kill"],
        "language_died": died,
        "TypeError": PLAIN_CRASH in plain.language.log_text()[r["r0"].lang_log:]}
    if "mmshm" not in pairs:
        pytest.skip(NO_MMSHM_EPD)
    pair = pairs["mmshm"]
    run = runs["mmshm"]
    assert run["waiting_at_kill"] >= 1, run  # at least one was waiting for the encoder
    for i, o in zip(run["photos"], run["outcomes"]):
        assert o[0] == "http" or o == ("answer", want[i]), (i, o, want)
    for o in follow:
        assert o[0] == "http" or o == ("answer", want[0]), follow
    r1 = Reading(pair)
    r0 = run["r0"]
    answered = sum(o[0] == "answer" for o in run["outcomes"] + follow)
    failed = sum(o[0] == "http" for o in run["outcomes"] + follow)

    def fb(reason):
        return r0.delta(r1, "lang", "mmshm_epd_fallbacks_total", server="sglang",
                        reason=reason)

    local = r0.lang_lines(NO_ENCODER)
    S["encoder_killed_mmshm"] = {
        "outcomes": run["outcomes"], "waiting_at_kill": run["waiting_at_kill"],
        "following": len(follow), "following_last": follow[-1] if follow else None,
        "answered": answered, "failed": failed,
        "local_encodes": local, "fallbacks_encoder_gone": fb("encoder_gone"),
        "fallbacks_encoder_dropped": fb("encoder_dropped"),
        # said once per process: in the whole log (a drop before this case said it)
        "warnings_gone": len(re.findall(WARN + r"the encoder did not deliver",
                                        pair.language.log_text())),
        "warnings_dropped": len(re.findall(WARN + r"no encoder is registered",
                                           pair.language.log_text()))}
    k = S["encoder_killed_mmshm"]
    assert follow and follow[-1][0] == "answer", follow
    assert pair.language.proc.poll() is None
    assert PLAIN_CRASH not in pair.language.log_text()
    # where each answer came from: the encoder is dead, so a local encode,
    # which SGLang's tokenizer says per request and mmshm counts
    assert local >= 1 and k["fallbacks_encoder_dropped"] == local, k
    assert k["fallbacks_encoder_gone"] == failed, k
    assert k["warnings_dropped"] == 1 and k["warnings_gone"] == (1 if failed else 0), k


# -- 5. nothing left ----------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_nothing_left_after_the_stop(pairs):
    """The mmshm pair's language instance stopped gracefully, then ``mmshm
    gc`` (what a restart runs: it reclaims the SIGKILLed encoder's
    segments): no mmshm segment in the pair's /dev/shm."""
    pair = _mmshm(pairs)
    from tests.harness import faults

    # segments of the SIGKILLed encoder that the language instance's own
    # reaper (mmshm run's, every MMSHM_REAP_INTERVAL_S) reclaimed by now
    S["reaped_by_the_language_instance"] = _m(pair.language.metrics_text(),
                                               "mmshm_reaped_segments_total")
    plain = pairs["plain"]
    _, servers = _harness()
    servers.in_parallel(lambda: pair.language.stop(signal.SIGTERM, timeout_s=90),
                        lambda: plain.language.stop(signal.SIGTERM, timeout_s=90))
    S["left_before_gc"] = pair.files(("mmshm-*",))
    done = faults.Mmshm(pair.shm)._json("gc")
    S["reclaimed_by_gc"] = done.get("reclaimed")
    S["left_after_gc"] = pair.files(("mmshm-*",))
    # SGLang's own files live in each pair's private /dev/shm (never the host's):
    # read there, mmshm's pair may leave no more of them than the plain pair
    own = ("sgl_shm_*", "sglang_loads_*", "psm_*")
    S["sglang_own_left"] = {n: pairs[n].files(own) for n in ("plain", "mmshm")}
    assert S["left_after_gc"] == [], S
    for prefix in ("sgl_shm_", "sglang_loads_", "psm_"):
        mine, base = ([f for f in S["sglang_own_left"][n] if f.startswith(prefix)]
                      for n in ("mmshm", "plain"))
        assert len(mine) <= len(base), (prefix, S["sglang_own_left"])
    # every instance ran in a private /dev/shm: none of SGLang's files new in the
    # host's (mmshm's of the pairs are in theirs, checked above; other processes
    # of a shared host make mmshm segments in the host's /dev/shm)
    assert servers.host_shm_new(STATE["host_shm_before"], own) == []
