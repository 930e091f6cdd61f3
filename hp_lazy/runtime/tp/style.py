"""Tensor parallel: what only tp knows about a bound model.

- validate: refuse modules whose forward takes statistics over the features tp shards
  (activation sparsity) and expert weights in a layout the packed cut would scramble;
- replicas: K/V heads kept on ``tp / kv`` ranks when tp > num_key_value_heads;
- after partition: head counts the attention module caches, per-output vectors of a colwise
  Linear subclass (a vocab-sized ``logit_scale``) sharded like its rows;
- attach: the vocab-parallel embedding leaf; the ``tp_experts`` region (experts split by expert
  over the tp ranks, :func:`hp_lazy.runtime.ep.dispatch.keep_local`), validated and mounted by
  the expert room's functions;
- gradients: which replicated parameters hold partial sums over tp (module docstring of
  :mod:`hp_lazy.runtime.grads`);
- finish: the vocab-parallel loss when the logits stay sharded; the global aux loss when the
  experts take each tp rank's own tokens (sequence parallel).
"""

from __future__ import annotations

from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.plan.model import Contract
from hp_lazy.plan.placement import Shard
from hp_lazy.runtime import outputs
from hp_lazy.runtime.adapters import base_of
from hp_lazy.runtime.binding import Binding
from hp_lazy.runtime.ep import aux
from hp_lazy.runtime.ep.style import attach_region, check_region, mount
from hp_lazy.runtime.layout import plan_layout, shard_in_place
from hp_lazy.runtime.sp.stack import scatters_output, sequence_sharded_params
from hp_lazy.runtime.style import BindContext, params_matching, routes_own_tokens
from hp_lazy.runtime.tp.embedding import install_vocab_parallel, vocab_sharded
from hp_lazy.runtime.tp.heads import check_projections, fit_attention_heads, kv_replicas
from hp_lazy.runtime.tp.loss import VocabParallelCausalLMLoss
from hp_lazy.runtime.tp.norms import install_split_norm, install_split_topk, runs_gaussian_topk

# Attributes of modules whose forward takes statistics over the features a colwise split shards:
# on a shard they would be computed from part of the features, silently.
_FEATURE_STATISTICS = {
    "activation_sparsity": "keeps the top activations by the mean and std of the intermediate features",
}


def shards_on(contract: Contract, axis: str) -> bool:
    return any(isinstance(p.get(axis), Shard) for p in contract.params.values())


class TensorParallelStyle:
    axis = "tp"

    def validate(self, fqn: str, module: nn.Module, contract: Contract, ctx: BindContext) -> None:
        if _is_region(contract):
            check_region(fqn, module, contract, contract.region, ctx)  # type: ignore[arg-type]
        _refuse_feature_statistics(fqn, module, shards_on(contract, "tp"))
        _refuse_expert_layouts(fqn, module, contract)
        check_projections(fqn, module, contract, ctx.groups)

    def replicas(self, fqn: str, module: nn.Module, contract: Contract, ctx: BindContext) -> dict[str, int]:
        return kv_replicas(fqn, module, contract, ctx.groups)

    def after_partition(
        self, fqn: str, module: nn.Module, contract: Contract, ctx: BindContext, replicas: dict[str, int]
    ) -> None:
        if _is_region(contract):
            mount(module, ctx.groups["tp"], local=True)
        _shard_row_vectors(fqn, module, ctx)
        _split_norms(fqn, module, ctx)
        _split_statistics(module, contract, ctx)
        fit_attention_heads(fqn, module, contract, ctx.groups, replicas)

    def attach(self, fqn: str, module: nn.Module, binding: Binding, ctx: BindContext) -> bool:
        if isinstance(module, nn.Embedding) and vocab_sharded(module, binding):
            install_vocab_parallel(module, binding)
            return True
        if _is_region(binding.contract):
            attach_region(module, binding)
            return True
        return False

    def gradients(self, ctx: BindContext) -> None:
        """Partial sums over tp: every unsharded parameter inside a boundary with tp-sharded
        parameters (its output is a sum of per-rank parts, so each rank's gradient of anything
        inside is a part too: Qwen3's q/k norms, a learnable activation, a diff-attention lambda),
        except the deferred biases, added once after the reduction — unless the reduction scatters
        (sequence parallel): then a bias meets only this rank's tokens; the contract's
        ``grad_sum_params`` (``"*"``: the sequence-parallel stack's norms); and K/V shards kept on
        several ranks, summed over those (their piece's slot)."""
        claimed = {id(p) for _, m, c in ctx.bound if c.params for p in m.parameters()} | ctx.whole_sequence
        for _, module, contract in ctx.bound:
            deferred = [id(p) for p in _deferred(module, contract)]
            params: list[nn.Parameter] = []
            if shards_on(contract, "tp"):
                params += [p for p in module.parameters() if id(p) not in deferred]
            if scatters_output(contract):
                params += list(_deferred(module, contract))
            params += sequence_sharded_params(module, contract, claimed)
            params += [p for name in contract.grad_sum_params if name not in ("*", "**") for p in _named(module, name)]
            for param in params:
                layout = ctx.by_param.get(id(param))
                cut = layout.on("tp") if layout is not None else None
                if cut is None:
                    ctx.add_partial(param, "tp")
            for param in module.parameters():
                layout = ctx.by_param.get(id(param))
                cut = layout.on("tp") if layout is not None else None
                if cut is not None and cut.replicas > 1:
                    ctx.add_partial(param, "tp", slots=cut.pieces, slot=cut.piece)

    def finish(self, ctx: BindContext) -> None:
        """A head Linear that keeps its logits vocab-sharded (``output: S(-1)`` after the boundary)
        needs a loss that works on the shards: the root's ``loss_function`` becomes vocab-parallel.
        Experts that take each tp rank's own tokens (sequence parallel) make the load-balancing aux
        loss global over tp (and dp: :func:`hp_lazy.runtime.ep.aux.install`)."""
        group = ctx.groups["tp"]
        if routes_own_tokens(ctx) and ctx.mesh.degree("cp") == 1:  # under cp, cp's finish adds tp to its own
            over = [group] + ([ctx.mesh.group("dp")] if ctx.mesh.degree("dp") > 1 else [])
            aux.install(ctx.root, over, ctx.mesh.degree("dp"), aux.pieces(group), under="sequence parallel")
        for fqn, bound, contract in ctx.bound:
            module = base_of(bound)  # a head PEFT wrapped
            out = contract.out_dst.get("output", {}).get("tp")
            if not isinstance(module, nn.Linear) or not isinstance(out, Shard) or out.dim != -1:
                continue  # S(1): this rank's piece of the sequence, which a module run whole returns (plan.auto.sp)
            get_head = getattr(ctx.root, "get_output_embeddings", None)
            head = get_head() if callable(get_head) else None
            if head is not None and base_of(head) is not module:
                raise ShardingError(
                    f"{fqn}: out_dst['output'] is {out} on tp, which keeps this Linear's output sharded after the "
                    "boundary, but only the model's head may leave its logits vocab-sharded (the vocab-parallel loss "
                    f"reads them); the code after {fqn} reads a whole value: set out_dst['output'] to 'R' on tp"
                )
            if not hasattr(ctx.root, "loss_function"):
                raise ShardingError(
                    f"{fqn}: output {out} on tp keeps logits vocab-sharded, which needs a transformers model "
                    "whose loss_function hp_lazy can replace; use out_dst 'R' (gathered logits) for this model"
                )
            setattr(ctx.root, "loss_function", VocabParallelCausalLMLoss(group, group.rank * module.weight.shape[0]))
            outputs.keep_vocab_whole_for_callers(ctx.root, group)



def _is_region(contract: Contract) -> bool:
    return contract.region is not None and contract.region.kind == "tp_experts"


def _deferred(module: nn.Module, contract: Contract) -> list[nn.Parameter]:
    return [p for name in contract.deferred_bias_params for p in _named(module, name)]


def _named(module: nn.Module, name: str) -> list[nn.Parameter]:
    return [p for _, p in params_matching(module, name)]


def _refuse_expert_layouts(fqn: str, module: nn.Module, contract: Contract) -> None:
    """Packed expert weights are cut as [gate; up] blocks on dim -2; transformers' experts
    decorator also allows interleaved or transposed layouts, which that cut would scramble."""
    cuts = [p for placements in contract.params.values() for p in placements.values() if isinstance(p, Shard)]
    packed = any(p.blocks > 1 for p in cuts)
    if packed and (getattr(module, "is_concatenated", True) is False or getattr(module, "is_transposed", False)):
        raise ShardingError(
            f"{fqn}: expert weights stored with is_concatenated={getattr(module, 'is_concatenated', True)}, "
            f"is_transposed={getattr(module, 'is_transposed', False)}; hp_lazy shards packed experts only in the "
            "concatenated [gate; up], untransposed layout; leave these experts out of the plan"
        )


def _refuse_feature_statistics(fqn: str, module: nn.Module, sharded: bool) -> None:
    """Statistics over the features a colwise split shards, computed by code hp_lazy cannot split
    (Gemma 3n's ``_gaussian_topk`` it can: :func:`_split_statistics`)."""
    for attr, what in _FEATURE_STATISTICS.items():
        value = getattr(module, attr, None)
        if sharded and isinstance(value, (int, float)) and value > 0 and not runs_gaussian_topk(module):
            raise ShardingError(
                f"{fqn}: {attr}={value} {what}, which tp splits across ranks, so each rank would use partial "
                f"statistics; use a config with {attr}=0 for this layer, or leave this module out of the plan"
            )


def _split_statistics(module: nn.Module, contract: Contract, ctx: BindContext) -> None:
    sparsity = getattr(module, "activation_sparsity", None)
    if shards_on(contract, "tp") and isinstance(sparsity, (int, float)) and sparsity > 0 and runs_gaussian_topk(module):
        install_split_topk(module, ctx.groups["tp"])


def _split_norms(fqn: str, module: nn.Module, ctx: BindContext) -> None:
    """A norm inside the boundary whose weight the plan cuts on dim 0 over tp normalises features
    tp splits (``q_norm(q_proj(x))`` over every head): it runs on its slice with row statistics
    summed over tp (:mod:`hp_lazy.runtime.tp.norms`)."""
    for name, sub in module.named_modules():
        if not name or isinstance(sub, (nn.Linear, nn.Embedding)):
            continue
        weight = sub._parameters.get("weight")
        layout = ctx.by_param.get(id(weight)) if weight is not None else None
        cut = layout.on("tp") if layout is not None else None
        if layout is not None and cut is not None and cut.dim == 0 and len(layout.full_shape) == 1:
            install_split_norm(f"{fqn}.{name}", sub, layout, ctx.groups["tp"])


def _shard_row_vectors(fqn: str, module: nn.Module, ctx: BindContext) -> None:
    """A colwise ``nn.Linear`` subclass may scale its outputs with its own per-output parameter
    (a vocab-sized ``logit_scale``): shard every such 1-D parameter like the weight's rows."""
    module = base_of(module)
    weight = module._parameters.get("weight") if isinstance(module, nn.Linear) else None
    layout = ctx.by_param.get(id(weight)) if weight is not None else None
    cut = layout.on("tp") if layout is not None else None
    if layout is None or cut is None or cut.dim != 0:
        return
    for name, param in module._parameters.items():
        if param is not None and name not in ("weight", "bias") and tuple(param.shape) == layout.full_shape[:1]:
            rows = plan_layout(f"{fqn}.{name}", tuple(param.shape), {"tp": Shard(0)}, ctx.groups)
            ctx.table.add(rows)
            ctx.by_param[id(param)] = rows
            shard_in_place(param, rows)
