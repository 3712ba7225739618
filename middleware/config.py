"""Configuration from ``MMSHM_*`` environment variables.

The settings are read once per process and cached; :func:`reload` re-reads
them (tests change the environment and call it).

Every variable is declared once, in :data:`VARIABLES`: its name, type,
default, bounds and documentation (:class:`Variable`). Parsing, the
warnings, ``mmshm config``, the command line's help and the table of
``docs/configuration.md`` (``tests/test_docs.py`` checks it) come from there.

Bad values: a value a variable does not accept never stops a process. The
settings fall back to that variable's default and log one WARNING naming the
variable, the value and what is allowed (a server keeps running). The
``mmshm`` commands check first (:func:`check`) and exit with
:data:`EXIT_BAD_SETTING` and that one line; ``mmshm config`` prints the values
in effect. Sizes accept units (:func:`parse_size`: ``720M``, ``2GiB``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mmshm.errors import MmshmError

log = logging.getLogger("mmshm")

#: Exit status of every ``mmshm`` command (but ``run``, which exits with its
#: command's status) when an ``MMSHM_*`` variable has a value it cannot use.
EXIT_BAD_SETTING = 4


class SettingError(MmshmError, ValueError):
    """An ``MMSHM_*`` environment variable holds a value mmshm cannot use.

    ``str()`` is one line naming the variable, the value and what is allowed.

    Attributes:
        variable: the variable's name, e.g. ``"MMSHM_MIN_BYTES"``.
        value: the value found in the environment.
        allowed: what the variable accepts, in words.
    """

    def __init__(self, variable: str, value: str, allowed: str):
        super().__init__(f"{variable}={value!r} is not valid: expected {allowed}")
        self.variable = variable
        self.value = value
        self.allowed = allowed

    def __reduce__(self):
        return (type(self), (self.variable, self.value, self.allowed))


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*\Z")
SIZE_SYNTAX = ("bytes: an integer or a size such as 64K, 720M, 2GiB (K, M, G, T = KiB, MiB, "
               "GiB, TiB; KB, MB, GB, TB = powers of 1000)")


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``"65536"``, ``"1e9"``, ``"720M"``, ``"2GiB"``, ``"1.5G"``.

    K, M, G, T and KiB, MiB, GiB, TiB are powers of 1024 (as in docker's
    ``--shm-size``); KB, MB, GB, TB powers of 1000. Case is ignored.

    Raises:
        ValueError: not a non-negative number with one of those units.
    """
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not {SIZE_SYNTAX}")
    return int(float(m.group(1)) * _UNITS[unit])


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(raw)


#: Where the names ``MMSHM_INSTRUMENT`` may list come from. The settings
#: import nothing above the errors: the package root (``mmshm/__init__.py``,
#: run before any module of mmshm) hands in the registry of installed
#: instrumentors (:func:`mmshm.hooks.instrumentor.registered`, read when a
#: value is checked, not before).
_instrumentor_source: Callable[[], Iterable[str]] = tuple


def set_instrumentor_source(source: Callable[[], Iterable[str]]) -> None:
    """Set what :func:`known_instrumentors` reads (the package root does)."""
    global _instrumentor_source
    _instrumentor_source = source


def known_instrumentors() -> list[str]:
    """Names ``MMSHM_INSTRUMENT`` may list: the registered instrumentors
    (:func:`mmshm.hooks.instrumentor.registered`, the ``mmshm.instrumentors``
    entry points, through :func:`set_instrumentor_source`)."""
    return sorted(_instrumentor_source())


def instrument_names(value: str | None, known: Iterable[str] | None = None) -> list[str] | None:
    """The instrumentors an ``MMSHM_INSTRUMENT`` value selects.

    Args:
        value: the variable's value (``None`` or empty: unset).
        known: the valid names (default :func:`known_instrumentors`).

    Returns:
        ``None`` when unset (the caller picks the installed ones), ``[]`` for
        ``none`` (or ``0``, ``off``, ``false``), else the listed names in order.

    Raises:
        SettingError: a name that is no instrumentor, or an empty list item.
    """
    if value is None or value.strip() == "":
        return None
    if value.strip().lower() in ("none", "0", "off", "false"):
        return []
    known = list(known_instrumentors() if known is None else known)
    names = [n.strip() for n in value.split(",")]
    if any(not n or n not in known for n in names):
        raise SettingError("MMSHM_INSTRUMENT", value,
                           f"a comma-separated list of {', '.join(known)}, or none")
    return names


def default_min_free_bytes(fs_size: int) -> int:
    """The default of ``MMSHM_MIN_FREE_BYTES`` (the budget reserve, bytes) for a
    file system of ``fs_size`` bytes: 5%, at least 16 MiB, at most 1 GiB."""
    return int(min(max(16 << 20, fs_size * 0.05), 1 << 30))


def default_pool_max_bytes(fs_size: int) -> int:
    """The default of ``MMSHM_POOL_MAX_BYTES`` (bytes) for a file system of
    ``fs_size`` bytes: a quarter, at most 2 GiB."""
    return int(min(fs_size // 4, 2 << 30))


def default_arena_bytes(fs_size: int) -> int:
    """The default size of the arena (``MMSHM_ARENA_BYTES``, bytes) in a process
    where CUDA is available, for a file system of ``fs_size`` bytes: 1 GiB, at
    most a quarter of the file system (Docker's 64 MiB /dev/shm: 16 MiB, too
    small for one 720p photo, so the arena then serves nothing and says so).
    Where CUDA is not available the default is 0 (off): see
    :func:`arena_bytes`."""
    return int(min(fs_size // 4, 1 << 30))


#: The types a :class:`Variable` may have, and what each accepts in words.
TYPES = {
    "text": "any text",
    "bool": "1 or 0 (also true/false, yes/no, on/off)",
    "int": "an integer",
    "size": SIZE_SYNTAX,
    "seconds": "a number of seconds",
    "choice": "",
    "port": "a port number",
    "instrumentors": "a comma-separated list of instrumentors",
}


@dataclass(frozen=True)
class Variable:
    """The one declaration of an ``MMSHM_*`` setting.

    Attributes:
        name: the environment variable, e.g. ``"MMSHM_MIN_BYTES"``.
        field: the :class:`Settings` attribute it sets (None: read where it
            is used, through :func:`value`).
        type: one of :data:`TYPES`: ``text``, ``bool``, ``int``, ``size``
            (bytes, with units), ``seconds`` (a float), ``choice`` (one of
            ``choices``), ``port`` or ``instrumentors``.
        default: the value used when unset or bad (None: unset, or computed
            where it is used; ``default_text`` says how).
        doc: what it does, one line (``mmshm config``, docs/configuration.md).
        minimum, maximum: bounds of a number (None: none); ``minimum`` is
            excluded when ``above_minimum``.
        choices: the values a ``choice`` accepts.
        allowed_text: what it accepts, in words, where the type says too
            little (a ``text``); else derived from the type and bounds.
        default_text: the default in words, where ``default`` is None
            (``"5% of the fs, 16 MiB..1 GiB"``); else derived from it.
        zero: what 0 means, where it means something (``"off"``).
        computed: for a default that depends on the segment directory's file
            system, the default for one of that many bytes.
    """

    name: str
    field: str | None
    type: str
    default: object
    doc: str
    minimum: float | None = None
    maximum: float | None = None
    above_minimum: bool = False
    choices: tuple[str, ...] = ()
    allowed_text: str | None = None
    default_text: str | None = None
    zero: str | None = None
    computed: Callable[[int], int] | None = None

    @property
    def allowed(self) -> str:
        """What the variable accepts, in words (for errors and ``mmshm config``)."""
        if self.allowed_text is not None:
            return self.allowed_text
        if self.type == "choice":
            return " or ".join(self.choices)
        if self.type == "instrumentors":
            return f"{TYPES[self.type]} ({', '.join(known_instrumentors())}), or none"
        if self.type == "port":
            return f"{TYPES[self.type]}, {self.minimum:g} to {self.maximum:g}"
        out = TYPES[self.type]
        if self.minimum is not None:
            out += (f" above {self.minimum:g}" if self.above_minimum
                    else f" >= {self.minimum:g}")
        if self.maximum is not None:
            out += f", at most {self.maximum:g}"
        return out + (f" (0: {self.zero})" if self.zero else "")

    @property
    def shown_default(self) -> str:
        """The default as docs/configuration.md, ``mmshm config`` and the CLI
        help show it: ``65536``, ``/dev/shm``, ``1``, ``unset``."""
        if self.default_text is not None:
            return self.default_text
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)

    def parse(self, raw: str) -> object:
        """The value of ``raw``.

        Raises:
            ValueError: ``raw`` is not of the type, or out of bounds.
            SettingError: an ``instrumentors`` value names no instrumentor.
        """
        if self.type == "text":
            return raw.strip()
        if self.type == "bool":
            return _bool(raw)
        if self.type == "choice":
            v = raw.strip().lower()
            if v not in self.choices:
                raise ValueError(raw)
            return v
        if self.type == "instrumentors":
            instrument_names(raw)
            return raw.strip()
        if self.type == "size":
            v = parse_size(raw)
        elif self.type in ("int", "port"):
            v = int(raw.strip())
        elif self.type == "seconds":
            v = float(raw.strip())
            if v != v or v == float("inf"):
                raise ValueError(raw)
        else:
            raise TypeError(f"{self.name}: unknown type {self.type!r}")
        if self.minimum is not None and (v < self.minimum
                                         or (self.above_minimum and v == self.minimum)):
            raise ValueError(raw)
        if self.maximum is not None and v > self.maximum:
            raise ValueError(raw)
        return v


VARIABLES: tuple[Variable, ...] = (
    Variable("MMSHM_DIR", "dir", "text", "/dev/shm", "segment directory (a tmpfs)",
             allowed_text="a directory path"),
    Variable("MMSHM_MIN_BYTES", "min_bytes", "size", 65536,
             "smaller tensors stay inline (below that, pickling is cheaper than a segment)"),
    Variable("MMSHM_DISABLE", "disable", "bool", False, "1: everything travels inline"),
    Variable("MMSHM_MODE", "mode", "choice", "shm",
             "shm: mmshm carries the tensors; observe: the server's own transport carries "
             "them and mmshm only times each hop (mmshm run --observe)",
             choices=("shm", "observe")),
    Variable("MMSHM_SWEEP_INTERVAL_S", "sweep_interval_s", "seconds", 1.0,
             "seconds between a producer's sweeps of its finished segments", minimum=0,
             above_minimum=True),
    # NCCL keeps its intra-node buffers in /dev/shm (nccl-*: a few MiB per rank with
    # P2P, up to several hundred MiB on its SHM transport): 16 MiB keeps its start-up
    # working in Docker's 64 MiB default while one 22 MB Qwen2-VL image still fits, and
    # 5% scales the headroom on large mounts
    Variable("MMSHM_MIN_FREE_BYTES", "min_free_bytes", "size", None,
             "budget guard reserve: a segment is not created if it would leave less free "
             "(NCCL headroom)", default_text="5% of the fs, 16 MiB..1 GiB",
             computed=default_min_free_bytes),
    Variable("MMSHM_MAX_BYTES", "max_bytes", "size", 0,
             "cap on one process's live segment bytes (0: none)"),
    Variable("MMSHM_FD_RESERVE", "fd_reserve", "int", 64,
             "descriptors kept free below RLIMIT_NOFILE (segment creation and attach fail "
             "with EMFILE, and go inline, beyond)", minimum=0),
    Variable("MMSHM_REAP_INTERVAL_S", "reap_interval_s", "seconds", 60.0,
             "automatic reaper period, at start-up per directory and in long-lived "
             "processes", minimum=0, zero="off"),
    Variable("MMSHM_IN_FLIGHT_GRACE_S", "in_flight_grace_s", "seconds", 300.0,
             "the reaper keeps a segment whose references are in flight (pickled, not yet "
             "opened) this long after every holder closed it cleanly; a killed holder's "
             "segments go at once", minimum=0),
    Variable("MMSHM_DEBUG_REFS", "debug_refs", "bool", False,
             "1: record where each reference was taken and given back, report those still "
             "held at exit (no cost when off)"),
    Variable("MMSHM_POOL", "pool", "bool", True,
             "warm segment pool (0: every segment fresh, unlinked by its last release)"),
    Variable("MMSHM_POOL_IDLE_S", "pool_idle_s", "seconds", 10.0,
             "idle pooled segments are unlinked after this", minimum=0),
    Variable("MMSHM_POOL_MAX_BYTES", "pool_max_bytes", "size", None,
             "idle pooled bytes one process keeps", default_text="1/4 of the fs, at most 2 GiB",
             computed=default_pool_max_bytes),
    Variable("MMSHM_ARENA_BYTES", "arena_bytes", "size", None,
             "the arena: pooled segments this process keeps for good, mapped once and "
             "registered with CUDA once by each consumer (0: off)",
             default_text="where CUDA is available 1 GiB, at most 1/4 of the fs; else 0"),
    Variable("MMSHM_HASH", "hash", "choice", "lazy",
             "when a handle's BLAKE3 content hash is computed if none is given: lazy on the "
             "first read, eager at creation, in the copy's pass", choices=("lazy", "eager")),
    Variable("MMSHM_COPY_THREADS", "copy_threads", "int", 0,
             "threads that copy (and hash) one large tensor into a segment, the calling one "
             "included; capped by the CPUs of the process's affinity (1: the calling thread "
             "only)", minimum=0, maximum=1024,
             zero="automatic: half the CPUs of the affinity, 1 to 8"),
    Variable("MMSHM_NODE_ID", "node_id", "text", None,
             "overrides this process's node identity (equal values count as one node)"),
    Variable("MMSHM_HANDSHAKE_S", "handshake_s", "seconds", 60.0,
             "a rank's first broadcast on a group waits this long, at most half the group's "
             "timeout, for every peer's mmshm",
             minimum=0, above_minimum=True, maximum=3600),
    Variable("MMSHM_INSTRUMENT", None, "instrumentors", None,
             "instrumentors `mmshm run` loads, or none; each active only in a process that "
             "imports its server", default_text="every registered one (sglang,vllm)"),
    Variable("MMSHM_METRICS_PORT", None, "port", None,
             "start a standalone Prometheus exporter on this port", minimum=0, maximum=65535),
    Variable("MMSHM_METRICS_ADDR", None, "text", "127.0.0.1",
             "the standalone exporter's listen address", allowed_text="an address to listen on"),
    Variable("MMSHM_METRICS_REFRESH_S", None, "seconds", 5.0,
             "how often the directory gauges (mmshm_dir_free_bytes ...) are refreshed",
             minimum=0, zero="only on demand"),
)
BY_NAME = {v.name: v for v in VARIABLES}
# set by `mmshm run` for its start-up hook, or read by other modules / the tests
_INTERNAL = ("MMSHM_AUTOPATCH_", "MMSHM_DEBUG_", "MMSHM_TEST_", "MMSHM_CHAOS_",
             "MMSHM_SGLANG_", "MMSHM_VLLM_")


def parse_variable(var: Variable, environ=None) -> tuple[object, str]:
    """``(value, source)`` of one variable: source is ``"environment"`` or
    ``"default"``.

    Raises:
        SettingError: the variable is set to a value it does not accept.
    """
    raw = (os.environ if environ is None else environ).get(var.name)
    if raw is None or raw.strip() == "":
        return var.default, "default"
    try:
        return var.parse(raw), "environment"
    except SettingError:
        raise
    except (ValueError, TypeError, OverflowError):
        raise SettingError(var.name, raw, var.allowed) from None


def problems(environ=None) -> list[SettingError]:
    """Every ``MMSHM_*`` variable set to a value mmshm cannot use (empty
    when all is well). Reads the environment; changes nothing."""
    out = []
    for var in VARIABLES:
        try:
            parse_variable(var, environ)
        except SettingError as exc:
            out.append(exc)
    return out


#: Under ``mmshm run``: the file the run's processes append their pids to,
#: and beside it the one they note their other segment directories in.
RUN_PIDS_ENV = "MMSHM_RUN_PIDS"
RUN_DIRS_FILE = "dirs"


def note_segment_dir(directory: str) -> None:
    """Under ``mmshm run``: record that this process uses the segment
    directory ``directory`` besides ``MMSHM_DIR`` (an EC connector's
    ``directory`` setting), so that what the server's processes leave there
    is reclaimed once the command has exited too
    (:func:`mmshm.operations.autopatch.run_dirs`). Never raises."""
    pids = os.environ.get(RUN_PIDS_ENV)
    if not pids or not directory:
        return
    try:
        fd = os.open(os.path.join(os.path.dirname(pids), RUN_DIRS_FILE),
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, os.fsencode(os.path.realpath(directory)) + b"\n")
        finally:
            os.close(fd)
    except OSError:
        pass


def unknown_variables(environ=None) -> list[str]:
    """``MMSHM_*`` names set in the environment that mmshm does not read
    (typos such as ``MMSHM_MINBYTES``)."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith("MMSHM_") and k not in BY_NAME
                  and not k.startswith(_INTERNAL))


def check(environ=None) -> None:
    """Raise the first :class:`SettingError` among :func:`problems`, if any
    (the CLI's commands call it first, and exit with :data:`EXIT_BAD_SETTING`)."""
    bad = problems(environ)
    if bad:
        raise bad[0]


def min_free_bytes(fs_size: int) -> int:
    """The reserve in force for a file system of ``fs_size`` bytes."""
    v = get().min_free_bytes
    return default_min_free_bytes(fs_size) if v is None else v


def arena_bytes(fs_size: int, cuda: bool) -> int:
    """The arena's size in force (bytes; 0: off) for a file system of ``fs_size``
    bytes, in a process where CUDA is available (``cuda``) or not: the
    ``MMSHM_ARENA_BYTES`` set, else :func:`default_arena_bytes` with CUDA and 0
    without."""
    v = get().arena_bytes
    if v is not None:
        return v
    return default_arena_bytes(fs_size) if cuda else 0


def pool_max_bytes(fs_size: int) -> int:
    """Most idle pooled bytes one process keeps, for a file system of
    ``fs_size`` bytes."""
    v = get().pool_max_bytes
    return default_pool_max_bytes(fs_size) if v is None else v


@dataclass(frozen=True)
class Settings:
    """The settings of this process: one attribute per :class:`Variable`
    with a ``field`` (its default is the declaration's)."""

    dir: str
    min_bytes: int
    disable: bool
    sweep_interval_s: float
    min_free_bytes: int | None
    max_bytes: int
    fd_reserve: int
    reap_interval_s: float
    pool: bool
    pool_idle_s: float
    pool_max_bytes: int | None
    arena_bytes: int | None
    node_id: str | None
    hash: str
    copy_threads: int
    in_flight_grace_s: float
    debug_refs: bool
    mode: str
    handshake_s: float

    @property
    def observe(self) -> bool:
        """Observe mode (``MMSHM_MODE=observe``): time the server's own
        transport, carry nothing (see :mod:`mmshm.hooks.observe`)."""
        return self.mode == "observe"


_settings: Settings | None = None


_warned: set[tuple[str, str]] = set()


def reload(warn: bool = True) -> Settings:
    """Re-read the environment and return the new settings.

    A variable set to a value it does not accept takes its default instead,
    and (with ``warn``) logs one WARNING naming it, once per value and
    process. Never raises on a bad value: see :func:`check` for that.
    """
    global _settings
    _settings = Settings(**{var.field: value(var.name, warn=warn) for var in VARIABLES
                            if var.field is not None})
    return _settings


def value(name: str, environ=None, warn: bool = True) -> object:
    """The value of the variable ``name`` in ``environ`` (default
    ``os.environ``), or its default when unset or bad; a bad value logs (with
    ``warn``) one WARNING naming the variable, once per value and process.
    Never raises on a bad value. For the variables without a
    :class:`Settings` field, read where they are used.

    Raises:
        KeyError: ``name`` is no declared variable.
    """
    var = BY_NAME[name]
    try:
        return parse_variable(var, environ)[0]
    except SettingError as exc:
        if warn and (exc.variable, exc.value) not in _warned:
            _warned.add((exc.variable, exc.value))
            log.warning("mmshm: %s; using the default (%s)", exc,
                        "its computed default" if var.default is None else var.default)
        return var.default


def get() -> Settings:
    """Return the cached settings (read from the environment on first use)."""
    return _settings if _settings is not None else reload()


# -- the segment directory: one wording for "it cannot hold segments" -----------------
@dataclass(frozen=True)
class DirProblem:
    """Why a segment directory cannot hold segments, worded once for the
    library's WARNING (:meth:`mmshm.segments.table.SegmentTable.ensure_dir`),
    ``mmshm doctor``, ``status``, ``gc``, ``config`` and ``bench``
    (:func:`dir_problem` finds it).

    Attributes:
        directory: the directory, as given.
        reason: why, e.g. ``"its parent /srv does not exist"``.
        where: what named it: ``"MMSHM_DIR"`` (or its default), or the
            command's option (``"--dir"``, ``"--shm-dir"``).
    """

    directory: str
    reason: str
    where: str = "MMSHM_DIR"

    @property
    def problem(self) -> str:
        """``the segment directory MMSHM_DIR=/x cannot hold segments: <reason>``."""
        return (f"the segment directory {self.where}={self.directory} cannot hold segments: "
                f"{self.reason}")

    @property
    def fix(self) -> str:
        """What to do: point it at a writable directory on a tmpfs."""
        return (f"point {self.where} at a writable directory on a tmpfs, e.g. /dev/shm or a "
                f"directory under it"
                + ("" if self.where == "MMSHM_DIR" else " (servers read MMSHM_DIR)"))

    def message(self, meanwhile: str = "") -> str:
        """One line: the problem, ``meanwhile`` (what happens until it is
        fixed) when given, and the fix."""
        return self.problem + (f"; {meanwhile}" if meanwhile else "") + f". Fix: {self.fix}"

    def __str__(self) -> str:
        return self.message()


def dir_problem(directory: str, *, create: bool = True,
                where: str = "MMSHM_DIR") -> DirProblem | None:
    """Why ``directory`` cannot hold segments, or None if it can. Only looks:
    nothing is created or changed.

    Args:
        directory: the segment directory (``MMSHM_DIR``, or a command's option).
        create: True for a process that makes segments: a missing directory
            whose parent exists and is writable is fine (the library creates
            it, mode 0700, at its first segment); the directory must be
            writable. False for the commands that look at an existing one
            (``status``, ``gc``, ``doctor``, ``bench``): it must exist and be
            readable.
        where: what named it, for the message (:attr:`DirProblem.where`).
    """
    import stat

    def problem(reason: str) -> DirProblem:
        return DirProblem(directory, reason, where)

    try:
        st = os.stat(directory)
    except FileNotFoundError:
        parent = os.path.dirname(directory.rstrip("/")) or "/"
        if not os.path.isdir(parent):
            return problem(f"its parent {parent} does not exist")
        if not create:
            return problem("it does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            return problem(f"it does not exist and this process cannot create it in {parent} "
                           f"(permissions or a read-only mount)")
        return None
    except OSError as exc:
        return problem(f"it cannot be read ({exc.strerror})")
    if not stat.S_ISDIR(st.st_mode):
        return problem("it is not a directory")
    if create and not os.access(directory, os.W_OK | os.X_OK):
        return problem("this process cannot write to it (permissions or a read-only mount)")
    if not create and not os.access(directory, os.R_OK | os.X_OK):
        return problem("this process cannot read it (permissions)")
    return None
