"""The rules between a sequence-parallel layer stack and the contracts inside it, checked with
the rest of :mod:`hp_lazy.plan.consistency` when the plan is sliced:

- **the stack** takes and gives whole values (``in_src`` / ``out_dst`` ``R``) and sums the
  gradients of the replicated parameters inside it (``grad_sum_params`` ``"*"``);
- **a boundary inside it** that shards parameters takes one input as the stack's shard (the
  layer's hidden states; an encoder's states may arrive whole) and leaves as it; experts split by
  expert over tp take every input as this rank's rows (``S(0)``);
- **a module run on the whole sequence inside it**: a contract that shards nothing and gathers the
  stack's shard on entry (one holding per-Linear leaves, :mod:`hp_lazy.plan.auto.sp`) leaves as
  the shard; the contracts inside it take whole inputs and leave whole, except the one whose output
  it returns as it is, which may leave as the shard, and then the module's ``out_src`` is the shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hp_lazy.errors import PlanError
from hp_lazy.plan.model import Contract
from hp_lazy.plan.placement import REPLICATE, Placement, Replicate, Shard


def check_stacks(contracts: Sequence[Contract], mesh: Mapping[str, int]) -> None:
    stacks = [c for c in contracts if is_stack(c)]
    regions = [(c, s) for c in contracts for s in stacks if _runs_whole(c, s, mesh)]
    for contract in contracts:
        if is_stack(contract):
            _check_stack(contract)
            continue
        around = [(r, s) for r, s in regions if contract.pattern.startswith(r.pattern + ".")]
        if around:
            _check_inside_region(contract, *around[0])
        else:
            _check_inside_stacks(contract, stacks, mesh)
    for region, stack in regions:
        _check_region(region, stack, [c for c in contracts if c.pattern.startswith(region.pattern + ".")])


def is_stack(contract: Contract) -> bool:
    """Scatters on entry and gathers on exit along the same dim, on some axis (an experts region
    that takes and gives this rank's rows, ``S(0)``, under sequence parallel does neither)."""
    return contract.region is None and any(
        isinstance(contract.placement("in_dst", name, axis), Shard)
        and contract.placement("in_dst", name, axis) == contract.placement("out_src", "output", axis)
        for name in contract.in_dst for axis in contract.in_dst[name]
    )


def _check_stack(stack: Contract) -> None:
    """A sequence-parallel stack takes whole values in and gives whole values back (the embedding
    before it and the final norm after it run on every token), and the replicated parameters inside
    it see only this rank's tokens, so their gradients are partial sums: ``grad_sum_params`` "*"."""
    for side, name in [("in_src", n) for n in stack.in_dst] + [("out_dst", "output")]:
        for axis in _stack_axes(stack):
            placement = stack.placement(side, name, axis)
            if not isinstance(placement, Replicate):
                raise PlanError(
                    f"{stack.pattern}: {side}[{name!r}] is {placement} on {axis}, but the layer stack scatters the "
                    f"sequence itself: the value {'arriving' if side == 'in_src' else 'leaving'} is whole on every "
                    f"rank; set {side}[{name!r}] to 'R' on {axis}"
                )
    if _stack_axes(stack) and not {"*", "**"} & set(stack.grad_sum_params):
        raise PlanError(
            f"{stack.pattern}: the stack shards the sequence on {', '.join(_stack_axes(stack))}, so every replicated "
            "parameter inside it (the norms) sees only this rank's tokens and its gradient is a partial sum; set "
            "grad_sum_params to ['*'] (everything under the stack that no other contract claims)"
        )


def _stack_axes(stack: Contract) -> list[str]:
    return sorted({axis for name in stack.in_dst for axis, p in stack.in_dst[name].items()
                   if isinstance(p, Shard) and p == stack.placement("out_src", "output", axis)})


def _check_inside_stacks(contract: Contract, stacks: list[Contract], mesh: Mapping[str, int]) -> None:
    """A boundary inside a sequence-parallel stack receives the stack's sequence shard and returns
    it, on each axis it shards parameters on: one of its inputs is that shard in in_src (the layer's
    hidden states; others, such as an encoder's states, may arrive whole) and its out_dst is that
    shard (the entry gathers, the exit reduce-scatters); 'R' there would mix whole and sharded rows.
    Experts split by expert over tp take every input as this rank's rows: ids and weights per row too."""
    for stack in stacks:
        if not contract.pattern.startswith(stack.pattern + "."):
            continue
        for axis in _stack_axes(stack):
            if axis not in contract.sharding_axes(mesh):
                continue
            shard = held(contract, stack.placement("out_src", "output", axis))
            fix = f"(the entry gathers the sequence, the exit reduce-scatters it) in the stack {stack.pattern!r}"
            out = contract.placement("out_dst", "output", axis)
            if out != shard:
                raise PlanError(
                    f"{contract.pattern}: out_dst['output'] is {out} on {axis}, but the stack around it holds the "
                    f"sequence as {shard} there; set out_dst['output'] to {str(shard)!r} on {axis} {fix}"
                )
            seen = {n: contract.placement("in_src", n, axis) for n in contract.in_dst}
            experts = shard != stack.placement("out_src", "output", axis)  # they hold it as rows
            rows = [n for n, p in seen.items() if p != shard] if experts else []
            if rows:
                raise PlanError(
                    f"{contract.pattern}: in_src[{rows[0]!r}] is {seen[rows[0]]} on {axis}, but experts split by "
                    f"expert over tp inside the stack {stack.pattern!r} take every input per row, as this rank's rows "
                    f"({shard}): the hidden states and their top-k ids and weights alike; set in_src[{rows[0]!r}] to "
                    f"{str(shard)!r} on {axis}"
                )
            if seen and shard not in seen.values():
                raise PlanError(
                    f"{contract.pattern}: in_src declares {', '.join(f'{n}: {p}' for n, p in seen.items())} on {axis}, "
                    f"but the stack around it holds the sequence as {shard} there: the layer's hidden states arrive "
                    f"as that shard; set their in_src to {str(shard)!r} on {axis} {fix}"
                )


def _runs_whole(contract: Contract, stack: Contract, mesh: Mapping[str, int]) -> bool:
    """A module inside a sequence-parallel stack that runs on the whole sequence: it shards nothing
    and gathers the stack's shard on entry (one holding per-Linear leaves, :mod:`hp_lazy.plan.auto.sp`)."""
    if not contract.pattern.startswith(stack.pattern + "."):
        return False
    return any(
        axis not in contract.sharding_axes(mesh)
        and contract.placement("in_src", name, axis) == stack.placement("out_src", "output", axis)
        and isinstance(contract.placement("in_dst", name, axis), Replicate)
        for axis in _stack_axes(stack) for name in contract.in_dst
    )


def _check_region(region: Contract, stack: Contract, inner: list[Contract]) -> None:
    """A module run on the whole sequence inside a stack hands the layer's code after it this rank's
    piece (``out_dst`` the stack's shard). Its output is cut at its exit (``out_src`` ``R``), or is
    already this rank's piece (``out_src`` the shard) because exactly one contract inside it, the
    one whose output it returns, leaves as that piece; no other does."""
    for axis in _stack_axes(stack):
        shard = stack.placement("out_src", "output", axis)
        out_src, out_dst = region.placement("out_src", "output", axis), region.placement("out_dst", "output", axis)
        if out_dst != shard:
            raise PlanError(
                f"{region.pattern}: out_dst['output'] is {out_dst} on {axis}, but this module runs on the whole "
                f"sequence inside the stack {stack.pattern!r}, whose code after it holds the sequence as {shard}; "
                f"set out_dst['output'] to {str(shard)!r} on {axis}"
            )
        leaving = [c.pattern for c in inner if c.placement("out_dst", "output", axis) == shard]
        if out_src not in (REPLICATE, shard) or len(leaving) != (out_src == shard):
            raise PlanError(
                f"{region.pattern}: out_src['output'] is {out_src} on {axis} while {leaving or 'no contract'} inside "
                f"it leave(s) as {shard}; a module run on the whole sequence returns whole values ('R', cut at its "
                f"exit) or, where one contract inside it (the one whose output it returns) leaves as {shard}, that "
                "piece: make the two agree"
            )


def _check_inside_region(contract: Contract, region: Contract, stack: Contract) -> None:
    """Inside a module run on the whole sequence, values are whole: no input arrives as the stack's
    shard, and an output leaves whole or, returned by the module as it is, as that shard."""
    for axis in _stack_axes(stack):
        shard = stack.placement("out_src", "output", axis)
        cut = [n for n in contract.in_src if isinstance(contract.placement("in_src", n, axis), Shard)]
        out = contract.placement("out_dst", "output", axis)
        if cut or out not in (REPLICATE, shard):
            what = f"in_src[{cut[0]!r}]" if cut else "out_dst['output']"
            got = contract.placement("in_src", cut[0], axis) if cut else out
            raise PlanError(
                f"{contract.pattern}: {what} is {got} on {axis}, but {region.pattern!r} around it "
                f"gathers the sequence and runs on whole values; set {what} to 'R' on {axis}"
                + ("" if cut else f" (or {str(shard)!r} for the output {region.pattern!r} returns as it is)")
            )


def held(contract: Contract, shard: Placement) -> Placement:
    """How ``contract`` receives a stack's sequence shard: as it is, or, for an experts region (split
    by expert over tp, ``tp_experts``, or over ep, ``ep_dispatch``), as rows ``S(0)``: the experts
    take the layer's tokens flattened (``[B * S / tp, H]``) and treat every row alike, so this rank's
    rows are its sequence shard."""
    if contract.region is not None and isinstance(shard, Shard):
        return Shard(0)
    return shard
