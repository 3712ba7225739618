"""Prometheus metrics of mmshm (prometheus-client).

All names are prefixed ``mmshm_`` and use base units. The core updates them
through the objects below; they land in prometheus-client's default registry
(and in ``PROMETHEUS_MULTIPROC_DIR`` when that is set before import).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# 100 us .. 10 s
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
# 1 KB .. 1 GB
BYTES_BUCKETS = tuple(float(10 ** e * m) for e in range(3, 9) for m in (1, 4)) + (1e9,)

SEGMENTS_CREATED = Counter(
    "mmshm_segments_created", "Shared-memory segments created.")
SHM_WRITTEN_BYTES = Counter(
    "mmshm_shm_written_bytes", "Payload bytes written into shared memory.")
FALLBACKS = Counter(
    "mmshm_inline_fallbacks",
    "Tensors that travelled inline because a segment could not be made.", ["reason"])
MATERIALIZE_FAILURES = Counter(
    "mmshm_materialize_failures", "Handles that could not be materialized.", ["reason"])
MATERIALIZE_SECONDS = Histogram(
    "mmshm_materialize_seconds", "Time to materialize one request's handles.",
    buckets=LATENCY_BUCKETS)
BROADCAST_SECONDS = Histogram(
    "mmshm_broadcast_seconds", "Time spent in the wrapped broadcast_pyobj call.", ["role"],
    buckets=LATENCY_BUCKETS)
BROADCAST_BYTES = Histogram(
    "mmshm_broadcast_bytes", "Pickled bytes carried by the wrapped broadcast (estimate).",
    ["role"], buckets=BYTES_BUCKETS)
FANOUT_COPIES = Counter(
    "mmshm_fanout_copies", "Request copies made by fan_out (parallel sampling).")
REQUEST_FAILURES = Counter(
    "mmshm_request_failures",
    "Requests turned into a per-request error by deferred_unwrap.", ["reason"])
SEGMENTS_IN_USE = Gauge(
    "mmshm_segments_in_use",
    "Segments created by this process that are not yet freed and closed.",
    multiprocess_mode="livesum")
BYTES_IN_USE = Gauge(
    "mmshm_shm_in_use_bytes",
    "Bytes of /dev/shm held by segments created by this process (header included).",
    multiprocess_mode="livesum")
REAPED_SEGMENTS = Counter(
    "mmshm_reaped_segments", "Orphaned segments (no live holder) reclaimed by the reaper.")
REAPED_BYTES = Counter(
    "mmshm_reaped_bytes", "Bytes of orphaned segments reclaimed by the reaper.")
FREE_BYTES = Gauge(
    "mmshm_dir_free_bytes", "Free bytes in the segment directory's file system (statvfs).",
    multiprocess_mode="mostrecent")
POOL_REQUESTS = Counter(
    "mmshm_pool_requests", "Segment pool lookups, by result (hit or miss).", ["result"])
