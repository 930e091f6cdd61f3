"""Model parity, tensor parallel without sequence parallel: tiny transformers models loaded with
``from_pretrained`` under ``activate("auto", tp=N)`` against the same model in one process —
logits, loss, every gradient, and three SGD steps with weight decay; plus collective counts."""

from __future__ import annotations

import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)


def _pool(world: int, pool2: DistPool, pool4: DistPool) -> DistPool:
    return parity.activated(pool2 if world == 2 else pool4, sequence_parallel=False)


@pytest.mark.parametrize("name", sorted(models.CONFIGS))
@pytest.mark.parametrize("world", [2, 4])
def test_parity(name: str, world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    errors = parity.check_parity(_pool(world, pool2, pool4), refs, name)
    assert len(errors) > 10 and max(errors.values()) <= parity.TOL


@pytest.mark.parametrize("world", [2, 4])
def test_halved_gate_up_projections_need_no_gather(world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    """GLM-4's and Phi-3's MLPs halve gate_up_proj's output (``chunk(2, dim=-1)``), which transformers'
    plan gathers whole on every rank; here each rank holds its rows of both halves, and the MLP
    moves one all-reduce of ``[B, S, H]`` each way: the only all-gathers are the logits' (and Phi-3's
    attention's, leaves as planned: qkv_proj's output is cut in unequal q/k/v ranges, gathered
    forward, and o_proj's split input gathered backward). Before, each MLP added an all-gather of
    ``[B, S, 2I]`` (forward; a replicated activation on every rank)."""
    layers, batch, vocab = models.BASE["num_hidden_layers"], models.batch(), models.VOCAB
    for name, forward, backward in (("glm4", 1, 0), ("phi3", layers + 1, layers)):
        pool = _pool(world, pool2, pool4)
        errors = parity.check_parity(pool, refs, name)
        assert max(errors.values()) <= parity.TOL
        path, _ = refs(name)
        counts = pool.run(parity.count_bytes, path, batch)
        assert counts[0]["forward"] == {"all_reduce": 2 * layers + 1, "all_gather": forward}
        assert counts[0]["backward"] == {"all_reduce": 2 * layers + 1, **({"all_gather": backward} if backward else {})}
        if name == "glm4":  # this rank's vocab slice of the logits, nothing else
            assert counts[0]["all_gather_bytes"] == batch.numel() * vocab // world * 4


def test_dropped_entry_op_fails_parity(refs, pool2: DistPool, pool4: DistPool) -> None:
    """Negative control: without copy_to's backward all-reduce the gradients must differ."""
    path, ref = refs("llama")
    got = _pool(2, pool2, pool4).run(parity.train_with_broken_entry, path, models.batch())[0]
    assert models.rel_err(got["logits"], ref["logits"]) <= parity.TOL  # forward is unaffected
    with pytest.raises(AssertionError, match="grad model.layers.0"):
        parity.compare(got, ref)


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_are_megatron_minimal(world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    """Per pass with L layers: forward one all-reduce per attention and per MLP block plus the
    embedding's, one all-gather for the logits; backward one all-reduce per block entry plus the
    lm_head's entry (not one per q/k/v/gate/up)."""
    path, _ = refs("llama")
    layers = models.BASE["num_hidden_layers"]
    counts = _pool(world, pool2, pool4).run(parity.count, path, models.batch())
    assert counts[0]["forward"] == {"all_reduce": 2 * layers + 1, "all_gather": 1}
    assert counts[0]["backward"] == {"all_reduce": 2 * layers + 1}
    assert all(c == counts[0] for c in counts)
    path, _ = refs("qwen3")  # + one all-reduce for every q/k norm gradient together
    counts = _pool(world, pool2, pool4).run(parity.count, path, models.batch())
    assert counts[0]["backward"] == {"all_reduce": 2 * layers + 2}
    if world == 4:  # K/V heads replicated on 2 ranks each: their gradients joined into that same one
        path, _ = refs("llama_gqa")
        counts = _pool(world, pool2, pool4).run(parity.count, path, models.batch())
        assert counts[0]["backward"] == {"all_reduce": 2 * layers + 2}
