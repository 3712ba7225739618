"""Prefill/decode disaggregation on vLLM (docs/vllm.md, "Prefill/decode"): a decode
instance (``kv_consumer``, ``kv_load_failure_policy=fail``) gets requests
prefilled elsewhere without their pixel payload; the EngineCore keeps their
hashes, placeholder ranges and grids, and a request that would still run its
encoder fails with :class:`mmshm.errors.PayloadWithheldError`. A withheld
stand-in is never keyed by the EPD connector (:mod:`.epd`)."""

import contextvars

from mmshm.transport import withhold

from .server import SCHED, tensors

#: The placeholder of a withheld tensor: ``{WITHHELD_KEY: nbytes}``.
WITHHELD_KEY = "mmshm_withheld"
#: Inside the ``ADD`` of a request whose payload is withheld: [tensors, bytes].
WITHHOLDING: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "mmshm_vllm_withholding", default=None)
#: This frontend's decode_payload_policy: True withholds, False keeps, None: no KV consumer.
DECODE_WITHHOLDS: bool | None = None
#: The EngineCore's stand-in for a withheld tensor (``dtype``: vLLM's name
#: without ``torch.``): empty, known to :func:`withheld_in`.
withheld_tensor = withhold.stand_in
PATH_DECODE_WITHHOLD = (
    "decode instance (kv_consumer, kv_load_failure_policy=fail): requests prefilled "
    "elsewhere (kv_transfer_params.do_remote_prefill) carry no pixel payload; the "
    "EngineCore keeps their hashes, placeholder ranges and grids, and a request that would "
    "still run its encoder fails with PayloadWithheldError")
PATH_DECODE_KEEP = "decode instance: pixels kept for requests prefilled elsewhere ({})"


def decode_payload_policy(vllm_config) -> tuple[bool, str] | None:
    """``(True, line)``: withhold the pixels of requests prefilled elsewhere;
    ``(False, line)``: keep them (why); None: no KV consumer. Withheld only
    where vLLM fails such a request rather than compute it: a pure
    ``kv_consumer``, ``kv_load_failure_policy=fail``, no processor cache, a
    scheduler mmshm can guard."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or not getattr(kv, "is_kv_consumer", False):
        return None
    policy = getattr(kv, "kv_load_failure_policy", "recompute")
    mm = getattr(getattr(vllm_config, "model_config", None), "multimodal_config", None)
    if getattr(kv, "kv_role", None) != "kv_consumer":
        why = f"kv_role={kv.kv_role}: this instance prefills too"
    elif policy != "fail":
        why = (f"kv_load_failure_policy={policy}: a KV load that fails is recomputed here, "
               f"which needs them")
    elif (getattr(mm, "mm_processor_cache_gb", 0) or 0) > 0:
        why = ("the multimodal processor cache is on; --mm-processor-cache-gb 0 lets mmshm "
               "withhold them")
    elif not scheduler_guarded():
        why = "this vLLM's scheduler has no _try_schedule_encoder_inputs to guard"
    else:
        return True, PATH_DECODE_WITHHOLD
    return False, PATH_DECODE_KEEP.format(why)


def scheduler_guarded() -> bool:
    """vLLM's ``Scheduler`` has ``_try_schedule_encoder_inputs`` (read once at start-up)."""
    try:
        import importlib

        sched = importlib.import_module(SCHED).Scheduler
    except Exception:  # noqa: BLE001 - no scheduler: nothing to guard with
        return False
    return hasattr(sched, "_try_schedule_encoder_inputs")


def remote_prefilled(request) -> bool:
    """``kv_transfer_params.do_remote_prefill`` in the request's sampling
    params' ``extra_args`` (where vLLM's OpenAI server puts it)."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    return isinstance(params, dict) and bool(params.get("do_remote_prefill"))


def withheld_in(feature) -> bool:
    """Whether a ``MultiModalFeatureSpec``'s data holds a withheld stand-in."""
    data = getattr(feature, "data", None)
    if data is None or not withhold.any_stand_ins():
        return False
    return any(withhold.is_stand_in(t) for elem in data.values()
               for t in tensors(getattr(elem, "data", None)))


def try_schedule_encoder_inputs(wrapped, instance, args, kwargs):
    """An encoder input whose pixels were withheld fails its request (vLLM's
    ``encoder_cache_mismatch_reqs``: ``FINISHED_ERROR`` after the step)."""
    out = wrapped(*args, **kwargs)
    if not withhold.any_stand_ins():
        return out
    request = args[0] if args else kwargs.get("request")
    features = getattr(request, "mm_features", None) or ()
    # (to schedule, num_new_tokens, budget[, loaded from the EC connector[, duplicates]])
    duplicates = out[4] if len(out) > 4 else ()
    need = [i for i in (*out[0], *duplicates)
            if i < len(features) and withheld_in(features[i])]
    failed = getattr(instance, "encoder_cache_mismatch_reqs", None)
    if not need or failed is None:
        return out
    rid = getattr(request, "request_id", "?")
    failed.add(rid)  # the error: counted and said, vLLM fails the request after the step
    withhold.failure(
        f"request {rid}: the decode instance would run the encoder for "
        f"{len(need)} item(s) whose pixels mmshm withheld (its KV did not load up to "
        f"them: {args[1] if len(args) > 1 else kwargs.get('num_computed_tokens', '?')} of "
        f"{getattr(request, 'num_prompt_tokens', '?')} prompt tokens computed). Fix: "
        f"prefill it on the prefill instance first, or set kv_load_failure_policy=recompute "
        f"on the decode instance", warn=True)
    budget = args[3] if len(args) > 3 else kwargs.get("encoder_compute_budget")
    return ([], 0, budget, *([] for _ in out[3:]))
