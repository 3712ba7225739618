"""mmshm's Prometheus metrics move exactly with their events.

Everything runs through the public core API in this process, with the segment
directory (``MMSHM_DIR``) pointed at a private temporary directory; values are
compared as deltas of prometheus-client's default registry. The multiprocess
test runs child processes with ``PROMETHEUS_MULTIPROC_DIR`` set and merges
their files with a ``MultiProcessCollector``.
"""

from __future__ import annotations

import errno
import gc
import math
import os
import pickle
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import mmshm
import mmshm.segments.segment
import pytest
import torch
from mmshm import config, metrics
from mmshm.segments.segfile import HEADER_SIZE
from mmshm.segments.table import TABLE
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.metrics import scrape
from tests.harness.segments import segment_files

REPO = Path(__file__).resolve().parents[1]
metrics.init()  # the samples read below exist (at 0) before any event


# -- helpers ------------------------------------------------------------------
def value(name: str, **labels: str) -> float:
    """Current value of one sample of the default registry (which must exist)."""
    v = REGISTRY.get_sample_value(name, labels)
    assert v is not None, f"no sample {name}{labels}"
    return v


class Delta:
    """Snapshot of several samples; ``d(name, **labels)`` is the change since."""

    def __init__(self, *keys):
        self.before = {k: value(k[0], **dict(k[1:])) for k in keys}

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, *sorted(labels.items()))
        return value(name, **labels) - self.before[key]


def k(name: str, **labels: str) -> tuple:
    return (name, *sorted(labels.items()))


SEG_KEYS = (k("mmshm_segments_created_total"), k("mmshm_shm_written_bytes_total"),
            k("mmshm_segments_in_use"), k("mmshm_shm_in_use_bytes"))
FALLBACK_KEYS = tuple(k("mmshm_inline_fallbacks_total", reason=r)
                      for r in metrics.FALLBACK_REASONS)


def assert_no_segments(d) -> None:
    gc.collect()
    TABLE.sweep()
    assert segment_files(d) == []


def tensors(*numels: int) -> list[torch.Tensor]:
    return [torch.arange(n, dtype=torch.float32) + i for i, n in enumerate(numels)]


@pytest.fixture
def private_dir(tmp_path, monkeypatch):
    """A private segment directory for this test; no segment may be left in it.
    (Runs after the conftest's autouse fixture, if any, and overrides its
    MMSHM_DIR.)"""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("MMSHM_DIR", str(d))
    monkeypatch.setenv("MMSHM_REAP_INTERVAL_S", "0")  # no automatic reaper passes
    monkeypatch.setenv("MMSHM_MIN_FREE_BYTES", "0")
    monkeypatch.delenv("MMSHM_MAX_BYTES", raising=False)
    monkeypatch.delenv("MMSHM_DISABLE", raising=False)
    config.reload()
    try:
        yield d
        assert_no_segments(d)
    finally:
        gc.collect()
        monkeypatch.undo()
        config.reload()


@pytest.fixture
def fallocate_fails(monkeypatch):
    """``fail(errno)`` makes ``posix_fallocate`` in mmshm.segments.segment raise that errno;
    monkeypatch puts the real one back."""

    def fail(code: int) -> None:
        def fake(fd, offset, length):
            raise OSError(code, f"{os.strerror(code)} (forced by the test)")

        monkeypatch.setattr(mmshm.segments.segment.os, "posix_fallocate", fake)

    return fail


# -- segments -------------------------------------------------------------------
def test_wrap_counts_segments_and_payload_bytes(private_dir, monkeypatch):
    from tests.harness.segments import one_segment_per_tensor

    one_segment_per_tensor(monkeypatch)  # the figures are per segment
    ts = tensors(20_000, 33_333, 70_001)
    payload = sum(t.numel() * t.element_size() for t in ts)
    d = Delta(*SEG_KEYS)

    obj = mmshm.wrap({"pixel_values": ts}, min_bytes=1)
    assert len(mmshm.handles(obj)) == 3
    assert len(segment_files(private_dir)) == 3
    assert d("mmshm_segments_created_total") == 3
    assert d("mmshm_shm_written_bytes_total") == payload
    assert d("mmshm_segments_in_use") == 3
    assert d("mmshm_shm_in_use_bytes") == payload + 3 * HEADER_SIZE

    out = mmshm.unwrap(obj)  # zero-copy views hold the references now
    del obj
    for a, b in zip(out["pixel_values"], ts):
        assert torch.equal(a, b)
    assert d("mmshm_segments_in_use") == 3

    del out, a, b
    gc.collect()
    assert d("mmshm_segments_in_use") == 0
    assert d("mmshm_shm_in_use_bytes") == 0
    assert d("mmshm_segments_created_total") == 3  # counters never go back
    assert segment_files(private_dir) == []


def test_release_returns_in_use_gauges_to_zero(private_dir):
    d = Delta(*SEG_KEYS)
    objs = [mmshm.wrap({"x": t}, min_bytes=1) for t in tensors(1000, 2000, 3000, 4000)]
    assert d("mmshm_segments_in_use") == 4
    for i, o in enumerate(objs):
        assert mmshm.release(o) == 1
        assert d("mmshm_segments_in_use") == 3 - i
    assert d("mmshm_shm_in_use_bytes") == 0
    assert d("mmshm_segments_created_total") == 4


def test_small_tensors_stay_inline_and_count_nothing(private_dir):
    d = Delta(*SEG_KEYS, *FALLBACK_KEYS)
    obj = mmshm.wrap({"x": torch.ones(10)}, min_bytes=1024)
    assert isinstance(obj["x"], torch.Tensor)
    for key in SEG_KEYS + FALLBACK_KEYS:
        assert d(key[0], **dict(key[1:])) == 0


# -- fan-out -------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 5])
def test_fan_out_counts_copies(private_dir, n):
    t = torch.arange(50_000, dtype=torch.float32)
    d = Delta(k("mmshm_fanout_copies_total"), *SEG_KEYS)
    copies = mmshm.fan_out({"mm_items": [{"feature": t}]}, n, min_bytes=1)
    assert len(copies) == n
    assert d("mmshm_fanout_copies_total") == n
    assert d("mmshm_segments_created_total") == 1  # one segment whatever n
    assert d("mmshm_shm_written_bytes_total") == t.numel() * 4
    for c in copies:
        assert torch.equal(mmshm.unwrap(c, copy=True)["mm_items"][0]["feature"], t)
    assert d("mmshm_segments_in_use") == 0


# -- inline fallbacks -------------------------------------------------------------------
def test_forced_enospc_fallbacks_counted_exactly(private_dir, fallocate_fails):
    fallocate_fails(errno.ENOSPC)
    n = 7
    d = Delta(*SEG_KEYS, *FALLBACK_KEYS)
    ts = tensors(*range(10_000, 10_000 + n))
    for t in ts:
        out = mmshm.wrap({"pixel_values": t}, min_bytes=1)
        assert out["pixel_values"] is t  # travels inline
    assert d("mmshm_inline_fallbacks_total", reason="enospc") == n
    for r in ("budget", "emfile", "other"):
        assert d("mmshm_inline_fallbacks_total", reason=r) == 0
    for key in SEG_KEYS:
        assert d(key[0]) == 0
    assert segment_files(private_dir) == []  # nothing half-made is left behind


@pytest.mark.parametrize("code, reason", [(errno.EMFILE, "emfile"), (errno.EIO, "other")])
def test_other_fallback_reasons(private_dir, fallocate_fails, code, reason):
    fallocate_fails(code)
    d = Delta(*FALLBACK_KEYS)
    out = mmshm.wrap({"a": tensors(5000, 6000)}, min_bytes=1)
    assert all(isinstance(x, torch.Tensor) for x in out["a"])
    for r in metrics.FALLBACK_REASONS:
        assert d("mmshm_inline_fallbacks_total", reason=r) == (2 if r == reason else 0)


def test_budget_fallback_counted(private_dir, monkeypatch):
    monkeypatch.setenv("MMSHM_MAX_BYTES", "1")  # any segment is over this process's cap
    config.reload()
    d = Delta(*SEG_KEYS, *FALLBACK_KEYS)
    for t in tensors(4096, 8192, 3):
        assert isinstance(mmshm.wrap({"t": t}, min_bytes=1)["t"], torch.Tensor)
    assert d("mmshm_inline_fallbacks_total", reason="budget") == 3
    assert d("mmshm_inline_fallbacks_total", reason="enospc") == 0
    assert d("mmshm_segments_created_total") == 0


# -- broadcast and materialize ------------------------------------------------------------
BCAST_KEYS = tuple(
    k(f"mmshm_broadcast_{m}_{s}", role=r)
    for m in ("seconds", "bytes") for s in ("count", "sum") for r in metrics.ROLES
) + (k("mmshm_materialize_seconds_count"),)


def test_broadcast_histograms_observe_by_role(private_dir):
    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    ts = tensors(40_000, 50_000)
    d = Delta(*BCAST_KEYS)

    out = bcast([mmshm.wrap({"pixel_values": t}, min_bytes=1) for t in ts], 0)  # rank 0 = src
    assert [torch.equal(o["pixel_values"], t) for o, t in zip(out, ts)] == [True, True]
    del out
    assert d("mmshm_broadcast_seconds_count", role="src") == 1
    assert d("mmshm_broadcast_seconds_sum", role="src") >= 0
    assert d("mmshm_broadcast_bytes_count", role="src") == 1
    assert d("mmshm_broadcast_bytes_sum", role="src") > 0
    assert d("mmshm_materialize_seconds_count") == 1
    for m in ("seconds", "bytes"):
        assert d(f"mmshm_broadcast_{m}_count", role="dst") == 0

    for _ in range(3):  # rank 1, src 0: the receiving role (world 1: data passes through)
        out = bcast([mmshm.wrap({"pixel_values": ts[0]}, min_bytes=1)], 1, None, 0)
        assert torch.equal(out[0]["pixel_values"], ts[0])
        del out
    assert d("mmshm_broadcast_seconds_count", role="dst") == 3
    assert d("mmshm_broadcast_bytes_count", role="dst") == 3
    assert d("mmshm_broadcast_seconds_count", role="src") == 1
    assert d("mmshm_materialize_seconds_count") == 4

    bcast([{"input_ids": [1, 2, 3]}], 0)  # nothing to materialize
    assert d("mmshm_broadcast_seconds_count", role="src") == 2
    assert d("mmshm_materialize_seconds_count") == 4
    gc.collect()


def test_materialize_failure_counted_by_reason(private_dir):
    h = mmshm.ShmTensor.from_tensor(torch.arange(30_000, dtype=torch.float32))
    h.share(1)  # the reference travelling in the pickle below
    blob = pickle.dumps([{"pixel_values": h}])
    name = h.name
    h.release()
    mmshm.segments.segment.update_refcount(name, -1)  # unlinked before the receiver opened it
    assert segment_files(private_dir) == []
    keys = [k("mmshm_materialize_failures_total", reason=r) for r in metrics.FAILURE_REASONS]
    keys += [k("mmshm_request_failures_total", reason=r) for r in metrics.FAILURE_REASONS]
    d = Delta(*keys)

    out = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)(pickle.loads(blob), 0)
    assert isinstance(out[0], mmshm.MaterializeError)
    assert out[0].reason == "not_found"
    for r in metrics.FAILURE_REASONS:
        want = 1 if r == "not_found" else 0
        assert d("mmshm_materialize_failures_total", reason=r) == want
        assert d("mmshm_request_failures_total", reason=r) == want


def test_failure_reason_labels_match_the_core():
    from mmshm.transport import broadcast

    assert set(metrics.FAILURE_REASONS) == set(broadcast.REASONS) - {"ok"}


# -- reaper -----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_reaper_counts_orphans_and_bytes(private_dir):
    # A process that dies without releasing leaves its segments behind.
    code = ("import os, mmshm.segments.segment as s\n"
            "for n in (1000, 50000, 123457):\n"
            "    s.create(n)\n"
            "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=os.environ.copy())
    names = segment_files(private_dir)
    assert len(names) == 3
    size = sum(os.stat(private_dir / n).st_size for n in names)
    assert size == 3 * HEADER_SIZE + 1000 + 50000 + 123457
    keys = [k(f"mmshm_reaped_{what}_total", reason=r)
            for what in ("segments", "bytes") for r in ("killed", "in_flight_expired")]
    d = Delta(*keys)
    from mmshm.segments import reaper

    rep = reaper.reap(str(private_dir))
    assert rep.reclaimed == 3 and rep.reasons == {"killed": 3, "in_flight_expired": 0}
    # os._exit: no clean close, so "killed"
    assert d("mmshm_reaped_segments_total", reason="killed") == 3
    assert d("mmshm_reaped_bytes_total", reason="killed") == size
    assert d("mmshm_reaped_segments_total", reason="in_flight_expired") == 0
    assert segment_files(private_dir) == []
    reaper.reap(str(private_dir))  # nothing left: nothing counted
    assert d("mmshm_reaped_segments_total", reason="killed") == 3


# -- free space in the segment directory ----------------------------------------------------
needs_single_process = pytest.mark.skipif(
    metrics.multiprocess_enabled(), reason="function-valued gauges: single-process mode only")


@needs_single_process
def test_free_bytes_is_statvfs_of_mmshm_dir(private_dir):
    st = os.statvfs(private_dir)
    assert value("mmshm_dir_size_bytes") == st.f_blocks * st.f_frsize
    free = value("mmshm_dir_free_bytes")
    assert abs(free - st.f_bavail * st.f_frsize) <= 64 << 20  # other writers on the disk


@needs_single_process
def test_free_bytes_is_read_at_scrape_time(private_dir, tmp_path, monkeypatch):
    real = os.statvfs
    other = tmp_path / "other"
    other.mkdir()
    fake = {str(private_dir): [1000, 4096, 50], str(other): [7, 4096, 8]}  # bavail, frsize, blocks

    def statvfs(path):
        if str(path) in fake:
            bavail, frsize, blocks = fake[str(path)]
            return os.statvfs_result((frsize, frsize, blocks, bavail, bavail, 0, 0, 0, 0, 255))
        return real(path)

    monkeypatch.setattr(metrics.os, "statvfs", statvfs)
    assert value("mmshm_dir_free_bytes") == 1000 * 4096
    assert value("mmshm_dir_size_bytes") == 50 * 4096
    fake[str(private_dir)][0] = 3  # space used up between two scrapes: no update call needed
    assert value("mmshm_dir_free_bytes") == 3 * 4096
    assert b"mmshm_dir_free_bytes 12288.0" in metrics.render()

    monkeypatch.setenv("MMSHM_DIR", str(other))  # follows the configured directory
    config.reload()
    assert value("mmshm_dir_free_bytes") == 7 * 4096
    monkeypatch.setenv("MMSHM_DIR", str(tmp_path / "missing"))
    config.reload()
    assert math.isnan(value("mmshm_dir_free_bytes"))  # never breaks a scrape
    assert b"mmshm_dir_free_bytes NaN" in metrics.render()


# -- exposition -------------------------------------------------------------------------------
COUNTERS = {"mmshm_segments_created", "mmshm_shm_written_bytes", "mmshm_inline_fallbacks",
            "mmshm_materialize_failures", "mmshm_fanout_copies", "mmshm_request_failures",
            "mmshm_reaped_segments", "mmshm_reaped_bytes", "mmshm_pool_requests",
            "mmshm_pool_dropped",
            "mmshm_internode_bytes", "mmshm_references_handed", "mmshm_observe_errors",
            "mmshm_epd_saves", "mmshm_epd_loads", "mmshm_epd_bytes", "mmshm_epd_fallbacks",
            "mmshm_epd_lookups",
            "mmshm_arena_registrations", "mmshm_arena_fallbacks", "mmshm_arena_views",
            "mmshm_gpu_copy_bytes", "mmshm_device_tensors"}
GAUGES = {"mmshm_segments_in_use", "mmshm_shm_in_use_bytes", "mmshm_dir_free_bytes",
          "mmshm_dir_size_bytes", "mmshm_path_enabled", "mmshm_arena_bytes",
          "mmshm_arena_in_use_bytes", "mmshm_arena_registered_bytes", "mmshm_epd_held_bytes"}
HISTOGRAMS = {"mmshm_materialize_seconds", "mmshm_broadcast_seconds", "mmshm_broadcast_bytes",
              "mmshm_ipc_seconds", "mmshm_ipc_bytes", "mmshm_epd_transfer_seconds",
              "mmshm_gpu_copy_seconds", "mmshm_arena_settle_seconds"}
#: Families whose labels (server, hop...) come with their first event: no series
#: until an instrumented server process makes one.
FIRST_USE = {"mmshm_path_enabled", "mmshm_ipc_seconds", "mmshm_ipc_bytes",
             "mmshm_observe_errors"}


def mmshm_families(text: str) -> dict:
    """mmshm's families in an exposition, without the ``<name>_created`` gauges
    that prometheus-client adds next to counters and histograms."""
    fams = {f.name: f for f in text_string_to_metric_families(text)
            if f.name.startswith("mmshm_")}
    return {n: f for n, f in fams.items()
            if not (n.endswith("_created") and n[: -len("_created")] in fams)}


def test_exposition_names_types_and_buckets():
    fams = mmshm_families(metrics.render().decode())
    assert {n: f.type for n, f in fams.items()} == (
        {n: "counter" for n in COUNTERS} | {n: "gauge" for n in GAUGES}
        | {n: "histogram" for n in HISTOGRAMS})
    for name, fam in fams.items():
        assert fam.documentation
        if fam.type == "counter":
            assert {s.name for s in fam.samples} <= {name + "_total", name + "_created"}
        if fam.type == "histogram":
            assert name.endswith(("_seconds", "_bytes"))
            want = metrics.LATENCY_BUCKETS if name.endswith("_seconds") else metrics.BYTES_BUCKETS
            les = {float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket")}
            assert les == set(want) | {math.inf} or (not les and name in FIRST_USE), name
    assert metrics.LATENCY_BUCKETS[0] == 1e-4 and metrics.LATENCY_BUCKETS[-1] == 10.0
    assert metrics.BYTES_BUCKETS[0] == 1e3 and metrics.BYTES_BUCKETS[-1] == 1e9
    assert list(metrics.LATENCY_BUCKETS) == sorted(metrics.LATENCY_BUCKETS)
    assert list(metrics.BYTES_BUCKETS) == sorted(metrics.BYTES_BUCKETS)


def test_label_values_are_preinitialised():
    fams = mmshm_families(metrics.render().decode())

    def labels(fam, key, suffix):
        return {s.labels[key] for s in fams[fam].samples if s.name == fam + suffix}

    assert labels("mmshm_inline_fallbacks", "reason", "_total") == {
        "enospc", "budget", "emfile", "other", "group"}
    assert labels("mmshm_materialize_failures", "reason", "_total") == set(
        metrics.FAILURE_REASONS)
    assert labels("mmshm_request_failures", "reason", "_total") == set(metrics.FAILURE_REASONS)
    assert labels("mmshm_pool_requests", "result", "_total") == {"hit", "miss"}
    for fam in ("mmshm_broadcast_seconds", "mmshm_broadcast_bytes"):
        assert labels(fam, "role", "_count") == {"src", "dst"}


# -- exporter ---------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_start_exporter_serves_render(private_dir):
    metrics.stop_exporter()
    srv = metrics.start_exporter(0)
    try:
        assert srv.server_address[0] == "127.0.0.1"
        assert metrics.start_exporter(0) is srv  # once per process
        mmshm.release(mmshm.wrap({"x": torch.ones(1000)}, min_bytes=1))
        body = scrape(srv.server_port)
        created = value("mmshm_segments_created_total")
        assert f"mmshm_segments_created_total {created}" in body
        assert set(mmshm_families(body)) == COUNTERS | GAUGES | HISTOGRAMS
    finally:
        metrics.stop_exporter()


@pytest.mark.timeout(60)
def test_maybe_start_exporter_from_env(monkeypatch):
    metrics.stop_exporter()
    monkeypatch.delenv("MMSHM_METRICS_PORT", raising=False)
    monkeypatch.delenv("MMSHM_METRICS_ADDR", raising=False)
    assert metrics.maybe_start_exporter_from_env() is None
    monkeypatch.setenv("MMSHM_METRICS_PORT", "not-a-port")
    assert metrics.maybe_start_exporter_from_env() is None
    with socket.socket() as busy:  # the port is taken: log, never raise
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MMSHM_METRICS_PORT", str(busy.getsockname()[1]))
        assert metrics.maybe_start_exporter_from_env() is None
    monkeypatch.setenv("MMSHM_METRICS_PORT", "0")
    monkeypatch.setenv("MMSHM_METRICS_ADDR", "127.0.0.1")
    srv = metrics.maybe_start_exporter_from_env()
    try:
        assert srv is not None
        assert "mmshm_inline_fallbacks_total" in scrape(srv.server_port)
    finally:
        metrics.stop_exporter()


# -- multiprocess mode --------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import errno, gc, os, sys
    import torch
    import mmshm, mmshm.segments.segment
    from mmshm import metrics
    assert metrics.multiprocess_enabled()
    n_seg, n_fallback, numel = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    held = [mmshm.wrap({"pixel_values": torch.full((numel,), float(i))}, min_bytes=1)
            for i in range(n_seg)]
    real = os.posix_fallocate
    def enospc(*a):
        raise OSError(errno.ENOSPC, "forced")
    mmshm.segments.segment.os.posix_fallocate = enospc
    for i in range(n_fallback):
        mmshm.wrap({"x": torch.ones(numel)}, min_bytes=1)
    mmshm.segments.segment.os.posix_fallocate = real
    print("HELD", flush=True)
    sys.stdin.readline()  # the parent looks at the gauges while the segments are held
    for o in held:
        mmshm.release(o)
    del held
    gc.collect()
    print("DONE", flush=True)
""")


def _child_env(mpdir, shm) -> dict:
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    env.update(PROMETHEUS_MULTIPROC_DIR=str(mpdir), MMSHM_DIR=str(shm),
               MMSHM_REAP_INTERVAL_S="0", MMSHM_MIN_FREE_BYTES="0")
    return env


@pytest.mark.timeout(180)
def test_multiprocess_collector_sums_processes(tmp_path):
    mpdir, shm = tmp_path / "prom", tmp_path / "shm"
    mpdir.mkdir()
    shm.mkdir()
    env = _child_env(mpdir, shm)
    plan = [(3, 2, 1000), (5, 4, 3000)]  # segments, forced ENOSPC fallbacks, float32 numel
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, *map(str, p)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for p in plan]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "HELD"
        reg = CollectorRegistry()
        MultiProcessCollector(reg, path=str(mpdir))

        def get(name, **labels):
            v = reg.get_sample_value(name, labels)
            assert v is not None, name
            return v

        n_seg = sum(p[0] for p in plan)
        payload = sum(p[0] * p[2] * 4 for p in plan)
        assert get("mmshm_segments_created_total") == n_seg
        assert get("mmshm_shm_written_bytes_total") == payload
        assert get("mmshm_inline_fallbacks_total", reason="enospc") == sum(p[1] for p in plan)
        assert get("mmshm_inline_fallbacks_total", reason="budget") == 0
        assert get("mmshm_segments_in_use") == n_seg  # livesum over the live processes
        assert get("mmshm_shm_in_use_bytes") == payload + n_seg * HEADER_SIZE
        free = get("mmshm_dir_free_bytes")  # mostrecent: one series, not one per process
        st = os.statvfs(shm)
        assert 0 < free <= st.f_blocks * st.f_frsize
        assert get("mmshm_dir_size_bytes") == st.f_blocks * st.f_frsize

        for p in procs:
            out, _ = p.communicate("\n", timeout=60)
            assert p.returncode == 0 and out.strip() == "DONE"
        assert get("mmshm_segments_in_use") == 0
        assert get("mmshm_shm_in_use_bytes") == 0
        assert get("mmshm_segments_created_total") == n_seg
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert segment_files(shm) == []

    # render() in multiprocess mode serves the merged series (an exporter side-car).
    out = subprocess.run([sys.executable, "-m", "mmshm.metrics", "--once"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    fams = mmshm_families(out)
    # mmshm_path_enabled has samples only from processes an instrumentor ran in
    assert set(fams) == (COUNTERS | GAUGES | HISTOGRAMS) - FIRST_USE
    created = [s.value for s in fams["mmshm_segments_created"].samples]
    assert created == [n_seg]
    assert next(s.value for s in fams["mmshm_dir_free_bytes"].samples) > 0


@pytest.mark.timeout(120)
def test_metrics_wait_for_a_server_that_sets_multiproc_dir_late(tmp_path):
    """SGLang sets PROMETHEUS_MULTIPROC_DIR during start-up, after mmshm may
    have been imported by its start-up hook. mmshm must not import
    prometheus-client before that (it would fix single-process mode for the
    server's own metrics too): the metrics are created on first use."""
    mpdir, shm = tmp_path / "prom", tmp_path / "shm"
    mpdir.mkdir()
    shm.mkdir()
    env = _child_env(mpdir, shm)
    del env["PROMETHEUS_MULTIPROC_DIR"]
    code = textwrap.dedent(f"""
        import os, sys
        import torch
        import mmshm
        from mmshm import metrics
        assert "prometheus_client" not in sys.modules
        assert not metrics.initialised()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(mpdir)!r}  # the server's start-up
        from prometheus_client import Counter
        server_metric = Counter("server_requests", "A metric of the server itself.")
        server_metric.inc(2)
        for i in range(3):
            mmshm.release(mmshm.wrap({{"x": torch.ones(4096)}}, min_bytes=1))
        assert metrics.multiprocess_enabled()
    """)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(mpdir))
    assert reg.get_sample_value("server_requests_total") == 2
    assert reg.get_sample_value("mmshm_segments_created_total") == 3
    assert reg.get_sample_value("mmshm_inline_fallbacks_total", {"reason": "enospc"}) == 0
    assert segment_files(shm) == []


# -- killed processes' live gauges -------------------------------------------------------------
HOLDER = textwrap.dedent("""
    import signal, sys, os
    import torch
    from mmshm import ShmTensor, metrics
    assert metrics.multiprocess_enabled()
    h = ShmTensor.from_tensor(torch.ones(1 << 14))   # mmshm_segments_in_use: livesum
    print("HELD", flush=True)
    sys.stdin.readline()
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
""")


def _merged(mpdir, name: str) -> float | None:
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(mpdir))
    return reg.get_sample_value(name)


def _killed_holder(mpdir, shm_dir, how: str = "kill") -> int:
    """A child with PROMETHEUS_MULTIPROC_DIR that holds one segment, SIGKILLed
    (waited for); returns its pid. Its live gauges are still merged."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, how], env=_child_env(mpdir, shm_dir),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "HELD"
        assert _merged(mpdir, "mmshm_segments_in_use") == 1
        p.communicate("\n", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -9
    return p.pid


@pytest.mark.timeout(120)
def test_reaper_drops_the_live_gauges_of_a_killed_holder(tmp_path, shm_dir, monkeypatch):
    """A SIGKILLed process's livesum gauges (segments and bytes in use) leave
    the merged exposition once the reaper finds its segment killed."""
    from mmshm.segments import reaper

    mpdir = tmp_path / "prom"
    mpdir.mkdir()
    pid = _killed_holder(mpdir, shm_dir)
    # still there: nothing told prometheus-client the process died
    assert _merged(mpdir, "mmshm_segments_in_use") == 1
    assert _merged(mpdir, "mmshm_shm_in_use_bytes") == HEADER_SIZE + (1 << 16)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mpdir))
    rep = reaper.reap(shm_dir)
    assert rep.reasons["killed"] == 1
    assert _merged(mpdir, "mmshm_segments_in_use") in (None, 0)
    assert _merged(mpdir, "mmshm_shm_in_use_bytes") in (None, 0)
    assert not list(mpdir.glob(f"gauge_live*_{pid}.db"))
    assert _merged(mpdir, "mmshm_segments_created_total") == 1  # counters stay
