"""Microbenchmarks (pytest-benchmark): handle codec, reference operations, and
wrap/unwrap of a 32-image request. Run with

    .venv/bin/python -m pytest benchmarks --benchmark-only

They are not part of the test suite's assertions on speed; they report.
"""

from __future__ import annotations

import gc
import os
import tempfile

import pytest
import torch

import mmshm
from mmshm import config, segment

QWEN2VL_720P = (4784, 1176)


@pytest.fixture(autouse=True)
def private_dir(monkeypatch):
    d = tempfile.mkdtemp(prefix="mmshm-bench-", dir="/dev/shm")
    monkeypatch.setenv("MMSHM_DIR", d)
    monkeypatch.setenv("MMSHM_REAP_INTERVAL_S", "0")
    config.reload()
    yield d
    gc.collect()
    segment.sweep()
    left = [n for n in os.listdir(d) if n.startswith("mmshm-")]
    os.rmdir(d) if not left else None
    config.reload()
    assert not left, left


@pytest.fixture
def handle():
    h = mmshm.ShmTensor.from_tensor(torch.zeros(1024))
    yield h
    h.release()


def test_encode(benchmark, handle):
    data = benchmark(handle.encode)
    assert len(data) <= 64


def test_decode(benchmark, handle):
    data = handle.encode()

    def decode():
        h = mmshm.ShmTensor.decode(data)
        h._disown()  # no reference was handed out for it
        return h

    assert benchmark(decode).name == handle.name


def test_share_release(benchmark, handle):
    def op():
        handle.share(1)
        segment.update_refcount(handle.name, -1)

    benchmark(op)
    assert segment.attach(handle.name).refcount() == 1


def test_wrap_unwrap_32_images(benchmark):
    req = {"mm_items": [{"feature": torch.rand(*QWEN2VL_720P)} for _ in range(32)]}

    def roundtrip():
        w = mmshm.wrap(req)
        out = mmshm.unwrap(w)
        del w
        return out

    out = benchmark.pedantic(roundtrip, rounds=3, iterations=1)
    assert torch.equal(out["mm_items"][5]["feature"], req["mm_items"][5]["feature"])
