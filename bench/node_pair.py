"""What the cross-node row's two-process runs share (:mod:`mmshm.bench.epd_nodes`,
:mod:`mmshm.bench.ec_mooncake_baseline`): the items node A holds, their
digest, and the driver's read of a node's ``PREFIX {json}`` lines.
Importing this module loads no torch."""

from __future__ import annotations

import json
import selectors
import subprocess
import time


def item(i: int, shape):
    """Item ``i``: a ``shape`` bf16 tensor of seeded normal values (the same
    bytes in every process and run)."""
    import torch

    g = torch.Generator().manual_seed(7000 + i)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def blake(t) -> str:
    """BLAKE3 (hex) of ``t``'s bytes, in its contiguous layout."""
    import blake3
    import torch

    return blake3.blake3(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def line(p: subprocess.Popen, prefix: str, timeout: float) -> dict:
    """The JSON after ``prefix`` on the first of ``p``'s stdout lines that
    starts with it (others skipped).

    Raises:
        RuntimeError: no such line within ``timeout`` s (``p`` ended, or is
            silent); it names the node (``p``'s second-to-last argument).
    """
    end = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    while time.monotonic() < end:
        if not sel.select(max(0.0, end - time.monotonic())):
            break
        got = p.stdout.readline()
        if not got:
            break
        if got.startswith(prefix):
            return json.loads(got[len(prefix):])
    raise RuntimeError(f"no {prefix.strip()!r} line from node {p.args[-2]} within "
                       f"{timeout:.0f} s (rc {p.poll()})")
