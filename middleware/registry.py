"""This process's open segments: the registry, its lock, the bytes it owns.

A :class:`~mmshm.segment.Segment` is cached here by name from its creation or
attach until it is closed, so a process holds exactly one descriptor per
segment whatever number of handles and views it has of it.

Invariants:

- the registry is read and changed only under :data:`_LOCK` (re-entrant: the
  pool and the sweeper run under it, called from :mod:`mmshm.segment`);
- :func:`owned_bytes` is the sum of ``HEADER_SIZE + payload_size`` of the
  created segments in the registry: :func:`add_owned` when a created segment
  is registered, :func:`_forget` when it leaves;
- a segment leaves the registry only through :func:`_forget`, which records a
  clean detach in its header (:func:`mmshm.segfile._detach`) and closes it;
- in a forked child the registry starts empty, with a fresh lock (the
  parent's segments are closed, not released: their references are the
  parent's).

Depends only on :mod:`mmshm.segfile` and the metrics; nothing here calls up.
"""

from __future__ import annotations

import os
import threading

from .metrics import BYTES_IN_USE, SEGMENTS_IN_USE
from .segfile import HEADER_SIZE, _detach


class _ForkSafeLock:
    """A re-entrant lock that a forked child replaces by a fresh one (another
    thread of the parent may have held it at the fork). The object stays the
    same, so every module that imported it keeps a valid lock."""

    __slots__ = ("_lock",)

    def __init__(self):
        self._lock = threading.RLock()

    def __enter__(self):
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)

    def _reset(self) -> None:
        self._lock = threading.RLock()


_LOCK = _ForkSafeLock()
_REGISTRY: dict = {}  # name -> mmshm.segment.Segment
_owned_bytes = 0


def add_owned(total: int) -> None:
    """Count ``total`` bytes (header included) of a segment this process
    created and registered (call under :data:`_LOCK`)."""
    global _owned_bytes
    _owned_bytes += total


def _forget(seg) -> None:
    global _owned_bytes
    if _REGISTRY.get(seg.name) is seg:
        del _REGISTRY[seg.name]
        _detach(seg.fd)
        if seg.owned:
            _owned_bytes -= HEADER_SIZE + seg.payload_size
            SEGMENTS_IN_USE.dec()
            BYTES_IN_USE.dec(HEADER_SIZE + seg.payload_size)
    seg.close()


def owned_bytes() -> int:
    """Bytes (header included) of this process's created, not yet closed segments."""
    return _owned_bytes


def open_segments() -> list[str]:
    """Names of the segments this process currently has open."""
    with _LOCK:
        return list(_REGISTRY)


def _after_fork_in_child() -> None:
    global _owned_bytes
    _LOCK._reset()
    _owned_bytes = 0
    for seg in list(_REGISTRY.values()):
        seg.close()
    _REGISTRY.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
