"""What an attention module reads of token positions besides RoPE, under context parallel.

RoPE takes the global positions the entry passes (:mod:`.rope`). Two more position-dependent
computations live in attention modules (Llama 4):

- **chunked attention** (``layer_types[i] == "chunked_attention"``): a query sees the keys of its
  own chunk of ``config.attention_chunk_size`` tokens only, chunks counted from the first
  non-padding token (transformers' ``chunked_overlay`` with its left padding), over the position
  ids where the model separates packed documents (its ``remap_positions_for_packed_sequence``).
  :func:`chunk_of` says which layers; the call state folds the chunks into the documents the
  blockwise attention separates (:meth:`~hp_lazy.runtime.cp.state.CallState.visibility`).
- **query temperature tuning** on the layers without RoPE: ``q * (1 + attn_scale *
  log1p(floor((i + 1) / floor_scale)))`` with ``i = torch.arange(hidden_states.shape[1])`` — the
  row's index in the sequence, which under cp the module computes over its *own* rows. The
  attention function rescales each query row by the ratio of the global row's factor to the local
  one (:func:`query_rescale`; every factor is >= 1).

A planned attention module whose forward reads positions from its local rows in another way is
refused at bind (:func:`local_positions`): under cp it would compute a different model than one
process, silently — at short sequences often the same numbers (Llama 4's factor is 1 below
``floor_scale`` = 8,192 tokens), at the lengths cp is for a different one.
"""

from __future__ import annotations

import ast

import torch
from torch import nn

from hp_lazy.runtime.cp.zigzag import Zigzag

CHUNKED = "chunked_attention"


def chunk_of(module: nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer's module, else None."""
    config = getattr(module, "config", None)
    types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if not isinstance(types, (list, tuple)) or not isinstance(index, int) or index >= len(types):
        return None
    return int(config.attention_chunk_size) if types[index] == CHUNKED else None  # type: ignore[union-attr]


def tunes_temperature(module: nn.Module) -> bool:
    """Llama 4's query temperature tuning runs in this module's forward (a layer without RoPE)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True) \
        and hasattr(module, "floor_scale") and hasattr(module, "attn_scale")


def corrected(module: nn.Module) -> bool:
    """The module's local-row positions are Llama 4's temperature tuning, which
    :func:`query_rescale` corrects (on the layers where it runs)."""
    return all(hasattr(module, name) for name in ("attn_temperature_tuning", "floor_scale", "attn_scale", "use_rope"))


def _factor(module: nn.Module, index: torch.Tensor) -> torch.Tensor:
    floor_scale, attn_scale = float(module.floor_scale), float(module.attn_scale)  # type: ignore[arg-type]
    return torch.log1p(torch.floor((index.double() + 1.0) / floor_scale)) * attn_scale + 1.0


def query_rescale(module: nn.Module, zig: Zigzag) -> torch.Tensor | None:
    """``[S/C]`` float64: each local query row's global temperature factor over the local one the
    module applied, or None where the module tunes no temperature (or every ratio is 1)."""
    if not tunes_temperature(module):
        return None
    local = torch.arange(zig.local_len, device=zig.local.device)
    ratio = _factor(module, zig.local) / _factor(module, local)
    return None if bool((ratio == 1.0).all()) else ratio


def local_positions(forward: ast.AST) -> str | None:
    """The first ``torch.arange(<x>.shape[1] ...)`` of a forward's source (positions counted over
    the rows the module holds), else None."""
    for node in ast.walk(forward):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.arange", "arange") and node.args:
            length = node.args[0]
            if isinstance(length, ast.Subscript) and ast.unparse(length).endswith(".shape[1]"):
                return ast.unparse(node)
    return None

