"""Stub of triton for importing SGLang on CPU (tests only)."""
import _anything


def _decorator(fn=None, **kwargs):
    return fn if fn is not None else (lambda f: f)


_anything.install(
    __name__, __version__="3.5.0", jit=_decorator,
    autotune=lambda *a, **kw: (lambda f: f), heuristics=lambda *a, **kw: (lambda f: f),
    cdiv=lambda a, b: -(-a // b),
    next_power_of_2=lambda n: 1 << (max(int(n), 1) - 1).bit_length())

import triton.runtime

triton.runtime.driver = _anything.NoDevice()  # GPU probes fail: code falls back to CPU

import triton.language

# a class, as in triton: torch's compiler calls isinstance(x, triton.language.dtype)
# (a non-class makes it fail now and then in a TP rank)
triton.language.dtype = type("dtype", (), {"__module__": "triton.language"})
