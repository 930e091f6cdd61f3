"""Per-layer inputs under sequence parallel (:mod:`hp_lazy.runtime.sp.inputs`, and the stack's
own cut of stacked hidden states, :mod:`hp_lazy.runtime.sp.stack`): Gemma 3n hands each layer
its slice of the per-layer embeddings (``[B, S, P]``), which the layer multiplies into its
hidden states outside any boundary, and carries its hidden states as AltUp's stacked predictions
(``[A, B, S, H]``, the sequence at dim 2). One process's loss, logits, every gradient and 3
SGD+wd steps at tp=2 and 4; which inputs are read outside the boundaries, from the source; a
boundary handed selected rows instead of the layer's hidden states is refused."""

from __future__ import annotations

import models
import parity
import pytest
import torch
from dist import DistPool, pool_fixture
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.sp import inputs

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)


@pytest.mark.parametrize("world", [2, 4])
def test_gemma3n_matches_one_process(world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    pool = parity.activated(pool2 if world == 2 else pool4, sequence_parallel=True)
    path, ref = refs("gemma3n")
    results = pool.run(parity.train_loaded, path, models.batch())
    assert len(parity.compare(results[0], ref)) > 10


def test_inputs_read_outside_the_boundaries() -> None:
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextDecoderLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    assert inputs.read_outside(Gemma3nTextDecoderLayer, frozenset({"self_attn", "mlp"})) == ("per_layer_input",)
    assert inputs.read_outside(LlamaDecoderLayer, frozenset({"self_attn", "mlp"})) == ()
    # with no boundary named, the attention's own inputs are read outside one too (control)
    assert "attention_mask" in inputs.read_outside(LlamaDecoderLayer, frozenset())


class _Rows(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_a_boundary_given_selected_rows_is_refused() -> None:
    """HiggsAudio-v2 calls its MLP on ``h[~audio_mask]`` (rows ``[N, H]``): no gather along the
    sequence rebuilds that. A call with ``[B, S / tp, H]`` passes."""
    refused = _Rows()
    inputs._check_rows("model.layers.0.mlp", refused, "x", "HiggsAudioV2ForConditionalGeneration")
    with pytest.raises(ShardingError) as info:
        refused(torch.zeros(16, 32))
    assert str(info.value).startswith(
        "model.layers.0.mlp (HiggsAudioV2ForConditionalGeneration): under sequence parallel this boundary's input "
        "'x' must arrive as the layer's hidden states, [batch, seq / tp, ...], which it gathers along the sequence; "
        "it got shape [16, 32]: the layer's code flattens or selects tokens before calling it")
    passed = _Rows()
    inputs._check_rows("model.layers.0.mlp", passed, "x", "LlamaForCausalLM")
    passed(torch.zeros(2, 8, 32))
