"""Context parallel, Ulysses mode (``cp_mode="ulysses"``): all-to-all from sequence shards to head
shards and back, at cp=2 (world 2) and cp=4 (world 4: one query head per rank, the two K/V heads
replicated), against one process; collectives per layer; heads the mode cannot split are refused."""

from __future__ import annotations

import cpwork
import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)


def _ready(pool: DistPool, cp: int) -> DistPool:
    return parity.once(pool, cpwork.activate, cp, 1, "ulysses")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))



@pytest.mark.parametrize(("name", "kind"), [("llama_gqa", "plain"), ("qwen3", "plain"), ("qwen3_sliding", "packed"),
                                            ("llama_gqa", "padded"), ("llama_dynamic", "plain"),
                                            ("deepseek_v2", "plain"), ("minicpm3", "plain"),  # MLA (MiniCPM3: V wider than K)
                                            ("gpt_oss", "packed"), ("gemma2", "padded"),  # sinks of this rank's heads; softcap
                                            ("llama4", "left_padded")])  # chunks from the first token; temperature
def test_ulysses_cp2(pool2: DistPool, root: str, name: str, kind: str) -> None:
    cpwork.check(_ready(pool2, 2), models.build(name, root), cpwork.batch(kind))


def test_ulysses_collectives_per_layer(pool2: DistPool, root: str) -> None:
    counts = _ready(pool2, 2).run(cpwork.count, models.build("llama_gqa", root), cpwork.batch("plain"))
    layers = models.BASE["num_hidden_layers"]
    # per layer: Q, then K and V together, to head shards; the output back; backward the same three
    assert counts == [{"forward": {"all_to_all": 3 * layers, "all_reduce": 1},
                       "backward": {"all_to_all": 3 * layers, "all_reduce": 1}}] * 2


@pytest.mark.parametrize(("name", "kind"), [("llama_gqa", "plain"), ("qwen3_sliding", "packed"), ("gpt_oss", "padded")])
def test_ulysses_cp4_replicates_kv_heads(pool4: DistPool, root: str, name: str, kind: str) -> None:
    cpwork.check(_ready(pool4, 4), models.build(name, root), cpwork.batch(kind))


def test_heads_ulysses_cannot_split_are_refused(pool4: DistPool, root: str) -> None:
    got = _ready(pool4, 4).run(cpwork.error, models.build("llama_2heads", root), cpwork.batch("plain"))
    assert got == ["ShardingError: LlamaAttention: cp_mode='ulysses' splits this rank's 2 attention heads over cp=4, "
                   "which does not divide them; use cp_mode='allgather', or a cp (x tp) that divides the heads"] * 4


def test_dsa_under_ulysses_is_refused_by_layer(pool2: DistPool, root: str) -> None:
    """DSA's selection is over each row's whole sequence of keys: the all-gather mode splits it, Ulysses
    (whole rows of some heads) would need every rank's rows of it; refused at load, naming the fix."""
    got = _ready(pool2, 2).run(cpwork.error, models.build("deepseek_v32", root), cpwork.batch("plain"))
    assert got == ["ShardingError: model.layers.0.self_attn (DeepseekV32ForCausalLM): context parallel cannot split "
                   "this attention over the sequence: it selects its keys with an indexer, which context parallel "
                   "splits with cp_mode='allgather' only (Ulysses would need every rank's whole rows of the "
                   "selection); use cp_mode='allgather'; train this family without cp"] * 2
