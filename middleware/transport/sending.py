"""The sending side of a hop, for every instrumentor: one message's
references, parallel sampling's shared segments, and what mmshm remembers of
a tensor.

A server's send path (SGLang's tokenizer, vLLM's frontend and its
scheduler-output broadcast) opens a :func:`sending` scope around the call
that serializes and sends one message; its glue, wherever the server meets a
tensor inside that call (a ``wrap_shm_features``, an out-of-band tensor hook,
a pickle reducer), asks the scope's :class:`Outbox` for a handle with
:meth:`Outbox.put`. Parallel sampling opens a :func:`fanning_out` scope (or
:func:`fanned_out` around an async generator) around the calls that send the
``n`` copies of one request, so that a tensor is written once per fan-out.

The ownership protocol, as applied here:

- **hand out before handing over**: each handle :meth:`Outbox.put` returns
  carries ``1 + hops`` references for the message (one per receiver: the
  next process, any process that forwards it, each reader of a broadcast);
  they are counted in ``mmshm_references_handed_total{path}``;
- the references **travel with the message** once it is sent
  (:meth:`Outbox.sent`: the local handle objects give up ownership), and are
  **given back** if sending fails (:meth:`Outbox.abandon`);
- a fan-out holds **one reference of its own** per tensor for its whole scope,
  so a receiver that releases an early copy (SGLang's warm-up) never frees the
  segment the later copies share; it is released when the scope ends;
- a tensor already known to live in a segment (written by this process, or a
  zero-copy view materialized from one) **shares that segment** instead of
  being copied again: :data:`SEGMENTS`, keyed by tensor identity and torch's
  version counter, checked against the segment's generation so a segment the
  pool has reused is never shared.

Content hashes: :func:`digest_of` gives the BLAKE3-128 digest of a feature
(the one a handle carries, or computed once per CPU tensor and remembered in
:data:`DIGESTS`), so a server's own hashing never re-reads pixels mmshm
already hashed; a new segment carries the digest already known for its tensor.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator

import torch

from mmshm import config
from mmshm.errors import MmshmError
from mmshm.metrics import FANOUT_COPIES, REFERENCES_HANDED
from mmshm.segments import codec
from mmshm.segments.codec import HandleMeta
from mmshm.segments.segfile import segment_dir
from mmshm.segments.segment import SegmentRef
from mmshm.segments.shmtensor import ShmTensor, content_hash
from mmshm.transport import wrapping

log = logging.getLogger("mmshm")


# -- what is remembered of a tensor ----------------------------------------------
class TensorMemo:
    """Values per tensor, keyed by identity; an entry is dropped when its
    tensor dies and ignored once the tensor is modified in place (torch's
    version counter). Never compares tensors, never keeps one alive.
    Thread-safe."""

    def __init__(self):
        self._d: dict[int, tuple] = {}
        self._lock = threading.Lock()

    def get(self, t, default=None):
        """The value for ``t`` (this very tensor, unmodified), or ``default``."""
        e = self._d.get(id(t))
        if e is None or e[0]() is not t or e[1] != t._version:
            return default
        return e[2]

    def __getitem__(self, t):
        missing = object()
        value = self.get(t, missing)
        if value is missing:
            raise KeyError("tensor not in the memo")
        return value

    def put(self, t, value) -> None:
        key = id(t)

        def gone(_ref, key=key, d=self._d):
            e = d.get(key)
            if e is not None and e[0] is _ref:
                d.pop(key, None)

        with self._lock:
            self._d[key] = (weakref.ref(t, gone), t._version, value)

    def drop(self, t) -> None:
        with self._lock:
            e = self._d.get(id(t))
            if e is not None and e[0]() is t:
                del self._d[id(t)]


#: tensor -> BLAKE3-128 digest of its bytes.
DIGESTS = TensorMemo()
#: tensor -> ``(wire bytes, HandleMeta, segment directory)`` of a live segment
#: holding exactly its bytes.
SEGMENTS = TensorMemo()


def remember_segment(t: torch.Tensor, meta: HandleMeta, wire: bytes | None = None,
                     directory: str | None = None) -> None:
    """Remember that the segment of the handle ``meta`` (wire bytes ``wire``,
    encoded here if not given) in ``directory`` (default ``MMSHM_DIR``, as
    it is now) holds ``t``'s bytes: ``t`` was copied into it, or is a
    zero-copy view of it."""
    SEGMENTS.put(t, (codec.encode(meta) if wire is None else wire, meta,
                     segment_dir(directory)))


def share_segment(t: torch.Tensor) -> ShmTensor | None:
    """A new handle, owning one more reference, on the live segment known to
    hold ``t``'s bytes, in the directory that segment lives in; None if there
    is none, or it was freed or reused by the pool meanwhile (the entry is
    then forgotten)."""
    entry = SEGMENTS.get(t)
    if entry is None:
        return None
    _wire, meta, directory = entry
    try:
        # the generation check refuses a segment the pool has since reused
        SegmentRef(meta.name, directory, meta.gen).add(1)
    except (MmshmError, OSError):
        SEGMENTS.drop(t)
        return None
    return ShmTensor(meta, owns=True, directory=directory)


def _flatten(xs):
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from _flatten(x)
        else:
            yield x


def digest_of(f) -> bytes | None:
    """BLAKE3-128 digest (16 bytes) of a feature: a handle (the hash it
    carries, computed from its segment if it carries none yet), a CPU tensor
    (computed once per tensor, see :data:`DIGESTS`), or a non-empty list or
    tuple of those, possibly nested and mixed (the digest of the elements'
    digests). None for anything else (a GPU tensor, a string...).

    Raises what :attr:`ShmTensor.hash` raises when a handle's segment
    cannot be read (``MMSHM_HASH=lazy``)."""
    import blake3

    if isinstance(f, ShmTensor):
        return f.hash
    if isinstance(f, torch.Tensor):
        if f.device.type != "cpu":
            return None
        d = DIGESTS.get(f)
        if d is None:
            d = content_hash(f)
            DIGESTS.put(f, d)
        return d
    if isinstance(f, (list, tuple)) and f:
        flat = list(_flatten(f))
        if not flat or not all(isinstance(x, (ShmTensor, torch.Tensor)) for x in flat):
            return None
        parts = [digest_of(x) for x in flat]
        if any(p is None for p in parts):
            return None
        return blake3.blake3(b"".join(parts)).digest(16)
    return None


def eligible(t, min_bytes: int | None = None) -> bool:
    """Whether ``t`` goes through shared memory: a strided CPU tensor of at
    least ``min_bytes`` bytes (default ``MMSHM_MIN_BYTES``), not quantized and
    not requiring grad (a handle carries neither)."""
    if min_bytes is None:
        min_bytes = config.get().min_bytes
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu"
            and t.layout == torch.strided and not t.is_quantized and not t.requires_grad
            and t.numel() * t.element_size() >= min_bytes)


# -- parallel sampling -----------------------------------------------------------
class FanOut:
    """One request fanned out to copies over the same segments (parallel
    sampling): the one fan-out concept of :func:`mmshm.fan_out`, of the
    instrumentors' scopes (:func:`fanning_out`, :func:`fanned_out`) and of
    the bench.

    A scope holds one reference of its own per tensor it put in shared
    memory, released by :meth:`close`. The segment therefore outlives any
    copy's receiver, and every later copy shares it through :data:`SEGMENTS`
    (the tensor is kept here too, so its memo entry lives as long as the
    scope).

    ``mmshm_fanout_copies_total`` counts the copies of a fanned-out request
    that share its segments, each once, the first included
    (:meth:`count_copies`). A request is fanned out when it is known to be:
    at once for :func:`mmshm.fan_out` (the caller asks for ``n`` copies,
    ``n`` counted), from its second message carrying handles for a scope (2,
    then 1 per further message; a scope that sends one message fanned out
    nothing: vLLM opens one around every request).

    Args:
        declared: the caller asks for the copies (:func:`mmshm.fan_out`):
            every copy counts, the first included, even if it is the only one.
    """

    __slots__ = ("closed", "copies", "counted", "declared", "held")

    def __init__(self, declared: bool = False):
        self.held: dict[int, tuple[torch.Tensor, ShmTensor]] = {}
        self.copies = 0
        self.counted = 0
        self.declared = declared
        self.closed = False

    def hold(self, t: torch.Tensor, h: ShmTensor) -> None:
        """Keep one reference on ``h``'s segment for ``t`` (once per tensor)."""
        if id(t) in self.held:
            return
        try:
            self.held[id(t)] = (t, h.clone())
        except (MmshmError, OSError):  # gone already: later copies write it again
            pass

    def count_copies(self, k: int = 1) -> None:
        """``k`` more copies of the request left (a message sent with
        handles, or ``n`` copies made at once), counted in
        ``mmshm_fanout_copies_total`` once the request is fanned out (see
        the class docstring)."""
        self.copies += k
        due = self.copies if self.declared or self.copies >= 2 else 0
        if due > self.counted:
            FANOUT_COPIES.inc(due - self.counted)
            self.counted = due

    def close(self) -> None:
        """Release the scope's references. Idempotent."""
        self.closed = True
        held, self.held = self.held, {}
        for _t, h in held.values():
            h.release()


_FANOUT: contextvars.ContextVar[FanOut | None] = contextvars.ContextVar(
    "mmshm_fanout", default=None)


def current_fan_out() -> FanOut | None:
    """The open :class:`FanOut` of this context, or None."""
    fan = _FANOUT.get()
    return fan if fan is not None and not fan.closed else None


@contextlib.contextmanager
def fanning_out() -> Iterator[FanOut]:
    """A :class:`FanOut` for the sends inside the block (the open one, if
    the block is inside one already), closed when the block ends."""
    fan = current_fan_out()
    if fan is not None:
        yield fan
        return
    fan = FanOut()
    token = _FANOUT.set(fan)
    try:
        yield fan
    finally:
        _FANOUT.reset(token)
        fan.close()


async def fanned_out(agen) -> AsyncIterator:
    """``agen`` (an async generator) with one :class:`FanOut` for its whole
    life: visible to it whenever it runs (set and reset around each step, in
    the caller's context), closed when it ends, fails or is closed."""
    fan = FanOut()
    try:
        while True:
            token = _FANOUT.set(fan)
            try:
                item = await agen.__anext__()
            except StopAsyncIteration:
                return
            finally:
                _FANOUT.reset(token)
            yield item
    finally:
        try:
            await agen.aclose()
        finally:
            fan.close()


# -- one message -----------------------------------------------------------------
class Outbox:
    """The handles made for one message.

    Args:
        hops: references to add per handle beyond the first: one per further
            receiver (a forwarding process, the other readers of a
            broadcast).
        path: the ``path`` label of ``mmshm_references_handed_total``
            (``"send"`` or ``"broadcast"``).
    """

    __slots__ = ("fan", "handles", "hops", "path", "prepared", "t0", "written")

    def __init__(self, hops: int = 0, path: str = "send"):
        if hops < 0:
            raise ValueError("hops must be >= 0")
        self.hops = hops
        self.path = path
        self.handles: list[ShmTensor] = []
        #: handles :meth:`prepare` made, by tensor id: ``(tensor, version, handle)``
        self.prepared: dict[int, tuple[torch.Tensor, int, ShmTensor | None]] = {}
        self.fan = current_fan_out()
        #: When the message began to be sent (``time.monotonic()``, seconds).
        self.t0 = time.monotonic()
        #: Bytes copied into segments for this message (shared ones: none).
        self.written = 0

    def prepare(self, tensors, hash_now=None) -> int:
        """Write the tensors this message is about to :meth:`put` into **one**
        segment (:func:`mmshm.transport.wrapping.to_shm_group`): a request's
        photos take one pooled segment, which each TP rank maps (and, on a
        GPU host, registers) once, instead of one per photo. A tensor that a
        live segment already holds (:data:`SEGMENTS`: this fan-out, an
        earlier message) or that was prepared already is left out (it is
        shared, not written again); fewer than two left: nothing is done
        (each :meth:`put` writes its own as before). The handles wait here
        for :meth:`put` of the same tensor (unmodified); one never put is
        given back when the message is sent or abandoned.

        Args:
            tensors: the message's eligible tensors (:func:`eligible`), in
                the order they will be put; the same one may appear twice.
            hash_now: None, or one ``hash_now`` (as for :meth:`put`) per tensor.
        Returns:
            How many tensors were written into the shared segment (or their
            own, where it did not fit). Never raises for a segment that
            cannot be made (the tensors then travel as :meth:`put` sends them).
        """
        tensors = list(tensors)
        nows = list(hash_now) if isinstance(hash_now, (list, tuple)) else [hash_now] * len(tensors)
        todo: list[torch.Tensor] = []
        todo_now: list[bool | None] = []
        seen: set[int] = set()
        for t, now in zip(tensors, nows):
            if id(t) in seen or id(t) in self.prepared or SEGMENTS.get(t) is not None:
                continue
            seen.add(id(t))
            todo.append(t)
            todo_now.append(now)
        if len(todo) < 2:
            return 0
        # looked up per call: tests spy it
        hs = wrapping.to_shm_group(todo, [DIGESTS.get(t) for t in todo], hash_now=todo_now)
        done = 0
        for t, h in zip(todo, hs):
            # None: it travels inline, its fallback counted there: :meth:`put`
            # must not try (and count) it again
            self.prepared[id(t)] = (t, t._version, h)
            done += h is not None
        return done

    def prepare_tree(self, obj, hash_now=None, min_bytes: int | None = None,
                     leaves: tuple[type, ...] = ()) -> int:
        """:meth:`prepare` for every eligible tensor (:func:`eligible`) found
        in ``obj`` (a request, or its multimodal items: walked as
        :func:`mmshm.transport.wrapping.transform` walks it, never changed),
        in the order they are met. Both servers hand a request's images as
        views of one tensor (SGLang 0.5.23's ``get_new_expanded_mm_items``
        slices a bundled ``pixel_values`` per image; vLLM 0.32/0.33's
        ``MultiModalFlatField.build_elems`` slices the batch per item), which
        the server then puts one by one: prepared here, they take one segment.

        Args:
            obj: any structure of containers and tensors.
            hash_now: None, a bool for every tensor, or a callable that tells
                it for one tensor (as for :meth:`put`).
            min_bytes: as for :func:`eligible` (default ``MMSHM_MIN_BYTES``).
            leaves: types taken whole, never walked into or prepared (an
                integration's opaque types, e.g. SGLang's CUDA-IPC proxies).
        Returns:
            How many tensors were written. Never raises: a structure that
            cannot be walked is sent as before, one segment per tensor (said
            at DEBUG)."""
        found: list = []

        def collect(x):
            if not (leaves and isinstance(x, leaves)) and eligible(x, min_bytes):
                found.append(x)
            return x

        try:
            wrapping.transform(obj, collect, leaves=leaves)
            nows = [hash_now(t) for t in found] if callable(hash_now) else hash_now
            return self.prepare(found, nows)
        except Exception as exc:  # noqa: BLE001 - the send goes on tensor by tensor
            log.debug("mmshm: the message's tensors were not grouped: %s", exc)
            return 0

    def _take_prepared(self, t: torch.Tensor):
        """What :meth:`prepare` decided for ``t``: its handle; None where it
        travels inline (its fallback already counted); :data:`_NOT_PREPARED`
        where nothing was prepared for it, or ``t`` changed since."""
        entry = self.prepared.pop(id(t), None)
        if entry is None:
            return _NOT_PREPARED
        if entry[0] is not t or entry[1] != t._version:  # changed since: written anew
            if entry[2] is not None:
                entry[2].release()
            return _NOT_PREPARED
        return entry[2]

    def _drop_prepared(self) -> None:
        prepared, self.prepared = self.prepared, {}
        for _t, _v, h in prepared.values():
            if h is not None:
                h.release()

    def put(self, t: torch.Tensor, hash_now: bool | None = None) -> ShmTensor | None:
        """A handle that rides in this message for ``t``'s bytes, owning
        ``1 + hops`` references; None when ``t`` must travel inline (the
        fallback is counted in ``mmshm_inline_fallbacks_total``).

        ``hash_now=True``: a new segment's handle carries its BLAKE3 hash,
        computed in the copy's pass (for a caller that reads :attr:`hash`
        next); None: ``MMSHM_HASH`` decides (see
        :meth:`~mmshm.ShmTensor.from_tensor`). A shared segment's handle
        carries what its first handle carried.

        No bytes are copied when a live segment already holds them (the
        same tensor, unmodified, earlier in this message, in this fan-out or
        in an earlier message: :data:`SEGMENTS`). Eligibility (:func:`eligible`) is the caller's to
        judge. Never raises for a segment that cannot be made or shared."""
        h = self._take_prepared(t)  # written with the message's other tensors
        if h is None:  # prepare found no room for it: inline, counted there
            return None
        if h is not _NOT_PREPARED:
            self.written += h.nbytes
            if hash_now and h.meta.hash:
                DIGESTS.put(t, h.meta.hash)
            remember_segment(t, h.meta, directory=h.directory)
        else:
            h = share_segment(t)  # earlier in this message, in this fan-out, or before
        if h is None:
            # looked up per call: tests spy it
            h = wrapping.to_shm(t, hash=DIGESTS.get(t), hash_now=hash_now)
            if h is None:
                return None
            self.written += h.nbytes
            if hash_now and h.meta.hash:
                DIGESTS.put(t, h.meta.hash)
            remember_segment(t, h.meta, directory=h.directory)
        if self.fan is not None:
            self.fan.hold(t, h)
        if self.hops:
            try:
                h.share(self.hops)
            except (MmshmError, OSError) as exc:
                h.release()
                wrapping.record_fallback(exc)
                return None
        self.handles.append(h)
        REFERENCES_HANDED.labels(path=self.path).inc(1 + self.hops)
        return h

    def sent(self) -> None:
        """The message left: its references travel with it (the handle
        objects, kept alive until now so no finalizer released them, give up
        ownership). Counts one copy of the open fan-out if it carried any."""
        self._drop_prepared()
        handles, self.handles = self.handles, []
        for h in handles:
            h.disown()
        if handles and self.fan is not None and not self.fan.closed:
            self.fan.count_copies()

    def abandon(self) -> None:
        """The message never left: give back every reference made for it."""
        self._drop_prepared()
        handles, self.handles = self.handles, []
        for h in handles:
            if h.owns_reference:
                h.ref.release(self.hops)
            h.release()


#: :meth:`Outbox._take_prepared`: nothing was prepared for the tensor
_NOT_PREPARED = object()

_OUTBOX: contextvars.ContextVar[Outbox | None] = contextvars.ContextVar(
    "mmshm_outbox", default=None)


def current_outbox() -> Outbox | None:
    """The :class:`Outbox` of the :func:`sending` scope this code runs in, or None."""
    return _OUTBOX.get()


@contextlib.contextmanager
def sending(hops: int = 0, path: str = "send") -> Iterator[Outbox]:
    """An :class:`Outbox` for the one message sent inside the block, current
    for the code the block runs (this thread or task only): sent when the
    block returns, abandoned when it raises (anything, cancellation too)."""
    box = Outbox(hops, path)
    token = _OUTBOX.set(box)
    try:
        yield box
    except BaseException:
        box.abandon()
        raise
    finally:
        _OUTBOX.reset(token)
    box.sent()


@contextlib.contextmanager
def not_sending() -> Iterator[None]:
    """No :class:`Outbox` inside the block (a nested send that must not put
    its tensors into the enclosing message)."""
    token = _OUTBOX.set(None)
    try:
        yield
    finally:
        _OUTBOX.reset(token)


__all__ = [
    "DIGESTS",
    "SEGMENTS",
    "FanOut",
    "Outbox",
    "TensorMemo",
    "current_fan_out",
    "current_outbox",
    "digest_of",
    "eligible",
    "fanned_out",
    "fanning_out",
    "not_sending",
    "remember_segment",
    "share_segment",
    "sending",
]
