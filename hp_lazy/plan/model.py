"""The plan as data: frozen dataclasses, built and validated by :mod:`hp_lazy.plan.parse`.

Vocabulary (DESIGN.md section 2): a *contract* says, for every module whose FQN matches
``pattern``, how each forward input and output is placed on each mesh axis before (``src``) and
after (``dst``) the boundary, and how each parameter under it is placed.

Input keys are forward parameter names (``"hidden_states"``; ``"input"`` for torch leaves).
Output keys are ``"output"`` (the sole return value, or position 0 of a tuple return) and
``"output.<i>"`` (tuple position ``i``).

A contract may also name an op *inside* the boundary's body (:class:`InnerOp`, at the attention
function call: context parallel) or a *region* that replaces the module's compute
(:class:`Region`: expert-parallel dispatch). Kinds not in :data:`IMPLEMENTED` are refused by
:func:`check_implemented`, at parse time and again by the lowerer.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Literal, Mapping

from hp_lazy.errors import PlanError
from hp_lazy.plan.fqn import matches
from hp_lazy.plan.placement import Placement

AxisPlacements = Mapping[str, Placement]
"""Mesh axis -> placement; an axis that is absent means ``R``."""

InnerCall = Literal["attention"]
InnerKind = Literal["cp_allgather_kv", "cp_ulysses"]
RegionKind = Literal["ep_dispatch"]
INNER_CALLS: tuple[str, ...] = ("attention",)
"""Call sites an inner op can sit at: the attention function a boundary's forward calls."""
INNER_KINDS: Mapping[str, str] = MappingProxyType(
    {"cp_allgather_kv": "context parallel", "cp_ulysses": "context parallel"}
)
REGION_KINDS: Mapping[str, str] = MappingProxyType({"ep_dispatch": "expert parallel"})
IMPLEMENTED: frozenset[str] = frozenset()
"""Inner-op and region kinds hp_lazy lowers and runs. CP/EP work adds its kinds here."""


def one_of(where: str, what: str, value: object, allowed: Mapping[str, str] | tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``; else a :class:`PlanError` listing them."""
    if not isinstance(value, str) or value not in allowed:
        raise PlanError(f"{where}: {what} {value!r} is not one of {sorted(allowed)}; use one of those")
    return value


@dataclass(frozen=True, kw_only=True)
class InnerOp:
    """An op at a call inside the boundary's body, e.g. ``InnerOp(call="attention",
    kind="cp_allgather_kv")``: K/V all-gathered over cp around the attention function."""

    call: InnerCall
    kind: InnerKind

    def __post_init__(self) -> None:
        one_of("InnerOp", "call", self.call, INNER_CALLS)
        one_of("InnerOp", "kind", self.kind, INNER_KINDS)

    def to_dict(self) -> dict[str, str]:
        return {"call": self.call, "kind": self.kind}


@dataclass(frozen=True, kw_only=True)
class Region:
    """A region that replaces the module's compute, e.g. ``Region(kind="ep_dispatch")``: tokens
    sent to the ranks holding their experts and back."""

    kind: RegionKind

    def __post_init__(self) -> None:
        one_of("Region", "kind", self.kind, REGION_KINDS)

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind}



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
    inner: InnerOp | None = None
    """An op at the attention call inside the body (context parallel); refused until implemented."""
    region: Region | None = None
    """A region replacing the module's compute (expert parallel); refused until implemented."""

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


def check_implemented(where: str, contract: Contract) -> None:
    """Refuse an inner op or region whose kind is not in :data:`IMPLEMENTED` (never ignore it)."""
    for key, value, kinds in (("inner", contract.inner, INNER_KINDS), ("region", contract.region, REGION_KINDS)):
        if value is not None and value.kind not in IMPLEMENTED:
            raise PlanError(
                f"{where}.{key}: kind {value.kind!r} ({kinds[value.kind]}) is not implemented yet in "
                f"hp_lazy {_version()}; remove the key"
            )


def _version() -> str:
    # The parent package is imported before any of its modules; reading it is not an import.
    return str(getattr(sys.modules.get("hp_lazy"), "__version__", "?"))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A validated, normalised plan. Build it with ``Plan.from_dict``/``from_json``/``auto``."""

    version: int = 1
    mesh: Mapping[str, int] = field(default_factory=dict)
    modules: tuple[str, ...] = ()
    """Module names or globs (:mod:`hp_lazy.plan.fqn`) whose import is lowered."""
    boundaries: tuple[Contract, ...] = ()
    boundary_classes: Mapping[str, str] = field(default_factory=dict)
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
        return any(matches(m, module_name) for m in self.modules)

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
        }
