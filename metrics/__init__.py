"""Prometheus metrics of mmshm (prometheus-client).

All names are prefixed ``mmshm_`` and use base units (seconds, bytes); counters
are exposed with the ``_total`` suffix. The core updates the objects below;
they land in prometheus-client's default registry, and in
``PROMETHEUS_MULTIPROC_DIR`` when that variable is set before the metrics are
created (SGLang's ``--enable-metrics`` sets it), so that the server's own
``/metrics`` merges mmshm's series across its tokenizer, scheduler and
detokenizer processes.

Families (as exposed):

=============================================  ==========================================
``mmshm_segments_created_total``               segments created
``mmshm_shm_written_bytes_total``              payload bytes written into segments
``mmshm_segments_in_use``                      segments created and not yet freed
``mmshm_shm_in_use_bytes``                     bytes of those segments (header included)
``mmshm_inline_fallbacks_total{reason}``       tensors sent inline: ``enospc``, ``budget``,
                                               ``emfile``, ``other``
``mmshm_reaped_segments_total{reason}``        segments nobody held, reclaimed by the reaper:
                                               ``killed`` (a holder died without closing
                                               them), ``in_flight_expired`` (references in
                                               flight past the grace period after every
                                               holder closed them cleanly)
``mmshm_reaped_bytes_total{reason}``           bytes of those segments
``mmshm_materialize_failures_total{reason}``   handles that failed to open
``mmshm_materialize_seconds``                  histogram: one broadcast batch's handles
``mmshm_request_failures_total{reason}``       requests turned into per-request errors
``mmshm_broadcast_seconds{role}``              histogram, ``role`` = ``src`` / ``dst``
``mmshm_broadcast_bytes{role}``                histogram of broadcast payload bytes
``mmshm_fanout_copies_total``                  copies of a fanned-out request sharing its
                                               segments, the first included (``fan_out(req,
                                               n)``: n; a server's scope: each message with
                                               handles, from the second; see
                                               :class:`mmshm.transport.sending.FanOut`)
``mmshm_pool_requests_total{result}``          segment pool lookups, ``hit`` / ``miss``
``mmshm_internode_bytes_total``                payload bytes sent to other nodes (multi-node
                                               TP: once per tensor and other node)
``mmshm_references_handed_total{path}``        references handed out before a hand-over:
                                               ``send`` (to the next process, one per
                                               message), ``broadcast`` (one per reader and
                                               handle sent: vLLM's scheduler-output queue,
                                               ``deferred_unwrap`` for SGLang)
``mmshm_path_enabled{server,role,path}``       1 while an instrumented transport path is on
                                               in a live process, 0 when left off;
                                               ``role`` as the process's "on:" line says it,
                                               with its data-parallel rank under data
                                               parallelism only (``scheduler (DP rank 1, TP
                                               rank 0)``, ``EngineCore (DP rank 0)``): one
                                               series per DP rank, and a server without
                                               data parallelism keeps its series
``mmshm_ipc_seconds{server,hop,transport}``   histogram: seconds one message spends in one hop
                                               of the multimodal path (see :mod:`mmshm.hooks.observe`),
                                               ``transport`` = ``server`` (the server's own,
                                               observe mode) / ``mmshm``
``mmshm_ipc_bytes{server,hop,transport}``     histogram: bytes that hop serializes for one
                                               message
``mmshm_observe_errors_total{server,hop}``     timings that failed (the message went through
                                               untouched)
``mmshm_dir_free_bytes``                       free bytes in ``MMSHM_DIR`` (statvfs)
``mmshm_dir_size_bytes``                       size of ``MMSHM_DIR``'s file system
``mmshm_epd_saves_total{server}``              encoder outputs an encoder instance published
                                               for other instances (EPD, one per item written)
``mmshm_epd_loads_total{server}``              encoder outputs an instance loaded instead of
                                               running its encoder (one per item and holder)
``mmshm_epd_bytes_total{server,direction}``    bytes of those, ``direction`` = ``saved`` /
                                               ``loaded``; between nodes through a
                                               Mooncake Store: ``store_put`` / ``store_get``
``mmshm_epd_fallbacks_total{server,reason}``   items encoded locally (or not published), by
                                               reason (:data:`EPD_FALLBACK_REASONS`)
``mmshm_epd_transfer_seconds{server}``         histogram: seconds to publish or to load one
                                               encoder output
``mmshm_epd_lookups_total{server,result}``     a consumer's lookups of encoder outputs,
                                               ``result`` = ``hit`` / ``miss`` (the hit ratio)
``mmshm_epd_held_bytes{server}``               bytes of encoder outputs consumers hold
``mmshm_arena_bytes``                          the arena's size in a producing process
                                               (``MMSHM_ARENA_BYTES``; 0: off)
``mmshm_arena_in_use_bytes``                   bytes of arena segments held by references
                                               (the rest of the arena is idle, warm pages)
``mmshm_arena_registered_bytes``               bytes of arena mappings this process has
                                               registered with CUDA (page-locked for DMA)
``mmshm_arena_registrations_total{result}``    mappings registered with CUDA, ``ok`` /
                                               ``failed`` (then served unregistered)
``mmshm_arena_fallbacks_total{reason}``        tensors that went to a plain segment because
                                               the arena had no room: ``full`` / ``too_big``
``mmshm_arena_views_total{registered}``        tensors handed out from the arena's
                                               persistent mappings, ``yes`` / ``no``
``mmshm_gpu_copy_bytes_total{direction}``      bytes mmshm copied between the arena and a
                                               GPU, ``h2d`` / ``d2h``
``mmshm_gpu_copy_seconds{direction}``          histogram: seconds of one such copy
``mmshm_arena_settle_seconds``                 histogram: seconds a released registered arena
                                               view is held until the GPU has settled
``mmshm_device_tensors_total{kind}``           tensors met in a request that already live
                                               on a device and are left to the server:
                                               ``cuda`` (a CUDA tensor), ``sglang_ipc``
                                               (SGLang's CUDA-IPC proxy)
=============================================  ==========================================

**When the metrics are created.** prometheus-client picks single-process or
multiprocess storage once, when it is first imported, from
``PROMETHEUS_MULTIPROC_DIR``. A server such as SGLang sets that variable during
start-up and imports prometheus-client afterwards; if mmshm (loaded early by its
start-up hook) imported it first, the server's *own* metrics of that process
would silently stop being merged. So importing this module creates the metrics
at once only if prometheus-client is already imported or the variable is
already set; otherwise the module-level objects are stand-ins, and the metrics
are created on the first use of any of them (the first segment, fallback or
broadcast, by which time the server has set up), or by :func:`init`,
:func:`render`, :func:`registry` or the exporter.

**Scrape-time gauges.** ``mmshm_dir_*`` are read at scrape time. In a single
process they are function-valued gauges calling
``os.statvfs(mmshm.config.get().dir)``. In multiprocess mode the scraping
process (the server's HTTP process) reads every process's files and runs no
mmshm code, so each mmshm process refreshes its value every
``MMSHM_METRICS_REFRESH_S`` seconds (default 5; 0: only on demand) from a
daemon thread, and :func:`render` / the exporter refresh it again right before
collecting; the merge keeps the most recent value
(``multiprocess_mode="mostrecent"``). The in-use gauges are ``livesum``; a
killed process's live gauges are dropped by :func:`mark_dead_processes` (the
reaper calls it when it reclaims a killed holder's segments, ``mmshm run`` once
the server has exited).

Exporter: :func:`start_exporter`, :func:`maybe_start_exporter_from_env`
(``MMSHM_METRICS_PORT``, ``MMSHM_METRICS_ADDR``) and :func:`render`; see
:mod:`mmshm.metrics.exporter`.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import sys
import threading
import time

log = logging.getLogger("mmshm")

# 100 us .. 10 s
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
# 1 KB .. 1 GB
BYTES_BUCKETS = tuple(float(10 ** e * m) for e in range(3, 9) for m in (1, 4)) + (1e9,)

#: ``reason`` label values of the fallback and failure counters: defined with
#: the one mapping of an exception to a reason (:func:`mmshm.errors.failure_reason`)
from ..errors import FAILURE_REASONS, FALLBACK_REASONS  # noqa: E402
#: ``reason`` label values of the reaper's counters (:data:`mmshm.segments.reaper.REASONS`).
REAP_REASONS = ("killed", "in_flight_expired")
#: ``role`` label values of the broadcast histograms.
ROLES = ("src", "dst")
#: ``result`` label values of ``mmshm_pool_requests_total``.
POOL_RESULTS = ("hit", "miss")
#: ``reason`` label values of ``mmshm_pool_dropped_total``.
POOL_DROP_REASONS = ("truncated", "damaged")
#: ``path`` label values of ``mmshm_references_handed_total``.
HANDED_PATHS = ("send", "broadcast")
#: ``server`` label values of the EPD families (created at 0 for both).
EPD_SERVERS = ("vllm", "sglang")
#: ``direction`` label values of ``mmshm_epd_bytes_total``.
EPD_DIRECTIONS = ("saved", "loaded", "store_put", "store_get")
#: ``reason`` label values of ``mmshm_epd_fallbacks_total`` (an item encoded locally,
#: or an encoder output not published): ``over_budget`` (the budget guard or
#: MMSHM_MAX_BYTES refused the segment), ``no_space`` (ENOSPC), ``missing`` (no
#: entry of that content), ``content_mismatch`` (the name found holds other
#: content), ``incompatible`` (dtype or shape differ from what the consumer
#: expects), ``segment_gone`` (the entry's segment was freed or unreadable),
#: ``encoder_gone`` / ``encoder_dropped`` / ``encoder_error`` (SGLang: the encoder
#: instance died, was dropped by the registry, or rejected the item), ``torn`` (an
#: entry truncated or whose header or record cannot be read), ``digest`` (its payload
#: is not its record's), ``name_taken`` (its published names are held by other files),
#: ``queue_full`` (a producer's key queue dropped a key before publishing),
#: ``unproven`` (SGLang: the language instance did not prove it can open the
#: encoder's segments; SGLang's own bytes carried the output); the Mooncake Store
#: leg between nodes (:mod:`mmshm.transport.ec_store`): ``store_`` + a lookup's
#: miss reason (``absent``, ``unreachable``, ``timeout``, ``short``,
#: ``record_mismatch``, ``digest``, ``register``) or a put not made (``queue_full``,
#: ``unreachable``, ``too_big``, ``put_failed``).
EPD_FALLBACK_REASONS = ("over_budget", "no_space", "missing", "content_mismatch",
                        "incompatible", "segment_gone", "encoder_gone", "encoder_dropped",
                        "encoder_error", "torn", "digest", "name_taken", "queue_full",
                        "unproven", "store_absent", "store_unreachable", "store_timeout",
                        "store_short", "store_record_mismatch", "store_digest",
                        "store_register", "store_too_big", "store_put_failed",
                        "store_queue_full")
#: ``result`` label values of ``mmshm_epd_lookups_total``.
EPD_LOOKUP_RESULTS = ("hit", "miss")

#: ``result`` label values of ``mmshm_arena_registrations_total``.
ARENA_REG_RESULTS = ("ok", "failed")
#: ``reason`` label values of ``mmshm_arena_fallbacks_total``: ``full`` (the arena's
#: segments are all held), ``too_big`` (the tensor is larger than the whole arena).
ARENA_FALLBACK_REASONS = ("full", "too_big")
#: ``registered`` label values of ``mmshm_arena_views_total``.
ARENA_VIEW_KINDS = ("yes", "no")
#: ``direction`` label values of the GPU copy families.
GPU_DIRECTIONS = ("h2d", "d2h")
#: ``kind`` label values of ``mmshm_device_tensors_total``.
DEVICE_TENSOR_KINDS = ("cuda", "sglang_ipc")

_MULTIPROC_ENV = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")

# (module attribute, kind, name, help, labels, options)
_SPECS = (
    ("SEGMENTS_CREATED", "counter", "mmshm_segments_created",
     "Shared-memory segments created.", (), {}),
    ("SHM_WRITTEN_BYTES", "counter", "mmshm_shm_written_bytes",
     "Payload bytes written into shared memory.", (), {}),
    ("FALLBACKS", "counter", "mmshm_inline_fallbacks",
     "Tensors that travelled inline because a segment could not be made, by reason.",
     ("reason",), {}),
    ("MATERIALIZE_FAILURES", "counter", "mmshm_materialize_failures",
     "Handles that could not be materialized, by reason.", ("reason",), {}),
    ("MATERIALIZE_SECONDS", "histogram", "mmshm_materialize_seconds",
     "Time to materialize one broadcast batch's handles.", (),
     {"buckets": LATENCY_BUCKETS}),
    ("BROADCAST_SECONDS", "histogram", "mmshm_broadcast_seconds",
     "Time spent in the wrapped broadcast_pyobj call, by process-group role (src or dst).",
     ("role",), {"buckets": LATENCY_BUCKETS}),
    ("BROADCAST_BYTES", "histogram", "mmshm_broadcast_bytes",
     "Pickled bytes carried by the wrapped broadcast (estimate), by role (src or dst).",
     ("role",), {"buckets": BYTES_BUCKETS}),
    ("FANOUT_COPIES", "counter", "mmshm_fanout_copies",
     "Copies of a fanned-out request sharing its segments, the first included "
     "(parallel sampling).", (), {}),
    ("REQUEST_FAILURES", "counter", "mmshm_request_failures",
     "Requests turned into a per-request error by deferred_unwrap, by reason.",
     ("reason",), {}),
    ("SEGMENTS_IN_USE", "gauge", "mmshm_segments_in_use",
     "Segments created by mmshm that are not yet freed and closed.", (),
     {"multiprocess_mode": "livesum"}),
    ("BYTES_IN_USE", "gauge", "mmshm_shm_in_use_bytes",
     "Bytes of the segment directory held by mmshm's live segments (header included).", (),
     {"multiprocess_mode": "livesum"}),
    ("REAPED_SEGMENTS", "counter", "mmshm_reaped_segments",
     "Segments no live process held, reclaimed by the reaper, by reason (killed: a holder "
     "died without closing them; in_flight_expired: references in flight past "
     "MMSHM_IN_FLIGHT_GRACE_S after a clean exit).", ("reason",), {}),
    ("REAPED_BYTES", "counter", "mmshm_reaped_bytes",
     "Bytes of segments reclaimed by the reaper, by reason.", ("reason",), {}),
    ("REFERENCES_HANDED", "counter", "mmshm_references_handed",
     "References added for receivers before a hand-over, by path (send or broadcast).",
     ("path",), {}),
    ("PATH_ENABLED", "gauge", "mmshm_path_enabled",
     "1 while an instrumented transport path is on in a live process, 0 when it was left "
     "off (see the process's WARNING for the reason); role as the process's on: line says "
     "it, with its DP rank under data parallelism.", ("server", "role", "path"),
     {"multiprocess_mode": "livemax"}),
    ("FREE_BYTES", "gauge", "mmshm_dir_free_bytes",
     "Free bytes in the segment directory's file system (statvfs f_bavail * f_frsize).", (),
     {"multiprocess_mode": "mostrecent"}),
    ("DIR_SIZE_BYTES", "gauge", "mmshm_dir_size_bytes",
     "Size of the segment directory's file system (statvfs f_blocks * f_frsize).", (),
     {"multiprocess_mode": "mostrecent"}),
    ("POOL_REQUESTS", "counter", "mmshm_pool_requests",
     "Segment pool lookups, by result (hit or miss).", ("result",), {}),
    ("POOL_DROPPED", "counter", "mmshm_pool_dropped",
     "Idle pooled segments dropped instead of reused, by reason (truncated: a third party "
     "shortened the file; damaged: its header was overwritten).", ("reason",), {}),
    ("IPC_SECONDS", "histogram", "mmshm_ipc_seconds",
     "Seconds one message spends in one hop of the multimodal path, by server, hop and "
     "transport (server: the server's own, timed by observe mode; mmshm).",
     ("server", "hop", "transport"), {"buckets": LATENCY_BUCKETS}),
    ("IPC_BYTES", "histogram", "mmshm_ipc_bytes",
     "Bytes one hop of the multimodal path serializes for one message, by server, hop and "
     "transport.", ("server", "hop", "transport"), {"buckets": BYTES_BUCKETS}),
    ("OBSERVE_ERRORS", "counter", "mmshm_observe_errors",
     "Hop timings that failed; the message went through untouched.", ("server", "hop"), {}),
    ("INTERNODE_BYTES", "counter", "mmshm_internode_bytes",
     "Tensor payload bytes sent by the source TP rank to the other nodes' leader ranks.",
     (), {}),
    ("EPD_SAVES", "counter", "mmshm_epd_saves",
     "Encoder outputs published for other instances (encoder disaggregation), by server.",
     ("server",), {}),
    ("EPD_LOADS", "counter", "mmshm_epd_loads",
     "Encoder outputs loaded from another instance instead of encoded locally, by server.",
     ("server",), {}),
    ("EPD_BYTES", "counter", "mmshm_epd_bytes",
     "Bytes of encoder outputs published (saved) or loaded, by server and direction.",
     ("server", "direction"), {}),
    ("EPD_FALLBACKS", "counter", "mmshm_epd_fallbacks",
     "Encoder outputs not published, or items encoded locally instead of loaded, by server "
     "and reason.", ("server", "reason"), {}),
    ("EPD_TRANSFER_SECONDS", "histogram", "mmshm_epd_transfer_seconds",
     "Seconds to publish or to load one encoder output, by server.", ("server",),
     {"buckets": LATENCY_BUCKETS}),
    ("EPD_LOOKUPS", "counter", "mmshm_epd_lookups",
     "Lookups of encoder outputs by a consumer instance, by server and result (hit or miss).",
     ("server", "result"), {}),
    ("EPD_HELD_BYTES", "gauge", "mmshm_epd_held_bytes",
     "Bytes of encoder outputs held by consumer instances (until their requests free them), "
     "by server.", ("server",), {"multiprocess_mode": "livesum"}),
    ("ARENA_BYTES", "gauge", "mmshm_arena_bytes",
     "Size of this process's arena (MMSHM_ARENA_BYTES; 0: off).", (),
     {"multiprocess_mode": "livemax"}),
    ("ARENA_IN_USE_BYTES", "gauge", "mmshm_arena_in_use_bytes",
     "Bytes of arena segments held by references (the rest is idle, warm pages).", (),
     {"multiprocess_mode": "livesum"}),
    ("ARENA_REGISTERED_BYTES", "gauge", "mmshm_arena_registered_bytes",
     "Bytes of arena mappings registered with CUDA (page-locked) in live processes.", (),
     {"multiprocess_mode": "livesum"}),
    ("ARENA_REGISTRATIONS", "counter", "mmshm_arena_registrations",
     "Arena mappings registered with CUDA, by result (failed: served unregistered).",
     ("result",), {}),
    ("ARENA_FALLBACKS", "counter", "mmshm_arena_fallbacks",
     "Tensors that went to a plain segment because the arena had no room, by reason.",
     ("reason",), {}),
    ("ARENA_SETTLE_SECONDS", "histogram", "mmshm_arena_settle_seconds",
     "Seconds a released registered arena view is held, from its release until the GPU has "
     "settled and its reference is given back.", (), {"buckets": LATENCY_BUCKETS}),
    ("ARENA_VIEWS", "counter", "mmshm_arena_views",
     "Tensors handed out from the arena's persistent mappings, by whether the mapping is "
     "registered with CUDA.", ("registered",), {}),
    ("GPU_COPY_BYTES", "counter", "mmshm_gpu_copy_bytes",
     "Bytes mmshm copied between the arena and a GPU, by direction (h2d, d2h).",
     ("direction",), {}),
    ("GPU_COPY_SECONDS", "histogram", "mmshm_gpu_copy_seconds",
     "Seconds of one copy between the arena and a GPU, by direction.", ("direction",),
     {"buckets": LATENCY_BUCKETS}),
    ("DEVICE_TENSORS", "counter", "mmshm_device_tensors",
     "Tensors met in a request that already live on a device and are left to the server, "
     "by kind (cuda, sglang_ipc).", ("kind",), {}),
)
# Label values created (at 0) with the metrics, so every series exists from the
# first scrape: increase()/rate() and alerts then see the first event, and
# dashboards show 0 instead of "no data".
_PREINIT = {
    "FALLBACKS": ("reason", FALLBACK_REASONS),
    "MATERIALIZE_FAILURES": ("reason", FAILURE_REASONS),
    "REQUEST_FAILURES": ("reason", FAILURE_REASONS),
    "BROADCAST_SECONDS": ("role", ROLES),
    "BROADCAST_BYTES": ("role", ROLES),
    "POOL_REQUESTS": ("result", POOL_RESULTS),
    "POOL_DROPPED": ("reason", POOL_DROP_REASONS),
    "REFERENCES_HANDED": ("path", HANDED_PATHS),
    "REAPED_SEGMENTS": ("reason", REAP_REASONS),
    "REAPED_BYTES": ("reason", REAP_REASONS),
    "ARENA_REGISTRATIONS": ("result", ARENA_REG_RESULTS),
    "ARENA_FALLBACKS": ("reason", ARENA_FALLBACK_REASONS),
    "ARENA_VIEWS": ("registered", ARENA_VIEW_KINDS),
    "GPU_COPY_BYTES": ("direction", GPU_DIRECTIONS),
    "GPU_COPY_SECONDS": ("direction", GPU_DIRECTIONS),
    "DEVICE_TENSORS": ("kind", DEVICE_TENSOR_KINDS),
}
# The same for families with two labels: every combination of the values.
_PREINIT_GRID = {
    "EPD_SAVES": (("server", EPD_SERVERS),),
    "EPD_LOADS": (("server", EPD_SERVERS),),
    "EPD_TRANSFER_SECONDS": (("server", EPD_SERVERS),),
    "EPD_LOOKUPS": (("server", EPD_SERVERS), ("result", EPD_LOOKUP_RESULTS)),
    "EPD_HELD_BYTES": (("server", EPD_SERVERS),),
    "EPD_BYTES": (("server", EPD_SERVERS), ("direction", EPD_DIRECTIONS)),
    "EPD_FALLBACKS": (("server", EPD_SERVERS), ("reason", EPD_FALLBACK_REASONS)),
}


class _Deferred:
    """Stand-in for one metric until :func:`init` has created it: any attribute
    (``inc``, ``labels``, ``observe``, ``set``...) creates the metrics first and
    is then taken from the real prometheus-client object."""

    __slots__ = ("_attr", "_real")

    def __init__(self, attr: str):
        self._attr = attr
        self._real = None

    def __getattr__(self, name: str):
        real = self._real
        if real is None:
            init()
            real = self._real
        return getattr(real, name)

    def __repr__(self) -> str:
        state = "created" if self._real is not None else "not created yet"
        return f"<mmshm.metrics.{self._attr} ({state})>"


_deferred = {spec[0]: _Deferred(spec[0]) for spec in _SPECS}
# The module-level metric objects; init() rebinds them to the real ones.
SEGMENTS_CREATED = _deferred["SEGMENTS_CREATED"]
SHM_WRITTEN_BYTES = _deferred["SHM_WRITTEN_BYTES"]
FALLBACKS = _deferred["FALLBACKS"]
MATERIALIZE_FAILURES = _deferred["MATERIALIZE_FAILURES"]
MATERIALIZE_SECONDS = _deferred["MATERIALIZE_SECONDS"]
BROADCAST_SECONDS = _deferred["BROADCAST_SECONDS"]
BROADCAST_BYTES = _deferred["BROADCAST_BYTES"]
FANOUT_COPIES = _deferred["FANOUT_COPIES"]
REQUEST_FAILURES = _deferred["REQUEST_FAILURES"]
SEGMENTS_IN_USE = _deferred["SEGMENTS_IN_USE"]
BYTES_IN_USE = _deferred["BYTES_IN_USE"]
REAPED_SEGMENTS = _deferred["REAPED_SEGMENTS"]
REAPED_BYTES = _deferred["REAPED_BYTES"]
FREE_BYTES = _deferred["FREE_BYTES"]
DIR_SIZE_BYTES = _deferred["DIR_SIZE_BYTES"]
POOL_REQUESTS = _deferred["POOL_REQUESTS"]
POOL_DROPPED = _deferred["POOL_DROPPED"]
INTERNODE_BYTES = _deferred["INTERNODE_BYTES"]
IPC_SECONDS = _deferred["IPC_SECONDS"]
IPC_BYTES = _deferred["IPC_BYTES"]
OBSERVE_ERRORS = _deferred["OBSERVE_ERRORS"]
REFERENCES_HANDED = _deferred["REFERENCES_HANDED"]
PATH_ENABLED = _deferred["PATH_ENABLED"]
EPD_SAVES = _deferred["EPD_SAVES"]
EPD_LOADS = _deferred["EPD_LOADS"]
EPD_BYTES = _deferred["EPD_BYTES"]
EPD_FALLBACKS = _deferred["EPD_FALLBACKS"]
EPD_TRANSFER_SECONDS = _deferred["EPD_TRANSFER_SECONDS"]
EPD_LOOKUPS = _deferred["EPD_LOOKUPS"]
EPD_HELD_BYTES = _deferred["EPD_HELD_BYTES"]
ARENA_BYTES = _deferred["ARENA_BYTES"]
ARENA_IN_USE_BYTES = _deferred["ARENA_IN_USE_BYTES"]
ARENA_REGISTERED_BYTES = _deferred["ARENA_REGISTERED_BYTES"]
ARENA_REGISTRATIONS = _deferred["ARENA_REGISTRATIONS"]
ARENA_FALLBACKS = _deferred["ARENA_FALLBACKS"]
ARENA_VIEWS = _deferred["ARENA_VIEWS"]
ARENA_SETTLE_SECONDS = _deferred["ARENA_SETTLE_SECONDS"]
GPU_COPY_BYTES = _deferred["GPU_COPY_BYTES"]
GPU_COPY_SECONDS = _deferred["GPU_COPY_SECONDS"]
DEVICE_TENSORS = _deferred["DEVICE_TENSORS"]
_init_lock = threading.RLock()
_initialised = False
_multiprocess = False


def init() -> None:
    """Create mmshm's metrics now (idempotent, thread-safe). This imports
    prometheus-client, which fixes single-process or multiprocess mode for the
    whole process (see the module docstring)."""
    global _initialised, _multiprocess
    if _initialised:
        return
    with _init_lock:
        if _initialised:
            return
        from prometheus_client import Counter, Gauge, Histogram
        from prometheus_client import values as _values

        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        created = {}
        for attr, kind, name, doc, labels, opts in _SPECS:
            created[attr] = kinds[kind](name, doc, list(labels), **opts)
        for attr, (label, label_values) in _PREINIT.items():
            for v in label_values:
                created[attr].labels(**{label: v})
        for attr, axes in _PREINIT_GRID.items():
            for combo in itertools.product(*(values for _, values in axes)):
                created[attr].labels(**{name: v for (name, _), v in zip(axes, combo)})
        _multiprocess = _values.ValueClass is not _values.MutexValue
        if _multiprocess:
            _set_dir_gauges(created["FREE_BYTES"], created["DIR_SIZE_BYTES"])
        else:
            created["FREE_BYTES"].set_function(dir_free_bytes)
            created["DIR_SIZE_BYTES"].set_function(dir_size_bytes)
            if any(os.environ.get(v) for v in _MULTIPROC_ENV):
                log.warning("mmshm: PROMETHEUS_MULTIPROC_DIR is set but prometheus_client was "
                            "imported before it was set; mmshm's metrics stay in this process")
        for attr, metric in created.items():
            _deferred[attr]._real = metric
        globals().update(created)
        _initialised = True
    if _multiprocess:
        start_refresher()


def initialised() -> bool:
    """Whether the metrics exist yet (see :func:`init`)."""
    return _initialised


def multiprocess_enabled() -> bool:
    """Whether mmshm's metrics are written to ``PROMETHEUS_MULTIPROC_DIR``
    (creates the metrics first). True only if the variable was set when
    prometheus-client was imported, whatever the environment says now."""
    init()
    return _multiprocess


# -- segment directory space, read at scrape time ---------------------------
def _statvfs():
    from mmshm import config  # late: mmshm.metrics is imported while mmshm initialises

    try:
        return os.statvfs(config.get().dir)
    except OSError:
        return None


def dir_free_bytes() -> float:
    """Free bytes (available to unprivileged users) in the segment directory's
    file system, or NaN if it cannot be read. Never raises: it runs inside
    scrapes."""
    st = _statvfs()
    return float("nan") if st is None else float(st.f_bavail * st.f_frsize)


def dir_size_bytes() -> float:
    """Total bytes of the segment directory's file system, or NaN."""
    st = _statvfs()
    return float("nan") if st is None else float(st.f_blocks * st.f_frsize)


def _set_dir_gauges(free, size) -> None:
    st = _statvfs()
    if st is None:
        free.set(float("nan"))
        size.set(float("nan"))
    else:
        free.set(st.f_bavail * st.f_frsize)
        size.set(st.f_blocks * st.f_frsize)


def refresh() -> None:
    """Write the current ``mmshm_dir_*`` values into this process's
    multiprocess file. A no-op in single-process mode, where those gauges are
    function-valued and always current, and before :func:`init`."""
    if _initialised and _multiprocess:
        _set_dir_gauges(_deferred["FREE_BYTES"], _deferred["DIR_SIZE_BYTES"])


_refresher: threading.Thread | None = None
_refresher_lock = threading.Lock()


def _refresh_interval() -> float:
    """``MMSHM_METRICS_REFRESH_S`` (a bad value: a WARNING and the default)."""
    from mmshm import config

    return config.value("MMSHM_METRICS_REFRESH_S")


def _refresh_loop(interval: float) -> None:
    while True:
        try:
            refresh()
        except Exception as exc:  # noqa: BLE001 - a metrics thread must never die noisily
            log.debug("mmshm: refreshing metrics failed: %s", exc)
        time.sleep(interval)


def start_refresher() -> threading.Thread | None:
    """Start (once per process) the daemon thread that refreshes the
    ``mmshm_dir_*`` gauges in multiprocess mode. Returns it, or None in
    single-process mode or when ``MMSHM_METRICS_REFRESH_S`` is 0."""
    global _refresher
    if not multiprocess_enabled():
        return None
    interval = _refresh_interval()
    if interval <= 0:
        refresh()
        return None
    with _refresher_lock:
        if _refresher is None or not _refresher.is_alive():
            _refresher = threading.Thread(target=_refresh_loop, args=(interval,),
                                          name="mmshm-metrics-refresh", daemon=True)
            _refresher.start()
        return _refresher


#: prometheus-client's files of live gauges (``livesum``, ``livemax``, ...): ``gauge_live*_<pid>.db``
_LIVE_DB_RE = re.compile(r"gauge_live[a-z]*_([0-9]+)\.db\Z")


def multiproc_dir(env=None) -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` (or its lower-case spelling) of ``env``
    (default ``os.environ``), None when unset or empty."""
    env = os.environ if env is None else env
    return next((env[v] for v in _MULTIPROC_ENV if env.get(v)), None)


def _process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs any more: none exists, or only its
    zombie (killed, not yet waited for by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def mark_dead_processes(path: str | None = None) -> list[int]:
    """Drop the live gauges (``livesum``/``livemax``: segments and bytes in
    use, ``mmshm_path_enabled``, ...) of processes that no longer run from
    prometheus-client's multiprocess directory ``path`` (default
    ``PROMETHEUS_MULTIPROC_DIR``), with prometheus-client's
    ``multiprocess.mark_process_dead``, so that the merged exposition stops
    counting what a killed process had in use. Its counters and histograms
    stay (they count what happened). A pid is dead when no process has it
    or only its zombie; a pid reused by a live process keeps its files.

    Called by the reaper when it reclaims a killed holder's segments and by
    ``mmshm run`` once the server has exited. Returns the pids marked.
    Never raises (a directory that cannot be read marks nothing)."""
    path = path or multiproc_dir()
    if not path:
        return []
    try:
        names = os.listdir(path)
    except OSError:
        return []
    me = os.getpid()
    pids = {int(m.group(1)) for m in map(_LIVE_DB_RE.match, names) if m}
    dead = sorted(p for p in pids if p != me and _process_gone(p))
    if not dead:
        return []
    try:
        from prometheus_client.multiprocess import mark_process_dead
    except ImportError:  # pragma: no cover - a dependency of mmshm
        return []
    marked = []
    for pid in dead:
        try:
            mark_process_dead(pid, path)
            marked.append(pid)
        except OSError as exc:
            log.debug("mmshm: marking process %d dead in %s failed: %s", pid, path, exc)
    return marked


def _after_fork_in_child() -> None:
    global _refresher, _refresher_lock, _init_lock
    _refresher_lock = threading.Lock()
    _init_lock = threading.RLock()
    if _refresher is not None:  # the thread did not survive the fork
        _refresher = None
        try:
            start_refresher()
        except Exception as exc:  # noqa: BLE001 - never break a fork
            log.debug("mmshm: restarting the metrics refresher failed: %s", exc)


os.register_at_fork(after_in_child=_after_fork_in_child)

if "prometheus_client" in sys.modules or any(os.environ.get(v) for v in _MULTIPROC_ENV):
    init()  # the storage mode is already decided: nothing to wait for

# The exporter needs the objects above: it gets them through this module, handed
# over here (it imports nothing of the package, so the two make no import cycle).
from .exporter import (
    DEFAULT_ADDR,
    maybe_start_exporter_from_env,
    registry,
    render,
    start_exporter,
    stop_exporter,
)
from .exporter import attach as _attach_exporter

_attach_exporter(sys.modules[__name__])

__all__ = [
    "BROADCAST_BYTES",
    "BROADCAST_SECONDS",
    "BYTES_BUCKETS",
    "BYTES_IN_USE",
    "DEFAULT_ADDR",
    "DIR_SIZE_BYTES",
    "FAILURE_REASONS",
    "FALLBACKS",
    "FALLBACK_REASONS",
    "FANOUT_COPIES",
    "FREE_BYTES",
    "HANDED_PATHS",
    "INTERNODE_BYTES",
    "IPC_BYTES",
    "IPC_SECONDS",
    "LATENCY_BUCKETS",
    "MATERIALIZE_FAILURES",
    "MATERIALIZE_SECONDS",
    "OBSERVE_ERRORS",
    "PATH_ENABLED",
    "POOL_REQUESTS",
    "POOL_RESULTS",
    "REAPED_BYTES",
    "REFERENCES_HANDED",
    "REAPED_SEGMENTS",
    "REAP_REASONS",
    "REQUEST_FAILURES",
    "ROLES",
    "SEGMENTS_CREATED",
    "SEGMENTS_IN_USE",
    "SHM_WRITTEN_BYTES",
    "dir_free_bytes",
    "dir_size_bytes",
    "init",
    "initialised",
    "mark_dead_processes",
    "maybe_start_exporter_from_env",
    "multiproc_dir",
    "multiprocess_enabled",
    "refresh",
    "registry",
    "render",
    "start_exporter",
    "start_refresher",
    "stop_exporter",
]
