"""SGLang's own names, objects and decisions, as mmshm reads them (docs/sglang.md)."""

import logging
import os
import sys

from mmshm.hooks.instrumentor import Instrumentor
from mmshm.transport.sending import digest_of
from mmshm.transport.views import tensors

log = logging.getLogger("mmshm")

SERVER = "sglang"
MM_UTILS = "sglang.srt.managers.mm_utils"
IO_STRUCT = "sglang.srt.managers.io_struct"
TOKENIZER = "sglang.srt.managers.tokenizer_manager"
SCHEDULER = "sglang.srt.managers.scheduler"
RECEIVER = "sglang.srt.managers.scheduler_components.request_receiver"
DP_CONTROLLER = "sglang.srt.managers.data_parallel_controller"
#: EPD (encoder disaggregation): 0.5.23's encoder package; 0.5.9-0.5.15's modules.
ENCODER_SERVER = "sglang.srt.disaggregation.encoder.server"
ENCODER_RECEIVER = "sglang.srt.disaggregation.encoder.receiver"
OLD_ENCODE_SERVER = "sglang.srt.disaggregation.encode_server"
OLD_ENCODE_RECEIVER = "sglang.srt.disaggregation.encode_receiver"

#: Transport paths as :mod:`mmshm.hooks.report` names them (``mmshm_path_enabled``).
PATH_REQUESTS = "multimodal tensors to the scheduler through shared memory"
PATH_FANOUT = "parallel sampling (n>1) writes each tensor once"
PATH_SCHED_IN = "requests materialized zero-copy on every TP rank"
PATH_BROADCAST = "TP broadcast carries metadata only"
PATH_MULTINODE = "multi-node: payload once per node"
PATH_DP_FORWARD = "requests forwarded to the DP ranks, their references given back at once"
FIX_BUG = "report this as an mmshm bug with the SGLang version"
#: SGLang's own GPU transports of multimodal features (``--mm-feature-transport``,
#: 0.5.23; ``SGLANG_USE_CUDA_IPC_TRANSPORT=1`` on 0.5.9-0.5.15, still read by 0.5.23).
GPU_TRANSPORTS = ("cuda_ipc", "cuda_vmm")
#: Where SGLang defines the proxy a feature in its GPU pool travels as:
#: ``CudaIpcTensorTransportProxy`` (0.5.23's ``CudaVmmTensorTransportProxy``
#: and its packed variants subclass it), 0.5.23's module then the older one
#: (which 0.5.23 keeps as a re-export).
GPU_PROXY_MODULES = ("sglang.srt.multimodal.transport.cuda_ipc",
                     "sglang.srt.utils.cuda_ipc_transport_utils")
GPU_PROXY_CLASS = "CudaIpcTensorTransportProxy"


def me() -> Instrumentor:
    return Instrumentor.of(SERVER)


def hash_int(digest: bytes) -> int:
    """SGLang's hash (unsigned 64-bit int): the first 8 bytes of the carried
    BLAKE3-128 digest, big-endian."""
    return int.from_bytes(digest[:8], "big", signed=False)


def items(mm_inputs) -> list:
    """``mm_inputs``' ``mm_items`` (a dict's or an object's; [] if none)."""
    found = mm_inputs.get("mm_items") if isinstance(mm_inputs, dict) else getattr(
        mm_inputs, "mm_items", None)
    return found or []


def feature(item):
    f = getattr(item, "feature", None)
    return getattr(item, "precomputed_embeddings", None) if f is None else f


def unhashed_features(mm_inputs) -> set[int]:
    """``id()`` of the tensors of the items without a hash."""
    return {id(t) for item in items(mm_inputs) if getattr(item, "hash", 0) is None
            for t in tensors(feature(item))}


def set_item_hashes(mm_inputs) -> None:
    """Give each item without a hash the int of its feature's content hash
    (the handle's, computed from its segment under ``MMSHM_HASH=lazy``, or
    once for an inline tensor): the scheduler never hashes pixels.
    Deterministic, so harmless on items fan-out copies share."""
    from mmshm import MmshmError

    for item in items(mm_inputs):
        if getattr(item, "hash", 0) is not None:
            continue
        f = feature(item)
        try:
            d = digest_of(f) if f is not None else None
        except (MmshmError, OSError) as exc:
            # the segment vanished under us (MMSHM_HASH=lazy reads it here):
            # leave the item unhashed; the scheduler's unwrap reports the loss
            log.warning("mmshm: could not hash a multimodal item: %s", exc)
            continue
        if d is not None:
            item.hash = hash_int(d)


def gpu_proxy_types() -> tuple[type, ...]:
    """SGLang's GPU-pool proxy classes among the modules this process has
    imported (one not imported cannot have made a proxy here): () if none."""
    found = (getattr(sys.modules.get(m), GPU_PROXY_CLASS, None) for m in GPU_PROXY_MODULES)
    return tuple(dict.fromkeys(c for c in found if isinstance(c, type)))


def gpu_feature_transport(server_args=None) -> str | None:
    """SGLang's own GPU transport of multimodal features in this process,
    ``"cuda_ipc"`` or ``"cuda_vmm"``, else None (``cpu``, the default).

    Read, first found: 0.5.23's resolved value (``runtime_context.get_mm()``,
    once published), ``server_args.mm_feature_transport`` (0.5.23's flag as
    given), the legacy ``SGLANG_USE_CUDA_IPC_TRANSPORT`` (0.5.9-0.5.15's only
    switch). Raises nothing."""
    try:
        return _gpu(sys.modules["sglang.srt.runtime_context"].get_mm().mm_feature_transport)
    except Exception:  # noqa: BLE001 - before 0.5.23, or not published: the next source
        pass
    value = getattr(server_args, "mm_feature_transport", None)
    if value is not None:
        return _gpu(value)
    try:
        legacy = bool(sys.modules["sglang.srt.environ"].envs.SGLANG_USE_CUDA_IPC_TRANSPORT.get())
    except Exception:  # noqa: BLE001 - environ not imported or renamed: read it here
        legacy = os.environ.get("SGLANG_USE_CUDA_IPC_TRANSPORT", "").strip().lower() in (
            "1", "true", "yes", "y")
    return "cuda_ipc" if legacy else None


def _gpu(value) -> str | None:
    return value if value in GPU_TRANSPORTS else None


def gpu_transport_note(transport: str) -> str:
    """The "on:" line's phrase for SGLang's own GPU transport ``transport``."""
    return (f"multimodal features in SGLang's own GPU pool (--mm-feature-transport "
            f"{transport}) are left to it, counted in mmshm_device_tensors_total; mmshm "
            "carries only the rest (the CPU tensors: features the pool could not take, "
            "features processed on the CPU)")


def pickle_ipc() -> bool:
    """SGLang pickles its messages (``SGLANG_USE_PICKLE_IPC``, the default)."""
    return bool(getattr(sys.modules.get(IO_STRUCT), "_USE_PICKLE_IPC", True))


def transport_off_reason() -> tuple[str, str] | None:
    """``(reason, fix)`` where mmshm cannot carry the tensors (no tokenizer,
    no pickle IPC), else None. Not SGLang's transport mode: mmshm decides by
    the node layout (docs/sglang.md, "Several nodes")."""
    mm = sys.modules.get(MM_UTILS)
    if mm is None:
        return "sglang's mm_utils is not imported in this process", FIX_BUG
    try:  # get_global_server_args, or get_serving on some releases
        getter = getattr(mm, "get_global_server_args", None) or getattr(mm, "get_serving", None)
        if getattr(getter() if getter else None, "skip_tokenizer_init", False):
            return ("--skip-tokenizer-init: the tokenizer process sends no tensors",
                    "none needed")
    except Exception:  # noqa: BLE001 - server args not set yet: judged later
        pass
    if not pickle_ipc():
        return ("SGLANG_USE_PICKLE_IPC is off: requests are not pickled, so handles "
                "cannot ride in them", "unset SGLANG_USE_PICKLE_IPC (pickle IPC is the default)")
    return None


def on_failure(req, err):
    """What a request whose handles could not be materialized becomes, on
    every rank: SGLang's ``MMInputsProcessError`` (0.5.23); on older releases
    the abort path of an unknown session, whose message carries the reason."""
    io = sys.modules.get(IO_STRUCT)
    message = f"mmshm: {err}"
    log.error("%s", message)
    error_cls = getattr(io, "MMInputsProcessError", None)
    try:
        if error_cls is not None:
            req.mm_inputs = error_cls(message)
        else:
            req.mm_inputs = None
            session_cls = getattr(io, "SessionParams", None)
            if session_cls is not None and hasattr(req, "session_params"):
                req.session_params = session_cls(id=message)
    except (AttributeError, TypeError):
        return err
    return req


def _parallel():
    from sglang.srt.runtime_context import get_parallel

    return get_parallel()


def tp_rank_size(scheduler) -> tuple[int | str, int]:
    """(TP rank, TP size): the ``Scheduler``'s up to about 0.5.2x, else
    ``runtime_context.get_parallel()`` (0.5.23); rank ``"?"`` if neither."""
    rank, size = getattr(scheduler, "tp_rank", None), getattr(scheduler, "tp_size", None)
    if rank is None or size is None:
        try:
            parallel = _parallel()
            rank = parallel.tp_rank if rank is None else rank
            size = parallel.tp_size if size is None else size
        except Exception:  # noqa: BLE001 - moved or not published: say "?" below
            pass
    return ("?" if rank is None else rank), (1 if size is None else size)


def dp_rank(scheduler) -> int | None:
    """The DP rank (``Scheduler.dp_rank``, or ``get_parallel().dp_rank`` on
    0.5.23); None without data parallelism, as in SGLang's process title."""
    rank = getattr(scheduler, "dp_rank", None)
    if rank is None:
        try:
            rank = _parallel().dp_rank
        except Exception:  # noqa: BLE001 - moved or not published: no DP rank said
            rank = None
    return rank if isinstance(rank, int) else None


def scheduler_role(tp_rank: int | str, dp: int | None = None) -> str:
    """``scheduler (TP rank 0)``, or ``scheduler (DP rank 1, TP rank 0)``."""
    return f"scheduler ({'' if dp is None else f'DP rank {dp}, '}TP rank {tp_rank})"


def nnodes(scheduler) -> int:
    """``--nnodes`` (1 where unknown)."""
    try:
        return int(getattr(getattr(scheduler, "server_args", None), "nnodes", 1) or 1)
    except (TypeError, ValueError):
        return 1
