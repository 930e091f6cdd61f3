"""Gradients of replicated parameters that are partial sums over a group, summed in backward.

Which parameters: Qwen3's q/k norms between a colwise and a rowwise Linear (each rank normalises
its own heads), norms and rowwise biases on sequence-sharded activations (each rank sees its own
tokens). Their gradient contributions of one backward pass are summed over the group in **one**
all-reduce at the end of that pass (``queue_callback``), not one per parameter — what Megatron
does for sequence-parallel norms after the backward. Gradient accumulation over micro-batches is
respected: only this pass's contribution is reduced.

A parameter shard held by ``replicas`` ranks of the group (a K/V head kept on ``tp / kv`` ranks) is
summed over those ranks only: it goes into its head's slot of a zero stack, so the same all-reduce
sums every slot at once (no extra process groups).
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

    def add(self, param: nn.Parameter, replicas: int | None = None) -> None:
        """Sum ``param``'s gradient over the group from now on (once per parameter); with
        ``replicas``, only over the ranks ``r`` with the same ``r // replicas``."""
        if getattr(param, "_hp_grad_sum", False):
            return
        param.register_hook(lambda grad, param=param: self._collect(param, grad))
        param._hp_grad_sum = replicas or self.group.size

    def _collect(self, param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        if not self._pending:
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        self._pending.append((param, grad, param.grad is None))
        return grad

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for dtype in sorted({g.dtype for _, g, _ in pending}, key=str):
            self._reduce([item for item in pending if item[1].dtype == dtype])

    def _slots(self, param: nn.Parameter) -> tuple[int, int]:
        """(slots in the stack, this rank's slot); (1, 0) for a parameter summed over the group."""
        replicas = param._hp_grad_sum
        return self.group.size // replicas, self.group.rank // replicas

    def _reduce(self, items: list[tuple[nn.Parameter, torch.Tensor, bool]]) -> None:
        parts = []
        for param, grad, _ in items:
            slots, mine = self._slots(param)
            stack = grad.new_zeros((slots, grad.numel()))
            stack[mine] = grad.reshape(-1)
            parts.append(stack.reshape(-1))
        summed = collectives.all_reduce_(torch.cat(parts), self.group)
        offset = 0
        for param, grad, fresh in items:
            slots, mine = self._slots(param)
            part = summed[offset : offset + slots * grad.numel()].view(slots, -1)[mine].view_as(grad)
            offset += slots * grad.numel()
            if fresh:  # .grad was created by this pass: it is exactly this contribution
                param.grad.copy_(part)
            else:  # accumulating: replace this pass's local contribution by its sum
                param.grad.add_(part - grad)
