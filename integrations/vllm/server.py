"""vLLM's own names, objects and processes, as mmshm reads them (docs/vllm.md)."""

import logging
import re

from mmshm.hooks.instrumentor import Instrumentor, title_match
from mmshm.transport.views import socket_endpoint, tensors  # noqa: F401 - tensors: glue's

log = logging.getLogger("mmshm")

SERVER = "vllm"
SERIAL = "vllm.v1.serial_utils"
CLIENT = "vllm.v1.engine.core_client"
CORE = "vllm.v1.engine.core"
ASYNC = "vllm.v1.engine.async_llm"
LLM = "vllm.v1.engine.llm_engine"
MQ = "vllm.distributed.device_communicators.shm_broadcast"
EXEC = "vllm.v1.executor.multiproc_executor"
SCHED = "vllm.v1.core.sched.scheduler"

#: Key of the placeholder dict that the consumer puts in a message.
WIRE_KEY = "mmshm"
#: Path names in the report lines and ``mmshm_path_enabled{path}``.
PATH_REQUESTS = "requests to the EngineCore through shared memory"
PATH_FANOUT = "parallel sampling (n>1) shares one segment per tensor"
PATH_ENGINE_IN = "requests from the frontend materialized zero-copy"
PATH_WORKERS = "scheduler outputs to the TP workers through shared memory"
PATH_WORKER_IN = "scheduler outputs materialized zero-copy"
#: A worker on another node than the EngineCore (a remote reader of its queue).
PATH_WORKER_REMOTE = ("scheduler outputs inline from the EngineCore's node (vLLM's remote "
                      "socket; no handle is sent across nodes)")
FIX_RELEASE = "run a vLLM release mmshm supports (0.32-0.33)"

#: vLLM's process title of an engine under data parallelism:
#: ``run_engine_core`` names it ``<prefix>::EngineCore_DP<rank>`` exactly when
#: ``--data-parallel-size`` > 1 (Ray's actors ``DPEngineCoreActor_DP<rank>``).
_DP_TITLE = re.compile(r"::(?:EngineCore|DPEngineCoreActor)_DP(\d+)\b")


def me() -> Instrumentor:
    return Instrumentor.of(SERVER)


def is_add(request_type) -> bool:
    """An ``EngineCoreRequestType.ADD`` (its value, ``b"\\x00"``)."""
    return getattr(request_type, "value", request_type) == b"\x00"


def dp_rank() -> int | None:
    """The DP rank of this EngineCore or of a worker's EngineCore (None without
    data parallelism), from the title vLLM gives the engine process, its own
    or its parent's (:func:`~mmshm.hooks.instrumentor.title_match`): a dense
    model's engines keep it nowhere else."""
    m = title_match(_DP_TITLE)
    return int(m.group(1)) if m else None


def engine_role() -> str:
    """``EngineCore``, or ``EngineCore (DP rank 1)`` under data parallelism."""
    dp = dp_rank()
    return "EngineCore" if dp is None else f"EngineCore (DP rank {dp})"


def worker_role(rank) -> str:
    """``worker (rank 1)``, or ``worker (DP rank 1, rank 0)`` under data
    parallelism (``rank``: its rank in its engine's TP x PP world)."""
    dp = dp_rank()
    return f"worker ({'' if dp is None else f'DP rank {dp}, '}rank {rank})"


def input_endpoint(client) -> str:
    """Where an ``MPClient`` sends requests: ``input_address`` (0.33), else its
    socket's ``zmq.LAST_ENDPOINT`` (0.32, :func:`mmshm.transport.views.socket_endpoint`)."""
    return str(getattr(client, "input_address", None) or "") or socket_endpoint(
        getattr(client, "input_socket", None))


#: How the EC connector keys items (printed in its namespace: both instances
#: of a pair must key alike): by vLLM's ``mm_hash``, or by the processed tensors.
KEY_MM_HASH = "mm_hash"
KEY_PIXELS = "pixels"


def key_mode(vllm_config) -> str:
    """:data:`KEY_MM_HASH` where this instance's ``mm_hash`` is a content hash
    (its processor cache or prefix caching on), else :data:`KEY_PIXELS`."""
    mc = getattr(vllm_config, "model_config", None)
    mm = getattr(mc, "multimodal_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if (getattr(mm, "mm_processor_cache_gb", 0) or 0) > 0 or getattr(
            cache, "enable_prefix_caching", False):
        return KEY_MM_HASH
    return KEY_PIXELS
