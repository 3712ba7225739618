"""Instrumentors: one module per server, glue only (all logic is in the core).

Each instrumentor class has:
    name: str                 -- "sglang", "vllm"
    package: str              -- the distribution whose version is checked
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


def installed_version(package: str) -> Version | None:
    """The installed version of a distribution, or None."""
    try:
        return Version(metadata.version(package))
    except metadata.PackageNotFoundError:
        return None


def check_version(package: str, supported: str) -> Version:
    """Return the installed version; raise :class:`UnsupportedVersionError`
    if it is missing or outside ``supported``."""
    v = installed_version(package)
    if v is None:
        raise UnsupportedVersionError(f"{package} is not installed")
    if v not in SpecifierSet(supported):
        raise UnsupportedVersionError(
            f"{package} {v} is outside mmshm's supported range {supported}; nothing was "
            f"patched (set MMSHM_INSTRUMENT to skip it)")
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
