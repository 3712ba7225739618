"""How many tensors of one size a small tmpfs holds with the warm pool on
run inside

    unshare -m sh -c 'mount -t tmpfs -o size=64m tmpfs /dev/shm && python -m tests.scripts.pool_fit 8388608 8 0'

Arguments: tensor bytes, how many to wrap, ``MMSHM_MIN_FREE_BYTES`` (``-`` for
the default reserve). Every tensor is wrapped and kept; prints one JSON
object: how many went through shared memory, how many inline (and why), the
size class and whether every byte reads back.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    nbytes, count, reserve = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.environ.update(MMSHM_DIR="/dev/shm", MMSHM_POOL="1", MMSHM_REAP_INTERVAL_S="0")
    if reserve != "-":
        os.environ["MMSHM_MIN_FREE_BYTES"] = reserve
    import mmshm
    import torch
    from mmshm import config
    from mmshm.segments import segfile, table
    from mmshm.segments.table import TABLE
    from tests.harness.metrics import delta, fallbacks
    from tests.harness.segments import segment_files
    from tests.harness.tensors import pattern

    config.reload()
    before = fallbacks()
    tensors = [pattern(nbytes, i) for i in range(count)]
    wrapped = [mmshm.wrap({"feature": t})["feature"] for t in tensors]
    handles = [w for w in wrapped if isinstance(w, mmshm.ShmTensor)]
    out = {"shm": len(handles), "inline": count - len(handles),
           "fallbacks": delta(before, fallbacks()),
           "class_bytes": table.size_class(segfile.HEADER_SIZE + nbytes),
           "bytes_equal": all(torch.equal(w.clone().materialize(copy=True)
                                          if isinstance(w, mmshm.ShmTensor) else w, t)
                              for w, t in zip(wrapped, tensors))}
    for h in handles:
        h.release()
    TABLE.trim_pool()
    out["left"] = segment_files("/dev/shm")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
