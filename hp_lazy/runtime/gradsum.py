"""Gradients of replicated parameters that are partial sums over a group, summed in backward.

Which parameters: Qwen3's q/k norms between a colwise and a rowwise Linear (each rank normalises
its own heads), norms and rowwise biases on sequence-sharded activations (each rank sees its own
tokens). Their gradient contributions of one backward pass are summed over the group in **one**
all-reduce at the end of that pass (``queue_callback``), not one per parameter — what Megatron
does for sequence-parallel norms after the backward. Gradient accumulation over micro-batches is
respected: only this pass's contribution is reduced.
"""

from __future__ import annotations

import torch
from torch import nn

from hp_lazy.runtime import collectives
from hp_lazy.runtime.mesh import Group


class GradSum:
    """Collects this backward pass's contributions of its parameters and reduces them once."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._pending: list[tuple[nn.Parameter, torch.Tensor, bool]] = []

    def add(self, param: nn.Parameter) -> None:
        """Sum ``param``'s gradient over the group from now on (once per parameter)."""
        if getattr(param, "_hp_grad_sum", False):
            return
        param.register_hook(lambda grad, param=param: self._collect(param, grad))
        param._hp_grad_sum = True

    def _collect(self, param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        if not self._pending:
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        self._pending.append((param, grad, param.grad is None))
        return grad

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for dtype in sorted({g.dtype for _, g, _ in pending}, key=str):
            self._reduce([item for item in pending if item[1].dtype == dtype])

    def _reduce(self, items: list[tuple[nn.Parameter, torch.Tensor, bool]]) -> None:
        flat = torch.cat([grad.reshape(-1) for _, grad, _ in items])
        summed = collectives.all_reduce_(flat.clone(), self.group)
        offset = 0
        for param, grad, fresh in items:
            part = summed[offset : offset + grad.numel()].view_as(grad)
            offset += grad.numel()
            if fresh:  # .grad was created by this pass: it is exactly this contribution
                param.grad.copy_(part)
            else:  # accumulating: replace this pass's local contribution by its sum
                param.grad.add_(part - grad)
