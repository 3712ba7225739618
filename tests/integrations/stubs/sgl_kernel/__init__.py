"""Stub of sgl_kernel for SGLang 0.5.9 on CPU (tests only)."""
import _anything

_anything.install(__name__, __version__="0.3.21")
