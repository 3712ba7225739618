"""Descriptors per mapped segment. Prints one JSON object:

* ``producer_fds``: descriptors this process gained by creating ``N``
  segments (default 1000) and holding them;
* ``reader_views``: how many zero-copy views a reader holds at once under
  ``RLIMIT_NOFILE`` = ``LIMIT`` (default 256, with the default
  ``MMSHM_FD_RESERVE`` of 64) before mmshm refuses with EMFILE, the
  descriptors it then has open, and whether ``materialize(copy=True)`` still
  works while they are held.

Usage: ``python -m tests.scripts.fd_views [N] [LIMIT]`` (from the repository root). The reader is a forked child.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import sys


def nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    import mmshm
    import torch
    from tests.harness.tensors import pattern

    torch.set_num_threads(1)  # the forked reader must not meet a parent's thread pool
    src = pattern(1 << 16, 1)
    want = src.numpy().tobytes()
    base = nfds()
    handles = [mmshm.ShmTensor.from_tensor(src) for _ in range(n)]
    out = {"segments": n, "producer_fds": nfds() - base, "limit": limit}
    for h in handles:
        h.share(1)
    wire = [pickle.dumps(h) for h in handles]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        res = {}
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            received = [pickle.loads(b) for b in wire]
            views = []
            try:
                for h in received:
                    views.append(h.materialize())
            except mmshm.DescriptorLimitError:
                pass
            res["reader_views"] = len(views)
            res["reader_fds"] = nfds()
            res["views_equal"] = all(v.numpy().tobytes() == want for v in views)
            rest = received[len(views):]
            try:
                res["copy_while_held"] = bool(rest) and (
                    rest[0].materialize(copy=True).numpy().tobytes() == want)
            except mmshm.DescriptorLimitError:
                res["copy_while_held"] = False
            del views
            for h in received:
                h.release()
        except BaseException as exc:  # noqa: BLE001 - reported
            res["error"] = repr(exc)
        os.write(w, json.dumps(res).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.waitpid(pid, 0)
    out.update(json.loads(data))
    for h in handles:
        h.release()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
