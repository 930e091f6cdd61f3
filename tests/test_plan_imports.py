"""hp_lazy.plan and hp_lazy.lower import downward only: no module of theirs is on an import cycle,
counting imports inside functions too (a cycle hidden in a function is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

import hp_lazy

PACKAGE = Path(hp_lazy.__file__).parent
CHECKED = ("hp_lazy.plan", "hp_lazy.lower")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, known: set[str]) -> set[str]:
    """hp_lazy modules ``path`` imports anywhere in its body (``from pkg import sub`` is ``pkg.sub``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            out |= subs or {node.module}
    return out & known


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module, or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_plan_and_lower_are_on_no_import_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(path, set(modules)) for name, path in modules.items()}
    assert graph["hp_lazy.plan.plan"] >= {"hp_lazy.plan.parse", "hp_lazy.plan.slice"}  # the checker reads imports
    bad = [sorted(c) for c in _cycles(graph) if any(m.startswith(CHECKED) for m in c)]
    assert bad == []
