"""The two hops of a message queue (vLLM's scheduler-output ``MessageQueue``:
``mq_enqueue`` and ``mq_dequeue``), declared once for every server's glue on
:func:`mmshm.hooks.observe.timed` and :mod:`mmshm.transport.mqueue`.

A queue is timed once the glue adds it to :attr:`QueueHops.queues` (a
reader: with the pyzmq taps, :func:`mmshm.hooks.observe.install_taps`): each
``enqueue`` / ``dequeue`` of a message with tensors is one observation, its
bytes those pickled out of band or mmshm's handles'
(:func:`mmshm.transport.mqueue.reduced_bytes`, and the ``recv_multipart``
tap for one too big for the ring); a reader's clock starts once the message
is there (:class:`mmshm.transport.mqueue.ClockAtMessage`), not while it waits.
Nothing here raises into the server.
"""

from __future__ import annotations

import weakref

from mmshm.hooks import observe
from mmshm.transport import mqueue


class QueueHops:
    """The queue hops of one server (``server``: the label).

    Attributes:
        queues: the queues timed (weak).
        enqueue, dequeue: the hop timers of ``enqueue`` and ``dequeue`` (as
            :func:`mmshm.hooks.observe.timed`'s): a timed queue's message
            with tensors, their bytes counted while pickled or unpickled.
        count_reduced: the wrapper factory of the pickler's ``_reduce_tensor``:
            the open hop counts what is sent out of band, or a handle's bytes.
    """

    def __init__(self, server: str):
        self.server = server
        self.queues: weakref.WeakSet = weakref.WeakSet()
        self.enqueue, self.dequeue = (
            observe.timed(server, hop, when=lambda inst, a, kw: inst in self.queues,
                          count_frames=True, skip=lambda out, t: t.nbytes == 0)
            for hop in ("mq_enqueue", "mq_dequeue"))
        self.count_reduced = observe.adds(server, lambda out, a, kw: mqueue.reduced_bytes(out, a))

    def acquire_read(self, wrapped, instance, args, kwargs):
        """A wrapt wrapper of a reader's ``acquire_read``: in a timed dequeue,
        :class:`~mmshm.transport.mqueue.ClockAtMessage`."""
        cm = wrapped(*args, **kwargs)
        return mqueue.ClockAtMessage(cm, self.server) if observe.current() is not None else cm


__all__ = ["QueueHops"]
