"""Child-process entry points and helpers of tests/integrations/test_vllm.py.

Children are started from the ``spawn`` context, so everything they run lives
here, at top level. They talk to the test through a ``multiprocessing`` pipe:
the test sends ``(command, *args)`` and reads one reply per command.

* :func:`engine_main` is an EngineCore input side: the real
  ``EngineCoreProc.process_input_sockets`` (patched by mmshm) in its thread,
  with the real ``MsgpackDecoder`` and the real ``preprocess_add_request``,
  on a bare ``EngineCoreProc`` object (no model, no scheduler).
* :func:`reader_main` is a TP worker: a real ``MessageQueue`` reader, local
  (the ring) or remote (vLLM's zmq remote socket, as a worker on another node
  reads it).
"""

from __future__ import annotations

import gc
import hashlib
import os
import queue
import threading
import time
import traceback

import torch


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in C order (any dtype, any layout)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def describe(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype), "shape": list(t.shape), "digest": digest(t)}


def nested(data, path: str, out: dict) -> None:
    """Flatten vLLM NestedTensors into ``out[path] = tensor``."""
    if isinstance(data, torch.Tensor):
        out[path] = data
    elif isinstance(data, list | tuple):
        for i, x in enumerate(data):
            nested(x, f"{path}[{i}]", out)


def flat_tensors(obj, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in nested dicts / lists / tuples, by path."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{path}.{k}" if path else str(k)))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{path}[{i}]"))
    return out


def request_tensors(req) -> dict[str, torch.Tensor]:
    """Every tensor of an ``EngineCoreRequest`` / ``Request``, by path."""
    out: dict[str, torch.Tensor] = {}
    for i, f in enumerate(req.mm_features or ()):
        if f.data is None:
            continue
        for key, elem in f.data.items():
            nested(elem.data, f"mm[{i}].{key}", out)
    if getattr(req, "prompt_embeds", None) is not None:
        out["prompt_embeds"] = req.prompt_embeds
    return out


def _summarize(item, mv, codec) -> dict:
    tensors = {}
    for path, t in request_tensors(item).items():
        d = describe(t)
        entry = mv.VIEWS.get(t)
        d["segment"] = codec.decode(entry[0]).name if entry else None
        d["mapped"] = _is_segment_view(t)
        tensors[path] = d
    return {"kind": "add", "id": item.request_id,
            "n": item.sampling_params.n if item.sampling_params else None, "tensors": tensors}


def _serve(conn, **handlers) -> None:
    """A child's command loop: ``("stop",)`` ends it, ``("env", {...})`` swaps
    the MMSHM_* environment (answering "ok"), any other ``(cmd, *args)``
    calls ``handlers[cmd](*args)``, which answers on ``conn`` itself."""
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            return
        if cmd == "env":
            _setenv(args[0])
            conn.send("ok")
        else:
            handlers[cmd](*args)


def _setenv(env: dict) -> None:
    from mmshm import config

    for k in [k for k in os.environ if k.startswith("MMSHM_")]:
        del os.environ[k]
    os.environ.update(env)
    config.reload()


# -- EngineCore input side ----------------------------------------------------------
def engine_main(conn, address: str, env: dict) -> None:
    """Bind nothing, connect a DEALER to ``address`` the way vLLM's EngineCore
    does, and report what arrives."""
    try:
        _setenv(env)
        import vllm.v1.serial_utils as su

        su.PIN_MEMORY = False
        from mmshm.integrations import get

        get("vllm").instrument()
        from mmshm.segments import codec
        from mmshm.integrations.vllm import requests as mv
        from vllm.v1.engine import EngineCoreRequestType
        from vllm.v1.engine.core import EngineCoreProc

        results: queue.Queue = queue.Queue()
        eng = object.__new__(EngineCoreProc)
        eng.tensor_ipc_receiver = None
        eng.input_queue = queue.Queue()
        eng.aborts_queue = queue.Queue()
        eng.mm_receiver_cache = None
        eng.request_block_hasher = None
        eng.structured_output_manager = None
        eng._make_ready_response = lambda: {"ready": True}
        eng._send_error_outputs_to_client = (
            lambda ids, client_index: results.put(("error", list(ids))))
        ready = threading.Event()
        th = threading.Thread(target=eng.process_input_sockets,
                              args=([address], None, b"\x00\x00", ready), daemon=True)
        th.start()
        if not ready.wait(120):
            raise RuntimeError("input thread did not start")

        def pump():
            while True:
                rtype, req = eng.input_queue.get()
                if rtype == EngineCoreRequestType.ADD:
                    results.put(("add", req[0]))
                else:
                    results.put(("other", str(rtype)))
                del req  # nothing here may keep a request alive

        threading.Thread(target=pump, daemon=True).start()
        conn.send(("ready", os.getpid(), type(eng.tensor_ipc_receiver).__name__))

        def take(count, timeout):
            got = []
            for _ in range(count):
                kind, item = results.get(timeout=timeout)
                if kind != "add":
                    got.append({"kind": kind, "item": item})
                    continue
                got.append(_summarize(item, mv, codec))
                del item
            kind = item = None  # noqa: F841 - no request alive at the gc below
            gc.collect()
            conn.send(got)

        def metrics():
            """This process's mmshm_ipc_* and observe-error samples of vLLM."""
            from prometheus_client import REGISTRY

            conn.send({(m.name, s.name, tuple(sorted(s.labels.items()))): s.value
                       for m in REGISTRY.collect() if m.name.startswith("mmshm_")
                       for s in m.samples if s.labels.get("server") == "vllm"})

        _serve(conn, take=take, metrics=metrics)
    except BaseException:
        conn.send(("crash", traceback.format_exc()))
        raise


# -- MessageQueue readers ------------------------------------------------------------
def reader_main(conn, handles: dict, rank: int, env: dict) -> None:
    """A TP worker: attach to every queue in ``handles`` (name -> Handle) and
    dequeue on command, timing enqueue -> dequeue with the writer's clock."""
    try:
        _setenv(env)
        from mmshm.integrations import get

        get("vllm").instrument()
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        queues = {}
        for name, h in handles.items():
            if rank not in h.local_reader_ranks and h.remote_subscribe_addr is None:
                continue  # not a reader of this queue
            queues[name] = MessageQueue.create_from_handle(h, rank)
            if queues[name]._is_remote_reader:
                continue  # no ring: vLLM's remote socket
            if not hasattr(queues[name].buffer, "shared_memory"):  # vLLM defers this failure
                raise RuntimeError(f"ring buffer {h.buffer_handle[-1]} of queue {name!r} is gone "
                                   "from /dev/shm (another process removed it)")
        conn.send(("attached", os.getpid()))
        import zmq

        for q in queues.values():  # bounded: a lost writer fails, never hangs
            sock = q.remote_socket if q._is_remote_reader else q.local_socket
            sock.setsockopt(zmq.RCVTIMEO, 120_000)
            q.wait_until_ready()
            sock.setsockopt(zmq.RCVTIMEO, -1)
        conn.send("ready")

        def read(name, count):  # one report per message, then "done"
            for _ in range(count):
                conn.send(_read_one(queues[name]))
            gc.collect()
            conn.send("done")

        def metric(*args):
            from prometheus_client import REGISTRY

            conn.send(REGISTRY.get_sample_value(*args))

        _serve(conn, read=read, metric=metric)
    except BaseException:
        conn.send(("crash", traceback.format_exc()))
        raise


def _read_one(mq) -> dict:
    try:
        obj = mq.dequeue(timeout=120)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(exc).__name__}: {exc}"}
    t1 = time.monotonic()
    x = obj["x"]
    if x.numel():  # first touch of every page (a zero-copy view faults them in here)
        x.reshape(-1).view(torch.uint8)[::4096].sum()
    t2 = time.monotonic()
    tensors = flat_tensors(obj)
    return {"t_enqueue": obj["t_enqueue"], "t_dequeue": t1, "t_touch": t2,
            "digests": {k: digest(v) for k, v in tensors.items()},
            "shared": [k for k, v in tensors.items() if _is_segment_view(v)],
            "remote": bool(mq._is_remote_reader)}


def _is_segment_view(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is a mapping of an mmshm segment file."""
    ptr = t.untyped_storage().data_ptr()
    if t.numel() == 0:
        return False
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return len(parts) == 6 and os.path.basename(parts[5].strip()).startswith(
                    "mmshm-")
    return False
