"""Parameters held whole on every rank start alike on every rank, as DDP makes them at construction.

A weight read from the checkpoint is the same on every rank. A weight the model draws at random
when it is built (a new classification or value head, resized embedding rows, adapters on a
replicated base) is each rank's own draw unless every rank was seeded alike, and torchrun's
processes are not: tp ranks holding different copies of one replicated weight compute different
numbers, and dp ranks drift apart, silently. DDP hides this by broadcasting rank 0's parameters
when it is built; hp_lazy, owning the gradients in its place, does the same for what differs.

At bind, every parameter that no axis cuts is fingerprinted (its float64 sum and sum of squares;
bit-equal tensors give bit-equal fingerprints), one all-reduce over the world takes the largest
and smallest of each, and those that differ are broadcast from global rank 0, with a warning
naming them (seed every rank alike, ``transformers.set_seed``, to keep each rank's own draw
out of it). Cut parameters come from the checkpoint (or, for LoRA on a cut base, are broadcast
before they are cut: :mod:`hp_lazy.runtime.adapters`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from hp_lazy.runtime import adapters
from hp_lazy.runtime.layout import LayoutTable

logger = logging.getLogger("hp_lazy")
_SHOWN = 4
_CHUNK = 1 << 22
"""Elements fingerprinted at a time (32 MiB in float64)."""


def agree(model: nn.Module, table: LayoutTable | None) -> list[str]:
    """Make ``model``'s replicated parameters rank 0's wherever the ranks differ; returns the names
    of those that differed (the same list on every rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    live = dict(model.named_parameters())
    whole = [(name, p) for name, p in live.items()
             if p.is_floating_point() and p.numel() and not p.is_meta and not _cut(table, name, live)
             and not _distributed(p)]
    if not whole:
        return []
    device = whole[0][1].device
    prints = torch.stack([_fingerprint(p).to(device) for _, p in whole])  # [n, 2]
    spread = torch.cat([prints, -prints])
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    largest, smallest = spread[: len(whole)], -spread[len(whole):]
    differ = (largest != smallest).any(dim=1).tolist()
    names = [name for (name, _), bad in zip(whole, differ, strict=True) if bad]
    with torch.no_grad():
        for (_, param), bad in zip(whole, differ, strict=True):
            if bad:
                dist.broadcast(param.data, src=0)
    if names and dist.get_rank() == 0:
        shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
        logger.warning(
            "hp_lazy: %s differed between the ranks, which each hold it whole (drawn at random when the model was "
            "built, with each rank's own seed); every rank now holds rank 0's, as DDP does when it is built. Seed "
            "every rank alike (transformers.set_seed) before building the model to make this draw yours",
            shown,
        )
    return names


def _cut(table: LayoutTable | None, name: str, live: dict[str, nn.Parameter]) -> bool:
    """Whether the table cuts ``name`` (or the name it had before PEFT wrapped its module)."""
    if table is None:
        return False
    before = adapters.old_name(name, live)
    layout = table.get(name) or (table.get(before) if before else None)
    return layout is not None and bool(layout.shards)


def _distributed(param: torch.Tensor) -> bool:
    """A DTensor (FSDP2 put its shards there): its owner keeps its replicas alike."""
    return type(param.data).__name__ == "DTensor"


def _fingerprint(param: torch.Tensor) -> torch.Tensor:
    """``[sum, sum of squares]`` in float64, a chunk at a time: a float64 copy of a whole
    replicated embedding would hold twice (bf16: four times) its memory on the device."""
    total = torch.zeros(2, dtype=torch.float64, device=param.device)
    for chunk in param.detach().reshape(-1).split(_CHUNK):
        values = chunk.double()
        total += torch.stack([values.sum(), values.square().sum()])
    return total
