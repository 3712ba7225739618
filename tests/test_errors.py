"""Typed errors cross processes.

* every public exception class round-trips through pickle, and through
  ``concurrent.futures``' remote-traceback wrapper, with its type, message and
  attributes;
* a ``ProcessPoolExecutor`` race for the last space in a 64 MiB tmpfs ends
  with typed errors in the parent, a usable pool and nothing stranded.
"""

from __future__ import annotations

import errno
import pickle
from concurrent.futures.process import _ExceptionWithTraceback

import pytest

import mmshm
from mmshm import errors

from tests.harness.shm import run_script
from tests.harness.tensors import pattern


def _examples() -> list[BaseException]:
    nospace = mmshm.ShmSpaceError("create: no space left in /dev/shm")
    nospace.filename = "/dev/shm/mmshm-1-0123456789abcdef"  # as segment._os_error sets it
    return [
        mmshm.MmshmError("base"),
        mmshm.HandleError("bad dtype code 99"),
        mmshm.WrongNodeError("handle names a segment on node 7"),
        mmshm.HandleStateError("handle mmshm-1-x no longer owns a reference"),
        mmshm.SegmentError(errno.EIO, "update: I/O error", "/dev/shm/mmshm-1-x"),
        mmshm.SegmentError("no errno at all"),
        mmshm.ShmSpaceError("a 9-byte segment does not fit"),
        mmshm.ShmSpaceError("budget: below the reserve", reason="budget"),
        nospace,
        mmshm.DescriptorLimitError(errno.EMFILE, "attach: out of file descriptors", "/p"),
        mmshm.SegmentNotFoundError(errno.ENOENT, "attach: segment is gone", "/p"),
        mmshm.SegmentCorruptError(errno.EINVAL, "not an mmshm segment (bad magic)", "/p"),
        mmshm.MaterializeError("2 handles failed", request={"rid": "r1"}, reason="corrupt",
                               ranks=[1, 3]),
        mmshm.PeerLostError("TP rank 0 lost a peer", ranks=[1]),
        mmshm.PayloadWithheldError("request r1: 1 multimodal tensor(s) were withheld"),
    ]


def _public_classes() -> set[type]:
    return {getattr(mmshm, n) for n in mmshm.__all__
            if isinstance(getattr(mmshm, n), type) and issubclass(getattr(mmshm, n),
                                                                   BaseException)}


def _same(a: BaseException, b: BaseException) -> None:
    assert type(b) is type(a)
    assert str(b) == str(a) and b.args == a.args
    assert b.__dict__ == a.__dict__
    if isinstance(a, OSError):
        assert (b.errno, b.strerror, b.filename, b.filename2) == (
            a.errno, a.strerror, a.filename, a.filename2)


def test_every_public_exception_class_is_covered():
    assert {type(e) for e in _examples()} == _public_classes()
    assert all(issubclass(c, errors.MmshmError) for c in _public_classes())


@pytest.mark.parametrize("exc", _examples(), ids=lambda e: f"{type(e).__name__}:{e}"[:60])
def test_exception_round_trips_through_pickle(exc):
    for proto in (2, pickle.HIGHEST_PROTOCOL):
        _same(exc, pickle.loads(pickle.dumps(exc, proto)))


@pytest.mark.parametrize("exc", _examples(), ids=lambda e: f"{type(e).__name__}:{e}"[:60])
def test_exception_round_trips_through_the_process_pool_wrapper(exc):
    try:
        raise exc
    except BaseException as raised:  # noqa: BLE001 - what a pool worker catches
        wrapped = _ExceptionWithTraceback(raised, raised.__traceback__)
    back = pickle.loads(pickle.dumps(wrapped))
    _same(exc, back)
    assert "raise exc" in str(back.__cause__)  # the remote traceback came along


def test_the_issue_reproducer_keeps_message_reason_and_filename():
    e = mmshm.ShmSpaceError("create: no space")
    e.filename = "/dev/shm/x"
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), back.errno, back.strerror, back.filename, back.reason) == (
        mmshm.ShmSpaceError, errno.ENOSPC, "create: no space", "/dev/shm/x", "enospc")
    b = pickle.loads(pickle.dumps(mmshm.ShmSpaceError("budget: over", reason="budget")))
    assert (str(b), b.reason) == ("[Errno 28] budget: over", "budget")


def test_a_materialize_error_whose_request_cannot_be_pickled_keeps_the_rest():
    h = mmshm.ShmTensor.from_tensor(pattern(1 << 17, 1))
    h.release()  # a released handle refuses pickling, as in a failed request
    e = mmshm.MaterializeError("failed", request={"feature": h}, reason="not_found", ranks=[0])
    back = pickle.loads(pickle.dumps(e))
    assert (str(back), back.reason, back.ranks, back.request) == (
        "failed", "not_found", [0], None)


@pytest.mark.fault
@pytest.mark.timeout(180)
def test_process_pool_race_for_the_last_space_gives_typed_errors_and_strands_nothing():
    res = run_script("pool_race", size="64m", timeout=170)
    assert res["other"] == []  # no BrokenProcessPool, no TypeError
    assert res["pool_usable"] is True
    assert res["bytes_equal"] and res["handles"] >= 3
    assert res["handles"] + len(res["errors"]) == 16
    errs = res["errors"]
    assert all(e["type"] == "ShmSpaceError" and e["errno"] == errno.ENOSPC
               and e["remote_traceback"] for e in errs)
    fallocate = [e for e in errs if e["filename"]]
    guard = [e for e in errs if not e["filename"]]
    assert fallocate and guard, errs  # both paths raced
    assert all(e["reason"] == "enospc" and e["filename"].startswith("/dev/shm/mmshm-")
               and "no space left" in e["message"] for e in fallocate)
    assert all(e["reason"] in ("budget", "enospc") and "28] 28" not in e["message"]
               and ("budget" in e["message"] or "does not fit" in e["message"])
               for e in guard)
    assert res["left"] == []
