"""A vLLM decode instance's withheld pixels, at module level (no vLLM here):
which configurations withhold, what the frontend's consumer puts in a
message instead of a segment, and the scheduler guard that fails a request
rather than run its encoder on a stand-in. The real decode instance is
launched in tests/e2e/test_vllm_shapes.py."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from mmshm.transport import sending
from mmshm.integrations.vllm import pd as iv
from mmshm.integrations.vllm import requests as ivr


def _config(role="kv_consumer", policy="fail", cache_gb=0.0, connector="ExampleConnector"):
    kv = NS(kv_connector=connector, kv_role=role, kv_load_failure_policy=policy,
            is_kv_consumer=role in ("kv_consumer", "kv_both"))
    return NS(kv_transfer_config=kv,
              model_config=NS(multimodal_config=NS(mm_processor_cache_gb=cache_gb)))


@pytest.fixture
def guarded(monkeypatch):
    monkeypatch.setattr(iv, "scheduler_guarded", lambda: True)


def test_only_a_pure_consumer_that_fails_on_a_bad_load_withholds(guarded):
    assert iv.decode_payload_policy(None) is None
    assert iv.decode_payload_policy(NS(kv_transfer_config=None)) is None
    assert iv.decode_payload_policy(_config(role="kv_producer")) is None
    assert iv.decode_payload_policy(_config()) == (True, iv.PATH_DECODE_WITHHOLD)
    for cfg, why in ((_config(role="kv_both"), "kv_role=kv_both"),
                     (_config(policy="recompute"), "kv_load_failure_policy=recompute"),
                     (_config(cache_gb=4.0), "--mm-processor-cache-gb 0")):
        withhold, line = iv.decode_payload_policy(cfg)
        assert not withhold and line.startswith("decode instance: pixels kept") and why in line


def test_no_guard_no_withholding(monkeypatch):
    monkeypatch.setattr(iv, "scheduler_guarded", lambda: False)
    withhold, line = iv.decode_payload_policy(_config())
    assert not withhold and "_try_schedule_encoder_inputs" in line


def test_remote_prefilled_reads_the_requests_kv_transfer_params():
    def req(extra):
        return NS(sampling_params=NS(extra_args=extra))

    assert iv.remote_prefilled(req({"kv_transfer_params": {"do_remote_prefill": True}}))
    assert not iv.remote_prefilled(req({"kv_transfer_params": {"do_remote_decode": True}}))
    assert not iv.remote_prefilled(req(None))
    assert not iv.remote_prefilled(NS(sampling_params=None))


def test_consumer_withholds_the_payload_and_writes_nothing():
    t = torch.ones(4096, 64)
    consumer = ivr.ShmTensorConsumer()
    token = iv.WITHHOLDING.set([0, 0])
    try:
        with sending.sending() as box:
            out = consumer(t)
            assert not box.handles
    finally:
        withheld = iv.WITHHOLDING.get()
        iv.WITHHOLDING.reset(token)
    assert out == {iv.WITHHELD_KEY: t.nbytes}
    assert withheld == [1, t.nbytes]
    stand_in = ivr.ShmTensorProvider()("float32", [4096, 64], out)
    assert stand_in.numel() == 0 and stand_in.dtype == torch.float32


def _feature(data_tensor):
    return NS(data={"pixel_values": NS(data=data_tensor),
                    "image_grid_thw": NS(data=torch.tensor([1, 4, 4]))})


def test_scheduler_guard_fails_the_request_instead_of_running_the_encoder():
    stand_in = iv.withheld_tensor("float32", (16, 1176))
    request = NS(request_id="r1", num_prompt_tokens=100,
                 mm_features=[_feature(torch.ones(16, 1176)), _feature(stand_in)])
    sched = NS(encoder_cache_mismatch_reqs=set())
    assert iv.withheld_in(request.mm_features[1]) and not iv.withheld_in(request.mm_features[0])

    # vLLM would schedule the first item only (its pixels are there): untouched
    out = ([0], 40, 7, [], [])
    got = iv.try_schedule_encoder_inputs(lambda *a: out, sched, (request, 10, 40, 9), {})
    assert got is out and not sched.encoder_cache_mismatch_reqs

    # the withheld item: nothing scheduled, the request failed through vLLM's set
    got = iv.try_schedule_encoder_inputs(lambda *a: ([1], 40, 3, [], []), sched,
                                            (request, 60, 40, 9), {})
    assert got == ([], 0, 9, [], []) and sched.encoder_cache_mismatch_reqs == {"r1"}
    # an older vLLM's 4-tuple keeps its arity
    got = iv.try_schedule_encoder_inputs(lambda *a: ([1], 40, 3, []), sched,
                                            (request, 60, 40, 9), {})
    assert got == ([], 0, 9, [])


def test_a_device_tensor_is_left_to_vllm_and_counted_once_per_message():
    """A tensor already on a device (here the ``meta`` device: no CUDA on this
    host) is handed to vLLM's own consumer untouched, and counted once per
    message in mmshm_device_tensors_total{kind="cuda"}."""
    from tests.harness.metrics import metric

    seen = []

    class Inner:
        def new_message(self):
            seen.append("new")

        def __call__(self, t):
            seen.append(t)
            return "vllm's"

    t = torch.empty(4096, 64, device="meta")
    consumer = ivr.ShmTensorConsumer(Inner())
    before = metric("mmshm_device_tensors_total", kind="cuda")
    for _ in range(2):  # two messages, the tensor twice in each
        consumer.new_message()
        with sending.sending() as box:
            assert consumer(t) == "vllm's" and consumer(t) == "vllm's"
            assert not box.handles
    assert seen == ["new", t, t, "new", t, t]
    assert metric("mmshm_device_tensors_total", kind="cuda") - before == 2
