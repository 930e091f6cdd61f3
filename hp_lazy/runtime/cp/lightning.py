"""Lightning attention under context parallel (MiniMax-Text-01 / M1's ``linear_attention`` layers),
split over the sequence with transformers' own forward as the local computation, in the zigzag
order the attention layers use.

Lightning attention is a linear attention with a per-head scalar decay ``a = exp(-slope)``: the
state ``S [H, D, D]`` evolves ``S_t = a S_(t-1) + k_t^T v_t`` and ``o_t = q_t S_t``; transformers
computes it in blocks (``(q k^T * decay) v`` inside a block, ``(q * a^i) S`` from the blocks
before), which is the same recurrence whatever the block boundaries. So a chunk of ``c`` tokens
that starts from ``S_in`` instead of zeros outputs ``o0_t + (q_t a^t) S_in`` (``t = 1 .. c``) and
leaves ``a^c S_in + F``, with ``o0`` its outputs from zeros and ``F = sum_t a^(c - t) k_t^T v_t``.

The class's forward computes the recurrence inline (no module-level kernel to wrap, unlike
:mod:`.recurrent`), so each planned instance's forward is wrapped (:func:`wrap`) to:

- run on this rank's two chunks as a batch of ``2B`` (``[B, 2c, D] -> [2B, c, D]``, the 2-D
  padding mask likewise): transformers' block loop gives ``o0`` of each chunk from zeros;
- read ``q, k, v`` where the forward makes them (a hook on its activation, the padding mask
  applied as the forward applies it) and compute every chunk's ``F`` (``[2B, H, D, D]``);
- all-gather the ``F`` of every chunk (per rank ``2 x B x H x D x D`` values, whatever ``S``),
  compose them in sequence order up to this rank's chunks (:func:`~.recurrent.starts`) and add
  ``(q a^t) S_in`` to the attention output on its way into the module's ``norm`` (a pre-hook),
  before anything that is not linear in it;
- join the ``2B`` rows back to ``[B, 2c, D]``.

Autograd runs through all of it (the all-gather's backward reduce-scatters the gradients of ``F``
to the chunks they came from). The carry computes in float32 (float64 for float64 inputs).
Outside a context-parallel forward the wrapper calls through unchanged.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hp_lazy.names import IMPL
from hp_lazy.runtime.cp.recurrent import chunks, starts
from hp_lazy.runtime.cp.state import CallState, current

READS = frozenset({"qkv_proj", "act_fn", "norm", "slope_rate", "query_decay", "key_decay", "diagonal_decay",
                   "head_dim", "num_attention_heads"})
"""What a lightning attention forward reads off its module (MiniMax's ``MiniMaxLightningAttention``)."""
MASK_FN = "apply_mask_to_padding_states"
FLAG = "hp_cp_lightning"
"""Set on a wrapped instance, so it is wrapped once."""


def supports(module: nn.Module) -> bool:
    """A lightning attention: its forward reads :data:`READS` and masks padding with the modeling
    module's :data:`MASK_FN`; its activation and norm are modules (hooked), its slopes ``[H, 1, 1]``."""
    forward = inspect.unwrap(getattr(type(module), IMPL, type(module).forward))
    names = set(getattr(getattr(forward, "__code__", None), "co_names", ()))
    slope = getattr(module, "slope_rate", None)
    return READS | {MASK_FN} <= names and isinstance(getattr(module, "act_fn", None), nn.Module) \
        and isinstance(getattr(module, "norm", None), nn.Module) and isinstance(slope, torch.Tensor) \
        and slope.dim() == 3 and hasattr(sys.modules.get(type(module).__module__), MASK_FN)


def wrap(module: nn.Module) -> None:
    """Give ``module`` (an instance) a forward that carries the state between ranks under cp."""
    if getattr(module, FLAG, False):
        return
    module.forward = _carrying(module, module.forward)
    setattr(module, FLAG, True)


def _carrying(module: nn.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)
    mask_fn = getattr(sys.modules[type(module).__module__], MASK_FN)

    def forward(*args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is None:
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)  # no cache: the entry refuses one before any layer runs
        given = bound.arguments
        hidden = given["hidden_states"]
        batch = hidden.shape[0]
        given["hidden_states"] = torch.cat(chunks(state, hidden, 1), dim=0)
        mask = given.get("attention_mask")
        if mask is not None:
            given["attention_mask"] = torch.cat(chunks(state, mask, 1), dim=0)
        seen: dict[str, torch.Tensor] = {}
        act_fn, norm = getattr(module, "act_fn"), getattr(module, "norm")  # noqa: B009 (nn.Module's attribute typing)
        handles = [
            act_fn.register_forward_hook(lambda _m, _i, out: seen.__setitem__("qkv", out)),
            norm.register_forward_pre_hook(
                lambda _m, inputs: (inputs[0] + _carry(module, state, mask_fn(seen.pop("qkv"),
                                                                              given.get("attention_mask")), batch),
                                    *inputs[1:])),
        ]
        try:
            out, *rest = fn(*bound.args, **bound.kwargs)
        finally:
            for handle in handles:
                handle.remove()
        return (torch.cat(out.split(batch, dim=0), dim=1), *(None for _ in rest))

    return forward


def _carry(module: nn.Module, state: CallState, qkv: torch.Tensor, batch: int) -> torch.Tensor:
    """What the state of the chunks before adds to each chunk's attention output: ``qkv [2B, c,
    H * 3D]`` (activated and masked as the forward's) -> ``[2B, c, H * D]``."""
    heads, dim = int(getattr(module, "num_attention_heads")), int(getattr(module, "head_dim"))  # noqa: B009
    rows, c = qkv.shape[0], qkv.shape[1]
    work = torch.promote_types(qkv.dtype, torch.float32)
    q, k, v = qkv.to(work).reshape(rows, c, heads, 3 * dim).split(dim, dim=-1)  # [2B, c, H, D] each
    slope = getattr(module, "slope_rate").to(work).reshape(heads, 1)  # noqa: B009
    t = torch.arange(1, c + 1, device=qkv.device, dtype=work)
    final = torch.einsum("bthk,ht,bthv->bhkv", k, torch.exp(-slope * (c - t)), v)  # F, [2B, H, D, D]
    decay = torch.exp(-slope * c)[..., None]  # a^c, [H, 1, 1]
    s_in = starts(state, final, final.new_zeros(batch, heads, dim, dim), lambda f, s: decay * s + f)
    carried = torch.einsum("bthk,ht,bhkv->bthv", q, torch.exp(-slope * t), s_in)
    return carried.reshape(rows, c, heads * dim).to(qkv.dtype)
