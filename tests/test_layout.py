"""The layout the README describes: ``middleware/`` (``mmshm``) is the transport
core and never imports a server. Checked on the source with ``ast``, so a lazy
import inside a function, ``importlib.import_module("vllm...")`` or
``__import__("sglang")`` count as much as a top-level ``import``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "middleware"
SERVERS = ("sglang", "vllm")


def _is_server(name: str | None) -> bool:
    return bool(name) and name.split(".")[0] in SERVERS


def _server_imports(path: Path) -> list[str]:
    """``file:line name`` for each import of a server package in ``path``."""
    found = []
    label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            arg = node.args[0]
            if (called in ("import_module", "__import__")
                    and isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                names = [arg.value]
        found += [f"{label}:{node.lineno} {n}" for n in names if _is_server(n)]
    return found


def test_the_core_never_imports_a_server():
    files = sorted(CORE.rglob("*.py"))
    assert files
    offenders = [hit for f in files for hit in _server_imports(f)]
    assert offenders == []


def test_the_check_sees_each_kind_of_import(tmp_path):
    probe = tmp_path / "probe.py"
    src = ("import vllm.v1\nfrom sglang.srt import x\nimport importlib\n"
           "def f():\n    importlib.import_module('vllm.multimodal')\n    __import__('sglang')\n"
           "import mmshm\n")
    probe.write_text(src)
    hits = _server_imports(probe)
    assert [h.split()[1] for h in hits] == ["vllm.v1", "sglang.srt", "vllm.multimodal", "sglang"]


def _mmshm_imports(path: Path) -> set[str]:
    """The core modules (``segment``, ``table``...) that ``path`` imports,
    at the top level or in a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            base = (node.module or "").split(".")
            if node.level == 0 and base[0] == "mmshm":
                if len(base) > 1 and base[-1] in _PATHS:
                    out.add(base[-1])
                out.update(a.name for a in node.names if a.name in _PATHS)
            elif node.level == 1:
                if node.module:
                    out.add(base[0])
                else:
                    out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[-1] for a in node.names if a.name.startswith("mmshm."))
    return out


# module -> the core modules above it, which it must never import (nothing below calls back up)
_PATHS = {f.stem: f for f in CORE.rglob("*.py") if f.stem != "__init__"}
ABOVE = {
    # the segment layer: segfile -> reaper -> table -> segment
    "segfile": {"reaper", "table", "segment"},
    "reaper": {"table", "segment"},
    "table": {"segment"},
    "agreement": {"multinode", "broadcast"},
    "shmagree": {"agreement", "multinode", "broadcast"},
    "multinode": {"broadcast"},
    # the integrations' shared machinery: the instrumentor knows no transport,
    # the sending side nothing of the receiving side
    "instrumentor": {"sending", "receiving", "segment", "table", "shmtensor", "wrapping",
                     "broadcast"},
    "sending": {"receiving", "instrumentor", "broadcast"},
    "receiving": {"instrumentor", "broadcast"},
    # per-hop timing knows no transport: it only counts what the hops report
    "observe": {"segment", "shmtensor", "wrapping", "sending", "receiving", "broadcast",
                "instrumentor", "table"},
}


def test_the_segment_layer_and_the_broadcast_import_one_way():
    wrong = {mod: sorted(_mmshm_imports(_PATHS[mod]) & above)
             for mod, above in ABOVE.items()}
    assert {mod: up for mod, up in wrong.items() if up} == {}
