"""This process's segment table: its open segments, its warm pool, its sweeper.

One object, :data:`TABLE` (a :class:`SegmentTable`), holds all the segment
layer's process-local state: the open segments by name (a process holds one
descriptor per segment whatever number of handles and views it has of it),
the bytes it created, the warm pool, the sweeper thread and what it knows of
each segment directory (checked, reaped, its size). A forked child resets it
in one place (:meth:`SegmentTable.reset_after_fork`): the parent's segments
are closed, not released (their references are the parent's).

**The warm pool.** Writing into a fresh tmpfs segment runs at the kernel's
page-allocation speed (``posix_fallocate``, then a ``pwrite`` that spares
the zeroing a page fault would do: a few GB/s); copying into warm pages at
memcpy speed. So a producing process keeps the segments it created and
reuses one whose count came back to zero instead of creating a file.
Every reuse bumps the segment's *generation* (:func:`mmshm.segments.segfile.revive`);
a handle carries the generation it was made for, and attach and every
reference update check it, so a stale handle can never read a reused
segment's new bytes. Idle pooled segments are unlinked after
``MMSHM_POOL_IDLE_S``, beyond ``MMSHM_POOL_MAX_BYTES``, when the budget guard
needs the room, and when the owner exits; after a SIGKILL the reaper
reclaims them (nobody holds them).

**Which idle segment serves a request: best fit.** A new segment is made at
its size class (:func:`size_class`: eight per power of two, at most 12.5%
slack). A request takes the *smallest* idle segment of this process (arena or
plain, as asked) that holds its size class, the longest idle first among
equal sizes: a plain segment up to :data:`FIT_RATIO` (4) times the size
class, an arena segment of any size (:data:`ARENA_FIT_RATIO`).

Why: Qwen2-VL-style processors give a different ``pixel_values`` size for
almost every photo (dynamic resolution between ``min_pixels`` and
``max_pixels``), so reuse by exact size class (what the pool did first)
misses on most photos, and a miss in the arena is a new mapping that every
TP rank registers with CUDA. Power-of-two classes, as PyTorch's
``CachingHostAllocator`` rounds (reusing a block only within its class),
bound the waste to 2x too, but every segment pays it (1.4x on average, new
ones included), and a request whose class has no idle segment still misses
beside an idle segment one class up; jemalloc's four classes per doubling
waste less and miss more. Best fit wastes only on a hit, only memory the
pool already holds, and creates tight segments on a miss. The bound differs:
an idle plain segment is memory the pool could give back, and a small
tensor holding a large one can make the next large tensor miss into fresh
pages (the slow case), so a plain segment serves only requests of at least
a quarter of its size (with one segment per request, below, one request's
size ranges from 0.7 to 193 MB on the mixed workload: a bound of 2x gave a
93.3% hit rate there, 4x 96.1%, 8x 97.8%, one run each on the project's
2-core host; 4x is the smallest that meets the 95% goal, and the pool's
idle bytes stay bounded by ``MMSHM_POOL_MAX_BYTES``); an idle arena segment is memory the arena keeps (and every
rank has registered) whatever it holds, and any miss costs a registration
per rank, so any idle arena segment that holds the tensor serves it (the
arena's size, ``MMSHM_ARENA_BYTES``, bounds the waste). On the mixed-size
workload (``mmshm bench --workload mixed``: 1-8 photos per request, 3 in
flight; docs/gpu.md gives the figures) this raises the pool's hit rate and
cuts the registrations; the arena then gives idle segments back only when
no idle one fits. A consumer never sees the slack: a handle carries its
tensor's ``nbytes``, and every view and copy is cut to it.

**One segment per request, not per photo.** Best fit alone leaves the pool
growing towards the most *photos* ever in flight at once (up to 24 with 8
photos and 3 requests in flight), and each new arena segment is a
registration on every TP rank. So the walker and the servers' send paths
put all of one request's eligible tensors in one segment
(:meth:`mmshm.ShmTensor.from_tensors`, each tensor at a 4 KiB-aligned
offset its handle carries): one pool request per request, and the pool
only has to cover the requests in flight, which the warm-up reaches. Both
servers hand mmshm a request's images as views of one tensor (SGLang
0.5.23 splits a bundled ``pixel_values`` into per-image items by slicing it,
``mm_utils.get_new_expanded_mm_items``; vLLM 0.32/0.33 slice a batched
field into per-item ``MultiModalKwargsItem`` s,
``MultiModalFlatField.build_elems``), but what mmshm groups is all the
eligible tensors of one request (one message), whatever their storage, so a
model whose processor gives separate tensors is grouped too. The cost: the
segment goes back to the pool only when its last tensor is let go. A
server releases a request's features together, except where a cache keeps
one (vLLM's EngineCore receiver cache, the processor cache, keeps items by
hash beyond their request): then one cached image holds its whole request's
segment, up to 8 photos' bytes, until the cache lets it go. A group that does not fit in one segment (ENOSPC, the budget)
falls back per tensor, as single tensors do.

**A file shortened by a third party** (a tmpfs cleaner, an operator's
``truncate``) is never written through a mapping, which would SIGBUS the
producer: :meth:`SegmentTable.pool_take` checks the file's size (one
``fstat``, about 1 us) against ``HEADER_SIZE + payload size`` before it
revives an idle segment, and :func:`~mmshm.segments.segfile.revive` again
under the segment's mutex; a short one is unlinked and let go, counted in
``mmshm_pool_dropped_total{reason="truncated"}`` and said once at WARNING
(the sweep drops an idle one it finds short the same way). What is left is
a truncation *during* the copy into a reused segment (a millisecond or two
per photo): that still SIGBUSes the producer. Closing it would cost the
copy: ``pwrite`` (which extends a short file instead of faulting) runs at a
third of a mapped copy's speed on one thread, and tmpfs serialises writes to
one file, so the copy could not be split across threads; a second
``posix_fallocate`` before each reuse (which restores a short file's size)
costs half a warm copy and still leaves the copy itself open. Measured on
the project's 2-core host, 22.5 MB (one 720p photo) into a warm pooled
segment: mapped copy 1.1 ms, ``pwrite`` 3.1-3.4 ms, ``posix_fallocate`` of
the allocated file 0.53-0.66 ms, ``fstat`` 1 us. A consumer never reads
wrong bytes either way: attach and every view check the file's size.

**The sweeper.** :meth:`SegmentTable.sweep` runs on every creation (before
the budget is counted) and every ``MMSHM_SWEEP_INTERVAL_S`` on a daemon
thread (``mmshm-sweep``), started with the process's first created segment
and ended once it owns none. The thread also runs the automatic reaper
(:meth:`SegmentTable.maybe_reap`) on every directory this process has
created segments in.

Invariants:

- the table is read and changed only under :attr:`SegmentTable.lock`
  (re-entrant; a forked child gets a fresh one, since another thread of the
  parent may have held it at the fork);
- :attr:`SegmentTable.owned_bytes` is the sum of ``HEADER_SIZE + payload
  size`` of the created segments in the table;
- a segment leaves the table only through :meth:`SegmentTable.forget`, which
  records a clean detach in its header and closes it;
- only the creating process takes a pooled segment back, and only at count
  0 in state ``POOLED``; a pinned segment (a view of this process depends on
  it) is never taken or unlinked;
- the sweeper thread never dies of an exception of the reaper (logged).

Depends on :mod:`mmshm.segments.segfile`, :mod:`mmshm.segments.reaper` and the metrics; called
from :mod:`mmshm.segments.segment`, never calls it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mmshm import config
from mmshm.metrics import ARENA_IN_USE_BYTES, BYTES_IN_USE, POOL_DROPPED, SEGMENTS_IN_USE
from mmshm.segments.reaper import ReapReport, reap
from mmshm.segments.segfile import (
    HEADER_SIZE,
    STATE_FREED,
    STATE_LIVE,
    STATE_POOLED,
    detach,
    peek_header,
    revive,
    segment_dir,
    unlink_pooled,
)

#: a :class:`mmshm.segments.segment.Segment` (that module sits above this one: never imported)
Segment = Any

log = logging.getLogger("mmshm")

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_POPULATE_OK = True


_CUDA_HOST: bool | None = None


def cuda_host() -> bool:
    """Whether this process could use CUDA: torch is a CUDA build, the NVIDIA
    driver's device files exist and ``CUDA_VISIBLE_DEVICES`` does not hide
    every GPU. Cached per process. It never initializes CUDA (no
    ``torch.cuda.is_available()``, which would make a later fork's children
    unable to use CUDA); the arena's default size depends on it
    (:func:`mmshm.config.arena_bytes`)."""
    global _CUDA_HOST
    if _CUDA_HOST is None:
        try:
            import torch
            built = torch.version.cuda is not None
        except Exception:  # noqa: BLE001 - no usable torch: no CUDA
            built = False
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        _CUDA_HOST = (built and os.path.exists("/dev/nvidiactl")
                      and (visible is None or visible.strip() not in ("", "-1")))
    return _CUDA_HOST


#: a plain pooled segment serves a request whose size class is at least
#: ``1 / FIT_RATIO`` of its own size (see the module docstring: best fit up to 4x)
FIT_RATIO = 4.0
#: the same for an arena segment: any idle arena segment that holds the request
#: (the arena's size bounds what is kept; see the module docstring)
ARENA_FIT_RATIO = float("inf")

_said: set[str] = set()


def size_class(total: int) -> int:
    """Round a segment size (bytes, header included) up to its pool class:
    whole pages up to 64 KiB, then eight classes per power of two: a size in
    [2**k, 2**(k+1)) rounds up to a multiple of 2**(k-3), so the slack is
    below 12.5% of the size (an 8 MiB tensor plus its header takes 9 MiB)."""
    if total <= 1 << 16:
        return -(-total // 4096) * 4096
    step = (1 << (total.bit_length() - 1)) // 8
    return -(-total // step) * step


class SegmentTable:
    """The segment layer's state in one process (see the module docstring).

    Attributes:
        lock: re-entrant; guards everything below.
        segments: name -> :class:`mmshm.segments.segment.Segment`, in the order they
            were registered or last taken from the pool.
        owned_bytes: bytes (header included) of this process's created, not
            yet closed segments.
        arena_bytes: the part of ``owned_bytes`` that are arena segments
            (``FLAG_ARENA``: kept in the pool for good, see
            :mod:`mmshm.segments.arena`), in use or idle.
        let_go_hooks: callables ``hook(segment)`` run by
            :meth:`before_let_go` (add with :meth:`add_let_go_hook`).
    """

    def __init__(self):
        self.lock = threading.RLock()
        self.segments: dict[str, Segment] = {}
        self.owned_bytes = 0
        self.arena_bytes = 0
        self._sweeper: threading.Thread | None = None
        #: directory -> why it cannot hold segments (None: it can), once checked
        self._dir_problems: dict[str, str | None] = {}
        #: directories this process created segments in (reaped at the first
        #: segment, then by the sweeper thread)
        self._reaped_dirs: set[str] = set()
        self._last_reap: dict[str, float] = {}
        self._fs_size: dict[str, int] = {}
        self.let_go_hooks: list[Callable[[Segment], None]] = []

    # -- what hangs on a segment's mapping ---------------------------------
    def add_let_go_hook(self, hook: Callable[[Segment], None]) -> None:
        """Run ``hook(segment)`` before this process lets go of a segment:
        before its file is unlinked here (:meth:`unlink_pooled`: the sweep's
        idle time and pool cap, :meth:`trim_pool`, :meth:`evict_arena`, an
        owner's close or exit; :meth:`drop_truncated`) and before its
        creator mapping is released (:meth:`forget`), so that whatever a
        caller attached to that mapping (a transfer engine's registration of
        its pages: :mod:`mmshm.transport.ec_store`) is given back while the
        file and the pages are still there. A ``weakref.finalize`` on the
        mapping (what :func:`mmshm.segments.arena._register_producer` uses
        for CUDA) runs only at the unmapping, after the unlink. Not run for
        a file another process unlinks, nor at a count that falls to 0 in a
        segment that is not poolable (``MMSHM_POOL=0``: the last release
        unlinks it), nor in a forked child (which starts with none). Runs
        under :attr:`lock`: a hook must be quick, must not wait for a lock
        whose holder may wait for :attr:`lock`, and should not raise (a
        raise is logged at DEBUG). Added once (an equal hook is not added
        twice)."""
        with self.lock:
            if hook not in self.let_go_hooks:
                self.let_go_hooks.append(hook)

    def remove_let_go_hook(self, hook: Callable[[Segment], None]) -> None:
        """Stop running ``hook`` (one added by :meth:`add_let_go_hook`;
        absent: nothing)."""
        with self.lock:
            if hook in self.let_go_hooks:
                self.let_go_hooks.remove(hook)

    def before_let_go(self, seg: Segment) -> None:
        """Run the let-go hooks on ``seg`` (call under :attr:`lock`, before
        its file is unlinked or its mapping released). Never raises."""
        for hook in list(self.let_go_hooks):
            try:
                hook(seg)
            except Exception as exc:  # noqa: BLE001 - letting go never fails
                log.debug("mmshm: a let-go hook failed on %s: %s", seg.name, exc)

    def reset_after_fork(self) -> None:
        """In a forked child: a fresh lock, no sweeper, no let-go hooks, and
        the parent's segments closed (not released) and forgotten."""
        self.lock = threading.RLock()
        self._sweeper = None
        self.let_go_hooks = []
        self.owned_bytes = 0
        self.arena_bytes = 0
        for seg in list(self.segments.values()):
            seg.close()
        self.segments.clear()

    # -- open segments -----------------------------------------------------
    def get(self, name: str) -> Segment | None:
        """This process's open segment ``name``, or None (call under :attr:`lock`)."""
        return self.segments.get(name)

    def register(self, seg: Segment) -> None:
        """Add a segment just created or attached (call under :attr:`lock`);
        a created one counts in :attr:`owned_bytes` and starts the sweeper."""
        self.segments[seg.name] = seg
        if seg.owned:
            self.owned_bytes += HEADER_SIZE + seg.payload_size
            if seg.arena:
                self.arena_bytes += HEADER_SIZE + seg.payload_size
            self._ensure_sweeper()

    def forget(self, seg: Segment) -> None:
        """Let go of ``seg``: a clean detach in its header, out of the table,
        closed (call under :attr:`lock`; the let-go hooks run first)."""
        if self.let_go_hooks:
            self.before_let_go(seg)
        if self.segments.get(seg.name) is seg:
            del self.segments[seg.name]
            detach(seg.fd)
            if seg.owned:
                self.owned_bytes -= HEADER_SIZE + seg.payload_size
                if seg.arena:
                    self.arena_bytes -= HEADER_SIZE + seg.payload_size
                SEGMENTS_IN_USE.dec()
                BYTES_IN_USE.dec(HEADER_SIZE + seg.payload_size)
        seg.close()

    def names(self) -> list[str]:
        """Names of the segments this process currently has open."""
        with self.lock:
            return list(self.segments)

    def pooled_names(self) -> list[str]:
        """Names of this process's idle segments in its warm pool."""
        with self.lock:
            return [n for n, s in self.segments.items()
                    if s.owned and s.status() == STATE_POOLED]

    # -- segment directories -----------------------------------------------
    def ensure_dir(self, directory: str) -> bool:
        """Make the segment directory usable, once per process and directory.

        A missing directory whose parent exists is created with mode 0700 (the
        example launch scripts point ``MMSHM_DIR`` at one that does not exist
        yet). A directory that cannot hold segments (parent missing, not a
        directory, not writable, read-only) gets one WARNING naming it, the
        reason and the fix; tensors then travel inline, each fallback counted.
        Returns whether the directory was created now. Never raises.
        """
        if directory in self._dir_problems:
            return False
        made = False
        problem = None
        try:
            os.mkdir(directory, 0o700)
            made = True
            log.info("mmshm: created the segment directory %s (mode 0700)", directory)
        except FileExistsError:
            pass
        except FileNotFoundError:
            pass  # its parent is missing: config.dir_problem says so
        except OSError as exc:
            problem = config.DirProblem(directory, f"it cannot be created ({exc.strerror})")
        if problem is None:
            problem = config.dir_problem(directory)  # the one wording (mmshm doctor's too)
        self._dir_problems[directory] = problem and problem.reason
        if problem is not None and os.environ.get("MMSHM_DIR_PROBLEM_SAID") == directory:
            # ``mmshm run`` said it once for every process of the server
            log.info("mmshm: MMSHM_DIR=%s is unusable (%s); tensors travel inline, as "
                     "mmshm run said", directory, problem.reason)
        elif problem is not None:
            log.warning("mmshm: %s", problem.message(
                "every tensor travels inline (correct, but without shared memory)"))
        return made

    def dir_problem(self, directory: str) -> str | None:
        """Why ``directory`` cannot hold segments, as :meth:`ensure_dir`
        found it; None if it can or was not checked yet."""
        return self._dir_problems.get(directory)

    def first_use(self, directory: str | None = None) -> None:
        """On this process's first segment in ``directory`` (default
        ``MMSHM_DIR``): make it usable (:meth:`ensure_dir`) and reclaim its
        orphans (:meth:`maybe_reap`); later calls do nothing."""
        d = segment_dir(directory)
        if d in self._reaped_dirs:
            return
        self._reaped_dirs.add(d)
        self.ensure_dir(d)
        self.maybe_reap(d)

    def maybe_reap(self, directory: str | None = None) -> ReapReport | None:
        """Run :func:`mmshm.segments.reaper.reap` unless this process ran it on
        ``directory`` less than ``MMSHM_REAP_INTERVAL_S`` ago (0 disables).
        Called on a process's first segment in a directory (start-up) and by
        the sweeper thread. Logs and returns None if the pass fails."""
        interval = config.get().reap_interval_s
        if interval <= 0:
            return None
        d = segment_dir(directory)
        now = time.monotonic()
        if now - self._last_reap.get(d, -interval) < interval:
            return None
        self._last_reap[d] = now
        try:
            return reap(d)
        except OSError as exc:
            log.warning("mmshm: reaper pass over %s failed: %s", d, exc)
            return None

    def fs_size(self, directory: str) -> int:
        """Size in bytes of the filesystem holding ``directory`` (0 if unknown)."""
        size = self._fs_size.get(directory)
        if size is None:
            try:
                st = os.statvfs(directory)
                size = self._fs_size[directory] = st.f_blocks * st.f_frsize
            except OSError:
                return 0
        return size

    # -- the warm pool -----------------------------------------------------
    def pool_take(self, directory: str, total: int, arena: bool) -> Segment | None:
        """The idle pooled segment that best fits a request of ``total`` bytes
        (its size class, header included) in ``directory``, an arena segment
        or a plain one as ``arena`` says, revived (count 1, next generation);
        None if there is none (call under :attr:`lock`).

        Best fit: the smallest idle segment of at least ``total`` bytes and
        at most :data:`FIT_RATIO` (plain) or :data:`ARENA_FIT_RATIO` (arena:
        any) times it; among equal sizes the longest idle (a segment taken
        moves to the end of the table). A candidate whose file is shorter than its header says
        (truncated by a third party) is unlinked and let go, counted in
        ``mmshm_pool_dropped_total{reason="truncated"}`` (WARNING once), never
        written. Cost: one ``fstat`` and one memory read per candidate looked
        at; under steady traffic the first candidate is idle."""
        ratio = ARENA_FIT_RATIO if arena else FIT_RATIO
        limit = total * ratio
        fits = sorted(
            (seg for seg in self.segments.values()
             if seg.owned and seg.pins == 0 and seg.arena == arena
             and total <= HEADER_SIZE + seg.payload_size <= limit
             and seg.directory == directory),
            key=lambda seg: seg.payload_size)  # stable: the longest idle first
        for seg in fits:
            size = HEADER_SIZE + seg.payload_size
            try:
                st = os.fstat(seg.fd)
            except OSError:
                continue
            if st.st_nlink == 0 or st.st_size < HEADER_SIZE:
                continue  # gone for good: the sweep lets go of it
            if st.st_size < size:
                self.drop_truncated(seg, st.st_size)
                continue
            if seg.status() != STATE_POOLED:
                continue
            if self.take_pooled(seg):
                return seg
        return None

    def take_pooled(self, seg: Segment) -> bool:
        """Take idle pooled ``seg`` for reuse (call under :attr:`lock`):
        revived (count 1, next generation) and moved to the end of the table,
        so the scans meet the longest-idle segments first. False if it could
        not be revived (its state changed, or its file is short)."""
        gen = revive(seg.fd, seg.path)
        if gen is None:
            return False
        seg.gen = gen
        seg.idle_since = None
        del self.segments[seg.name]
        self.segments[seg.name] = seg
        return True

    @staticmethod
    def _short(seg: Segment) -> int | None:
        """The size on disk of ``seg``'s file if it is shorter than its header
        says (``HEADER_SIZE`` + payload size), else None (also if it cannot
        be read: the state checks see to that)."""
        try:
            size = os.fstat(seg.fd).st_size
        except OSError:
            return None
        return size if size < HEADER_SIZE + seg.payload_size else None

    @staticmethod
    def _damaged(seg: Segment) -> bool:
        """Whether ``seg``'s file no longer starts with an mmshm header (a
        third party overwrote it); False if it cannot be read."""
        try:
            return peek_header(seg.fd) is None
        except OSError:
            return False

    def drop_truncated(self, seg: Segment, on_disk: int, reason: str = "truncated") -> None:
        """Let go of an idle pooled segment whose file a third party shortened
        to ``on_disk`` bytes (call under :attr:`lock`): unlinked if its name
        still names this file, closed, counted in
        ``mmshm_pool_dropped_total{reason="truncated"}``, said once at
        WARNING. ``reason="damaged"``: its header was overwritten (no
        mmshm header any more), counted and said as such. Never raises."""
        POOL_DROPPED.labels(reason=reason).inc()
        if reason == "damaged" and "damaged" not in _said:
            _said.add("damaged")
            log.warning(
                "mmshm: a segment of this process, %s, no longer has an mmshm header: "
                "something outside mmshm overwrote it; it is dropped, never reused (said "
                "once; mmshm_pool_dropped_total{reason=\"damaged\"} counts each); fix: keep "
                "other programs off the segment directory (%s) or give mmshm a directory of "
                "its own (MMSHM_DIR)", seg.path, seg.directory)
        elif reason == "truncated" and "truncated" not in _said:
            _said.add("truncated")
            log.warning(
                "mmshm: a pooled segment, %s, is %d bytes on disk where its header says %d: "
                "something outside mmshm truncated it (a tmpfs cleaner, an operator's "
                "truncate); it is dropped, never written (said once; "
                "mmshm_pool_dropped_total{reason=\"truncated\"} counts each); fix: keep "
                "cleaners off the segment directory (%s) or give mmshm a directory of its "
                "own (MMSHM_DIR)", seg.path, on_disk, HEADER_SIZE + seg.payload_size,
                seg.directory)
        if self.let_go_hooks:
            self.before_let_go(seg)
        try:
            st = os.fstat(seg.fd)
            if st.st_nlink:
                cur = os.stat(seg.path, follow_symlinks=False)
                if (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
                    os.unlink(seg.path)
        except OSError:
            pass
        self.forget(seg)

    def unlink_pooled(self, seg: Segment) -> None:
        """Unlink an idle pooled segment (the owner's decision) and let go of
        it; the let-go hooks run first."""
        if self.let_go_hooks:
            self.before_let_go(seg)
        unlink_pooled(seg.fd, seg.path)
        self.forget(seg)

    def trim_pool(self, directory: str | None = None) -> int:
        """Unlink every idle pooled segment of this process (in ``directory``,
        or all). Returns the bytes given back."""
        freed = 0
        with self.lock:
            for seg in list(self.segments.values()):
                if (seg.owned and seg.pins == 0
                        and (directory is None or seg.directory == directory)
                        and seg.status() == STATE_POOLED):
                    freed += HEADER_SIZE + seg.payload_size
                    self.unlink_pooled(seg)
        return freed

    def evict_arena(self, directory: str, need: int) -> int:
        """Unlink idle arena segments of this process in ``directory``, the
        longest idle first, until ``need`` bytes are given back (an arena
        full of segments of another size: their consumers' mappings go with
        them). Returns the bytes given back (call under :attr:`lock`)."""
        freed = 0
        for seg in list(self.segments.values()):
            if freed >= need:
                break
            if (seg.owned and seg.arena and seg.pins == 0 and seg.directory == directory
                    and seg.status() == STATE_POOLED):
                freed += HEADER_SIZE + seg.payload_size
                self.unlink_pooled(seg)
        return freed

    # -- the sweeper -------------------------------------------------------
    def sweep(self) -> int:
        """Let go of this process's created segments whose last reference is
        gone (closing them, or keeping them pooled), and trim the pool: idle
        segments older than ``MMSHM_POOL_IDLE_S``, or beyond
        ``MMSHM_POOL_MAX_BYTES`` (longest idle first), are unlinked; arena
        segments stay (they are the arena). Returns how many segments were
        closed. Cheap: an ``fstat`` and a memory read per segment."""
        n = 0
        cfg = config.get()
        now = time.monotonic()
        idle: list[Segment] = []
        arena_idle = 0
        with self.lock:
            for seg in list(self.segments.values()):
                if not seg.owned or seg.pins:
                    continue
                st = seg.status()
                if st == STATE_FREED:
                    self.forget(seg)
                    n += 1
                    continue
                if st not in (STATE_LIVE, STATE_POOLED) and self._damaged(seg):
                    # its header overwritten by a third party: neither live nor
                    # pooled for good, so nothing else would ever let go of it
                    self.drop_truncated(seg, 0, reason="damaged")
                    n += 1
                    continue
                if st == STATE_POOLED:
                    short = self._short(seg)
                    if short is not None:  # truncated by a third party while idle
                        self.drop_truncated(seg, short)
                        n += 1
                        continue
                if st == STATE_POOLED and seg.arena and cfg.pool:
                    arena_idle += HEADER_SIZE + seg.payload_size
                elif st == STATE_POOLED:
                    if seg.idle_since is None:
                        seg.idle_since = now
                    if not cfg.pool or now - seg.idle_since >= cfg.pool_idle_s:
                        self.unlink_pooled(seg)
                        n += 1
                    else:
                        idle.append(seg)
            if idle:
                cap = config.pool_max_bytes(self.fs_size(idle[0].directory))
                total = sum(HEADER_SIZE + s.payload_size for s in idle)
                for seg in sorted(idle, key=lambda s: s.idle_since or 0.0):
                    if total <= cap:
                        break
                    total -= HEADER_SIZE + seg.payload_size
                    self.unlink_pooled(seg)
                    n += 1
            if self.arena_bytes or arena_idle:
                ARENA_IN_USE_BYTES.set(max(self.arena_bytes - arena_idle, 0))
        return n

    def warm_pooled(self) -> int:
        """Map into this process the pages of its idle pooled segments that
        were written with ``pwrite`` and never touched through its mapping
        (``Segment.cold``), with ``MADV_POPULATE_WRITE``, so that their next
        reuse copies without a page fault per 4 KiB (5,500 per 22.5 MB
        photo: 17-21 ms against 1.9 on a loaded 2-core host). Runs outside
        :attr:`lock` (the sweeper calls it after each sweep; ``mmshm bench``
        between runs); the contents are not touched, so a reuse meanwhile is
        safe. Returns how many segments it warmed; does nothing where the
        kernel lacks the advice (before Linux 5.14)."""
        global _POPULATE_OK
        if not _POPULATE_OK:
            return 0
        with self.lock:
            cold = [s for s in self.segments.values()
                    if s.cold and s.owned and s.shared_map is not None
                    and s.status() == STATE_POOLED]
            for s in cold:
                s.cold = False
        n = 0
        for s in cold:
            buf = s.shared_map  # kept mapped while advised
            if buf is None:
                continue
            addr = ctypes.addressof(buf) + HEADER_SIZE
            if _madvise(addr, s.payload_size, _MADV_POPULATE_WRITE) == 0:
                n += 1
                continue
            err = ctypes.get_errno()
            if err == errno.EINVAL:  # an older kernel: a reuse faults, as before
                _POPULATE_OK = False
                return n
            # ENOMEM, EFAULT...: nothing is lost, the reuse faults the pages in
        return n

    def _sweep_loop(self) -> None:
        while True:
            time.sleep(config.get().sweep_interval_s)
            for d in list(self._reaped_dirs):
                try:
                    self.maybe_reap(d)
                except Exception as exc:  # noqa: BLE001 - never kill the sweeper
                    log.warning("mmshm: periodic reap of %s failed: %s", d, exc)
            with self.lock:
                self.sweep()
                if not any(s.owned for s in self.segments.values()):
                    self._sweeper = None
                    return
            try:
                self.warm_pooled()
            except Exception as exc:  # noqa: BLE001 - never kill the sweeper
                log.warning("mmshm: warming pooled segments failed: %s", exc)

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep_loop, name="mmshm-sweep",
                                             daemon=True)
            self._sweeper.start()


#: This process's segment table.
TABLE = SegmentTable()
os.register_at_fork(after_in_child=TABLE.reset_after_fork)
