"""The plan as data: frozen dataclasses, built and validated by :mod:`hp_lazy.plan.parse`.

Vocabulary (DESIGN.md section 2): a *contract* says, for every module whose FQN matches
``pattern``, how each forward input and output is placed on each mesh axis before (``src``) and
after (``dst``) the boundary, and how each parameter under it is placed.

Input keys are forward parameter names (``"hidden_states"``; ``"input"`` for torch leaves).
Output keys are ``"output"`` (the sole return value, or position 0 of a tuple return) and
``"output.<i>"`` (tuple position ``i``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from hp_lazy.plan.placement import Placement

AxisPlacements = Mapping[str, Placement]
"""Mesh axis -> placement; an axis that is absent means ``R``."""


def _frozen(mapping: Mapping | None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True, kw_only=True)
class Contract:
    """One boundary rule: ``pattern`` is an FQN glob relative to the top-level model
    (``"model.layers.*.self_attn"``, ``"lm_head"``)."""

    pattern: str
    in_src: Mapping[str, AxisPlacements] = field(default_factory=dict)
    in_dst: Mapping[str, AxisPlacements] = field(default_factory=dict)
    out_src: Mapping[str, AxisPlacements] = field(default_factory=dict)
    out_dst: Mapping[str, AxisPlacements] = field(default_factory=dict)
    params: Mapping[str, AxisPlacements] = field(default_factory=dict)
    deferred_bias_params: tuple[str, ...] = ()
    """Biases of rowwise Linears: kept out of the Linear, added once after the reduction."""
    grad_sum_params: tuple[str, ...] = ()
    """Replicated parameters whose gradient is a partial sum over tp (q/k norms between a colwise
    and a rowwise Linear; norms on sequence-sharded activations): all-reduced in backward."""
    skip_source_lowering: bool = False
    """Bind the contract at run time only (leaf modules, shared classes); do not rewrite source."""

    def __post_init__(self) -> None:
        for name in ("in_src", "in_dst", "out_src", "out_dst", "params"):
            value = getattr(self, name)
            object.__setattr__(self, name, _frozen({k: _frozen(v) for k, v in value.items()}))

    def placement(self, side: str, name: str, axis: str) -> Placement:
        """``side`` in in_src/in_dst/out_src/out_dst/params; a missing entry or axis is ``R``."""
        from hp_lazy.plan.placement import REPLICATE

        return getattr(self, side).get(name, {}).get(axis, REPLICATE)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A validated, normalised plan. Build it with ``Plan.from_dict``/``from_json``/``auto``."""

    version: int = 1
    mesh: Mapping[str, int] = field(default_factory=dict)
    modules: tuple[str, ...] = ()
    """Module names (or globs, for ``auto``) whose import is lowered."""
    boundaries: tuple[Contract, ...] = ()
    boundary_classes: Mapping[str, str] = field(default_factory=dict)
    injections: tuple[Mapping[str, object], ...] = ()
    auto: Mapping[str, object] | None = None
    """Set for ``Plan.auto``: ``{"tp": 2, "sequence_parallel": False, "loss_parallel": False}``;
    the contracts of each transformers module are derived when it is imported."""


@dataclass(frozen=True, kw_only=True)
class ModulePlan:
    """The slice of a plan that applies to one module's source: what the lowerer, the cache key
    and the runtime binder see. ``hash`` covers everything that changes the emitted code."""

    module: str
    plan_hash: str
    mesh: Mapping[str, int]
    contracts: tuple[Contract, ...]
    classes: Mapping[str, str]
    """Contract pattern -> class name. A class defined in this module is lowered; any other
    (``"torch.nn.Linear"``, an imported class) is a leaf bound at run time only."""
    roots: tuple[str, ...]
    """Classes of this module whose ``forward`` first binds the model (shards it) if needed."""
    injections: tuple[Mapping[str, object], ...] = ()
    toggle: bool = False
    hash: str = ""
