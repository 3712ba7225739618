"""The encoder cache's cross-node leg (mmshm.transport.ec_store) against a real
``mooncake_master`` on 127.0.0.1: an encoder on simulated node A and two PD
instances on simulated node B (each node a mount namespace with its own
/dev/shm), faults (bad records, a truncated payload, the master killed, a master
that answers garbage), the engine's library missing, and bad settings."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from mmshm import metrics
from mmshm.transport import ec_store
from tests.harness.mooncake import Master, kill_group
from tests.harness.shm import unshare_reason

try:
    ec_store.load_engine()
    ENGINE_MISSING = None
except (ImportError, OSError) as exc:
    ENGINE_MISSING = f"the Mooncake engine cannot be loaded ({exc}): {ec_store._FIX_ENGINE}"


needs_engine = pytest.mark.skipif(ENGINE_MISSING is not None, reason=str(ENGINE_MISSING))


@pytest.fixture
def master():
    m = Master().start()
    try:
        yield m
    finally:
        m.kill()


# -- the children ---------------------------------------------------------------------------
# One script, a role per run; prints one JSON line "RESULT {...}" at the end.
CHILD = r'''
import json, os, subprocess, sys, time
import torch
from mmshm.transport import ec_store
from mmshm.transport.encoder_cache import EncoderCache, content_key

role, extra = sys.argv[1], json.loads(sys.argv[2])
N, ROWS, WIDTH = 3, 600, 3584

def item(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(ROWS, WIDTH, generator=g).to(torch.bfloat16)

def key(i):
    return content_key(f"image {i}", "model")

def done(**kw):
    print("RESULT " + json.dumps(kw), flush=True)

if role == "encoder":
    cache = EncoderCache(keep_s=60, namespace="model")
    tier = ec_store.from_config(extra)
    assert tier.wait_connected(10)
    for i in range(N):
        assert cache.save(key(i), item(i)).published
        assert tier.put(key(i), item(i))
    assert tier.flush(20)
    print("READY " + json.dumps(tier.stats), flush=True)
    sys.stdin.readline()  # the PD node has read what it needs
    tier.close()
    cache.close()
    done(stats=tier.stats)
elif role in ("pd", "pd2"):
    cache = EncoderCache(keep_s=60, namespace="model")
    tier = ec_store.from_config(extra)
    assert tier.wait_connected(10)
    equal = []
    for i in range(N):
        e = ec_store.load_through(cache, tier, key(i), torch.bfloat16, ROWS)
        if e is None:
            equal.append(None)
            continue
        t = e.load()
        equal.append(bool(torch.equal(t, item(i))))
        del t
        e.release()
    second = None
    if role == "pd":  # a second PD instance on this node, while this one keeps its entries
        out = subprocess.run([sys.executable, "-c", sys.argv[3], "pd2", sys.argv[2]],
                             capture_output=True, text=True, timeout=60)
        lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        second = json.loads(lines[-1][7:]) if lines else {"rc": out.returncode,
                                                          "err": out.stderr[-2000:]}
    tier.close()
    cache.close()
    done(equal=equal, stats=tier.stats, second=second)
elif role == "faults":
    from mmshm.segments import codec
    from mmshm.metrics import EPD_FALLBACKS
    cache = EncoderCache(keep_s=60, namespace="model")
    tier = ec_store.from_config(extra)
    assert tier.wait_connected(10)
    raw = tier._store
    good = item(0)
    payload = good.reshape(-1).view(torch.uint8).numpy()
    digest = ec_store.payload_digest(key(0), payload.nbytes, lambda o, n: payload[o:o + n])
    bf16 = codec.dtype_code(torch.bfloat16)
    def rec(k, **kw):
        d = dict(key=k, dtype=bf16, shape=(ROWS, WIDTH), nbytes=payload.nbytes, gen=1,
                 digest=digest)
        d.update(kw)
        return ec_store.record_bytes(ec_store._Record(**d))
    bad = {  # key index -> (head, payload)
        1: (rec(key(0)), payload),                                  # names other content
        2: (rec(key(2), dtype=codec.dtype_code(torch.float16)), payload),  # another dtype
        3: (rec(key(3)), payload[: payload.nbytes // 2]),           # payload cut short
        4: (rec(key(4)), payload.copy()),                           # another payload
        5: (b"\0" * ec_store.RECORD_BYTES, payload),                # no record at all
    }
    bad[4][1][:4096] ^= 0xFF
    for i, (head, body) in bad.items():
        assert raw.put_parts(tier.store_key(key(i)), head, body) == 0, i
    before = {r: EPD_FALLBACKS.labels(server="vllm", reason="store_" + r)._value.get()
              for r in ec_store.MISS_REASONS}
    got = {i: ec_store.load_through(cache, tier, key(i), torch.bfloat16, ROWS)
           for i in [1, 2, 3, 4, 5, 6]}                             # 6: never put
    assert tier.put(key(0), good) and tier.flush(10)
    ok = tier.fetch(key(0), torch.bfloat16, ROWS)
    wrong_rows = tier.fetch(key(0), torch.bfloat16, ROWS + 1)
    after = {r: EPD_FALLBACKS.labels(server="vllm", reason="store_" + r)._value.get()
             for r in ec_store.MISS_REASONS}
    published = sorted(os.listdir("/dev/shm"))
    tier.close()
    cache.close()
    done(none=[v is None for v in got.values()], stats=tier.stats, published=published,
         counted={r: after[r] - before[r] for r in after},
         ok=ok is not None and bool(torch.equal(ok, good)), wrong_rows=wrong_rows is None)
elif role == "killed":
    tier = ec_store.from_config(extra)
    assert tier.wait_connected(10)
    assert tier.put(key(0), item(0)) and tier.flush(10)
    first = tier.fetch(key(0), torch.bfloat16, ROWS)
    print("READY", flush=True)
    sys.stdin.readline()  # the master is gone now
    times, got = [], []
    for i in range(3):
        t0 = time.monotonic()
        got.append(tier.fetch(key(0), torch.bfloat16, ROWS) is None)
        times.append(time.monotonic() - t0)
    put = tier.put(key(1), item(1))
    tier.flush(10)
    t0 = time.monotonic()
    tier.close(timeout=2)  # the engine's own close would retry the dead master for seconds
    close_s = time.monotonic() - t0
    done(first=first is not None and bool(torch.equal(first, item(0))), missed=got,
         times=times, stats=tier.stats, close_s=close_s)
    os._exit(0)  # the engine's client may retry a dead master in its own threads
elif role == "garbage":
    tier = ec_store.from_config(extra)
    times, got = [], []
    for i in range(3):
        t0 = time.monotonic()
        got.append(tier.fetch(key(0), torch.bfloat16, ROWS) is None)
        times.append(time.monotonic() - t0)
    done(missed=got, times=times, stats=tier.stats)
    os._exit(0)
'''


def _node(script_role: str, extra: dict, *, node: bool = True, stdin=None) -> subprocess.Popen:
    """A child running CHILD's role, in a mount namespace with its own 256 MiB
    /dev/shm when ``node`` (it prints ``LEFT:<files>`` of that /dev/shm after
    the child exits), in a process group of its own."""
    env = dict(os.environ, MMSHM_DIR="/dev/shm", PYTHONUNBUFFERED="1",
               GLOG_minloglevel="2")
    argv = [sys.executable, "-c", CHILD, script_role, json.dumps(extra), CHILD]
    if node:
        argv = ["unshare", "-m", "sh", "-c",
                'mount --make-rprivate / && mount -t tmpfs -o size=256m tmpfs /dev/shm && '
                '"$0" "$@"; rc=$?; echo "LEFT:$(ls -A /dev/shm | tr "\\n" " ")"; exit $rc',
                *argv]
    return subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=os.getcwd(),
                            start_new_session=True)


def _read_until(p: subprocess.Popen, prefix: str, timeout: float) -> str:
    """The first stdout line of ``p`` starting with ``prefix`` (its rest)."""
    box: list[str] = []

    def reader():
        for line in p.stdout:
            if line.startswith(prefix):
                box.append(line[len(prefix):].strip())
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        kill_group(p)
        pytest.fail(f"no {prefix!r} line within {timeout} s; stderr: "
                    f"{p.stderr.read()[-3000:]}")
    return box[0]


def _finish(p: subprocess.Popen, timeout: float = 60) -> tuple[dict, str | None]:
    """The child's RESULT and, for a node, what was left in its /dev/shm."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(p)
        pytest.fail(f"child still running after {timeout} s")
    lines = out.splitlines()
    res = [ln for ln in lines if ln.startswith("RESULT ")]
    left = [ln[5:].strip() for ln in lines if ln.startswith("LEFT:")]
    assert res, f"rc={p.returncode}; stdout: {out[-2000:]}; stderr: {err[-3000:]}"
    return json.loads(res[-1][7:]), (left[-1] if left else None)


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("mmshm")}


# -- two nodes ---------------------------------------------------------------------------
@needs_engine
@pytest.mark.timeout(120)
def test_encoder_on_node_a_pd_on_node_b_equal_bytes_and_second_pd_hits_locally(master):
    if unshare_reason():
        pytest.skip(unshare_reason())
    host_before = _shm_names()
    enc = _node("encoder", master.extra(), stdin=subprocess.PIPE)
    pd = None
    try:
        put = json.loads(_read_until(enc, "READY ", 60))
        assert put["puts"] == 3 and put["put_bytes"] == 3 * 600 * 3584 * 2
        pd = _node("pd", master.extra())
        got, pd_left = _finish(pd)
        enc.stdin.write("done\n")
        enc.stdin.flush()
        _, enc_left = _finish(enc)
    finally:
        for p in (enc, pd):
            if p is not None:
                kill_group(p)
    # node B's first PD read every output across nodes, bytes equal
    assert got["equal"] == [True, True, True]
    assert got["stats"]["gets"] == 3 and got["stats"]["get_bytes"] == 3 * 600 * 3584 * 2
    # the second PD of node B found them in node B's shared memory: no Store get at all
    assert got["second"]["equal"] == [True, True, True], got["second"]
    assert got["second"]["stats"]["gets"] == 0 and got["second"]["stats"]["get_bytes"] == 0
    assert not any(v for k, v in got["second"]["stats"].items() if k.startswith("miss_"))
    # nothing left on either node, nor on the host
    assert pd_left == "" and enc_left == ""
    assert _shm_names() == host_before


# -- faults ------------------------------------------------------------------------------
@needs_engine
@pytest.mark.timeout(90)
def test_bad_records_and_short_payload_are_counted_misses_never_loaded(master):
    if unshare_reason():
        pytest.skip(unshare_reason())
    p = _node("faults", master.extra())
    try:
        got, left = _finish(p)
    finally:
        kill_group(p)
    assert got["none"] == [True] * 6  # every bad object and the absent one: encode here
    assert got["published"] == []  # nothing saved locally from a bad object
    assert got["counted"] == {"absent": 1, "unreachable": 0, "timeout": 0, "short": 0,
                              "record_mismatch": 5, "digest": 1, "register": 0}, got["counted"]
    assert got["stats"]["miss_record_mismatch"] == 5 and got["stats"]["miss_digest"] == 1
    assert got["ok"] and got["wrong_rows"]  # a good object still reads; other rows: a miss
    assert left == ""


@needs_engine
@pytest.mark.timeout(120)
def test_encoder_node_killed_its_objects_go_with_it_and_pd_misses_counted(master):
    """The encoder's node SIGKILLed after its puts (its Store objects live in
    its own segment, docs/epd-nodes.md): PD on node B finds none of them,
    each a miss counted by its reason within the connector's bound, nothing
    partial published, nothing left on node B; the master lives on."""
    if unshare_reason():
        pytest.skip(unshare_reason())
    enc = _node("encoder", master.extra(), stdin=subprocess.PIPE)
    pd = None
    try:
        put = json.loads(_read_until(enc, "READY ", 60))
        assert put["puts"] == 3
        kill_group(enc)
        t0 = time.monotonic()
        pd = _node("pd2", master.extra(store_timeout_s=2.0))
        got, pd_left = _finish(pd, timeout=90)
        wall = time.monotonic() - t0
    finally:
        for p in (enc, pd):
            if p is not None:
                kill_group(p)
    assert got["equal"] == [None, None, None], got  # no bytes of a dead node, none partial
    s = got["stats"]
    missed = {k: v for k, v in s.items() if k.startswith("miss_") and v}
    assert sum(missed.values()) == 3, s  # each item one counted miss (absent, short, timeout)
    assert s["gets"] == 0 and s["get_bytes"] == 0, s
    assert pd_left == "", pd_left  # nothing published or left on node B
    # bounded: a start, 3 lookups of at most 2 x store_timeout_s each, a close
    assert wall < 60, wall
    assert master.proc.poll() is None


@needs_engine
@pytest.mark.timeout(90)
def test_master_killed_is_a_bounded_counted_miss(master):
    p = _node("killed", master.extra(store_timeout_s=1.0), node=False, stdin=subprocess.PIPE)
    try:
        _read_until(p, "READY", 60)
        master.kill()
        p.stdin.write("go\n")
        p.stdin.flush()
        got, _ = _finish(p)
    finally:
        kill_group(p)
    assert got["first"]  # read while the master lived
    assert got["missed"] == [True, True, True]
    assert max(got["times"]) < 1.0 + 1.0, got["times"]  # the connector's own timeout
    s = got["stats"]
    assert s["miss_unreachable"] + s["miss_timeout"] == 3, s
    assert s["drop_unreachable"] + s["drop_put_failed"] == 1, s
    assert s["gets"] == 1
    assert got["close_s"] < 2.5, got["close_s"]


@needs_engine
@pytest.mark.timeout(60)
def test_a_master_that_answers_garbage_or_hangs_is_a_bounded_miss():
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    conns = []
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            conns.append(c)
            try:
                c.sendall(b"\x17garbage\xff" * 64)  # then never another byte
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    extra = {"master_server_address": f"127.0.0.1:{port}",
             "metadata_server": f"http://127.0.0.1:{port}/metadata",
             "local_hostname": "127.0.0.1", "global_segment_size": "16MB",
             "local_buffer_size": "16MB", "store_read_buffer_bytes": "1MB",
             "store_timeout_s": 0.5}
    p = _node("garbage", extra, node=False)
    try:
        got, _ = _finish(p)
    finally:
        kill_group(p)
        stop.set()
        t.join(5)
        for c in conns:
            c.close()
        srv.close()
    assert got["missed"] == [True, True, True]
    assert max(got["times"]) < 0.5 + 1.0, got["times"]
    s = got["stats"]
    assert s["miss_unreachable"] + s["miss_timeout"] == 3, s


# -- configuration ---------------------------------------------------------------------------
def test_engine_missing_is_one_warning_with_the_fix_and_no_tier(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        tier = ec_store.from_config({"master_server_address": "127.0.0.1:50051"})
    assert tier is None
    warns = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 1
    msg = warns[0].getMessage()
    assert "127.0.0.1:50051" in msg and "libibverbs1" in msg and "mooncake-transfer-engine" in msg


def test_no_master_named_is_no_tier():
    assert ec_store.from_config(None) is None
    assert ec_store.from_config({"max_bytes": 10}) is None


@pytest.mark.parametrize("extra, key", [
    ({"master_server_address": "nohost"}, "master_server_address"),
    ({"master_server_address": "h:99999"}, "master_server_address"),
    ({"master_server_address": 12}, "master_server_address"),
    ({"master_server_address": "h:1", "mooncake_protocol": "udp"}, "mooncake_protocol"),
    ({"master_server_address": "h:1", "global_segment_size": "lots"}, "global_segment_size"),
    ({"master_server_address": "h:1", "local_buffer_size": -1}, "local_buffer_size"),
    ({"master_server_address": "h:1", "store_timeout_s": float("nan")}, "store_timeout_s"),
    ({"master_server_address": "h:1", "store_timeout_s": "soon"}, "store_timeout_s"),
    ({"master_server_address": "h:1", "store_max_pending_items": 1.5},
     "store_max_pending_items"),
    ({"master_server_address": "h:1", "store_key_prefix": ""}, "store_key_prefix"),
    ({"mooncake_config_path": "/nonexistent/mooncake.json"}, "mooncake_config_path"),
])
def test_bad_settings_are_typed_errors(extra, key):
    with pytest.raises(ec_store.StoreConfigError) as ei:
        ec_store.StoreConfig.from_extra(extra)
    assert ei.value.key == key
    assert isinstance(ei.value, ValueError)


def test_settings_follow_vllm_names_and_sizes(tmp_path):
    f = tmp_path / "mooncake.json"
    f.write_text(json.dumps({"master_server_address": "10.0.0.5:50051", "protocol": "rdma",
                             "device_name": "mlx5_0", "global_segment_size": "4GB"}))
    cfg = ec_store.StoreConfig.from_extra({"mooncake_config_path": str(f),
                                           "local_buffer_size": "512MB",
                                           "store_timeout_s": "1.5"})
    assert cfg.master() == ("10.0.0.5", 50051)
    assert cfg.metadata_server == "http://10.0.0.5:8080/metadata"
    assert cfg.protocol == "rdma" and cfg.device_name == "mlx5_0"
    assert cfg.global_segment_size == 4 << 30 and cfg.local_buffer_size == 512 << 20
    assert cfg.timeout_s == 1.5


def test_store_labels_exist_at_zero():
    metrics.init()
    for r in ec_store.MISS_REASONS + ec_store.PUT_DROP_REASONS:
        assert f"store_{r}" in metrics.EPD_FALLBACK_REASONS
    assert {"store_put", "store_get"} <= set(metrics.EPD_DIRECTIONS)


# -- the tier's own bounds, on a stand-in engine ----------------------------------------------
def _mapped(addr: int) -> bool:
    """Whether ``addr`` lies in a mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def _segment_at(addr: int):
    """The segment of this process whose creator mapping's payload starts at
    ``addr``, or None (read without the table's lock: a let-go hook may run
    under it in another thread)."""
    from mmshm.segments.table import TABLE

    for seg in list(TABLE.segments.values()):
        span = seg.payload_span()
        if span is not None and span[0] == addr:
            return seg
    return None


class FakeEngine:
    """The engine's calls the tier makes, on a dict; ``gate`` holds puts and
    reads back while cleared; ``short`` makes a read return fewer bytes;
    ``register_rc`` is what ``register_buffer`` returns (non-zero: refused).
    An unregister of a segment's payload records whether that segment's file
    was still linked and its pages still mapped (``"live"``), else
    ``"gone"``; of other memory (the read buffer) ``"other"``."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.short = False
        self.gets = 0
        self.register_rc = 0
        self.registered: dict[int, int] = {}
        self.events: list[tuple] = []
        self.batches: list[list[str]] = []  # the keys of each batch_get_into_multi_buffers
        self.put_batches: list[list[str]] = []  # the keys of each batch_put_from_multi_buffers
        self.put_rc: dict[str, int] = {}
        # keys whose put is "in flight": sized and read as the master's
        # REPLICA_IS_NOT_READY (-703), until the key is put
        self.not_ready: set[str] = set()

    def setup(self, *args):
        return 0

    def register_buffer(self, ptr, n):
        self.events.append(("register", ptr, n))
        if self.register_rc:
            return self.register_rc
        self.registered[ptr] = n
        return 0

    def unregister_buffer(self, ptr):
        self.registered.pop(ptr, None)
        seg = _segment_at(ptr)
        if seg is None:
            state = "other"
        else:
            try:
                linked = os.fstat(seg.fd).st_nlink > 0 and os.path.exists(seg.path)
            except OSError:
                linked = False
            state = "live" if linked and _mapped(ptr) else "gone"
        self.events.append(("unregister", ptr, state))
        return 0

    def health_check(self):
        return 0

    def close(self):
        return 0

    def put_parts(self, key, *parts):
        self.gate.wait(30)
        self.objects[key] = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        return 0

    def batch_put_from_multi_buffers(self, keys, all_ptrs, all_sizes):
        """Each object gathered from its buffers, in order (the engine's
        call; ``put_rc`` maps a key to the code its put returns instead)."""
        import ctypes

        self.put_batches.append(list(keys))
        self.gate.wait(30)
        out = []
        for key, ptrs, sizes in zip(keys, all_ptrs, all_sizes):
            rc = self.put_rc.get(key, 0)
            if not rc:
                self.objects[key] = b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))
            out.append(rc)
        return out

    def get_size(self, key):
        if key in self.not_ready:
            return -703
        return len(self.objects[key]) if key in self.objects else -704

    def get_into(self, key, ptr, n):
        import ctypes

        self.gets += 1
        self.gate.wait(30)
        data = self.objects[key][: n // 2 if self.short else n]
        ctypes.memmove(ptr, data, len(data))
        return len(data)

    def batch_get_into_multi_buffers(self, keys, all_ptrs, all_sizes):
        """The object scattered over the buffers, in order (the engine's call)."""
        import ctypes

        out = []
        self.batches.append(list(keys))
        for key, ptrs, sizes in zip(keys, all_ptrs, all_sizes):
            self.gets += 1
            # every target lies in memory registered with the engine (RDMA needs it)
            self.events.append(("get", list(ptrs), list(sizes), all(
                any(b <= p and p + n <= b + m for b, m in self.registered.items())
                for p, n in zip(ptrs, sizes))))
            self.gate.wait(30)
            data = self.objects.get(key)
            if data is None or key in self.not_ready:
                out.append(-703 if key in self.not_ready else -704)
                continue
            data = data[: len(data) // 2 if self.short else len(data)]
            off = 0
            for ptr, n in zip(ptrs, sizes):
                part = data[off:off + n]
                ctypes.memmove(ptr, part, len(part))
                off += len(part)
            out.append(off)
        return out


@pytest.fixture
def fake_tier(monkeypatch):
    srv = socket.create_server(("127.0.0.1", 0))  # the probe's TCP connect to the "master"
    monkeypatch.setattr(ec_store, "_probe_http", lambda url, timeout: None)
    eng = FakeEngine()
    extra = {"master_server_address": f"127.0.0.1:{srv.getsockname()[1]}",
             "local_hostname": "127.0.0.1", "local_buffer_size": "1MB",
             "store_read_buffer_bytes": "1MB", "store_timeout_s": 2.0,
             "store_max_pending_items": 2}  # 2 s: a good read never times out on a loaded host
    tier = ec_store.from_config(extra, engine=lambda: eng)
    assert tier.wait_connected(5)
    try:
        yield tier, eng
    finally:
        eng.gate.set()
        tier.close(timeout=5)
        srv.close()


def _hang_bound(tier, monkeypatch, timeout_s: float = 0.3) -> None:
    """``store_timeout_s`` of ``tier`` cut to ``timeout_s`` for a test whose
    engine hangs (the bound is read at each call)."""
    import dataclasses

    monkeypatch.setattr(tier, "config", dataclasses.replace(tier.config, timeout_s=timeout_s))


def test_put_queue_bounds_in_flight_put_and_too_big_are_counted(fake_tier):
    import torch

    from mmshm.transport.encoder_cache import content_key

    tier, eng = fake_tier
    keys = [content_key(f"x{i}") for i in range(4)]
    t = torch.arange(1000, dtype=torch.float32)
    eng.gate.clear()  # puts hang in the engine
    assert tier.put(keys[0], t) and tier.put(keys[1], t)
    assert not tier.put(keys[2], t)  # 2 pending: the third is dropped, counted
    assert tier.stats["drop_queue_full"] == 1
    assert not tier.put(keys[3], torch.zeros(1 << 20))  # 4 MiB > local_buffer_size
    assert tier.stats["drop_too_big"] == 1
    assert tier.fetch(keys[0], torch.float32, 1000) is None  # its put still in flight
    assert tier.stats["miss_absent"] == 1
    eng.gate.set()
    assert tier.flush(5) and tier.stats["puts"] == 2
    got = tier.fetch(keys[0], torch.float32, 1000)
    assert got is not None and torch.equal(got, t)


def test_puts_queued_while_one_runs_go_in_one_call_from_where_they_lie(fake_tier, monkeypatch):
    """The put thread takes what queued while a put ran as one
    ``batch_put_from_multi_buffers`` (tcp), each payload read from the
    caller's memory (no copy), each failure counted alone."""
    import dataclasses

    import torch

    from mmshm.transport.encoder_cache import content_key

    tier, eng = fake_tier
    keys = [content_key(f"batch put {i}") for i in range(3)]
    ts = [torch.randn(200, 64).to(torch.bfloat16) for _ in keys]
    monkeypatch.setattr(tier, "config", dataclasses.replace(tier.config, max_pending_items=8))
    eng.put_rc[tier.store_key(keys[2])] = -1  # the master refuses this one
    released = []
    eng.gate.clear()  # the first put hangs in the engine while two more queue
    assert tier.put(keys[0], ts[0], on_done=lambda: released.append(0))
    deadline = time.monotonic() + 5
    while not eng.put_batches and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tier.put(keys[1], ts[1], on_done=lambda: released.append(1))
    assert tier.put(keys[2], ts[2], on_done=lambda: released.append(2))
    assert released == []  # nothing handed back while its put is in flight
    eng.gate.set()
    assert tier.flush(5)
    assert eng.put_batches == [[tier.store_key(keys[0])],
                               [tier.store_key(k) for k in keys[1:]]]
    assert sorted(released) == [0, 1, 2]
    assert tier.stats["puts"] == 2 and tier.stats["put_bytes"] == 2 * ts[0].numel() * 2
    assert tier.stats["drop_put_failed"] == 1
    for k, t in zip(keys[:2], ts[:2]):
        got = tier.fetch(k, torch.bfloat16, 200)
        assert got is not None and torch.equal(got, t)
    assert tier.fetch(keys[2], torch.bfloat16, 200) is None  # refused: absent, never partial


def test_short_read_and_hanging_read_are_bounded_misses(fake_tier, caplog, monkeypatch):
    import torch

    from mmshm.transport.encoder_cache import content_key

    tier, eng = fake_tier
    _hang_bound(tier, monkeypatch)
    ec_store._WARNED.difference_update({"short", "timeout"})  # said once per process
    caplog.set_level(logging.WARNING, logger="mmshm")
    k = content_key("y")
    t = torch.arange(5000, dtype=torch.float32)
    assert tier.put(k, t) and tier.flush(5)
    eng.short = True
    assert tier.fetch(k, torch.float32, 5000) is None
    assert tier.stats["miss_short"] == 1
    eng.short = False
    eng.gate.clear()  # the engine's read hangs
    t0 = time.monotonic()
    assert tier.fetch(k, torch.float32, 5000) is None
    assert tier.fetch(k, torch.float32, 5000) is None  # the reader is still busy: no 2nd read
    assert time.monotonic() - t0 < 2 * 0.3 + 0.5
    assert tier.stats["miss_timeout"] == 2 and eng.gets == 2
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("reason=store_timeout" in m for m in said) == 1  # two misses, said once
    assert sum("reason=store_short" in m for m in said) == 1
    eng.gate.set()  # the hung read ends; the reader serves again
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        got = tier.fetch(k, torch.float32, 5000)
        if got is not None:
            break
    assert got is not None and torch.equal(got, t) and tier.stats["gets"] >= 1


def test_a_put_in_flight_is_absent_not_an_unreachable_master(fake_tier, shm_dir, caplog):
    """The master answers ``REPLICA_IS_NOT_READY`` (-703) for an object whose
    put has not completed (seen in the real pair's proxy flow): a miss
    ``absent``, said at INFO, never ``unreachable`` with its WARNING to
    start ``mooncake_master``, nor counted as a failure of the master."""
    import torch

    from mmshm.transport.encoder_cache import EncoderCache, content_key

    tier, eng = fake_tier
    ec_store._WARNED.difference_update({"absent", "unreachable"})  # said once per process
    caplog.set_level(logging.INFO, logger="mmshm")
    cache = EncoderCache(keep_s=60, namespace="m")
    try:
        ks = [content_key(f"in flight {i}") for i in range(3)]
        t = torch.randn(300, 256).to(torch.bfloat16)
        for k in ks:
            eng.not_ready.add(tier.store_key(k))
        assert tier.fetch(ks[0], torch.bfloat16, 300) is None  # the read-buffer path
        assert ec_store.fetch_local_many(cache, tier, [(k, torch.bfloat16, 300, None)
                                                       for k in ks[1:]]) == ["store_absent"] * 2
        # sized while in flight, put complete by the read: read as in flight too
        _object(tier, eng, ks[0], t)
        eng.not_ready.discard(tier.store_key(ks[0]))
        sized = eng.get_size
        eng.get_size = lambda key: len(eng.objects[key])  # sized as complete
        eng.not_ready.add(tier.store_key(ks[0]))
        assert ec_store.fetch_local(cache, tier, ks[0], torch.bfloat16, 300) == "store_absent"
        eng.get_size = sized
        assert tier.stats["miss_absent"] == 4 and tier.stats["miss_unreachable"] == 0
        assert tier.stats["miss_short"] == 0 and tier._failed_at == -math.inf
        said = [(r.levelno, r.getMessage()) for r in caplog.records if "Mooncake" in r.getMessage()]
        assert [lvl for lvl, _ in said] == [logging.INFO], said
        assert "still being put" in said[0][1] and "mooncake_master" not in said[0][1]
        eng.not_ready.clear()  # the put completes: the next read loads it
        assert ec_store.fetch_local(cache, tier, ks[0], torch.bfloat16, 300) == ""
        e = cache.lookup(ks[0], torch.bfloat16, 300)
        assert e is not None and torch.equal(e.load(), t)
        e.release()
    finally:
        cache.close()
    assert _mmshm_files(shm_dir) == []


# -- the one-copy fetch (fetch_local): network -> the new segment, checked, then published ----
def _object(tier, eng, key, t, *, rec_key=None, payload=None):
    """Put ``t`` under ``key`` in the stand-in engine as the encoder's put
    would; ``rec_key`` / ``payload`` make a bad record / another payload."""
    import torch

    from mmshm.segments import codec

    good = t.reshape(-1).view(torch.uint8).numpy()
    digest = ec_store.payload_digest(key, good.nbytes, lambda o, n: good[o:o + n])
    head = ec_store.record_bytes(ec_store._Record(rec_key or key, codec.dtype_code(t.dtype),
                                                  tuple(t.shape), good.nbytes, 1, digest))
    body = good if payload is None else payload
    eng.objects[tier.store_key(key)] = head + body.tobytes()


def _mmshm_files(d):
    return sorted(n for n in os.listdir(d) if n.startswith("mmshm"))


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_fetch_local_reads_straight_into_the_published_segment(fake_tier, shm_dir, protocol,
                                                              monkeypatch):
    import dataclasses

    import torch

    from mmshm.transport.encoder_cache import EncoderCache, content_key, published_name

    tier, eng = fake_tier
    monkeypatch.setattr(tier, "config", dataclasses.replace(tier.config, protocol=protocol))
    cache = EncoderCache(keep_s=60, namespace="m")
    try:
        k = content_key("one copy")
        t = torch.randn(300, 256).to(torch.bfloat16)
        _object(tier, eng, k, t)
        before = _epd_counts(cache.server)
        assert ec_store.fetch_local(cache, tier, k, torch.bfloat16, 300, shape=(300, 256)) == ""
        e = cache.lookup(k, torch.bfloat16, 300, shape=(300, 256))
        assert e is not None and torch.equal(e.load(), t)  # equal bytes, published
        # a PD instance's Store read is counted as a get, not as a save of its own
        after = _epd_counts(cache.server)
        assert after["saves"] == before["saves"] and after["saved"] == before["saved"]
        assert after["store_get"] - before["store_get"] == t.numel() * 2
        # one get: the record into the read buffer, the payload straight into the
        # segment's shared mapping; with rdma registered for the read and given back
        # right after it (tcp: never registered, a registration is a metadata update)
        gets = [ev for ev in eng.events if ev[0] == "get"]
        assert len(gets) == 1 and eng.gets == 1
        _, ptrs, sizes, in_registered = gets[0]
        assert sizes == [ec_store.RECORD_BYTES, t.numel() * 2]
        assert ptrs[0] == tier._read_buf.data_ptr()
        assert not (tier._read_buf.data_ptr() <= ptrs[1] < tier._read_buf.data_ptr()
                    + tier._read_buf.numel())
        i = eng.events.index(gets[0])
        if protocol == "rdma":
            assert in_registered
            # the segment's whole payload mapping (its capacity) is registered
            assert eng.events[i - 1][:2] == ("register", ptrs[1])
            assert eng.events[i - 1][2] >= sizes[1]
            # MMSHM_POOL=0 here: the segment is never reused, so it is given back
            # right after its read, its file still there
            assert eng.events[i + 1] == ("unregister", ptrs[1], "live")
        else:
            assert not in_registered
            assert [ev for ev in eng.events if ev[0] != "get"] == [
                ("register", tier._read_buf.data_ptr(), tier._read_buf.numel())]
        assert not eng.registered.get(ptrs[1])
        assert tier.stats["gets"] == 1 and tier.stats["get_bytes"] == t.numel() * 2
        # the segment published is the one the engine wrote: its mapping holds the payload
        seg = e._seg
        view = seg.payload_view()
        import ctypes

        base = ctypes.addressof(ctypes.c_char.from_buffer(view))
        assert base == ptrs[1]
        del view
        # published already: a second fetch reads nothing
        assert ec_store.fetch_local(cache, tier, k, torch.bfloat16, 300) == ""
        assert eng.gets == 1
        e.release()
        assert _mmshm_files(shm_dir) == [published_name(k)]
    finally:
        cache.close()
    assert _mmshm_files(shm_dir) == []


def _epd_counts(server: str) -> dict:
    """This process's ``mmshm_epd_*`` saves, saved bytes and Store get bytes
    for ``server``."""
    from prometheus_client import REGISTRY

    def v(name, **labels):
        return REGISTRY.get_sample_value(name, {"server": server, **labels}) or 0.0

    return {"saves": v("mmshm_epd_saves_total"),
            "saved": v("mmshm_epd_bytes_total", direction="saved"),
            "store_get": v("mmshm_epd_bytes_total", direction="store_get")}


def _rdma_pool(tier, monkeypatch):
    """``tier`` on rdma, in a process whose warm pool is on."""
    import dataclasses

    from mmshm import config

    monkeypatch.setattr(tier, "config", dataclasses.replace(tier.config, protocol="rdma"))
    monkeypatch.setenv("MMSHM_POOL", "1")
    config.reload()


@pytest.mark.parametrize("closed_first", ["cache", "tier"])
def test_rdma_registers_each_pooled_segment_once_and_gives_it_back_before_its_unlink(
        fake_tier, shm_dir, monkeypatch, closed_first):
    import torch

    from mmshm.transport.encoder_cache import EncoderCache, content_key

    tier, eng = fake_tier
    _rdma_pool(tier, monkeypatch)
    rbuf = tier._read_buf.data_ptr()
    cache = EncoderCache(keep_s=60, namespace="m")
    try:
        keys = [content_key(f"pooled {i}") for i in range(20)]
        items = {k: torch.randn(300, 256).to(torch.bfloat16) for k in keys}
        for k, t in items.items():
            _object(tier, eng, k, t)
        regs_before = 0
        for n, (k, t) in enumerate(items.items()):
            assert ec_store.fetch_local(cache, tier, k, torch.bfloat16, 300) == "", n
            e = cache.lookup(k, torch.bfloat16, 300, shape=(300, 256))
            assert e is not None and torch.equal(e.load(), t), n  # bytes fetched == put
            e.release()
            assert cache.evict(k)  # its segment goes back to this process's warm pool
            regs = [ev for ev in eng.events if ev[0] == "register" and ev[1] != rbuf]
            if n:  # a fetch into a pooled segment registers nothing
                assert len(regs) == regs_before, n
            regs_before = len(regs)
        gets = [ev for ev in eng.events if ev[0] == "get"]
        segs = {ev[1][1] for ev in gets}
        assert len(gets) == 20 and all(ev[3] for ev in gets)  # every read into registered memory
        regs = [ev for ev in eng.events if ev[0] == "register" and ev[1] != rbuf]
        assert len(regs) == len(segs) == 1  # one warm segment served all 20
        assert [ev for ev in eng.events if ev[0] == "unregister"] == []
        assert len(tier._regs) == 1
        if closed_first == "tier":
            tier.close(timeout=5)
    finally:
        cache.close()
        tier.close(timeout=5)
    unregs = [ev for ev in eng.events if ev[0] == "unregister" and ev[1] != rbuf]
    # every registration given back exactly once, each while its file and pages were there
    assert sorted(ev[1] for ev in unregs) == sorted(ev[1] for ev in regs)
    assert all(ev[2] == "live" for ev in unregs), unregs
    assert _mmshm_files(shm_dir) == []


def test_rdma_registration_is_given_back_before_the_pool_drops_the_segment(fake_tier, shm_dir,
                                                                            monkeypatch):
    import torch

    from mmshm.segments.table import TABLE
    from mmshm.transport.encoder_cache import EncoderCache, content_key

    tier, eng = fake_tier
    _rdma_pool(tier, monkeypatch)
    rbuf = tier._read_buf.data_ptr()
    cache = EncoderCache(keep_s=60, namespace="m")
    try:
        t = torch.randn(300, 256).to(torch.bfloat16)
        k = content_key("trimmed")
        _object(tier, eng, k, t)
        assert ec_store.fetch_local(cache, tier, k, torch.bfloat16, 300) == ""
        assert cache.evict(k)
        assert [ev for ev in eng.events if ev[0] == "unregister"] == []
        assert TABLE.trim_pool(shm_dir) > 0  # the pool lets go of it: unlinked, unmapped
        unregs = [ev for ev in eng.events if ev[0] == "unregister"]
        assert len(unregs) == 1 and unregs[0][2] == "live" and unregs[0][1] != rbuf
        assert len(tier._regs) == 0 and set(eng.registered) == {rbuf}
        assert _mmshm_files(shm_dir) == []
        # the next read gets a new segment: registered again, once
        k2 = content_key("after the trim")
        _object(tier, eng, k2, t)
        assert ec_store.fetch_local(cache, tier, k2, torch.bfloat16, 300) == ""
        assert len([ev for ev in eng.events if ev[0] == "register" and ev[1] != rbuf]) == 2
    finally:
        cache.close()
    assert set(eng.registered) == {rbuf}
    assert all(ev[2] == "live" for ev in eng.events if ev[0] == "unregister" and ev[1] != rbuf)


def test_rdma_refused_registration_is_a_counted_miss_said_once(fake_tier, shm_dir, monkeypatch,
                                                              caplog):
    import torch

    from mmshm.segments.table import TABLE
    from mmshm.transport.encoder_cache import EncoderCache, content_key

    tier, eng = fake_tier
    _rdma_pool(tier, monkeypatch)
    monkeypatch.setattr(ec_store, "_WARNED", set())
    eng.register_rc = -1  # e.g. a memlock limit below the segment's size
    cache = EncoderCache(keep_s=60, namespace="m")
    try:
        t = torch.randn(300, 256).to(torch.bfloat16)
        keys = [content_key(f"refused {i}") for i in range(2)]
        for k in keys:
            _object(tier, eng, k, t)
        with caplog.at_level(logging.DEBUG, logger="mmshm"):
            got = [ec_store.fetch_local(cache, tier, k, torch.bfloat16, 300) for k in keys]
        assert got == ["store_register"] * 2
        assert tier.stats["miss_register"] == 2 and tier.stats["gets"] == 0
        assert [ev for ev in eng.events if ev[0] == "get"] == []  # never read unregistered
        assert all(cache.lookup(k, count=False) is None for k in keys)
        warned = [r for r in caplog.records if r.levelno == logging.WARNING
                  and "store_register" in r.getMessage()]
        assert len(warned) == 1
        assert "returned -1" in warned[0].getMessage()
        assert "ulimit -l" in warned[0].getMessage()
        assert len(tier._regs) == 0
    finally:
        cache.close()
        TABLE.trim_pool(shm_dir)  # the unpublished segments idle in the pool under their names
    assert _mmshm_files(shm_dir) == []


def test_fetch_local_never_publishes_a_bad_record_short_get_or_other_payload(fake_tier,
                                                                            shm_dir):
    import torch

    from mmshm.transport.encoder_cache import EncoderCache, content_key

    tier, eng = fake_tier
    cache = EncoderCache(keep_s=60, namespace="m")
    try:
        t = torch.randn(300, 256).to(torch.bfloat16)
        keys = {r: content_key(f"bad {r}") for r in ("record", "dtype", "short", "digest")}
        _object(tier, eng, keys["record"], t, rec_key=content_key("another item"))
        _object(tier, eng, keys["dtype"], t.to(torch.float16))
        _object(tier, eng, keys["short"], t)
        other = t.reshape(-1).view(torch.uint8).numpy().copy()
        other[-4096:] ^= 0xFF  # the last page: one the digest samples
        _object(tier, eng, keys["digest"], t, payload=other)
        before = dict(tier.stats)
        got = {}
        for r, k in keys.items():
            eng.short = r == "short"
            got[r] = ec_store.fetch_local(cache, tier, k, torch.bfloat16, 300)
            eng.short = False
            # nothing published, nothing left: not even an unpublished segment
            assert cache.lookup(k, count=False) is None, r
            assert _mmshm_files(shm_dir) == [], (r, _mmshm_files(shm_dir))
        assert got == {"record": "store_record_mismatch", "dtype": "store_record_mismatch",
                       "short": "store_short", "digest": "store_digest"}
        counted = {r: tier.stats[f"miss_{r}"] - before[f"miss_{r}"]
                   for r in ("record_mismatch", "short", "digest")}
        assert counted == {"record_mismatch": 2, "short": 1, "digest": 1}
        assert tier.stats["gets"] == before["gets"]
        assert set(eng.registered) == {tier._read_buf.data_ptr()}  # each segment given back
    finally:
        cache.close()
    assert _mmshm_files(shm_dir) == []


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_fetch_local_many_reads_a_requests_items_in_one_scattered_get(fake_tier, shm_dir,
                                                                     protocol, monkeypatch):
    """A request's items are read in ONE ``batch_get_into_multi_buffers``
    (each record into its own slice of the read buffer, each payload
    straight into its segment), each checked on its own: a bad record or an
    absent object misses alone, an entry already here is not read."""
    import dataclasses

    import torch

    from mmshm.transport.encoder_cache import EncoderCache, content_key

    tier, eng = fake_tier
    monkeypatch.setattr(tier, "config", dataclasses.replace(tier.config, protocol=protocol))
    cache = EncoderCache(keep_s=60, namespace="m")
    try:
        ks = [content_key(f"batch {i}") for i in range(5)]
        ts = [torch.randn(300, 256).to(torch.bfloat16) for _ in ks]
        _object(tier, eng, ks[0], ts[0])
        _object(tier, eng, ks[1], ts[1])
        _object(tier, eng, ks[2], ts[2], rec_key=ks[0])  # a record that names other content
        # ks[3]: no object (its put in flight); ks[4]: this node has it already
        assert cache.save(ks[4], ts[4], label="here").published
        _object(tier, eng, ks[4], ts[4])
        got = ec_store.fetch_local_many(cache, tier, [(k, torch.bfloat16, 300, (300, 256))
                                                      for k in ks])
        assert got == ["", "", "store_record_mismatch", "store_absent", ""]
        assert eng.batches == [[tier.store_key(k) for k in ks[:3]]]  # one call, 3 objects
        gets = [ev for ev in eng.events if ev[0] == "get"]
        heads = [ev[1][0] for ev in gets]
        assert heads == [tier._read_buf.data_ptr() + n * ec_store.RECORD_BYTES
                         for n in range(3)]  # each record in its own slice
        assert all(ev[3] for ev in gets) == (protocol == "rdma")  # rdma: registered
        for k, t in zip(ks[:2] + ks[4:], ts[:2] + ts[4:]):
            e = cache.lookup(k, torch.bfloat16, 300, shape=(300, 256))
            assert e is not None and torch.equal(e.load(), t)
            e.release()
        assert cache.lookup(ks[2], torch.bfloat16, 300) is None  # never published
        assert tier.stats["gets"] == 2 and tier.stats["get_bytes"] == 2 * ts[0].numel() * 2
        assert tier.stats["miss_record_mismatch"] == 1 and tier.stats["miss_absent"] == 1
        assert ec_store.fetch_local_many(cache, tier, []) == []
    finally:
        cache.close()
    assert _mmshm_files(shm_dir) == []


def test_a_batched_get_that_raises_misses_only_the_objects_it_was_reading(fake_tier, shm_dir,
                                                                         monkeypatch):
    """The engine's batched get raising: each object it was reading is a
    ``store_short`` miss, given back unpublished; an absent object stays
    ``store_absent`` and an entry already here stays found."""
    import torch

    from mmshm.transport.encoder_cache import EncoderCache, content_key

    tier, eng = fake_tier
    cache = EncoderCache(keep_s=60, namespace="m")
    try:
        ks = [content_key(f"raising {i}") for i in range(4)]
        ts = [torch.randn(300, 256).to(torch.bfloat16) for _ in ks]
        for k, t in zip(ks[:2], ts[:2]):
            _object(tier, eng, k, t)
        assert cache.save(ks[3], ts[3], label="here").published
        _object(tier, eng, ks[3], ts[3])

        def boom(*args):
            raise RuntimeError("the engine failed")

        monkeypatch.setattr(eng, "batch_get_into_multi_buffers", boom)
        got = ec_store.fetch_local_many(cache, tier, [(k, torch.bfloat16, 300, (300, 256))
                                                      for k in ks])
        assert got == ["store_short", "store_short", "store_absent", ""]
        assert tier.stats["miss_short"] == 2 and tier.stats["miss_absent"] == 1
        assert [cache.lookup(k, torch.bfloat16, 300) is None for k in ks[:2]] == [True, True]
        e = cache.lookup(ks[3], torch.bfloat16, 300)
        assert e is not None and torch.equal(e.load(), ts[3])
        e.release()
    finally:
        cache.close()
    assert _mmshm_files(shm_dir) == []


def test_a_read_past_its_deadline_publishes_only_checked_bytes(fake_tier, shm_dir, monkeypatch):
    import torch

    from mmshm.transport.encoder_cache import EncoderCache, content_key

    tier, eng = fake_tier
    _hang_bound(tier, monkeypatch)
    cache = EncoderCache(keep_s=60, namespace="m")
    try:
        k = content_key("late")
        t = torch.randn(300, 256).to(torch.bfloat16)
        _object(tier, eng, k, t)
        eng.gate.clear()  # the engine's read hangs past store_timeout_s
        assert ec_store.fetch_local(cache, tier, k, torch.bfloat16, 300) == "store_timeout"
        assert cache.lookup(k, count=False) is None  # the segment being read is not found
        eng.gate.set()  # the read ends on the reader thread: checked, then published
        deadline = time.monotonic() + 5
        e = None
        while e is None and time.monotonic() < deadline:
            time.sleep(0.02)
            e = cache.lookup(k, torch.bfloat16, 300, count=False)
        assert e is not None and torch.equal(e.load(), t)
        e.release()
        assert set(eng.registered) == {tier._read_buf.data_ptr()}
    finally:
        cache.close()
    assert _mmshm_files(shm_dir) == []
