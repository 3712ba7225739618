"""Data parallelism without a server: the data-parallel rank in the roles
each process says (SGLang's schedulers, vLLM's EngineCore and workers) and in
``mmshm status``, and SGLang's data-parallel controller giving its
references back once it has forwarded a request.

The real servers are in the e2e tests (``tests/e2e/test_sglang_dp_e2e.py``;
vLLM's ``--data-parallel-size`` in its own e2e). Here vLLM's EngineCore and
worker hooks run in processes whose command line shows the title vLLM gives
them (``VLLM::EngineCore_DP1``: setproctitle writes it over the command
line), so what decides the role is what decides it in a server.
"""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import psutil
import pytest
import torch
from mmshm import ShmTensor
from mmshm.operations import status
from mmshm.segments import segfile
from mmshm.integrations.sglang import roles as sg_roles
from mmshm.integrations.sglang import server as sg

# -- SGLang --------------------------------------------------------------------------------


def test_sglang_scheduler_role_names_the_dp_rank():
    assert sg.scheduler_role(0) == "scheduler (TP rank 0)"
    assert sg.scheduler_role(1, 0) == "scheduler (DP rank 0, TP rank 1)"
    assert sg.scheduler_role("?", 1) == "scheduler (DP rank 1, TP rank ?)"
    # SGLang <= 0.5.2x keeps the rank on the Scheduler (None without --dp-size)
    assert sg.dp_rank(SimpleNamespace(dp_rank=1)) == 1
    assert sg.dp_rank(SimpleNamespace(dp_rank=0)) == 0
    # no sglang here: 0.5.23's runtime context cannot be asked, no DP rank said
    assert sg.dp_rank(SimpleNamespace(dp_rank=None)) is None


def _segment_refcount(directory: str, name: str) -> int:
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDONLY)
    try:
        return segfile.read_header(fd, path).refcount
    finally:
        os.close(fd)


def test_dp_controller_gives_its_references_back_once_forwarded(shm_dir):
    """SGLang's controller keeps the last request it received in a local
    variable until the next one arrives; its handles' references come back
    as soon as the dispatcher has forwarded the request all the same, and the
    scheduler's copy is the last holder."""
    t = torch.arange(64 * 1024, dtype=torch.float32)
    h = ShmTensor.from_tensor(t)
    h.share(1)  # the tokenizer's hop for the controller (_dp_hops)
    wire = pickle.dumps({"mm": [h]})
    h.disown()  # sent: both references travel in the message
    name = h.name
    sent: list[bytes] = []

    class Controller:  # DataParallelController's shape: its dispatcher sends at once
        def __init__(self):
            self._request_dispatcher = lambda req: sent.append(pickle.dumps(req))

    ctrl = Controller()
    sg_roles.controller_ready(lambda: None, ctrl, (), {})
    recv_req = pickle.loads(wire)  # the controller's copy (one holder)
    assert _segment_refcount(shm_dir, name) == 2
    ctrl._request_dispatcher(recv_req)
    # recv_req is still alive, as in the event loop: its reference is back anyway
    assert _segment_refcount(shm_dir, name) == 1
    sched = pickle.loads(sent[0])  # the DP rank's scheduler
    view = sched["mm"][0].materialize()
    assert torch.equal(view, t)
    del sched, view
    gc.collect()
    assert not os.path.exists(os.path.join(shm_dir, name))  # the last release unlinked
    del recv_req


def test_dp_controller_gives_its_references_back_when_dispatch_fails(shm_dir):
    h = ShmTensor.from_tensor(torch.ones(32 * 1024))
    wire = pickle.dumps([h])
    h.disown()
    name = h.name

    class Controller:
        def __init__(self):
            self._request_dispatcher = self.fail

        def fail(self, req):
            raise ValueError("DP rank 3 is not active.")

    ctrl = Controller()
    sg_roles.controller_ready(lambda: None, ctrl, (), {})
    recv_req = pickle.loads(wire)
    with pytest.raises(ValueError, match="not active"):
        ctrl._request_dispatcher(recv_req)
    assert not os.path.exists(os.path.join(shm_dir, name))
    del recv_req


# -- vLLM ----------------------------------------------------------------------------------
_VLLM_PROC = textwrap.dedent('''
    import subprocess, sys
    from types import SimpleNamespace
    from mmshm import metrics
    from mmshm.hooks import report
    from mmshm.integrations.vllm import roles, server as mv

    report.configure_logging(force=True)
    if sys.argv[1] == "engine":
        print("role:", mv.engine_role(), flush=True)
        # the EngineCore's own hook, as in vLLM: it says what this engine turned on
        roles.engine_ready(lambda: None, SimpleNamespace(), (), {})
        # a worker process the engine starts (vLLM's MultiprocExecutor)
        subprocess.run([sys.executable, "-c", sys.argv[2], "worker", sys.argv[2]], check=True)
    else:
        class Queue:  # a reader's MessageQueue
            _is_writer = False
            _is_remote_reader = False
        roles.worker_ready(lambda: None,
                           SimpleNamespace(worker=SimpleNamespace(rank=0),
                                           rpc_broadcast_mq=Queue()), (), {})
        print("role:", mv.worker_role(0), flush=True)
    print("gauge:", sorted(set(
        s.labels["role"] for s in metrics.PATH_ENABLED.collect()[0].samples)), flush=True)
''')


def _vllm_process(title: str | None) -> tuple[str, str]:
    """Run :data:`_VLLM_PROC` as an EngineCore whose command line shows
    ``title`` (None: no title) and that starts a worker; (stdout, stderr).
    The title rides as an argument: ``exec -a`` would hide this virtualenv
    from the interpreter, and mmshm, as ``mmshm status``, reads the whole
    command line."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    cmd = [sys.executable, "-c", _VLLM_PROC, "engine", _VLLM_PROC, *([title] if title else [])]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout, p.stderr


@pytest.mark.timeout(240)
def test_vllm_roles_name_the_dp_rank_of_the_engine_process():
    out, err = _vllm_process("VLLM::EngineCore_DP1")
    assert "role: EngineCore (DP rank 1)" in out
    assert "role: worker (DP rank 1, rank 0)" in out  # from its EngineCore's title
    assert "gauge: ['EngineCore (DP rank 1)']" in out
    assert "gauge: ['worker (DP rank 1, rank 0)']" in out
    assert ", EngineCore (DP rank 1) (pid " in err and ": on: " in err, err
    assert ", worker (DP rank 1, rank 0) (pid " in err, err


@pytest.mark.timeout(240)
def test_vllm_roles_without_data_parallelism_are_unchanged():
    out, err = _vllm_process(None)
    assert "role: EngineCore\n" in out and "role: worker (rank 0)\n" in out
    assert ", EngineCore (pid " in err and ", worker (rank 0) (pid " in err, err
    assert "DP rank" not in out + err


# -- mmshm status ------------------------------------------------------------------------
@pytest.mark.parametrize("title, role, dp", [
    ("sglang::scheduler", "SGLang scheduler", None),
    ("sglang::scheduler_TP1", "SGLang scheduler TP1", None),
    ("sglang::scheduler_DP1", "SGLang scheduler DP1", 1),
    ("sglang::scheduler_DP0_TP1", "SGLang scheduler TP1 DP0", 0),
    ("sglang::scheduler_DP1_MOE_DP0_TP1", "SGLang scheduler TP1 DP1 MOE_DP0", 1),
    ("sglang::data_parallel_controller", "SGLang data_parallel_controller", None),
    ("VLLM::EngineCore", "vLLM EngineCore", None),
    ("VLLM::EngineCore_DP1", "vLLM EngineCore DP1", 1),
    ("VLLM::Worker_DP0_TP1", "vLLM worker DP0 TP1", 0),
])
def test_status_roles_and_dp_rank_from_process_titles(title, role, dp):
    assert status.role_of(title) == role
    assert status.dp_rank_of(status.role_of(title)) == dp


@pytest.mark.timeout(120)
def test_status_row_of_a_dp_scheduler_and_of_a_dense_replicas_worker(shm_dir, tmp_path):
    """``mmshm status --json`` rows carry ``dp_rank``: a scheduler from its
    own title, a vLLM worker whose title has no DP (a dense model's replica)
    from its EngineCore's."""
    engine = tmp_path / "engine.sh"  # its worker's title stays off its command line
    engine.write_text("(exec -a VLLM::Worker_TP1 sleep 60) & wait\n")
    procs = [subprocess.Popen(["bash", "-c", "exec -a sglang::scheduler_DP1 sleep 60"]),
             subprocess.Popen(["bash", "-c", f"exec -a VLLM::EngineCore_DP3 bash {engine}"])]
    try:
        import time

        deadline = time.monotonic() + 30
        rows: dict = {}
        while time.monotonic() < deadline:
            found, _ = status.scan_processes(shm_dir)
            worker = [c.pid for c in psutil.Process(procs[1].pid).children()]
            rows = {pid: (found[pid]["role"], found[pid]["dp_rank"])
                    for pid in [procs[0].pid, procs[1].pid, *worker] if pid in found}
            if len(rows) == 3:
                break
            time.sleep(0.2)
        assert rows.get(procs[0].pid) == ("SGLang scheduler DP1", 1), rows
        assert rows.get(procs[1].pid) == ("vLLM EngineCore DP3", 3), rows
        assert [v for k, v in rows.items() if k not in (procs[0].pid, procs[1].pid)] == \
            [("vLLM worker TP1", 3)], rows
        rep = status.status(shm_dir)
        mine = {p.pid: p.dp_rank for p in rep.processes if p.pid in rows}
        assert mine == {pid: dp for pid, (_, dp) in rows.items()}
    finally:
        for p in procs:
            for c in psutil.Process(p.pid).children(recursive=True):
                c.kill()
            p.kill()
            p.wait(10)
