"""The producer's wrap at the host's speed: ``ShmTensor.from_tensor`` of K
photos' ``pixel_values`` (Qwen2-VL, float32 [4784, 1176] at 720p, 22.5 MB;
[1196, 1176] at 360p, 5.6 MB) into new and warm pooled segments, with and
without the hash asked for now, for each ``MMSHM_COPY_THREADS`` given,
interleaved repetition by repetition; beside it the floor, one
multi-threaded torch copy of the same bytes into warm memory (best of three,
as ``mmshm bench``'s), and the ratio of each to it.

    python benchmarks/wrap_threads.py --images 1,8 --threads 1,0 [--json out.json]

``--threads 0`` is the automatic setting; each line says the threads it
used (``mmshm.segments.shmtensor.copy_threads``). Before every timed wrap a buffer of
twice the last-level cache is written, so every copy reads and writes DRAM.
Runs with an older mmshm too (no ``copy_threads``: shown as ``-``).
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

SHAPES = {"720p": (4784, 1176), "360p": (1196, 1176)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", default="1,8")
    ap.add_argument("--resolution", default="720p")
    ap.add_argument("--threads", default="1,0", help="MMSHM_COPY_THREADS values (0: automatic)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    d = tempfile.mkdtemp(prefix="mmshm-wrap-threads-", dir="/dev/shm")
    # the "new" cases write into a directory of their own whose pool is emptied after
    # each: the pooled cases' idle segments stay warm (MMSHM_POOL=0 would unlink them)
    dnew = os.path.join(d, "new")
    os.mkdir(dnew)
    os.environ.update(MMSHM_DIR=d, MMSHM_REAP_INTERVAL_S="0", MMSHM_POOL_IDLE_S="600",
                      MMSHM_POOL="1")
    import torch

    from mmshm import config
    from mmshm.segments import shmtensor
    from mmshm.segments.shmtensor import ShmTensor
    from mmshm.segments.table import TABLE

    evict = torch.empty(256 << 20, dtype=torch.uint8)
    results = []
    try:
        for res in a.resolution.split(","):
            for k in (int(x) for x in a.images.split(",")):
                xs = [torch.rand(SHAPES[res]) for _ in range(k)]
                nbytes = sum(x.numel() * 4 for x in xs)
                dst = torch.empty(nbytes, dtype=torch.uint8)
                dst.fill_(0)
                floor = float("inf")
                for _ in range(3):
                    evict.add_(1)
                    t0 = time.perf_counter()
                    off = 0
                    for x in xs:
                        dst[off:off + x.numel() * 4].copy_(x.reshape(-1).view(torch.uint8))
                        off += x.numel() * 4
                    floor = min(floor, time.perf_counter() - t0)
                del dst
                cases = [(t, pooled, hn) for t in a.threads.split(",")
                         for pooled in (False, True) for hn in (False, True)]
                times: dict = {c: [] for c in cases}
                used: dict = {}
                # the first two: warm-up (the first fills the pool with files written by
                # pwrite; with an mmshm older than warm_pooled, the second maps their pages
                # into this process: 5500 minor faults per 22.5 MB on a first reuse)
                for rep in range(a.reps + 2):
                    for c in cases:
                        t, pooled, hn = c
                        os.environ["MMSHM_COPY_THREADS"] = t
                        config.reload()
                        used[c] = shmtensor.copy_threads() if hasattr(shmtensor, "copy_threads") else None
                        evict.add_(1)
                        t0 = time.perf_counter()
                        hs = [ShmTensor.from_tensor(x, hash_now=hn,
                                                    directory=None if pooled else dnew)
                              for x in xs]
                        dt = time.perf_counter() - t0
                        for h in hs:
                            h.release()
                        del hs
                        TABLE.sweep()
                        if not pooled:
                            TABLE.trim_pool(dnew)
                        if hasattr(TABLE, "warm_pooled"):
                            TABLE.warm_pooled()  # the sweeper's work between requests
                        if rep >= 2:
                            times[c].append(dt)
                for c in cases:
                    t, pooled, hn = c
                    med = statistics.median(times[c])
                    r = {"resolution": res, "images": k, "bytes": nbytes,
                         "setting": t, "threads": used[c],
                         "segment": "pooled" if pooled else "new", "hash_now": hn,
                         "wrap_s": med, "wrap_min_s": min(times[c]), "GBps": nbytes / med / 1e9,
                         "floor_s": floor, "wrap_over_floor": med / floor}
                    results.append(r)
                    print(f"{res} x{k} ({nbytes / 1e6:.1f} MB) MMSHM_COPY_THREADS={t} -> "
                          f"{used[c] if used[c] is not None else '-'} thread(s), "
                          f"{r['segment']:6s} hash_now={int(hn)}: {med * 1e3:8.2f} ms "
                          f"(min {min(times[c]) * 1e3:.2f}) {r['GBps']:6.2f} GB/s, "
                          f"{r['wrap_over_floor']:5.2f}x the floor ({floor * 1e3:.2f} ms, "
                          f"{nbytes / floor / 1e9:.1f} GB/s)", flush=True)
    finally:
        TABLE.trim_pool()
        shutil.rmtree(d, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpus_affinity": len(os.sched_getaffinity(0)), "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
