"""What a process holds of the encoder-output store (EPD), for ``mmshm status``.

A consumer instance holds published encoder outputs
(:class:`mmshm.transport.encoder_cache.Entry`) while its requests need them.
Each process lists what it holds, with each entry's holder ("vLLM encoder
cache", a request id), as JSON lines in a memfd of its own named
:data:`HOLDERS_MEMFD`: nothing in any directory (so nothing to leave behind),
gone with the process, and readable by ``mmshm status`` through
``/proc/<pid>/fd`` (same user, or root). This module imports neither torch nor
the store, so that ``mmshm status`` stays light.
"""

from __future__ import annotations

import json
import os
import threading
from typing import NamedTuple

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
        self.lock = threading.Lock()
        #: serialises the flushes: the lists and the memfd
        self.io = threading.RLock()
        self.parts: dict[int, bytes] = {}
        #: store id -> a callable giving ``(server, directory, entries)``
        self.pending: dict[int, object] = {}
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
                self._put(store_id, None if got is None else self._render(*got))

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
        self.lock, self.io, self.timer = threading.Lock(), threading.RLock(), None


HOLDERS = _Holders()
os.register_at_fork(after_in_child=HOLDERS._after_fork)


def read_holders(pid: int, directory: str | None = None) -> list[HeldEntry]:
    """The entries process ``pid`` holds of the encoder cache (in
    ``directory`` when given), with their holders, read from its memfd
    through ``/proc/<pid>/fd``; empty when it holds none or cannot be read
    (another user's process without root). Never raises."""
    out: list[HeldEntry] = []
    if pid == os.getpid():
        try:
            HOLDERS.flush()  # this process's own list: what it holds now
        except OSError:
            pass
    want = os.path.realpath(directory) if directory else None
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for n in fds:
        p = f"/proc/{pid}/fd/{n}"
        try:
            if not os.readlink(p).startswith(f"/memfd:{HOLDERS_MEMFD}"):
                continue
            with open(p, "rb") as f:
                raw = f.read()
        except OSError:
            continue
        for line in raw.splitlines():
            try:
                data = json.loads(line)
                if want and os.path.realpath(data.get("directory", "")) != want:
                    continue
                out += [HeldEntry(str(e["name"]), int(e["nbytes"]), str(e.get("holder", "")),
                                  str(e.get("label", ""))) for e in data["entries"]]
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
        break
    return out
