"""RoPE under context parallel: cos/sin computed from the *global* position ids, then this rank's rows.

transformers' rotary modules compute cos/sin from the position values, which the entry passes
globally correct already; but ``dynamic`` and ``longrope`` RoPE also rescale by the largest
position they see, which would differ per rank. Computing on the whole sequence's positions (the
same on every rank) and keeping the local rows is right for every RoPE type (Megatron does the
same), for the price of ``S`` rather than ``S/C`` rows of a small table per forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.cp.state import current


def is_rotary(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq")


def wrap_rotary(module: nn.Module, where: str) -> None:
    """Give ``module`` (an instance) a forward that computes on the global positions."""
    inner = module.forward

    def forward(x: torch.Tensor, position_ids: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is None or position_ids is None:
            return inner(x, position_ids, *args, **kwargs)
        out = inner(x, state.positions, *args, **kwargs)
        parts = (out,) if isinstance(out, torch.Tensor) else out  # DeepSeek-V2: one complex freqs_cis
        if not isinstance(parts, tuple) or any(
                not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[1] != state.zig.seq for t in parts):
            raise ShardingError(
                f"{where}: its output under context parallel is neither (cos, sin) nor one table of "
                "[batch, seq, dim]; this RoPE cannot be split over the sequence yet"
            )
        local = tuple(t.index_select(1, state.zig.local) for t in parts)
        return local[0] if isinstance(out, torch.Tensor) else local

    module.forward = forward
