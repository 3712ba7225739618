"""The examples (scrape config, alert rules, Grafana dashboard) against real tools.

* ``promtool check metrics`` on the exporter's output, ``promtool check rules``
  / ``check config`` on the examples, and ``promtool test rules`` on the alert
  expressions with synthetic series.
* A real Prometheus server, started here on loopback, scrapes a running
  pipeline (a subprocess with the exporter started from ``MMSHM_METRICS_PORT``
  that drives forced ENOSPC fallbacks, deferred-unwrap broadcasts and a
  fan-out); its query API must return the exact values, evaluate every alert
  rule without error, and accept every dashboard expression.

The promtool/Prometheus tests skip when the binaries are missing (CI installs
Debian's ``prometheus`` package in ``.ci/run``). The static checks of the
dashboard and the rules run everywhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from mmshm import metrics

from tests.harness.ports import free_port

yaml = pytest.importorskip("yaml")  # PyYAML (comes with transformers, in the test extra)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
ALERTS = EXAMPLES / "alerts.yml"
DASHBOARD = EXAMPLES / "grafana-dashboard.json"
SCRAPE_CONFIG = EXAMPLES / "prometheus.yml"

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed "
                                    "(apt-get install prometheus)")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed "
                                      "(apt-get install prometheus)")

# Grafana's variables, replaced by values Prometheus accepts.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h",
                "$job": ".*", "$instance": ".*"}
METRIC_NAME = re.compile(r"\bmmshm_[a-zA-Z0-9_]*[a-zA-Z0-9]")


# -- the examples, parsed ------------------------------------------------------------------
def alert_rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(d: dict):
    for p in d["panels"]:
        yield p
        yield from p.get("panels", [])


def dashboard_exprs() -> list[str]:
    """PromQL of every panel target and of every query variable (the series
    selector inside ``label_values(...)``), Grafana variables substituted."""
    exprs = [t["expr"] for p in all_panels(dashboard()) for t in p.get("targets", [])]
    for v in dashboard()["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", v["definition"])
            assert m, v["definition"]
            exprs.append(m.group(1))
    return [grafana_substitute(e) for e in exprs]


def grafana_substitute(expr: str) -> str:
    for var in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(var, GRAFANA_VARS[var])
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr}"
    return expr


def exposed_sample_names(text: str) -> set[str]:
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines()
            if line and not line.startswith("#")}


# -- static checks (no promtool needed) ---------------------------------------------------------
def test_alert_rules_have_summary_and_runbook():
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    assert {"MmshmInlineFallbacks", "MmshmOrphanedSegmentsReclaimed", "MmshmShmLowFreeSpace",
            "MmshmBroadcastSlow"} <= names
    for r in rules:
        ann = r["annotations"]
        assert ann["summary"].strip() and len(ann["runbook"]) > 80, r["alert"]
        assert "mmshm doctor" in ann["runbook"], r["alert"]
        assert r["labels"]["severity"] in ("info", "warning", "critical")
    by_name = {r["alert"]: r for r in rules}
    for name in ("MmshmInlineFallbacks", "MmshmShmLowFreeSpace"):
        runbook = by_name[name]["annotations"]["runbook"]
        for fix in ("--shm-size", "--ipc=host", "emptyDir", "medium: Memory"):
            assert fix in runbook, (name, fix)


def test_dashboard_is_importable_json():
    d = dashboard()
    assert d["title"] and d["uid"] and d["schemaVersion"] >= 30
    assert d.get("id") is None  # import creates a new dashboard
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    ids = [p["id"] for p in all_panels(d)]
    assert len(ids) == len(set(ids))
    for p in all_panels(d):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert t["expr"].strip()
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${datasource}"


def test_dashboard_covers_every_family():
    used = {m for e in dashboard_exprs() for m in METRIC_NAME.findall(e)}
    families = {line.split()[2] for line in metrics.render().decode().splitlines()
                if line.startswith("# TYPE mmshm_") and not line.split()[2].endswith("_created")}
    missing = {f for f in families if not any(u == f or u.startswith(f + "_") for u in used)}
    assert not missing, f"no dashboard panel for {sorted(missing)}"


#: Series that only an instrumented server process emits (the real-server
#: e2e tests under tests/e2e/ read them from the server's own /metrics): the
#: per-hop timings of mmshm.hooks.observe have server and hop labels, created by the
#: first message an instrumentor times.
SERVER_ONLY = {"mmshm_path_enabled", "mmshm_ipc_seconds_sum", "mmshm_ipc_seconds_count",
               "mmshm_ipc_bytes_sum", "mmshm_ipc_bytes_count", "mmshm_observe_errors_total"}


def test_expressions_name_only_emitted_metrics():
    emitted = exposed_sample_names(metrics.render().decode())
    exprs = dashboard_exprs() + [r["expr"] for r in alert_rules()]
    names = {m for e in exprs for m in METRIC_NAME.findall(e)} - SERVER_ONLY
    assert names
    assert names <= emitted, f"not emitted by the exporter: {sorted(names - emitted)}"


def test_scrape_config_targets_each_server_once():
    """mmshm_* comes from one job per server: the servers' /metrics merge
    mmshm's series, so an active job on mmshm's exporter (port 9477) would
    make the dashboard's sum() panels count every series twice."""
    cfg = yaml.safe_load(SCRAPE_CONFIG.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(jobs) == {"sglang", "vllm"}
    targets = [t for j in jobs.values() for sc in j["static_configs"] for t in sc["targets"]]
    assert len(targets) == len(set(targets)) and not any(t.endswith(":9477") for t in targets)
    assert jobs["sglang"].get("metrics_path", "/metrics") == "/metrics"
    assert cfg["rule_files"] == ["alerts.yml"]
    assert "one place per server" in dashboard()["description"]


# -- promtool -----------------------------------------------------------------------------------
def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, timeout=60,
                          check=False)


def check_metrics(text: bytes) -> None:
    r = promtool("check", "metrics", stdin=text)
    assert r.returncode == 0, (r.stdout + r.stderr).decode()


@needs_promtool
@pytest.mark.timeout(60)
def test_promtool_check_metrics_render():
    check_metrics(metrics.render())


@needs_promtool
@pytest.mark.timeout(120)
def test_promtool_check_metrics_multiprocess(tmp_path):
    mpdir = tmp_path / "prom"
    mpdir.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mpdir), MMSHM_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "mmshm.metrics", "--once"], env=env,
                         capture_output=True, timeout=60, check=True).stdout
    assert b"mmshm_inline_fallbacks_total" in out
    check_metrics(out)


@needs_promtool
@pytest.mark.timeout(60)
def test_promtool_check_rules_and_config():
    r = promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, (r.stdout + r.stderr).decode()
    r = promtool("check", "config", str(SCRAPE_CONFIG))  # loads alerts.yml too
    assert r.returncode == 0, (r.stdout + r.stderr).decode()


def _series(name: str, values: str, **labels: str) -> dict:
    lab = ",".join(f'{k}="{v}"' for k, v in {"job": "mmshm", "instance": "a", **labels}.items())
    return {"series": f"{name}{{{lab}}}", "values": values}


@needs_promtool
@pytest.mark.timeout(60)
def test_alert_rules_fire_on_synthetic_series(tmp_path):
    """``promtool test rules`` on the rules (annotations stripped: they are
    checked above, and their text would have to be repeated here)."""
    doc = yaml.safe_load(ALERTS.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(doc))
    bucket = "mmshm_broadcast_seconds_bucket"
    series = [
        _series("mmshm_inline_fallbacks_total", "0 0 3 6 9 12 15 18 21 24", reason="enospc"),
        _series("mmshm_inline_fallbacks_total", "0x10", reason="budget"),
        _series("mmshm_reaped_segments_total", "0 0 2 2 2 2 2 2", reason="killed"),
        _series("mmshm_dir_free_bytes", "50000000x20"),  # 48 MiB of a 64 MiB /dev/shm
        _series("mmshm_dir_size_bytes", "67108864x20"),
        _series("mmshm_dir_free_bytes", "10737418240x20", instance="b"),  # 10 of 16 GiB
        _series("mmshm_dir_size_bytes", "17179869184x20", instance="b"),
        _series("mmshm_dir_free_bytes", "5368709120x20", instance="c"),  # 5 of 100 GiB
        _series("mmshm_dir_size_bytes", "107374182400x20", instance="c"),
        _series("mmshm_request_failures_total", "0x10", reason="not_found"),
    ]
    for role, slow in (("src", True), ("dst", False)):
        for le in ("0.005", "0.25", "0.5", "1.0", "+Inf"):
            hit = le in ("1.0", "+Inf") if slow else True
            series.append(_series(bucket, "0+10x30" if hit else "0x30", role=role, le=le))

    def alert(name, t, *labels):
        return {"eval_time": t, "alertname": name,
                "exp_alerts": [{"exp_labels": {"severity": "warning", "job": "mmshm",
                                               "instance": "a", **lab}} for lab in labels]}

    test = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "alert_rule_test": [
            alert("MmshmInlineFallbacks", "1m"),
            alert("MmshmInlineFallbacks", "8m", {"reason": "enospc"}),
            alert("MmshmOrphanedSegmentsReclaimed", "5m", {}),
            alert("MmshmShmLowFreeSpace", "10m", {"instance": "a"}, {"instance": "c"}),
            alert("MmshmBroadcastSlow", "5m"),  # pending for 10m first
            alert("MmshmBroadcastSlow", "15m", {"role": "src"}),
            alert("MmshmRequestFailures", "8m"),
        ]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    r = promtool("test", "rules", str(tmp_path / "test.yml"))
    assert r.returncode == 0, (r.stdout + r.stderr).decode()


def _want(expr: str, *samples: tuple[dict, float]) -> dict:
    """A ``promql_expr_test`` of ``promtool test rules``: ``expr`` at 5 minutes
    gives these ``(labels, value)`` samples."""
    return {"expr": expr, "eval_time": "5m",
            "exp_samples": [{"labels": "{" + ",".join(f'{k}="{v}"' for k, v in lab.items())
                             + "}", "value": v} for lab, v in samples]}


IPC_PANEL = "multimodal IPC seconds per request, by hop and transport"


@needs_promtool
@pytest.mark.timeout(60)
def test_ipc_panel_gives_the_like_for_like_total_beside_the_servers_own_stage(tmp_path):
    """The IPC panel's TOTAL is every hop's seconds per request the tokenizer
    sent (all TP ranks' hops included), per server and transport; beside it
    SGLang's own ``request_process`` stage per TP rank: evaluated by
    ``promtool test rules`` on synthetic series (64 requests a minute)."""
    from mmshm.integrations.sglang.timing import HOPS

    panel = next(p for p in all_panels(dashboard()) if p["title"] == IPC_PANEL)
    expr = {t["refId"]: grafana_substitute(t["expr"]) for t in panel["targets"]}
    assert set(expr) == {"A", "B", "C"}
    assert "tokenizer_wrap|frontend_encode" in expr["B"] and "mm_inputs" in HOPS
    sec, stage = "mmshm_ipc_seconds", "sglang:per_stage_req_latency_seconds"
    series = []
    # per minute: 64 requests, 128 mm_inputs (2 ranks); seconds in binary fractions
    for tr, wrap, mm in (("server", "2", "16"), ("mmshm", "4", "1")):
        lab = {"server": "sglang", "transport": tr}
        series += [_series(f"{sec}_count", "0+64x10", hop="tokenizer_wrap", **lab),
                   _series(f"{sec}_sum", f"0+{wrap}x10", hop="tokenizer_wrap", **lab),
                   _series(f"{sec}_count", "0+128x10", hop="mm_inputs", **lab),
                   _series(f"{sec}_sum", f"0+{mm}x10", hop="mm_inputs", **lab)]
    for rank, total in (("0", "2"), ("1", "1")):
        series += [_series(f"{stage}_count", "0+64x10", stage="request_process", tp_rank=rank),
                   _series(f"{stage}_sum", f"0+{total}x10", stage="request_process",
                           tp_rank=rank),
                   _series(f"{stage}_sum", "0+600x10", stage="prefill_forward", tp_rank=rank),
                   _series(f"{stage}_count", "0+60x10", stage="prefill_forward", tp_rank=rank)]

    (tmp_path / "none.yml").write_text("groups: []\n")
    test = {"rule_files": ["none.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series, "promql_expr_test": [
            _want(expr["B"], ({"server": "sglang", "transport": "server"}, 18 / 64),
                 ({"server": "sglang", "transport": "mmshm"}, 5 / 64)),
            _want(expr["C"], ({"tp_rank": "0"}, 2 / 64), ({"tp_rank": "1"}, 1 / 64))]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    r = promtool("test", "rules", str(tmp_path / "test.yml"))
    assert r.returncode == 0, (r.stdout + r.stderr).decode()


ARENA_ROW = "Arena (GPU)"


def _panel_exprs(title: str) -> dict[str, str]:
    panel = next(p for p in all_panels(dashboard()) if p["title"] == title)
    return {t["refId"]: grafana_substitute(t["expr"]) for t in panel["targets"]}


@needs_promtool
@pytest.mark.timeout(60)
def test_arena_panels_compute_size_in_use_registered_fallbacks_and_copy_time(tmp_path):
    """The "Arena (GPU)" row's panels on synthetic series of two
    instances: the size, in-use and registered bytes per instance, fallbacks
    per second by reason, the median GPU copy time by direction."""
    d = dashboard()
    row = next(i for i, p in enumerate(d["panels"]) if p["title"] == ARENA_ROW)
    titles = [p["title"] for p in d["panels"][row + 1:]]
    assert len(titles) == 9 and all(
        any(m in " ".join(t["expr"] for t in p["targets"]) for m in ("mmshm_arena_",
            "mmshm_gpu_copy_", "mmshm_device_tensors_")) for p in d["panels"][row + 1:])
    sizes = _panel_exprs("Arena: size, in use, registered with CUDA")
    fallbacks = _panel_exprs("Arena fallbacks by reason")["A"]
    copy_time = _panel_exprs("GPU copy time p50 / p99 by direction")["A"]
    GiB = 1 << 30
    series = []
    for inst, used, reg in (("a", GiB // 4, GiB // 2), ("b", 0, 0)):
        series += [_series("mmshm_arena_bytes", f"{GiB}x10", instance=inst),
                   _series("mmshm_arena_in_use_bytes", f"{used}x10", instance=inst),
                   _series("mmshm_arena_registered_bytes", f"{reg}x10", instance=inst)]
        # per minute: 60 full (1/s) on a, 120 too_big (2/s) on b
        series += [_series("mmshm_arena_fallbacks_total", "0+60x10" if inst == "a" else "0x10",
                           instance=inst, reason="full"),
                   _series("mmshm_arena_fallbacks_total", "0+120x10" if inst == "b" else "0x10",
                           instance=inst, reason="too_big")]
    for direction in ("h2d", "d2h"):  # every copy between 0.5 and 1 s: the median is 0.75
        for le, v in (("0.5", "0x10"), ("1.0", "0+10x10"), ("+Inf", "0+10x10")):
            series.append(_series("mmshm_gpu_copy_seconds_bucket", v, direction=direction,
                                  le=le))

    (tmp_path / "none.yml").write_text("groups: []\n")
    test = {"rule_files": ["none.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series, "promql_expr_test": [
            _want(sizes["A"], ({"instance": "a"}, GiB), ({"instance": "b"}, GiB)),
            _want(sizes["B"], ({"instance": "a"}, GiB // 4), ({"instance": "b"}, 0)),
            _want(sizes["C"], ({"instance": "a"}, GiB // 2), ({"instance": "b"}, 0)),
            _want(fallbacks, ({"reason": "full"}, 1), ({"reason": "too_big"}, 2)),
            _want(copy_time, ({"direction": "d2h"}, 0.75), ({"direction": "h2d"}, 0.75))]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    r = promtool("test", "rules", str(tmp_path / "test.yml"))
    assert r.returncode == 0, (r.stdout + r.stderr).decode()


# -- a real Prometheus server scraping a running pipeline ----------------------------------
PIPELINE = textwrap.dedent("""
    import errno, gc, os, sys
    import torch
    import mmshm, mmshm.segments.segment
    from mmshm import metrics
    n_fallback, n_bcast, n_copies = map(int, sys.argv[1:4])
    srv = metrics.maybe_start_exporter_from_env()
    assert srv is not None
    print("PORT", srv.server_port, flush=True)
    assert sys.stdin.readline().strip() == "go"

    real = os.posix_fallocate
    def enospc(*a):
        raise OSError(errno.ENOSPC, "No space left on device (forced)")
    mmshm.segments.segment.os.posix_fallocate = enospc
    try:
        for i in range(n_fallback):
            t = torch.ones(128, 1024)
            assert mmshm.wrap({"pixel_values": t}, min_bytes=1)["pixel_values"] is t
    finally:
        mmshm.segments.segment.os.posix_fallocate = real

    bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
    for i in range(n_bcast):
        data = [mmshm.wrap({"pixel_values": torch.full((256, 256), float(i))}, min_bytes=1)]
        out = bcast(data, 0)
        assert float(out[0]["pixel_values"][0, 0]) == i
        del out, data
    copies = mmshm.fan_out({"mm_items": [{"feature": torch.ones(256, 256)}]}, n_copies,
                           min_bytes=1)
    for c in copies:
        mmshm.release(c)
    del copies
    gc.collect()
    print("DONE", flush=True)
    sys.stdin.read()  # stay alive (scraped) until killed or stdin closes
""")


def http_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_for(what: str, fn, timeout: float = 45, interval: float = 0.5):
    """Call ``fn`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (OSError, ValueError) as exc:  # server not up yet, connection reset
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


class Prometheus:
    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}"

    def query(self, expr: str) -> dict:
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            return http_json(url)
        except urllib.error.HTTPError as exc:  # 400/422 carry the error as JSON
            return json.loads(exc.read())

    def scalar(self, expr: str) -> float | None:
        res = self.query(expr)
        assert res["status"] == "success", (expr, res)
        vals = res["data"]["result"]
        assert len(vals) <= 1, (expr, vals)
        return float(vals[0]["value"][1]) if vals else None


@pytest.fixture
def pipeline(tmp_path):
    """A running mmshm pipeline with its exporter; yields (process, exporter port)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    env.update(MMSHM_DIR=str(shm), MMSHM_METRICS_PORT="0", MMSHM_METRICS_ADDR="127.0.0.1",
               MMSHM_REAP_INTERVAL_S="0", MMSHM_MIN_FREE_BYTES="0")
    proc = subprocess.Popen([sys.executable, "-c", PIPELINE, "5", "4", "3"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["PORT"], line
        yield proc, int(line[1])
    finally:
        stop(proc)
        assert not [n for n in os.listdir(shm) if n.startswith("mmshm-")]


@pytest.fixture
def prometheus(tmp_path, pipeline):
    """A Prometheus server scraping the pipeline's exporter every second, with
    the example alert rules loaded. Always terminated."""
    _, exporter_port = pipeline
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "rule_files": [str(ALERTS)],
           "scrape_configs": [{"job_name": "mmshm", "static_configs": [
               {"targets": [f"127.0.0.1:{exporter_port}"]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "wb") as log:
        for _attempt in range(3):  # a free port can be taken between probe and bind
            port = free_port()
            proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
            try:
                if _ready(proc, f"http://127.0.0.1:{port}/-/ready", timeout=30):
                    yield Prometheus(port)
                    return
            finally:
                stop(proc)
    pytest.fail("prometheus did not start:\n" + log_path.read_text())


def _ready(proc: subprocess.Popen, url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except OSError:
            time.sleep(0.3)
    return False


@needs_prometheus
@pytest.mark.timeout(180)
def test_prometheus_scrapes_pipeline(pipeline, prometheus):
    proc, exporter_port = pipeline
    prom = prometheus
    # Scraped before any event: the pre-initialised series exist at 0.
    wait_for("the first scrape", lambda: prom.scalar('up{job="mmshm"}') == 1)
    assert prom.scalar('mmshm_inline_fallbacks_total{reason="enospc"}') == 0
    assert prom.scalar('mmshm_broadcast_seconds_count{role="src"}') == 0

    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "DONE"
    # a scrape taken after the last event: one taken while the pipeline ran has the
    # fallbacks (its first events) without all of the broadcasts
    wait_for("a scrape after the pipeline's last event",
             lambda: prom.scalar('mmshm_inline_fallbacks_total{reason="enospc"}') == 5
             and prom.scalar("mmshm_fanout_copies_total") == 3
             and prom.scalar("mmshm_materialize_seconds_count") == 4)
    for reason in ("budget", "emfile", "other"):
        assert prom.scalar(f'mmshm_inline_fallbacks_total{{reason="{reason}"}}') == 0
    assert prom.scalar('mmshm_broadcast_seconds_count{role="src"}') == 4
    assert prom.scalar('mmshm_broadcast_bytes_count{role="src"}') == 4
    assert prom.scalar('mmshm_broadcast_seconds_count{role="dst"}') == 0
    assert prom.scalar('sum(mmshm_broadcast_seconds_bucket{role="src", le="+Inf"})') == 4
    assert prom.scalar("mmshm_materialize_seconds_count") == 4
    assert prom.scalar("mmshm_segments_created_total") == 5  # 4 broadcasts + 1 fan-out
    assert prom.scalar("mmshm_shm_written_bytes_total") == 5 * 256 * 256 * 4
    assert prom.scalar("mmshm_fanout_copies_total") == 3
    assert prom.scalar("mmshm_segments_in_use") == 0
    assert prom.scalar("mmshm_shm_in_use_bytes") == 0
    assert prom.scalar("mmshm_dir_free_bytes") > 0
    p99 = prom.scalar('histogram_quantile(0.99, rate(mmshm_broadcast_seconds_bucket'
                      '{role="src"}[1m]))')
    assert p99 is not None and 0 < p99 <= 10

    # The exporter's HTTP output passes promtool's linter.
    if PROMTOOL:
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter_port}/metrics") as r:
            check_metrics(r.read())

    # Every name the dashboard and the rules use is stored from this scrape.
    stored = set(http_json(f"{prom.base}/api/v1/label/__name__/values")["data"])
    exprs = dashboard_exprs() + [r["expr"] for r in alert_rules()]
    names = {m for e in exprs for m in METRIC_NAME.findall(e)} - SERVER_ONLY
    assert names <= stored, f"not scraped: {sorted(names - stored)}"

    # Every dashboard expression is valid PromQL for this server.
    for expr in dashboard_exprs():
        res = prom.query(expr)
        assert res["status"] == "success", (expr, res)

    # The alert rules are loaded and evaluate cleanly; the fallback alert is on its way.
    def rules_evaluated():
        groups = http_json(f"{prom.base}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if len(rules) != len(alert_rules()):
            return None
        if any(r.get("lastEvaluation", "0001").startswith("0001") for r in rules):
            return None
        return rules

    for r in wait_for("a rule evaluation", rules_evaluated):
        assert r["health"] == "ok", r

    def fallback_alert():
        alerts = http_json(f"{prom.base}/api/v1/alerts")["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "MmshmInlineFallbacks"]

    alerts = wait_for("MmshmInlineFallbacks to be pending", fallback_alert)
    assert [a["labels"]["reason"] for a in alerts] == ["enospc"]
    assert alerts[0]["state"] in ("pending", "firing")
    assert "enospc" in alerts[0]["annotations"]["summary"]
