"""The house rules that keep the rooms apart: no import circles inside hp_lazy (function-local
imports included), and lowered code calls only names the runtime module exports."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hp_lazy
from hp_lazy import names

PACKAGE = Path(hp_lazy.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.AST, here: str, modules: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if not isinstance(node, ast.ImportFrom) or node.module is None or not node.module.startswith("hp_lazy"):
        return set()
    out = set()
    for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        out.add(sub if sub in modules else node.module)
    return out & modules


def import_graph() -> dict[str, set[str]]:
    """hp_lazy module -> the hp_lazy modules it imports, anywhere in its body (not the implicit
    parent-package imports)."""
    paths = {p: _module_name(p) for p in PACKAGE.rglob("*.py")}
    modules = set(paths.values())
    graph = {}
    for path, name in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        graph[name] = set().union(*(_targets(n, name, modules) for n in ast.walk(tree))) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _imports_by_string(path: Path, prefix: str) -> list[str]:
    """``importlib.import_module("<prefix>...")`` / ``__import__(...)`` calls with a literal name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and str(node.args[0].value).startswith(prefix):
                found.append(str(node.args[0].value))
    return found


def test_no_import_circles() -> None:
    assert cycles(import_graph()) == []


def test_import_time_half_does_not_name_the_runtime() -> None:
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith(("hp_lazy.plan", "hp_lazy.lower", "hp_lazy.hook")):
            assert not {d for d in deps if d.startswith("hp_lazy.runtime")}, name
            path = PACKAGE.parent / (name.replace(".", "/") + ".py")
            if path.exists():
                assert not _imports_by_string(path, "hp_lazy.runtime"), f"{name} imports the runtime by name"
        if name.startswith("hp_lazy.runtime"):
            assert not {d for d in deps if d.startswith(("hp_lazy.hook", "hp_lazy.api", "hp_lazy.lower"))}, name


def test_emitter_calls_only_runtime_exports() -> None:
    from hp_lazy.runtime import rt

    emitted = set(re.findall(r"\{RT\}\.(\w+)", (PACKAGE / "lower" / "emit.py").read_text(encoding="utf-8")))
    lower_text = "\n".join(p.read_text(encoding="utf-8") for p in (PACKAGE / "lower").glob("*.py"))
    emitted |= set(re.findall(rf"{names.RT}\.(\w+)", lower_text))
    ops = set(re.findall(r'"(\w+_(?:to|from|all))"', (PACKAGE / "plan" / "transitions.py").read_text(encoding="utf-8")))
    assert emitted and ops
    assert (emitted | ops) <= set(rt.__all__), (emitted | ops) - set(rt.__all__)
    for name in rt.__all__:
        assert callable(getattr(rt, name)), name


def test_lowered_golden_code_calls_only_runtime_exports() -> None:
    from hp_lazy.runtime import rt

    golden = Path(__file__).parent / "golden"
    used = set()
    for path in golden.glob("*.lowered.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == names.RT:
                used.add(node.attr)
    assert used and used <= set(rt.__all__), used - set(rt.__all__)
