"""``resize_token_embeddings`` after ``parallelize`` (vocab-parallel embedding and lm_head, tied or
not) re-cuts the weights at the new size: logits, loss, every gradient and three SGD steps equal
one process's resized model (the added rows drawn from the same mean and covariance); a size tp
does not divide is refused, before anything changes, with ``pad_to_multiple_of``."""

from __future__ import annotations

import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)

NEW_VOCAB = models.VOCAB + 8


def _resize_after(rank: int, world: int, path: str, ids, when: str) -> dict:
    import torch

    import hp_lazy
    from hp_lazy.errors import ShardingError

    model = parity._load(path)
    if when == "after":
        hp_lazy.parallelize(model)
    try:
        model.resize_token_embeddings(NEW_VOCAB + 1)
    except ShardingError as exc:
        refused = str(exc)
    torch.manual_seed(5)  # the new rows' init
    model.resize_token_embeddings(NEW_VOCAB)
    result = models.run_training(model, ids, full_grads=hp_lazy.full_grads, full_state_dict=hp_lazy.full_state_dict)
    result["refused"] = refused if when == "after" else ""
    return result if rank == 0 else {"loss": result["loss"]}


def _reference(path: str, ids) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(5)
    model.resize_token_embeddings(NEW_VOCAB)
    return models.run_training(model, ids)


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_resize_after_parallelize(name: str, refs, pool2: DistPool) -> None:
    path, _ = refs(name)
    results = parity.activated(pool2, sequence_parallel=False).run(_resize_after, path, models.batch(), "after")
    got = results[0]
    assert "model.embed_tokens.weight: resize_token_embeddings to 137 rows, which tp=2 does not divide" in got["refused"]
    assert "pad_to_multiple_of=2" in got["refused"]
    assert got["logits"].shape[-1] == NEW_VOCAB and got["state"]["lm_head.weight"].shape[0] == NEW_VOCAB
    assert max(parity.compare(got, _reference(path, models.batch())).values()) <= parity.TOL
    assert models.rel_err(results[1]["loss"], got["loss"]) <= parity.TOL
