"""A free TCP port on 127.0.0.1 (gloo rendezvous, exporters, servers)."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, drawn below the kernel's ephemeral
    range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by
    default): a port the kernel hands to another ``bind(("", 0))`` or an
    outgoing connection (a server's own internal sockets, other tests)
    between this check and the caller's bind would make that bind fail with
    EADDRINUSE. Falls back to a port the kernel picks when 200 draws found
    none free."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
