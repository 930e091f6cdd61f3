"""Per-instance bindings: what a lowered forward reads from ``self._hp_b``.

A :class:`Binding` holds the groups of the mesh axes (``_hp_b.tp`` in lowered code), the deferred
biases (by owner module and name: the Parameter objects may be swapped, e.g. by FSDP2), and the
compiled entry and exit ops of the instance's contract (used by the generic form and by leaves;
the static form writes its ops inline and only reads the groups).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.plan.model import Contract
from hp_lazy.plan.placement import AXES
from hp_lazy.plan.transitions import Op, entry_ops, exit_ops
from hp_lazy.runtime.comm import pairs as collectives
from hp_lazy.runtime.mesh import Group


class CallContext:
    """What one call of a boundary carries from its entry ops to its exit ops (expert
    parallel's splits and permutation, context parallel's layout); tensor parallel's ops keep
    nothing in it. One per call: a module called re-entrantly gets one per call."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}


TensorOp = Callable[[torch.Tensor, CallContext], torch.Tensor]


def compile_ops(contract: Contract, groups: Mapping[str, Group], *, entry: bool) -> dict[Any, tuple[TensorOp, ...]]:
    """name (entry) or output index (exit) -> the ops that move it from src to dst, axis by axis:
    the lowerer's own op chains (:func:`~hp_lazy.plan.transitions.entry_ops` / ``exit_ops``), bound
    to this rank's groups."""
    axes = tuple(axis for axis in AXES if axis in groups and groups[axis].size > 1)
    if contract.region is not None and contract.region.kind == "ep_dispatch":  # the region moves tokens over ep
        axes = tuple(axis for axis in axes if axis != "ep")
    found = entry_ops(contract, axes) if entry else exit_ops(contract, axes)
    chains: dict[Any, list[TensorOp]] = {}
    for bound in found:
        key = bound.name if entry else bound.position
        chains.setdefault(key, []).append(_bind_op(bound.op, groups[bound.axis]))
    return {key: tuple(chain) for key, chain in chains.items()}


def _bind_op(op: Op, group: Group) -> TensorOp:
    fn = getattr(collectives, op.call)
    dims = tuple(op.dims)

    def run(x: torch.Tensor, ctx: CallContext) -> torch.Tensor:
        return fn(x, group, *dims)

    run.__qualname__ = f"{op.call}{dims or ''}@{group.axis}"
    return run


@dataclass(eq=False, kw_only=True)
class Binding:
    """What one boundary instance needs at run time."""

    fqn: str
    contract: Contract
    groups: Mapping[str, Group]
    in_ops: Mapping[str, tuple[TensorOp, ...]] = field(default_factory=dict)
    out_ops: Mapping[int, tuple[TensorOp, ...]] = field(default_factory=dict)
    deferred_biases: tuple[tuple[nn.Module, str], ...] = ()
    """(owner, name) of each rowwise bias added after the reduction."""

    def __post_init__(self) -> None:
        for axis in AXES:  # ``_hp_b.tp`` in lowered code: a plain attribute, no lookup logic
            self.__dict__[axis] = self.groups.get(axis)

    def enter(self, name: str, value: Any, ctx: CallContext | None = None) -> Any:
        """The entry ops of input ``name``; ``ctx`` is this call's (a fresh one when the caller
        keeps none: leaves and the layer stack, whose ops are stateless)."""
        ctx = ctx or CallContext()
        for op in self.in_ops.get(name, ()):
            value = op(value, ctx)
        return value

    def exit(self, outputs: Any, ctx: CallContext | None = None) -> Any:
        """Every exit op, by output position, then the deferred biases."""
        ctx = ctx or CallContext()
        if not self.out_ops:
            return outputs
        if isinstance(outputs, tuple):
            items = list(outputs)
            for index, chain in self.out_ops.items():
                if index >= len(items):
                    raise ShardingError(
                        f"{self.fqn}: the contract places output.{index} but forward returned "
                        f"{len(items)} values; fix the plan's out_src/out_dst keys"
                    )
                items[index] = _run(chain, items[index], ctx)
            if 0 in self.out_ops:
                items[0] = add_deferred_bias(items[0], self)
            return type(outputs)(items) if type(outputs) is tuple else type(outputs)(*items)
        if set(self.out_ops) - {0}:
            raise ShardingError(
                f"{self.fqn}: the contract places tuple positions {sorted(self.out_ops)} but forward "
                f"returned a single {type(outputs).__name__}; use the key 'output'"
            )
        return add_deferred_bias(_run(self.out_ops[0], outputs, ctx), self)


def _run(chain: tuple[TensorOp, ...], value: Any, ctx: CallContext) -> Any:
    for op in chain:
        value = op(value, ctx)
    return value


def add_deferred_bias(x: torch.Tensor, binding: Binding) -> torch.Tensor:
    for owner, name in binding.deferred_biases:
        bias = owner._parameters[name]
        if bias is not None:
            x = x + bias
    return x
