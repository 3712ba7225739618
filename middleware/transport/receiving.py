"""The receiving side of a hop, for every instrumentor: materializing handles
where the server decodes or unpickles a message, and turning a handle that
cannot be opened into that request's error, never a crash of the loop that
received it and never wrong bytes.

Three shapes of receiver, each with its helper:

- **a decoder that must return a tensor** (vLLM's out-of-band tensor
  provider, in the EngineCore's input thread): :func:`materialize_wire`
  returns a zero-copy view, or on failure an empty placeholder tensor;
  :func:`failure_in` finds the placeholders in the request later, where the
  server has a per-request error path, and gives the typed error;
- **an unpickler** (a pickle reducer's rebuild function, inside a queue's
  ``dequeue``): inside :func:`collecting`, :func:`rebuild` collects its
  failures instead of raising half-way through a message; the collector
  gives one typed error for the whole message afterwards;
- **a batch of request objects** (SGLang's scheduler at TP size 1):
  :func:`unwrap_each` materializes each request and turns each failed one
  into ``on_failure(request, error)``.

A materialized view is remembered (:data:`mmshm.transport.sending.SEGMENTS`), so that
sending it on (vLLM's EngineCore to its workers) shares its segment instead
of copying it. Every failure is counted in
``mmshm_materialize_failures_total{reason}`` and, per request or message, in
``mmshm_request_failures_total{reason}``; the handle's reference is given
back either way.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mmshm.errors import HandleError, MaterializeError, MmshmError, failure_reason
from mmshm.hooks import observe
from mmshm.metrics import MATERIALIZE_FAILURES, REQUEST_FAILURES
from mmshm.segments.shmtensor import ShmTensor
from mmshm.transport.sending import remember_segment
from mmshm.transport.wrapping import handles, transform, unwrap

#: Placeholders returned for handles that could not be opened: tensor -> (error, reason).
_BROKEN = WeakIdKeyDictionary()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _placeholder(dtype) -> torch.Tensor:
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    return torch.empty(0, dtype=dt if isinstance(dt, torch.dtype) else torch.uint8)


def materialize_wire(wire, dtype: str | None = None, shape=None) -> torch.Tensor:
    """The tensor behind a handle's wire bytes, as a zero-copy view.

    Args:
        wire: :meth:`ShmTensor.encode` bytes (any bytes-like object).
        dtype: the dtype the message says, without ``torch.`` (``"float32"``);
            checked against the handle's when given.
        shape: the shape the message says; checked likewise.
    Returns:
        The view; or, when the handle is malformed, does not match, or its
        segment cannot be opened, an empty placeholder of ``dtype`` that
        :func:`failure_in` finds (the handle's reference is given back).
        Never raises for a bad handle.
    """
    wire = bytes(wire)
    h = None
    try:
        h = ShmTensor.decode(wire)
        if dtype is not None and shape is not None and (
                tuple(h.shape) != tuple(shape) or _dtype_name(h.dtype) != dtype):
            raise HandleError(f"handle {h.name} is {_dtype_name(h.dtype)}{list(h.shape)}, "
                              f"the message says {dtype}{list(shape)}")
        meta = h.meta
        t = h.materialize()
    except (MmshmError, OSError) as exc:
        if h is not None:
            h.release()
        reason = failure_reason(exc)
        MATERIALIZE_FAILURES.labels(reason=reason).inc()
        bad = _placeholder(dtype)
        _BROKEN[bad] = (exc, reason)
        return bad
    remember_segment(t, meta, wire)
    return t


def has_failures() -> bool:
    """Whether any placeholder of :func:`materialize_wire` is alive (a cheap
    test before walking a request with :func:`failure_in`)."""
    return len(_BROKEN) > 0


def failure_in(obj, what: str = "the request") -> MaterializeError | None:
    """The error for the placeholders of :func:`materialize_wire` reachable
    from ``obj`` (counted once in ``mmshm_request_failures_total``), or None.
    ``what`` names ``obj`` in the message."""
    found: list = []

    def leaf(x):
        if isinstance(x, torch.Tensor) and x.numel() == 0:
            entry = _BROKEN.get(x)
            if entry is not None:
                found.append(entry)
        return x

    transform(obj, leaf)
    if not found:
        return None
    exc, reason = found[0]
    REQUEST_FAILURES.labels(reason=reason).inc()
    return MaterializeError(
        f"{what}: {len(found)} shared-memory tensor(s) could not be materialized "
        f"({reason}: {exc})", request=None, reason=reason)


# -- unpickling ------------------------------------------------------------------
class Collector:
    """The failures of the :func:`rebuild` calls of one :func:`collecting`
    scope, and the earliest send time they carried (seconds, monotonic)."""

    __slots__ = ("errors", "t_sent")

    def __init__(self):
        self.errors: list[BaseException] = []
        self.t_sent: float | None = None

    def error(self, what: str = "a message") -> MaterializeError | None:
        """The typed error for the collected failures (counted once in
        ``mmshm_request_failures_total``), or None when there were none."""
        if not self.errors:
            return None
        reason = failure_reason(self.errors[0])
        REQUEST_FAILURES.labels(reason=reason).inc()
        return MaterializeError(
            f"{len(self.errors)} shared-memory tensor(s) of {what} could not be "
            f"materialized ({reason}: {self.errors[0]})", reason=reason)


_TLS = threading.local()


@contextlib.contextmanager
def collecting() -> Iterator[Collector]:
    """Collect the failures of :func:`rebuild` in this thread inside the
    block (nested scopes each collect their own)."""
    prev = getattr(_TLS, "collector", None)
    c = _TLS.collector = Collector()
    try:
        yield c
    finally:
        _TLS.collector = prev


def rebuild(wire: bytes, t_sent: float | None = None) -> torch.Tensor:
    """Unpickle hook of a tensor sent as a handle (a reducer returns
    ``(rebuild, (handle.encode(), time.monotonic()))``): the zero-copy view.

    A handle that cannot be opened gives back its reference; inside
    :func:`collecting` the failure is collected and an empty tensor returned,
    elsewhere :class:`~mmshm.errors.MaterializeError` is raised."""
    observe.add_bytes(len(wire))  # the bytes this hop carried for the tensor
    c = getattr(_TLS, "collector", None)
    h = None
    try:
        h = ShmTensor.decode(wire)
        t = h.materialize()
    except (MmshmError, OSError) as exc:
        if h is not None:
            h.release()
        MATERIALIZE_FAILURES.labels(reason=failure_reason(exc)).inc()
        if c is None:
            raise MaterializeError(f"a shared-memory tensor could not be materialized: "
                                   f"{exc}", reason=failure_reason(exc)) from exc
        c.errors.append(exc)
        return torch.empty(0)
    if c is not None and t_sent is not None and (c.t_sent is None or t_sent < c.t_sent):
        c.t_sent = t_sent
    return t


# -- request objects -------------------------------------------------------------
def unwrap_each(reqs, on_failure: Callable[[Any, MaterializeError], Any]):
    """Materialize the handles of each request in ``reqs`` (zero-copy), with
    nothing to agree on (one receiver: TP size 1). A request whose handles
    cannot be opened becomes ``on_failure(request, error)``; its handles'
    references are given back. A list is updated in place and returned;
    another sequence gives a new list (unchanged: the same object)."""
    if not reqs:
        return reqs
    out = None
    for i, req in enumerate(reqs):
        if not handles(req):
            continue
        try:
            new = unwrap(req)
        except (MmshmError, OSError) as exc:
            new = on_failure(req, MaterializeError(
                f"shared-memory tensors could not be materialized: {exc}", request=req,
                reason=failure_reason(exc)))
        if out is None:
            out = list(reqs)
        out[i] = new
    if out is None:
        return reqs
    if isinstance(reqs, list):
        reqs[:] = out
        return reqs
    return out


__all__ = [
    "Collector",
    "collecting",
    "failure_in",
    "has_failures",
    "materialize_wire",
    "rebuild",
    "unwrap_each",
]
