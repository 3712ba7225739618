"""Bench modes that run vLLM's own transport code (written for vLLM 0.33.0).

Registered by :mod:`mmshm.bench.modes` in every interpreter, they run only
where ``vllm`` is importable and are reported as skipped otherwise (see
:meth:`VllmMode.unavailable`), e.g.::

    .venvs/vllm-0.33.0/bin/python -m mmshm.cli bench --modes inline,vllm,vllm-arena,mmshm

Both take vLLM's path from the frontend to every TP worker:

* **producer -> TP rank 0** (frontend -> EngineCore): the bench's request
  becomes a ``vllm.v1.engine.EngineCoreRequest`` whose ``mm_features`` hold
  one ``MultiModalFeatureSpec`` per image (``pixel_values`` and
  ``image_grid_thw`` in a ``MultiModalKwargsItem``); ``n > 1`` fans out into
  ``n`` child requests with ``vllm.v1.engine.parallel_sampling.ParentRequest``
  as ``AsyncLLM.add_request`` does (shallow copies sharing the tensors); each
  child is encoded by ``vllm.v1.serial_utils.MsgpackEncoder`` (the default
  ``direct_rpc`` IPC: every tensor above 256 bytes becomes an out-of-band
  frame) and TP rank 0 decodes it with ``MsgpackDecoder(EngineCoreRequest)``,
  zero-copy over the received message, as ``EngineCoreProc`` does. vLLM sends
  the frames as one ZMQ multipart message; the bench's socket carries one
  frame per message, so the frames are joined behind a small length header
  (one copy of the pixels on the producer that vLLM does not make; ``inline``
  makes the same one when it pickles). Rank 0 turns the decoded request back
  into the bench's :class:`~mmshm.bench.requests.Req` (no copy of the pixels).
* **TP rank 0 -> every TP rank** (EngineCore -> workers):
  ``vllm.distributed.device_communicators.shm_broadcast.MessageQueue``, the
  queue ``MultiprocExecutor`` broadcasts ``SchedulerOutput`` on, with rank 0
  as its writer (``enqueue``) and the other ranks as its local readers
  (``dequeue``). It is made once per TP group on the first broadcast: the
  writer creates it with ``MultiprocExecutor``'s chunk size
  (``VLLM_MQ_MAX_CHUNK_BYTES_MB``, 16 MiB: the metadata fits a chunk, a
  720p image does not) and exports its handle, which reaches the readers
  through ``torch.distributed.broadcast_object_list`` over the TP group;
  readers attach with ``MessageQueue.create_from_handle`` and everybody meets
  in ``wait_until_ready`` (in the warm-up run, unless ``--no-warmup``; the
  timed transfer is ``enqueue`` / ``dequeue`` alone).

Importing vLLM adds half a million objects to a process's heap; they are
frozen at once with vLLM's ``freeze_gc_heap`` (as its EngineCore and workers
do after start-up), or every later ``gc.collect()`` of the bench would scan
them. mmshm's own vLLM instrumentor, if active, leaves these encoders and
queues alone (it acts on the ``MPClient``'s encoder and ``MultiprocExecutor``'s
queue only).

``broadcast_bytes`` counts what rank 0's ``enqueue`` put on the queue: the
bytes written into the ring buffer's chunk, or, for a message that overflows
it, the frames sent on the queue's ZMQ socket. The bench's TP rank counts the
bytes passed to ``torch.distributed.broadcast``, which the MessageQueue never
calls, so these are added to that count. Copies into the tensor arena are
shared-memory writes (as mmshm's ``wrap``) and are not counted.

Clean-up: the writer removes the names of the ring buffer and of the arena
from /dev/shm as soon as every reader has attached (``wait_until_ready``
returned; the mappings stay valid), so nothing stays there even if a TP rank
is killed; the queue's ZMQ sockets are closed, and the files of the writer's
``ipc://`` endpoints (which libzmq leaves in /tmp) removed, when a rank exits.
Single-node only: every reader is a local (shared-memory) reader, ``--nodes``
notwithstanding.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import gc
import os
import struct
import time
import types
import warnings
from typing import ClassVar

from .modes import Mode, _items, import_failure, register
from .requests import IMAGE_PAD, MultimodalDataItem, MultimodalInputs, Req
from .worker import count_broadcast_bytes

VLLM_VERSION = "0.33.0"
# MultiprocExecutor's rpc_broadcast_mq: VLLM_MQ_MAX_CHUNK_BYTES_MB (16) MiB chunks,
# MessageQueue's default of 10 chunks
MQ_CHUNK_BYTES = 16 * 1024 * 1024
MQ_CHUNKS = 10
# bound on every wait for the other side of the queue (the bench's default --timeout)
WAIT_S = 300.0
_SHM_PATH = "/dev/shm"
_HEADER = struct.Struct("<Q")

_VLLM: dict[str, types.SimpleNamespace] = {}


def load_vllm() -> types.SimpleNamespace:
    """The vLLM classes and modules these modes run (imported once). Raises
    ImportError (or whatever vLLM raises on import) when vLLM cannot be
    imported or lacks one of them."""
    if "ns" not in _VLLM:
        import importlib
        import importlib.metadata
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ImportError("vllm is not installed in this interpreter")
        serial = importlib.import_module("vllm.v1.serial_utils")
        shm = importlib.import_module("vllm.distributed.device_communicators.shm_broadcast")
        engine = importlib.import_module("vllm.v1.engine")
        sampling = importlib.import_module("vllm.v1.engine.parallel_sampling")
        mm = importlib.import_module("vllm.multimodal.inputs")
        params = importlib.import_module("vllm.sampling_params")
        gc_utils = importlib.import_module("vllm.utils.gc_utils")
        ns = types.SimpleNamespace(
            version=importlib.metadata.version("vllm"),
            MsgpackEncoder=serial.MsgpackEncoder, MsgpackDecoder=serial.MsgpackDecoder,
            MessageQueue=shm.MessageQueue, check_shm_free_space=shm.check_shm_free_space,
            EngineCoreRequest=engine.EngineCoreRequest, ParentRequest=sampling.ParentRequest,
            SamplingParams=params.SamplingParams,
            MultiModalFeatureSpec=mm.MultiModalFeatureSpec,
            MultiModalKwargsItem=mm.MultiModalKwargsItem,
            MultiModalFieldElem=mm.MultiModalFieldElem,
            MultiModalBatchedField=mm.MultiModalBatchedField,
            PlaceholderRange=mm.PlaceholderRange,
        )
        gc_utils.freeze_gc_heap()  # see the module docstring
        _VLLM["ns"] = ns
    return _VLLM["ns"]


def load_vllm_arena():
    """``vllm.distributed.device_communicators.shm_tensor_arena`` (vLLM's
    opt-in tensor arena of ``MessageQueue(enable_shm_tensor_arena=True)``)."""
    import importlib
    import inspect

    v = load_vllm()
    if "enable_shm_tensor_arena" not in inspect.signature(v.MessageQueue).parameters:
        raise ImportError(f"vLLM {v.version}'s MessageQueue has no enable_shm_tensor_arena")
    return importlib.import_module("vllm.distributed.device_communicators.shm_tensor_arena")


# -- request conversion (producer and TP rank 0) -------------------------------------
def to_engine_request(v, req: Req, n: int):
    """The bench's request as the ``EngineCoreRequest`` vLLM's frontend would
    send (the tensors are shared, not copied); ``image_grid_thw`` stays plain
    ints, as in the bench's requests."""
    pads = [i for i, t in enumerate(req.input_ids) if t == IMAGE_PAD]
    feats = []
    for j, it in enumerate(_items(req)):
        grid = list(it.image_grid_thw) if it.image_grid_thw else []
        item = v.MultiModalKwargsItem({
            "pixel_values": v.MultiModalFieldElem(data=it.feature,
                                                  field=v.MultiModalBatchedField()),
            "image_grid_thw": v.MultiModalFieldElem(data=grid,
                                                    field=v.MultiModalBatchedField()),
        })
        h = it.hash.hex()
        feats.append(v.MultiModalFeatureSpec(
            data=item, modality=it.modality, identifier=h, mm_hash=h,
            mm_position=v.PlaceholderRange(offset=pads[j] if j < len(pads) else 0, length=1)))
    return v.EngineCoreRequest(
        request_id=req.rid, prompt_token_ids=list(req.input_ids), mm_features=feats,
        sampling_params=v.SamplingParams(n=n, max_tokens=1), pooling_params=None,
        arrival_time=time.time(), lora_request=None, cache_salt=None,
        data_parallel_rank=None, external_req_id=req.rid)


def from_engine_request(request) -> Req:
    """The bench's request back from a decoded ``EngineCoreRequest`` (the
    tensors are the decoder's, not copied)."""
    items = []
    for f in request.mm_features or ():
        d = f.data
        grid = d["image_grid_thw"].data if "image_grid_thw" in d else None
        items.append(MultimodalDataItem(
            modality=f.modality, hash=bytes.fromhex(f.mm_hash), feature=d["pixel_values"].data,
            image_grid_thw=tuple(int(g) for g in grid) if grid else None))
    sp = request.sampling_params
    return Req(rid=request.request_id, mm_inputs=MultimodalInputs(mm_items=items),
               input_ids=list(request.prompt_token_ids or ()), n=sp.n if sp is not None else 1)


def join_frames(frames) -> bytes:
    """One message holding ``frames``: their count and lengths, then the frames."""
    lens = [memoryview(f).nbytes for f in frames]
    head = struct.pack(f"<{len(lens) + 1}Q", len(lens), *lens)
    return b"".join((head, *frames))


def split_frames(msg) -> list[memoryview]:
    """The frames of a :func:`join_frames` message, as views of it."""
    mv = memoryview(msg)
    (count,) = _HEADER.unpack_from(mv, 0)
    lens = struct.unpack_from(f"<{count}Q", mv, _HEADER.size)
    off = _HEADER.size * (count + 1)
    out = []
    for n in lens:
        out.append(mv[off:off + n])
        off += n
    if off != mv.nbytes:
        raise ValueError(f"message of {mv.nbytes} bytes, frames end at {off}")
    return out


# -- the MessageQueue of a TP group (every TP rank) ----------------------------------
def _chunk_bytes(buf) -> int:
    """Bytes ``MessageQueue.enqueue`` wrote into a ring-buffer chunk: the
    overflow flag alone, or flag, buffer count and each length-prefixed buffer."""
    if buf[0] != 0:
        return 1  # overflow: the message goes on the ZMQ socket
    off = 3
    for _ in range(int.from_bytes(buf[1:3], "big")):
        off += 4 + int.from_bytes(buf[off:off + 4], "big")
    return off


class _CountingSocket:
    """The writer's ZMQ socket, counting the bytes of overflowed messages."""

    def __init__(self, sock, queue: TPQueue):
        self._sock = sock
        self._queue = queue

    def send_multipart(self, frames, *args, **kwargs):
        self._queue.sent += sum(memoryview(f).nbytes for f in frames)
        return self._sock.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class _ReleaseNow(list):
    """A reader arena's ``_pending_release`` that hands a slot back as soon as
    the storage of its tensor is freed.

    vLLM queues the slot when the tensor goes and retires it at the reader's
    next ``dequeue`` (``ShmTensorArena.flush_releases``; without pinned memory
    it marks the slot released at once). A vLLM worker dequeues at every
    engine step, milliseconds later; the bench's readers dequeue once per run,
    after the writer has already looked for free slots, so without this every
    other run would find the slots of the previous one still taken."""

    def __init__(self, arena):
        super().__init__()
        self._arena = arena

    def append(self, idx) -> None:
        super().append(idx)
        self._arena.flush_releases()


def _unlink_names(mq) -> None:
    """Remove the writer's ring buffer and arena from /dev/shm (mappings stay)."""
    for owner in (getattr(mq, "buffer", None), getattr(mq, "tensor_arena", None)):
        shm = getattr(owner, "shared_memory", None)
        if shm is None or not getattr(owner, "is_creator", False):
            continue
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()
        owner.is_creator = False  # its __del__ must not unlink the name again


_LIVE: list[TPQueue] = []


def _close_all() -> None:
    while _LIVE:
        _LIVE.pop().close()


class TPQueue:
    """vLLM's ``MessageQueue`` over one TP group, seen from one rank: the
    writer (rank ``src``) creates it, the other ranks attach to its handle,
    all wait until it is ready (a collective, run once per group).

    Args:
        rank: this rank in ``group``.
        group: the TP group (its ``torch.distributed`` process group).
        src: the writer's rank in ``group``.
        arena: create it with ``enable_shm_tensor_arena=True``.
    """

    def __init__(self, rank: int, group, src: int, arena: bool):
        import torch.distributed as dist
        import zmq

        v = load_vllm()
        world = dist.get_world_size(group)
        self.writer = rank == src
        self.sent = 0
        self.mq = None
        readers = [r for r in range(world) if r != src]
        if self.writer:
            self._keep(v.MessageQueue(world - 1, world - 1, local_reader_ranks=readers,
                                      max_chunk_bytes=MQ_CHUNK_BYTES, max_chunks=MQ_CHUNKS,
                                      enable_shm_tensor_arena=arena))
            box = [self.mq.export_handle()]
        else:
            box = [None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
        if not self.writer:
            self._keep(v.MessageQueue.create_from_handle(box[0], rank))
            # vLLM defers a failed attach to the first read; fail here instead
            for what, owner in (("ring buffer", self.mq.buffer),
                                ("tensor arena", self.mq.tensor_arena)):
                if owner is not None and not hasattr(owner, "shared_memory"):
                    raise RuntimeError(f"TP rank {rank}: the MessageQueue's {what} is gone "
                                       f"from /dev/shm")
            if arena and self.mq.tensor_arena is None:
                raise RuntimeError(f"TP rank {rank}: the MessageQueue has no tensor arena")
        mq = self.mq
        sock = mq.local_socket
        sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))  # a lost rank fails, never hangs
        try:
            mq.wait_until_ready()
        except zmq.Again:
            raise TimeoutError(f"TP rank {rank}: the MessageQueue was not ready within "
                               f"{WAIT_S} s") from None
        finally:
            sock.setsockopt(zmq.RCVTIMEO, -1)
        if self.writer:
            _unlink_names(mq)  # every reader has mapped them
            self._count_writes(mq)
        elif mq.tensor_arena is not None:
            mq.tensor_arena._pending_release = _ReleaseNow(mq.tensor_arena)

    def _keep(self, mq) -> None:
        """Hold ``mq`` and close it when this process exits."""
        self.mq = mq
        _LIVE.append(self)
        if len(_LIVE) == 1:
            atexit.register(_close_all)

    def _count_writes(self, mq) -> None:
        """Count what ``enqueue`` writes into a ring chunk or sends on the socket."""
        acquire = mq.acquire_write

        @contextlib.contextmanager
        def acquire_write(timeout=None):
            with acquire(timeout) as buf:
                yield buf
                self.sent += _chunk_bytes(buf)

        mq.acquire_write = acquire_write
        mq.local_socket = _CountingSocket(mq.local_socket, self)

    def transfer(self, data):
        """Writer: enqueue ``data`` and return it; reader: the dequeued object."""
        if self.writer:
            self.sent = 0
            self.mq.enqueue(data, timeout=WAIT_S)
            count_broadcast_bytes(self.sent)
            return data
        return self.mq.dequeue(timeout=WAIT_S)

    def close(self) -> None:
        """Drop the queue: vLLM's finalizers close its ZMQ sockets and shared
        memory (the names are gone already on the writer); the writer removes
        its ipc:// socket files."""
        mq, self.mq = self.mq, None
        if mq is None:
            return
        _unlink_names(mq)
        with contextlib.suppress(Exception):
            mq.shutdown()
        if isinstance(mq.local_socket, _CountingSocket):
            mq.local_socket = mq.local_socket._sock
        mq.__dict__.pop("acquire_write", None)
        h = mq.export_handle()
        sockets = [h.local_subscribe_addr, h.local_notify_addr] if self.writer else []
        del mq
        gc.collect()
        # libzmq leaves the files of the writer's ipc:// endpoints behind
        for addr in sockets:
            if addr and addr.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(addr[len("ipc://"):])
        with contextlib.suppress(ValueError):
            _LIVE.remove(self)


def _transfer(queue: TPQueue, data):
    return queue.transfer(data)


# -- the modes ------------------------------------------------------------------------
@register
class VllmMode(Mode):
    """vLLM 0.33.0's default transport, run with vLLM's own code (skipped
    where ``vllm`` is not importable).

    Producer: ``vllm.v1.engine.parallel_sampling.ParentRequest`` fans the
    ``EngineCoreRequest`` out into ``n`` children (as
    ``vllm.v1.engine.async_llm.AsyncLLM.add_request``), each encoded by
    ``vllm.v1.serial_utils.MsgpackEncoder`` (the pixels as out-of-band
    frames). TP rank 0: ``vllm.v1.serial_utils.MsgpackDecoder(EngineCoreRequest)``
    (as ``vllm.v1.engine.core.EngineCoreProc``). Broadcast:
    ``vllm.distributed.device_communicators.shm_broadcast.MessageQueue``
    with default options (as ``vllm.v1.executor.multiproc_executor.MultiprocExecutor``'s
    ``rpc_broadcast_mq``): ``enqueue`` pickles the batch with the tensors as
    out-of-band buffers; a message above the 16 MiB chunk overflows to the
    queue's ZMQ PUB socket, so every reader receives the pixels of every copy.
    See :mod:`mmshm.bench.vllm_modes`."""

    name = "vllm"
    summary = "vLLM's MsgpackEncoder/Decoder; MessageQueue (pickle, ZMQ overflow)"
    arena: ClassVar[bool] = False
    warm_up_per_config = True  # the MessageQueue's ring buffer (and arena) stay mapped

    def __init__(self, min_bytes: int | None = None):
        super().__init__(min_bytes)  # no threshold of ours: vLLM's own apply
        self._encoder = None
        self._decoder = None
        self._xfer = _transfer
        self._queues: dict[tuple[int, int], TPQueue] = {}

    @classmethod
    def unavailable(cls) -> str | None:
        def load():
            load_vllm()
            if cls.arena:
                load_vllm_arena()

        return import_failure(load, "vLLM", f"vllm {VLLM_VERSION}",
                              f".venvs/vllm-{VLLM_VERSION}")

    @classmethod
    def estimate(cls, payload, copies, tp):
        # The producer: the request and a joined message per copy in flight;
        # rank 0: the copies received and the overflow frames ZMQ sends from
        # them; every reader: ZMQ's receive and the frames it keeps.
        batch = copies * payload
        return payload + 3 * batch + 3 * batch * max(0, tp - 1), 0

    # -- producer --------------------------------------------------------------------
    def fan_out(self, req, n: int) -> list:
        v = load_vllm()
        request = to_engine_request(v, req, n)
        if n == 1:
            return [request]
        parent = v.ParentRequest(request)  # AsyncLLM.add_request's fan-out
        out = []
        for idx in range(n):
            rid, params = parent.get_child_info(idx)
            child = request if idx == n - 1 else copy.copy(request)
            child.request_id = rid
            child.sampling_params = params
            out.append(child)
        return out

    def dumps(self, req) -> bytes:
        if self._encoder is None:
            self._encoder = load_vllm().MsgpackEncoder()  # as the MPClient's
        return join_frames(self._encoder.encode(req))

    # -- TP rank 0 ---------------------------------------------------------------------
    def loads(self, msg):
        if self._decoder is None:
            v = load_vllm()
            self._decoder = v.MsgpackDecoder(v.EngineCoreRequest)  # as EngineCoreProc's
        frames = split_frames(msg)
        with warnings.catch_warnings():
            # the tensors are views of the received message, which is read-only
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            request = self._decoder.decode(frames)
        return from_engine_request(request)

    # -- scheduler (every TP rank) -----------------------------------------------------
    def broadcast(self, data, rank, dist_group, src=0):
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size(dist_group) == 1:
            return list(data)
        key = (id(dist_group), src)
        q = self._queues.get(key)
        if q is None:  # once per TP group, outside the timed transfer
            q = self._queues[key] = TPQueue(rank, dist_group, src, arena=self.arena)
        return self._xfer(q, data)

    def instrument_broadcast(self, inner):
        self._xfer = inner(_transfer)


@register
class VllmArenaMode(VllmMode):
    """vLLM 0.33.0 with its opt-in tensor arena, run with vLLM's own code
    (skipped where ``vllm`` is not importable).

    As ``vllm``, but the ``MessageQueue`` is created with
    ``enable_shm_tensor_arena=True`` (``--enable-shm-tensor-arena``):
    ``enqueue`` pickles with
    ``vllm.distributed.device_communicators.shm_tensor_arena._ArenaPickler``,
    which copies every contiguous CPU tensor of at least 8 MiB once into a free
    slot of a ``ShmTensorArena`` (8 slots of 256 MiB in /dev/shm) and pickles
    a stub; readers rebuild zero-copy views of the slot. Tensors that find no
    free slot take the default path. A slot is handed back once every reader
    has dropped its tensor (see :class:`_ReleaseNow` for when)."""

    name = "vllm-arena"
    summary = "vLLM's MsgpackEncoder/Decoder; MessageQueue with its shm tensor arena"
    arena = True

    @classmethod
    def unavailable(cls) -> str | None:
        why = super().unavailable()
        if why is not None:
            return why
        sta = load_vllm_arena()
        need = (sta._ARENA_SLOT_BYTES + 8) * sta._ARENA_SLOTS + MQ_CHUNK_BYTES * MQ_CHUNKS
        try:
            load_vllm().check_shm_free_space(need, _SHM_PATH,
                                             allocation_name="ShmTensorArena")
        except RuntimeError as exc:
            return str(exc)
        return None

    @classmethod
    def estimate(cls, payload, copies, tp):
        # the tensors that fit the arena are in /dev/shm once, the rest as vllm
        batch = copies * payload
        shm = min(batch, 8 * 256 * 1024 * 1024)
        rest = batch - shm
        return payload + 3 * batch + shm + 3 * rest * max(0, tp - 1), shm
