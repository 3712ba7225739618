"""A content-keyed store of encoder outputs shared between instances of one node (EPD).

Encoder disaggregation (encode / prefill / decode, EPD): an *encoder*
instance runs the vision encoder and publishes each item's encoder output; a
*consumer* instance (prefill, or unified prefill+decode) loads it instead of
running its own encoder. This module is the transport for that hop, built on
mmshm's segments; the server glue (vLLM's ``MmshmECConnector``,
:mod:`mmshm.integrations.vllm.disagg`) sits on top of it.

**Keyed by content, never by the server's item names.** A server may name an
item by a per-instance counter (vLLM names images ``renderer0-mm-<n>-image-<i>``
when its processor cache is off), so two instances' names match only while
their counters stay in step. Entries are keyed by :func:`content_key`, the
BLAKE3 (256 bits) of the item's *processed* input (for vLLM, the
``MultiModalKwargsItem``: ``pixel_values``, ``image_grid_thw``...) and of a
namespace (the model), which both sides compute from what they hold. A
consumer therefore only ever finds the encoder output of the very bytes it
would encode itself; another image's output is unreachable, whatever the
names say.

**Where an entry lives.** One segment per entry (the core's
:func:`mmshm.segments.segment.create`: ``posix_fallocate``, the budget guard
and the reserve ``MMSHM_MIN_FREE_BYTES``, ``MMSHM_MAX_BYTES``, ENOSPC as a
typed error, the liveness locks), laid out as::

    [0, 4096)                      the segment header (mmshm.segments.segfile)
    payload [0, nbytes)            the encoder output, C order, its own dtype
    payload [cap - 4096, cap)      the entry record: magic, the full 32-byte key,
                                   dtype, shape, nbytes, the producer's label

**Published only once complete.** The producer writes the payload and the
record under the segment's ordinary, random name (``mmshm-<pid>-<64 random
bits>``), then ``link()`` s it to its published name and unlinks the first:
``mmshm-<producer pid>-<the key's first 16 hex digits>``. ``link`` is atomic
and never replaces a name, so a consumer sees either no entry or a complete
one; a producer SIGKILLed mid-write leaves only a random name, which no
lookup matches and which the reaper reclaims like any segment nobody holds
(both names follow the segment naming scheme, so the reaper, ``mmshm gc``
and ``mmshm run``'s exit reclaim of the server's pids all cover them). The
full key in the record is compared before anything is used: 64 bits of name
that collide give a miss (``content_mismatch``), never another item's bytes.

**The warm pool.** With ``MMSHM_POOL`` on (the default) an entry's segment
goes back to its producer's pool when its last reference is given back (and
the producer lives), keeping its pages; the next save of the size class
reuses it (memcpy into warm pages instead of ``posix_fallocate`` and page
allocation) and renames it. A pooled segment is not live, so a lookup
misses it (``segment_gone``), and idle pooled segments are unlinked after
``MMSHM_POOL_IDLE_S``. The record carries the segment's *generation*: a
pooled segment reused by any other traffic of the process keeps its name and
may keep the old record, but its generation moved on, so the old key is a
miss; and the consumer's reference is taken for the generation it checked,
so a reuse between its check and its reference fails the reference.

**On a GPU: the arena** (:mod:`mmshm.segments.arena`). In a producer where
CUDA is available the first ``MMSHM_ARENA_BYTES`` (default 1 GiB) of its
segments are arena segments: pooled for good, so entry after entry of one size
class is written into the same warm pages under a new published name. An
output on a GPU is copied once, device to host, straight into the segment's
creator mapping (:func:`mmshm.segments.arena.copy_from_device`, which
registers that mapping with CUDA once, for a pinned-speed copy; counted in
``mmshm_gpu_copy_bytes_total{direction="d2h"}``), never through a private
CPU copy first. A consumer maps an arena segment once (its mappings are
keyed by the file, not by the name) and, where CUDA is initialized, registers
that mapping with CUDA once; its loads are views of it, and its copy to the
GPU (:func:`mmshm.segments.arena.to_device`, what ``MmshmECConnector`` does)
runs at pinned speed. An output that does not fit in the arena gets a plain
segment (``mmshm_arena_fallbacks_total``), as on a CPU host.

**Lookup** (:meth:`EncoderCache.lookup`) lists the segment directory for
names ending in the key's 16 hex digits (a consumer does not know the
producer's pid; one ``listdir`` per item, about 0.1 ms for a few hundred
files), attaches the segment, checks the record (key, dtype, the number of
rows the consumer expects) and takes one reference, held until
:meth:`Entry.release`. While a consumer holds its :class:`Entry` the segment
cannot go away: not by the producer's keep timer, not by its eviction, not
by the reaper (the consumer holds the liveness lock), not when the producer
is SIGKILLed.

**How long an entry lives.** The producer holds the creator's reference for
``keep_s`` seconds (default :data:`DEFAULT_KEEP_S`) after the last save of
that key (a save of content already published refreshes it instead of
writing again), so that the consumer's request, which a proxy sends right
after the encoder's, finds it; then the producer gives its reference back.
The segment is freed when the last consumer reference is given back as
well: the core's last release unlinks its name, so the name stays while any
consumer holds the entry (a worker of that consumer may still attach it by
name, and new lookups may find and hold it too). Under space pressure a new
save first gives back the producer's oldest entries. An entry gone before a
consumer looked it up is a miss, and the consumer encodes the item itself:
a re-encode, never a crash. A producer that exits cleanly gives back all
its references (at exit, including multiprocessing children); one that is
SIGKILLed leaves complete entries that stay loadable until the reaper
reclaims them, once no consumer holds them.

**Counting** (:mod:`mmshm.metrics`, label ``server``): a publish counts
``mmshm_epd_saves_total`` and ``mmshm_epd_bytes_total{direction="saved"}``;
each load (one per holder: a TP rank's worker) ``mmshm_epd_loads_total`` and
``{direction="loaded"}``; both observe ``mmshm_epd_transfer_seconds``. A save
refused counts ``mmshm_epd_fallbacks_total{reason}`` with ``over_budget``
(budget guard, ``MMSHM_MAX_BYTES``) or ``no_space`` (ENOSPC, descriptors),
and a lookup that misses counts ``missing``, ``content_mismatch``,
``incompatible`` or ``segment_gone``; the first of each reason in a process
is said at WARNING with the fix.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import struct
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import blake3
import msgspec
import numpy as np
import torch

from mmshm.errors import MmshmError, SegmentError, ShmSpaceError
from mmshm.metrics import (
    EPD_BYTES,
    EPD_FALLBACKS,
    EPD_LOADS,
    EPD_SAVES,
    EPD_TRANSFER_SECONDS,
)
from mmshm.segments import arena, codec, segfile, segment
from mmshm.segments.codec import HandleMeta
from mmshm.segments.segfile import (
    HEADER_SIZE,
    NAME_RE,
    PREFIX,
    STATE_POOLED,
    read_header,
    segment_dir,
)
from mmshm.segments.segment import SegmentRef
from mmshm.segments.shmtensor import (
    PARALLEL_MIN_BYTES,
    ShmTensor,
    copy_threads,
    parallel_fill,
    write_and_hash,
)
from mmshm.segments.table import TABLE

log = logging.getLogger("mmshm")

#: bytes of a key (BLAKE3-256)
KEY_BYTES = 32
#: hex digits of the key in a published name (the random part of the naming scheme)
NAME_KEY_HEX = 16
#: bytes kept for the entry record at the end of the payload
RECORD_SIZE = 4096
#: seconds a producer keeps an entry published after its last save
DEFAULT_KEEP_S = 60.0
_RECORD_MAGIC = b"MMSHMEC1"
_LEN = struct.Struct("<I")
_KEY_DOMAIN = b"mmshm-encoder-cache-v1\0"


class EncoderCacheError(MmshmError):
    """An encoder output could not be stored or loaded; ``reason`` is a label
    value of ``mmshm_epd_fallbacks_total`` (``over_budget``, ``no_space``,
    ``segment_gone``...)."""

    def __init__(self, message: str, reason: str = "segment_gone"):
        super().__init__(message)
        self.reason = reason


class _CacheCapError(ShmSpaceError):
    """An output larger than :attr:`EncoderCache.max_bytes` (reason ``budget``)."""


class _Record(msgspec.Struct, array_like=True, frozen=True):
    key: bytes
    dtype: int
    shape: tuple[int, ...]
    nbytes: int
    label: str
    pid: int
    created_ns: int
    #: the segment's generation when the record was written (a pooled
    #: segment reused since has another: the record is stale)
    gen: int


_REC_ENC = msgspec.msgpack.Encoder()
_REC_DEC = msgspec.msgpack.Decoder(_Record)


# -- the key ----------------------------------------------------------------------------
def _feed(h, data: Any) -> None:
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}\0".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(data, np.ndarray):
        a = np.ascontiguousarray(data)
        h.update(f"A{a.dtype.str}{a.shape}\0".encode())
        h.update(a.reshape(-1).view(np.uint8))
    elif isinstance(data, Mapping):
        h.update(f"D{len(data)}\0".encode())
        for k in sorted(data, key=str):
            h.update(f"K{k}\0".encode())
            _feed(h, data[k])
    elif isinstance(data, (list, tuple)):
        h.update(f"L{len(data)}\0".encode())
        for v in data:
            _feed(h, v)
    elif data is None or isinstance(data, (bool, int, float, str)):
        h.update(f"V{type(data).__name__}:{data!r}\0".encode())
    elif isinstance(data, (bytes, bytearray, memoryview)):
        b = bytes(data)
        h.update(f"B{len(b)}\0".encode())
        h.update(b)
    else:
        raise TypeError(f"cannot key a {type(data).__name__} by content")


def content_key(data: Any, namespace: str = "") -> bytes:
    """The content key of one item: BLAKE3-256 over ``namespace`` and then,
    in a fixed order, every tensor's dtype, shape and bytes (C order) with
    the field names around them.

    Args:
        data: a tensor (CPU or not; moved to the CPU to be read), a numpy
            array, a mapping of field name to such values (keys sorted), a
            list/tuple of them, or scalars/strings/bytes. For vLLM, the
            processed item ``mm_feature.data.get_data()``.
        namespace: what else must match for two encoder outputs to be
            interchangeable (the model); entries of another namespace are
            never found.
    Returns:
        32 bytes.
    Raises:
        TypeError: a value of another type (nothing can be keyed by it).
    """
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update(_KEY_DOMAIN + namespace.encode() + b"\0")
    _feed(h, data)
    return h.digest(KEY_BYTES)


def published_name(key: bytes, pid: int | None = None) -> str:
    """The published name of ``key`` by producer ``pid`` (default this
    process): ``mmshm-<pid>-<the key's first 16 hex digits>``."""
    return f"{PREFIX}{os.getpid() if pid is None else pid}-{key.hex()[:NAME_KEY_HEX]}"


# -- consumer side ----------------------------------------------------------------------
class EntryHandle(NamedTuple):
    """A picklable pointer to a published encoder output, for another process
    of the same node (vLLM: from the scheduler to each TP rank's worker).
    It owns no reference: :meth:`load` takes one.

    Attributes:
        name: the segment's published name.
        directory: its segment directory (None: ``MMSHM_DIR``).
        gen: the segment's generation (a reused segment is refused).
        dtype: the tensor's dtype.
        shape: its shape.
        nbytes: its size in bytes.
    """

    name: str
    directory: str | None
    gen: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int

    def load(self, server: str = "vllm") -> torch.Tensor:
        """The encoder output as a zero-copy CPU view of the segment
        (``shape``, ``dtype``), holding one reference of its own that is given
        back when the tensor and every view of it are collected. A plain
        segment's view is copy-on-write (a write in place stays private). An
        arena segment's is a view of this process's persistent mapping of it
        (:data:`mmshm.segments.arena.VIEWS`, one per file whatever the name
        the entry was published under): registered with CUDA where CUDA is
        initialized, and then read-only (a write in place is a SIGSEGV of
        this process, never a change to the bytes), else copy-on-write with
        the written pages dropped at release.
        Counts ``mmshm_epd_loads_total``, ``mmshm_epd_bytes_total{direction=
        "loaded"}`` and ``mmshm_epd_transfer_seconds`` for ``server``.

        Raises:
            SegmentNotFoundError: the segment is gone or was reused (its
                holder let go: only possible if nobody held it).
            SegmentCorruptError, DescriptorLimitError: it cannot be opened.
        """
        t0 = time.perf_counter()
        ref = SegmentRef(self.name, self.directory, self.gen)
        ref.add(1)
        meta = HandleMeta(self.name, self.nbytes, codec.dtype_code(self.dtype),
                          tuple(self.shape), b"", self.gen)
        h = ShmTensor(meta, owns=True, directory=self.directory)
        try:
            out = h.materialize()
        except BaseException:
            h.release()
            raise
        EPD_LOADS.labels(server=server).inc()
        EPD_BYTES.labels(server=server, direction="loaded").inc(self.nbytes)
        EPD_TRANSFER_SECONDS.labels(server=server).observe(time.perf_counter() - t0)
        return out


class Entry:
    """A published encoder output this process holds one reference on (from
    :meth:`EncoderCache.lookup`): the segment stays until :meth:`release`.
    ``key``, ``name``, ``gen``, ``dtype``, ``shape``, ``nbytes``, ``label``
    (the producer's name for the item) describe it."""

    __slots__ = ("__weakref__", "_released", "_seg", "directory", "dtype", "gen", "key",
                 "label", "name", "nbytes", "producer_pid", "shape")

    def __init__(self, seg, rec: _Record, directory: str | None, gen: int):
        self._seg = seg
        self._released = False
        self.directory = directory
        self.name = seg.name
        self.gen = gen
        self.key = rec.key
        self.dtype = codec.DTYPES[rec.dtype]
        self.shape = tuple(rec.shape)
        self.nbytes = rec.nbytes
        self.label = rec.label
        self.producer_pid = rec.pid

    def handle(self) -> EntryHandle:
        """A picklable :class:`EntryHandle` for a loader in another process."""
        return EntryHandle(self.name, self.directory, self.gen, self.dtype, self.shape,
                           self.nbytes)

    def load(self, server: str = "vllm") -> torch.Tensor:
        """:meth:`EntryHandle.load` in this process."""
        return self.handle().load(server)

    def release(self) -> None:
        """Give this holder's reference back (idempotent, never raises)."""
        if self._released:
            return
        self._released = True
        seg, self._seg = self._seg, None
        try:
            segment.update_refcount(self.name, -1, self.directory, self.gen)
        except (MmshmError, OSError) as exc:
            log.debug("mmshm: giving back %s failed: %s", self.name, exc)
        finally:
            segment.unpin(seg)

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return (f"<Entry {self.name} {self.dtype} {list(self.shape)} label={self.label!r}"
                f"{' released' if self._released else ''}>")


class SaveResult(NamedTuple):
    """What :meth:`EncoderCache.save` did: ``published`` (the entry can be
    found now, written now or already there), ``name`` (its published name),
    ``reason`` (why not: ``over_budget`` / ``no_space``; None when
    published), ``nbytes`` written now (0 when it was there already)."""

    published: bool
    name: str | None
    reason: str | None
    nbytes: int


class _Own(NamedTuple):
    seg: Any
    name: str
    gen: int
    nbytes: int


_WARNED: set[str] = set()
_FIX = {
    "over_budget": "raise MMSHM_MAX_BYTES or lower MMSHM_MIN_FREE_BYTES, give the segment "
                   "directory more room, or lower the connector's keep_s",
    "no_space": "give the segment directory (MMSHM_DIR, default /dev/shm) more room "
                "(docker --shm-size), or lower the connector's keep_s",
    "missing": "normal when the encoder did not run for this item; otherwise send the "
               "encoder request first and keep both instances on one MMSHM_DIR and one model",
    "content_mismatch": "nothing to fix: two keys share 64 bits of name; the item is encoded here",
    "incompatible": "run the encoder and this instance with the same model and --dtype",
    "segment_gone": "the encoder instance exited or evicted the entry (raise keep_s if the "
                    "consumer's queue is long)",
}


def count_fallback(server: str, reason: str, detail: str, fix: str | None = None) -> None:
    """Count one ``mmshm_epd_fallbacks_total{server, reason}``; the first of
    each reason in this process is said at WARNING with its fix (``fix``,
    else the reason's usual one), the others at DEBUG."""
    EPD_FALLBACKS.labels(server=server, reason=reason).inc()
    if reason not in _WARNED:
        _WARNED.add(reason)
        level = logging.INFO if reason == "missing" else logging.WARNING
        log.log(level, "mmshm: encoder cache (%s): %s (reason=%s; said once per process); "
                "fix: %s", server, detail, reason, fix or _FIX.get(reason, "see docs/vllm.md"))
    else:
        log.debug("mmshm: encoder cache (%s): %s (reason=%s)", server, detail, reason)


def _read_record(seg) -> _Record | None:
    off = HEADER_SIZE + seg.payload_size - RECORD_SIZE
    if seg.payload_size < RECORD_SIZE:
        return None
    raw = os.pread(seg.fd, RECORD_SIZE, off)
    if len(raw) < RECORD_SIZE or raw[:8] != _RECORD_MAGIC:
        return None
    (n,) = _LEN.unpack_from(raw, 8)
    if n > RECORD_SIZE - 12:
        return None
    try:
        rec = _REC_DEC.decode(raw[12:12 + n])
    except msgspec.DecodeError:
        return None
    if (len(rec.key) != KEY_BYTES or not 0 <= rec.dtype < len(codec.DTYPES)
            or codec.DTYPES[rec.dtype] is None
            or rec.nbytes > seg.payload_size - RECORD_SIZE or rec.nbytes < 0):
        return None
    want = codec.DTYPES[rec.dtype].itemsize * int(np.prod(rec.shape, dtype=np.int64))
    return rec if want == rec.nbytes else None


class EncoderCache:
    """This process's side of the encoder-output store (see the module
    docstring): publishing as a producer, looking up as a consumer, or both.

    Args:
        directory: the segment directory (default ``MMSHM_DIR`` at each use).
        server: the ``server`` label of the metrics.
        keep_s: seconds a published entry stays after its last save.
        max_bytes: the most bytes (records included) this process's published
            entries may take, 0 for no cap of its own (the core's budget
            still applies): a save evicts this process's oldest entries to
            stay under it, and an output larger than the cap is not published
            (``over_budget``). The core's ``MMSHM_MAX_BYTES`` caps every
            segment of the process (pixel payloads too); this caps only the
            encoder cache.
    """

    def __init__(self, directory: str | None = None, server: str = "vllm",
                 keep_s: float = DEFAULT_KEEP_S, max_bytes: int = 0):
        if keep_s < 0 or max_bytes < 0:
            raise ValueError("keep_s and max_bytes must be >= 0")
        self.directory = directory
        self.server = server
        self.keep_s = float(keep_s)
        self.max_bytes = int(max_bytes)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        #: key -> this process's published entry (holds the creator's reference)
        self._own: dict[bytes, _Own] = {}
        #: key -> monotonic time it expires at (insertion order = oldest first)
        self._expiry: dict[bytes, float] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pid = os.getpid()
        _register_exit(self)

    # -- producer ------------------------------------------------------------------
    def save(self, key: bytes, tensor: torch.Tensor, label: str = "") -> SaveResult:
        """Publish ``tensor`` (any dtype and shape) as the encoder output of
        ``key``, written once. A CPU tensor is copied into the segment (a new
        file by ``pwrite``, a warm pooled one through its mapping, split
        across the copy threads from ``PARALLEL_MIN_BYTES``); a tensor on a
        GPU by one blocking device-to-host copy straight into the segment's
        mapping (:func:`mmshm.segments.arena.copy_from_device`: pinned speed
        when it is an arena segment, counted in ``mmshm_gpu_copy_*``).

        Content this process already published is not written again (its
        keep time restarts); content another producer of the node published
        is not written either. A save that does not fit evicts this process's
        oldest entries and tries once more; if it still does not fit the
        entry is not published, and ``mmshm_epd_fallbacks_total`` counts the
        reason (the consumer encodes the item itself).

        Returns:
            :class:`SaveResult`.
        Raises:
            ValueError: a key that is not :data:`KEY_BYTES` long.
            HandleError: a dtype that cannot travel through shared memory.
        """
        if len(key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes, not {len(key)}")
        code = codec.dtype_code(tensor.dtype)
        with self._lock:
            if self._closed:
                return SaveResult(False, None, "closed", 0)
            own = self._own.get(key)
            if own is not None and not own.seg.freed():
                self._touch(key)
                return SaveResult(True, own.name, None, 0)
            if own is not None:
                self._drop(key)
        other = self._find(key, tensor.dtype, tensor.shape[0] if tensor.dim() else None)
        if other is not None:
            name = other.name
            other.release()
            return SaveResult(True, name, None, 0)
        t0 = time.perf_counter()
        # a tensor on a GPU stays there until its one copy (D2H) into the segment
        t = tensor.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        try:
            self._make_room(nbytes + RECORD_SIZE)
            seg = self._create(nbytes + RECORD_SIZE)
        except SegmentError as exc:
            reason = "over_budget" if getattr(exc, "reason", "") == "budget" else "no_space"
            capped = isinstance(exc, _CacheCapError)
            count_fallback(self.server, reason,
                           f"an encoder output of {nbytes} bytes ({label or key.hex()[:16]}) "
                           f"was not published: {exc}",
                           fix=(f"raise the encoder cache's max_bytes ({self.max_bytes}; vLLM: "
                                f"ec_connector_extra_config max_bytes) above the largest "
                                f"output") if capped else None)
            return SaveResult(False, None, reason, 0)
        try:
            name = self._fill_and_publish(seg, key, t, code, nbytes, label)
        except BaseException:
            segment.update_refcount(seg.name, -1, self.directory, seg.gen)
            raise
        if name is None:  # the name is taken (published since by this pid, or a stale file)
            segment.update_refcount(seg.name, -1, self.directory, seg.gen)
            count_fallback(self.server, "no_space",
                           f"the name {published_name(key)} is taken by another file")
            return SaveResult(False, None, "no_space", 0)
        with self._lock:
            self._own[key] = _Own(seg, name, seg.gen, nbytes)
            self._touch(key)
        EPD_SAVES.labels(server=self.server).inc()
        EPD_BYTES.labels(server=self.server, direction="saved").inc(nbytes)
        EPD_TRANSFER_SECONDS.labels(server=self.server).observe(time.perf_counter() - t0)
        return SaveResult(True, name, None, nbytes)

    def _make_room(self, need: int) -> None:
        """Give back this process's oldest entries until ``need`` more bytes
        fit under :attr:`max_bytes`. Raises :class:`ShmSpaceError` (reason
        ``budget``) for an output larger than the cap."""
        if not self.max_bytes:
            return
        if need > self.max_bytes:
            raise _CacheCapError(f"budget: {need} bytes exceed the encoder cache's max_bytes="
                                 f"{self.max_bytes}", reason="budget")
        with self._lock:
            while self._expiry and (sum(o.nbytes + RECORD_SIZE for o in self._own.values())
                                    + need > self.max_bytes):
                self._drop(next(iter(self._expiry)))

    def _create(self, nbytes: int):
        """A segment from the core (:func:`mmshm.segments.segment.create`: a
        warm one from this process's pool when ``MMSHM_POOL`` is on and one
        of the size class is idle, else a new file), evicting this process's
        oldest entries while the budget or the space refuses."""
        while True:
            try:
                return segment.create(nbytes, self.directory)
            except ShmSpaceError:
                with self._lock:
                    oldest = next(iter(self._expiry), None)
                    if oldest is None:
                        raise
                    self._drop(oldest)

    def _fill_and_publish(self, seg, key: bytes, t: torch.Tensor, code: int, nbytes: int,
                          label: str) -> str | None:
        if nbytes and t.device.type != "cpu":
            # one D2H straight into the creator's mapping (a new file too: its
            # pages are written through the mapping, not by pwrite), which
            # copy_from_device registers with CUDA once when it is an arena
            # segment; bytes viewed as uint8 on both sides (any dtype, bf16 too)
            dst = torch.from_numpy(np.frombuffer(seg.payload_view(), dtype=np.uint8,
                                                 count=nbytes))
            arena.copy_from_device(dst, t.reshape(-1).view(torch.uint8), seg)
            del dst
            seg.cold = False
        elif nbytes:
            # as the core fills a handle's segment: a new file by pwrite (no
            # zeroing, no page faults; the sweeper maps its pages once it is
            # pooled), a warm pooled one through its mapping; split across
            # the copy threads from PARALLEL_MIN_BYTES on
            src = t.reshape(-1).view(torch.uint8).numpy()
            threads = copy_threads() if nbytes >= PARALLEL_MIN_BYTES else 1
            try:
                if seg.blank:
                    seg.cold = True
                    if threads > 1:
                        parallel_fill(src, threads, fd=seg.fd, offset=HEADER_SIZE)
                    else:
                        write_and_hash(seg.fd, HEADER_SIZE, src)
                else:
                    dst = np.frombuffer(seg.payload_view(), dtype=np.uint8, count=nbytes)
                    if threads > 1:
                        parallel_fill(src, threads, dst=dst)
                    else:
                        np.copyto(dst, src)
                    del dst
                    seg.cold = False
            except OSError as exc:
                raise segfile.os_error(exc, "write", seg.path) from None
        seg.blank = False
        rec = _REC_ENC.encode(_Record(key, code, tuple(int(s) for s in t.shape), nbytes,
                                      label[:512], os.getpid(), time.time_ns(), seg.gen))
        os.pwrite(seg.fd, _RECORD_MAGIC + _LEN.pack(len(rec)) + rec,
                  HEADER_SIZE + seg.payload_size - RECORD_SIZE)
        name = published_name(key)
        d = os.path.dirname(seg.path)
        final = os.path.join(d, name)
        old = seg.path
        try:
            os.link(old, final)  # atomic, never replaces: complete or invisible
        except FileExistsError:
            try:
                same = os.path.samefile(old, final)  # a pooled segment of this key's name
            except OSError:
                same = False
            if not same:
                return None
            if old == final:
                return name
        except OSError as exc:
            raise segfile.os_error(exc, "publish", final) from None
        with TABLE.lock:
            if TABLE.segments.get(seg.name) is seg:
                del TABLE.segments[seg.name]
            seg.name = name
            seg.path = final
            TABLE.segments[name] = seg
        try:
            os.unlink(old)
        except OSError:
            pass
        return name

    def _touch(self, key: bytes) -> None:
        """(under the lock) restart ``key``'s keep time; start the timer."""
        self._expiry.pop(key, None)
        self._expiry[key] = time.monotonic() + self.keep_s
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._expire_loop, name="mmshm-ec-keep",
                                            daemon=True)
            self._thread.start()
        self._wake.notify()

    def _drop(self, key: bytes) -> None:
        """(under the lock) give back the creator's reference of ``key``.
        The name stays while a consumer holds the entry (a worker of that
        consumer may still attach it by name), and the core's last release
        unlinks it: a later lookup then misses."""
        self._expiry.pop(key, None)
        own = self._own.pop(key, None)
        if own is None:
            return
        try:
            segment.update_refcount(own.name, -1, self.directory, own.gen)
        except (MmshmError, OSError) as exc:
            log.debug("mmshm: releasing %s failed: %s", own.name, exc)

    def _expire_loop(self) -> None:
        with self._lock:
            while self._expiry and not self._closed and os.getpid() == self._pid:
                now = time.monotonic()
                key, when = next(iter(self._expiry.items()))
                if when <= now:
                    self._drop(key)
                    continue
                self._wake.wait(timeout=min(when - now, 60.0))
            self._thread = None

    def evict(self, key: bytes) -> bool:
        """Give back this process's reference on its entry of ``key`` now
        (gone at once unless a consumer holds it); False if it had none."""
        with self._lock:
            had = key in self._own
            self._drop(key)
            return had

    def published(self) -> list[str]:
        """Published names of this process's entries."""
        with self._lock:
            return [o.name for o in self._own.values()]

    def close(self) -> None:
        """Give back the creator's reference of every entry of this process
        (also run at exit): entries nobody else holds go at once, their
        warm pages too.
        Idempotent; the store publishes nothing after it."""
        with self._lock:
            self._closed = True
            if os.getpid() != self._pid:
                self._own.clear()
                self._expiry.clear()
                return
            segs = [o.seg for o in self._own.values()]
            for key in list(self._own):
                self._drop(key)
            self._wake.notify_all()
        with TABLE.lock:  # and no warm pages kept for saves that will not come
            for seg in segs:
                if seg.fd >= 0 and seg.pins == 0 and seg.status() == STATE_POOLED:
                    TABLE.unlink_pooled(seg)

    # -- consumer --------------------------------------------------------------------
    def lookup(self, key: bytes, dtype: torch.dtype | None = None, rows: int | None = None,
               *, count: bool = True) -> Entry | None:
        """Find the published encoder output of ``key`` and take one
        reference on it (hold it until :meth:`Entry.release`).

        Args:
            key: :func:`content_key` of the item.
            dtype: the dtype the consumer expects (None: any).
            rows: the number of rows (``shape[0]``: the item's embeddings) it
                expects (None: any).
            count: count a miss in ``mmshm_epd_fallbacks_total`` with its
                reason (``missing``, ``content_mismatch``, ``incompatible``,
                ``segment_gone``).
        Returns:
            an :class:`Entry`, or None (the caller encodes the item itself).
            Never raises for a missing, foreign, torn or vanishing file.
        """
        found, reason, detail = self._search(key, dtype, rows)
        if found is None and count:
            count_fallback(self.server, reason, detail)
        return found

    def _find(self, key: bytes, dtype, rows) -> Entry | None:
        return self._search(key, dtype, rows)[0]

    def _search(self, key: bytes, dtype, rows) -> tuple[Entry | None, str, str]:
        d = segment_dir(self.directory)
        TABLE.first_use(d)  # reclaims orphans of this directory once per process
        suffix = "-" + key.hex()[:NAME_KEY_HEX]
        try:
            names = [n for n in os.listdir(d) if n.endswith(suffix) and NAME_RE.match(n)]
        except OSError as exc:
            return None, "missing", f"cannot list {d}: {exc}"
        reason, detail = "missing", f"no encoder output of content {key.hex()[:16]} in {d}"
        own = published_name(key)
        names.sort(key=lambda n: n != own)
        for name in names:
            try:
                seg = segment.attach(name, self.directory)
            except (MmshmError, OSError) as exc:
                reason, detail = "segment_gone", f"{name}: {exc}"
                continue
            segment.pin(seg)  # the descriptor (and its liveness lock) stays while held
            held = False
            try:
                rec = _read_record(seg)
                gen = read_header(seg.fd, seg.path).gen
                if rec is None or rec.gen != gen:
                    reason, detail = "segment_gone", f"{name} holds no complete entry record"
                    continue
                if rec.key != key:
                    reason, detail = "content_mismatch", (
                        f"{name} holds the encoder output of other content "
                        f"({rec.key.hex()[:16]}, item {rec.label!r})")
                    continue
                got = codec.DTYPES[rec.dtype]
                if (dtype is not None and got != dtype) or (
                        rows is not None and (not rec.shape or rec.shape[0] != rows)):
                    reason, detail = "incompatible", (
                        f"{name} holds {got} {list(rec.shape)}, expected {dtype} with "
                        f"{rows} rows")
                    continue
                # fails if the last holder let go since the attach, or the segment
                # was pooled and reused (another generation): a miss, never its bytes
                segment.update_refcount(name, 1, self.directory, gen)
                held = True
                return Entry(seg, rec, self.directory, gen), "", ""
            except (MmshmError, OSError) as exc:
                reason, detail = "segment_gone", f"{name}: {exc}"
            finally:
                if not held:
                    segment.unpin(seg)
        return None, reason, detail


# -- exit -------------------------------------------------------------------------------
_STORES: weakref.WeakSet = weakref.WeakSet()
_EXIT_PID = 0


def _close_stores() -> None:
    for store in list(_STORES):
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001 - never stop the exit path
            log.debug("mmshm: closing an encoder cache failed: %s", exc)


def _register_exit(store: EncoderCache) -> None:
    """Close every store at exit: ``atexit`` for a main process, and
    multiprocessing's finalizers (``exitpriority`` 1, before the segment
    layer's at 0) for a child that leaves through ``os._exit`` (vLLM's
    EngineCore and workers)."""
    global _EXIT_PID
    _STORES.add(store)
    if _EXIT_PID != os.getpid():
        _EXIT_PID = os.getpid()
        multiprocessing.util.Finalize(None, _close_stores, exitpriority=1)


atexit.register(_close_stores)
