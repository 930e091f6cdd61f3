"""PEFT LoRA adapters on planned Linears: the adapter's layout follows its base's cut.

PEFT wraps a targeted ``nn.Linear`` in a tuner layer (``q_proj`` becomes ``q_proj.base_layer``
plus ``q_proj.lora_A.<adapter>`` and ``q_proj.lora_B.<adapter>``) and sizes the adapters from the
base's ``in_features`` / ``out_features``. hp_lazy leaves those attributes **global** (the full
module's sizes, as in the checkpoint), so the adapters PEFT makes are the one-process adapters
(same shapes, same random init), whether PEFT runs before or after ``parallelize``; hp_lazy then
cuts them like their base (``y = base(x) + B(A(x)) * s``)::

    base weight [out, in]   colwise S(0) (also SS(0,k), K/V kept on m ranks)   rowwise S(1)
    lora_A      [r, in]     R, gradient summed over tp                         S(1), the base's cut
    lora_B      [out, r]    the base's dim-0 cut (same blocks, same replicas)  R, gradient summed over tp

A rowwise adapter's output is a partial sum like its base's: the boundary's one reduction sums
both, and the base's deferred bias is still added once after it. The gradient rules come from
the tensor-parallel style unchanged (an unsharded parameter inside a boundary with sharded
parameters holds a partial gradient). Fresh adapters are broadcast from global rank 0 before
they are cut (as DDP does at construction), so ranks seeded differently still agree.

``state_dict()`` of a tuner layer holds its adapters **full** (gathered over the cut axes, a
collective: call it on every rank, e.g. ``peft_model.save_pretrained(d, is_main_process=rank == 0)``),
and the base weight too for a targeted head PEFT saves with the adapter (``lm_head``);
``load_state_dict`` takes them full, so PEFT's own save and load see the one-process adapter.
Other base weights stay local in ``state_dict()`` (``hp_lazy.full_state_dict`` gathers them and
takes full entries as they are).

When PEFT runs after binding, the model is re-bound before its next forward (``owner.refresh``; a
replaced submodule marks the model dirty), outside any ``torch.compile`` trace (the root's
lazy-module hook). ``lora_dropout`` on a rowwise base draws one process's mask for the full
input and keeps this rank's columns (on a colwise base the input is replicated: torch's own
dropout draws one process's mask already, given ranks seeded alike). LoRA on an experts module's
3-D tensors (``target_parameters``) is cut like the experts: by expert (ep, tp's by-expert split)
or within each expert on tp (:func:`lay_out_parameter_adapters`). Refused with the fix: DoRA
and other LoRA variants, ``lora_bias`` on a rowwise base, adapters on a vocab-parallel embedding
or on any tuner layer that is not a LoRA ``Linear``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import ADAPTER_HOOKS, DROPOUT_CUTS
from hp_lazy.runtime.layout import AxisShard, LayoutTable, ParamLayout, shard_in_place
from hp_lazy.runtime.mesh import Group

BASE = "base_layer"
"""The attribute a PEFT tuner layer keeps its wrapped module under (a segment of parameter names)."""


def is_tuner(module: nn.Module) -> bool:
    """A PEFT tuner layer (peft is only looked at when it was imported)."""
    peft = sys.modules.get("peft.tuners.tuners_utils")
    return peft is not None and isinstance(module, peft.BaseTunerLayer)


def base_of(module: nn.Module) -> nn.Module:
    """The module a PEFT tuner layer wraps (through nested wrappers); ``module`` otherwise."""
    while is_tuner(module) and isinstance(getattr(module, BASE, None), nn.Module):
        module = getattr(module, BASE)
    return module


def resolve(module: nn.Module, dotted: str) -> tuple[nn.Module, str] | None:
    """``(owner, leaf)`` of the parameter a plan names ``dotted`` under ``module``, looking
    through tuner layers (``q_proj.weight`` is ``q_proj.base_layer.weight`` under LoRA)."""
    owner_name, _, leaf = dotted.rpartition(".")
    owner = base_of(module)
    for part in owner_name.split(".") if owner_name else ():
        child = owner._modules.get(part)
        if child is None:
            return None
        owner = base_of(child)
    return owner, leaf


def real_name(module: nn.Module, dotted: str) -> str:
    """The ``named_parameters`` name of what the plan calls ``dotted`` (``base_layer`` inserted)."""
    parts, owner, out = dotted.split("."), module, []
    for part in parts[:-1]:
        while is_tuner(owner) and isinstance(getattr(owner, BASE, None), nn.Module):
            out.append(BASE)
            owner = getattr(owner, BASE)
        out.append(part)
        child = owner._modules[part]
        assert child is not None
        owner = child
    while is_tuner(owner) and isinstance(getattr(owner, BASE, None), nn.Module):
        out.append(BASE)
        owner = getattr(owner, BASE)
    return ".".join([*out, parts[-1]])


def plain(name: str) -> str:
    """A parameter name without PEFT's ``base_layer`` segments (its name before PEFT wrapped it)."""
    return ".".join(part for part in name.split(".") if part != BASE)


def old_name(name: str, live: Mapping[str, object]) -> str | None:
    """The name a parameter had before PEFT wrapped its module (:func:`plain`), where that differs
    and no live parameter has it: nested wrappers (``target_parameters`` on two tensors of one
    module) give the inner adapter's old name to the outer adapter, a parameter of its own."""
    before = plain(name)
    return before if before != name and before not in live else None


def tuners(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The outermost tuner layers at or under ``module``, by their name relative to it."""
    inside: list[str] = []
    for name, sub in module.named_modules():
        if is_tuner(sub) and not any(name.startswith(t + ".") for t in inside):
            inside.append(name)
            yield name, sub


def adapter_ids(module: nn.Module) -> set[int]:
    """ids of the adapters' parameters and modules under ``module`` (everything a tuner layer
    holds besides its base): a plan's names never mean them."""
    found: set[int] = set()
    for _, tuner in tuners(module):
        found |= {id(p) for n, p in tuner.named_parameters() if not n.startswith(BASE + ".")}
        found |= {id(m) for n, m in tuner.named_modules() if n and n != BASE and not n.startswith(BASE + ".")}
    return found


def lay_out(
    fqn: str, module: nn.Module, table: LayoutTable, by_param: dict[int, ParamLayout], groups: Mapping[str, Group]
) -> None:
    """Cut the adapters of every tuner layer at or under boundary ``module`` like their base's
    weight, record their layouts (by name and by parameter) and give the layer its state-dict hooks."""
    for name, tuner in tuners(module):
        where = f"{fqn}.{name}" if fqn and name else fqn or name
        base = base_of(tuner)
        weight = base._parameters.get("weight")
        layout = by_param.get(id(weight)) if weight is not None else None
        if layout is None or not layout.shards:
            continue  # a replicated base: its adapters stay replicated (the style sums their gradients)
        cuts = _refuse_unsupported(where, tuner, base, layout)
        made: dict[str, ParamLayout] = {}
        if where.rpartition(".")[2] in _saved_bases():  # PEFT saves a targeted head's base weight too
            made[f"{BASE}.weight"] = layout
        for pname, param in tuner.named_parameters():
            if pname.startswith(BASE + "."):
                continue
            shards = _adapter_cut(pname, cuts)
            full = by_param.get(id(param))
            if full is None:
                fresh = _broadcast(param) if tuple(param.shape) else param
                full = ParamLayout(fqn=f"{where}.{pname}", full_shape=tuple(fresh.shape), shards=shards)
            made[pname] = full
            if full.shards:
                shard_in_place(param, full)
                table.add(full)
            by_param[id(param)] = full
        _hook_state_dict(tuner, made, groups)
        _full_dropout_masks(tuner, tuple(c for c in cuts if c.dim == 1))


def lay_out_parameter_adapters(
    root: nn.Module, table: LayoutTable, by_param: dict[int, ParamLayout], groups: Mapping[str, Group]
) -> None:
    """PEFT's LoRA on a parameter hp_lazy cuts (``target_parameters``: an experts module's 3-D
    ``[E, out, in]`` tensor, one adapter of rank ``r`` per expert), cut like the parameter.

    PEFT reads a cut parameter's full shape from ``ds_shape`` (:func:`.layout.mark_full_shape`), so
    it makes one process's adapters (``num_experts = E``, one process's random init, broadcast from
    rank 0 as above); hp_lazy then keeps this rank's part of each (:func:`_factor_cuts`)::

        lora_A  [r·E, in]   rows e·r + k      by expert: S(0), the parameter's cut
        lora_B  [out, r·E]  columns k·E + e   by expert: SS(1, r), its experts in each of r blocks
        within each expert (tp): the output dim's cut on B's rows, the input dim's on A's columns

    and sets the wrapper's ``num_experts`` to the local count, so PEFT's own forward (the delta
    folded into the parametrized weight) and ``merge`` run on this rank's block. The wrapper is
    the bound experts region now, so its adapters take the region's gradient rules (by expert:
    summed over edp under ep, complete on each rank under tp's by-expert split; within each expert:
    the whole factor's gradient summed over tp); their ``state_dict`` is full, as for the Linear
    adapters. Refused by name: both cuts at once (5.24's experts-TP under ep), and an adapter PEFT
    sized from this rank's shard."""
    for name, module in root.named_modules():
        wanted = getattr(module, "parameter_name", None)
        if not is_tuner(module) or not isinstance(wanted, str):
            continue
        param = base_of(module)._parameters.get(wanted)
        layout = by_param.get(id(param)) if param is not None else None
        if param is None or layout is None or not layout.shards:
            continue
        made: dict[str, ParamLayout] = {}
        for adapter, lora_a in module.lora_A.items():
            factors = {f"lora_A.{adapter}.weight": lora_a.weight,
                       f"lora_B.{adapter}.weight": module.lora_B[adapter].weight}
            if any(id(w) in by_param for w in factors.values()):  # laid out at an earlier bind (a refresh)
                made.update({n: by_param[id(w)] for n, w in factors.items() if id(w) in by_param})
                continue
            rank = module.r[adapter]
            a, b = factors.values()
            transposed = not getattr(module, "_did_swap_in_out_features", True)  # PEFT's reading: [E, out, in]
            _refuse_parameter_adapter(name, wanted, layout, param, (tuple(a.shape), tuple(b.shape)), rank, transposed)
            cuts = _factor_cuts(layout, rank, transposed=transposed)
            for (pname, weight), shards in zip(factors.items(), cuts, strict=True):
                fresh = _broadcast(weight)
                if not shards:  # the factor left whole (a cut within each expert): replicated, as broadcast
                    continue
                full = ParamLayout(fqn=f"{name}.{pname}", full_shape=tuple(fresh.shape), shards=shards)
                shard_in_place(weight, full)
                table.add(full)
                by_param[id(weight)] = made[pname] = full
        module.num_experts = layout.local_shape[0]  # within each expert: all of them, as before
        _hook_state_dict(module, made, groups)


def _out_in(transposed: bool) -> tuple[int, int]:
    """The output and input dims of an experts tensor as PEFT reads it: ``[E, out, in]``, or
    ``[E, in, out]`` when ``transposed``."""
    return (2, 1) if transposed else (1, 2)


def _factor_cuts(
    layout: ParamLayout, rank: int, *, transposed: bool
) -> tuple[tuple[AxisShard, ...], tuple[AxisShard, ...]]:
    """The cuts of ``lora_A [r·E, in]`` and ``lora_B [out, r·E]`` that give this rank the delta of
    its block of the ``[E, out, in]`` parameter (``[E, in, out]`` when ``transposed``): by expert,
    A's rows and B's columns within each of the r blocks; a cut of the output dim, B's rows (its
    packed blocks too); of the input dim, A's columns. The factor left whole holds a partial
    gradient, summed over the axis by the boundary's rule like any whole parameter inside it."""
    out_dim, in_dim = _out_in(transposed)
    a_cuts: list[AxisShard] = []
    b_cuts: list[AxisShard] = []
    for cut in layout.shards:
        if cut.dim == 0:
            a_cuts.append(cut)
            b_cuts.append(replace(cut, dim=1, blocks=rank))
        elif cut.dim == out_dim:
            b_cuts.append(replace(cut, dim=0))
        elif cut.dim == in_dim:
            a_cuts.append(replace(cut, dim=1))
    return tuple(a_cuts), tuple(b_cuts)


def _refuse_parameter_adapter(
    where: str, wanted: str, layout: ParamLayout, param: nn.Parameter,
    shapes: tuple[tuple[int, ...], tuple[int, ...]], rank: int, transposed: bool,
) -> None:
    experts = layout.full_shape[0]
    by_expert = [c for c in layout.shards if c.dim == 0]
    within = [c for c in layout.shards if c.dim != 0]
    if len(layout.full_shape) != 3 or any(c.blocks != 1 for c in by_expert) or (by_expert and within):
        raise ShardingError(
            f"{where}: PEFT LoRA on the parameter {wanted!r} (target_parameters), which hp_lazy cuts "
            f"{layout.describe()} of {list(layout.full_shape)}: hp_lazy cuts such adapters where the experts are "
            "cut by expert (ep, or Plan.auto's by-expert split over tp) or within each expert on tp alone, not "
            "both at once (5.24's experts-TP under ep); target the attention and dense MLP modules "
            "(target_modules) instead, or use transformers 5.25, whose plans split these experts by expert"
        )
    out_dim, in_dim = _out_in(transposed)
    full = layout.full_shape
    wanted_shapes = ((rank * experts, full[in_dim]), (full[out_dim], rank * experts))
    if shapes != wanted_shapes:
        raise ShardingError(
            f"{where}: PEFT LoRA on the parameter {wanted!r} (target_parameters) has lora_A of shape "
            f"{list(shapes[0])} and lora_B of {list(shapes[1])}, sized from this rank's {list(param.shape)} of the "
            f"{list(full)} hp_lazy cuts {layout.describe()}; one process's adapter is {list(wanted_shapes[0])} and "
            f"{list(wanted_shapes[1])} (r x {experts} experts); add every adapter of these experts at once, before "
            "the forward that cuts them (PEFT sizes a later one from the wrapper's local num_experts), with a PEFT "
            "that sizes them from ds_shape"
        )


def _saved_bases() -> tuple[str, ...]:
    """Module names whose base weight PEFT's ``save_pretrained`` stores with the adapter when they
    are targeted (``save_embedding_layers="auto"``): ``embed_tokens``, ``lm_head``, ..."""
    constants = sys.modules.get("peft.utils.constants")
    return tuple(getattr(constants, "EMBEDDING_LAYER_NAMES", ())) if constants is not None else ()


def _adapter_cut(pname: str, cuts: tuple[AxisShard, ...]) -> tuple[AxisShard, ...]:
    """lora_B (weight, bias) takes the base's dim-0 cuts; lora_A's weight its dim-1 cuts."""
    if ".lora_B." in f".{pname}" or pname.startswith("lora_B."):
        return tuple(c for c in cuts if c.dim == 0)
    if (".lora_A." in f".{pname}" or pname.startswith("lora_A.")) and pname.endswith("weight"):
        return tuple(c for c in cuts if c.dim == 1)
    return ()


def _refuse_unsupported(where: str, tuner: nn.Module, base: nn.Module, layout: ParamLayout) -> tuple[AxisShard, ...]:
    lora = sys.modules.get("peft.tuners.lora.layer")
    if lora is None or not isinstance(tuner, lora.Linear) or not isinstance(base, nn.Linear):
        raise ShardingError(
            f"{where}: PEFT wraps this sharded {type(base).__name__} ({layout.describe()}) in "
            f"{type(tuner).__module__}.{type(tuner).__qualname__}; hp_lazy cuts only LoRA adapters of nn.Linear "
            f"bases; leave {where.rpartition('.')[2]} out of target_modules (or out of the plan)"
        )
    variants = dict(getattr(tuner, "lora_variant", {}) or {})
    if variants or any(getattr(tuner, "use_dora", {}).values()):
        raise ShardingError(
            f"{where}: LoRA variant {sorted({type(v).__name__ for v in variants.values()}) or ['DoRA']} (adapters "
            f"{sorted(variants)}) on a base sharded {layout.describe()} is not supported (DoRA normalises over the "
            "whole weight); use plain LoRA (use_dora=False) for this module"
        )
    cuts = layout.shards
    if any(c.dim not in (0, 1) for c in cuts):
        raise ShardingError(f"{where}: base weight laid out {layout.describe()}; LoRA needs a cut on dim 0 or 1")
    rowwise = any(c.dim == 1 for c in cuts)
    if rowwise and any(b.bias is not None for b in tuner.lora_B.values()):
        raise ShardingError(
            f"{where}: lora_bias=True on a rowwise base ({layout.describe()}): the adapter's bias would be added on "
            "every rank before the reduction; use lora_bias=False for this module"
        )
    return cuts


class _ShardedDropout(nn.Dropout):
    """Dropout of a feature-sharded input ``[..., in/n]`` (a rowwise base's): draws one process's
    mask for the full ``[..., in]`` from the same generator and keeps this rank's columns, so the
    masks (and the random stream after them) equal one process's."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return input
        cuts: tuple[AxisShard, ...] = self.__dict__[DROPOUT_CUTS]
        shape = list(input.shape)
        for cut in cuts:
            shape[-1] *= cut.pieces
        noise = torch.empty(shape, dtype=input.dtype, device=input.device).bernoulli_(1.0 - self.p)
        noise.div_(1.0 - self.p)  # torch's own dropout: the same draws, the same rounding
        for cut in reversed(cuts):
            noise = noise.chunk(cut.pieces, dim=-1)[cut.piece]
        return input * noise


def _full_dropout_masks(tuner: nn.Module, cuts: tuple[AxisShard, ...]) -> None:
    """A rowwise adapter's dropout sees this rank's features only: give it one process's mask."""
    if not cuts:
        return
    for dropout in getattr(tuner, "lora_dropout", {}).values():
        if type(dropout) is nn.Dropout and dropout.p > 0:
            dropout.__class__ = _ShardedDropout
            dropout.__dict__[DROPOUT_CUTS] = cuts


def _broadcast(param: nn.Parameter) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            dist.broadcast(param.data, src=0)
    return param.data


def _hook_state_dict(tuner: nn.Module, made: Mapping[str, ParamLayout], groups: Mapping[str, Group]) -> None:
    sharded = {name: layout for name, layout in made.items() if layout.shards}
    if not sharded or tuner.__dict__.get(ADAPTER_HOOKS):
        return
    tuner.__dict__[ADAPTER_HOOKS] = (
        tuner.register_state_dict_post_hook(_gathered(sharded, groups)),
        tuner.register_load_state_dict_pre_hook(_cut(sharded)),
    )


def _gathered(layouts: Mapping[str, ParamLayout], groups: Mapping[str, Group]) -> Any:
    def hook(module: nn.Module, state: dict[str, torch.Tensor], prefix: str, meta: Any) -> None:
        for name, layout in layouts.items():
            key = prefix + name
            if key in state and tuple(state[key].shape) == layout.local_shape:
                state[key] = layout.gather(state[key], groups)

    return hook


def _cut(layouts: Mapping[str, ParamLayout]) -> Any:
    def hook(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, layout in layouts.items():
            key = prefix + name
            value = state.get(key)
            if isinstance(value, torch.Tensor) and tuple(value.shape) == layout.full_shape != layout.local_shape:
                state[key] = layout.local(value)

    return hook
