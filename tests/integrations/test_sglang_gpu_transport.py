"""SGLang's own GPU transport of multimodal features, under mmshm, on the real code.

With ``--mm-feature-transport cuda_ipc|cuda_vmm`` (0.5.23) or
``SGLANG_USE_CUDA_IPC_TRANSPORT=1`` (0.5.9-0.5.15, which have no flag) SGLang's
processor puts each feature in its GPU pool and the request carries a
``CudaIpcTensorTransportProxy`` (0.5.23's VMM proxies subclass it) or, pool
full, the tensor. mmshm leaves the proxies and any tensor on a device to SGLang
(the same objects, counted in ``mmshm_device_tensors_total{kind}``), carries the
CPU tensors, and its tokenizer "on:" line says so at INFO.

No CUDA here: the proxies are built by the release's real constructor on CPU
tensors. On 0.5.23 it takes a pool slice's offsets and a pool handle that is
never opened here; on 0.5.9-0.5.15, given no pool handle, SGLang's own
``get_proxy_state`` finds no CUDA IPC handle and keeps the tensor in the proxy
(``tensor_data``), its real fallback state. A tensor on the ``meta`` device
stands for a CUDA tensor (its ``device.type`` is not ``cpu``, which is all
mmshm reads). Runs in ``python -m tests.run sglang``'s venvs.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import logging
import os
import pickle

import pytest

RELEASE = os.environ.get("MMSHM_SGLANG_RELEASE")
if not RELEASE:
    pytest.skip("SGLang integration tests run in `python -m tests.run sglang`'s venvs",
                allow_module_level=True)

import mmshm
import torch
from mmshm.hooks import report
from mmshm.integrations.sglang import roles, server

from tests.harness.metrics import metric
from tests.harness.segments import segment_files
from tests.integrations import sglang_env as E

V = tuple(int(x) for x in RELEASE.split("."))


@pytest.fixture(scope="module")
def ns():
    return E.load()


@pytest.fixture(autouse=True)
def clean(ns, monkeypatch):
    mmshm.uninstrument("sglang")
    E.configure(ns.mm)
    report._reset_for_tests()
    monkeypatch.delenv("SGLANG_USE_CUDA_IPC_TRANSPORT", raising=False)
    yield
    mmshm.uninstrument("sglang")
    report._reset_for_tests()
    gc.collect()
    assert segment_files() == []


def device_count(kind: str) -> float:
    return metric("mmshm_device_tensors_total", kind=kind)


def proxy_class():
    """The release's ``CudaIpcTensorTransportProxy``, imported as its processor does."""
    for name in server.GPU_PROXY_MODULES:
        try:
            return getattr(importlib.import_module(name), server.GPU_PROXY_CLASS)
        except (ImportError, AttributeError):
            continue
    raise AssertionError("no CudaIpcTensorTransportProxy in this release")


def make_proxy(t):
    cls = proxy_class()
    params = inspect.signature(cls.__init__).parameters
    data = t.reshape(-1).view(torch.uint8)
    if "ready_byte_offset" in params:  # 0.5.23: a slice of the pool; the handle is never opened
        return cls(data=data, info_data=t, pool_ipc_handle=(0, b"no-cuda-pool-here", 1),
                   pool_byte_offset=0, ready_byte_offset=data.numel(),
                   ack_byte_offset=data.numel() + 64, generation=1, total_consumer_count=1,
                   use_pool_handle_cache=True)
    # 0.5.9-0.5.15, no pool handle: no CUDA IPC handle for a CPU tensor, so the
    # proxy keeps the tensor itself (its own fallback)
    return cls(data, t, {"handle": "unused", "shape": (1,), "dtype": "int32"})


class Recording(E.Socket):
    """The socket of the real send path; also keeps the object it was given."""

    def __init__(self):
        super().__init__()
        self.objs = []

    def send_pyobj(self, obj, *a, **kw):
        self.objs.append(obj)
        super().send_pyobj(obj, *a, **kw)


def test_proxies_and_device_tensors_are_left_to_sglang(ns):
    mmshm.instrument("sglang")
    inner = E.expected_feature(0)
    proxy = make_proxy(inner)
    state = pickle.dumps(proxy.__dict__)  # what SGLang's proxy holds, compared after
    on_gpu = torch.empty(512, 1176, device="meta")  # 2.4 MB, not on the CPU
    cpu = E.expected_feature(1)
    req = E.make_request(ns, [proxy, on_gpu, cpu, proxy])
    ipc0, cuda0 = device_count("sglang_ipc"), device_count("cuda")
    sock = Recording()
    E.send_one(ns, req, sock)
    sent = E.items(sock.objs[0])
    # left to SGLang: the very objects, the proxy's state unchanged (not walked into)
    assert sent[0].feature is proxy and sent[3].feature is proxy and sent[1].feature is on_gpu
    assert pickle.dumps(proxy.__dict__) == state
    if V < (0, 5, 23):  # the proxy's own fallback keeps a CPU tensor: not carried by mmshm
        assert isinstance(proxy.proxy_state["tensor_data"], torch.Tensor)
        assert proxy.proxy_state["tensor_data"].data_ptr() == inner.data_ptr()
    # the rest carried: the CPU tensor as a handle
    assert isinstance(sent[2].feature, mmshm.ShmTensor)
    # counted once per object in this request (the proxy is met twice)
    assert device_count("sglang_ipc") - ipc0 == 1
    assert device_count("cuda") - cuda0 == 1
    # the request itself is not modified
    assert [it.feature for it in E.items(req)] == [proxy, on_gpu, cpu, proxy]
    assert E.items(req)[2].feature is cpu
    # what the scheduler receives: the proxy and the meta tensor inline, the handle's bytes
    received = pickle.loads(sock.sent[0])
    got = E.items(received)
    assert type(got[0].feature) is type(proxy) and got[1].feature.device.type == "meta"
    assert torch.equal(got[2].feature.materialize(copy=True), cpu)
    mmshm.release(received)
    del received, got, sent, sock
    gc.collect()
    assert segment_files() == []


def _tokenizer_line(server_args, caplog) -> tuple[str, list[str]]:
    """Run the tokenizer's ``__init__`` hook on a manager holding ``server_args``;
    return its "on:" line and the WARNING lines."""
    import types

    mmshm.instrument("sglang")
    mgr = types.SimpleNamespace(server_args=server_args)
    with caplog.at_level(logging.INFO, logger="mmshm"):
        roles.tokenizer_ready(lambda: None, mgr, (), {})
    lines = [r.getMessage() for r in caplog.records if r.name == "mmshm"]
    on = [m for m in lines if ", tokenizer (pid " in m and ": on: " in m]
    assert len(on) == 1, lines
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "mmshm" and r.levelno >= logging.WARNING]
    return on[0], warnings


@pytest.mark.skipif(V < (0, 5, 23), reason="--mm-feature-transport is 0.5.23's")
@pytest.mark.parametrize("transport", ["cuda_ipc", "cuda_vmm"])
def test_on_line_names_sglangs_gpu_transport(ns, caplog, transport):
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="tiny", mm_feature_transport=transport)
    assert server.gpu_feature_transport(args) == transport
    line, warnings = _tokenizer_line(args, caplog)
    assert server.gpu_transport_note(transport) in line
    assert f"--mm-feature-transport {transport}) are left to it" in line
    assert "mmshm carries only the rest" in line
    assert warnings == []  # not a failure
    assert metric("mmshm_path_enabled", server="sglang", role="tokenizer",
                  path=server.gpu_transport_note(transport)) == 1


@pytest.mark.skipif(V < (0, 5, 23), reason="--mm-feature-transport is 0.5.23's")
@pytest.mark.parametrize("transport", [None, "cpu"])
def test_on_line_without_a_gpu_transport_says_nothing_of_it(ns, caplog, transport):
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="tiny", mm_feature_transport=transport)
    assert server.gpu_feature_transport(args) is None
    line, warnings = _tokenizer_line(args, caplog)
    assert "GPU pool" not in line and server.PATH_REQUESTS in line
    assert warnings == []


def test_legacy_environment_variable(ns, caplog, monkeypatch):
    """0.5.9-0.5.15 switch CUDA IPC on with ``SGLANG_USE_CUDA_IPC_TRANSPORT``
    (0.5.23 still maps it to ``--mm-feature-transport cuda_ipc``)."""
    import types

    args = types.SimpleNamespace(dp_size=1)
    if V >= (0, 5, 23):
        from sglang.srt.server_args import ServerArgs

        args = ServerArgs(model_path="tiny")  # the flag unset
    assert server.gpu_feature_transport(args) is None
    monkeypatch.setenv("SGLANG_USE_CUDA_IPC_TRANSPORT", "1")
    assert server.gpu_feature_transport(args) == "cuda_ipc"
    line, warnings = _tokenizer_line(args, caplog)
    assert server.gpu_transport_note("cuda_ipc") in line and warnings == []
    monkeypatch.setenv("SGLANG_USE_CUDA_IPC_TRANSPORT", "0")
    assert server.gpu_feature_transport(args) is None
