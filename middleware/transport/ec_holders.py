"""What a process holds of the encoder-output store (EPD), for ``mmshm status``.

A consumer instance holds published encoder outputs
(:class:`mmshm.transport.encoder_cache.Entry`) while its requests need them.
Each process lists what it holds, with each entry's holder ("vLLM encoder
cache", a request id), as JSON lines in a memfd of its own named
:data:`HOLDERS_MEMFD`: nothing in any directory (so nothing to leave behind),
gone with the process, and readable by ``mmshm status`` through
``/proc/<pid>/fd`` (same user, or root). This module imports neither torch nor
the store, so that ``mmshm status`` stays light.

A process with the Mooncake Store leg (:class:`mmshm.transport.ec_store.StoreTier`)
adds one ``"kind": "store"`` line per tier to the same memfd
(:func:`watch_store`): the master, the protocol, what listens where, whether
it is connected (else the last connect error) and its counts, read back by
:func:`read_stores`.
"""

from __future__ import annotations

import json
import os
import threading
from typing import NamedTuple

import msgspec

#: the name of the memfd in which a process lists the entries it holds
#: (``/proc/<pid>/fd/*`` links to ``/memfd:<this> (deleted)``)
HOLDERS_MEMFD = "mmshm-epd-holders"
#: seconds within which a change of what a process holds reaches its memfd
FLUSH_S = 0.1


class HeldEntry(NamedTuple):
    """One entry a process holds: its published ``name``, ``nbytes`` (its
    payload), ``holder`` label and the producer's ``label`` for the item."""

    name: str
    nbytes: int
    holder: str
    label: str


class _Holders:
    """This process's memfd: one JSON line per store.

    A store that takes or gives back an entry calls :meth:`update` (nothing
    written then: a consumer's scheduler takes dozens of entries in one step,
    and rewriting the list at each would cost the step O(n) each time); the
    list is written at most :data:`FLUSH_S` later by one timer thread, at
    :meth:`flush`, or when this process reads its own list
    (:func:`read_holders`)."""

    def __init__(self):
        self.fd = -1
        self.pid = 0
        #: guards ``pending`` and ``timer`` only (an entry given back by the
        #: garbage collector in the middle of a flush calls :meth:`update`)
        #: reentrant: a Store tier's finalizer (:func:`watch_store`) may run from the
        #: garbage collector while this thread holds it
        self.lock = threading.RLock()
        #: serialises the flushes: the lists and the memfd
        self.io = threading.RLock()
        self.parts: dict[int, bytes] = {}
        #: store id -> a callable giving ``(server, directory, entries)``; a
        #: Store tier's ``("store", id)`` -> a callable giving its line's dict
        self.pending: dict = {}
        self.timer: threading.Timer | None = None
        self.timer_pid = 0

    @staticmethod
    def _render(server: str, directory: str, entries: list[HeldEntry]) -> bytes | None:
        if not entries:
            return None
        return json.dumps({"pid": os.getpid(), "server": server, "directory": directory,
                           "entries": [e._asdict() for e in entries]}).encode()

    def write(self, store_id: int, server: str, directory: str,
              entries: list[HeldEntry]) -> None:
        """Replace what store ``store_id`` holds, now. Raises :class:`OSError`."""
        with self.io:
            data = self._render(server, directory, entries)
            with self.lock:
                self.pending.pop(store_id, None)
            self._put(store_id, data)

    def update(self, store_id: int, source) -> None:
        """Store ``store_id``'s list changed: ``source()`` (``(server,
        directory, entries)``, or None for a store that is gone) is written
        within :data:`FLUSH_S` seconds (one timer for every store). Raises
        nothing."""
        with self.lock:
            self.pending[store_id] = source
            pid = os.getpid()
            if self.timer is not None and self.timer_pid == pid:
                return  # a flush is coming (a forked child has no timer thread)
            self.timer, self.timer_pid = threading.Timer(FLUSH_S, self._flush_later), pid
            self.timer.daemon = True
            self.timer.start()

    def _flush_later(self) -> None:
        with self.lock:
            self.timer = None
        try:
            self.flush()
        except OSError:
            pass

    def flush(self) -> None:
        """Write every pending store's list now. Raises :class:`OSError`."""
        with self.io:
            with self.lock:
                pending, self.pending = self.pending, {}
            for store_id, source in pending.items():
                got = source()
                if got is None:
                    self._put(store_id, None)
                elif isinstance(store_id, tuple):  # a Store tier's line: a dict
                    self._put(store_id, json.dumps({"pid": os.getpid(), **got}).encode())
                else:
                    self._put(store_id, self._render(*got))

    def _put(self, store_id: int, data: bytes | None) -> None:
        # under self.io
        if self.pid != os.getpid():  # a forked child: its own list
            self.fd, self.pid, self.parts = -1, os.getpid(), {}
        if data is None:
            self.parts.pop(store_id, None)
        else:
            self.parts[store_id] = data
        if self.fd < 0:
            if not self.parts:
                return
            self.fd = os.memfd_create(HOLDERS_MEMFD, os.MFD_CLOEXEC)
        body = b"\n".join(self.parts.values())
        os.ftruncate(self.fd, 0)
        if body:
            os.pwrite(self.fd, body, 0)

    def _after_fork(self) -> None:
        # a lock another thread held at the fork stays held in the child
        self.lock, self.io, self.timer = threading.RLock(), threading.RLock(), None


HOLDERS = _Holders()
os.register_at_fork(after_in_child=HOLDERS._after_fork)


def _lines(pid: int) -> list[dict]:
    """The JSON objects of process ``pid``'s memfd (empty: none, or it cannot
    be read). Never raises."""
    if pid == os.getpid():
        try:
            HOLDERS.flush()  # this process's own list: what it holds now
        except OSError:
            pass
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for n in fds:
        p = f"/proc/{pid}/fd/{n}"
        try:
            if not os.readlink(p).startswith(f"/memfd:{HOLDERS_MEMFD}"):
                continue
            with open(p, "rb") as f:
                raw = f.read()
        except OSError:
            continue
        out = []
        for line in raw.splitlines():
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict):
                out.append(data)
        return out
    return []


def read_holders(pid: int, directory: str | None = None) -> list[HeldEntry]:
    """The entries process ``pid`` holds of the encoder cache (in
    ``directory`` when given), with their holders, read from its memfd
    through ``/proc/<pid>/fd``; empty when it holds none or cannot be read
    (another user's process without root). Never raises."""
    out: list[HeldEntry] = []
    want = os.path.realpath(directory) if directory else None
    for data in _lines(pid):
        if data.get("kind", "entries") != "entries":
            continue
        try:
            if want and os.path.realpath(data.get("directory", "")) != want:
                continue
            out += [HeldEntry(str(e["name"]), int(e["nbytes"]), str(e.get("holder", "")),
                              str(e.get("label", ""))) for e in data["entries"]]
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


# -- the Mooncake Store leg ------------------------------------------------------------------
class StoreLine(msgspec.Struct):
    """A process's Store tier (:class:`mmshm.transport.ec_store.StoreTier`) as
    its memfd says: ``server`` ("vllm"), the ``master``'s RPC ``host:port``,
    the ``metadata`` server's URL, ``protocol`` (``tcp``/``rdma``),
    ``listens`` (:meth:`StoreConfig.describe`: what listens where),
    ``connected``, ``error`` (the last connect error; empty when connected
    or not tried yet) and ``stats`` (:attr:`StoreTier.stats`:
    ``puts``, ``put_bytes``, ``gets``, ``get_bytes``, ``miss_<reason>``,
    ``drop_<reason>`` as counts, ``put_seconds``/``get_seconds`` in s).
    ``mmshm status`` reports it as is (:class:`mmshm.operations.status.StoreState`)."""

    server: str
    master: str
    metadata: str
    protocol: str
    listens: str
    connected: bool
    error: str = ""
    stats: dict[str, float] = msgspec.field(default_factory=dict)


class _Counts(dict):
    """A tier's ``stats``: a dict whose every assignment has the tier's line
    written within :data:`FLUSH_S` (:meth:`_Holders.update`)."""

    __slots__ = ("_tier_id", "_source")

    def __setitem__(self, key, value) -> None:
        dict.__setitem__(self, key, value)
        HOLDERS.update(self._tier_id, self._source)


def _store_source(ref):
    describe: list[str] = []

    def source():
        tier = ref()
        if tier is None:
            return None  # gone: its line goes
        cfg = tier.config
        if not describe:  # once: it looks up the route to the master
            try:
                describe.append(cfg.describe())
            except Exception as exc:  # noqa: BLE001 - a line never raises
                describe.append(f"Mooncake Store at master {cfg.master_server_address} ({exc})")
        try:
            stats = dict(tier.stats)
        except RuntimeError:  # changed size meanwhile: next flush
            stats = {}
        return {"kind": "store", "server": str(tier.server),
                "master": str(cfg.master_server_address), "metadata": str(cfg.metadata_server),
                "protocol": str(cfg.protocol), "listens": describe[0],
                "connected": bool(tier._connected), "error": str(tier._connect_error or ""),
                "stats": stats}

    return source


def watch_store(tier) -> None:
    """List ``tier`` (a :class:`~mmshm.transport.ec_store.StoreTier`) in this
    process's memfd: its line is written within :data:`FLUSH_S`, again within
    :data:`FLUSH_S` of any change of its counts (``tier.stats`` becomes a dict
    that says so) and at :func:`store_changed`; it goes with the tier (a weak
    reference). Raises nothing."""
    import weakref

    tid = ("store", id(tier))
    counts = _Counts(tier.stats)
    counts._tier_id, counts._source = tid, _store_source(weakref.ref(tier))
    tier.stats = counts
    weakref.finalize(tier, HOLDERS.update, tid, lambda: None)
    HOLDERS.update(tid, counts._source)


def store_changed(tier) -> None:
    """``tier`` connected or failed to: its line is rewritten within
    :data:`FLUSH_S`. Raises nothing."""
    counts = getattr(tier, "stats", None)
    if isinstance(counts, _Counts):
        HOLDERS.update(counts._tier_id, counts._source)


def read_stores(pid: int) -> list[StoreLine]:
    """The Store tiers of process ``pid`` (:func:`watch_store`), read from its
    memfd through ``/proc/<pid>/fd``; empty when it has none or cannot be
    read. Never raises."""
    out = []
    for data in _lines(pid):
        if data.get("kind") != "store":
            continue
        try:
            stats = data.get("stats") or {}
            out.append(StoreLine(
                str(data["server"]), str(data["master"]), str(data.get("metadata", "")),
                str(data.get("protocol", "")), str(data.get("listens", "")),
                bool(data.get("connected")), str(data.get("error", "")),
                {str(k): v for k, v in stats.items() if isinstance(v, (int, float))}))
        except (KeyError, TypeError, AttributeError):
            continue
    return out
