"""Request objects shaped like SGLang's, filled with real Qwen2-VL pixel_values.

``Req.mm_inputs.mm_items[i].feature`` holds one image's ``pixel_values`` (CPU
float32 tensor) and ``Req.mm_inputs.mm_items[i].hash`` the BLAKE3-128 of its
bytes, computed by the producer before anything is wrapped, so that every TP
rank can check the bytes it received.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mmshm
import msgspec
import torch

from .photos import Photo

# Qwen2-VL special tokens, only to make the prompt look like one.
VISION_START, IMAGE_PAD, VISION_END = 151652, 151655, 151653


class MultimodalDataItem(msgspec.Struct, array_like=True):
    """One image of a request (mirrors SGLang's ``MultimodalDataItem``).

    Attributes:
        modality: ``"image"``.
        hash: BLAKE3-128 of ``feature``'s bytes (16 bytes), computed before wrapping.
        feature: ``pixel_values``, float32 [patches, 1176], or a ``ShmTensor`` in transit.
        image_grid_thw: (t, h, w) patch grid as plain ints. A tiny tensor here would
            be pickled inline in every mode alike (about 40 us per tensor each way),
            a per-item cost that is not the transport's.
        photo: name of the source photo.
    """

    modality: str
    hash: bytes
    feature: Any = None
    image_grid_thw: Any = None
    photo: str = ""


@dataclasses.dataclass
class MultimodalInputs:
    """Mirrors SGLang's ``MultimodalInputs``: the request's list of ``mm_items``."""

    mm_items: list
    im_token_id: int = IMAGE_PAD


@dataclasses.dataclass
class Req:
    """A generation request (mirrors SGLang's ``TokenizedGenerateReqInput``)."""

    rid: str
    mm_inputs: MultimodalInputs
    input_ids: list
    n: int = 1


def build_request(rid: str, photos: list[Photo], images: int, n: int) -> Req:
    """A request with ``images`` mm items cycling through ``photos``.

    Every item gets its own tensor (a copy of the photo's ``pixel_values``), as
    if each image had been processed separately, so a request of ``images``
    items carries ``images`` distinct payloads.
    """
    if not photos:
        raise ValueError("no photos")
    items = []
    input_ids: list[int] = [9707, 11, 1246, 525, 498, 30]  # a short text prompt
    for i in range(images):
        p = photos[i % len(photos)]
        feature = p.pixel_values.clone()
        items.append(MultimodalDataItem(
            modality="image", hash=mmshm.content_hash(feature), feature=feature,
            image_grid_thw=tuple(int(v) for v in p.image_grid_thw.reshape(-1)[:3]),
            photo=p.name))
        input_ids += [VISION_START, IMAGE_PAD, VISION_END]
    return Req(rid=rid, mm_inputs=MultimodalInputs(mm_items=items), input_ids=input_ids, n=n)


def metadata_only_batch(n: int, images: int) -> list[Req]:
    """``n`` requests shaped like the bench's, each of ``images`` items whose
    ``feature`` is a 64-byte stand-in for a handle: what a metadata-only
    broadcast carries (the floor's broadcast)."""
    out = []
    for i in range(n):
        items = [MultimodalDataItem(modality="image", hash=bytes(16), feature=bytes(64),
                                    image_grid_thw=(1, 52, 92), photo="floor")
                 for _ in range(images)]
        out.append(Req(rid=f"floor-{i}", mm_inputs=MultimodalInputs(mm_items=items),
                       input_ids=[9707, 11] + [VISION_START, IMAGE_PAD, VISION_END] * images,
                       n=n))
    return out


def payload_bytes(req: Req) -> int:
    """Bytes of ``pixel_values`` in one request (all its mm items)."""
    total = 0
    for it in req.mm_inputs.mm_items:
        f = it.feature
        if isinstance(f, torch.Tensor):
            total += f.numel() * f.element_size()
        elif isinstance(f, mmshm.ShmTensor):
            total += f.nbytes
    return total


def verify(reqs, n: int, images: int) -> list[str]:
    """Check what a TP rank holds after the broadcast.

    Returns a list of problems (empty when every one of the ``n`` requests has
    ``images`` items whose ``feature`` is a plain tensor with the carried hash).
    """
    problems: list[str] = []
    if reqs is None or len(reqs) != n:
        return [f"expected {n} requests, got {0 if reqs is None else len(reqs)}"]
    for r in reqs:
        if isinstance(r, mmshm.MaterializeError):
            problems.append(f"MaterializeError: {r}")
            continue
        if not isinstance(r, Req):
            problems.append(f"unexpected object {type(r).__name__}")
            continue
        items = r.mm_inputs.mm_items
        if len(items) != images:
            problems.append(f"{r.rid}: {len(items)} mm items, expected {images}")
        for j, it in enumerate(items):
            f = it.feature
            if not isinstance(f, torch.Tensor):
                problems.append(f"{r.rid} item {j}: feature is {type(f).__name__}")
            elif it.image_grid_thw and f.shape[0] != math.prod(it.image_grid_thw):
                problems.append(f"{r.rid} item {j}: shape {tuple(f.shape)} does not match "
                                f"grid {it.image_grid_thw}")
            elif mmshm.content_hash(f) != it.hash:
                problems.append(f"{r.rid} item {j}: bytes differ from the carried hash")
    return problems
