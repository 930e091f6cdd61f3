"""Context parallel at world 4: cp=2 x tp=2, cp=4, and dp=2 x cp=2, against one process (loss,
gathered logits, every gradient, 3 SGD steps; the Trainer's predictions); one pool per layout, each
with its own plan."""

from __future__ import annotations

import cpwork
import models
import parity
import pytest
from dist import DistPool, pool_fixture

cp2tp2 = pool_fixture(4, timeout=180)
cp4 = pool_fixture(4, timeout=180)
dp2cp2 = pool_fixture(4, timeout=180)


def _ready(pool: DistPool, cp: int, tp: int) -> DistPool:
    return parity.once(pool, cpwork.activate, cp, tp)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))



@pytest.mark.parametrize(("name", "kind"), [("llama_gqa", "plain"), ("qwen3", "plain"), ("llama_bias", "plain"),
                                            ("qwen3_sliding", "packed"), ("llama_gqa", "padded"), ("phi3", "plain"),
                                            ("deepseek_v2", "plain"),  # MLA: latent heads cut on tp
                                            ("gpt_oss", "packed"), ("gemma2", "plain"),  # sinks cut with their heads; softcap
                                            ("deepseek_v32", "padded"),  # DSA: the indexer whole on each tp rank
                                            ("jamba", "padded")])  # Mamba1 layers beside tp-cut attention and MoE
def test_cp2_tp2(cp2tp2: DistPool, root: str, name: str, kind: str) -> None:
    cpwork.check(_ready(cp2tp2, 2, 2), models.build(name, root), cpwork.batch(kind))


@pytest.mark.parametrize(("name", "kind"), [("llama_gqa", "plain"), ("qwen3_sliding", "packed"), ("llama_dynamic", "plain"),
                                            ("gpt_oss", "packed"), ("gemma2", "padded"), ("deepseek_v32", "packed"),
                                            ("glm_moe_dsa", "padded"), ("llama4", "packed"),
                                            ("kolibri1_1", "plain")])  # the selection mask of 2-row zigzag chunks
def test_cp4(cp4: DistPool, root: str, name: str, kind: str) -> None:
    cpwork.check(_ready(cp4, 4, 1), models.build(name, root), cpwork.batch(kind))


def test_dp2_cp2(dp2cp2: DistPool, root: str) -> None:
    path = models.build("llama_gqa", root)
    data = cpwork.balanced()
    ref = cpwork.reference(path, data)
    results = _ready(dp2cp2, 2, 1).run(cpwork.train_dp, path, data)
    got = results[0]
    assert got["dp_rank"] == 0
    for name, grad in ref["grads"].items():  # the dp average of the two halves = one process on both
        assert models.rel_err(got["grads"][name], grad) <= parity.TOL, name
    for name, value in ref["state"].items():
        assert models.rel_err(got["state"][name], value) <= parity.TOL, name
    for r in results:  # each rank's gathered logits are its dp group's rows
        assert models.rel_err(r["logits"], ref["logits"][r["dp_rank"] : r["dp_rank"] + 1]) <= parity.TOL


@pytest.mark.parametrize(("layout", "cp", "tp"), [("cp2tp2", 2, 2), ("dp2cp2", 2, 1)])
def test_trainer_predictions(request, root: str, tmp_path, layout: str, cp: int, tp: int) -> None:
    """``compute_metrics`` and ``Trainer.predict``: one process's logits and metrics on every rank,
    the last batch cut (under dp=2 x cp=2, each dp rank's rows gathered whole over cp, then over dp)."""
    import trainwork

    pool = _ready(request.getfixturevalue(layout), cp, tp)
    path = models.build("llama_gqa", root)
    ref = trainwork.predict(0, 1, path, str(tmp_path / "ref"))
    for got in pool.run(trainwork.predict, path, str(tmp_path / "hp")):
        trainwork.compare_predictions(got, ref)
