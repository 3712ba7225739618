"""Transport modes compared by ``mmshm bench``.

A mode has two halves:

* the **producer** half (tokenizer process): :meth:`Mode.fan_out` turns one
  request into the :meth:`Mode.copies` messages it sends for ``n`` parallel
  samples; then, for each copy, :meth:`Mode.before_send` runs, the copy is
  serialized (:meth:`Mode.dumps`, pickle by default) and sent over ZMQ to TP
  rank 0, which decodes it with :meth:`Mode.loads`, and :meth:`Mode.after_send`
  runs;
* the **scheduler** half (every TP rank): :meth:`Mode.broadcast` has the
  contract of SGLang's ``broadcast_pyobj(data, rank, dist_group, src) -> list``
  and must return requests whose tensors are in hand on every rank.

Add a mode by subclassing :class:`Mode` and decorating it with
:func:`register`; it then appears in ``--modes``. Modes are instantiated in
the producer and in every TP rank (spawned processes), so a mode must be
defined in an importable module and be cheap to construct. Optional hooks
report the producer's shared-memory writes (:meth:`Mode.producer_stats`),
clean up after a run (:meth:`Mode.after_run`) and estimate the memory a run
needs (:meth:`Mode.estimate`), so that the sweep skips what the host cannot
hold instead of crashing.

Built in: ``inline``, ``fresh-segment`` (SGLang 0.5.23's strategy as a
baseline) and ``mmshm``, plus, not run by default, ``mmshm-hash-given``
(mmshm with the content hashes taken from the request) and
``mmshm-eager-hash`` (mmshm with every hash computed by the producer, the cost
of ``MMSHM_HASH=eager``), ``mmshm-arena`` (mmshm with the arena, which is on by
default only where CUDA is), and ``sglang`` (SGLang's own transport code, when sglang is
importable; skipped otherwise). ``vllm`` and ``vllm-arena`` (vLLM 0.33.0's own
transport code, its default path and its tensor arena, when vllm is importable;
skipped otherwise) live in :mod:`mmshm.bench.vllm_modes`, which the package registers.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import mmap
import os
import pickle
import secrets
import time
from collections.abc import Callable
from typing import ClassVar

import mmshm
import torch
from mmshm.segments.reaper import pid_alive

MODES: dict[str, type[Mode]] = {}


def register(cls: type[Mode]) -> type[Mode]:
    """Class decorator: make ``cls`` selectable by its ``name``."""
    if not cls.name:
        raise ValueError("a mode needs a name")
    MODES[cls.name] = cls
    return cls


def get_mode(name: str, min_bytes: int | None = None) -> Mode:
    """Instantiate the mode called ``name``.

    Raises:
        KeyError: unknown mode.
    """
    try:
        cls = MODES[name]
    except KeyError:
        raise KeyError(f"unknown mode {name!r}; choose from {', '.join(MODES)}") from None
    return cls(min_bytes=min_bytes)


class Mode:
    """Base class of a transport mode (see the module docstring).

    Args:
        min_bytes: tensors of at least this many bytes go through shared
            memory in modes that use it (default ``MMSHM_MIN_BYTES``).
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: the mode keeps memory warm across requests (a pool, a ring buffer, an
    #: arena), as a server under steady traffic has it: the bench runs it once
    #: per config, unmeasured, before the repetitions it reports
    warm_up_per_config: ClassVar[bool] = False

    def __init__(self, min_bytes: int | None = None):
        self.min_bytes = min_bytes

    # -- producer (tokenizer) --------------------------------------------------
    def copies(self, n: int) -> int:
        """How many messages :meth:`fan_out` makes for ``n`` parallel samples
        (what TP rank 0 receives and every rank must hold)."""
        return n

    def fan_out(self, req, n: int) -> list:
        """The :meth:`copies` copies of ``req`` to send (parallel sampling)."""
        raise NotImplementedError

    def before_send(self, req) -> None:
        """Called on a copy just before it is pickled for its one receiver."""

    def after_send(self, req) -> None:
        """Called on a copy once it has been pickled and handed to ZMQ; the
        producer drops the copy right after."""

    def discard(self, req) -> None:
        """Called instead of :meth:`after_send` on a copy that was never sent
        (an error stopped the sends): give back what it holds. By default
        :meth:`after_send`."""
        self.after_send(req)

    def dumps(self, req) -> bytes:
        """The ZMQ message for one copy (default: pickle, as ``send_pyobj``)."""
        return pickle.dumps(req, pickle.DEFAULT_PROTOCOL)

    def producer_stats(self) -> dict:
        """Shared-memory writes of the last request on the producer:
        ``{"wrap_s": seconds, "wrap_bytes": bytes}``, or ``{}`` when the mode
        writes nothing to shared memory. Reset by :meth:`fan_out`."""
        return {}

    def after_run(self, directory: str) -> list[str]:
        """Called on the producer once every TP rank is done with a request:
        names of files of this mode's own making still present in
        ``directory`` (leftovers, which this call removes)."""
        return []

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this mode cannot run in this interpreter (it is then reported as
        skipped with that note), or None. Called on the producer only for the
        modes selected."""
        return None

    @classmethod
    def estimate(cls, payload: int, copies: int, tp: int) -> tuple[int, int]:
        """``(memory, tmpfs)``: bytes a run holds at its peak, over all the
        bench's processes (tmpfs pages included), and the part of it in the
        segment directory. Used to skip runs the host cannot hold."""
        return 2 * payload, 0

    # -- TP rank 0 ----------------------------------------------------------------
    def loads(self, msg) -> object:
        """The request in a ZMQ message (default: unpickle, as ``recv_pyobj``)."""
        return pickle.loads(msg)

    # -- scheduler (every TP rank) ---------------------------------------------
    def broadcast(self, data, rank: int, dist_group, src: int = 0) -> list:
        """Broadcast the batch ``data`` (meaningful on ``src`` only) to the TP group."""
        raise NotImplementedError

    def instrument_broadcast(self, inner: Callable[[Callable], Callable]) -> None:
        """Let the bench wrap the inner broadcast function (``inner(fn) -> fn``)
        to time the transfer apart from materialization. Optional."""


def _rename(copies: list, rid: str) -> list:
    for i, c in enumerate(copies):
        c.rid = f"{rid}-{i}"
    return copies


@register
class InlineMode(Mode):
    """Pixels are pickled into every ZMQ message and into the TP broadcast
    (SGLang <= 0.5.9, vLLM's default socket path)."""

    name = "inline"
    summary = "pixels pickled through ZMQ and the TP broadcast"

    def __init__(self, min_bytes: int | None = None):
        super().__init__(min_bytes)
        self._bcast = mmshm.broadcast_pyobj

    def fan_out(self, req, n: int) -> list:
        # SGLang's _handle_batch_request: shallow copies sharing mm_items.
        return _rename([copy.copy(req) for _ in range(n)], req.rid)

    def broadcast(self, data, rank, dist_group, src=0):
        return self._bcast(data, rank, dist_group, src)

    def instrument_broadcast(self, inner):
        self._bcast = inner(mmshm.broadcast_pyobj)

    @classmethod
    def estimate(cls, payload, copies, tp):
        # Measured peaks (TP=2, n=2, 32 images: producer 3.3 P, rank 0 3.9 nP,
        # rank 1 4.8 nP above their baselines): the producer holds the request
        # and the messages in flight; rank 0 the n unpickled copies, the pickled
        # batch and broadcast_pyobj's array copy; every other rank the receive
        # buffer, its bytes copy, the unpickled batch and gloo's staging.
        batch = copies * payload
        return payload + batch + batch * (4 + 5 * max(0, tp - 1)), 0


@register
class MmshmMode(Mode):
    """Pixels go through shared memory once: :func:`mmshm.wrap` writes each
    tensor into a segment (from the warm pool when one is idle),
    :func:`mmshm.fan_out` makes the ``n`` copies over the same segments, each
    send hands one reference to its receiver, and TP rank 0 broadcasts
    metadata only through :func:`mmshm.deferred_unwrap`; every rank
    materializes zero-copy views."""

    name = "mmshm"
    summary = "wrap + fan_out + hand_over per send; deferred_unwrap(broadcast_pyobj)"
    warm_up_per_config = True  # the producer's warm pool

    def __init__(self, min_bytes: int | None = None):
        super().__init__(min_bytes)
        self._bcast = mmshm.deferred_unwrap(mmshm.broadcast_pyobj)
        self._stats: dict = {}

    def fan_out(self, req, n: int) -> list:
        t0 = time.perf_counter()
        wrapped = self._wrap(req)  # the producer's shm writes
        t1 = time.perf_counter()
        self._stats = {"wrap_s": t1 - t0,
                       "wrap_bytes": sum(h.nbytes for h in mmshm.handles(wrapped))}
        return _rename(mmshm.fan_out(wrapped, n, min_bytes=self.min_bytes), req.rid)

    def _wrap(self, req):
        """``req`` with its large tensors in shared memory (timed as ``wrap_s``)."""
        return mmshm.wrap(req, min_bytes=self.min_bytes)

    def producer_stats(self) -> dict:
        return dict(self._stats)

    def after_send(self, req) -> None:
        # each copy owns one reference per segment (fan_out): the pickled copy
        # gives it to its one receiver, with no locked update
        for h in mmshm.handles(req):
            h.hand_over()

    def discard(self, req) -> None:
        mmshm.release(req)

    def broadcast(self, data, rank, dist_group, src=0):
        return self._bcast(data, rank, dist_group, src)

    def instrument_broadcast(self, inner):
        self._bcast = mmshm.deferred_unwrap(inner(mmshm.broadcast_pyobj))

    @classmethod
    def estimate(cls, payload, copies, tp):
        # the request, its one set of segments, and (pooled) last run's segments
        return 3 * payload, 2 * payload


def _wrap_items(req, min_bytes: int | None, kwargs_of):
    """A copy of SGLang-shaped ``req`` whose items' features of at least
    ``min_bytes`` (default ``MMSHM_MIN_BYTES``) are handles made by
    :meth:`mmshm.ShmTensor.from_tensor` with ``kwargs_of(item)``; a feature
    that cannot go into shared memory stays inline, as ``wrap``'s fallback."""
    from mmshm import config

    threshold = min_bytes if min_bytes is not None else config.get().min_bytes
    c = copy.copy(req)
    c.mm_inputs = copy.copy(req.mm_inputs)
    c.mm_inputs.mm_items = [copy.copy(it) for it in req.mm_inputs.mm_items]
    for it in c.mm_inputs.mm_items:
        f = it.feature
        if not isinstance(f, torch.Tensor) or f.numel() * f.element_size() < threshold:
            continue
        try:
            it.feature = mmshm.ShmTensor.from_tensor(f, **kwargs_of(it))
        except (OSError, mmshm.MmshmError):
            continue
    return c


@register
class MmshmHashGivenMode(MmshmMode):
    """``mmshm`` where the producer hands each tensor's content hash to
    :meth:`mmshm.ShmTensor.from_tensor` from the request (``item.hash``, which
    the bench computes before timing, as SGLang's tokenizer does for its
    prefix cache) instead of letting :func:`mmshm.wrap` compute BLAKE3 over the
    segment when asked. Not a default mode: with ``MMSHM_HASH=lazy`` (the
    default) nobody asks in the bench, so it costs what ``mmshm`` does; it
    shows that a given hash is free (``fresh-segment`` gets the hash from the
    request in the same way)."""

    name = "mmshm-hash-given"
    summary = "mmshm, content hashes taken from the request instead of computed"

    def _wrap(self, req):
        return _wrap_items(req, self.min_bytes, lambda it: {"hash": it.hash})


@register
class MmshmEagerHashMode(MmshmMode):
    """``mmshm`` where the producer computes every handle's BLAKE3 content
    hash before sending, so that it travels with the handle: the cost of
    ``MMSHM_HASH=eager``, and of SGLang's tokenizer asking for the hash of an
    item its processor left unhashed (``Outbox.put(hash_now=True)``): the
    hash is computed in the copy's pass, or beside it on more copy threads
    (:meth:`mmshm.ShmTensor.from_tensor` ``hash_now=True``). The default,
    ``lazy``, hashes only for a consumer that asks. Not a default mode."""

    name = "mmshm-eager-hash"
    summary = "mmshm, BLAKE3 of every tensor computed by the producer (MMSHM_HASH=eager)"

    def _wrap(self, req):
        return _wrap_items(req, self.min_bytes, lambda it: {"hash_now": True})


@register
class MmshmArenaMode(MmshmMode):
    """``mmshm`` with the arena on in the producer (``MMSHM_ARENA_BYTES`` as
    set, else the size a CUDA host gets by default,
    :func:`mmshm.config.default_arena_bytes`: 1 GiB, at most a quarter of the
    segment directory's file system; set around each wrap only, so the other
    modes of the run are untouched; one line on stderr says the size, and
    requests that do not fit fall back to plain segments as a server's do,
    counted in ``mmshm_arena_fallbacks_total``): its segments are arena
    segments, kept warm in its pool, and every TP rank maps each one once and
    keeps the mapping (registered with CUDA once, with ``--device cuda``), so
    that a rank's reads and its copy to the GPU take no page faults (see
    :mod:`mmshm.segments.arena`). Off by default on a host without CUDA, hence
    its own mode; not a default mode."""

    name = "mmshm-arena"
    summary = "mmshm with the arena: warm segments each rank maps once (MMSHM_ARENA_BYTES)"

    _said = False

    def _wrap(self, req):
        import sys

        from mmshm import config

        before = os.environ.get("MMSHM_ARENA_BYTES")
        size = config.get().arena_bytes
        if not size:  # unset, or 0: this mode is the arena's, at a CUDA host's default
            st = os.statvfs(config.get().dir)
            size = config.default_arena_bytes(st.f_blocks * st.f_frsize)
        if not MmshmArenaMode._said:
            MmshmArenaMode._said = True
            print(f"mmshm-arena: an arena of {size / 2**20:.0f} MiB in the producer"
                  f"{' (MMSHM_ARENA_BYTES)' if before else ' (the default on a CUDA host)'}; "
                  f"a request that does not fit goes to a plain segment; without CUDA in the "
                  f"ranks its "
                  f"views are warm unregistered pages (docs/gpu.md)", file=sys.stderr)
        os.environ["MMSHM_ARENA_BYTES"] = str(size)
        config.reload()
        try:
            return super()._wrap(req)
        finally:
            if before is None:
                del os.environ["MMSHM_ARENA_BYTES"]
            else:
                os.environ["MMSHM_ARENA_BYTES"] = before
            config.reload()


# -- fresh-segment: SGLang 0.5.23's ShmPointerMMData, as our own baseline -------

FRESH_PREFIX = "mmshm-bench-fresh-"
# Fresh segments live in a per-producer subdirectory of the segment directory
# (same tmpfs): the test suite's leak check treats any "mmshm-*" entry of
# /dev/shm that is not an mmshm segment as its own and removes it, which would
# pull the files from under a bench running beside it.
FRESH_DIR_PREFIX = "bench-fresh-"
_FRESH_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def fresh_dir(directory: str, pid: int | None = None) -> str:
    """The subdirectory of ``directory`` holding the fresh segments of ``pid``
    (default: this process)."""
    return os.path.join(directory, f"{FRESH_DIR_PREFIX}{os.getpid() if pid is None else pid}")


def _fresh_dirs(directory: str) -> dict[int, str]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    out = {}
    for name in names:
        pid = name[len(FRESH_DIR_PREFIX):]
        if name.startswith(FRESH_DIR_PREFIX) and pid.isdigit():
            out[int(pid)] = os.path.join(directory, name)
    return out


def fresh_files(directory: str, pids=None) -> list[str]:
    """Fresh-segment files under ``directory`` (in its producers'
    subdirectories, made by one of ``pids`` or by anyone), as paths relative
    to ``directory``."""
    out = []
    for pid, d in _fresh_dirs(directory).items():
        if pids is not None and pid not in pids:
            continue
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            continue
        out += [os.path.join(os.path.basename(d), n) for n in names
                if n.startswith(FRESH_PREFIX)]
    return sorted(out)


def remove_fresh_dirs(directory: str, pids=None, dead_only: bool = False) -> list[str]:
    """Remove the fresh-segment subdirectories of ``pids`` (or of every
    producer no longer alive, with ``dead_only``) and their files; returns
    the files removed (relative to ``directory``)."""
    removed = []
    for pid, d in _fresh_dirs(directory).items():
        if pids is not None and pid not in pids:
            continue
        if dead_only and pid_alive(pid):
            continue
        for name in fresh_files(directory, {pid}):
            if _unlink_quietly(os.path.join(directory, name)):
                removed.append(name)
        with contextlib.suppress(OSError):
            os.rmdir(d)
    return removed


def _unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def write_fresh_segment(t: torch.Tensor, directory: str) -> str:
    """Copy ``t`` into a new file of ``directory`` the way SGLang 0.5.23's
    ``ShmPointerMMData.__init__`` does: create, ``ftruncate``,
    ``posix_fallocate`` (ENOSPC instead of SIGBUS), map shared, copy, close.
    Returns the file's name. Nothing is left behind on failure."""
    t = t.detach().contiguous()
    nbytes = t.numel() * t.element_size()
    name = f"{FRESH_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    path = os.path.join(directory, name)
    fd = os.open(path, _FRESH_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if nbytes:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            with mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE) as mm:
                dst = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
                dst.copy_(t.reshape(-1).view(torch.uint8))
                del dst
    except BaseException:
        _unlink_quietly(path)
        raise
    finally:
        os.close(fd)
    return name


class FreshShmPointer:
    """A tensor in a fresh segment: pickled as name, shape and dtype.

    As SGLang's ``ShmPointerMMData``, unpickling opens and maps the segment
    (and never raises: a failure is kept for :meth:`materialize`), and
    :meth:`materialize` returns a copy-on-write (``MAP_PRIVATE``) mapping,
    then closes and unlinks the segment, whatever happens.
    """

    __slots__ = ("_fd", "_map", "directory", "dtype", "error", "name", "nbytes", "shape")

    def __init__(self, name: str, shape, dtype: torch.dtype, directory: str):
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        self.directory = directory
        self.nbytes = 0
        self.error: str | None = None
        self._fd: int | None = None
        self._map: mmap.mmap | None = None

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    def __reduce__(self):
        return (_open_fresh, (self.name, self.shape, self.dtype, self.directory))

    def _open(self) -> None:
        try:
            self._fd = os.open(self.path, _FRESH_FLAGS)
            self.nbytes = os.fstat(self._fd).st_size
            if self.nbytes:  # SharedMemory(name) maps the whole segment, shared
                self._map = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_SHARED,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except Exception as exc:  # noqa: BLE001 - unpickling must not raise
            self.error = f"{type(exc).__name__}: {exc}"
            self._close()

    def materialize(self) -> torch.Tensor:
        """The tensor over a private copy-on-write mapping; the segment is
        unlinked and this pointer's descriptors closed in any case."""
        try:
            if self.error is not None:
                raise OSError(errno.ENOENT, self.error, self.path)
            want = torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()
            if want > self.nbytes:
                raise OSError(errno.EINVAL, f"segment holds {self.nbytes} bytes, "
                                            f"expected {want}", self.path)
            if want == 0:
                return torch.empty(self.shape, dtype=self.dtype)
            owned = mmap.mmap(self._fd, want, flags=mmap.MAP_PRIVATE,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
            return torch.frombuffer(owned, dtype=self.dtype).reshape(self.shape)
        finally:
            self.close_and_unlink()

    def close_and_unlink(self) -> None:
        """Unlink the segment (tolerating another rank's unlink) and close."""
        try:
            _unlink_quietly(self.path)
        except OSError:
            pass
        finally:
            self._close()

    def _close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self._close()  # only close: unlinking is materialize()'s job


def _open_fresh(name: str, shape, dtype, directory: str) -> FreshShmPointer:
    p = FreshShmPointer(name, shape, dtype, directory)
    p._open()
    return p


def _items(req) -> list:
    mm = getattr(req, "mm_inputs", None)
    return list(getattr(mm, "mm_items", None) or ())


@register
class FreshSegmentMode(Mode):
    """SGLang 0.5.23's strategy, written as a baseline: every copy sent (the
    parallel-sampling warm-up copy plus the ``n`` samples when ``n > 1``) gets
    its own full segment per tensor, created per request in fresh tmpfs pages;
    the pickled messages and the broadcast carry name, shape and dtype; the TP
    ranks meet at a barrier before anyone unlinks, then each materializes a
    copy-on-write mapping and unlinks."""

    name = "fresh-segment"
    summary = "n+1 fresh segments per request; barrier, MAP_PRIVATE materialize, unlink"

    def __init__(self, min_bytes: int | None = None):
        super().__init__(min_bytes)
        self._bcast = mmshm.broadcast_pyobj
        self._wrap_s = 0.0
        self._wrap_bytes = 0
        self._created: list[str] = []
        self._dir: str | None = None

    def _directory(self) -> str:
        if self._dir is None:
            from mmshm import config

            d = fresh_dir(config.get().dir)
            os.makedirs(d, mode=0o700, exist_ok=True)
            self._dir = d
        return self._dir

    # -- producer --------------------------------------------------------------
    def copies(self, n: int) -> int:
        return n + 1 if n > 1 else n  # the prefix-caching warm-up copy, then n samples

    def fan_out(self, req, n: int) -> list:
        self._wrap_s, self._wrap_bytes = 0.0, 0
        out = []
        for _ in range(self.copies(n)):  # independent mm_items, as 0.5.23 makes them
            c = copy.copy(req)
            c.mm_inputs = copy.copy(req.mm_inputs)
            c.mm_inputs.mm_items = [copy.copy(it) for it in req.mm_inputs.mm_items]
            out.append(c)
        return _rename(out, req.rid)

    def before_send(self, req) -> None:
        # wrap_shm_features, per copy at dispatch time
        from mmshm import config

        threshold = self.min_bytes if self.min_bytes is not None else config.get().min_bytes
        d = self._directory()
        t0 = time.perf_counter()
        for it in _items(req):
            f = it.feature
            if not isinstance(f, torch.Tensor) or f.numel() * f.element_size() < threshold:
                continue
            try:
                name = write_fresh_segment(f, d)
            except OSError:
                continue  # SGLang falls back to inline transport
            self._created.append(name)
            self._wrap_bytes += f.numel() * f.element_size()
            it.feature = FreshShmPointer(name, f.shape, f.dtype, d)
        self._wrap_s += time.perf_counter() - t0

    def producer_stats(self) -> dict:
        if not self._wrap_bytes:
            return {}
        return {"wrap_s": self._wrap_s, "wrap_bytes": self._wrap_bytes}

    def after_run(self, directory: str) -> list[str]:
        d = self._dir or fresh_dir(directory)
        left = [n for n in self._created if _unlink_quietly(os.path.join(d, n))]
        self._created = []
        return [os.path.join(os.path.basename(d), n) for n in left]

    @classmethod
    def estimate(cls, payload, copies, tp):
        # every copy's segments, the request, and a little for the ranks
        return (copies + 2) * payload, copies * payload

    # -- scheduler -------------------------------------------------------------
    def broadcast(self, data, rank, dist_group, src=0):
        import torch.distributed as dist

        out = self._bcast(data, rank, dist_group, src)  # unpickling opens the segments
        if dist.is_initialized() and dist.get_world_size(dist_group) > 1:
            dist.barrier(group=dist_group)  # every rank has opened them: unlink is safe
        failed = torch.zeros(len(out), dtype=torch.int32)
        errors: dict[int, str] = {}
        for i, req in enumerate(out):
            pending = [it for it in _items(req) if isinstance(it.feature, FreshShmPointer)]
            try:
                for it in pending:
                    it.feature = it.feature.materialize()
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
                failed[i] = 1
                errors[i] = f"{type(exc).__name__}: {exc}"
                for it in pending:
                    if isinstance(it.feature, FreshShmPointer):
                        it.feature.close_and_unlink()
        if dist.is_initialized() and dist.get_world_size(dist_group) > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=dist_group)
        for i in torch.nonzero(failed).reshape(-1).tolist():
            why = errors.get(i, "failed on another rank")
            out[i] = mmshm.MaterializeError(f"fresh-segment: request {i}: {why}",
                                            request=out[i])
        return out

    def instrument_broadcast(self, inner):
        self._bcast = inner(mmshm.broadcast_pyobj)


# -- sglang: SGLang's own transport code (0.5.23), when it is importable -------

SGLANG_MM = "sglang.srt.managers.mm_utils"
SGLANG_COMMON = "sglang.srt.utils.common"
# SGLang 0.5.23 names its segments sgl_shm_<kind>_<pid>_<rand> (make_shm_name);
# older releases let SharedMemory pick psm_<rand>.
SGLANG_SHM_DIR = "/dev/shm"
#: SGLang's run-time imports a CPU-only host lacks: its server environments
#: (``.venvs/sglang-<release>-server``, ``python -m tests.run sglang``) have
#: CPU stand-ins for them installed.
SGLANG_NEEDS = ("triton", "torchvision")


_SGLANG: dict = {}


def import_failure(load, server: str, package: str, venv: str) -> str | None:
    """None if ``load()`` succeeds, else the note a mode that runs
    ``server``'s own code is skipped with (naming a Python that has it)."""
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - any failure to import means "skip"
        return (f"{server}'s transport code is not importable in this interpreter "
                f"({type(exc).__name__}: {exc}); run the bench with a Python that has "
                f"{package}, e.g. {venv}/bin/python (tests/integrations/ builds it)")
    return None


def load_sglang():
    """``(mm_utils, utils.common)`` of the SGLang in this interpreter, with its
    shared-memory transport switched on (transport mode not ``default``, a
    tokenizer present). Raises ImportError when SGLang cannot be imported."""
    if "mm" not in _SGLANG:
        import importlib
        import importlib.util
        import types

        if importlib.util.find_spec("sglang") is None:
            raise ImportError("sglang is not installed in this interpreter")
        missing = [m for m in SGLANG_NEEDS if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(f"SGLang needs {' and '.join(missing)}, not installed in this "
                              f"interpreter (a server environment such as "
                              f".venvs/sglang-0.5.23-server has CPU stand-ins for them)")
        if importlib.util.find_spec("cpu_stubs") is not None:
            import cpu_stubs  # those stand-ins' helper, installed beside them

            cpu_stubs.use()  # torch must not take the triton stand-in for triton
        mm = importlib.import_module(SGLANG_MM)
        common = importlib.import_module(SGLANG_COMMON)
        for sym in ("ShmPointerMMData", "_wrap_tensor_or_list", "_unwrap_tensor_or_list",
                    "_discard_tensor_or_list", "_feature_has_shm"):
            if not hasattr(mm, sym):
                raise ImportError(f"{SGLANG_MM}.{sym} not found (SGLang release "
                                  f"without 0.5.23's transport code)")
        mm._is_default_tensor_transport = False
        args = types.SimpleNamespace(skip_tokenizer_init=False)
        for name in ("get_global_server_args", "get_serving"):
            if hasattr(mm, name):
                setattr(mm, name, lambda: args)
        _SGLANG["mm"], _SGLANG["common"] = mm, common
    return _SGLANG["mm"], _SGLANG["common"]


@register
class SglangMode(FreshSegmentMode):
    """SGLang's own transport code (written for 0.5.23), run when
    ``sglang.srt.managers.mm_utils`` is importable; skipped otherwise.

    Producer: 0.5.23's fan-out (the warm-up copy plus ``n`` samples when
    ``n > 1``, independent ``mm_items``), then, per copy at dispatch,
    ``wrap_shm_features``' body: every CPU tensor becomes a
    ``ShmPointerMMData`` (a fresh ``sgl_shm_mm_*`` segment, fallocated and
    filled), pickled through ZMQ. Rank 0's unpickling opens the segments;
    SGLang's own ``broadcast_pyobj`` carries name, shape and dtype; then, as
    ``SchedulerRequestReceiver._finalize_shm_features``: a TP barrier (every
    rank has opened them), ``materialize`` (``MAP_PRIVATE`` copy, close,
    unlink) per request, failures all-reduced. SGLang's ``unwrap_shm_features``
    only accepts its own request classes, so its per-item body
    (``_unwrap_tensor_or_list``) is called on the bench's requests."""

    name = "sglang"
    summary = "SGLang's own ShmPointerMMData wrap / broadcast_pyobj / barrier+materialize"

    def __init__(self, min_bytes: int | None = None):
        super().__init__(min_bytes)
        self._inner: Callable[[Callable], Callable] | None = None
        self._bcast = None
        self._created: list[str] = []

    @classmethod
    def unavailable(cls) -> str | None:
        return import_failure(load_sglang, "SGLang", "sglang",
                              ".venvs/sglang-0.5.23-server")

    # -- producer --------------------------------------------------------------
    def before_send(self, req) -> None:
        mm, _ = load_sglang()
        t0 = time.perf_counter()
        for it in _items(req):
            f = it.feature
            if f is None:
                continue
            it.feature = mm._wrap_tensor_or_list(f, precomputed_hash=it.hash)
            for p in (it.feature if isinstance(it.feature, (list, tuple)) else [it.feature]):
                if isinstance(p, mm.ShmPointerMMData):
                    self._created.append(p.shm_name)
                    self._wrap_bytes += p.shape.numel() * p.dtype.itemsize
        self._wrap_s += time.perf_counter() - t0

    def after_run(self, directory: str) -> list[str]:
        """SGLang's segments of this producer still in /dev/shm (all are unlinked)."""
        import glob

        names = {n.lstrip("/") for n in self._created}
        self._created = []
        names |= {os.path.basename(p) for p in
                  glob.glob(os.path.join(SGLANG_SHM_DIR, f"sgl_shm_*_{os.getpid()}_*"))}
        return sorted(p for p in (os.path.join(SGLANG_SHM_DIR, n) for n in names)
                      if _unlink_quietly(p))

    # -- TP rank 0 ----------------------------------------------------------------
    def loads(self, msg):
        load_sglang()  # the stubs and module in place before unpickling opens segments
        return pickle.loads(msg)

    # -- scheduler -------------------------------------------------------------
    def instrument_broadcast(self, inner):
        self._inner = inner
        self._bcast = None

    def broadcast(self, data, rank, dist_group, src=0):
        import torch.distributed as dist

        mm, common = load_sglang()
        if self._bcast is None:
            fn = common.broadcast_pyobj
            self._bcast = self._inner(fn) if self._inner is not None else fn
        out = self._bcast(data, rank, dist_group, src)  # unpickling opens the segments
        multi = dist.is_initialized() and dist.get_world_size(dist_group) > 1

        def has_shm(req) -> bool:
            return any(mm._feature_has_shm(it.feature) for it in _items(req))

        if not any(has_shm(r) for r in out):
            return out
        if multi:
            dist.barrier(group=dist_group)  # 1. every rank has opened the segments
        failed = torch.zeros(len(out), dtype=torch.int32)
        errors: dict[int, str] = {}
        for i, req in enumerate(out):  # 2. materialize per request
            if not has_shm(req):
                continue
            try:
                for it in _items(req):
                    it.feature = mm._unwrap_tensor_or_list(it.feature)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
                for it in _items(req):
                    mm._discard_tensor_or_list(it.feature)
                failed[i] = 1
                errors[i] = f"{type(exc).__name__}: {exc}"
        if multi:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=dist_group)  # 3. agree
        for i in torch.nonzero(failed).reshape(-1).tolist():
            for it in _items(out[i]):
                mm._discard_tensor_or_list(it.feature)
            why = errors.get(i, "failed on another rank")
            out[i] = mmshm.MaterializeError(f"sglang: request {i}: {why}", request=out[i])
        return out

