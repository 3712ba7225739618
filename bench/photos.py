"""Real photos through the real Qwen2-VL image processor, without network.

The photos are the colour samples bundled in the scikit-image wheel; a
loader is used only when its file is in the wheel's data directory, so no
download is ever attempted. Each photo is cropped to 16:9, resized to the
target resolution with PIL and turned into ``pixel_values`` by
``transformers``' Qwen2-VL image processor (PIL backend, with the pixel
bounds of the released checkpoints). A 720p photo gives ``pixel_values``
[4784, 1176] float32 (22.5 MB), a 1080p one [10764, 1176] (50.6 MB).
"""

from __future__ import annotations

import dataclasses
import os
import threading

import torch

RESOLUTIONS: dict[str, tuple[int, int]] = {"720p": (1280, 720), "1080p": (1920, 1080)}

# (name, file in skimage.data's directory, loader)
_BUNDLED = (
    ("astronaut", "astronaut.png", lambda d: d.astronaut()),
    ("coffee", "coffee.png", lambda d: d.coffee()),
    ("chelsea", "chelsea.png", lambda d: d.chelsea()),
    ("rocket", "rocket.jpg", lambda d: d.rocket()),
    ("motorcycle", "motorcycle_left.png", lambda d: d.stereo_motorcycle()[0]),
    ("hubble_deep_field", "hubble_deep_field.jpg", lambda d: d.hubble_deep_field()),
    ("immunohistochemistry", "ihc.png", lambda d: d.immunohistochemistry()),
    ("retina", "retina.jpg", lambda d: d.retina()),
)


@dataclasses.dataclass(frozen=True)
class Photo:
    """One processed photo.

    Attributes:
        name: scikit-image sample name.
        resolution: ``"720p"`` or ``"1080p"``.
        pixel_values: float32 [patches, 1176].
        image_grid_thw: int64 [1, 3].
    """

    name: str
    resolution: str
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of ``pixel_values``."""
        return self.pixel_values.numel() * self.pixel_values.element_size()


_lock = threading.Lock()
_cache: dict[tuple[str, str], Photo] = {}
_processor = None


def available_photos() -> list[str]:
    """Names of the bundled photos present in the installed scikit-image."""
    import skimage.data

    d = skimage.data.data_dir
    return [name for name, fname, _ in _BUNDLED if os.path.exists(os.path.join(d, fname))]


# The pixel bounds of the released Qwen2-VL checkpoints' preprocessor_config.json
# (min_pixels 56*56, max_pixels 16384*28*28). transformers' bare default caps an
# image at 1280*28*28 pixels, which would shrink 1080p to about 720p's size.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 16384 * 28 * 28


def image_processor():
    """The Qwen2-VL image processor (PIL backend, the checkpoints' pixel bounds;
    nothing is downloaded)."""
    global _processor
    if _processor is None:
        try:
            from transformers import Qwen2VLImageProcessorPil as cls
        except ImportError:  # older transformers: the slow processor is PIL-based
            from transformers import Qwen2VLImageProcessor as cls
        size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
        try:
            _processor = cls(size=size)
        except (TypeError, ValueError):  # releases that took min/max_pixels instead
            _processor = cls(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return _processor


def _load_rgb(name: str, size: tuple[int, int]):
    import numpy as np
    import skimage.data
    from PIL import Image, ImageOps

    loader = {n: f for n, _, f in _BUNDLED}[name]
    arr = np.asarray(loader(skimage.data))
    if arr.dtype != np.uint8:
        arr = (255 * (arr.astype(np.float64) / max(float(arr.max()), 1.0))).astype(np.uint8)
    img = Image.fromarray(arr).convert("RGB")
    return ImageOps.fit(img, size, method=Image.Resampling.BICUBIC)


def rgb(name: str, resolution: str, shift: int = 0):
    """The bundled photo ``name`` as an RGB ``PIL.Image`` of ``resolution``
    (cropped to 16:9), before the processor: what a client uploads. ``shift``
    rolls it right by that many pixels (a different image of the same size).
    Raises KeyError for an unknown photo, ValueError for an unknown
    resolution."""
    if resolution not in RESOLUTIONS:
        raise ValueError(f"unknown resolution {resolution!r}; choose from {sorted(RESOLUTIONS)}")
    img = _load_rgb(name, RESOLUTIONS[resolution])
    if shift:
        from PIL import ImageChops

        img = ImageChops.offset(img, shift, 0)
    return img


def photo(name: str, resolution: str) -> Photo:
    """The processed photo ``name`` at ``resolution`` (processed once, then cached)."""
    if resolution not in RESOLUTIONS:
        raise ValueError(f"unknown resolution {resolution!r}; choose from {sorted(RESOLUTIONS)}")
    key = (name, resolution)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        img = _load_rgb(name, RESOLUTIONS[resolution])
        out = image_processor()(images=[img], return_tensors="pt")
        pv = out["pixel_values"].to(torch.float32).contiguous()
        grid = out["image_grid_thw"].to(torch.int64).contiguous()
        p = Photo(name, resolution, pv, grid)
        _cache[key] = p
        return p


def photos(count: int, resolution: str) -> list[Photo]:
    """The first ``min(count, available)`` bundled photos, processed at ``resolution``.

    Raises:
        RuntimeError: no bundled photo is available.
    """
    names = available_photos()
    if not names:
        raise RuntimeError("no bundled scikit-image photo found (is scikit-image installed?)")
    return [photo(n, resolution) for n in names[:max(1, count)]]
