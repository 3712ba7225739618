"""``mmshm bench`` end to end, small: TP=2, n=2, 1 and 2 images, one repetition,
the three built-in modes, the floor, the plot; plus the pieces in-process.

The bench runs as the real console entry point (``python -m mmshm.cli``) in a
subprocess, inheriting the test's private ``MMSHM_DIR`` from the conftest.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from mmshm.segments.reaper import pid_alive

pytest.importorskip("zmq")
pytest.importorskip("transformers")
pytest.importorskip("skimage")

RUN_KEYS = {
    "mode": str, "tp": int, "n": int, "copies": int, "images": int, "resolution": str,
    "payload_bytes": int, "broadcast_s": float, "end_to_end_s": float, "correct": bool,
    "broadcast_bytes": int, "leftover_segments": list, "materialize_s": float,
    "floor_s": float, "floor_memcpy_s": float, "floor_broadcast_s": float,
    "memcpy_Bps": float, "e2e_over_floor": float, "repeat": int, "rss_growth_bytes": int,
    "rss_growth_over_payload": float,
}
MODES = ("inline", "fresh-segment", "mmshm")
FRESH = "mmshm-bench-fresh-"


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmshm.cli", *args], capture_output=True,
                          check=False, text=True, timeout=timeout, env=dict(os.environ))


def _of_live_process(name: str) -> bool:
    """Whether ``name`` ends in the pid of a live process (``bench-fresh-<pid>``)."""
    tail = name.rsplit("-", 1)[-1]
    return tail.isdigit() and int(tail) > 0 and pid_alive(int(tail))


def _bench_files(d: str) -> set[str]:
    """``mmshm-*`` entries of ``d`` and the fresh-segment mode's subdirectories."""
    try:
        return {n for n in os.listdir(d) if n.startswith(("mmshm-", "bench-fresh-"))}
    except FileNotFoundError:
        return set()


EXTRA_MODES = (*MODES, "mmshm-hash-given", "mmshm-eager-hash")


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_bench_small_run_is_correct_and_leaves_nothing(shm_dir, tmp_path):
    out, png = tmp_path / "out.json", tmp_path / "plot.png"
    shm_before = _bench_files("/dev/shm")
    proc = _cli("bench", "--tp", "2", "--n", "2", "--images", "1,2", "--repeat", "1",
                "--modes", ",".join(EXTRA_MODES), "--timeout", "60",
                "--json", str(out), "--plot", str(png), timeout=85)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(out.read_text())

    runs = result["runs"]
    assert {(r["mode"], r["images"]) for r in runs} == {
        (m, k) for m in EXTRA_MODES for k in (1, 2)}
    for r in runs:
        for key, typ in RUN_KEYS.items():
            assert isinstance(r[key], typ), (key, r)
        assert not r.get("skipped")
        assert r["correct"] is True, r["problems"]
        assert r["leftover_segments"] == []
        assert (r["tp"], r["n"], r["resolution"]) == (2, 2, "720p")
        assert r["broadcast_s"] > 0 and r["end_to_end_s"] >= r["broadcast_s"]
        assert r["floor_s"] >= r["floor_memcpy_s"] > 0
        assert r["e2e_over_floor"] == pytest.approx(r["end_to_end_s"] / r["floor_s"])
    by = {(r["mode"], r["images"]): r for r in runs}
    # a 720p photo through Qwen2-VL: [4784, 1176] float32 per image
    assert by["inline", 1]["payload_bytes"] == 4784 * 1176 * 4
    assert by["mmshm", 2]["payload_bytes"] == 2 * 4784 * 1176 * 4
    for k in (1, 2):
        p = by["inline", k]["payload_bytes"]
        # inline pickles the pixels of the n copies into the broadcast; the others metadata
        assert by["inline", k]["broadcast_bytes"] >= 2 * p
        assert by["inline", k]["wrap_Bps"] is None
        for m in ("mmshm", "fresh-segment", "mmshm-hash-given", "mmshm-eager-hash"):
            assert by[m, k]["broadcast_bytes"] < 64 * 1024
            assert by[m, k]["broadcast_speedup_vs_inline"] > 1
            assert by[m, k]["wrap_Bps"] > 0 and by[m, k]["wrap_over_memcpy"] > 0
            # the wrap's time over the floor's memcpy of as many bytes, and its threads
            assert by[m, k]["wrap_over_floor"] == pytest.approx(
                by[m, k]["memcpy_Bps"] / by[m, k]["wrap_Bps"])
            assert by[m, k]["copy_threads"] == result["config"]["copy_threads"]
        assert by["inline", k]["wrap_over_floor"] is None
        assert by["inline", k]["copy_threads"] is None
        # mmshm writes the payload once; fresh-segment once per copy (warm-up + n)
        assert by["mmshm", k]["wrap_bytes"] == by["mmshm-hash-given", k]["wrap_bytes"] == p
        assert by["mmshm-eager-hash", k]["wrap_bytes"] == p
        # zero-copy: a rank holding both copies (read in full) grows by the payload
        # once (at most 1.1x). (Inline's private copies are not checked:
        # the allocator may reuse pages an earlier run left resident.)
        assert by["mmshm", k]["rss_growth_over_payload"] <= 1.1, by["mmshm", k]
        assert by["fresh-segment", k]["copies"] == 3
        assert by["fresh-segment", k]["wrap_bytes"] == 3 * p
        assert "end_to_end_speedup_vs_fresh_segment" in by["mmshm", k]
    floors = result["floors"]
    assert len(floors) == 2 and all(f["floor_broadcast_bytes"] < 64 * 1024 for f in floors)
    # the producer's copy threads: its affinity (here at most the test host's CPUs)
    from mmshm.segments.shmtensor import copy_threads

    assert result["host"]["cpus_affinity"] == len(os.sched_getaffinity(0))
    assert result["config"]["copy_threads"] == copy_threads()
    assert f"producer copy threads: {copy_threads()} per photo (" in proc.stdout
    assert "wrap/floor" in proc.stdout
    assert result["leftover_segments"] == []
    assert result["config"]["shm_dir"] == shm_dir
    assert not _bench_files(shm_dir)
    # others' mmshm-* are the conftest's; a bench-fresh-<pid> of a live process is
    # another bench running on this host (this one's producer is gone by now)
    new = {n for n in _bench_files("/dev/shm") - shm_before
           if n.startswith(("bench-fresh-", FRESH))
           and not _of_live_process(n)}
    assert not new


def test_cli_lists_bench_and_rejects_bad_options():
    proc = _cli("--help", timeout=30)
    assert proc.returncode == 0 and "bench" in proc.stdout
    proc = _cli("bench", "--modes", "inline,bogus", timeout=30)
    assert proc.returncode == 2 and "bogus" in proc.stderr
    proc = _cli("bench", "--resolution", "720p,4k", timeout=30)
    assert proc.returncode == 2 and "4k" in proc.stderr
    proc = _cli("bench", "--tp", "2,x", timeout=30)
    assert proc.returncode == 2


def test_sweep_expands_the_grid_and_explicit_options_win(no_bench):
    from click.testing import CliRunner
    from mmshm import cli

    seen = no_bench
    r = CliRunner().invoke(cli.main, ["bench", "--sweep"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli.main, ["bench", "--sweep", "--tp", "4", "--images", "32"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli.main, ["bench"])
    assert r.exit_code == 0, r.output
    full, partial, default = seen
    assert (full.tp, full.n, full.images, full.resolution) == (
        (2, 4), (1, 8), (1, 8, 32), ("720p", "1080p"))
    assert (partial.tp, partial.n, partial.images) == ((4,), (1, 8), (32,))
    assert (default.tp, default.n, default.images, default.resolution, default.modes) == (
        (2,), (2,), (1, 8, 32), ("720p",), MODES)
    assert len(full.configs()) == 24


def test_memory_estimates_skip_what_cannot_fit(shm_dir):
    from mmshm.bench.modes import MODES as REGISTRY
    from mmshm.bench.runner import _skip_reason

    gb = 10**9
    # inline at 32 images x n=8 pickles the payload many times over: skipped
    why, mem, shm = _skip_reason(REGISTRY["inline"], int(0.72 * gb), 8, 2, 16 * gb, shm_dir)
    assert why and "memory" in why and mem > 16 * gb and shm == 0
    why, mem, _ = _skip_reason(REGISTRY["mmshm"], int(0.72 * gb), 8, 2, 16 * gb, shm_dir)
    assert why is None and mem < 4 * gb
    # fresh-segment holds a segment per copy: n+1 of them
    _, mem, shm = _skip_reason(REGISTRY["fresh-segment"], gb, 9, 4, None, shm_dir)
    assert shm == 9 * gb and mem > shm


def test_modes_registry_and_verify():
    import mmshm
    import torch
    from mmshm.bench import MODES as REGISTRY
    from mmshm.bench import Mode, get_mode, register
    from mmshm.bench.requests import MultimodalDataItem, MultimodalInputs, Req, verify

    assert set(MODES) <= set(REGISTRY)

    @register
    class Dummy(Mode):
        name = "dummy-test"

    try:
        d = get_mode("dummy-test")
        assert isinstance(d, Dummy)
        assert d.copies(4) == 4 and d.producer_stats() == {} and d.after_run("/") == []
    finally:
        del REGISTRY["dummy-test"]
    with pytest.raises(KeyError):
        get_mode("nope")

    f = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    item = MultimodalDataItem("image", mmshm.content_hash(f), f, (1, 2, 2))
    req = Req("r", MultimodalInputs([item]), [1, 2, 3])
    assert verify([req, req], 2, 1) == []
    bad = MultimodalDataItem("image", mmshm.content_hash(f), f + 1, (1, 2, 2))
    assert verify([Req("b", MultimodalInputs([bad]), [])], 1, 1)
    assert verify([req], 2, 1)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_eager_hash_mode_hashes_in_the_copy_and_leaves_the_request(shm_dir, monkeypatch,
                                                                   threads):
    """``mmshm-eager-hash`` wraps with the hash asked for now (in the copy's
    pass, or beside it on two copy threads): every handle carries BLAKE3-128
    of its bytes, the request keeps its tensors."""
    import mmshm
    import torch
    from mmshm import config
    from mmshm.bench.modes import get_mode
    from mmshm.bench.requests import MultimodalDataItem, MultimodalInputs, Req

    monkeypatch.setenv("MMSHM_COPY_THREADS", threads)
    config.reload()
    fs = [torch.rand(1000, 1176), torch.rand(2000, 1176)]  # 4.7 and 9.4 MB
    items = [MultimodalDataItem("image", mmshm.content_hash(f), f, (1, 10, 100)) for f in fs]
    req = Req("r", MultimodalInputs(items), [1, 2, 3])
    wrapped = get_mode("mmshm-eager-hash")._wrap(req)
    hs = list(mmshm.handles(wrapped))
    assert [h.meta.hash for h in hs] == [it.hash for it in items]
    assert all(isinstance(it.feature, torch.Tensor) for it in req.mm_inputs.mm_items)
    mmshm.release(wrapped)


def test_fresh_segment_mode_in_process(shm_dir):
    """The baseline's producer half and one rank's half in one process (TP=1):
    n+1 copies with independent mm_items, a segment per copy and tensor,
    names+shape+dtype on the wire, copy-on-write tensors, nothing left."""
    import mmshm
    import torch
    from mmshm.bench.modes import FreshShmPointer, fresh_files, get_mode, remove_fresh_dirs
    from mmshm.bench.requests import MultimodalDataItem, MultimodalInputs, Req, verify

    f = torch.rand(300, 1176)
    items = [MultimodalDataItem("image", mmshm.content_hash(f), f.clone(), (1, 10, 30))
             for _ in range(2)]
    req = Req("r", MultimodalInputs(items), [1, 2, 3], n=2)
    mode = get_mode("fresh-segment", min_bytes=0)
    copies = mode.fan_out(req, 2)
    assert len(copies) == mode.copies(2) == 3
    assert len({id(c.mm_inputs.mm_items) for c in copies}) == 3
    msgs = []
    for c in copies:
        mode.before_send(c)
        msgs.append(mode.dumps(c))
        mode.after_send(c)
    assert all(isinstance(it.feature, torch.Tensor) for it in req.mm_inputs.mm_items)
    assert len(fresh_files(shm_dir)) == 6
    assert all(len(m) < 2048 for m in msgs)  # metadata only
    assert mode.producer_stats()["wrap_bytes"] == 6 * f.numel() * 4
    data = [mode.loads(m) for m in msgs]
    assert isinstance(data[0].mm_inputs.mm_items[0].feature, FreshShmPointer)
    out = mode.broadcast(data, 0, None, 0)  # world of one: no barrier
    assert verify(out, 3, 2) == []
    assert fresh_files(shm_dir) == [] and mode.after_run(shm_dir) == []
    remove_fresh_dirs(shm_dir, {os.getpid()})
    assert not _bench_files(shm_dir)
    t = out[0].mm_inputs.mm_items[0].feature
    t[0, 0] = -1.0  # copy-on-write: the other copies keep their bytes
    assert torch.equal(out[1].mm_inputs.mm_items[0].feature, f)

    # a pointer whose segment is gone: unpickling does not raise, materialize does
    gone = pickle.loads(pickle.dumps(FreshShmPointer(f"{FRESH}1-0", (2,), torch.float32,
                                                     shm_dir)))
    assert gone.error
    with pytest.raises(OSError):
        gone.materialize()


def test_plot_from_a_result(tmp_path):
    pytest.importorskip("matplotlib")
    from mmshm.bench.plot import plot_result

    runs, floors = [], []
    for tp in (2, 4):
        for k, p in ((1, 22_500_000), (32, 720_000_000)):
            floors.append({"tp": tp, "n": 1, "resolution": "720p", "payload_bytes": p,
                           "floor_s": p / 5e9})
            for i, m in enumerate(MODES):
                runs.append({"mode": m, "tp": tp, "n": 1, "resolution": "720p", "images": k,
                             "payload_bytes": p, "end_to_end_s": p / 1e9 * (3 - i)})
    runs.append({"mode": "inline", "tp": 4, "n": 1, "resolution": "1080p", "images": 32,
                 "payload_bytes": 1, "skipped": "memory"})
    path = plot_result({"runs": runs, "floors": floors}, str(tmp_path / "p.png"))
    assert os.path.getsize(path) > 1000


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_bench_two_simulated_nodes(shm_dir, tmp_path):
    """--nodes 2 over TP=4: ranks 0-1 on node 0 (with the producer), 2-3 on
    node 1. mmshm sends each payload once to node 1's leader; inline pickles
    it to both ranks of node 1. Nothing is left in any node directory."""
    from mmshm.segments import node

    out = tmp_path / "nodes.json"
    proc = _cli("bench", "--tp", "4", "--n", "1", "--images", "1,2", "--nodes", "2",
                "--modes", "inline,mmshm", "--repeat", "1", "--timeout", "40",
                "--json", str(out), timeout=55)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["config"]["nodes"] == 2
    by = {(r["mode"], r["images"]): r for r in result["runs"]}
    assert set(by) == {(m, k) for m in ("inline", "mmshm") for k in (1, 2)}
    for r in by.values():
        assert r["correct"] is True, r["problems"]
        assert r["nodes"] == 2 and r["leftover_segments"] == []
    for k in (1, 2):
        mm, inl = by["mmshm", k], by["inline", k]
        assert mm["internode_bytes"] == mm["payload_bytes"] * 1 * (2 - 1)
        # the pickled batch, to the 2 ranks of node 1
        assert inl["internode_bytes"] == 2 * inl["broadcast_bytes"]
        assert inl["internode_bytes"] > mm["internode_bytes"]
        # the link's floor: one send of the payload to node 1, and each mode's
        # whole broadcast over it (a ratio, not a timing goal)
        for r in (mm, inl):
            assert r["floor_link_s"] > 0
            assert r["broadcast_over_link"] == pytest.approx(
                r["broadcast_total_s"] / r["floor_link_s"])
    assert result["leftover_segments"] == []
    for k in range(2):
        assert not _bench_files(node.simulated_dir(shm_dir, k))
    assert not _bench_files(shm_dir)
    assert "inter-node" in proc.stdout and "vs link" in proc.stdout


def test_bench_rejects_more_nodes_than_ranks():
    proc = _cli("bench", "--tp", "2", "--nodes", "3", timeout=30)
    assert proc.returncode == 2 and "nodes" in proc.stderr


def _sglang_missing() -> str | None:
    from mmshm.bench.modes import MODES as ALL

    return ALL["sglang"].unavailable()


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_sglang_mode_is_skipped_cleanly_without_sglang(shm_dir, tmp_path):
    """Where SGLang cannot be imported, with --skip-missing, the ``sglang`` mode
    is reported as skipped with a note; the other modes run, and no sglang
    module is loaded. (Without --skip-missing it is a usage error: test_ops.)"""
    if not _sglang_missing():
        pytest.skip("sglang is importable here")
    out = tmp_path / "out.json"
    proc = _cli("bench", "--tp", "2", "--n", "2", "--images", "1", "--repeat", "1",
                "--modes", "inline,sglang", "--skip-missing", "--timeout", "60", "--json",
                str(out), timeout=85)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"inline", "sglang"}
    assert "not importable" in runs["sglang"]["skipped"]
    assert runs["sglang"]["repeat"] == 0 and runs["sglang"]["leftover_segments"] == []
    assert not runs["inline"].get("skipped") and runs["inline"]["correct"] is True
    assert "broadcast_speedup_vs_sglang" not in runs["inline"]


def test_sglang_mode_unavailable_does_not_import_sglang():
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    assert "not importable" in _sglang_missing()
    assert not any(m == "sglang" or m.startswith("sglang.") for m in sys.modules)


def test_sglang_mode_in_process():
    """With SGLang importable (its venv): SGLang's own ShmPointerMMData per
    copy and tensor, metadata on the wire, materialized bytes, nothing left."""
    why = _sglang_missing()
    if why:
        pytest.skip(why)
    import mmshm
    import torch
    from mmshm.bench.modes import get_mode, load_sglang
    from mmshm.bench.requests import MultimodalDataItem, MultimodalInputs, Req, verify

    mm, _ = load_sglang()
    f = torch.rand(300, 1176)
    items = [MultimodalDataItem("image", mmshm.content_hash(f), f.clone(), (1, 10, 30))
             for _ in range(2)]
    req = Req("r", MultimodalInputs(items), [1, 2, 3], n=2)
    mode = get_mode("sglang")
    copies = mode.fan_out(req, 2)
    assert len(copies) == mode.copies(2) == 3
    msgs = []
    for c in copies:
        mode.before_send(c)
        assert isinstance(c.mm_inputs.mm_items[0].feature, mm.ShmPointerMMData)
        msgs.append(mode.dumps(c))
        mode.after_send(c)
    assert all(len(m) < 2048 for m in msgs)
    assert mode.producer_stats()["wrap_bytes"] == 6 * f.numel() * 4
    names = list(mode._created)
    assert all(os.path.exists(f"/dev/shm/{n}") for n in names) and len(names) == 6
    # world of one: SGLang's broadcast_pyobj needs a process group, rank 0 keeps its data
    mode.instrument_broadcast(lambda fn: lambda data, rank, group, src: data)
    out = mode.broadcast([mode.loads(m) for m in msgs], 0, None, 0)
    assert verify(out, 3, 2) == []
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
    assert mode.after_run("/dev/shm") == []


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present")
def test_device_cuda_is_refused_clearly_without_a_gpu():
    from mmshm.bench import BenchConfig

    with pytest.raises(ValueError, match="--device cuda: torch .* sees no CUDA device"):
        BenchConfig(device="cuda").validate()
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        BenchConfig(device="tpu").validate()
    proc = _cli("bench", "--device", "cuda", timeout=60)
    assert proc.returncode == 2 and "sees no CUDA device" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_h2d_pieces_without_a_gpu():
    """What --device cuda does around the GPU: one copy per memory block (the
    fan-out copies' views share theirs), the slowest rank's times, the
    medians and bandwidths, and the report's line (pinned, or the driver's
    error)."""
    import torch
    from mmshm.bench.h2d import distinct_features
    from mmshm.bench.report import h2d_line
    from mmshm.bench.requests import MultimodalDataItem, MultimodalInputs, Req
    from mmshm.bench.runner import _aggregate, _h2d_of

    a, b = torch.arange(1024.0), torch.arange(2048.0)

    def req(*feats):
        return Req("r", MultimodalInputs([MultimodalDataItem("image", b"", f) for f in feats]),
                   [])
    got = distinct_features([req(a, b), req(a.view(1024), b), req(torch.empty(0), "x"), None])
    assert [t.data_ptr() for t in got] == [a.data_ptr(), b.data_ptr()]
    ranks = [{"h2d_bytes": 4096, "h2d_pageable_s": 0.002, "h2d_pinned_s": 0.001,
              "host_register_s": 0.0005, "host_unregister_s": 0.0001, "h2d_error": None},
             {"h2d_bytes": 4096, "h2d_pageable_s": 0.004, "h2d_pinned_s": None,
              "host_register_s": 0.0002, "host_unregister_s": 0.0, "h2d_error": "error 1"}]
    one = _h2d_of(ranks)
    assert one["h2d_pageable_s"] == 0.004 and one["h2d_pinned_s"] == 0.001
    assert one["h2d_error"] == "error 1" and _h2d_of([{"rank": 0}]) == {}
    base = {"mode": "mmshm", "tp": 2, "n": 1, "images": 1, "resolution": "720p",
            "payload_bytes": 4096}
    sample = {k: 0.01 for k in ("broadcast_s", "share_s", "materialize_s", "broadcast_total_s",
                                "end_to_end_s", "produce_s", "recv_s")}
    sample.update(broadcast_bytes=1, zmq_bytes=1, internode_bytes=0, problems=[],
                  rank_open_segments=0, rss_growth_bytes=0, wrap_s=None, wrap_bytes=None)
    run = _aggregate(base, [{**sample, **one}], [], {"floor_s": 0.01})
    assert run["h2d_pageable_Bps"] == 4096 / 0.004 and run["h2d_pinned_Bps"] == 4096 / 0.001
    assert h2d_line(run) == ("host to device 0.0 MB per rank: pageable 0.00 GB/s, registered "
                             "0.00 GB/s (+0.5 ms to register, 0.1 ms to unregister)")
    run = _aggregate(base, [{**sample, **one, "h2d_pinned_s": None}], [], {"floor_s": 0.01})
    assert run["h2d_pinned_Bps"] is None and h2d_line(run).endswith("registered: error 1")
    assert h2d_line(base) is None


# -- one benchmark home: mmshm bench serve ---------------------------------------------------
def test_bench_serve_reaches_the_server_benchmarks():
    """``mmshm bench [options]`` stays the command it was and gains ``serve
    ttft|transport``: the real-server benchmarks, whose options are their own
    (their --help, under the subcommand's name)."""
    from click.testing import CliRunner
    from mmshm import cli

    r = CliRunner().invoke(cli.main, ["bench", "--help"])
    assert r.exit_code == 0 and "--quick" in r.output and "serve" in r.output, r.output
    r = CliRunner().invoke(cli.main, ["bench", "serve", "--help"])
    assert r.exit_code == 0 and "--python" in r.output, r.output
    assert "ttft" in r.output and "transport" in r.output
    for name, flags in (("ttft", ("--server", "--concurrency", "--requests", "--n", "--configs",
                                  "--model", "--json")),
                        ("transport", ("--server", "--images", "--requests", "--configs",
                                       "--resolution", "--model", "--json"))):
        proc = _cli("bench", "serve", name, "--help", timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.startswith(f"usage: mmshm bench serve {name} "), proc.stdout
        assert all(f in proc.stdout for f in flags), proc.stdout
    proc = _cli("bench", "serve", "--python", sys.executable, "transport", "--help", timeout=60)
    assert proc.returncode == 0 and "usage: mmshm bench serve transport" in proc.stdout
    proc = _cli("bench", "serve", "ttft", "--server", "tgi", timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'tgi'" in proc.stderr, proc.stderr
    proc = _cli("bench", "hop", "--help", timeout=60)  # the broadcast hop alone, likewise
    assert proc.returncode == 0 and proc.stdout.startswith("usage: mmshm bench hop "), proc.stdout
    assert "--baseline" in proc.stdout


def test_bench_homes_edit_no_sys_path():
    """bench/ and benchmarks/ reach the rest of the tree by imports only: no
    ``sys.path`` edit (into tests/, or into each other)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    edit = re.compile(r"sys\.path\s*(\[|\.insert|\.append|\.extend|\+=|=[^=])")
    found = [f"{f.relative_to(root)}:{i}" for d in ("bench", "benchmarks")
             for f in sorted((root / d).rglob("*.py"))
             for i, line in enumerate(f.read_text().splitlines(), 1) if edit.search(line)]
    assert found == []


# -- the package loads its names on first use --------------------------------------------------
def test_importing_the_serve_helpers_loads_no_torch():
    """The test harness and ``mmshm bench serve`` import the server starter
    (``mmshm.bench.serve.servers``); the package must not load torch for it."""
    code = ("import sys\n"
            "import mmshm.bench.serve.servers, mmshm.bench.serve.ttft, "
            "mmshm.bench.serve.transport\n"
            "heavy = sorted(m for m in ('torch', 'numpy', 'mmshm.bench.modes', "
            "'mmshm.bench.runner') if m in sys.modules)\n"
            "print(heavy)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_the_package_names_load_on_first_use_with_the_vllm_modes():
    code = ("import sys\n"
            "import mmshm.bench as b\n"
            "assert 'mmshm.bench.modes' not in sys.modules\n"
            "modes = b.MODES\n"
            "from mmshm.bench import run_bench, BenchConfig\n"
            "print(sorted(modes), 'mmshm.bench.runner' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "'vllm'" in proc.stdout and "'vllm-arena'" in proc.stdout and "'mmshm'" in proc.stdout
    assert proc.stdout.strip().endswith("True")
    with pytest.raises(AttributeError):
        import mmshm.bench as b
        b.no_such_name  # noqa: B018


# -- the mixed-size workload --------------------------------------------------------------------
def test_the_mixed_workload_sizes_are_qwen2_vl_processor_outputs():
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    import random

    from mmshm.bench import mixed

    rng = random.Random(7)
    groups = set()
    for _ in range(2000):
        group, w, h = mixed.draw_photo(rng)
        groups.add(group)
        want = pil.smart_resize(h, w, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
        assert mixed.smart_resize(h, w) == tuple(want), (w, h)
    assert groups == {g for _, g, _ in mixed.PHOTO_MIX}
    work = mixed.workload(200, seed=0)
    assert work == mixed.workload(200, seed=0) and work != mixed.workload(200, seed=1)
    assert all(1 <= len(r) <= 8 for r in work)
    rows = [t * gh * gw for r in work for t, gh, gw in r]
    assert min(rows) >= 56 * 56 // 196 and max(rows) <= 28 * 28 * 1280 // 196
    d = mixed.describe(work)
    assert d["distinct_shapes"] > 40  # almost every photo has its own size
    assert mixed.COLUMNS == 1176 and mixed.grid(1280, 720) == (1, 52, 92)  # 720p: [4784, 1176]


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_the_mixed_workload_counts_hits_and_registrations_with_bytes_checked(shm_dir, tmp_path):
    """A short mixed run, both reuse rules, the arena on: every photo's bytes
    checked on every rank, nothing left, each rank's simulated registrations
    equal to the arena segments the producer made (each mapped and
    registered once), and best fit hitting at least as often as the exact
    size class."""
    out = tmp_path / "mixed.json"
    proc = _cli("bench", "mixed", "--tp", "2", "--requests", "14", "--warm", "4", "--rule",
                "exact,best", "--arena", "on", "--timeout", "120", "--json", str(out),
                timeout=230)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    exact, best = res["variants"]
    for v in (exact, best):
        assert v["correct"] and v["problems"] == [], v
        made = v["totals"]["created"]
        # one pool request per request: its photos share one segment
        assert made > 0 and v["totals"]["hits"] + v["totals"]["misses"] == res["workload"]["requests"]
        # no eviction in a 1 GiB arena: every segment made is one registration per rank
        assert v["totals"]["evicted"] == 0
        regs = [v["first_requests"]["registrations_per_rank"][k]
                + v["registrations_per_rank_steady"][k] for k in range(2)]
        assert regs == [made, made], v
    assert best["totals"]["hits"] >= exact["totals"]["hits"]
    assert res["leftover_segments"] == [] and _bench_files(shm_dir) == set()
    assert "simulated on a CPU host" in proc.stdout and "segments left: none" in proc.stdout


def test_bench_workload_mixed_runs_the_mixed_workload(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from mmshm import cli
    from mmshm.bench import mixed

    seen = []
    monkeypatch.setattr(mixed, "main", lambda args, prog=None: seen.append((args, prog)) or 0)
    out = str(tmp_path / "m.json")
    r = CliRunner().invoke(cli.main, ["bench", "--workload", "mixed", "--tp", "4,2", "--json",
                                      out])
    assert r.exit_code == 0, r.output
    assert seen == [(["--tp", "4", "--timeout", "300.0", "--json", out],
                     "mmshm bench --workload mixed")]
    seen.clear()  # --quick is passed on, never silently dropped
    r = CliRunner().invoke(cli.main, ["bench", "--workload", "mixed", "--quick"])
    assert r.exit_code == 0, r.output
    assert seen == [(["--tp", "2", "--timeout", "300.0", "--quick"],
                     "mmshm bench --workload mixed")]
