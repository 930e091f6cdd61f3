"""Attention heads under tp (:mod:`hp_lazy.runtime.tp.heads` and transformers 5.25's
``local_params``): per-head vectors cut with the heads they belong to (GraniteSWA's and
MiMo-V2-Flash's attention sinks, Beam's output-gate bias) and a layer whose K/V head count is not the
config's (MiMo-V2-Flash's sliding layers have twice as many). At tp=2 and 4 against one process:
logits, loss, every gradient and 3 SGD+wd steps; each vector is ``1/tp`` of itself on every rank.
Negative control: the K/V count read from the config alone (as before) breaks MiMo's sliding layer."""

from __future__ import annotations

import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)

VECTORS = ("sinks", "gate_bias")


def _train(rank: int, world: int, path: str, ids) -> dict:
    import hp_lazy

    model = parity._load(path)
    vectors = {n: tuple(p.shape) for n, p in model.named_parameters() if n.endswith(VECTORS)}
    result = models.run_training(model, ids, full_grads=hp_lazy.full_grads, full_state_dict=hp_lazy.full_state_dict)
    return {**result, "vectors": vectors}


def _train_config_heads(rank: int, world: int, path: str, ids) -> dict:
    """The K/V heads of every layer from the config (the code before per-layer counts)."""
    from hp_lazy.runtime.tp import heads

    original = heads._head_counts

    def config_only(module):
        groups = getattr(module, "num_key_value_groups", None)
        try:
            module.num_key_value_groups = None
            return original(module)
        finally:
            module.num_key_value_groups = groups

    heads._head_counts = config_only
    try:
        return _train(rank, world, path, ids)
    finally:
        heads._head_counts = original


@pytest.mark.parametrize(("name", "world"), [("granite_swa", 2), ("beam", 2), ("mimo_v2_flash", 2),
                                           ("mimo_v2_flash", 4)])  # at 4: K/V heads on 2 ranks in layer 0, 1 in layer 1
def test_matches_one_process(name: str, world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    pool = parity.activated(pool2 if world == 2 else pool4, sequence_parallel=False)
    path, ref = refs(name)
    results = pool.run(_train, path, models.batch())
    errors = parity.compare(results[0], ref)
    assert len(errors) > 10
    heads = models.BASE["num_attention_heads"]
    expected = {n: (heads,) for n in ref["grads"] if n.endswith(VECTORS)}
    assert expected, f"{name} has no per-head vector"
    for result in results:  # bytes per rank: each vector holds this rank's heads only
        assert models.rel_err(result["loss"], ref["loss"]) <= parity.TOL
        assert result["vectors"] == {n: (heads // world,) for n in expected}


def test_layer_kv_heads_from_the_config_alone_fail(refs, pool2: DistPool, pool4: DistPool) -> None:
    path, _ = refs("mimo_v2_flash")
    pool = parity.activated(pool2, sequence_parallel=False)
    with pytest.raises(Exception, match="must match the size of tensor"):
        pool.run(_train_config_heads, path, models.batch())
