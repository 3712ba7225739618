"""Chaos: 100 randomized SIGKILL trials beside a second live instance.

Kill points:

* ``producer``: a producer creating 1-48 MiB segments in a loop, killed at a
  random moment (mid-``posix_fallocate``, mid-copy, between creations);
* ``consumer``: a consumer killed after materialize and before release (its
  zero-copy view, and so its reference and liveness lock, still held);
* ``tp_rank``: TP rank 1 killed right after the broadcast (after unpickling,
  or after materializing), while rank 0 and the tokenizer finish normally.

After every trial ``mmshm gc`` (every fourth trial the click command, else
the reaper it runs) goes over the directory; it must leave no orphan, nothing
but the live instance's segments, and those must be intact (bytes equal) and
still readable, including a handle "in flight" that the test materializes at
the end.
Trials run in a private directory (segments are files), so they never touch
/dev/shm's other users. Workers are forks of a fork server that has torch and
mmshm loaded, which keeps each trial well under a second.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import signal
import time
from collections import Counter

import msgspec
import pytest

import mmshm
from mmshm.segments import reaper

from tests.harness.procs import fork_ctx, fork_start, join, recv
from tests.harness.segments import segment_files
from tests.harness.metrics import metric
from tests.harness import workers

log = logging.getLogger("tests.figures")

TRIALS = int(os.environ.get("MMSHM_CHAOS_TRIALS", "100"))
SEED = int(os.environ.get("MMSHM_CHAOS_SEED", "20240603"))
KINDS = ("producer", "consumer", "tp_rank")
KILLED = -signal.SIGKILL


@pytest.fixture
def segdir(shm_dir):
    """The private segment directory the project conftest gives every test
    (also ``MMSHM_DIR``; checked empty, with nothing left open, afterwards)."""
    return shm_dir


def _producer_trial(d: str, rnd: random.Random, seed: int) -> tuple[int, set[str]]:
    a, b = fork_ctx().Pipe()
    p = fork_start(workers.w_producer_loop, d, seed, b, name="producer")
    assert recv(a, 30) == "started"
    time.sleep(rnd.uniform(0.0, 0.12))
    p.kill()
    assert join(p) == KILLED
    return 1, set()


def _consumer_trial(d: str, rnd: random.Random, seed: int) -> tuple[int, set[str]]:
    ha, hb = fork_ctx().Pipe()
    holder = fork_start(workers.w_holder, d, rnd.randrange(1 << 16, 24 << 20), seed, 1, hb,
                        name="holder")
    data, digest, name = recv(ha, 30)
    ca, cb = fork_ctx().Pipe()
    consumer = fork_start(workers.w_consumer, d, cb, name="consumer")
    ca.send((data, digest))
    assert recv(ca, 30) == ("materialized", True)
    holder_first = rnd.random() < 0.5  # the creator leaves before or after the kill
    if holder_first:
        ha.send("exit")
        assert recv(ha) == "bye"
    time.sleep(rnd.uniform(0.0, 0.02))
    consumer.kill()
    assert join(consumer) == KILLED
    if not holder_first:
        ha.send("exit")
        assert recv(ha) == "bye"
    assert join(holder) == 0
    return 1, {name}  # the consumer's reference leaked: the reaper's job


def _tp_trial(d: str, rnd: random.Random, seed: int) -> tuple[int, set[str]]:
    ctx = fork_ctx()
    p_r0, r0_p = ctx.Pipe()
    r0_r1, r1_r0 = ctx.Pipe()
    t_r0, r0_t = ctx.Pipe()
    t_r1, r1_t = ctx.Pipe()
    materialize = rnd.random() < 0.5
    prod = fork_start(workers.w_tp_producer, d, seed, p_r0, name="tokenizer")
    r0 = fork_start(workers.w_tp_rank0, d, r0_p, r0_r1, r0_t, name="rank0")
    r1 = fork_start(workers.w_tp_rank1, d, materialize, r1_r0, r1_t, name="rank1")
    assert recv(t_r1, 30) == ("rank1", True)
    r1.kill()  # right after the broadcast
    assert recv(t_r0, 30) == ("rank0", True)
    assert join(r1) == KILLED
    assert join(r0) == 0
    assert join(prod) == 0
    return 1, set()


def _gc(d: str, cli: bool) -> reaper.ReapReport:
    """`mmshm gc` (the click command, in-process) or the reaper it runs."""
    if not cli:
        return reaper.reap(d)
    from click.testing import CliRunner
    from mmshm.cli import main

    r = CliRunner().invoke(main, ["gc", "--dir", d, "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return msgspec.json.decode(r.stdout.encode(), type=reaper.ReapReport)


TRIAL = {"producer": _producer_trial, "consumer": _consumer_trial, "tp_rank": _tp_trial}


@pytest.mark.timeout(240)
def test_chaos_sigkill_trials(segdir):
    rnd = random.Random(SEED)
    kinds = [KINDS[i % len(KINDS)] for i in range(TRIALS)]
    rnd.shuffle(kinds)
    reaped_segments0 = metric("mmshm_reaped_segments_total")
    reaped_bytes0 = metric("mmshm_reaped_bytes_total")

    live_conn, live_end = fork_ctx().Pipe()
    live = fork_start(workers.w_live_instance, segdir, live_end, name="live-instance")
    info = recv(live_conn, 60)
    live_names = set(info["names"])
    assert set(segment_files(segdir)) == live_names

    kills = Counter()
    reclaimed = reclaimed_bytes = 0
    slowest = 0.0
    for trial, kind in enumerate(kinds):
        t0 = time.monotonic()
        nkilled, must_reap = TRIAL[kind](segdir, rnd, SEED * 1000 + trial)
        kills[kind] += nkilled
        rep = _gc(segdir, cli=trial % 4 == 0)
        reclaimed += rep.reclaimed
        reclaimed_bytes += rep.reclaimed_bytes
        assert must_reap <= set(rep.names), (trial, kind, rep)
        assert not live_names & set(rep.names), f"trial {trial}: reaped a live segment {rep}"
        if kind == "tp_rank":  # the request's segment (its two tensors share one)
            if rep.reclaimed:  # rank 1 had opened it: a killed holder
                assert rep.reasons == {"killed": 1, "in_flight_expired": 0}, (trial, rep)
            else:
                # rank 1 was killed before opening it, rank 0 and the tokenizer
                # left cleanly: like references in flight, kept for the grace period
                assert rep.in_flight == 1, (trial, rep)
                rep = reaper.reap(segdir, grace_s=0)
                assert rep.reasons == {"killed": 0, "in_flight_expired": 1}, (trial, rep)
                reclaimed += rep.reclaimed
                reclaimed_bytes += rep.reclaimed_bytes
        infos = reaper.scan(segdir)
        assert [i.name for i in infos if i.orphan] == [], f"trial {trial} ({kind}): orphans"
        assert {i.name for i in infos} == live_names, f"trial {trial} ({kind}): leftovers"
        live_conn.send("verify")
        assert recv(live_conn, 30) is True, f"trial {trial}: the live instance's bytes changed"
        slowest = max(slowest, time.monotonic() - t0)
        if os.environ.get("MMSHM_CHAOS_DEBUG"):
            print(f"trial {trial} {kind} {time.monotonic() - t0:.3f}s {rep.reclaimed}", flush=True)

    assert metric("mmshm_reaped_segments_total") - reaped_segments0 == reclaimed
    assert metric("mmshm_reaped_bytes_total") - reaped_bytes0 == reclaimed_bytes
    # the handle that stayed in flight through all trials is intact
    h = pickle.loads(info["in_flight"])
    assert mmshm.content_hash(h.materialize(copy=True)) == info["in_flight_hash"]
    live_conn.send("exit")
    assert recv(live_conn) == "bye"
    assert join(live) == 0
    assert segment_files(segdir) == []
    # diagnostic figures go to the log (pytest -o log_cli=true --log-cli-level=INFO)
    log.info("chaos: %d trials (seed %s), kills %s, reclaimed %d segments / %d bytes, "
             "orphans left 0, live segments intact %d, slowest trial %.2fs", TRIALS, SEED,
             dict(kills), reclaimed, reclaimed_bytes, len(live_names), slowest)
