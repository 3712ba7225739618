"""The interface a server's integration is built on (``mmshm.hooks.instrumentor``,
``mmshm.transport.sending``, ``mmshm.transport.receiving``), used as is by a third server.

The server is a small package written for the test (``toyserver``, with a
distribution of its own on ``sys.path``): a client that pickles requests
(``n`` copies for parallel sampling) and an engine that unpickles them. Its
integration below is only targets and glue, the shape of
``mmshm.integrations.sglang`` and ``vllm``; the SGLang and vLLM suites run the
same machinery in the real servers. The toy distribution registers it as
mmshm's own are registered, through a ``mmshm.instrumentors`` entry point,
and ``mmshm run`` finds it there with no edit of mmshm.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from mmshm import ShmTensor, integrations
from mmshm.hooks import instrumentor
from mmshm.operations import autopatch
from mmshm.transport import receiving, sending
from mmshm.errors import MaterializeError
from mmshm.hooks.instrumentor import Instrumentor, Target, UnsupportedVersionError
from mmshm.transport.wrapping import transform

from tests.harness.segments import refcount, segment_files
from tests.harness.metrics import metric

FRONTEND = '''
import pickle

def encode(req):
    return pickle.dumps(req)

class Client:
    def __init__(self):
        self.wire = []

    def send(self, req):
        data = encode(req)
        if req.get("fail"):
            raise ConnectionError("the engine is gone")
        self.wire.append(data)

    def add_request(self, req, n=1):
        for i in range(n):
            self.send(dict(req, sample=i))


def late():  # in the source, gone from the module once it is imported
    pass


del late
'''
ENGINE = '''
import pickle

def receive(wire):
    return [pickle.loads(b) for b in wire]
'''


# -- the third server's integration: targets and glue only ---------------------------
def _encode(wrapped, instance, args, kwargs):
    box = sending.current_outbox()
    req = args[0]
    if box is not None:
        req = transform(req, lambda x: (box.put(x) or x) if sending.eligible(x) else x)
    return wrapped(req)


def _send(wrapped, instance, args, kwargs):
    with sending.sending():
        return wrapped(*args, **kwargs)


def _add_request(wrapped, instance, args, kwargs):
    with sending.fanning_out():
        return wrapped(*args, **kwargs)


def _receive(wrapped, instance, args, kwargs):
    return receiving.unwrap_each(wrapped(*args, **kwargs), on_failure=lambda req, err: err)


class ToyInstrumentor(Instrumentor):
    name = "toyserver"
    package = "toyserver"
    supported = ">=1.0,<2"

    def targets(self):
        return [Target("toyserver.frontend", "encode", _encode, params=("req",)),
                Target("toyserver.frontend", "Client.send", _send),
                Target("toyserver.frontend", "Client.add_request", _add_request,
                       params=("req", "n")),
                Target("toyserver.engine", "receive", _receive),
                Target("toyserver.engine", "Engine.step", optional=True)]


@pytest.fixture(scope="module")
def toy_path(tmp_path_factory):
    """The toy server on ``sys.path`` for this module's tests (imported once,
    as a server's modules are: a post-import hook fires once per import)."""
    root = tmp_path_factory.mktemp("toyserver")
    pkg = root / "toyserver"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "frontend.py").write_text(textwrap.dedent(FRONTEND))
    (pkg / "engine.py").write_text(textwrap.dedent(ENGINE))
    info = root / "toyserver-1.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyserver\nVersion: 1.2.0\n")
    (info / "top_level.txt").write_text("toyserver\n")
    # registered as mmshm's own instrumentors are (pyproject.toml's entry points)
    (info / "entry_points.txt").write_text(
        f"[{instrumentor.ENTRY_POINT_GROUP}]\ntoyserver = {__name__}:ToyInstrumentor\n")
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    instrumentor.registered.cache_clear()
    yield root
    sys.path.remove(str(root))
    importlib.invalidate_caches()
    instrumentor.registered.cache_clear()
    integrations._instances.pop("toyserver", None)


@pytest.fixture
def toy(toy_path):
    inst = ToyInstrumentor()
    yield inst
    inst.uninstrument()


def _pixels(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(256, 1176, generator=g)  # 1.2 MB, above MMSHM_MIN_BYTES


def _counts():
    return (metric("mmshm_references_handed_total", path="send"),
            metric("mmshm_fanout_copies_total"),
            metric("mmshm_segments_created_total"))


def test_a_third_server_is_instrumented_through_the_interface_as_is(toy, shm_dir):
    frontend_before = importlib.import_module("toyserver.frontend")
    original_encode = frontend_before.encode
    toy.instrument()  # the module is imported already: patched at once
    from toyserver import engine, frontend

    assert toy.instrumented and frontend.encode is not original_encode
    assert set(toy.patched) == {("toyserver.frontend", "encode"),
                                ("toyserver.frontend", "Client.send"),
                                ("toyserver.frontend", "Client.add_request"),
                                ("toyserver.engine", "receive")}
    t = _pixels()
    before = _counts()
    client = frontend.Client()
    client.add_request({"pixel_values": t}, n=3)
    handed, copies, created = (a - b for a, b in zip(_counts(), before))
    assert (handed, copies, created) == (3, 3, 1)  # written once for the 3 copies
    [name] = segment_files(shm_dir)
    assert refcount(name, shm_dir) == 3  # the fan-out's own reference is back
    assert all(len(m) < 2000 for m in client.wire)  # metadata only, not 1.2 MB

    reqs = engine.receive(client.wire)
    assert [r["sample"] for r in reqs] == [0, 1, 2]
    assert all(torch.equal(r["pixel_values"], t) for r in reqs)
    del reqs
    gc.collect()
    assert segment_files(shm_dir) == []

    toy.uninstrument()
    assert frontend.encode is original_encode and toy.patched == {}
    toy.instrument()  # idempotent across uninstrument: the hooks stay registered
    assert ("toyserver.frontend", "encode") in toy.patched


def test_a_third_server_is_found_through_its_entry_point(toy_path):
    """The toy distribution's ``mmshm.instrumentors`` entry point is all it
    takes: ``MMSHM_INSTRUMENT`` accepts the name, the start-up hook waits for
    its package, and :func:`mmshm.integrations.get` loads it."""
    assert instrumentor.registered()["toyserver"] == f"{__name__}:ToyInstrumentor"
    assert {"sglang", "vllm"} <= set(instrumentor.registered())
    assert autopatch.selected("toyserver") == ["toyserver"]
    assert "toyserver" in autopatch.selected("")
    env, work = autopatch.prepare({"MMSHM_INSTRUMENT": "toyserver"})
    try:
        assert env[autopatch.ENV_ROOTS] == "toyserver=toyserver"
    finally:
        autopatch.release(work)
    assert isinstance(integrations.get("toyserver"), ToyInstrumentor)


@pytest.mark.timeout(240)
def test_mmshm_run_instruments_a_third_server_from_its_entry_point(toy_path, shm_dir):
    code = ("import wrapt, toyserver.frontend as f; "
            "print(isinstance(f.encode, wrapt.FunctionWrapper))")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, MMSHM_INSTRUMENT="toyserver",
               PYTHONPATH=os.pathsep.join([str(toy_path), here]))
    r = subprocess.run([sys.executable, "-m", "mmshm.cli", "run", "--", sys.executable, "-c",
                        code], check=False, env=env, capture_output=True, text=True,
                       timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1:] == ["True"], (r.stdout, r.stderr[-3000:])


@pytest.mark.parametrize("how", ["not installed", "old metadata"])
def test_unreadable_entry_points_fall_back_to_the_built_ins_with_a_warning(
        monkeypatch, caplog, how):
    from importlib import metadata

    class OldDist:
        version = "0.0.1"
        entry_points = ()

    def distribution(name):
        if how == "not installed":
            raise metadata.PackageNotFoundError(name)
        return OldDist()

    monkeypatch.setattr(metadata, "entry_points", lambda group=None: [])
    monkeypatch.setattr(metadata, "distribution", distribution)
    instrumentor.registered.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="mmshm"):
            found = instrumentor.registered()
        assert found == instrumentor.BUILTIN
        [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert ("not installed as a distribution" if how == "not installed"
                else "predates them") in warning
        assert "using the built-in instrumentors (sglang, vllm)" in warning
        assert "Fix: " in warning and "-m pip install" in warning
        assert autopatch.roots() == {"sglang": "sglang", "vllm": "vllm"}
    finally:
        monkeypatch.undo()
        instrumentor.registered.cache_clear()


def test_a_failed_send_gives_back_every_reference(toy, shm_dir):
    toy.instrument()
    from toyserver import frontend

    client = frontend.Client()
    with pytest.raises(ConnectionError):
        client.send({"pixel_values": _pixels(), "fail": True})
    gc.collect()
    assert segment_files(shm_dir) == [] and client.wire == []


def test_a_tensor_still_in_a_live_segment_is_shared_not_copied(toy, shm_dir):
    toy.instrument()
    from toyserver import engine, frontend

    t = _pixels()
    client = frontend.Client()
    client.send({"pixel_values": t})
    client.send({"pixel_values": t})  # the first segment is still held by message 1
    assert len(segment_files(shm_dir)) == 1
    t.add_(1)  # modified in place: its bytes are no longer the segment's
    client.send({"pixel_values": t})
    assert len(segment_files(shm_dir)) == 2
    got = engine.receive(client.wire)
    assert torch.equal(got[2]["pixel_values"], t) and not torch.equal(got[0]["pixel_values"], t)
    del got
    gc.collect()


def test_a_handle_that_cannot_be_opened_becomes_that_requests_error(toy, shm_dir):
    toy.instrument()
    from toyserver import engine, frontend

    client = frontend.Client()
    client.send({"pixel_values": _pixels(1)})
    first = engine.receive(client.wire)  # takes the message's one reference
    del first
    gc.collect()  # the last release: the segment is gone
    client.send({"pixel_values": _pixels(2)})
    assert len(segment_files(shm_dir)) == 1
    got = engine.receive(client.wire)
    errors = [r for r in got if isinstance(r, MaterializeError)]
    assert len(errors) == 1 and errors[0].reason == "not_found"
    good = [r for r in got if not isinstance(r, MaterializeError)]
    assert len(good) == 1 and isinstance(good[0]["pixel_values"], torch.Tensor)
    del got, good, errors
    gc.collect()


@pytest.mark.parametrize("how", ["moved", "parameter", "version", "at_import"])
def test_refuses_all_or_nothing(toy, monkeypatch, how):
    from toyserver import frontend

    send, encode = frontend.Client.send, frontend.encode
    want = {"moved": "Client.gone", "parameter": "receive(timeout)", "version": "outside",
            "at_import": "late is missing at import"}[how]
    if how == "version":
        monkeypatch.setattr(toy, "supported", ">=2")
    else:
        extra = {"moved": Target("toyserver.frontend", "Client.gone", _send),
                 "parameter": Target("toyserver.engine", "receive", _receive,
                                     params=("timeout",)),
                 "at_import": Target("toyserver.frontend", "late", _send)}[how]
        targets = toy.targets() + [extra]
        monkeypatch.setattr(toy, "targets", lambda: targets)
    problems = toy.preflight()
    if how == "at_import":
        assert problems == []  # the source defines it: only the import shows it gone
    else:
        assert len(problems) == 1 and want in problems[0]
    with pytest.raises(UnsupportedVersionError) as info:
        toy.instrument()
    assert want in str(info.value)
    assert not toy.instrumented and toy.patched == {}
    assert frontend.Client.send is send and frontend.encode is encode  # encode was patched first


def test_the_source_check_reads_definitions_imports_and_signatures():
    import ast

    tree = ast.parse(textwrap.dedent('''
        from x import imported as alias
        CONST = 1
        class C:
            def m(self, a, *, b): ...
            async def am(self): ...
        def f(req, /, n=1): ...
    '''))
    assert instrumentor.defines(tree, "alias") == []
    assert instrumentor.defines(tree, "CONST") == []
    assert instrumentor.defines(tree, "C.m", ("a", "b")) == []
    assert instrumentor.defines(tree, "C.am") == []
    assert instrumentor.defines(tree, "f", ("req", "n")) == []
    assert instrumentor.defines(tree, "f", ("req", "timeout")) == ["f(timeout)"]
    assert instrumentor.defines(tree, "C.gone") == ["C.gone"]
    assert instrumentor.defines(tree, "C.alias") == ["C.alias"]  # imports count at top level only
    assert instrumentor.defines(tree, "CONST", ("x",)) == ["CONST(x)"]


def test_a_broken_wire_handle_becomes_a_placeholder_and_a_typed_error(shm_dir):
    t = _pixels()
    h = ShmTensor.from_tensor(t)
    wire = h.encode()
    h.disown()  # its reference rides in "wire"
    view = receiving.materialize_wire(wire, "float32", tuple(t.shape))
    assert torch.equal(view, t) and sending.SEGMENTS.get(view)[0] == wire
    mismatch = receiving.materialize_wire(ShmTensor.from_tensor(t).encode(), "float16",
                                          tuple(t.shape))
    assert mismatch.numel() == 0 and receiving.has_failures()
    err = receiving.failure_in({"x": [view, mismatch]}, "request r1")
    assert isinstance(err, MaterializeError) and err.reason == "malformed"
    assert "request r1: 1 shared-memory tensor(s)" in str(err)
    assert receiving.failure_in({"x": view}) is None
    del view, mismatch
    gc.collect()


def test_rebuild_collects_failures_inside_a_scope_and_raises_outside(shm_dir):
    t = _pixels()
    h = ShmTensor.from_tensor(t)
    wire = h.encode()
    h.disown()  # its reference rides in "wire"
    with receiving.collecting() as got:
        x = receiving.rebuild(wire, 5.0)
        y = receiving.rebuild(b"\x00not a handle", 3.0)
    assert torch.equal(x, t) and y.numel() == 0
    assert len(got.errors) == 1 and got.t_sent == 5.0
    err = got.error("a test message")
    assert isinstance(err, MaterializeError) and err.reason == "malformed"
    assert "1 shared-memory tensor(s) of a test message" in str(err)
    with pytest.raises(MaterializeError):
        receiving.rebuild(b"\x00not a handle")
    del x
    gc.collect()


def test_a_fan_out_copies_a_tensor_again_once_it_is_modified_in_place(toy, shm_dir):
    toy.instrument()
    from toyserver import engine, frontend

    t = _pixels()
    client = frontend.Client()
    with sending.fanning_out():
        client.send({"pixel_values": t})
        client.send({"pixel_values": t})  # shares the first copy's segment
        assert len(segment_files(shm_dir)) == 1
        t.mul_(2)
        client.send({"pixel_values": t})  # new bytes, new segment
        assert len(segment_files(shm_dir)) == 2
    got = engine.receive(client.wire)
    assert torch.equal(got[2]["pixel_values"], t)
    assert torch.equal(got[0]["pixel_values"], got[1]["pixel_values"])
    assert torch.equal(got[0]["pixel_values"] * 2, t)
    del got
    gc.collect()


def test_a_remembered_segment_is_shared_and_given_back_in_its_own_directory(shm_dir,
                                                                               monkeypatch):
    """A tensor remembered in a segment of one directory, sent
    again after ``MMSHM_DIR`` changed, shares that segment in the directory
    it lives in (its handle was made for ``MMSHM_DIR`` at the time of use,
    so it looked like another node's: the share was refused, the tensor went
    inline and the reference leaked); abandoning the message gives every
    reference back there."""
    import os

    from mmshm import config

    t = _pixels()
    first = sending.Outbox()
    h1 = first.put(t)  # written into a segment of shm_dir, remembered
    assert h1 is not None and segment_files(shm_dir) == [h1.name]
    other = os.path.join(shm_dir, "other")
    os.mkdir(other, 0o700)
    monkeypatch.setenv("MMSHM_DIR", other)
    config.reload()
    second = sending.Outbox(hops=1)
    h2 = second.put(t)
    assert h2 is not None, "the remembered segment was not shared"
    assert (h2.name, h2.directory) == (h1.name, shm_dir) and h2.is_local()
    assert refcount(h1.name, shm_dir) == 3  # h1's, and h2's 1 + hops
    assert torch.equal(h2.clone().materialize(copy=True), t)
    second.abandon()
    assert refcount(h1.name, shm_dir) == 1
    monkeypatch.setenv("MMSHM_DIR", shm_dir)  # h1 was made for MMSHM_DIR (no directory)
    config.reload()
    first.abandon()
    assert segment_files(shm_dir) == [] and os.listdir(other) == []
