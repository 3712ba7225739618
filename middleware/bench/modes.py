"""Transport modes compared by ``mmshm bench``.

A mode has two halves:

* the **producer** half (tokenizer process): :meth:`Mode.fan_out` turns one
  request into its ``n`` parallel-sampling copies; then, for each copy,
  :meth:`Mode.before_send` runs, the copy is serialized (:meth:`Mode.dumps`,
  pickle by default) and sent over ZMQ to TP rank 0, which decodes it with
  :meth:`Mode.loads`, and :meth:`Mode.after_send` runs;
* the **scheduler** half (every TP rank): :meth:`Mode.broadcast` has the
  contract of SGLang's ``broadcast_pyobj(data, rank, dist_group, src) -> list``
  and must return requests whose tensors are in hand on every rank.

Add a mode by subclassing :class:`Mode` and decorating it with
:func:`register`; it then appears in ``--modes``. Modes are instantiated in
the producer and in every TP rank (spawned processes), so a mode must be
defined in an importable module and be cheap to construct.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import ClassVar

import mmshm

MODES: dict[str, type[Mode]] = {}


def register(cls: type[Mode]) -> type[Mode]:
    """Class decorator: make ``cls`` selectable by its ``name``."""
    if not cls.name:
        raise ValueError("a mode needs a name")
    MODES[cls.name] = cls
    return cls


def get_mode(name: str, min_bytes: int | None = None) -> Mode:
    """Instantiate the mode called ``name``.

    Raises:
        KeyError: unknown mode.
    """
    try:
        cls = MODES[name]
    except KeyError:
        raise KeyError(f"unknown mode {name!r}; choose from {', '.join(MODES)}") from None
    return cls(min_bytes=min_bytes)


class Mode:
    """Base class of a transport mode (see the module docstring).

    Args:
        min_bytes: tensors of at least this many bytes go through shared
            memory in modes that use it (default ``MMSHM_MIN_BYTES``).
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""

    def __init__(self, min_bytes: int | None = None):
        self.min_bytes = min_bytes

    # -- producer (tokenizer) --------------------------------------------------
    def fan_out(self, req, n: int) -> list:
        """The ``n`` copies of ``req`` to send (parallel sampling)."""
        raise NotImplementedError

    def before_send(self, req) -> None:
        """Called on a copy just before it is pickled for its one receiver."""

    def after_send(self, req) -> None:
        """Called on a copy once it has been pickled and handed to ZMQ; the
        producer drops the copy right after."""

    def dumps(self, req) -> bytes:
        """The ZMQ message for one copy (default: pickle, as ``send_pyobj``)."""
        return pickle.dumps(req, pickle.DEFAULT_PROTOCOL)

    # -- TP rank 0 ----------------------------------------------------------------
    def loads(self, msg) -> object:
        """The request in a ZMQ message (default: unpickle, as ``recv_pyobj``)."""
        return pickle.loads(msg)

    # -- scheduler (every TP rank) ---------------------------------------------
    def broadcast(self, data, rank: int, dist_group, src: int = 0) -> list:
        """Broadcast the batch ``data`` (meaningful on ``src`` only) to the TP group."""
        raise NotImplementedError

    def instrument_broadcast(self, inner: Callable[[Callable], Callable]) -> None:
        """Let the bench wrap the inner broadcast function (``inner(fn) -> fn``)
        to time the transfer apart from materialization. Optional."""


def _rename(copies: list, rid: str) -> list:
    for i, c in enumerate(copies):
        c.rid = f"{rid}-{i}"
    return copies


@register
class InlineMode(Mode):
    """Pixels are pickled into every ZMQ message and into the TP broadcast
    (SGLang <= 0.5.9, vLLM's default socket path)."""

    name = "inline"
    summary = "pixels pickled through ZMQ and the TP broadcast"

    def __init__(self, min_bytes: int | None = None):
        super().__init__(min_bytes)
        self._bcast = mmshm.broadcast_pyobj

    def fan_out(self, req, n: int) -> list:
        # SGLang's _handle_batch_request: shallow copies sharing mm_items.
        return _rename([copy.copy(req) for _ in range(n)], req.rid)

    def broadcast(self, data, rank, dist_group, src=0):
        return self._bcast(data, rank, dist_group, src)

    def instrument_broadcast(self, inner):
        self._bcast = inner(mmshm.broadcast_pyobj)


@register
class MmshmMode(Mode):
    """Pixels go through shared memory once: :func:`mmshm.fan_out` makes the
    ``n`` copies over the same segments, each send hands one reference to its
    receiver, and TP rank 0 broadcasts metadata only through
    :func:`mmshm.deferred_unwrap`; every rank materializes zero-copy views."""

    name = "mmshm"
    summary = "fan_out + share(1) per send; deferred_unwrap(broadcast_pyobj)"

    def __init__(self, min_bytes: int | None = None):
        super().__init__(min_bytes)
        self._bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)

    def fan_out(self, req, n: int) -> list:
        return _rename(mmshm.fan_out(req, n, min_bytes=self.min_bytes), req.rid)

    def before_send(self, req) -> None:
        for h in mmshm.handles(req):
            h.share(1)

    def after_send(self, req) -> None:
        mmshm.release(req)  # the producer's own reference; the receiver owns the other

    def broadcast(self, data, rank, dist_group, src=0):
        return self._bcast(data, rank, dist_group, src)

    def instrument_broadcast(self, inner):
        self._bcast = mmshm.deferred_unwrap(inner(mmshm.broadcast_pyobj))
