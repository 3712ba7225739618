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
    MMSHM_MIN_FREE_BYTES: budget guard reserve: a segment is not created if it
        would leave less than this many bytes free in the segment directory.
        Default: 5% of the file system, at least 16 MiB and at most 1 GiB. NCCL
        keeps its own intra-node buffers in /dev/shm (``nccl-*`` files: a few
        MiB per rank with P2P, up to several hundred MiB when it falls back to
        its SHM transport); 16 MiB keeps NCCL's start-up working in Docker's
        64 MiB default while still letting one 22 MB Qwen2-VL image through,
        and 5% scales the headroom on large tmpfs mounts.
    MMSHM_MAX_BYTES: optional cap on the bytes of shared memory this process's
        live segments may hold (0 = no cap).
    MMSHM_FD_RESERVE: descriptors kept free for the server: segment creation
        and attach fail with EMFILE (inline fallback) once the process's
        descriptor numbers reach RLIMIT_NOFILE minus this (default 64).
    MMSHM_POOL: ``0`` turns the warm segment pool off (every segment is
        created fresh and unlinked by its last release). Default on.
    MMSHM_POOL_IDLE_S: seconds an idle pooled segment is kept (default 10).
    MMSHM_POOL_MAX_BYTES: most bytes of idle pooled segments one process keeps
        (default: a quarter of the file system, at most 2 GiB).
    MMSHM_REAP_INTERVAL_S: the reaper runs at most once per this many seconds
        per segment directory on process start-up, and this often in
        long-lived processes (default 60; 0 disables the automatic runs).
    MMSHM_IN_FLIGHT_GRACE_S: seconds a segment whose references are in
        flight (pickled handles not yet opened) is kept by the reaper after
        every process that had it open closed it cleanly, e.g. its writer
        exited with requests still queued (default 300: longer than a busy
        server's queues hold a request). A segment a killed process held is
        reclaimed at once whatever this says (see :mod:`mmshm.reaper`).
    MMSHM_DEBUG_REFS: ``1`` records, in each process, where every reference
        was taken and given back, reports references still held at exit with
        their stacks, and names the call that gave back the last reference
        when a handle is used after it (see :mod:`mmshm.refdebug`). Off by
        default: no cost then.
    MMSHM_HASH: when a handle's BLAKE3-128 content hash is computed when
        none is given. ``lazy`` (default): on the first read of
        :attr:`mmshm.ShmTensor.hash`, in whichever process asks, from the
        segment's bytes (once per segment and process; a handle pickled after
        that carries it). ``eager``: at creation, on the producer, so it
        travels with every handle (costs about 2.4x the copy: BLAKE3 runs at
        about 5 GB/s per core, a warm memcpy at about 12 GB/s).
    MMSHM_NODE_ID: overrides this process's node identity (see
        :mod:`mmshm.node`). Ranks with the same value count as one node, ranks
        with different values as different nodes, whatever the system says. A
        decimal integer below 2**32 is used as the node id itself; any other
        string is hashed. Unset (the default): the identity comes from the
        system (boot id, IPC and mount namespace, segment directory). Meant for
        tests and for simulating several nodes on one machine.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("mmshm")


def _env_bool(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v.strip().lower() in ("1", "true", "yes", "on")


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of ``name`` (default: the first choice). Raises
    :class:`ValueError` naming the variable and the choices."""
    v = (os.environ.get(name) or "").strip().lower() or choices[0]
    if v not in choices:
        raise ValueError(f"{name}={os.environ.get(name)!r}: expected one of {', '.join(choices)}")
    return v


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v.strip() == "":
        return None
    return int(float(v))


def _env_seconds(name: str, default: float) -> float:
    """A non-negative number of seconds from ``name``; a malformed or negative
    value is logged and ``default`` used (a setting never stops a server)."""
    v = (os.environ.get(name) or "").strip()
    if not v:
        return default
    try:
        out = float(v)
    except ValueError:
        out = -1.0
    if not out >= 0 or out == float("inf"):  # also NaN
        log.warning("mmshm: %s=%r is not a number of seconds >= 0; using %g", name, v, default)
        return default
    return out


def default_min_free_bytes(fs_size: int) -> int:
    """The default budget reserve for a file system of ``fs_size`` bytes."""
    return int(min(max(16 << 20, fs_size * 0.05), 1 << 30))


def min_free_bytes(fs_size: int) -> int:
    """The reserve in force for a file system of ``fs_size`` bytes."""
    v = get().min_free_bytes
    return default_min_free_bytes(fs_size) if v is None else v


def pool_max_bytes(fs_size: int) -> int:
    """Most idle pooled bytes one process keeps, for a file system of
    ``fs_size`` bytes."""
    v = get().pool_max_bytes
    return int(min(fs_size // 4, 2 << 30)) if v is None else v


@dataclass(frozen=True)
class Settings:
    dir: str
    min_bytes: int
    disable: bool
    sweep_interval_s: float
    min_free_bytes: int | None
    max_bytes: int
    fd_reserve: int
    reap_interval_s: float
    pool: bool
    pool_idle_s: float
    pool_max_bytes: int | None
    node_id: str | None = None
    hash: str = "lazy"
    in_flight_grace_s: float = 300.0
    debug_refs: bool = False


_settings: Settings | None = None


def reload() -> Settings:
    """Re-read the environment and return the new settings."""
    global _settings
    _settings = Settings(
        dir=os.environ.get("MMSHM_DIR") or "/dev/shm",
        min_bytes=int(os.environ.get("MMSHM_MIN_BYTES", "65536")),
        disable=_env_bool("MMSHM_DISABLE", False),
        sweep_interval_s=float(os.environ.get("MMSHM_SWEEP_INTERVAL_S", "1.0")),
        min_free_bytes=_env_int("MMSHM_MIN_FREE_BYTES"),
        max_bytes=_env_int("MMSHM_MAX_BYTES") or 0,
        fd_reserve=_env_int("MMSHM_FD_RESERVE") if os.environ.get("MMSHM_FD_RESERVE") else 64,
        reap_interval_s=float(os.environ.get("MMSHM_REAP_INTERVAL_S", "60")),
        pool=_env_bool("MMSHM_POOL", True),
        pool_idle_s=float(os.environ.get("MMSHM_POOL_IDLE_S", "10")),
        pool_max_bytes=_env_int("MMSHM_POOL_MAX_BYTES"),
        node_id=(os.environ.get("MMSHM_NODE_ID") or "").strip() or None,
        hash=_env_choice("MMSHM_HASH", ("lazy", "eager")),
        in_flight_grace_s=_env_seconds("MMSHM_IN_FLIGHT_GRACE_S", 300.0),
        debug_refs=_env_bool("MMSHM_DEBUG_REFS", False),
    )
    return _settings


def get() -> Settings:
    """Return the cached settings (read from the environment on first use)."""
    return _settings if _settings is not None else reload()
