"""Norms and statistics over features tp splits (:mod:`hp_lazy.runtime.tp.norms`): OLMo 2's RMSNorm
and ESM C's LayerNorm over every head of q/k. Their weights are cut with the projections' rows and
their row statistics summed over tp, so attention runs on each rank's heads; transformers' own OLMo
plan gathers q/k/v whole on every rank instead, and ESM C's plan crashes. Gemma 3n's activation
sparsity (mean and std of the intermediate row colwise gate_proj splits) likewise.

At tp=2 and 4 against one process: logits, loss, every gradient and 3 SGD+wd steps. Per rank and
forward: one all-reduce of ``[B, S, 1]`` per statistic besides the two block exits, and no
all-gather but the logits'. The forms a norm class runs are identified from its own forward, and a
class that matches none is refused by name. Negative control: statistics of the slice alone."""

from __future__ import annotations

import models
import parity
import pytest
import torch
from dist import DistPool, pool_fixture
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.tp.norms import identify

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)

STATS = {"olmo2": 1, "esmc": 2}
"""All-reduces of row statistics per norm and forward: RMS the mean square; LayerNorm the mean, then the variance."""


def _train(rank: int, world: int, path: str, ids, dtype: str = "float32") -> dict:
    import hp_lazy

    model = hp_lazy.parallelize(models.load(path, dtype))
    norms = {n: tuple(p.shape) for n, p in model.named_parameters() if "_norm.weight" in n and "self_attn" in n}
    with hp_lazy.collective_counter() as counter:
        model(input_ids=ids, labels=ids)
    result = models.run_training(model, ids, full_grads=hp_lazy.full_grads, full_state_dict=hp_lazy.full_state_dict)
    forward = {op: (n, counter.payload[(op, "forward")]) for op, n in counter.by_phase("forward").items()}
    return {**result, "norms": norms, "forward": forward}


def _train_local_statistics(rank: int, world: int, path: str, ids) -> dict:
    from hp_lazy.runtime.tp import norms

    original = norms.SplitNorm.stat
    norms.SplitNorm.stat = lambda self, partial: partial / (self.features // self.group.size)
    try:
        return _train(rank, world, path, ids)
    finally:
        norms.SplitNorm.stat = original


@pytest.fixture(scope="module")
def esmc64(refs) -> tuple[str, dict]:
    path, _ = refs("esmc")
    return path, models.run_training(models.load(path, "float64"), models.batch())


@pytest.mark.parametrize(("name", "world"), [("olmo2", 2), ("olmo2", 4), ("esmc", 2)])  # at 4: k_norm slices on 2 ranks
def test_matches_one_process(name: str, world: int, refs, esmc64, pool2: DistPool, pool4: DistPool) -> None:
    """ESM C in float64: in float32 one process is 7.4e-6 from itself in float64 on layer 1's q_norm
    gradient, so two float32 runs of equal math may differ by twice that; float64 shows exactness."""
    pool = parity.activated(pool2 if world == 2 else pool4, sequence_parallel=False)
    path, ref = esmc64 if name == "esmc" else refs(name)
    dtype, size = ("float64", 8) if name == "esmc" else ("float32", 4)
    results = pool.run(_train, path, models.batch(), dtype)
    assert len(parity.compare(results[0], ref)) > 10
    layers, hidden, vocab = models.BASE["num_hidden_layers"], models.BASE["hidden_size"], models.VOCAB
    head_dim = hidden // models.BASE["num_attention_heads"]
    rows = 2 * 16  # models.batch(): 2 sequences of 16 tokens
    full = {n: tuple(g.shape) for n, g in ref["grads"].items() if "_norm.weight" in n and "self_attn" in n}
    assert len(full) == 2 * layers
    stat = size * rows  # [B, S, 1]
    for result in results:
        assert models.rel_err(result["loss"], ref["loss"]) <= parity.TOL
        # bytes per rank: each norm holds its slice (q: H*D/tp; k: its K/V heads' slice)
        assert result["norms"] == {n: (max(s[0] // world, head_dim),) for n, s in full.items()}
        exits = 2 * layers * size * rows * hidden  # attention and MLP outputs
        stats = 2 * layers * STATS[name] * stat
        assert result["forward"]["all_reduce"][1] == exits + stats + size * rows * hidden, result["forward"]
        # no all-gather but the logits' (ESM C's masked-LM head is not in its tp plan: nothing)
        gathered = (1, size * rows * vocab // world) if name == "olmo2" else None
        assert result["forward"].get("all_gather") == gathered


def test_slice_statistics_fail(refs, pool2: DistPool) -> None:
    path, ref = refs("olmo2")
    got = parity.activated(pool2, sequence_parallel=False).run(_train_local_statistics, path, models.batch())[0]
    with pytest.raises(AssertionError, match="relative errors above"):
        parity.compare(got, ref)


def _train_gemma3n(rank: int, world: int, path: str, ids) -> dict:
    import hp_lazy

    model = hp_lazy.parallelize(models.load(path))
    mlp = model.model.layers[0].mlp
    from hp_lazy.runtime.tp import norms

    split = norms._SplitGaussianTopK in type(mlp).__mro__
    return {**models.run_training(model, ids, full_grads=hp_lazy.full_grads, full_state_dict=hp_lazy.full_state_dict),
            "split": split, "gate": tuple(mlp.gate_proj.weight.shape)}


def test_gemma3n_activation_sparsity_matches_one_process(refs, pool2: DistPool) -> None:
    world = 2
    pool = parity.activated(pool2, sequence_parallel=False)
    path, ref = refs("gemma3n")
    results = pool.run(_train_gemma3n, path, models.batch())
    assert len(parity.compare(results[0], ref)) > 10
    assert all(r["split"] and r["gate"] == (64 // world, 32) for r in results)  # each rank its slice of the row


def _train_gemma3n_local(rank: int, world: int, path: str, ids) -> dict:
    from hp_lazy.runtime.tp import norms

    original = norms._SplitGaussianTopK._gaussian_topk
    norms._SplitGaussianTopK._gaussian_topk = lambda self, x: norms._topk(x, self.activation_sparsity, x.shape[-1],
                                                                           lambda s: s)
    try:
        return _train_gemma3n(rank, world, path, ids)
    finally:
        norms._SplitGaussianTopK._gaussian_topk = original


def test_gemma3n_slice_statistics_fail(refs, pool2: DistPool) -> None:
    path, ref = refs("gemma3n")
    got = parity.activated(pool2, sequence_parallel=False).run(_train_gemma3n_local, path, models.batch())[0]
    with pytest.raises(AssertionError, match="relative errors above"):
        parity.compare(got, ref)


class Centred(nn.Module):
    """Activation sparsity by another rule (relu(x - mean)): not Gemma 3n's, so tp refuses it."""

    activation_sparsity = 0.95

    def _gaussian_topk(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x - x.mean(-1, keepdim=True))


def test_gemma3n_topk_is_recognised_by_its_output() -> None:
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextMLP

    from hp_lazy.runtime.tp.norms import runs_gaussian_topk
    from hp_lazy.runtime.tp.style import _refuse_feature_statistics

    mlp = Gemma3nTextMLP.__new__(Gemma3nTextMLP)
    mlp.activation_sparsity = 0.95
    assert runs_gaussian_topk(mlp) and not runs_gaussian_topk(Centred())
    _refuse_feature_statistics("model.layers.0.mlp", mlp, True)  # split at run time
    with pytest.raises(ShardingError, match=r"^model.layers.0.mlp: activation_sparsity=0.95 keeps the top activations "
                       r"by the mean and std of the intermediate features, which tp splits across ranks"):
        _refuse_feature_statistics("model.layers.0.mlp", Centred(), True)


class Scaled(nn.Module):
    """x * w / (|x|_1 + eps): no form hp_lazy splits."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight / (x.abs().sum(-1, keepdim=True) + self.eps)


def test_forms_are_read_from_the_norms_own_forward() -> None:
    from transformers.models.esmc.modeling_esmc import EsmcLayerNorm
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    assert identify("a", nn.LayerNorm(16, eps=1e-5), 16) == ("layer", 1e-5)
    assert identify("a", EsmcLayerNorm(16, bias=False), 16)[0] == "layer"
    assert identify("a", Olmo2RMSNorm(16, eps=1e-6), 16) == ("rms", 1e-6)
    assert identify("a", LlamaRMSNorm(16), 16)[0] == "rms"
    assert identify("a", GemmaRMSNorm(16), 16)[0] == "rms_offset"
    with pytest.raises(ShardingError) as info:
        identify("model.layers.0.self_attn.q_norm", Scaled(16), 16)
    assert str(info.value) == (
        "model.layers.0.self_attn.q_norm: Scaled normalises the 16 features of a projection tp splits, but its "
        "forward matches none of the norms hp_lazy can split (layer, rms, rms_offset: LayerNorm, RMSNorm with w or "
        "1 + w); leave its input whole (colwise_gather_output on the projection, rowwise_split_input after)"
    )
    nameless = Scaled(16)
    del nameless.eps
    with pytest.raises(ShardingError, match=r"q_norm: Scaled normalises features tp splits, but hp_lazy finds no "
                       r"epsilon on it \(looked for \['eps', 'variance_epsilon', 'epsilon'\]\)"):
        identify("q_norm", nameless, 16)


def test_olmo2_compiles_as_one_graph(refs, pool2: DistPool) -> None:
    """``torch.compile(model, fullgraph=True)`` at tp=2: the split norms' statistics all-reduces are
    inside the one graph, and the step is one process's."""
    import test_compile

    path, ref = refs("olmo2")
    results = parity.activated(pool2, sequence_parallel=False).run(
        test_compile._compiled, path, models.batch(), "torch.compile before the first forward")
    assert [r["graph_breaks"] for r in results] == [0, 0] and results[0]["graphs"] == 1
    assert max(parity.compare(results[0], ref).values()) <= parity.TOL


@pytest.mark.parametrize("lora", [False, True])
def test_olmo2_through_the_stock_trainer(lora: bool, refs, pool2: DistPool, tmp_path) -> None:
    """The user's stack: the stock Trainer with its defaults (clipping at 1.0, so the split norms'
    weight gradients enter the clipped norm) and transformers' gradient checkpointing, 3 SGD steps;
    with ``lora``, PEFT LoRA on every projection (q/k's adapters feed the split norms): losses, logged
    grad norms and every parameter against the same run in one process."""
    import trainwork

    path, _ = refs("olmo2")
    ref = trainwork.trainer(0, 1, path, str(tmp_path / "ref"), lora=lora, gradient_checkpointing=True)
    assert ref["grad_norm"].min() > 1.0 or lora  # clipping changes the full model's steps
    got = parity.activated(pool2, sequence_parallel=False).run(trainwork.trainer, path, str(tmp_path / "hp"),
                                                               lora=lora, gradient_checkpointing=True)
    trainwork.compare_trainer(got[0], ref)


class LearnedScale(nn.Module):
    """x * w: each feature its own, so exact on a slice without statistics."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_a_per_feature_module_runs_on_its_slice_as_it_is() -> None:
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from hp_lazy.runtime.tp.norms import per_feature

    assert per_feature(LearnedScale(16), 16)
    assert not per_feature(Olmo2RMSNorm(16), 16) and not per_feature(nn.LayerNorm(16), 16)
    assert not per_feature(Scaled(16), 16)
