"""mmshm: shared-memory transport for multimodal tensors in VLM serving servers.

Public API:
    ShmTensor        refcounted, picklable handle to a tensor in shared memory
    wrap / unwrap    replace tensors in request objects by handles and back
    fan_out          parallel-sampling copies sharing one segment per tensor
    deferred_unwrap  wrap a ``broadcast_pyobj``-like function (metadata only)
    broadcast_pyobj  a mirror of SGLang's CPU broadcast, for tests and the bench

Layers, bottom-up (a module imports only its own layer or lower ones, and no
import cycle exists, lazy imports included: tests/test_layout.py):
    mmshm.errors, mmshm.config   typed errors; the MMSHM_* settings
    mmshm.metrics                Prometheus series and the exporter
    mmshm.hooks                  instrumentor, "on:" lines, hop timer; no transport
    mmshm.segments               segment files, owners, ShmTensor
    mmshm.transport              wrap/unwrap, one hop's two ends, the TP broadcast
    mmshm.integrations           one package per server (SGLang, vLLM)
    mmshm.operations, mmshm.bench  status, doctor, `mmshm run`; the benchmark
    mmshm.cli                    the `mmshm` command
"""

from mmshm.errors import (
    DescriptorLimitError,
    HandleError,
    HandleStateError,
    MaterializeError,
    MmshmError,
    PayloadWithheldError,
    PeerLostError,
    SegmentCorruptError,
    SegmentError,
    SegmentNotFoundError,
    ShmSpaceError,
    WrongNodeError,
)

from mmshm import config as _config


def _registered_instrumentors() -> dict[str, str]:
    """The names ``MMSHM_INSTRUMENT`` may list (mmshm.config asks; the settings
    import no layer above them, so the package root wires them here)."""
    from mmshm.hooks.instrumentor import registered

    return registered()


_config.set_instrumentor_source(_registered_instrumentors)

# The rest imports torch: loaded on first use (PEP 562), so that `mmshm --help`,
# `mmshm doctor`, `mmshm gc` and the start-up hook stay fast.
_LAZY = {
    "instrument": "operations.autopatch", "uninstrument": "operations.autopatch",
    "broadcast_pyobj": "transport.broadcast", "deferred_unwrap": "transport.broadcast",
    "fan_out": "transport.fanout",
    "ShmTensor": "segments.shmtensor", "content_hash": "segments.shmtensor",
    "handles": "transport.wrapping", "release": "transport.wrapping",
    "unwrap": "transport.wrapping", "wrap": "transport.wrapping",
}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'mmshm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "DescriptorLimitError",
    "HandleError",
    "HandleStateError",
    "MaterializeError",
    "MmshmError",
    "PayloadWithheldError",
    "PeerLostError",
    "SegmentCorruptError",
    "SegmentError",
    "SegmentNotFoundError",
    "ShmSpaceError",
    "ShmTensor",
    "WrongNodeError",
    "__version__",
    "broadcast_pyobj",
    "content_hash",
    "deferred_unwrap",
    "fan_out",
    "handles",
    "instrument",
    "release",
    "uninstrument",
    "unwrap",
    "wrap",
]
