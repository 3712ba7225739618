"""Tensors already on a device, met in a request: left to the server and counted.

mmshm's handles carry CPU bytes; a tensor that lives on a GPU stays with the
server as it came (mmshm would otherwise add a D2H and an H2D), counted once
per tensor in ``mmshm_device_tensors_total{kind="cuda"}``. This host has no
GPU: a tensor on torch's ``meta`` device is a tensor whose ``device.type`` is
not ``cpu``, the one property :func:`mmshm.transport.wrapping.left_on_device`
reads. An integration's opaque types (SGLang's CUDA-IPC proxies, counted by
the integration, see tests/integrations/test_sglang_gpu_transport.py) reach the
walk's leaf whole (``transform(..., leaves=...)``).
"""

from __future__ import annotations

import mmshm
import torch
from mmshm.transport.wrapping import left_on_device, transform

from tests.harness.metrics import fallbacks_total, metric
from tests.harness.segments import segment_files
from tests.harness.tensors import make_tensor, same

BIG = 64 * 1024


def cuda_count() -> float:
    return metric("mmshm_device_tensors_total", kind="cuda")


def test_device_tensors_stay_and_count_once_each(shm_dir):
    on_dev = torch.empty(BIG // 4, device="meta")  # 64 KiB, float32
    other = torch.empty(BIG // 2, device="meta")
    tiny = torch.empty(4, device="meta")  # under min_bytes: not counted
    cpu = make_tensor(1, (64, 256))
    before, fb = cuda_count(), fallbacks_total()
    req = {"a": on_dev, "again": [on_dev, (on_dev,)], "b": other, "tiny": tiny, "cpu": cpu}
    w = mmshm.wrap(req, min_bytes=BIG)
    assert cuda_count() - before == 2  # on_dev once although met three times, other once
    assert w["a"] is on_dev and w["again"][0] is on_dev and w["again"][1][0] is on_dev
    assert w["b"] is other and w["tiny"] is tiny
    assert isinstance(w["cpu"], mmshm.ShmTensor) and same(w["cpu"].materialize(copy=True), cpu)
    assert fallbacks_total() == fb  # not a failure
    assert req["cpu"] is cpu  # the request is not modified
    mmshm.release(w)
    # another request with the same tensor counts it again: once per request
    w2 = mmshm.wrap({"a": on_dev}, min_bytes=BIG)
    assert w2["a"] is on_dev and cuda_count() - before == 3
    assert segment_files() == []


def test_left_on_device_is_false_for_cpu_and_non_tensors(shm_dir):
    seen: set[int] = set()
    before = cuda_count()
    assert not left_on_device(make_tensor(2), seen)
    assert not left_on_device("pixels", seen) and not left_on_device(None, seen)
    assert seen == set() and cuda_count() == before
    m = torch.empty(8, device="meta")
    assert left_on_device(m, seen, min_bytes=64)  # 32 bytes: left, not counted
    assert cuda_count() == before and seen == set()
    assert left_on_device(m, seen) and left_on_device(m, seen)
    assert cuda_count() - before == 1 and seen == {id(m)}


class Opaque:
    """An integration's object holding device state (as SGLang's proxies do)."""

    def __init__(self, inner):
        self.inner = inner


def test_leaves_reach_the_leaf_whole(shm_dir):
    inner = make_tensor(3, (64, 256))
    box = Opaque(inner)
    req = {"item": [box, inner]}
    met = []

    def leaf(x):
        met.append(x)
        return x

    out = transform(req, leaf, leaves=(Opaque,))
    assert out is req and met == [box, inner]  # the box whole, its tensor not walked into
    met.clear()
    transform(req, leaf)  # without leaves=, the walk goes inside
    assert met == [inner, inner]
    # wrap walks into a plain object and carries its CPU tensor, in a copy
    w = mmshm.wrap(req, min_bytes=BIG)
    assert w["item"][0] is not box and isinstance(w["item"][0].inner, mmshm.ShmTensor)
    assert box.inner is inner
    mmshm.release(w)
    assert segment_files() == []
