"""mmshm: shared-memory transport for multimodal tensors in VLM serving servers.

Public API:
    ShmTensor        refcounted, picklable handle to a tensor in shared memory
    wrap / unwrap    replace tensors in request objects by handles and back
    fan_out          parallel-sampling copies sharing one segment per tensor
    deferred_unwrap  wrap a ``broadcast_pyobj``-like function (metadata only)
    broadcast_pyobj  a mirror of SGLang's CPU broadcast, for tests and the bench
"""

from .autopatch import instrument, uninstrument
from .broadcast import broadcast_pyobj, deferred_unwrap
from .errors import (
    DescriptorLimitError,
    HandleError,
    HandleStateError,
    MaterializeError,
    MmshmError,
    SegmentCorruptError,
    SegmentError,
    SegmentNotFoundError,
    ShmSpaceError,
    WrongNodeError,
)
from .fanout import fan_out
from .handle import ShmTensor, content_hash
from .walker import handles, release, unwrap, wrap

__version__ = "0.1.0"

__all__ = [
    "DescriptorLimitError",
    "HandleError",
    "HandleStateError",
    "MaterializeError",
    "MmshmError",
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
