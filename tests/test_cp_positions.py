"""``runtime/cp/positions``: what attention modules read of token positions besides RoPE under cp
(Llama 4's chunks and query temperature; any other count over a module's own rows refused at bind).
The end-to-end parity of both, and their negative controls, are in ``tests/test_cp.py`` (llama4)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.plan.model import Contract, InnerOp
from hp_lazy.runtime.cp import positions
from hp_lazy.runtime.cp.style import ContextParallelStyle
from hp_lazy.runtime.cp.zigzag import zigzag


class _Config:
    layer_types = ["chunked_attention", "full_attention"]
    attention_chunk_size = 8
    attention_dropout = 0.0


class TunedAttention(nn.Module):
    """Llama 4's temperature tuning, as its attention module holds it."""

    def __init__(self, layer_idx: int, use_rope: bool) -> None:
        super().__init__()
        self.config, self.layer_idx, self.use_rope = _Config(), layer_idx, use_rope
        self.attn_temperature_tuning, self.floor_scale, self.attn_scale = True, 2, 0.1


class RowCountingAttention(nn.Module):
    """An attention module that numbers its rows itself: under cp, this rank's rows."""

    is_causal = True

    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()

    def forward(self, hidden_states, attention_mask=None, attention_interface=None):
        bias = torch.arange(hidden_states.shape[1], device=hidden_states.device)
        return attention_interface(self, hidden_states + bias[:, None], hidden_states, hidden_states, attention_mask)


def test_chunk_of_reads_the_layer_type() -> None:
    assert positions.chunk_of(TunedAttention(0, True)) == 8
    assert positions.chunk_of(TunedAttention(1, False)) is None
    assert positions.chunk_of(nn.Linear(2, 2)) is None


def test_query_rescale_is_the_global_factor_over_the_local_one() -> None:
    zig = zigzag(16, 2, 1, torch.device("cpu"))  # rank 1 of cp=2: rows 4..7 and 8..11
    ratio = positions.query_rescale(TunedAttention(1, False), zig)
    factor = lambda i: 1 + 0.1 * torch.log1p(torch.floor((i.double() + 1) / 2))  # noqa: E731 - Llama 4's formula
    assert torch.equal(zig.local, torch.tensor([4, 5, 6, 7, 8, 9, 10, 11]))
    assert torch.allclose(ratio * factor(torch.arange(8)), factor(zig.local), rtol=0, atol=1e-15)
    assert positions.query_rescale(TunedAttention(0, True), zig) is None  # a RoPE layer tunes nothing


def test_counting_positions_over_local_rows_is_refused_at_bind() -> None:
    module = RowCountingAttention()
    contract = Contract(pattern="model.layers.*.self_attn", inner=InnerOp(call="attention", kind="cp_allgather_kv"))
    ctx = types.SimpleNamespace(root=module)
    with pytest.raises(ShardingError) as caught:
        ContextParallelStyle().validate("model.layers.0.self_attn", module, contract, ctx)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "model.layers.0.self_attn (RowCountingAttention): context parallel cannot split this attention over the "
        "sequence: it counts token positions over the rows it holds (torch.arange(hidden_states.shape[1], "
        "device=hidden_states.device)), which under context parallel are this rank's rows, not the sequence's; "
        "train this family without cp")
