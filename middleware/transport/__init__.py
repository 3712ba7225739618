"""Layer 4, the transport: moving request objects' tensors through segments.

In dependency order:

- :mod:`~mmshm.transport.wrapping`: ``wrap``/``unwrap``/``handles``: walk a
  request object and swap its tensors for :class:`~mmshm.ShmTensor` handles and back;
- :mod:`~mmshm.transport.sending` and :mod:`~mmshm.transport.receiving`: the two
  ends of one hop (the sending side knows nothing of the receiving side);
- :mod:`~mmshm.transport.fanout`: parallel-sampling copies sharing segments;
- :mod:`~mmshm.transport.topology`: which ranks of a process group share a node;
- :mod:`~mmshm.transport.handshake`: does every rank run this mmshm;
- :mod:`~mmshm.transport.shmagree`, :mod:`~mmshm.transport.agreement`: the
  failure agreement of a broadcast (through shared memory on one node);
- :mod:`~mmshm.transport.multinode`: payloads that cross node boundaries;
- :mod:`~mmshm.transport.broadcast`: ``deferred_unwrap`` / ``broadcast_pyobj``.

May import: every lower layer (:mod:`mmshm.errors`, :mod:`mmshm.config`,
:mod:`mmshm.metrics`, :mod:`mmshm.hooks`, :mod:`mmshm.segments`) and modules
listed before it here. Never a server, never :mod:`mmshm.integrations`.
"""
