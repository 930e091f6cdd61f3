"""``Plan.auto(tp, loss_parallel=True)``: lm_head keeps its logits vocab-sharded and the loss is
computed from the shards (vocab-parallel cross-entropy); loss and every gradient still equal one
process's, and no rank ever holds the full logits."""

from __future__ import annotations

import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)


def _train(rank: int, world: int, path: str, ids) -> dict:
    import hp_lazy

    model = parity._load(path)
    with hp_lazy.collective_counter() as counter:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    return {"logits": out.logits.detach(), "loss": out.loss.detach(), "grads": hp_lazy.full_grads(model),
            "forward": counter.by_phase("forward")}


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_vocab_parallel_loss_matches_one_process(name: str, pool2: DistPool, tmp_path) -> None:
    path = models.build(name, str(tmp_path))
    ref = models.reference(path, models.batch())
    parity.activated(pool2, loss_parallel=True)
    results = pool2.run(_train, path, models.batch())
    half = models.VOCAB // 2
    for rank, got in enumerate(results):
        assert got["logits"].shape[-1] == half
        assert models.rel_err(got["logits"], ref["logits"][..., rank * half : (rank + 1) * half]) <= parity.TOL
        assert models.rel_err(got["loss"], ref["loss"]) <= parity.TOL
        # no all-gather of logits: the loss needs two small all-reduces (max, sums) instead
        assert "all_gather" not in got["forward"]
    for pname, grad in ref["grads"].items():
        assert models.rel_err(results[0]["grads"][pname], grad) <= parity.TOL, pname
