"""``torchaudio.functional`` of the stub: only ``resample``, which raises."""


def resample(waveform, orig_freq, new_freq, *args, **kwargs):
    """Raises NotImplementedError: the stub does not resample (send audio at
    the model's own rate, 16 kHz for Qwen2-Audio)."""
    if orig_freq == new_freq:
        return waveform
    raise NotImplementedError(
        f"torchaudio stub: cannot resample {orig_freq} Hz -> {new_freq} Hz; "
        f"send audio at {new_freq} Hz")
