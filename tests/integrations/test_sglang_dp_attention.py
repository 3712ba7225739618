"""The seeds' race under DP attention, with each release's real receive path.

The one user-reported failure of the seeds came from a PD deployment with DP
attention ("2xP nodes (dp8tp2), 1xD node"); upstream found the cause in
SGLang PRs 23027 and 29543. Under ``--enable-dp-attention`` each DP group's
attention-TP rank 0 takes its requests off the socket and broadcasts them to
the other ranks of its attention-TP group with ``broadcast_pyobj``. The
requests carry SGLang's own shared-memory pointers (``ShmPointerMMData``,
``/dev/shm/psm_*``, ``sgl_shm_mm_*`` on 0.5.23). gloo's broadcast returns on
the source as soon as its receivers have the bytes, so the source goes on
(the control broadcast, then ``unwrap_shm_features``, which materializes and
unlinks) while the receivers are still in ``pickle.loads`` ->
``__setstate__`` -> ``shm_open``: ``FileNotFoundError: '/psm_...'``, and the
scheduler dies. On 0.5.12 the only thing that held a source back was the
control broadcast on the whole TP group, which waits only for the ranks
gloo's tree makes it send to: it holds the DP group of TP rank 0 and not
the others. 0.5.15 added a barrier on the attention-TP group before the
unwrap (PR 29543, after the refactor into ``SchedulerRequestReceiver`` had
lost PR 23027's), 0.5.23 keeps it.

Here four gloo ranks on 127.0.0.1 (TP 4, two DP groups of attention-TP 2:
ranks [0, 1] and [2, 3]) run the release's own receive code
(``Scheduler.recv_requests`` up to 0.5.12, ``SchedulerRequestReceiver`` from
0.5.15, whose 0.5.23 version broadcasts with ``attn_cp_tp_broadcast_pyobj``)
on requests made by the release's own ``TokenizerManager._send_one_request``
(and so its own ``wrap_shm_features``). Each receiving rank is delayed
inside its deserialization, by a hook around ``pickle.loads`` in
``broadcast_pyobj``, until its source has returned from ``recv_requests``
and dropped everything it received, or for :data:`WAIT_S` if the source
cannot return first (a barrier holds it): the window is hit every time, not
by chance.

Runs only in ``python -m tests.run sglang``'s per-release venvs
(``MMSHM_SGLANG_RELEASE``); skipped elsewhere.
"""

from __future__ import annotations

import gc
import inspect
import os
import re
import sys
import time
import types

import pytest

RELEASE = os.environ.get("MMSHM_SGLANG_RELEASE")
if not RELEASE:
    pytest.skip("SGLang integration tests run in `python -m tests.run sglang`'s venvs",
                allow_module_level=True)

import mmshm
from tests.integrations import sglang_env as E

from tests.harness import procs
from tests.harness.procs import run_group
from tests.harness.segments import segment_files
from tests.harness.tensors import same

V = tuple(int(x) for x in RELEASE.split("."))
#: 0.5.9 materializes on TP rank 0 before it broadcasts: the pixels are
#: pickled into the attention-TP broadcast, no pointer crosses it, no race.
PIXELS_IN_BROADCAST = V <= (0, 5, 9)
#: The attention-TP barrier before the unwrap (upstream PR 29543), from 0.5.15.
HAS_ATTN_TP_BARRIER = V >= (0, 5, 15)
#: Plain SGLang races only where neither holds (0.5.12 of the releases tested):
#: the race is shown there; elsewhere the source check
#: (:func:`test_release_has_the_barrier_upstream_says`) says why there is none.
PLAIN_RACES = not (PIXELS_IN_BROADCAST or HAS_ATTN_TP_BARRIER)

WORLD, ATTN_TP = 4, 2  # TP 4 = 2 DP groups x attention-TP 2
N_REQS = 2
#: How long a receiver waits, inside its unpickling, for its source to return.
WAIT_S = 6.0
#: SGLang's own segment names, as they appear in a pickled request.
SGLANG_SHM = re.compile(rb"(?:sgl_shm_mm|psm)_\w+")


# -- the facts the tests rely on, read from the release's own source -------------------
def _receive_source(ns) -> str:
    if ns.receiver is not None:
        return inspect.getsource(ns.receiver.SchedulerRequestReceiver)
    return inspect.getsource(ns.scheduler.Scheduler.recv_requests)


@pytest.fixture(scope="module")
def ns():
    ns = E.load()
    src = _receive_source(ns)
    if "enable_dp_attention" not in src and "attn_dp_enabled" not in src:
        pytest.skip(f"SGLang {RELEASE} has no DP-attention receive path")
    return ns


def test_release_has_the_barrier_upstream_says(ns):
    """The table in the README: which releases hold the attention-TP source
    back with a barrier, and which pickle the pixels into the broadcast."""
    src = _receive_source(ns)
    barrier = re.search(r"barrier\(\s*group=[\w.]*attn_tp", src) is not None
    assert barrier == HAS_ATTN_TP_BARRIER, src
    if PIXELS_IN_BROADCAST:  # unwrap on rank 0 right after the socket, before any broadcast
        assert src.index("unwrap_shm_features(recv_req)") < src.index("broadcast_pyobj(")


# -- one rank ----------------------------------------------------------------------------
class Inbox:
    """The scheduler's socket from the tokenizer: the pickled messages the
    real send path produced, then ``zmq.Again`` (a non-blocking recv on an
    empty socket)."""

    def __init__(self, blobs=()):
        self.blobs = list(blobs)

    def recv(self, flags=0, **kw):
        import zmq

        if not self.blobs:
            raise zmq.Again()
        return self.blobs.pop(0)

    def recv_pyobj(self, flags=0):
        import pickle

        return pickle.loads(self.recv(flags))


def _group(rank: int, ranks: list[int], cpu_group):
    """What SGLang's ``GroupCoordinator`` answers about a group."""
    return types.SimpleNamespace(rank=rank, ranks=ranks, rank_in_group=ranks.index(rank),
                                 world_size=len(ranks), cpu_group=cpu_group)


def _receiver(ns, rank: int, attn_group, inbox: Inbox):
    """The release's real receive path on this rank, with DP attention on
    (``--tp 4 --dp 2 --enable-dp-attention``): ``Scheduler.recv_requests`` up
    to 0.5.12, ``SchedulerRequestReceiver.recv_requests`` from 0.5.15 (0.5.23:
    its parallel state from ``get_parallel()``, the attention groups from
    ``parallel_state``, as ``attn_cp_tp_broadcast_pyobj`` looks them up)."""
    import torch.distributed as dist

    dp, attn_rank = divmod(rank, ATTN_TP)
    attn_ranks = list(range(dp * ATTN_TP, (dp + 1) * ATTN_TP))
    tp = _group(rank, list(range(WORLD)), dist.group.WORLD)
    attn_tp = _group(rank, attn_ranks, attn_group)
    attn_cp = _group(rank, [rank], None)
    par = types.SimpleNamespace(
        pp_rank=0, tp_size=WORLD, tp_group=tp, attn_tp_rank=attn_rank, attn_tp_size=ATTN_TP,
        attn_tp_group=attn_tp, attn_cp_rank=0, attn_cp_size=1, attn_cp_group=attn_cp,
        attn_dp_rank=dp, attn_dp_enabled=True, enable_dp_attention_local_control_broadcast=False,
        moe=types.SimpleNamespace(is_ep_scale_joiner=False), language_only=False,
        encoder_transfer_backend=None)
    server_args = E._Manager(enable_dp_attention=True, language_only=False,
                             enable_dp_attention_local_control_broadcast=False,
                             encoder_transfer_backend=None, enable_trace=False, skip_tokenizer_init=False)
    known = dict(
        recv_from_tokenizer=inbox, recv_from_rpc=Inbox(), recv_skipper=None, input_blocker=None,
        mm_receiver=None, ps=par, tp_group=tp, tp_cpu_group=tp.cpu_group, attn_tp_group=attn_tp,
        attn_tp_cpu_group=attn_group, attn_cp_group=attn_cp, attn_cp_cpu_group=None,
        world_group=tp, server_args=server_args,
        model_config=types.SimpleNamespace(is_multimodal=True), max_recv_per_poll=-1,
        stream_output=E._noop, get_last_forward_mode=lambda: None, get_last_batch=lambda: None,
        scripted_scheduler_hook=None, scheduler_stage_metrics=None)
    if ns.receiver is not None:
        import dataclasses

        mod = ns.receiver
        for fn in ("get_parallel", "get_disagg", "get_exec"):
            if hasattr(mod, fn):
                setattr(mod, fn, lambda: par)
        comm = sys.modules.get("sglang.srt.distributed.communication_op")
        if comm is not None:  # attn_cp_tp_broadcast_pyobj's lookups
            comm.get_attn_tp_group = lambda: attn_tp
            comm.get_attn_cp_group = lambda: attn_cp
        cls = mod.SchedulerRequestReceiver
        inst = cls(**{f.name: known.get(f.name, E._Manager()) for f in dataclasses.fields(cls)})
        return lambda: cls.recv_requests(inst)
    sched = ns.scheduler.Scheduler
    fake = E._Manager(**known, **{k: v for k, v in vars(par).items() if k not in known},
                      enable_trace=False)
    fake.recv_limit_reached = lambda n: False
    fake._split_work_and_control_reqs = types.MethodType(sched._split_work_and_control_reqs,
                                                         fake)
    return lambda: sched.recv_requests(fake)


def _delay_unpickling(ns, marker: str, wait_s: float, seen: dict) -> None:
    """On a receiving rank: the first ``pickle.loads`` in ``broadcast_pyobj``
    (the work requests) waits until ``marker`` exists (the source has
    returned and dropped its requests) or ``wait_s`` has passed."""
    import pickle

    real = pickle.loads

    def loads(data, *a, **kw):
        if "t" not in seen:
            deadline = time.monotonic() + wait_s
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.005)
            seen["source_done_first"] = os.path.exists(marker)
            seen["t"] = time.time()
        return real(data, *a, **kw)

    hooked = types.ModuleType("pickle")
    hooked.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
    hooked.loads = loads
    ns.common.pickle = hooked


def _feature_of(req):
    """The request's first feature; for a request that failed, what its
    ``mm_inputs`` became (``MMInputsProcessError``, or None on older
    releases: mmshm's per-request failure)."""
    mm = req.mm_inputs
    return E.items(req)[0].feature if isinstance(mm, dict) or hasattr(mm, "mm_items") else mm


def _feature(dp: int, i: int):
    return E.expected_feature(10 * dp + i)


def rank_dp_attention(rank: int, world: int, mode: str, marker_dir: str, wait_s: float) -> dict:
    """One scheduler rank; returns what it received, or the exception."""
    import torch
    import torch.distributed as dist

    ns = E.load()
    if mode == "mmshm":
        mmshm.instrument("sglang")
    groups = [dist.new_group(list(range(d * ATTN_TP, (d + 1) * ATTN_TP)))
              for d in range(world // ATTN_TP)]
    dp, attn_rank = divmod(rank, ATTN_TP)
    out: dict = {"rank": rank, "dp": dp, "error": None, "names": [], "sizes": []}
    real_broadcast = dist.broadcast

    def spy(tensor, *a, **kw):  # the bytes each pickled broadcast carries, and when
        result = real_broadcast(tensor, *a, **kw)
        if tensor.dtype == torch.uint8:
            out["sizes"].append(tensor.numel())
            out["t_broadcast"] = time.time()
        return result

    dist.broadcast = spy
    inbox, seen = Inbox(), {}
    marker = os.path.join(marker_dir, f"source-{dp}-done")
    if attn_rank == 0:  # the tokenizer's messages to this DP group's scheduler
        sock = E.Socket()
        for i in range(N_REQS):
            E.send_one(ns, E.make_request(ns, [_feature(dp, i)], rid=f"dp{dp}-{i}"), sock)
        inbox.blobs = list(sock.sent)
        out["names"] = sorted({m.decode() for b in sock.sent for m in SGLANG_SHM.findall(b)})
    else:
        _delay_unpickling(ns, marker, wait_s, seen)
    recv = _receiver(ns, rank, groups[dp], inbox)
    dist.barrier()
    try:
        reqs = recv()
    except Exception as exc:  # noqa: BLE001 - what the scheduler would die of
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    finally:
        out["source_done_first"] = seen.get("source_done_first")
        out["t_unpickle"] = seen.get("t")
    out["rids"] = [r.rid for r in reqs]
    features = [_feature_of(r) for r in reqs]
    out["kinds"] = [type(f).__name__ for f in features]  # or what stands for a failure
    out["ok"] = [same(f, _feature(dp, int(r.rid.split("-")[1])))
                 for f, r in zip(features, reqs)]
    del features
    del reqs
    gc.collect()  # the source drops its references at once
    if attn_rank == 0:
        open(marker, "w").close()
    return out


_RANK_MAIN = procs._rank_main


def _rank_main_then_exit(target, rank, world, port, q, args) -> None:
    """:func:`tests.harness.procs._rank_main`, then ``os._exit``: a spawned child's interpreter
    teardown with torch and SGLang imported takes more than the 10 s that
    :func:`~tests.harness.procs.stop_all` grants on a loaded 2-core host (measured: 6 s for
    torch alone at a load of 30), and the rank would be SIGKILLed."""
    try:
        _RANK_MAIN(target, rank, world, port, q, args)
        q.close()
        q.join_thread()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _run(mode: str, tmp_path, monkeypatch) -> dict:
    monkeypatch.setattr(procs, "_rank_main", _rank_main_then_exit)
    return run_group(rank_dp_attention, WORLD, mode, str(tmp_path), WAIT_S, timeout=300,
                     ctx=procs.preload_ctx("tests.integrations.sglang_ranks"))


def _gone(names) -> list[str]:
    """Those of ``names`` still in /dev/shm (and removes them)."""
    left = sorted(n for n in names if os.path.exists(os.path.join("/dev/shm", n)))
    E.remove_segments(left)
    return left


def _window(res: dict) -> dict:
    """Per receiving rank: seconds from its source's return from the
    attention-TP broadcast to the start of its own unpickling (> 0: the
    window of the race was open)."""
    return {r: round(v["t_unpickle"] - res[r - r % ATTN_TP]["t_broadcast"], 3)
            for r, v in sorted(res.items()) if r % ATTN_TP}


def _figures(request, tmp_path, mode: str, res: dict) -> None:
    from tests.harness.servers import report_figures

    payload = _feature(0, 0).numel() * 4
    report_figures(request, f"SGLang {RELEASE} DP attention ({mode})", {
        "payload per request, bytes": payload,
        "attention-TP broadcast, bytes per rank (max)": {
            r: max(v["sizes"], default=0) for r, v in sorted(res.items())},
        "errors": {r: v["error"] for r, v in sorted(res.items()) if v["error"]},
        "receiver unpickled after its source returned": {
            r: v["source_done_first"] for r, v in sorted(res.items()) if r % ATTN_TP},
        "receiver unpickled after its source's broadcast returned, s": _window(res),
    }, tmp_path)


# -- the tests ------------------------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_dp_attention_race_without_mmshm(ns, request, tmp_path, monkeypatch):
    """Plain SGLang 0.5.12 (no barrier, pointers in the broadcast) fails on
    the receiver of the DP group whose source is not TP rank 0. Run only on
    a release that races (:data:`PLAIN_RACES`): 0.5.9 pickles the pixels
    into the broadcast and 0.5.15+ hold the source at their barrier, which
    the source check states (a run of 20 s per release showed no more)."""
    if not PLAIN_RACES:
        pytest.skip(f"plain SGLang {RELEASE} does not race ("
                    f"{'pixels in the broadcast' if PIXELS_IN_BROADCAST else 'its barrier'}: "
                    f"test_release_has_the_barrier_upstream_says); shown on 0.5.12")
    res = _run("plain", tmp_path, monkeypatch)
    _figures(request, tmp_path, "plain", res)
    names = [n for r in res.values() for n in r["names"]]
    assert all(dt > 0 for dt in _window(res).values()), "the receivers were not delayed"
    # the tokenizer's messages: one SGLang segment per request
    assert len(set(names)) == N_REQS * WORLD // ATTN_TP, names
    # DP group 0: the control broadcast on the TP group holds TP rank 0 until
    # rank 1 has unpickled; no release fails there
    assert res[1]["source_done_first"] is False
    # the seeds' race: DP group 1's source (rank 2) returned, materialized
    # and unlinked while rank 3 was still unpickling
    assert res[3]["source_done_first"] is True
    err = res[3]["error"]
    assert err is not None and err.startswith("FileNotFoundError"), err
    gone = re.search(r"'/(psm_\w+)'", err)
    assert gone and gone.group(1) in res[2]["names"], (err, res[2]["names"])
    assert res[2]["error"] is None and res[0]["error"] is None
    # rank 1 either passed or lost rank 3 in the control broadcast: the
    # scheduler that died takes the group down, as in a server
    assert res[1]["error"] is None or "FileNotFoundError" not in res[1]["error"]
    assert max(max(r["sizes"]) for r in res.values()) < 16384, "pointers only"
    for r in res.values():
        if r["error"] is None:
            assert r["kinds"] == ["Tensor"] * N_REQS and all(r["ok"]), r
    assert _gone(names) == []


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_dp_attention_race_with_mmshm(ns, request, tmp_path, monkeypatch):
    """Under mmshm (what ``mmshm run`` patches: ``broadcast_pyobj`` or
    ``attn_cp_tp_broadcast_pyobj``), with the same delay: no rank fails on
    any release, every rank has the bytes sent, the broadcast carries
    metadata only, and nothing is left."""
    res = _run("mmshm", tmp_path, monkeypatch)
    _figures(request, tmp_path, "mmshm", res)
    assert all(dt > 0 for dt in _window(res).values()), "the receivers were not delayed"
    for r in res.values():
        assert r["error"] is None, r
        assert r["names"] == [], "SGLang's own shared memory was used"
        assert r["rids"] == [f"dp{r['dp']}-{i}" for i in range(N_REQS)]
        assert r["kinds"] == ["Tensor"] * N_REQS and all(r["ok"]), f"bytes differ: {r}"
        assert max(r["sizes"]) < 16384, f"the broadcast carried {max(r['sizes'])} bytes"
    assert segment_files() == []
