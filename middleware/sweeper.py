"""The sweeper: this process lets go of its segments freed elsewhere and trims its pool.

:func:`sweep` runs on every creation (before the budget is counted) and
every ``MMSHM_SWEEP_INTERVAL_S`` on a daemon thread (``mmshm-sweep``), started
with the process's first created segment and ended once it owns none. The
thread also runs the automatic reaper (:func:`mmshm.reaper.maybe_reap`) on
every directory this process has created segments in
(:data:`_reaped_dirs`).

Invariants:

- a sweep runs under the registry lock and looks only at this process's
  created, unpinned segments: an ``fstat`` and a memory read each;
- a segment whose last reference is gone is closed (freed) or kept pooled;
  pooled segments idle beyond ``MMSHM_POOL_IDLE_S``, or beyond
  ``MMSHM_POOL_MAX_BYTES`` (longest idle first), are unlinked;
- the thread never dies of an exception of the reaper (logged).

Depends on :mod:`mmshm.registry`, :mod:`mmshm.pool`, :mod:`mmshm.reaper` and
:mod:`mmshm.segfile`; called from :mod:`mmshm.segment`, never calls it.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from . import config
from .pool import _unlink_pooled
from .reaper import maybe_reap
from .registry import _LOCK, _REGISTRY, _forget
from .segfile import HEADER_SIZE, STATE_FREED, STATE_POOLED

log = logging.getLogger("mmshm")

_sweeper: threading.Thread | None = None
#: directories this process created segments in (reaped once at the first,
#: then by the sweeper thread)
_reaped_dirs: set[str] = set()


def sweep() -> int:
    """Let go of this process's created segments whose last reference is gone
    (closing them, or keeping them pooled), and trim the pool: idle segments
    older than ``MMSHM_POOL_IDLE_S``, or beyond ``MMSHM_POOL_MAX_BYTES``, are
    unlinked. Returns how many segments were closed. Cheap: an ``fstat`` and a
    memory read per segment."""
    n = 0
    cfg = config.get()
    now = time.monotonic()
    idle: list = []
    with _LOCK:
        for seg in list(_REGISTRY.values()):
            if not seg.owned or seg.pins:
                continue
            st = seg.status()
            if st == STATE_FREED:
                _forget(seg)
                n += 1
            elif st == STATE_POOLED:
                if seg.idle_since is None:
                    seg.idle_since = now
                if not cfg.pool or now - seg.idle_since >= cfg.pool_idle_s:
                    _unlink_pooled(seg)
                    n += 1
                else:
                    idle.append(seg)
        if idle:
            cap = config.pool_max_bytes(_fs_size(idle[0].directory))
            total = sum(HEADER_SIZE + s.payload_size for s in idle)
            for seg in sorted(idle, key=lambda s: s.idle_since or 0.0):
                if total <= cap:
                    break
                total -= HEADER_SIZE + seg.payload_size
                _unlink_pooled(seg)
                n += 1
    return n


_FS_SIZE: dict[str, int] = {}


def _fs_size(directory: str) -> int:
    size = _FS_SIZE.get(directory)
    if size is None:
        try:
            st = os.statvfs(directory)
            size = _FS_SIZE[directory] = st.f_blocks * st.f_frsize
        except OSError:
            return 0
    return size


def _sweep_loop() -> None:
    global _sweeper
    while True:
        time.sleep(config.get().sweep_interval_s)
        for d in list(_reaped_dirs):
            try:
                maybe_reap(d)
            except Exception as exc:  # noqa: BLE001 - never kill the sweeper
                log.warning("mmshm: periodic reap of %s failed: %s", d, exc)
        with _LOCK:
            sweep()
            if not any(s.owned for s in _REGISTRY.values()):
                _sweeper = None
                return


def _ensure_sweeper() -> None:
    global _sweeper
    if _sweeper is None:
        _sweeper = threading.Thread(target=_sweep_loop, name="mmshm-sweep", daemon=True)
        _sweeper.start()


def _after_fork_in_child() -> None:
    global _sweeper
    _sweeper = None


os.register_at_fork(after_in_child=_after_fork_in_child)
