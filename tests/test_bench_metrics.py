"""`mmshm bench --metrics-port` serves the pipeline's merged metrics while it runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.harness.ports import free_port


@pytest.mark.timeout(180)
def test_bench_serves_metrics_of_every_process_while_it_runs(shm_dir):
    pytest.importorskip("transformers")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    p = subprocess.Popen(
        [sys.executable, "-m", "mmshm.cli", "bench", "--tp", "2", "--n", "2", "--images", "1",
         "--modes", "mmshm", "--repeat", "2", "--no-warmup", "--metrics-port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    best = ""
    deadline = time.monotonic() + 170
    try:
        while p.poll() is None and time.monotonic() < deadline:
            try:
                txt = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                             timeout=2).read().decode()
                if 'mmshm_broadcast_seconds_count{role="dst"}' in txt:
                    best = txt
            except OSError:
                pass
            time.sleep(0.3)
        out = p.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out[-3000:]
    samples = {line.split(" ")[0]: float(line.split(" ")[1])
               for line in best.splitlines() if line.startswith("mmshm_")}
    # the producer's segments and the TP ranks' broadcasts, merged in one scrape
    assert samples.get("mmshm_segments_created_total", 0) >= 1, best[:2000]
    assert samples.get("mmshm_fanout_copies_total", 0) >= 2
    assert samples['mmshm_broadcast_seconds_count{role="src"}'] >= 1
    assert samples['mmshm_broadcast_seconds_count{role="dst"}'] >= 1
