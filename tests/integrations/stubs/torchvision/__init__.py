"""Stub of torchvision (PyPI's build fails beside CPU torch; tests only)."""
import _anything

_anything.install(__name__, __version__="0.28.0")
