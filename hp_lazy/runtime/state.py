"""Full (unsharded) tensors of a parallel model, on every rank: for saving and for parity checks.

Both helpers are collectives: every rank of the model's groups must call them. They read the
layout table of every bound root inside ``model`` (``model`` itself, or wrapped in DDP, where the
names carry DDP's ``module.`` prefix); a tensor FSDP2 holds as a DTensor is gathered over its own
mesh first. (``model.save_pretrained(path)`` on every rank writes a checkpoint the plain model
loads: :mod:`hp_lazy.runtime.checkpoint`.)
"""

from __future__ import annotations

import torch
from torch import nn

from hp_lazy.runtime.layout import LayoutTable, ParamLayout, tables


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
