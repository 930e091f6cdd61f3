"""Per-token outputs of a context-parallel forward back in sequence order."""

from __future__ import annotations

import torch

from hp_lazy.runtime.comm import gather_from
from hp_lazy.runtime.cp.zigzag import zigzag
from hp_lazy.runtime.mesh import Group


def gather_sequence(tensor: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """All-gather ``tensor``'s zigzag rows along ``dim`` over ``group`` and put them in sequence
    order (backward: this rank's rows of the gradient)."""
    if group.size == 1:
        return tensor
    full = gather_from(tensor, group, dim)
    zig = zigzag(full.shape[dim], group.size, group.rank, tensor.device)
    return full.index_select(dim, zig.inverse)
