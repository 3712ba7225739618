"""What multimodal IPC costs, hop by hop, in a live server: the bytes each
hop serializes and the seconds it spends, for the server's own transport and
for mmshm's.

Two modes use it (``MMSHM_MODE``, :mod:`mmshm.config`):

- **observe** (``mmshm run --observe``): the instrumentors patch the same
  boundaries as in shm mode, but each wrapper only times the server's own
  function and calls it with the same arguments; no segment is made and no
  byte of any message changes. Series carry ``transport="server"``.
- **shm** (the default): the same hops are timed around mmshm's transport,
  ``transport="mmshm"``, so one dashboard compares the two.

A hop is one message crossing one boundary: ``with hop("sglang",
"tokenizer_send") as t: ...`` times the block (``time.perf_counter``,
seconds) and ``t.add(n)`` (or :func:`add_bytes` from code deeper in the
call, through a context variable) counts the bytes serialized for it. On
exit one observation goes to ``mmshm_ipc_seconds{server,hop,transport}`` and
``mmshm_ipc_bytes{server,hop,transport}``, unless the block raised (the
server's exception goes on unchanged) or it was marked :attr:`Tally.skip`
(a message without multimodal tensors, an empty broadcast).

Byte taps for what a server calls but does not own, installed per process by
:func:`install_taps` (wrapt, restored by :func:`remove_taps`):

- ``zmq.Socket.send_pyobj`` / ``recv_pyobj`` (pyzmq's own two lines, the
  same ``pickle.dumps(obj, protocol)`` and ``send``, so the bytes are
  identical) time and count a message only while :func:`zmq_hop` names the
  hop: SGLang's tokenizer-to-scheduler send and the scheduler's receive;
- ``zmq.Socket.recv_multipart`` adds the bytes of the frames after the
  first to the open hop that asked for them (:attr:`Tally.count_frames`);
- ``torch.distributed.broadcast`` adds each tensor's bytes to the open hop
  that asked for it (:attr:`Tally.count_broadcasts`): what SGLang's
  ``broadcast_pyobj`` sends, its size tensor included.

A hop whose two ends are in two processes (vLLM's frontend -> EngineCore
``zmq_transfer``) is timed by a stamp beside the message: the sender's
``time.monotonic_ns()`` and the message's key, one datagram to an abstract
unix socket the receiver binds (:func:`send_stamp`, :class:`StampReceiver`;
nothing in the message changes, no file is made). A stamp that does not
arrive is a missing observation, never an error of the server.

Invariant: nothing here raises into the server. A failure while timing or
recording is counted in ``mmshm_observe_errors_total{server,hop}`` and the
message goes through untouched. The cost is two ``perf_counter`` calls, a
context-variable set and two histogram observations per message (about
6.5 us measured here, 0.02% of one 720p photo's send and receive: see
``benchmarks/test_micro.py``), against hops of milliseconds.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import inspect
import logging
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Iterator

from mmshm import config
from mmshm.metrics import IPC_BYTES, IPC_SECONDS, OBSERVE_ERRORS

log = logging.getLogger("mmshm")

#: ``transport`` label values.
SERVER = "server"
MMSHM = "mmshm"
TRANSPORTS = (SERVER, MMSHM)


def observing() -> bool:
    """Observe mode is on in this process (``MMSHM_MODE=observe``)."""
    return config.get().observe


def transport() -> str:
    """The ``transport`` label for this process: ``"server"`` in observe
    mode, else ``"mmshm"``."""
    return SERVER if observing() else MMSHM


class Tally:
    """One message's figures in one hop.

    Attributes:
        server, hop: the labels.
        nbytes: bytes serialized so far (int, bytes).
        t0: start (``time.perf_counter()``, seconds); :meth:`restart` moves
            it (a dequeue that waited for the message starts its clock when
            the message is there).
        skip: record nothing for this message.
        count_broadcasts: ``torch.distributed.broadcast`` calls inside the
            block add their tensors' bytes.
        count_frames: ``recv_multipart`` calls inside the block add the bytes
            of every frame after the first (vLLM's out-of-band tensor
            buffers of a ``MessageQueue`` message too big for its ring).
        clock_at_first_broadcast: a receiving rank's clock starts when its
            first counted broadcast returns (``broadcast_pyobj`` sends the
            message's size first): waiting for the source rank is not IPC.
    """

    __slots__ = ("clock_at_first_broadcast", "count_broadcasts", "count_frames", "hop",
                 "nbytes", "server", "skip", "t0")

    def __init__(self, server: str, hop: str):
        self.server, self.hop = server, hop
        self.nbytes = 0
        self.skip = False
        self.count_broadcasts = False
        self.count_frames = False
        self.clock_at_first_broadcast = False
        self.t0 = time.perf_counter()

    def add(self, nbytes: int) -> None:
        self.nbytes += nbytes

    def restart(self) -> None:
        self.t0 = time.perf_counter()


_CURRENT: contextvars.ContextVar[Tally | None] = contextvars.ContextVar("mmshm_hop",
                                                                        default=None)
_ZMQ_HOP: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "mmshm_zmq_hop", default=None)


def current() -> Tally | None:
    """The hop open in this context, or None."""
    return _CURRENT.get()


def add_bytes(nbytes: int) -> None:
    """Count ``nbytes`` for the hop open in this context (none: nothing)."""
    t = _CURRENT.get()
    if t is not None:
        t.add(nbytes)


def record(server: str, hop_name: str, seconds: float, nbytes: int) -> None:
    """One message's observation. Never raises: a failure is counted in
    ``mmshm_observe_errors_total``."""
    try:
        tr = transport()
        IPC_SECONDS.labels(server=server, hop=hop_name, transport=tr).observe(seconds)
        IPC_BYTES.labels(server=server, hop=hop_name, transport=tr).observe(nbytes)
    except Exception as exc:  # noqa: BLE001 - timing never breaks a server
        error(server, hop_name, exc)


def error(server: str, hop_name: str, exc: BaseException | None = None) -> None:
    """Count a failed timing (``mmshm_observe_errors_total``). Never raises."""
    try:
        OBSERVE_ERRORS.labels(server=server, hop=hop_name).inc()
        log.debug("mmshm: timing of %s %s failed: %r", server, hop_name, exc)
    except Exception:  # noqa: BLE001
        pass


@contextlib.contextmanager
def hop(server: str, hop_name: str, join: bool = False) -> Iterator[Tally]:
    """Time the block as one message of ``hop_name``; yields its
    :class:`Tally`. An exception from the block goes on unchanged and
    records nothing. With ``join``, inside an open hop of the same server
    and name the block yields that hop's tally and records nothing of its
    own (a function timed alone on one release and inside a wider hop on
    another: SGLang's ``unwrap_shm_features``)."""
    outer = _CURRENT.get() if join else None
    if outer is not None and outer.server == server and outer.hop == hop_name:
        yield outer
        return
    tally = Tally(server, hop_name)
    token = _CURRENT.set(tally)
    ok = False
    try:
        yield tally
        ok = True
    finally:
        seconds = time.perf_counter() - tally.t0
        try:
            _CURRENT.reset(token)
        except ValueError:  # reset in another context (a generator moved): harmless
            pass
        if ok and not tally.skip:
            record(server, hop_name, seconds, tally.nbytes)


@contextlib.contextmanager
def zmq_hop(server: str, hop_name: str) -> Iterator[None]:
    """Inside the block, each ``send_pyobj``/``recv_pyobj`` of a pyzmq socket
    is one message of ``hop_name`` (see :func:`install_taps`)."""
    token = _ZMQ_HOP.set((server, hop_name))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            _ZMQ_HOP.reset(token)


def passthrough(wrapped, instance, args, kwargs):
    """A wrapt wrapper that only calls the wrapped function: the inner
    wrapper of a timed hop in observe mode, where the server's own code runs."""
    return wrapped(*args, **kwargs)


def within(context):
    """A wrapt wrapper that runs the wrapped function inside the context
    manager ``context(instance, args, kwargs)`` (a send's references, a
    fan-out scope); a coroutine function's await included, in its own
    task's context."""

    def wrapper(wrapped, instance, args, kwargs):
        if inspect.iscoroutinefunction(wrapped):
            return _within_async(context, wrapped, instance, args, kwargs)
        with context(instance, args, kwargs):
            return wrapped(*args, **kwargs)

    return wrapper


async def _within_async(context, wrapped, instance, args, kwargs):
    with context(instance, args, kwargs):  # this task's context only
        return await wrapped(*args, **kwargs)

def timed(server: str, hop_name, *, zmq: bool = False, join: bool = False, when=None,
          setup=None, nbytes=None, skip=None, **attrs):
    """The hop timer: ``timed(server, hop)(inner)`` is a wrapt wrapper that
    runs ``inner`` (a wrapt wrapper: mmshm's glue, or :func:`passthrough`
    where the server's own code runs) as one message of the hop, in both
    modes. What a hop needs beyond the clock is declared, never hand-rolled:

    Args:
        server: the ``server`` label ("sglang", "vllm").
        hop_name: the ``hop`` label, or ``f(args, kwargs) -> str``.
        zmq: the block names the hop for the pyzmq taps (:func:`zmq_hop`:
            each ``send_pyobj``/``recv_pyobj`` in it is one message); a
            coroutine function is timed in its own task's context.
        join: see :func:`hop` (a function timed alone, or inside a wider hop).
        when: ``f(instance, args, kwargs) -> bool``; False: not a message of
            this hop, ``inner`` runs untimed.
        setup: ``f(tally, args, kwargs)`` before the call (bytes known from
            the arguments, a clock that starts later).
        nbytes: ``f(out, args, kwargs) -> int`` bytes counted after the call.
        skip: ``f(out, tally) -> bool`` after the call: record nothing (no
            multimodal tensor, an empty broadcast).
        attrs: :class:`Tally` flags set on entry (``count_frames=True``...).

    A failure of ``setup``, ``nbytes`` or ``skip`` is counted in
    ``mmshm_observe_errors_total`` (the message then records nothing, or for
    ``setup`` goes on timed); the server's exceptions go on unchanged."""

    def factory(inner=passthrough):
        def wrapper(wrapped, instance, args, kwargs):
            if when is not None and not when(instance, args, kwargs):
                return inner(wrapped, instance, args, kwargs)
            if zmq:
                if inspect.iscoroutinefunction(wrapped):
                    return _zmq_async(server, hop_name, inner, wrapped, instance, args, kwargs)
                with zmq_hop(server, hop_name):
                    return inner(wrapped, instance, args, kwargs)
            name = hop_name(args, kwargs) if callable(hop_name) else hop_name
            with hop(server, name, join=join) as t:
                for k, v in attrs.items():
                    setattr(t, k, v)
                if setup is not None:
                    try:
                        setup(t, args, kwargs)
                    except Exception as exc:  # noqa: BLE001 - timing never breaks a server
                        error(server, name, exc)
                out = inner(wrapped, instance, args, kwargs)
                try:
                    if nbytes is not None:
                        t.add(nbytes(out, args, kwargs))
                    if skip is not None:
                        t.skip = skip(out, t)
                except Exception as exc:  # noqa: BLE001
                    t.skip = True
                    error(server, name, exc)
                return out

        return wrapper

    return factory


async def _zmq_async(server, hop_name, inner, wrapped, instance, args, kwargs):
    with zmq_hop(server, hop_name):  # this task's context only
        out = inner(wrapped, instance, args, kwargs)
        return await out if inspect.isawaitable(out) else out


def tensor_bytes(t) -> int:
    """Bytes of a tensor's elements (``numel * element_size``); 0 for
    anything else."""
    try:
        return int(t.numel()) * int(t.element_size())
    except Exception:  # noqa: BLE001 - not a tensor
        return 0


def shape_bytes(x) -> int:
    """Bytes a tensor's stand-in (a ``shape`` of ints and a ``torch.dtype``:
    SGLang's shm pointer) stands for, without reading any data; 0 for
    anything else."""
    import torch

    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or not isinstance(dtype, torch.dtype):
        return 0
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize

# -- taps: pyzmq and torch.distributed ------------------------------------------------
def _send_pyobj(wrapped, instance, args, kwargs):
    label = _ZMQ_HOP.get()
    if label is None:
        return wrapped(*args, **kwargs)
    obj, flags, protocol, rest = _send_args(*args, **kwargs)
    with hop(*label) as t:
        # pyzmq's send_pyobj, the same two calls: the same bytes on the wire
        msg = pickle.dumps(obj, protocol)
        t.add(len(msg))
        return instance.send(msg, flags=flags, **rest)


def _send_args(obj, flags=0, protocol=pickle.DEFAULT_PROTOCOL, **rest):
    return obj, flags, protocol, rest


def _recv_pyobj(wrapped, instance, args, kwargs):
    label = _ZMQ_HOP.get()
    if label is None:
        return wrapped(*args, **kwargs)
    flags = args[0] if args else kwargs.get("flags", 0)
    t0 = time.perf_counter()
    msg = instance.recv(flags)  # zmq.Again (nothing queued) goes on: not a message
    if not isinstance(msg, (bytes, bytearray, memoryview)):  # an asyncio socket's future
        return instance._deserialize(msg, pickle.loads)
    obj = instance._deserialize(msg, pickle.loads)
    record(label[0], label[1], time.perf_counter() - t0, len(msg))
    return obj


def _recv_multipart(wrapped, instance, args, kwargs):
    frames = wrapped(*args, **kwargs)
    t = _CURRENT.get()
    if t is not None and t.count_frames and isinstance(frames, list):
        try:
            t.add(sum(memoryview(f).nbytes for f in frames[1:]))
        except Exception as exc:  # noqa: BLE001
            error(t.server, t.hop, exc)
    return frames


def _dist_broadcast(wrapped, instance, args, kwargs):
    t = _CURRENT.get()
    if t is None or not t.count_broadcasts:
        return wrapped(*args, **kwargs)
    t.add(tensor_bytes(args[0] if args else kwargs.get("tensor")))
    out = wrapped(*args, **kwargs)
    if t.clock_at_first_broadcast:
        t.clock_at_first_broadcast = False
        t.restart()
    return out


_TAPS = (("zmq.sugar.socket", "Socket.send_pyobj", _send_pyobj),
         ("zmq.sugar.socket", "Socket.recv_pyobj", _recv_pyobj),
         ("zmq.sugar.socket", "Socket.recv_multipart", _recv_multipart),
         ("torch.distributed", "broadcast", _dist_broadcast))
_tapped: dict[tuple[str, str], tuple] = {}
_tap_lock = threading.Lock()


def install_taps(which: tuple[str, ...] = ("zmq", "torch")) -> list[str]:
    """Install the byte taps (idempotent). Returns the ones that could not
    be installed, as ``"module:path (reason)"`` (the caller says so at
    WARNING: those hops go untimed); never raises."""
    import importlib

    import wrapt

    failed = []
    with _tap_lock:
        for module, path, tap in _TAPS:
            if module.split(".")[0] not in which or (module, path) in _tapped:
                continue
            try:
                mod = importlib.import_module(module)
                parent, attr, original = wrapt.resolve_path(mod, path)
                wrapper = wrapt.FunctionWrapper(original, tap)
                had = attr in vars(parent)
                setattr(parent, attr, wrapper)
                _tapped[(module, path)] = (parent, attr, original, had, wrapper)
            except Exception as exc:  # noqa: BLE001 - a moved symbol: said by the caller
                failed.append(f"{module}:{path} ({exc})")
    return failed


def remove_taps() -> None:
    """Put back what :func:`install_taps` replaced (a name re-patched since
    is left as it is)."""
    with _tap_lock:
        for (parent, attr, original, had, wrapper) in reversed(list(_tapped.values())):
            if vars(parent).get(attr) is not wrapper:
                continue
            if had:
                setattr(parent, attr, original)
            else:
                delattr(parent, attr)
        _tapped.clear()


# -- stamps: a hop whose two ends are in two processes ---------------------------------
#: A stamp datagram: the sender's ``time.monotonic_ns()`` (int64, little
#: endian), then the message's key (UTF-8: vLLM's request id).
_STAMP = struct.Struct("<q")
#: Keys a :class:`StampReceiver` keeps for messages not decoded yet (oldest dropped).
STAMPS_KEPT = 4096
#: A stamp older than this (seconds) is no observation: another clock (a
#: time namespace) or a message that waited for a stopped reader.
STAMP_MAX_S = 3600.0


def stamp_address(*parts: str) -> bytes:
    """The abstract unix socket (Linux; ``\\0mmshm-stamps-<uid>-<24 hex>``)
    of one stamp channel: a hash of ``parts`` (for vLLM the EngineCore's
    input endpoint and identity), so that the sender and the receiver name
    it alike without telling each other. Abstract names live in the network
    namespace and vanish with their socket: no file is made or left."""
    h = hashlib.blake2b("\0".join(parts).encode(), digest_size=12).hexdigest()
    return f"\0mmshm-stamps-{os.getuid()}-{h}".encode()


class _StampSender:
    """One unbound, non-blocking ``AF_UNIX`` datagram socket per process."""

    def __init__(self):
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.said: set[str] = set()

    def send(self, server: str, hop_name: str, address: bytes, key: str, ns: int) -> bool:
        try:
            if self.sock is None:
                with self.lock:
                    if self.sock is None:
                        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                        s.setblocking(False)
                        self.sock = s
            self.sock.sendto(_STAMP.pack(ns) + key.encode(), address)
            return True
        except OSError as exc:  # no receiver (another node, not instrumented), queue full
            if type(exc).__name__ not in self.said:
                self.said.add(type(exc).__name__)
                if isinstance(exc, BlockingIOError):
                    why = ("the receiver's queue is full (net.unix.max_dgram_qlen stamps of "
                           "messages it has not read yet)")
                    fix = "raise the sysctl net.unix.max_dgram_qlen"
                else:
                    why = "no receiving process is listening for it"
                    fix = ("run both processes under `mmshm run` on one host and network "
                           "namespace")
                log.warning("mmshm: the %s hop %s of a message goes unobserved: its send "
                            "stamp could not reach the receiving process: %s (%s); fix: %s "
                            "(said once per reason)", server, hop_name, why, exc, fix)
            error(server, hop_name, exc)
            return False
        except Exception as exc:  # noqa: BLE001 - timing never breaks a server
            error(server, hop_name, exc)
            return False


_SENDER = _StampSender()


def send_stamp(server: str, hop_name: str, address: bytes, key: str,
               ns: int | None = None) -> bool:
    """Send ``ns`` (default: now, ``time.monotonic_ns()``, CLOCK_MONOTONIC,
    one clock for every process of a host) for message ``key`` to the
    :class:`StampReceiver` bound at ``address``. The datagram is queued at
    the receiver before this returns, so a stamp sent before its message
    is there when the message is. Never raises, never blocks: a stamp that
    cannot go (no receiver, its queue full) is a missing observation of
    ``hop_name``, counted in ``mmshm_observe_errors_total`` and said once per
    reason at WARNING. Returns whether it went."""
    return _SENDER.send(server, hop_name, address,
                        key, time.monotonic_ns() if ns is None else ns)


class StampReceiver:
    """The receiving end of stamp channels: one abstract datagram socket
    bound per address (:func:`stamp_address`), read only by the thread
    that calls :meth:`take`.

    Args:
        server, hop_name: the labels of the hop it ends.
        addresses: the channels' addresses; one that cannot be bound (in
            use: another process with the same endpoint and identity) is
            said at WARNING and left out.
    """

    def __init__(self, server: str, hop_name: str, addresses: list[bytes]):
        self.server, self.hop = server, hop_name
        self.socks: list[socket.socket] = []
        self.pending: dict[str, int] = {}
        for a in addresses:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                s.bind(a)
                s.setblocking(False)
                self.socks.append(s)
            except OSError as exc:
                s.close()
                log.warning("mmshm: the %s hop %s goes unobserved here: its stamp channel "
                            "could not be opened (%s); fix: one process per vLLM engine "
                            "identity and endpoint", server, hop_name, exc)

    def take(self, key: str) -> int | None:
        """The stamp (``time.monotonic_ns()`` at the sender) of message
        ``key``, removed; None when none came (a missing observation).
        Reads every datagram queued so far. Never raises."""
        try:
            for s in self.socks:
                while True:
                    try:
                        data = s.recv(4096)
                    except (BlockingIOError, InterruptedError):
                        break
                    if len(data) > _STAMP.size:
                        self.pending[data[_STAMP.size:].decode("utf-8", "replace")] = \
                            _STAMP.unpack_from(data)[0]
            while len(self.pending) > STAMPS_KEPT:
                del self.pending[next(iter(self.pending))]
            return self.pending.pop(key, None)
        except Exception as exc:  # noqa: BLE001 - timing never breaks a server
            error(self.server, self.hop, exc)
            return None

    def observe(self, key: str, received_ns: int, nbytes: int) -> float | None:
        """Record one observation of the hop for message ``key``: from its
        stamp to ``received_ns`` (``time.monotonic_ns()`` when it was
        received), ``nbytes`` bytes. Returns the seconds recorded, or None
        (no stamp; a negative or older-than-:data:`STAMP_MAX_S` gap, counted
        in ``mmshm_observe_errors_total``). Never raises."""
        sent = self.take(key)
        if sent is None:
            return None
        seconds = (received_ns - sent) / 1e9
        if not 0.0 <= seconds <= STAMP_MAX_S:
            error(self.server, self.hop, ValueError(f"stamp gap {seconds} s"))
            return None
        record(self.server, self.hop, seconds, nbytes)
        return seconds

    def close(self) -> None:
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()
        self.socks.clear()


class StampedHop:
    """One hop whose two ends are in two processes (vLLM's frontend ->
    EngineCore ``zmq_transfer``), timed by stamps (:func:`send_stamp`,
    :class:`StampReceiver`) as the server's glue declares it. Sender:
    :meth:`sending` marks the block that sends one message and names its
    channel, :meth:`take` (once per message) tells the encoder where its
    stamp goes, :meth:`stamp` sends it when the bytes go. Receiver:
    :meth:`receiving` holds a thread's channels open for the block (the
    thread's life), :meth:`arrived` ends the hop of each message it reads.
    Never raises into the server: a failure is counted in
    ``mmshm_observe_errors_total`` and the message goes on, unobserved."""

    def __init__(self, server: str, hop_name: str):
        self.server, self.hop = server, hop_name
        self._to: contextvars.ContextVar[bytes | bool] = contextvars.ContextVar(
            f"mmshm_stamp_{server}_{hop_name}", default=False)
        self._in = threading.local()

    @contextlib.contextmanager
    def sending(self, channel) -> Iterator[None]:
        """In the block one message is sent; ``channel() -> bytes | None``
        is its receiver's address (:func:`stamp_address`; None, or a
        failure: unknown, the message is timed with no stamp)."""
        try:
            to = channel() or True
        except Exception as exc:  # noqa: BLE001 - timing never breaks a request
            error(self.server, self.hop, exc)
            to = True
        token = self._to.set(to)
        try:
            yield
        finally:
            self._to.reset(token)

    def take(self) -> bytes | bool:
        """Inside :meth:`sending`, its channel (True where unknown), then
        False for the rest of the block (one encode per message; nested
        encodes are no message of their own); outside it False."""
        to = self._to.get()
        if to:
            self._to.set(False)
        return to

    def stamp(self, to: bytes | bool, key) -> None:
        """Send the stamp (now) of message ``key()`` (a str) to channel ``to``
        (from :meth:`take`; True: none is sent)."""
        if to is True or not to:
            return
        try:
            send_stamp(self.server, self.hop, to, key())
        except Exception as exc:  # noqa: BLE001
            error(self.server, self.hop, exc)

    @contextlib.contextmanager
    def receiving(self, channels) -> Iterator[None]:
        """In the block (a receiving thread's life) this thread reads the
        stamps of ``channels() -> list[bytes] | None`` (none: nothing timed;
        one that cannot be opened is a WARNING, the thread runs regardless)."""
        receiver = None
        try:
            addresses = channels()
            if addresses:
                receiver = StampReceiver(self.server, self.hop, addresses)
                self._in.receiver = receiver
        except Exception as exc:  # noqa: BLE001 - never break the receiving thread
            error(self.server, self.hop, exc)
        try:
            yield
        finally:
            if receiver is not None:
                if getattr(self._in, "receiver", None) is receiver:
                    self._in.receiver = None
                receiver.close()

    def arrived(self, received_ns: int, message) -> float | None:
        """End the hop of one message read at ``received_ns``
        (``time.monotonic_ns()``) in this thread: ``message() -> (key,
        nbytes)``, or None where it is no message of the hop (called only
        inside :meth:`receiving`). Returns the seconds recorded, or None."""
        receiver = getattr(self._in, "receiver", None)
        if receiver is None:
            return None
        try:
            found = message()
            return None if found is None else receiver.observe(found[0], received_ns, found[1])
        except Exception as exc:  # noqa: BLE001
            error(self.server, self.hop, exc)
            return None


def frames_bytes(frames) -> int:
    """Bytes of a message's frames: one buffer, or a sequence of buffers
    (a ``zmq.Frame`` without the buffer protocol: its ``len``)."""
    if isinstance(frames, (bytes, bytearray, memoryview)):
        return memoryview(frames).nbytes
    total = 0
    for f in frames:
        try:
            total += memoryview(f).nbytes
        except TypeError:  # a zmq.Frame without the buffer protocol
            total += len(f)
    return total


def endpoint_key(endpoint: str) -> str:
    """A zmq endpoint as both of its ends name it: ``tcp://`` by its port
    alone (``tcp:<port>``: bound on 0.0.0.0 at one end, connected to an
    address at the other), anything else (``ipc://<path>``) as it is."""
    scheme, sep, rest = endpoint.partition("://")
    return "tcp:" + rest.rsplit(":", 1)[1] if sep and scheme == "tcp" and ":" in rest \
        else endpoint


def adds(server: str, nbytes):
    """A wrapper factory (as :func:`timed`'s): inside an open hop, each call
    of the wrapped function adds ``nbytes(out, args, kwargs)`` bytes to it
    (a failure counted, the call's result goes on); outside one, nothing."""

    def factory(inner=passthrough):
        def wrapper(wrapped, instance, args, kwargs):
            t = _CURRENT.get()
            if t is None:
                return inner(wrapped, instance, args, kwargs)
            out = inner(wrapped, instance, args, kwargs)
            try:
                t.add(nbytes(out, args, kwargs))
            except Exception as exc:  # noqa: BLE001 - timing never breaks a message
                error(server, t.hop, exc)
            return out

        return wrapper

    return factory


__all__ = [
    "MMSHM",
    "SERVER",
    "STAMPS_KEPT",
    "STAMP_MAX_S",
    "TRANSPORTS",
    "Tally",
    "StampedHop",
    "add_bytes",
    "adds",
    "current",
    "endpoint_key",
    "error",
    "frames_bytes",
    "hop",
    "install_taps",
    "observing",
    "passthrough",
    "record",
    "remove_taps",
    "send_stamp",
    "shape_bytes",
    "stamp_address",
    "StampReceiver",
    "tensor_bytes",
    "timed",
    "transport",
    "within",
    "zmq_hop",
]
