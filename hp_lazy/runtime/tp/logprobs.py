"""Per-token log-probabilities (and entropy, top-1) of a head whose weight is cut over the vocab.

Stacks that fuse the LM head into their loss (TRL's ``add_fused_lm_head``) read
``get_output_embeddings().weight`` and run their own softmax over it, bypassing the lowered head.
Under tp that weight is this rank's rows ``[V/tp, H]``: a softmax over it is a softmax over part of
the vocabulary. :func:`per_token` computes what such a kernel returns for the whole vocabulary
from the shards: ``hidden [N, H]`` (the same on every tp rank) and ``targets [N]`` (global ids) ->
per token ``log p(target)``, and on request the entropy, ``log sum p^2``, the mean logit and whether
the target is the first arg-max, with each logit transformed as ``z = softcap * tanh(scale * x /
softcap) / temperature``. The ``[N, V]`` logits are never built: rows are taken in chunks of at
most ``2**24`` elements of this rank's ``[N, V/tp]`` and recomputed in backward.

Two all-reduces of ``[2, N]`` and ``[5, N]`` fp32 in forward (max and max-before-target; then the
five sums), one of ``[N, H]`` in backward (the hidden gradient, a sum of per-shard parts). The
weight's gradient stays this rank's rows.

:func:`register_head` records, at bind, which parameter is a vocab shard (the output embeddings
of a tp-bound model); :func:`shard_of` answers for a weight tensor an integration is handed.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hp_lazy.runtime import adapters
from hp_lazy.runtime.comm import wire
from hp_lazy.runtime.layout import LayoutTable
from hp_lazy.runtime.mesh import Group

OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""Per-token fields computed on request, besides the log-probabilities (TRL's names)."""
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows ``[start, start + rows)`` of a head weight over the whole ``vocab``."""

    group: Group
    start: int
    vocab: int


_SHARDS: dict[int, tuple[weakref.ref[torch.Tensor], VocabShard]] = {}


def register(weight: torch.Tensor, shard: VocabShard) -> None:
    key = id(weight)
    _SHARDS[key] = (weakref.ref(weight, lambda _: _SHARDS.pop(key, None)), shard)


def register_head(model: nn.Module, table: LayoutTable | None) -> None:
    """Record ``model``'s output-embedding weight if the table cuts it over the vocab on tp alone
    (called once the parameters are the loaded ones)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(adapters.base_of(head), "weight", None) if isinstance(head, nn.Module) else None
    if weight is None or table is None:
        return
    name = next((n for n, p in model.named_parameters(remove_duplicate=False) if p is weight), None)
    layout = table.get(name) if name is not None else None
    cut = layout.on("tp") if layout is not None else None
    if layout is None or cut is None or len(layout.shards) > 1 or cut.dim != 0 or cut.blocks > 1 or cut.replicas > 1:
        return
    rows = layout.local_shape[0]
    register(weight, VocabShard(group=table.groups["tp"], start=cut.piece * rows, vocab=layout.full_shape[0]))


def shard_of(weight: torch.Tensor) -> VocabShard | None:
    found = _SHARDS.get(id(weight))
    return found[1] if found is not None and found[0]() is weight else None


@dataclass(frozen=True)
class Transform:
    """``z = softcap * tanh(scale * x / softcap) * inv_t`` (no tanh when ``softcap`` is None)."""

    scale: float
    softcap: float | None
    inv_t: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        z = x * self.scale
        if self.softcap is not None:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z * self.inv_t

    def backward(self, x: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
        dz = dz * self.inv_t
        if self.softcap is not None:
            dz = dz * (1 - torch.tanh(x * self.scale / self.softcap) ** 2)
        return dz * self.scale


def per_token(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    shard: VocabShard,
    transform: Transform,
    outputs: tuple[str, ...] = (),
) -> tuple[torch.Tensor | None, ...]:
    """``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)`` over the whole vocabulary,
    each ``[N]`` (``None`` where not in ``outputs``); ``weight [V/tp, H]`` is this rank's rows."""
    unknown = sorted(set(outputs) - set(OUTPUTS) - {"log_probs"})
    if unknown:
        raise ValueError(f"vocab-parallel log-probabilities: unknown outputs {unknown}; known: {OUTPUTS}")
    return _VocabParallelLogProbs.apply(hidden, weight, bias, targets, shard, transform, tuple(outputs))


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    kind = hidden.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype


def head_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """This rank's raw logits of ``hidden`` rows, as the one-process kernel forms them (in the
    compute dtype), in fp32."""
    x = hidden.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        x = x + bias.to(dtype)
    return x.float()


def row_chunks(n: int, cols: int) -> Iterator[slice]:
    """Slices of ``n`` rows, each at most ``_CHUNK_ELEMENTS`` of this rank's ``[rows, cols]`` logits."""
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    return (slice(lo, min(lo + step, n)) for lo in range(0, n, step))


class HeadGrads:
    """The gradients of a vocab-shard head ``hidden @ weight.T + bias`` that a kernel's backward
    accumulates chunk by chunk in fp32 from ``dx``, the gradient of this rank's raw logits: the
    weight's and bias's stay this rank's rows, the hidden's is summed over the shards at the end."""

    def __init__(self, needs: tuple[bool, ...], hidden: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        self.hidden, self.weight, self.bias = hidden, weight, bias

        def zeros(t: torch.Tensor | None, need: bool) -> torch.Tensor | None:
            return torch.zeros(t.shape, device=t.device, dtype=torch.float32) if need and t is not None else None

        needed = zip((hidden, weight, bias), needs, strict=True)
        self.d_hidden, self.d_weight, self.d_bias = (zeros(t, n) for t, n in needed)

    def add(self, rows: slice, dx: torch.Tensor) -> None:
        if self.d_hidden is not None:
            self.d_hidden[rows] = dx @ self.weight.float()
        if self.d_weight is not None:
            self.d_weight += dx.t() @ self.hidden[rows].float()
        if self.d_bias is not None:
            self.d_bias += dx.sum(0)

    def result(self, group: Group) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        if self.d_hidden is not None and group.size > 1:
            wire.all_reduce(self.d_hidden, group, "backward")  # each rank's part of the vocabulary
        pairs = ((self.d_hidden, self.hidden), (self.d_weight, self.weight), (self.d_bias, self.bias))
        return tuple(None if d is None or t is None else d.to(t.dtype) for d, t in pairs)  # type: ignore[return-value]


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, shard: VocabShard, transform: Transform, outputs):
        ctx.set_materialize_grads(False)
        n, cols, g = hidden.shape[0], weight.shape[0], shard.group
        dtype = compute_dtype(hidden)
        stats = torch.zeros(7, n, device=hidden.device, dtype=torch.float32)
        top, before, sum_exp, x_sum, sq_sum, z_sum, target = stats  # views
        columns = torch.arange(shard.start, shard.start + cols, device=hidden.device)
        for rows in row_chunks(n, cols):
            z = transform(head_logits(hidden[rows], weight, bias, dtype))
            t = targets[rows]
            top[rows] = z.amax(-1)
            before[rows] = z.masked_fill(columns >= t.unsqueeze(-1), -math.inf).amax(-1)
            e = torch.exp(z - top[rows].unsqueeze(-1))
            sum_exp[rows], x_sum[rows], sq_sum[rows] = e.sum(-1), (e * z).sum(-1), (e * e).sum(-1)
            z_sum[rows] = z.sum(-1)
            mine = (t >= shard.start) & (t < shard.start + cols)
            picked = z.gather(-1, (t - shard.start).clamp(0, cols - 1).unsqueeze(-1)).squeeze(-1)
            target[rows] = torch.where(mine, picked, 0.0)
        local_top = top.clone()
        if g.size > 1:
            wire.all_reduce(stats[:2], g, "forward", dist.ReduceOp.MAX)
        rescale = torch.exp(local_top - top)
        sum_exp.mul_(rescale)
        x_sum.mul_(rescale)
        sq_sum.mul_(rescale * rescale)
        if g.size > 1:
            wire.all_reduce(stats[2:], g, "forward")
        log_z = top + sum_exp.log()
        log_probs = target - log_z
        entropy = log_z - x_sum / sum_exp if "entropy" in outputs else None
        log_sum_sq = sq_sum.log() - 2 * sum_exp.log() if "log_sum_sq_probs" in outputs else None
        mean_logits = z_sum / shard.vocab if "mean_logits" in outputs else None
        is_top1 = (target >= top) & (target > before) if "is_top1" in outputs else None
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, log_z if entropy is None else entropy)
        ctx.shard, ctx.transform, ctx.dtype = shard, transform, dtype
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq, mean_logits, is_top1) if x is not None))
        return log_probs, entropy, log_sum_sq, mean_logits, is_top1

    @staticmethod
    def backward(ctx, d_log_probs, d_entropy, *_):
        hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
        shard, transform, dtype = ctx.shard, ctx.transform, ctx.dtype
        grads = HeadGrads(ctx.needs_input_grad[:3], hidden, weight, bias)
        n, cols = hidden.shape[0], weight.shape[0]
        columns = torch.arange(shard.start, shard.start + cols, device=hidden.device)
        for rows in row_chunks(n, cols):
            x = head_logits(hidden[rows], weight, bias, dtype)
            log_p = transform(x) - log_z[rows].unsqueeze(-1)
            p = log_p.exp()
            dz = torch.zeros_like(p)
            if d_log_probs is not None:
                onehot = (columns == targets[rows].unsqueeze(-1)).float()
                dz += d_log_probs[rows].float().unsqueeze(-1) * (onehot - p)
            if d_entropy is not None:
                dz -= d_entropy[rows].float().unsqueeze(-1) * p * (log_p + entropy[rows].unsqueeze(-1))
            grads.add(rows, transform.backward(x, dz))
        return (*grads.result(shard.group), None, None, None, None)
