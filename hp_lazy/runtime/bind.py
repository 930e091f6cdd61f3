"""The walker: match -> validate -> partition -> bind -> check.

:func:`bind_layout` walks a model once. For every instance of a lowered root class it matches
each module FQN against the contracts of the plan slice the class was lowered under, asks each
axis's style (:mod:`hp_lazy.runtime.style`) to validate, lays every planned parameter out on every
axis (:mod:`hp_lazy.runtime.layout`) and shards it in place, compiles the entry/exit ops, sets
``module._hp_b`` on lowered instances or installs a leaf forward on torch modules, and lets the
styles mark their partial sums and set their loss policy. It returns the model's
:class:`~hp_lazy.runtime.record.BoundModel`; the lifecycle around it (the gradient owner, the
state-dict face, refreshing after a change) is :mod:`hp_lazy.runtime.owner`'s.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import BINDING, FORM
from hp_lazy.plan.fqn import compile_glob
from hp_lazy.plan.model import Contract, ModulePlan
from hp_lazy.plan.placement import Partial, Shard
from hp_lazy.runtime import adapters, hub_kernels, leaves, registry
from hp_lazy.runtime.binding import Binding, compile_ops
from hp_lazy.runtime.cp.style import ContextParallelStyle
from hp_lazy.runtime.ep import aux
from hp_lazy.runtime.ep.style import ExpertParallelStyle
from hp_lazy.runtime.layout import LayoutTable, ParamLayout, plan_layout, shard_in_place
from hp_lazy.runtime.mesh import Group, Mesh, get_mesh
from hp_lazy.runtime.record import BoundModel
from hp_lazy.runtime.sp import inputs, mixers
from hp_lazy.runtime.sp.stack import install_stack
from hp_lazy.runtime.style import (
    BindContext,
    Bound,
    ParallelStyle,
    get_param,
    params_matching,
)
from hp_lazy.runtime.tp.style import TensorParallelStyle

__all__ = ["STYLES", "UnsplitLayersWarning", "bind_layout", "match_rules", "outermost_roots", "tied_to_a_shard"]

class UnsplitLayersWarning(UserWarning):
    """Under tp > 1, no layer of the text stack holds a boundary: every rank runs the layers whole
    (transformers 5.25's Qwen3-VL, LFM2, DiffLlama, ... configs plan only their embedding).
    ``declared``: what the config plans instead (``"XConfig.base_model_tp_plan plans only [...]"``)."""

    def __init__(self, message: str, declared: str) -> None:
        super().__init__(message)
        self.declared = declared


STYLES: dict[str, type] = {"tp": TensorParallelStyle, "cp": ContextParallelStyle, "ep": ExpertParallelStyle}
"""Mesh axis -> its parallelism's style (a new parallelism adds its room and one entry here)."""


def bind_layout(model: nn.Module) -> BoundModel:
    """Lay out, shard in place and bind every boundary of ``model`` (a meta model too): its record,
    without the gradient owner, which holds the Parameter objects (loading replaces them)."""
    roots = list(outermost_roots(model))
    if not roots:
        raise ShardingError(
            f"{type(model).__qualname__}: no class of this model was lowered by hp_lazy (its module "
            f"{type(model).__module__} is not in the active plan); call hp_lazy.activate(plan) before "
            "importing the modeling module"
        )
    meshes = [get_mesh(dict(lowered.plan.mesh)) for _, _, lowered in roots]  # a collective, once
    contexts: list[tuple[str, BindContext, dict[str, ParallelStyle]]] = []
    failure: BaseException | None = None
    try:
        for (prefix, root, lowered), mesh in zip(roots, meshes, strict=True):
            contexts.append((prefix, *_bind_root(root, lowered, mesh)))
        _refuse_unmatched(model, roots, [ctx for _, ctx, _ in contexts])
    except Exception as exc:  # agreed on below, then raised on every rank
        failure = exc
    _agree(model, roots, failure)
    names = {id(p): n for n, p in model.named_parameters()}
    hub_kernels.keep_planned_forwards(
        model,
        planned=[n for n, m in model.named_modules() if m.__dict__.get(BINDING) is not None],
        sharded=[names[pid] for _, ctx, _ in contexts for pid, layout in ctx.by_param.items()
                 if pid in names and layout.shards],
    )
    table: LayoutTable | None = None
    partial: dict[str, tuple[str, int, int]] = {}
    styles: dict[str, ParallelStyle] = {}
    for prefix, ctx, used in contexts:
        table = _merge_table(table, ctx, prefix)
        partial.update({names[pid]: rule for pid, rule in ctx.partial.items() if pid in names})
        for axis, style in used.items():
            styles.setdefault(axis, style)
    return BoundModel(mesh=meshes[0], table=table, roots=tuple(root for _, root, _ in roots), styles=styles,
                      partial=partial)


def _refuse_unmatched(
    model: nn.Module, roots: list[tuple[str, nn.Module, registry.Lowered]], contexts: list[BindContext]
) -> None:
    """Every boundary of an explicit plan (:attr:`registry.Lowered.required`) matches a module of
    the model that binds, unless it is marked ``optional``: a pattern typo, a boundary sliced away
    in every module the plan names, or a ``boundary_classes`` entry naming a class the model does
    not use would otherwise leave those modules whole on every rank, silently. (``Plan.auto``
    derives its boundaries from the model's own TP/EP plans, where a config may leave a planned
    module out.)"""
    required = {pattern for _, _, lowered in roots for pattern in lowered.required}
    matched = {contract.pattern for ctx in contexts for _, _, contract in ctx.bound}
    missing = sorted(required - matched)
    if not missing:
        return
    classes = {pattern: cls for _, _, lowered in roots for pattern, cls in lowered.plan.classes.items()}
    modules = sorted({lowered.module for _, _, lowered in roots})
    named = [n for n, _ in model.named_modules()][1:6]
    lines = [
        f"{p!r} (no module at a path it matches is a {classes[p]})" if p in classes
        else f"{p!r} (sliced away: no class of {modules} resolves it, or none is the one its boundary_classes names)"
        for p in missing
    ]
    raise ShardingError(
        f"{type(model).__qualname__}: the plan's boundaries {'; '.join(lines)} match no module of this model (its "
        f"modules are named like {named}), so what they plan would run whole on every rank; fix the pattern "
        "(relative to the top-level model) or boundary_classes, or mark a boundary \"optional\": true when the "
        "plan is shared by models that lack it"
    )


def _merge_table(table: LayoutTable | None, ctx: BindContext, prefix: str) -> LayoutTable:
    merged = table or LayoutTable(ctx.groups)
    for fqn in ctx.table:
        layout = ctx.table.get(fqn)
        assert layout is not None
        merged.alias(f"{prefix}.{fqn}" if prefix else fqn, layout)
    return merged


def outermost_roots(model: nn.Module) -> Iterator[tuple[str, nn.Module, registry.Lowered]]:
    """Instances of lowered root classes that no other such instance contains."""
    taken: list[str] = []
    for name, module in model.named_modules():
        found = registry.lowered_for(type(module))
        if found is None or any(t == "" or name == t or name.startswith(t + ".") for t in taken):
            continue
        taken.append(name)
        yield name, module, found[0]


def _bind_root(
    root: nn.Module, lowered: registry.Lowered, mesh: Mesh
) -> tuple[BindContext, dict[str, ParallelStyle]]:
    """Everything rank-local of binding one root (no collective: see :func:`_agree`): its context
    and the style instance of each axis that bound it."""
    plan = lowered.plan
    groups = {axis: mesh.group(axis) for axis in plan.mesh}
    ctx = BindContext(root=root, plan=plan, mesh=mesh, groups=groups, table=LayoutTable(groups))
    ctx.bound = _match(root, lowered)
    in_contract = {id(m) for _, m, _ in ctx.bound}
    for module in root.modules():
        if hasattr(type(module), FORM) and id(module) not in in_contract:
            setattr(module, BINDING, None)  # a lowered class, used here outside any contract
    if all(group.size == 1 for group in groups.values()):
        _data_parallel_aux(ctx)
        return ctx, {}  # nothing is lowered at degree 1 (identity forms): the model runs as it is
    _refuse_unplanned_towers(root, plan, groups)
    if not ctx.bound:
        names = [n for n, _ in root.named_modules()][1:6]
        raise ShardingError(
            f"{type(root).__qualname__}: none of the plan's contracts {[c.pattern for c in plan.contracts]} "
            f"matches a module of this model (its modules are named like {names}); write the patterns "
            "relative to the top-level model, in an explicit plan for composite models"
        )
    used: dict[str, ParallelStyle] = {a: STYLES[a]() for a, g in groups.items() if g.size > 1 and a in STYLES}
    styles = list(used.values())
    for fqn, module, contract in ctx.bound:
        if all(ctx.groups[axis].size == 1 for axis in contract.axes):  # e.g. tp=1 under cp: runs as written
            for style in styles:
                style.validate(fqn, module, contract, ctx)
            setattr(module, BINDING, None)
            continue
        _bind_boundary(fqn, module, contract, ctx, styles)
    adapters.lay_out_parameter_adapters(root, ctx.table, ctx.by_param, ctx.groups)
    mixers.gather_mixers(ctx)
    inputs.cut_layer_inputs(ctx)
    inputs.refuse_outside_calls(ctx)
    for style in styles:
        style.gradients(ctx)
        style.finish(ctx)
    _data_parallel_aux(ctx)
    _alias_tied(ctx)
    _check_shards_covered(ctx)
    _warn_unsplit_layers(ctx)
    return ctx, used


def _data_parallel_aux(ctx: BindContext) -> None:
    """An MoE's load-balancing aux loss over every dp rank's rows where no style made it global
    over the ranks it splits rows between (dp alone, dp x tp): :func:`hp_lazy.runtime.ep.aux.install`."""
    if ctx.mesh.degree("dp") > 1 and aux.routes(ctx.root):
        aux.install(ctx.root, [ctx.mesh.group("dp")], ctx.mesh.degree("dp"), under="data parallel")


def _refuse_unplanned_towers(root: nn.Module, plan: ModulePlan, groups: dict[str, Group]) -> None:
    """A module of a class Plan.auto could not plan (its config's TP plan did not translate while
    the module's other plans did) would run whole on every tp rank: refused, with the reason."""
    if not plan.refused or groups.get("tp") is None or groups["tp"].size == 1:
        return
    for fqn, module in root.named_modules():
        why = plan.refused.get(type(module).__name__) if type(module).__module__ == plan.module else None
        if why is not None:
            raise ShardingError(
                f"{fqn or type(root).__name__} ({type(module).__name__}): Plan.auto planned this model's other parts "
                f"for tp={groups['tp'].size} but not this one, which would run whole on every rank: {why}"
            )


def _strip_prefix(root: nn.Module) -> str | None:
    """``model.`` when ``root`` is the base model itself (``LlamaModel`` rather than ``...ForCausalLM``)."""
    prefix = getattr(root, "base_model_prefix", None)
    if prefix and not isinstance(getattr(root, prefix, None), nn.Module):
        return prefix + "."
    return None


def _matchers(plan: ModulePlan, root: nn.Module) -> list[tuple[re.Pattern[str], Contract]]:
    strip = _strip_prefix(root)
    found = []
    for contract in plan.contracts:
        pattern = contract.pattern
        if strip and pattern.startswith(strip):
            pattern = pattern[len(strip):]
        found.append((compile_glob(pattern), contract))
    return found


def _is_planned_class(module: nn.Module, plan: ModulePlan, contract: Contract) -> bool:
    """The module is of the class the plan resolved for the pattern (by name, through its MRO:
    ``torch.nn.Linear`` names ``nn.Linear`` and any subclass)."""
    wanted = plan.classes.get(contract.pattern)
    if not wanted:
        return True
    short = wanted.rpartition(".")[2]
    return any(k.__name__ == short for k in type(adapters.base_of(module)).__mro__)


def match_rules(root: nn.Module, plan: ModulePlan) -> list[Bound]:
    """The modules of ``root`` a plan slice names, before anything is lowered or bound: modules of
    classes defined in the slice's module are matched from each instance of such a class that
    holds the patterns (the report of :func:`hp_lazy.runtime.report.planned`)."""
    found: dict[int, Bound] = {}
    for prefix, sub in root.named_modules():
        if type(sub).__module__ != plan.module or type(sub).__name__ not in plan.roots:
            continue
        matchers = _matchers(plan, sub)
        for rel, module in sub.named_modules():
            hits = [c for regex, c in matchers if regex.match(rel) and _is_planned_class(module, plan, c)]
            if hits:
                found.setdefault(id(module), (f"{prefix}.{rel}" if prefix and rel else prefix or rel, module, hits[0]))
    return list(found.values())


def _match(root: nn.Module, lowered: registry.Lowered) -> list[Bound]:
    """Every module of ``root`` that a contract names, matched from each instance of a root class
    of the plan inside it (so a text model nested in a composite model matches its patterns too)."""
    plan = lowered.plan
    found: dict[int, Bound] = {}
    for prefix, sub in root.named_modules():
        hit = registry.lowered_for(type(sub))
        if hit is None or hit[0] is not lowered:
            continue
        matchers = _matchers(plan, sub)
        for rel, module in sub.named_modules():
            hits = [c for regex, c in matchers if regex.match(rel) and _is_planned_class(module, plan, c)]
            fqn = f"{prefix}.{rel}" if prefix and rel else prefix or rel
            if len(hits) > 1:
                raise ShardingError(
                    f"{fqn}: matches the contracts {[c.pattern for c in hits]}; make the plan's patterns disjoint"
                )
            if not hits:
                continue
            earlier = found.setdefault(id(module), (fqn, module, hits[0]))
            # the same contract under two patterns (a layer stack planned from a composite model and from its tower)
            if earlier[2] is not hits[0] and earlier[2].to_dict() != hits[0].to_dict():
                raise ShardingError(
                    f"{fqn}: matches contract {earlier[2].pattern!r} from the top-level model and "
                    f"{hits[0].pattern!r} from its nested model at {prefix!r}; make the plan's patterns disjoint"
                )
    return list(found.values())  # model order


def _bind_boundary(
    fqn: str, module: nn.Module, contract: Contract, ctx: BindContext, styles: list[ParallelStyle]
) -> None:
    for style in styles:
        style.validate(fqn, module, contract, ctx)
    replicas = {style.axis: style.replicas(fqn, module, contract, ctx) for style in styles}
    _partition(fqn, module, contract, ctx, replicas)
    adapters.lay_out(fqn, module, ctx.table, ctx.by_param, ctx.groups)
    for style in styles:
        style.after_partition(fqn, module, contract, ctx, replicas[style.axis])
    binding = Binding(
        fqn=fqn,
        contract=contract,
        groups=ctx.groups,
        in_ops=compile_ops(contract, ctx.groups, entry=True),
        out_ops=compile_ops(contract, ctx.groups, entry=False),
        deferred_biases=_defer_biases(fqn, module, contract),
    )
    setattr(module, BINDING, binding)
    if hasattr(type(module), FORM) and not contract.skip_source_lowering:
        return  # the lowered forward reads it
    if isinstance(module, nn.ModuleList):
        install_stack(module, binding, ctx.root.get_submodule(fqn.rpartition(".")[0]))
    elif not any(style.attach(fqn, module, binding, ctx) for style in styles):
        leaves.wrap_forward(module, binding)


def _partition(
    fqn: str, module: nn.Module, contract: Contract, ctx: BindContext, replicas: dict[str, dict[str, int]]
) -> None:
    """Lay every planned parameter out on every axis and replace it by this rank's shard."""
    for name, placements in sorted(contract.params.items()):
        params = params_matching(module, name)
        if not params and name not in contract.optional_params:
            extra = adapters.adapter_ids(module)
            own = sorted(adapters.plain(n) for n, p in module.named_parameters() if id(p) not in extra)
            peft = ""
            if extra or "lora_" in name or "base_layer" in name:
                peft = (" (a plan names the base model's parameters: PEFT's adapters are cut like their base by "
                        "hp_lazy, and its base_layer segments are left out)")
            raise ShardingError(
                f"{fqn}: the plan shards parameter {name!r} but the module has none (it has {own[:8]}){peft}; fix "
                "the plan's params, or list the name in optional_params if the model may not have it"
            )
        for pname, param in params:
            full = f"{fqn}.{pname}" if fqn else pname
            held = {axis: r[key] for axis, r in replicas.items() if (key := pname if pname in r else name) in r}
            earlier = ctx.by_param.get(id(param))
            shape = earlier.full_shape if earlier is not None else tuple(param.shape)
            layout = plan_layout(full, shape, placements, ctx.groups, replicas=held)
            if not layout.shards:
                continue
            _refuse_experts_cut_without_region(fqn, module, contract, full, shape, placements)
            if earlier is not None and earlier.shards != layout.shards:
                raise ShardingError(
                    f"{full}: this parameter is tied to {earlier.fqn}, laid out {earlier.describe()}, but the plan "
                    f"asks for {layout.describe()} here; give tied parameters one placement"
                )
            ctx.table.add(layout)
            ctx.by_param[id(param)] = layout
            shard_in_place(param, layout)


def _refuse_experts_cut_without_region(
    fqn: str, module: nn.Module, contract: Contract, full: str, shape: tuple[int, ...], placements: Any
) -> None:
    """An experts module's ``[num_experts, ...]`` tensor cut on its expert dim runs only under an
    experts region (which routes each token to the rank holding its expert): the module's own
    forward indexes experts by their global ids, which this rank's slice does not hold."""
    total = getattr(adapters.base_of(module), "num_experts", None)
    if contract.region is not None or not isinstance(total, int) or len(shape) < 2 or shape[0] != total:
        return
    for axis, placement in sorted(placements.items()):
        if isinstance(placement, Shard) and placement.normalized(len(shape)).dim == 0:
            raise ShardingError(
                f"{full}: the plan cuts this [num_experts={total}, ...] tensor by expert ({placement} on {axis}), "
                f"but {fqn} has no experts region, and its own forward indexes experts this rank does not hold; "
                f"add the region {{\"kind\": \"{'ep_dispatch' if axis == 'ep' else 'tp_experts'}\"}} "
                "to the contract (or cut the experts inside, on dim 1 or 2)"
            )


def _defer_biases(fqn: str, module: nn.Module, contract: Contract) -> tuple[tuple[nn.Module, str], ...]:
    """Rowwise biases, kept out of their Linear and added once after the reduction."""
    _check_rowwise_biases(fqn, module, contract)
    biases = []
    for name in contract.deferred_bias_params:
        if get_param(module, name) is None:
            if name in contract.optional_params:
                continue  # the model was built without this bias (e.g. attention_bias=False)
            raise ShardingError(
                f"{fqn}: the plan defers bias {name!r} but the module has none; fix deferred_bias_params, or "
                "list the name in optional_params if the model may not have it"
            )
        found = adapters.resolve(module, name)
        assert found is not None  # get_param found it
        owner, leaf = found
        leaves.suppress_bias(owner)
        biases.append((owner, leaf))
    return tuple(biases)


def _check_rowwise_biases(fqn: str, module: nn.Module, contract: Contract) -> None:
    """In a boundary whose output is a partial sum, a bias the model has on a rowwise weight
    (``<x>.weight`` cut on its input dim) must be deferred: added on every rank, it would count
    once per rank."""
    for name, spec in sorted(contract.params.items()):
        if not (name == "weight" or name.endswith(".weight")):
            continue
        for axis, weight in spec.items():
            out = contract.placement("out_src", "output", axis)
            if not isinstance(weight, Shard) or weight.dim not in (1, -1) or not isinstance(out, Partial):
                continue
            bias = name[: -len("weight")] + "bias"
            if get_param(module, bias) is not None and bias not in contract.deferred_bias_params:
                raise ShardingError(
                    f"{fqn}: {name} is rowwise ({weight} on {axis}) and the module has {bias!r}, which the plan "
                    f"does not defer: added on every rank before the {axis} reduction it would count "
                    f"{axis}-fold; add {bias!r} to deferred_bias_params"
                )


def _alias_tied(ctx: BindContext) -> None:
    """Every name of a sharded parameter (tied weights have several) is in the table."""
    live = dict(ctx.root.named_parameters(remove_duplicate=False))
    for name, param in live.items():
        layout = ctx.by_param.get(id(param))
        if layout is not None:
            ctx.table.alias(name, layout)
            before = adapters.old_name(name, live)
            if before:
                ctx.table.alias(before, layout)  # its name once PEFT's merge_and_unload unwraps it


def _check_shards_covered(ctx: BindContext) -> None:
    """A sharded parameter also used by a module outside every contract (a tied embedding the
    plan leaves replicated) would silently compute on a shard: refuse."""
    owners = [fqn for fqn, _, contract in ctx.bound if contract.params]
    for name, module in ctx.root.named_modules():
        if any(name == o or name.startswith(o + ".") or o == "" for o in owners):
            continue
        for pname, param in module.named_parameters(recurse=False):
            layout = ctx.by_param.get(id(param))
            if layout is not None:
                raise tied_to_a_shard(f"{name}.{pname}" if name else pname, layout, name or type(ctx.root).__name__)


def _warn_unsplit_layers(ctx: BindContext) -> None:
    """Under tp > 1, text attention layers none of which holds a boundary: every rank holds and
    computes them whole, which tp is meant to split. Not an error (the plan is what the config
    declares, and the numbers are one process's) but never silent: warned, with the fix."""
    tp = ctx.groups.get("tp")
    config = getattr(ctx.root, "config", None)
    if tp is None or tp.size == 1 or config is None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = sorted({name.rpartition(".")[0] for name, m in ctx.root.named_modules()
                     if getattr(m, "config", None) is text and leaves.calls_attention(m)})
    bound = [fqn for fqn, _, _ in ctx.bound]
    if not layers or any(b == layer or b.startswith(layer + ".") for layer in layers for b in bound):
        return
    planned = sorted(getattr(text, "base_model_tp_plan", None) or {})
    declared = f"{type(text).__name__}.base_model_tp_plan plans only {planned}"
    family = type(ctx.root).__qualname__
    warnings.warn(UnsplitLayersWarning(
        f"{family}: under tp={tp.size} no module of its {len(layers)} attention layers ({layers[0]} ... "
        f"{layers[-1]}) is split: {declared}, so every rank holds and runs those layers whole (one process's "
        "memory and compute for them); pass a plan that names their projections (README: Plans; `python -m "
        "hp_lazy layout` shows what each rank holds), or train this family without tp",
        declared,
    ), stacklevel=2)


def tied_to_a_shard(where: str, layout: ParamLayout, module: str) -> ShardingError:
    return ShardingError(
        f"{where}: this parameter is tied to {layout.fqn}, which the plan shards {layout.describe()}, "
        f"but {module} has no contract; give it one (vocab-parallel embedding: "
        "Plan.auto(vocab_parallel_embedding=True)) or untie the weights"
    )


def _agree(
    model: nn.Module, roots: list[tuple[str, nn.Module, registry.Lowered]], failure: BaseException | None
) -> None:
    """One all-gather over the world of what each rank lowered and whether its binding failed.

    Binding is rank-local up to here, so a rank that failed has not left its peers inside a
    collective: every rank learns the outcome and raises. When every rank failed, each raises its
    own error (they are the same plan on the same model); when only some did, every rank raises
    one :class:`ShardingError` naming them. Different plans or sources on different ranks are
    refused here too, before anything runs on the wire.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if failure is not None:
            raise failure
        return
    lowered = [(lw.module, lw.plan.plan_hash[:16], lw.plan.hash[:16], lw.source_sha256[:16]) for _, _, lw in roots]
    told = None if failure is None else f"{type(failure).__name__}: {str(failure)[:800]}"
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (lowered, told))
    differ = [(rank, theirs) for rank, (theirs, _) in enumerate(everyone) if theirs != lowered]
    if differ:
        raise ShardingError(
            f"{type(model).__qualname__}: rank {dist.get_rank()} lowered {lowered} (module, plan hash, slice hash, "
            f"source sha256) but ranks {[r for r, _ in differ]} lowered {[o for _, o in differ]}; activate the same "
            "plan on every rank and install the same transformers version everywhere"
        )
    failed = [(rank, text) for rank, (_, text) in enumerate(everyone) if text is not None]
    if not failed:
        return
    if failure is not None and len(failed) == len(everyone):
        raise failure
    raise ShardingError(
        f"{type(model).__qualname__}: binding failed on rank(s) {[r for r, _ in failed]} of {len(everyone)} "
        f"(rank {failed[0][0]}: {failed[0][1]}); every rank raises this error so that none waits in a collective "
        "for the failed ones; fix the cause on those ranks (every rank must build the same model and plan)"
    ) from failure
