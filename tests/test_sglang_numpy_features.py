"""SGLang's tokenizer boundary with a numpy feature (no SGLang needed).

SGLang's ``LlavaImageProcessor`` (LLaVA checkpoints in their original format,
e.g. ``LlavaQwenForCausalLM``) returns float16 numpy pixel values, which the
model reads with ``np.concatenate``. mmshm carries torch tensors only, so such
a feature travels inline: that must be said once at WARNING, while torch
features in the same request still go through shared memory.
"""

from __future__ import annotations

import logging
import pickle
import sys
import types

import numpy as np
import pytest
import torch
from mmshm import ShmTensor
from mmshm.transport import sending
from mmshm.integrations.sglang import requests as glue
from mmshm.integrations.sglang import server


class _Item:
    def __init__(self, feature):
        self.feature = feature
        self.precomputed_embeddings = None
        self.hash = 1  # hashed already: nothing for the glue to hash


class _Req:
    def __init__(self, items):
        self.mm_inputs = types.SimpleNamespace(mm_items=items)


@pytest.fixture
def sglang_modules(monkeypatch):
    """The two SGLang modules the glue asks about, as stand-ins: a tokenizer
    with pickle IPC (the default)."""
    mm = types.ModuleType(server.MM_UTILS)
    mm.get_global_server_args = lambda: types.SimpleNamespace(skip_tokenizer_init=False)
    monkeypatch.setitem(sys.modules, server.MM_UTILS, mm)
    monkeypatch.delitem(sys.modules, server.IO_STRUCT, raising=False)
    monkeypatch.setattr(glue, "_numpy_warned", set())


def _wrap(req):
    """The glue's wrap_shm_features on ``req`` inside one send; returns the
    request as the scheduler receives it (pickled: the handles own the
    references that travelled) and how many handles the send carried."""
    def wrapped(obj):  # SGLang's own wrap_shm_features: not called under mmshm
        raise AssertionError("SGLang's wrap_shm_features was called")

    with sending.sending() as box:
        out = glue.wrap_shm_features(wrapped, None, (req,), {})
        carried = len(box.handles)
        wire = pickle.dumps(out)
    return pickle.loads(wire), carried


def test_a_numpy_feature_travels_inline_and_is_said_once(sglang_modules, caplog):
    pixels = np.ones((5, 3, 336, 336), dtype=np.float16)  # 3.4 MB, as LlavaImageProcessor's
    audio = torch.ones(1, 128, 3000)  # 1.5 MB
    req = _Req([_Item(pixels), _Item(audio)])
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        out, carried = _wrap(req)
        again, carried2 = _wrap(_Req([_Item(pixels.copy())]))
    items = out.mm_inputs.mm_items
    assert isinstance(items[0].feature, np.ndarray)  # inline, pickled
    assert np.array_equal(items[0].feature, pixels) and items[0].feature.dtype == np.float16
    assert carried == 1 and isinstance(items[1].feature, ShmTensor)  # the tensor went through shm
    assert torch.equal(items[1].feature.materialize(copy=True), audio)
    items[1].feature.release()
    assert req.mm_inputs.mm_items[1].feature is audio  # the input is not modified
    warnings = [r.getMessage() for r in caplog.records if "numpy array" in r.getMessage()]
    assert len(warnings) == 1, warnings  # said once per process
    assert "feature of 3386880 bytes" in warnings[0] and "float16" in warnings[0]
    assert "inline" in warnings[0]
    assert again.mm_inputs.mm_items[0].feature.dtype == np.float16 and carried2 == 0


def test_a_small_numpy_array_is_not_worth_a_warning(sglang_modules, caplog):
    small = np.ones((4, 4), dtype=np.float32)  # 64 bytes: inline anyway
    with caplog.at_level(logging.WARNING, logger="mmshm"):
        out, carried = _wrap(_Req([_Item(small)]))
    assert np.array_equal(out.mm_inputs.mm_items[0].feature, small) and carried == 0
    assert not [r for r in caplog.records if "numpy array" in r.getMessage()]
