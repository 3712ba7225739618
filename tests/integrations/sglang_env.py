"""Import a real SGLang release on CPU and drive its transport code.

Used by test_sglang.py in the per-release virtualenvs that
``python -m tests.run sglang`` builds, and by the child processes those
tests start (spawned ranks, the ``mmshm run`` child, the small-tmpfs child).
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import inspect
import os
import pickle
import types

from tests.harness.segments import segment_files

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = os.path.join(HERE, "stubs")
RELEASE = os.environ.get("MMSHM_SGLANG_RELEASE")

MM = "sglang.srt.managers.mm_utils"
IO = "sglang.srt.managers.io_struct"
TM = "sglang.srt.managers.tokenizer_manager"
SB = "sglang.srt.managers.schedule_batch"
COMMON = "sglang.srt.utils.common"
RECEIVER = "sglang.srt.managers.scheduler_components.request_receiver"
SCHEDULER = "sglang.srt.managers.scheduler"


def add_stubs() -> None:
    """Put the triton / torchvision / sgl_kernel stubs on sys.path (and on
    PYTHONPATH for children), and keep torch from believing triton exists
    (:func:`cpu_stubs.use`)."""
    from tests.integrations.stubs import cpu_stubs

    cpu_stubs.use(export=True)


def load(scheduler: bool = True):
    """Import SGLang's transport modules; return a namespace of them."""
    add_stubs()
    import importlib

    ns = types.SimpleNamespace()
    ns.mm = importlib.import_module(MM)
    ns.io = importlib.import_module(IO)
    ns.sb = importlib.import_module(SB)
    ns.common = importlib.import_module(COMMON)
    ns.tm = importlib.import_module(TM)
    ns.receiver = None
    if scheduler:
        try:
            ns.receiver = importlib.import_module(RECEIVER)
        except ImportError:
            ns.scheduler = importlib.import_module(SCHEDULER)
    configure(ns.mm)
    return ns


def configure(mm) -> None:
    """SGLang's shared-memory transport on (mode not ``default``), a tokenizer
    present. The server-args accessor differs by release."""
    mm._is_default_tensor_transport = False
    args = types.SimpleNamespace(skip_tokenizer_init=False)
    for name in ("get_global_server_args", "get_serving"):
        if hasattr(mm, name):
            setattr(mm, name, lambda: args)


# -- request objects -----------------------------------------------------------
class Perm:
    """A permissive stand-in for server state the code touches in passing:
    any attribute or call gives another Perm; awaitable, iterable, falsy."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Perm()

    def __call__(self, *a, **kw):
        return Perm()

    def __await__(self):
        return iter(())

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False


class Stats:
    """Picklable time_stats stand-in (any method call is a no-op)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _noop


def _noop(*a, **kw):
    return None


def make_item(ns, feature):
    Modality = ns.sb.Modality
    cls = ns.sb.MultimodalDataItem
    return cls(modality=Modality.IMAGE, feature=feature, offsets=[(0, 4)])


def make_mm_inputs(ns, items):
    wrap_src = inspect.getsource(ns.mm.wrap_shm_features)
    if 'get("mm_items"' in wrap_src:  # 0.5.9: a dict
        return {"mm_items": items}
    for name in ("MultimodalProcessorOutput", "MultimodalInputs"):
        cls = getattr(ns.sb, name, None)
        if cls is not None:
            try:
                return cls(mm_items=items)
            except TypeError:
                continue
    raise RuntimeError("cannot build mm_inputs for this release")


def _fields(cls):
    if dataclasses.is_dataclass(cls):
        return [(f.name, f.default is dataclasses.MISSING
                 and f.default_factory is dataclasses.MISSING) for f in dataclasses.fields(cls)]
    import msgspec

    return [(f.name, f.required) for f in msgspec.structs.fields(cls)]


def make_request(ns, features, rid="req-0"):
    """A real ``TokenizedGenerateReqInput`` with one image item per feature."""
    cls = ns.io.TokenizedGenerateReqInput
    kwargs = {}
    for name, required in _fields(cls):
        if required:
            kwargs[name] = None
    kwargs.update(rid=rid, input_text="<image> describe", input_ids=[1, 2, 3, 4],
                  mm_inputs=make_mm_inputs(ns, [make_item(ns, f) for f in features]),
                  sampling_params=types.SimpleNamespace(max_new_tokens=8), stream=False,
                  return_logprob=False, logprob_start_len=-1, top_logprobs_num=0)
    names = {n for n, _ in _fields(cls)}
    kwargs = {k: v for k, v in kwargs.items() if k in names}
    req = cls(**kwargs)
    if "time_stats" in names or hasattr(req, "time_stats"):
        try:
            req.time_stats = Stats()
        except AttributeError:
            pass
    return req


def items(req):
    mm = req.mm_inputs
    return mm["mm_items"] if isinstance(mm, dict) else mm.mm_items


def fan_out_copies(ns, req, n):
    """The copies ``TokenizerManager._handle_batch_request`` makes for
    parallel sampling, as this release makes them (``copy.copy``; since 0.5.15
    the items are copied too)."""
    src = inspect.getsource(ns.tm.TokenizerManager._handle_batch_request)
    out = []
    for i in range(n):
        c = copy.copy(req)
        if "Ensure independent mm_items" in src and c.mm_inputs:
            c.mm_inputs = copy.copy(c.mm_inputs)
            c.mm_inputs.mm_items = [copy.copy(it) for it in c.mm_inputs.mm_items]
        c.rid = f"{req.rid}-{i}"
        out.append(c)
    return out


# -- the real send path -----------------------------------------------------------
class Socket:
    """Records what the tokenizer sends: pickled bytes, as zmq's send_pyobj."""

    def __init__(self):
        self.sent: list[bytes] = []

    def send_pyobj(self, obj, flags=0, protocol=pickle.HIGHEST_PROTOCOL):
        self.sent.append(pickle.dumps(obj, protocol))

    def send(self, data, flags=0, **kw):
        self.sent.append(bytes(data))


def send_one(ns, tokenized_obj, sock: Socket) -> None:
    """Call the release's real ``TokenizerManager._send_one_request`` on a
    minimal manager whose socket records the pickled message."""
    import asyncio

    mgr = _Manager()
    mgr.send_to_scheduler = sock
    mgr.rid_to_state = {}
    mgr.req_state_class = lambda *a, **kw: types.SimpleNamespace()
    mgr.server_args = types.SimpleNamespace(dp_size=1)
    mgr.tokenizer_ipc_name = None
    mgr._dispatch_to_scheduler = lambda obj: sock.send_pyobj(obj)
    fn = ns.tm.TokenizerManager._send_one_request
    params = list(inspect.signature(inspect.unwrap(fn)).parameters)
    args = [tokenized_obj]
    if "obj" in params:  # 0.5.9: (obj, tokenized_obj, created_time)
        args = [types.SimpleNamespace(rid=tokenized_obj.rid), tokenized_obj]
    result = fn(mgr, *args)
    if inspect.isawaitable(result):
        asyncio.run(_await(result))


async def _await(aw):
    return await aw


class _Manager(types.SimpleNamespace):
    """A namespace whose missing attributes are permissive :class:`Perm`."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Perm()


# -- SGLang's own segments ---------------------------------------------------------
def sglang_segments(root: str = "/dev/shm") -> set[str]:
    """Segments SGLang's ShmPointerMMData makes (``psm_*``, ``mm_*``, ``sgl*``)."""
    out = set()
    for pat in ("psm_*", "mm_*", "mm-*", "sgl*"):
        out.update(os.path.basename(p) for p in glob.glob(os.path.join(root, pat)))
    return out


def remove_segments(names, root: str = "/dev/shm") -> None:
    """Unlink what a test's SGLang code left in ``root``, except files a live
    process maps or holds open: another program's (a server's ring buffer)
    with a name of the same shape is never touched."""
    from tests.harness.segments import mapped_shm_names

    held = mapped_shm_names(root)
    for n in names:
        if n in held:
            continue
        try:
            os.unlink(os.path.join(root, n))
        except FileNotFoundError:
            pass


# -- the scheduler's receive path, at TP=2 over gloo --------------------------------
def make_receiver(ns, rank: int, group, pull, pull_rpc, tp: int = 2):
    """A callable running the release's real ``recv_requests`` on this rank
    (``Scheduler`` up to 0.5.12, ``SchedulerRequestReceiver`` since 0.5.15)."""
    par = _Manager(pp_rank=0, attn_tp_rank=rank, attn_cp_rank=0, attn_dp_rank=0, tp_size=tp,
                   attn_tp_size=tp, attn_cp_size=1, attn_dp_enabled=False,
                   tp_group=types.SimpleNamespace(rank=rank, ranks=list(range(tp)),
                                                  cpu_group=group, world_size=tp))
    server_args = _Manager(enable_dp_attention=False, language_only=False,
                           encoder_transfer_backend=None, enable_trace=False)
    known = {
        "recv_from_tokenizer": pull, "recv_from_rpc": pull_rpc, "recv_skipper": None,
        "input_blocker": None, "mm_receiver": None, "ps": par, "tp_group": par.tp_group,
        "tp_cpu_group": group, "server_args": server_args,
        "model_config": types.SimpleNamespace(is_multimodal=True), "max_recv_per_poll": -1,
        "stream_output": _noop, "get_last_forward_mode": lambda: None,
        "get_last_batch": lambda: None, "scripted_scheduler_hook": None,
        "scheduler_stage_metrics": None,
    }
    if ns.receiver is not None:
        mod = ns.receiver
        for fn in ("get_parallel", "get_disagg", "get_exec"):
            if hasattr(mod, fn):
                setattr(mod, fn, lambda par=par: par)
        cls = mod.SchedulerRequestReceiver
        kwargs = {f.name: known.get(f.name, _Manager()) for f in dataclasses.fields(cls)}
        inst = cls(**kwargs)
        return lambda: cls.recv_requests(inst)
    fake = _Manager(**known, pp_rank=0, attn_tp_rank=rank, attn_cp_rank=0, tp_size=tp,
                    attn_tp_size=tp, attn_cp_size=1, enable_trace=False)
    fake.recv_limit_reached = lambda n: False
    return lambda: ns.scheduler.Scheduler.recv_requests(fake)


def feature_digest(t) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().view(-1).view(dtype=__import__("torch").uint8)
                          .numpy().tobytes()).hexdigest()


def expected_feature(i: int = 0):
    import torch

    g = torch.Generator().manual_seed(1234 + i)
    return torch.randn(512, 1176, generator=g)  # 2.4 MB, a small Qwen2-VL image


def _one_round(ns, rank, recv, push, pull, label, n_reqs=2):
    """Rank 0 sends ``n_reqs`` requests through the real tokenizer send path
    into the scheduler socket; every rank runs the real receive path."""
    import torch.distributed as dist
    import zmq

    if rank == 0:
        sock = Socket()
        for i in range(n_reqs):
            send_one(ns, make_request(ns, [expected_feature(i)], rid=f"{label}-{i}"), sock)
        for b in sock.sent:
            push.send(b)
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        poller.poll(10000)
    sizes.clear()
    dist.barrier()
    reqs = recv()
    out = {"n": len(reqs), "sizes": list(sizes), "ok": [], "kinds": []}
    for i, r in enumerate(reqs):
        f = items(r)[0].feature
        out["kinds"].append(type(f).__name__)
        out["ok"].append(feature_digest(f) == feature_digest(expected_feature(i)))
    del reqs, r, f
    return out


sizes: list[int] = []


def rank_main(rank, port, zport, modes, queue):
    """One TP rank: gloo group on 127.0.0.1, the real receive path, per mode."""
    import datetime
    import gc

    import torch
    import torch.distributed as dist
    import zmq

    try:
        ns = load()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=90))
        real_broadcast = dist.broadcast

        def spy(tensor, *a, **kw):
            if tensor.dtype == torch.uint8:
                sizes.append(tensor.numel())
            return real_broadcast(tensor, *a, **kw)

        dist.broadcast = spy
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull_rpc = ctx.socket(zmq.PULL)
        push = None
        if rank == 0:
            pull.bind(f"tcp://127.0.0.1:{zport}")
            pull_rpc.bind(f"tcp://127.0.0.1:{zport + 1}")
            push = ctx.socket(zmq.PUSH)
            push.connect(f"tcp://127.0.0.1:{zport}")
        group = dist.group.WORLD
        results = {}
        for mode in modes:
            if mode == "mmshm":
                import mmshm

                mmshm.instrument("sglang")
            recv = make_receiver(ns, rank, group, pull, pull_rpc)
            results[mode] = _one_round(ns, rank, recv, push, pull, mode)
            gc.collect()
            dist.barrier()  # every rank dropped its tensors
            d = os.environ.get("MMSHM_DIR", "/dev/shm")
            results[mode]["left"] = segment_files(d)
        for s in (pull, pull_rpc, push):
            if s is not None:
                s.close(linger=0)
        ctx.term()
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, results))
    except BaseException as exc:  # noqa: BLE001
        import traceback

        queue.put((rank, {"error": f"{exc!r}\n{traceback.format_exc()}"}))


# -- a full /dev/shm -------------------------------------------------------------------
def tmpfs_child(mode: str) -> None:
    """Run inside a private 64 MiB tmpfs on /dev/shm: send one request whose
    100 MB feature cannot fit, through the real send path."""
    import torch

    ns = load(scheduler=False)
    if mode == "mmshm":
        import mmshm

        mmshm.instrument("sglang")
    big = torch.ones(25 * 1024 * 1024, dtype=torch.float32)  # 100 MiB
    sock = Socket()
    send_one(ns, make_request(ns, [big]), sock)
    print(f"SENT {len(sock.sent[0])}", flush=True)
    if mode == "mmshm":
        from mmshm.metrics import FALLBACKS

        n = sum(FALLBACKS.labels(reason=r)._value.get() for r in ("enospc", "budget"))
        print(f"FALLBACKS {int(n)}", flush=True)
