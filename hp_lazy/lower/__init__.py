"""How a forward changes: the pure source -> AST rewrite of boundary classes (no torch here).

``lower(source, module_plan)`` returns the module tree the import hook compiles;
``lower_source(source, plan, module_name)`` returns that tree as text (``hp_lazy show``).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

from hp_lazy.lower.classify import BoundOp, FormDecision, classify
from hp_lazy.lower.facts import ForwardFacts, ModuleFacts, forward_facts, module_facts
from hp_lazy.lower.lower import boundary_decisions, lower
from hp_lazy.plan import Plan

__all__ = [
    "BoundOp",
    "FormDecision",
    "ForwardFacts",
    "ModuleFacts",
    "boundary_decisions",
    "classify",
    "forward_facts",
    "lower",
    "lower_source",
    "module_facts",
]


def lower_source(source_text: str, plan: Plan | Mapping[str, Any], module_name: str) -> str:
    """The lowered text of ``module_name`` under ``plan`` (the original, re-printed, when the
    plan has nothing for the module)."""
    plan = plan if isinstance(plan, Plan) else Plan.from_dict(plan)
    module_plan = plan.slice(module_name, source_text)
    if module_plan is None:
        return ast.unparse(ast.parse(source_text))
    return ast.unparse(lower(source_text, module_plan, filename=module_name))
