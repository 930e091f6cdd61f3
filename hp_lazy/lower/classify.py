"""Which form a boundary takes, and which op each of its transitions lowers to.

One pure classifier, :func:`classify`, shared by the emitter, the runtime binder and
``hp_lazy check``. Forms (DESIGN.md section 3):

- ``identity``: no transition changes a placement, no deferred bias: not rewritten;
- ``tp_collective``: every op is written inline; needs the structural gates below;
- ``generic``: the runtime applies the same ops by name and position.

Structural gates of the inline form: no ``*args``; every ``return`` has a value; every input
with an op is a named forward parameter; every output op targets output 0 or a tuple position
that every ``return`` has. The op of each transition comes from
:func:`hp_lazy.plan.transitions.transition_op`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from hp_lazy.errors import PlanError
from hp_lazy.lower.facts import ForwardFacts
from hp_lazy.plan.model import Contract, check_implemented
from hp_lazy.plan.placement import AXES
from hp_lazy.plan.transitions import BoundOp, entry_ops, exit_ops

Form = Literal["identity", "tp_collective", "generic"]


@dataclass(frozen=True, slots=True)
class FormDecision:
    form: Form
    reasons: tuple[str, ...]
    in_ops: tuple[BoundOp, ...]
    out_ops: tuple[BoundOp, ...]


def active_axes(mesh: Mapping[str, int]) -> tuple[str, ...]:
    """Axes in mesh order whose degree is not 1 (an absent degree is decided at run time)."""
    return tuple(a for a in AXES if mesh.get(a, 0) != 1)


def _in_ops(contract: Contract, facts: ForwardFacts, axes: tuple[str, ...]) -> tuple[BoundOp, ...]:
    order = {n: i for i, n in enumerate(facts.param_names)}
    names = sorted({*contract.in_src, *contract.in_dst}, key=lambda n: (order.get(n, len(order)), n))
    return entry_ops(contract, axes, names)


def _check_inputs(contract: Contract, facts: ForwardFacts, in_ops: tuple[BoundOp, ...]) -> None:
    for name in sorted({o.name for o in in_ops}):
        if name not in facts.param_names and facts.kwarg is None:
            raise PlanError(
                f"{contract.pattern}: input {name!r} is not a parameter of {facts.owner}.forward"
                f"({', '.join(facts.param_names)}); name one of those parameters in the plan"
            )


def _gate_failures(facts: ForwardFacts, in_ops: tuple[BoundOp, ...], out_ops: tuple[BoundOp, ...]) -> list[str]:
    fails = []
    if facts.vararg is not None:
        fails.append(f"forward takes *{facts.vararg}")
    if not facts.every_return_has_value():
        lines = sorted({r.lineno for r in facts.returns if r.kind == "bare"})
        fails.append(f"forward can return without a value (line {', '.join(map(str, lines)) or facts.lineno})")
    unbound = sorted({o.name for o in in_ops if o.name not in facts.param_names})
    if unbound:
        fails.append(f"inputs {unbound} are not named forward parameters")
    layout, arity = facts.output_layout()
    for pos in sorted({o.position for o in out_ops if o.position}):
        if layout != "tuple" or pos >= arity:
            fails.append(f"output position {pos} is not in every return (returns: {_describe_returns(facts)})")
    if out_ops and layout == "unknown":
        fails.append(f"the output layout is not fixed by the returns ({_describe_returns(facts)})")
    return fails


def _describe_returns(facts: ForwardFacts) -> str:
    kinds = sorted({r.kind if r.kind != "tuple" else f"tuple of {r.arity}" for r in facts.returns})
    return ", ".join(kinds) or "none"


def classify(contract: Contract, facts: ForwardFacts, mesh: Mapping[str, int]) -> FormDecision:
    """Decide the form of one boundary whose forward is described by ``facts``."""
    check_implemented(contract.pattern, contract)
    if contract.region is not None:
        raise PlanError(
            f"{contract.pattern}.region: kind {contract.region.kind!r} replaces the module's compute at run time "
            "(runtime/ep), so its class is not rewritten from source; add \"skip_source_lowering\": true to the "
            "boundary (Plan.auto does)"
        )
    axes = active_axes(mesh)
    in_ops, out_ops = _in_ops(contract, facts, axes), exit_ops(contract, axes)
    _check_inputs(contract, facts, in_ops)
    partial_out = any(p.is_partial for p in contract.out_src.get("output", {}).values())
    if contract.deferred_bias_params and not partial_out:
        raise PlanError(
            f"{contract.pattern}: deferred_bias_params {list(contract.deferred_bias_params)} need a P(sum) output "
            "reduced at exit; declare out_src 'P(sum)' for 'output' or drop deferred_bias_params"
        )
    if not in_ops and not out_ops:
        return FormDecision("identity", ("no transition changes a placement",), in_ops, out_ops)
    fails = _gate_failures(facts, in_ops, out_ops)
    if fails:
        return FormDecision("generic", tuple(fails), in_ops, out_ops)
    why = ("every transition lowers to a known op and the structural gates pass",)
    return FormDecision("tp_collective", why, in_ops, out_ops)
