"""What each rank holds: every parameter's placement per axis and its bytes against one process's.

:func:`of_model` reads a bound (or laid-out) model's own record: its layout table, and the
contract each bound module was matched to; it is this rank's view and issues no collective.
:func:`planned` answers the same before anything runs (the CLI's ``layout`` verb).

A parameter that no axis cuts is held whole by every rank: the report lists those ("whole"), the
largest first, so that experts or a vocabulary left replicated are seen, not discovered in
``nvidia-smi``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn

from hp_lazy.names import BINDING
from hp_lazy.plan.model import ModulePlan
from hp_lazy.runtime import record
from hp_lazy.runtime.layout import ParamLayout, plan_layout
from hp_lazy.runtime.mesh import AXES, Group
from hp_lazy.runtime.style import params_matching


@dataclass(frozen=True)
class Row:
    name: str
    full_shape: tuple[int, ...]
    placements: Mapping[str, str]
    """Axis -> its cut (``S(0)``, ``SS(-2,2)``); an axis absent holds the parameter whole."""
    held: int
    """Bytes this rank holds."""
    full: int
    """Bytes one process holds."""
    contract: str | None
    """The plan pattern of the module the parameter belongs to, if a contract named it."""

    @property
    def whole(self) -> bool:
        return not self.placements


@dataclass(frozen=True)
class LayoutReport:
    mesh: Mapping[str, int]
    rows: tuple[Row, ...]

    @property
    def held_bytes(self) -> int:
        return sum(r.held for r in self.rows)

    @property
    def full_bytes(self) -> int:
        return sum(r.full for r in self.rows)

    def whole(self) -> list[Row]:
        """Parameters every rank holds whole, the largest first."""
        return sorted((r for r in self.rows if r.whole), key=lambda r: (-r.full, r.name))

    def __str__(self) -> str:
        width = max([len(r.name) for r in self.rows] + [9])
        axes = [a for a, n in self.mesh.items() if n > 1]
        head = f"{'parameter':<{width}}  {'shape':<18}" + "".join(f"  {a:<10}" for a in axes) + "  held/one process"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            cuts = "".join(f"  {r.placements.get(a, 'R'):<10}" for a in axes)
            lines.append(f"{r.name:<{width}}  {str(list(r.full_shape)):<18}{cuts}  {_ratio(r.held, r.full)}")
        whole = self.whole()
        lines.append("")
        lines.append(f"this rank holds {_mib(self.held_bytes)} of one process's {_mib(self.full_bytes)} "
                     f"({_ratio(self.held_bytes, self.full_bytes)}); mesh {dict(self.mesh)}")
        if whole:
            held = sum(r.full for r in whole)
            named = sum(r.full for r in whole if r.contract is not None)
            lines.append(f"whole on every rank: {len(whole)} parameters, {_mib(held)} "
                         f"({_ratio(held, self.full_bytes)} of the model); largest: "
                         + ", ".join(f"{r.name} {_mib(r.full)}" for r in whole[:3]))
            if named:
                lines.append(f"  of which inside planned modules: {_mib(named)} (norms, routers, replicated "
                             "projections the plan keeps whole)")
        return "\n".join(lines)


def _mib(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _ratio(held: int, full: int) -> str:
    return f"{held / full:.3f}x" if full else "-"


def rows_for(
    params: Iterable[tuple[str, nn.Parameter]], layouts: Mapping[str, ParamLayout], contracts: Mapping[str, str]
) -> tuple[Row, ...]:
    out = []
    for name, param in params:
        layout = layouts.get(name)
        shape = layout.full_shape if layout is not None else tuple(param.shape)
        cuts = {c.axis: c.describe() for c in layout.shards} if layout is not None else {}
        size = param.element_size()
        full = math.prod(shape) * size
        held = math.prod(layout.local_shape) * size if layout is not None else full
        out.append(Row(name, shape, cuts, held, full, contracts.get(name)))
    return tuple(out)


def of_model(model: nn.Module) -> LayoutReport:
    """This rank's view of a model hp_lazy bound (``hp_lazy.layout``)."""
    found = list(record.records(model))
    if not found:
        raise ValueError(
            f"hp_lazy.layout({type(model).__qualname__}): the model is not bound by hp_lazy (no record); "
            "activate a plan before importing the model, then bind it (a first forward or hp_lazy.parallelize(model))"
        )
    layouts: dict[str, ParamLayout] = {}
    mesh: dict[str, int] = {}
    for prefix, bound in found:
        mesh.update({axis: bound.mesh.degree(axis) for axis in AXES})
        for fqn in bound.table or ():
            layout = bound.table.get(fqn)  # type: ignore[union-attr]
            if layout is not None:
                layouts[prefix + fqn] = layout
    contracts: dict[str, str] = {}
    for name, module in model.named_modules():
        binding = module.__dict__.get(BINDING)
        if binding is None:
            continue
        for pname, _ in module.named_parameters():
            contracts.setdefault(f"{name}.{pname}" if name else pname, binding.contract.pattern)
    return LayoutReport(mesh=mesh, rows=rows_for(model.named_parameters(), layouts, contracts))


def planned(model: nn.Module, plans: Iterable[ModulePlan], degrees: Mapping[str, int]) -> LayoutReport:
    """Before anything runs (the CLI's ``layout`` verb): ``model`` built on the meta device, the
    plan slices of its modeling modules, matched by the walker's own globs and class check and laid
    out by its own arithmetic as rank 0 of each axis would (K/V heads that tp keeps on several ranks
    are shown cut)."""
    from hp_lazy.runtime.bind import match_rules

    groups = {axis: Group(axis=axis, pg=None, size=n, rank=0) for axis, n in degrees.items()}
    layouts: dict[str, ParamLayout] = {}
    contracts: dict[str, str] = {}
    for plan in plans:
        for fqn, module, contract in match_rules(model, plan):
            for name, placements in contract.params.items():
                for pname, param in params_matching(module, name):
                    full = f"{fqn}.{pname}" if fqn else pname
                    layout = plan_layout(full, tuple(param.shape), placements, groups)
                    if layout.shards:
                        layouts[full] = layout
            for pname, _ in module.named_parameters():
                contracts.setdefault(f"{fqn}.{pname}" if fqn else pname, contract.pattern)
    return LayoutReport(mesh=dict(degrees), rows=rows_for(model.named_parameters(), layouts, contracts))
