"""The warm pool: a producing process reuses the segments it created.

Copying into a fresh tmpfs segment runs at page-fault speed (about 1.3 GB/s
here: allocation and zeroing); into warm pages at memcpy speed. So a producing process keeps the segments it created, in size classes (eight
per power of two, at most 12.5% slack), and reuses one whose count came back to
zero instead of creating a file. Every reuse bumps the segment's *generation*;
a handle carries the generation it was made for, and attach and every
reference update check it, so a stale handle can never read a reused segment's
new bytes. A pooled segment is never reused while any holder in any process
has a view: views hold references, and only a count of zero is pooled. Idle
pooled segments are unlinked after ``MMSHM_POOL_IDLE_S``, beyond
``MMSHM_POOL_MAX_BYTES``, when the budget guard needs the room, and when the
owner exits; after a SIGKILL the reaper reclaims them (nobody holds them).

Invariants:

- only the creating process (its registry's owned segments) takes a pooled
  segment back, under the segment mutex, and only at count 0 in state
  ``POOLED``: :func:`_revive` sets count 1 and the next generation in one
  locked update, so a stale handle (older generation) is refused by attach and
  by every reference update;
- a pinned segment (a view of this process depends on it) is never taken or
  unlinked;
- size classes (:func:`size_class`) waste below 12.5% of a segment.

Depends on :mod:`mmshm.segfile` and :mod:`mmshm.registry`; called from
:mod:`mmshm.segment` (create) and :mod:`mmshm.sweeper`, never calls them.
"""

from __future__ import annotations

import fcntl
import os

from .registry import _LOCK, _REGISTRY, _forget
from .segfile import (
    _I64,
    _MUTEX_BYTE,
    _OFF_GEN,
    _OFF_REFCOUNT,
    _OFF_STATE,
    _U32,
    _U64,
    HEADER_SIZE,
    STATE_FREED,
    STATE_LIVE,
    STATE_POOLED,
    _clear_hand_out,
    _lock,
    _read_header,
)


def size_class(total: int) -> int:
    """Round a segment size (bytes, header included) up to its pool class:
    whole pages up to 64 KiB, then eight classes per power of two: a size in
    [2**k, 2**(k+1)) rounds up to a multiple of 2**(k-3), so the slack is
    below 12.5% of the size (an 8 MiB tensor plus its header takes 9 MiB)."""
    if total <= 1 << 16:
        return -(-total // 4096) * 4096
    step = (1 << (total.bit_length() - 1)) // 8
    return -(-total // step) * step


def _revive(seg) -> bool:
    """Take a pooled segment back into use: count 1, next generation."""
    _lock(seg.fd, fcntl.F_WRLCK, _MUTEX_BYTE)
    try:
        hdr = _read_header(seg.fd, seg.path)
        if hdr[2] != STATE_POOLED or hdr[4] != 0 or os.fstat(seg.fd).st_nlink == 0:
            return False
        gen = hdr[7] + 1
        os.pwrite(seg.fd, _U64.pack(gen), _OFF_GEN)
        os.pwrite(seg.fd, _I64.pack(1), _OFF_REFCOUNT)
        os.pwrite(seg.fd, _U32.pack(STATE_LIVE), _OFF_STATE)
        _clear_hand_out(seg.fd)  # a new life: nothing handed out yet
    except OSError:
        return False
    finally:
        _lock(seg.fd, fcntl.F_UNLCK, _MUTEX_BYTE)
    seg.gen = gen
    seg.idle_since = None
    return True


def _pool_take(directory: str, total: int) -> Segment | None:  # noqa: F821 - a mmshm.segment.Segment
    """An idle pooled segment of this size class, revived (count 1). A
    segment taken moves to the end of the registry, so the scan meets the
    longest-idle segments first and under steady traffic stops at the first
    candidate (one ``fstat``), not after every busy one."""
    for seg in list(_REGISTRY.values()):
        if (seg.owned and seg.pins == 0 and seg.directory == directory
                and HEADER_SIZE + seg.payload_size == total
                and seg.status() == STATE_POOLED and _revive(seg)):
            del _REGISTRY[seg.name]
            _REGISTRY[seg.name] = seg
            return seg
    return None


def _unlink_pooled(seg) -> None:
    """Unlink an idle pooled segment (the owner's decision) and let go of it."""
    try:
        _lock(seg.fd, fcntl.F_WRLCK, _MUTEX_BYTE)
        try:
            hdr = _read_header(seg.fd, seg.path)
            if hdr[2] == STATE_POOLED and hdr[4] == 0:
                os.pwrite(seg.fd, _U32.pack(STATE_FREED), _OFF_STATE)
                try:
                    os.unlink(seg.path)
                except FileNotFoundError:
                    pass
            elif hdr[2] == STATE_LIVE:
                return  # cannot happen: only the owner revives
        finally:
            _lock(seg.fd, fcntl.F_UNLCK, _MUTEX_BYTE)
    except OSError:
        pass
    _forget(seg)


def trim_pool(directory: str | None = None) -> int:
    """Unlink every idle pooled segment of this process (in ``directory``, or
    all). Returns the bytes given back."""
    freed = 0
    with _LOCK:
        for seg in list(_REGISTRY.values()):
            if (seg.owned and seg.pins == 0 and (directory is None or seg.directory == directory)
                    and seg.status() == STATE_POOLED):
                freed += HEADER_SIZE + seg.payload_size
                _unlink_pooled(seg)
    return freed
