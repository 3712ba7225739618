"""The server-neutral half of an EC connector (EPD) on
:mod:`mmshm.transport.encoder_cache`: what a connector counts, the entries
a consumer's scheduler holds for its requests, and a worker's loads and
saves. A server's connector (vLLM's ``MmshmECConnector``,
:mod:`mmshm.integrations.vllm.epd`) keeps only its glue: reading the
server's request objects and calling these with ids, indices and keys.

**Counts** (:class:`Counts`): the connector's own numbers (:data:`STAT_KEYS`
and ``fallback_<reason>``), summed per step and reported through the
server's own stats; every fallback also counts
``mmshm_epd_fallbacks_total{server, reason}``
(:func:`~mmshm.transport.encoder_cache.count_fallback`, the first of each
reason said at WARNING).

**A consumer's held entries** (:class:`Holdings`): the scheduler looks each
item of a request up once (a request item is ``(request id, index)``; an
item's server name is its ``ident``), holds the entry it finds (one
reference, its holder the request) until the item's input is freed or the
request finishes, answers "is it held" only from an entry still intact on
disk (:meth:`~mmshm.transport.encoder_cache.Entry.intact`), and remembers
the requests a worker could not load for (the server fails each one) and
the items it may hold zeros for.

**Across nodes** (a Mooncake Store, :mod:`mmshm.transport.ec_store`): a
consumer whose own node has no entry for an item asks the Store on a reader
thread (:class:`StoreFetches`) and the server defers the request (it is
"still in transit": :data:`PENDING`) until the object is published in this
node's shared memory, where it is held and loaded as any local entry, or the
fetch missed (counted ``store_<reason>``) and the item is encoded here; a
producer's worker also puts each output it publishes into the Store
(:func:`save`, from the published entry's bytes).

**A worker** (:func:`load`, :func:`save`): each load maps the entry
zero-copy (copied to a device by :func:`mmshm.segments.arena.to_device`); a
load that fails is never raised: its slot gets zeros of the output's shape
and dtype, and the request is reported for the server to fail.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque

import torch

from mmshm.errors import MmshmError
from mmshm.metrics import EPD_FALLBACKS
from mmshm.segments import arena
from mmshm.transport.encoder_cache import EncoderCache, EncoderCacheError, count_fallback

#: :meth:`Holdings.look`'s answer for an item whose Store fetch is in flight:
#: the server defers the request and asks again at a later step
PENDING = object()

log = logging.getLogger("mmshm")

#: a connector's counts (summed over workers and steps): ``loads``/
#: ``loaded_bytes``/``load_failed`` (worker), ``saves``/``saved_bytes``
#: (worker), ``hits`` (scheduler), ``transfer_seconds`` (worker, summed),
#: ``hashed_bytes``/``hash_seconds`` (bytes the scheduler hashed itself for
#: a key, and the seconds it took); ``fallback_<reason>`` besides
STAT_KEYS = ("hits", "loads", "loaded_bytes", "load_failed", "saves", "saved_bytes",
             "transfer_seconds", "hashed_bytes", "hash_seconds")
#: how many item names a consumer remembers as failed (a bounded map)
MAX_REMEMBERED = 4096
#: the most Store fetches the reader makes in one scattered get, and the
#: most bytes they are expected to hold (a batch is bounded by one
#: ``store_timeout_s``: 64 MiB need 32 MB/s at the default 2 s)
MAX_BATCH = 64
MAX_BATCH_BYTES = 64 << 20
#: the fix said with a held entry or a load lost to something outside mmshm
FIX_OUTSIDE = ("keep tmpfs cleaners, systemd's RemoveIPC=yes and operators off mmshm-* "
               "files in {}")


def new_counts() -> dict:
    """A zero of each of :data:`STAT_KEYS`."""
    return dict.fromkeys(STAT_KEYS, 0)


def add_counts(into: dict, more: dict) -> dict:
    """``more`` added into ``into`` key by key (returned)."""
    for k, v in more.items():
        into[k] = into.get(k, 0) + v
    return into


def reduce_counts(data: dict) -> dict:
    """The non-zero counts, sorted by name, floats rounded to 6 digits."""
    return {k: (round(v, 6) if isinstance(v, float) else v)
            for k, v in sorted(data.items()) if v}


class Counts(dict):
    """A connector's counts since its last report (:data:`STAT_KEYS`, then
    ``fallback_<reason>``) for the ``server`` label."""

    def __init__(self, server: str):
        super().__init__(new_counts())
        self.server = server

    def fallback(self, reason: str, detail: str | None = None, fix: str | None = None) -> None:
        """Count ``fallback_<reason>``; with ``detail`` also one
        ``mmshm_epd_fallbacks_total{server, reason}`` (said at WARNING the
        first time, with ``fix``)."""
        self["fallback_" + reason] = self.get("fallback_" + reason, 0) + 1
        if detail is not None:
            count_fallback(self.server, reason, detail, fix)

    def take(self) -> dict:
        """The counts as a plain dict; zero again."""
        out = dict(self)
        self.clear()
        self.update(new_counts())
        return out


class _Fetch:
    __slots__ = ("deadline", "done_at", "dtype", "key", "reason", "readers", "rows", "shape",
                 "state")

    def __init__(self, key: bytes, dtype, rows, shape, deadline: float):
        self.key, self.dtype, self.rows, self.shape = key, dtype, rows, shape
        self.deadline = deadline
        self.state = "queued"  # -> "running" -> "done"
        self.reason = ""       # done: "" (published in this node's segments) or why not
        self.done_at = 0.0
        self.readers = 0       # requests that took its outcome (the first one's miss is counted)


def _expected_bytes(f: _Fetch) -> int:
    """The payload bytes ``f`` expects (0 when its width or dtype is not known)."""
    width = f.shape[1] if f.shape and len(f.shape) > 1 else None
    if not (f.rows and width and f.dtype is not None):
        return 0
    return int(f.rows) * int(width) * f.dtype.itemsize


class StoreFetches:
    """A consumer's Store fetches (:func:`mmshm.transport.ec_store.fetch_local_many`)
    on one reader thread, one fetch per content key at a time, so that the
    server's scheduling loop never waits on the network: it only reads a
    fetch's state (:meth:`ask`, then :meth:`outcome` at each step). The
    reader takes every fetch queued when it wakes (at most :data:`MAX_BATCH`
    and :data:`MAX_BATCH_BYTES`) as one batch, read in one scattered get; the items a
    scheduler asks for within :meth:`gather` (one request's) wake it once.

    Bounds: a fetch not started within ``store_timeout_s`` of being asked
    is never made (a miss, ``store_timeout``, counted once); one started
    returns within ``store_timeout_s`` (the tier's own bound). A request
    therefore waits at most twice ``store_timeout_s``. A request keeps its
    fetch until it took the outcome; for other requests of the same key an
    outcome is reused for ``store_timeout_s`` (a miss is not asked again at
    once); at most :data:`MAX_REMEMBERED` keys are remembered.

    Args:
        cache: the consumer's :class:`~mmshm.transport.encoder_cache.EncoderCache`
            (the fetched object is published there).
        tier: its :class:`~mmshm.transport.ec_store.StoreTier`.
    """

    def __init__(self, cache: EncoderCache, tier):
        self.cache, self.tier = cache, tier
        self.timeout_s = float(tier.config.timeout_s)
        self._lock = threading.Condition()
        self._queue: deque[_Fetch] = deque()
        self._by_key: OrderedDict[bytes, _Fetch] = OrderedDict()
        self._closed = False
        self._gathering = 0  # > 0: asks queue without waking the reader (gather)
        self._thread: threading.Thread | None = None

    def ask(self, key: bytes, dtype, rows, shape) -> _Fetch:
        """The fetch of ``key``: the one in flight or recently done, else a
        new one queued for the reader thread."""
        now = time.monotonic()
        with self._lock:
            f = self._by_key.get(key)
            if f is not None and f.state == "done" and now - f.done_at > self.timeout_s:
                f = None
            if f is None:
                f = _Fetch(key, dtype, rows, shape, now + self.timeout_s)
                if self._closed:
                    self._done(f, "store_closed")
                    return f
                self._by_key[key] = f
                self._by_key.move_to_end(key)
                while len(self._by_key) > MAX_REMEMBERED:
                    self._by_key.popitem(last=False)
                self._queue.append(f)
                self._start()
                if not self._gathering:
                    self._lock.notify_all()
            return f

    def outcome(self, f: _Fetch) -> str | None:
        """None while ``f`` is in flight, else ``""`` (published in this
        node's segments: look it up there) or why it missed
        (``store_<reason>``, or the local cache's refusal)."""
        with self._lock:
            if f.state == "queued" and time.monotonic() > f.deadline:
                self._expire(f)
            return f.reason if f.state == "done" else None

    def _expire(self, f: _Fetch) -> None:
        """``f`` not started by its deadline: never made, counted here (lock held)."""
        self._done(f, "store_timeout")
        count_fallback(self.tier.server, "store_timeout",
                       f"the Store fetch of {f.key.hex()[:16]} did not start within "
                       f"store_timeout_s={self.timeout_s} s (earlier fetches queued)")

    def _done(self, f: _Fetch, reason: str) -> None:
        f.state, f.reason, f.done_at = "done", reason, time.monotonic()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mmshm-ec-store-fetch",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        from mmshm.transport.ec_store import fetch_local_many

        while True:
            with self._lock:
                while (not self._queue or self._gathering) and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                batch, nbytes = [], 0
                while self._queue and len(batch) < MAX_BATCH and nbytes < MAX_BATCH_BYTES:
                    f = self._queue.popleft()
                    if f.state != "queued":
                        continue
                    if time.monotonic() > f.deadline:  # nobody looked since: never started
                        self._expire(f)
                        continue
                    f.state = "running"
                    batch.append(f)
                    nbytes += _expected_bytes(f)
            if not batch:
                continue
            try:
                reasons = fetch_local_many(self.cache, self.tier,
                                           [(f.key, f.dtype, f.rows, f.shape) for f in batch])
            except Exception as exc:  # noqa: BLE001 - a fetch never takes the thread down
                log.warning("mmshm: a Store fetch failed: %s", exc)
                reasons = ["store_short"] * len(batch)
            with self._lock:
                for f, reason in zip(batch, reasons):
                    self._done(f, reason)

    @contextlib.contextmanager
    def gather(self):
        """Within it, :meth:`ask` queues without waking the reader; on exit
        the reader takes every fetch queued meanwhile as one batch (one
        scattered get: a request's items are asked in one scheduler pass)."""
        with self._lock:
            self._gathering += 1
        try:
            yield self
        finally:
            with self._lock:
                self._gathering -= 1
                if not self._gathering:
                    self._lock.notify_all()

    def close(self) -> None:
        """Stop the reader (a fetch in flight ends within ``store_timeout_s``)."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._lock.notify_all()


class Holdings:
    """A consumer scheduler's held entries (module docstring).

    Args:
        store: the consumer's :class:`~mmshm.transport.encoder_cache.EncoderCache`.
        counts: where hits and misses are counted.
        tier: the Store leg (:class:`~mmshm.transport.ec_store.StoreTier`),
            asked on a local miss, or None (within the node only).
    """

    def __init__(self, store: EncoderCache, counts: Counts, tier=None):
        self.store, self.counts = store, counts
        self.fetches = StoreFetches(store, tier) if tier is not None else None
        self.held: dict[tuple[str, int], object] = {}   # (req id, index) -> Entry
        self.by_id: dict[str, tuple[str, int]] = {}     # item name -> (req id, index)
        self.looked: dict[str, set[int]] = {}           # req id -> items looked up (once)
        self.missed: dict[str, dict[str, str]] = {}     # req id -> item name -> why it missed
        self.held_of: dict[str, set[int]] = {}          # req id -> items it holds
        self.name_of: dict[tuple[str, int], str] = {}   # (req id, index) held -> item name
        self.unavailable: set[str] = set()              # failed in a worker: the server fails them
        self.poisoned: OrderedDict[str, str] = OrderedDict()  # item name -> request
        self.waiting: dict[tuple[str, int], _Fetch] = {}  # (req id, index) -> its Store fetch
        self.counted: set[tuple[str, str]] = set()      # (req id, item) whose miss's metric is in

    def fails(self, rid: str, pending: list[str]) -> bool:
        """Whether request ``rid`` needs an item (``pending``: the names of
        those not yet computed) the server may hold zeros for: then it is
        unavailable (failed) and True."""
        if self.poisoned and any(ident in self.poisoned for ident in pending):
            self.unavailable.add(rid)
            return True
        return False

    def looking(self):
        """A context for one request's :meth:`look` calls: the Store
        fetches they ask for start together, as one batch
        (:meth:`StoreFetches.gather`)."""
        return self.fetches.gather() if self.fetches is not None else contextlib.nullcontext()

    def look(self, rid: str, index: int, ident: str, key: bytes | None, *, rows: int,
             dtype: torch.dtype | None, width: int | None):
        """Look item ``index`` of ``rid`` up once: the store's entry of
        ``key`` of ``dtype``, ``rows`` rows and ``width`` columns (None:
        any), held for the request; None if not looked up now (no key,
        looked up already, another request holds the item) or a miss;
        :data:`PENDING` while the item's Store fetch is in flight (the
        server defers the request and looks again at a later step)."""
        looked = self.looked.setdefault(rid, set())
        if key is None or index in looked or self.by_id.get(ident) is not None:
            return None
        shape = (rows, width or None)
        fetch = self.waiting.get((rid, index))
        if fetch is None:
            entry, reason, _ = self._lookup(rid, key, dtype, rows, shape)
            if entry is None and reason == "missing" and self.fetches is not None:
                fetch = self.waiting[(rid, index)] = self.fetches.ask(key, dtype, rows, shape)
        if fetch is not None:
            reason = self.fetches.outcome(fetch)
            if reason is None:
                return PENDING
            del self.waiting[(rid, index)]
            fetch.readers += 1
            entry = None
            if not reason:  # published here by the fetch: held from here
                entry, reason, _ = self._lookup(rid, key, dtype, rows, shape)
            elif fetch.readers == 1:  # the fetch (the tier, the cache) counted its metric
                self.counted.add((rid, ident))
        looked.add(index)
        if entry is None:
            self.missed.setdefault(rid, {})[ident] = reason
        else:
            self.held[(rid, index)] = entry
            self.held_of.setdefault(rid, set()).add(index)
            self.by_id[ident] = (rid, index)
            self.name_of[(rid, index)] = ident
            log.debug("mmshm: EC hit %s (request %s item %d) -> %s", ident, rid, index,
                      entry.name)
        return entry

    def _lookup(self, rid: str, key: bytes, dtype, rows: int, shape: tuple):
        # the payload's digest is checked where the bytes are used (each
        # worker's load); here the name, record, generation and a reference
        return self.store.lookup_why(key, dtype=dtype, rows=rows, count=False, shape=shape,
                                     holder=f"request {rid}", verify=False)

    def has(self, ident: str) -> bool:
        """Whether an intact entry of item ``ident`` is held (the server asks
        only for items it no longer holds: they are not poisoned any more).
        One that is not intact is let go, counted ``segment_gone``."""
        self.poisoned.pop(ident, None)
        owner = self.by_id.get(ident)
        if owner is None:
            return False
        entry = self.held[owner]
        if entry.intact():
            return True
        self.release(*owner)
        self.counts.fallback("segment_gone",
                             f"the held encoder output {entry.name} of item {ident} was "
                             f"removed or truncated in the segment directory by something "
                             f"outside mmshm: the item is encoded here",
                             FIX_OUTSIDE.format("MMSHM_DIR"))
        return False

    def hit(self, ident: str):
        """The handle of item ``ident``'s held entry, counted as a hit; None
        if it is not held."""
        owner = self.by_id.get(ident)
        if owner is None:
            return None
        self.counts["hits"] += 1
        return self.held[owner].handle()

    def miss(self, rid: str, ident: str, key: bytes | None, rows: int) -> None:
        """Item ``ident`` of ``rid`` is encoded here: counted by why its
        lookup for this request missed (an entry published since is not
        taken: the local encode is decided); an item this request did not
        look up (or held, then let go) is looked up once more, counting
        nothing, for the reason."""
        if key is None:
            return  # counted as unkeyed
        reason = self.missed.get(rid, {}).pop(ident, None)
        if reason is None:  # not looked up by this request: look now, counting nothing
            found, reason, _ = self.store._search(key, None, rows, hold=False, verify=False)
            if found is not None:
                found.release()
        if (rid, ident) in self.counted:  # the fetch counted the metric and said why
            self.counted.discard((rid, ident))
            self.counts.fallback(reason)
            return
        if reason and reason.startswith("store_"):  # another request's fetch: counted here
            self.counts.fallback(reason)
            EPD_FALLBACKS.labels(server=self.counts.server, reason=reason).inc()
            return
        self.counts.fallback(reason or "missing",
                             f"item {ident} of request {rid} is encoded here: no loadable "
                             f"encoder output of its content (namespace "
                             f"'{self.store.namespace}')")

    def release(self, rid: str, index: int) -> None:
        """Give back the entry held for item ``index`` of ``rid`` (if any)."""
        entry = self.held.pop((rid, index), None)
        if entry is None:
            return
        self.held_of.get(rid, set()).discard(index)
        ident = self.name_of.pop((rid, index), None)
        if ident is not None and self.by_id.get(ident) == (rid, index):
            del self.by_id[ident]
        entry.release()

    def free(self, rid: str, index: int) -> None:
        """Item ``index`` of ``rid`` is done: given back, looked up afresh next time."""
        self.release(rid, index)
        self.looked.get(rid, set()).discard(index)

    def finish(self, rid: str) -> None:
        """Request ``rid`` finished: every entry it held given back."""
        for i in list(self.held_of.pop(rid, ())):
            self.release(rid, i)
        self.looked.pop(rid, None)
        self.missed.pop(rid, None)
        if self.waiting:
            self.waiting = {w: f for w, f in self.waiting.items() if w[0] != rid}
        if self.counted:
            self.counted = {c for c in self.counted if c[0] != rid}

    def failed(self, failed: dict) -> None:
        """``{request id: item name}`` a worker could not load: each request
        unavailable, each item poisoned (the server may hold zeros for it)."""
        for rid, ident in failed.items():
            self.unavailable.add(rid)
            self.poisoned[ident] = rid
            self.poisoned.move_to_end(ident)
            while len(self.poisoned) > MAX_REMEMBERED:
                self.poisoned.popitem(last=False)

    def take_unavailable(self) -> set[str]:
        """The unavailable requests since the last call."""
        out, self.unavailable = self.unavailable, set()
        return out

    def close(self) -> None:
        """Every held entry given back; the Store's reader stopped."""
        if self.fetches is not None:
            self.fetches.close()
        for key in list(self.held):
            self.release(*key)


def open_tier(extra: dict, server: str, keep_s: float | None = None):
    """The Store leg that ``extra`` (``ec_connector_extra_config``) names,
    started (:func:`mmshm.transport.ec_store.from_config`; a producer's
    objects removed ``keep_s`` seconds after their put), or None: no
    master named, the engine missing (said there), or a setting that is not
    valid (said here at WARNING with the key: the connector then works
    within the node, as a bad ``MMSHM_*`` value never stops the server)."""
    from mmshm.transport import ec_store

    try:
        return ec_store.from_config(extra, server=server, keep_s=keep_s)
    except (ec_store.StoreConfigError, TypeError, ValueError, OverflowError) as exc:
        log.warning("mmshm: encoder cache (%s): the Mooncake Store leg is off: %s; encoder "
                    "outputs move within this node only. Fix the setting in "
                    "ec_connector_extra_config (docs/epd-nodes.md)", server, exc)
        return None


def save(store: EncoderCache, key: bytes, tensor: torch.Tensor, label: str,
         counts: Counts, tier=None):
    """Publish ``tensor`` (any dtype and shape) under ``key``; a publish
    counts ``saves``, ``saved_bytes`` and ``transfer_seconds``, a refusal
    ``fallback_<reason>`` (the store counted its metric). With ``tier``
    (:class:`~mmshm.transport.ec_store.StoreTier`), an output written now
    is also queued for the Store, from the published entry's bytes (held
    until the put is over): what other nodes get is what this node serves.
    Returns the :class:`~mmshm.transport.encoder_cache.SaveResult`."""
    t0 = time.perf_counter()
    res = store.save(key, tensor, label=label)
    if res.published and res.nbytes:
        counts["saves"] += 1
        counts["saved_bytes"] += res.nbytes
        counts["transfer_seconds"] += time.perf_counter() - t0
        log.debug("mmshm: EC save %s -> %s (%d bytes)", label, res.name, res.nbytes)
        if tier is not None:
            put(store, tier, key, label)
    elif res.published and tier is not None and not tier.touch(key):
        put(store, tier, key, label)  # kept here again: in the Store again, for as long
    elif not res.published and res.reason:
        counts.fallback(res.reason)
    return res


def put(store: EncoderCache, tier, key: bytes, label: str) -> bool:
    """Queue this node's published entry of ``key`` for the Store
    (:meth:`~mmshm.transport.ec_store.StoreTier.put`), held until the put
    is over. False (nothing queued) when the entry is gone already or the
    tier refused it (the tier counted why)."""
    # held without counting a lookup: the producer reads its own entry
    entry = store._search(key, None, None, verify=False, holder="Mooncake Store put")[0]
    if entry is None:
        log.debug("mmshm: EC output %s gone before its Store put", label)
        return False
    try:
        view = entry.load(store.server, verify=False, count=False)
    except (MmshmError, OSError, ValueError, RuntimeError) as exc:
        entry.release()
        log.debug("mmshm: EC output %s not put into the Store: %s", label, exc)
        return False
    return tier.put(key, view, on_done=entry.release)


def load(loads, cache: dict, device: str, counts: Counts, failed: dict, failed_says: str):
    """Load each ``(request id, item name, EntryHandle)`` of ``loads`` not
    yet in ``cache`` (the server's encoder cache: item name -> tensor) into
    it: a zero-copy view of the entry, on ``device`` (``"cpu"``, ``"cuda"``)
    copied by :func:`~mmshm.segments.arena.to_device`; counted in
    ``loads``, ``loaded_bytes``, ``transfer_seconds``. A load that fails
    (any :class:`~mmshm.errors.MmshmError`, ``OSError``, ``ValueError``,
    ``RuntimeError``) is not raised: the item gets zeros of the handle's
    shape and dtype on ``device``, the request goes into ``failed``
    (``{request id: item name}``), counted ``load_failed`` and said
    (``failed_says``: what the server does with the request)."""
    for rid, ident, handle in loads:
        if ident in cache:
            continue
        t0 = time.perf_counter()
        try:
            t = handle.load(counts.server)
            if device != "cpu":
                # from the arena's registered mapping: pinned speed (counted
                # and timed in mmshm_gpu_copy_*{direction="h2d"})
                t = arena.to_device(t, device)
        except (MmshmError, OSError, ValueError, RuntimeError) as exc:
            err = exc if isinstance(exc, EncoderCacheError) else EncoderCacheError(
                f"request {rid}: the encoder output of {ident} ({handle.name}) cannot be "
                f"loaded: {exc}", reason="load_failed")
            failed[rid] = ident
            counts["load_failed"] += 1
            count_fallback(counts.server, "load_failed", f"request {rid}: {err}; {failed_says}",
                           fix=FIX_OUTSIDE.format("the segment directory"))
            cache[ident] = torch.zeros(tuple(handle.shape), dtype=handle.dtype, device=device)
            continue
        cache[ident] = t
        counts["loads"] += 1
        counts["loaded_bytes"] += handle.nbytes
        counts["transfer_seconds"] += time.perf_counter() - t0
        log.debug("mmshm: EC load %s from %s (%d bytes)", ident, handle.name, handle.nbytes)


def prom_counters(counter_cls, labelnames: list, prefix: str) -> dict:
    """The server's own Prometheus counters of a connector's counts
    (``counter_cls(name=, labelnames=, documentation=)``, the server's
    per-engine ``labelnames``): ``<prefix>loads``, ``<prefix>saves``,
    ``<prefix>bytes{direction}``, ``<prefix>fallbacks{reason}``; fed by
    :func:`observe_counts`."""
    c = counter_cls
    return {
        "loads": c(name=prefix + "loads", labelnames=labelnames,
                   documentation="Encoder outputs loaded through mmshm (per holder)."),
        "saves": c(name=prefix + "saves", labelnames=labelnames,
                   documentation="Encoder outputs published through mmshm."),
        "bytes": c(name=prefix + "bytes", labelnames=[*labelnames, "direction"],
                   documentation="Bytes of encoder outputs saved or loaded by mmshm."),
        "fallbacks": c(name=prefix + "fallbacks", labelnames=[*labelnames, "reason"],
                       documentation="Items encoded locally (or not published), by reason."),
    }


def observe_counts(counters: dict, values, data: dict) -> None:
    """Add one report's counts ``data`` (:class:`Counts`) to the counters of
    :func:`prom_counters` under the label ``values`` of one engine."""
    if data.get("loads"):
        counters["loads"].labels(*values).inc(data["loads"])
    if data.get("saves"):
        counters["saves"].labels(*values).inc(data["saves"])
    for direction in ("loaded", "saved"):
        if data.get(f"{direction}_bytes"):
            counters["bytes"].labels(*values, direction).inc(data[f"{direction}_bytes"])
    for k, v in data.items():
        if k.startswith("fallback_") and v:
            counters["fallbacks"].labels(*values, k.removeprefix("fallback_")).inc(v)
