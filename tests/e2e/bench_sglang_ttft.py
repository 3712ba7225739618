"""Time to first token of a real SGLang server, plain and under ``mmshm run``.

One request carries 8 photos at 720p (8 x 22.5 MB of pixel_values); TP=2 on
CPU; n=1 (the 8 photos in one request) and n=4 (one photo per request:
SGLang refuses several images in one prompt with n > 1); the first streamed token's arrival is timed with the
OpenAI client. The radix cache is off, so every request pays the transport,
the vision encoder and the prefill again (a repeated photo would otherwise be
served from the prefix cache). Servers run one at a time, each in a process
group of its own that is killed on every way out.

    .venvs/sglang-0.5.23-server/bin/python tests/e2e/bench_sglang_ttft.py \\
        [--reps 5] [--photos 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import server
import tiny_model

ROOT = HERE.parents[1]
MODEL_DIR = ROOT / ".venvs" / "tiny-qwen2-vl"


def _argv(port: int, version: tuple) -> list[str]:
    img = (["--disable-fast-image-processor"] if version <= (0, 5, 9)
           else ["--image-processor-backend", "pil"])
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(MODEL_DIR),
            "--host", "127.0.0.1", "--port", str(port), "--tp", "2", "--device", "cpu",
            "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--disable-cuda-graph", "--disable-overlap-schedule", "--grammar-backend", "none",
            "--max-total-tokens", "65536", "--mem-fraction-static", "0.3", "--enable-metrics",
            "--disable-radix-cache", "--random-seed", "1", *img]


def _ttft(srv, urls: list[str], n: int) -> float:
    client = srv.client(timeout_s=900)
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    content.append({"type": "text", "text": "Describe the pictures."})
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model="default", max_tokens=4, n=n, seed=7, temperature=0.0 if n == 1 else 0.8,
        stream=True, messages=[{"role": "user", "content": content}])
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no token streamed")
    return first


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]


def main() -> int:
    import sglang

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--photos", type=int, default=8)
    ap.add_argument("--ns", default="1,4")
    ap.add_argument("--json")
    args = ap.parse_args()
    version = tuple(int(x) for x in sglang.__version__.split(".")[:3])
    tiny_model.build(MODEL_DIR)
    from mmshm.bench.photos import _load_rgb, available_photos

    names = available_photos()
    urls = [server.data_url(_load_rgb(names[i % len(names)], (1280, 720)))
            for i in range(args.photos)]
    logs = Path(tempfile.mkdtemp(prefix="sglang-ttft-"))
    seg_dir = Path(tempfile.mkdtemp(prefix="mmshm-ttft-", dir="/dev/shm"))
    results: dict = {"sglang": sglang.__version__, "photos": args.photos, "reps": args.reps}
    try:
        for mode in ("plain", "mmshm"):
            port = server.free_port()
            env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", SGLANG_CPU_OMP_THREADS_BIND="0|1",
                       MMSHM_DIR=str(seg_dir))
            env.pop("PYTHONPATH", None)
            srv = server.Server(_argv(port, version), port, logs / f"{mode}.log", env=env,
                                mmshm_run=mode == "mmshm", ready_timeout_s=400)
            try:
                srv.start()
                print(f"{mode}: ready in {srv.startup_s:.0f} s", flush=True)
                _ttft(srv, urls, 1)  # warm-up (first-use costs), not timed
                for n in (int(x) for x in args.ns.split(",")):
                    if n == 1:
                        key = f"{mode} {len(urls)} photos n=1"
                        xs = [_ttft(srv, urls, 1) for _ in range(args.reps)]
                    else:
                        # SGLang refuses several images in one prompt with n > 1
                        # ("The length of image_data should be equal to the batch
                        # size"): one photo per request, cycling through them
                        key = f"{mode} 1 photo n={n}"
                        xs = [_ttft(srv, [urls[i % len(urls)]], n)
                              for i in range(max(args.reps, len(urls)))]
                    results[key] = {"median_s": statistics.median(xs), "p90_s": _p90(xs),
                                    "all_s": xs}
                    print(f"{key}: median {statistics.median(xs):.2f} s, "
                          f"p90 {_p90(xs):.2f} s  {[round(x, 2) for x in xs]}", flush=True)
                if mode == "mmshm":
                    text = srv.metrics_text()
                    results["mmshm_written_bytes"] = server.metric(
                        text, "mmshm_shm_written_bytes_total")
                    results["mmshm_fanout_copies"] = server.metric(
                        text, "mmshm_fanout_copies_total")
            finally:
                srv.kill()
    finally:
        server._kill_all()
        # a SIGKILLed server leaves its idle pooled segments: reclaim them
        from mmshm.reaper import reap

        reap(str(seg_dir))
        results["left_after_reclaim"] = server.segments(seg_dir)
        shutil.rmtree(seg_dir, ignore_errors=True)
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
