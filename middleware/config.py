"""Configuration from ``MMSHM_*`` environment variables.

The settings are read once per process and cached; :func:`reload` re-reads
them (tests change the environment and call it).

Variables:
    MMSHM_DIR: directory that holds segments (default ``/dev/shm``).
    MMSHM_MIN_BYTES: tensors smaller than this many bytes stay inline
        (default 65536: below that, pickling is cheaper than a segment).
    MMSHM_DISABLE: ``1`` turns the transport off; everything travels inline.
    MMSHM_MODE: ``shm`` (default): mmshm carries the multimodal tensors.
        ``observe``: the server's own transport carries them, untouched, and
        mmshm only times each hop (``mmshm_ipc_seconds``, ``mmshm_ipc_bytes``
        with ``transport="server"``; see :mod:`mmshm.observe`). ``mmshm run
        --observe`` sets it.
    MMSHM_SWEEP_INTERVAL_S: seconds between sweeps of a producer's finished
        segments (default 1.0).
    MMSHM_MIN_FREE_BYTES: budget guard reserve: a segment is not created if it
        would leave less than this many bytes free in the segment directory.
        Default: 5% of the file system, at least 16 MiB and at most 1 GiB. NCCL
        keeps its own intra-node buffers in /dev/shm (``nccl-*`` files: a few
        MiB per rank with P2P, up to several hundred MiB when it falls back to
        its SHM transport); 16 MiB keeps NCCL's start-up working in Docker's
        64 MiB default while still letting one 22 MB Qwen2-VL image through,
        and 5% scales the headroom on large tmpfs mounts.
    MMSHM_MAX_BYTES: optional cap on the bytes of shared memory this process's
        live segments may hold (0 = no cap).
    MMSHM_FD_RESERVE: descriptors kept free for the server: segment creation
        and attach fail with EMFILE (inline fallback) once the process's
        descriptor numbers reach RLIMIT_NOFILE minus this (default 64).
    MMSHM_POOL: ``0`` turns the warm segment pool off (every segment is
        created fresh and unlinked by its last release). Default on.
    MMSHM_POOL_IDLE_S: seconds an idle pooled segment is kept (default 10).
    MMSHM_POOL_MAX_BYTES: most bytes of idle pooled segments one process keeps
        (default: a quarter of the file system, at most 2 GiB).
    MMSHM_REAP_INTERVAL_S: the reaper runs at most once per this many seconds
        per segment directory on process start-up, and this often in
        long-lived processes (default 60; 0 disables the automatic runs).
    MMSHM_IN_FLIGHT_GRACE_S: seconds a segment whose references are in
        flight (pickled handles not yet opened) is kept by the reaper after
        every process that had it open closed it cleanly, e.g. its writer
        exited with requests still queued (default 300: longer than a busy
        server's queues hold a request). A segment a killed process held is
        reclaimed at once whatever this says (see :mod:`mmshm.reaper`).
    MMSHM_DEBUG_REFS: ``1`` records, in each process, where every reference
        was taken and given back, reports references still held at exit with
        their stacks, and names the call that gave back the last reference
        when a handle is used after it (see :mod:`mmshm.refdebug`). Off by
        default: no cost then.
    MMSHM_HASH: when a handle's BLAKE3-128 content hash is computed when
        none is given. ``lazy`` (default): on the first read of
        :attr:`mmshm.ShmTensor.hash`, in whichever process asks, from the
        segment's bytes (once per segment and process; a handle pickled after
        that carries it). ``eager``: at creation, on the producer, so it
        travels with every handle (costs about 2.4x the copy: BLAKE3 runs at
        about 5 GB/s per core, a warm memcpy at about 12 GB/s).
    MMSHM_NODE_ID: overrides this process's node identity (see
        :mod:`mmshm.node`). Ranks with the same value count as one node, ranks
        with different values as different nodes, whatever the system says. A
        decimal integer below 2**32 is used as the node id itself; any other
        string is hashed. Unset (the default): the identity comes from the
        system (boot id, IPC and mount namespace, segment directory). Meant for
        tests and for simulating several nodes on one machine.
    MMSHM_HANDSHAKE_S: seconds a rank's first broadcast on a process group
        waits for every peer rank to announce the same mmshm (default 60; see
        :func:`mmshm.node.handshake`). A peer that never does (no mmshm on its
        node, or another version) makes the whole group carry its tensors
        inline, with a WARNING naming it.

Bad values: a value a variable does not accept never stops a process. The
settings fall back to that variable's default and log one WARNING naming the
variable, the value and what is allowed (a server keeps running). The
``mmshm`` commands check first (:func:`check`) and exit with
:data:`EXIT_BAD_SETTING` and that one line. :data:`VARIABLES` lists every
variable with what it accepts; ``mmshm config`` prints the values in effect.
Sizes accept units (:func:`parse_size`: ``720M``, ``2GiB``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .errors import MmshmError

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


def _nonneg_int(raw: str) -> int:
    v = int(raw.strip())
    if v < 0:
        raise ValueError(raw)
    return v


def _size(raw: str) -> int:
    return parse_size(raw)


def _seconds(minimum_exclusive: bool, maximum: float | None = None
             ) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        v = float(raw.strip())
        if v != v or v in (float("inf"),) or v < 0 or (minimum_exclusive and v == 0):
            raise ValueError(raw)
        if maximum is not None and v > maximum:
            raise ValueError(raw)
        return v
    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        v = raw.strip().lower()
        if v not in choices:
            raise ValueError(raw)
        return v
    return parse


def _port(raw: str) -> int:
    v = int(raw.strip())
    if not 0 <= v <= 65535:
        raise ValueError(raw)
    return v


def _text(raw: str) -> str:
    return raw.strip()


def known_instrumentors() -> list[str]:
    """Names ``MMSHM_INSTRUMENT`` may list: the registered instrumentors
    (:func:`mmshm.instrumentor.registered`, the ``mmshm.instrumentors``
    entry points)."""
    from .instrumentor import registered

    return sorted(registered())


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


def _instrument(raw: str) -> str:
    instrument_names(raw)
    return raw.strip()


@dataclass(frozen=True)
class Variable:
    """One ``MMSHM_*`` setting: how it is parsed and what it accepts.

    Attributes:
        name: the environment variable.
        field: the :class:`Settings` attribute it sets (None: read elsewhere,
            validated here).
        parse: turns the raw text into the value; raises ValueError (or
            SettingError) on a bad one.
        default: the value used when unset or bad.
        allowed: what it accepts, in words (for errors).
        meaning: one line for ``mmshm config``.
    """

    name: str
    field: str | None
    parse: Callable[[str], object]
    default: object
    allowed: str
    meaning: str


_BOOL = "1 or 0 (also true/false, yes/no, on/off)"
VARIABLES: tuple[Variable, ...] = (
    Variable("MMSHM_DIR", "dir", _text, "/dev/shm", "a directory path",
             "segment directory (a tmpfs)"),
    Variable("MMSHM_MIN_BYTES", "min_bytes", _size, 65536, SIZE_SYNTAX,
             "smaller tensors stay inline"),
    Variable("MMSHM_DISABLE", "disable", _bool, False, _BOOL, "1: everything travels inline"),
    Variable("MMSHM_MODE", "mode", _choice("shm", "observe"), "shm", "shm or observe",
             "shm: mmshm carries the tensors; observe: the server's own transport carries "
             "them and mmshm only times each hop (mmshm run --observe)"),
    Variable("MMSHM_SWEEP_INTERVAL_S", "sweep_interval_s", _seconds(True), 1.0,
             "a number of seconds above 0", "seconds between sweeps of finished segments"),
    Variable("MMSHM_MIN_FREE_BYTES", "min_free_bytes", _size, None, SIZE_SYNTAX,
             "budget guard reserve kept free (NCCL headroom)"),
    Variable("MMSHM_MAX_BYTES", "max_bytes", _size, 0, SIZE_SYNTAX,
             "cap on one process's live segment bytes (0: none)"),
    Variable("MMSHM_FD_RESERVE", "fd_reserve", _nonneg_int, 64, "an integer >= 0",
             "descriptors kept free below RLIMIT_NOFILE"),
    Variable("MMSHM_REAP_INTERVAL_S", "reap_interval_s", _seconds(False), 60.0,
             "a number of seconds >= 0 (0: off)", "automatic reaper period"),
    Variable("MMSHM_IN_FLIGHT_GRACE_S", "in_flight_grace_s", _seconds(False), 300.0,
             "a number of seconds >= 0",
             "in-flight segments are kept this long after a clean exit"),
    Variable("MMSHM_DEBUG_REFS", "debug_refs", _bool, False, _BOOL,
             "1: record where each reference was taken and given back"),
    Variable("MMSHM_POOL", "pool", _bool, True, _BOOL, "warm segment pool"),
    Variable("MMSHM_POOL_IDLE_S", "pool_idle_s", _seconds(False), 10.0,
             "a number of seconds >= 0", "idle pooled segments are unlinked after this"),
    Variable("MMSHM_POOL_MAX_BYTES", "pool_max_bytes", _size, None, SIZE_SYNTAX,
             "idle pooled bytes one process keeps"),
    Variable("MMSHM_HASH", "hash", _choice("lazy", "eager"), "lazy", "lazy or eager",
             "when a handle's content hash is computed"),
    Variable("MMSHM_NODE_ID", "node_id", _text, None, "any text",
             "overrides this process's node identity"),
    Variable("MMSHM_HANDSHAKE_S", "handshake_s", _seconds(True, maximum=3600.0), 60.0,
             "a number of seconds above 0, at most 3600",
             "a rank's first broadcast on a group waits this long for every peer's mmshm"),
    Variable("MMSHM_INSTRUMENT", None, _instrument, None,
             "a comma-separated list of instrumentors (sglang, vllm), or none",
             "instrumentors `mmshm run` loads (unset: sglang,vllm, each active only in a process that imports its server)"),
    Variable("MMSHM_METRICS_PORT", None, _port, None, "a port number, 0 to 65535",
             "start a standalone Prometheus exporter on this port"),
    Variable("MMSHM_METRICS_ADDR", None, _text, "127.0.0.1", "an address to listen on",
             "the standalone exporter's address"),
    Variable("MMSHM_METRICS_REFRESH_S", None, _seconds(True), 5.0,
             "a number of seconds above 0", "how often directory gauges are refreshed"),
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


def default_min_free_bytes(fs_size: int) -> int:
    """The default budget reserve for a file system of ``fs_size`` bytes."""
    return int(min(max(16 << 20, fs_size * 0.05), 1 << 30))


def min_free_bytes(fs_size: int) -> int:
    """The reserve in force for a file system of ``fs_size`` bytes."""
    v = get().min_free_bytes
    return default_min_free_bytes(fs_size) if v is None else v


def pool_max_bytes(fs_size: int) -> int:
    """Most idle pooled bytes one process keeps, for a file system of
    ``fs_size`` bytes."""
    v = get().pool_max_bytes
    return int(min(fs_size // 4, 2 << 30)) if v is None else v


@dataclass(frozen=True)
class Settings:
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
    node_id: str | None = None
    hash: str = "lazy"
    in_flight_grace_s: float = 300.0
    debug_refs: bool = False
    mode: str = "shm"
    handshake_s: float = 60.0

    @property
    def observe(self) -> bool:
        """Observe mode (``MMSHM_MODE=observe``): time the server's own
        transport, carry nothing (see :mod:`mmshm.observe`)."""
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
    values = {}
    for var in VARIABLES:
        if var.field is None:
            continue
        try:
            values[var.field] = parse_variable(var)[0]
        except SettingError as exc:
            values[var.field] = var.default
            if warn and (exc.variable, exc.value) not in _warned:
                _warned.add((exc.variable, exc.value))
                log.warning("mmshm: %s; using the default (%s)", exc,
                            "its computed default" if var.default is None else var.default)
    _settings = Settings(**values)
    return _settings


def get() -> Settings:
    """Return the cached settings (read from the environment on first use)."""
    return _settings if _settings is not None else reload()
