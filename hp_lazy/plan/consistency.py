"""Rules a contract must keep so that a plan that validates cannot train wrong, checked when the
plan is sliced (before any model exists).

On every mesh axis on which a contract shards a parameter:

- **entry**: it declares at least one input, and each declared input either gets an entry op on
  that axis (its backward all-reduces or gathers the partial input gradient) or is already
  sharded there on both sides; without one, the input gradient stays a partial sum, silently;
- **whole inputs**: each input is ``R`` after the entry op (``in_dst``), except a rowwise Linear
  leaf's, which arrives as its columns (``S(-1)``);
- **exit**: its ``output`` leaves as partial sums (``P(sum)``) or shards of the last dim (``S(-1)``)
  on that axis — a computation on sharded parameters never yields a replicated value by itself,
  nor shards of another dim;
- **leaves**: a ``torch.nn.Linear`` with its weight ``S(0)`` (colwise) produces shards, with
  ``S(1)`` (rowwise) partial sums; an ``nn.Embedding`` with ``S(0)`` (vocab rows) partial sums;
- **biases follow their weight**: a bias cut on an axis belongs to a weight cut the same way
  (colwise: ``<x>.weight`` on ``S(0)``, or the same packed blocks);
- **optional names** are names the contract plans (``optional_params`` ⊆ params ∪ deferred biases);
- a colwise weight's **bias** is cut with it; no parameter is ever ``P(sum)``; experts split by
  ``tp_experts`` leave ``P(sum)``; nothing is placed on ``cp`` (the model's entry splits the sequence).

On every axis, whatever the contract shards:

- **partial sums come from shards**: an output declared ``P(sum)`` needs a parameter sharded on that
  axis (a replicated computation reduced over the axis would count once per rank);
- **the sequence-parallel stack** and what lies inside it: :mod:`hp_lazy.plan.stack_rules`;
- **sequence shards live in the stack**: an input or output that is sharded where it crosses the
  boundary (``in_src`` / ``out_dst`` ``S(d)``) only exists inside a contract that scatters and
  gathers that dim (the sequence-parallel layer stack: ``in_dst`` and ``out_src`` ``S(d)``), or is a
  vocab-sharded head (``out_dst`` ``S(-1)`` on a Linear leaf: the vocab-parallel loss).

Whether a rowwise Linear has a bias is a property of the model's config, not of its source, so
that rule is checked when the model is bound (:mod:`hp_lazy.runtime.bind`): an existing bias of a
rowwise weight must be in ``deferred_bias_params``, and a planned parameter the model lacks must
be in ``optional_params``. Only the model's head may leave its output sharded (``out_dst``
``S(-1)``), which needs the model: :mod:`hp_lazy.runtime.tp.style` checks it at bind.
``benchmarks/mutants.py`` is the evidence: every single change of every field of Plan.auto's
plans is refused or exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hp_lazy.errors import PlanError
from hp_lazy.plan.model import Contract
from hp_lazy.plan.placement import REPLICATE, Partial, Shard
from hp_lazy.plan.stack_rules import check_stacks, held, is_stack
from hp_lazy.plan.transitions import transition_op

_FIX_ENTRY = "declare the boundary's input (e.g. 'hidden_states') with in_src/in_dst on that axis"


def check_plan(contracts: Sequence[tuple[Contract, str]], mesh: Mapping[str, int]) -> None:
    """Every contract (with its resolved class), then the rules between contracts."""
    for contract, cls in contracts:
        check_contract(contract, cls, mesh)
    stacks = [c for c, _ in contracts if is_stack(c)]
    for contract, cls in contracts:
        if is_stack(contract):  # it scatters the sequence itself: only a partial sum cannot enter it
            for name, axis, placement in [(n, a, p) for n in contract.in_src for a, p in contract.in_src[n].items()]:
                if isinstance(placement, Partial):
                    _refuse_partial_crossing(contract, "in_src", name, axis, placement)
        else:
            _check_sharded_crossings(contract, cls, stacks)
    check_stacks([c for c, _ in contracts], mesh)


def _check_sharded_crossings(contract: Contract, cls: str, stacks: list[Contract]) -> None:
    crossings = [("in_src", n) for n in contract.in_src] + [("out_dst", "output")]
    for side, name in crossings:
        for axis, placement in getattr(contract, side).get(name, {}).items():
            if isinstance(placement, Partial):
                _refuse_partial_crossing(contract, side, name, axis, placement)
            if not isinstance(placement, Shard):
                continue
            if side == "out_dst" and placement.dim == -1 and cls.rpartition(".")[2] == "Linear":
                continue  # a vocab-sharded head: the vocab-parallel loss reads it
            inside = [s for s in stacks if contract.pattern.startswith(s.pattern + ".")
                      and any(held(contract, s.placement("in_dst", n, axis)) == placement for n in s.in_dst)]
            if not inside:
                raise PlanError(
                    f"{contract.pattern}: {side}[{name!r}] is {placement} on {axis}, but no contract around it "
                    f"scatters and gathers that dim (a sequence-parallel layer stack with in_dst and out_src "
                    f"{placement}); use 'R', or plan the stack (Plan.auto(sequence_parallel=True))"
                )


def _refuse_partial_crossing(contract: Contract, side: str, name: str, axis: str, placement: Partial) -> None:
    """A partial sum never crosses a boundary: between boundaries runs code hp_lazy does not rewrite
    (residual adds, norms, the loss), which reads each rank's part as the whole value; and nothing
    there produces one, so an input declared partial would be summed tp-fold on entry."""
    if side == "out_dst":
        fix = (f"set out_dst['output'] to 'R' on {axis} (an all-reduce at the exit), or to the sequence shard "
               "'S(1)' inside a sequence-parallel layer stack (a reduce-scatter)")
        what = "the output would leave each rank holding its part while the code after it reads a whole value"
    else:
        fix = f"declare in_src[{name!r}] as what arrives, 'R' on {axis} (or the stack's sequence shard)"
        what = "every value reaches a boundary whole or sharded, and the entry would sum it over the ranks"
    raise PlanError(
        f"{contract.pattern}: {side}[{name!r}] is {placement} on {axis}, a partial sum crossing the boundary: "
        f"{what}; {fix}"
    )


def check_contract(contract: Contract, cls: str, mesh: Mapping[str, int]) -> None:
    """Raise a PlanError naming the contract, the axis, the rule and the fix."""
    for name in contract.optional_params:
        if name not in contract.params and name not in contract.deferred_bias_params:
            raise PlanError(
                f"{contract.pattern}: optional_params names {name!r}, which is neither in params nor in "
                "deferred_bias_params; fix the name or drop it"
            )
    _check_params(contract)
    for axis in contract.sharding_axes(mesh):
        _check_entry(contract, axis)
        _check_inputs(contract, cls, axis)
        _check_exit(contract, axis)
        _check_leaf(contract, cls, axis)
        _check_biases_follow_weights(contract, axis)
    _check_region_exit(contract, mesh)
    _check_partial_outputs(contract, mesh)
    _check_context_parallel(contract, mesh)


def _check_entry(contract: Contract, axis: str) -> None:
    names = sorted({*contract.in_src, *contract.in_dst})
    if not names:
        raise PlanError(
            f"{contract.pattern}: the contract shards parameters on {axis} but declares no input, so the "
            f"gradient of its input would stay a partial sum over {axis}; {_FIX_ENTRY}"
        )
    for name in names:
        src, dst = contract.placement("in_src", name, axis), contract.placement("in_dst", name, axis)
        if isinstance(src, Shard) and isinstance(dst, Shard) and src == dst:
            continue  # already sharded: its gradient is too
        where = f"{contract.pattern}: input {name!r} on {axis}"
        if transition_op(src, dst, entering_sharded=True, where=where) is None:
            raise PlanError(
                f"{contract.pattern}: input {name!r} enters parameters sharded on {axis} as {src} -> {dst}, which "
                f"issues no collective, so its gradient would stay a partial sum; {_FIX_ENTRY}"
            )


def _check_params(contract: Contract) -> None:
    for name, spec in sorted(contract.params.items()):
        for axis, placement in spec.items():
            if isinstance(placement, Partial):
                raise PlanError(
                    f"{contract.pattern}: params[{name!r}] is {placement} on {axis}, but a parameter is stored whole "
                    f"or cut, never as a partial sum; use 'R' or 'S(d)'"
                )


def _check_inputs(contract: Contract, cls: str, axis: str) -> None:
    """Sharded parameters compute on whole inputs (colwise Linears, blocks: ``R`` after the entry
    op); a rowwise Linear leaf reads its input's matching columns (``S(-1)``)."""
    weight = contract.params.get("weight", {}).get(axis)
    rowwise_leaf = (cls.rpartition(".")[2] == "Linear" and isinstance(weight, Shard)
                    and weight.dim in (1, -1))
    want = Shard(-1) if rowwise_leaf else REPLICATE
    names = sorted(contract.in_dst) if contract.in_dst else (["input"] if rowwise_leaf else [])
    for name in names:
        placement = contract.placement("in_dst", name, axis)
        if placement != want:
            why = ("a rowwise Linear (weight cut on its input features) multiplies this rank's columns of the input"
                   if rowwise_leaf else "its body computes with parameters sharded on that axis from whole values")
            raise PlanError(
                f"{contract.pattern}: in_dst[{name!r}] is {placement} on {axis}, but {why}; set in_dst[{name!r}] "
                f"to {str(want)!r} on {axis}"
            )


def _check_exit(contract: Contract, axis: str) -> None:
    out = contract.placement("out_src", "output", axis)
    if not isinstance(out, (Partial, Shard)):
        raise PlanError(
            f"{contract.pattern}: the contract shards parameters on {axis} but its output leaves as {out} "
            f"on {axis}; a computation on shards yields partial sums or shards: set out_src['output'] to "
            f"'P(sum)' (rowwise) or 'S(-1)' (colwise) on {axis}, with the out_dst it should become"
        )
    if isinstance(out, Shard) and (out.dim != -1 or out.blocks != 1):
        raise PlanError(
            f"{contract.pattern}: out_src['output'] is {out} on {axis}, but a computation on shards of the "
            f"parameters yields shards of the output's last dim (features), never of another; set it to 'S(-1)' "
            f"(colwise) or 'P(sum)' (rowwise) on {axis}"
        )


def _colwise(weight: Shard) -> str:
    return "S(0)" if weight.blocks == 1 else f"SS(0,{weight.blocks})"


def _check_region_exit(contract: Contract, mesh: Mapping[str, int]) -> None:
    """tp_experts: each rank runs its own experts on every token, so the output is a partial sum."""
    if contract.region is None or contract.region.kind != "tp_experts" or mesh.get("tp", 0) == 1:
        return
    out = contract.placement("out_src", "output", "tp")
    if not isinstance(out, Partial):
        raise PlanError(
            f"{contract.pattern}: out_src['output'] is {out} on tp, but the tp_experts region runs each rank's "
            "experts on every token, so each rank holds a part of every token's output; set out_src['output'] "
            "to 'P(sum)' on tp (and out_dst to 'R': the all-reduce)"
        )


def _check_context_parallel(contract: Contract, mesh: Mapping[str, int]) -> None:
    """Under context parallel the model's entry splits the sequence once and every boundary sees its
    rank's rows as its whole input: nothing is placed on cp (the attention's inner op does the rest)."""
    if mesh.get("cp", 1) == 1:
        return
    for side in ("in_src", "in_dst", "out_src", "out_dst", "params"):
        for name, spec in getattr(contract, side).items():
            placement = spec.get("cp", REPLICATE)
            if placement != REPLICATE:
                raise PlanError(
                    f"{contract.pattern}: {side}[{name!r}] is {placement} on cp, but context parallel splits the "
                    "sequence once at the model's entry and every boundary works on its rank's rows as they are; "
                    "leave cp out of the contract's placements (the attention's inner op gathers what it needs)"
                )


def _check_leaf(contract: Contract, cls: str, axis: str) -> None:
    weight = contract.params.get("weight", {}).get(axis)
    if not isinstance(weight, Shard):
        return
    out = contract.placement("out_src", "output", axis)
    short = cls.rpartition(".")[2]
    rows = weight.dim in (0, -2)
    if short == "Linear":
        want, style = (Shard, "colwise: S(-1)") if rows else (Partial, "rowwise: P(sum)")
    elif short == "Embedding":
        want, style = (Partial, "vocab rows: P(sum)") if rows else (Shard, "hidden columns: S(-1)")
    else:
        return
    if not isinstance(out, want):
        raise PlanError(
            f"{contract.pattern}: a {short} with its weight {weight} on {axis} produces {style.split(': ')[1]} "
            f"({style.split(':')[0]}), but out_src['output'] says {out}; set out_src['output'] to "
            f"{style.split(': ')[1]!r} on {axis}"
        )


def _check_biases_follow_weights(contract: Contract, axis: str) -> None:
    for name, spec in sorted(contract.params.items()):
        weight = spec.get(axis)
        bias_name = name[: -len("weight")] + "bias" if name == "weight" or name.endswith(".weight") else ""
        if (bias_name in contract.params and isinstance(weight, Shard) and weight.dim in (0, -2)
                and not isinstance(contract.params[bias_name].get(axis), Shard)):
            raise PlanError(
                f"{contract.pattern}: {name} is {weight} on {axis} (colwise) but {bias_name} is "
                f"{contract.placement('params', bias_name, axis)}; a colwise Linear's bias is cut with its output "
                f"features: plan {bias_name} as {_colwise(weight)!r} on {axis}"
            )
    for name, spec in sorted(contract.params.items()):
        bias = spec.get(axis)
        if not (name == "bias" or name.endswith(".bias")) or not isinstance(bias, Shard):
            continue
        weight_name = name[: -len("bias")] + "weight"
        weight = contract.params.get(weight_name, {}).get(axis)
        if not isinstance(weight, Shard) or weight.dim not in (0, -2) or weight.blocks != bias.blocks:
            raise PlanError(
                f"{contract.pattern}: {name} is {bias} on {axis} but its weight {weight_name} is "
                f"{weight if weight is not None else 'not planned'}; a bias is cut with its colwise weight: "
                f"plan {weight_name} as S(0) on {axis} (same packed blocks), or drop {name} from params"
            )


def _check_partial_outputs(contract: Contract, mesh: Mapping[str, int]) -> None:
    for axis, out in contract.out_src.get("output", {}).items():
        if mesh.get(axis, 0) == 1 or not isinstance(out, Partial):
            continue
        if not any(isinstance(spec.get(axis), Shard) for spec in contract.params.values()):
            raise PlanError(
                f"{contract.pattern}: the output is declared P(sum) on {axis}, but the contract shards no "
                f"parameter on {axis}, so every rank computes the whole value and the reduction would count "
                f"it {axis}-fold; plan the parameters it shards, or declare the output 'R'"
            )
