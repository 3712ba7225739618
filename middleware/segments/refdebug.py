"""Reference debugging: ``MMSHM_DEBUG_REFS=1``.

Misused references are hard to trace: a forgotten ``share(1)`` before a second
send surfaces as ``SegmentNotFoundError`` on some later message, in another
process; ``share(1)`` followed by ``hand_over()`` leaks one reference
silently. With ``MMSHM_DEBUG_REFS=1`` each process:

* records where every reference it owns was taken (a handle created,
  unpickled or cloned; a zero-copy view) and where it was given back;
* logs an error, with both stacks, when ``hand_over()`` follows ``share(k)``
  on a handle pickled fewer than ``k + 1`` times since: a reference that no
  receiver can own (it is reported again at exit);
* names, in the message of a ``HandleStateError``, the call that gave the
  handle's reference back; and in the message of a ``SegmentNotFoundError``,
  the call that gave back the segment's *last* reference, in whichever
  process made it: the release that frees a segment leaves a small note
  (pid, time, stack) in ``<segment directory>/.mmshm-debug/`` (notes older than
  10 minutes are pruned);
* reports at exit the references it still holds (:func:`held`, with the
  stacks where they were taken) and the leaks found, as one warning on the
  ``mmshm`` logger.

Off (the default), nothing of this module is installed: ``ShmTensor`` runs its
own methods, with no check of the setting on any path
(``benchmarks/test_micro.py::test_share_release`` compares). :func:`install`
wraps the methods; :mod:`mmshm.segments.shmtensor` calls it at import when the setting
is on.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import traceback
import weakref

import msgspec

from mmshm.errors import HandleStateError, SegmentNotFoundError
from mmshm.segments import segfile, segment

log = logging.getLogger("mmshm")

NOTES_DIR = ".mmshm-debug"
_NOTE_TTL_S = 600.0
_STACK_LIMIT = 24


class HeldRef(msgspec.Struct):
    """A reference this process still holds.

    Attributes:
        name: segment name.
        gen: segment generation.
        kind: ``handle`` (a handle object owns it) or ``view`` (a zero-copy
            tensor holds it).
        taken_at: the stack (innermost call last) where it was taken.
    """

    name: str
    gen: int
    kind: str
    taken_at: str


class _Rec:
    __slots__ = ("given_back", "pickles", "shared", "taken")

    def __init__(self, taken: str):
        self.taken = taken
        self.shared: list[tuple[int, str]] = []  # (k, stack) of share() calls
        self.pickles = 0
        self.given_back: str | None = None


_lock = threading.Lock()
_handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_views: dict[tuple[str, int], list[HeldRef]] = {}
_leaks: list[str] = []
_installed: dict[str, object] = {}
#: mmshm.segments.shmtensor, which hands itself over when it loads (:func:`attach`):
#: this module wraps it and never imports it
_target = None
_pending = False  # install() came before ShmTensor was loaded: installed when it is
_reported_pid = 0
_notes_written = 0


def _stack(skip: int = 2) -> str:
    frames = traceback.extract_stack(limit=_STACK_LIMIT + skip)[:-skip]
    return "".join(traceback.format_list(frames)).rstrip()


def held() -> list[HeldRef]:
    """The references this process holds now, with where each was taken."""
    out = []
    with _lock:
        for h, rec in list(_handles.items()):
            if h.owns_reference:
                m = h.meta
                out.append(HeldRef(m.name, m.gen, "handle", rec.taken))
        for refs in _views.values():
            out.extend(refs)
    return out


def leaks() -> list[str]:
    """Descriptions of the references found leaked (``hand_over()`` after
    ``share()``), in this process, so far."""
    with _lock:
        return list(_leaks)


def report() -> str:
    """What :func:`held` and :func:`leaks` return, as text."""
    parts = []
    refs = held()
    for r in refs:
        parts.append(f"- {r.kind} reference to {r.name} (generation {r.gen}), taken at:\n"
                     f"{r.taken_at}")
    for leak in leaks():
        parts.append(f"- leaked: {leak}")
    if not parts:
        return ""
    return (f"mmshm (MMSHM_DEBUG_REFS, pid {os.getpid()}): {len(refs)} reference(s) never "
            f"given back, {len(leaks())} leak(s):\n" + "\n".join(parts))


def _report_at_exit() -> None:
    global _reported_pid
    if _reported_pid == os.getpid():
        return
    _reported_pid = os.getpid()
    text = report()
    if text:
        log.warning("%s", text)


def _note_path(path: str) -> str:
    return os.path.join(os.path.dirname(path), NOTES_DIR, os.path.basename(path))


def _write_note(path: str, gen: int | None, stack: str) -> None:
    """The last reference of ``path`` was given back here: leave a note."""
    global _notes_written
    note = _note_path(path)
    try:
        os.makedirs(os.path.dirname(note), mode=0o700, exist_ok=True)
        with open(note, "w") as f:
            f.write(f"pid {os.getpid()} at {time.strftime('%H:%M:%S')}"
                    f"{'' if gen is None else f' (generation {gen})'}:\n{stack}\n")
        _notes_written += 1
        if _notes_written % 64 == 0:
            cutoff = time.time() - _NOTE_TTL_S
            with os.scandir(os.path.dirname(note)) as it:
                for e in it:
                    if e.stat().st_mtime < cutoff:
                        os.unlink(e.path)
    except OSError as exc:
        log.debug("mmshm: cannot write a reference note: %s", exc)


def _explain_gone(h, exc: SegmentNotFoundError) -> None:
    """Append to ``exc`` the call that gave back the segment's last reference."""
    if h.error is not None or getattr(exc, "_mmshm_explained", False):
        return
    meta = h.meta
    path = os.path.join(segfile.segment_dir(h.directory), meta.name)
    try:
        with open(_note_path(path)) as f:
            where = f.read().rstrip()
        msg = f" (MMSHM_DEBUG_REFS: its last reference was given back by {where})"
    except OSError:
        msg = (" (MMSHM_DEBUG_REFS: no process that gave back its last reference left a note; "
               "run every process with MMSHM_DEBUG_REFS=1)")
    exc.strerror = f"{exc.strerror}{msg}"
    exc._mmshm_explained = True


def _explaining(method):
    """``method`` with :func:`_explain_gone` applied to what it raises."""
    @functools.wraps(method)
    def call(self, *args):
        try:
            return method(self, *args)
        except SegmentNotFoundError as exc:
            _explain_gone(self, exc)
            raise
    return call


def _wrap(obj, attr: str, make) -> None:
    orig = vars(obj)[attr]  # the raw attribute (a classmethod stays one)
    _installed[f"{id(obj)}.{attr}"] = (obj, attr, orig)
    setattr(obj, attr, make(orig))


def attach(module, on: bool) -> None:
    """Called by :mod:`mmshm.segments.shmtensor` at its import, with itself:
    the module :func:`install` wraps; ``on`` (``MMSHM_DEBUG_REFS``) installs
    now, as does an :func:`install` made before the module was loaded."""
    global _target
    _target = module
    if on or _pending:
        install()


def install() -> None:
    """Wrap ``ShmTensor``'s reference operations to record and check them
    (idempotent). :func:`uninstall` restores them. Before
    :mod:`mmshm.segments.shmtensor` is loaded, they are wrapped when it is."""
    global _pending
    if _installed:
        return
    if _target is None:
        _pending = True
        return
    _pending = False
    shmtensor = _target
    cls = shmtensor.ShmTensor

    def track(h, taken: str) -> None:
        with _lock:
            _handles[h] = _Rec(taken)

    def rec_of(h) -> _Rec | None:
        with _lock:
            return _handles.get(h)

    def give_back(h, how: str) -> None:
        rec = rec_of(h)
        if rec is not None and rec.given_back is None:
            rec.given_back = f"{how} at:\n{_stack(3)}"

    def wrap_from_writer(orig):
        @functools.wraps(orig)
        def from_writer(*args, **kwargs):
            h = orig(*args, **kwargs)
            track(h, _stack())
            return h
        return classmethod(from_writer)

    _wrap(cls, "from_writer", lambda orig: wrap_from_writer(orig.__func__))

    def wrap_adopt(orig):
        @functools.wraps(orig)
        def _adopt(c, meta, directory):
            h = orig(c, meta, directory)
            track(h, _stack())
            return h
        return _adopt

    _wrap(shmtensor, "_adopt", wrap_adopt)

    def wrap_require(orig):
        @functools.wraps(orig)
        def _require_owned(self):
            try:
                return orig(self)
            except HandleStateError as exc:
                rec = rec_of(self)
                if rec is not None and rec.given_back:
                    raise HandleStateError(f"{exc} (MMSHM_DEBUG_REFS: given back by "
                                           f"{rec.given_back})") from None
                raise
        return _require_owned

    _wrap(cls, "_require_owned", wrap_require)

    def wrap_share(orig):
        orig = _explaining(orig)

        @functools.wraps(orig)
        def share(self, k):
            orig(self, k)
            rec = rec_of(self)
            if rec is not None and k:
                rec.shared.append((k, _stack()))
        return share

    _wrap(cls, "share", wrap_share)

    def wrap_reduce(orig):
        @functools.wraps(orig)
        def __reduce__(self):
            out = orig(self)
            rec = rec_of(self)
            if rec is not None:
                rec.pickles += 1
            return out
        return __reduce__

    _wrap(cls, "__reduce__", wrap_reduce)

    def wrap_hand_over(orig):
        @functools.wraps(orig)
        def hand_over(self):
            orig(self)
            rec = rec_of(self)
            give_back(self, "hand_over()")
            if rec is None:
                return
            shared = sum(k for k, _ in rec.shared)
            extra = shared + 1 - rec.pickles
            if shared and extra > 0:
                where = "\n".join(f"share({k}) at:\n{s}" for k, s in rec.shared)
                leak = (f"{extra} reference(s) to {self.name} leak: hand_over() gives this "
                        f"handle's reference to the copy just pickled, but share() already "
                        f"handed out {shared} for {rec.pickles} pickled copies; use one or the "
                        f"other.\n{where}\nhand_over() at:\n{_stack()}")
                with _lock:
                    _leaks.append(leak)
                log.error("mmshm (MMSHM_DEBUG_REFS): %s", leak)
        return hand_over

    _wrap(cls, "hand_over", wrap_hand_over)

    def wrap_release(orig):
        @functools.wraps(orig)
        def release(self):
            if self.owns_reference:
                give_back(self, "release()")
            orig(self)
        return release

    _wrap(cls, "release", wrap_release)

    def wrap_disown(orig):
        @functools.wraps(orig)
        def disown(self):
            give_back(self, "moved to another holder (disown())")
            orig(self)
        return disown

    _wrap(cls, "disown", wrap_disown)

    def wrap_materialize(orig):
        orig = _explaining(orig)

        @functools.wraps(orig)
        def materialize(self, copy=False):
            out = orig(self, copy)
            m = self.meta
            if copy or m.nbytes == 0:
                give_back(self, f"materialize(copy={copy})")
            else:
                give_back(self, "materialize() (moved to the view)")
                with _lock:
                    _views.setdefault((m.name, m.gen), []).append(
                        HeldRef(m.name, m.gen, "view", _stack()))
            return out
        return materialize

    _wrap(cls, "materialize", wrap_materialize)

    def wrap_release_view(orig):
        @functools.wraps(orig)
        def _release_view(name, gen, seg):
            with _lock:
                refs = _views.get((name, gen))
                if refs:
                    refs.pop()
                    if not refs:
                        del _views[(name, gen)]
            orig(name, gen, seg)
        return _release_view

    _wrap(shmtensor, "_release_view", wrap_release_view)

    def wrap_update(orig):
        @functools.wraps(orig)
        def update_count(fd, path, delta, gen=None, owner_here=False):
            new = orig(fd, path, delta, gen, owner_here)
            if delta < 0 and new == 0:
                _write_note(path, gen, _stack())
            return new
        return update_count

    _wrap(segfile, "update_count", wrap_update)
    segment.exit_reporters.append(_report_at_exit)


def uninstall() -> None:
    """Undo :func:`install` and forget what was recorded."""
    global _pending
    _pending = False
    for obj, attr, orig in _installed.values():
        setattr(obj, attr, orig)
    _installed.clear()
    if _report_at_exit in segment.exit_reporters:
        segment.exit_reporters.remove(_report_at_exit)
    with _lock:
        _handles.clear()
        _views.clear()
        _leaks.clear()


def installed() -> bool:
    """Whether reference debugging is on in this process."""
    return bool(_installed) or _pending

