"""Stub of torchvision (PyPI's build fails beside CPU torch; tests only).

Everything is a permissive stand-in (:mod:`_anything`) except the few
functions of ``torchvision.transforms.v2.functional`` that transformers'
torchvision-only *video* processors call on CPU (``Qwen2VLVideoProcessor``,
which Qwen2-VL and Qwen2.5-VL load for ``pixel_values_videos``; there is no
PIL video processor to switch to, as images do with ``use_fast: false``):

- ``InterpolationMode``: the real enum (also ``torchvision.transforms.InterpolationMode``);
- the same ``resize`` and ``normalize`` as ``torchvision.transforms.functional``
  (v1), which SGLang 0.5.23's Qwen-VL video path resizes decoded frames with;
- ``resize(inpt, size, interpolation=BILINEAR, max_size=None, antialias=True)``:
  ``torch.nn.functional.interpolate`` on ``[..., C, H, W]`` tensors (uint8 is
  resized in float32, then rounded and clamped back, as torchvision does);
  NEAREST, NEAREST_EXACT, BILINEAR and BICUBIC only, ``size`` ``[h, w]`` or
  an int (the shorter edge; ``max_size`` caps the longer one);
- ``normalize(inpt, mean, std, inplace=False)``: ``(x - mean) / std`` per
  channel (dim -3) of a float tensor;
- ``grayscale_to_rgb(inpt)``: 1 channel repeated to 3, else unchanged.

They are plain torch, so pixel values may differ from real torchvision's in
the last bits (both runs of an e2e comparison use this same stub); shapes and
dtypes are torchvision's.
"""
import enum
import sys

import _anything

_anything.install(__name__, __version__="0.28.0")


class InterpolationMode(enum.Enum):
    """torchvision's interpolation modes (the same names and values)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


_TORCH_MODES = {"nearest": "nearest", "nearest-exact": "nearest-exact",
                "bilinear": "bilinear", "bicubic": "bicubic"}


def resize(inpt, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
    """Resize the last two dims of a ``[..., C, H, W]`` tensor to ``size``."""
    import torch
    import torch.nn.functional as F

    mode = getattr(interpolation, "value", interpolation)
    if mode not in _TORCH_MODES:
        raise NotImplementedError(f"torchvision stub: resize with {interpolation!r}")
    h, w = inpt.shape[-2:]
    if isinstance(size, int) or len(size) == 1:
        short = size if isinstance(size, int) else size[0]
        if h <= w:
            new_h, new_w = short, int(short * w / h)
        else:
            new_h, new_w = int(short * h / w), short
        if max_size is not None and max(new_h, new_w) > max_size:
            scale = max_size / max(new_h, new_w)
            new_h, new_w = int(new_h * scale), int(new_w * scale)
    else:
        new_h, new_w = int(size[0]), int(size[1])
    lead = inpt.shape[:-3]
    x = inpt.reshape(-1, *inpt.shape[-3:])
    dtype = x.dtype
    if not x.is_floating_point():
        x = x.to(torch.float32)
    kwargs = {}
    if mode in ("bilinear", "bicubic"):
        kwargs = {"align_corners": False, "antialias": bool(antialias)}
    y = F.interpolate(x, size=(new_h, new_w), mode=_TORCH_MODES[mode], **kwargs)
    if dtype == torch.uint8:
        y = y.round_().clamp_(0, 255).to(torch.uint8)
    elif y.dtype != dtype:
        y = y.to(dtype)
    return y.reshape(*lead, *y.shape[-3:])


def normalize(inpt, mean, std, inplace=False):
    """``(inpt - mean) / std`` per channel (dim -3) of a float tensor."""
    import torch

    if not inpt.is_floating_point():
        raise TypeError(f"Input tensor should be a float tensor. Got {inpt.dtype}.")
    m = torch.as_tensor(mean, dtype=inpt.dtype).reshape(-1, 1, 1)
    s = torch.as_tensor(std, dtype=inpt.dtype).reshape(-1, 1, 1)
    return inpt.sub_(m).div_(s) if inplace else (inpt - m) / s


def grayscale_to_rgb(inpt):
    """A 1-channel ``[..., 1, H, W]`` tensor as 3 channels; others as they are."""
    if inpt.shape[-3] == 1:
        return inpt.repeat(*([1] * (inpt.dim() - 3)), 3, 1, 1)
    return inpt


def _stub_module(name: str, **attrs):
    mod = _anything.StubModule(name)
    mod.__path__ = []
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    return mod


_functional = _stub_module(__name__ + ".transforms.v2.functional",
                           InterpolationMode=InterpolationMode, resize=resize,
                           normalize=normalize, grayscale_to_rgb=grayscale_to_rgb)
_v2 = _stub_module(__name__ + ".transforms.v2", functional=_functional,
                   InterpolationMode=InterpolationMode)
# v1: SGLang 0.5.23's Qwen-VL video path resizes the decoded frames with
# torchvision.transforms.functional.resize before transformers' processor
_functional_v1 = _stub_module(__name__ + ".transforms.functional",
                              InterpolationMode=InterpolationMode, resize=resize,
                              normalize=normalize)
transforms = _stub_module(__name__ + ".transforms", v2=_v2, functional=_functional_v1,
                          InterpolationMode=InterpolationMode)
