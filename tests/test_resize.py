"""``resize_token_embeddings`` and hp_lazy: after ``parallelize`` (vocab-parallel embedding and
lm_head, tied or not) it is refused with the fix instead of copying a shard as the whole
vocabulary; before binding, the resized model shards and trains like one process's."""

from __future__ import annotations

import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)

NEW_VOCAB = models.VOCAB + 8


def _resize_after(rank: int, world: int, path: str) -> str:
    import hp_lazy
    from hp_lazy.errors import ShardingError

    model = hp_lazy.parallelize(parity._load(path))
    try:
        model.resize_token_embeddings(NEW_VOCAB)
    except ShardingError as exc:
        return str(exc)
    return "resized"


def _resize_before(rank: int, world: int, path: str, ids) -> dict:
    import torch

    import hp_lazy

    model = parity._load(path)
    torch.manual_seed(5)  # the new rows' init
    model.resize_token_embeddings(NEW_VOCAB)
    result = models.run_training(model, ids, full_grads=hp_lazy.full_grads, full_state_dict=hp_lazy.full_state_dict)
    return result if rank == 0 else {}


def _reference(path: str, ids) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(5)
    model.resize_token_embeddings(NEW_VOCAB)
    return models.run_training(model, ids)


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_resize(name: str, refs, pool2: DistPool) -> None:
    path, _ = refs(name)
    pool = parity.activated(pool2, sequence_parallel=False)
    messages = pool.run(_resize_after, path)
    assert "resize_token_embeddings: hp_lazy already sharded model.embed_tokens.weight (S(0) of [128, 32])" in messages[0]
    assert "before hp_lazy.parallelize(model)" in messages[0] and messages[0] == messages[1]
    got = pool.run(_resize_before, path, models.batch())[0]
    assert got["logits"].shape[-1] == NEW_VOCAB
    assert max(parity.compare(got, _reference(path, models.batch())).values()) <= parity.TOL
