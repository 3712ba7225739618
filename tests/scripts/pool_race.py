"""A ``ProcessPoolExecutor`` race for the last space in a small tmpfs,
run inside

    unshare -m sh -c 'mount -t tmpfs -o size=64m tmpfs /dev/shm && python -m tests.scripts.pool_race'

Workers (fork) each make one 12 MiB segment, hand its reference to the parent
in the pickled handle, and return it. The tmpfs runs out: half the workers have
the budget guard on (typed ``ShmSpaceError`` from the guard), half have it off,
as if they had lost the race between the guard's ``statvfs`` and
``posix_fallocate`` (``ShmSpaceError`` from ENOSPC, ``filename`` set). The
parent must get every error typed, the pool must stay usable, every handle it
got must read back its bytes, and once it releases them and the pool is shut
down no segment may be left.

Prints one JSON object.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import pickle
import sys

MiB = 1 << 20
SIZE = 12 * MiB


_GUARD = None  # the real budget guard (a worker runs several tasks)


def make(i: int, guard: bool) -> tuple[bytes, bytes]:
    import mmshm
    from mmshm.segments import segment
    from tests.harness.tensors import pattern

    global _GUARD
    if _GUARD is None:
        _GUARD = segment.check_budget
    # off: lost the race (the guard saw room that another worker then took)
    segment.check_budget = _GUARD if guard else (lambda directory, total: None)
    h = mmshm.ShmTensor.from_tensor(pattern(SIZE, i))
    data = pickle.dumps(h)
    h.hand_over()
    return data, mmshm.content_hash(pattern(SIZE, i))


def pid() -> int:
    return os.getpid()


def main() -> int:
    os.environ["MMSHM_DIR"] = "/dev/shm"
    os.environ["MMSHM_REAP_INTERVAL_S"] = "0"
    os.environ["MMSHM_POOL"] = "0"
    import mmshm
    from mmshm import config
    from tests.harness.segments import segment_files

    config.reload()
    out: dict = {"errors": [], "handles": 0, "bytes_equal": True, "other": []}
    handles = []
    with cf.ProcessPoolExecutor(4) as pool:
        futs = [pool.submit(make, i, i % 2 == 0) for i in range(16)]
        for f in futs:
            try:
                data, digest = f.result(timeout=60)
            except mmshm.ShmSpaceError as exc:
                out["errors"].append({"type": type(exc).__name__, "errno": exc.errno,
                                      "reason": exc.reason, "filename": exc.filename,
                                      "message": str(exc),
                                      "remote_traceback": exc.__cause__ is not None})
                continue
            except BaseException as exc:  # noqa: BLE001 - reported
                out["other"].append(repr(exc))
                continue
            h = pickle.loads(data)
            out["bytes_equal"] &= mmshm.content_hash(h.materialize(copy=True)) == digest
            handles.append(h)
        out["handles"] = len(handles)
        try:
            out["pool_usable"] = pool.submit(pid).result(timeout=60) > 0
        except BaseException as exc:  # noqa: BLE001
            out["pool_usable"] = repr(exc)
    out["left"] = segment_files("/dev/shm")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
