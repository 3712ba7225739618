"""msgspec encoding of handle metadata.

The wire form of a handle is a msgpack array::

    [name, nbytes, dtype code, shape, hash, generation, node, offset]

``name`` travels without its constant ``mmshm-`` prefix (a name that still
has it is accepted too); ``node`` is the 32-bit id of the node that holds the
segment (:func:`mmshm.segments.node.node_id`). A wire array without ``node`` (six
elements, or five without the generation) decodes with this process's own
node; one without ``offset`` (seven elements or fewer: every handle made
before segments held several tensors) decodes with offset 0, and a handle
whose offset is 0 is encoded without it (seven elements), so the wire of a
segment of one tensor is unchanged. A 720p Qwen2-VL ``pixel_values`` handle ([4784, 1176] float32, 16-byte
hash, the largest pid Linux hands out) encodes to 63 bytes; 47 with the hash
empty (not computed yet, ``MMSHM_HASH=lazy``). With an offset (the tensor is
not the first of its segment): 66 bytes for an offset under 64 KiB, 68 for
one of up to 4 GiB (the 8th photo of a request of 720p photos: 157 MB in);
measured with msgspec here, the same before the offset existed for offset 0.

**Offsets** are multiples of :data:`OFFSET_ALIGN`, 4 KiB, not 64 B: a
consumer's copy-on-write view maps the tensor's own pages (``mmap`` takes
page-aligned file offsets only, so a 64 B offset would need a mapping from
the page below and a cut), the pages a consumer wrote are dropped per page
at release, and no two tensors share a page. The cost is at most 4 KiB of
slack per tensor, against tensors of ``MMSHM_MIN_BYTES`` or more. Dtype codes are a
fixed, append-only table so that processes running different torch builds
agree on them.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

import msgspec
import torch

from mmshm.errors import HandleError
from mmshm.segments import node as _node
from mmshm.segments.segfile import PREFIX

# Append-only: the position is the wire code. Names missing from this torch
# build are kept as placeholders so codes never shift.
_DTYPE_NAMES = (
    "float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16", "int32",
    "int64", "bool", "complex64", "complex128", "complex32", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
)
DTYPES: tuple[torch.dtype | None, ...] = tuple(getattr(torch, n, None) for n in _DTYPE_NAMES)
DTYPE_CODES: dict[torch.dtype, int] = {dt: i for i, dt in enumerate(DTYPES) if dt is not None}
_ITEMSIZES = tuple(dt.itemsize if dt is not None else 0 for dt in DTYPES)  # 0: not in this build

HASH_BYTES = 16  # BLAKE3 truncated to 128 bits
#: A tensor's offset in its segment's payload is a multiple of this (the
#: page size): a consumer maps a tensor's own pages (``mmap`` takes page-
#: aligned offsets only), and no two tensors of a segment share a page.
OFFSET_ALIGN = 4096
MAX_NDIM = 32
_NODE_LIMIT = 1 << _node.NODE_ID_BITS


def _local_node() -> int:
    return _node.node_id()


class HandleMeta(msgspec.Struct, array_like=True, frozen=True):
    """Metadata of one shared-memory tensor.

    Attributes:
        name: segment file name, ``mmshm-<pid>-<16 hex>``.
        nbytes: payload size in bytes (= prod(shape) * itemsize).
        dtype: code into :data:`DTYPES`.
        shape: tensor shape.
        hash: BLAKE3 digest of the payload, 16 to 32 bytes; empty when it was
            not computed before the handle was encoded (``MMSHM_HASH=lazy``:
            :attr:`mmshm.ShmTensor.hash` computes it on first use).
        gen: the segment's generation (bumped each time the owner's pool
            reuses it).
        node: id of the node whose segment directory holds the segment
            (default: this process's node for ``MMSHM_DIR``).
        offset: where the tensor starts, in bytes from the payload's start
            (a multiple of :data:`OFFSET_ALIGN`; 0: the segment holds one
            tensor). The segment's payload holds ``offset + nbytes`` bytes
            at least; attach and every view check it.
    """

    name: str
    nbytes: int
    dtype: int
    shape: tuple[int, ...]
    hash: bytes
    gen: int = 0
    node: int = msgspec.field(default_factory=_local_node)
    offset: int = 0


_WIRE_NAME_RE = re.compile(f"(?:{re.escape(PREFIX)})?" + r"[0-9]{1,10}-[0-9a-f]{16}")
_Dim = Annotated[int, msgspec.Meta(ge=0)]


class _Wire(msgspec.Struct, array_like=True, frozen=True):
    """The wire array; ``name`` without the ``mmshm-`` prefix. The range
    checks of :func:`validate` that msgspec can express are done here, by
    msgspec's decoder (in C); the name's pattern is matched after decoding
    (msgspec's ``pattern`` constraint costs twice as much)."""

    name: str
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    dtype: Annotated[int, msgspec.Meta(ge=0, lt=len(DTYPES))]
    shape: Annotated[tuple[_Dim, ...], msgspec.Meta(max_length=MAX_NDIM)]
    hash: Annotated[bytes, msgspec.Meta(max_length=32)]
    gen: Annotated[int, msgspec.Meta(ge=0)] = 0
    node: Annotated[int, msgspec.Meta(ge=0, lt=_NODE_LIMIT)] | None = None
    offset: Annotated[int, msgspec.Meta(ge=0, multiple_of=OFFSET_ALIGN)] = 0


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Wire)
_PLEN = len(PREFIX)


def dtype_code(dtype: torch.dtype) -> int:
    """Wire code of ``dtype``. Raises :class:`HandleError` if unsupported
    (quantized dtypes carry scale/zero-point state and are not supported)."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise HandleError(f"dtype {dtype} cannot travel through shared memory") from None


def encode(meta: HandleMeta) -> bytes:
    """Wire bytes of ``meta``. Raises :class:`HandleError` for a name outside
    the naming scheme."""
    name = meta.name
    if not name.startswith(PREFIX):
        raise HandleError(f"segment name {name!r} is outside the naming scheme")
    if meta.offset:
        if meta.offset < 0 or meta.offset % OFFSET_ALIGN:
            raise HandleError(f"offset {meta.offset} is not a non-negative multiple of "
                              f"{OFFSET_ALIGN}")
        return _ENCODER.encode((name[_PLEN:], meta.nbytes, meta.dtype, meta.shape, meta.hash,
                                meta.gen, meta.node, meta.offset))
    return _ENCODER.encode((name[_PLEN:], meta.nbytes, meta.dtype, meta.shape, meta.hash,
                            meta.gen, meta.node))


def decode(data: bytes) -> HandleMeta:
    """Decode and validate wire bytes (the checks of :func:`validate`).

    Raises:
        HandleError: not a wire array, a name outside the naming scheme, a
            value out of range (an offset below 0 or not a multiple of
            :data:`OFFSET_ALIGN` included), an unknown dtype code, or
            ``prod(shape) * itemsize != nbytes``.
    """
    try:
        w = _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HandleError(f"malformed handle metadata: {exc}") from None
    if _WIRE_NAME_RE.fullmatch(w.name) is None:
        raise HandleError(f"segment name {w.name!r} is outside the naming scheme")
    if 0 < len(w.hash) < HASH_BYTES:
        raise HandleError(f"hash must be empty or 16..32 bytes, got {len(w.hash)}")
    itemsize = _ITEMSIZES[w.dtype]
    if not itemsize:
        raise HandleError(f"unknown dtype code {w.dtype}")
    if math.prod(w.shape) * itemsize != w.nbytes:
        raise HandleError(f"shape {w.shape} x itemsize {itemsize} != nbytes {w.nbytes}")
    name = w.name if w.name.startswith(PREFIX) else PREFIX + w.name
    if w.node is None:
        return HandleMeta(name, w.nbytes, w.dtype, w.shape, w.hash, w.gen, _local_node(),
                          w.offset)
    return HandleMeta(name, w.nbytes, w.dtype, w.shape, w.hash, w.gen, w.node, w.offset)
