"""Vocab-parallel embedding: an ``nn.Embedding`` (or a subclass whose forward is linear in the
lookup, e.g. gemma's scaled embedding) whose weight is ``S(0)`` on tp holds rows ``[start, end)``
of the vocabulary; ids of other ranks are looked up as row 0 and zeroed, and the boundary's exit
op sums the partial rows (``P(sum) -> R``, or ``-> S(1)`` under sequence parallel). An id outside
the whole vocabulary raises the plain model's ``IndexError`` (:mod:`.bounds`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hp_lazy.names import VOCAB_RANGE
from hp_lazy.plan.placement import Shard
from hp_lazy.runtime.binding import Binding
from hp_lazy.runtime.leaves import subclass
from hp_lazy.runtime.tp.bounds import check_ids


def vocab_sharded(module: nn.Module, binding: Binding) -> bool:
    placement = binding.contract.params.get("weight", {}).get("tp")
    return isinstance(module, nn.Embedding) and type(placement) is Shard and placement.dim in (0, -2)


class _VocabParallelEmbedding:
    """Mixin: look up this rank's rows, zero the others; the exit op sums over tp."""

    def forward(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        start, end, vocab = getattr(self, VOCAB_RANGE)
        check_ids(input, vocab)
        outside = (input < start) | (input >= end)
        out = super().forward((input - start).masked_fill(outside, 0), *args, **kwargs)  # type: ignore[misc]
        return self._hp_b.exit(out.masked_fill(outside.unsqueeze(-1), 0.0))  # type: ignore[attr-defined]


def install_vocab_parallel(module: nn.Embedding, binding: Binding) -> None:
    group = binding.groups["tp"]
    rows = module.weight.shape[0]  # already the local shard
    start = group.rank * rows
    setattr(module, VOCAB_RANGE, (start, start + rows, rows * group.size))
    pad = module.padding_idx  # F.embedding skips the gradient of this (now local) row
    module.padding_idx = pad - start if pad is not None and start <= pad < start + rows else None
    module.__class__ = subclass(type(module), _VocabParallelEmbedding)
