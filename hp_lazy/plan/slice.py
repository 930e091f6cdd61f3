"""``Plan.slice(module, source)``: the part of a plan that applies to one modeling module.

For each contract the boundary class is found statically (:mod:`hp_lazy.plan.resolve`) or taken
from ``boundary_classes``; ``roots`` are the classes from which a contract pattern resolves, plus,
in a transformers module, every class deriving from the module's ``PreTrainedModel`` subclass.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from hp_lazy.errors import PlanError
from hp_lazy.plan.auto import auto_parts
from hp_lazy.plan.consistency import check_plan
from hp_lazy.plan.model import AutoFlags, Contract, ModulePlan, sha256_json
from hp_lazy.plan.resolve import ModuleFacts, analyze, resolve_pattern


class PlanSource(Protocol):
    """What slicing reads of a plan (:class:`hp_lazy.plan.Plan` has it all)."""

    @property
    def hash(self) -> str: ...
    @property
    def mesh(self) -> Mapping[str, int]: ...
    @property
    def modules(self) -> tuple[str, ...]: ...
    @property
    def boundaries(self) -> tuple[Contract, ...]: ...
    @property
    def boundary_classes(self) -> Mapping[str, str]: ...
    @property
    def auto_flags(self) -> AutoFlags | None: ...
    def targets(self, module_name: str) -> bool: ...


@dataclass(frozen=True)
class _Applied:
    contract: Contract
    cls: str
    local: bool
    starts: frozenset[str]


_COMPARED = (
    "in_src", "in_dst", "out_src", "out_dst", "deferred_bias_params", "grad_sum_params", "optional_params", "inner",
    "region",
)


def slice_plan(plan: PlanSource, module: str, source: str) -> ModulePlan | None:
    """None when the plan does not target ``module`` or nothing of it applies there."""
    if not plan.targets(module):
        return None
    if plan.auto_flags is not None:
        parts = auto_parts(module, source, plan.auto_flags)
        if parts is None:
            return None
        (contracts, overrides, refused), strict = parts, True
    else:
        contracts, overrides, refused = plan.boundaries, dict(plan.boundary_classes), {}
        strict = tuple(plan.modules) == (module,)
    facts = analyze(module, source)
    applied = [a for c in contracts if (a := _apply(facts, c, overrides.get(c.pattern), strict)) is not None]
    if not applied:
        return None
    _check_shared_classes(module, applied)
    check_plan([(a.contract, _torch_kind(facts, a)) for a in applied], plan.mesh)
    sliced = ModulePlan(
        module=module,
        plan_hash=plan.hash,
        mesh=dict(plan.mesh),
        contracts=tuple(sorted((a.contract for a in applied), key=lambda c: c.pattern)),
        classes={a.contract.pattern: a.cls for a in sorted(applied, key=lambda a: a.contract.pattern)},
        roots=_roots(facts, applied),
        refused=dict(refused),
    )
    return replace(sliced, hash=sha256_json(sliced.to_dict()))


def _apply(facts: ModuleFacts, contract: Contract, override: str | None, strict: bool) -> _Applied | None:
    module, pattern = facts.module, contract.pattern
    found = resolve_pattern(facts, pattern)
    names = set().union(*found.values()) if found else set()
    if override is not None:
        return _overridden(facts, contract, override, frozenset(found), strict)
    if not names:
        if not strict:
            return None
        raise PlanError(
            f"{module}: boundary {pattern!r} matches no class of the module (no chain of "
            "'self.<attr> = Cls(...)' / nn.ModuleList assignments reaches it from any class); "
            "fix the pattern, or name the class in boundary_classes"
        )
    if len(names) > 1:
        detail = "; ".join(f"from {start}: {', '.join(sorted(hits))}" for start, hits in sorted(found.items()))
        raise PlanError(
            f"{module}: boundary {pattern!r} resolves to different classes {sorted(names)} ({detail}); "
            f"make the pattern match one class, or set boundary_classes[{pattern!r}]"
        )
    (name,) = names
    local = name in facts.classes
    _check_forward(facts, pattern, name, local)
    return _Applied(contract, name, local, frozenset(found))


def _overridden(
    facts: ModuleFacts, contract: Contract, name: str, starts: frozenset[str], strict: bool
) -> _Applied | None:
    if name.startswith(facts.module + "."):
        name = name[len(facts.module) + 1 :]
    local = "." not in name
    if local and name not in facts.classes:
        if not strict:
            return None
        raise PlanError(
            f"{facts.module}: boundary_classes[{contract.pattern!r}] = {name!r} is not a class defined in the "
            f"module; name a class of {facts.module} or a dotted name such as 'torch.nn.Linear'"
        )
    if not local:
        _check_imported_class(facts.module, contract.pattern, name)
    _check_forward(facts, contract.pattern, name, local)
    return _Applied(contract, name, local, starts)


def _check_imported_class(module: str, pattern: str, name: str) -> None:
    """A dotted class (``torch.nn.Linear``) whose module is imported must be there; nothing is
    imported to find out (a plan runs no code). One whose module is not imported is left to bind,
    where a boundary no module matches is refused."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        owner = sys.modules.get(".".join(parts[:cut]))
        if owner is None:
            continue
        found: object = owner
        for attr in parts[cut:]:
            found = getattr(found, attr, None)
        if not isinstance(found, type):
            raise PlanError(
                f"{module}: boundary_classes[{pattern!r}] = {name!r}, but {'.'.join(parts[:cut])} has no class "
                f"{'.'.join(parts[cut:])!r}; fix the class name (e.g. 'torch.nn.Linear')"
            )
        return


def _check_forward(facts: ModuleFacts, pattern: str, name: str, local: bool) -> None:
    if local and not facts.has_forward(name):
        raise PlanError(
            f"{facts.module}: boundary {pattern!r} is class {name!r}, which has no forward of its own or "
            "inherited; point the pattern at a module that defines forward"
        )


def _torch_kind(facts: ModuleFacts, item: _Applied) -> str:
    """The boundary's class, or for a local subclass of ``torch.nn.Linear`` / ``torch.nn.Embedding``
    (Gemma's scaled word embedding) that torch class: the placement rules of a leaf apply to it."""
    if item.local:
        for base in sorted(facts.external_bases(item.cls)):
            if base.rpartition(".")[2] in ("Linear", "Embedding"):
                return base
    return item.cls


def _check_shared_classes(module: str, applied: list[_Applied]) -> None:
    """One lowered class has one forward: every pattern that lands on it needs the same contract,
    and none may bind it at run time as well (its lowered forward would apply that contract's
    entry and exit, and the run-time wrapper again)."""
    first: dict[str, _Applied] = {}
    for item in applied:
        if not item.local or item.contract.skip_source_lowering:
            continue
        other = first.setdefault(item.cls, item)
        mine, theirs = item.contract.to_dict(), other.contract.to_dict()
        for field in _COMPARED:
            if mine.get(field) != theirs.get(field):
                raise PlanError(
                    f"{module}: boundaries {other.contract.pattern!r} and {item.contract.pattern!r} both lower "
                    f"class {item.cls!r} but differ in {field}: {theirs.get(field)!r} vs {mine.get(field)!r}; "
                    "give them identical contracts (only params may differ), or mark both skip_source_lowering"
                )
    for item in applied:
        lowered = first.get(item.cls)
        if item.local and item.contract.skip_source_lowering and lowered is not None:
            raise PlanError(
                f"{module}: boundary {item.contract.pattern!r} binds class {item.cls!r} at run time "
                f"(skip_source_lowering), but {lowered.contract.pattern!r} rewrites that class's forward from source, "
                "which would apply the entry and exit ops a second time; drop skip_source_lowering (identical "
                "contracts share the rewritten forward), or mark every boundary of the class skip_source_lowering"
            )


def _roots(facts: ModuleFacts, applied: list[_Applied]) -> tuple[str, ...]:
    roots = {start for item in applied for start in item.starts}
    bases = facts.pretrained_roots()
    for name in facts.classes:
        if name not in bases and any(b in facts.mro(name) for b in bases):
            roots.add(name)
    return tuple(sorted(roots, key=lambda name: facts.classes[name].lineno))
