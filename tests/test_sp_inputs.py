"""Per-layer inputs under sequence parallel (:mod:`hp_lazy.runtime.sp.inputs`, and the stack's
own cut of stacked hidden states, :mod:`hp_lazy.runtime.sp.stack`): Gemma 3n hands each layer
its slice of the per-layer embeddings (``[B, S, P]``), which the layer multiplies into its
hidden states outside any boundary, and carries its hidden states as AltUp's stacked predictions
(``[A, B, S, H]``, the sequence at dim 2). DeepSeek-V4 carries ``[B, S, N, H]`` (hyper-connection
streams after the sequence, dim 1) and routes its hash-MoE layers by ``input_ids`` inside an MoE
block that only holds a boundary (the shared experts). One process's loss, logits, every gradient
and 3 SGD+wd steps at tp=2 and 4; which inputs are read outside the boundaries, from the source;
a token-wise boundary handed the hidden states flattened to rows (Ernie-4.5-MoE's shared experts)
runs on them as one sequence; stacked hidden states whose sequence dim the layer's inputs do not
tell, and a boundary handed selected rows, are refused."""

from __future__ import annotations

import epwork
import models
import parity
import pytest
import torch
from dist import DistPool, pool_fixture
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import SEQUENCE_TOKENS
from hp_lazy.runtime.mesh import Group
from hp_lazy.runtime.sp import inputs, stack

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)
EAGER = {"experts_implementation": "eager"}  # torch's grouped_mm takes no float64


@pytest.mark.parametrize("world", [2, 4])
def test_gemma3n_matches_one_process(world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    pool = parity.activated(pool2 if world == 2 else pool4, sequence_parallel=True)
    path, ref = refs("gemma3n")
    results = pool.run(parity.train_loaded, path, models.batch())
    assert len(parity.compare(results[0], ref)) > 10


@pytest.fixture(scope="module")
def hashed(tmp_path_factory) -> tuple[str, dict, dict]:
    """DeepSeek-V4 with its hash router's token -> experts table drawn at random (the default is
    all zeros: every token to the same experts, which would hide a wrong cut of ``input_ids``), in
    float64: in float32 one process's router gradient is 0.93 from itself in float64."""
    path = models.build("deepseek_v4", str(tmp_path_factory.mktemp("models")))
    model = models.load(path)
    tables = [m for m in model.modules() if hasattr(m, "tid2eid")]
    assert tables, "no hash-routed layer in the tiny config"
    generator = torch.Generator().manual_seed(0)
    for m in tables:
        vocab, k = m.tid2eid.shape
        m.tid2eid.copy_(torch.rand(vocab, m.num_experts, generator=generator).argsort(-1)[:, :k])
    model.save_pretrained(path)
    ref = models.run_training(models.load(path, "float64", **EAGER), models.batch())
    # its hyper-connections, norms and sinks stay float32 whatever the dtype: the floor of those
    # entries is one process's distance from itself with the batch's rows summed in another order
    swapped = models.run_training(models.load(path, "float64", **EAGER), models.batch().flip(0))
    swapped["logits"] = swapped["logits"].flip(0)
    return path, ref, parity.relative_errors(swapped, ref)


def _train64(rank: int, world: int, path: str, ids) -> dict:
    import hp_lazy

    model = hp_lazy.parallelize(models.load(path, "float64", **EAGER))
    stacked = [n for n, m in model.named_modules() if n.endswith("attn_hc")]
    result = models.run_training(model, ids, full_grads=hp_lazy.full_grads, full_state_dict=hp_lazy.full_state_dict)
    return {**result, "stacked": len(stacked)}


def _train64_holders_whole(rank: int, world: int, path: str, ids) -> dict:
    """Negative control: a child that only holds a boundary taken as reading its inputs whole."""
    original = inputs._reads
    inputs._reads = lambda module, bounded: inputs.read_outside(
        inputs.kind_of(module), frozenset(n for n, c in module.named_children()
                                          if any(inputs._takes_whole(m, bounded) for m in c.modules())))
    try:
        return _train64(rank, world, path, ids)
    finally:
        inputs._reads = original


@pytest.mark.parametrize("world", [2, 4])
def test_deepseek_v4_matches_one_process(world: int, hashed, pool2: DistPool, pool4: DistPool) -> None:
    """The entries the model keeps in float32 may reach twice ``world`` times one reordering's floor:
    each rank sums its piece of the sequence in its own order, ``world`` orders where the floor's
    run has one (``model.hc_head.hc_base`` at world 4: 1.2e-5 against a floor of 2.9e-6 on one
    machine, under 1e-5 on another; a wrong cut is off by more than 1e-3)."""
    pool = parity.activated(pool2 if world == 2 else pool4, sequence_parallel=True)
    path, ref, floor = hashed
    result = pool.run(_train64, path, models.batch())[0]
    assert result["stacked"] == 2  # [B, S, N, H] hidden states in both layers
    assert len(parity.compare(result, ref, {name: world * v for name, v in floor.items()})) > 10


def test_deepseek_v4_holders_read_whole_fail(hashed, pool2: DistPool) -> None:
    path = hashed[0]
    with pytest.raises(Exception, match="expected index"):  # the whole input_ids gathered against S / tp rows
        parity.activated(pool2, sequence_parallel=True).run(_train64_holders_whole, path, models.batch())


def test_stacked_sequence_dim_from_position_ids() -> None:
    assert stack.sequence_dim("m.layers", torch.zeros(2, 16, 4, 8), 16) == 1  # [B, S, N, H]
    assert stack.sequence_dim("m.layers", torch.zeros(4, 2, 16, 8), 16) == 2  # [A, B, S, H]
    assert stack.sequence_dim("m.layers", torch.zeros(2, 8, 4, 8), 16, parts=2) == 1  # this rank's half
    with pytest.raises(ShardingError) as info:
        stack.sequence_dim("model.layers", torch.zeros(4, 16, 16, 8), 16)
    assert str(info.value) == (
        "model.layers: under sequence parallel the layers' hidden states stack several streams per token, shape "
        "[4, 16, 16, 8] (1 part(s) of the sequence), and their sequence dim is cut: dim 1 ([B, S, N, H]) or dim 2 "
        "([A, B, S, H]); its position_ids' 16 tokens match both; pass the layers position_ids of the batch's length, "
        "with a batch size and stream count other than that length, or train this family without sequence_parallel")
    with pytest.raises(ShardingError, match="the layer is given no position_ids to tell which"):
        stack.sequence_dim("model.layers", torch.zeros(2, 16, 4, 8), None)


def test_inputs_read_outside_the_boundaries() -> None:
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextDecoderLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    assert inputs.read_outside(Gemma3nTextDecoderLayer, frozenset({"self_attn", "mlp"})) == ("per_layer_input",)
    assert inputs.read_outside(LlamaDecoderLayer, frozenset({"self_attn", "mlp"})) == ()
    # with no boundary named, the attention's own inputs are read outside one too (control)
    assert "attention_mask" in inputs.read_outside(LlamaDecoderLayer, frozenset())
    # DeepSeek-V4's MoE block holds a boundary and reads input_ids itself (its hash router)
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4SparseMoeBlock

    assert inputs.read_outside(DeepseekV4SparseMoeBlock, frozenset({"shared_experts"})) == ("input_ids",)
    held = frozenset({("mlp", ("input_ids",), ("input_ids",))})
    assert inputs.read_outside(DeepseekV4DecoderLayer, frozenset({"self_attn"}), held) == ("input_ids",)
    assert inputs.read_outside(DeepseekV4DecoderLayer, frozenset({"self_attn"}),
                               frozenset({("mlp", (), ("input_ids",))})) == ()


@pytest.mark.parametrize("world", [2, 4])
def test_flattened_rows_to_a_tokenwise_boundary(world: int, tmp_path, pool2: DistPool, pool4: DistPool) -> None:
    """Ernie-4.5-MoE hands its shared experts ``h.view(-1, H)``: run as one sequence of this rank's
    rows (its experts, split over tp, gather the rows with their top-k)."""
    pool = parity.activated(pool2 if world == 2 else pool4, sequence_parallel=True)
    path = models.build("ernie4_5_moe", str(tmp_path))
    epwork.check(pool, path, "eager", sequence=True)
    # bytes per rank: the rows cross once each way, as [B, S / tp, H] would (the count exchange is
    # control traffic, not counted)
    rows, hidden = 2 * 16 // world, models.BASE["hidden_size"]
    want = {"all_gather": (1, rows * hidden * 4), "reduce_scatter": (1, world * rows * hidden * 4)}
    for mine in pool.run(epwork.experts_collectives, path, "mlp.shared_experts"):
        assert mine == {"model.layers.1.mlp.shared_experts": want}, mine


class _Rows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(list(x.shape))
        return x * 2


class _Mixer(_Rows):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ALL_ATTENTION_FUNCTIONS(x)  # noqa: F821  (read by name: what marks a token mixer)


SOLO = Group.solo("tp")


def _stack(tokens: int) -> nn.Module:
    stack = nn.ModuleList()
    setattr(stack, SEQUENCE_TOKENS, tokens)
    return stack


def test_a_boundary_given_selected_rows_is_refused() -> None:
    """HiggsAudio-v2 calls its MLP on ``h[~audio_mask]`` (rows ``[N, H]``, fewer than this rank's
    tokens): no gather along the sequence rebuilds that. Its flattened hidden states (``[B * S / tp,
    H]``, as many rows as tokens) run as one sequence; ``[B, S / tp, H]`` passes as it is."""
    refused = _Rows()
    inputs._check_rows("model.layers.0.mlp", refused, "x", "HiggsAudioV2ForConditionalGeneration", _stack(16), SOLO)
    with pytest.raises(ShardingError) as info:
        refused(torch.zeros(12, 32))
    assert str(info.value) == (
        "model.layers.0.mlp (HiggsAudioV2ForConditionalGeneration): under sequence parallel this boundary's input "
        "'x' must arrive as the layer's hidden states, [batch, seq / tp, ...], which it gathers along the sequence, "
        "or, for a token-wise boundary, as those flattened to [16, hidden]; it got shape [12, 32]: the layer's code "
        "selects tokens before calling it, and no gather along the sequence rebuilds that; train this family without "
        "sequence_parallel")
    flat = _Rows()
    inputs._check_rows("model.layers.0.mlp.shared_experts", flat, "x", "Ernie4_5_MoeForCausalLM", _stack(16), SOLO)
    assert flat(torch.ones(16, 32)).shape == (16, 32) and flat.seen == [[1, 16, 32]]  # one sequence inside
    assert flat(torch.ones(2, 8, 32)).shape == (2, 8, 32) and flat.seen[-1] == [2, 8, 32]
    mixer = _Mixer()
    inputs._check_rows("model.layers.0.self_attn", mixer, "x", "LlamaForCausalLM", _stack(16), SOLO)
    with pytest.raises(ShardingError, match=r"along the sequence \(it mixes tokens\), or, for a token-wise"):
        mixer(torch.zeros(16, 32))


def _diverging_rows(rank: int, world: int) -> str:
    import torch.distributed as dist

    module = _Rows()
    group = Group(axis="tp", pg=dist.group.WORLD, size=world, rank=rank)
    inputs._check_rows("model.layers.0.mlp", module, "x", "HiggsAudioV2ForConditionalGeneration", _stack(16), group)
    try:
        module(torch.zeros(16 if rank == 0 else 12, 32))  # rank 0: every token text; rank 1: 4 audio tokens
    except ShardingError as refused:
        return str(refused)
    return "ran"


def test_rows_selected_on_one_rank_only_are_refused_on_every_rank(pool2: DistPool) -> None:
    """Rank 0's rows look flattened (all its tokens), rank 1's selected: both refuse at once (one
    rank left in the gather would wait out the process-group timeout)."""
    texts = pool2.run(_diverging_rows)
    assert len(set(texts)) == 1 and "it got [16, 12] rows on the tp ranks" in texts[0], texts


def _head_called_in_a_layer(rank: int, world: int, path: str) -> dict:
    """An early-exit head: layer 0 calls the model's lm_head (planned outside the stack) itself."""
    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    ids = models.batch()
    handle = model.model.layers[0].register_forward_hook(lambda m, a, out: model.lm_head(out))
    try:
        model(input_ids=ids, labels=ids)
        refused = "ran"
    except ShardingError as error:
        refused = str(error)
    handle.remove()
    return {"refused": refused, "loss": model(input_ids=ids, labels=ids).loss.detach()}


def test_a_module_planned_outside_the_stack_called_in_a_layer_is_refused(refs, pool2: DistPool) -> None:
    """It would read this rank's piece of the sequence as the whole (a colwise head gathers its
    features across ranks that hold other tokens). Refused on every rank; the next forward runs."""
    path, ref = refs("llama")
    results = parity.activated(pool2, sequence_parallel=True).run(_head_called_in_a_layer, path)
    for got in results:
        assert got["refused"].startswith(
            "lm_head (LlamaForCausalLM): its contract lies outside the sequence-parallel layer stack ['model.layers'] "
            "and takes whole values, but a layer calls it while the stack runs, with this rank's piece of the "
            "sequence"), got["refused"]
        assert models.rel_err(got["loss"], ref["loss"]) <= parity.TOL
