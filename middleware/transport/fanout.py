"""Tokenizer boundary: parallel sampling (``n > 1``) without shared ``mm_items``."""

from __future__ import annotations

from mmshm.errors import MmshmError
from mmshm.segments.shmtensor import ShmTensor
from mmshm.transport.sending import FanOut
from mmshm.transport.wrapping import handles, transform, wrap


def fan_out(obj, n: int, min_bytes: int | None = None, directory: str | None = None) -> list:
    """Return ``n`` independent copies of a request for parallel sampling.

    Tensors of at least ``min_bytes`` are first moved into shared memory (once,
    see :func:`mmshm.wrap`). Every container of every copy is a new object, so
    mutating one copy's ``mm_items`` never touches another's; every copy has its
    own :class:`ShmTensor` objects over the same segments. Exactly ``n - 1``
    references are added per segment (one locked update each) and no payload
    byte is copied. The original handles give their reference to copy 0 and
    are left released: use the copies, not ``obj``. The ``n`` copies count
    in ``mmshm_fanout_copies_total`` (one :class:`~mmshm.transport.sending.FanOut`,
    the fan-out of the instrumentors' scopes too).

    This replaces ``copy.copy(req)`` in SGLang's ``_handle_batch_request``,
    whose copies share one ``mm_items`` list.

    Raises:
        ValueError: ``n < 1``.
        SegmentNotFoundError: a handle in ``obj`` names a segment that is gone.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    obj = wrap(obj, min_bytes=min_bytes, directory=directory)
    hs = handles(obj)
    done: list[ShmTensor] = []
    try:
        for h in hs:
            h.share(n - 1)
            done.append(h)
    except MmshmError:
        for h in done:  # roll back: nothing was handed out yet
            h.ref.add(-(n - 1))
        raise

    def leaf(x):
        return x.twin() if isinstance(x, ShmTensor) else x

    copies = [transform(obj, leaf, copy_all=True) for _ in range(n)]
    for h in hs:
        h.disown()
    FanOut(declared=True).count_copies(n)
    return copies
