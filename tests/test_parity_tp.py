"""Model parity, tensor parallel without sequence parallel: tiny transformers models loaded with
``from_pretrained`` under ``activate("auto", tp=N)`` against the same model in one process —
logits, loss, every gradient, and three SGD steps with weight decay; plus collective counts."""

from __future__ import annotations

import pytest

import models
import parity
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)
SEQUENCE_PARALLEL = False


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def refs(model_dir):
    cache: dict[str, dict] = {}

    def get(name: str) -> tuple[str, dict]:
        path = models.build(name, model_dir)
        if name not in cache:
            cache[name] = models.reference(path, models.batch())
        return path, cache[name]

    return get


def _activated(pool: DistPool) -> DistPool:
    if not getattr(pool, "_hp_activated", False):
        pool.run(parity.activate, "auto", pool.world_size, SEQUENCE_PARALLEL)
        pool._hp_activated = True
    return pool


@pytest.mark.parametrize("name", sorted(models.CONFIGS))
@pytest.mark.parametrize("world", [2, 4])
def test_parity(name: str, world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    pool = _activated(pool2 if world == 2 else pool4)
    path, ref = refs(name)
    results = pool.run(parity.train, path, models.batch())
    errors = parity.compare(results[0], ref)
    assert max(errors.values()) <= parity.TOL
    for other in results[1:]:  # every rank sees the same full logits and loss
        assert models.rel_err(other["logits"], ref["logits"]) <= parity.TOL
        assert models.rel_err(other["loss"], ref["loss"]) <= parity.TOL


def test_dropped_entry_op_fails_parity(refs, pool2: DistPool) -> None:
    """Negative control: without copy_to's backward all-reduce the gradients must differ."""
    pool = _activated(pool2)
    path, ref = refs("llama")
    got = pool.run(parity.train_with_broken_entry, path, models.batch())[0]
    assert models.rel_err(got["logits"], ref["logits"]) <= parity.TOL  # forward is unaffected
    with pytest.raises(AssertionError, match="grad model.layers.0"):
        parity.compare(got, ref)


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_are_megatron_minimal(world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    """Per pass with L layers: forward one all-reduce per attention and per MLP block plus the
    embedding's, one all-gather for the logits; backward one all-reduce per block entry plus the
    lm_head's entry (not one per q/k/v/gate/up)."""
    pool = _activated(pool2 if world == 2 else pool4)
    path, _ = refs("llama")
    layers = models.BASE["num_hidden_layers"]
    counts = pool.run(parity.count, path, models.batch())
    assert counts[0]["forward"] == {"all_reduce": 2 * layers + 1, "all_gather": 1}
    assert counts[0]["backward"] == {"all_reduce": 2 * layers + 1}
    assert all(c == counts[0] for c in counts)
