"""Tokenizer -> (DP controller ->) scheduler: handles instead of pixels (docs/sglang.md)."""

import copy
import functools

from mmshm import config
from mmshm.hooks import observe
from mmshm.transport import sending, views
from mmshm.transport.receiving import unwrap_each
from mmshm.transport.sending import digest_of

from . import pd
from .server import (gpu_proxy_types, hash_int, items, on_failure, set_item_hashes,
                     transport_off_reason, unhashed_features)

_numpy_warned: set[str] = set()


def _warn_numpy_features(mm_inputs, min_bytes: int) -> None:
    """Say once per process (:func:`mmshm.transport.views.warn_numpy`) that a
    feature of ``min_bytes`` or more is a numpy array (SGLang's
    ``LlavaImageProcessor`` returns them)."""
    views.warn_numpy(((name, getattr(item, name, None)) for item in items(mm_inputs)
                      for name in ("feature", "precomputed_embeddings")), min_bytes,
                     _numpy_warned, "SGLang's processor for this model returns numpy arrays "
                     "(its LlavaImageProcessor does, for LLaVA checkpoints in their original "
                     "format); the Hugging Face format of the checkpoint (e.g. "
                     "LlavaNextForConditionalGeneration) gives tensors")


def wrap_shm_features(wrapped, instance, args, kwargs):
    """``wrap_shm_features(obj)``: a copy of ``obj`` whose ``mm_inputs`` carry
    handles from this send's outbox (``obj`` and the ``mm_items`` fan-out
    copies share are not modified; a decode instance's pixels are withheld
    first); the bytes written count in the open ``tokenizer_wrap`` hop.
    Features SGLang's own GPU transport holds (its CUDA-IPC / CUDA-VMM
    proxies, tensors on a GPU) are left as they are, each counted once in
    ``mmshm_device_tensors_total{kind="sglang_ipc"|"cuda"}``."""
    from mmshm.metrics import DEVICE_TENSORS
    from mmshm.transport.wrapping import left_on_device, transform

    box = sending.current_outbox()
    if box is None or config.get().disable or transport_off_reason() is not None:
        return wrapped(*args, **kwargs)
    obj = args[0] if args else kwargs["obj"]
    mm_inputs = getattr(obj, "mm_inputs", None)
    if not mm_inputs or not items(mm_inputs):
        return obj
    min_bytes = config.get().min_bytes
    kept = pd.withhold_payloads(mm_inputs) if pd.DECODE_WITHHOLDS else mm_inputs
    # the features of items SGLang's processor did not hash: hashed in the copy's pass
    unhashed = unhashed_features(kept)
    before = box.written
    proxies = gpu_proxy_types()
    on_device: set[int] = set()

    # one segment for the request's tensors (its per-image items are views of one)
    box.prepare_tree(kept, lambda x: id(x) in unhashed, min_bytes, leaves=proxies)

    def leaf(x):
        if proxies and isinstance(x, proxies):  # in SGLang's GPU pool: its own
            if id(x) not in on_device:
                on_device.add(id(x))
                DEVICE_TENSORS.labels(kind="sglang_ipc").inc()
            return x
        if left_on_device(x, on_device, min_bytes) or not sending.eligible(x, min_bytes):
            return x
        h = box.put(x, hash_now=id(x) in unhashed)
        return x if h is None else h

    new_mm = transform(kept, leaf, leaves=proxies)
    observe.add_bytes(box.written - before)
    _warn_numpy_features(new_mm, min_bytes)
    set_item_hashes(new_mm)
    if new_mm is mm_inputs:
        return obj
    new_obj = copy.copy(obj)
    new_obj.mm_inputs = new_mm
    return new_obj


def dp_hops(tokenizer_manager) -> int:
    """References per handle for the DP controller (one more holder)."""
    args = getattr(tokenizer_manager, "server_args", None)
    return 1 if getattr(args, "dp_size", 1) and getattr(args, "dp_size", 1) > 1 else 0


#: ``_send_one_request``: one message; its handles' references travel with it,
#: or come back if dispatch fails (async since 0.5.2x).
send_one_request = observe.within(lambda inst, a, kw: sending.sending(hops=dp_hops(inst)))


def handle_batch_request(wrapped, instance, args, kwargs):
    """``n > 1``: one fan-out scope for the call (the warm-up and the samples)."""
    obj = args[0] if args else kwargs.get("obj")
    if getattr(obj, "parallel_sample_num", 1) in (None, 0, 1):
        return wrapped(*args, **kwargs)
    return sending.fanned_out(wrapped(*args, **kwargs))


def hash_feature(wrapped, instance, args, kwargs):
    """The hash the handle carries (BLAKE3-128 of the bytes), however a tensor travelled."""
    f = args[0] if args else kwargs.get("f")
    d = digest_of(f)
    return wrapped(*args, **kwargs) if d is None else hash_int(d)


def forward_then_release(wrapped, instance, args, kwargs):
    """The DP controller's dispatcher: forwarded, then the controller's own
    references given back (also if it raises); the receivers' travel on."""
    from mmshm.transport import wrapping

    try:
        return wrapped(*args, **kwargs)
    finally:
        if args:
            wrapping.release(args[0])


#: Unwrap what no broadcast unwrapped (TP size 1: nothing to agree on).
local_unwrap = functools.partial(unwrap_each, on_failure=on_failure)


def recv_requests(wrapped, instance, args, kwargs):
    """``recv_requests``: unwrapped here at TP size 1, withheld pixels settled."""
    return pd.settle_withheld(local_unwrap(wrapped(*args, **kwargs)))
