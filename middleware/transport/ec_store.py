"""The cross-node leg of the encoder cache (EPD): a Mooncake Store.

:mod:`mmshm.transport.encoder_cache` serves encoder outputs within one node
(one segment directory). This module adds the leg between nodes on a
`Mooncake Store <https://github.com/kvcache-ai/Mooncake>`_: a
``mooncake_master`` the user runs (mmshm never starts one) keeps the index
and the leases, each client process lends a segment of its memory to the
Store, and the transfer engine (``tcp`` here, ``rdma`` on real hosts) moves
the bytes.

**The same content key, the same checks.** An encoder instance saves each
output in its node's shared memory as before and also hands it to
:meth:`StoreTier.put`, which queues it for a background thread (bounded by
items and bytes; a full queue drops the put, counted). The thread puts
whatever queued meanwhile in one call (``tcp``: one
``batch_put_from_multi_buffers``, each payload read from the published
entry's shared mapping; ``rdma``: ``put_parts`` each), one Store object per
output under ``<key_prefix>/<content key hex>``::

    [0, 256)           the record: magic, length, msgpack of (key, dtype,
                       shape, nbytes, generation, digest)
    [256, 256+nbytes)  the encoder output, C order, its own dtype

The record's digest is :func:`~mmshm.transport.encoder_cache.payload_digest`
of the payload, as the local store computes it. A Store put is atomic (the
object is found only once complete), so a put still in flight is a miss
(``absent``), never partial bytes.

**PD's order** (:func:`load_through`): its own node's segments first
(:meth:`EncoderCache.lookup`); on a miss, :func:`fetch_local`
(:meth:`StoreTier.fetch_into`) reads the object with one copy: ``get_size``,
a new unpublished segment of this node (:meth:`EncoderCache.reserve`; with
``rdma`` its payload mapping registered with the engine, see below; ``tcp``
needs no registration), and one scattered get of the object (the record into
the read buffer registered once, the payload straight into the segment's
shared mapping); a request's items are read together
(:func:`fetch_local_many`, :meth:`StoreTier.fetch_into_many`: each sized
and reserved, then ONE scattered get of them all, which the engine moves in
parallel, as vLLM's push mode writes a request's items in one call); then it
checks the record against the key, the expected dtype, rows and shape and the
object's size, and the payload's digest, and only then publishes the segment
(:meth:`PendingEntry.publish`; a failed check gives it back unpublished), and
the output is looked up there: other PD instances of that node then hit it in
shared memory, with no cross-node bytes. If both miss, the caller encodes the
item. (:meth:`StoreTier.fetch_view` reads into the read buffer instead, for a
caller that wants no segment.)

**Registration with the engine (``rdma``): once per segment, never per
request.** The first read into a segment registers the segment's whole
payload mapping (:attr:`PendingEntry.span`: its capacity, so any later entry
of the size class fits) with ``register_buffer``; the warm pool
(``MMSHM_POOL``) then hands the same mapped segment to later reads, which
register nothing. The registration is given back (``unregister_buffer``)
before this process unlinks or unmaps the segment: by a let-go hook of the
segment table (:meth:`mmshm.segments.table.SegmentTable.add_let_go_hook`)
that runs when the pool drops it (idle time, pool cap, ``trim_pool``), the
encoder cache's close unlinks it, or the table lets go of it; and, for all
that remain, by :meth:`StoreTier.close` before the client is closed (the
cache and the tier close in either order). A segment that is not poolable
(``MMSHM_POOL=0``: used once) is given back right after its read. What is
left out: a file another process unlinks (another producer taking the
published name of an idle pooled segment, an operator's ``rm``) is given
back when this process lets go of it, after that unlink, and so is the
segment of a read still hanging in the engine when the encoder cache closes
(the close unlinks its file without waiting for the engine); a client left
to the process's exit (master gone, a call that hangs) keeps its
registrations until then. Registrations pin pages: the locked-memory limit must cover the
encoder cache's segments (``ulimit -l``). A registration the engine refuses
(non-zero) is a miss, ``register``: the read is not made (``rdma`` cannot
receive into unregistered memory). ``tcp`` registers no segment (the
engine receives into any local memory; a register + unregister measured
1-3 ms a read on a 2-core host, as much as the read of 8 MB).

**Failures are per request** and never raise into the server: every one is a
miss counted in ``mmshm_epd_fallbacks_total{reason="store_<reason>"}`` with
``<reason>`` one of :data:`MISS_REASONS`: ``absent`` (no object under the
key, or its put is still in flight: the master's ``OBJECT_NOT_FOUND``, -704,
or ``REPLICA_IS_NOT_READY``, -703, in Mooncake's ``types.h``; said at INFO),
``unreachable`` (the master cannot be reached or refused the client; said
once at WARNING with the fix),
``timeout`` (no answer within :attr:`StoreConfig.timeout_s`; a read that
hangs keeps the reader busy, and lookups meanwhile miss at once),
``short`` (a get that failed or returned fewer bytes than the object),
``record_mismatch`` (the record disagrees with the key, dtype, shape or
size), ``digest`` (the payload is not the record's), ``register`` (``rdma``:
the engine refused to register the segment, with its return code; said once
at WARNING with the fix: the locked-memory limit, ``ulimit -l``). Puts not made are
counted with ``store_`` + one of :data:`PUT_DROP_REASONS`. Bytes moved are
``mmshm_epd_bytes_total{direction="store_put"|"store_get"}``; counts and
seconds are in :attr:`StoreTier.stats`.
"""

from __future__ import annotations

import ctypes
import http.client
import importlib
import json
import logging
import math
import os
import queue
import re
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import msgspec
import numpy as np
import torch
from mmshm.errors import MmshmError
from mmshm.metrics import EPD_BYTES, EPD_FALLBACKS
from mmshm.segments import codec
from mmshm.segments.table import TABLE
from mmshm.transport import ec_holders
from mmshm.transport.encoder_cache import (
    KEY_BYTES,
    EncoderCache,
    Entry,
    PendingEntry,  # noqa: F401 - documented: fetch_into's segment
    SaveResult,
    payload_digest,
)

log = logging.getLogger("mmshm")

#: reasons a Store lookup misses (label ``store_<reason>``)
#: the keys of ``ec_connector_extra_config`` the Store leg reads (docs/epd-nodes.md)
EXTRA_KEYS = ("master_server_address", "metadata_server", "mooncake_protocol", "protocol",
              "device_name", "local_hostname", "global_segment_size", "local_buffer_size",
              "store_timeout_s", "store_max_pending_items", "store_max_pending_bytes",
              "store_read_buffer_bytes", "store_key_prefix", "mooncake_config_path")
MISS_REASONS = ("absent", "unreachable", "timeout", "short", "record_mismatch", "digest",
                "register")
#: reasons a put is not made (label ``store_<reason>``)
PUT_DROP_REASONS = ("queue_full", "unreachable", "too_big", "put_failed")
#: the most queued puts the put thread makes in one call
MAX_PUT_BATCH = 64
#: bytes before the payload in a Store object
RECORD_BYTES = 256
#: the engine's "no such object" status (Mooncake's ``ErrorCode::OBJECT_NOT_FOUND``)
_OBJECT_NOT_FOUND = -704
#: the engine's "no complete replica yet" status: the object's put is in flight
#: (``ErrorCode::REPLICA_IS_NOT_READY``; ``get_size`` gives it for a put not yet done)
_REPLICA_NOT_READY = -703
_MAGIC = b"MMSHMXS1"
_LEN = struct.Struct("<I")
_FIX_ENGINE = ("pip install mooncake-transfer-engine-non-cuda (CUDA hosts: "
               "mooncake-transfer-engine) and, on Debian/Ubuntu, apt-get install libibverbs1 "
               "libnl-3-200 libnl-route-3-200 (needed even for tcp)")
_FIX = {
    "unreachable": "start mooncake_master where ec_connector_extra_config's "
                   "master_server_address points (with --enable_http_metadata_server=true "
                   "unless metadata_server names another) and let this node reach its RPC "
                   "and metadata ports",
    "timeout": "the master or the encoder's node answers too slowly: check them, or raise "
               "store_timeout_s",
    "absent": "normal when the encoder did not run for this item or its put is still in "
              "flight; otherwise check that the encoder names the same master and namespace",
    "short": "the encoder's node or its network failed mid-read; the item is encoded here",
    "record_mismatch": "something other than mmshm wrote under mmshm's Store keys, or the "
                       "encoder runs another model or --dtype: give it another key_prefix",
    "digest": "the Store returned another payload than its record describes: check the "
              "transfer engine's network",
    "register": "raise this process's locked-memory limit (ulimit -l unlimited; docker run "
                "--ulimit memlock=-1; systemd LimitMEMLOCK=infinity) above the bytes of the "
                "encoder cache's segments (each warm segment stays registered while this "
                "process keeps it), or lower the encoder cache's max_bytes / "
                "MMSHM_POOL_MAX_BYTES",
    "queue_full": "the Store takes puts slower than the encoder makes outputs: raise "
                  "store_max_pending_items / store_max_pending_bytes",
    "too_big": "raise local_buffer_size above the largest encoder output",
    "put_failed": "the master refused the put (no room in the Store's segments?): raise "
                  "global_segment_size on the encoder's node, or check the master's log",
}
_WARNED: set[str] = set()
_WARN_LOCK = threading.Lock()


class StoreConfigError(MmshmError, ValueError):
    """A Store setting in ``ec_connector_extra_config`` that is not valid
    (``key`` names it)."""

    def __init__(self, message: str, key: str = ""):
        super().__init__(message)
        self.key = key


class _Record(msgspec.Struct, array_like=True, frozen=True):
    key: bytes
    dtype: int
    shape: tuple[int, ...]
    nbytes: int
    #: the producer's put counter (``pid << 32 | n``): which put wrote the object
    gen: int
    #: :func:`~mmshm.transport.encoder_cache.payload_digest` of the payload
    digest: bytes


_REC_ENC = msgspec.msgpack.Encoder()
_REC_DEC = msgspec.msgpack.Decoder(_Record)


def record_bytes(rec: _Record) -> bytes:
    """The :data:`RECORD_BYTES` before a Store object's payload."""
    body = _REC_ENC.encode(rec)
    head = bytearray(RECORD_BYTES)
    head[:8] = _MAGIC
    _LEN.pack_into(head, 8, len(body))
    head[12:12 + len(body)] = body
    return bytes(head)


# -- configuration ----------------------------------------------------------------------
_SIZE_RE = re.compile(r"^\s*([\d.]+)\s*(gb|mb|kb|b)?\s*$", re.IGNORECASE)
_UNITS = {"gb": 1 << 30, "mb": 1 << 20, "kb": 1 << 10, "b": 1}


def _size(key: str, value: Any) -> int:
    """Bytes from an int or a string such as ``"4GB"`` (vLLM's syntax)."""
    if isinstance(value, bool):
        raise StoreConfigError(f"{key} must be a size in bytes, not {value!r}", key)
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        n = int(value)
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        try:
            n = int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])
        except (ValueError, OverflowError):
            raise StoreConfigError(f"{key} must be a size (4GB, 512MB, 1048576), not "
                                   f"{value!r}", key) from None
    else:
        raise StoreConfigError(f"{key} must be a size (4GB, 512MB, 1048576), not {value!r}",
                               key)
    if n <= 0:
        raise StoreConfigError(f"{key} must be > 0, not {value!r}", key)
    return n


def _positive(key: str, value: Any, kind=float):
    try:
        if isinstance(value, bool):
            raise ValueError
        v = kind(value)
        if isinstance(value, float) and kind is int and not value.is_integer():
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise StoreConfigError(f"{key} must be a number > 0, not {value!r}", key) from None
    try:
        finite = math.isfinite(v)
    except OverflowError:  # an int above a float's range
        finite = False
    if not (v > 0 and finite):
        raise StoreConfigError(f"{key} must be a number > 0, not {value!r}", key)
    return v


def _host_port(key: str, value: Any) -> tuple[str, int]:
    if not isinstance(value, str):
        raise StoreConfigError(f"{key} must be 'host:port', not {value!r}", key)
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StoreConfigError(f"{key} must be 'host:port', not {value!r}", key)
    return host, int(port)


@dataclass(frozen=True)
class StoreConfig:
    """The Store leg's settings, from an ``ec_connector_extra_config``-like
    mapping (:meth:`from_extra`); key names follow vLLM's Mooncake Store
    configuration (``MOONCAKE_CONFIG_PATH``'s file) and its
    ``ECMooncakeConnector`` (``mooncake_protocol``, ``store_*``).

    Attributes:
        master_server_address: the ``mooncake_master``'s RPC ``host:port``
            (``master_server_address``); naming it turns the leg on.
        metadata_server: the transfer engine's metadata server
            (``metadata_server``; default the master's built-in HTTP one,
            ``http://<master host>:8080/metadata``).
        protocol: ``tcp`` or ``rdma`` (``mooncake_protocol``, or ``protocol``).
        device_name: RDMA devices (``device_name``; empty for tcp).
        local_hostname: the address other nodes reach this process's segment
            at (``local_hostname``; default the address of the interface that
            routes to the master).
        global_segment_size: bytes this process lends to the Store (an
            encoder's objects live there), ``global_segment_size``.
        local_buffer_size: bytes of the engine's staging buffer, at least the
            largest output plus :data:`RECORD_BYTES` (``local_buffer_size``).
        timeout_s: seconds a lookup waits for the Store (``store_timeout_s``).
        max_pending_items / max_pending_bytes: the put queue's bounds
            (``store_max_pending_items`` / ``store_max_pending_bytes``).
        read_buffer_bytes: bytes of the read buffer registered once
            (``store_read_buffer_bytes``); a larger object is read into
            memory allocated for it.
        key_prefix: the Store keys' prefix (``store_key_prefix``).
    """

    master_server_address: str
    metadata_server: str
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = ""
    global_segment_size: int = 1 << 30
    local_buffer_size: int = 256 << 20
    timeout_s: float = 2.0
    max_pending_items: int = 32
    max_pending_bytes: int = 2 << 30
    read_buffer_bytes: int = 128 << 20
    key_prefix: str = "mmshm-ec"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_extra(cls, extra: Mapping | None) -> StoreConfig | None:
        """The settings in ``extra`` (``ec_connector_extra_config``), or None
        when it names no master (the leg is off). A ``mooncake_config_path``
        (a JSON file as vLLM's ``MOONCAKE_CONFIG_PATH`` names) gives defaults
        that the mapping's own keys override.

        Raises:
            StoreConfigError: a value that is not valid, or a config file that
                cannot be read.
        """
        d = dict(extra or {})
        path = d.get("mooncake_config_path")
        if path is not None and not isinstance(path, str):  # an int would be a descriptor
            raise StoreConfigError(f"mooncake_config_path must be a file's path, not {path!r}",
                                   "mooncake_config_path")
        if path:
            try:
                with open(path, encoding="utf-8") as f:
                    file_cfg = json.load(f)
                if not isinstance(file_cfg, dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as exc:
                raise StoreConfigError(f"mooncake_config_path {path!r}: {exc}",
                                       "mooncake_config_path") from None
            d = {**file_cfg, **d}
        master = d.get("master_server_address")
        if not master:
            return None
        host, _ = _host_port("master_server_address", master)
        protocol = str(d.get("mooncake_protocol", d.get("protocol", "tcp"))).lower()
        if protocol not in ("tcp", "rdma"):
            raise StoreConfigError(f"mooncake_protocol must be tcp or rdma, not {protocol!r}",
                                   "mooncake_protocol")
        meta = d.get("metadata_server") or f"http://{host}:8080/metadata"
        if not isinstance(meta, str):
            raise StoreConfigError(f"metadata_server must be a URL, not {meta!r}",
                                   "metadata_server")
        prefix = d.get("store_key_prefix", "mmshm-ec")
        if not isinstance(prefix, str) or not prefix:
            raise StoreConfigError(f"store_key_prefix must be a non-empty string, not "
                                   f"{prefix!r}", "store_key_prefix")
        lbuf = _size("local_buffer_size", d.get("local_buffer_size", 256 << 20))
        if lbuf <= RECORD_BYTES:
            raise StoreConfigError(f"local_buffer_size must exceed {RECORD_BYTES}",
                                   "local_buffer_size")
        return cls(
            master_server_address=str(master).strip(),
            metadata_server=meta,
            protocol=protocol,
            device_name=str(d.get("device_name", "") or ""),
            local_hostname=str(d.get("local_hostname", "") or ""),
            global_segment_size=_size("global_segment_size",
                                      d.get("global_segment_size", 1 << 30)),
            local_buffer_size=lbuf,
            timeout_s=_positive("store_timeout_s", d.get("store_timeout_s", 2.0)),
            max_pending_items=_positive("store_max_pending_items",
                                        d.get("store_max_pending_items", 32), int),
            max_pending_bytes=_size("store_max_pending_bytes",
                                    d.get("store_max_pending_bytes", 2 << 30)),
            read_buffer_bytes=_size("store_read_buffer_bytes",
                                    d.get("store_read_buffer_bytes", 128 << 20)),
            key_prefix=prefix,
            extra=d,
        )

    def master(self) -> tuple[str, int]:
        return _host_port("master_server_address", self.master_server_address)

    def hostname(self) -> str:
        """:attr:`local_hostname`, else the address of the interface that
        routes to the master (a UDP ``connect``: no packet is sent)."""
        if self.local_hostname:
            return self.local_hostname
        host, port = self.master()
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, port))
                return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"

    def describe(self) -> str:
        """One line for a connector's "on:" line: what listens where."""
        return (f"Mooncake Store at master {self.master_server_address} (metadata "
                f"{self.metadata_server}, {self.protocol}); this process lends "
                f"{self.global_segment_size >> 20} MiB, its transfer engine listens on "
                f"{self.hostname()} (and, with tcp, on every interface)")


def _probe_http(url: str, timeout: float) -> None:
    """Raise OSError unless the HTTP metadata server at ``url`` answers an
    HTTP request within ``timeout`` seconds (any status: an unknown key is a
    404). The engine's ``setup`` keeps the interpreter's lock while it
    retries a server that does not answer, so this is asked first."""
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        return  # etcd, P2PHANDSHAKE...: nothing mmshm can ask
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = cls(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("GET", (u.path or "/") + "?key=mmshm%2Fprobe")
        conn.getresponse().read(4096)
    except (http.client.HTTPException, ValueError) as exc:
        raise OSError(f"the metadata server {url} does not answer HTTP: {exc!r}") from None
    finally:
        conn.close()


def load_engine():
    """The Mooncake Store class (``mooncake.store.MooncakeDistributedStore``).
    Raises ImportError (or OSError: a shared library missing) when the
    engine cannot be loaded."""
    return importlib.import_module("mooncake.store").MooncakeDistributedStore


def from_config(extra: Mapping | None, server: str = "vllm", engine=None,
                keep_s: float | None = None) -> StoreTier | None:
    """The Store leg configured by ``extra`` (``ec_connector_extra_config``),
    started (it connects in the background), or None: no master named, or
    the engine's library cannot be loaded (said once at WARNING with the fix;
    the connector then works within the node). ``keep_s``: seconds each
    object this process puts stays in the Store (:attr:`StoreTier.keep_s`).

    Raises:
        StoreConfigError: a setting that is not valid.
    """
    cfg = StoreConfig.from_extra(extra)
    if cfg is None:
        return None
    if engine is None:
        try:
            engine = load_engine()
        except (ImportError, OSError) as exc:
            log.warning("mmshm: encoder cache (%s): ec_connector_extra_config names the "
                        "Mooncake master %s but the Mooncake engine cannot be loaded (%s); "
                        "encoder outputs move within this node only. Fix: %s", server,
                        cfg.master_server_address, exc, _FIX_ENGINE)
            return None
    tier = StoreTier(cfg, server=server, engine=engine)
    tier.keep_s = keep_s
    return tier.start()


# -- the tier ------------------------------------------------------------------------------
class _Job:
    __slots__ = ("abandoned", "cache", "done", "dtype", "key", "result", "rows", "shape")

    def __init__(self, key, dtype, rows, shape, cache=None):
        self.key, self.dtype, self.rows, self.shape = key, dtype, rows, shape
        #: an EncoderCache: read straight into a new segment of it and publish there
        self.cache = cache
        self.done = False
        self.abandoned = False
        self.result = None


class _Batch:
    """Jobs read in one scattered get (:meth:`StoreTier.fetch_into_many`);
    ``key`` (the first job's) names the batch in messages."""

    __slots__ = ("abandoned", "cache", "done", "jobs", "key", "result")

    def __init__(self, jobs: list[_Job], cache):
        self.jobs, self.cache, self.key = jobs, cache, jobs[0].key
        self.done = False
        self.abandoned = False
        self.result = None


class _Registrations:
    """(``rdma``) The payload mappings of this process's segments registered
    with one client, each once: by the first read into the segment, kept
    while the segment serves later entries from the warm pool, and given
    back (``unregister_buffer``) by the segments' let-go hook
    (:meth:`mmshm.segments.table.SegmentTable.add_let_go_hook`) before this
    process unlinks or unmaps the segment, or by :meth:`close`. Keyed by
    the mapping's ``(address, nbytes)`` (:attr:`PendingEntry.span`).
    Thread-safe; the engine's calls run under its own lock (re-entrant: a
    finalizer may let go of a segment in any thread), which is taken under
    the table's lock (the hook), never the other way round."""

    def __init__(self, store):
        self._store = store
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._spans: set[tuple[int, int]] = set()
        TABLE.add_let_go_hook(self.let_go)

    def __len__(self) -> int:
        return len(self._spans)

    def ensure(self, span: tuple[int, int]) -> int:
        """Register ``span`` unless it is: 0, or the engine's non-zero code."""
        if span in self._spans:
            return 0
        with self._lock:
            if self._store is None:
                return -1
            if span in self._spans:
                return 0
            rc = self._store.register_buffer(span[0], span[1])
            if rc == 0:
                self._spans.add(span)
            return rc

    def give_back(self, span: tuple[int, int]) -> None:
        """Unregister ``span`` if it is registered. Never raises."""
        if span not in self._spans:  # cheap: the hook runs for every segment let go
            return
        with self._lock:
            if span not in self._spans:
                return
            self._spans.discard(span)
            try:
                self._store.unregister_buffer(span[0])
            except Exception as exc:  # noqa: BLE001 - giving back never raises
                log.debug("mmshm: unregistering a segment from the Store's engine: %s", exc)

    def let_go(self, seg) -> None:
        """The let-go hook: ``seg`` is about to be unlinked or unmapped."""
        if not self._spans or os.getpid() != self._pid:
            return
        span = seg.payload_span()
        if span is not None:
            self.give_back(span)

    def close(self, unregister: bool) -> None:
        """Stop: every registration given back (``unregister``; before the
        client is closed), or forgotten (a client left to the process's
        exit, whose calls could hang: they go with the process)."""
        TABLE.remove_let_go_hook(self.let_go)
        with self._lock:
            spans, self._spans = self._spans, set()
            store, self._store = self._store, None
            if not unregister or store is None:
                return
            for addr, _ in spans:
                try:
                    store.unregister_buffer(addr)
                except Exception as exc:  # noqa: BLE001 - closing never raises
                    log.debug("mmshm: unregistering a segment at close: %s", exc)


class StoreTier:
    """One process's client of the Store: background puts (encoder) and
    bounded fetches (PD). Made by :func:`from_config`; thread-safe.

    Attributes:
        stats: counts of this process: ``puts``, ``put_bytes``,
            ``put_seconds``, ``gets``, ``get_bytes``, ``get_seconds``,
            ``miss_<reason>`` and ``drop_<reason>``.
    """

    def __init__(self, config: StoreConfig, server: str = "vllm", engine=None):
        self.config = config
        self.server = server
        self._engine_cls = engine
        self._store = None
        self._connected = False
        self._connect_error = ""
        self._connect_at = 0.0
        self._failed_at = -math.inf
        self._connect_lock = threading.Lock()
        self._cond = threading.Condition()
        self._jobs: list[_Job] = []
        self._busy = False
        self._closed = False
        self._puts: queue.Queue = queue.Queue()
        self._pending_items = 0
        self._pending_bytes = 0
        self._gen = 0
        self._read_buf: torch.Tensor | None = None
        #: (rdma) the segments registered with the engine, made at the first read
        self._regs: _Registrations | None = None
        self._threads: list[threading.Thread] = []
        #: seconds an object stays in the Store after its put (None: until the
        #: master evicts it or this client closes); the connector's ``keep_s``
        self.keep_s: float | None = None
        self._put_at: OrderedDict[str, float] = OrderedDict()  # store key -> put time
        self.stats: dict[str, float] = {"puts": 0, "put_bytes": 0, "put_seconds": 0.0,
                                        "gets": 0, "get_bytes": 0, "get_seconds": 0.0}
        for r in MISS_REASONS:
            self.stats[f"miss_{r}"] = 0
        for r in PUT_DROP_REASONS:
            self.stats[f"drop_{r}"] = 0
        ec_holders.watch_store(self)  # `mmshm status` shows this tier and its counts

    def start(self) -> StoreTier:
        for name, target in (("getter", self._get_loop), ("putter", self._put_loop)):
            t = threading.Thread(target=target, name=f"mmshm-ec-store-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        with self._cond:  # the getter connects first, in the background
            self._jobs.append(None)
            self._busy = True
            self._cond.notify_all()
        return self

    def describe(self) -> str:
        return self.config.describe()

    def store_key(self, key: bytes) -> str:
        return f"{self.config.key_prefix}/{key.hex()}"

    # -- counting ----------------------------------------------------------------------
    def _count(self, kind: str, reason: str, detail: str) -> None:
        self.stats[f"{kind}_{reason}"] += 1
        if reason in ("unreachable", "timeout", "short", "put_failed"):
            self._failed_at = time.monotonic()
        EPD_FALLBACKS.labels(server=self.server, reason=f"store_{reason}").inc()
        with _WARN_LOCK:
            first = reason not in _WARNED
            _WARNED.add(reason)
        if first:
            level = logging.INFO if reason == "absent" else logging.WARNING
            log.log(level, "mmshm: encoder cache (%s): Mooncake Store: %s (reason=store_%s; "
                    "said once per process); fix: %s", self.server, detail, reason,
                    _FIX[reason])
        else:
            log.debug("mmshm: encoder cache (%s): Mooncake Store: %s (reason=store_%s)",
                      self.server, detail, reason)

    # -- connecting --------------------------------------------------------------------
    def _connect(self) -> bool:
        """Set the client up once (in a worker thread). The master's RPC port
        and an HTTP metadata server are probed first, so a master that is
        not there is a quick failure instead of the engine's endless
        retries; a failure is tried again after ``5 * timeout_s``."""
        with self._connect_lock:
            if self._connected:
                return True
            if self._closed:
                return False
            now = time.monotonic()
            if self._connect_error and now - self._connect_at < 5 * self.config.timeout_s:
                return False
            self._connect_at = now
            cfg = self.config
            try:
                socket.create_connection(cfg.master(), timeout=cfg.timeout_s).close()
                _probe_http(cfg.metadata_server, cfg.timeout_s)
                store = self._engine_cls()
                rc = store.setup(cfg.hostname(), cfg.metadata_server, cfg.global_segment_size,
                                 cfg.local_buffer_size, cfg.protocol, cfg.device_name,
                                 cfg.master_server_address)
                if rc != 0:
                    raise OSError(f"setup returned {rc}")
                buf = torch.empty(cfg.read_buffer_bytes, dtype=torch.uint8)
                if store.register_buffer(buf.data_ptr(), buf.numel()) != 0:
                    buf = None  # reads then go to memory allocated per object
            except Exception as exc:  # noqa: BLE001 - any failure is "unreachable"
                self._connect_error = f"{type(exc).__name__}: {exc}"
                ec_holders.store_changed(self)
                return False
            # the metrics are created now, in this background thread, not on the first put
            EPD_BYTES.labels(server=self.server, direction="store_get")
            self._store, self._read_buf = store, buf
            self._connected = True
            self._connect_error = ""
            ec_holders.store_changed(self)
            log.info("mmshm: encoder cache (%s): %s", self.server, cfg.describe())
            return True

    def _unreachable(self) -> str | None:
        """Why the Store cannot be used now, or None."""
        if not self._connected:
            return (f"the master {self.config.master_server_address} cannot be reached "
                    f"({self._connect_error or 'not connected yet'})")
        try:
            if self._store.health_check() != 0:
                return f"the master {self.config.master_server_address} does not answer"
        except Exception as exc:  # noqa: BLE001
            return f"health check failed: {exc}"
        return None

    def wait_connected(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the client to be set up."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self._connected:
                return True
            time.sleep(0.02)
        return self._connected

    # -- producer ------------------------------------------------------------------------
    def put(self, key: bytes, tensor: torch.Tensor, on_done=None) -> bool:
        """Queue ``tensor`` (any dtype and shape, CPU or a device) to be put
        under ``key`` by the background thread; the caller must not write
        into ``tensor`` until ``on_done()`` (called exactly once, from the
        put thread once the put is over or at once when it is not queued;
        an encoder gives it a held local entry's release, so the bytes put
        are the bytes published in shared memory). Returns False when it is
        not queued (counted: ``queue_full``, ``unreachable``, ``too_big``).

        Raises:
            ValueError: a key that is not :data:`KEY_BYTES` long.
        """
        if len(key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes, not {len(key)}")
        queued = False
        try:
            queued = self._queue(key, tensor.detach(), on_done)
        finally:
            if not queued and on_done is not None:
                on_done()
        return queued

    def _queue(self, key: bytes, t: torch.Tensor, on_done) -> bool:
        nbytes = t.numel() * t.element_size()
        if self._closed:
            return False
        if nbytes + RECORD_BYTES > self.config.local_buffer_size:
            self._count("drop", "too_big", f"an encoder output of {nbytes} bytes does not fit "
                        f"the engine's local_buffer_size={self.config.local_buffer_size}")
            return False
        if self._connect_error and not self._connected:
            self._count("drop", "unreachable", f"not put: {self._unreachable()}")
            return False
        with self._cond:
            if (self._pending_items >= self.config.max_pending_items
                    or self._pending_bytes + nbytes > self.config.max_pending_bytes):
                full = True
            else:
                full = False
                self._pending_items += 1
                self._pending_bytes += nbytes
        if full:
            self._count("drop", "queue_full", f"{self._pending_items} puts "
                        f"({self._pending_bytes} bytes) already wait")
            return False
        self._puts.put((key, t, nbytes, on_done))
        return True

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every queued put is done."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._cond:
                if not self._pending_items:
                    return True
            time.sleep(0.01)
        return False

    def _put_loop(self) -> None:
        while True:
            try:
                item = self._puts.get(timeout=1.0 if self.keep_s is not None else None)
            except queue.Empty:
                self._expire()
                continue
            if item is None:
                return
            batch, stop = [item], False
            while len(batch) < MAX_PUT_BATCH:  # what queued meanwhile goes in the same call
                try:
                    item = self._puts.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            try:
                self._put_batch(batch)
            except Exception as exc:  # noqa: BLE001 - a put never takes the thread down
                for key, *_ in batch:
                    self._count("drop", "put_failed", f"put of {key.hex()[:16]} failed: {exc}")
            finally:
                done = [on_done for *_, on_done in batch if on_done is not None]
                count, nbytes = len(batch), sum(n for _, _, n, _ in batch)
                del batch, item  # the views go now, not at the next put
                for on_done in done:
                    try:
                        on_done()
                    except Exception:
                        log.debug("mmshm: Store put's on_done failed", exc_info=True)
                with self._cond:
                    self._pending_items -= count
                    self._pending_bytes -= nbytes
                    self._cond.notify_all()
            if stop:
                return
            self._expire()

    def touch(self, key: bytes) -> bool:
        """The encoder saved ``key``'s content again (its local keep time
        restarted): keep its Store object :attr:`keep_s` from now. False
        when this process holds no such object (never put, removed, or its
        put still queued): the caller puts it again."""
        skey = self.store_key(key)
        with self._cond:
            if skey not in self._put_at:
                return False
            self._put_at[skey] = time.monotonic()
            self._put_at.move_to_end(skey)
            return True

    def _expire(self) -> None:
        """Remove this process's objects put more than :attr:`keep_s` ago
        (the local entry's keep time: the Store keeps no output longer than
        the encoder's node does). Called from the put thread only."""
        if self.keep_s is None or self._store is None:
            return
        end = time.monotonic() - self.keep_s
        while True:
            with self._cond:
                if not self._put_at:
                    return
                skey, at = next(iter(self._put_at.items()))
                if at > end:
                    return
                del self._put_at[skey]
            try:
                rc = self._store.remove(skey)
            except Exception as exc:  # noqa: BLE001 - a removal never takes the thread down
                rc = str(exc)
            if rc in (0, _OBJECT_NOT_FOUND):
                self.stats["removes"] = self.stats.get("removes", 0) + 1
            else:  # a lease a reader holds, a transient error: tried again in a second
                log.debug("mmshm: Store remove of %s returned %s; tried again", skey, rc)
                with self._cond:
                    self._put_at.setdefault(skey, time.monotonic() - self.keep_s + 1.0)
                return

    def _put_batch(self, batch: list) -> None:
        """Put each ``(key, tensor, nbytes, on_done)`` of ``batch`` (the put
        thread's). On ``tcp`` every non-empty one goes in ONE
        ``batch_put_from_multi_buffers``, each object's record and payload
        read where they lie (the payload from the published entry's shared
        mapping: no copy into the client's buffer; the engine moves a
        batch's objects in parallel: 8 objects of 8.5 MB measured 1.7-1.9x
        faster than 8 ``put_parts`` on a 2-core host); ``rdma`` (whose
        sources must be registered memory), an empty payload or an engine
        without that call use ``put_parts`` (one copy into the registered
        client buffer). Each object's failure is counted on its own."""
        if not self._connect():
            for _ in batch:
                self._count("drop", "unreachable", f"not put: {self._unreachable()}")
            return
        why = self._unreachable()
        if why:
            for _ in batch:
                self._count("drop", "unreachable", f"not put: {why}")
            return
        t0 = time.perf_counter()
        puts = []  # (key, store key, record, payload as uint8 numpy, nbytes)
        for key, t, nbytes, _ in batch:
            t = t.to("cpu").contiguous()
            payload = t.reshape(-1).view(torch.uint8).numpy() if nbytes else \
                np.empty(0, np.uint8)
            digest = payload_digest(key, nbytes, lambda off, n: payload[off:off + n])
            self._gen += 1
            head = record_bytes(_Record(key, codec.dtype_code(t.dtype),
                                        tuple(int(s) for s in t.shape), nbytes,
                                        (os.getpid() << 32) | self._gen, digest))
            puts.append((key, self.store_key(key), head, payload, nbytes))
        rcs: dict[int, Any] = {}
        many = [i for i, p in enumerate(puts) if p[4]] if (
            self.config.protocol == "tcp"
            and hasattr(self._store, "batch_put_from_multi_buffers")) else []
        if many:
            heads = np.frombuffer(b"".join(puts[i][2] for i in many), np.uint8)
            base = heads.ctypes.data
            out = self._store.batch_put_from_multi_buffers(
                [puts[i][1] for i in many],
                [[base + n * RECORD_BYTES, puts[i][3].ctypes.data] for n, i in enumerate(many)],
                [[RECORD_BYTES, puts[i][4]] for i in many])
            rcs.update(zip(many, out))
        for i, (_, skey, head, payload, _) in enumerate(puts):
            if i not in rcs:
                rcs[i] = self._store.put_parts(skey, head, payload)
        for i, (key, skey, _, _, nbytes) in enumerate(puts):
            if rcs[i] != 0:
                self._count("drop", "put_failed", f"put of {key.hex()[:16]} ({nbytes} bytes) "
                            f"returned {rcs[i]}")
                continue
            self.stats["puts"] += 1
            self.stats["put_bytes"] += nbytes
            if self.keep_s is not None:
                with self._cond:
                    self._put_at[skey] = time.monotonic()
                    self._put_at.move_to_end(skey)
            EPD_BYTES.labels(server=self.server, direction="store_put").inc(nbytes)
        self.stats["put_seconds"] += time.perf_counter() - t0

    # -- consumer ------------------------------------------------------------------------
    def fetch(self, key: bytes, dtype: torch.dtype | None = None, rows: int | None = None,
              *, shape: tuple | None = None) -> torch.Tensor | None:
        """The encoder output of ``key`` from the Store as a new CPU tensor
        (its own memory), or None (a counted miss). Waits at most
        :attr:`StoreConfig.timeout_s`; never raises for a Store failure.
        ``dtype``, ``rows`` and ``shape`` as :meth:`EncoderCache.lookup`."""
        got = self.fetch_view(key, dtype, rows, shape=shape)
        if got is None:
            return None
        view, release = got
        try:
            return view.clone()
        finally:
            release()

    def fetch_view(self, key: bytes, dtype=None, rows=None, *, shape=None):
        """``(tensor, release)``: the output read into the registered read
        buffer (a view of it), valid until ``release()`` is called (which
        lets the next read use the buffer; call it exactly once), or None (a
        counted miss). Bounded as :meth:`fetch`."""
        return self.fetch_view_why(key, dtype, rows, shape=shape)[0]

    def fetch_view_why(self, key: bytes, dtype=None, rows=None, *, shape=None):
        """:meth:`fetch_view` and why it missed: ``((tensor, release), "")``
        or ``(None, reason)`` with ``reason`` one of :data:`MISS_REASONS`
        (``"closed"`` after :meth:`close`)."""
        got, reason = self._submit(_Job(key, dtype, rows, shape))
        if got is None:
            return None, reason
        view = got
        released = []

        def release() -> None:
            if not released:
                released.append(1)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

        return (view, release), ""

    def fetch_into(self, cache: EncoderCache, key: bytes, dtype=None, rows=None, *,
                   shape=None) -> tuple[SaveResult | None, str]:
        """The object of ``key`` read straight into a new segment of ``cache``
        (:meth:`EncoderCache.reserve`: one copy, network to shared memory),
        checked as :meth:`fetch_view` checks it (record against the key,
        ``dtype``, ``rows``, ``shape`` and the object's size; the payload's
        digest) and only then published (:meth:`PendingEntry.publish`); a
        failed check gives the segment back unpublished. With ``rdma`` the
        segment's payload mapping is registered with the engine once, at
        its first read, and kept while the warm pool reuses the segment
        (given back before it is unlinked or unmapped, or at :meth:`close`;
        see the module docstring); a refused registration is a miss,
        ``register`` (``tcp`` receives into any memory: no registration,
        which measured 1-3 ms a read). Returns ``(SaveResult, "")`` (published now,
        or already there: no Store read) or ``(None, reason)``: one of
        :data:`MISS_REASONS` (counted here), ``"closed"``, or the save's
        refusal ``"save_<reason>"`` (counted by the cache). Bounded as
        :meth:`fetch`; a read still running at the deadline finishes on the
        reader thread, which then publishes or discards its segment.

        Raises:
            ValueError: a key that is not :data:`KEY_BYTES` long.
        """
        return self._submit(_Job(key, dtype, rows, shape, cache))

    def fetch_into_many(self, cache: EncoderCache, items) -> list[tuple[SaveResult | None, str]]:
        """:meth:`fetch_into` for several objects at once: ``items`` is a
        sequence of ``(key, dtype, rows, shape)``; each object is checked and
        published as :meth:`fetch_into` does, but all of them are read in one
        scattered get (:meth:`_read_many`: the engine moves a batch's objects
        in parallel, as vLLM's push mode moves a request's items in one
        ``batch_transfer_sync_write``). One ``(SaveResult, "")`` or
        ``(None, reason)`` per item, in order, each miss counted once. The
        whole batch is bounded by :attr:`StoreConfig.timeout_s`.

        Raises:
            ValueError: a key that is not :data:`KEY_BYTES` long.
        """
        jobs = [_Job(key, dtype, rows, shape, cache) for key, dtype, rows, shape in items]
        if not jobs:
            return []
        return self._submit(_Batch(jobs, cache))

    def _submit(self, job):
        """Run ``job`` (a :class:`_Job`, or a :class:`_Batch` of them) on the
        reader thread, waiting at most ``timeout_s``: ``(value, "")`` or
        ``(None, reason)`` (counted); for a batch, one of those per job."""
        jobs = job.jobs if isinstance(job, _Batch) else [job]
        for j in jobs:
            if len(j.key) != KEY_BYTES:
                raise ValueError(f"a key is {KEY_BYTES} bytes, not {len(j.key)}")
        result = self._wait_for(job)
        if isinstance(job, _Batch) and isinstance(result[0], list):
            return [self._counted(r) for r in result[0]]
        if isinstance(job, _Batch):  # one outcome for every item of the batch
            return [self._counted(result) for _ in jobs]
        return self._counted(result)

    def _counted(self, result: tuple) -> tuple:
        """``(value, reason, detail)`` as ``(value, "")`` or ``(None, reason)``,
        a miss counted."""
        value, reason, detail = result
        if value is None:
            if reason in MISS_REASONS:
                self._count("miss", reason, detail)
            return None, reason
        return value, ""

    def _wait_for(self, job) -> tuple:
        """``job``'s ``(value, reason, detail)`` from the reader thread, or the
        miss when it cannot run or does not answer within ``timeout_s``."""
        if self._closed:
            return None, "closed", ""
        if self._connect_error and not self._connected and (
                time.monotonic() - self._connect_at < 5 * self.config.timeout_s):
            return None, "unreachable", self._unreachable()
        deadline = time.monotonic() + self.config.timeout_s
        submitted = job
        with self._cond:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._busy:
                job = None
            else:
                self._busy = True
                job = submitted
                self._jobs.append(job)
                self._cond.notify_all()
                while not job.done:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        job.abandoned = True
                        break
                    self._cond.wait(left)
        if job is None or not job.done:
            why = ("the previous Store read is still running" if job is None
                   else "the Store did not answer")
            if not self._connected:
                return None, "unreachable", (f"{self._unreachable()} (within "
                                             f"{self.config.timeout_s} s)")
            return None, "timeout", (f"{why} within store_timeout_s={self.config.timeout_s} "
                                     f"s ({submitted.key.hex()[:16]})")
        return job.result

    def _get_loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                job = self._jobs.pop(0)
            if job is _STOP:
                return
            if job is None:  # the first connect
                self._connect()
                result = None
            else:
                try:
                    result = self._read(job)
                except Exception as exc:  # noqa: BLE001 - a read never takes the thread down
                    result = (None, "short", f"the read of {job.key.hex()[:16]} failed: {exc}")
            with self._cond:
                if job is None:
                    self._busy = False
                else:
                    job.result = result
                    job.done = True
                    if job.abandoned or result[0] is None or job.cache is not None:
                        self._busy = False
                self._cond.notify_all()

    def _read(self, job):
        key = job.key
        if not self._connect():
            return None, "unreachable", self._unreachable()
        why = self._unreachable()
        if why:
            return None, "unreachable", why
        t0 = time.perf_counter()
        if isinstance(job, _Batch):
            return self._read_many(job.jobs, t0), "", ""
        if job.cache is not None:
            return self._read_many([job], t0)[0]
        skey = self.store_key(key)
        size, miss = self._size(skey)
        if miss:
            return miss
        buf = self._read_buf
        if buf is None or size > buf.numel():
            buf = torch.empty(size, dtype=torch.uint8)
        miss = _read_miss(skey, size, self._store.get_into(skey, buf.data_ptr(), size))
        if miss:
            return miss
        raw = buf[:size].numpy()
        head = raw[:RECORD_BYTES].tobytes()
        rec, got_dtype, bad = self._check_record(job, skey, head, size - RECORD_BYTES)
        if bad:
            return None, "record_mismatch", bad
        nbytes = size - RECORD_BYTES
        payload = raw[RECORD_BYTES:size]
        if payload_digest(key, nbytes, lambda off, n: payload[off:off + n]) != rec.digest:
            return None, "digest", f"{skey}: the payload is not the one its record describes"
        view = buf[RECORD_BYTES:size].view(got_dtype).view(tuple(rec.shape)) if nbytes else \
            torch.empty(tuple(rec.shape), dtype=got_dtype)
        self._got(nbytes, t0)
        return view, "", ""

    def _size(self, skey: str) -> tuple[int, tuple | None]:
        """``(size, None)``: the Store object ``skey``'s size in bytes (its
        record included), or ``(code, (None, reason, detail))``: the miss
        when it is absent, the engine failed, or it is too small to hold a
        record."""
        size = self._store.get_size(skey)
        if size == _OBJECT_NOT_FOUND:
            return size, (None, "absent", f"no Store object {skey} (not put, or its put is "
                          f"in flight)")
        if size == _REPLICA_NOT_READY:
            return size, (None, "absent", f"the Store object {skey} is still being put (no "
                          f"complete replica yet)")
        if size < 0:
            return size, (None, "unreachable", f"get_size({skey}) returned {size}")
        if size < RECORD_BYTES:
            return size, (None, "record_mismatch", f"{skey} holds {size} bytes, no record")
        return size, None

    def _got(self, nbytes: int, t0: float, count: int = 1) -> None:
        self.stats["gets"] += count
        self.stats["get_bytes"] += nbytes
        self.stats["get_seconds"] += time.perf_counter() - t0
        EPD_BYTES.labels(server=self.server, direction="store_get").inc(nbytes)

    def _read_many(self, jobs: list[_Job], t0: float) -> list:
        """(reader thread) Each of ``jobs`` (all with a cache) read straight
        into a new segment of its cache, checked, published: one
        ``(SaveResult, "", "")`` or ``(None, reason, detail)`` per job, in
        order. Every object is sized first (``get_size``), then all of them
        that need bytes are read in ONE scattered ``batch_get_into_multi_buffers``
        (the engine moves a batch's objects in parallel: 8 objects of 8.5 MB
        in one call measured about 1.6x faster than 8 calls on tcp over
        loopback), each record into its own slice of the read buffer
        registered once and each payload into its segment's shared mapping."""
        out: list = [None] * len(jobs)
        todo = []  # (index, skey, size, pending)
        try:
            for i, job in enumerate(jobs):
                skey = self.store_key(job.key)
                size, out[i] = self._size(skey)
                if out[i] is None:
                    pending = job.cache.reserve(job.key, size - RECORD_BYTES,
                                                label="mooncake-store", count=False)
                    if isinstance(pending, SaveResult):  # published already, or refused
                        out[i] = ((pending, "", "") if pending.published
                                  else (None, f"save_{pending.reason}", ""))
                    else:
                        todo.append((i, skey, size, pending))
            heads = self._read_buf
            if heads is None or heads.numel() < RECORD_BYTES * len(todo):
                heads = torch.empty(RECORD_BYTES * max(1, len(todo)), dtype=torch.uint8)
            got = self._get_batch(todo, heads, out)
            for n, (i, skey, size, pending) in enumerate(todo):
                if out[i] is None:
                    head = heads[n * RECORD_BYTES:(n + 1) * RECORD_BYTES].numpy().tobytes()
                    out[i] = self._publish(jobs[i], pending, skey, size, got[n], head)
        finally:
            for _, _, _, pending in todo:
                pending.discard()  # unless published: nothing unchecked is ever found
        read = [size - RECORD_BYTES for i, _, size, _ in todo if out[i][0] is not None]
        if read:
            self._got(sum(read), t0, len(read))
        return out

    def _get_batch(self, todo: list, heads: torch.Tensor, out: list) -> list[int]:
        """The one scattered get of :meth:`_read_many`: what the engine
        returned per object of ``todo`` (bytes read, or its error code); an
        object whose segment the engine refused to register (``rdma``) gets
        its miss in ``out`` and is not read."""
        got = [0] * len(todo)
        keys, ptrs, sizes, where, spans = [], [], [], [], []
        regs = None
        if self.config.protocol != "tcp" and todo:
            # rdma: the segment's whole payload mapping is registered once, at its first
            # read, and stays registered while the warm pool reuses the segment for later
            # entries; the let-go hook gives it back before the segment is unlinked or
            # unmapped (a segment that is not poolable: right after this read). tcp reads
            # into any local memory (the engine receives into it), and a register +
            # unregister measured 1-3 ms a read on a 2-core host, as much as the read of
            # 8 MB: none there
            regs = self._regs
            if regs is None and not self._closed:
                regs = self._regs = _Registrations(self._store)
        for n, (i, skey, size, pending) in enumerate(todo):
            head = heads.data_ptr() + n * RECORD_BYTES
            nbytes = size - RECORD_BYTES
            if not nbytes:
                got[n] = self._store.get_into(skey, head, RECORD_BYTES)
                continue
            if self.config.protocol != "tcp":
                if regs is None:  # a read that outlived close: no new registrations
                    out[i] = (None, "closed", "")
                    continue
                rc = regs.ensure(pending.span)
                if rc != 0:
                    out[i] = (None, "register", (
                        f"the engine's register_buffer of a {pending.span[1]}-byte segment "
                        f"returned {rc}; {skey} was not read"))
                    continue
                spans.append(pending)
            keys.append(skey)
            ptrs.append([head, pending.address])
            sizes.append([RECORD_BYTES, nbytes])
            where.append(n)
        try:
            if keys:
                for n, rc in zip(where, self._store.batch_get_into_multi_buffers(
                        keys, ptrs, sizes)):
                    got[n] = rc
        except Exception as exc:  # noqa: BLE001 - each object read is then short, alone
            log.debug("mmshm: the Store's batched get failed: %s", exc)
            for n in where:
                got[n] = -1
        finally:
            for pending in spans:
                if not pending.reusable:
                    regs.give_back(pending.span)
        return got

    def _publish(self, job: _Job, pending: PendingEntry, skey: str, size: int, got: int,
                 head: bytes):
        """``job``'s object read into ``pending`` (``got``: what the engine
        returned): its record and digest checked, then published."""
        nbytes = size - RECORD_BYTES
        miss = _read_miss(skey, size, got)
        if miss:
            return miss
        rec, got_dtype, bad = self._check_record(job, skey, head, nbytes)
        if bad:
            return None, "record_mismatch", bad
        saved = pending.publish(got_dtype, tuple(rec.shape), rec.digest)
        if saved.reason == "digest":
            return None, "digest", f"{skey}: the payload is not the one its record describes"
        if not saved.published:
            return None, f"save_{saved.reason}", ""
        return saved, "", ""

    def _check_record(self, job: _Job, skey: str, head: bytes, nbytes: int):
        """``(record, dtype, "")`` or ``(record | None, dtype | None, why)``:
        the record in ``head`` against the job's key, dtype, rows, shape and
        the object's payload size ``nbytes``."""
        key = job.key
        rec = None
        if head[:8] == _MAGIC:
            (n,) = _LEN.unpack_from(head, 8)
            if n <= RECORD_BYTES - 12:
                try:
                    rec = _REC_DEC.decode(head[12:12 + n])
                except msgspec.DecodeError:
                    rec = None
        if rec is None:
            return None, None, f"{skey} holds no mmshm record"
        got_dtype = (codec.DTYPES[rec.dtype] if 0 <= rec.dtype < len(codec.DTYPES) else None)
        bad = None
        if rec.key != key:
            bad = f"its record names content {rec.key.hex()[:16]}"
        elif got_dtype is None or any(s < 0 for s in rec.shape):
            bad = f"its record's dtype {rec.dtype} or shape {list(rec.shape)} is not valid"
        elif rec.nbytes != nbytes or rec.nbytes != got_dtype.itemsize * int(
                np.prod(rec.shape, dtype=np.int64)):
            bad = (f"its record says {rec.nbytes} bytes of {got_dtype} {list(rec.shape)}, "
                   f"the object holds {nbytes}")
        elif job.dtype is not None and got_dtype != job.dtype:
            bad = f"it holds {got_dtype}, expected {job.dtype}"
        elif job.rows is not None and (not rec.shape or rec.shape[0] != job.rows):
            bad = f"it holds shape {list(rec.shape)}, expected {job.rows} rows"
        elif job.shape is not None and (len(job.shape) != len(rec.shape) or any(
                w is not None and w >= 0 and int(w) != g
                for w, g in zip(job.shape, rec.shape))):
            bad = f"it holds shape {list(rec.shape)}, expected {list(job.shape)}"
        return rec, got_dtype, (f"{skey}: {bad}" if bad else "")

    # -- the end -----------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads (puts still queued are dropped after ``timeout``
        seconds of waiting), give the segments' registrations (``rdma``) and
        the read buffer back to the engine and close the client (its objects
        in the Store go with its segment), each wait bounded by ``timeout``
        seconds. Idempotent."""
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        self._puts.put(None)
        with self._cond:
            self._jobs.append(_STOP)
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
        regs, self._regs = self._regs, None
        if any(t.is_alive() for t in self._threads):
            if regs is not None:  # its registrations go with the client
                regs.close(unregister=False)
            return  # a call into the engine hangs: leave the client to the process's exit
        store, self._store = self._store, None
        if store is None:
            return
        try:
            healthy = store.health_check() == 0
        except Exception:  # noqa: BLE001
            healthy = False
        # the engine's health lags a master just gone: a failure seen lately counts too
        if not healthy or time.monotonic() - self._failed_at < 60:
            # the engine's close retries a dead master for seconds while it keeps the
            # interpreter's lock; the master drops this client after its client_ttl
            # nor may it be destroyed: its destructor does the same (about 6-10 s with
            # the master gone), so one more reference keeps it until the process ends
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))
            if regs is not None:  # its registrations go with the client
                regs.close(unregister=False)
            log.info("mmshm: encoder cache (%s): the Mooncake master does not answer; the "
                     "client is left to the process's exit", self.server)
            return
        buf = self._read_buf

        def close_client():
            try:
                if regs is not None:  # the segments' registrations, before the client
                    regs.close(unregister=True)
                if buf is not None:
                    store.unregister_buffer(buf.data_ptr())
                store.close()  # unmounts this process's segment: the master's RPCs
            except Exception:  # noqa: BLE001 - closing never raises
                pass

        # with the master gone the engine retries its RPCs for seconds: wait at most
        # ``timeout`` and leave the rest to the process's exit
        t = threading.Thread(target=close_client, name="mmshm-ec-store-close", daemon=True)
        t.start()
        t.join(timeout)
        if not t.is_alive():
            self._read_buf = None


_STOP = _Job(b"", None, None, None)


def _read_miss(skey: str, size: int, got: int) -> tuple | None:
    """The miss ``(None, reason, detail)`` of a get of ``size`` bytes of
    ``skey`` that returned ``got`` (bytes, or the engine's error code), or
    None when it read them all."""
    if got == _OBJECT_NOT_FOUND:
        return None, "absent", f"{skey} went away before its read"
    if got == _REPLICA_NOT_READY:
        return None, "absent", f"{skey} had no complete replica at its read"
    if got != size:
        return None, "short", f"the read of {skey} returned {got} of {size} bytes"
    return None


def fetch_local(cache: EncoderCache, tier: StoreTier, key: bytes,
                dtype: torch.dtype | None = None, rows: int | None = None, *,
                shape: tuple | None = None) -> str:
    """The Store's object of ``key`` read straight into a new segment of this
    node's shared memory and published there once every check passed
    (:meth:`StoreTier.fetch_into`: one copy; kept for ``cache``'s keep
    time; nothing read when the entry is there already), where the
    caller then looks it up (:meth:`EncoderCache.lookup`). Returns ``""``
    when published, else why not: ``store_<reason>`` (:data:`MISS_REASONS`;
    the Store counted it) or the local save's refusal (counted by the
    save). Runs on a reader thread: it waits up to
    :attr:`StoreConfig.timeout_s` and never raises for a Store failure.

    Raises:
        ValueError: a key that is not :data:`KEY_BYTES` long.
    """
    return _why(*tier.fetch_into(cache, key, dtype, rows, shape=shape))


def fetch_local_many(cache: EncoderCache, tier: StoreTier, items) -> list[str]:
    """:func:`fetch_local` for several items (``items``: a sequence of
    ``(key, dtype, rows, shape)``) in one scattered get
    (:meth:`StoreTier.fetch_into_many`); one answer per item, in order, as
    :func:`fetch_local` gives it. Bounded by :attr:`StoreConfig.timeout_s`
    for the whole batch; never raises for a Store failure.

    Raises:
        ValueError: a key that is not :data:`KEY_BYTES` long.
    """
    return [_why(saved, reason) for saved, reason in tier.fetch_into_many(cache, items)]


def _why(saved: SaveResult | None, reason: str) -> str:
    if saved is not None:
        return ""
    if reason.startswith("save_"):
        return reason[len("save_"):] or "store_save_failed"
    return f"store_{reason}"


def load_through(cache: EncoderCache, tier: StoreTier | None, key: bytes,
                 dtype: torch.dtype | None = None, rows: int | None = None, *,
                 shape: tuple | None = None, holder: str = "") -> Entry | None:
    """PD's lookup order for one item: this node's segments
    (:meth:`EncoderCache.lookup`); on a miss, the Store
    (:func:`fetch_local`: read straight into a new local segment, checked,
    published, so other instances of this node hit it in shared memory) and
    looked up there. Returns the held :class:`Entry`, or
    None: the caller encodes the item (the miss is counted: the local one's
    reason without a Store, ``store_<reason>`` with one). Never raises for a
    missing, foreign or failed entry.

    Raises:
        ValueError: a key that is not :data:`KEY_BYTES` long.
    """
    entry = cache.lookup(key, dtype, rows, shape=shape, count=tier is None, holder=holder)
    if entry is not None or tier is None:
        return entry
    if fetch_local(cache, tier, key, dtype, rows, shape=shape):
        return None  # the Store or the save counted why
    return cache.lookup(key, dtype, rows, shape=shape, holder=holder)
