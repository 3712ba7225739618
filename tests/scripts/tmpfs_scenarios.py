"""Budget scenarios in a small private tmpfs, run inside

    unshare -m sh -c 'mount -t tmpfs -o size=64m tmpfs /dev/shm && python -m tests.scripts.tmpfs_scenarios'

* ``fill``: an unrelated file fills the tmpfs to 90%, then a burst of wraps
  (and a fan-out): every tensor travels inline with reason ``budget`` (the
  tensors would still fit in the raw free space, so it is the guard, not
  ENOSPC), nothing raises, the foreign file is untouched. Once it is removed
  the same burst goes through shared memory again.
* ``min_free``: ``MMSHM_MIN_FREE_BYTES=40 MiB`` in an empty 64 MiB tmpfs lets
  exactly two 10 MiB segments in; the rest fall back with ``budget``.

Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys

MiB = 1 << 20


def main() -> int:
    d = sys.argv[1] if len(sys.argv) > 1 else "/dev/shm"
    os.environ["MMSHM_DIR"] = d
    os.environ.pop("MMSHM_MIN_FREE_BYTES", None)
    os.environ.pop("MMSHM_MAX_BYTES", None)
    import mmshm
    import torch
    from mmshm import config
    from mmshm.segments import reaper
    from mmshm.segments.table import TABLE
    from tests.harness.metrics import delta, fallbacks
    from tests.harness.segments import segment_files
    from tests.harness.tensors import pattern

    config.reload()
    out: dict = {}
    st = os.statvfs(d)
    size = st.f_blocks * st.f_frsize
    out["fs_size"] = size

    # -- fill: a foreign file takes 90% -------------------------------------
    foreign = os.path.join(d, "foreign-fill.bin")
    fd = os.open(foreign, os.O_CREAT | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, int(size * 0.9))
    os.close(fd)
    st = os.statvfs(d)
    out["free_after_fill"] = st.f_bavail * st.f_frsize
    tensors = [pattern(MiB, i) for i in range(24)]
    hashes = [mmshm.content_hash(t) for t in tensors]
    before = fallbacks()
    errors = []
    kept = []
    inline = 0
    for i, t in enumerate(tensors):
        try:
            w = mmshm.wrap({"rid": i, "mm_items": [{"feature": t}]})
        except Exception as exc:  # noqa: BLE001 - must not happen
            errors.append(repr(exc))
            continue
        f = w["mm_items"][0]["feature"]
        if isinstance(f, torch.Tensor):
            inline += 1
            if mmshm.content_hash(f) != hashes[i]:
                errors.append(f"tensor {i}: inline bytes differ")
        kept.append(w)
    # fan-out of a request in the full tmpfs: n copies, all inline, all equal
    try:
        copies = mmshm.fan_out({"mm_items": [{"feature": tensors[0]}]}, 4)
        fan_inline = sum(isinstance(c["mm_items"][0]["feature"], torch.Tensor) for c in copies)
        fan_equal = all(mmshm.content_hash(c["mm_items"][0]["feature"]) == hashes[0]
                        for c in copies)
    except Exception as exc:  # noqa: BLE001
        errors.append(repr(exc))
        fan_inline, fan_equal = 0, False
    out["fill"] = {"wraps": len(tensors) + 1, "inline": inline + (1 if fan_inline else 0),
                   "fanout_inline_copies": fan_inline, "fanout_equal": fan_equal,
                   "fallbacks": delta(before, fallbacks()), "errors": errors,
                   "segments": segment_files(d),
                   "foreign_size": os.path.getsize(foreign),
                   "foreign_reaped": reaper.reap(d).reclaimed}
    mmshm.release(kept)
    del kept, copies
    # -- recovery: the foreign file goes away, the same burst uses segments ---
    os.unlink(foreign)
    before = fallbacks()
    ws = [mmshm.wrap({"mm_items": [{"feature": t}]}) for t in tensors[:8]]
    out["recovered"] = {
        "handles": sum(isinstance(w["mm_items"][0]["feature"], mmshm.ShmTensor) for w in ws),
        "fallbacks": delta(before, fallbacks())}
    mmshm.release(ws)
    del ws

    # -- min_free: an explicit reserve of 40 MiB -------------------------------
    os.environ["MMSHM_MIN_FREE_BYTES"] = str(40 * MiB)
    config.reload()
    big = [pattern(10 * MiB, 50 + i) for i in range(4)]
    before = fallbacks()
    w = mmshm.wrap({"mm_items": [{"feature": t} for t in big]})
    feats = [it["feature"] for it in w["mm_items"]]
    out["min_free"] = {
        "handles": sum(isinstance(f, mmshm.ShmTensor) for f in feats),
        "inline": sum(isinstance(f, torch.Tensor) for f in feats),
        "fallbacks": delta(before, fallbacks()),
        "bytes_equal": all(
            mmshm.content_hash(f.materialize(copy=True) if isinstance(f, mmshm.ShmTensor)
                               else f) == mmshm.content_hash(t) for f, t in zip(feats, big)),
    }
    del w, feats
    os.environ.pop("MMSHM_MIN_FREE_BYTES")
    config.reload()
    TABLE.sweep()
    TABLE.trim_pool()  # what the owner does on its way out
    out["leftovers"] = segment_files(d)
    out["other_files"] = sorted(n for n in os.listdir(d) if n not in out["leftovers"])
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
