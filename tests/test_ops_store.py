"""Operators see the Mooncake Store leg (EPD across nodes): ``mmshm status``
shows a live process's Store tier (master, protocol, what listens where,
connected or the last connect error, its counts), and ``mmshm doctor
--ec-config`` checks the leg's settings, engine, master and metadata server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from click.testing import CliRunner

from mmshm import cli
from mmshm.operations import doctor, status
from mmshm.transport import ec_store
from tests.harness.mooncake import Master, engine_missing
from tests.harness.ports import free_port

# A process with a Store tier on a stand-in engine (the engine's calls on a dict):
# it connects to a listening socket standing for the master, then runs commands
# from stdin: "put <n>" queues a put of n float32 and waits for it, "get <tag>"
# fetches a key nobody put (a miss: absent); it answers each with a line.
CHILD = textwrap.dedent('''
    import json, socket, sys
    from mmshm.transport import ec_store
    from mmshm.transport.encoder_cache import content_key
    import torch

    ec_store._probe_http = lambda url, timeout: None

    class Engine:
        def __init__(self):
            self.objects = {}
        def setup(self, *a): return 0
        def register_buffer(self, ptr, n): return 0
        def unregister_buffer(self, ptr): return 0
        def health_check(self): return 0
        def close(self): return 0
        def put_parts(self, key, *parts):
            self.objects[key] = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
            return 0
        def get_size(self, key):
            return len(self.objects[key]) if key in self.objects else -704

    extra = json.loads(sys.argv[1])
    tier = ec_store.from_config(extra, engine=Engine)
    if extra.get("wait", True):
        assert tier.wait_connected(10)
    else:
        tier._connect()  # the master does not listen: fails at once
    print("READY", flush=True)
    for line in sys.stdin:
        cmd, arg = line.split()
        if cmd == "put":
            assert tier.put(content_key(arg), torch.zeros(int(arg)))
            assert tier.flush(10)
        elif cmd == "connect":
            assert tier._connect()
        elif cmd == "get":
            assert tier.fetch(content_key("absent-" + arg)) is None
        print("DONE " + json.dumps(tier.stats), flush=True)
    tier.close(5)
''')


def _child(extra: dict) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(extra)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "READY"
    return p


def _do(p: subprocess.Popen, cmd: str) -> dict:
    p.stdin.write(cmd + "\n")
    p.stdin.flush()
    line = p.stdout.readline()
    assert line.startswith("DONE "), line
    return json.loads(line[5:])


def _stop(p: subprocess.Popen) -> None:
    try:
        p.stdin.close()
        p.wait(15)
    except (subprocess.TimeoutExpired, OSError):
        p.kill()
        p.wait(5)


def _store_of(d: str, pid: int, until=lambda t: True, timeout: float = 5.0):
    """The Store tiers ``mmshm status`` reports for ``pid``, once ``until`` holds
    for the first (the memfd is written within FLUSH_S)."""
    end = time.monotonic() + timeout
    while True:
        procs = {p.pid: p for p in status.status(d).processes}
        got = procs[pid].store if pid in procs else []
        if (got and until(got[0])) or time.monotonic() > end:
            return got
        time.sleep(0.05)


def _invoke(*args):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def test_status_shows_a_live_process_tier_its_state_and_its_counts(tmp_path):
    d = str(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        master = f"127.0.0.1:{srv.getsockname()[1]}"
        p = _child({"master_server_address": master, "local_hostname": "127.0.0.1",
                    "mooncake_protocol": "tcp", "global_segment_size": "64MB",
                    "local_buffer_size": "1MB", "store_read_buffer_bytes": "1MB",
                    "store_timeout_s": 1.0})
        try:
            (t,) = _store_of(d, p.pid, lambda t: t.connected)
            assert (t.server, t.master, t.protocol, t.connected, t.error) == (
                "vllm", master, "tcp", True, "")
            assert t.metadata == "http://127.0.0.1:8080/metadata"
            assert "lends 64 MiB" in t.listens and "listens on 127.0.0.1" in t.listens
            assert t.stats["puts"] == 0 and t.stats["gets"] == 0

            # counts change: the status shows them within FLUSH_S
            stats = _do(p, "put 100")
            stats = _do(p, "put 50")
            stats = _do(p, "get a")
            assert (stats["puts"], stats["put_bytes"], stats["miss_absent"]) == (2, 600, 1)
            (t,) = _store_of(d, p.pid, lambda t: t.stats.get("miss_absent") == 1)
            assert {k: t.stats[k] for k in ("puts", "put_bytes", "gets", "miss_absent",
                                              "drop_queue_full")} == {
                "puts": 2, "put_bytes": 600, "gets": 0, "miss_absent": 1, "drop_queue_full": 0}
            assert t.stats == stats  # every count, as the process has it

            r = _invoke("status", "--dir", d)
            assert r.exit_code == 0
            line = next(x for x in r.output.splitlines()
                        if f"{p.pid}: Mooncake Store (vllm, tcp)" in x)
            assert "connected; puts 2 (600 B), gets 0 (0 B); misses: absent 1" in line
            assert f"Mooncake Store at master {master}" in r.output
            js = json.loads(_invoke("status", "--dir", d, "--json").stdout)
            (e,) = [x for x in js["processes"] if x["pid"] == p.pid]
            assert e["store"][0]["connected"] is True
            assert e["store"][0]["stats"]["put_bytes"] == 600
        finally:
            _stop(p)
    # the process gone, so is its line
    assert p.pid not in {x.pid for x in status.status(d).processes}


def test_status_shows_a_tier_whose_master_does_not_listen_then_connected(tmp_path):
    port = free_port()
    p = _child({"master_server_address": f"127.0.0.1:{port}", "local_hostname": "127.0.0.1",
                "local_buffer_size": "1MB", "store_read_buffer_bytes": "1MB",
                "store_timeout_s": 0.2, "wait": False})
    try:
        (t,) = _store_of(str(tmp_path), p.pid, lambda t: bool(t.error))
        assert not t.connected and "ConnectionRefusedError" in t.error, t
        r = _invoke("status", "--dir", str(tmp_path))
        assert f"{p.pid}: Mooncake Store (vllm, tcp): NOT connected (ConnectionRefusedError" \
            in r.output
        # the master listens now; the tier's next try (after 5 x store_timeout_s) connects,
        # with no count changed: the status says so within FLUSH_S
        with socket.create_server(("127.0.0.1", port)):
            time.sleep(1.1)
            stats = _do(p, "connect 0")
            assert stats["puts"] == 0 and stats["miss_unreachable"] == 0
            (t,) = _store_of(str(tmp_path), p.pid, lambda t: t.connected)
            assert t.connected and t.error == "", t
    finally:
        _stop(p)


# -- doctor --------------------------------------------------------------------------------
def _diagnose(tmp_path, ec_config):
    return doctor.diagnose(str(tmp_path), ec_config=ec_config)


def _store_problems(rep) -> list[doctor.Problem]:
    return [p for p in rep.problems if "Mooncake" in p.problem]


def test_doctor_without_ec_config_checks_no_store(tmp_path):
    rep = _diagnose(tmp_path, None)
    assert rep.store is None and not _store_problems(rep)
    r = _invoke("doctor", "--dir", str(tmp_path))
    assert "Mooncake" not in r.output


def test_doctor_names_a_bad_setting_with_its_key(tmp_path):
    rep = _diagnose(tmp_path, {"master_server_address": "127.0.0.1:1",
                               "store_timeout_s": "soon"})
    assert rep.store.settings != "ok" and rep.store.key == "store_timeout_s"
    (p,) = _store_problems(rep)
    assert "store_timeout_s" in p.problem and "correct store_timeout_s" in p.fix
    # vLLM's whole --ec-transfer-config, as the CLI takes it, from a file
    f = tmp_path / "ec.json"
    f.write_text(json.dumps({"ec_connector": "MmshmECConnector", "ec_role": "ec_consumer",
                             "ec_connector_extra_config": {"master_server_address": "nohost",
                                                           "mooncake_protocol": "tcp"}}))
    r = _invoke("doctor", "--dir", str(tmp_path), "--ec-config", f"@{f}")
    assert r.exit_code == 1
    assert "the Mooncake Store setting master_server_address in ec_connector_extra_config " \
           "is not valid" in r.output
    # not JSON: a usage error
    assert _invoke("doctor", "--dir", str(tmp_path), "--ec-config", "{nope").exit_code == 2


def test_doctor_says_no_master_named_is_the_leg_off(tmp_path):
    rep = _diagnose(tmp_path, {"ec_connector_extra_config": {"shm_dir": "/dev/shm"}})
    assert rep.store.settings == "off" and not _store_problems(rep)
    assert any("Store leg is off" in n for n in rep.notes)


def test_doctor_names_a_missing_engine_with_the_packages(tmp_path, monkeypatch):
    def missing():
        raise OSError("libibverbs.so.1: cannot open shared object file")

    monkeypatch.setattr(ec_store, "load_engine", missing)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        rep = _diagnose(tmp_path, {"master_server_address": f"127.0.0.1:"
                                   f"{srv.getsockname()[1]}", "metadata_server": "P2PHANDSHAKE"})
    assert "libibverbs.so.1" in rep.store.engine
    (p,) = _store_problems(rep)
    assert "engine cannot be loaded" in p.problem
    for needed in ("libibverbs1", "libnl-3-200", "libnl-route-3-200",
                   "mooncake-transfer-engine"):
        assert needed in p.fix
    assert rep.store.master_rpc == "accepts"
    assert rep.store.metadata_http == "not checked (P2PHANDSHAKE)"


def test_doctor_names_a_master_that_does_not_listen_within_the_timeout(tmp_path):
    port, meta = free_port(), free_port()
    t0 = time.monotonic()
    rep = _diagnose(tmp_path, {"master_server_address": f"127.0.0.1:{port}",
                               "metadata_server": f"http://127.0.0.1:{meta}/metadata",
                               "store_timeout_s": 0.5})
    assert time.monotonic() - t0 < 10
    probs = _store_problems(rep)
    assert [p.problem.split(" does not ")[0] for p in probs] == [
        f"the Mooncake master's RPC port 127.0.0.1:{port}",
        f"the Mooncake metadata server http://127.0.0.1:{meta}/metadata"]
    assert all("start mooncake_master" in p.fix for p in probs)
    assert not rep.ok and rep.store.master_rpc.startswith("ConnectionRefusedError")


@pytest.mark.skipif(engine_missing() is not None, reason=str(engine_missing()))
def test_doctor_ok_against_a_real_master(tmp_path):
    with Master() as m:
        extra = m.extra()
        rep = _diagnose(tmp_path, extra)
        assert (rep.store.settings, rep.store.engine, rep.store.master_rpc,
                rep.store.metadata_http) == ("ok", "loads", "accepts", "answers")
        assert not _store_problems(rep)
        r = _invoke("doctor", "--dir", str(tmp_path), "--ec-config", json.dumps(
            {"ec_connector": "MmshmECConnector", "ec_connector_extra_config": extra}))
        out = r.output
        assert f"Mooncake Store at master 127.0.0.1:{m.rpc}" in out
        assert f"127.0.0.1:{m.rpc}: accepts" in out
        assert f"http://127.0.0.1:{m.meta}/metadata: answers" in out
        assert "Mooncake" not in out.split("other files on this file system:")[1]
    # the master gone, the same config is a problem
    rep = _diagnose(tmp_path, extra)
    assert len(_store_problems(rep)) == 2


def test_a_tier_dropped_in_a_process_leaves_its_memfd():
    import gc

    from mmshm.transport import ec_holders

    cfg = ec_store.StoreConfig.from_extra({"master_server_address": "127.0.0.1:1",
                                           "local_hostname": "127.0.0.1"})
    tier = ec_store.StoreTier(cfg, server="unit")  # not started: no client, no thread
    mine = [t for t in ec_holders.read_stores(os.getpid()) if t.server == "unit"]
    assert [(t.master, t.connected, t.stats["puts"]) for t in mine] == [("127.0.0.1:1", False, 0)]
    tier.stats["puts"] += 1
    assert [t.stats["puts"] for t in ec_holders.read_stores(os.getpid())
            if t.server == "unit"] == [1]
    del tier
    gc.collect()
    assert not [t for t in ec_holders.read_stores(os.getpid()) if t.server == "unit"]
