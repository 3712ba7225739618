"""The layout is the architecture: one ordered list of layers, checked on the source.

``mmshm`` is ``middleware/`` (the core, in sub-packages), plus ``metrics/``,
``integrations/`` and ``bench/``. :data:`LAYERS` lists them bottom-up; a module
may import only what is listed before it or at its own place. Checked with
``ast``, so a lazy import inside a function, a relative import,
``importlib.import_module("mmshm...")`` and ``__import__`` count as much as a
top-level ``import``. The import graph of all of mmshm has no cycle, lazy
imports included, and the core never imports a server.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "middleware"
SERVERS = ("sglang", "vllm")
#: where each top-level package of the distribution lives (pyproject's package-dir)
PACKAGES = {"mmshm": CORE, "mmshm.metrics": ROOT / "metrics",
            "mmshm.integrations": ROOT / "integrations", "mmshm.bench": ROOT / "bench"}

#: The layers, bottom-up. A module belongs to the longest entry that is its name
#: or a package above it; it may import modules of its own entry or of entries
#: before it, never one after. Within the core's sub-packages the modules are
#: listed in their own order, so that order is part of the rule; a module a
#: sub-package gains without being listed belongs to the package's entry, the
#: last of its block (it may use the whole sub-package; nothing listed uses it).
LAYERS: list[str] = [
    # 0: the errors, the settings, and the package root (its eager part: the
    # errors it re-exports, __version__; its lazy public API wires the layers
    # together, see ROOT_LAZY_EXEMPT)
    "mmshm.errors",
    "mmshm.config",
    "mmshm",
    # 1: Prometheus metrics
    "mmshm.metrics",
    # 2: the hooks: the instrumentor, the "on:" lines, the hop timer; no transport
    "mmshm.hooks.report",
    "mmshm.hooks.observe",
    "mmshm.hooks.instrumentor",
    "mmshm.hooks",
    # 3: the segments: files, owners, handles
    "mmshm.segments.node",
    "mmshm.segments.segfile",
    "mmshm.segments.reaper",
    "mmshm.segments.table",
    "mmshm.segments.segment",
    "mmshm.segments.codec",
    "mmshm.segments.refdebug",
    "mmshm.segments.arena",
    "mmshm.segments.shmtensor",
    "mmshm.segments",
    # 4: the transport: wrap/unwrap, one hop's two ends, the broadcast
    "mmshm.transport.wrapping",
    "mmshm.transport.sending",  # knows nothing of the receiving side
    "mmshm.transport.receiving",
    "mmshm.transport.fanout",
    "mmshm.transport.topology",
    "mmshm.transport.handshake",
    "mmshm.transport.shmagree",
    "mmshm.transport.agreement",
    "mmshm.transport.multinode",
    "mmshm.transport.broadcast",
    "mmshm.transport",
    # 5: one package per server
    "mmshm.integrations",
    # 6: operations, then the bench (which may use them)
    "mmshm.operations.status",
    "mmshm.operations.doctor",
    "mmshm.operations.autopatch",
    "mmshm.operations",
    "mmshm.bench",
    # 7: the command line
    "mmshm.cli",
]

#: The package root's imports inside functions are its lazy public API
#: (``mmshm.wrap``, ``mmshm.ShmTensor``... through PEP 562) and the names
#: ``MMSHM_INSTRUMENT`` may list (handed to mmshm.config): the one place that
#: wires the layers together. They still count for cycles.
ROOT_LAZY_EXEMPT = True


# -- reading the source ------------------------------------------------------------------
def modules(packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    """Every module of ``packages``: dotted name -> file (``pkg/__init__.py`` is ``pkg``)."""
    out: dict[str, Path] = {}
    for pkg, top in packages.items():
        for f in sorted(top.rglob("*.py")):
            rel = f.relative_to(top).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(p.startswith(".") or p == "__pycache__" or "-" in p for p in parts):
                continue
            name = ".".join([pkg, *parts])
            # a nested top-level package (mmshm.metrics in middleware/metrics) is its own
            if name not in out:
                out[name] = f
    return out


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _resolve(pkg: str, level: int, module: str | None) -> str:
    base = pkg.split(".")
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _lazy_names(path: Path) -> dict[str, str]:
    """The root's PEP 562 table: public name -> module (relative to mmshm)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_LAZY"
                                                  for t in node.targets)):
            return {k.value: "mmshm." + v.value
                    for k, v in zip(node.value.keys, node.value.values)}
    return {}


def imports(name: str, path: Path, known: set[str], lazy: dict[str, str]
            ) -> list[tuple[int, str, bool]]:
    """``(line, module, in a function)`` for each module of ``known`` that the
    module ``name`` (file ``path``) imports. ``from pkg import x`` counts ``pkg.x``
    when that is a module, else ``pkg``; ``from mmshm import ShmTensor`` counts the
    module the root loads it from (:data:`_LAZY`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = _package(name, path)
    found: list[tuple[int, str, bool]] = []

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST, in_fn: bool) -> None:
        for child in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = (_resolve(pkg, child.level, child.module) if child.level
                        else child.module or "")
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    if sub in known:
                        targets.append(sub)
                    elif base == "mmshm" and a.name in lazy:
                        targets.append(lazy[a.name])
                    else:
                        targets.append(base)
            elif isinstance(child, ast.Call) and child.args:
                f = child.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                arg = child.args[0]
                if (called in ("import_module", "__import__")
                        and isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                    target = arg.value
                    if target.startswith(".") and len(child.args) > 1:
                        continue  # relative to a computed package: not a constant
                    targets = [target]
            for t in targets:
                m = owner(t)
                if m is not None and m != name:
                    found.append((child.lineno, m, fn))
            visit(child, fn)

    visit(tree, False)
    return found


def graph(packages: dict[str, Path] = PACKAGES) -> dict[str, list[tuple[int, str, bool]]]:
    mods = modules(packages)
    known = set(mods)
    lazy = _lazy_names(mods["mmshm"]) if "mmshm" in mods else {}
    return {name: imports(name, path, known, lazy) for name, path in mods.items()}


# -- the rules -----------------------------------------------------------------------------
def layer_of(name: str, layers: list[str] = LAYERS) -> int | None:
    """The index in ``layers`` of the longest entry that is ``name`` or above it."""
    best = None
    for i, entry in enumerate(layers):
        if name == entry or name.startswith(entry + "."):
            if best is None or len(entry) > len(layers[best]):
                best = i
    return best


def upward_imports(g, layers: list[str] = LAYERS) -> list[str]:
    """``importer:line -> imported`` for each import of a module of a later layer."""
    bad = []
    for name, edges in sorted(g.items()):
        mine = layer_of(name, layers)
        for line, target, in_fn in edges:
            if ROOT_LAZY_EXEMPT and name == "mmshm" and in_fn:
                continue
            theirs = layer_of(target, layers)
            if mine is None or theirs is None or theirs > mine:
                bad.append(f"{name}:{line} -> {target}")
    return bad


def cycles(g) -> list[list[str]]:
    """The import cycles of ``g`` (each strongly connected component of more
    than one module, or a module importing itself), lazy imports included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    succ = {n: sorted({t for _, t, _ in edges if t in g}) for n, edges in g.items()}

    def strong(v: str) -> None:  # Tarjan, iteratively deep enough for a few hundred modules
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in succ[v]:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


# -- the tests -----------------------------------------------------------------------------
def test_every_module_has_a_layer():
    g = graph()
    assert "mmshm.segments.shmtensor" in g and "mmshm.integrations" in g
    assert [n for n in sorted(g) if layer_of(n) is None] == []


def test_no_module_imports_a_higher_layer():
    assert upward_imports(graph()) == []


def test_mmshm_has_no_import_cycle():
    assert cycles(graph()) == []


def test_the_checks_can_fail(tmp_path):
    """An upward import (lazy, relative, absolute or through importlib) and a
    cycle of lazy imports, in a made-up package laid out as mmshm is."""
    core = tmp_path / "middleware"
    for sub in ("segments", "transport"):
        (core / sub).mkdir(parents=True)
        (core / sub / "__init__.py").write_text("")
    (core / "__init__.py").write_text("_LAZY = {'wrap': 'transport.wrapping'}\n")
    (core / "errors.py").write_text("")
    (core / "segments" / "segfile.py").write_text(
        "from mmshm.errors import x\n"
        "def f():\n    from ..transport import wrapping\n")  # up, lazy, relative
    (core / "segments" / "table.py").write_text(
        "import importlib\n"
        "def f():\n    importlib.import_module('mmshm.transport.broadcast')\n"  # up, importlib
        "def g():\n    from . import segment\n")  # table <-> segment, lazily
    (core / "segments" / "segment.py").write_text("from mmshm.segments import table\n")
    (core / "transport" / "wrapping.py").write_text("from mmshm.segments import segfile\n")
    (core / "transport" / "broadcast.py").write_text("from mmshm import wrap\n")
    g = graph({"mmshm": core})
    layers = ["mmshm", "mmshm.errors", "mmshm.segments.segfile", "mmshm.segments.table",
              "mmshm.segments.segment", "mmshm.segments", "mmshm.transport.wrapping",
              "mmshm.transport"]
    assert upward_imports(g, layers) == [
        "mmshm.segments.segfile:3 -> mmshm.transport.wrapping",
        "mmshm.segments.table:3 -> mmshm.transport.broadcast",
        "mmshm.segments.table:5 -> mmshm.segments.segment",
    ]
    assert cycles(g) == [["mmshm.segments.segfile", "mmshm.transport.wrapping"],
                         ["mmshm.segments.segment", "mmshm.segments.table"]]
    # `from mmshm import wrap` is an import of the module the root loads it from
    assert g["mmshm.transport.broadcast"] == [(1, "mmshm.transport.wrapping", False)]
    # a module no entry names belongs to its package's entry; outside mmshm, to none
    assert layer_of("mmshm.segments.new", layers) == layers.index("mmshm.segments")
    assert layer_of("other", layers) is None


# -- the core never imports a server -------------------------------------------------------
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
