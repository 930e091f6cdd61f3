"""Which modules hp_lazy lowered in this process, with the plan slice each was lowered under.

The loader registers a module just before executing it; the binder looks classes up here by
``type(module).__module__`` to find the contracts of a model and to check that every rank lowered
the same plan and source.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_lazy.plan.model import ModulePlan


@dataclass(frozen=True, kw_only=True)
class Lowered:
    module: str
    plan: ModulePlan
    source_sha256: str
    required: tuple[str, ...] = ()
    """The patterns of the whole explicit plan (not only this slice) that a model binding under it
    must match, the ones not marked ``optional``; empty for ``Plan.auto``."""


_LOWERED: dict[str, Lowered] = {}


def register(module_name: str, module_plan: ModulePlan, source_sha256: str, required: tuple[str, ...] = ()) -> None:
    _LOWERED[module_name] = Lowered(module=module_name, plan=module_plan, source_sha256=source_sha256,
                                    required=required)


def lookup(module_name: str) -> Lowered | None:
    return _LOWERED.get(module_name)


def lowered_for(cls: type) -> tuple[Lowered, str] | None:
    """The registered module and class name that define ``cls`` or its nearest lowered base."""
    for klass in cls.__mro__:
        found = _LOWERED.get(klass.__module__)
        if found is not None and klass.__name__ in found.plan.roots:
            return found, klass.__name__
    return None


def meshes() -> list[dict[str, int]]:
    """The distinct mesh degrees the lowered modules' plans were made for (registration order)."""
    found: list[dict[str, int]] = []
    for lowered in _LOWERED.values():
        mesh = dict(lowered.plan.mesh)
        if mesh not in found:
            found.append(mesh)
    return found
