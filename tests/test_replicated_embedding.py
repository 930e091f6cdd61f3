"""``Plan.auto(tp, vocab_parallel_embedding=False)``: the embedding stays replicated (one
all-reduce less per forward, the hand-written baseline's layout); refused when it is tied to a
sharded lm_head. Also: at tp=1 nothing is rewritten and the model runs as it is."""

from __future__ import annotations

import os
import subprocess
import sys

import models
import parity
import pytest
from dist import DistPool, WorkerError, pool_fixture

pool2 = pool_fixture(2, timeout=120)


@pytest.fixture
def pool(pool2: DistPool) -> DistPool:
    return parity.activated(pool2, vocab_parallel_embedding=False)


def test_replicated_embedding_parity_and_counts(pool: DistPool, refs) -> None:
    errors = parity.check_parity(pool, refs, "llama")
    assert max(errors.values()) <= parity.TOL
    path, _ = refs("llama")
    layers = models.BASE["num_hidden_layers"]
    counts = pool.run(parity.count, path, models.batch())[0]
    assert counts["forward"] == {"all_reduce": 2 * layers, "all_gather": 1}  # no embedding all-reduce


def test_replicated_embedding_tied_to_a_sharded_head_is_refused(pool: DistPool, refs) -> None:
    path, _ = refs("llama_tied")
    with pytest.raises(WorkerError) as info:
        pool.run(parity.count, path, models.batch())
    assert (
        "ShardingError: model.embed_tokens.weight: this parameter is tied to lm_head.weight, which the plan "
        "shards S(0), but model.embed_tokens has no contract; give it one (vocab-parallel embedding: "
        "Plan.auto(vocab_parallel_embedding=True)) or untie the weights"
    ) in str(info.value)


TP1 = r"""
import sys, torch
sys.path.insert(0, {tests!r})
import hp_lazy, models
hp_lazy.activate("auto", tp=1)
import transformers
from transformers.models.llama import modeling_llama
ref = models.reference({path!r}, models.batch())  # the lowered module, at tp=1
print(modeling_llama.__hp_lazy__ is not None, hasattr(modeling_llama.LlamaAttention, "_hp_form"),
      repr(float(ref["loss"])), repr(float(ref["losses"][-1])))
"""


def test_tp1_rewrites_nothing_and_runs_in_one_process(refs) -> None:
    path, ref = refs("llama")
    code = TP1.format(tests=os.path.dirname(__file__), path=path)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    hooked, rewritten, loss, last = out.stdout.split()
    assert (hooked, rewritten) == ("True", "False")  # hooked, but no class needed a rewrite
    assert (float(loss), float(last)) == (float(ref["loss"]), float(ref["losses"][-1]))  # bit for bit
