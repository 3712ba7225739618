"""Stub of torchaudio for SGLang on CPU (tests only).

PyPI has no torchaudio for torch 2.13 (the newest, 2.11, pins torch 2.11), and
SGLang 0.5.23's audio loader (``sglang.srt.utils.common.load_audio``, the
soundfile path) imports torchaudio unconditionally, only to resample a clip
whose rate is not the model's. The e2e tests send 16 kHz WAV (Qwen2-Audio's
rate), so nothing here is called; :func:`functional.resample` raises rather
than guessing.
"""

__version__ = "0.0.0+mmshm-stub"

from . import functional  # noqa: E402,F401
