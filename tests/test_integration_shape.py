"""The machinery every integration shares (:mod:`mmshm.hooks`): one target row
declares both modes, one hop timer times a wrapper as it declares, one role
record says a process's "on:" line in either mode; and both integrations are
packages of the same shape. The servers' own hooks are tested against the real
SGLang and vLLM code (tests/integrations)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from mmshm.hooks import instrumentor, observe, report
from mmshm.hooks.instrumentor import OBSERVE, SHM, Instrumentor, Role, Target

from tests.harness.metrics import metric

ROOT = Path(__file__).resolve().parent.parent


def _calls(tag, log):
    def wrapper(wrapped, instance, args, kwargs):
        log.append(tag)
        return wrapped(*args, **kwargs)

    return wrapper


def test_one_row_declares_both_modes():
    log: list[str] = []
    shm, obs = _calls("shm", log), _calls("observe", log)

    def hop(inner=observe.passthrough):
        def wrapper(wrapped, instance, args, kwargs):
            log.append("hop")
            return inner(wrapped, instance, args, kwargs)

        return wrapper

    both = Target("m", "f", shm, obs, hop)
    for mode, want in ((SHM, ["hop", "shm"]), (OBSERVE, ["hop", "observe"])):
        log.clear()
        assert both.wrapper(mode, None)(lambda: 7, None, (), {}) == 7 and log == want
    same = Target("m", "f", shm)  # observe defaults to the shm wrapper
    assert same.inner(OBSERVE) is shm and same.patches(OBSERVE)
    shm_only = Target("m", "f", shm, None)  # observe mode: the server's own code, checked only
    assert shm_only.patches(SHM) and not shm_only.patches(OBSERVE)
    timed_only = Target("m", "f", hop=hop)  # both modes: the hop around the server's function
    log.clear()
    assert timed_only.wrapper(OBSERVE, None)(lambda: 1, None, (), {}) == 1 and log == ["hop"]
    made = Target("m", "f", lambda original: _calls(original, log), factory=True)
    log.clear()
    made.wrapper(SHM, "the attribute found")(lambda: None, None, (), {})
    assert log == ["the attribute found"]
    assert Target("m", "f", optional=SHM).required(OBSERVE)
    assert not Target("m", "f", optional=SHM).required(SHM)
    assert not Target("m", "f", optional=True).required(OBSERVE)


def test_rows_and_missing_targets_follow_the_mode(mode):
    class Toy(Instrumentor):
        name = "toy-shape"

        def targets(self):
            return [Target("no_such_module_x", "f", optional=SHM),
                    Target("no_such_module_y", "g", only=SHM)]

    toy = Toy()
    mode("shm")
    assert toy.mode == SHM and [t.path for t in toy.rows()] == ["f", "g"]
    assert instrumentor.missing_targets(toy.rows(), SHM) == ["module no_such_module_y"]
    mode("observe")
    assert toy.mode == OBSERVE and [t.path for t in toy.rows()] == ["f"]
    assert toy.missing() == ["module no_such_module_x"]
    assert Instrumentor.of("toy-shape").name == "toy-shape"


def test_the_hop_timer_times_its_wrapper_with_what_it_declares(mode):
    """``timed(...)(inner)``: one observation per call with the bytes that
    ``setup``, the glue and ``nbytes`` count; none where ``skip`` or ``when``
    says so or the call raised; a failing ``nbytes`` is counted in
    ``mmshm_observe_errors_total`` and the call's result goes on."""
    mode("observe")
    lab = {"server": "shape", "hop": "t1", "transport": "server"}
    n = lambda: metric("mmshm_ipc_seconds_count", **lab)  # noqa: E731
    b = lambda: metric("mmshm_ipc_bytes_sum", **lab)  # noqa: E731
    errors = lambda: metric("mmshm_observe_errors_total", server="shape", hop="t1")  # noqa: E731
    n0, b0, e0 = n(), b(), errors()
    seen = []

    def glue(wrapped, instance, args, kwargs):  # mmshm's glue counts its own bytes
        seen.append(observe.current() and observe.current().hop)
        observe.add_bytes(1)
        return wrapped(*args, **kwargs)

    wrapper = observe.timed("shape", lambda a, kw: "t1",
                            when=lambda inst, a, kw: inst != "not a message",
                            setup=lambda t, a, kw: t.add(a[0]),
                            nbytes=lambda out, a, kw: len(out),
                            skip=lambda out, t: out == "skip me")(glue)
    assert wrapper(lambda x: "abc", None, (10,), {}) == "abc"
    assert (n() - n0, b() - b0, seen) == (1, 14, ["t1"])
    assert wrapper(lambda x: "skip me", None, (10,), {}) == "skip me"
    assert wrapper(lambda x: "abc", "not a message", (10,), {}) == "abc"
    assert seen[-1] is None and n() - n0 == 1
    with pytest.raises(KeyError):  # the server's exception goes on, nothing recorded
        wrapper(lambda x: {}[x], None, (10,), {})
    assert n() - n0 == 1
    bad = observe.timed("shape", "t1", nbytes=lambda out, a, kw: 1 // 0)()
    assert bad(lambda: "kept", None, (), {}) == "kept" and n() - n0 == 1
    assert errors() - e0 == 1
    mode("shm")
    observe.timed("shape", "t1")()(lambda: None, None, (), {})
    assert metric("mmshm_ipc_seconds_count", **{**lab, "transport": "mmshm"}) >= 1


def test_one_role_record_says_the_line_of_either_mode(mode, caplog):
    class Toy(Instrumentor):
        name = "toy-role"
        title = "Toy"

    role = Role("frontend", ["a path"], [("another path", "why", "the fix")],
                hops=("h1", "h2"), untimed=[(("h2",), "no tap", "install it")])
    report._reset_for_tests()
    with caplog.at_level(logging.INFO, logger="mmshm"):
        mode("shm")
        Toy().say(role)
        mode("observe")
        Toy().say(Role("worker", hops=role.hops, untimed=role.untimed))
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.endswith(", frontend (pid %d): on: a path" % __import__("os").getpid())
               for line in lines), lines
    assert any("another path is OFF: why. Fix: the fix" in line for line in lines)
    assert any(": on: observe mode: Toy's own transport carries the tensors; timing each hop "
               '(mmshm_ipc_seconds, transport="server") (h1)' in line for line in lines), lines
    assert any("timing of h2 is OFF: no tap. Fix: install it" in line for line in lines)
    report._reset_for_tests()


def test_both_integrations_are_packages_of_one_shape():
    shapes = {name: sorted(p.name for p in (ROOT / "integrations" / name).glob("*.py"))
              for name in ("sglang", "vllm")}
    assert shapes["sglang"] == shapes["vllm"], shapes
    assert {"__init__.py", "requests.py", "workers.py", "pd.py", "epd.py", "timing.py",
            "roles.py", "server.py"} <= set(shapes["sglang"])


def test_timing_is_a_leaf_in_both_integrations():
    """Each server's ``timing.py`` imports, of its own package, only
    ``server.py`` (vLLM's read the engines' input endpoint from
    ``requests.py`` once; it lives in ``server.py`` now)."""
    import ast

    for name in ("sglang", "vllm"):
        tree = ast.parse((ROOT / "integrations" / name / "timing.py").read_text())
        siblings = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                siblings.add(node.module or "")
                if not node.module:
                    siblings.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    f"mmshm.integrations.{name}."):
                siblings.add(node.module.rsplit(".", 1)[1])
        assert siblings <= {"server"}, (name, siblings)


#: The most lines the integrations (every ``integrations/**/*.py``, blank lines
#: and docstrings included, as ``wc -l`` counts them) may hold: the server glue
#: stays glue, and what both servers share lives in the core (the hop timer and
#: its stamps, ``mmshm.hooks.observe``; the registry, ``mmshm.hooks.instrumentor``;
#: request views, queue hops and an EC connector's item keys, ``mmshm.transport``).
MAX_INTEGRATION_LINES = 2300
#: The longest function (or method) the integrations may hold, in lines.
MAX_FUNCTION_LINES = 150


def integration_lines(root: Path = ROOT) -> dict[str, int]:
    """Lines of each integration module (path relative to ``root``)."""
    return {str(p.relative_to(root)): len(p.read_text().splitlines())
            for p in sorted((root / "integrations").rglob("*.py"))
            if "__pycache__" not in p.parts}


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines)`` of each function or method of the
    integrations longer than ``limit`` lines (decorators excluded)."""
    import ast

    out = []
    for rel in integration_lines(root):
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_the_integrations_stay_small():
    lines = integration_lines()
    assert len(lines) >= 17  # the two packages were read
    total = sum(lines.values())
    assert total <= MAX_INTEGRATION_LINES, (
        f"the integrations hold {total} lines (at most {MAX_INTEGRATION_LINES}): move what "
        f"is not server glue to the core (mmshm.transport); by file: {lines}")


def test_no_function_of_the_integrations_is_over_150_lines():
    assert long_functions() == []
