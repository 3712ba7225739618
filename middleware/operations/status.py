"""``mmshm status``: what mmshm, and everything else, holds in shared memory now.

Read-only and safe beside running servers:

* **Segments** are read without taking any lock: the header (state, reference
  count, creation time) with one ``pread``, liveness with ``F_OFD_GETLK`` on
  the liveness byte (some process holds the segment) and the owner byte (its
  creating process is alive), as in :mod:`mmshm.segments.segfile`. A segment nobody
  holds is an orphan, whatever pid its name carries (pids are reused).
* **Processes** are found with psutil (pids, start times, command lines,
  parents, open files): a process that has a segment open holds it now
  (holders keep their descriptor while they hold a reference or a view), and
  ``/proc/<pid>/fdinfo`` shows whether its descriptor carries the owner lock
  (it created the segment). A pid is kept only if its start time is the same
  before and after its descriptors were read, so a pid reused during the scan
  is never reported. Processes of other users are invisible unless run as
  root: their segments count as ``unattributed`` (live by their locks, holder
  not visible). ``/proc`` is read directly only for what psutil does not
  expose: the descriptors' locks, mount namespaces, and a raw environment
  (to tell one a process title overwrote).
* **Everything else** on the same tmpfs (NCCL's ``nccl-*``, Python
  shared memory ``psm_*`` of vLLM and SGLang, SGLang's ``sgl_shm_mq_*`` and
  ``sglang_loads_*``, DeepSpeed's ``deepspeed_allreduce_buffer_*``, POSIX
  semaphores ``sem.*``, mmshm segments in other directories) is grouped by
  name pattern with its bytes: other programs' files by their apparent size
  where that is larger than what they occupy now (sparse files fill up).
  When the segment directory is not on a tmpfs only that directory is
  surveyed (never a whole disk).
* **The arena** (:mod:`mmshm.segments.arena`, docs/gpu.md): its size as
  configured in this environment (``MMSHM_ARENA_BYTES``, else the default:
  on where CUDA is available), and the arena segments in the directory (header
  flag ``FLAG_ARENA``) per producing process, idle in its warm pool or in use.
  Idle arena segments are the arena itself: held by their live producer, never
  orphans. A consumer's persistent mapping of one shows as an ``O_PATH``
  descriptor, which holds no lock and no reference (``mapped``, not ``held``).
  Whether a consumer registered its mappings with CUDA is per process and not
  visible from outside: its metrics and its log say it (:data:`REGISTRATION_HINT`).
* **The Mooncake Store leg** (EPD across nodes, docs/epd-nodes.md): a process
  with a Store tier (a PD instance's EngineCore, an encoder's TP-rank-0
  worker) lists it in its memfd (:mod:`mmshm.transport.ec_holders`): the
  master, the protocol, what listens where, connected or the last connect
  error, and its counts (:class:`StoreState`). Such a process is listed even
  when it holds no segment. Neither torch nor the engine is imported.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
import time
from collections.abc import Callable

import msgspec
import psutil

from mmshm import config
from mmshm.segments import node
from mmshm.segments.node import NodeInfo
from mmshm.segments.segfile import (
    CACHE_BYTE,
    FLAG_ARENA,
    LIVE_BYTE,
    NAME_RE,
    OWNER_BYTE,
    PREFIX,
    STATE_LIVE,
    STATE_POOLED,
    boottime_ns,
    delivered,
    hand_out,
    holders,
    lock_holders_present,
    peek_header,
    segment_dir,
)
from mmshm.transport.ec_holders import StoreLine

#: (name pattern, who makes such files), first match wins.
OWNER_PATTERNS: tuple[tuple[str, str], ...] = (
    ("nccl-*", "NCCL intra-node buffers"),
    ("psm_*", "Python shared_memory (vLLM, SGLang, multiprocessing)"),
    ("sgl_shm_mq_*", "SGLang shared-memory message queue"),
    ("sglang_loads_*", "SGLang load reporting"),
    ("deepspeed_allreduce_buffer_*", "DeepSpeed all-reduce buffer"),
    ("torch_*", "PyTorch tensor sharing"),
    ("vllm_dist_*", "vLLM CPU shared-memory communicator"),
    ("sem.*", "POSIX semaphores"),
)
MMSHM_ELSEWHERE = "mmshm segments in another directory"
OTHER = "other files"
_MAX_ENTRIES = 50_000  # a survey stops after this many directory entries
_TMPFS = ("tmpfs", "shm", "ramfs")


class SegmentState(msgspec.Struct):
    """One segment file in the segment directory.

    Attributes:
        name: file name (``mmshm-<creator pid>-<hex>``).
        bytes: allocated bytes (header included).
        state: ``live``, ``pooled`` (idle in its owner's warm pool),
            ``freed`` or ``unreadable`` (another user's, or not a segment).
        references: the reference count in its header.
        age_s: seconds since its creation (header), else since its last change.
        held: some process holds it (liveness lock).
        owner_alive: its creating process still runs (owner lock).
        in_flight: nobody holds it, every holder closed it cleanly and
            references are still counted that no reader has attached yet
            (handles not opened yet) within
            ``MMSHM_IN_FLIGHT_GRACE_S`` of the last close: the reaper keeps
            it (see :mod:`mmshm.segments.reaper`), so it is not an orphan yet.
    """

    name: str
    bytes: int
    state: str
    references: int
    age_s: float
    held: bool
    owner_alive: bool
    in_flight: bool = False
    #: an arena segment (header flag ``FLAG_ARENA``): kept in its producer's
    #: warm pool for good, mapped once by each consumer (docs/gpu.md)
    arena: bool = False

    @property
    def orphan(self) -> bool:
        return not self.held and not self.in_flight and self.state != "unreadable"


class EpdHeld(msgspec.Struct):
    """Encoder outputs (EPD) a consumer process holds for one holder
    (:mod:`mmshm.transport.ec_holders`): ``entries`` of ``bytes`` (payload
    bytes), held by ``holder`` ("vLLM encoder cache", a request id; empty:
    no label given)."""

    holder: str
    entries: int = 0
    bytes: int = 0


#: A process's Mooncake Store tier (EPD across nodes), as its memfd says: the
#: record :func:`mmshm.transport.ec_holders.read_stores` reads (``server``,
#: ``master``, ``metadata``, ``protocol``, ``listens``, ``connected``,
#: ``error``, ``stats``: see :class:`~mmshm.transport.ec_holders.StoreLine`).
StoreState = StoreLine


class ProcessEntry(msgspec.Struct):
    """A process that holds segments, or a server process mmshm knows.

    Attributes:
        pid, command: the process and its command line (shortened).
        role: what it is in a server, when its command line tells
            (``SGLang scheduler TP0``, ``vLLM worker TP1``, ...), else None.
        dp_rank: the data-parallel rank it serves (SGLang ``--dp-size``, vLLM
            ``--data-parallel-size``), from the server's process title
            (``sglang::scheduler_DP1``, ``VLLM::EngineCore_DP1``; a vLLM
            worker of a dense model's replica from its EngineCore's); None
            without data parallelism or where no title tells.
        under_mmshm_run: started under ``mmshm run`` (its environment has the
            start-up hook, or an ancestor is the wrapper); None (unknown) when
            its environment cannot be read or was overwritten by setproctitle
            and no ancestor tells.
        owned: segments it created and still owns (owner lock).
        held: segments it has open without owning them.
        bytes: bytes of those segments.
        references: reference counts of the segments it owns, summed.
        oldest_age_s: age in seconds of its oldest segment (None: none).
        pooled, pooled_bytes: owned segments idle in its warm pool.
        cached, cached_bytes: segments (owned or held) that a cache of the
            process keeps on purpose (vLLM's multimodal processor cache in
            the EngineCore): they go when the cache evicts them, not a leak.
        mapped, mapped_bytes: arena segments it keeps mapped for good (a
            consumer's persistent mapping, :class:`mmshm.segments.arena.ArenaViews`,
            seen as an ``O_PATH`` descriptor): no reference and no lock, so
            neither ``owned`` nor ``held``, and not counted in ``bytes``.
        epd_held: encoder outputs of other instances (EPD) it holds, by
            holder (what an idle consumer still holds, and why); part of
            ``held`` and ``bytes``.
        store: its Mooncake Store tiers (EPD across nodes; usually one).
    """

    pid: int
    command: str
    role: str | None
    under_mmshm_run: bool | None
    dp_rank: int | None = None
    owned: int = 0
    held: int = 0
    bytes: int = 0
    references: int = 0
    oldest_age_s: float | None = None
    pooled: int = 0
    pooled_bytes: int = 0
    cached: int = 0
    cached_bytes: int = 0
    mapped: int = 0
    mapped_bytes: int = 0
    epd_held: list[EpdHeld] = msgspec.field(default_factory=list)
    store: list[StoreState] = msgspec.field(default_factory=list)


#: Where a consumer's registration of the arena with CUDA can be seen: it is
#: state of that process, which no file shows.
REGISTRATION_HINT = (
    "registration with CUDA is per consumer process and not visible from outside: see "
    "mmshm_arena_registered_bytes and mmshm_arena_registrations_total{result} on the server's "
    "/metrics, and its log for the one WARNING \"CUDA refused to register the arena's memory\"")


class ArenaProducer(msgspec.Struct):
    """A process that owns arena segments (it created them: its warm pool
    keeps them for good). Sizes in bytes, header included.

    Attributes:
        pid: the producing process.
        segments, bytes: its arena segments in the directory.
        idle, idle_bytes: those idle in its warm pool (state ``pooled``): the
            arena's warm pages waiting for the next request, not a leak.
        in_use_bytes: those held by references (state ``live``).
    """

    pid: int
    segments: int = 0
    bytes: int = 0
    idle: int = 0
    idle_bytes: int = 0
    in_use_bytes: int = 0


class ArenaMapper(msgspec.Struct):
    """A consuming process that keeps arena segments mapped for good
    (:class:`mmshm.segments.arena.ArenaViews`): ``segments`` of ``bytes``."""

    pid: int
    segments: int = 0
    bytes: int = 0


class ArenaState(msgspec.Struct):
    """The arena (:mod:`mmshm.segments.arena`) as seen from this process and
    the segment directory. Sizes in bytes, header included.

    Attributes:
        bytes: its size as configured in this environment for this file
            system (:func:`mmshm.config.arena_bytes`; 0: off). A server
            started from another environment may have another.
        source: where ``bytes`` comes from: ``MMSHM_ARENA_BYTES``, or the
            default and why (CUDA available here or not).
        cuda_host: CUDA is available in this environment
            (:func:`mmshm.segments.table.cuda_host`).
        segments, segment_bytes: arena segments in the directory (header flag
            ``FLAG_ARENA``), every producer's.
        idle_bytes: those idle in a live producer's warm pool.
        in_use_bytes: those held by references.
        orphans, orphan_bytes: those no live process holds (their producer
            died): the reaper reclaims them like any orphan.
        producers: per producing process.
        mappers: consuming processes that keep arena segments mapped.
        registration: where the registration state can be seen
            (:data:`REGISTRATION_HINT`).
    """

    bytes: int
    source: str
    cuda_host: bool
    segments: int = 0
    segment_bytes: int = 0
    idle_bytes: int = 0
    in_use_bytes: int = 0
    orphans: int = 0
    orphan_bytes: int = 0
    producers: list[ArenaProducer] = msgspec.field(default_factory=list)
    mappers: list[ArenaMapper] = msgspec.field(default_factory=list)
    registration: str = REGISTRATION_HINT


class OtherGroup(msgspec.Struct):
    """Files on the same file system that are not this directory's segments.

    ``bytes`` counts each file by the larger of its apparent size (``st_size``)
    and its allocated pages: a program's sparse file (Python shared memory
    ``psm_*``, vLLM's message queues) is what it wants room for, and vLLM
    refuses to start when /dev/shm cannot hold it whole. ``allocated_bytes``
    is what the files occupy now.
    """

    owner: str
    pattern: str
    files: int
    bytes: int
    examples: list[str]
    allocated_bytes: int = 0


class StatusReport(msgspec.Struct):
    """What :func:`status` found. Sizes in bytes, ages in seconds.

    ``used_bytes`` is the file system's used space; ``unaccounted_bytes`` is
    what no visible file explains (files of other users or beyond the survey,
    unlinked files still open).
    """

    directory: str
    root: str
    fs_type: str
    fs_size_bytes: int
    fs_used_bytes: int
    fs_free_bytes: int
    reserve_bytes: int
    segments: list[SegmentState]
    segment_bytes: int
    orphans: int
    orphan_bytes: int
    pooled_bytes: int
    in_flight: int
    in_flight_bytes: int
    processes: list[ProcessEntry]
    unattributed: int
    unattributed_bytes: int
    others: list[OtherGroup]
    other_bytes: int
    unaccounted_bytes: int
    notes: list[str]
    #: bytes of mmshm segments (``mmshm-<pid>-<hex>``) in other directories of
    #: the same file system, part of ``other_bytes``
    mmshm_elsewhere_bytes: int = 0
    #: this process's node for the directory (:func:`mmshm.segments.node.describe`)
    node: NodeInfo | None = None
    #: the arena: its size and its segments (:func:`arena_state`)
    arena: ArenaState | None = None


def mount_of(path: str) -> tuple[str, str]:
    """``(mount point, file system type)`` of ``path`` from /proc/mounts
    (``("/", "unknown")`` when it cannot be read)."""
    path = os.path.realpath(path)
    best, kind = "/", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return best, kind


def owner_of(name: str) -> tuple[str, str]:
    """``(owner, pattern)`` of a file name in /dev/shm (:data:`OWNER_PATTERNS`)."""
    for pattern, owner in OWNER_PATTERNS:
        if fnmatch.fnmatchcase(name, pattern):
            return owner, pattern
    if NAME_RE.match(name):
        return MMSHM_ELSEWHERE, PREFIX + "*"
    return OTHER, "*"


def read_segment(path: str, now: float | None = None) -> SegmentState | None:
    """The state of one segment file, taking no lock and changing nothing;
    None if it vanished or is not a regular file."""
    now = time.time() if now is None else now
    name = os.path.basename(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        try:
            st = os.lstat(path)
        except OSError:
            return None
        return SegmentState(name, st.st_blocks * 512, "unreadable", 0,
                            max(0.0, now - st.st_mtime), True, False)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        size = st.st_blocks * 512
        age = max(0.0, now - st.st_mtime)
        hdr = peek_header(fd)
        if hdr is None:
            return SegmentState(name, size, "unreadable", 0, age, True, False)
        state = {STATE_LIVE: "live", STATE_POOLED: "pooled"}.get(hdr.state, "freed")
        if hdr.created_ns:
            age = max(0.0, now - hdr.created_ns / 1e9)
        held = lock_holders_present(fd, LIVE_BYTE)
        in_flight = False
        if not held and hdr.state == STATE_LIVE and hdr.refcount > 0:
            n, detached = holders(fd)  # as the reaper judges it (mmshm.segments.reaper._why)
            in_flight = n <= 0 and detached != 0 and not delivered(*hand_out(fd)) and \
                boottime_ns() - detached < config.get().in_flight_grace_s * 1e9
        return SegmentState(name, size, state, hdr.refcount, age, held,
                            lock_holders_present(fd, OWNER_BYTE), in_flight,
                            bool(hdr.flags & FLAG_ARENA))
    except OSError:
        return None
    finally:
        os.close(fd)


def _start_time(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch), None if it is gone or
    unreadable; read afresh each call (a reused pid shows a new time)."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


#: The command line of the ``mmshm run`` wrapper itself: the console script,
#: ``python -m mmshm[.cli] run``, or ``python -c "from mmshm.cli import main; main()" run``.
_WRAPPER_RE = re.compile(
    r"(?:^|[\s/])mmshm\s+run(?:\s|$)"
    r"|-m\s+mmshm(?:\.cli)?\s+run(?:\s|$)"
    r"|mmshm\.cli import main;[^;]*main\(\)\)?\s+run(?:\s|$)")
WRAPPER_ROLE = "mmshm run wrapper"


def is_wrapper(command: str) -> bool:
    """Whether a command line is the ``mmshm run`` wrapper's."""
    return _WRAPPER_RE.search(command) is not None


_ROLES = (
    (_WRAPPER_RE, lambda m: WRAPPER_ROLE),  # first: its command line names the server's
    # sglang::scheduler (one rank), sglang::scheduler_TP1, sglang::scheduler_DP1 (data
    # parallelism, TP=1), sglang::scheduler_DP0_TP1, ..._PP1_TP0: SGLang's
    # configure_scheduler_process; said TP first ("SGLang scheduler TP1 DP0")
    (re.compile(r"sglang::scheduler((?:_(?:ATTN_CP|MOE_DP|DP|PP|TP|EP)\d+)*)"),
     lambda m: " ".join(["SGLang scheduler", *sorted(
         re.findall(r"_((?:ATTN_CP|MOE_DP|DP|PP|TP|EP)\d+)", m.group(1)),
         key=lambda part: not part.startswith("TP"))])),
    (re.compile(r"sglang::detokenizer"), lambda m: "SGLang detokenizer"),
    (re.compile(r"sglang::(\w+)"), lambda m: f"SGLang {m.group(1)}"),
    (re.compile(r"sglang\.launch_server"), lambda m: "SGLang tokenizer / API server"),
    # VLLM::Worker (TP=1), VLLM::Worker_TP1, VLLM::Worker_PP1_TP0, VLLM::Worker_DP0_TP1
    (re.compile(r"VLLM::Worker((?:_[A-Z]{2}\d+)*)"),
     lambda m: " ".join(["vLLM worker", *m.group(1).split("_")[1:]])),
    # VLLM::EngineCore, VLLM::EngineCore_DP1 (run_engine_core under data parallelism)
    (re.compile(r"VLLM::EngineCore(?:_DP(\d+))?"),
     lambda m: "vLLM EngineCore" + (f" DP{m.group(1)}" if m.group(1) else "")),
    (re.compile(r"vllm serve|vllm\.entrypoints"), lambda m: "vLLM API server"),
    (re.compile(r"mmshm\.bench|mmshm bench"), lambda m: "mmshm bench"),
)


_DP_RE = re.compile(r"\bDP(\d+)\b")


def dp_rank_of(role: str | None) -> int | None:
    """The data-parallel rank a role of :func:`role_of` names (``SGLang
    scheduler DP1``, ``vLLM EngineCore DP0``, ``vLLM worker DP0 TP1``), or
    None."""
    m = _DP_RE.search(role or "")
    return int(m.group(1)) if m else None


def _dp_rank(pid: int, role: str | None) -> int | None:
    """:func:`dp_rank_of` the role; a vLLM worker whose title has none (a
    dense model's DP replicas are independent engines, each with a DP group
    of one) takes its parent EngineCore's."""
    rank = dp_rank_of(role)
    if rank is None and role is not None and role.startswith("vLLM worker"):
        parent = _ppid(pid)
        if parent is not None:
            rank = dp_rank_of(role_of(_command(parent)))
    return rank


def role_of(command: str) -> str | None:
    """A server role recognised in a command line (or process title), or None."""
    for rx, name in _ROLES:
        m = rx.search(command)
        if m:
            return name(m)
    return None


def _command(pid: int) -> str:
    """The command line of ``pid`` (its process title where it set one), else
    ``[name]`` (a kernel thread, an empty command line), else ``?``."""
    try:
        proc = psutil.Process(pid)
        cmd = " ".join(proc.cmdline()).strip()
        return cmd or f"[{proc.name()}]"
    except psutil.Error:
        return "?"


def _environ_says(pid: int) -> bool | None:
    """True: the environment of ``pid`` has the start-up hook; False: it is a
    real environment without it; None: it cannot be read, or it was
    overwritten (setproctitle, as SGLang's scheduler and detokenizer and
    vLLM's EngineCore and workers call, writes the title over the memory
    /proc/PID/environ shows: NULs or the title's tail, no ``KEY=value``)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = [e for e in f.read().split(b"\0") if e]
    except OSError:
        return None
    if any(e.startswith(b"MMSHM_AUTOPATCH_ROOTS=") for e in env):
        return True
    if not env or any(b"=" not in e for e in env):
        return None  # clobbered: says nothing
    return False


def _ppid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def _run_ancestor(pid: int) -> bool:
    """Whether an ancestor of ``pid`` is the ``mmshm run`` wrapper, or has the
    start-up hook in its environment (children inherit it)."""
    seen = {pid}
    p = _ppid(pid)
    while p is not None and p > 1 and p not in seen and len(seen) < 64:
        seen.add(p)
        if is_wrapper(_command(p)) or _environ_says(p) is True:
            return True
        p = _ppid(p)
    return False


def _under_run(pid: int) -> bool | None:
    """Whether ``pid`` runs under ``mmshm run``: its environment has the
    start-up hook, or an ancestor is the wrapper (or has the hook); False
    only when its environment is readable and real and nothing says so;
    None (unknown) when its environment is unreadable or overwritten."""
    own = _environ_says(pid)
    if own:
        return True
    if _run_ancestor(pid):
        return True
    return own


_O_PATH = getattr(os, "O_PATH", 0o10000000)

#: Marks a process in another mount namespace that has this directory's segments open.
OTHER_NS = "(other mount namespace)"


def _mount_ns(pid: int | str) -> str | None:
    """The mount namespace of ``pid`` (``mnt:[...]``), None if unreadable."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def lock_marks(pid: int, fd: int | str) -> tuple[bool, bool]:
    """``(owner, cached)`` of a segment descriptor of ``pid``, from
    ``/proc/<pid>/fdinfo``: whether it carries the owner lock (byte 2,
    exclusive: the process created the segment) and the cache mark (byte 3,
    shared: a cache of the process keeps views of it, see
    :func:`mmshm.segments.segment.mark_cached`)."""
    owner = cached = False
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("lock:"):
                    parts = line.split()
                    if "WRITE" in parts and parts[-2:] == [str(OWNER_BYTE)] * 2:
                        owner = True
                    elif "READ" in parts and parts[-2:] == [str(CACHE_BYTE)] * 2:
                        cached = True
    except OSError:
        pass
    return owner, cached


def _owns(pid: int, fd: str) -> bool:
    """Whether that descriptor carries the owner lock (byte 2, exclusive)."""
    return lock_marks(pid, fd)[0]


def scan_processes(directory: str) -> tuple[dict[int, dict], list[str]]:
    """Per visible pid: ``{"owned": set, "held": set, "cached": set, "mapped": set,
    "role": ..., "dp_rank": ..., "command": ..., "stores": [StoreLine]}`` of this directory's
    segments it has open
    (``cached``: those a cache of the process keeps, :func:`lock_marks`; ``mapped``: those it
    has open only as an ``O_PATH`` descriptor, an arena consumer's persistent mapping, which
    holds neither lock nor reference; ``stores``: its Mooncake Store tiers,
    :func:`mmshm.transport.ec_holders.read_stores`), plus the server processes and the
    processes with a Store tier that hold none; and notes
    (processes whose descriptors cannot be read)."""
    from mmshm.transport.ec_holders import read_stores

    d = os.path.realpath(directory)
    out: dict[int, dict] = {}
    hidden = 0
    me = os.getpid()
    my_ns = _mount_ns("self")
    try:
        pids = psutil.pids()
    except (OSError, psutil.Error):
        return {}, ["/proc cannot be read: no per-process view"]
    for pid in pids:
        if pid == me:
            continue
        t0 = _start_time(pid)
        if t0 is None:
            continue
        owned: set[str] = set()
        held: set[str] = set()
        cached: set[str] = set()
        mapped: set[str] = set()
        try:
            files = psutil.Process(pid).open_files()  # regular files; unlinked ones left out
        except psutil.AccessDenied:
            hidden += 1
            files = []
        except psutil.Error:
            continue
        for f in files:
            if os.path.dirname(f.path) != d or not NAME_RE.match(os.path.basename(f.path)):
                continue  # elsewhere
            name = os.path.basename(f.path)
            if f.flags & _O_PATH:
                mapped.add(name)  # an arena consumer's mapping: no lock, no reference
                continue
            owner, in_cache = lock_marks(pid, f.fd)
            (owned if owner else held).add(name)
            if in_cache:
                cached.add(name)
        command = _command(pid)
        role = role_of(command)
        mapped -= owned | held
        stores = read_stores(pid)
        if not owned and not held and not mapped and role is None and not stores:
            continue
        ns = _mount_ns(pid)
        if my_ns is not None and ns is not None and ns != my_ns:
            if not owned and not held and not mapped:
                continue  # another mount namespace: another /dev/shm, not ours
            role = (role + " " if role else "") + OTHER_NS
        under = True if role == WRAPPER_ROLE else _under_run(pid)
        if _start_time(pid) != t0:
            continue  # the pid was reused while we looked: drop it
        out[pid] = {"owned": owned, "held": held - owned, "role": role,
                    "dp_rank": _dp_rank(pid, role), "command": command,
                    "under_mmshm_run": under, "cached": cached, "mapped": mapped,
                    "stores": stores}
    notes = []
    if hidden and os.geteuid() != 0:
        notes.append(f"{hidden} process(es) of other users cannot be inspected (run as root "
                     f"to see their segments per process)")
    return out, notes


def survey(root: str, directory: str) -> tuple[list[OtherGroup], list[str]]:
    """Group the files under ``root`` (recursively, not crossing file systems,
    never following links) that are not ``directory``'s own segments."""
    d = os.path.realpath(directory)
    groups: dict[tuple[str, str], OtherGroup] = {}
    notes: list[str] = []
    try:
        dev = os.stat(root).st_dev
    except OSError:
        return [], [f"{root} cannot be read"]
    seen = 0
    stack = [root]
    while stack:
        top = stack.pop()
        try:
            it = list(os.scandir(top))
        except OSError:
            continue
        for e in it:
            seen += 1
            if seen > _MAX_ENTRIES:
                notes.append(f"survey of {root} stopped after {_MAX_ENTRIES} entries")
                stack.clear()
                break
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if st.st_dev == dev:
                    stack.append(e.path)
                continue
            if top == d and NAME_RE.match(e.name):
                continue  # this directory's segments: reported as segments
            owner, pattern = owner_of(e.name)
            if owner == MMSHM_ELSEWHERE:
                pattern = os.path.join(top, PREFIX + "*")
            g = groups.setdefault((owner, pattern), OtherGroup(owner, pattern, 0, 0, []))
            g.files += 1
            allocated = st.st_blocks * 512
            g.allocated_bytes += allocated
            g.bytes += allocated if owner == MMSHM_ELSEWHERE else max(allocated, st.st_size)
            if len(g.examples) < 3:
                g.examples.append(os.path.relpath(e.path, root))
    return sorted(groups.values(), key=lambda g: -g.bytes), notes


def epd_held(pid: int, directory: str) -> list[EpdHeld]:
    """The encoder outputs (EPD) process ``pid`` holds in ``directory``, by
    holder, largest first (:func:`mmshm.transport.ec_holders.read_holders`)."""
    from mmshm.transport.ec_holders import read_holders

    by: dict[str, EpdHeld] = {}
    for h in read_holders(pid, directory):
        g = by.setdefault(h.holder, EpdHeld(h.holder))
        g.entries += 1
        g.bytes += h.nbytes
    return sorted(by.values(), key=lambda g: -g.bytes)


def status(directory: str | None = None) -> StatusReport:
    """Survey the segment directory (default ``MMSHM_DIR``) and its file system.

    Raises:
        FileNotFoundError: the directory does not exist.
        NotADirectoryError: it is not a directory.
        PermissionError: it cannot be listed.
    """
    d = segment_dir(directory)
    names = sorted(n for n in os.listdir(d) if NAME_RE.match(n))  # raises on a bad dir
    st = os.statvfs(d)
    size = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    mnt, fs = mount_of(d)
    root = mnt if fs in _TMPFS else d
    now = time.time()
    segs = [s for s in (read_segment(os.path.join(d, n), now) for n in names) if s]
    by_name = {s.name: s for s in segs}
    procs, notes = scan_processes(d)
    entries = []
    seen: set[str] = set()
    for pid, p in sorted(procs.items()):
        e = ProcessEntry(pid, p["command"][:120], p["role"], p["under_mmshm_run"],
                         p.get("dp_rank"))
        for name in p["owned"] | p["held"]:
            s = by_name.get(name)
            if s is None:
                continue
            seen.add(name)
            e.bytes += s.bytes
            e.oldest_age_s = max(e.oldest_age_s or 0.0, s.age_s)
            if name in p["owned"]:
                e.owned += 1
                e.references += s.references
                if s.state == "pooled":
                    e.pooled += 1
                    e.pooled_bytes += s.bytes
            else:
                e.held += 1
            if name in p.get("cached", ()):
                e.cached += 1
                e.cached_bytes += s.bytes
        for name in p.get("mapped", ()):
            s = by_name.get(name)
            if s is not None:
                e.mapped += 1
                e.mapped_bytes += s.bytes
        if p["held"]:
            e.epd_held = epd_held(pid, d)
        e.store = list(p.get("stores", ()))
        entries.append(e)
    hidden = [s for s in segs if s.held and s.name not in seen]
    orphans = [s for s in segs if s.orphan]
    others, more = survey(root, d)
    notes += more
    other_bytes = sum(g.bytes for g in others)
    seg_bytes = sum(s.bytes for s in segs)
    return StatusReport(
        directory=d, root=root, fs_type=fs, fs_size_bytes=size, fs_used_bytes=used,
        fs_free_bytes=free, reserve_bytes=config.min_free_bytes(size), segments=segs,
        segment_bytes=seg_bytes, orphans=len(orphans), orphan_bytes=sum(s.bytes for s in orphans),
        pooled_bytes=sum(s.bytes for s in segs if s.state == "pooled"),
        in_flight=sum(1 for s in segs if s.in_flight),
        in_flight_bytes=sum(s.bytes for s in segs if s.in_flight), processes=entries,
        unattributed=len(hidden), unattributed_bytes=sum(s.bytes for s in hidden),
        others=others, other_bytes=other_bytes,
        unaccounted_bytes=max(0, used - seg_bytes - sum(g.allocated_bytes for g in others))
        if root != d else 0,
        notes=notes,
        mmshm_elsewhere_bytes=sum(g.bytes for g in others if g.owner == MMSHM_ELSEWHERE),
        node=node.describe(d), arena=arena_state(size, segs, procs))


def store_lines(pid: int, t: StoreState, size: Callable[[int], str]) -> list[str]:
    """``mmshm status``'s lines for process ``pid``'s Store tier ``t``."""
    st = t.stats
    state = ("connected" if t.connected else
             f"NOT connected ({t.error})" if t.error else "not connected yet")
    counts = (f"puts {int(st.get('puts', 0))} ({size(int(st.get('put_bytes', 0)))}), "
              f"gets {int(st.get('gets', 0))} ({size(int(st.get('get_bytes', 0)))})")
    for kind, word in (("miss_", "misses"), ("drop_", "puts dropped")):
        got = [f"{k[len(kind):]} {int(v)}" for k, v in sorted(st.items())
               if k.startswith(kind) and v]
        counts += f"; {word}: " + (", ".join(got) if got else "none")
    return [f"  {pid}: Mooncake Store ({t.server}, {t.protocol}): {state}; {counts}",
            f"  {pid}:   {t.listens}"]


def cuda_available() -> bool:
    """Whether CUDA is available in this environment, as a server's producer
    decides it (:func:`mmshm.segments.table.cuda_host`), without importing
    torch where the NVIDIA driver's device file is missing (it would be
    False there anyway)."""
    from mmshm.segments.table import cuda_host

    return os.path.exists("/dev/nvidiactl") and cuda_host()


def arena_config(fs_size: int) -> tuple[int, str, bool]:
    """``(bytes, source, cuda_host)``: the arena's size as configured in this
    environment for a file system of ``fs_size`` bytes
    (:func:`mmshm.config.arena_bytes`), where that comes from, and whether
    CUDA is available here (:func:`mmshm.segments.table.cuda_host`; torch is
    imported only where the NVIDIA driver's device file exists)."""
    cuda = cuda_available()
    size = config.arena_bytes(fs_size, cuda)
    if config.get().arena_bytes is not None:
        source = "MMSHM_ARENA_BYTES"
    elif cuda:
        source = "default: CUDA is available here (1 GiB, at most 1/4 of the file system)"
    else:
        source = "default: off where CUDA is not available"
    return size, source, cuda


def arena_state(fs_size: int, segs: list[SegmentState], procs: dict[int, dict]) -> ArenaState:
    """The arena in the directory: its configured size (:func:`arena_config`)
    and its segments (``segs`` with ``arena`` set) per producer (the process
    holding the owner lock, from ``procs`` of :func:`scan_processes`) and per
    consumer that maps them."""
    size, source, cuda = arena_config(fs_size)
    arena = {s.name: s for s in segs if s.arena}
    st = ArenaState(size, source, cuda, segments=len(arena),
                    segment_bytes=sum(s.bytes for s in arena.values()))
    for s in arena.values():
        if s.orphan:
            st.orphans += 1
            st.orphan_bytes += s.bytes
        elif s.state == "pooled":
            st.idle_bytes += s.bytes
        elif s.state == "live":
            st.in_use_bytes += s.bytes
    for pid, p in sorted(procs.items()):
        mine = [arena[n] for n in p["owned"] if n in arena]
        if mine:
            idle = [s for s in mine if s.state == "pooled"]
            st.producers.append(ArenaProducer(
                pid, len(mine), sum(s.bytes for s in mine), len(idle),
                sum(s.bytes for s in idle),
                sum(s.bytes for s in mine if s.state == "live")))
        maps = [arena[n] for n in p.get("mapped", ()) if n in arena]
        if maps:
            st.mappers.append(ArenaMapper(pid, len(maps), sum(s.bytes for s in maps)))
    return st


def arena_lines(a: ArenaState | None, size: Callable[[int], str]) -> list[str]:
    """``mmshm status``'s text for the arena: its size and source, its
    segments (idle vs in use, per producer; consumers' mappings), and where
    to see the registration state; ``size`` writes a byte count for people."""
    if a is None:
        return []
    head = (f"arena: {size(a.bytes)} ({a.source})" if a.bytes else f"arena: off ({a.source})")
    if not a.segments:
        return [head + "; no arena segments in this directory"]
    lines = [head + f"; {a.segments} arena segment(s) here ({size(a.segment_bytes)}): "
             f"{size(a.in_use_bytes)} in use, {size(a.idle_bytes)} idle in their producers' "
             f"warm pools (the arena's warm pages, kept for good: not a leak)"
             + (f", {a.orphans} orphaned ({size(a.orphan_bytes)}; their producer died: "
                f"`mmshm gc` reclaims them)" if a.orphans else "")]
    for p in a.producers:
        lines.append(f"  producer {p.pid}: {p.segments} segment(s) ({size(p.bytes)}), "
                     f"{size(p.in_use_bytes)} in use, {p.idle} idle ({size(p.idle_bytes)})")
    for m in a.mappers:
        lines.append(f"  consumer {m.pid}: keeps {m.segments} arena segment(s) mapped "
                     f"({size(m.bytes)}; mapped once, reused by every request)")
    lines.append(f"  {a.registration}")
    return lines
