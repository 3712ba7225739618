"""Configuration from ``MMSHM_*`` environment variables.

The settings are read once per process and cached; :func:`reload` re-reads
them (tests change the environment and call it).

Variables:
    MMSHM_DIR: directory that holds segments (default ``/dev/shm``).
    MMSHM_MIN_BYTES: tensors smaller than this many bytes stay inline
        (default 65536: below that, pickling is cheaper than a segment).
    MMSHM_DISABLE: ``1`` turns the transport off; everything travels inline.
    MMSHM_SWEEP_INTERVAL_S: seconds between sweeps of a producer's finished
        segments (default 1.0).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def _env_bool(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    dir: str
    min_bytes: int
    disable: bool
    sweep_interval_s: float


_settings: Settings | None = None


def reload() -> Settings:
    """Re-read the environment and return the new settings."""
    global _settings
    _settings = Settings(
        dir=os.environ.get("MMSHM_DIR") or "/dev/shm",
        min_bytes=int(os.environ.get("MMSHM_MIN_BYTES", 64 * 1024)),
        disable=_env_bool("MMSHM_DISABLE", False),
        sweep_interval_s=float(os.environ.get("MMSHM_SWEEP_INTERVAL_S", 1.0)),
    )
    return _settings


def get() -> Settings:
    """Return the cached settings (read from the environment on first use)."""
    return _settings if _settings is not None else reload()
