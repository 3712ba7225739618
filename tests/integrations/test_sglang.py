"""mmshm against the real SGLang code of one release, on CPU.

Runs only in the per-release virtualenvs of ``python -m tests.run sglang``
(``MMSHM_SGLANG_RELEASE`` is set there); skipped everywhere else. Each bug the
release has is reproduced twice: without mmshm the test asserts the failure,
with mmshm instrumented the same scenario passes, with the bytes equal on
every rank and nothing left in the segment directory.
"""

from __future__ import annotations

import gc
import inspect
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import types

import pytest

RELEASE = os.environ.get("MMSHM_SGLANG_RELEASE")
if not RELEASE:
    pytest.skip("SGLang integration tests run in `python -m tests.run sglang`'s venvs",
                allow_module_level=True)

import mmshm
from tests.integrations import sglang_env as E
import torch
from mmshm import integrations
from mmshm.integrations.sglang import requests as glue
from mmshm.integrations.sglang import server

from tests.harness import ROOT
from tests.harness.metrics import metric
from tests.harness.ports import free_port
from tests.harness.procs import env_process, preload_ctx, track
from tests.harness.segments import segment_files
from tests.harness.shm import private_shm_prefix, skip_without_unshare

V = tuple(int(x) for x in RELEASE.split("."))
HAS_FANOUT_BUG = V <= (0, 5, 12)  # copies share mm_items: FileNotFoundError
HAS_SIGBUS = V <= (0, 5, 15)  # no posix_fallocate
PIXELS_IN_BROADCAST = V <= (0, 5, 9)  # unwrap before broadcast_pyobj


@pytest.fixture(scope="module")
def ns():
    return E.load()


@pytest.fixture(autouse=True)
def clean(ns):
    """No instrumentation unless a test asks; SGLang's own segments removed."""
    mmshm.uninstrument("sglang")
    E.configure(ns.mm)
    before = E.sglang_segments()
    yield
    mmshm.uninstrument("sglang")
    gc.collect()
    leaked = E.sglang_segments() - before
    E.remove_segments(leaked)


def test_release_is_the_one_under_test(ns):
    import sglang

    assert sglang.__version__ == RELEASE
    assert str(integrations.installed_version("sglang")) == RELEASE
    assert "sglang" in integrations.available()


# -- parallel sampling (fan-out) ------------------------------------------------------
def _fan_out_and_receive(ns, n):
    """Tokenizer: the release's fan-out copies, each through the real
    ``_send_one_request``. Scheduler: unpickle each message (``recv_pyobj``)
    and unwrap it as the release does, in order."""
    req = E.make_request(ns, [E.expected_feature(0)])
    sock = E.Socket()
    for c in E.fan_out_copies(ns, req, n):
        E.send_one(ns, c, sock)
    received, errors = [], []
    for b in sock.sent:
        try:
            r = pickle.loads(b)
            ns.mm.unwrap_shm_features(r)
            received.append(r)
        except FileNotFoundError as exc:
            errors.append(exc)
    return req, sock, received, errors


def test_fanout_without_mmshm(ns):
    _, sock, received, errors = _fan_out_and_receive(ns, 3)
    if HAS_FANOUT_BUG:
        # The copies share mm_items: the first wrap mutates the shared item,
        # the first receiver unlinks the segment, the next copy is gone.
        assert errors, "expected FileNotFoundError on the second copy"
        assert all("psm_" in str(e) or "No such file" in str(e) for e in errors)
        assert len(received) == 1
    else:
        # Fixed upstream by giving every copy its own full segment: n copies
        # of the pixels in /dev/shm (unlinked again by the receivers).
        assert not errors and len(received) == 3
        names = {m for b in sock.sent for m in re.findall(rb"(?:sgl_shm_mm|psm)_\w+", b)}
        assert len(names) == 3
    for r in received:
        assert E.feature_digest(E.items(r)[0].feature) == \
            E.feature_digest(E.expected_feature(0))


def test_fanout_with_mmshm(ns):
    mmshm.instrument("sglang")
    n = 4
    req, sock, received, errors = _fan_out_and_receive(ns, n)
    assert not errors
    # the original request is untouched: no handle leaked into shared items
    assert isinstance(E.items(req)[0].feature, torch.Tensor)
    metas = [E.items(r)[0].feature for r in received]
    assert all(isinstance(h, mmshm.ShmTensor) for h in metas)
    assert len({h.name for h in metas}) == 1, "one shared segment for all copies"
    assert len(segment_files()) == 1
    assert all(len(b) < 16384 for b in sock.sent), "metadata only on the socket"
    out = glue.local_unwrap(received)
    want = E.feature_digest(E.expected_feature(0))
    assert [E.feature_digest(E.items(r)[0].feature) for r in out] == [want] * n
    del out, received, metas
    gc.collect()
    assert segment_files() == []


# -- parallel sampling through the real _handle_batch_request ------------------------
class _Scheduler:
    """The scheduler side of the stand-in: unpickles a copy when the tokenizer
    waits for its answer, materializes it as the release's receive path does
    (mmshm's unwrap), checks the bytes, and drops everything before answering
    (a warm-up's references are all released before the samples are sent)."""

    def __init__(self, ns, sock):
        self.ns, self.sock, self.next = ns, sock, 0
        self.pending: dict[str, object] = {}  # received, not yet run
        self.answered: list[tuple[str, int, bool, int]] = []  # rid, max_new_tokens, ok, refs
        self.want = E.feature_digest(E.expected_feature(0))

    def answer(self, rid):
        from mmshm.segments import segment

        for b in self.sock.sent[self.next:]:
            r = pickle.loads(b)  # its handles own the references sent with it
            self.pending[r.rid] = r
        self.next = len(self.sock.sent)
        req = self.pending.pop(rid)
        h = E.items(req)[0].feature
        refs = segment.update_refcount(h.name, 0) if isinstance(h, mmshm.ShmTensor) else -1
        req = glue.local_unwrap([req])[0]
        f = E.items(req)[0].feature
        ok = isinstance(f, torch.Tensor) and E.feature_digest(f) == self.want
        self.answered.append((rid, req.sampling_params.max_new_tokens, ok, refs))
        del req, f, h
        gc.collect()
        return {"text": "", "meta_info": {"id": rid}}


def _batch_stand_in(ns, sched):
    """A minimal TokenizerManager running the release's own
    ``_handle_batch_request`` and ``_send_one_request`` (as instrumented now)."""
    tm = ns.tm.TokenizerManager
    feature = E.expected_feature(0)

    async def tokenize(self, obj):
        return E.make_request(ns, [feature], rid=obj.rid)  # one tensor per prompt

    async def wait(self, obj, *rest):
        yield sched.answer(obj.rid)

    def init_state(self, obj):
        self.rid_to_state[obj.rid] = types.SimpleNamespace(
            time_stats=E.Stats(), lora_released=False, prompt_token_ids=None)

    methods = {name: tm.__dict__[name] for name in
               ("_handle_batch_request", "_send_one_request", "_collect_batch_responses")
               if name in tm.__dict__}
    cls = type("StandIn", (E._Manager,), dict(
        methods, _tokenize_one_request=tokenize, _wait_one_response=wait,
        _init_req_state=init_state))
    mgr = cls(send_to_scheduler=sched.sock, rid_to_state={}, tokenizer_ipc_name=None,
              server_args=types.SimpleNamespace(dp_size=1),
              req_state_class=lambda *a, **kw: types.SimpleNamespace())
    mgr._dispatch_to_scheduler = lambda obj: sched.sock.send_pyobj(obj)
    return mgr


def _batch_extra_args(mgr, states) -> list:
    """What the release's ``_handle_batch_request`` takes after (obj, request):
    0.5.9 ``created_time``, 0.5.12-0.5.15 nothing, 0.5.2x ``request_states``."""
    params = list(inspect.signature(inspect.unwrap(mgr._handle_batch_request)).parameters)
    if "request_states" in params:
        return [states]
    if "created_time" in params:
        return [None]
    return []


def _run_batch(ns, n):
    """One request with one image and ``n`` samples through the real
    ``_handle_batch_request`` (the warm-up awaited before the samples)."""
    import asyncio

    sched = _Scheduler(ns, E.Socket())
    mgr = _batch_stand_in(ns, sched)
    obj = ns.io.GenerateReqInput(text="<image> describe",
                                 sampling_params={"n": n, "max_new_tokens": 4})
    obj.normalize_batch_and_arguments()
    states = {}
    for rid in obj.rid if isinstance(obj.rid, list) else [obj.rid]:
        mgr._init_req_state(types.SimpleNamespace(rid=rid))
        states[rid] = mgr.rid_to_state[rid]
    extra = _batch_extra_args(mgr, states)

    async def drive():
        return [out async for out in mgr._handle_batch_request(obj, None, *extra)]

    outs = asyncio.run(drive())
    return sched, outs


def _counters():
    from mmshm import metrics

    return (metrics.SHM_WRITTEN_BYTES._value.get(), metrics.SEGMENTS_CREATED._value.get(),
            metrics.FANOUT_COPIES._value.get())


@pytest.mark.parametrize("pooled", [False, True], ids=["fresh", "pool"])
def test_fanout_writes_once_through_handle_batch_request(ns, request, pooled):
    """Parallel sampling through the release's own ``_handle_batch_request``:
    the warm-up copy is sent, answered and released by the scheduler before
    the n samples are sent. The tokenizer's reference for the fan-out scope
    keeps the segment, so the pixels are written once for the n + 1 copies."""
    if pooled:
        request.getfixturevalue("pool")
    mmshm.instrument("sglang")
    n = 3
    payload = E.expected_feature(0).numel() * 4
    before = _counters()
    made = []
    from mmshm.transport import wrapping

    orig = wrapping.to_shm

    def spy(x, *a, **kw):
        h = orig(x, *a, **kw)
        if h is not None:
            made.append(h.name)
        return h

    wrapping.to_shm = spy
    try:
        sched, outs = _run_batch(ns, n)
    finally:
        wrapping.to_shm = orig
    written, created, copies = (a - b for a, b in zip(_counters(), before))
    assert len(sched.answered) == n + 1, sched.answered
    assert sched.answered[0][1] == 0, "the warm-up (max_new_tokens 0) comes first"
    assert all(ok for _, _, ok, _ in sched.answered), "bytes differ"
    assert len(outs) == 1 and len(outs[0]) == n
    assert written == payload, f"{written / payload:.0f} payloads written for one fan-out"
    assert len(made) == 1 and created == 1
    assert copies == n + 1
    # references on the one segment when each copy is run: the warm-up's and
    # the scope's; then the n samples' and the scope's, one fewer each time
    assert [refs for *_, refs in sched.answered] == [2] + list(range(n + 1, 1, -1))
    gc.collect()
    # the scope's reference was given back at its end: the segment is free
    from mmshm import MmshmError
    from mmshm.segments import segment

    with pytest.raises((MmshmError, OSError)):
        segment.update_refcount(made[0], 0)
    if not pooled:
        assert segment_files() == []


def test_fanout_without_the_scope_writes_again(ns, monkeypatch):
    """The cause, shown: without the fan-out scope the scheduler's release of
    the warm-up frees the segment and the samples write the pixels again."""
    monkeypatch.setattr(glue, "handle_batch_request",
                        lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    mmshm.instrument("sglang")
    payload = E.expected_feature(0).numel() * 4
    before = _counters()
    sched, _ = _run_batch(ns, 2)
    written, _, copies = (a - b for a, b in zip(_counters(), before))
    assert all(ok for _, _, ok, _ in sched.answered)
    assert written == 2 * payload and copies == 0
    assert [refs for *_, refs in sched.answered] == [1, 2, 1]


def test_fanout_scope_releases_when_the_request_fails(ns):
    """A warm-up whose answer never comes (the client went away: the
    generator is closed): the scope's references are given back."""
    import asyncio

    mmshm.instrument("sglang")
    sched = _Scheduler(ns, E.Socket())
    mgr = _batch_stand_in(ns, sched)

    async def fail(self, obj, *rest):
        raise RuntimeError("client went away")
        yield  # an async generator

    type(mgr)._wait_one_response = fail
    obj = ns.io.GenerateReqInput(text="x", sampling_params={"n": 2, "max_new_tokens": 4})
    obj.normalize_batch_and_arguments()
    extra = _batch_extra_args(mgr, {})

    async def drive():
        async for _ in mgr._handle_batch_request(obj, None, *extra):
            pass

    with pytest.raises(RuntimeError, match="client went away"):
        asyncio.run(drive())
    # the scope gave its reference back; the warm-up's message, which no
    # scheduler will receive now, holds the only one left
    (name,) = segment_files()
    from mmshm.segments import segment

    assert segment.update_refcount(name, 0) == 1
    received = [pickle.loads(b) for b in sched.sock.sent]
    del received  # received and dropped: released
    gc.collect()
    assert segment_files() == []


def test_dispatch_failure_releases(ns):
    mmshm.instrument("sglang")

    class Broken(E.Socket):
        def send_pyobj(self, obj, *a, **kw):
            raise RuntimeError("scheduler socket closed")

    with pytest.raises(RuntimeError):
        E.send_one(ns, E.make_request(ns, [E.expected_feature(1)]), Broken())
    gc.collect()
    assert segment_files() == []


# -- content hash ------------------------------------------------------------------------
def test_hash_is_carried_and_transport_independent(ns, monkeypatch):
    mmshm.instrument("sglang")
    t = E.expected_feature(2)
    small = torch.arange(10, dtype=torch.float32)

    def send(tensor_list_or_tensor):
        sock = E.Socket()
        E.send_one(ns, E.make_request(ns, [tensor_list_or_tensor]), sock)
        return pickle.loads(sock.sent[0])

    via_shm = send(t)
    assert isinstance(E.items(via_shm)[0].feature, mmshm.ShmTensor)
    monkeypatch.setenv("MMSHM_MIN_BYTES", str(1 << 40))
    mmshm.config.reload()
    inline = send(t.clone())
    monkeypatch.delenv("MMSHM_MIN_BYTES")
    mmshm.config.reload()
    assert isinstance(E.items(inline)[0].feature, torch.Tensor)
    h = E.items(via_shm)[0].hash
    assert h is not None and h == E.items(inline)[0].hash
    # hash_feature: the carried hash, equal to the hash of the bytes
    handle = E.items(via_shm)[0].feature
    assert ns.mm.hash_feature(handle) == h == ns.mm.hash_feature(t)
    assert h == server.hash_int(mmshm.content_hash(t))
    # lists mixing handles and inline tensors (a partial fallback)
    mixed = ns.mm.hash_feature([handle, small])
    assert mixed == ns.mm.hash_feature([t, small])
    # the scheduler side: set_pad_value keeps the carried hash, no re-hash
    item = E.items(glue.local_unwrap([via_shm])[0])[0]
    calls = []
    real = ns.mm.hash_feature
    monkeypatch.setattr(ns.mm, "hash_feature", lambda f: calls.append(1) or real(f))
    item.set_pad_value()
    assert calls == [] and item.hash == h
    del item, handle, via_shm
    gc.collect()
    assert segment_files() == []


def test_unhashed_items_are_hashed_in_the_copy_pass(ns, monkeypatch):
    """An item SGLang's processor left unhashed gets its handle's hash in
    the pass that copies its pixels (the handle carries it: nothing reads
    the segment again); an item that has a hash keeps it and its handle
    carries none (MMSHM_HASH=lazy). Both hashes are BLAKE3 of the bytes."""
    mmshm.instrument("sglang")
    from mmshm.segments import shmtensor as handle_mod

    t0, t1 = E.expected_feature(4), E.expected_feature(5)
    req = E.make_request(ns, [t0, t1])
    E.items(req)[0].hash = None
    E.items(req)[1].hash = 1234
    reads = []
    real = handle_mod._segment_digest
    monkeypatch.setattr(handle_mod, "_segment_digest",
                        lambda seg, meta: reads.append(meta.name) or real(seg, meta))
    sock = E.Socket()
    E.send_one(ns, req, sock)
    sent = pickle.loads(sock.sent[0])
    first, second = E.items(sent)
    assert reads == [], "the hash was read back from the segment"
    assert first.feature.meta.hash == mmshm.content_hash(t0)
    assert first.hash == server.hash_int(mmshm.content_hash(t0))
    assert second.hash == 1234 and second.feature.meta.hash == b""
    assert E.items(req)[0].hash is None, "the request itself is not modified"
    mmshm.release(sent)
    gc.collect()
    assert segment_files() == []


def test_item_whose_segment_vanished_before_hashing_stays_unhashed(ns, caplog):
    """MMSHM_HASH=lazy: the tokenizer side reads the handle's hash from its
    segment. A segment removed in between (an operator's rm) leaves the item
    unhashed with a warning; the send goes on, nothing raises."""
    h = mmshm.ShmTensor.from_tensor(E.expected_feature(3))
    assert h.meta.hash == b""  # not computed yet
    name = h.name
    h2 = h.clone()
    h.release()
    h2.release()  # the last reference: the segment is gone
    assert name not in segment_files()
    orphan = mmshm.ShmTensor(h2.meta)  # a handle whose segment no longer exists
    item = ns.sb.MultimodalDataItem(modality=ns.sb.Modality.IMAGE, feature=orphan,
                                    offsets=[(0, 4)])
    item.hash = None
    mm_inputs = E.make_mm_inputs(ns, [item])
    with caplog.at_level("WARNING", logger="mmshm"):
        server.set_item_hashes(mm_inputs)
    assert item.hash is None
    assert any("could not hash" in r.getMessage() for r in caplog.records)
    orphan.disown()  # it never owned a live reference


# -- instrumentor behaviour --------------------------------------------------------------
def test_instrument_is_idempotent_and_reversible(ns):
    originals = (ns.tm.wrap_shm_features, ns.mm.hash_feature,
                 ns.tm.TokenizerManager.__dict__["_send_one_request"])
    mmshm.instrument("sglang")
    mmshm.instrument("sglang")
    assert getattr(ns.tm.wrap_shm_features, "_self_mmshm", False)
    assert not getattr(ns.tm.wrap_shm_features.__wrapped__, "_self_mmshm", False)
    mmshm.uninstrument("sglang")
    assert (ns.tm.wrap_shm_features, ns.mm.hash_feature,
            ns.tm.TokenizerManager.__dict__["_send_one_request"]) == originals
    sched = ns.receiver or ns.scheduler
    assert not getattr(sched.broadcast_pyobj, "_self_mmshm", False)


def test_moved_symbol_refuses_and_patches_nothing(ns, monkeypatch):
    inst = integrations.get("sglang")
    from mmshm.hooks import instrumentor

    real = instrumentor.defines
    monkeypatch.setattr(instrumentor, "defines", lambda tree, path, params=(): (
        [path] if path == "hash_feature" else real(tree, path, params)))
    with pytest.raises(integrations.UnsupportedVersionError, match="hash_feature"):
        inst.instrument()
    assert not inst.instrumented
    assert not getattr(ns.tm.wrap_shm_features, "_self_mmshm", False)


def test_unsupported_version_refuses(ns, monkeypatch):
    inst = integrations.get("sglang")
    monkeypatch.setattr(inst, "supported", "<0.5.9")
    with pytest.raises(integrations.UnsupportedVersionError, match="outside"):
        inst.instrument()
    assert not getattr(ns.tm.wrap_shm_features, "_self_mmshm", False)


# -- per-hop timing: the scheduler hops timed alike in both modes -------------------------
def _ipc(hop, what="count", transport="server"):
    return metric(f"mmshm_ipc_{'bytes' if what == 'bytes' else 'seconds'}"
                  f"_{'sum' if what == 'bytes' else what}",
                  server="sglang", hop=hop, transport=transport)


@pytest.fixture
def instrumented(monkeypatch):
    """``instrumented("observe" | "shm")``: SGLang instrumented in that mode."""

    def on(mode):
        mmshm.uninstrument("sglang")
        monkeypatch.setenv("MMSHM_MODE", mode)
        mmshm.config.reload()
        mmshm.instrument("sglang")

    yield on
    mmshm.uninstrument("sglang")
    monkeypatch.delenv("MMSHM_MODE", raising=False)
    mmshm.config.reload()


def _scheduler_self(monkeypatch):
    """A bare ``Scheduler`` with what ``_get_multimodal_inputs`` reads."""
    import importlib

    sched = importlib.import_module(E.SCHEDULER)
    if hasattr(sched, "get_mm"):  # 0.5.23: the mm config bag
        monkeypatch.setattr(sched, "get_mm", lambda: types.SimpleNamespace(
            enable_broadcast_mm_inputs_process=False))
    s = object.__new__(sched.Scheduler)
    s.server_args = types.SimpleNamespace(enable_broadcast_mm_inputs_process=False)
    s.model_config = types.SimpleNamespace(requires_mm_token_modalities=False,
                                           is_multimodal=True)
    return s


@pytest.mark.parametrize("mode", ["observe", "shm"])
def test_mm_inputs_hop_times_the_scheduler_hash_once_per_request(ns, monkeypatch,
                                                                instrumented, mode):
    """``Scheduler._get_multimodal_inputs`` (SGLang hashes every item there)
    is one ``mm_inputs`` per request in both modes, with the items' bytes;
    the features come out bit-identical, the hash is SGLang's own in observe
    mode and mmshm's carried BLAKE3 value under mmshm."""
    transport = "server" if mode == "observe" else "mmshm"
    feats = [E.expected_feature(5), E.expected_feature(6)]
    plain = _scheduler_self(monkeypatch)._get_multimodal_inputs(
        E.make_mm_inputs(ns, [E.make_item(ns, f.clone()) for f in feats]))
    instrumented(mode)
    n0, b0 = _ipc("mm_inputs", transport=transport), _ipc("mm_inputs", "bytes", transport)
    out = _scheduler_self(monkeypatch)._get_multimodal_inputs(
        E.make_mm_inputs(ns, [E.make_item(ns, f.clone()) for f in feats]))
    assert _ipc("mm_inputs", transport=transport) - n0 == 1
    assert _ipc("mm_inputs", "bytes", transport) - b0 == sum(f.numel() * 4 for f in feats)
    for item, f, p in zip(out.mm_items, feats, plain.mm_items, strict=True):
        assert torch.equal(item.feature, f)
        want = p.hash if mode == "observe" else server.hash_int(mmshm.content_hash(f))
        assert item.hash == want
    # a text-only request (no items) is no multimodal message
    _scheduler_self(monkeypatch)._get_multimodal_inputs(E.make_mm_inputs(ns, []))
    assert _ipc("mm_inputs", transport=transport) - n0 == 1


@pytest.mark.skipif(V < (0, 5, 15), reason="_finalize_shm_features is 0.5.15+")
@pytest.mark.parametrize("mode", ["observe", "shm"])
def test_materialize_hop_is_the_whole_finalize(ns, monkeypatch, instrumented, mode):
    """0.5.15+: SGLang's ``_finalize_shm_features`` (TP barrier, unwrap, the
    all-reduce of failures) is one ``materialize`` per batch with SGLang's
    pointers' bytes, never one more per unwrap inside; under mmshm the
    handles were materialized before it (in the broadcast hop), so it times
    nothing. The bytes come out identical."""
    transport = "server" if mode == "observe" else "mmshm"
    instrumented(mode)
    feats = [E.expected_feature(7), E.expected_feature(8)]
    sock = E.Socket()
    for i, f in enumerate(feats):  # two requests: two unwraps, one hop
        E.send_one(ns, E.make_request(ns, [f.clone()], rid=f"fin-{i}"), sock)
    reqs = [pickle.loads(b) for b in sock.sent]
    if mode == "shm":
        reqs = glue.local_unwrap(reqs)
    par = E._Manager(attn_dp_enabled=False, tp_size=1, attn_tp_size=1, attn_cp_size=1)
    for fn in ("get_parallel",):
        if hasattr(ns.receiver, fn):
            monkeypatch.setattr(ns.receiver, fn, lambda: par)
    cls = ns.receiver.SchedulerRequestReceiver
    known = {"model_config": types.SimpleNamespace(is_multimodal=True), "tp_size": 1,
             "ps": par, "server_args": E._Manager(enable_dp_attention=False)}
    inst = cls(**{f.name: known.get(f.name, E._Manager()) for f in
                  __import__("dataclasses").fields(cls)})
    n0, b0 = _ipc("materialize", transport=transport), _ipc("materialize", "bytes", transport)
    cls._finalize_shm_features(inst, reqs)
    want = (1, sum(f.numel() * 4 for f in feats)) if mode == "observe" else (0, 0)
    assert (_ipc("materialize", transport=transport) - n0,
            _ipc("materialize", "bytes", transport) - b0) == want
    got = [E.items(r)[0] for r in reqs]
    assert [type(i.feature).__name__ for i in got] == ["Tensor", "Tensor"]
    assert all(torch.equal(i.feature, f) for i, f in zip(got, feats, strict=True))
    del reqs, got
    gc.collect()
    assert segment_files() == []


# -- TP broadcast over gloo, the real receive path --------------------------------------
@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_tp2_receive_path():
    modes = (["inline"] if PIXELS_IN_BROADCAST else []) + ["mmshm"]
    ctx = preload_ctx("tests.integrations.sglang_ranks")  # forks: SGLang imported once
    q = ctx.Queue()
    port, zport = free_port(), free_port()
    procs = [env_process(ctx, E.rank_main, r, port, zport, modes, q) for r in (0, 1)]
    for p in procs:
        p.start()
        track(p.pid)
    results = {}
    try:
        for _ in procs:
            rank, res = q.get(timeout=300)
            results[rank] = res
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    for rank, res in results.items():
        assert "error" not in res, res.get("error")
    pixels = E.expected_feature(0).numel() * 4
    if PIXELS_IN_BROADCAST:
        # without mmshm: the scheduler unwraps before broadcast_pyobj, so the
        # pixels are pickled to every rank
        for rank in (0, 1):
            r = results[rank]["inline"]
            assert r["n"] == 2 and all(r["ok"])
            assert max(r["sizes"]) >= 2 * pixels
    for rank in (0, 1):
        r = results[rank]["mmshm"]
        assert r["n"] == 2, r
        assert r["kinds"] == ["Tensor", "Tensor"]
        assert all(r["ok"]), "bytes differ on a rank"
        assert max(r["sizes"]) < 16384, f"broadcast carried {max(r['sizes'])} bytes"
        assert r["left"] == [], r["left"]


# -- a full /dev/shm: SIGBUS -----------------------------------------------------------
def _in_small_tmpfs(mode: str):
    skip_without_unshare()
    code = f"from tests.integrations import sglang_env; sglang_env.tmpfs_child({mode!r})"
    env = dict(os.environ, MMSHM_DIR="/dev/shm", MMSHM_REAP_INTERVAL_S="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), E.STUBS]))
    cmd = private_shm_prefix() + [sys.executable, "-c", code]
    p = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    if "mount" in p.stderr and p.returncode not in (0, -signal.SIGBUS, 128 + signal.SIGBUS):
        pytest.skip(f"cannot mount a private tmpfs: {p.stderr[-300:]}")
    return p


@pytest.mark.fault
@pytest.mark.timeout(400)
def test_full_shm_without_mmshm():
    p = _in_small_tmpfs("inline")
    if HAS_SIGBUS:
        assert p.returncode in (-signal.SIGBUS, 128 + signal.SIGBUS), (p.returncode, p.stderr[-2000:])
    else:  # 0.5.16+ reserves with posix_fallocate and falls back inline
        assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.fault
@pytest.mark.timeout(400)
def test_full_shm_with_mmshm():
    p = _in_small_tmpfs("mmshm")
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    sent = int(p.stdout.split("SENT ")[1].split()[0])
    assert sent >= 100 * 1024 * 1024, "the feature travels inline"
    assert int(p.stdout.split("FALLBACKS ")[1].split()[0]) == 1


# -- mmshm run: every process, spawn children included -----------------------------------
@pytest.mark.timeout(400)
def test_mmshm_run_instruments_spawn_children(tmp_path):
    orig_site = tmp_path / "orig_site"
    orig_site.mkdir()
    (orig_site / "sitecustomize.py").write_text(
        "import os\nos.environ['MMSHM_TEST_ORIGINAL_SITECUSTOMIZE'] = '1'\n")
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp
        import os
        import sys


        def child(q):
            from tests.integrations import sglang_env
            ns = sglang_env.load(scheduler=False)
            from mmshm import integrations
            q.put((integrations.get("sglang").instrumented,
                   getattr(ns.tm.wrap_shm_features, "_self_mmshm", False),
                   getattr(ns.mm.hash_feature, "_self_mmshm", False),
                   os.environ.get("MMSHM_TEST_ORIGINAL_SITECUSTOMIZE")))


        if __name__ == "__main__":
            # the parent never imports sglang: no mmshm, no torch here
            assert "mmshm" not in sys.modules and "torch" not in sys.modules
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            print("CHILD", q.get(timeout=300), flush=True)
            p.join(60)
            print("PARENT", os.environ.get("MMSHM_TEST_ORIGINAL_SITECUSTOMIZE"),
                  os.environ.get("MMSHM_INSTRUMENT"), flush=True)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(orig_site), E.STUBS, str(ROOT)]))
    env.pop("MMSHM_INSTRUMENT", None)
    cmd = [sys.executable, "-c", "from mmshm.cli import main; main()", "run", "--",
           sys.executable, str(script)]
    p = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=360)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "CHILD (True, True, True, '1')" in p.stdout, p.stdout + p.stderr[-3000:]
    assert "PARENT 1 sglang,vllm" in p.stdout, p.stdout


def test_mmshm_run_propagates_exit_status():
    cmd = [sys.executable, "-c", "from mmshm.cli import main; main()", "run", "--",
           sys.executable, "-c", "import sys; sys.exit(7)"]
    assert subprocess.run(cmd, check=False, timeout=120).returncode == 7
