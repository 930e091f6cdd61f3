"""The plan as data: frozen dataclasses, built and validated by :mod:`hp_lazy.plan.parse`.

Vocabulary (DESIGN.md section 2): a *contract* says, for every module whose FQN matches
``pattern``, how each forward input and output is placed on each mesh axis before (``src``) and
after (``dst``) the boundary, and how each parameter under it is placed.

Input keys are forward parameter names (``"hidden_states"``; ``"input"`` for torch leaves).
Output keys are ``"output"`` (the sole return value, or position 0 of a tuple return) and
``"output.<i>"`` (tuple position ``i``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import cached_property
from types import MappingProxyType
from typing import Any, Mapping

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

    def to_dict(self) -> dict[str, Any]:
        """The JSON body of this contract (no pattern), placements as strings, empty fields left out."""
        from hp_lazy.plan.parse import contract_to_dict

        return contract_to_dict(self)


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

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """Validate and normalise JSON data (DESIGN.md section 2); raises ``PlanError``."""
        from hp_lazy.plan.parse import plan_from_dict

        return plan_from_dict(data)

    @classmethod
    def from_json(cls, path_or_text: "str | os.PathLike[str]") -> "Plan":
        """JSON text (starting with ``{``) or the path of a JSON file."""
        from hp_lazy.plan.parse import plan_from_json

        return plan_from_json(path_or_text)

    def to_dict(self) -> dict[str, Any]:
        from hp_lazy.plan.parse import plan_to_dict

        return plan_to_dict(self)

    def to_json(self, indent: int | None = None) -> str:
        """Canonical JSON (sorted keys, no whitespace) unless ``indent`` is given."""
        import json

        from hp_lazy.plan.parse import canonical_json

        data = self.to_dict()
        return canonical_json(data) if indent is None else json.dumps(data, sort_keys=True, indent=indent)

    @cached_property
    def hash(self) -> str:
        """Hex sha256 of the canonical JSON of the normalised plan."""
        from hp_lazy.plan.parse import sha256_json

        return sha256_json(self.to_dict())

    def targets(self, module_name: str) -> bool:
        """Whether importing ``module_name`` is lowered: a name check against ``modules``, no I/O."""
        return any(module_name == m or fnmatchcase(module_name, m) for m in self.modules)

    def slice(self, module_name: str, source: str) -> "ModulePlan | None":
        """The part of the plan that applies to one module's source; None if it targets nothing there."""
        from hp_lazy.plan.slice import slice_plan

        return slice_plan(self, module_name, source)


def _auto_plan(
    tp: int = 2, sequence_parallel: bool = False, loss_parallel: bool = False, vocab_parallel_embedding: bool = True
) -> Plan:
    """``Plan.auto(tp=2)``: contracts derived from transformers' own ``base_model_tp_plan`` (and the
    model classes' ``_tp_plan``) when each ``transformers.models.<x>.modeling_<x>`` is imported.

    ``loss_parallel``: keep the logits vocab-sharded and compute the loss from the shards.
    ``vocab_parallel_embedding=False``: keep ``embed_tokens`` replicated (one all-reduce less per
    forward, the embedding's memory on every rank); not possible when it is tied to a sharded lm_head.
    """
    from hp_lazy.plan.parse import plan_from_dict

    flags = {"tp": tp, "sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel,
             "vocab_parallel_embedding": vocab_parallel_embedding}
    return plan_from_dict({"version": 1, "mesh": {"tp": tp}, "auto": flags})


class _AutoAttribute:
    """``Plan.auto(...)`` on the class is the factory; ``plan.auto`` on an instance is the field
    (the instance's ``__dict__`` entry wins over this non-data descriptor)."""

    def __get__(self, obj: object, owner: type) -> Any:
        return _auto_plan if obj is None else obj.__dict__["auto"]


Plan.auto = _AutoAttribute()  # type: ignore[assignment,misc]


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
    hash: str = ""

    def contract(self, pattern: str) -> Contract:
        """The contract for ``pattern`` (KeyError if the slice has none)."""
        for contract in self.contracts:
            if contract.pattern == pattern:
                return contract
        raise KeyError(pattern)

    def to_dict(self) -> dict[str, Any]:
        """Everything the slice holds except its hashes, as JSON data (what ``hash`` is taken over)."""
        return {
            "module": self.module,
            "mesh": dict(self.mesh),
            "contracts": {c.pattern: c.to_dict() for c in self.contracts},
            "classes": dict(self.classes),
            "roots": list(self.roots),
            "injections": [dict(rule) for rule in self.injections],
        }
