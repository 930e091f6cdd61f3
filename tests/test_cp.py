"""Context parallel at world 2 (cp=2): one process's loss, logits (``hp_lazy.gather_sequence``),
every gradient and 3 SGD steps, for GQA, q/k norms, biases, sliding-window and full layers mixed,
dynamic RoPE, packed documents and a padding mask; the collectives per layer; refusals."""

from __future__ import annotations

import cpwork
import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)


@pytest.fixture(scope="module")
def ready(pool2: DistPool, tmp_path_factory):
    if getattr(pool2, "_hp_activated", None) is not pool2._procs or not pool2._procs:
        pool2.run(cpwork.activate, 2, 1)
        pool2._hp_activated = pool2._procs
    return pool2, str(tmp_path_factory.mktemp("models"))


CASES = [("llama_gqa", "plain"), ("qwen3", "plain"), ("llama_bias", "plain"), ("qwen3_sliding", "plain"),
         ("llama_dynamic", "plain"), ("llama_gqa", "packed"), ("llama_gqa", "packed_cached"), ("qwen3_sliding", "packed"),
         ("llama_gqa", "padded"), ("llama_gqa", "left_padded"), ("qwen3_moe", "plain")]


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_cp_matches_one_process(ready, name: str, kind: str) -> None:
    pool, root = ready
    path = models.build(name, root)
    data = cpwork.batch(kind)
    ref = cpwork.reference(path, data)
    results = pool.run(cpwork.train, path, data)
    parity.compare(results[0], ref)
    for other in results[1:]:  # the global loss and, gathered, the whole logits on every rank
        assert models.rel_err(other["loss"], ref["loss"]) <= parity.TOL
        assert models.rel_err(other["logits"], ref["logits"]) <= parity.TOL
