"""SGLang's hops (:func:`mmshm.hooks.observe.timed`), alike in both modes (docs/sglang.md)."""

import sys

from mmshm.hooks import observe

from .server import FIX_BUG, RECEIVER, SCHEDULER, SERVER, items, me, pickle_ipc

#: The hops timed, in the order a request takes them.
HOPS = ("tokenizer_wrap", "tokenizer_send", "scheduler_recv", "broadcast_src",
        "broadcast_dst", "materialize", "mm_inputs")


def pointer_bytes(mm_inputs, tensors: bool = False) -> int:
    """Bytes that SGLang's shm pointers (``ShmPointerMMData``: a ``shape`` and a
    ``dtype``, :func:`mmshm.hooks.observe.shape_bytes`) in ``mm_inputs``'s items
    stand for, or with ``tensors`` the items' torch tensors' bytes; reads no data."""
    import torch
    from mmshm import ShmTensor

    total = 0
    for item in items(mm_inputs):
        for name in ("feature", "precomputed_embeddings"):
            v = getattr(item, name, None)
            for x in (v if isinstance(v, (list, tuple)) else (v,)):
                if x is None or isinstance(x, (torch.Tensor, ShmTensor)):  # not SGLang's
                    total += observe.tensor_bytes(x) if tensors else 0
                else:
                    total += observe.shape_bytes(x)
    return total


def _no_items(out, t) -> bool:
    mm = getattr(out, "mm_inputs", None)
    return not mm or not items(mm)


def _broadcast_hop(args, kwargs) -> str:
    rank = args[1] if len(args) > 1 else kwargs.get("rank")
    src = args[3] if len(args) > 3 else kwargs.get("src", 0)
    return "broadcast_src" if rank == src else "broadcast_dst"


def _receiver_clock(t, args, kwargs) -> None:
    # a receiver waits for the source rank in the size broadcast: its clock
    # starts once the size is there
    t.clock_at_first_broadcast = t.hop == "broadcast_dst"


def _pointers_in(t, args, kwargs) -> None:
    obj = args[0] if args else kwargs.get("obj")
    try:
        t.add(sum(pointer_bytes(getattr(r, "mm_inputs", None))
                  for r in (getattr(obj, "batch", None) or [obj])))
    finally:
        t.skip = t.nbytes == 0


#: ``wrap_shm_features``: the bytes put into shared memory (SGLang's
#: pointers in observe mode; mmshm's copies, counted by its glue).
TOKENIZER_WRAP = observe.timed(
    SERVER, "tokenizer_wrap", skip=_no_items, nbytes=lambda out, a, kw: pointer_bytes(
        getattr(out, "mm_inputs", None)) if observe.observing() else 0)
#: ``_send_one_request``: its ``send_pyobj`` is one message.
TOKENIZER_SEND = observe.timed(SERVER, "tokenizer_send", zmq=True)
#: ``recv_requests``: each ``recv_pyobj`` in it (the unpickle included).
SCHEDULER_RECV = observe.timed(SERVER, "scheduler_recv", zmq=True)
#: A non-empty ``broadcast_pyobj``: the bytes ``torch.distributed.broadcast`` carries.
BROADCAST = observe.timed(SERVER, _broadcast_hop, count_broadcasts=True,
                          setup=_receiver_clock, skip=lambda out, t: not out)
#: ``unwrap_shm_features``: SGLang's pointers turned back into tensors
#: (none under mmshm: skipped); inside a timed ``_finalize_shm_features``
#: it adds them to that hop.
UNWRAP = observe.timed(SERVER, "materialize", join=True, setup=_pointers_in)
#: ``_finalize_shm_features`` (0.5.15+): the TP barrier, every unwrap, the
#: all-reduce of failures; skipped unless an unwrap inside counts pointers.
FINALIZE = observe.timed(SERVER, "materialize", setup=lambda t, a, kw: setattr(t, "skip", True))
#: ``Scheduler._get_multimodal_inputs`` on every TP rank, SGLang's hash of
#: each item included: the items' tensors' bytes.
MM_INPUTS = observe.timed(SERVER, "mm_inputs", skip=lambda out, t: not items(out),
                          nbytes=lambda out, a, kw: pointer_bytes(out, tensors=True))


def untimed_hops(hops: tuple[str, ...]) -> list[tuple[tuple[str, ...], str, str]]:
    """``(hops, reason, fix)`` for what cannot be timed in this process."""
    out = []
    zmq_hops = tuple(h for h in hops if h in ("tokenizer_send", "scheduler_recv"))
    if zmq_hops and not pickle_ipc():
        out.append((zmq_hops, "SGLANG_USE_PICKLE_IPC is off: messages are msgpack-encoded, "
                    "not sent with send_pyobj, which is what mmshm times",
                    "unset SGLANG_USE_PICKLE_IPC (pickle IPC is the default)"))
    if "materialize" in hops:
        mod = sys.modules.get(RECEIVER) or sys.modules.get(SCHEDULER)
        if mod is not None and not hasattr(mod, "unwrap_shm_features"):
            out.append((("materialize",), "this SGLang release has no unwrap_shm_features in "
                        f"{mod.__name__}", FIX_BUG))
    return out


def install_taps(role: str) -> None:
    """The pyzmq and torch.distributed byte taps (a WARNING for each that fails)."""
    me().tap(role, ("zmq", "torch"), lambda failed: "tokenizer_send, scheduler_recv"
             if failed.startswith("zmq") else "broadcast_src, broadcast_dst (their bytes)",
             "pyzmq and torch versions")
