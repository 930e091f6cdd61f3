"""Loss on vocab-sharded logits (``Plan.auto(..., loss_parallel=True)``).

With loss parallel the lm_head keeps its output ``S(-1)`` on tp: each rank holds
``[batch, seq, vocab/tp]`` logits and the full logits are never built. The model's
``loss_function`` becomes :class:`VocabParallelCausalLMLoss`, which computes transformers'
``ForCausalLMLoss`` (shifted labels, ``ignore_index``, ``num_items_in_batch``) from the shards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hp_lazy.runtime.collectives import vocab_parallel_cross_entropy
from hp_lazy.runtime.mesh import Group


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
