"""Deterministic tensors, rebuilt alike in every process, and byte-exact compares."""

from __future__ import annotations


def as_bytes(t):
    """A tensor's bytes in C order as a flat uint8 tensor (NaN-safe compare)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same(a, b) -> bool:
    """Same shape, dtype and bytes."""
    import torch

    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(as_bytes(a), as_bytes(b)))


def make_tensor(seed: int, shape=(64, 300), dtype=None):
    """A deterministic tensor of ``shape`` and ``dtype`` (default float32,
    any bit pattern); every process rebuilds the same one from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)


def pattern(nbytes: int, seed: int):
    """A reproducible uint8 tensor of ``nbytes`` bytes (cheap to make: 4 KiB
    of random bytes from ``seed``, repeated)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    reps = -(-nbytes // 4096)
    return base.repeat(reps)[:nbytes].clone()
