"""The TP broadcast hop on its own: one SGLang-shaped batch through
``mmshm.deferred_unwrap(mmshm.transport.broadcast.broadcast_pyobj)``, gloo on 127.0.0.1.

A benchmark, not a test. ``--tp`` ranks (processes) join one gloo group; per
iteration rank 0 wraps one request of ``--k`` photos (``pixel_values`` of a
360p photo each, float32, in shared memory; wrapping is not timed), every
rank meets the others at a barrier (not timed), then each times its call of
the wrapped broadcast: handles out, SGLang's own ``broadcast_pyobj`` (size,
then pickled bytes), every handle mapped, and the failure agreement. The
time spent inside the agreement (``mmshm.transport.broadcast._agree_max``, wrapped) is
recorded beside it: its share of the hop is what waiting for the peers costs.

Prints per rank the median and p90 of the hop and of the agreement over
``--iters`` iterations (after ``--warmup``). ``--baseline DIR`` runs the
whole measurement twice per round, alternately with ``PYTHONPATH=DIR`` (an
importable copy of another mmshm, e.g. the code before a change) and with
the mmshm this interpreter imports, ``--rounds`` rounds back to back, and
prints both side by side with their ratio, so that a loaded host affects
both alike.

Examples (``python -m mmshm.bench.hop`` takes the same flags)::

    mmshm bench hop --tp 2 --k 1,8 --iters 200
    mmshm bench hop --tp 2 --k 1,8 --baseline /tmp/old --rounds 2

With ``--baseline`` each measurement runs in a child interpreter that runs
this file by its path (``runpy.run_path``, nothing put on ``sys.path``), so
that the other mmshm needs no copy of it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

PHOTO_360P = (1, 3, 360, 640)  # one 360p photo's pixel_values, float32 (2.76 MB)


def _free_port() -> int:
    # its own, not mmshm.bench.serve.servers.free_port: this file runs beside another
    # mmshm (--baseline), which may not have that module
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, k: int, iters: int, warmup: int, q,
          spin_us: float | None = None) -> None:
    import gc
    import statistics

    import torch
    import torch.distributed as dist

    import mmshm
    import mmshm.transport.broadcast as mb

    if spin_us is not None:  # the shared-memory agreement's spin (mmshm.transport.shmagree.SPIN_S)
        import mmshm.transport.shmagree

        mmshm.transport.shmagree.SPIN_S = spin_us * 1e-6
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    agree_s = [0.0]
    real = mb._agree_max

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return real(*a, **kw)
        finally:
            agree_s[0] += time.perf_counter() - t

    mb._agree_max = timed
    bcast = mmshm.deferred_unwrap(mb.broadcast_pyobj)
    gen = torch.Generator().manual_seed(41)  # the same photos on every rank, to check them
    photos = [torch.rand(PHOTO_360P, generator=gen) for _ in range(k)]
    hop, agree = [], []
    for it in range(warmup + iters):
        reqs = None
        if rank == 0:
            items = [{"modality": "image", "feature": p} for p in photos]
            reqs = [mmshm.wrap({"rid": f"r{it}", "input_ids": list(range(64)),
                                "mm_inputs": {"mm_items": items}}, min_bytes=1024)]
        dist.barrier()
        agree_s[0] = 0.0
        t0 = time.perf_counter()
        out = bcast(reqs, rank, None, 0)
        dt = time.perf_counter() - t0
        if it >= warmup:
            hop.append(dt * 1e3)
            agree.append(agree_s[0] * 1e3)
        feats = out[0]["mm_inputs"]["mm_items"]
        assert len(feats) == k and torch.equal(feats[-1]["feature"], photos[-1])
        del out, feats, reqs
        gc.collect()
    dist.barrier()
    dist.destroy_process_group()

    def pct(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    q.put((rank, {"hop_med": statistics.median(hop), "hop_p90": pct(hop, 0.9),
                  "agree_med": statistics.median(agree), "agree_p90": pct(agree, 0.9),
                  "mmshm": os.path.dirname(mmshm.__file__)}))


def measure(tp: int, k: int, iters: int, warmup: int, spin_us: float | None = None) -> dict:
    """Run one measurement in this interpreter's mmshm; {rank: figures}."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, tp, port, k, iters, warmup, q, spin_us))
             for r in range(tp)]
    for p in procs:
        p.start()
    import queue

    res = {}
    try:
        deadline = time.monotonic() + 900
        while len(res) < tp:
            try:
                r, fig = q.get(timeout=1.0)
                res[r] = fig
            except queue.Empty:
                bad = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if bad or time.monotonic() > deadline:
                    raise RuntimeError(f"a rank failed (exit codes {bad}) or timed out")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return res


def _child(args, pythonpath: str | None, k: int, spin_us: float | None = None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    # this file by its path, whichever mmshm PYTHONPATH gives the child
    run_file = ("import runpy, sys; path = sys.argv.pop(1); sys.argv[0] = path; "
                "runpy.run_path(path, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", run_file, os.path.abspath(__file__),
                          "--tp", str(args.tp),
                          "--k", str(k), "--iters", str(args.iters), "--warmup",
                          str(args.warmup), "--json",
                          *(["--spin-us", str(spin_us)] if spin_us is not None else [])],
                         env=env, check=True,
                         capture_output=True, text=True, timeout=1200)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {int(r): v for r, v in got["ranks"].items()}


def _row(label: str, res: dict) -> str:
    return "  ".join(f"{label} rank {r}: hop {v['hop_med']:.2f} (p90 {v['hop_p90']:.2f}) "
                     f"agree {v['agree_med']:.2f} ms ({100 * v['agree_med'] / v['hop_med']:.0f}%)"
                     for r, v in sorted(res.items()))


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--k", default="1,8", help="photos per request, comma separated")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--baseline", help="PYTHONPATH of another mmshm, measured alternately")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--spin-us", type=float, help="override mmshm.transport.shmagree.SPIN_S (the new "
                    "code only), microseconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ks = [int(x) for x in args.k.split(",")]
    made = None
    if os.environ.get("MMSHM_DIR") is None:
        made = os.environ["MMSHM_DIR"] = tempfile.mkdtemp(prefix="bench-hop-", dir="/dev/shm")
    os.environ.setdefault("MMSHM_REAP_INTERVAL_S", "0")
    try:
        _run(args, ks)
    finally:
        if made is not None:
            import shutil

            left = os.listdir(made)
            if left:
                print(f"left in {made}: {left}", file=sys.stderr)
            shutil.rmtree(made, ignore_errors=True)
    return 0


def _run(args, ks) -> None:
    if args.json:
        print(json.dumps({"ranks": measure(args.tp, ks[0], args.iters, args.warmup,
                                           args.spin_us)}))
        return
    print(f"TP={args.tp}, {args.iters} iterations after {args.warmup}, load average "
          f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} cores; medians in ms, agreement share")
    for k in ks:
        for rnd in range(args.rounds):
            if args.baseline:
                old = _child(args, args.baseline, k)
                new = _child(args, None, k, args.spin_us)
                print(f"K={k} round {rnd + 1} (old: {old[0]['mmshm']}, new: {new[0]['mmshm']}):")
                print("  " + _row("old", old))
                print("  " + _row("new", new))
                print("  ratio new/old: " + "  ".join(
                    f"rank {r} {new[r]['hop_med'] / old[r]['hop_med']:.2f}" for r in sorted(new)))
            else:
                print(f"K={k}: " + _row("", measure(args.tp, k, args.iters, args.warmup,
                                                args.spin_us)))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    sys.exit(main())
