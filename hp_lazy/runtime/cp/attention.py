"""The context-parallel attention function, registered with transformers' attention interface.

Each rank holds its zigzag rows of Q, K and V (``[B, H, S/C, D]``, RoPE applied with the global
positions). K and V are all-gathered along the sequence in one collective (before ``repeat_kv``:
under GQA only the K/V heads travel), each local query row attends to the gathered keys through
one boolean mask over global token indices (causal, sliding window, packed documents, key padding:
:meth:`~hp_lazy.runtime.cp.state.CallState.mask`), and the output keeps the local rows.

Memory: the gathered K/V are not kept for backward. :class:`_GatheredAttention` saves the local
Q, K, V only; its backward gathers K/V again, recomputes the attention and reduce-scatters dK/dV
(each rank's queries contributed to every rank's keys). Per layer: forward one all-gather of K
and V together; backward one all-gather and one reduce-scatter (two of each when K and V differ in
head dim). Activation memory per rank falls as 1/C; the price is one attention forward more.

Registered under :data:`KEY`, a name transformers' mask code does not know: ``create_causal_mask``
then returns ``None`` and builds no (wrong, local) mask, and the modeling code's own
``ALL_ATTENTION_FUNCTIONS.get_interface(...)`` call dispatches here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.comm import wire
from hp_lazy.runtime.cp.state import current
from hp_lazy.runtime.mesh import Group

KEY = "hp_lazy_cp"


def register() -> None:
    """Make :data:`KEY` a known attention implementation (idempotent)."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(KEY, cp_attention)


def _gather(k: torch.Tensor, v: torch.Tensor, g: Group, phase: wire.Phase) -> tuple[torch.Tensor, torch.Tensor]:
    if k.shape == v.shape:
        both = wire.all_gather(torch.stack([k, v]), g, 3, phase)
        return both[0], both[1]
    return wire.all_gather(k, g, 2, phase), wire.all_gather(v, g, 2, phase)


def _scatter(dk: torch.Tensor, dv: torch.Tensor, g: Group) -> tuple[torch.Tensor, torch.Tensor]:
    if dk.shape == dv.shape:
        both = wire.reduce_scatter(torch.stack([dk, dv]), g, 3, "backward")
        return both[0], both[1]
    return wire.reduce_scatter(dk, g, 2, "backward"), wire.reduce_scatter(dv, g, 2, "backward")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None):
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # transformers' repeat_kv
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class _GatheredAttention(torch.autograd.Function):
    """Attention of local queries over all-gathered K/V, saving only the local tensors."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, g):
        kg, vg = _gather(k, v, g, "forward")
        ctx.save_for_backward(q, k, v)
        ctx.mask, ctx.scale, ctx.g = mask, scale, g
        return _attend(q, kg, vg, mask, scale)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        kg, vg = _gather(k, v, ctx.g, "backward")
        with torch.enable_grad():
            q, kg, vg = (t.detach().requires_grad_() for t in (q, kg, vg))
            out = _attend(q, kg, vg, ctx.mask, ctx.scale)
            dq, dkg, dvg = torch.autograd.grad(out, (q, kg, vg), dout)
        dk, dv = _scatter(dkg, dvg, ctx.g)
        return dq, dk, dv, None, None, None


def cp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[B, H, S/C, D]`` in, ``[B, S/C, H, Dv]`` out."""
    state = current()
    where = type(module).__qualname__
    if state is None:
        raise ShardingError(
            f"{where}: context-parallel attention ran outside a context-parallel forward of the bound model (a "
            "layer called on its own?); call the top-level model, whose forward splits the sequence"
        )
    if attention_mask is not None:
        raise ShardingError(
            f"{where}: got a {attention_mask.dim()}-D attention mask inside a context-parallel forward; pass a 2-D "
            "padding mask (or none) to the top-level model, which builds the masks over the whole sequence"
        )
    if dropout:
        raise ShardingError(
            f"{where}: attention dropout {dropout} under context parallel would draw different masks per rank than "
            "one process; set the config's attention_dropout to 0 (or call model.eval())"
        )
    if kwargs.get("s_aux") is not None:
        raise ShardingError(f"{where}: attention sinks (s_aux) are not supported under context parallel yet")
    causal = bool(getattr(module, "is_causal", True)) if is_causal is None else bool(is_causal)
    mask = state.mask(causal, sliding_window)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        out = _GatheredAttention.apply(query, key, value, mask, scaling, state.group)
    else:
        kg, vg = _gather(key, value, state.group, "forward")
        out = _attend(query, kg, vg, mask, scaling)
    return out.transpose(1, 2).contiguous(), None
