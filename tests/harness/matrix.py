"""The model matrix of the e2e tests: families, requests, expected bytes, metric deltas.

Server-independent (vLLM's and SGLang's matrix tests both use it): which
tiny model each family is (``models.build(dir, family=...)``), what each
request sends, and what mmshm must have done for it, computed offline with
the model's own HF processor.

- :data:`FAMILIES`: name -> :class:`Family` (its modalities and its
  :class:`Case` list: 1 and 2 items, n=1 and n=2; Qwen2.5-VL also a video
  alone and a video with an image in one request).
- Media, deterministic and offline: photos (scikit-image's samples at 720p,
  PNG data URLs), videos (4 frames of 448x252 panning across a photo at
  2 fps, an MPEG-4 file made with OpenCV, sent as a ``video/mp4`` data URL)
  and sounds (16 kHz mono chirps with a seeded noise floor, 16-bit WAV made
  with the standard library's ``wave``, sent as ``input_audio`` base64).
- :func:`content`: the OpenAI chat content of a case's items plus the prompt.
- :func:`expected_tensors`: per item, the bytes of each tensor the HF
  processor makes that mmshm puts in shared memory (at least
  ``MMSHM_MIN_BYTES``, default 64 KiB): what one request must write once,
  whatever its n.
- :data:`DELTAS` / :func:`deltas`: the mmshm counters read around each
  request, and :func:`request_problems`: what is wrong with one request's
  deltas (segments per item, bytes written once per fan-out, one reference
  per item and child, no inline fallback, no failure).

Every function here raises what its libraries raise (``KeyError`` for an
unknown family, photo, video or sound).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
import os
import tempfile
import wave

PROMPT = "Describe what you see and hear."
MAX_TOKENS = 6
SEED = 1234
#: mmshm's default MMSHM_MIN_BYTES: smaller tensors stay inline.
MIN_BYTES = 65536

#: Video geometry: 4 frames of 448x252 at 2 fps (multiples of 28 above
#: Qwen2VLVideoProcessor's 128*28*28 minimum: no resize), so a video is
#: pixel_values_videos [1152, 1176] float32 (5.4 MB; uint8 in vLLM 0.32,
#: 1.35 MB: see expected_tensors), 288 tokens.
VIDEO_FRAMES = 4
VIDEO_SIZE = (448, 252)  # width, height
VIDEO_FPS = 2.0
#: Sound: 16 kHz mono (the WhisperFeatureExtractor's rate: no resampling).
AUDIO_RATE = 16000


@dataclasses.dataclass(frozen=True)
class Item:
    """One multimodal item of a request: ``kind`` ``image`` (``name`` a
    scikit-image photo), ``video`` (a photo the video pans across) or
    ``audio`` (a key of :data:`SOUNDS`)."""

    kind: str
    name: str


@dataclasses.dataclass(frozen=True)
class Case:
    """One request: ``key`` (its label), its ``items`` in order, ``n`` choices."""

    key: str
    items: tuple[Item, ...]
    n: int


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family of the matrix: ``name`` (``tests/harness/models.py``'s family),
    the HF ``architecture``, its ``modalities`` and its request ``cases``."""

    name: str
    architecture: str
    modalities: tuple[str, ...]
    cases: tuple[Case, ...]

    @property
    def max_items(self) -> dict[str, int]:
        """The most items of each modality one case sends."""
        out: dict[str, int] = {}
        for c in self.cases:
            for m in self.modalities:
                out[m] = max(out.get(m, 0), sum(i.kind == m for i in c.items))
        return out


def _img(name):
    return Item("image", name)


def _vid(name):
    return Item("video", name)


def _aud(name):
    return Item("audio", name)


#: Sounds: name -> (seconds, start Hz, end Hz) of a linear chirp.
SOUNDS = {
    "chirp-a": (2.0, 220.0, 880.0),
    "chirp-b": (1.5, 440.0, 330.0),
    "chirp-c": (3.0, 110.0, 1760.0),
    "chirp-d": (2.5, 660.0, 990.0),
    "chirp-e": (1.0, 1200.0, 300.0),
    "chirp-f": (2.0, 500.0, 520.0),
}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llava-next", "LlavaNextForConditionalGeneration", ("image",), (
        Case("1 image, n=1", (_img("astronaut"),), 1),
        Case("2 images, n=1", (_img("coffee"), _img("chelsea")), 1),
        Case("1 image, n=2", (_img("rocket"),), 2),
        Case("2 images, n=2", (_img("motorcycle"), _img("hubble_deep_field")), 2),
    )),
    Family("qwen2.5-vl", "Qwen2_5_VLForConditionalGeneration", ("image", "video"), (
        Case("1 image, n=1", (_img("astronaut"),), 1),
        Case("2 images, n=2", (_img("coffee"), _img("chelsea")), 2),
        Case("1 video, n=1", (_vid("rocket"),), 1),
        Case("1 video, n=2", (_vid("motorcycle"),), 2),
        Case("video + image, n=1", (_vid("hubble_deep_field"), _img("retina")), 1),
        Case("video + image, n=2", (_vid("immunohistochemistry"), _img("rocket")), 2),
    )),
    Family("qwen2-audio", "Qwen2AudioForConditionalGeneration", ("audio",), (
        Case("1 audio, n=1", (_aud("chirp-a"),), 1),
        Case("2 audios, n=1", (_aud("chirp-b"), _aud("chirp-c")), 1),
        Case("1 audio, n=2", (_aud("chirp-d"),), 2),
        Case("2 audios, n=2", (_aud("chirp-e"), _aud("chirp-f")), 2),
    )),
)}


def model(family: str) -> str:
    """The family's tiny model directory, built if needed (see
    ``tests/harness/models.py``)."""
    from tests.harness import models

    return models.build(models.model_dir(family), family=family)


# -- media ---------------------------------------------------------------------------
@functools.cache
def photo(name: str):
    """Photo ``name`` at 720p, an RGB ``PIL.Image``."""
    from mmshm.bench import photos as ph

    return ph.rgb(name, "720p")


@functools.cache
def photo_url(name: str) -> str:
    """Photo ``name`` at 720p as a PNG data URL."""
    buf = io.BytesIO()
    photo(name).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@functools.cache
def video_frames(name: str):
    """The video over photo ``name``: uint8 [VIDEO_FRAMES, 252, 448, 3] RGB,
    a 16:9 window of three quarters of the 720p photo's height (960x540),
    at mid-height, panning left to right in equal steps (107 pixels between
    frames: every frame differs), shrunk to 448x252."""
    import numpy as np
    from PIL import Image

    img = photo(name)
    w, h = img.size
    win_h = h * 3 // 4
    win_w = win_h * VIDEO_SIZE[0] // VIDEO_SIZE[1]
    top = (h - win_h) // 2
    step = (w - win_w) // max(VIDEO_FRAMES - 1, 1)
    frames = [np.asarray(img.crop((i * step, top, i * step + win_w, top + win_h)).resize(
        VIDEO_SIZE, Image.Resampling.BICUBIC)) for i in range(VIDEO_FRAMES)]
    return np.stack(frames)


@functools.cache
def video_mp4(name: str) -> bytes:
    """:func:`video_frames` as an MPEG-4 part 2 (``mp4v``) .mp4 at
    VIDEO_FPS, made with OpenCV (needs ``cv2``)."""
    import cv2

    frames = video_frames(name)
    with tempfile.TemporaryDirectory(prefix="mmshm-video-") as d:
        path = os.path.join(d, "v.mp4")
        out = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), VIDEO_FPS, VIDEO_SIZE)
        if not out.isOpened():
            raise RuntimeError("OpenCV cannot write mp4v video")
        for f in frames:
            out.write(cv2.cvtColor(f, cv2.COLOR_RGB2BGR))
        out.release()
        with open(path, "rb") as fh:
            return fh.read()


def video_url(name: str) -> str:
    """:func:`video_mp4` as a ``video/mp4`` data URL."""
    return "data:video/mp4;base64," + base64.b64encode(video_mp4(name)).decode()


@functools.cache
def audio_wave(name: str):
    """Sound ``name`` of :data:`SOUNDS`: float32 [samples] in [-1, 1] at
    AUDIO_RATE, a linear chirp at 0.5 plus N(0, 0.01) noise (seeded by the
    name), as the 16-bit WAV of :func:`audio_wav` decodes."""
    import zlib

    import numpy as np

    secs, f0, f1 = SOUNDS[name]
    t = np.arange(int(secs * AUDIO_RATE)) / AUDIO_RATE
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t * t / (2 * secs))
    noise = np.random.default_rng(zlib.crc32(name.encode())).normal(0, 0.01, t.shape)
    x = np.clip(0.5 * np.sin(phase) + noise, -1, 1)
    return (np.round(x * 32767).astype(np.int16).astype(np.float32) / 32768.0)


@functools.cache
def audio_wav(name: str) -> bytes:
    """Sound ``name`` as a 16-bit mono WAV file at AUDIO_RATE."""
    import numpy as np

    pcm = np.round(audio_wave(name) * 32768.0).astype("<i2").tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(AUDIO_RATE)
        w.writeframes(pcm)
    return buf.getvalue()


def item_part(item: Item, audio_style: str = "input_audio") -> dict:
    """One OpenAI chat content part: ``image_url`` / ``video_url`` data URLs;
    audio as ``input_audio`` (base64 WAV, ``format`` ``wav``) or, with
    ``audio_style="audio_url"``, an ``audio/wav`` data URL."""
    if item.kind == "image":
        return {"type": "image_url", "image_url": {"url": photo_url(item.name)}}
    if item.kind == "video":
        return {"type": "video_url", "video_url": {"url": video_url(item.name)}}
    if item.kind == "audio":
        b64 = base64.b64encode(audio_wav(item.name)).decode()
        if audio_style == "audio_url":
            return {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64}}
        return {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}
    raise KeyError(item.kind)


def content(items, audio_style: str = "input_audio") -> list[dict]:
    """The user message's content: the items' parts in order, then PROMPT."""
    return [item_part(i, audio_style) for i in items] + [{"type": "text", "text": PROMPT}]


# -- what the processor makes --------------------------------------------------------
@functools.cache
def _processor(family: str):
    from transformers import AutoProcessor

    kwargs = {} if family == "qwen2-audio" else {"use_fast": False}
    return AutoProcessor.from_pretrained(model(family), **kwargs)


@functools.cache
def _item_tensors(family: str, item: Item) -> tuple[tuple[str, tuple, int], ...]:
    """(name, shape, bytes) of every tensor the family's HF processor makes
    for ``item`` alone."""
    import torch

    p = _processor(family)
    if item.kind == "image":
        out = p.image_processor(images=[photo(item.name)], return_tensors="pt")
    elif item.kind == "video":
        from transformers.video_utils import VideoMetadata

        frames = video_frames(item.name)
        meta = VideoMetadata(total_num_frames=len(frames), fps=VIDEO_FPS,
                             duration=len(frames) / VIDEO_FPS,
                             frames_indices=list(range(len(frames))))
        out = p.video_processor(videos=[frames], video_metadata=[meta], do_sample_frames=False,
                                return_tensors="pt")
    elif item.kind == "audio":
        out = p.feature_extractor([audio_wave(item.name)], sampling_rate=AUDIO_RATE,
                                  return_attention_mask=True, padding="max_length",
                                  return_tensors="pt")
    else:
        raise KeyError(item.kind)
    # a batch of one item: its tensors' bytes are the item's (a leading 1 is no byte)
    return tuple((k, tuple(v.shape), v.numel() * v.element_size()) for k, v in out.items()
                 if isinstance(v, torch.Tensor))


def expected_tensors(family: str, items, min_bytes: int = MIN_BYTES,
                     uint8_videos: bool = False) -> list[list[int]]:
    """Per item, the bytes of each tensor of at least ``min_bytes`` that the
    family's HF processor makes for it (what mmshm writes to shared memory):
    Qwen2.5-VL an image's pixel_values [patches, 1176] float32 or a video's
    pixel_values_videos [patches, 1176] float32; LLaVA-NeXT pixel_values
    [tiles, 3, 336, 336] float32 (image_sizes is 16 bytes); Qwen2-Audio
    input_features [128, 3000] float32 (the feature_attention_mask is 12 KB).

    ``uint8_videos``: pixel_values_videos of the same shape in uint8, one byte
    an element: vLLM 0.32's ``mm_device_do_normalize`` (on by default for
    Qwen2-VL and Qwen2.5-VL) makes the torchvision video processor skip
    rescale and normalize, which the model then does on its device."""
    out = []
    for i in items:
        sizes = []
        for name, shape, nbytes in _item_tensors(family, i):
            if uint8_videos and name == "pixel_values_videos":
                nbytes = nbytes // 4  # float32 -> uint8, the same elements
            if nbytes >= min_bytes:
                sizes.append(nbytes)
        out.append(sizes)
    return out


def tensor_shapes(family: str, items) -> list[dict[str, tuple]]:
    """Per item, every tensor's shape from the HF processor (for the record)."""
    return [{k: s for k, s, _ in _item_tensors(family, i)} for i in items]


# -- what mmshm must have done ---------------------------------------------------------
#: Metric deltas read around each request: short name -> (series, labels).
DELTAS = {
    "created": ("mmshm_segments_created_total", {}),
    "written": ("mmshm_shm_written_bytes_total", {}),
    "fanout": ("mmshm_fanout_copies_total", {}),
    "sent_refs": ("mmshm_references_handed_total", {"path": "send"}),
    "bcast_refs": ("mmshm_references_handed_total", {"path": "broadcast"}),
    "pool_hits": ("mmshm_pool_requests_total", {"result": "hit"}),
    "fallbacks": ("mmshm_inline_fallbacks_total", {}),
    "failures": ("mmshm_materialize_failures_total", {}),
}


def deltas(before: str, after: str) -> dict[str, float]:
    """:data:`DELTAS` between two expositions of the server's ``/metrics``."""
    from tests.harness.servers import metric

    return {short: metric(after, name, **labels) - metric(before, name, **labels)
            for short, (name, labels) in DELTAS.items()}


def request_problems(d: dict, tensors: list[int], messages: int, fanout: int) -> list[str]:
    """What is wrong with one request's :func:`deltas` ``d`` (empty: nothing):
    one segment (new, or a warm one from the pool) for all the tensors of ``tensors``
    (a request's tensors are grouped in one segment)
    (the bytes of each tensor the request carries through shared memory,
    e.g. :func:`expected_tensors` flattened), their bytes written once
    whatever n is, one send reference per tensor and each of the
    ``messages`` that carry the request, ``fanout`` fan-out copies counted,
    no inline fallback and no materialize failure."""
    k, nbytes = len(tensors), sum(tensors)
    out = []
    if d["created"] + d["pool_hits"] != min(k, 1):
        out.append(f"{d['created']:.0f} segments made + {d['pool_hits']:.0f} from the pool, "
                   f"want {min(k, 1)} (one per request, its {k} tensors grouped)")
    if d["written"] != nbytes:
        out.append(f"{d['written']:.0f} bytes written, want {nbytes} (each tensor once)")
    if d["sent_refs"] != k * messages:
        out.append(f"{d['sent_refs']:.0f} send references, want {k * messages}")
    if d["fanout"] != fanout:
        out.append(f"{d['fanout']:.0f} fan-out copies, want {fanout}")
    if d["fallbacks"]:
        out.append(f"{d['fallbacks']:.0f} inline fallbacks")
    if d["failures"]:
        out.append(f"{d['failures']:.0f} materialize failures")
    return out
