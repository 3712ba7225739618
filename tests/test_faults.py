"""Faults: a full tmpfs (ENOSPC, never SIGBUS), the budget guard, and segment
files truncated by a third party.

The tmpfs tests run a child Python under ``unshare -m`` with a private 64 MiB
tmpfs mounted on /dev/shm (Docker's default size); they need root."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.harness.procs import run_child, signal_name
from tests.harness.segments import segment_files
from tests.harness.shm import private_shm_prefix, skip_without_unshare
from tests.harness import children

pytestmark = pytest.mark.timeout(120)

def run_in_small_tmpfs(script: str, **env) -> subprocess.CompletedProcess:
    """Run ``script`` in a child Python with a private 64 MiB tmpfs on
    /dev/shm as its ``MMSHM_DIR``; skip where that cannot be had."""
    skip_without_unshare()
    e = {k: v for k, v in os.environ.items() if k != "MMSHM_DIR"}
    e.update(MMSHM_DIR="/dev/shm", MMSHM_REAP_INTERVAL_S="0", **env)
    proc = subprocess.run(private_shm_prefix() + [sys.executable, "-c", textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=100, env=e, check=False)
    code = proc.returncode
    # the shell execs Python, so a signal shows as a negative code (128 + n if not)
    assert code == 0, (f"child {signal_name(code)}"
                       f"{' (SIGBUS?)' if code in (-7, 135) else ''}\n"
                       f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


_COMMON = """
    import errno, gc, os
    import torch
    import mmshm
    from mmshm.segments import segment
    from prometheus_client import REGISTRY

    assert os.environ["MMSHM_DIR"] == "/dev/shm"
    st = os.statvfs("/dev/shm")
    assert st.f_blocks * st.f_frsize == 64 << 20, st

    def fallbacks(reason):
        v = REGISTRY.get_sample_value("mmshm_inline_fallbacks_total", {"reason": reason})
        return v or 0.0

    def files():
        return [n for n in os.listdir("/dev/shm") if n.startswith("mmshm-")]
"""

TOO_BIG_SCRIPT = _COMMON + """
    # a 200 MiB tensor in a 64 MiB tmpfs: inline fallback through wrap
    t = torch.ones(200 << 18, dtype=torch.float32)  # 200 MiB
    out = mmshm.wrap({"pixel_values": t}, min_bytes=1)
    assert out["pixel_values"] is t, type(out["pixel_values"])
    assert files() == [], files()
    print("FALLBACKS", {r: fallbacks(r) for r in ("enospc", "budget", "emfile", "other")})
    # directly: ShmSpaceError, an OSError with errno ENOSPC, and no file left
    try:
        mmshm.ShmTensor.from_tensor(t)
    except mmshm.ShmSpaceError as exc:
        assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC, exc
    else:
        raise AssertionError("from_tensor did not raise ShmSpaceError")
    assert files() == [], files()
    assert fallbacks("enospc") == 1, "reason=enospc counted %s times" % fallbacks("enospc")
    print("TOO-BIG-OK")
"""


@pytest.mark.fault
def test_tensor_larger_than_the_tmpfs_falls_back_as_enospc():
    proc = run_in_small_tmpfs(TOO_BIG_SCRIPT)
    assert "TOO-BIG-OK" in proc.stdout, proc.stdout + proc.stderr


ENOSPC_SCRIPT = _COMMON + """
    # Space can vanish between the budget check and the allocation (NCCL and
    # other processes share the tmpfs): skip the check so that posix_fallocate
    # itself meets the full file system. It must raise ENOSPC, never SIGBUS.
    assert callable(segment.check_budget)
    segment.check_budget = lambda directory, total: None

    # 1. a 200 MiB tensor: inline fallback through wrap
    t = torch.ones(200 << 18, dtype=torch.float32)  # 200 MiB
    out = mmshm.wrap({"pixel_values": t}, min_bytes=1)
    assert out["pixel_values"] is t, type(out["pixel_values"])
    assert fallbacks("enospc") == 1, fallbacks("enospc")
    assert files() == [], files()

    # 2. directly: ShmSpaceError, an OSError with errno ENOSPC, and no file left
    try:
        mmshm.ShmTensor.from_tensor(t)
    except mmshm.ShmSpaceError as exc:
        assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC, exc
    else:
        raise AssertionError("from_tensor did not raise ShmSpaceError")
    assert files() == [], files()
    assert os.statvfs("/dev/shm").f_bfree == st.f_blocks  # nothing stays allocated

    # 3. two 40 MiB tensors: the first goes through shared memory, the second
    #    does not fit next to it and travels inline; both arrive intact
    a = torch.arange(10 << 20, dtype=torch.float32)
    b = a.flip(0)
    out = mmshm.wrap({"a": a, "b": b}, min_bytes=1)
    assert isinstance(out["a"], mmshm.ShmTensor), type(out["a"])
    assert out["b"] is b
    assert fallbacks("enospc") == 2
    assert len(files()) == 1
    back = mmshm.unwrap(out)
    assert torch.equal(back["a"], a) and torch.equal(back["b"], b)
    del back, out
    gc.collect()
    assert files() == [], files()

    # 4. after the failures, the directory is usable again
    small = torch.randn(1 << 20)
    h = mmshm.ShmTensor.from_tensor(small)
    assert torch.equal(h.materialize(copy=True), small)
    assert files() == []
    print("ENOSPC-OK")
"""


@pytest.mark.fault
def test_enospc_from_fallocate_falls_back_inline_without_sigbus():
    proc = run_in_small_tmpfs(ENOSPC_SCRIPT, MMSHM_MIN_FREE_BYTES="0")
    assert "ENOSPC-OK" in proc.stdout, proc.stdout + proc.stderr


BUDGET_SCRIPT = """
    import os
    import torch
    import mmshm
    from prometheus_client import REGISTRY

    def fallbacks(reason):
        v = REGISTRY.get_sample_value("mmshm_inline_fallbacks_total", {"reason": reason})
        return v or 0.0

    # default reserve on a 64 MiB tmpfs: 16 MiB must stay free
    t = torch.ones(56 << 18, dtype=torch.float32)  # 56 MiB: would fit, but eats the reserve
    out = mmshm.wrap({"x": t}, min_bytes=1)
    assert out["x"] is t
    assert fallbacks("budget") == 1 and fallbacks("enospc") == 0
    try:
        mmshm.ShmTensor.from_tensor(t)
    except mmshm.ShmSpaceError as exc:
        assert exc.reason == "budget", exc.reason
    else:
        raise AssertionError("no budget refusal")
    ok = torch.ones(40 << 18, dtype=torch.float32)  # 40 MiB leaves 24 MiB free
    out = mmshm.wrap({"x": ok}, min_bytes=1)
    assert isinstance(out["x"], mmshm.ShmTensor)
    assert torch.equal(mmshm.unwrap(out, copy=True)["x"], ok)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("mmshm-")]
    print("BUDGET-OK")
"""


@pytest.mark.fault
def test_budget_guard_keeps_the_reserve_free():
    proc = run_in_small_tmpfs(BUDGET_SCRIPT)
    assert "BUDGET-OK" in proc.stdout, proc.stdout + proc.stderr


# -- truncation by a third party ----------------------------------------------------
def test_truncated_segment_in_the_creating_process(shm_dir):
    res, code = run_child(children.truncate_in_creator, 100)
    assert code == 0, signal_name(code)
    assert res == {False: "SegmentCorruptError", True: "SegmentCorruptError", "left": []}, res


def test_header_truncated_by_third_party_does_not_kill_the_creator(shm_dir):
    try:
        res, code = run_child(children.truncate_header_then_sweep)
        assert code == 0, signal_name(code)
        assert res == {"ok": True}
    finally:
        for n in segment_files():  # the corrupt file cannot be released by count
            os.unlink(os.path.join(shm_dir, n))
