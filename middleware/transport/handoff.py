"""Encoder outputs handed to readers in other processes (EPD), on the store.

An encoder instance that pushes each output to its readers, one send per
reader (SGLang's ``zmq_to_scheduler``: one per TP rank of the language
instance), hands them out through :mod:`mmshm.transport.encoder_cache`
instead of sending the bytes:

* **Published once, complete-only**: :meth:`Handoff.publish` saves the
  output in the store (:meth:`~mmshm.transport.encoder_cache.EncoderCache.save`:
  written once, visible under its published name only once complete) under a
  key of its own (random: one entry per output, whatever its content).
* **A reference per reader**: :meth:`Handoff.handle` adds one reference for
  the reader of one send, before the send, and returns the handle (a
  :class:`Wire`, about 60 bytes) that owns it. The producer's own reference
  goes at :meth:`Handoff.done` (or after the store's keep time); the segment
  stays until the last reader lets go.
* **The reader's held view**: :func:`take` maps the handle zero-copy,
  checked against the dtype and shape the reader expects, and the view holds
  a reference until it is collected
  (:meth:`~mmshm.transport.encoder_cache.EntryHandle.load`), the handle's
  own given back once the view holds its.
* **Unread handles given back**: :func:`give_back` for one, and an
  :class:`Inbox`, which gives back every handle received in its scope and
  not taken (a request aborted, failed or timed out, a stale part).
* **The handshake** (:class:`Cards`): a reader publishes a card in the store
  as it opens its receive endpoint, naming its node id
  (:func:`mmshm.segments.node.node_id`); a producer sends handles only to an
  endpoint whose card it finds in its own segment directory, of its own node
  id (one boot, IPC and mount namespaces, segment directory: the reader can
  open the producer's segments). Any other reader (not under ``mmshm run``,
  another IPC or mount namespace, another /dev/shm, another host) gets the
  server's own bytes, counted (``mmshm_epd_fallbacks_total{reason="unproven"}``).
* **Counting by reason** through :mod:`mmshm.metrics`' objects
  (:func:`~mmshm.transport.encoder_cache.count_fallback`): saves and loads by
  the store, fallbacks by their reason, each reason said once at WARNING.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
import weakref
from typing import NamedTuple

import msgspec
import torch

from mmshm.errors import (
    HandleError,
    MaterializeError,
    MmshmError,
    WrongNodeError,
    failure_reason,
)
from mmshm.segments import codec, node
from mmshm.segments.segfile import NAME_RE
from mmshm.segments.segment import SegmentRef
from mmshm.segments.table import TABLE
from mmshm.transport.encoder_cache import (
    KEY_BYTES,
    EncoderCache,
    EntryHandle,
    content_key,
    count_fallback,
)

#: the first bytes of every encoded :class:`Wire` (a frame that starts
#: otherwise is no handle)
MAGIC = b"MMSHMEP1"
#: seconds a producer trusts what it found of an endpoint's card
CARD_TTL_S = 5.0
#: the namespace of the cards' keys (no encoder output has it)
CARD_NAMESPACE = "mmshm-epd-reader-card-v1"
#: seconds a producer keeps an output it was not told it is done with
DEFAULT_KEEP_S = 300.0
_FIX_TAKE = ("run the encoder and the reader on one node, of one mmshm release, with one "
             "MMSHM_DIR; report it as an mmshm bug if they are")
_CARD_LABEL = re.compile(r"reader card: node=(\d+) pid=(\d+)\Z")


class Wire(msgspec.Struct, array_like=True, frozen=True):
    """One handed-out output as it travels (after :data:`MAGIC`): the
    published ``name``, ``gen`` (its generation), ``dtype`` (a code of
    :data:`mmshm.segments.codec.DTYPES`), ``shape``, ``nbytes`` and the
    ``node`` id of the producer's segment directory. Owns one reference."""

    name: str
    gen: int
    dtype: int
    shape: tuple[int, ...]
    nbytes: int
    node: int

    def encode(self) -> bytes:
        return MAGIC + _ENC.encode(self)

    @classmethod
    def decode(cls, data) -> Wire:
        """The handle in ``data`` (bytes-like).

        Raises:
            HandleError: not a handle, or one whose fields do not agree (name,
                dtype, the size of the shape).
        """
        raw = bytes(data)
        if not raw.startswith(MAGIC):
            raise HandleError("not an encoder-output handle (no mmshm magic)")
        try:
            w = _DEC.decode(raw[len(MAGIC):])
        except msgspec.DecodeError as exc:
            raise HandleError(f"malformed encoder-output handle: {exc}") from None
        if not NAME_RE.match(w.name) or not 0 <= w.dtype < len(codec.DTYPES) \
                or codec.DTYPES[w.dtype] is None or any(d < 0 for d in w.shape):
            raise HandleError(f"malformed encoder-output handle {w!r}")
        if w.nbytes != codec.DTYPES[w.dtype].itemsize * math.prod(w.shape):
            raise HandleError(f"handle {w.name}: {w.nbytes} bytes do not make "
                              f"{codec.DTYPES[w.dtype]}{list(w.shape)}")
        return w

    @property
    def torch_dtype(self) -> torch.dtype:
        return codec.DTYPES[self.dtype]

    def ref(self, directory: str | None = None) -> SegmentRef:
        return SegmentRef(self.name, directory, self.gen)


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Wire)


def is_handle(frame) -> bool:
    """Whether ``frame`` (bytes-like, or a zmq frame) starts like a handle;
    reads its first bytes only."""
    buf = getattr(frame, "buffer", frame)
    try:
        return bytes(memoryview(buf)[:len(MAGIC)]) == MAGIC
    except TypeError:
        return False


class Published(NamedTuple):
    """An output :meth:`Handoff.publish` wrote: its store ``key``, published
    ``name`` and ``gen``, ``dtype``, ``shape``, ``nbytes``."""

    key: bytes
    name: str
    gen: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


class Handoff:
    """A producer's outputs handed out to readers (module docstring).

    Args:
        server: the ``server`` label of the metrics (``"sglang"``).
        directory: the segment directory (default ``MMSHM_DIR``).
        keep_s: seconds an output stays published after its publication if
            :meth:`done` is never called.
    """

    def __init__(self, server: str, directory: str | None = None,
                 keep_s: float = DEFAULT_KEEP_S):
        self.server = server
        self.directory = directory
        self.store = EncoderCache(directory, server=server, keep_s=keep_s)
        self._sent: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # obj -> Published

    def publish(self, tensor: torch.Tensor, label: str = "") -> Published | None:
        """Write ``tensor`` (any dtype and shape, CPU or not) once; None where
        it is not published (no room, over the budget: counted by reason; a
        dtype mmshm does not carry: not counted). Counts the save."""
        key = os.urandom(KEY_BYTES)
        try:
            res = self.store.save(key, tensor, label)
        except HandleError:
            return None  # a dtype or layout mmshm does not carry: the server's path
        if not res.published:
            return None
        with TABLE.lock:
            seg = TABLE.segments.get(res.name)
            gen = seg.gen if seg is not None else None
        if gen is None:  # evicted at once (space pressure): nothing to hand out
            self.store.evict(key)
            return None
        return Published(key, res.name, gen, tensor.dtype, tuple(tensor.shape),
                         res.nbytes)

    def handle(self, pub: Published) -> bytes:
        """An encoded :class:`Wire` for one reader, owning one reference
        added here (give it back with :func:`give_back` if it is not sent).

        Raises:
            SegmentNotFoundError: the output's segment is gone (someone
                removed it): the caller sends the bytes instead.
        """
        SegmentRef(pub.name, self.directory, pub.gen).add(1)
        return Wire(pub.name, pub.gen, codec.dtype_code(pub.dtype), pub.shape, pub.nbytes,
                    node.node_id(self.directory)).encode()

    def done(self, pub: Published) -> None:
        """The producer's own reference goes: the readers' keep the output."""
        self.store.evict(pub.key)

    def publish_once(self, obj, tensor: torch.Tensor, label: str = "") -> Published | None:
        """``tensor``, the output ``obj`` (the server's message object, weakly
        referenced) carries, published at its first call (:meth:`publish`)
        and the same :class:`Published` (or None) at every later one; the
        producer's reference goes at :meth:`finish` or, at the latest, when
        ``obj`` is collected."""
        if obj not in self._sent:
            pub = self.publish(tensor, label)
            self._sent[obj] = pub
            if pub is not None:
                weakref.finalize(obj, self.done, pub)
        return self._sent[obj]

    def wire_for(self, obj, tensor: torch.Tensor, label: str, cards: Cards, reader: str,
                 who: str, theirs: str, fix_unproven: str) -> bytes | None:
        """An encoded :class:`Wire` owning one reference for one send of
        ``obj``'s output ``tensor`` to the reader at endpoint ``reader``
        (published once: :meth:`publish_once`), or None: the send carries the
        server's own bytes. None, counted by reason, where the reader proved
        nothing in ``cards`` (``unproven``, said as "``who`` gets ``theirs``",
        with ``fix_unproven``) or the output's segment vanished
        (``segment_gone``); None where the store did not publish it (counted
        by the store). Never raises for these."""
        why = cards.check(reader)
        if why is not None:
            count(self.server, "unproven", f"{who} gets {theirs}, not a shared-memory handle: "
                  f"{why}", fix_unproven)
            return None
        pub = self.publish_once(obj, tensor, label)
        if pub is None:
            return None
        try:
            return self.handle(pub)
        except (MmshmError, OSError) as exc:  # the segment is gone: the server's bytes
            count(self.server, "segment_gone", f"an encoder output's segment vanished before "
                  f"its send ({exc}); {theirs} carry it",
                  "nothing may remove mmshm's segments while the encoder runs")
            return None

    def finish(self, obj) -> None:
        """``obj``'s last send is done: the producer's reference goes (the
        readers' keep the output). Nothing if it was never published."""
        pub = self._sent.pop(obj, None)
        if pub is not None:
            self.done(pub)

    def close(self) -> None:
        """Every output's producer reference goes (also run at exit)."""
        self.store.close()


def take(wire, dtype: torch.dtype | None, shape, server: str,
         directory: str | None = None) -> torch.Tensor:
    """The output a received handle names, as a zero-copy view holding a
    reference of its own (given back when the view is collected); the
    handle's reference is given back here, whatever happens.

    Args:
        wire: the encoded :class:`Wire` (bytes-like).
        dtype, shape: what the reader expects (the message's metadata; None:
            not checked).
        server: the ``server`` label of the load's metrics.
    Failures are counted by reason (``incompatible``, or the store's:
    ``segment_gone``, ``torn``), the first of each said at WARNING.

    Raises:
        HandleError: a malformed handle, or one of another dtype or shape
            (its reference given back where it could be read).
        WrongNodeError: a handle of another node (given back cannot be).
        EncoderCacheError: (an ``OSError``, with ``reason``) from
            :meth:`~mmshm.transport.encoder_cache.EntryHandle.load`: the
            segment is gone or unreadable.
    """
    try:
        w = Wire.decode(wire)
        if not node.is_local(w.node, directory):
            raise WrongNodeError(f"handle {w.name} names node {w.node}, this process is on "
                                 f"node {node.node_id(directory)} ({node.identity(directory)})")
    except HandleError as exc:
        count(server, "incompatible", f"a received handle cannot be used: {exc}", _FIX_TAKE)
        raise
    try:
        if (dtype is not None and w.torch_dtype != dtype) or (
                shape is not None and list(w.shape) != [int(x) for x in shape]):
            exc = HandleError(f"handle {w.name} is {w.torch_dtype}{list(w.shape)}, the "
                              f"message says {dtype}{list(shape) if shape is not None else None}")
            count(server, "incompatible", str(exc), _FIX_TAKE)
            raise exc
        h = EntryHandle(w.name, directory, w.gen, w.torch_dtype, tuple(w.shape), w.nbytes)
        return h.load(server)  # the view's own reference (a failure counted by the store)
    finally:
        w.ref(directory).release()


def take_noted(frame, dtype: torch.dtype | None, shape, server: str, what: str,
               directory: str | None = None) -> torch.Tensor:
    """:func:`take` of a received handle ``frame`` (a zmq frame or bytes),
    noted as taken in this thread's :meth:`Inbox.current` (its reference is
    the view's now, whatever happens). A handle that cannot be mapped raises
    :class:`~mmshm.errors.MaterializeError` naming ``what`` (the output), its
    ``reason`` that of the failure (counted by reason in :func:`take`), which
    a server turns into that one request's failure."""
    frame = getattr(frame, "buffer", frame)
    box = Inbox.current()
    if box is not None:
        box.took(frame)
    try:
        return take(frame, dtype, shape, server, directory)
    except (MmshmError, OSError) as exc:  # counted by reason in take
        raise MaterializeError(f"{what}: {exc}", reason=failure_reason(exc)) from exc


def encode_failure(msg, code) -> str | None:
    """The ``mmshm_epd_fallbacks_total`` reason of a request whose encode
    failed with HTTP status ``code`` (an int, or None: 500) and message
    ``msg``: ``encoder_error`` (the encoder rejected its input: 4xx but 408),
    ``encoder_gone`` (any other); None for a user's abort."""
    if msg == "Aborted by user":
        return None
    try:
        code = int(code) if code is not None else 500
    except (TypeError, ValueError):
        code = 500
    return "encoder_error" if 400 <= code < 500 and code != 408 else "encoder_gone"


def give_back(wire, directory: str | None = None) -> bool:
    """Give back the reference an unread handle owns; False when ``wire`` is
    no handle or its segment is gone. Never raises."""
    try:
        w = Wire.decode(wire)
    except HandleError:
        return False
    return w.ref(directory).release()


class Inbox:
    """The handles received in one scope (a receive call), for giving back
    those not taken by its end. ``with Inbox() as box:`` makes it this
    thread's :meth:`current`."""

    _tls = threading.local()

    def __init__(self, directory: str | None = None):
        self.directory = directory
        self._got: list[bytes] = []

    @classmethod
    def current(cls) -> Inbox | None:
        return getattr(cls._tls, "box", None)

    def saw(self, frame) -> None:
        """Note a received frame (a zmq frame or bytes): kept if it is a handle."""
        if is_handle(frame):
            self._got.append(bytes(getattr(frame, "buffer", frame)))

    def took(self, wire) -> None:
        """Note that ``wire`` was taken (its reference is the view's now)."""
        raw = bytes(getattr(wire, "buffer", wire))
        try:
            self._got.remove(raw)
        except ValueError:
            pass

    def close(self) -> int:
        """Give back every handle seen and not taken; returns how many."""
        got, self._got = self._got, []
        return sum(give_back(w, self.directory) for w in got)

    def __enter__(self) -> Inbox:
        self._prev = Inbox.current()
        Inbox._tls.box = self
        return self

    def __exit__(self, *exc) -> None:
        Inbox._tls.box = self._prev
        self.close()

    @classmethod
    def around(cls, instance, attr: str, call):
        """``call()`` with the handles that ``instance.<attr>`` (a zmq socket,
        its ``recv_multipart``'s second frame) receives noted in an inbox;
        those not taken in it are given back afterwards. ``instance.<attr>``
        is put back as it was; an absent socket: ``call()`` alone."""
        sock = getattr(instance, attr, None)
        if sock is None:
            return call()
        with cls() as box:
            setattr(instance, attr, _Noting(sock, box))
            try:
                return call()
            finally:
                if isinstance(getattr(instance, attr, None), _Noting):
                    setattr(instance, attr, sock)


class _Noting:
    """A zmq socket whose received handle frames are noted in an inbox."""

    def __init__(self, sock, box: Inbox):
        self._sock, self._box = sock, box

    def recv_multipart(self, *a, **kw):
        parts = self._sock.recv_multipart(*a, **kw)
        if len(parts) > 1:
            self._box.saw(parts[1])
        return parts

    def __getattr__(self, name):
        return getattr(self._sock, name)


def endpoint(host: str, port: int) -> str:
    """``host:port`` as a reader's receive endpoint is named (IPv6 bracketed,
    as SGLang's ``NetworkAddress.to_host_port_str``)."""
    host = str(host).strip("[]")
    return f"[{host}]:{int(port)}" if ":" in host else f"{host}:{int(port)}"


class Cards:
    """The handshake: readers' cards in the store, and a producer's checks.

    A reader calls :meth:`publish` with its receive endpoint (``host:port``
    as the producer addresses it) as it opens it; the card (no payload but
    its record: ``reader card: node=<id> pid=<pid>``) is published like an
    output (one ``mmshm_epd_saves_total`` per reader; each producer's check
    one ``mmshm_epd_lookups_total``) and held by this process until it exits
    (then given back, or reclaimed like any segment of a killed process). A producer calls
    :meth:`check` before it sends a handle to an endpoint.

    Args:
        server: the ``server`` label of the fallbacks counted.
        directory: the segment directory (default ``MMSHM_DIR``).
    """

    def __init__(self, server: str, directory: str | None = None):
        self.server = server
        self.directory = directory
        self._store = EncoderCache(directory, server=server, keep_s=math.inf)
        # its misses are readers without a card (counted as "unproven"), not
        # an instance that cannot meet its encoder: the store's warning is not ours
        self._store._meet_said = True
        self._seen: dict[str, tuple[str | None, float]] = {}

    @staticmethod
    def key(endpoint: str) -> bytes:
        return content_key({"endpoint": endpoint}, CARD_NAMESPACE)

    def publish(self, endpoint: str) -> bool:
        """Publish this process's card for ``endpoint``; False where it could
        not be (no room: the producers send their own bytes)."""
        label = f"reader card: node={node.node_id(self.directory)} pid={os.getpid()}"
        try:
            res = self._store.save(self.key(endpoint), torch.zeros(1, dtype=torch.uint8),
                                   label)
        except (MmshmError, OSError):
            return False
        return res.published

    def check(self, endpoint: str) -> str | None:
        """None: ``endpoint``'s reader proved it can open this process's
        segments; else why not (for the log). Cached :data:`CARD_TTL_S` s."""
        now = time.monotonic()
        seen = self._seen.get(endpoint)
        if seen is not None and seen[1] > now:
            return seen[0]
        why = self._look(endpoint)
        self._seen[endpoint] = (why, now + CARD_TTL_S)
        return why

    def _look(self, endpoint: str) -> str | None:
        try:
            entry = self._store.lookup(self.key(endpoint), count=False)
        except (MmshmError, OSError) as exc:
            return f"its card could not be read ({exc})"
        if entry is None:
            return ("it published no card in this segment directory (not under mmshm run, "
                    "or in another IPC/mount namespace or /dev/shm)")
        try:
            m = _CARD_LABEL.match(entry.label)
        finally:
            entry.release()
        here = node.node_id(self.directory)
        if m is None:
            return f"its card is not one this release reads ({entry.label!r})"
        if int(m.group(1)) != here:
            return (f"it is on node {m.group(1)}, this process on node {here} "
                    f"({node.identity(self.directory)}): another IPC or mount namespace")
        return None

    def withdraw(self, endpoint: str) -> bool:
        """Give back this process's card for ``endpoint`` (False: it had none)."""
        return self._store.evict(self.key(endpoint))

    def close(self) -> None:
        """Every card of this process given back (also run at exit)."""
        self._store.close()
        self._seen.clear()

    def forget(self, endpoint: str | None = None) -> None:
        """Drop what :meth:`check` cached (one endpoint, or all)."""
        if endpoint is None:
            self._seen.clear()
        else:
            self._seen.pop(endpoint, None)


def count(server: str, reason: str, detail: str, fix: str | None = None) -> None:
    """Count one ``mmshm_epd_fallbacks_total{server, reason}``; the first of
    each reason in this process said at WARNING with ``fix``
    (:func:`~mmshm.transport.encoder_cache.count_fallback`)."""
    count_fallback(server, reason, detail, fix)
