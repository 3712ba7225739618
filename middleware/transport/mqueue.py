"""One writer's messages to readers of two kinds: those on its node, through a
shared-memory ring, and those on other nodes, through a socket (vLLM's
``MessageQueue`` of scheduler outputs: ``n_local_reader``, ``n_remote_reader``).

The local readers get handles (one reference per local reader, handed out
before the write: :func:`mmshm.transport.sending.sending` on the ``broadcast``
path); a handle can reach no other node, so where the queue has remote
readers too the message is written twice, in the queue's own order: the ring
through a view with only the local readers (:class:`OnlyReaders`), then the
socket through a view with only the remote ones, the tensors inline (their
bytes counted once per remote reader in ``mmshm_internode_bytes_total``).
A reader materializes the handles while it unpickles (:func:`read`); one
that cannot be materialized raises, the others' references given back.

**Timing** (the ``mq_enqueue`` / ``mq_dequeue`` hops of
:mod:`mmshm.hooks.observe`): a message's bytes are what the queue sends out
of band (buffers of :data:`OOB_MIN_BYTES` or more: :func:`reduced_bytes` as
they are pickled, :func:`ring_oob_bytes` from the ring's header as they are
read) or mmshm's handles; a reader's clock starts once the message is there
(:class:`ClockAtMessage`), not while it waits.
"""

from __future__ import annotations

import contextvars
import time

import torch

from mmshm.hooks import observe
from mmshm.metrics import BROADCAST_SECONDS, INTERNODE_BYTES
from mmshm.transport import receiving, sending

#: The queue sends buffers of 1 MiB or more out of band: its hops count those
#: (and mmshm's handles), alike on both sides.
OOB_MIN_BYTES = 1 << 20

#: In the remote half of a write: [tensor bytes pickled inline].
_INLINE_BYTES: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "mmshm_mqueue_inline", default=None)


class OnlyReaders:
    """``mq`` with only its local readers (the ring) or only its remote ones
    (the socket): those two counts are the view's, every other attribute is
    ``mq``'s, read and written through; ``mq`` never changes."""

    __slots__ = ("_mq", "n_local_reader", "n_remote_reader")

    def __init__(self, mq, local: bool):
        object.__setattr__(self, "_mq", mq)
        object.__setattr__(self, "n_local_reader", mq.n_local_reader if local else 0)
        object.__setattr__(self, "n_remote_reader", 0 if local else mq.n_remote_reader)

    def __getattr__(self, name):
        return getattr(self._mq, name)

    def __setattr__(self, name, value):
        setattr(self._mq, name, value)


def describe_readers(n_local: int, n_remote: int) -> str:
    """``"2 readers"``, or ``"multi-node: 1 local reader through shared memory,
    1 remote reader inline"``."""
    def n(k, what):
        return f"{k} {what}{'' if k == 1 else 's'}"

    if not n_remote:
        return n(n_local, "reader")
    return (f"multi-node: {n(n_local, 'local reader')} through shared memory, "
            f"{n(n_remote, 'remote reader')} inline")


def put(t) -> tuple | None:
    """In a write's local half: ``(receiving.rebuild, (wire, t0))``, the
    pickle reduction of a handle to tensor ``t`` (one reference per local
    reader), or None (the server pickles it itself). In its remote half the
    bytes of a tensor pickled inline are counted."""
    box = sending.current_outbox()
    if box is not None and box.path == "broadcast":
        if type(t) is torch.Tensor and sending.eligible(t):
            h = box.put(t)
            if h is not None:
                return receiving.rebuild, (h.encode(), box.t0)
    inline = _INLINE_BYTES.get()
    if inline is not None and isinstance(t, torch.Tensor):
        inline[0] += t.numel() * t.element_size()
    return None


def write(mq, wrapped, args, kwargs, refuse):
    """``mq``'s write of one message (``wrapped(*args, **kwargs)``, the bound
    method): handles for the local readers; with remote readers too, written
    twice (module docstring). Where ``wrapped`` is no plain bound method
    (another wrapper) and there are remote readers, ``refuse()`` says so and
    every reader gets the tensors inline. Returns what the write returned."""
    n_remote = getattr(mq, "n_remote_reader", 0)
    method = getattr(wrapped, "__func__", None)
    if n_remote and method is None:  # cannot give each kind of reader its own bytes
        refuse()
        with sending.not_sending():
            return wrapped(*args, **kwargs)
    with sending.sending(hops=mq.n_local_reader - 1, path="broadcast") as box:
        if n_remote:
            out = method(OnlyReaders(mq, local=True), *args, **kwargs)
        else:
            out = wrapped(*args, **kwargs)
        if box.handles:
            BROADCAST_SECONDS.labels(role="src").observe(time.monotonic() - box.t0)
    if n_remote:
        inline = [0]
        token = _INLINE_BYTES.set(inline)
        try:
            with sending.not_sending():  # no handle can reach another node
                out = method(OnlyReaders(mq, local=False), *args, **kwargs)
        finally:
            _INLINE_BYTES.reset(token)
        if inline[0]:  # the socket sends the same frames to each remote reader
            INTERNODE_BYTES.inc(inline[0] * n_remote)
    return out


def read(wrapped, args, kwargs, what: str = "a MessageQueue message"):
    """One read (``wrapped(*args, **kwargs)``): handles materialized while
    unpickling. Raises the typed error of one that could not be (``what``
    names the message), the references of what did materialize given back."""
    with receiving.collecting() as got:
        obj = wrapped(*args, **kwargs)
    err = got.error(what)
    if err is not None:
        del obj  # gives back the references of what did materialize
        raise err
    if got.t_sent is not None:
        BROADCAST_SECONDS.labels(role="dst").observe(max(0.0, time.monotonic() - got.t_sent))
    return obj


def ring_oob_bytes(buf) -> int:
    """Out-of-band bytes of a ring chunk's message, from vLLM's header: byte 0
    the overflow flag (0 bytes: its frames count as they arrive), bytes 1-2
    the buffer count, each buffer after its 4-byte big-endian length."""
    if buf[0] != 0:
        return 0
    count = int.from_bytes(bytes(buf[1:3]), "big")
    offset, total = 3, 0
    for i in range(count):
        n = int.from_bytes(bytes(buf[offset:offset + 4]), "big")
        if i:
            total += n
        offset += 4 + n
    return total


class ClockAtMessage:
    """A reader's ``acquire_read`` context ``cm``: once the message is there,
    an open ``mq_dequeue`` hop's clock restarts (the wait is not IPC) and its
    out-of-band buffers count (a failure counted for ``server``, never raised)."""

    __slots__ = ("cm", "server")

    def __init__(self, cm, server: str):
        self.cm, self.server = cm, server

    def __enter__(self):
        buf = self.cm.__enter__()
        t = observe.current()
        if t is not None and t.hop == "mq_dequeue":
            t.restart()
            try:  # the queue's own buffers (mmshm's handles count themselves: receiving.rebuild)
                t.add(ring_oob_bytes(buf))
            except Exception as exc:  # noqa: BLE001 - timing never breaks a worker
                observe.error(self.server, "mq_dequeue", exc)
        return buf

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


def reduced_bytes(out, args) -> int:
    """The bytes one pickled tensor (``args[0]``, reduced to ``out``) adds to
    a write's hop: a handle's wire, or the tensor's bytes where the queue
    sends it out of band (:data:`OOB_MIN_BYTES` or more), else 0."""
    if out[0] is receiving.rebuild:
        return len(out[1][0])
    n = observe.tensor_bytes(args[0]) if args else 0
    return n if n >= OOB_MIN_BYTES else 0  # what is sent out of band, as a reader sees it
