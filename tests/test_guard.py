"""A bound model whose forward someone replaced (hp_lazy.runtime.guard), at tp=2: a replacement
that computes with the vocab-sharded head's weight is refused naming the function and the weight;
one that only wraps the model's own forward runs, exact."""

from __future__ import annotations

import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)


@pytest.fixture
def pool(pool2: DistPool) -> DistPool:
    return parity.activated(pool2, tp=2)


def _own_head(self, input_ids=None, labels=None, **kwargs):
    """A hand-written fused head: the backbone, then a softmax over get_output_embeddings().weight."""
    import torch

    hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
    logits = hidden @ self.get_output_embeddings().weight.t()
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _replaced(rank: int, world: int, path: str, how: str):
    import types

    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    ids = models.batch()
    if how == "own_head":
        model.forward = types.MethodType(_own_head, model)
        try:
            model(input_ids=ids, labels=ids)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ran"
    stock = model.forward

    def forward(*args, **kwargs):  # accelerate's convert_outputs_to_fp32 does this
        return stock(*args, **kwargs)

    model.forward = forward
    return model(input_ids=ids, labels=ids).loss.detach()


def test_a_forward_reading_the_vocab_shard_is_refused(pool: DistPool, refs) -> None:
    path, _ = refs("llama")
    for text in pool.run(_replaced, path, "own_head"):
        assert text.startswith("ShardingError: LlamaForCausalLM.forward was replaced by test_guard._own_head, which "
                               "reads an embedding's or head's weight directly, but lm_head.weight is this rank's "
                               "shard (S(0) of [128, 32]) under tensor parallel"), text


def test_a_forward_that_wraps_the_model_s_own_runs_exact(pool: DistPool, refs) -> None:
    path, ref = refs("llama")
    for loss in pool.run(_replaced, path, "wrap"):
        assert models.rel_err(loss, ref["loss"]) <= parity.TOL
