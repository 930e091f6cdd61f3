"""The context-parallel attention function, registered with transformers' attention interface.

Each rank holds its zigzag rows of Q, K and V (``[B, H, S/C, D]``, RoPE applied with the global
positions). K and V are all-gathered along the sequence in one collective (before ``repeat_kv``:
under GQA only the K/V heads travel), each local query row attends to the gathered keys through
one boolean mask over global token indices (causal, sliding window, packed documents, key padding:
:meth:`~hp_lazy.runtime.cp.state.CallState.mask`), and the output keeps the local rows.

Memory: the gathered K/V are not kept for backward; only local tensors are saved, and backward
gathers K/V again and reduce-scatters dK/dV (each rank's queries contributed to every rank's
keys). Per layer: forward one all-gather of K and V together; backward one all-gather and one
reduce-scatter (two of each when K and V differ in head dim). Activation memory per rank falls
as 1/C. Two kernels:

- plain causal attention on CPU (:class:`_ZigzagCausal`): each local chunk ``i`` attends to the
  keys of the chunks before it with no mask and to its own chunk with ``is_causal`` (same length,
  same positions: upper-left alignment is right), two flash-attention calls merged by their
  log-sum-exp; it saves the local output and log-sum-exp, and backward runs the flash backward of
  each part with the merged output and log-sum-exp (which gives each part's exact gradient) — no
  mask is built and nothing is recomputed;
- everything else (:class:`_GatheredAttention`: sliding windows, packed documents, padding,
  non-causal layers, CUDA): one SDPA call with a boolean mask over global token indices; it saves
  the local Q, K, V and recomputes the attention in backward.

Ulysses (``cp_ulysses``): an all-to-all takes Q, K and V (K and V in one call) from sequence
shards of every head to the whole sequence of ``heads / C`` heads; attention runs over the whole
sequence in sequence order (``is_causal``, or the whole-sequence mask); a second all-to-all takes
the output back. K/V heads fewer than ``C`` are replicated first. Per layer: forward two
all-to-alls in, one out; backward the same. No zigzag balancing is needed (every rank computes
whole rows); the zigzag rows are used anyway, so both modes share the entry.

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
from hp_lazy.runtime.comm import all_to_all, wire
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


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of :func:`_expand` for gradients: sum each K/V head's copies."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def _parts(chunk: int, c: int) -> list[tuple[int, int, bool]]:
    """(start, end, causal) key ranges (global order) that global query chunk ``chunk`` attends to."""
    own = (chunk * c, (chunk + 1) * c, True)
    return [(0, chunk * c, False), own] if chunk else [own]


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _ZigzagCausal(torch.autograd.Function):
    """Causal attention of this rank's two zigzag chunks over the gathered K/V (CPU flash kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, g, zig, whole):
        kg, vg = (k, v) if whole else _gather(k, v, g, "forward")
        groups = q.shape[1] // k.shape[1]
        keys = _expand(kg.index_select(2, zig.inverse), groups)
        values = _expand(vg.index_select(2, zig.inverse), groups)
        c = zig.seq // (2 * zig.size)
        outs, lses = [], []
        for half, chunk in enumerate((zig.rank, 2 * zig.size - 1 - zig.rank)):
            rows = q[:, :, half * c : (half + 1) * c].contiguous()
            out, lse = None, None
            for start, end, causal in _parts(chunk, c):
                o, lse_part = _FLASH(rows, keys[:, :, start:end].contiguous(), values[:, :, start:end].contiguous(),
                                     0.0, causal, scale=scale)
                if out is None:
                    out, lse = o.float(), lse_part
                    continue
                merged = torch.logaddexp(lse, lse_part)
                out = out * (lse - merged).exp().unsqueeze(-1) + o.float() * (lse_part - merged).exp().unsqueeze(-1)
                lse = merged
            assert out is not None and lse is not None
            outs.append(out.to(q.dtype))
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.g, ctx.zig, ctx.whole = scale, g, zig, whole
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        zig, scale = ctx.zig, ctx.scale
        kg, vg = (k, v) if ctx.whole else _gather(k, v, ctx.g, "backward")
        groups = q.shape[1] // k.shape[1]
        keys = _expand(kg.index_select(2, zig.inverse), groups)
        values = _expand(vg.index_select(2, zig.inverse), groups)
        dq, dkeys, dvalues = torch.zeros_like(q), torch.zeros_like(keys), torch.zeros_like(values)
        c = zig.seq // (2 * zig.size)
        for half, chunk in enumerate((zig.rank, 2 * zig.size - 1 - zig.rank)):
            rows = slice(half * c, (half + 1) * c)
            args = [t[:, :, rows].contiguous() for t in (dout, q, out, lse)]
            for start, end, causal in _parts(chunk, c):
                gq, gk, gv = _FLASH_BACKWARD(args[0], args[1], keys[:, :, start:end].contiguous(),
                                             values[:, :, start:end].contiguous(), args[2], args[3], 0.0, causal,
                                             scale=scale)
                dq[:, :, rows] += gq
                dkeys[:, :, start:end] += gk
                dvalues[:, :, start:end] += gv
        dk = _fold(dkeys, groups).index_select(2, zig.gathered)  # back to the all-gather's row order
        dv = _fold(dvalues, groups).index_select(2, zig.gathered)
        if not ctx.whole:
            dk, dv = _scatter(dk, dv, ctx.g)
        return dq, dk, dv, None, None, None, None


class _GatheredAttention(torch.autograd.Function):
    """Attention of local queries over all-gathered K/V, saving only the local tensors."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, g, whole):
        kg, vg = (k, v) if whole else _gather(k, v, g, "forward")
        ctx.save_for_backward(q, k, v)
        ctx.mask, ctx.scale, ctx.g, ctx.whole = mask, scale, g, whole
        return _attend(q, kg, vg, mask, scale)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        kg, vg = (k, v) if ctx.whole else _gather(k, v, ctx.g, "backward")
        with torch.enable_grad():
            q, kg, vg = (t.detach().requires_grad_() for t in (q, kg, vg))
            out = _attend(q, kg, vg, ctx.mask, ctx.scale)
            dq, dkg, dvg = torch.autograd.grad(out, (q, kg, vg), dout)
        if ctx.whole:
            return dq, dkg, dvg, None, None, None, None
        dk, dv = _scatter(dkg, dvg, ctx.g)
        return dq, dk, dv, None, None, None, None


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
    plain = causal and sliding_window is None and state.docs is None and state.key_padding is None
    if state.mode == "cp_ulysses":
        return _ulysses(where, query, key, value, state, causal, sliding_window, plain, scaling), None
    # MLA: K/V expanded from the gathered latent (latent.py), the whole sequence in all-gather order
    whole = key.shape[2] == state.zig.seq != query.shape[2]
    if plain and query.device.type == "cpu" and key.shape[-1] == value.shape[-1]:
        out = _ZigzagCausal.apply(query, key, value, scaling, state.group, state.zig, whole)
        return out.transpose(1, 2).contiguous(), None
    mask = state.mask(causal, sliding_window)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        out = _GatheredAttention.apply(query, key, value, mask, scaling, state.group, whole)
    else:
        kg, vg = (key, value) if whole else _gather(key, value, state.group, "forward")
        out = _attend(query, kg, vg, mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def _ulysses(
    where: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, state: Any, causal: bool,
    window: int | None, plain: bool, scale: float | None,
) -> torch.Tensor:
    g, zig = state.group, state.zig
    heads, kv = query.shape[1], key.shape[1]
    if heads % g.size:
        raise ShardingError(
            f"{where}: cp_mode='ulysses' splits this rank's {heads} attention heads over cp={g.size}, which does not "
            f"divide them; use cp_mode='allgather', or a cp (x tp) that divides the heads"
        )
    if kv % g.size:  # fewer K/V heads than ranks: each rank gets the copies its query heads use
        key, value = key.repeat_interleave(heads // kv, dim=1), value.repeat_interleave(heads // kv, dim=1)
    q = all_to_all(query, g, 2, 1).index_select(2, zig.inverse)
    if key.shape == value.shape:
        both = all_to_all(torch.stack([key, value]), g, 3, 2).index_select(3, zig.inverse)
        k, v = both[0], both[1]
    else:
        k = all_to_all(key, g, 2, 1).index_select(2, zig.inverse)
        v = all_to_all(value, g, 2, 1).index_select(2, zig.inverse)
    groups = q.shape[1] // k.shape[1]
    k, v = _expand(k, groups), _expand(v, groups)
    if plain:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=state.mask(causal, window, whole=True), scale=scale)
    out = all_to_all(out.index_select(2, zig.gathered), g, 1, 2)  # [B, H, S/C, Dv], this rank's rows
    return out.transpose(1, 2).contiguous()
