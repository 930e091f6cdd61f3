"""Rules a contract must keep so that a plan that validates cannot train wrong, checked when the
plan is sliced (before any model exists).

On every mesh axis on which a contract shards a parameter:

- **entry**: it declares at least one input, and each declared input either gets an entry op on
  that axis (its backward all-reduces or gathers the partial input gradient) or is already
  sharded there on both sides; without one, the input gradient stays a partial sum, silently;
- **exit**: its ``output`` leaves as partial sums (``P(sum)``) or shards (``S(d)``) on that axis —
  a computation on sharded parameters never yields a replicated value by itself;
- **leaves**: a ``torch.nn.Linear`` with its weight ``S(0)`` (colwise) produces shards, with
  ``S(1)`` (rowwise) partial sums; an ``nn.Embedding`` with ``S(0)`` (vocab rows) partial sums;
- **biases follow their weight**: a bias cut on an axis belongs to a weight cut the same way
  (colwise: ``<x>.weight`` on ``S(0)``, or the same packed blocks);
- **optional names** are names the contract plans (``optional_params`` ⊆ params ∪ deferred biases).

On every axis, whatever the contract shards:

- **partial sums come from shards**: an output declared ``P(sum)`` needs a parameter sharded on that
  axis (a replicated computation reduced over the axis would count once per rank);
- **sequence shards live in the stack**: an input or output that is sharded where it crosses the
  boundary (``in_src`` / ``out_dst`` ``S(d)``) only exists inside a contract that scatters and
  gathers that dim (the sequence-parallel layer stack: ``in_dst`` and ``out_src`` ``S(d)``), or is a
  vocab-sharded head (``out_dst`` ``S(-1)`` on a Linear leaf: the vocab-parallel loss).

Whether a rowwise Linear has a bias is a property of the model's config, not of its source, so
that rule is checked when the model is bound (:mod:`hp_lazy.runtime.bind`): an existing bias of a
rowwise weight must be in ``deferred_bias_params``, and a planned parameter the model lacks must
be in ``optional_params``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hp_lazy.errors import PlanError
from hp_lazy.plan.model import Contract
from hp_lazy.plan.placement import Partial, Shard
from hp_lazy.plan.transitions import transition_op

_FIX_ENTRY = "declare the boundary's input (e.g. 'hidden_states') with in_src/in_dst on that axis"


def check_plan(contracts: Sequence[tuple[Contract, str]], mesh: Mapping[str, int]) -> None:
    """Every contract (with its resolved class), then the rules between contracts."""
    for contract, cls in contracts:
        check_contract(contract, cls, mesh)
    stacks = [c for c, _ in contracts if _is_stack(c)]
    for contract, cls in contracts:
        if not _is_stack(contract):
            _check_sharded_crossings(contract, cls, stacks)


def _is_stack(contract: Contract) -> bool:
    """Scatters on entry and gathers on exit along the same dim, on some axis."""
    return any(
        isinstance(contract.placement("in_dst", name, axis), Shard)
        and contract.placement("in_dst", name, axis) == contract.placement("out_src", "output", axis)
        for name in contract.in_dst for axis in contract.in_dst[name]
    )


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
                      and any(s.placement("in_dst", n, axis) == placement for n in s.in_dst)]
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
    for axis in _sharding_axes(contract, mesh):
        _check_entry(contract, axis)
        _check_exit(contract, axis)
        _check_leaf(contract, cls, axis)
        _check_biases_follow_weights(contract, axis)
    _check_partial_outputs(contract, mesh)


def _sharding_axes(contract: Contract, mesh: Mapping[str, int]) -> list[str]:
    axes = {a for spec in contract.params.values() for a, p in spec.items() if isinstance(p, Shard)}
    if contract.region is not None and contract.region.kind == "ep_dispatch":
        axes.discard("ep")  # the region moves the tokens over ep itself (runtime/ep/dispatch.py)
    return sorted(a for a in axes if mesh.get(a, 0) != 1)


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


def _check_exit(contract: Contract, axis: str) -> None:
    out = contract.placement("out_src", "output", axis)
    if not isinstance(out, (Partial, Shard)):
        raise PlanError(
            f"{contract.pattern}: the contract shards parameters on {axis} but its output leaves as {out} "
            f"on {axis}; a computation on shards yields partial sums or shards: set out_src['output'] to "
            f"'P(sum)' (rowwise) or 'S(-1)' (colwise) on {axis}, with the out_dst it should become"
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
