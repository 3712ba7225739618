"""A content-keyed store of encoder outputs shared between instances of one node (EPD).

Encoder disaggregation (encode / prefill / decode, EPD): an *encoder*
instance runs the vision encoder and publishes each item's encoder output; a
*consumer* instance (prefill, or unified prefill+decode) loads it instead of
running its own encoder. This module is the transport for that hop, built on
mmshm's segments; the server glue (vLLM's ``MmshmECConnector``,
:mod:`mmshm.integrations.vllm.epd`) sits on top of it.

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

**Published only once complete, under a name the key gives.** The producer
writes the payload and the record under the segment's ordinary, random name
(``mmshm-<pid>-<64 random bits>``), then ``link()`` s it to its published
name and unlinks the first: ``mmshm-0-<the key's first 16 hex digits>``
(:func:`published_name`; the pid field is 0 for every producer, so a consumer
derives the name from the key alone and opens it directly, never listing the
directory, which under ``mmshm run`` holds every pixel segment too).
``link`` is atomic and never replaces a name, so a consumer sees either no
entry or a complete one, and two producers of one content publish it once:
the one whose ``link`` fails finds the other's entry and takes a keep
reference on it instead (it lives its keep time for that producer too). A
producer SIGKILLed mid-write leaves only a random name, which no lookup
matches and which the reaper reclaims like any segment nobody holds (the
reaper and ``mmshm gc`` judge by the liveness locks, never by the name's
pid). A name held by something that is not this key's live entry (a pooled
segment reused by other traffic, which keeps its name; a third party's file)
sends the entry to a second name, ``mmshm-0-<the key's next 16 hex digits>``
(:data:`SLOTS`); an idle pooled segment under the name (this key's old entry
after its keep time) is reused when it is this process's, else unlinked
under its mutex and replaced. The full key in the record is compared before
anything is used: 64 bits of name that collide give a miss
(``content_mismatch``), never another item's bytes.

**The payload is checked** (``digest`` in the record): BLAKE3-128 of the
payload's first and last 4 KiB pages and of :data:`SAMPLE_PAGES` pages at
offsets drawn from the key (one in each half between them), computed once by
the producer from what it writes, and checked by ``pread`` (never through a
mapping, so a truncated file cannot SIGBUS) at every lookup and every load.
Another item's bytes under a valid record (a payload swapped or overwritten
by a third party) differ in every page of a float encoder output, so they
are a miss (``digest``) at lookup and a failed load
(:class:`EncoderCacheError`, reason ``digest``) at load, never loaded; a
payload whose second half was overwritten is caught by its last page. Why
sampled: on a 2-core CPU host a BLAKE3 of every byte of 8 x 720p Qwen2-VL-7B
outputs (68.6 MB bf16) takes 14 ms (blake3's ``max_threads`` gains nothing
on 2 busy cores), twice the 7 ms hop itself, and it would be paid at the
producer and at every load; a check of the sampled pages takes about 20 us
per output, about 0.5 ms for the three checks (publish, lookup, load) of
those 8 outputs, under 10% of the hop (``mmshm bench epd`` prints both
costs). What it cannot see: a change confined to pages it does not sample
(a partial overwrite in the middle of a payload); it catches swapped and
torn payloads, it is not an integrity seal. A consumer's scheduler
(:class:`mmshm.transport.ec_connector.Holdings`) looks up with ``verify=False``:
its "probably there" reads no payload page on the scheduler's loop, and each
worker's load checks the pages before the bytes are used (a failed load fails
that request, never another item's bytes).

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

**Lookup** (:meth:`EncoderCache.lookup`) opens the key's names
(:func:`published_name`, at most :data:`SLOTS`), attaches the segment, checks
the record (key, dtype, the shape the consumer expects: rows and width) and
the payload's digest, and takes one reference, held until
:meth:`Entry.release`. While a consumer holds its :class:`Entry` the segment
cannot go away: not by the producer's keep timer, not by its eviction, not
by the reaper (the consumer holds the liveness lock), not when the producer
is SIGKILLed. What a process holds is listed by :meth:`EncoderCache.held`
with each entry's holder (:attr:`Entry.holder`, set by the connector: "vLLM
encoder cache", a request id), shown by ``mmshm status`` (:func:`read_holders`:
a memfd of the process, nothing on disk), and given back by
:meth:`EncoderCache.close` (also at exit).

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
``{direction="loaded"}``; both observe ``mmshm_epd_transfer_seconds``. Every
lookup counts ``mmshm_epd_lookups_total{result}`` (``hit``/``miss``: the hit
ratio on the dashboard). A save refused counts
``mmshm_epd_fallbacks_total{reason}`` with ``over_budget`` (budget guard,
``MMSHM_MAX_BYTES``, the store's ``max_bytes``), ``no_space`` (ENOSPC,
descriptors) or ``name_taken`` (both names held by files that are not this
key's entry); a lookup that misses counts ``missing``, ``content_mismatch``,
``incompatible`` (dtype or shape), ``segment_gone``, ``torn`` (a header or
record that cannot be read, a truncated file) or ``digest`` (the payload is
not the record's); a producer's key queue (:class:`KeyQueue`) that drops a
key counts ``queue_full``. The first of each reason in a process is said at
WARNING with the fix. A consumer that missed :data:`MISSES_BEFORE_WARNING`
times without a single hit says once, at WARNING, that it and the encoder
cannot meet (another directory, namespace or node).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import multiprocessing.util
import os
import re
import struct
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

import blake3
import msgspec
import numpy as np
import torch
from mmshm import config
from mmshm.errors import (
    MmshmError,
    SegmentError,
    SegmentNotFoundError,
    ShmSpaceError,
)
from mmshm.metrics import (
    EPD_BYTES,
    EPD_FALLBACKS,
    EPD_HELD_BYTES,
    EPD_LOADS,
    EPD_LOOKUPS,
    EPD_SAVES,
    EPD_TRANSFER_SECONDS,
)
from mmshm.segments import arena, codec, node, segfile, segment
from mmshm.segments.codec import HandleMeta
from mmshm.segments.segfile import (
    HEADER_SIZE,
    OPEN_FLAGS,
    PREFIX,
    STATE_LIVE,
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
from mmshm.transport.ec_holders import (  # noqa: F401 - HeldEntry, read_holders: re-exported
    HOLDERS,
    HeldEntry,
    read_holders,
)

log = logging.getLogger("mmshm")

#: bytes of a key (BLAKE3-256)
KEY_BYTES = 32
#: hex digits of the key in a published name (the random part of the naming scheme)
NAME_KEY_HEX = 16
#: the pid field of every published name: consumers derive the name from the key alone
PUBLISHED_PID = 0
#: published names a key may take (each another 64 bits of the key)
SLOTS = 2
#: bytes kept for the entry record at the end of the payload
RECORD_SIZE = 4096
#: seconds a producer keeps an entry published after its last save
DEFAULT_KEEP_S = 60.0
#: pages of the payload its digest samples besides the first and the last
SAMPLE_PAGES = 2
#: bytes of the payload digest
DIGEST_BYTES = 16
#: keys a producer's :class:`KeyQueue` keeps before it drops the oldest
QUEUE_LIMIT = 4096
#: seconds :meth:`EncoderCache.close` waits for reserved segments still being written
PENDING_WAIT_S = 1.0
#: lookups missed without a single hit before a consumer says the pair cannot meet
MISSES_BEFORE_WARNING = 32
_PAGE = 4096
_RECORD_MAGIC = b"MMSHMEC2"
_LEN = struct.Struct("<I")
_KEY_DOMAIN = b"mmshm-encoder-cache-v1\0"
_DIGEST_DOMAIN = b"mmshm-encoder-output-pages-v1\0"


class EncoderCacheError(MmshmError, OSError):
    """An encoder output could not be stored or loaded; ``reason`` is a label
    value of ``mmshm_epd_fallbacks_total`` (``over_budget``, ``no_space``,
    ``segment_gone``, ``torn``, ``digest``...). An ``OSError``, as the
    segment errors it stands for (``except OSError`` catches it)."""

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
    #: :func:`payload_digest` of the payload
    digest: bytes


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


def published_name(key: bytes, pid: int | None = None, slot: int = 0) -> str:
    """The published name of ``key`` in ``slot`` (``0`` .. :data:`SLOTS` - 1):
    ``mmshm-0-<16 hex digits of the key>`` (slot 0 its first 16, slot 1 the
    next 16). Every producer publishes a key under the same names (the pid
    field is :data:`PUBLISHED_PID`), so a consumer opens them directly from
    the key. ``pid`` is accepted for callers of earlier releases, whose names
    carried the producer's pid, and ignored. Raises :class:`ValueError` for a
    slot out of range."""
    if not 0 <= slot < SLOTS:
        raise ValueError(f"slot {slot} is not in 0..{SLOTS - 1}")
    h = key.hex()
    return f"{PREFIX}{PUBLISHED_PID}-{h[slot * NAME_KEY_HEX:(slot + 1) * NAME_KEY_HEX]}"


# -- the payload digest --------------------------------------------------------------------
def sampled_pages(key: bytes, nbytes: int) -> list[int]:
    """Indexes of the 4 KiB pages of an ``nbytes`` payload that its digest
    covers: every page up to ``SAMPLE_PAGES + 2`` pages, else the first, the
    last, and one page in each of :data:`SAMPLE_PAGES` equal stretches
    between them, at an offset drawn from ``key`` (the same on both sides)."""
    pages = -(-nbytes // _PAGE)
    if pages <= SAMPLE_PAGES + 2:
        return list(range(pages))
    inner = pages - 2
    out = [0]
    for i in range(SAMPLE_PAGES):  # the key is a BLAKE3 output: its bits are the draw
        lo = 1 + inner * i // SAMPLE_PAGES
        hi = 1 + inner * (i + 1) // SAMPLE_PAGES
        r = int.from_bytes(key[(8 * i) % KEY_BYTES:(8 * i) % KEY_BYTES + 8], "little")
        out.append(lo + r % max(hi - lo, 1))
    out.append(pages - 1)
    return out


def payload_digest(key: bytes, nbytes: int, read) -> bytes:
    """The digest of an encoder output's payload: BLAKE3-128 over ``nbytes``
    and the pages :func:`sampled_pages` names, each read with
    ``read(offset, length)`` (a buffer). Returns ``b""`` when a read comes
    back short (a truncated file)."""
    h = blake3.blake3(_DIGEST_DOMAIN + struct.pack("<Q", nbytes))
    for p in sampled_pages(key, nbytes):
        off = p * _PAGE
        n = min(_PAGE, nbytes - off)
        b = read(off, n)
        if len(b) != n:
            return b""
        h.update(b)
    return h.digest(DIGEST_BYTES)


def _view_reader(seg):
    view = seg.payload_view()
    return lambda off, n: view[off:off + n]


def _fd_reader(fd: int):
    return lambda off, n: os.pread(fd, n, HEADER_SIZE + off)


# -- consumer side ----------------------------------------------------------------------
class EntryHandle(NamedTuple):
    """A picklable pointer to a published encoder output, for another process
    of the same node (vLLM: from the scheduler to each TP rank's worker).
    It owns no reference: :meth:`load` takes one.

    Attributes:
        name: the segment's published name.
        directory: its segment directory (None: ``MMSHM_DIR``); the node id
            the load checks is that directory's.
        gen: the segment's generation (a reused segment is refused).
        dtype: the tensor's dtype.
        shape: its shape.
        nbytes: its size in bytes.
        key: its content key (``b""``: read from the record).
        digest: the payload's digest from the record (:func:`payload_digest`;
            ``b""``: the load reads key and digest from the segment's record,
            which must name this handle's segment: its key gives ``name``,
            its generation, shape and size are the handle's).
    """

    name: str
    directory: str | None
    gen: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    key: bytes = b""
    digest: bytes = b""

    def load(self, server: str = "vllm", verify: bool = True, count: bool = True) -> torch.Tensor:
        """The encoder output as a zero-copy CPU view of the segment
        (``shape``, ``dtype``), holding one reference of its own that is given
        back when the tensor and every view of it are collected. A plain
        segment's view is copy-on-write (a write in place stays private). An
        arena segment's is a view of this process's persistent mapping of it
        (:data:`mmshm.segments.arena.VIEWS`, one per file whatever the name
        the entry was published under): registered with CUDA where CUDA is
        initialized, and then read-only (a write in place is a SIGSEGV of
        this process, never a change to the bytes), else copy-on-write with
        the written pages dropped at release. With ``verify`` (and a digest
        in the handle) the payload's sampled pages are checked first, by
        ``pread``; a handle without a digest (a hand-off's,
        :mod:`mmshm.transport.handoff`) is checked against the segment's
        own record. Counts ``mmshm_epd_loads_total``,
        ``mmshm_epd_bytes_total{direction="loaded"}`` and
        ``mmshm_epd_transfer_seconds`` for ``server`` (not with ``count``
        False: a producer reading its own entry for the Store); a failure
        counts ``mmshm_epd_fallbacks_total{reason}``.

        Raises:
            EncoderCacheError: (an ``OSError``) the entry cannot be loaded,
                with ``reason``: ``segment_gone`` (the file was removed, or
                the segment freed or reused: only possible if nobody held
                it), ``torn`` (a truncated file, a header that cannot be
                read, descriptors exhausted), ``digest`` (the payload is not
                the record's). Nothing is mapped and no reference is kept.
        """
        t0 = time.perf_counter()
        try:
            SegmentRef(self.name, self.directory, self.gen).add(1)
        except (SegmentError, OSError) as exc:
            raise _load_error(server, self, exc) from exc
        meta = HandleMeta(self.name, self.nbytes, codec.dtype_code(self.dtype),
                          tuple(self.shape), b"", self.gen, node.node_id(self.directory))
        h = ShmTensor(meta, owns=True, directory=self.directory)
        checked = None
        try:
            if verify and self.nbytes:
                # pinned until the view is made: it maps the very file checked
                # (a sweep between would let go of it, and a new attach could
                # open another file put under the name meanwhile)
                checked = self._verify(server)
            out = h.materialize()
        except EncoderCacheError:
            h.release()
            raise
        except (MmshmError, OSError, ValueError) as exc:
            h.release()
            raise _load_error(server, self, exc) from exc
        except BaseException:
            h.release()
            raise
        finally:
            if checked is not None:
                segment.unpin(checked)
        _note_load()
        if not count:
            return out
        EPD_LOADS.labels(server=server).inc()
        EPD_BYTES.labels(server=server, direction="loaded").inc(self.nbytes)
        EPD_TRANSFER_SECONDS.labels(server=server).observe(time.perf_counter() - t0)
        return out

    def _verify(self, server: str):
        """Check the payload's sampled pages; returns the segment checked,
        pinned (the caller unpins it). Raises :class:`EncoderCacheError`."""
        seg = segment.attach(self.name, self.directory, self.gen)
        segment.pin(seg)
        ok = False
        try:
            key, want = self.key, self.digest
            if not want:  # a hand-off's handle: the segment's record must be this output's
                rec = _read_record(seg)
                if (rec is None or rec.gen != self.gen or rec.nbytes != self.nbytes
                        or tuple(rec.shape) != tuple(self.shape)
                        or self.name not in {published_name(rec.key, slot=s)
                                             for s in range(SLOTS)}):
                    count_fallback(server, "torn", f"{self.name}: its record is not the "
                                   f"handle's output")
                    raise EncoderCacheError(
                        f"encoder output {self.name}: its record does not describe the "
                        f"output the handle names: something outside mmshm wrote into the "
                        f"segment directory", "torn")
                key, want = rec.key, rec.digest
            got = payload_digest(key, self.nbytes, _fd_reader(seg.fd))
            ok = got == want
        finally:
            if not ok:
                segment.unpin(seg)
        if not ok:
            reason = "torn" if not got else "digest"
            count_fallback(server, reason, f"{self.name}: the payload is not the one its "
                           f"record describes (sampled pages differ)")
            raise EncoderCacheError(
                f"encoder output {self.name}: its payload is not the one its record "
                f"describes ({'truncated' if not got else 'sampled pages differ'}): "
                f"something outside mmshm wrote into the segment directory", reason)
        return seg


_LOADED_PID = 0


def _note_load() -> None:
    """This process loaded a view: give back what is left of them at exit
    (:func:`_release_views_at_exit`), through multiprocessing's finalizers
    too (``exitpriority`` 1, before the segment layer's at 0)."""
    global _LOADED_PID
    if _LOADED_PID != os.getpid():
        _LOADED_PID = os.getpid()
        if _EXIT_PID != os.getpid():
            multiprocessing.util.Finalize(None, _close_stores, exitpriority=1)


def _load_error(server: str, h: EntryHandle, exc: BaseException) -> EncoderCacheError:
    if isinstance(exc, SegmentNotFoundError):
        reason = "segment_gone"
    else:
        reason = "torn"
    count_fallback(server, reason, f"{h.name} cannot be loaded: {exc}")
    return EncoderCacheError(
        f"encoder output {h.name} in {segment_dir(h.directory)} cannot be loaded: {exc} "
        f"(reason={reason}); fix: leave mmshm-* files in the segment directory to mmshm "
        f"(a tmpfs cleaner, systemd's RemoveIPC=yes or an rm removes them)", reason)


class Entry:
    """A published encoder output this process holds one reference on (from
    :meth:`EncoderCache.lookup`): the segment stays until :meth:`release`.
    ``key``, ``name``, ``gen``, ``dtype``, ``shape``, ``nbytes``, ``label``
    (the producer's name for the item), ``digest`` describe it; ``holder``
    (settable: "vLLM encoder cache", a request id) says who holds it, in
    :meth:`EncoderCache.held` and ``mmshm status``."""

    __slots__ = ("__weakref__", "_released", "_seg", "_store", "digest", "directory", "dtype",
                 "gen", "holder", "key", "label", "name", "nbytes", "producer_pid", "shape")

    def __init__(self, seg, rec: _Record, directory: str | None, gen: int,
                 store: EncoderCache | None = None, holder: str = ""):
        self._seg = seg
        self._released = False
        self._store = store
        self.directory = directory
        self.name = seg.name
        self.gen = gen
        self.key = rec.key
        self.dtype = codec.DTYPES[rec.dtype]
        self.shape = tuple(rec.shape)
        self.nbytes = rec.nbytes
        self.label = rec.label
        self.producer_pid = rec.pid
        self.digest = rec.digest
        self.holder = holder

    def handle(self) -> EntryHandle:
        """A picklable :class:`EntryHandle` for a loader in another process."""
        return EntryHandle(self.name, self.directory, self.gen, self.dtype, self.shape,
                           self.nbytes, self.key, self.digest)

    def load(self, server: str = "vllm", verify: bool = True, count: bool = True) -> torch.Tensor:
        """:meth:`EntryHandle.load` in this process."""
        return self.handle().load(server, verify, count)

    def release(self) -> None:
        """Give this holder's reference back (idempotent, never raises)."""
        if self._released:
            return
        self._released = True
        seg, self._seg = self._seg, None
        store, self._store = self._store, None
        try:
            segment.update_refcount(self.name, -1, self.directory, self.gen)
        except (MmshmError, OSError) as exc:
            log.debug("mmshm: giving back %s failed: %s", self.name, exc)
        finally:
            segment.unpin(seg)
            if store is not None:
                store._forget_held(self)

    @property
    def released(self) -> bool:
        return self._released

    def intact(self) -> bool:
        """Whether this held entry's file is still loadable by name: the name
        still links to the inode this process holds, at its full size (a third
        party's ``rm``, ``truncate`` or replacement says no; so does a released
        entry). Two syscalls; never raises."""
        seg = self._seg
        if seg is None:
            return False
        try:
            held, named = os.fstat(seg.fd), os.stat(seg.path)
        except (OSError, AttributeError, TypeError):
            return False
        return ((held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
                and named.st_size >= HEADER_SIZE + self.nbytes)

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return (f"<Entry {self.name} {self.dtype} {list(self.shape)} label={self.label!r}"
                f"{' holder=' + repr(self.holder) if self.holder else ''}"
                f"{' released' if self._released else ''}>")


class SaveResult(NamedTuple):
    """What :meth:`EncoderCache.save` did: ``published`` (the entry can be
    found now, written now or already there), ``name`` (its published name),
    ``reason`` (why not: ``over_budget`` / ``no_space`` / ``name_taken``;
    None when published), ``nbytes`` written now (0 when it was there
    already: this process's, or another producer's on which it now keeps a
    reference)."""

    published: bool
    name: str | None
    reason: str | None
    nbytes: int


class PendingEntry:
    """A segment made by :meth:`EncoderCache.reserve` for one encoder output,
    not published yet: no lookup finds it until :meth:`publish`.

    Attributes:
        key: the content key.
        nbytes: the payload's size in bytes.
        payload: a ``torch.uint8`` tensor of ``nbytes`` elements over the
            segment's shared mapping (write the output's bytes there, C order);
            None once published or discarded (drop every view of it first).
        address: ``payload``'s address (for a transfer engine's
            ``register_buffer`` / ``get_into``), 0 for an empty payload.
        span: ``(address, nbytes)`` of the segment's whole payload mapping
            (its capacity: at least :attr:`nbytes`; the same for every later
            entry this process writes into the segment while it keeps it
            mapped), what a transfer engine registers once per segment;
            None for an empty payload.
        reusable: whether the segment goes back to this process's warm pool
            after this entry (``MMSHM_POOL`` on), to serve later entries:
            something attached to :attr:`span` (a registration) may then be
            kept and given back from a let-go hook
            (:meth:`mmshm.segments.table.SegmentTable.add_let_go_hook`),
            which runs before the segment is unlinked or unmapped here;
            otherwise it is given back before :meth:`publish` or
            :meth:`discard`.
    """

    __slots__ = ("_cache", "_count", "_done", "_seg", "_t0", "address", "key", "label",
                 "nbytes", "payload", "reusable", "span")

    def __init__(self, cache: EncoderCache, seg, key: bytes, nbytes: int, label: str,
                 t0: float, count: bool = True):
        self._cache, self._seg, self._t0, self._count = cache, seg, t0, count
        self._done = False
        self.key, self.nbytes, self.label = key, nbytes, label
        if nbytes:
            self.payload = torch.from_numpy(np.frombuffer(seg.payload_view(), dtype=np.uint8,
                                                          count=nbytes))
            self.address = self.payload.data_ptr()
            self.span = seg.payload_span()
        else:
            self.payload = torch.empty(0, dtype=torch.uint8)
            self.address = 0
            self.span = None
        try:
            hdr = segfile.peek_header(seg.fd)
        except OSError:
            hdr = None
        self.reusable = bool(hdr is not None and hdr.flags & segfile.FLAG_POOLABLE)

    def _give_back(self) -> None:
        self.payload = None
        self._done = True
        seg, self._seg = self._seg, None
        try:
            segment.update_refcount(seg.name, -1, self._cache.directory, seg.gen)
        except (MmshmError, OSError) as exc:  # its file removed by a close that did not wait
            log.debug("mmshm: giving back the reserved %s: %s", seg.name, exc)
        finally:
            self._settled()

    def _settled(self) -> None:
        cache = self._cache
        with cache._lock:
            cache._pending.discard(self)
            cache._pending_done.notify_all()

    def publish(self, dtype: torch.dtype, shape: tuple[int, ...], digest: bytes) -> SaveResult:
        """Check the payload written so far against ``digest``
        (:func:`payload_digest`, the producer's) and publish it as a
        ``dtype`` tensor of ``shape``. A payload that is not the digest's is
        given back, never published: ``SaveResult(False, None, "digest", 0)``
        (not counted here: the caller knows where the bytes came from); a
        name refused counts as :meth:`EncoderCache.save` counts it.

        Raises:
            ValueError: already published or discarded, or ``dtype`` and
                ``shape`` do not make :attr:`nbytes`.
            HandleError: a dtype that cannot travel through shared memory.
        """
        if self._done:
            raise ValueError("this pending entry was published or discarded already")
        shape = tuple(int(s) for s in shape)
        code = codec.dtype_code(dtype)
        if any(s < 0 for s in shape) or dtype.itemsize * math.prod(shape) != self.nbytes:
            raise ValueError(f"{dtype} {list(shape)} is not {self.nbytes} bytes")
        seg = self._seg
        self.payload = None
        seg.cold = False
        seg.blank = False
        got = payload_digest(self.key, self.nbytes, _view_reader(seg))
        if got != digest:
            self._give_back()
            return SaveResult(False, None, "digest", 0)
        if self._cache._closed:  # closed while the payload was written: nothing published
            self._give_back()
            return SaveResult(False, None, "closed", 0)
        self._done = True
        self._seg = None
        try:
            return self._cache._finish_save(seg, self.key, code, dtype, shape, self.nbytes,
                                            self.label, digest, self._t0, count=self._count)
        finally:
            self._settled()

    def discard(self) -> None:
        """Give the segment back unpublished (idempotent; drop every view of
        :attr:`payload` first)."""
        if not self._done:
            self._give_back()

    def __del__(self):
        try:
            self.discard()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass


class _Own(NamedTuple):
    seg: Any
    name: str
    gen: int
    nbytes: int
    #: another producer's entry this process keeps a reference on (not written here)
    kept: bool = False


_WARNED: set[str] = set()
_FIX = {
    "over_budget": "raise MMSHM_MAX_BYTES or lower MMSHM_MIN_FREE_BYTES, give the segment "
                   "directory more room, or lower the connector's keep_s (or raise its "
                   "max_bytes)",
    "no_space": "give the segment directory (MMSHM_DIR, default /dev/shm) more room "
                "(docker --shm-size), or lower the connector's keep_s",
    "name_taken": "run `mmshm status` to see which files hold the entry's names and `mmshm "
                  "gc` to reclaim orphans; leave mmshm-* files in the segment directory to "
                  "mmshm",
    "missing": "normal when the encoder did not run for this item; otherwise send the "
               "encoder request first and keep both instances on one MMSHM_DIR and one model",
    "content_mismatch": "nothing to fix: two keys share 64 bits of name; the item is encoded here",
    "incompatible": "run the encoder and this instance with the same model and --dtype",
    "segment_gone": "the encoder instance exited or evicted the entry (raise keep_s if the "
                    "consumer's queue is long)",
    "torn": "something outside mmshm truncated or overwrote the entry in the segment "
            "directory (a tmpfs cleaner, systemd's RemoveIPC=yes, an rm): leave mmshm-* "
            "files to mmshm",
    "digest": "something outside mmshm wrote another payload into the entry: leave mmshm-* "
              "files in the segment directory to mmshm",
    "queue_full": "the encoder's scheduler sends keys faster than its worker publishes: "
                  "lower the encoder's --max-num-seqs or raise the queue's limit",
}


#: an inline payload quoted in a server's error text (a data URL's base64)
_DATA_URL = re.compile(r"(data:[\w/+.-]{0,64}(?:;[\w=-]{0,32})*;base64,)[A-Za-z0-9+/=]{64,}")
#: the most characters of a server's own text a fallback line quotes
DETAIL_CHARS = 1000


def bounded_detail(detail: str) -> str:
    """``detail`` fit for one log line: each base64 data URL in it reduced to
    its head and length (SGLang's encoder quotes a rejected image's whole
    data URL: hundreds of KB), then cut at :data:`DETAIL_CHARS`."""
    detail = _DATA_URL.sub(lambda m: f"{m.group(1)}<{len(m.group(0)) - len(m.group(1))} "
                           f"base64 chars>", detail)
    if len(detail) > DETAIL_CHARS:
        detail = f"{detail[:DETAIL_CHARS]}... <{len(detail) - DETAIL_CHARS} more chars>"
    return detail


def count_fallback(server: str, reason: str, detail: str, fix: str | None = None) -> None:
    """Count one ``mmshm_epd_fallbacks_total{server, reason}``; the first of
    each reason in this process is said at WARNING with its fix (``fix``,
    else the reason's usual one), the others at DEBUG; ``detail`` as
    :func:`bounded_detail` leaves it."""
    EPD_FALLBACKS.labels(server=server, reason=reason).inc()
    detail = bounded_detail(detail)
    if reason not in _WARNED:
        _WARNED.add(reason)
        level = logging.INFO if reason == "missing" else logging.WARNING
        log.log(level, "mmshm: encoder cache (%s): %s (reason=%s; said once per process); "
                "fix: %s", server, detail, reason, fix or _FIX.get(reason, "see docs/vllm.md"))
    else:
        log.debug("mmshm: encoder cache (%s): %s (reason=%s)", server, detail, reason)


def _read_record(seg) -> _Record | None:
    if seg.payload_size < RECORD_SIZE:
        return None
    off = HEADER_SIZE + seg.payload_size - RECORD_SIZE
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
            or rec.nbytes > seg.payload_size - RECORD_SIZE or rec.nbytes < 0
            or any(s < 0 for s in rec.shape)):
        return None
    want = codec.DTYPES[rec.dtype].itemsize * math.prod(rec.shape)
    return rec if want == rec.nbytes else None


def _shape_ok(got: tuple[int, ...], rows: int | None, shape) -> bool:
    if rows is not None and (not got or got[0] != rows):
        return False
    if shape is None:
        return True
    shape = tuple(shape)
    return len(shape) == len(got) and all(w is None or w < 0 or int(w) == g
                                          for w, g in zip(shape, got))


class KeyQueue:
    """A producer's content keys by the server's item name, waiting for the
    worker that publishes (vLLM: the scheduler learns an item's key, its
    worker publishes the encoder output later). Keeps at most ``limit`` keys;
    past it the oldest is dropped, counted in
    ``mmshm_epd_fallbacks_total{reason="queue_full"}`` when it was never
    taken (its output will not be published), and said once at WARNING with
    the fix.

    Args:
        server: the ``server`` label of the counter.
        limit: keys kept (default :data:`QUEUE_LIMIT`).
    """

    def __init__(self, server: str = "vllm", limit: int = QUEUE_LIMIT):
        self.server = server
        self.limit = int(limit)
        self._keys: OrderedDict[str, list] = OrderedDict()
        self.dropped = 0

    def put(self, ident: str, key: bytes) -> None:
        """Remember ``key`` for item ``ident`` (the newest)."""
        self._keys[ident] = [key, False]
        self._keys.move_to_end(ident)
        while len(self._keys) > self.limit:
            old, (_, taken) = self._keys.popitem(last=False)
            if not taken:
                self.dropped += 1
                count_fallback(self.server, "queue_full",
                               f"the producer's queue of content keys is past {self.limit} "
                               f"keys: the key of item {old} was dropped before its encoder "
                               f"output was published, so no consumer will find it")

    def get(self, ident: str) -> bytes | None:
        """The key of item ``ident`` (marked taken), or None."""
        v = self._keys.get(ident)
        if v is None:
            return None
        v[1] = True
        return v[0]

    def __contains__(self, ident: str) -> bool:
        return ident in self._keys

    def __len__(self) -> int:
        return len(self._keys)


class EncoderCache:
    """This process's side of the encoder-output store (see the module
    docstring): publishing as a producer, looking up as a consumer, or both.

    Args:
        directory: the segment directory (default ``MMSHM_DIR`` at each use).
        server: the ``server`` label of the metrics.
        keep_s: seconds a published entry stays after its last save.
        max_bytes: the most bytes (records included) this process's published
            entries may take, and the most bytes of entries it may hold as a
            consumer; 0 for no cap of its own (the core's budget still
            applies): a save evicts this process's oldest entries to stay
            under it, an output larger than the cap is not published, and a
            lookup that would hold more is a miss (``over_budget``). The
            core's ``MMSHM_MAX_BYTES`` caps every segment of the process
            (pixel payloads too); this caps only the encoder cache.
        namespace: what both instances key under (the model), shown by
            :meth:`describe` and in the warning of a pair that cannot meet;
            the keys themselves come from :func:`content_key`.
    """

    def __init__(self, directory: str | None = None, server: str = "vllm",
                 keep_s: float = DEFAULT_KEEP_S, max_bytes: int = 0, namespace: str = ""):
        if not (keep_s >= 0 and max_bytes >= 0):  # NaN too: it compares false with any time
            raise ValueError(f"keep_s and max_bytes must be numbers >= 0, not {keep_s!r} and "
                             f"{max_bytes!r}")
        self.directory = directory
        self.server = server
        self.keep_s = float(keep_s)
        self.max_bytes = int(max_bytes)
        self.namespace = namespace
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        #: key -> this process's published entry (holds the creator's reference)
        #: or another producer's entry it keeps a reference on
        self._own: dict[bytes, _Own] = {}
        #: key -> monotonic time it expires at (insertion order = oldest first)
        self._expiry: dict[bytes, float] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pid = os.getpid()
        #: entries this process holds as a consumer (from lookup)
        self._held: weakref.WeakSet = weakref.WeakSet()
        self._held_bytes = 0
        self._hits = 0
        self._misses = 0
        self._meet_said = False
        #: segments reserved and not yet published or given back (PendingEntry)
        self._pending: set = set()
        self._pending_done = threading.Condition(self._lock)
        _register_exit(self)
        if directory:  # under mmshm run: what this process leaves here is reclaimed after it
            config.note_segment_dir(directory)

    # -- what it is ----------------------------------------------------------------
    def describe(self) -> str:
        """One line for a connector's "on:" line, to compare between the two
        instances of a pair: the namespace, the segment directory and its
        node id (:func:`mmshm.segments.node.node_id`)."""
        d = segment_dir(self.directory)
        try:
            nid = str(node.node_id(self.directory))
        except Exception as exc:  # noqa: BLE001 - a description never fails
            nid = f"unknown ({exc})"
        return f"namespace {self.namespace!r}, segment directory {d} (node {nid})"

    # -- producer ------------------------------------------------------------------
    def save(self, key: bytes, tensor: torch.Tensor, label: str = "") -> SaveResult:
        """Publish ``tensor`` (any dtype and shape) as the encoder output of
        ``key``, written once. A CPU tensor is copied into the segment (a new
        file by ``pwrite``, a warm pooled one through its mapping, split
        across the copy threads from ``PARALLEL_MIN_BYTES``); a tensor on a
        GPU by one blocking device-to-host copy straight into the segment's
        mapping (:func:`mmshm.segments.arena.copy_from_device`: pinned speed
        when it is an arena segment, counted in ``mmshm_gpu_copy_*``). The
        record carries the payload's digest (:func:`payload_digest`).

        Content this process already published is not written again (its
        keep time restarts); content another producer of the node published
        is not written either: this process keeps a reference on that entry
        for its own keep time. This key's old segment idle in this process's
        pool under the published name is reused; another process's idle one
        is replaced. A save that does not fit evicts this process's oldest
        entries and tries once more; if it still does not fit the entry is
        not published, and ``mmshm_epd_fallbacks_total`` counts the reason
        (the consumer encodes the item itself).

        Returns:
            :class:`SaveResult`.
        Raises:
            ValueError: a key that is not :data:`KEY_BYTES` long.
            HandleError: a dtype that cannot travel through shared memory.
        """
        if len(key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes, not {len(key)}")
        code = codec.dtype_code(tensor.dtype)
        again = self._own_again(key)
        if again is not None:
            return again
        # a tensor on a GPU stays there until its one copy (D2H) into the segment
        t = tensor.detach().contiguous()
        shape = tuple(int(s) for s in t.shape)
        nbytes = t.numel() * t.element_size()
        other = self._search(key, t.dtype, None, shape=shape, hold=False)[0]
        if other is not None:  # published by another producer: keep a reference on it
            return self._keep(key, other)
        t0 = time.perf_counter()
        seg = self._new_segment(key, nbytes, label)
        if isinstance(seg, SaveResult):
            return seg
        try:
            digest = self._fill(seg, key, t, nbytes)
        except BaseException:
            segment.update_refcount(seg.name, -1, self.directory, seg.gen)
            raise
        return self._finish_save(seg, key, code, t.dtype, shape, nbytes, label, digest, t0)

    def _new_segment(self, key: bytes, nbytes: int, label: str):
        """A segment for ``nbytes`` of payload and the record (this key's old
        pooled one, or a new one), or the :class:`SaveResult` of a refusal
        (counted)."""
        seg = self._take_own_pooled(key, nbytes + RECORD_SIZE)
        if seg is None:
            try:
                self._make_room(nbytes + RECORD_SIZE)
                seg = self._create(nbytes + RECORD_SIZE)
            except SegmentError as exc:
                reason = "over_budget" if getattr(exc, "reason", "") == "budget" else "no_space"
                capped = isinstance(exc, _CacheCapError)
                count_fallback(self.server, reason,
                               f"an encoder output of {nbytes} bytes ({label or key.hex()[:16]}) "
                               f"was not published: {exc}",
                               fix=(f"raise the encoder cache's max_bytes ({self.max_bytes}; "
                                    f"vLLM: ec_connector_extra_config max_bytes) above the "
                                    f"largest output") if capped else None)
                return SaveResult(False, None, reason, 0)
        return seg

    def _finish_save(self, seg, key: bytes, code: int, dtype, shape: tuple[int, ...],
                     nbytes: int, label: str, digest: bytes, t0: float,
                     count: bool = True) -> SaveResult:
        """Write the record of the filled ``seg`` and publish it (its creator
        reference becomes this process's entry, or is given back); ``count``:
        a save in ``mmshm_epd_saves_total`` and its bytes and seconds."""
        try:
            self._write_record(seg, key, code, shape, nbytes, label, digest)
            got = self._publish(seg, key, dtype, shape)
        except BaseException:
            segment.update_refcount(seg.name, -1, self.directory, seg.gen)
            raise
        if isinstance(got, Entry):  # another producer published it first
            segment.update_refcount(seg.name, -1, self.directory, seg.gen)
            return self._keep(key, got)
        if got is None:
            segment.update_refcount(seg.name, -1, self.directory, seg.gen)
            count_fallback(self.server, "name_taken",
                           f"the encoder output {label or key.hex()[:16]} was not published: "
                           f"its names {[published_name(key, slot=s) for s in range(SLOTS)]} "
                           f"are held by files that are not its entry")
            return SaveResult(False, None, "name_taken", 0)
        with self._lock:
            if key in self._own:  # a concurrent save kept this very entry meanwhile
                self._drop(key)
            self._own[key] = _Own(seg, got, seg.gen, nbytes)
            self._touch(key)
        if count:
            EPD_SAVES.labels(server=self.server).inc()
            EPD_BYTES.labels(server=self.server, direction="saved").inc(nbytes)
            EPD_TRANSFER_SECONDS.labels(server=self.server).observe(time.perf_counter() - t0)
        return SaveResult(True, got, None, nbytes)

    def _own_again(self, key: bytes) -> SaveResult | None:
        """What a save of ``key`` finds before writing: refused when closed,
        this process's live entry kept (its keep time restarted), else None
        (a freed one of ours dropped)."""
        with self._lock:
            if self._closed:
                return SaveResult(False, None, "closed", 0)
            own = self._own.get(key)
            if own is not None and not own.seg.freed():
                self._touch(key)
                return SaveResult(True, own.name, None, 0)
            if own is not None:
                self._drop(key)
        return None

    def reserve(self, key: bytes, nbytes: int, label: str = "",
                count: bool = True) -> PendingEntry | SaveResult:
        """A new segment for the encoder output of ``key`` (``nbytes`` bytes),
        not published: the caller fills :attr:`PendingEntry.payload` (a
        network read straight into shared memory: one copy) and then calls
        :meth:`PendingEntry.publish` (which checks the payload's digest
        first) or :meth:`PendingEntry.discard`; until then no lookup can
        find it. Returns a :class:`SaveResult` instead when there is nothing
        to fill: the entry is published already (this process's, its keep
        time restarted; or another producer's of the node, kept as
        :meth:`save` keeps it), or the segment was refused (``over_budget``,
        ``no_space``: counted as :meth:`save` counts them; ``closed``).
        ``count``: its publication counts as a save (``mmshm_epd_saves_total``,
        ``mmshm_epd_bytes_total{direction="saved"}``, the transfer seconds);
        False for bytes that came from elsewhere (a Store read on a PD
        instance, counted as ``store_get`` by its reader).

        Raises:
            ValueError: a key that is not :data:`KEY_BYTES` long, or
                ``nbytes`` < 0.
        """
        if len(key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes, not {len(key)}")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, not {nbytes!r}")
        again = self._own_again(key)
        if again is not None:
            return again
        other = self._search(key, None, None, hold=False)[0]
        if other is not None and other.nbytes == nbytes:  # another producer's: keep it
            return self._keep(key, other)
        if other is not None:
            other.release()
        t0 = time.perf_counter()
        seg = self._new_segment(key, nbytes, label)
        if isinstance(seg, SaveResult):
            return seg
        pending = PendingEntry(self, seg, key, nbytes, label, t0, count)
        with self._lock:
            self._pending.add(pending)
        return pending

    def _keep(self, key: bytes, entry: Entry) -> SaveResult:
        """Turn ``entry`` (one reference, pinned) into this producer's keep
        reference on ``key`` for :attr:`keep_s`."""
        seg, entry._seg = entry._seg, None
        entry._released = True
        with self._lock:
            if self._closed or key in self._own:
                # closed meanwhile, or another thread of this process kept it first
                try:
                    segment.update_refcount(entry.name, -1, self.directory, entry.gen)
                except (MmshmError, OSError):
                    pass
                segment.unpin(seg)
                own = self._own.get(key)
                return SaveResult(own is not None, own.name if own else None,
                                  None if own else "closed", 0)
            self._own[key] = _Own(seg, entry.name, entry.gen, entry.nbytes, kept=True)
            self._touch(key)
        return SaveResult(True, entry.name, None, 0)

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
        fits, else a new file), evicting this process's oldest entries while
        the budget or the space refuses."""
        while True:
            try:
                return segment.create(nbytes, self.directory)
            except ShmSpaceError:
                with self._lock:
                    oldest = next(iter(self._expiry), None)
                    if oldest is None:
                        raise
                    self._drop(oldest)

    def _take_own_pooled(self, key: bytes, need: int):
        """This process's idle pooled segment under one of ``key``'s
        published names (its old entry, after the keep time), revived (count
        1, the next generation; a file shorter than its header says is
        refused by :func:`mmshm.segments.segfile.revive`), or None."""
        with TABLE.lock:
            for slot in range(SLOTS):
                seg = TABLE.get(published_name(key, slot=slot))
                if (seg is None or not seg.owned or seg.pins or seg.payload_size < need
                        or seg.status() != STATE_POOLED):
                    continue
                try:
                    if os.fstat(seg.fd).st_size < HEADER_SIZE + seg.payload_size:
                        continue
                except OSError:
                    continue
                if TABLE.take_pooled(seg):
                    return seg
        return None

    def _fill(self, seg, key: bytes, t: torch.Tensor, nbytes: int) -> bytes:
        """Write the payload; return its digest."""
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
            seg.blank = False
            view = seg.payload_view()
            return payload_digest(key, nbytes, lambda off, n: view[off:off + n])
        if nbytes:
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
            return payload_digest(key, nbytes, lambda off, n: src[off:off + n])
        seg.blank = False
        return payload_digest(key, 0, None)

    def _write_record(self, seg, key: bytes, code: int, shape: tuple[int, ...], nbytes: int,
                      label: str, digest: bytes) -> None:
        rec = _REC_ENC.encode(_Record(key, code, shape, nbytes, label[:512], os.getpid(),
                                      time.time_ns(), seg.gen, digest))
        try:
            os.pwrite(seg.fd, _RECORD_MAGIC + _LEN.pack(len(rec)) + rec,
                      HEADER_SIZE + seg.payload_size - RECORD_SIZE)
        except OSError as exc:
            raise segfile.os_error(exc, "write", seg.path) from None

    def _publish(self, seg, key: bytes, dtype, shape) -> str | Entry | None:
        """Link ``seg`` to one of ``key``'s published names. Returns the name;
        or the entry another producer published there meanwhile (held once,
        pinned); or None when every name is held by something else."""
        d = os.path.dirname(seg.path)
        for slot in range(SLOTS):
            name = published_name(key, slot=slot)
            final = os.path.join(d, name)
            if seg.path == final:
                return name  # this key's old segment, reused from the pool under its name
            for attempt in range(2):
                try:
                    os.link(seg.path, final)  # atomic, never replaces: complete or invisible
                except FileExistsError:
                    peer = self._check_name(name, key, dtype, None, shape, hold=False)[0]
                    if peer is not None:
                        return peer
                    if attempt == 0 and self._clear_stale(final):
                        continue
                    break
                except OSError as exc:
                    raise segfile.os_error(exc, "publish", final) from None
                old = seg.path
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
        return None

    def _clear_stale(self, path: str) -> bool:
        """Unlink the idle pooled segment (count 0) at ``path``, whoever's
        it is, under its mutex (:func:`mmshm.segments.segfile.unlink_pooled`):
        this key's old entry after its keep time, or a segment the name kept
        through a reuse. Its owner sees it freed and lets go of it. A live
        segment or a file that is not a segment is left alone. Returns
        whether the name may be free now."""
        with TABLE.lock:
            seg = TABLE.get(os.path.basename(path))
            if (seg is not None and seg.owned and seg.pins == 0 and seg.path == path
                    and seg.status() == STATE_POOLED):
                TABLE.unlink_pooled(seg)
                return True
        try:
            fd = os.open(path, OPEN_FLAGS)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            hdr = segfile.peek_header(fd)
            if (hdr is None or st.st_uid != os.geteuid()
                    or hdr.state != STATE_POOLED or hdr.refcount != 0):
                return False
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                return True
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return True  # replaced meanwhile: try the link again
            segfile.unlink_pooled(fd, path)  # re-checks POOLED and count 0 under the mutex
            return not os.path.lexists(path)
        except OSError:
            return False
        finally:
            os.close(fd)

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
        """(under the lock) give back this process's reference of ``key``
        (the creator's, or the keep reference on another producer's entry).
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
        finally:
            if own.kept:
                segment.unpin(own.seg)

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
        """Published names of this process's entries (written here or kept)."""
        with self._lock:
            return [o.name for o in self._own.values()]

    def close(self) -> None:
        """Give back every reference of this process (also run at exit): the
        creator's and keep references of its entries, and the entries it
        holds as a consumer. Entries nobody else holds go at once, their
        warm pages too. A segment reserved (:meth:`reserve`) and still being
        written is waited for up to :data:`PENDING_WAIT_S` seconds: its
        writer then gives it back unpublished. Idempotent; the store
        publishes nothing after it."""
        with self._lock:
            self._closed = True
            if os.getpid() != self._pid:
                self._own.clear()
                self._expiry.clear()
                return
            # a reserved segment still being written (a Store read) is given back by its
            # writer, unpublished, once the write ends: wait a little for that
            end = time.monotonic() + PENDING_WAIT_S
            while self._pending and time.monotonic() < end:
                self._pending_done.wait(end - time.monotonic())
            for pending in list(self._pending):  # a read that hangs: its file goes now
                seg = pending._seg
                if seg is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(seg.path)
            segs = [o.seg for o in self._own.values() if not o.kept]
            for key in list(self._own):
                self._drop(key)
            self._wake.notify_all()
        for entry in list(self._held):
            entry.release()
        with TABLE.lock:  # and no warm pages kept for saves that will not come
            for seg in segs:
                if seg.fd >= 0 and seg.pins == 0 and seg.status() == STATE_POOLED:
                    TABLE.unlink_pooled(seg)
                elif seg.fd >= 0 and seg.status() == STATE_LIVE:
                    _unlink_unheld(seg)
            # this store's old entries idle in the pool under their published names
            prefix = f"{PREFIX}{PUBLISHED_PID}-"
            for seg in list(TABLE.segments.values()):
                if (seg.owned and seg.pins == 0 and seg.name.startswith(prefix)
                        and seg.status() == STATE_POOLED):
                    TABLE.unlink_pooled(seg)
        self._write_holders(now=True)

    # -- consumer --------------------------------------------------------------------
    def lookup(self, key: bytes, dtype: torch.dtype | None = None, rows: int | None = None,
               *, shape: tuple | None = None, count: bool = True, holder: str = "",
               verify: bool = True) -> Entry | None:
        """Find the published encoder output of ``key`` and take one
        reference on it (hold it until :meth:`Entry.release`).

        Args:
            key: :func:`content_key` of the item.
            dtype: the dtype the consumer expects (None: any).
            rows: the number of rows (``shape[0]``: the item's embeddings) it
                expects (None: any).
            shape: the whole shape it expects, e.g. ``(rows, hidden size)``;
                a ``None`` or negative dimension matches any (None: any shape).
            count: count a miss in ``mmshm_epd_fallbacks_total`` with its
                reason (``missing``, ``content_mismatch``, ``incompatible``,
                ``segment_gone``, ``torn``, ``digest``, ``over_budget``).
                Every lookup counts ``mmshm_epd_lookups_total{result}``.
            holder: the entry's :attr:`Entry.holder` label.
            verify: check the payload's sampled pages against the record's
                digest (``pread``, about 20 us for an output of 8.6 MB).
        Returns:
            an :class:`Entry`, or None (the caller encodes the item itself).
            Never raises for a missing, foreign, torn or vanishing file.
        """
        return self.lookup_why(key, dtype, rows, shape=shape, count=count, holder=holder,
                               verify=verify)[0]

    def lookup_why(self, key: bytes, dtype: torch.dtype | None = None, rows: int | None = None,
                   *, shape: tuple | None = None, count: bool = True, holder: str = "",
                   verify: bool = True) -> tuple[Entry | None, str, str]:
        """:meth:`lookup` (same arguments), returning ``(entry, "", "")`` for
        a hit and ``(None, reason, detail)`` for a miss: ``reason`` one of
        those :meth:`lookup` counts, ``detail`` a sentence naming the file.
        A miss of a name with no file costs one failed ``open`` per name
        (:data:`SLOTS`), nothing else. Never raises for a missing, foreign,
        torn or vanishing file."""
        found, reason, detail = self._search(key, dtype, rows, shape=shape, verify=verify,
                                             holder=holder)
        EPD_LOOKUPS.labels(server=self.server, result="hit" if found else "miss").inc()
        if found is not None:
            self._hits += 1
            return found, "", ""
        self._misses += 1
        if count:
            count_fallback(self.server, reason, detail)
        if not self._hits and self._misses >= MISSES_BEFORE_WARNING and not self._meet_said:
            self._meet_said = True
            log.warning(
                "mmshm: encoder cache (%s): %d lookups and not one hit: this instance and the "
                "encoder instance cannot meet, and every item is encoded here. Fix: run both "
                "on the same node (one host, one IPC and mount namespace: the same /dev/shm), "
                "with the same segment directory (here %s: MMSHM_DIR, or the connector's "
                "directory setting) and the same namespace (here %r; compare the encoder's "
                "\"on:\" line). Last miss: %s (reason=%s)", self.server, self._misses,
                segment_dir(self.directory), self.namespace, detail, reason)
        return None, reason, detail

    def _find(self, key: bytes, dtype, rows) -> Entry | None:
        return self._search(key, dtype, rows, hold=False)[0]

    def _search(self, key: bytes, dtype, rows, *, shape=None, verify: bool = True,
                hold: bool = True, holder: str = "") -> tuple[Entry | None, str, str]:
        """``(entry or None, reason, detail)`` for ``key``, opening its
        published names directly (never listing the directory)."""
        TABLE.first_use(segment_dir(self.directory))  # reclaims orphans once per process
        reason, detail = "missing", (f"no encoder output of content {key.hex()[:16]} in "
                                     f"{segment_dir(self.directory)}")
        for slot in range(SLOTS):
            found, r, det = self._check_name(published_name(key, slot=slot), key, dtype, rows,
                                             shape, verify=verify, hold=hold, holder=holder)
            if found is not None:
                return found, "", ""
            if r != "missing":  # a file under the name says more than an absent one
                reason, detail = r, det
        return None, reason, detail

    def _check_name(self, name: str, key: bytes, dtype, rows, shape, *, verify: bool = True,
                    hold: bool = False, holder: str = "") -> tuple[Entry | None, str, str]:
        with TABLE.lock:
            opened = TABLE.get(name) is None  # attached now: its header just read
        try:
            seg = segment.attach(name, self.directory)
        except SegmentNotFoundError as exc:
            # the usual miss: no file of that name (the open failed: one
            # syscall); else a file that is not live any more
            if exc.strerror == _NO_FILE or not os.path.lexists(
                    os.path.join(segment_dir(self.directory), name)):
                return None, "missing", ""
            return None, "segment_gone", f"{name}: {exc}"
        except (MmshmError, OSError) as exc:
            return None, "torn", f"{name}: {exc}"
        segment.pin(seg)  # the descriptor (and its liveness lock) stays while held
        held = False
        try:
            rec = _read_record(seg)
            # the generation attach read (the reference below checks it under
            # the segment's mutex), else this process's older descriptor's now
            gen = seg.gen if opened and not seg.owned else read_header(seg.fd, seg.path).gen
            if rec is None:
                return None, "torn", f"{name} holds no complete entry record"
            if rec.gen != gen:
                return None, "segment_gone", f"{name} was reused since its entry was written"
            if rec.key != key:
                return None, "content_mismatch", (
                    f"{name} holds the encoder output of other content "
                    f"({rec.key.hex()[:16]}, item {rec.label!r})")
            got = codec.DTYPES[rec.dtype]
            if (dtype is not None and got != dtype) or not _shape_ok(tuple(rec.shape), rows,
                                                                    shape):
                return None, "incompatible", (
                    f"{name} holds {got} {list(rec.shape)}, expected {dtype or 'any dtype'} "
                    f"with shape {list(shape) if shape is not None else '?'} and "
                    f"{rows if rows is not None else 'any number of'} rows")
            if hold and self.max_bytes and self._held_bytes + rec.nbytes > self.max_bytes:
                return None, "over_budget", (
                    f"{name} ({rec.nbytes} bytes) would take the entries this process holds "
                    f"past the encoder cache's max_bytes={self.max_bytes}")
            if verify:
                got_digest = payload_digest(key, rec.nbytes, _fd_reader(seg.fd))
                if got_digest != rec.digest:
                    return None, ("torn" if not got_digest else "digest"), (
                        f"{name}: the payload is not the one its record describes "
                        f"({'truncated' if not got_digest else 'sampled pages differ'})")
            # fails if the last holder let go since the attach, or the segment
            # was pooled and reused (another generation): a miss, never its bytes
            segment.update_refcount(name, 1, self.directory, gen)
            held = True
            entry = Entry(seg, rec, self.directory, gen, self if hold else None, holder)
            if hold:
                self._hold(entry)
            return entry, "", ""
        except SegmentNotFoundError as exc:
            return None, "segment_gone", f"{name}: {exc}"
        except (MmshmError, OSError) as exc:
            return None, "torn", f"{name}: {exc}"
        finally:
            if not held:
                segment.unpin(seg)

    # -- what a consumer holds -------------------------------------------------------
    def _hold(self, entry: Entry) -> None:
        with self._lock:
            self._held.add(entry)
            self._held_bytes += entry.nbytes
        EPD_HELD_BYTES.labels(server=self.server).inc(entry.nbytes)
        self._write_holders()

    def _forget_held(self, entry: Entry) -> None:
        with self._lock:
            if entry not in self._held:
                return
            self._held.discard(entry)
            self._held_bytes -= entry.nbytes
        EPD_HELD_BYTES.labels(server=self.server).dec(entry.nbytes)
        self._write_holders()

    def held(self) -> list[HeldEntry]:
        """The entries this process holds as a consumer, with their holders."""
        with self._lock:
            return [HeldEntry(e.name, e.nbytes, e.holder, e.label) for e in list(self._held)
                    if not e.released]

    def held_bytes(self) -> int:
        """Bytes of the entries this process holds (they count against
        :attr:`max_bytes`)."""
        return self._held_bytes

    def set_holder(self, entry: Entry, holder: str) -> None:
        """Label ``entry``'s holder (shown by ``mmshm status``)."""
        entry.holder = holder
        self._write_holders()

    def _write_holders(self, now: bool = False) -> None:
        """Publish what this process holds for ``mmshm status``
        (:mod:`mmshm.transport.ec_holders`: a memfd of this process, nothing
        in any directory, gone with the process): within
        :data:`~mmshm.transport.ec_holders.FLUSH_S` seconds, or ``now``
        (nothing written on a scheduler's step per entry). Never raises."""
        if os.getpid() != self._pid:
            return
        try:
            if now:
                HOLDERS.write(id(self), self.server, segment_dir(self.directory), self.held())
            else:
                HOLDERS.update(id(self), self._holders_source())
        except (OSError, ValueError) as exc:
            log.debug("mmshm: publishing the encoder cache's holders failed: %s", exc)

    def _holders_source(self):
        ref = weakref.ref(self)

        def source():
            store = ref()
            if store is None:
                return None
            return store.server, segment_dir(store.directory), store.held()
        return source


#: what :func:`mmshm.segments.segment.attach` says when the open of the name
#: itself found no file (:func:`mmshm.segments.segfile.os_error` of ENOENT)
_NO_FILE = "attach: segment is gone"


# -- exit -------------------------------------------------------------------------------
_STORES: weakref.WeakSet = weakref.WeakSet()
_EXIT_PID = 0


def _unlink_unheld(seg) -> bool:
    """(a producer's own entry, under the table's lock) Unlink ``seg``'s
    published name when no other process has it open (its liveness lock):
    the references still counted on it belong to holders that died without
    giving them back (a consumer's EngineCore or worker SIGKILLed, or leaving
    through ``os._exit``), which no one can give back any more. A consumer
    that holds the entry has it open (another process's liveness lock, or a
    pin in this one), and keeps it. Returns whether it was
    unlinked. Never raises."""
    if seg.pins:
        return False  # held in this process (an entry, a view): one descriptor for all
    try:
        with segfile.mutex(seg.fd):
            if segfile.lock_holders_present(seg.fd, segfile.LIVE_BYTE):
                return False
            if os.fstat(seg.fd).st_nlink == 0:
                return False
            now = os.stat(seg.path, follow_symlinks=False)
            st = os.fstat(seg.fd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return False
            TABLE.before_let_go(seg)  # e.g. a transfer engine's registration of its pages
            os.unlink(seg.path)
        log.debug("mmshm: %s unlinked at close: its other holders are gone", seg.name)
        return True
    except OSError:
        return False


def _release_views_at_exit() -> int:
    """Give back the references of this process's loaded views of published
    entries (:meth:`EntryHandle.load`) that are still alive at exit. Their
    finalizers (``weakref.finalize``) run at ``atexit`` in a main process,
    but a multiprocessing child (vLLM's workers, whose encoder cache keeps
    the views) leaves through ``os._exit`` after running only
    multiprocessing's finalizers, so without this the references stay
    counted and the segments stay in the directory until ``mmshm gc``.
    Returns how many were given back."""
    from mmshm.segments import shmtensor

    n = 0
    prefix = f"{PREFIX}{PUBLISHED_PID}-"
    for f in list(getattr(weakref.finalize, "_registry", {})):
        try:
            info = f.peek()
            if (info is not None and info[1] is shmtensor._release_view
                    and str(info[2][0]).startswith(prefix)):
                f()
                n += 1
        except Exception as exc:  # noqa: BLE001 - never stop the exit path
            log.debug("mmshm: giving back a view at exit failed: %s", exc)
    return n


def _close_stores() -> None:
    for store in list(_STORES):
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001 - never stop the exit path
            log.debug("mmshm: closing an encoder cache failed: %s", exc)
    if _EXIT_PID == os.getpid() or _LOADED_PID == os.getpid():
        _release_views_at_exit()


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
