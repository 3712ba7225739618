"""A PD decode instance's withheld payloads, for every server's glue.

A decode instance (prefill/decode disaggregation) gets requests whose KV
cache another instance computed: its vision encoder never runs, so mmshm
sends their multimodal tensors without their bytes. What stands for a
withheld tensor, and how a request that would still need one fails, is the
same on every server:

* on the wire, a :class:`WithheldPayload` (SGLang's requests are pickled
  objects) or a placeholder the server's own codec carries (vLLM: a dict
  naming the bytes); where the server needs a tensor, an empty stand-in of
  the tensor's dtype (:func:`stand_in`), recognized by :func:`is_stand_in`
  (a weak registry: no data, nothing to give back);
* a request that would still run its encoder on one fails with
  :class:`~mmshm.errors.PayloadWithheldError` (:func:`failure`: counted in
  ``mmshm_request_failures_total{reason="payload_withheld"}``), never with
  wrong pixels.
"""

from __future__ import annotations

import logging

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mmshm.errors import PayloadWithheldError
from mmshm.metrics import REQUEST_FAILURES

log = logging.getLogger("mmshm")

#: the stand-ins made in this process (tensor -> the withheld tensor's shape)
_STAND_INS = WeakIdKeyDictionary()


class WithheldPayload:
    """An item's tensor on its way to a decode scheduler: ``shape`` (ints),
    ``dtype`` (torch's name, ``"float32"``), ``nbytes``; no data. The decode
    scheduler hands the server ``None`` (as upstream SGLang's open PR 14832);
    any other fails the request with :class:`PayloadWithheldError`."""

    __slots__ = ("shape", "dtype", "nbytes")

    def __init__(self, shape: tuple, dtype: str, nbytes: int):
        self.shape, self.dtype, self.nbytes = tuple(shape), dtype, int(nbytes)

    @classmethod
    def of(cls, t) -> WithheldPayload:
        return cls(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.nbytes)

    def __repr__(self) -> str:
        return f"WithheldPayload({self.dtype}{list(self.shape)}, {self.nbytes} bytes)"


def has_withheld(value) -> bool:
    """Whether ``value`` (a field's value: a payload or nested lists/tuples)
    holds a :class:`WithheldPayload`."""
    if isinstance(value, WithheldPayload):
        return True
    return isinstance(value, (list, tuple)) and any(has_withheld(v) for v in value)


def stand_in(dtype: str, shape) -> torch.Tensor:
    """The stand-in for a withheld tensor of ``dtype`` (torch's name without
    ``torch.``; uint8 where unknown) and ``shape``: empty (0 elements),
    known to :func:`is_stand_in`."""
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    t = torch.empty(0, dtype=dt if isinstance(dt, torch.dtype) else torch.uint8)
    _STAND_INS[t] = tuple(shape)
    return t


def is_stand_in(t) -> bool:
    """Whether ``t`` is a stand-in of :func:`stand_in`."""
    return bool(_STAND_INS) and isinstance(t, torch.Tensor) and t in _STAND_INS


def any_stand_ins() -> bool:
    """Whether this process holds any stand-in (the cheap test first)."""
    return bool(_STAND_INS)


def failure(message: str, warn: bool = False) -> PayloadWithheldError:
    """The error of a request that needs a withheld payload (``message``),
    counted in ``mmshm_request_failures_total{reason="payload_withheld"}``;
    said at WARNING with ``warn``. The caller fails the request with it."""
    err = PayloadWithheldError(message)
    if warn:
        log.warning("mmshm: %s: %s", type(err).__name__, err)
    REQUEST_FAILURES.labels(reason=PayloadWithheldError.reason).inc()
    return err
