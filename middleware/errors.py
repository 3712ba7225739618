"""Typed errors raised by mmshm.

Every error derives from :class:`MmshmError`. Errors about the operating system
(space, descriptors, missing files) also derive from :class:`OSError` and carry
the ``errno`` the kernel reported, so callers that already handle ``OSError``
keep working.

Every error survives pickling (a ``concurrent.futures.ProcessPoolExecutor``
worker sends its exceptions to the parent that way) with its type, message and
attributes (``errno``, ``strerror``, ``filename``, ``reason``...):
:meth:`MmshmError.__reduce__` rebuilds the object without calling the
subclass's ``__init__``, whose signature differs from ``OSError``'s.
"""

from __future__ import annotations

import errno as _errno
import pickle


def _rebuild(cls: type, args: tuple, os_args: tuple | None, state: dict) -> MmshmError:
    """Unpickle an mmshm error: ``BaseException``'s (or ``OSError``'s)
    constructor gets ``args`` (the subclass's ``__init__`` is bypassed), then
    the instance attributes come back."""
    if os_args is None:
        exc = cls.__new__(cls, *args)
        Exception.__init__(exc, *args)
    else:
        # OSError parses its arguments in __new__, or in __init__ when the
        # subclass defines its own __init__: call both, one of them does it.
        exc = cls.__new__(cls, *os_args)
        OSError.__init__(exc, *os_args)
    exc.__dict__.update(state)
    return exc


class MmshmError(Exception):
    """Base class of every mmshm error."""

    def _pickle_state(self) -> dict:
        """Instance attributes to carry across pickling (all of them)."""
        return dict(self.__dict__)

    def __reduce__(self):
        if isinstance(self, OSError):
            os_args: tuple | None = (self.errno, self.strerror)
            if self.filename is not None or self.filename2 is not None:
                os_args += (self.filename, None, self.filename2)
            if self.errno is None and self.strerror is None:
                os_args = self.args  # built with a bare message
        else:
            os_args = None
        return (_rebuild, (type(self), self.args, os_args, self._pickle_state()))


class HandleError(MmshmError, ValueError):
    """Malformed handle metadata: bad name, dtype, shape or size.

    Raised by :meth:`mmshm.ShmTensor.decode` and at attach time when the
    metadata does not match the segment it names.
    """


class SegmentError(MmshmError, OSError):
    """A segment could not be created, opened or updated."""


class ShmSpaceError(SegmentError):
    """The segment directory has no room: ``posix_fallocate`` returned ENOSPC,
    or the budget guard refused the allocation. ``errno`` is ``ENOSPC``."""

    def __init__(self, msg: str, reason: str = "enospc"):
        super().__init__(_errno.ENOSPC, msg)
        self.reason = reason


class DescriptorLimitError(SegmentError):
    """The process ran out of file descriptors (EMFILE/ENFILE)."""


class SegmentNotFoundError(SegmentError, FileNotFoundError):
    """The segment was unlinked (released by its last holder, reclaimed by the
    reaper, or removed by a third party) before it could be opened."""


class SegmentCorruptError(SegmentError):
    """The segment file exists but its header or size is wrong (truncated,
    foreign file, wrong version, or already freed)."""


class WrongNodeError(HandleError):
    """The handle names a segment on another node (another host, IPC or mount
    namespace, or segment directory)."""


class RegistrationError(MmshmError, RuntimeError):
    """CUDA refused to register an arena mapping (``cudaHostRegister``; the
    message names CUDA's error). Raised by a registrar
    (:mod:`mmshm.segments.arena`); the arena then serves that mapping
    unregistered and says so once at WARNING. ``code`` is CUDA's error number
    (0 when unknown)."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


class HandleStateError(MmshmError, RuntimeError):
    """The handle no longer owns a reference (released or materialized)."""


class PeerLostError(MmshmError, RuntimeError):
    """A rank of the TP group stopped answering mmshm's messages after a
    broadcast (the multi-node payloads, the failure agreement), or was gone
    before the group's first broadcast (it announced nothing in the
    handshake, and the broadcast then broke): it died, or its link did.
    Raised from :func:`mmshm.deferred_unwrap` on the ranks still alive, as
    soon as ``torch.distributed`` reports the broken link (a dead peer's
    closed socket: at once; a hung one: the process group's timeout), and
    before the first broadcast within the group's timeout. The group cannot
    go on, as with any broken collective: the server's own failure handling
    takes over (SGLang's scheduler exits and its launcher stops the server).
    A ``RuntimeError``, as the ``torch.distributed`` error it wraps
    (``__cause__``, when there is one).

    Attributes:
        ranks: the lost group ranks where known (found by the failure
            agreement or the handshake), else the ranks this rank was
            waiting on; or ``None``.
    """

    def __init__(self, message: str, ranks=None):
        super().__init__(message)
        self.ranks = ranks


class MaterializeError(MmshmError):
    """A request's shared-memory tensors could not be materialized on some TP
    rank. Returned (not raised) by :func:`mmshm.deferred_unwrap` in place of
    the request, identically on every rank.

    Attributes:
        request: the request object as it came out of the broadcast; its
            handles have been released.
        reason: short machine-readable reason (``not_found``, ``corrupt``,
            ``malformed``, ``wrong_node``, ``emfile``, ``other``).
        ranks: the TP ranks of this group that failed (as agreed by all ranks), or
            ``None`` when unknown.
    """

    def __init__(self, message: str, request=None, reason: str = "other", ranks=None):
        super().__init__(message)
        self.request = request
        self.reason = reason
        self.ranks = ranks

    def _pickle_state(self) -> dict:
        """``request`` travels only if it pickles: its handles were released,
        and a released handle refuses to be pickled; it arrives as ``None``
        then (the message, ``reason`` and ``ranks`` always arrive)."""
        state = dict(self.__dict__)
        try:
            pickle.dumps(self.request)
        except Exception:  # noqa: BLE001 - any unpicklable request
            state["request"] = None
        return state


class PayloadWithheldError(MmshmError, RuntimeError):
    """A request whose multimodal payload a prefill/decode (PD) decode
    instance did not send (its pixels were withheld: only hashes, pad values
    and the token layout travel, since a decode instance takes the prompt's
    KV from the prefill instance and never runs the vision encoder) reached
    a step that would need the pixels: a scheduler that is not in decode mode
    (SGLang), or an encoder step after a KV load that did not cover the
    image's placeholder tokens (vLLM). The request fails with this error
    through the server's own per-request error path and is counted in
    ``mmshm_request_failures_total{reason="withheld"}``; the encoder never
    runs on a stand-in. The fix each integration names: prefill the request
    on the prefill instance first, or start the decode instance so that it
    may recompute (mmshm then keeps the pixels)."""

    reason = "withheld"


#: ``reason`` label values of the materialize and request failure counters and
#: of :class:`MaterializeError` (:data:`mmshm.transport.broadcast.REASONS` without ``ok``).
FAILURE_REASONS = ("malformed", "not_found", "corrupt", "wrong_node", "emfile", "released",
                   "enospc", "other", "withheld")
#: ``reason`` label values of ``mmshm_inline_fallbacks_total`` (``group``: the
#: TP group cannot use shared memory at all, a rank without this mmshm or two
#: nodes with one node id; see :func:`mmshm.transport.handshake.handshake`).
FALLBACK_REASONS = ("enospc", "budget", "emfile", "other", "group")
# a reason missing from a label set is said as its more general one there
_GENERAL = {"budget": "enospc"}


def failure_reason(exc: BaseException, labels: tuple[str, ...] = FAILURE_REASONS) -> str:
    """Map an exception to a ``reason`` label of ``labels`` (default
    :data:`FAILURE_REASONS`; :data:`FALLBACK_REASONS` for an inline fallback),
    the one mapping of every path.

    The most specific reason first: the one an mmshm error carries itself (a
    :class:`ShmSpaceError`'s ``enospc`` or ``budget``, a failure that
    happened on another rank); else by type (``wrong_node``, ``malformed``,
    ``not_found``, ``corrupt``, ``released``); else by errno (``emfile`` for
    EMFILE/ENFILE, ``enospc``). A reason not in ``labels`` becomes its more
    general one there (``budget`` -> ``enospc``), else ``other``.
    """
    if isinstance(exc, MmshmError) and isinstance(getattr(exc, "reason", None), str):
        reason = exc.reason
    elif isinstance(exc, WrongNodeError):
        reason = "wrong_node"
    elif isinstance(exc, HandleError):
        reason = "malformed"
    elif isinstance(exc, SegmentNotFoundError):
        reason = "not_found"
    elif isinstance(exc, SegmentCorruptError):
        reason = "corrupt"
    elif isinstance(exc, HandleStateError):
        reason = "released"
    elif isinstance(exc, OSError) and exc.errno in (_errno.EMFILE, _errno.ENFILE):
        reason = "emfile"
    elif isinstance(exc, OSError) and exc.errno == _errno.ENOSPC:
        reason = "enospc"
    else:
        reason = "other"
    while reason not in labels and reason != "other":
        reason = _GENERAL.get(reason, "other")
    return reason
