"""Binding a model: shard its parameters and give each boundary instance its ops.

``parallelize(model)`` walks the model once, matches every module FQN against the contracts of
the plan slice its top-level class was lowered under, shards the parameters in place, installs
leaf implementations for torch modules (embedding, lm_head, the sequence-parallel layer stack)
and sets ``module._hp_b`` on lowered instances. Lowered root classes call it from their forward,
so after ``activate`` a model runs in parallel with no further call.
"""

from __future__ import annotations

import importlib
import re
from typing import Iterator

import torch.distributed as dist
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.plan.model import Contract, ModulePlan
from hp_lazy.runtime import leaves, registry
from hp_lazy.runtime.binding import Binding, compile_ops
from hp_lazy.runtime.gradsum import GradSum
from hp_lazy.runtime.heads import fit_attention_heads, kv_replicas
from hp_lazy.runtime.loss import VocabParallelCausalLMLoss
from hp_lazy.runtime.mesh import Group, get_mesh
from hp_lazy.runtime.shard import make_spec, shard_parameter

__all__ = ["parallelize"]


def parallelize(model: nn.Module) -> nn.Module:
    """Shard ``model`` in place per the active plan and bind its boundaries; idempotent.

    Call it before building DDP/FSDP or an optimizer that inspects shapes; otherwise the first
    forward of a lowered model does it.
    """
    if model.__dict__.get("_hp_bound"):
        return model
    roots = list(_outermost_roots(model))
    if not roots:
        raise ShardingError(
            f"{type(model).__qualname__}: no class of this model was lowered by hp_lazy (its module "
            f"{type(model).__module__} is not in the active plan); call hp_lazy.activate(plan) before "
            "importing the modeling module"
        )
    for prefix, root, lowered in roots:
        _bind_root(root, lowered)
    for module in model.modules():
        if registry.lowered_for(type(module)) is not None:
            module._hp_bound = True
    model._hp_bound = True
    return model


def _outermost_roots(model: nn.Module) -> Iterator[tuple[str, nn.Module, registry.Lowered]]:
    """Instances of lowered root classes that no other such instance contains."""
    taken: list[str] = []
    for name, module in model.named_modules():
        found = registry.lowered_for(type(module))
        if found is None or any(t == "" or name == t or name.startswith(t + ".") for t in taken):
            continue
        taken.append(name)
        yield name, module, found[0]


def glob_regex(pattern: str) -> re.Pattern[str]:
    """FQN glob: ``*`` and ``?`` stay inside one path segment, ``[...]`` is a character class and
    a ``**`` segment spans any number of segments."""
    parts = []
    for segment in pattern.split("."):
        if segment == "**":
            parts.append(r"[^.]+(?:\.[^.]+)*")
            continue
        out, i = [], 0
        while i < len(segment):
            ch = segment[i]
            close = segment.find("]", i + 1)
            if ch == "*":
                out.append("[^.]*")
            elif ch == "?":
                out.append("[^.]")
            elif ch == "[" and close > i + 1:
                body = segment[i + 1 : close]
                out.append("[^" + re.escape(body[1:]) + "]" if body[0] == "!" else "[" + re.escape(body) + "]")
                i = close
            else:
                out.append(re.escape(ch))
            i += 1
        parts.append("".join(out))
    return re.compile(r"\.".join(parts) + r"\Z")


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
        found.append((glob_regex(pattern), contract))
    return found


def _is_planned_class(module: nn.Module, plan: ModulePlan, contract: Contract) -> bool:
    """The module is of the class the plan resolved for the pattern (by name, through its MRO:
    ``torch.nn.Linear`` names ``nn.Linear`` and any subclass)."""
    wanted = plan.classes.get(contract.pattern)
    if not wanted:
        return True
    short = wanted.rpartition(".")[2]
    return any(k.__name__ == short for k in type(module).__mro__)


def _bind_root(root: nn.Module, lowered: registry.Lowered) -> None:
    plan = lowered.plan
    mesh = get_mesh(dict(plan.mesh))
    groups = {axis: mesh.group(axis) for axis in plan.mesh}
    _check_ranks_agree(lowered, root)
    bound = _match(root, lowered)
    in_contract = {id(m) for _, m, _ in bound}
    for module in root.modules():
        if hasattr(type(module), "_hp_form") and id(module) not in in_contract:
            module._hp_b = None  # a lowered class, used here outside any contract
    if all(group.size == 1 for group in groups.values()):
        return  # nothing is lowered at degree 1 (identity forms): the model runs as it is
    if not bound:
        names = [n for n, _ in root.named_modules()][1:6]
        raise ShardingError(
            f"{type(root).__qualname__}: none of the plan's contracts {[c.pattern for c in plan.contracts]} "
            f"matches a module of this model (its modules are named like {names}); write the patterns "
            "relative to the top-level model, in an explicit plan for composite models"
        )
    for fqn, module, contract in bound:
        _bind_boundary(fqn, module, contract, plan, groups)
    tp = groups.get("tp")
    if tp is not None and tp.size > 1:
        _install_grad_sums(bound, GradSum(tp))
    _install_parallel_loss(root, bound, groups)
    _check_shards_covered(root, bound)


# Attributes of modules whose forward takes statistics over the features a colwise split shards:
# on a shard they would be computed from part of the features, silently.
_FEATURE_STATISTICS = {
    "activation_sparsity": "keeps the top activations by the mean and std of the intermediate features",
}


def _refuse_expert_layouts(fqn: str, module: nn.Module, contract: Contract) -> None:
    """Packed expert weights are cut as [gate; up] blocks on dim -2; transformers' experts
    decorator also allows interleaved or transposed layouts, which that cut would scramble."""
    packed = any(p.kind == "SS" for placements in contract.params.values() for p in placements.values())
    if packed and (getattr(module, "is_concatenated", True) is False or getattr(module, "is_transposed", False)):
        raise ShardingError(
            f"{fqn}: expert weights stored with is_concatenated={getattr(module, 'is_concatenated', True)}, "
            f"is_transposed={getattr(module, 'is_transposed', False)}; hp_lazy shards packed experts only in the "
            "concatenated [gate; up], untransposed layout; leave these experts out of the plan"
        )


def _refuse_feature_statistics(fqn: str, module: nn.Module, sharded_axes: frozenset[str]) -> None:
    for attr, what in _FEATURE_STATISTICS.items():
        value = getattr(module, attr, None)
        if "tp" in sharded_axes and isinstance(value, (int, float)) and value > 0:
            raise ShardingError(
                f"{fqn}: {attr}={value} {what}, which tp splits across ranks, so each rank would use partial "
                f"statistics; use a config with {attr}=0 for this layer, or leave this module out of the plan"
            )


def _match(root: nn.Module, lowered: registry.Lowered) -> list[tuple[str, nn.Module, Contract]]:
    """Every module of ``root`` that a contract names, matched from each instance of a root class
    of the plan inside it (so a text model nested in a composite model matches its patterns too)."""
    plan = lowered.plan
    found: dict[int, tuple[str, nn.Module, Contract]] = {}
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
            if earlier[2] is not hits[0]:
                raise ShardingError(
                    f"{fqn}: matches contract {earlier[2].pattern!r} from the top-level model and "
                    f"{hits[0].pattern!r} from its nested model at {prefix!r}; make the plan's patterns disjoint"
                )
    return list(found.values())  # model order


def _bind_boundary(fqn: str, module: nn.Module, contract: Contract, plan: ModulePlan, groups: dict[str, Group]) -> None:
    sharded_axes = frozenset(
        axis for placements in contract.params.values() for axis, p in placements.items() if p.is_shard
    )
    _refuse_feature_statistics(fqn, module, sharded_axes)
    _refuse_expert_layouts(fqn, module, contract)
    replicas = kv_replicas(fqn, module, contract, groups)
    _shard_params(fqn, module, contract, groups, replicas)
    _shard_row_vectors(fqn, module)
    fit_attention_heads(fqn, module, contract, groups, replicas)
    binding = Binding(
        fqn=fqn,
        contract=contract,
        groups=groups,
        in_ops=compile_ops(contract, groups, sharded_axes, entry=True),
        out_ops=compile_ops(contract, groups, sharded_axes, entry=False),
        deferred_biases=_defer_biases(fqn, module, contract),
        compute=_local_compute(fqn, plan),
    )
    if hasattr(type(module), "_hp_form") and not contract.skip_source_lowering:
        module._hp_b = binding
    else:
        leaves.install(module, binding)


def _local_compute(fqn: str, plan: ModulePlan):
    """The ``local_compute_fn`` of an injection matching ``fqn`` (region form), imported."""
    for injection in plan.injections:
        target = injection.get("local_compute_fn")
        if target and glob_regex(str(injection.get("match", ""))).match(fqn):
            module_name, _, attr = str(target).rpartition(".")
            try:
                return getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise ShardingError(
                    f"{fqn}: injection local_compute_fn={target!r} cannot be imported ({exc}); "
                    "give a dotted path to an importable function"
                ) from exc
    return None


def _params_matching(module: nn.Module, name: str) -> list[tuple[str, nn.Parameter]]:
    if not any(ch in name for ch in "*?["):
        param = _get_param(module, name)
        return [] if param is None else [(name, param)]
    regex = glob_regex(name)
    return [(n, p) for n, p in module.named_parameters() if regex.match(n)]


def _get_param(module: nn.Module, name: str) -> nn.Parameter | None:
    owner_name, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(owner_name) if owner_name else module
    except AttributeError:
        return None
    return owner._parameters.get(leaf)


def _shard_params(fqn: str, module: nn.Module, contract: Contract, groups: dict[str, Group], replicas: dict[str, int]) -> None:
    for name, placements in sorted(contract.params.items()):
        params = _params_matching(module, name)
        if not params and not name.endswith("bias"):
            raise ShardingError(
                f"{fqn}: the plan shards parameter {name!r} but the module has none "
                f"(it has {sorted(n for n, _ in module.named_parameters())[:8]}); fix the plan's params"
            )
        for pname, param in params:
            for axis, placement in placements.items():
                if not placement.is_shard or axis not in groups:
                    continue
                full = f"{fqn}.{pname}" if fqn else pname
                spec = make_spec(full, param.data, placement, groups[axis], replicas=replicas.get(pname, 1))
                shard_parameter(param, spec)


def _shard_row_vectors(fqn: str, module: nn.Module) -> None:
    """A colwise ``nn.Linear`` subclass may scale its outputs with its own per-output parameter
    (a vocab-sized ``logit_scale``): shard every such 1-D parameter like the weight's rows."""
    spec = getattr(module._parameters.get("weight"), "_hp_shard", None)
    if not isinstance(module, nn.Linear) or spec is None or spec.placement.dim != 0:
        return
    for name, param in module._parameters.items():
        if param is not None and name not in ("weight", "bias") and tuple(param.shape) == spec.full_shape[:1]:
            shard_parameter(param, make_spec(f"{fqn}.{name}", param.data, spec.placement, spec.group))


def _defer_biases(fqn: str, module: nn.Module, contract: Contract) -> tuple[nn.Parameter, ...]:
    """Rowwise biases, kept out of their Linear and added once after the reduction."""
    biases = []
    for name in contract.deferred_bias_params:
        param = _get_param(module, name)
        if param is None:
            continue  # the model was built without this bias (e.g. attention_bias=False)
        owner_name = name.rpartition(".")[0]
        leaves.suppress_bias(module.get_submodule(owner_name) if owner_name else module)
        biases.append(param)
    return tuple(biases)


def _install_grad_sums(bound: list[tuple[str, nn.Module, Contract]], grad_sum: GradSum) -> None:
    """Replicated parameters whose gradient is a partial sum over tp get it summed in backward:

    - every unsharded parameter inside a boundary that has tp-sharded parameters (its output is a
      sum of per-rank parts, so each rank's gradient of anything inside is a part too: Qwen3's q/k
      norms, a learnable activation, a diff-attention lambda), except the deferred biases, which are
      added once after the reduction — unless the reduction scatters (sequence parallel:
      ``P(sum) -> S(1)``): then a bias meets only this rank's tokens and is summed too;
    - the contract's ``grad_sum_params``; ``"*"`` means every parameter under the module that no
      contract with params claims (the norms of a sequence-parallel layer stack).
    """
    claimed = {id(p) for fqn, m, c in bound if c.params for p in m.parameters()}
    for fqn, module, contract in bound:
        params = []
        deferred = [p for name in contract.deferred_bias_params if (p := _get_param(module, name)) is not None]
        if any(p.is_shard for placements in contract.params.values() for axis, p in placements.items() if axis == "tp"):
            params += [p for p in module.parameters() if all(p is not d for d in deferred)]
        out = contract.out_dst.get("output", {}).get("tp")
        if out is not None and out.is_shard:
            params += deferred
        for name in contract.grad_sum_params:
            if name in ("*", "**"):
                params += [p for p in module.parameters() if id(p) not in claimed]
            else:
                params += [p for _, p in _params_matching(module, name)]
        for param in params:
            if getattr(param, "_hp_shard", None) is None:
                grad_sum.add(param)
        for param in module.parameters():  # K/V shards kept on several ranks: summed over those
            spec = getattr(param, "_hp_shard", None)
            if spec is not None and spec.replicas > 1:
                grad_sum.add(param, replicas=spec.replicas)


def _check_shards_covered(root: nn.Module, bound: list[tuple[str, nn.Module, Contract]]) -> None:
    """A sharded parameter also used by a module outside every contract (a tied embedding the
    plan leaves replicated) would silently compute on a shard: refuse."""
    owners = [fqn for fqn, _, contract in bound if contract.params]
    for name, module in root.named_modules():
        if any(name == o or name.startswith(o + ".") or o == "" for o in owners):
            continue
        for pname, param in module.named_parameters(recurse=False):
            spec = getattr(param, "_hp_shard", None)
            if spec is not None:
                where = f"{name}.{pname}" if name else pname
                raise ShardingError(
                    f"{where}: this parameter is tied to {spec.fqn}, which the plan shards {spec.placement}, but "
                    f"{name or type(root).__name__} has no contract; give it one (vocab-parallel embedding: "
                    "Plan.auto(vocab_parallel_embedding=True)) or untie the weights"
                )


def _install_parallel_loss(root: nn.Module, bound: list[tuple[str, nn.Module, Contract]], groups: dict[str, Group]) -> None:
    """A head Linear that keeps its logits vocab-sharded (``output: S(-1)`` after the boundary)
    needs a loss that works on the shards: the root's ``loss_function`` becomes vocab-parallel."""
    group = groups.get("tp")
    for fqn, module, contract in bound:
        out = contract.out_dst.get("output", {}).get("tp")
        if group is None or not isinstance(module, nn.Linear) or out is None or not out.is_shard:
            continue
        if out.dim != -1 or not hasattr(root, "loss_function"):
            raise ShardingError(
                f"{fqn}: output {out} on tp keeps logits vocab-sharded, which needs a transformers model "
                "whose loss_function hp_lazy can replace; use out_dst 'R' (gathered logits) for this model"
            )
        root.loss_function = VocabParallelCausalLMLoss(group, group.rank * module.weight.shape[0])


def _check_ranks_agree(lowered: registry.Lowered, root: nn.Module) -> None:
    """Every rank must have lowered the same plan and source: fail loudly instead of hanging later."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = (lowered.module, lowered.plan.plan_hash[:16], lowered.plan.hash[:16], lowered.source_sha256[:16])
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    differ = [(rank, other) for rank, other in enumerate(everyone) if other != mine]
    if differ:
        raise ShardingError(
            f"{type(root).__qualname__}: rank {dist.get_rank()} lowered {mine} (module, plan hash, slice hash, "
            f"source sha256) but ranks {[r for r, _ in differ]} lowered {[o for _, o in differ]}; activate the same "
            "plan on every rank and install the same transformers version everywhere"
        )
