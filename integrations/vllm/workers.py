"""EngineCore -> TP workers: the scheduler-output ``MessageQueue`` carries handles
to the readers on the EngineCore's node (docs/vllm.md)."""

import contextvars
import time
import weakref

import torch
from mmshm import config
from mmshm.transport import receiving, sending
from mmshm.metrics import BROADCAST_SECONDS, INTERNODE_BYTES

from . import timing
from .server import PATH_WORKERS, engine_role, me

QUEUES: weakref.WeakSet = weakref.WeakSet()  # MessageQueues whose tensors go through mmshm
#: The scheduler-output queue: ("on", local readers, remote readers),
#: ("off", reason, fix), or None: one worker, no queue.
EXEC_STATE: tuple | None = None
#: In the remote half of an enabled ``enqueue``: [tensor bytes pickled inline].
_INLINE_BYTES: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "mmshm_vllm_inline", default=None)


def enable_broadcast(mq) -> bool:
    """mmshm carries a writer queue's tensors to its local readers (the ring);
    False for a queue without local readers, or with vLLM's tensor arena."""
    if (not getattr(mq, "_is_writer", False) or getattr(mq, "n_local_reader", 0) < 1
            or getattr(mq, "tensor_arena", None) is not None):
        return False
    QUEUES.add(mq)
    return True


class OnlyReaders:
    """``mq`` with only its local readers (the ring) or only its remote ones
    (vLLM's zmq socket): those two counts are the view's, every other
    attribute is ``mq``'s, read and written through; ``mq`` never changes."""

    __slots__ = ("_mq", "n_local_reader", "n_remote_reader")

    def __init__(self, mq, local: bool):
        object.__setattr__(self, "_mq", mq)
        object.__setattr__(self, "n_local_reader", mq.n_local_reader if local else 0)
        object.__setattr__(self, "n_remote_reader", 0 if local else mq.n_remote_reader)

    def __getattr__(self, name):
        return getattr(self._mq, name)

    def __setattr__(self, name, value):
        setattr(self._mq, name, value)


def describe_readers(n_local: int, n_remote: int) -> str:
    """``"2 readers"``, or ``"multi-node: 1 local reader through shared memory,
    1 remote reader inline"``."""
    def n(k, what):
        return f"{k} {what}{'' if k == 1 else 's'}"

    if not n_remote:
        return n(n_local, "reader")
    return (f"multi-node: {n(n_local, 'local reader')} through shared memory, "
            f"{n(n_remote, 'remote reader')} inline")


def reduce_tensor(wrapped, instance, args, kwargs):
    """``_reduce_tensor``: in an enabled ``enqueue``, a handle with one
    reference per local reader; for remote readers vLLM's (bytes counted)."""
    box = sending.current_outbox()
    if box is not None and box.path == "broadcast" and args:
        t = args[0]
        if type(t) is torch.Tensor and sending.eligible(t):
            h = box.put(t)
            if h is not None:
                return receiving.rebuild, (h.encode(), box.t0)
    inline = _INLINE_BYTES.get()
    if inline is not None and args and isinstance(args[0], torch.Tensor):
        inline[0] += args[0].numel() * args[0].element_size()
    return wrapped(*args, **kwargs)


def enqueue(wrapped, instance, args, kwargs):
    """An enabled queue's ``enqueue``: handles for the local readers; with
    remote readers too, written twice in vLLM's order: the ring (handles),
    then the remote socket (inline, ``mmshm_internode_bytes_total``)."""
    if instance not in QUEUES or config.get().disable:
        with sending.not_sending():
            return wrapped(*args, **kwargs)
    n_local = instance.n_local_reader
    n_remote = getattr(instance, "n_remote_reader", 0)
    method = getattr(wrapped, "__func__", None)
    if n_remote and method is None:  # cannot give each kind of reader its own bytes
        me().path_off(
            engine_role(), PATH_WORKERS, "MessageQueue.enqueue is not a plain method here "
            "(another wrapper?), so local and remote readers cannot be written apart; every "
            "reader gets the tensors inline", "report this as an mmshm bug with the vLLM "
            "version and the other patches of MessageQueue.enqueue")
        with sending.not_sending():
            return wrapped(*args, **kwargs)
    with sending.sending(hops=n_local - 1, path="broadcast") as box:
        if n_remote:
            out = method(OnlyReaders(instance, local=True), *args, **kwargs)
        else:
            out = wrapped(*args, **kwargs)
        if box.handles:
            BROADCAST_SECONDS.labels(role="src").observe(time.monotonic() - box.t0)
    if n_remote:
        inline = [0]
        token = _INLINE_BYTES.set(inline)
        try:
            with sending.not_sending():  # no handle can reach another node
                out = method(OnlyReaders(instance, local=False), *args, **kwargs)
        finally:
            _INLINE_BYTES.reset(token)
        if inline[0]:  # vLLM's XPUB socket sends the same frames to each remote reader
            INTERNODE_BYTES.inc(inline[0] * n_remote)
    return out


def dequeue(wrapped, instance, args, kwargs):
    """Handles materialized while unpickling; a failure raises, views given back."""
    with receiving.collecting() as got:
        obj = wrapped(*args, **kwargs)
    err = got.error("a MessageQueue message")
    if err is not None:
        del obj  # gives back the references of what did materialize
        raise err
    if got.t_sent is not None:
        BROADCAST_SECONDS.labels(role="dst").observe(max(0.0, time.monotonic() - got.t_sent))
    return obj


def init_executor(wrapped, instance, args, kwargs):
    """The executor's queue timed and, where it can be, enabled (:data:`EXEC_STATE`)."""
    global EXEC_STATE
    out = wrapped(*args, **kwargs)
    mq = getattr(instance, "rpc_broadcast_mq", None)
    if mq is None:
        EXEC_STATE = ("off", ("this node's executor does not broadcast scheduler outputs "
                              "(a headless node of multi-node TP/PP, or multi-node data "
                              "parallelism)"), "nothing to do")
        return out
    timing.time_queue(mq, engine_role())
    if enable_broadcast(mq):
        EXEC_STATE = ("on", mq.n_local_reader, getattr(mq, "n_remote_reader", 0))
    elif getattr(mq, "tensor_arena", None) is not None:
        EXEC_STATE = ("off", "vLLM's shm tensor arena (--enable-shm-tensor-arena) carries "
                      "the tensors", "leave --enable-shm-tensor-arena off to let mmshm "
                      "carry them")
    else:
        EXEC_STATE = ("off", ("every reader of the queue is on another node, so the "
                              "tensors go inline on vLLM's remote socket"),
                      ("nothing to do: run TP workers on the EngineCore's node to give "
                       "them shared memory"))
    return out


def init_executor_observed(wrapped, instance, args, kwargs):
    """Observe mode: the queue timed (vLLM's tensor arena: a WARNING)."""
    out = wrapped(*args, **kwargs)
    mq = getattr(instance, "rpc_broadcast_mq", None)
    if mq is not None:
        timing.time_queue(mq, engine_role())
        if getattr(mq, "tensor_arena", None) is not None:
            me().path_off(
                engine_role(), "timing of mq_enqueue, mq_dequeue",
                "vLLM's shm tensor arena (--enable-shm-tensor-arena) carries the tensors "
                "outside the messages, so their bytes and copies are not in these hops",
                "leave --enable-shm-tensor-arena off to time the queue's own transport")
    return out
