"""``MmshmECConnector`` (mmshm.integrations.vllm.epd) against vLLM 0.33's real
EC-connector modules, on CPU, producer and consumer in two processes.

Run by ``python -m tests.run vllm`` in ``.venvs/vllm-0.33.0``; skipped where
vLLM is not installed. What is real: the ``ECTransferConfig`` with
``ec_connector_module_path``, vLLM's ``ECConnectorFactory`` (it imports the
module and takes the class by name), ``ensure_ec_transfer_initialized`` (the
worker's connector), the model runner's ``ECConnectorModelRunnerMixin``
(``maybe_get_ec_connector_output`` binds the metadata, calls
``start_save_caches`` / ``start_load_caches``; ``maybe_save_ec_to_connector``
calls ``save_caches``), ``Request``, ``MultiModalFeatureSpec``,
``MultiModalKwargsItem``, ``ECConnectorOutput`` and the Prometheus metric
types. The rest of ``VllmConfig`` is a stand-in (vLLM cannot build one
without a device platform here): the connector reads only the model's name
and dtype from it. The scheduler's calls are made in the order vLLM 0.32/0.33's
``Scheduler`` makes them (``ensure_cache_available``, ``has_cache_item``,
``update_state_after_alloc``, ``build_connector_meta``, then
``update_state_after_free`` / ``request_finished``).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import signal
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mmshm import config
from mmshm.segments import reaper
from mmshm.segments.segfile import NAME_RE
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer import ec_transfer_state
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorProm
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import Request
from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin as Mixin

from tests.harness.metrics import metric
from tests.harness.procs import stop_all, track
from tests.harness.segments import segment_files
from tests.harness.vllm_request import vllm_request

pytestmark = pytest.mark.timeout(240)
SPAWN = mp.get_context("spawn")
MODULE = "mmshm.integrations.vllm.epd"
ROWS, WIDTH = 64, 96


# -- shared by both processes ---------------------------------------------------------
def vllm_config(role: str, directory: str, keep_s: float = 60.0):
    """The real ``ECTransferConfig`` (loaded by module path) on a stand-in
    ``VllmConfig``."""
    tc = ECTransferConfig(ec_connector="MmshmECConnector", ec_connector_module_path=MODULE,
                          ec_role=role,
                          ec_connector_extra_config={"keep_s": keep_s, "directory": directory})
    return SimpleNamespace(ec_transfer_config=tc,
                           model_config=SimpleNamespace(model="tiny-qwen2-vl",
                                                        dtype=torch.float32))


def pixels(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(ROWS * 4, 1176, generator=g),
            "image_grid_thw": torch.tensor([[1, 16, 16]])}


def encoder_output(seed: int) -> torch.Tensor:
    """What the 'vision encoder' makes of ``pixels(seed)``."""
    g = torch.Generator().manual_seed(50_000 + seed)
    return torch.randn(ROWS, WIDTH, generator=g)


def request(rid: str, items) -> Request:
    """A real ``Request`` with one image per ``(identifier, seed)`` of ``items``."""
    return vllm_request(rid, [(ident, pixels(seed)) for ident, seed in items], ROWS)


def schedule(sched, reqs) -> tuple[SimpleNamespace, list[list[bool]]]:
    """The scheduler's calls for ``reqs`` (vLLM's order); returns the step's
    scheduler output (its connector metadata) and, per request and item,
    whether vLLM would load it (True) or encode it here (False)."""
    loads = []
    for r in reqs:
        assert sched.ensure_cache_available(r, 0) is True  # nothing is ever in flight
    for r in reqs:
        hit = [sched.has_cache_item(f.identifier) for f in r.mm_features]
        for i in range(len(r.mm_features)):
            sched.update_state_after_alloc(r, i)
        loads.append(hit)
    out = SimpleNamespace(ec_connector_metadata=sched.build_connector_meta(None),
                          finished_req_ids=set())
    return out, loads


# -- the producer (encoder instance) in its own process --------------------------------
def producer_main(conn) -> None:
    """Commands: ("open", directory, keep_s): a fresh producer (scheduler
    connector + the worker's, through vLLM's own initialisation);
    ("encode", [(rid, [(identifier, seed)...])...]): schedule, 'encode', save
    through the model runner's mixin, finish the requests, answer with the
    directory listing; ("close",): shut both connectors; ("exit",)."""
    sched = None
    d = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            return
        if cmd == "open":
            d, keep_s = args
            os.environ["MMSHM_DIR"] = d
            config.reload()
            vc = vllm_config("ec_producer", d, keep_s)
            ec_transfer_state.ensure_ec_transfer_initialized(vc)
            sched = ECConnectorFactory.create_connector(vc, ECConnectorRole.SCHEDULER)
            conn.send(type(ec_transfer_state.get_ec_transfer()).__name__)
        elif cmd == "encode":
            reqs = [request(rid, items) for rid, items in args[0]]
            out, loads = schedule(sched, reqs)
            assert not any(any(x) for x in loads)  # a producer never loads
            cache: dict[str, torch.Tensor] = {}
            with Mixin.maybe_get_ec_connector_output(out, encoder_cache=cache):
                for r in reqs:
                    for f, (_, seed) in zip(r.mm_features, dict(args[0])[r.request_id]):
                        cache[f.identifier] = encoder_output(seed)
                        Mixin.maybe_save_ec_to_connector(cache, f.identifier)
            for r in reqs:
                sched.request_finished(r)
            conn.send(sorted(os.listdir(d)))
        elif cmd == "close":
            sched.shutdown()
            ec_transfer_state.ensure_ec_transfer_shutdown()
            conn.send("closed")


class Producer:
    def __init__(self):
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=producer_main, args=(child,), daemon=True)
        self.proc.start()
        track(self.proc.pid)

    def ask(self, *cmd, timeout: float = 120):
        self.conn.send(cmd)
        assert self.conn.poll(timeout), f"the producer did not answer {cmd[0]}"
        return self.conn.recv()

    def stop(self):
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
            except OSError:
                pass
        stop_all([self.proc], timeout=20)


@pytest.fixture(scope="module")
def producer():
    p = Producer()
    yield p
    p.stop()


@pytest.fixture
def produced(producer, shm_dir):
    """The module's producer, opened on this test's segment directory."""
    assert producer.ask("open", shm_dir, 60.0) == "MmshmECConnector"
    yield producer
    if producer.proc.is_alive():
        assert producer.ask("close") == "closed"


@pytest.fixture
def consumer(shm_dir):
    """The consumer instance's scheduler connector and (vLLM's global) worker
    connector, both made by vLLM's factory."""
    vc = vllm_config("ec_consumer", shm_dir)
    ec_transfer_state.ensure_ec_transfer_initialized(vc)
    sched = ECConnectorFactory.create_connector(vc, ECConnectorRole.SCHEDULER)
    yield sched, ec_transfer_state.get_ec_transfer()
    sched.shutdown()
    ec_transfer_state.ensure_ec_transfer_shutdown()


def load_step(out) -> dict:
    cache: dict[str, torch.Tensor] = {}
    with Mixin.maybe_get_ec_connector_output(out, encoder_cache=cache) as ec_out:
        pass
    return cache, ec_out


def fallbacks(reason: str) -> float:
    return metric("mmshm_epd_fallbacks_total", server="vllm", reason=reason)


# -- tests -----------------------------------------------------------------------------
def test_vllm_factory_loads_the_connector_by_module_path(shm_dir):
    cls = ECConnectorFactory.get_connector_class(vllm_config("ec_both", shm_dir)
                                                 .ec_transfer_config)
    assert cls.__name__ == "MmshmECConnector" and cls.__module__ == MODULE
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase

    assert issubclass(cls, ECConnectorBase)
    for role, prod, cons in (("ec_producer", True, False), ("ec_consumer", False, True),
                             ("ec_both", True, True)):
        c = ECConnectorFactory.create_connector(vllm_config(role, shm_dir),
                                                ECConnectorRole.SCHEDULER)
        assert (c.is_producer, c.is_consumer) == (prod, cons)
        c.shutdown()
    # the metadata crosses to TP workers by pickle (MultiprocExecutor's queue)
    from mmshm.integrations.vllm import epd

    meta = epd.MmshmECConnectorMetadata([("r", "h", None)], {"h": b"k" * 32})
    assert pickle.loads(pickle.dumps(meta)) == meta


def test_producer_save_then_consumer_load_gives_identical_tensors(produced, consumer,
                                                                  shm_dir):
    sched, worker = consumer
    listing = produced.ask("encode", [("enc-0", [("renderer0-mm-0-image-0", 1),
                                                  ("renderer0-mm-0-image-1", 2)])])
    assert len(listing) == 2 and all(NAME_RE.match(n) for n in listing)
    loads0 = metric("mmshm_epd_loads_total", server="vllm")
    # the consumer's counter is elsewhere: its names differ, its content does not
    req = request("pd-0", [("renderer0-mm-9-image-0", 1), ("renderer0-mm-9-image-1", 2)])
    out, loads = schedule(sched, [req])
    assert loads == [[True, True]]
    cache, ec_out = load_step(out)
    assert set(cache) == {"renderer0-mm-9-image-0", "renderer0-mm-9-image-1"}
    assert torch.equal(cache["renderer0-mm-9-image-0"], encoder_output(1))
    assert torch.equal(cache["renderer0-mm-9-image-1"], encoder_output(2))
    assert metric("mmshm_epd_loads_total", server="vllm") - loads0 == 2
    # the worker's counts reach the scheduler (vLLM's worker metadata), then
    # vLLM's stats and the connector's Prometheus hook
    wmeta = ec_out.ec_connector_worker_meta
    assert wmeta.counts["loads"] == 2
    assert wmeta.counts["loaded_bytes"] == 2 * ROWS * WIDTH * 4
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wmeta))
    stats = sched.get_ec_connector_stats()
    assert stats.data["hits"] == 2 and stats.data["loads"] == 2
    reg = CollectorRegistry()

    def bound(kind):  # vLLM's metric types, registered in a private registry
        return type(kind.__name__, (kind,), {"__init__": lambda self, *a, **kw:
                                             kind.__init__(self, *a, registry=reg, **kw)})

    class Prom(ECConnectorProm):
        _gauge_cls, _counter_cls, _histogram_cls = bound(Gauge), bound(Counter), bound(Histogram)

    prom = Prom(vllm_config("ec_consumer", shm_dir), ["model_name", "engine"],
                {0: ["tiny", "0"]})
    assert type(prom.prom_metrics).__name__ == "MmshmECPromMetrics"
    # what vLLM's frontend gets: SchedulerStats.ec_connector_stats = stats.data
    prom.observe(pickle.loads(pickle.dumps(stats.data)), 0)
    assert metric("vllm:mmshm_ec_loads_total", reg, engine="0") == 2
    assert metric("vllm:mmshm_ec_bytes_total", reg, direction="loaded") == 2 * ROWS * WIDTH * 4
    # freed: the scheduler's references go, then the worker's views
    for i in range(2):
        sched.update_state_after_free(req, i)
    sched.request_finished(req)
    del cache
    gc.collect()


def test_counter_names_of_other_content_are_not_confused(produced, consumer, shm_dir):
    sched, _ = consumer
    produced.ask("encode", [("enc-0", [("renderer0-mm-0-image-0", 1)])])
    missing0 = fallbacks("missing")
    # the same name as the encoder's item, another photo: a miss, encoded here
    other = request("pd-0", [("renderer0-mm-0-image-0", 7)])
    out, loads = schedule(sched, [other])
    assert loads == [[False]] and out.ec_connector_metadata.loads == []
    assert fallbacks("missing") - missing0 == 1
    cache, _ = load_step(out)
    assert cache == {}
    sched.request_finished(other)
    # the encoder's photo under any name still loads its own output
    same = request("pd-1", [("renderer0-mm-3-image-0", 1)])
    out, loads = schedule(sched, [same])
    assert loads == [[True]]
    cache, _ = load_step(out)
    assert torch.equal(cache["renderer0-mm-3-image-0"], encoder_output(1))
    sched.request_finished(same)
    del cache
    gc.collect()


def test_an_aborted_request_gives_its_references_back(produced, consumer, shm_dir):
    from tests.harness.segments import refcount

    sched, _ = consumer
    (name,) = produced.ask("encode", [("enc-0", [("a", 4)])])
    assert refcount(name, shm_dir) == 1  # the producer's
    req = request("pd-0", [("b", 4)])
    sched.ensure_cache_available(req, 0)
    assert sched.has_cache_item("b") and refcount(name, shm_dir) == 2
    sched.request_finished(req)  # aborted before it was scheduled
    assert not sched.has_cache_item("b") and refcount(name, shm_dir) == 1


def test_a_producer_gone_before_the_lookup_means_a_local_encode(shm_dir, consumer):
    sched, _ = consumer
    p = Producer()
    try:
        p.ask("open", shm_dir, 60.0)
        (name,) = p.ask("encode", [("enc-0", [("x", 5)])])
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.join(20)
        assert reaper.reap(shm_dir).reasons["killed"] == 1
        assert segment_files(shm_dir) == []
        missing0 = fallbacks("missing")
        req = request("pd-0", [("y", 5)])
        out, loads = schedule(sched, [req])
        # vLLM encodes it here; nothing for the failure path to fail
        assert loads == [[False]] and out.ec_connector_metadata.loads == []
        assert fallbacks("missing") - missing0 == 1
        assert sched.take_unavailable_requests() == set()
        sched.request_finished(req)
    finally:
        p.stop()


def test_a_held_entry_outlives_its_producer(shm_dir, consumer):
    sched, _ = consumer
    p = Producer()
    try:
        p.ask("open", shm_dir, 60.0)
        p.ask("encode", [("enc-0", [("x", 6)])])
        req = request("pd-0", [("y", 6)])
        sched.ensure_cache_available(req, 0)  # held from here
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.join(20)
        assert reaper.reap(shm_dir).reclaimed == 0
        out, loads = schedule(sched, [req])
        assert loads == [[True]]
        cache, _ = load_step(out)
        assert torch.equal(cache["y"], encoder_output(6))
        sched.request_finished(req)
        del cache
        gc.collect()
        assert reaper.reap(shm_dir).reasons["killed"] == 1
    finally:
        p.stop()


def test_two_requests_of_one_item_each_get_it(produced, consumer, shm_dir):
    """Content-hash identifiers (processor cache on): two requests name the
    item alike. The second one loads it even after the first let go."""
    sched, _ = consumer
    produced.ask("encode", [("enc-0", [("sha-1", 8)])])
    a, b = request("pd-a", [("sha-1", 8)]), request("pd-b", [("sha-1", 8)])
    sched.ensure_cache_available(a, 0)
    sched.ensure_cache_available(b, 0)
    assert sched.has_cache_item("sha-1")
    sched.request_finished(a)  # aborted; b was waiting
    out, loads = schedule(sched, [b])
    assert loads == [[True]]
    cache, _ = load_step(out)
    assert torch.equal(cache["sha-1"], encoder_output(8))
    sched.request_finished(b)
    del cache
    gc.collect()


def test_on_a_device_the_worker_copies_with_arena_to_device(produced, consumer, shm_dir,
                                                             monkeypatch):
    """A worker on a device platform: each loaded output goes to vLLM's device
    through ``mmshm.segments.arena.to_device`` (counted and timed in
    ``mmshm_gpu_copy_*{direction="h2d"}``) and the worker's view of the segment
    is given back right after the copy. No GPU here: the platform's device is
    torch's ``meta`` device, so the path, the device and the counters are
    real and the bytes are not compared on it (they are on CPU, above)."""
    from vllm.platforms import current_platform

    from tests.harness.segments import refcount

    sched, _ = consumer
    (name,) = produced.ask("encode", [("enc-0", [("renderer0-mm-0-image-0", 3)])])
    monkeypatch.setattr(current_platform, "device_type", "meta")
    bytes0 = metric("mmshm_gpu_copy_bytes_total", direction="h2d")
    timed0 = metric("mmshm_gpu_copy_seconds_count", direction="h2d")
    req = request("pd-0", [("renderer0-mm-5-image-0", 3)])
    out, loads = schedule(sched, [req])
    assert loads == [[True]]
    cache, ec_out = load_step(out)
    t = cache["renderer0-mm-5-image-0"]
    assert t.device.type == "meta" and t.dtype == torch.float32
    assert tuple(t.shape) == (ROWS, WIDTH)
    assert metric("mmshm_gpu_copy_bytes_total", direction="h2d") - bytes0 == ROWS * WIDTH * 4
    assert metric("mmshm_gpu_copy_seconds_count", direction="h2d") - timed0 == 1
    assert ec_out.ec_connector_worker_meta.counts["loads"] == 1
    gc.collect()
    assert refcount(name, shm_dir) == 2  # the producer's and the scheduler's: not the view's
    sched.request_finished(req)
    assert refcount(name, shm_dir) == 1
    del cache, t


# -- failures per request --------------------------------------------------------------
def test_an_entry_removed_under_a_held_entry_is_encoded_locally(produced, consumer, shm_dir):
    """A third party removes the held entry's file before vLLM schedules the
    item: ``has_cache_item`` says no (the item is encoded here, counted
    ``segment_gone``), the scheduler's reference is given back."""
    from tests.harness.segments import refcount

    sched, _ = consumer
    (name,) = produced.ask("encode", [("enc-0", [("a", 11)])])
    req = request("pd-0", [("b", 11)])
    assert sched.ensure_cache_available(req, 0) is True
    assert refcount(name, shm_dir) == 2
    path, away = os.path.join(shm_dir, name), os.path.join(shm_dir, "moved-by-a-third-party")
    os.rename(path, away)  # removed from its name (and kept here to count on it)
    try:
        gone0 = fallbacks("segment_gone")
        out, loads = schedule(sched, [req])
        assert loads == [[False]] and out.ec_connector_metadata.loads == []
        assert fallbacks("segment_gone") - gone0 == 1
        assert sched._holds.held == {} and sched.take_unavailable_requests() == set()
        assert refcount("moved-by-a-third-party", shm_dir) == 1  # the producer's only
    finally:
        os.rename(away, path)
    sched.request_finished(req)


def test_a_failed_worker_load_fails_its_request_and_the_engine_goes_on(produced, consumer,
                                                                       shm_dir):
    """The file goes between the scheduler's decision and the worker's load:
    the worker raises nothing (zeros fill the step's slot), its worker
    metadata names the request, and the scheduler returns it from
    ``take_unavailable_requests`` (vLLM fails it). No reference of the
    worker's stays; the next request is loaded; a later request naming the
    failed item (vLLM may still hold the zeros) is failed too until vLLM asks
    the connector for the item again."""
    from tests.harness.segments import refcount

    sched, _ = consumer
    (name,) = produced.ask("encode", [("enc-0", [("sha-a", 12)])])
    req = request("pd-0", [("sha-a", 12)])
    out, loads = schedule(sched, [req])
    assert loads == [[True]]
    path, away = os.path.join(shm_dir, name), os.path.join(shm_dir, "moved-by-a-third-party")
    os.rename(path, away)  # after the scheduler's check, before the worker's load
    # a worker of another process opens the name (this one's scheduler still has the
    # segment open: its table would hand it over): a name nobody has open here
    meta = out.ec_connector_metadata
    meta.loads = [(rid, h, handle._replace(name=handle.name[:-1] + (
        "0" if handle.name[-1] != "0" else "1"))) for rid, h, handle in meta.loads]
    try:
        failed0 = fallbacks("load_failed")
        cache, ec_out = load_step(out)  # no exception: the engine lives
        t = cache["sha-a"]
        assert tuple(t.shape) == (ROWS, WIDTH) and not t.any()
        wmeta = ec_out.ec_connector_worker_meta
        assert wmeta.failed == {"pd-0": "sha-a"} and wmeta.counts["load_failed"] == 1
        assert fallbacks("load_failed") - failed0 == 1
        assert sched.take_unavailable_requests() == set()  # vLLM asks before the output
        sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=wmeta))
        assert sched.take_unavailable_requests() == {"pd-0"}
        assert sched.take_unavailable_requests() == set()
        # a later request naming the item while vLLM may hold its zeros: failed as well
        again = request("pd-1", [("sha-a", 12)])
        assert sched.ensure_cache_available(again, 0) is False
        assert sched.take_unavailable_requests() == {"pd-1"}
        sched.request_finished(again)
        # one whose KV already holds the item needs no output of it: left alone
        past = request("pd-9", [("sha-a", 12)])
        assert sched.ensure_cache_available(past, 4 + ROWS + 2) is True
        assert sched.take_unavailable_requests() == set()
        sched.request_finished(past)
        sched.request_finished(req)  # vLLM's FINISHED_ERROR frees it
        assert sched._holds.held == {}
        del cache, t
        gc.collect()
        assert refcount("moved-by-a-third-party", shm_dir) == 1  # the producer's only
    finally:
        os.rename(away, path)
    # the next request is served: another photo, loaded
    produced.ask("encode", [("enc-1", [("sha-b", 13)])])
    nxt = request("pd-2", [("sha-b", 13)])
    out, loads = schedule(sched, [nxt])
    assert loads == [[True]]
    cache, ec_out = load_step(out)
    assert torch.equal(cache["sha-b"], encoder_output(13))
    assert not ec_out.ec_connector_worker_meta.failed
    sched.request_finished(nxt)
    # vLLM asks for the failed item again once it holds no output of it: the poison goes
    assert sched.has_cache_item("sha-a") is False
    later = request("pd-3", [("sha-a", 12)])
    assert sched.ensure_cache_available(later, 0) is True
    sched.request_finished(later)
    del cache
    gc.collect()


def test_the_directory_setting_need_not_be_mmshm_dir(shm_dir, tmp_path, monkeypatch):
    """``ec_connector_extra_config.directory`` is the store's directory while
    ``MMSHM_DIR`` names another: the worker loads the producer's bytes (a
    handle names the node of the directory it lives in)."""
    p = Producer()
    other = tmp_path / "elsewhere"
    other.mkdir(mode=0o700)
    try:
        assert p.ask("open", shm_dir, 60.0) == "MmshmECConnector"
        p.ask("encode", [("enc-0", [("renderer0-mm-0-image-0", 14)])])
        monkeypatch.setenv("MMSHM_DIR", str(other))
        config.reload()
        vc = vllm_config("ec_consumer", shm_dir)
        ec_transfer_state.ensure_ec_transfer_initialized(vc)
        sched = ECConnectorFactory.create_connector(vc, ECConnectorRole.SCHEDULER)
        try:
            req = request("pd-0", [("renderer0-mm-4-image-0", 14)])
            out, loads = schedule(sched, [req])
            assert loads == [[True]]
            cache, ec_out = load_step(out)
            assert not ec_out.ec_connector_worker_meta.failed
            assert torch.equal(cache["renderer0-mm-4-image-0"], encoder_output(14))
            sched.request_finished(req)
            del cache
            gc.collect()
        finally:
            sched.shutdown()
            ec_transfer_state.ensure_ec_transfer_shutdown()
        assert p.ask("close") == "closed"
    finally:
        p.stop()
    assert os.listdir(other) == []


# -- across nodes: the Mooncake Store leg (a stand-in engine) ---------------------------
@pytest.fixture
def store_leg(monkeypatch):
    """The Store leg on a stand-in engine (tests/test_ec_store.py's
    ``FakeEngine``, a dict): ``(engine, extra)``, ``extra`` the connector's
    Store settings; what the connector's ``open_tier`` starts is closed with
    the connector."""
    import socket

    from mmshm.transport import ec_store
    from tests.test_ec_store import FakeEngine

    srv = socket.create_server(("127.0.0.1", 0))  # the tier's TCP probe of the "master"
    eng = FakeEngine()
    monkeypatch.setattr(ec_store, "_probe_http", lambda url, timeout: None)
    monkeypatch.setattr(ec_store, "load_engine", lambda: (lambda: eng))
    extra = {"master_server_address": f"127.0.0.1:{srv.getsockname()[1]}",
             "local_hostname": "127.0.0.1", "local_buffer_size": "1MB",
             "store_read_buffer_bytes": "1MB", "store_timeout_s": 0.5}
    yield eng, extra
    eng.gate.set()
    srv.close()


def test_a_consumer_on_another_node_defers_its_request_while_the_store_is_asked(
        shm_dir, store_leg):
    """vLLM's scheduler calls on a consumer whose node has no entry: the
    request is "still in transit" (``ensure_cache_available`` False, vLLM
    skips it this step) until the reader thread published the Store's
    object in this node's shared memory; then it is held and the worker
    loads the encoder's bytes. Content the Store never got: deferred too,
    then encoded here, counted ``store_absent`` once."""
    from mmshm.transport import ec_store

    eng, extra = store_leg
    tc = ECTransferConfig(ec_connector="MmshmECConnector", ec_connector_module_path=MODULE,
                          ec_role="ec_consumer",
                          ec_connector_extra_config={"directory": shm_dir, **extra})
    vc = SimpleNamespace(ec_transfer_config=tc, model_config=SimpleNamespace(
        model="tiny-qwen2-vl", dtype=torch.float32))
    ec_transfer_state.ensure_ec_transfer_initialized(vc)
    sched = ECConnectorFactory.create_connector(vc, ECConnectorRole.SCHEDULER)
    assert ec_transfer_state.get_ec_transfer()._tier is None  # a consumer's worker: no client
    encoder = ec_store.from_config(extra)  # node A's encoder put the first photo's output
    before = fallbacks("store_absent")
    try:
        req = request("pd-0", [("img-a", 21), ("img-b", 22)])
        keys = sched._keys_of(req)
        assert encoder.put(keys[0], encoder_output(21)) and encoder.flush(5)
        assert sched.ensure_cache_available(req, 0) is False  # in transit: skipped this step
        for _ in range(500):
            if sched.ensure_cache_available(req, 0):
                break
            time.sleep(0.01)
        else:
            pytest.fail("still in transit after 5 s")
        assert [sched.has_cache_item(f.identifier) for f in req.mm_features] == [True, False]
        for i in range(2):
            sched.update_state_after_alloc(req, i)
        out = SimpleNamespace(ec_connector_metadata=sched.build_connector_meta(None),
                              finished_req_ids=set())
        cache, ec_out = load_step(out)
        assert torch.equal(cache["img-a"], encoder_output(21)) and "img-b" not in cache
        stats = sched.get_ec_connector_stats().data
        assert stats["hits"] == 1 and stats["fallback_store_absent"] == 1, stats
        assert fallbacks("store_absent") - before == 1
        assert eng.gets == 1
        sched.request_finished(req)
        del cache
        gc.collect()
    finally:
        encoder.close()
        sched.shutdown()
        ec_transfer_state.ensure_ec_transfer_shutdown()
    assert [n for n in os.listdir(shm_dir) if NAME_RE.match(n)] == []


# -- a key that cannot give another answer -----------------------------------------------
def lora_request(request_: Request, name: str, path: str) -> Request:
    from vllm.lora.request import LoRARequest

    request_.lora_request = LoRARequest(name, abs(hash(name)) % 1000 + 1, path)
    return request_


def model_config(model: str, **kw) -> SimpleNamespace:
    return SimpleNamespace(model=model, dtype=torch.float32, revision=None, hf_overrides={},
                           quantization=None, hf_config=None, multimodal_config=None, **kw)


def tower_config(role: str, directory: str, tower_lora: bool = True) -> SimpleNamespace:
    vc = vllm_config(role, directory)
    vc.lora_config = SimpleNamespace(enable_tower_connector_lora=tower_lora)
    return vc


def test_the_key_folds_the_adapter_when_tower_lora_is_on(shm_dir):
    """With ``enable_tower_connector_lora`` the encoder output depends on the
    request's adapter (vLLM keys its own encoder cache ``<lora>:<mm_hash>``):
    what adapter A's request published is never loaded for adapter B's (a
    miss, encoded here), and a request whose adapter cannot be read is not
    keyed at all (counted ``unkeyed``). Without tower LoRA the adapter does
    not matter."""
    from mmshm.transport.encoder_cache import EncoderCache

    from mmshm.integrations.vllm import epd

    sched = ECConnectorFactory.create_connector(tower_config("ec_consumer", shm_dir),
                                                ECConnectorRole.SCHEDULER)
    plain = ECConnectorFactory.create_connector(tower_config("ec_consumer", shm_dir, False),
                                                ECConnectorRole.SCHEDULER)
    store = EncoderCache(shm_dir, keep_s=60)
    try:
        # vLLM names the items <lora_name>:<mm_hash> under tower LoRA
        a = lora_request(request("pd-a", [("adapter-a:x", 21)]), "adapter-a", "/adapters/a")
        b = lora_request(request("pd-b", [("adapter-b:x", 21)]), "adapter-b", "/adapters/b")
        (key_a,) = sched._keys_of(a)
        (key_b,) = sched._keys_of(b)
        assert key_a != key_b
        assert plain._keys_of(a) == plain._keys_of(b)  # tower LoRA off: one key
        store.save(key_a, encoder_output(21), label="x")
        _, loads = schedule(sched, [b])
        assert loads == [[False]]  # adapter B never gets adapter A's output
        _, loads = schedule(sched, [a])
        assert loads == [[True]]
        unkeyed0 = fallbacks("unkeyed")
        nameless = lora_request(request("pd-c", [(":x", 21)]), "", "/adapters/a")
        assert sched._keys_of(nameless) == [None]
        _, loads = schedule(sched, [nameless])
        assert loads == [[False]] and fallbacks("unkeyed") - unkeyed0 == 1
        for r in (a, b, nameless):
            sched.request_finished(r)
        assert epd.adapter_of(a, True) != epd.adapter_of(b, True)
    finally:
        store.close()
        sched.shutdown()
        plain.shutdown()


def _snapshot(root, commit: str, weights: bytes = b"w" * 64):
    """An HF cache layout: ``models--org--tiny/snapshots/<commit>/`` and
    ``refs/main``."""
    repo = root / "models--org--tiny"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"vision_config": {"depth": 2}}')
    (snap / "model.safetensors").write_bytes(weights)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


def test_the_namespace_is_the_weights_not_their_spelling(tmp_path, monkeypatch):
    """The default namespace: the same weights under two spellings meet (a
    hub id cached here, its snapshot path, a symlink to it; a local
    directory and a symlink to it), changed weights do not (another
    snapshot commit; a local directory whose weights were rewritten), nor do
    another dtype, revision, ``--hf-overrides`` or quantization."""
    from mmshm.integrations.vllm.epd import ec_namespace

    def ns(model, **kw):
        return ec_namespace(SimpleNamespace(model_config=model_config(model, **kw)), {})

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    snap = _snapshot(cache, "a" * 40)
    link = tmp_path / "tiny-link"
    link.symlink_to(snap)
    by_id, by_path, by_link = ns("org/tiny"), ns(str(snap)), ns(str(link))
    assert by_id == by_path == by_link and "snapshot:" + "a" * 40 in by_id
    other = _snapshot(tmp_path / "other", "b" * 40)
    assert ns(str(other)) != by_path  # another commit: other weights
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text('{"vision_config": {"depth": 2}}')
    (local / "model.safetensors").write_bytes(b"w" * 64)
    (tmp_path / "local-link").symlink_to(local)
    first = ns(str(local))
    assert first == ns(str(tmp_path / "local-link")) and "files:" in first
    (local / "model.safetensors").write_bytes(b"v" * 65)  # a rolling update
    assert ns(str(local)) != first
    changed = ns(str(local))
    assert ns(str(local), ) == changed
    assert ns(str(local), ).replace("float32", "bfloat16") != changed
    m = model_config(str(local))
    for field, value in (("revision", "v2"), ("hf_overrides", {"vision_config": {"x": 1}}),
                         ("quantization", "fp8")):
        setattr(m, field, value)
        assert ec_namespace(SimpleNamespace(model_config=m), {}) != changed, field
    # the user's own namespace wins
    assert ec_namespace(SimpleNamespace(model_config=m), {"namespace": "mine"}) == "mine"


def test_a_withheld_stand_in_is_never_keyed():
    """A decode instance's stand-in for a withheld tensor (empty) is never
    keyed: every withheld item of a grid would share one key."""
    from mmshm.integrations.vllm import epd, pd

    req = request("pd-0", [("x", 31)])
    feature = req.mm_features[0]
    assert epd.item_key(feature, "ns", "", "pixels") is not None
    elem = feature.data["pixel_values"]
    elem.data = pd.withheld_tensor("float32", tuple(elem.data.shape))
    assert epd.item_key(feature, "ns", "", "pixels") is None
    assert epd.item_key(feature, "ns", "", "mm_hash") is None


def test_the_engine_core_reuses_the_frontends_digest(shm_dir):
    """Items keyed by their tensors: where mmshm's frontend hashed a tensor
    while copying it (its segment's handle carries the digest), the
    EngineCore's key reads no byte of it (``hashed_bytes`` 0) and equals the
    key of the bytes; a digest that disagrees gives another key (it is what
    the key is made of). With vLLM's ``mm_hash`` as the key nothing is
    hashed either."""
    import blake3

    from mmshm.segments.codec import HandleMeta
    from mmshm.transport import sending
    from mmshm.transport.ec_connector import new_counts

    from mmshm.integrations.vllm import epd

    req = request("pd-0", [("x", 32)])
    feature = req.mm_features[0]
    counts = new_counts()
    plain_key = epd.item_key(feature, "ns", "", "pixels", counts)
    assert counts["hashed_bytes"] == ROWS * 4 * 1176 * 4 + 3 * 8
    pv = feature.data["pixel_values"].data
    digest = blake3.blake3(pv.contiguous().view(torch.uint8).numpy()).digest(16)
    meta = HandleMeta("mmshm-1-0000000000000000", pv.nbytes, 0, tuple(pv.shape), digest)
    sending.SEGMENTS.put(pv, (b"", meta, shm_dir))
    try:
        counts = new_counts()
        assert epd.item_key(feature, "ns", "", "pixels", counts) == plain_key
        assert counts["hashed_bytes"] == 3 * 8  # the grid only (inline, 24 bytes)
        sending.SEGMENTS.put(pv, (b"", meta._replace(hash=b"\0" * 16) if hasattr(
            meta, "_replace") else HandleMeta(meta.name, meta.nbytes, 0, meta.shape,
                                             b"\0" * 16), shm_dir))
        assert epd.item_key(feature, "ns", "", "pixels") != plain_key
    finally:
        sending.SEGMENTS.drop(pv)
    counts = new_counts()
    k1 = epd.item_key(feature, "ns", "", "mm_hash", counts)
    assert counts["hashed_bytes"] == 0 and k1 != plain_key
    assert epd.item_key(feature, "ns", "adapter", "mm_hash") != k1


def test_the_on_line_names_the_namespace_and_directory(shm_dir, caplog):
    """Each process's connector says its "on:" line once: its role, the
    namespace (weights, dtype, key mode...) and the segment directory, so an
    operator can compare the two instances of a pair."""
    import logging

    from mmshm.hooks import report

    report._reset_for_tests()
    with caplog.at_level(logging.INFO, logger="mmshm"):
        c = ECConnectorFactory.create_connector(vllm_config("ec_consumer", shm_dir),
                                                ECConnectorRole.SCHEDULER)
        c.shutdown()
    lines = [r.getMessage() for r in caplog.records if "EC connector (scheduler)" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert ": on: encoder outputs loaded through shared memory (ec_consumer)" in lines[0]
    assert "weights=id:tiny-qwen2-vl@main dtype=float32" in lines[0] and "key=pixels" in lines[0]
    assert shm_dir in lines[0]
    report._reset_for_tests()


@pytest.mark.parametrize("keep_s", ["abc", -1, float("nan")])
def test_a_bad_keep_time_setting_is_said_and_never_stops_the_server(shm_dir, caplog, keep_s):
    """A ``keep_s`` in ``ec_connector_extra_config`` that is no number at
    least 0: one WARNING naming the key and the value, the default used, and
    the connector (so the server) starts."""
    import logging

    from mmshm.transport.encoder_cache import DEFAULT_KEEP_S

    with caplog.at_level(logging.WARNING, logger="mmshm"):
        c = ECConnectorFactory.create_connector(vllm_config("ec_consumer", shm_dir, keep_s),
                                                ECConnectorRole.SCHEDULER)
    try:
        assert c._store.keep_s == DEFAULT_KEEP_S
        said = [r.getMessage() for r in caplog.records if "keep_s" in r.getMessage()]
        assert len(said) == 1 and repr(keep_s) in said[0], said
    finally:
        c.shutdown()


def test_importing_the_integration_imports_neither_vllm_nor_the_connector():
    """Only vLLM's factory imports the connector's file (it imports vLLM);
    importing mmshm's vLLM integration does neither, here where vLLM is
    installed."""
    import subprocess
    import sys

    code = ("import sys, mmshm.integrations.vllm; "
            "print('vllm' in sys.modules, 'mmshm.integrations.vllm.epd' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "False"], r.stdout + r.stderr
