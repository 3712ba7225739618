"""vLLM encoder disaggregation (EPD) for the real-server e2e tests: an encoder
instance and a PD instance, and the minimal proxy between them.

vLLM 0.32 starts an **encoder-only** instance from its EC transfer config
alone: ``--ec-transfer-config`` with ``ec_role`` ``ec_producer`` makes
``VllmConfig._resolve_mm_encoder_only`` set ``mm_encoder_only`` (no language
model, no KV cache; prefix caching off). The **PD** instance is a whole
server with ``ec_role`` ``ec_consumer``: its scheduler asks the connector's
``has_cache_item(identifier)`` for each item and loads what it has
(``start_load_caches``) instead of running the vision encoder; an item the
connector does not have is encoded locally.

The item's identifier is vLLM's ``mm_hash``: a content hash with the
processor cache or prefix caching on, else (as the e2e harness starts vLLM:
``--mm-processor-cache-gb 0 --no-enable-prefix-caching``) the renderer's
counter name ``renderer<rank>-mm-<n>-<modality>-<i>`` (vllm/renderers/
base.py ``_process_mm_uuids``), or the request's own ``uuid`` for the item
when it gives one. The counter advances once per multimodal request,
uuids or not.

vLLM's own proxy (``disagg_epd_proxy.py``) is not in the wheel; :func:`proxy`
is the minimal one: the request to the encoder first with ``max_tokens=1``,
then the original request to PD. An encoder request that fails (the encoder
is gone) is recorded and the request still goes to PD, which then encodes
the item itself if its connector has nothing for it.

Proof of where an item's encoder output came from is read from the servers'
own logs: with ``--enable-logging-iteration-details`` an engine logs
``encoder inputs: N`` for each step in which it runs its vision encoder on
N items, and not for items its connector loaded (:func:`encoder_inputs`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
from pathlib import Path

from tests.harness.servers import Server, free_port, vllm_argv_720p, vllm_env

#: The text of every request.
PROMPT = "Describe the picture."
MAX_TOKENS = 6
#: An engine step that ran the vision encoder (vllm/v1/metrics/loggers.py
#: ``_log_iteration_details``).
ENCODER_INPUTS = re.compile(r"encoder inputs: (\d+)")
#: ECExampleConnector's DEBUG line for each item it loaded.
EXAMPLE_LOAD = re.compile(r"Success load encoder cache for hash (\S+)")


def ec_config(role: str, connector: str = "ECExampleConnector", module: str | None = None,
              **extra) -> str:
    """``--ec-transfer-config`` JSON: ``role`` is ``ec_producer`` (an
    encoder-only instance), ``ec_consumer`` (PD) or ``ec_both``; ``extra``
    is the connector's ``ec_connector_extra_config`` (ECExampleConnector:
    ``shared_storage_path``, the directory of its files)."""
    cfg = {"ec_connector": connector, "ec_role": role, "ec_connector_extra_config": extra}
    if module:
        cfg["ec_connector_module_path"] = module
    return json.dumps(cfg)


@dataclasses.dataclass
class Pair:
    """One encoder instance (``E``) and one PD instance (``PD``)."""

    name: str
    E: Server
    PD: Server

    def servers(self) -> tuple[Server, Server]:
        return self.E, self.PD


def make_pair(name: str, model: str, logs: Path, ec_producer: str, ec_consumer: str,
              mmshm_run: bool = False, env_e: dict | None = None, env_pd: dict | None = None,
              prefix: list[str] | None = None, extra_argv: list[str] = (),
              leaks: tuple[str, ...] = ("vllm_dist_", "psm_"),
              ready_timeout_s: float = 600) -> Pair:
    """An encoder and a PD server (not started: :func:`tests.harness.servers.
    start_all`), each with one core for its engine (the encoder's on CPU 0,
    PD's on CPU 1), iteration details logged, the harness's vLLM flags
    (:func:`vllm_argv`: processor cache and prefix caching off, so items
    are named by the renderer's counter unless the request gives a uuid).
    ``ec_producer`` / ``ec_consumer``: their ``--ec-transfer-config``
    (:func:`ec_config`); ``env_*``: extra environment of each."""
    return Pair(name, *[
        make_server(f"{name}-{role}", model, logs, cfg, core, mmshm_run=mmshm_run, env=env,
                    prefix=prefix, extra_argv=extra_argv, leaks=leaks,
                    ready_timeout_s=ready_timeout_s)
        for role, cfg, core, env in (("E", ec_producer, "0", env_e),
                                     ("PD", ec_consumer, "1", env_pd))])


def make_server(name: str, model: str, logs: Path, ec_transfer_config: str, core: str,
                mmshm_run: bool = False, env: dict | None = None,
                prefix: list[str] | None = None, extra_argv: list[str] = (),
                leaks: tuple[str, ...] = ("vllm_dist_", "psm_"),
                ready_timeout_s: float = 600) -> Server:
    """One EPD instance (not started), TP=1, its engine on CPU ``core``,
    iteration details logged, the harness's vLLM flags; its log is
    ``logs/epd-<name>.log``. ``ec_transfer_config``: its
    ``--ec-transfer-config`` (:func:`ec_config`); ``prefix``: words before
    its command (a mount namespace's ``nsenter``); ``env``: extra
    environment."""
    port = free_port()
    # The start-up's dummy image at 720p, the largest these tests send: an EC
    # producer encodes one dummy item at start (vLLM's encoder output widths),
    # by default the model's largest image (about 16k tokens on Qwen2-VL),
    # which kept each encoder instance about 140 s in that one forward here
    argv = vllm_argv_720p(model, port, 1, images=2) + [
        "--ec-transfer-config", ec_transfer_config, "--enable-logging-iteration-details",
        *extra_argv]
    return Server(argv, port, logs / f"epd-{name}.log",
                  env=vllm_env(1, VLLM_CPU_OMP_THREADS_BIND=core, **(env or {})),
                  mmshm_run=mmshm_run, prefix=prefix, leaks=leaks,
                  ready_timeout_s=ready_timeout_s)


def content(urls: list[str], uuids: list[str] | None = None, text: str = PROMPT) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u},
              **({"uuid": uuids[i]} if uuids and uuids[i] else {})} for i, u in enumerate(urls)]
    return parts + [{"type": "text", "text": text}]


def chat(srv: Server, urls: list[str], uuids: list[str] | None = None,
         max_tokens: int = MAX_TOKENS, timeout_s: float = 120) -> dict:
    """One greedy chat completion. Returns ``{"tokens", "logprobs",
    "prompt_tokens"}``, or ``{"error": "<type>: <message>", "status": HTTP
    status or None}`` when it failed (a refused request, a dead server)."""
    try:
        r = srv.client(timeout_s=timeout_s).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content(urls, uuids)}],
            max_tokens=max_tokens, temperature=0.0, logprobs=True)
    except Exception as exc:  # noqa: BLE001 - recorded: the tests say what it must be
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}",
                "status": getattr(exc, "status_code", None)}
    c = r.choices[0]
    toks = c.logprobs.content if c.logprobs is not None else []
    return {"tokens": [t.token for t in toks], "logprobs": [t.logprob for t in toks],
            "prompt_tokens": r.usage.prompt_tokens}


def proxy(pair: Pair, urls: list[str], uuids: list[str] | None = None,
          enc_uuids: list[str] | None = None, on_encoded=None) -> dict:
    """The minimal EPD proxy: the request to the encoder with
    ``max_tokens=1`` (its answer is dropped), then the same request to PD.
    ``enc_uuids``: other uuids for the encoder's request (default
    ``uuids``); ``on_encoded``: called once the encoder answered (or
    failed). Returns PD's :func:`chat` record with the encoder's outcome
    under ``"encoder"`` (``"ok"`` or its error)."""
    enc = chat(pair.E, urls, enc_uuids if enc_uuids is not None else uuids, max_tokens=1)
    if on_encoded is not None:
        on_encoded(enc)
    out = chat(pair.PD, urls, uuids)
    out["encoder"] = enc.get("error", "ok")
    return out


class LogMark:
    """A point in a server's log: :meth:`since` is the text written after it."""

    def __init__(self, srv: Server):
        self.srv = srv
        self.offset = _size(srv.log_path)

    def since(self) -> str:
        with open(self.srv.log_path, "rb") as f:
            f.seek(self.offset)
            return f.read().decode(errors="replace")


def _size(p: Path) -> int:
    try:
        return os.path.getsize(p)
    except OSError:
        return 0


def encoder_inputs(log: str) -> int:
    """Items the engine ran its vision encoder on in ``log`` (the sum of the
    ``encoder inputs: N`` of its iteration details)."""
    return sum(int(n) for n in ENCODER_INPUTS.findall(log))


def burst_with_kill(pair: Pair, flows: list[tuple[list[str], list[str] | None]], victim: Server,
                    after: int = 1, late: int = 1) -> tuple[list[dict], dict]:
    """A burst through :func:`proxy` with the ``victim``'s whole process
    group SIGKILLed in the middle (its processes, ``mmshm run`` included,
    die at once, as in an OOM kill): all ``flows`` (urls, uuids) but the
    last ``late`` start at once, each in a thread of its own; as soon as
    ``after`` encoder requests have answered, the group is killed (the
    others are in flight or answered, as the encoder batched them); then
    the ``late`` flows start, and find the encoder gone. Returns each
    flow's record (in order) and ``{"killed_at_s": seconds from the start,
    "encoder_answers_at_kill"}``."""
    return burst_with_kill_to(pair.E, lambda i, rank, enc: pair.PD, flows, victim,
                              after=after, late=late)


def burst_with_kill_to(encoder: Server, route, flows: list[tuple[list[str], list[str] | None]],
                       victim: Server, after: int = 1,
                       late: int = 1) -> tuple[list[dict], dict]:
    """:func:`burst_with_kill` through a proxy that picks each flow's PD
    instance once its encoder request is over: ``route(i, rank, enc)``
    returns the server flow ``i``'s request goes to, ``rank`` being the
    order in which its encoder request ended (0: the first; the kill
    follows the ``after``-th answer) and ``enc`` the encoder's
    :func:`chat` record. The same order, kill and records (each with
    ``"encoder"``) as :func:`burst_with_kill`."""
    done = threading.Semaphore(0)
    answered, ended = [0], [0]
    lock = threading.Lock()
    records: list[dict | None] = [None] * len(flows)
    info: dict = {}
    t0 = time.monotonic()

    def run(i: int, urls, uuids):
        enc = chat(encoder, urls, uuids, max_tokens=1)
        with lock:
            answered[0] += "error" not in enc
            rank, ended[0] = ended[0], ended[0] + 1
        done.release()
        out = chat(route(i, rank, enc), urls, uuids)
        out["encoder"] = enc.get("error", "ok")
        records[i] = out

    def start(i: int) -> threading.Thread:
        t = threading.Thread(target=run, args=(i, *flows[i]), daemon=True)
        t.start()
        return t

    threads = [start(i) for i in range(len(flows) - late)]
    for _ in range(after):
        done.acquire(timeout=120)
    with lock:
        info["encoder_answers_at_kill"] = answered[0]
    kill_group(victim)
    info["killed_at_s"] = round(time.monotonic() - t0, 2)
    threads += [start(i) for i in range(len(flows) - late, len(flows))]
    for t in threads:
        t.join(timeout=300)
    return [r if r is not None else {"error": "no answer (thread still running)", "status": None}
            for r in records], info


def burst_then_kill(srv: Server, early: list[str], late: list[str], kill, after: int = 1,
                    timeout_s: float = 300) -> tuple[list[dict], dict]:
    """Requests of one photo each straight to ``srv`` (:func:`chat`): the
    ``early`` ones at once, each in a thread of its own; as soon as
    ``after`` of them have answered, ``kill()`` (e.g. SIGKILL a service
    ``srv`` depends on); then the ``late`` ones at once. Returns each
    request's record (``early`` then ``late``, in order) and
    ``{"killed_at_s": seconds from the start, "answers_at_kill"}``."""
    urls = list(early) + list(late)
    records: list[dict | None] = [None] * len(urls)
    done = threading.Semaphore(0)
    t0 = time.monotonic()

    def run(i: int) -> None:
        try:
            records[i] = chat(srv, [urls[i]])
        finally:
            done.release()

    def start(i: int) -> threading.Thread:
        t = threading.Thread(target=run, args=(i,), daemon=True)
        t.start()
        return t

    threads = [start(i) for i in range(len(early))]
    for _ in range(min(after, len(early))):
        done.acquire(timeout=timeout_s)
    info = {"answers_at_kill": sum(r is not None for r in records)}
    kill()
    info["killed_at_s"] = round(time.monotonic() - t0, 2)
    threads += [start(i) for i in range(len(early), len(urls))]
    for t in threads:
        t.join(timeout=timeout_s)
    return [r if r is not None else {"error": "no answer (thread still running)", "status": None}
            for r in records], info


def kill_group(srv: Server) -> None:
    """SIGKILL ``srv``'s whole process group now, without its normal stop,
    and wait for every process of it to be gone (:meth:`Server.kill`)."""
    srv.kill()


def kill_while_decoding(srv: Server, urls: list[str], uuids: list[str] | None = None,
                        max_tokens: int = 400) -> dict:
    """Start a long greedy streamed request on ``srv`` and, once its first
    token has come (the engine holds the request's items: a loaded encoder
    output among them), SIGKILL the server's whole process group. Returns
    ``{"first_token": bool, "metrics": srv's /metrics text read just before
    the kill (None if it did not answer)}``."""
    stream = srv.client(timeout_s=120).chat.completions.create(
        model="tiny", stream=True, temperature=0.0, max_tokens=max_tokens,
        messages=[{"role": "user", "content": content(urls, uuids)}],
        extra_body={"ignore_eos": True})
    first = False
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = True
            break
    try:
        text = srv.metrics_text()
    except OSError:
        text = None
    kill_group(srv)
    try:
        stream.close()
    except Exception:  # noqa: BLE001 - the server is gone
        pass
    return {"first_token": first, "metrics": text}


def photos(small: int = 8) -> dict:
    """The EPD e2e photos: ``small`` 336 x 224 photos, a 720p one (``big``),
    a tiny red square (``dummy``) and two mirrored photos no other flow sends
    (``extra``), as data URLs."""
    from PIL import Image, ImageOps

    from mmshm.bench.photos import _load_rgb, available_photos
    from tests.harness import faults
    from tests.harness.servers import data_url, photo_url

    names = available_photos()
    extra = [data_url(ImageOps.mirror(_load_rgb(names[i % len(names)], faults.SMALL)))
             for i in range(2)]
    return {"small": faults.small_photo_urls(small), "big": photo_url(0),
            "dummy": data_url(Image.new("RGB", (56, 56), (200, 30, 30))), "extra": extra}


def upside_down_photos(count: int) -> list[str]:
    """``count`` photos no flow of :func:`photos` sends: the bundled photos
    (cycled) at the small size (336 x 224), upside down, as PNG data URLs."""
    from PIL import ImageOps

    from mmshm.bench.photos import _load_rgb, available_photos
    from tests.harness import faults
    from tests.harness.servers import data_url

    names = available_photos()
    return [data_url(ImageOps.flip(_load_rgb(names[i % len(names)], faults.SMALL)))
            for i in range(count)]


def reference_urls(ph: dict) -> list[str]:
    """The photos the EPD e2e compares, in its order: the small ones, the
    720p one, the extra ones (a unified server answers the same list)."""
    return ph["small"] + [ph["big"]] + ph["extra"]
