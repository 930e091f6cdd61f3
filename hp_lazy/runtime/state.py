"""Full (unsharded) tensors of a parallel model, on every rank: for saving and for parity checks.

Both helpers are collectives: every rank of the model's groups must call them.
``model.save_pretrained(path, state_dict=hp_lazy.full_state_dict(model))`` on rank 0 writes a
checkpoint the plain model loads.
"""

from __future__ import annotations

import torch
from torch import nn

from hp_lazy.runtime.shard import ShardSpec, full_tensor


def _full(tensor: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    if spec is None:
        return tensor.detach().clone()
    return full_tensor(tensor, spec)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded parameter gathered to its full shape."""
    params = {id(p): p for p in model.parameters()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        spec = getattr(params.get(id(tensor)), "_hp_shard", None)
        out[name] = _full(tensor, spec)
    return out


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter FQN -> full gradient (parameters without a gradient are left out)."""
    return {
        name: _full(param.grad, getattr(param, "_hp_shard", None))
        for name, param in model.named_parameters()
        if param.grad is not None
    }
