"""Loss on vocab-sharded logits (``Plan.auto(..., loss_parallel=True)``).

With loss parallel the lm_head keeps its output ``S(-1)`` on tp: each rank holds
``[batch, seq, vocab/tp]`` logits and the full logits are never built. The model's
``loss_function`` becomes :class:`VocabParallelCausalLMLoss`, which computes transformers'
``ForCausalLMLoss`` (shifted labels, ``ignore_index``, ``num_items_in_batch``) from the shards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.comm import wire
from hp_lazy.runtime.mesh import Group
from hp_lazy.runtime.tp.bounds import check_targets


class _VocabParallelCE(torch.autograd.Function):
    """Per-token CE of logits sharded on the vocab: ``[N, V/W]`` (this rank's columns) -> ``[N]``.

    Two all-reduces in forward (max; then sum-exp and target logit together), none in backward.
    """

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, labels: torch.Tensor, g: Group, vocab_start: int, ignore_index: int
    ) -> torch.Tensor:
        x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        top = x.detach().amax(dim=-1)
        _reduce_if_parallel(top, g, dist.ReduceOp.MAX)
        shifted = x - top.unsqueeze(-1)
        local = labels - vocab_start
        valid = labels != ignore_index
        mine = valid & (local >= 0) & (local < x.shape[-1])
        idx = torch.where(mine, local, 0).unsqueeze(-1)
        target = torch.where(mine, shifted.gather(-1, idx).squeeze(-1), 0.0)
        probs = shifted.exp_()
        sums = torch.stack([probs.sum(dim=-1), target])
        _reduce_if_parallel(sums, g, dist.ReduceOp.SUM)
        loss = torch.where(valid, sums[0].log() - sums[1], 0.0)
        probs.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(probs, idx, mine, valid)
        ctx.dtype = logits.dtype
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        probs, idx, mine, valid = ctx.saved_tensors
        dloss = dloss.to(probs.dtype)
        grad = probs * torch.where(valid, dloss, 0.0).unsqueeze(-1)
        grad.scatter_add_(-1, idx, -torch.where(mine, dloss, 0.0).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


def _reduce_if_parallel(t: torch.Tensor, g: Group, op: dist.ReduceOp.RedOpType) -> None:
    if g.size > 1:
        wire.all_reduce(t, g, "forward", op)


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    labels: torch.Tensor,
    g: Group,
    vocab_start: int,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(full_logits.flatten(0, -2), labels.flatten(), ...)`` from vocab shards.

    ``local_logits [..., V/W]`` holds the full vocab's columns ``[vocab_start, vocab_start + V/W)``;
    ``labels [...]`` are global ids. Same value and gradient as the full-logits loss (computed in
    fp32 for half inputs); ``reduction`` is ``"mean"`` (over non-ignored tokens), ``"sum"`` or
    ``"none"`` (shape of ``labels``). A label outside ``[0, V)`` other than ``ignore_index`` raises
    ``F.cross_entropy``'s ``IndexError``.
    """
    if labels.shape != local_logits.shape[:-1]:
        raise ShardingError(
            f"vocab_parallel_cross_entropy over {g.axis}: labels of shape {list(labels.shape)} do not "
            f"match logits of shape {list(local_logits.shape)}; labels must be the logits' shape "
            "without the last (vocab) dim"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ShardingError(
            f"vocab_parallel_cross_entropy: reduction={reduction!r} is not supported; use 'mean', 'sum' or 'none'"
        )
    check_targets(labels, local_logits.shape[-1] * g.size, ignore_index)
    flat_labels = labels.reshape(-1)
    loss = _VocabParallelCE.apply(
        local_logits.reshape(-1, local_logits.shape[-1]), flat_labels, g, int(vocab_start), ignore_index
    )
    if reduction == "none":
        return loss.view(labels.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (flat_labels != ignore_index).sum()


class VocabParallelCausalLMLoss:
    """Drop-in for transformers' ``ForCausalLMLoss`` on this rank's vocab columns."""

    def __init__(self, group: Group, vocab_start: int) -> None:
        self.group = group
        self.vocab_start = vocab_start

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        logits = logits.float()
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
        shift_labels = shift_labels.to(logits.device)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = vocab_parallel_cross_entropy(
            logits, shift_labels, self.group, self.vocab_start, ignore_index=ignore_index, reduction=reduction
        )
        if num_items_in_batch is not None:
            loss = loss / num_items_in_batch
        return loss
