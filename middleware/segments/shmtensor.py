"""``ShmTensor``: a picklable, reference-owning pointer to a tensor in a segment.

Ownership rule: every live ``ShmTensor`` object owns exactly one reference on
its segment. The reference comes from creation (:meth:`ShmTensor.from_tensor`)
or was handed out for it by a giver (:meth:`ShmTensor.share` before pickling
for k receivers). Dropping an unmaterialized handle releases its reference;
:meth:`ShmTensor.materialize` moves it to the returned tensor.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import queue
import sys
import threading
import weakref

import blake3
import msgspec
import numpy as np
import torch

from mmshm import config
from mmshm.errors import (
    HandleError,
    HandleStateError,
    SegmentCorruptError,
    SegmentError,
    SegmentNotFoundError,
    WrongNodeError,
)
from mmshm.metrics import SHM_WRITTEN_BYTES
from mmshm.segments import arena, codec, node, refdebug, segment
from mmshm.segments.codec import HandleMeta
from mmshm.segments.segfile import HEADER_SIZE, os_error
from mmshm.segments.segment import SegmentRef

log = logging.getLogger("mmshm")

_PREAD_CHUNK = 1 << 30
_pwrite = os.pwrite  # (a test breaks it)


#: BLAKE3's threads for one hash with one copy thread (``MMSHM_COPY_THREADS=1``,
#: or a payload under :data:`PARALLEL_MIN_BYTES`): one. On a server the TP
#: ranks (and the other processes) keep the cores busy; a hash spread over
#: threads waits for each of them to be scheduled (milliseconds per request
#: on a loaded host), while one thread hashes at several GB/s.
HASH_THREADS = 1
#: Bytes copied, then hashed while they are still in the core's cache, at a
#: time by :meth:`ShmTensor.from_tensor` on one thread (a multiple of
#: BLAKE3's 1 KiB chunk).
COPY_CHUNK = 256 << 10
#: Bytes one thread copies at a time when a copy is split across threads
#: (:func:`copy_threads` > 1): large enough that the hand-off (a lock and a
#: few Python calls, microseconds) is small next to the copy (~0.2-1 ms).
PARALLEL_CHUNK = 4 << 20
#: A payload smaller than this is copied (and hashed) on the calling thread
#: whatever :func:`copy_threads` says: waking a thread costs more than it saves.
PARALLEL_MIN_BYTES = 4 << 20
#: Most threads the automatic setting (``MMSHM_COPY_THREADS`` 0 or unset)
#: uses: a server's tokenizer shares the host with one feeder process per GPU.
AUTO_MAX_THREADS = 8


def _cpus() -> int:
    """The CPUs this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def auto_copy_threads(cpus: int) -> int:
    """The automatic number of copy threads for a process allowed ``cpus``
    CPUs: half of them (the tokenizer leaves the others to the GPU feeders
    and the rest of the server), at least 1, at most
    :data:`AUTO_MAX_THREADS`. On a 2-CPU host that is 1, as before: there a
    second thread did not make the copy faster (one thread already copies
    at the memory's speed, ~20 GB/s) and, on a loaded host, made the median
    slower when the helper was not scheduled; it pays only with the hash
    beside the copy (``benchmarks/wrap_threads.py``)."""
    return max(1, min(AUTO_MAX_THREADS, cpus // 2))


def copy_threads() -> int:
    """Threads :meth:`ShmTensor.from_tensor` (and :func:`content_hash`)
    may use for one large payload, the calling thread included:
    ``MMSHM_COPY_THREADS`` when set (1: the calling thread only), capped by
    the CPUs in this process's affinity (``os.sched_getaffinity``); 0 or
    unset: :func:`auto_copy_threads`."""
    cpus = _cpus()
    cap = config.get().copy_threads
    return auto_copy_threads(cpus) if not cap else max(1, min(cap, cpus))


def split_threads(threads: int) -> tuple[int, int]:
    """``(copiers, hashers)`` for a copy with a hash on ``threads`` threads:
    about two fifths copy (the calling thread and ``copiers - 1`` helpers),
    the rest hash beside them (one helper running BLAKE3 with ``hashers``
    threads of its own): one thread copies faster than it hashes (here
    ~20 GB/s against ~8; on a 16-core H200 host 4.4 against 3.2)."""
    copiers = max(1, (2 * threads + 2) // 5)
    return copiers, max(1, threads - copiers)


class _Job:
    """Tasks (callables) shared by the calling thread, which takes them from
    the back, and helper threads, which take them from the front. Every task
    is run at most once; after a failure no new task starts."""

    __slots__ = ("active", "error", "hi", "idle", "lo", "lock", "tasks")

    def __init__(self, tasks: list):
        self.tasks = tasks
        self.lo = 0
        self.hi = len(tasks)
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.active = 0
        self.error: BaseException | None = None

    def _claim(self, front: bool) -> int | None:
        with self.lock:
            if self.lo >= self.hi or self.error is not None:
                return None
            self.active += 1
            if front:
                self.lo += 1
                return self.lo - 1
            self.hi -= 1
            return self.hi

    def work(self, front: bool = True) -> None:
        """Run tasks until none is left (a helper: ``front``)."""
        while True:
            i = self._claim(front)
            if i is None:
                return
            exc = None
            try:
                self.tasks[i]()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                exc = e
            with self.lock:
                self.active -= 1
                if exc is not None and self.error is None:
                    self.error = exc
                if self.active == 0:
                    self.idle.notify_all()

    def run(self) -> None:
        """The calling thread's part: run tasks from the back, then wait
        until no helper runs one (even when interrupted: no helper writes
        after this returns), then raise the first task's error if any."""
        interrupted: BaseException | None = None
        try:
            self.work(front=False)
        except BaseException as e:  # noqa: BLE001 - after the helpers stop
            interrupted = e
        with self.lock:
            self.lo = self.hi  # no task starts any more, whatever happened
            while self.active:
                try:
                    self.idle.wait()
                except BaseException as e:  # noqa: BLE001 - a signal: keep waiting
                    interrupted = interrupted or e
        # a helper that takes this job from the queue later finds nothing to
        # run, and holds no view of the segment meanwhile
        self.tasks = ()
        if interrupted is not None:
            raise interrupted
        if self.error is not None:
            raise self.error


class _Helpers:
    """A few persistent helper threads (daemons, started on first need, as
    many as the most ever asked for) serving :class:`_Job` s. The calling
    thread always takes part, so a job finishes even when no helper is
    scheduled (a busy host): it waits only for tasks a helper has begun."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def _serve(self) -> None:
        while True:
            self.queue.get().work()

    def run(self, tasks: list, helpers: int) -> None:
        """Run ``tasks`` on the calling thread and up to ``helpers`` helper
        threads; return when all ran, raise the first error (see
        :meth:`_Job.run`)."""
        job = _Job(tasks)
        helpers = min(helpers, len(tasks) - 1)
        if helpers > 0:
            if len(self.threads) < helpers:
                with self.lock:
                    while len(self.threads) < helpers:
                        th = threading.Thread(target=self._serve, daemon=True,
                                              name=f"mmshm-copy-{len(self.threads) + 1}")
                        th.start()
                        self.threads.append(th)
            for _ in range(helpers):
                self.queue.put(job)
        job.run()


_HELPERS = _Helpers()
# Idle BLAKE3 hashers by thread count: a hasher with max_threads > 1 builds
# its own pool of threads when made, so they are made once and reset.
_HASHERS: dict[int, list] = {}
_HASHERS_LOCK = threading.Lock()
_ORPHANS: list = []  # the parent's, after a fork: never used nor dropped


def _take_hasher(threads: int):
    with _HASHERS_LOCK:
        idle = _HASHERS.get(threads)
        if idle:
            return idle.pop()
    return blake3.blake3(max_threads=threads)


def _give_hasher(threads: int, hasher) -> None:
    hasher.reset()
    with _HASHERS_LOCK:
        _HASHERS.setdefault(threads, []).append(hasher)


def _hash_bytes(data, threads: int) -> bytes:
    """BLAKE3-128 of ``data`` (buffer protocol) on ``threads`` threads."""
    if threads <= 1:
        return blake3.blake3(data, max_threads=HASH_THREADS).digest(codec.HASH_BYTES)
    hasher = _take_hasher(threads)
    try:
        hasher.update(data)
        return hasher.digest(codec.HASH_BYTES)
    finally:
        _give_hasher(threads, hasher)


def _helpers_after_fork() -> None:
    # the parent's threads (ours and the hashers' pools) do not exist here
    global _HELPERS
    _ORPHANS.append((_HELPERS, dict(_HASHERS)))
    _HELPERS = _Helpers()
    _HASHERS.clear()


os.register_at_fork(after_in_child=_helpers_after_fork)


def content_hash(data) -> bytes:
    """BLAKE3 of a tensor's bytes (C order), truncated to 128 bits: on the
    calling thread, or on :func:`copy_threads` threads for a payload of at
    least :data:`PARALLEL_MIN_BYTES` (the digest is the same).

    Args:
        data: a CPU tensor (any dtype, made contiguous if needed) or any
            object exporting the buffer protocol.
    Returns:
        16 bytes.
    """
    if isinstance(data, torch.Tensor):
        t = data.detach().resolve_conj().resolve_neg().contiguous()
        if t.numel() == 0:
            data = b""
        else:
            data = t.reshape(-1).view(torch.uint8).numpy()
    n = memoryview(data).nbytes if not isinstance(data, np.ndarray) else data.nbytes
    return _hash_bytes(data, copy_threads() if n >= PARALLEL_MIN_BYTES else 1)


def _flat_bytes(t: torch.Tensor) -> np.ndarray | None:
    """The bytes of ``t`` (not empty) as a flat ``uint8`` numpy view, in C
    order; None when torch must copy them (not contiguous, a conjugate or
    negative bit, a dtype numpy cannot view)."""
    if t.is_conj() or t.is_neg() or not t.is_contiguous():
        return None
    try:
        return t.reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError, ValueError):
        return None


def _pwrite_range(fd: int, mv: memoryview, offset: int) -> None:
    """``pwrite`` all of ``mv`` at ``offset`` (short writes resumed).
    Raises :class:`OSError`."""
    done = 0
    n = len(mv)
    while done < n:
        k = _pwrite(fd, mv[done:], offset + done)
        if k <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        done += k


def write_and_hash(fd: int, offset: int, src: np.ndarray, hasher=None) -> None:
    """Write ``src`` (a flat ``uint8`` array) into the file open on ``fd``
    from ``offset`` with ``pwrite``, on the calling thread: into pages of a
    tmpfs file that were reserved (``posix_fallocate``) but never touched,
    the kernel copies without zeroing them first, as a fault through a
    mapping would. With ``hasher``, each :data:`COPY_CHUNK` bytes are fed
    to it right after they were written, from the cache. Raises
    :class:`OSError`."""
    mv = memoryview(src)
    n = len(mv)
    step = n if hasher is None else COPY_CHUNK
    off = 0
    while off < n:
        chunk = mv[off:off + step]
        _pwrite_range(fd, chunk, offset + off)
        if hasher is not None:
            hasher.update(chunk)
        off += len(chunk)


def copy_and_hash(dst: np.ndarray, src: np.ndarray, hasher=None) -> None:
    """Copy ``src`` into ``dst`` (flat ``uint8`` arrays of one length) on
    the calling thread; with ``hasher`` (a ``blake3.blake3``), feed it each
    :data:`COPY_CHUNK` bytes of ``dst`` right after copying them, so the
    bytes are hashed from the cache, in one pass over memory. The hash is
    that of the bytes written, the same whatever the chunking."""
    if hasher is None:
        np.copyto(dst, src)
        return
    for off in range(0, len(src), COPY_CHUNK):
        d = dst[off:off + COPY_CHUNK]
        np.copyto(d, src[off:off + COPY_CHUNK])
        hasher.update(d)


def parallel_fill(src: np.ndarray, threads: int, *, dst: np.ndarray | None = None,
                  fd: int = -1, offset: int = 0, hash: bool = False) -> bytes | None:
    """Copy ``src`` (a flat ``uint8`` array) on ``threads`` threads, the
    calling one included, :data:`PARALLEL_CHUNK` bytes at a time: into
    ``dst`` (a flat ``uint8`` array of the same length, e.g. a warm pooled
    segment's mapping; ``np.copyto`` releases the GIL), or, ``dst`` None,
    with ``pwrite`` into the file open on ``fd`` from ``offset`` (a new
    segment; tmpfs serialises writes to one file, so only the calling
    thread writes, in chunks). With ``hash``, BLAKE3 of ``src`` runs beside
    the copy on one helper with threads of its own (:func:`split_threads`),
    and its 16-byte digest (the same as :func:`content_hash`'s) is returned.

    Returns only when no helper runs a task of this call any more (none
    writes afterwards), also when one failed or the caller was
    interrupted. Raises the first task's :class:`OSError` (or other error).
    """
    n = len(src)
    if dst is None:
        copiers, hashers = (1, max(1, threads - 1)) if hash else (1, 0)
    else:
        copiers, hashers = split_threads(threads) if hash else (threads, 0)
    tasks: list = []
    digest: list[bytes] = []
    if hash:
        tasks.append(lambda: digest.append(_hash_bytes(src, hashers)))
    mv = memoryview(src) if dst is None else None
    for off in range(0, n, PARALLEL_CHUNK):
        end = min(n, off + PARALLEL_CHUNK)
        if dst is None:
            tasks.append(lambda o=off, e=end: _pwrite_range(fd, mv[o:e], offset + o))
        else:
            tasks.append(lambda o=off, e=end: np.copyto(dst[o:e], src[o:e]))
    helpers = (copiers - 1) + (1 if hash else 0)
    _HELPERS.run(tasks, helpers)
    return digest[0] if hash else None


def _check_tensor(t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise TypeError(f"only CPU tensors go through shared memory, got {t.device}")
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError("sparse and quantized tensors are not supported")
    if t.dtype not in codec.DTYPE_CODES:
        raise TypeError(f"dtype {t.dtype} cannot travel through shared memory")


def _check_hash(hash: bytes | None) -> None:
    if hash is not None and len(hash) and not codec.HASH_BYTES <= len(hash) <= 32:
        raise ValueError(f"hash must be 16..32 bytes (or empty), got {len(hash)}")


def _uint8_flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _release_view(name: str, gen: int, seg: segment.Segment) -> None:
    """Finalizer of a materialized view: gives back the view's reference."""
    try:
        seg.update_refcount(-1, gen)
    except SegmentNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - a finalizer must not raise
        log.warning("mmshm: releasing %s failed: %s", name, exc)
    finally:
        segment.unpin(seg)


def _fill_one(seg: segment.Segment, payload: np.ndarray, offset: int, t: torch.Tensor,
              src: torch.Tensor, flat: np.ndarray | None, nbytes: int,
              eager: bool) -> bytes | None:
    """Write ``t``'s ``nbytes`` bytes (``flat``: their flat ``uint8`` view,
    None when torch must copy them; ``src``: ``t`` detached) into ``seg``'s
    payload from ``offset`` (``payload``: a flat ``uint8`` view of the
    creator's mapping of the whole payload). A blank file (never written nor
    mapped) is written with ``pwrite``, on one thread or split
    (:func:`parallel_fill`); a warm pooled one through the mapping. Returns
    the BLAKE3-128 digest when ``eager``, else None. Raises
    :class:`SegmentError` subclasses for OS failures."""
    if not nbytes:
        return None
    dst = payload[offset:offset + nbytes]
    if flat is not None:
        threads = copy_threads() if nbytes >= PARALLEL_MIN_BYTES else 1
        if threads > 1:  # split across threads, the hash beside the copy
            try:
                if seg.blank:  # a new file: pwrite, no zeroing, no page faults
                    seg.cold = True
                    return parallel_fill(flat, threads, fd=seg.fd,
                                         offset=HEADER_SIZE + offset, hash=eager)
                return parallel_fill(flat, threads, dst=dst, hash=eager)
            except OSError as exc:
                raise os_error(exc, "write", seg.path) from None
        hasher = blake3.blake3(max_threads=HASH_THREADS) if eager else None
        if seg.blank:  # a new file: pwrite, no zeroing, no page faults
            seg.cold = True
            try:
                write_and_hash(seg.fd, HEADER_SIZE + offset, flat, hasher)
            except OSError as exc:
                raise os_error(exc, "write", seg.path) from None
        else:  # a warm pooled segment: its pages are mapped here
            copy_and_hash(dst, flat, hasher)
        return None if hasher is None else hasher.digest(codec.HASH_BYTES)
    torch.from_numpy(dst).view(t.dtype).view(t.shape).copy_(src)
    return content_hash(dst) if eager else None


def group_layout(sizes) -> tuple[list[int], int]:
    """Where each of the tensors of ``sizes`` bytes goes in one segment:
    ``(offsets, payload bytes)``, each offset the end of the one before
    rounded up to :data:`~mmshm.segments.codec.OFFSET_ALIGN` (4 KiB), the
    first 0; the payload ends at the last tensor's end."""
    align = codec.OFFSET_ALIGN
    offsets = []
    end = 0
    for n in sizes:
        off = -(-end // align) * align
        offsets.append(off)
        end = off + n
    return offsets, end


_EMPTY_DIGEST = content_hash(b"")


def _segment_digest(seg: segment.Segment, meta: HandleMeta) -> bytes:
    """BLAKE3-128 of the ``meta.nbytes`` payload bytes of ``seg`` (pinned by
    the caller) from ``meta.offset``, memoized on the segment by generation,
    offset and size, so that the handles of one tensor in this process hash
    it once (and the tensors of one segment each get their own digest).
    Raises :class:`HandleError` if the tensor ends past the payload,
    :class:`SegmentCorruptError` if the file is shorter than that."""
    key = (meta.gen, meta.offset, meta.nbytes)
    memo = seg.digest
    cached = memo.get(key)
    if cached is not None:
        return cached
    if meta.offset + meta.nbytes > seg.payload_size:
        raise HandleError(f"handle says {meta.nbytes} bytes at offset {meta.offset} but "
                          f"segment {meta.name} holds {seg.payload_size}")
    if seg.shared_map is not None:  # the creator's own mapping
        mm = None
        seg.check_size(meta.offset + meta.nbytes)
        buf = seg.payload_view()[meta.offset:meta.offset + meta.nbytes]
    else:
        mm = seg.map_private(meta.nbytes, meta.offset)
        buf = memoryview(mm).cast("B")  # ctypes exports "<B"; blake3 takes "B"
    try:
        digest = content_hash(buf)
    finally:
        buf.release()
        del mm  # a private mapping: unmapped now (see segfile.map_fd)
    if any(k[0] != meta.gen for k in memo):  # the pool reused it: older digests are stale
        memo.clear()
    memo[key] = digest
    return digest


# This process's pid, kept current across fork (os.getpid() is a system call,
# and every handle checks it when constructed and when dropped).
_PID = os.getpid()


def _after_fork_in_child() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def per_tensor(tensors, hashes=None, hash_now=None) -> tuple[list, list, list]:
    """``(tensors, hashes, hash_now)`` as lists of one value per tensor, for
    :meth:`ShmTensor.from_tensors` and its callers: ``hashes`` None gives
    None each, a single ``hash_now`` (not a list or tuple) is given to each.
    Raises ValueError when a list gives another number of values."""
    tensors = list(tensors)
    n = len(tensors)
    hashes = [None] * n if hashes is None else list(hashes)
    nows = list(hash_now) if isinstance(hash_now, (list, tuple)) else [hash_now] * n
    if len(hashes) != n or len(nows) != n:
        raise ValueError("hashes and hash_now must give one value per tensor")
    return tensors, hashes, nows


class ShmTensor:
    """Pointer to a CPU tensor stored in a shared-memory segment.

    Pickling carries only the msgspec-encoded :class:`~mmshm.segments.codec.HandleMeta`
    (about 60 bytes) and has no side effect; the unpickled object owns the
    reference the giver handed out with :meth:`share`. A handle whose
    metadata fails validation while being unpickled does not raise (that would
    abort a whole ``broadcast_pyobj``); it becomes a *broken* handle whose
    :meth:`materialize` raises the typed error.
    """

    __slots__ = ("__weakref__", "_dir", "_error", "_meta", "_owns", "_pid")

    def __init__(self, meta: HandleMeta | None, *, owns: bool = True,
                 directory: str | None = None, error: Exception | None = None):
        self._meta = meta
        self._owns = owns and meta is not None
        self._pid = _PID
        self._dir = directory
        self._error = error

    # -- construction ----------------------------------------------------
    @classmethod
    def from_tensor(cls, t: torch.Tensor, hash: bytes | None = None,
                    directory: str | None = None, *,
                    hash_now: bool | None = None) -> ShmTensor:
        """Copy ``t`` into a new segment and return a handle owning its one
        reference.

        A contiguous tensor of at least :data:`PARALLEL_MIN_BYTES` is copied
        on :func:`copy_threads` threads (``MMSHM_COPY_THREADS``, the CPUs of
        the process's affinity), :data:`PARALLEL_CHUNK` bytes at a time, the
        calling thread taking part, and a hash computed here runs beside the
        copy with BLAKE3's own threads (:func:`parallel_fill`). Otherwise
        (one thread; a smaller tensor) the copy runs on the calling thread
        (a contiguous tensor: one ``memcpy``; torch copies any other) and a
        hash computed here is computed in the same pass, chunk by chunk
        while the bytes are still in the cache. The digest is the same
        either way.

        Args:
            t: any CPU strided tensor (any dtype torch has but quantized ones;
                non-contiguous, 0-dim and 0-element tensors included).
            hash: the payload's content hash (16-32 bytes) if already known.
                ``None``: BLAKE3-128, computed here with ``hash_now`` (or,
                ``hash_now`` None, with ``MMSHM_HASH=eager``), else (the
                default, ``lazy``) on the first read of :attr:`hash`.
                ``b""``: not computed here whatever the setting.
            directory: segment directory (default ``MMSHM_DIR``).
            hash_now: with ``hash`` None: True computes the hash here
                whatever ``MMSHM_HASH`` says (a caller that reads it next,
                e.g. SGLang's tokenizer), False leaves it to the first read;
                None (default): ``MMSHM_HASH`` decides.
        Raises:
            TypeError: not a CPU strided tensor, or an unsupported dtype.
            ValueError: a ``hash`` of another length.
            ShmSpaceError: ENOSPC (the caller may fall back to inline).
            DescriptorLimitError, SegmentError: other OS failures.
        """
        _check_tensor(t)
        src = t.detach()
        nbytes = t.numel() * t.element_size()
        code = codec.DTYPE_CODES[t.dtype]
        _check_hash(hash)
        eager = hash is None and (config.get().hash == "eager" if hash_now is None
                                  else hash_now)
        flat = _flat_bytes(src) if nbytes else None

        def fill(seg: segment.Segment, payload: np.ndarray) -> bytes | None:
            return _fill_one(seg, payload, 0, t, src, flat, nbytes, eager)

        # through from_writer: the one creation point (MMSHM_DEBUG_REFS tracks it)
        return cls.from_writer(nbytes, code, tuple(t.shape), None, hash=hash,
                               directory=directory, _fill=fill)

    @classmethod
    def from_tensors(cls, tensors, hashes=None, directory: str | None = None, *,
                     hash_now=None) -> list[ShmTensor]:
        """Copy every tensor of ``tensors`` into **one** new segment and
        return one handle per tensor, in order, each owning one reference
        (the segment's count starts at ``len(tensors)``).

        Tensor i sits at ``offsets[i]`` of :func:`group_layout` (4 KiB
        aligned), and its handle carries that offset: a view, copy or hash of
        it reads its own bytes only. Each tensor is copied as
        :meth:`from_tensor` copies one (``pwrite`` into a new file, split
        across threads from :data:`PARALLEL_MIN_BYTES`; a memcpy into a warm
        pooled one), at its offset. The segment is one request of the pool
        (the arena's if it has room, best fit), so a request of many photos
        takes one pooled segment, and a TP rank maps (and registers) one
        mapping, instead of one per photo. It goes back to the pool when the
        last reference of the last tensor is given back; sharing, releasing,
        materializing and pickling work per handle as for a segment of one
        tensor. One tensor: :meth:`from_tensor`.

        Args:
            tensors: CPU strided tensors (as :meth:`from_tensor` takes; the
                same tensor twice gets two copies: dedup is the caller's).
            hashes: None, or one known content hash (16-32 bytes), None or
                ``b""`` per tensor, as ``hash`` of :meth:`from_tensor`.
            directory: segment directory (default ``MMSHM_DIR``).
            hash_now: a bool or None for all tensors, or one per tensor, as
                ``hash_now`` of :meth:`from_tensor`.
        Returns:
            ``len(tensors)`` handles (an empty list for no tensor).
        Raises:
            TypeError, ValueError: as :meth:`from_tensor`, for any tensor
                (checked before a segment is made).
            ShmSpaceError: the group's segment does not fit (ENOSPC, the
                budget): the caller may fall back per tensor.
            DescriptorLimitError, SegmentError: other OS failures (the
                segment is given back first).
        """
        tensors, hashes, nows = per_tensor(tensors, hashes, hash_now)
        n = len(tensors)
        if n == 1:
            return [cls.from_tensor(tensors[0], hash=hashes[0], directory=directory,
                                    hash_now=nows[0])]
        if n == 0:
            return []
        default_eager = config.get().hash == "eager"
        parts = []
        for t, h, now in zip(tensors, hashes, nows):
            _check_tensor(t)
            _check_hash(h)
            src = t.detach()
            nbytes = t.numel() * t.element_size()
            eager = h is None and (default_eager if now is None else now)
            parts.append((t, src, _flat_bytes(src) if nbytes else None, nbytes, eager))
        offsets, total = group_layout(p[3] for p in parts)
        seg = segment.create(total, directory)
        digests: list[bytes | None] = []
        try:
            if total:
                payload = np.frombuffer(seg.shared_map, dtype=np.uint8, count=total,
                                        offset=HEADER_SIZE)
                reused = not seg.blank
                try:
                    for (t, src, flat, nbytes, eager), off in zip(parts, offsets):
                        digests.append(_fill_one(seg, payload, off, t, src, flat, nbytes,
                                                 eager))
                finally:
                    seg.blank = False
                if reused:  # written through the mapping: its pages are mapped here
                    seg.cold = False
                del payload
            else:
                digests = [None] * n
            SegmentRef(seg.name, directory, seg.gen).add(n - 1)  # one per handle
        except BaseException:
            SegmentRef(seg.name, directory, seg.gen).add(-1)
            raise
        SHM_WRITTEN_BYTES.inc(total and sum(p[3] for p in parts))
        nid = node.node_id(directory)
        out = []
        for (t, _src, _flat, nbytes, _e), off, h, d in zip(parts, offsets, hashes, digests):
            digest = d if d is not None else (h if h is not None else
                                              (_EMPTY_DIGEST if not nbytes else b""))
            meta = HandleMeta(seg.name, nbytes, codec.DTYPE_CODES[t.dtype], tuple(t.shape),
                              digest, seg.gen, nid, off)
            out.append(_adopt(cls, meta, directory))  # (MMSHM_DEBUG_REFS tracks _adopt)
        return out

    @classmethod
    def from_writer(cls, nbytes: int, dtype: torch.dtype | int, shape: tuple[int, ...],
                    write, hash: bytes | None = None,
                    directory: str | None = None, *, _fill=None) -> ShmTensor:
        """Make a new segment of ``nbytes`` payload bytes, let ``write`` fill
        it, and return a handle owning its one reference. The bytes never pass
        through private memory: ``write`` gets the segment's payload as a flat
        ``uint8`` tensor (a receive from ``torch.distributed`` can land there
        directly).

        Args:
            nbytes: payload size; must equal ``prod(shape) * itemsize``.
            dtype: a torch dtype, or its wire code.
            shape: tensor shape.
            write: ``write(dst)`` with ``dst`` a writable ``uint8`` tensor of
                ``nbytes`` elements (not called when ``nbytes`` is 0).
            hash: the payload's content hash if known (16..32 bytes); as for
                :meth:`from_tensor` otherwise (``None``: BLAKE3-128 of what
                ``write`` wrote, now or on first use; ``b""``: on first use).
            directory: segment directory (default ``MMSHM_DIR``).
        Raises:
            ShmSpaceError, DescriptorLimitError, SegmentError: the segment
                could not be made (``write`` was not called).
            HandleError: inconsistent ``nbytes``/``dtype``/``shape``.
            Whatever ``write`` raises (the segment is given back first).
        """
        code = dtype if isinstance(dtype, int) else codec.dtype_code(dtype)
        _check_hash(hash)
        if not 0 <= code < len(codec.DTYPES) or codec.DTYPES[code] is None:
            raise HandleError(f"unknown dtype code {code}")
        itemsize = codec.DTYPES[code].itemsize  # type: ignore[union-attr]
        shape = tuple(int(d) for d in shape)
        if nbytes != math.prod(shape) * itemsize:
            raise HandleError(f"shape {shape} x itemsize {itemsize} != nbytes {nbytes}")

        if _fill is None:  # (from_tensor passes its own: see _make)
            eager = hash is None and config.get().hash == "eager"

            def _fill(seg: segment.Segment, payload: np.ndarray) -> bytes | None:
                write(torch.from_numpy(payload))
                return content_hash(payload) if eager else None

        return cls._make(nbytes, code, shape, _fill, hash, directory)

    @classmethod
    def _make(cls, nbytes: int, code: int, shape: tuple[int, ...], fill,
              hash: bytes | None, directory: str | None) -> ShmTensor:
        """A new segment of ``nbytes`` payload bytes filled by
        ``fill(seg, payload)`` (the segment, and a flat ``uint8`` numpy view
        of the creator's mapping of its payload; not called for 0 bytes),
        which returns the payload's digest if it computed one, else None;
        the handle owning its one reference. On any failure the segment is
        given back and the error raised."""
        seg = segment.create(nbytes, directory)
        try:
            if nbytes:
                payload = np.frombuffer(seg.shared_map, dtype=np.uint8, count=nbytes,
                                        offset=HEADER_SIZE)
                reused = not seg.blank
                try:
                    digest = fill(seg, payload)
                finally:
                    seg.blank = False
                if reused:  # written through the mapping: its pages are mapped here
                    seg.cold = False
                del payload
                if digest is not None:
                    hash = digest
            elif hash is None:
                hash = _EMPTY_DIGEST
        except BaseException:
            SegmentRef(seg.name, directory, seg.gen).add(-1)
            raise
        SHM_WRITTEN_BYTES.inc(nbytes)
        meta = HandleMeta(seg.name, nbytes, code, shape, hash or b"", seg.gen,
                          node.node_id(directory))
        return cls(meta, owns=True, directory=directory)

    @classmethod
    def decode(cls, data: bytes, directory: str | None = None) -> ShmTensor:
        """Build a handle from wire bytes; it owns the reference the giver
        handed out. Raises :class:`HandleError` on malformed metadata."""
        return _adopt(cls, codec.decode(data), directory)

    def encode(self) -> bytes:
        """Wire bytes of this handle's metadata (no side effect)."""
        return codec.encode(self._usable_meta())

    # -- pickling ----------------------------------------------------------
    def __reduce__(self):
        if self._error is not None:
            return (_rebuild_broken, (str(self._error),))
        if not self._owns:
            raise HandleStateError(
                "cannot pickle a handle that no longer owns a reference "
                "(it was released or materialized)")
        return (_rebuild, (codec.encode(self._meta),))

    def __copy__(self) -> ShmTensor:
        return self.clone()

    def __deepcopy__(self, memo) -> ShmTensor:
        return self.clone()

    # -- properties --------------------------------------------------------
    def _usable_meta(self) -> HandleMeta:
        if self._error is not None:
            raise self._error
        assert self._meta is not None
        return self._meta

    @property
    def meta(self) -> HandleMeta:
        return self._usable_meta()

    @property
    def name(self) -> str:
        return self._usable_meta().name

    @property
    def ref(self) -> SegmentRef:
        """The segment this handle stands for a reference on (name,
        directory, generation): references are added and given back
        through it. Raises the typed error of a broken handle."""
        meta = self._usable_meta()
        return SegmentRef(meta.name, self._dir, meta.gen)

    @property
    def identity(self) -> tuple:
        """``(metadata, directory)``: equal for handle objects over the same
        segment generation with the same shape, dtype and hash (the copies of
        a fan-out), whose views are interchangeable. ``(None, None)`` for a
        broken handle. Never raises."""
        return (self._meta, self._dir)

    @property
    def error(self) -> Exception | None:
        """The typed error of a broken handle (its metadata failed
        validation when it was unpickled), else None. Never raises."""
        return self._error

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._usable_meta().shape)

    @property
    def dtype(self) -> torch.dtype:
        return codec.DTYPES[self._usable_meta().dtype]  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return self._usable_meta().nbytes

    @property
    def hash(self) -> bytes:
        """BLAKE3 content hash of the payload (16 bytes unless a longer one
        was given). When the handle does not carry one yet (``MMSHM_HASH=lazy``,
        the default), it is computed here from the segment's bytes, once per
        segment in this process, and carried from then on (by this handle and
        whatever is pickled from it).

        Raises:
            HandleStateError: no hash was carried and the handle no longer
                owns a reference (the segment may be gone or reused).
            WrongNodeError, SegmentNotFoundError, SegmentCorruptError,
                DescriptorLimitError: as for :meth:`materialize`.
        """
        meta = self._usable_meta()
        if meta.hash:
            return meta.hash
        meta = self._require_owned()
        self._check_node(meta)
        if meta.nbytes == 0:
            digest = _EMPTY_DIGEST
        else:
            seg = segment.attach(meta.name, self._dir, meta.gen)
            segment.pin(seg)
            try:
                digest = _segment_digest(seg, meta)
            finally:
                segment.unpin(seg)
        self._meta = msgspec.structs.replace(meta, hash=digest)
        return digest

    @property
    def directory(self) -> str | None:
        """The segment directory this handle opens its segment in; None:
        ``MMSHM_DIR`` at the time of each use (every handle unpickled or
        decoded without a directory)."""
        return self._dir

    @property
    def node(self) -> int:
        """Id of the node whose segment directory holds the segment."""
        return self._usable_meta().node

    def is_local(self) -> bool:
        """Whether the segment is on this process's node (see :mod:`mmshm.segments.node`)."""
        return node.is_local(self._usable_meta().node, self._dir)

    def _check_node(self, meta: HandleMeta) -> None:
        if not node.is_local(meta.node, self._dir):
            raise WrongNodeError(
                f"handle {meta.name} names a segment on node {meta.node}, this process is on "
                f"node {node.node_id(self._dir)} (another host, IPC or mount namespace, or "
                f"segment directory): it cannot be opened here")

    @property
    def owns_reference(self) -> bool:
        """Whether this object still owns its reference."""
        return self._owns and self._pid == _PID

    def __repr__(self) -> str:
        if self._error is not None:
            return f"ShmTensor(<broken: {self._error}>)"
        m = self._meta
        state = "owned" if self._owns else "released"
        return (f"ShmTensor(name={m.name!r}, shape={tuple(m.shape)}, "
                f"dtype={codec.DTYPES[m.dtype]}, nbytes={m.nbytes}, node={m.node}, {state})")

    # -- reference operations ------------------------------------------------
    def _require_owned(self) -> HandleMeta:
        meta = self._usable_meta()
        if not self.owns_reference:
            raise HandleStateError(f"handle {meta.name} no longer owns a reference")
        return meta

    def share(self, k: int) -> None:
        """Add ``k`` references, one per receiver this handle is about to be
        handed to (pickled for). One locked update whatever ``k``.

        Raises:
            HandleStateError: this handle no longer owns a reference.
            WrongNodeError: the segment is on another node.
            SegmentNotFoundError: the segment is already gone.
        """
        meta = self._require_owned()
        if k < 0:
            raise ValueError("k must be >= 0")
        if k:
            self._check_node(meta)
            SegmentRef(meta.name, self._dir, meta.gen).add(k)

    def clone(self) -> ShmTensor:
        """A new, independent handle object on the same segment (adds one
        reference; no bytes are copied)."""
        self.share(1)
        return self.twin()

    def twin(self) -> ShmTensor:
        """A new handle object on the same segment that owns one of the
        references already added with :meth:`share` (no count change: the
        caller hands that reference to it)."""
        return _adopt(type(self), self._meta, self._dir)

    def hand_over(self) -> None:
        """Give this object's reference to the copy just pickled for one
        receiver: the receiver's unpickled handle owns it, this object no
        longer does (and releases nothing when dropped). The same as
        ``share(1)`` then ``release()``, without the two locked updates.
        Raises :class:`HandleStateError` if this object owns no reference."""
        self._require_owned()
        self._owns = False

    def disown(self) -> None:
        """Give up ownership without touching the count: the reference moved
        to another holder (a message that left, a twin, another rank's
        copy), which gives it back. Idempotent."""
        self._owns = False

    def reclaim(self) -> None:
        """Own the reference again after :meth:`disown`, when the move did
        not happen (a broadcast that failed put the reference back in the
        count for this object). Not for a broken handle."""
        self._owns = self._meta is not None

    def release(self) -> None:
        """Give back this handle's reference. Idempotent; a segment that has
        already disappeared (ENOENT) is tolerated. The last release unlinks.
        A handle of another node is only dropped: its segment cannot be
        reached from here (the reference it stood for stays with that node)."""
        if not self._owns or self._pid != _PID:
            return
        self._owns = False
        if not node.is_local(self._meta.node, self._dir):  # type: ignore[union-attr]
            log.warning("mmshm: dropping handle %s of node %d without giving its reference "
                        "back (not reachable from this node)", self._meta.name,  # type: ignore
                        self._meta.node)  # type: ignore[union-attr]
            return
        try:
            SegmentRef(self._meta.name, self._dir, self._meta.gen).add(-1)  # type: ignore
        except SegmentNotFoundError:
            pass
        except SegmentError as exc:
            log.warning("mmshm: release of %s failed: %s", self._meta.name, exc)

    def __del__(self):
        try:
            if self._owns and self._pid == _PID:
                self.release()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass

    # -- materialize -----------------------------------------------------------
    def materialize(self, copy: bool = False) -> torch.Tensor:
        """Return the tensor (same shape, dtype and bytes).

        With ``copy=False`` the tensor is a zero-copy, copy-on-write view of the
        segment; it takes over this handle's reference, which is released when
        the tensor and all its views are freed. With ``copy=True`` the bytes are
        read into private memory and the reference is released at once.

        Raises:
            HandleStateError: the handle was already released or materialized.
            WrongNodeError: the segment is on another node (a
                :class:`HandleError`); nothing is opened.
            HandleError: malformed metadata, or a size larger than the segment.
            SegmentNotFoundError, SegmentCorruptError, DescriptorLimitError:
                the segment cannot be opened. The handle keeps its reference
                in that case (release it, or drop it).
        """
        meta = self._require_owned()
        self._check_node(meta)
        dtype = codec.DTYPES[meta.dtype]
        if meta.nbytes == 0:
            out = torch.empty(meta.shape, dtype=dtype)
            self.release()
            return out
        seg = segment.attach(meta.name, self._dir, meta.gen)
        segment.pin(seg)
        try:
            if seg.payload_size < meta.offset + meta.nbytes:
                raise HandleError(
                    f"handle says {meta.nbytes} bytes at offset {meta.offset} but segment "
                    f"{meta.name} holds {seg.payload_size}")
            if copy:
                seg.check_size(meta.offset + meta.nbytes)
                out = torch.empty(meta.shape, dtype=dtype)
                buf = memoryview(_uint8_flat(out).numpy())
                off = 0
                while off < meta.nbytes:
                    n = os.preadv(seg.fd, [buf[off: off + _PREAD_CHUNK]],
                                  HEADER_SIZE + meta.offset + off)
                    if n <= 0:
                        raise SegmentCorruptError(errno.EINVAL, "segment ended early",
                                                  seg.path)
                    off += n
                del buf
                self.release()
                return out
            if seg.arena:  # this process's persistent mapping (registered with CUDA if it can)
                arr = arena.VIEWS.view(seg, meta.gen, meta.nbytes, meta.offset)
                self._owns = False  # the reference now belongs to the view
                return torch.from_numpy(arr).view(dtype).view(meta.shape)
            mm = seg.map_private(meta.nbytes, meta.offset)
            arr = np.frombuffer(mm, dtype=np.uint8, count=meta.nbytes)
            del mm
            segment.pin(seg)  # held by the view until its finalizer runs
            weakref.finalize(arr, _release_view, meta.name, meta.gen, seg)
            self._owns = False  # the reference now belongs to the view
            return torch.from_numpy(arr).view(dtype).view(meta.shape)
        finally:
            segment.unpin(seg)


def _adopt(cls, meta: HandleMeta, directory: str | None) -> ShmTensor:
    """A handle owning the reference handed out for ``meta`` (what
    ``cls(meta, owns=True, directory=directory)`` makes, without the call
    overhead: one is built per handle unpickled)."""
    h = _new(cls)
    h._meta = meta
    h._owns = True
    h._pid = _PID
    h._dir = directory
    h._error = None
    return h


_new = object.__new__


def _rebuild(data: bytes) -> ShmTensor:
    try:
        return _adopt(ShmTensor, codec.decode(data), None)
    except HandleError as exc:
        return ShmTensor(None, error=exc)


def _rebuild_broken(message: str) -> ShmTensor:
    return ShmTensor(None, error=HandleError(message))


# MMSHM_DEBUG_REFS=1: refdebug wraps the methods above (off: nothing is installed)
refdebug.attach(sys.modules[__name__], config.get().debug_refs)
