"""Each vLLM process's "on:" line (:class:`mmshm.hooks.instrumentor.Role`) once it is built."""

from mmshm.hooks.instrumentor import Role
from mmshm.transport import mqueue

from . import requests, timing, workers
from .server import (PATH_ENGINE_IN, PATH_WORKER_IN, PATH_WORKER_REMOTE, PATH_WORKERS,
                     engine_role, log, me, worker_role)


def client_ready(wrapped, instance, args, kwargs):
    """``MPClient.__init__``: :func:`requests.attach_encoder`."""
    out = wrapped(*args, **kwargs)
    try:
        requests.attach_encoder(instance)
    except Exception as exc:  # noqa: BLE001 - never break the server's start-up
        log.warning("mmshm: could not attach to the vLLM client: %s", exc)
    return out


def client_observed(wrapped, instance, args, kwargs):
    """Observe mode: the frontend's line."""
    out = wrapped(*args, **kwargs)
    me().say(Role("frontend", hops=requests.HOPS))
    return out


def engine_observed(wrapped, instance, args, kwargs):
    """``process_input_sockets`` (the input thread's start): the EngineCore's line."""
    on, state = [PATH_ENGINE_IN], workers.EXEC_STATE
    if state is None:
        on.append("one worker in this process (no scheduler-output broadcast)")
    elif state[0] == "on":
        on.append(f"{PATH_WORKERS} ({mqueue.describe_readers(*state[1:])})")
    me().say(Role(engine_role(), on, [] if state is None or state[0] == "on" else
                  [(PATH_WORKERS, *state[1:])], ("zmq_transfer", "engine_decode", "mq_enqueue")))
    return wrapped(*args, **kwargs)


def engine_ready(wrapped, instance, args, kwargs):
    """Shm mode: mmshm's provider for the input decoders, then the line."""
    requests.attach_provider(instance)
    return engine_observed(wrapped, instance, args, kwargs)


def worker_ready(wrapped, instance, args, kwargs):
    """``WorkerProc._init_message_queues``: the worker's queue timed, its line."""
    out = wrapped(*args, **kwargs)
    try:
        rank = getattr(getattr(instance, "worker", None), "rank", "?")
        mq = getattr(instance, "rpc_broadcast_mq", None)
        if mq is not None:
            timing.time_queue(mq, worker_role(rank))
            me().say(Role(worker_role(rank), [
                PATH_WORKER_REMOTE if getattr(mq, "_is_remote_reader", False)
                else PATH_WORKER_IN], hops=("mq_dequeue",)))
    except Exception as exc:  # noqa: BLE001 - never break a worker's start-up
        log.debug("mmshm: worker report failed: %s", exc)
    return out
