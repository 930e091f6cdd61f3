"""Plan vocabulary shared by the lowerer and the runtime: which op moves a tensor from one
placement to another on one axis (docs/contract.md tables), and what an output key names.

Entry into a boundary with a parameter sharded on the axis (its backward yields a partial gradient):

======================  ========================
src -> dst              op
======================  ========================
R -> R                  ``copy_to``
S(d) -> R               ``gather_to(d)``
R -> S(d)               ``scatter_to(d)``
S(a) -> S(b)            ``all_to_all(a, b)``
======================  ========================

Any other entry, and every exit: equal placements need nothing; ``P(sum) -> R`` is
``reduce_from``, ``P(sum) -> S(d)`` ``reduce_scatter_to(d)``, ``S(d) -> R`` ``gather_from(d)``,
``R -> S(d)`` ``scatter_to(d)``, ``S(a) -> S(b)`` ``all_to_all(a, b)``.

Output keys: ``"output"`` is the sole return value or tuple position 0, ``"output.<i>"`` position ``i``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hp_lazy.errors import PlanError
from hp_lazy.plan.model import Contract
from hp_lazy.plan.placement import PackedShard, Placement, Shard

_OUTPUT_KEY = re.compile(r"^output(?:\.(\d+))?$")


@dataclass(frozen=True, slots=True)
class Op:
    """A runtime collective: ``__hp_rt__.<call>(x, group, *dims)``."""

    call: str
    dims: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{self.call}({', '.join(map(str, self.dims))})" if self.dims else self.call


def transition_op(src: Placement, dst: Placement, *, entering_sharded: bool, where: str = "transition") -> Op | None:
    """The op that takes a tensor from ``src`` to ``dst`` on one axis; ``None`` when nothing is to
    be done. ``entering_sharded``: this is a boundary entry and the boundary has a parameter
    sharded on the axis (its backward yields a partial gradient)."""
    for p in (src, dst):
        if isinstance(p, PackedShard):
            raise PlanError(f"{where}: packed shard {p} is for parameters only; use 'S(d)' for activations")
    if entering_sharded and (src.is_partial or dst.is_partial):
        op: Op | None = _UNSUPPORTED  # the backward would hand a partial gradient to a reduction's identity
    else:
        op = _entry_op(src, dst) if entering_sharded else _exit_op(src, dst)
    if op is _UNSUPPORTED:
        into = " into sharded params" if entering_sharded else ""
        raise PlanError(
            f"{where}: {src} -> {dst}{into} has no collective; supported: R->R, S(d)->R, R->S(d), "
            "S(a)->S(b), P(sum)->R, P(sum)->S(d) (P(sum) inputs only into a boundary with no param sharded on the axis)"
        )
    return op


_UNSUPPORTED = Op("<unsupported>")


def _entry_op(src: Placement, dst: Placement) -> Op | None:
    if src.is_replicate and dst.is_replicate:
        return Op("copy_to")
    if isinstance(src, Shard) and dst.is_replicate:
        return Op("gather_to", (src.dim,))
    if src.is_replicate and isinstance(dst, Shard):
        return Op("scatter_to", (dst.dim,))
    if isinstance(src, Shard) and isinstance(dst, Shard):
        return None if src.dim == dst.dim else Op("all_to_all", (src.dim, dst.dim))
    return _UNSUPPORTED


def _exit_op(src: Placement, dst: Placement) -> Op | None:
    if src == dst:
        return None
    if src.is_partial and dst.is_replicate:
        return Op("reduce_from")
    if src.is_partial and isinstance(dst, Shard):
        return Op("reduce_scatter_to", (dst.dim,))
    if isinstance(src, Shard) and dst.is_replicate:
        return Op("gather_from", (src.dim,))
    if src.is_replicate and isinstance(dst, Shard):
        return Op("scatter_to", (dst.dim,))
    if isinstance(src, Shard) and isinstance(dst, Shard):
        return Op("all_to_all", (src.dim, dst.dim))
    return _UNSUPPORTED


def is_output_key(key: str) -> bool:
    return _OUTPUT_KEY.match(key) is not None


def output_index(key: str, *, where: str = "output") -> int:
    """``"output"`` -> 0, ``"output.<i>"`` -> ``i``; anything else is a :class:`PlanError`."""
    m = _OUTPUT_KEY.match(key)
    if m is None:
        raise PlanError(
            f"{where}: output key {key!r} is not 'output' or 'output.<i>'; "
            "use 'output' for the return value (or tuple position 0), 'output.1' for position 1"
        )
    return int(m.group(1) or 0)


@dataclass(frozen=True, slots=True)
class BoundOp:
    """``op`` applied to one input (``name`` = parameter) or output (``name`` = ``output[.i]``,
    ``position`` = tuple index) on one mesh axis."""

    name: str
    axis: str
    src: Placement
    dst: Placement
    op: Op
    position: int | None = None
    into_sharded: bool = False

    def describe(self) -> str:
        into = " into sharded params" if self.into_sharded else ""
        return f"{self.name}: {self.axis} {self.src} -> {self.dst}{into} ==> {self.op}"


def sharded_axes(contract: Contract) -> frozenset[str]:
    return frozenset(a for spec in contract.params.values() for a, p in spec.items() if p.is_shard)


def entry_ops(contract: Contract, axes: tuple[str, ...], names: list[str] | None = None) -> tuple[BoundOp, ...]:
    """The entry ops of every declared input (``names`` in that order; sorted by default), axes
    in mesh order; an axis with a sharded parameter enters ``into_sharded``."""
    sharded = sharded_axes(contract)
    names = sorted({*contract.in_src, *contract.in_dst}) if names is None else names
    ops = []
    for name in names:
        for axis in axes:
            src, dst = contract.placement("in_src", name, axis), contract.placement("in_dst", name, axis)
            where = f"{contract.pattern}: input {name!r} on {axis}"
            op = transition_op(src, dst, entering_sharded=axis in sharded, where=where)
            if op is not None:
                ops.append(BoundOp(name, axis, src, dst, op, None, axis in sharded))
    return tuple(ops)


def exit_ops(contract: Contract, axes: tuple[str, ...]) -> tuple[BoundOp, ...]:
    """The exit ops of every declared output, by tuple position, innermost axis first."""
    keys = sorted({*contract.out_src, *contract.out_dst}, key=lambda k: (output_index(k, where=contract.pattern), k))
    seen: dict[int, str] = {}
    ops = []
    for key in keys:
        pos = output_index(key, where=contract.pattern)
        if pos in seen:
            raise PlanError(f"{contract.pattern}: outputs {seen[pos]!r} and {key!r} both name position {pos}; keep one")
        seen[pos] = key
        for axis in reversed(axes):  # exit undoes entry: innermost axis first
            src, dst = contract.placement("out_src", key, axis), contract.placement("out_dst", key, axis)
            op = transition_op(src, dst, entering_sharded=False, where=f"{contract.pattern}: output {key!r} on {axis}")
            if op is not None:
                ops.append(BoundOp(key, axis, src, dst, op, pos))
    return tuple(ops)
