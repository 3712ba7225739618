"""What every server's request glue asks of the tensors in a request, once.

A server's request holds its multimodal tensors in its own fields (SGLang's
``mm_items``' ``feature``, vLLM's ``mm_features``' ``data``); the glue finds
them there and asks the same few things, answered here for both servers:

- :func:`tensors`: the torch tensors of a field (a tensor, or nested lists and
  tuples of them);
- :func:`drop` / :func:`mark_cached`: a finished request's views of segments
  (:data:`mmshm.transport.sending.SEGMENTS`) let go, or marked as held by a
  cache of the server (``mmshm status``: held, not leaked);
- :func:`is_local_endpoint`, :func:`socket_endpoint`: a zmq endpoint
  certainly on this node (a handle never goes to another one), a socket's;
- :func:`warn_numpy`: a large numpy feature travels inline (mmshm carries
  torch tensors), said once at WARNING;
- :func:`unwrap_or_fail`: a request materialized inline, or turned into its
  own failure.

Invariant: nothing here raises into a request's path but
:func:`unwrap_or_fail`'s ``on_failure``; a failure to let go or to mark a
view is logged at DEBUG and the request goes on.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable

import torch

from mmshm.transport.sending import SEGMENTS

log = logging.getLogger("mmshm")


def tensors(value) -> list[torch.Tensor]:
    """The torch tensors in ``value`` (a tensor, or nested lists/tuples; [] for
    anything else), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in tensors(v)] if isinstance(value, (list, tuple)) else []


def drop(holders: Iterable[tuple[object, str, list[torch.Tensor]]]) -> int:
    """``setattr(holder, attr, None)`` for each ``(holder, attr, tensors)`` whose
    ``tensors`` hold views of segments, so that no stale reference to the
    request (a server's input thread keeps the last one) keeps a segment
    alive. Returns the views let go. Never raises."""
    dropped = 0
    try:
        for holder, attr, ts in holders:
            views = sum(1 for t in ts if SEGMENTS.get(t) is not None)
            if views:
                setattr(holder, attr, None)
                dropped += views
    except Exception as exc:  # noqa: BLE001 - freeing a request never fails
        log.debug("mmshm: dropping a finished request's views failed: %s", exc)
    return dropped


def mark_cached(groups: Iterable[list[torch.Tensor]]) -> int:
    """Mark the segments of the views in ``groups`` (lists of tensors a
    server's cache keeps) as held by that cache
    (:func:`mmshm.segments.segment.mark_cached`). Returns the segments
    marked. Never raises."""
    from mmshm.segments import segment

    marked = 0
    try:
        for ts in groups:
            for t in ts:
                entry = SEGMENTS.get(t)
                if entry is not None and segment.mark_cached(entry[1].name):
                    marked += 1
    except Exception as exc:  # noqa: BLE001 - a status mark never fails a request
        log.debug("mmshm: marking the multimodal cache's segments failed: %s", exc)
    return marked


def is_local_endpoint(addr: str) -> bool:
    """Whether zmq endpoint ``addr`` is certainly on this node: ``ipc://``,
    ``inproc://``, or ``tcp://`` on a loopback address (127.x, ``::1``,
    ``localhost``); any other may be remote."""
    if addr.startswith(("ipc://", "inproc://")):
        return True
    host = addr.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return addr.startswith("tcp://") and (host.startswith("127.") or host in ("::1",
                                                                             "localhost"))


def socket_endpoint(sock) -> str:
    """The endpoint a zmq socket last bound or connected (``zmq.LAST_ENDPOINT``),
    ``""`` where it cannot be read (None, closed, not a zmq socket)."""
    if sock is None:
        return ""
    try:
        import zmq

        value = sock.getsockopt(zmq.LAST_ENDPOINT)
    except Exception:  # noqa: BLE001 - a closed or foreign socket: unknown
        return ""
    return value.decode() if isinstance(value, bytes) else str(value or "")


def warn_numpy(named: Iterable[tuple[str, object]], min_bytes: int, said: set[str],
               why: str) -> bool:
    """Say once per process (``said``, the caller's record), at WARNING, that
    a feature of ``named`` (``(field, value)`` pairs; a value may be a list or
    tuple) of ``min_bytes`` or more is a numpy array: it travels inline,
    pickled into the request, not through shared memory. ``why``: the
    server's reason it made one. Returns whether it said so now."""
    np = sys.modules.get("numpy")
    if np is None or "numpy" in said:
        return False
    for name, value in named:
        for x in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(x, np.ndarray) and x.nbytes >= min_bytes:
                said.add("numpy")
                log.warning("mmshm: a multimodal %s of %d bytes is a numpy array (%s %s), not "
                            "a torch tensor: it travels inline, pickled into the request, not "
                            "through shared memory (said once). %s", name, x.nbytes, x.dtype,
                            tuple(x.shape), why)
                return True
    return False


def unwrap_or_fail(req, on_failure: Callable):
    """``req`` with its handles materialized as copies (inline from here on),
    or ``on_failure(req, MaterializeError)`` where one cannot be (the error's
    reason from :func:`mmshm.errors.failure_reason`)."""
    from mmshm.errors import MaterializeError, MmshmError, failure_reason
    from mmshm.transport.wrapping import unwrap

    try:
        return unwrap(req, copy=True)
    except (MmshmError, OSError) as exc:
        return on_failure(req, MaterializeError(str(exc), request=req,
                                                reason=failure_reason(exc)))


__all__ = ["drop", "is_local_endpoint", "mark_cached", "socket_endpoint", "tensors",
           "unwrap_or_fail", "warn_numpy"]
