"""PD disaggregation: a decode instance's tokenizer withholds the pixels (docs/sglang.md)."""

from __future__ import annotations

from mmshm.transport import withhold
from mmshm.transport.withhold import WithheldPayload  # noqa: F401 - the tokenizer's stand-in

from .server import items, on_failure, set_item_hashes, tensors

DECODE_WITHHOLDS = False  # this tokenizer's decode_payload_policy: True withholds
SCHEDULER = None  # this process's Scheduler (weak): its disaggregation_mode
#: Item fields that hold a payload only the vision (or audio) encoder reads.
PAYLOAD_FIELDS = ("feature", "precomputed_embeddings")
PATH_DECODE_WITHHOLD = (
    "PD decode instance (--disaggregation-mode decode): multimodal items reach the "
    "scheduler without their pixels (hashes, pad values and token layout kept; the KV "
    "comes from the prefill instance, the vision encoder never runs here)")
PATH_DECODE_KEEP = "PD decode instance: pixels kept ({})"


def decode_payload_policy(tokenizer_manager) -> tuple[bool, str] | None:
    """``(True, line)``: withhold the pixels; ``(False, line)``: keep them (why:
    ``--enable-pd-role-switch``); None: not a PD decode instance."""
    mode = getattr(getattr(tokenizer_manager, "disaggregation_mode", None), "value", None)
    if mode != "decode":
        return None
    if getattr(getattr(tokenizer_manager, "server_args", None), "enable_pd_role_switch",
               False):
        return False, PATH_DECODE_KEEP.format(
            "--enable-pd-role-switch: this instance may become a prefill instance, "
            "which needs them")
    return True, PATH_DECODE_WITHHOLD


def withhold_payloads(mm_inputs):
    """A copy of ``mm_inputs`` with :class:`WithheldPayload` for the payload of
    each item hashed first (BLAKE3, as a prefill instance under mmshm hashes
    it); an item that cannot be hashed keeps its tensors."""
    from mmshm.transport.wrapping import transform

    set_item_hashes(mm_inputs)
    withheld = {id(t): t for item in items(mm_inputs) if getattr(item, "hash", None)
                is not None for name in PAYLOAD_FIELDS
                for t in tensors(getattr(item, name, None))}
    if not withheld:
        return mm_inputs
    return transform(mm_inputs, lambda x: withhold.WithheldPayload.of(x) if id(x) in withheld
                     else x)


def settle_withheld(reqs):
    """``None`` for each withheld payload in ``reqs`` (decode mode), else the
    request fails with :class:`PayloadWithheldError`; alike on every TP
    rank. ``reqs`` (a list) is updated in place and returned."""
    if not reqs:
        return reqs
    scheduler = SCHEDULER() if SCHEDULER is not None else None
    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", None)
    for i, req in enumerate(reqs):
        for r in (getattr(req, "batch", None) or [req]):
            mm = getattr(r, "mm_inputs", None)
            found = [(item, name) for item in (items(mm) if mm else ())
                     for name in PAYLOAD_FIELDS
                     if withhold.has_withheld(getattr(item, name, None))]
            if not found:
                continue
            if mode == "decode":
                for item, name in found:
                    setattr(item, name, None)
                continue
            err = withhold.failure(
                f"request {getattr(r, 'rid', '?')}: {len(found)} multimodal tensor(s) were "
                "withheld by a PD decode instance's tokenizer, and this scheduler is "
                f"in {mode or 'unknown'} mode, where the vision encoder may need them")
            out = on_failure(r, err)
            if r is req and out is not r and isinstance(reqs, list):
                reqs[i] = out
    return reqs
