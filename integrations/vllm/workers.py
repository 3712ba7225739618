"""EngineCore -> TP workers: the scheduler-output ``MessageQueue`` carries handles
to the readers on the EngineCore's node (docs/vllm.md)."""

import weakref

from mmshm import config
from mmshm.transport import mqueue, sending

from . import timing
from .server import PATH_WORKERS, engine_role, me

QUEUES: weakref.WeakSet = weakref.WeakSet()  # MessageQueues whose tensors go through mmshm
#: The scheduler-output queue: ("on", local readers, remote readers),
#: ("off", reason, fix), or None: one worker, no queue.
EXEC_STATE: tuple | None = None


def enable_broadcast(mq) -> bool:
    """mmshm carries a writer queue's tensors to its local readers (the ring);
    False for a queue without local readers, or with vLLM's tensor arena."""
    if (not getattr(mq, "_is_writer", False) or getattr(mq, "n_local_reader", 0) < 1
            or getattr(mq, "tensor_arena", None) is not None):
        return False
    QUEUES.add(mq)
    return True


def reduce_tensor(wrapped, instance, args, kwargs):
    """``_reduce_tensor``: in an enabled ``enqueue``, a handle with one
    reference per local reader; for remote readers vLLM's (bytes counted)."""
    out = mqueue.put(args[0]) if args else None
    return wrapped(*args, **kwargs) if out is None else out


def enqueue(wrapped, instance, args, kwargs):
    """An enabled queue's ``enqueue``: handles for the local readers; with
    remote readers too, written twice in vLLM's order: the ring (handles),
    then the remote socket (inline, ``mmshm_internode_bytes_total``)
    (:func:`mmshm.transport.mqueue.write`)."""
    if instance not in QUEUES or config.get().disable:
        with sending.not_sending():
            return wrapped(*args, **kwargs)

    def refuse():
        me().path_off(
            engine_role(), PATH_WORKERS, "MessageQueue.enqueue is not a plain method here "
            "(another wrapper?), so local and remote readers cannot be written apart; every "
            "reader gets the tensors inline", "report this as an mmshm bug with the vLLM "
            "version and the other patches of MessageQueue.enqueue")

    return mqueue.write(instance, wrapped, args, kwargs, refuse)


def dequeue(wrapped, instance, args, kwargs):
    """Handles materialized while unpickling; a failure raises, views given back."""
    return mqueue.read(wrapped, args, kwargs)


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
