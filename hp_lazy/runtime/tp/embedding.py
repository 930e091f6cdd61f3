"""Vocab-parallel embedding: an ``nn.Embedding`` (or a subclass whose forward is linear in the
lookup, e.g. gemma's scaled embedding) whose weight is ``S(0)`` on tp holds rows ``[start, end)``
of the vocabulary (``num_embeddings`` stays the vocabulary's size, ``padding_idx`` is the local
row); ids of other ranks are looked up as row 0 and zeroed, and the boundary's exit
op sums the partial rows (``P(sum) -> R``, or ``-> S(1)`` under sequence parallel). An id outside
the whole vocabulary raises the plain model's ``IndexError`` (:mod:`.bounds`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hp_lazy.names import BINDING, VOCAB_RANGE
from hp_lazy.plan.placement import Shard
from hp_lazy.runtime.binding import Binding
from hp_lazy.runtime.leaves import subclass
from hp_lazy.runtime.mesh import Group
from hp_lazy.runtime.tp.bounds import check_ids


def vocab_sharded(module: nn.Module, binding: Binding) -> bool:
    placement = binding.contract.params.get("weight", {}).get("tp")
    return isinstance(module, nn.Embedding) and type(placement) is Shard and placement.dim in (0, -2)


class _VocabParallelEmbedding:
    """Mixin: look up this rank's rows, zero the others; the exit op sums over tp."""

    def forward(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        start, end, vocab, _ = getattr(self, VOCAB_RANGE)
        check_ids(input, vocab)
        outside = (input < start) | (input >= end)
        out = super().forward((input - start).masked_fill(outside, 0), *args, **kwargs)  # type: ignore[misc]
        return getattr(self, BINDING).exit(out.masked_fill(outside.unsqueeze(-1), 0.0))


def install_vocab_parallel(module: nn.Embedding, binding: Binding) -> None:
    set_vocab_range(module, binding.groups["tp"], module.padding_idx)
    module.__class__ = subclass(type(module), _VocabParallelEmbedding)


def set_vocab_range(module: nn.Embedding, group: Group, padding_idx: int | None) -> None:
    """Rows ``[start, end)`` of the sharded weight; ``padding_idx`` (the vocabulary's) becomes the
    local row F.embedding skips the gradient of, or None when another rank holds it."""
    rows = module.weight.shape[0]  # already the local shard
    start = group.rank * rows
    setattr(module, VOCAB_RANGE, (start, start + rows, rows * group.size, padding_idx))
    pad = padding_idx
    module.padding_idx = pad - start if pad is not None and start <= pad < start + rows else None


def global_padding_idx(module: nn.Embedding) -> int | None:
    return getattr(module, VOCAB_RANGE)[3]
