"""Golden lowering tests: tests/golden/<case>.py + <case>.plan.json -> <case>.lowered.py.

Regenerate deliberately with ``HP_LAZY_REGEN_GOLDEN=1 pytest tests/test_lower_golden.py`` and
review the diff.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from hp_lazy.lower import lower
from hp_lazy.lower.facts import module_facts
from hp_lazy.plan.model import Contract, ModulePlan
from hp_lazy.plan.placement import Placement

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(p.name[: -len(".plan.json")] for p in GOLDEN.glob("*.plan.json"))


def _placements(spec: dict) -> dict:
    return {name: {axis: Placement.parse(text) for axis, text in axes.items()} for name, axes in spec.items()}


def _contract(raw: dict) -> Contract:
    sides = {k: _placements(raw.get(k, {})) for k in ("in_src", "in_dst", "out_src", "out_dst", "params")}
    return Contract(
        pattern=raw["pattern"],
        deferred_bias_params=tuple(raw.get("deferred_bias_params", ())),
        skip_source_lowering=raw.get("skip_source_lowering", False),
        **sides,
    )


def module_plan(raw: dict) -> ModulePlan:
    return ModulePlan(
        module=raw["module"],
        plan_hash="golden",
        mesh=raw["mesh"],
        contracts=tuple(_contract(c) for c in raw["contracts"]),
        classes=raw["classes"],
        roots=tuple(raw.get("roots", ())),
    )


def load(case: str) -> tuple[str, ModulePlan]:
    raw = json.loads((GOLDEN / f"{case}.plan.json").read_text())
    return (GOLDEN / f"{case}.py").read_text(), module_plan(raw)


def _impl_lines(tree: ast.Module) -> dict[str, list[int]]:
    out = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name in ("forward", "_forward_impl"):
                out[f"{cls.name}.{fn.name}"] = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.stmt)]
    return out


@pytest.mark.parametrize("case", CASES)
def test_golden(case: str) -> None:
    source, plan = load(case)
    text = ast.unparse(lower(source, plan, filename=f"{case}.py")) + "\n"
    expected = GOLDEN / f"{case}.lowered.py"
    if os.environ.get("HP_LAZY_REGEN_GOLDEN") == "1":
        expected.write_text(text)
    assert text == expected.read_text()


@pytest.mark.parametrize("case", CASES)
def test_lowered_compiles_and_keeps_line_numbers(case: str) -> None:
    source, plan = load(case)
    tree = lower(source, plan, filename=f"{case}.py")
    compile(tree, f"{case}.py", "exec")
    parsed = ast.parse(source)
    original = _impl_lines(parsed)
    owners = {c.name: c.forward_owner for c in module_facts(parsed, plan.module).classes if not c.copy_blocker}
    checked = 0
    for key, lines in _impl_lines(tree).items():
        cls, name = key.split(".")
        if name == "_forward_impl" and f"{owners.get(cls)}.forward" in original:
            assert lines == original[f"{owners[cls]}.forward"], key
            checked += 1
    assert checked >= 1


def test_golden_cases_exist() -> None:
    assert {"attention", "generic", "inherited", "kwonly", "two_axes"} <= set(CASES)
