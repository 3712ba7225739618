"""A free TCP port on 127.0.0.1 (gloo rendezvous, exporters, servers)."""

from __future__ import annotations


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, drawn below the kernel's ephemeral
    range, so that no ``bind(("", 0))`` or outgoing connection takes it
    before the caller binds it.

    The one implementation is the product's,
    :func:`mmshm.bench.serve.servers.free_port` (``mmshm bench serve`` starts
    its servers on it), imported when called: importing ``mmshm.bench`` loads
    torch, which the harness's modules never do at import."""
    from mmshm.bench.serve.servers import free_port as product_free_port

    return product_free_port()
