"""The failure agreement of a group on one node, through shared memory.

:mod:`mmshm.transport.agreement` combines every rank's ``int32`` vector by element-wise
MAX, point to point over gloo to the broadcast's source rank and back: a
round trip that costs 1-3 ms on a loaded host (a gloo send, receive and wait
on each side). When every rank of the group is on one node
(:attr:`mmshm.transport.topology.Layout.single`, gathered once per group, so identical on
every rank) the same star runs through one small file per group instead,
mapped by every rank:

- each rank has a *slot* (a sequence word, a length word, then the vector);
  a receiver writes its vector, then the round number into its sequence
  word, and wakes the source (``FUTEX_WAKE``);
- the source waits for every other rank's slot of this round, takes the MAX,
  sets the lost flags, writes the result the same way into the *result*
  slot and wakes every receiver;
- a waiter spins :data:`SPIN_S` (the peer is often a few microseconds away),
  then sleeps in ``FUTEX_WAIT`` on the word it waits for, in slices of at
  most :data:`SLICE_S`, testing between slices whether the peer it waits for
  is alive, and gives up at the group's own timeout
  (:func:`mmshm.transport.handshake.group_timeout`), as gloo would. A sleeping waiter burns
  no core (servers share theirs).

The decision is the same on every rank: the layout (one node), the machine
(x86-64: see the memory ordering below), the group's timeout being known,
the setup's outcome (below), and the vector's size (at most
:data:`CAPACITY` elements); otherwise the gloo agreement runs, as before.
Rounds are counted per group on every rank (every rank makes every
agreement, :mod:`mmshm.transport.agreement`'s invariant).

**Setting it up: one gloo agreement.** A group's first agreement of a
broadcast with handles (stage ``new``) goes over gloo, as before, and sets
the file up:

1. the broadcast's source makes the file before it broadcasts: unnamed
   (``O_TMPFILE``), locked and its header written, then linked into the
   segment directory as ``mmshm-<its pid>-<16 hex>``, a name every rank
   derives from the layout (the source's pid, start time and pid namespace,
   the group's name and size) (:meth:`ShmAgreement.prepare`);
2. every other rank, having received the broadcast (which orders the making
   before this), opens, checks, locks and maps it, and the gloo vector
   carries one more element, the probe (:meth:`ShmAgreement.setup_code`): 1
   from a rank that could not (it says why at WARNING: another segment
   directory than the source's although the layout calls them one node, a
   file removed or changed by a third party), 2 from a source that could not
   make it. The MAX tells every rank alike: ``on``, ``off`` (gloo for good),
   or still ``new`` (the next broadcast tries again). The source then
   unlinks the name: every rank that could open the file has it open, so
   nothing is left in the directory after that broadcast.

So ranks that disagree on what they share keep today's agreement, never an
error of their own. A setup round that fails (a peer lost) makes every rank
that sees it unlink the name; a broadcast that raises or carries no handle
after the file was made removes it (:meth:`ShmAgreement.discard`); if every
rank is killed inside the setup, the name is a segment name whose liveness
byte nobody holds, and the reaper reclaims it (``killed``) at its next pass,
as any segment of a killed process.

**Liveness, not pids.** Every rank holds, while it has the file open, an
exclusive OFD lock on its own byte (:data:`RANK_BYTE` + group rank) and a
shared one on :data:`mmshm.segments.segfile.LIVE_BYTE` (the reaper's liveness byte);
the kernel drops them when the process dies, whatever becomes of its pid. A
waiter tests the peer's byte (``F_OFD_GETLK``) between sleeps: a source whose
receiver's lock is gone marks it :data:`~mmshm.transport.agreement.LOST` (as a gloo
receive that fails: the broadcast then gives back the references handed to
it), a receiver whose source's lock is gone raises :class:`AgreementLost`
(a ``RuntimeError``, which the broadcast turns into a
:class:`~mmshm.errors.PeerLostError`, as a broken gloo link). A receiver
silent until the group's timeout is LOST too; one that the source gave up as
LOST and that answers later raises. After the result is written, the source
tests each receiver's lock once more: one that is gone is
:data:`~mmshm.transport.agreement.LATE` (the result cannot reach it), as a failed
gloo send.

**Memory ordering.** A writer stores the vector, then the length, then the
sequence word; a reader loads the sequence word, then the vector. On x86-64
(TSO) stores become visible to other cores in program order and loads are not
reordered with older loads, so a reader that sees the round number sees the
vector written before it; each store is a separate call out of the
interpreter (numpy), which no compiler reorders, and the ``FUTEX_WAKE`` that
follows is a system call. A slot is never rewritten while its reader may
still read it: a receiver writes round ``k + 1`` only after it read result
``k``, which the source writes only after it read every slot of round ``k``.
Weakly ordered machines (aarch64, POWER) may make the sequence word visible
before the vector, and Python cannot issue a fence there, so they take the
gloo agreement (:func:`usable`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import platform
import struct
import time

import blake3
import numpy as np
import torch

from mmshm.segments import segfile
from mmshm.transport import handshake

log = logging.getLogger("mmshm")

#: the header: magic, version, world, slot stride, creator pid
MAGIC = b"MMSHMAG\x01"
VERSION = 1
_HDR = struct.Struct("<8sIIII")
HEADER_SIZE = 4096
#: bytes per slot: 64 bytes of words, then the vector
STRIDE = 64 * 1024
_WORDS = 64
#: the longest vector (int32 elements) agreed through shared memory; a
#: longer one takes the gloo agreement on every rank (the size is the same
#: on every rank). Pages are touched only as far as vectors reach.
CAPACITY = (STRIDE - _WORDS) // 4
#: the OFD lock byte of group rank r is RANK_BYTE + r
RANK_BYTE = 64
#: spin this long (seconds) on the awaited word before sleeping in the kernel
SPIN_S = 50e-6
#: the longest sleep (seconds) between two liveness tests of the peer
SLICE_S = 0.005
_SEQ, _LEN = 0, 1  # word offsets in a slot
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX_X86_64 = 202


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_futex():
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    fn.argtypes = (ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32)
    return fn


_SYSCALL = _load_futex()


def usable() -> bool:
    """Whether this machine can agree through shared memory: x86-64 (its
    memory ordering; see the module docstring) with the futex system call.
    The same on every rank of one node."""
    return _SYSCALL is not None


def _futex_wait(addr: int, val: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``addr`` holds ``val``, at most
    ``timeout_s``; returns at once if it no longer does (the kernel compares
    under its own lock, so a wake after the writer's store is never lost)."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _SYSCALL(_SYS_FUTEX_X86_64, addr, _FUTEX_WAIT, val, ctypes.byref(ts), None, 0)


def _futex_wake(addr: int) -> None:
    _SYSCALL(_SYS_FUTEX_X86_64, addr, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


class AgreementLost(RuntimeError):
    """This rank cannot take part in the shared-memory agreement (its peer
    is gone, its file is gone or foreign, the group's timeout passed); the
    broadcast turns it into a :class:`~mmshm.errors.PeerLostError`."""


class ShmAgreement:
    """The shared-memory agreement of one process group on one node (see the
    module docstring). Made by :func:`for_group`; :meth:`agree` runs one
    round."""

    def __init__(self, world: int, me: int, procs, timeout_s: float, directory: str,
                 key: str):
        self.world = world
        self.me = me
        self.procs = tuple(procs)
        self.timeout_s = timeout_s
        self.directory = directory
        self.key = key  # the group's name and size, alike on every rank
        self.path = ""  # set by the setup round, from its source rank
        self.size = HEADER_SIZE + (world + 1) * STRIDE
        self.round = 0
        #: new (the next agreement with handles sets it up, over gloo), then
        #: on (through shared memory) or off (gloo for good)
        self.stage = "new"
        self.fd: int | None = None
        self._buf = None
        self._u32: np.ndarray | None = None
        self._i32: np.ndarray | None = None
        self._addr = 0
        self._named = False  # this process may still have to unlink the name

    # -- layout of the file ----------------------------------------------------------
    def _word(self, slot: int, field: int) -> int:
        return (HEADER_SIZE + slot * STRIDE) // 4 + field

    def _data(self, slot: int, n: int) -> np.ndarray:
        at = (HEADER_SIZE + slot * STRIDE) // 4 + _WORDS // 4
        return self._i32[at:at + n]

    def fits(self, n: int) -> bool:
        """Whether a vector of ``n`` elements is agreed here (else gloo)."""
        return 0 < n <= CAPACITY

    # -- attaching -------------------------------------------------------------------
    def _map(self, fd: int) -> None:
        self._buf = segfile.map_fd(fd, self.size, 0, shared=True)
        self._addr = ctypes.addressof(self._buf)
        self._u32 = np.frombuffer(self._buf, dtype=np.uint32)
        self._i32 = self._u32.view(np.int32)

    def _lock_mine(self, fd: int) -> None:
        segfile._lock(fd, fcntl.F_RDLCK, segfile.LIVE_BYTE, wait=False)
        segfile._lock(fd, fcntl.F_WRLCK, RANK_BYTE + self.me, wait=False)

    def _create(self) -> None:
        """The setup round's source: make the file unnamed, lock it, write its header,
        then link it under its name (no rank sees it half made); where
        ``O_TMPFILE`` or ``/proc`` is missing, create it under its name and
        write the magic last (the others wait for it)."""
        d = self.directory
        try:
            fd = os.open(d, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError:
            fd = None
        if fd is not None:
            try:
                self._init(fd)
                for _ in range(2):
                    try:
                        os.link(f"/proc/self/fd/{fd}", self.path)
                        break
                    except FileExistsError:
                        # left by an earlier group of this process with the
                        # same name whose first agreement never ended
                        os.unlink(self.path)
                else:
                    raise FileExistsError(errno.EEXIST, "agreement file exists", self.path)
            except FileExistsError:
                self._close(fd)
                raise
            except OSError:  # no /proc: made under its name below
                self._close(fd)
                fd = None
            except BaseException:
                self._close(fd)
                raise
        if fd is None:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | segfile.OPEN_FLAGS, 0o600)
            self._named = True
            try:
                self._init(fd)
            except BaseException:
                self._close(fd)
                raise
        self.fd = fd
        self._named = True

    def _init(self, fd: int) -> None:
        self._lock_mine(fd)
        os.ftruncate(fd, self.size)
        self._map(fd)
        raw = _HDR.pack(MAGIC, VERSION, self.world, STRIDE, os.getpid() & 0xFFFFFFFF)
        head = self._u32.view(np.uint8)
        head[8:len(raw)] = np.frombuffer(raw[8:], dtype=np.uint8)
        head[:8] = np.frombuffer(raw[:8], dtype=np.uint8)  # the magic last

    def _path_for(self, src: int) -> str:
        return os.path.join(self.directory, _name(self.key, self.procs[src]))

    def prepare(self, src: int) -> None:
        """Stage ``new``, on the broadcast's source ``src`` before the
        broadcast (its receivers open the file after it): make the file.
        Never raises: a file that cannot be made (said at WARNING) keeps the
        stage ``new`` on every rank (:meth:`setup_code`)."""
        if self.stage != "new" or self.me != src or self.fd is not None:
            return
        self.path = self._path_for(src)
        try:
            self._create()
        except OSError as exc:
            log.warning("mmshm: cannot make the shared-memory failure agreement file %s (%s); "
                        "the TP group agrees over gloo (about 1-3 ms more per broadcast) and "
                        "tries again at its next broadcast. Fix: free space in MMSHM_DIR",
                        self.path, exc)

    def discard(self) -> None:
        """The broadcast that :meth:`prepare` made the file for ended before
        its agreement (it raised, or carried no handle): remove it; the next
        broadcast tries again."""
        if self.stage == "new" and self._named:
            self._unlink_name()
            self.close()

    def setup_code(self, src: int) -> int:
        """Stage ``new``, in the agreement of the setup round (source
        ``src``): this rank's element of the probe, whose MAX over the group
        decides (:meth:`settle`). The source: 0 with the file made, 2
        without (try again). Another rank: 0 once it has opened, checked,
        locked and mapped the file (the broadcast orders its making before
        this), 1 if it cannot (said at WARNING): another segment directory
        than the source's although the layout calls them one node, a file
        removed or changed by a third party. Never raises."""
        if self.me == src:
            return 0 if self.fd is not None else 2
        self.path = self._path_for(src)
        return 0 if self.attach() else 1

    def attach(self) -> bool:
        """Open, check, lock and map the file; whether this rank has it."""
        if self.fd is not None:
            return True
        fd = None
        try:
            fd = os.open(self.path, segfile.OPEN_FLAGS)
            st = os.fstat(fd)
            raw = os.pread(fd, _HDR.size, 0)
            head = _HDR.unpack(raw) if len(raw) == _HDR.size else None
            if (st.st_size != self.size or head is None or head[0] != MAGIC
                    or head[1:4] != (VERSION, self.world, STRIDE)):
                raise OSError(errno.EINVAL, f"not this group's agreement file (size "
                                            f"{st.st_size}, header {head})")
            self._lock_mine(fd)  # EAGAIN: another process holds this rank's byte
            self._map(fd)
        except OSError as exc:
            if fd is not None:
                self._close(fd)
            log.warning("mmshm: TP rank %d cannot open the group's shared-memory failure "
                        "agreement file %s (%s): the ranks do not share one segment directory, "
                        "or a third party removed or changed the file; the TP group agrees "
                        "over gloo (about 1-3 ms more per broadcast). Fix: give every rank of "
                        "the node the same MMSHM_DIR", self.me, self.path, exc)
            return False
        self.fd = fd
        return True

    def settle(self, code: int) -> None:
        """End of the setup round, whose gloo agreement gave ``code``, the
        MAX of every rank's :meth:`setup_code` (the same on every rank): 0
        ``on``, 1 ``off`` (gloo for good), 2 still ``new``. The rank that
        made the file removes its name: every rank that could open it has."""
        if self._named:
            self._unlink_name()
        self.stage = "on" if code == 0 else "off" if code == 1 else "new"
        if code:
            self.close()

    def abort(self) -> None:
        """The setup round failed (a peer lost, a broken link): ``off``, the
        name removed by whichever rank gets here, the mapping closed."""
        self.stage = "off"
        if self.path:
            self._unlink_name()
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            self._close(self.fd)
            self.fd = None

    def _close(self, fd: int) -> None:
        self._u32 = self._i32 = None
        self._buf = None  # unmapped once nothing exported from it is left
        self._addr = 0
        os.close(fd)

    def _unlink_name(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("mmshm: could not remove the agreement file %s (%s); the reaper "
                        "reclaims it once the group's processes are gone", self.path, exc)
        self._named = False

    # -- waiting ---------------------------------------------------------------------
    def _alive(self, r: int) -> bool:
        """Whether group rank ``r`` still has the file open: its lock byte is
        held (every rank took its own at the probe)."""
        return segfile.lock_holders_present(self.fd, RANK_BYTE + r)

    def _wait(self, w: int, want: int, deadline: float, peer: int) -> bool | None:
        """Wait for word ``w`` to hold ``want``: True; False at ``deadline``;
        None when ``peer`` is found gone first."""
        u = self._u32
        if u[w] == want:
            return True
        end = time.perf_counter() + SPIN_S
        while time.perf_counter() < end:
            if u[w] == want:
                return True
        addr = self._addr + 4 * w
        check = 0.0
        while True:
            cur = int(u[w])
            if cur == want:
                return True
            now = time.monotonic()
            if now >= check:
                if not self._alive(peer):
                    return True if u[w] == want else None
                check = now + SLICE_S
            if now >= deadline:
                return False
            _futex_wait(addr, cur, min(SLICE_S, deadline - now))

    def _publish(self, slot: int, vec: np.ndarray, seq: int) -> None:
        self._data(slot, vec.size)[:] = vec  # the vector first,
        self._u32[self._word(slot, _LEN)] = vec.size
        w = self._word(slot, _SEQ)
        self._u32[w] = seq  # then its round number (see the memory ordering)
        _futex_wake(self._addr + 4 * w)

    # -- one round -------------------------------------------------------------------
    def agree(self, flat: torch.Tensor, src: int, lost_flag: int, late_flag: int
              ) -> torch.Tensor:
        """One round: the element-wise MAX of every rank's ``int32`` vector
        ``flat`` (the same length on every rank), with source rank ``src``;
        the last ``world`` elements are the lost flags, as
        :func:`mmshm.transport.agreement._agree_max` returns them. Raises
        :class:`AgreementLost` on a receiver that cannot get the result (the
        source gone, the group's timeout, the file gone or foreign), or that
        the source gave up as lost."""
        deadline = time.monotonic() + self.timeout_s
        self.round += 1
        seq = (self.round - 1) % 0xFFFFFFFF + 1
        if self.me == src:
            return self._source(flat, seq, deadline, lost_flag, late_flag)
        return self._receiver(flat, seq, deadline, src)

    def _source(self, flat, seq, deadline, lost_flag, late_flag) -> torch.Tensor:
        vec = flat.numpy()
        n = vec.size
        world = self.world
        out = vec.copy()
        lost, live = [], []
        for r in range(world):
            if r == self.me:
                continue
            got = self._wait(self._word(r, _SEQ), seq, deadline, r)
            if got and self._u32[self._word(r, _LEN)] == n:
                np.maximum(out, self._data(r, n), out=out)
                live.append(r)
            else:
                lost.append(r)  # gone, silent until the timeout, or a wrong length
        for r in lost:
            out[n - world + r] = lost_flag
        self._publish(world, out, seq)
        late = [r for r in live if not self._alive(r)]
        if late:
            out = out.copy()  # the vector published stays as it was
            for r in late:
                out[n - world + r] = late_flag
        return torch.from_numpy(out)

    def _receiver(self, flat, seq, deadline, src) -> torch.Tensor:
        vec = flat.numpy()
        n = vec.size
        self._publish(self.me, vec, seq)
        got = self._wait(self._word(self.world, _SEQ), seq, deadline, src)
        if not got:
            why = "exited" if got is None else \
                f"did not answer within the group's timeout ({self.timeout_s:g} s)"
            raise AgreementLost(f"the broadcast's source (group rank {src}) {why} during the "
                                f"shared-memory failure agreement")
        if self._u32[self._word(self.world, _LEN)] != n:
            raise AgreementLost(f"the agreement's result in {self.path} has "
                                f"{self._u32[self._word(self.world, _LEN)]} elements, not {n}")
        out = self._data(self.world, n).copy()
        if out[n - self.world + self.me]:
            raise AgreementLost(f"the broadcast's source (group rank {src}) gave group rank "
                                f"{self.me} up as lost (it answered after the group's timeout)")
        return torch.from_numpy(out)


# id(process group) -> (process group, agreement or None); the group object
# is kept so that its id cannot be reused while the entry exists
_GROUPS: dict[int, tuple[object, ShmAgreement | None]] = {}


def _name(key: str, proc) -> str:
    """The file's name for the group ``key`` made by process ``proc``
    (:func:`mmshm.transport.topology.process_id`): a segment name (the reaper's), unique
    per group and process, pid reuse notwithstanding."""
    text = f"{key}|{proc[0]}|{proc[1]}|{proc[2]}"
    return f"{segfile.PREFIX}{proc[0]}-{blake3.blake3(text.encode()).hexdigest()[:16]}"


def for_group(group, world: int, me: int, lay) -> ShmAgreement | None:
    """The shared-memory agreement of process group ``group`` (``world``
    ranks, this one ``me``) whose layout is ``lay``; None where the group
    takes the gloo agreement: not on one node, not an x86-64 machine with
    futexes, no known timeout, or no process ids in the layout. Decided from
    what every rank has alike, so every rank decides the same. Cached per
    group; opens nothing (the first :meth:`ShmAgreement.agree` does)."""
    import torch.distributed as dist

    if lay is None or not lay.single or world < 2 or not dist.is_initialized():
        return None
    pg = group if group is not None else dist.group.WORLD
    hit = _GROUPS.get(id(pg))
    if hit is not None and hit[0] is pg:
        return hit[1]
    agr = None
    timeout = handshake.group_timeout(group)
    if usable() and timeout and len(lay.procs) == world:
        key = f"{getattr(pg, 'group_name', '')}|{world}"
        agr = ShmAgreement(world, me, lay.procs, timeout, segfile.segment_dir(), key)
    _GROUPS[id(pg)] = (pg, agr)
    return agr


def forget() -> None:
    """Close every group's agreement file (after destroying process groups)."""
    for _, agr in _GROUPS.values():
        if agr is not None:
            if agr._named:
                agr._unlink_name()
            agr.close()
    _GROUPS.clear()
