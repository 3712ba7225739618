"""A real vLLM ``Request`` with images, for the EC connector's tests
(tests/integrations/test_vllm_ec_connector.py, the vLLM part of
tests/test_probes_ec_store_leg.py). Imports vLLM only when called."""

from __future__ import annotations


def vllm_request(rid: str, items, rows: int):
    """A ``vllm.v1.request.Request`` ``rid`` with one image per
    ``(identifier, inputs)`` of ``items`` (``inputs``: the processor's tensors
    by name, e.g. ``pixel_values`` and ``image_grid_thw``), each image
    ``rows`` placeholder tokens, the ``i``-th at offset ``2 + i * (rows + 2)``,
    its ``mm_hash`` its identifier; the prompt ``4 + len(items) * (rows + 2)``
    token ids, ``max_tokens=4``."""
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        PlaceholderRange,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    feats = []
    for i, (ident, inputs) in enumerate(items):
        data = MultiModalKwargsItem({k: MultiModalFieldElem(data=v, field=MultiModalBatchedField())
                                     for k, v in inputs.items()})
        feats.append(MultiModalFeatureSpec(
            data=data, modality="image", identifier=ident,
            mm_position=PlaceholderRange(offset=2 + i * (rows + 2), length=rows),
            mm_hash=ident))
    n = 4 + len(items) * (rows + 2)
    return Request(request_id=rid, prompt_token_ids=list(range(n)),
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                   mm_features=feats)
