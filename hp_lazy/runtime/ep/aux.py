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

Under sequence parallel the tp ranks hold consecutive pieces of every row's sequence, so the
router logits of a tp rank are its piece's tokens: the counts and the row count are summed over
tp (and dp), the attention mask is cut to this rank's piece (:func:`pieces`), and the part is not
scaled by tp (the router's gradients are summed over tp, not averaged). Under context parallel
the cp ranks hold the zigzag rows of every sequence, and the model is called without a mask: the
mask of this rank's rows comes from the call's state (:func:`hp_lazy.runtime.cp.state.padding_rows`),
the counts are summed over cp (and dp), and the value returned is the global loss's ``1 / cp``
share, which the cp entry sums over cp with the model's loss (``out.aux_loss`` too).
:func:`install` puts the function in place or refuses what it cannot replace. Where no
parallelism gave ranks pieces of the rows (dp alone, dp x tp), the bind makes it global over dp
the same way (:mod:`hp_lazy.runtime.bind`): on one dp rank's rows transformers' loss is not one
process's over the global batch either.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hp_lazy.errors import ShardingError
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


Rows = Callable[[torch.Tensor | None], torch.Tensor | None]
"""The call's ``[B, S]`` attention mask (or None) -> the mask of the tokens this rank routes."""


def pieces(group: Group) -> Rows:
    """Sequence parallel's rows: ``group``'s ranks hold consecutive pieces of each row."""
    return lambda mask: None if mask is None else mask.chunk(group.size, dim=1)[group.rank]


def global_load_balancing(original: Any, over: Sequence[Group], scale: int, local_mask: Rows | None = None,
                          share: int = 1) -> Any:
    """transformers' load-balancing loss over the rows of every rank of the groups ``over`` (each
    rank holding other rows), its gradient scaled by ``scale`` (the dp average to undo); ``local_mask``:
    the mask of this rank's tokens from the call's; the value returned is the global loss ``/ share``."""

    def load_balancing_loss_func(
        gate_logits: Any, num_experts: int, top_k: int = 2, attention_mask: torch.Tensor | None = None
    ) -> Any:
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0
        device = gate_logits[0].device
        counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
        probs_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
        rows = torch.zeros((), dtype=torch.float32, device=device)
        if local_mask is not None:
            attention_mask = local_mask(attention_mask)
        mask = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
        for layer in gate_logits:
            probs = torch.softmax(layer.to(device), dim=-1)
            _, chosen = torch.topk(probs, top_k, dim=-1)
            weight = mask if mask is not None else probs.new_ones(probs.shape[0], dtype=torch.float32)
            if weight.shape[0] != probs.shape[0]:
                raise ShardingError(
                    f"load_balancing_loss_func: the attention mask holds {weight.shape[0]} tokens but this rank's "
                    f"router logits {probs.shape[0]} rows; hp_lazy computes the aux loss over the tokens each rank "
                    "routes, so pass the model the attention mask of the batch it runs on"
                )
            counts = counts.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
            probs_sum = probs_sum + (probs.float() * weight.unsqueeze(-1)).sum(0)
            rows = rows + weight.sum()
        stats = torch.cat([counts, rows.reshape(1)]).detach().contiguous()
        for group in over:
            stats = wire.all_reduce(stats, group, "forward")
        total_rows = stats[-1]
        mine = (stats[:-1] / total_rows * probs_sum / total_rows).sum() * num_experts
        value = mine.detach().reshape(1).clone()
        for group in over:
            value = wire.all_reduce(value, group, "forward")
        scaled = mine * scale
        return scaled + (value.reshape(()) / share - scaled).detach()

    load_balancing_loss_func.hp_original = original  # type: ignore[attr-defined]
    return load_balancing_loss_func


def text_config(model: nn.Module) -> Any:
    """``model``'s config, or its text stack's for a composite model (None without a config)."""
    config = getattr(model, "config", None)
    return getattr(config, "get_text_config", lambda: config)()


def routes(root: nn.Module) -> bool:
    """``root``'s (text) config has ``output_router_logits``: an MoE whose aux loss may be turned on."""
    return hasattr(text_config(root), "output_router_logits")


def install(root: nn.Module, over: Sequence[Group], scale: int, local_mask: Rows | None = None, *, under: str,
            cannot: str | None = None, share: int = 1) -> None:
    """Make the aux loss of ``root``'s modeling module global (:func:`global_load_balancing`). Where
    its function is not transformers' standard one, or ``cannot`` says why it may not be replaced,
    ``output_router_logits`` is refused (``under``: the parallelism that gives each rank its own rows)."""
    family = type(root).__qualname__
    module = sys.modules.get(type(root).__module__)
    current = getattr(module, NAME, None)
    if getattr(current, "hp_original", None) is not None:
        return  # made global by an earlier bind
    if cannot is None and current is not None and replaceable(current):
        setattr(module, NAME, global_load_balancing(current, over, scale, local_mask, share))
        return
    why = cannot or ("it has none" if current is None else "not transformers' standard one")
    text = (
        f"{family}: {{where}} adds the load-balancing aux loss, which transformers computes from this rank's "
        f"router logits only, so under {under} it is not one process's aux loss over the global batch, and "
        f"hp_lazy cannot replace this module's {NAME} ({why}); set output_router_logits=False"
    )
    if getattr(getattr(root, "config", None), "output_router_logits", False):
        raise ShardingError(text.format(where="config.output_router_logits=True"))
    root.register_forward_pre_hook(_refuse(text), with_kwargs=True)


def _refuse(text: str) -> Any:
    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("output_router_logits"):
            raise ShardingError(text.format(where="output_router_logits=True"))

    return hook
