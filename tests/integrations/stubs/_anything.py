"""A permissive stand-in used by the stub packages (triton, torchvision,
sgl_kernel): SGLang imports them at module level, but the CPU code paths the
integration tests drive never run a kernel."""

from __future__ import annotations

import sys
import types
from typing import ClassVar


class Anything:
    """Any attribute, call, subscript or decorator use returns something usable."""

    def __init__(self, name: str = "stub"):
        self._name = name

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Anything(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a bare decorator
        return Anything(f"{self._name}()")

    def __getitem__(self, item):
        return Anything(f"{self._name}[]")

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __repr__(self):
        return f"<stub {self._name}>"

    def __mro_entries__(self, bases):
        return (object,)


class NoDevice:
    """Raises on any use: code that probes for a GPU falls back to CPU."""

    def __getattr__(self, name):
        raise RuntimeError("no GPU: triton is stubbed")


class _PermissiveType(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Anything(f"{cls.__name__}.{name}")


class StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():  # a class: usable with isinstance() and as a base
            value = _PermissiveType(name, (), {"__module__": self.__name__,
                                               "__init__": lambda self, *a, **kw: None})
        else:
            value = Anything(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder:
    """Creates a permissive stub for any submodule of a stubbed package."""

    roots: ClassVar[set[str]] = set()

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        import importlib.machinery

        if fullname.split(".", 1)[0] not in cls.roots or fullname in cls.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, cls, is_package=True)

    @staticmethod
    def create_module(spec):
        mod = StubModule(spec.name)
        mod.__path__ = []
        return mod

    @staticmethod
    def exec_module(module):
        pass


def install(name: str, **attrs) -> StubModule:
    """Turn ``sys.modules[name]`` (a stub package) into a permissive module
    whose submodules, whatever their name, are permissive stubs too."""
    mod = sys.modules[name]
    mod.__class__ = StubModule
    for k, v in attrs.items():
        setattr(mod, k, v)
    _Finder.roots.add(name)
    if _Finder not in sys.meta_path:
        sys.meta_path.append(_Finder)
    return mod
