"""Each SGLang process's "on:" line (:class:`mmshm.hooks.instrumentor.Role`) once it is built."""

import weakref

from mmshm.hooks.instrumentor import Role

from . import epd, pd, timing
from .requests import dp_hops, forward_then_release
from .server import (FIX_BUG, PATH_BROADCAST, PATH_DP_FORWARD, PATH_FANOUT, PATH_MULTINODE,
                     PATH_REQUESTS, PATH_SCHED_IN, dp_rank, gpu_feature_transport,
                     gpu_transport_note, log, me, nnodes, scheduler_role, tp_rank_size,
                     transport_off_reason)


def say(role: str, on: list[str], offs: list[str], hops: tuple[str, ...] = ()) -> None:
    """The byte taps, then the line: ``on``, or each of ``offs`` off with
    :func:`transport_off_reason`; in observe mode the ``hops`` timed."""
    try:
        timing.install_taps(role)
    except Exception as exc:  # noqa: BLE001 - never break a server's start-up
        log.warning("mmshm: per-hop timing taps failed: %s", exc)
    off = transport_off_reason()
    me().say(Role(role, on if off is None else [], [] if off is None else
                  [(p, *off) for p in offs], hops, timing.untimed_hops(hops)))


def tokenizer_ready(wrapped, instance, args, kwargs):
    """``TokenizerManager.__init__``: the tokenizer's line; a PD decode
    instance's pixel policy (:func:`pd.decode_payload_policy`); SGLang's
    own GPU transport of the features, if on (:func:`gpu_transport_note`)."""
    result = wrapped(*args, **kwargs)
    paths = [PATH_REQUESTS + (" (via the data-parallel controller)" if dp_hops(instance)
                              else ""), PATH_FANOUT]
    decode = pd.decode_payload_policy(instance)
    pd.DECODE_WITHHOLDS = decode is not None and decode[0]
    if decode is not None:
        paths.append(decode[1])
    gpu = gpu_feature_transport(getattr(instance, "server_args", None))
    if gpu is not None:  # not a failure: SGLang's own pool already holds them on the GPU
        paths.append(gpu_transport_note(gpu))
    say("tokenizer", paths, [PATH_REQUESTS, PATH_FANOUT], ("tokenizer_wrap", "tokenizer_send"))
    return result


def scheduler_ready(wrapped, instance, args, kwargs):
    """``Scheduler.__init__``: the line of this scheduler (DP rank, TP rank)."""
    result = wrapped(*args, **kwargs)
    pd.SCHEDULER = weakref.ref(instance)
    rank, size = tp_rank_size(instance)
    on = [PATH_SCHED_IN] + ([f"{PATH_BROADCAST} ({size} ranks)"] if size > 1 else [])
    if size > 1 and nnodes(instance) > 1:
        on.append(f"{PATH_MULTINODE} ({nnodes(instance)} nodes)")
    if size == 1:
        hops = ("scheduler_recv", "materialize", "mm_inputs")
    elif rank == 0:
        hops = ("scheduler_recv", "broadcast_src", "materialize", "mm_inputs")
    else:
        hops = ("broadcast_dst", "materialize", "mm_inputs")
    say(scheduler_role(rank, dp_rank(instance)), on, [PATH_SCHED_IN], hops)
    return result


def controller_ready(wrapped, instance, args, kwargs):
    """``DataParallelController.__init__``: its dispatcher gives the controller's
    references back once a request is forwarded (its event loop keeps the
    last request until the next arrives)."""
    result = wrapped(*args, **kwargs)
    dispatcher = getattr(instance, "_request_dispatcher", None)
    if not callable(dispatcher):
        me().path_off(
            "data-parallel controller", PATH_DP_FORWARD,
            "this SGLang release's DataParallelController has no _request_dispatcher, so the "
            "references of the last request it forwarded are given back only when the next "
            "one arrives", FIX_BUG)
        return result
    import wrapt

    instance._request_dispatcher = wrapt.FunctionWrapper(dispatcher, forward_then_release)
    say("data-parallel controller", [PATH_DP_FORWARD], [PATH_DP_FORWARD])
    return result


def encoder_ready(wrapped, instance, args, kwargs):
    """``MMEncoder.__init__`` (0.5.23, an ``--encoder-only`` instance): its line."""
    result = wrapped(*args, **kwargs)
    backend = getattr(instance, "transfer_backend", None)
    if backend == "zmq_to_scheduler":
        me().say(Role("encoder", [epd.PATH_EPD_SEND]))
    else:
        me().say(Role("encoder", [], [(epd.PATH_EPD_SEND,
                                       f"--encoder-transfer-backend {backend}: mmshm carries "
                                       "zmq_to_scheduler only", epd.FIX_EPD_BACKEND)]))
    return result


def epd_receiver_ready(wrapped, instance, args, kwargs):
    """``MMReceiverBase.__init__`` (0.5.23) of a language-only scheduler: its line."""
    result = wrapped(*args, **kwargs)
    if getattr(instance, "scheduler", None) is None:
        return result  # the tokenizer's receiver: dispatches, receives nothing
    rank = getattr(instance, "tp_rank", "?")
    role = f"encoder receiver ({scheduler_role(rank)})"
    backend = getattr(instance, "encoder_transfer_backend", None)
    if backend == "zmq_to_scheduler":
        epd.publish_card(instance)  # the handshake: the encoder sends handles here
        me().say(Role(role, [epd.PATH_EPD_RECV, epd.PATH_EPD_FAULTS]))
    else:
        me().say(Role(role, [epd.PATH_EPD_FAULTS], [(
            epd.PATH_EPD_RECV, f"--encoder-transfer-backend {backend}: mmshm carries "
            "zmq_to_scheduler only", epd.FIX_EPD_BACKEND)]))
    return result


def epd_unrecognized(role: str, path: str):
    """A wrapper for the ``__init__`` of an encoder or receiver class whose
    release mmshm does not carry (0.5.9-0.5.15): says ``path`` is off."""

    def wrapper(wrapped, instance, args, kwargs):
        me().say(Role(role, [], [(path, "mmshm does not recognize this SGLang release's "
                                  "encoder code (disaggregation/encode_server.py, "
                                  "encode_receiver.py)", epd.FIX_EPD_RELEASE)]))
        return wrapped(*args, **kwargs)

    return wrapper
