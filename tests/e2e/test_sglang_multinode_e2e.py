"""mmshm against a real SGLang server whose TP group spans two nodes:
``--tp 2 --nnodes 2`` on CPU, one rank per node, real photos. ``tests.run``
runs it on 0.5.23 (:data:`tests.run.E2E_SGLANG`); it passes on 0.5.9 too
(``python -m tests.run sglang --release 0.5.9 --e2e-only --
tests/e2e/test_sglang_multinode_e2e.py``).

Two nodes on one machine: each node's ``sglang.launch_server`` runs in its
own mount namespace whose /dev/shm is a tmpfs of its own (the test mounts it
on a host path and bind-mounts it there, so it can look in from outside),
bound to a core of its own (``taskset``), and the nodes talk over 127.0.0.1
only. mmshm tells them apart as a real deployment would: a node is what can
open the same segments (:mod:`mmshm.segments.node`: the mount namespace and the
segment directory differ).

Run by ``python -m tests.run sglang`` after the single-node e2e, in
``.venvs/sglang-<version>-server``. The phases share one state; each
starts one server on both nodes. Phases 1 and 2 run side by side (the
module fixture ``across_nodes``: nothing either asserts depends on the
other's server, and a start is mostly one process at a time importing
Python), each node of each on a tmpfs of its own; their tests then raise
what each phase raised and compare the texts. Phases 3 and 4 follow in file
order:

1. SGLang's own transport, timed by observe mode (the plain reference):
   greedy texts, and the bytes its ``broadcast_pyobj`` carries to the other
   node (the pickled pixels); nothing made in either of its nodes' /dev/shm.
2. under ``mmshm run`` on both nodes (on the module's two tmpfs): the same
   texts as phase 1; per request, the payload crosses to node 1 once
   (``mmshm_internode_bytes_total`` = the bytes mmshm wrote, x (nodes - 1))
   and the broadcast carries metadata only; n=2 writes the photo once; then
   node 1's processes are SIGKILLed while its pool holds the photo's
   segment.
3. under ``mmshm run`` again, on phase 2's tmpfs, after it: node 1 reclaims
   the killed node's segments before its first request; a graceful stop
   leaves nothing on either node.
4. ``--tp 4`` (two ranks per node, a 4-head build of the tiny model),
   observed and under mmshm, the two servers side by side (each node of
   each on a tmpfs of its own; a start is mostly one process at a time
   importing Python): the answer is the same, and plain sends the
   pixels to each of node 1's ranks where mmshm sends them once to the node
   (inter-node bytes plain / mmshm = 2).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.harness.servers import needs_e2e

pytestmark = [needs_e2e("sglang"),
              pytest.mark.skipif(not (os.geteuid() == 0 and shutil.which("unshare")
                                      and shutil.which("taskset")),
                                 reason="two simulated nodes need root, unshare and taskset "
                                        "(a mount namespace and a core each)"),
              pytest.mark.skipif(not shutil.which("nsenter"), reason="needs nsenter")]

RELEASE = os.environ.get("MMSHM_SGLANG_RELEASE", "0.0.0")
V = tuple(int(x) for x in RELEASE.split("."))
ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / ".venvs" / "tiny-qwen2-vl"  # models.model_dir("qwen2-vl")
#: the same tiny Qwen2-VL with 4 heads, which TP=4 can shard
MODEL4_DIR = ROOT / ".venvs" / "tiny-qwen2-vl-4heads"
NODES = 2
TP = 2
#: two ranks on each node: where a node's leader shares what it received
TP4 = 4
MAX_TOKENS = 8
GREEDY = [(0, "Describe the picture."), (1, "What is in it?")]
#: a broadcast's metadata for one request stays below this (bytes)
METADATA_MAX = 100_000

S: dict = {}


def _server():
    """tests/harness/servers.py."""
    from tests.harness import servers

    return servers


@pytest.fixture(scope="module")
def env(request):
    """The model, the logs, and one tmpfs per node that becomes its /dev/shm
    (phase 2's and phase 3's; phases 1 and 4 mount their own)."""
    from tests.harness import models

    models.build(MODEL_DIR)
    model4 = models.build(MODEL4_DIR, heads=4)
    logs = Path(tempfile.mkdtemp(prefix=f"sglang-multinode-{RELEASE}-"))
    server = _server()
    shms = []
    try:
        for k in range(NODES):
            shms.append(server.mount_tmpfs(f"mmshm-node{k}-shm-", "256m"))
        print(f"\nSGLang {RELEASE} multi-node e2e: logs in {logs}", flush=True)
        yield {"logs": logs, "shm": shms, "model4": model4}
    finally:
        server.report_figures(request, f"SGLang {RELEASE} multi-node e2e", S, logs)
        server._kill_all()
        for d in shms:
            server.unmount_tmpfs(d)


class Nodes:
    """One SGLang server on two simulated nodes: node 0 runs the HTTP server,
    the tokenizer and TP rank 0; node 1 runs TP rank 1 (and SGLang's dummy
    health endpoint). Under mmshm, node 1's own exporter
    (``MMSHM_METRICS_PORT``) shows its processes' metrics."""

    def __init__(self, env, name: str, mode: str, node1_pool_idle_s: str = "2", tp: int = TP,
                 shm: list[Path] | None = None):
        srv = _server()
        per_node = tp // NODES
        dist_port = srv.free_port()
        self.metrics_port = srv.free_port()
        self.shm = env["shm"] if shm is None else shm
        self.nodes = []
        for k in range(NODES):
            port = srv.free_port()
            argv = srv.sglang_argv(MODEL_DIR if tp == TP else env["model4"], port, tp, V) + [
                "--nnodes", str(NODES), "--node-rank", str(k),
                "--dist-init-addr", f"127.0.0.1:{dist_port}"]
            # one core per node: every rank of node k on core k
            bind = "|".join(str(r // per_node) for r in range(tp))
            e = srv.sglang_env(MMSHM_DIR="/dev/shm", MMSHM_REAP_INTERVAL_S="60",
                               MMSHM_POOL_IDLE_S=node1_pool_idle_s if k else "2",
                               SGLANG_CPU_OMP_THREADS_BIND=bind)
            if mode == "observe":
                e["MMSHM_MODE"] = "observe"
            if k:
                e["MMSHM_METRICS_PORT"] = str(self.metrics_port)
            prefix = ["unshare", "-m", "sh", "-c",
                      (f"mount --make-rprivate / && mount --bind {self.shm[k]} /dev/shm && "
                       f'exec taskset -c {k} "$0" "$@"')]
            self.nodes.append(srv.Server(argv, port, env["logs"] / f"{name}-node{k}.log",
                                         env=e, mmshm_run=True, prefix=prefix,
                                         ready_timeout_s=400))
        t0 = time.monotonic()
        for n in self.nodes:  # node 1's ranks wait for node 0's in the dist init
            n.launch()
        try:
            for n in self.nodes:
                n.wait_ready()
        except BaseException:
            self.kill()
            raise
        S.setdefault("startup_s", {})[name] = round(time.monotonic() - t0, 1)
        print(f"  {name}: both nodes ready in {S['startup_s'][name]:.0f} s", flush=True)

    def ask(self, photo: int, text: str, n: int = 1) -> list[str]:
        """One chat request with one photo: greedy for n=1, seeded for n>1."""
        r = self.nodes[0].client(timeout_s=600).chat.completions.create(
            model="default", max_tokens=MAX_TOKENS, n=n, seed=7,
            temperature=0.0 if n == 1 else 0.8,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _server().photo_url(photo)}},
                {"type": "text", "text": text}]}])
        assert len(r.choices) == n
        return [c.message.content for c in r.choices]

    def metrics(self, k: int) -> str:
        """Node ``k``'s exposition (node 0: SGLang's /metrics, which merges
        mmshm's; node 1: mmshm's exporter)."""
        if k == 0:
            return self.nodes[0].metrics_text()
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=30) as r:
            return r.read().decode()

    def segments(self, k: int) -> list[str]:
        return _server().segments(self.shm[k])

    def stop(self) -> None:
        for n in self.nodes:
            n.stop(signal.SIGTERM, timeout_s=60)

    def kill(self) -> None:
        for n in self.nodes:
            n.kill()


def _m(text: str, name: str, **labels) -> float:
    return _server().metric(text, name, **labels)


def _delta(before: str, after: str, name: str, **labels) -> float:
    return _m(after, name, **labels) - _m(before, name, **labels)


def _hop_bytes(before: str, after: str, hop: str, transport: str) -> float:
    return _delta(before, after, "mmshm_ipc_bytes_sum", server="sglang", hop=hop,
                  transport=transport)


def _figures(a0: str, a1: str, b0: str, b1: str) -> dict:
    """One request under mmshm, from node 0's (``a``) and node 1's (``b``)
    expositions before and after it: bytes written into shared memory,
    payload bytes sent to node 1, the broadcast's metadata bytes, node 1's
    new segments and pool hits, and the source's broadcast hop in ms."""
    return {"written": _delta(a0, a1, "mmshm_shm_written_bytes_total"),
            "internode": _delta(a0, a1, "mmshm_internode_bytes_total"),
            "metadata": _delta(a0, a1, "mmshm_broadcast_bytes_sum", role="src"),
            "node1_segments": _delta(b0, b1, "mmshm_segments_created_total"),
            "node1_pool_hits": _delta(b0, b1, "mmshm_pool_requests_total", result="hit"),
            "broadcast_src_ms": 1e3 * _delta(a0, a1, "mmshm_ipc_seconds_sum", server="sglang",
                                             hop="broadcast_src", transport="mmshm")}


def _wait_no_segments(nodes: Nodes, timeout_s: float = 30.0) -> list[list[str]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(nodes.segments(k) for k in range(NODES)):
        time.sleep(0.5)
    return [nodes.segments(k) for k in range(NODES)]


def _stop_clean(g: Nodes, env, key: str) -> None:
    """Stop both nodes gracefully: nothing of mmshm's is left on either
    (``S[key + "left_after_stop"]``; SGLang's own files, for the record, in
    ``S[key + "others_after_stop"]``)."""
    g.stop()
    S[f"{key}left_after_stop"] = [g.segments(k) for k in range(NODES)]
    S[f"{key}others_after_stop"] = _others(g.shm)
    assert S[f"{key}left_after_stop"] == [[], []]


def _others(shms: list[Path]) -> list[list[str]]:
    """What is left in each node's /dev/shm (``shms``) besides mmshm's
    segments (SGLang's own files, for the record)."""
    return [sorted(n for n in os.listdir(d) if not n.startswith("mmshm-")) for d in shms]


def _side_by_side(runs: dict, given: dict | None = None) -> dict:
    """Run ``runs`` (name -> a callable taking its nodes' /dev/shm
    directories, one per node) in threads of their own, side by side (a
    start is mostly one process at a time importing Python, so two servers
    start in little more than one's time). A name in ``given`` gets those
    directories; every other name gets a fresh tmpfs per node
    (``mmshm-<name>-node<k>-``), unmounted once all are done. Returns name
    -> the callable's result, or the exception it raised (see
    ``servers.result``)."""
    srv = _server()
    given = given or {}
    mounted: dict[str, list[Path]] = {}
    try:
        for name in runs:
            if name not in given:
                mounted[name] = []
                for k in range(NODES):
                    mounted[name].append(srv.mount_tmpfs(f"mmshm-{name}-node{k}-", "256m"))
        shms = {**mounted, **given}
        out = srv.in_parallel(*[lambda f=f, d=shms[name]: f(d) for name, f in runs.items()],
                              return_exceptions=True)
    finally:
        for d in [d for ds in mounted.values() for d in ds]:
            srv.unmount_tmpfs(d)
    return dict(zip(runs, out))


# -- 1. and 2., side by side ------------------------------------------------------------
def _observe_phase(env, shm: list[Path]) -> None:
    """Phase 1 on the nodes' /dev/shm ``shm``: SGLang's ``default`` transport
    pickles the pixels into the broadcast that reaches node 1 (observe mode
    times it); records the texts and bytes in ``S``."""
    t0 = time.monotonic()
    g = Nodes(env, "observe", "observe", shm=shm)
    try:
        S["plain"], S["plain_internode_bytes"] = [], []
        for photo, text in GREEDY:
            m0 = g.metrics(0)
            S["plain"].append(g.ask(photo, text)[0])
            m1 = g.metrics(0)
            # what torch.distributed.broadcast carried from rank 0: the pickled
            # request, pixels included, once per remote rank (1 here)
            sent = _hop_bytes(m0, m1, "broadcast_src", "server")
            assert sent > 4784 * 1176 * 4, sent  # the pixels were pickled into it
            S["plain_internode_bytes"].append(sent * (TP - 1))
            S.setdefault("plain_broadcast_src_ms", []).append(round(1e3 * _delta(
                m0, m1, "mmshm_ipc_seconds_sum", server="sglang", hop="broadcast_src",
                transport="server"), 1))
        m0 = g.metrics(0)
        S["plain_n2"] = g.ask(0, "Describe the picture.", n=2)
        S["plain_n2_internode_bytes"] = _hop_bytes(m0, g.metrics(0), "broadcast_src",
                                                   "server") * (TP - 1)
        node1 = g.metrics(1)
        S["plain_node1_received_bytes"] = _m(node1, "mmshm_ipc_bytes_sum", server="sglang",
                                             hop="broadcast_dst", transport="server")
        assert S["plain_node1_received_bytes"] >= sum(S["plain_internode_bytes"])
        assert _m(g.metrics(0), "mmshm_segments_created_total") == 0
        assert [g.segments(k) for k in range(NODES)] == [[], []]
        _stop_clean(g, env, "plain_")
    finally:
        g.kill()
        S.setdefault("phase_s", {})["observe"] = round(time.monotonic() - t0, 1)


def _mmshm_phase(env, shm: list[Path]) -> None:
    """Phase 2 on the nodes' /dev/shm ``shm`` (the module's, which phase 3
    restarts on): each payload crosses to node 1 once; then node 1 dies.
    Records the texts (compared with phase 1's by the test) and figures in
    ``S``."""
    t0 = time.monotonic()
    # node 1's pool keeps an idle photo segment for 10 minutes: it is what
    # the SIGKILL below leaves behind
    g = Nodes(env, "mmshm", "shm", node1_pool_idle_s="600", shm=shm)
    try:
        texts, per_req = [], []
        for photo, text in GREEDY:
            a0, b0 = g.metrics(0), g.metrics(1)
            texts.append(g.ask(photo, text)[0])
            a1, b1 = g.metrics(0), g.metrics(1)
            r = _figures(a0, a1, b0, b1)
            written = r["written"]
            per_req.append(r)
            assert written >= 4784 * 1176 * 4, r
            # the payload crossed to the other node once: payload x (nodes - 1)
            assert r["internode"] == written * (NODES - 1), r
            assert 0 < r["metadata"] < METADATA_MAX, r
            # node 1's leader put it in a segment of its own node (new or pooled)
            assert r["node1_segments"] + r["node1_pool_hits"] == 1, r
        S["mmshm"], S["mmshm_per_request"] = texts, per_req
        a0 = g.metrics(0)
        S["mmshm_n2"] = g.ask(0, "Describe the picture.", n=2)
        a1 = g.metrics(0)
        n2 = {"written": _delta(a0, a1, "mmshm_shm_written_bytes_total"),
              "internode": _delta(a0, a1, "mmshm_internode_bytes_total"),
              "fanout_copies": _delta(a0, a1, "mmshm_fanout_copies_total")}
        S["mmshm_n2_figures"] = n2
        # written once for the warm-up and both samples; it crosses once per
        # broadcast that carries it (the warm-up's, then the samples')
        assert n2["written"] == per_req[0]["written"], n2
        assert n2["fanout_copies"] == 3, n2
        assert n2["internode"] in (2 * n2["written"], 3 * n2["written"]), n2
        m0, m1 = g.metrics(0), g.metrics(1)
        for m in (m0, m1):
            assert sum(_m(m, "mmshm_inline_fallbacks_total", reason=r)
                       for r in ("enospc", "budget", "emfile", "other", "group")) == 0
            assert _m(m, "mmshm_materialize_failures_total", reason="other") == 0
        S["mmshm_node1_created"] = _m(m1, "mmshm_segments_created_total")
        # `mmshm status` run inside each node's namespace shows that node
        ids = []
        for n in g.nodes:
            out = subprocess.run(["nsenter", "-t", str(n.proc.pid), "-m", sys.executable, "-m",
                                  "mmshm.cli", "status", "--json"], capture_output=True,
                                 text=True, timeout=120,
                                 env=dict(os.environ, MMSHM_DIR="/dev/shm"))
            ids.append(json.loads(out.stdout)["node"]["id"])
        S["status_node_ids"] = [f"0x{i:08x}" for i in ids]
        assert ids[0] != ids[1]
        # node 0's segments go back to its pool and out after 2 s; node 1's
        # pool keeps the photo
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and g.segments(0):
            time.sleep(0.5)
        assert g.segments(0) == []
        S["left_on_node1_before_kill"] = g.segments(1)
        assert S["left_on_node1_before_kill"], "node 1's pool holds nothing to leave behind"
        g.nodes[1].kill()  # SIGKILL: node 1's processes, with their pool
        S["left_on_node1_after_kill"] = g.segments(1)
        assert S["left_on_node1_after_kill"] == S["left_on_node1_before_kill"]
        g.nodes[0].kill()  # its TP peer is gone: SGLang cannot go on
    finally:
        g.kill()
        S.setdefault("phase_s", {})["mmshm"] = round(time.monotonic() - t0, 1)


@pytest.fixture(scope="module")
def across_nodes(env) -> dict:
    """Phases 1 and 2, their two servers side by side (nothing either
    asserts depends on the other's server): phase 1's nodes on a tmpfs each
    of their own, phase 2's on the module's (``env["shm"]``, where phase 3
    restarts). Returns ``{"observe": ..., "mmshm": ...}``: ``None``, or the
    exception that phase raised, which its test raises."""
    t0 = time.monotonic()
    out = _side_by_side({"observe": lambda shm: _observe_phase(env, shm),
                         "mmshm": lambda shm: _mmshm_phase(env, shm)},
                        given={"mmshm": env["shm"]})
    S.setdefault("phase_s", {})["observe+mmshm"] = round(time.monotonic() - t0, 1)
    return out


@pytest.mark.timeout(900)
def test_plain_across_nodes(across_nodes):
    """Phase 1, the reference (run by :func:`across_nodes`): the pixels were
    pickled into the broadcast that reaches node 1, and nothing was made in
    either node's /dev/shm."""
    _server().result(across_nodes["observe"])


@pytest.mark.timeout(900)
def test_mmshm_across_nodes(across_nodes):
    """Phase 2 (run by :func:`across_nodes`): each payload crossed to node 1
    once, n=2 wrote the photo once, node 1 died holding a segment; its
    answers equal phase 1's."""
    _server().result(across_nodes["mmshm"])
    assert S.get("plain"), "the plain phase did not run"
    assert S["mmshm"] == S["plain"]


# -- 3. the restarted group ----------------------------------------------------------
@pytest.mark.timeout(900)
def test_restart_reclaims_on_each_node_and_stops_clean(env, across_nodes):
    left = S.get("left_on_node1_after_kill")
    if not left:
        pytest.skip("the mmshm phase left nothing to reclaim")
    t0 = time.monotonic()
    g = Nodes(env, "mmshm-restart", "shm")
    try:
        # node 1 reclaimed the killed processes' segments as it started,
        # before its first request
        assert not set(g.segments(1)) & set(left), "the killed node's segments are still there"
        S["node1_reaped_at_start"] = _m(g.metrics(1), "mmshm_reaped_segments_total",
                                        reason="killed")
        assert S["node1_reaped_at_start"] >= len(left)
        assert g.ask(*GREEDY[0])[0] == S["plain"][0]
        S["left_before_stop"] = _wait_no_segments(g)
        assert S["left_before_stop"] == [[], []]
        _stop_clean(g, env, "")
    finally:
        g.kill()
        S.setdefault("phase_s", {})["mmshm-restart"] = round(time.monotonic() - t0, 1)


# -- 4. two ranks per node (TP=4): the payload crosses once per node, not per rank ----------
@pytest.mark.timeout(900)
def test_two_ranks_per_node_plain_and_mmshm(env):
    """``--tp 4 --nnodes 2``: SGLang's broadcast sends the pickled pixels to
    each of node 1's two ranks; mmshm sends the payload once to node 1's
    leader, which puts it in one segment for both. Inter-node bytes plain /
    mmshm = remote ranks / remote nodes = 2; the answers are equal."""
    t0 = time.monotonic()
    remote_ranks = TP4 - TP4 // NODES
    photo, text = GREEDY[0]
    srv = _server()

    def run(mode: str, shm: list[Path]) -> str:
        g = Nodes(env, f"tp4-{mode}", mode, tp=TP4, shm=shm)
        try:
            a0, b0 = g.metrics(0), g.metrics(1)
            answer = g.ask(photo, text)[0]
            a1, b1 = g.metrics(0), g.metrics(1)
            if mode == "observe":
                sent = _hop_bytes(a0, a1, "broadcast_src", "server")
                assert sent > 4784 * 1176 * 4, sent
                S["tp4_plain_internode_bytes"] = sent * remote_ranks
            else:
                S["tp4_mmshm"] = r = _figures(a0, a1, b0, b1)
                assert r["internode"] == r["written"] * (NODES - 1), r
                assert 0 < r["metadata"] < METADATA_MAX, r
                # one segment on node 1 for both of its ranks
                assert r["node1_segments"] + r["node1_pool_hits"] == 1, r
                S["tp4_left_before_stop"] = _wait_no_segments(g)
                assert S["tp4_left_before_stop"] == [[], []]
            _stop_clean(g, env, f"tp4_{mode}_")
            return answer
        finally:
            g.kill()

    # the two servers side by side (each node of each on its own tmpfs)
    out = _side_by_side({f"tp4-{m}": lambda shm, m=m: run(m, shm) for m in ("observe", "shm")})
    res = {"observe": srv.result(out["tp4-observe"]), "shm": srv.result(out["tp4-shm"])}
    S["tp4_texts"] = res
    assert res["shm"] == res["observe"]
    ratio = S["tp4_plain_internode_bytes"] / S["tp4_mmshm"]["internode"]
    S["tp4_internode_plain_over_mmshm"] = round(ratio, 3)
    # remote ranks / remote nodes = 2, less the pickle's framing
    assert remote_ranks * 0.99 < ratio < remote_ranks * 1.01, ratio
    S.setdefault("phase_s", {})["tp4"] = round(time.monotonic() - t0, 1)
