"""The load-balancing aux loss over the global batch (``output_router_logits=True`` under ep).

transformers' ``load_balancing_loss_func`` (Switch: ``E * sum_e f_e * P_e``, ``f_e`` the share of
top-k assignments to expert ``e``, ``P_e`` its mean routing probability, over every layer's rows,
padding weighted out by the attention mask) computed on one rank's rows is not one process's
value. :func:`global_load_balancing` replaces the modeling module's function: the per-expert
assignment counts and the row count are all-reduced over the dp ranks (no gradient), and this
rank's part ``E * sum_e f_e^global * sum_local p_e / N^global`` (whose sum over ranks is the
global loss) is returned scaled by dp with the global value as its value: DDP's dp average of
the gradients then gives one process's gradient of the global aux loss, and ``out.aux_loss`` and
``out.loss`` hold the global aux loss on every rank. Two all-reduces per forward.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hp_lazy.runtime.comm import wire
from hp_lazy.runtime.mesh import Group

PARAMS = ("gate_logits", "num_experts", "top_k", "attention_mask")
NAME = "load_balancing_loss_func"


def replaceable(fn: Any) -> bool:
    """A transformers ``load_balancing_loss_func`` of the standard signature."""
    try:
        return tuple(inspect.signature(fn).parameters) == PARAMS
    except (TypeError, ValueError):
        return False


def global_load_balancing(group: Group, original: Any) -> Any:
    def load_balancing_loss_func(
        gate_logits: Any, num_experts: int, top_k: int = 2, attention_mask: torch.Tensor | None = None
    ) -> Any:
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0
        device = gate_logits[0].device
        counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
        probs_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
        rows = torch.zeros((), dtype=torch.float32, device=device)
        mask = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
        for layer in gate_logits:
            probs = torch.softmax(layer.to(device), dim=-1)
            _, chosen = torch.topk(probs, top_k, dim=-1)
            weight = mask if mask is not None else probs.new_ones(probs.shape[0], dtype=torch.float32)
            counts = counts.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
            probs_sum = probs_sum + (probs.float() * weight.unsqueeze(-1)).sum(0)
            rows = rows + weight.sum()
        stats = wire.all_reduce(torch.cat([counts, rows.reshape(1)]).detach().contiguous(), group, "forward")
        total_rows = stats[-1]
        mine = (stats[:-1] / total_rows * probs_sum / total_rows).sum() * num_experts
        value = wire.all_reduce(mine.detach().reshape(1).clone(), group, "forward").reshape(())
        scaled = mine * group.size
        return scaled + (value - scaled).detach()

    load_balancing_loss_func.hp_original = original  # type: ignore[attr-defined]
    return load_balancing_loss_func
