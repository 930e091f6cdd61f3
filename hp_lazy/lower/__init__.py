"""How a forward changes: the pure source -> AST rewrite of boundary classes (no torch here).

``lower(source, module_plan)`` returns the module tree the import hook compiles;
``lower_source(source, plan, module_name)`` returns that tree as text (``hp_lazy show``).
"""

from __future__ import annotations

import ast
from typing import Any, Mapping

from hp_lazy.errors import HpLazyError
from hp_lazy.lower.classify import BoundOp, FormDecision, Op, classify, transition_op
from hp_lazy.lower.facts import ForwardFacts, ModuleFacts, forward_facts, module_facts
from hp_lazy.lower.lower import boundary_decisions, lower
from hp_lazy.plan.model import Plan

__all__ = [
    "BoundOp",
    "FormDecision",
    "ForwardFacts",
    "ModuleFacts",
    "Op",
    "boundary_decisions",
    "classify",
    "forward_facts",
    "lower",
    "lower_source",
    "module_facts",
    "transition_op",
]


def _as_plan(plan: Plan | Mapping[str, Any]) -> Plan:
    if isinstance(plan, Plan):
        return plan
    from_dict = getattr(Plan, "from_dict", None)
    if from_dict is None:
        raise HpLazyError("hp_lazy.plan: Plan.from_dict is not available in this build; pass a Plan object")
    return from_dict(plan)


def lower_source(source_text: str, plan: Plan | Mapping[str, Any], module_name: str) -> str:
    """The lowered text of ``module_name`` under ``plan`` (the original, re-printed, when the
    plan has nothing for the module)."""
    plan = _as_plan(plan)
    slicer = getattr(plan, "slice", None)
    if slicer is None:
        raise HpLazyError(f"{module_name}: Plan.slice is not available in this build; lower a ModulePlan with lower()")
    module_plan = slicer(module_name, source_text)
    if module_plan is None:
        return ast.unparse(ast.parse(source_text))
    return ast.unparse(lower(source_text, module_plan, filename=module_name))
