"""The TP path: ``broadcast_pyobj`` carries metadata, every rank materializes (docs/sglang.md)."""

import sys

from .server import on_failure


def deferred_broadcast(original):
    """``broadcast_pyobj`` as :func:`mmshm.deferred_unwrap`: references handed
    out before, unwrap after on every rank, failures agreed, no barrier."""
    from mmshm import deferred_unwrap

    deferred = deferred_unwrap(original, on_failure=on_failure)

    def wrapper(wrapped, instance, args, kwargs):
        return deferred(*args, **kwargs)

    return wrapper


def attn_broadcast(original):
    """``attn_cp_tp_broadcast_pyobj`` (0.5.23, DP attention): deferred unwrap on
    the attention-TP group; with context parallel, materialized first, inline."""
    from mmshm import deferred_unwrap
    from mmshm.transport.views import unwrap_or_fail

    module = sys.modules[original.__module__]
    deferred = deferred_unwrap(module.broadcast_pyobj, on_failure=on_failure)

    def wrapper(wrapped, instance, args, kwargs):
        data = args[0] if args else kwargs["data"]
        tp, cp = module.get_attn_tp_group(), module.get_attn_cp_group()
        if cp.world_size > 1:
            if data:
                data = [unwrap_or_fail(r, on_failure) for r in data]
            return wrapped(data)
        if tp.world_size == 1:
            return wrapped(*args, **kwargs)
        return deferred(data, tp.rank, tp.cpu_group, src=tp.ranks[0])

    return wrapper
