"""Multi-head latent attention under context parallel: the compressed latent travels, not K/V.

MLA (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite, ...) projects each token to a small latent
(``kv_lora_rank`` values after ``kv_a_layernorm``) plus one RoPE key shared by every head
(``qk_rope_head_dim``), and expands both into per-head K and V in the attention module's own
``expand_kv(kv_nope, k_rot)``. Gathering the *inputs* of ``expand_kv`` along the sequence, rather
than its outputs, sends ``kv_lora_rank + qk_rope_head_dim`` values per token instead of
``heads * (qk_head_dim + v_head_dim)``: 576 against 40,960 on DeepSeek-V3's config, 71x less (per
tp rank: 71 / tp, since tp cuts the expanded heads but not the latent).

:func:`wrap_expand_kv` gives the instance an ``expand_kv`` that all-gathers this rank's latent
rows over cp in one collective (``gather_to``: backward one reduce-scatter of the latent's
gradient) and expands the whole sequence with the module's own ``kv_b_proj``; the attention
function sees K/V of the whole sequence (in the all-gather's rank order, which is the key order
its masks use) and gathers nothing (:func:`~hp_lazy.runtime.cp.attention.cp_attention`).

The price: every rank runs ``kv_b_proj`` over the whole sequence (``C`` times its share of that
one matmul) and autograd keeps the expanded K/V of the whole sequence for the attention backward
(the K/V gather keeps only the local rows and gathers again in backward). Per layer and step:
one all-gather and one reduce-scatter of the latent, against two all-gathers and one
reduce-scatter of K/V. Only with ``cp_mode='allgather'``; Ulysses splits heads, and its
all-to-alls carry the expanded K/V as for any attention.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hp_lazy.runtime.comm import gather_to
from hp_lazy.runtime.cp.state import current

MODE = "cp_allgather_kv"


def is_latent_attention(module: nn.Module) -> bool:
    """An MLA module: it expands a latent into K/V in its own ``expand_kv``."""
    return callable(getattr(type(module), "expand_kv", None))


def wrap_expand_kv(module: nn.Module) -> None:
    inner: Any = module.expand_kv

    def expand_kv(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = current()
        if state is None or state.mode != MODE or kv_nope.dtype != k_rot.dtype:
            return inner(kv_nope, k_rot)
        rank = kv_nope.shape[-1]
        both = gather_to(torch.cat([kv_nope, k_rot], dim=-1), state.group, 2)  # [B, 1, S, rank + rope]
        return inner(both[..., :rank], both[..., rank:])

    module.__dict__["expand_kv"] = expand_kv  # the instance's, over the class's method
