"""Full (unsharded) tensors of a parallel model, on every rank: for saving and for parity checks.

Both helpers are collectives: every rank of the model's groups must call them. They read the
layout table of every bound root inside ``model`` (``model`` itself, or wrapped in DDP, where the
names carry DDP's ``module.`` prefix); a tensor FSDP2 holds as a DTensor is gathered over its own
mesh first. (``model.save_pretrained(path)`` on every rank writes a checkpoint the plain model
loads: :mod:`hp_lazy.runtime.checkpoint`.)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.layout import LayoutTable, ParamLayout
from hp_lazy.runtime.mesh import check_arrival
from hp_lazy.runtime.record import records, tables


def _layouts(model: nn.Module) -> tuple[dict[str, ParamLayout], LayoutTable | None]:
    found: dict[str, ParamLayout] = {}
    last = None
    for prefix, table in tables(model):
        last = table
        for fqn in table:
            layout = table.get(fqn)
            assert layout is not None
            found[prefix + fqn] = layout
    return found, last


def _full(tensor: torch.Tensor, layout: ParamLayout | None, table: LayoutTable | None) -> torch.Tensor:
    tensor = tensor.detach()
    if hasattr(tensor, "full_tensor"):  # an FSDP2 DTensor: gather over its own (dp) mesh first
        tensor = tensor.full_tensor()
    if layout is None or table is None or tuple(tensor.shape) == layout.full_shape != layout.local_shape:
        return tensor.clone()  # not sharded, or a LoRA adapter, whose state_dict entry is already full
    return layout.gather(tensor, table.groups)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded parameter gathered to its full shape."""
    from hp_lazy.runtime.checkpoint.hooks import local_shards  # imported once a model is bound

    layouts, table = _layouts(model)
    with local_shards():
        local = model.state_dict()
    return {name: _full(t, layouts.get(name), table) for name, t in local.items()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter FQN -> full gradient (parameters without a gradient are left out)."""
    layouts, table = _layouts(model)
    return {
        name: _full(param.grad, layouts.get(name), table)
        for name, param in model.named_parameters()
        if param.grad is not None
    }


def full_weights(model: nn.Module, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``model.state_dict()``'s names and full tensors in buckets of at most ``bucket_bytes`` (a
    tensor larger than that is a bucket of its own), every rank taking part and receiving them:
    for streaming weights out (RL weight sync, export to an inference engine). Sharded tensors are
    gathered one bucket at a time (the iterator holds no more); unsharded ones are the model's own
    tensors, detached (no copy). A rank that iterates alone fails within ``HP_LAZY_ARRIVAL_TIMEOUT_S``."""
    if bucket_bytes <= 0:
        raise ShardingError(f"hp_lazy.full_weights: bucket_mb must be positive, got {bucket_bytes} bytes")
    from hp_lazy.runtime.checkpoint.hooks import local_shards  # imported once a model is bound

    bound = next((found for _, found in records(model)), None)
    if bound is not None:
        check_arrival(bound.mesh, "hp_lazy.full_weights", "iterate it on every rank (each gathers its shards); "
                      "keep or send the tensors on one rank only")
    layouts, table = _layouts(model)
    with local_shards():
        local = model.state_dict()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in local.items():
        layout = layouts.get(name)
        full = tensor.detach() if layout is None else _full(tensor, layout, table)
        nbytes = full.numel() * full.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, full))
        size += nbytes
    if bucket:
        yield bucket
