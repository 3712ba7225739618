"""mmshm's test suite, importable as a package.

Helpers live in :mod:`tests.harness` (``from tests.harness.procs import run_group``);
pytest imports this package from the repository root, so nothing edits
``sys.path``. The scripts under ``tests/scripts`` run as modules from the
root (``python -m tests.scripts.burst``); every test command, main suite and
real servers alike, goes through one runner: ``python -m tests.run``.
"""
