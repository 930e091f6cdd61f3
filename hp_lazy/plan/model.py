"""The plan's parts as data: frozen dataclasses, validated by :mod:`hp_lazy.plan.parse`.

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

import hashlib
import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from hp_lazy.errors import PlanError
from hp_lazy.plan.fqn import shown
from hp_lazy.plan.placement import REPLICATE, Placement

AxisPlacements = Mapping[str, Placement]
"""Mesh axis -> placement; an axis that is absent means ``R``."""

InnerCall = Literal["attention"]
InnerKind = Literal["cp_allgather_kv", "cp_ulysses"]
RegionKind = Literal["ep_dispatch", "tp_experts"]
INNER_CALLS: tuple[str, ...] = ("attention",)
"""Call sites an inner op can sit at: the attention function a boundary's forward calls."""
INNER_KINDS: Mapping[str, str] = MappingProxyType(
    {"cp_allgather_kv": "context parallel", "cp_ulysses": "context parallel"}
)
REGION_KINDS: Mapping[str, str] = MappingProxyType(
    {"ep_dispatch": "expert parallel", "tp_experts": "tensor parallel (experts split by expert over tp)"}
)
REGION_AXES: Mapping[str, str] = MappingProxyType({"ep_dispatch": "ep", "tp_experts": "tp"})
"""The axis each region kind splits the experts over."""
IMPLEMENTED: frozenset[str] = frozenset({"cp_allgather_kv", "cp_ulysses", "ep_dispatch", "tp_experts"})
"""Inner-op and region kinds hp_lazy lowers and runs."""
CP_MODES: Mapping[str, str] = MappingProxyType({"allgather": "cp_allgather_kv", "ulysses": "cp_ulysses"})
"""``Plan.auto(cp_mode=...)`` -> the inner-op kind it puts on attention boundaries."""


def canonical_json(data: object) -> str:
    """Sorted keys, no whitespace: the text every hash in hp_lazy is taken over."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_json(data: object) -> str:
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()


def one_of(where: str, what: str, value: object, allowed: Mapping[str, str] | tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``; else a :class:`PlanError` listing them."""
    if not isinstance(value, str) or value not in allowed:
        raise PlanError(f"{where}: {what} {shown(value)} is not one of {sorted(allowed)}; use one of those")
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
    """A region that replaces the module's compute: ``Region(kind="ep_dispatch")``, tokens sent to
    the ranks holding their experts and back; ``Region(kind="tp_experts")``, the experts split by
    expert over the tp ranks, which hold the same tokens: each runs the (token, slot) pairs routed
    to its own experts and nothing is sent (the contract's exit all-reduce sums the ranks' parts)."""

    kind: RegionKind
    replicated: tuple[str, ...] = ()
    """Parameters or submodules of the experts module kept whole on every rank (transformers'
    ``replicated_with_grad_allreduce``, e.g. a norm every expert's output goes through): they
    run on the rows a rank receives, and their gradient is averaged over dp like a dense one's."""

    def __post_init__(self) -> None:
        one_of("Region", "kind", self.kind, REGION_KINDS)

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, **({"replicated": list(self.replicated)} if self.replicated else {})}


def _frozen(mapping: Mapping | None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True, kw_only=True)
class Contract:
    """One boundary rule: ``pattern`` is an FQN glob relative to the top-level model
    (``"model.layers.*.self_attn"``, ``"lm_head"``; :mod:`hp_lazy.plan.fqn`)."""

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
    optional_params: tuple[str, ...] = ()
    """Names in ``params`` or ``deferred_bias_params`` the model may not have (a bias the config can
    turn off): absent, they are skipped; any other planned parameter that matches nothing is an error."""
    skip_source_lowering: bool = False
    """Bind the contract at run time only (leaf modules, shared classes); do not rewrite source."""
    optional: bool = False
    """The boundary may be absent from a model (a plan shared across families). Otherwise a model
    that binds with no module matching the pattern is refused: the plan asked for a split that
    would not happen."""
    inner: InnerOp | None = None
    """An op at the attention call inside the body (context parallel); refused until implemented."""
    region: Region | None = None
    """A region replacing the module's compute (expert parallel: :mod:`hp_lazy.runtime.ep`)."""

    def __post_init__(self) -> None:
        for name in ("in_src", "in_dst", "out_src", "out_dst", "params"):
            value = getattr(self, name)
            object.__setattr__(self, name, _frozen({k: _frozen(v) for k, v in value.items()}))

    @property
    def axes(self) -> frozenset[str]:
        """The mesh axes any of its placements names."""
        sides = (self.in_src, self.in_dst, self.out_src, self.out_dst, self.params)
        return frozenset(axis for side in sides for axes in side.values() for axis in axes)

    def sharding_axes(self, mesh: Mapping[str, int]) -> list[str]:
        """The axes of ``mesh`` (size above 1) on which it shards a parameter; an ``ep_dispatch``
        region moves the tokens over ep itself (:mod:`hp_lazy.runtime.ep.dispatch`), so not ep."""
        axes = {a for spec in self.params.values() for a, p in spec.items() if p.is_shard}
        if self.region is not None and self.region.kind == "ep_dispatch":
            axes.discard("ep")
        return sorted(a for a in axes if mesh.get(a, 0) != 1)

    def placement(self, side: str, name: str, axis: str) -> Placement:
        """``side`` in in_src/in_dst/out_src/out_dst/params; a missing entry or axis is ``R``."""
        return getattr(self, side).get(name, {}).get(axis, REPLICATE)

    def to_dict(self) -> dict[str, Any]:
        """The JSON body of this contract (no pattern), placements as strings, empty fields left out."""
        out: dict[str, Any] = {}
        for side in ("in_src", "in_dst", "out_src", "out_dst", "params"):
            value = getattr(self, side)
            if value:
                out[side] = {name: {axis: str(p) for axis, p in axes.items()} for name, axes in value.items()}
        for name in ("deferred_bias_params", "grad_sum_params", "optional_params"):
            if getattr(self, name):
                out[name] = list(getattr(self, name))
        if self.skip_source_lowering:
            out["skip_source_lowering"] = True
        if self.optional:
            out["optional"] = True
        if self.inner is not None:
            out["inner"] = self.inner.to_dict()
        if self.region is not None:
            out["region"] = self.region.to_dict()
        return out


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
class AutoFlags:
    """``Plan.auto(...)``'s options; the contracts of each transformers module are derived from
    its config's TP plan when it is imported."""

    tp: int = 2
    sequence_parallel: bool = False
    loss_parallel: bool = False
    """Keep the logits vocab-sharded and compute the loss from the shards."""
    vocab_parallel_embedding: bool = True
    """False: keep ``embed_tokens`` replicated (not possible when tied to a sharded lm_head)."""
    cp: int = 1
    """Context-parallel degree: attention boundaries get the inner op of ``cp_mode``."""
    cp_mode: str = "allgather"
    ep: int = 1
    """Expert-parallel degree (carved out of dp * cp): experts modules get the ``ep_dispatch`` region."""

    @property
    def mesh(self) -> dict[str, int]:
        """The mesh these flags ask for: ``tp`` always, ``cp`` and ``ep`` where above 1 (the one
        derivation the plan parser and every preset of :mod:`hp_lazy.plan.auto` read)."""
        return {"tp": self.tp, **({"cp": self.cp} if self.cp > 1 else {}), **({"ep": self.ep} if self.ep > 1 else {})}

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        if self.cp == 1:  # plans without cp keep the JSON (and hash) they always had
            del out["cp"], out["cp_mode"]
        if self.ep == 1:  # likewise without ep
            del out["ep"]
        return out


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
    refused: Mapping[str, str] = field(default_factory=dict)
    """Classes of this module Plan.auto could not plan (another config's TP plan it cannot translate)
    -> why: a bound model holding one is refused with that reason."""
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
            **({"refused": dict(self.refused)} if self.refused else {}),
        }
