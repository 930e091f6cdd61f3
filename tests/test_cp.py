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
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture
def ready(pool2: DistPool, root: str):
    """The pool, activated: per test, since a pool restarts its workers after a worker error (the
    restarted workers would otherwise run the tests after a failure without hp_lazy)."""
    parity.once(pool2, cpwork.activate, 2, 1)
    return pool2, root


CASES = [("llama_gqa", "plain"), ("qwen3", "plain"), ("llama_bias", "plain"), ("qwen3_sliding", "plain"),
         ("llama_dynamic", "plain"), ("llama_gqa", "packed"), ("llama_gqa", "packed_cached"), ("qwen3_sliding", "packed"),
         ("llama_gqa", "padded"), ("llama_gqa", "left_padded"), ("qwen3_moe", "plain"),
         ("phi3", "plain"), ("deepseek_v2", "plain"), ("minicpm3", "packed"),  # MLA (DeepSeek-V2: complex RoPE)
         ("gpt_oss", "plain"), ("gpt_oss", "packed"), ("gpt_oss", "padded"),  # attention sinks, sliding + full
         ("gemma2", "plain"), ("gemma2", "padded"),  # logit softcapping
         ("deepseek_v32", "plain"), ("deepseek_v32", "packed"), ("deepseek_v32", "padded"),  # DSA: top-4 of 16 keys
         ("glm_moe_dsa", "plain"),  # DSA: a layer reusing the top-k of the one before
         ("kolibri1_1", "plain"), ("kolibri1_1", "packed"), ("kolibri1_1", "padded"),  # a selection-mask indexer
         ("llama4", "plain"), ("llama4", "packed"), ("llama4", "left_padded"),  # chunked attention, temperature
         ("ergo", "packed")]  # no TP plan: its ep plan locates the attention (a sliding and a global layer)


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_cp_matches_one_process(ready, name: str, kind: str) -> None:
    pool, root = ready
    path = models.build(name, root)
    cpwork.check(pool, path, cpwork.batch(kind))  # the global loss and, gathered, the whole logits on every rank


NAIVE = {"local positions": "llama_gqa", "upper-left causal": "llama_gqa", "mean of means": "llama_gqa",
         "indexer keys in rank order": "deepseek_v32", "mask indexer keys in rank order": "kolibri1_1",
         "temperature of the local rows": "llama4",
         "chunks ignored": "llama4"}


@pytest.mark.parametrize("how", sorted(NAIVE))
def test_naive_context_parallel_fails_parity(ready, how: str) -> None:
    pool, root = ready
    path = models.build(NAIVE[how], root)
    data = cpwork.batch("plain")
    ref = cpwork.reference(path, data)
    results = pool.run(cpwork.train_broken, path, data, how)
    with pytest.raises(AssertionError, match="relative errors above"):
        parity.compare(results[0], ref)


def test_collectives_per_layer(ready) -> None:
    pool, root = ready
    path = models.build("llama_gqa", root)
    counts = pool.run(cpwork.count, path, cpwork.batch("plain"))
    layers = models.BASE["num_hidden_layers"]
    # per layer: K and V gathered in one all-gather; backward re-gathers them and reduce-scatters dK/dV
    # together; outside attention only the loss's all-reduce and one gradient bucket over cp
    assert counts == [{"forward": {"all_gather": layers, "all_reduce": 1},
                       "backward": {"all_gather": layers, "reduce_scatter": layers, "all_reduce": 1}}] * 2


def test_kolibri_indexer_keys_are_gathered_once_per_kv_source(ready) -> None:
    """Kolibri 1.1 (layer 0 sliding, layers 1-3 indexed, layer 2 reading layer 1's K/V): forward
    all-gathers are each layer's K/V (4) and the indexer keys of layers 1 and 3; layer 2's indexer
    gets layer 1's gathered keys, not a third gather. Backward: each layer's K/V again and dK/dV."""
    pool, root = ready
    counts = pool.run(cpwork.count, models.build("kolibri1_1", root), cpwork.batch("plain"))
    assert counts == [{"forward": {"all_gather": 6, "all_reduce": 1},
                       "backward": {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 1}}] * 2


def test_backward_keeps_no_gathered_key_or_value(ready) -> None:
    pool, root = ready
    path = models.build("llama_gqa", root)
    seq = 24  # no other dim of the tiny model (one row) is 24: a saved tensor with a dim of 24 spans the sequence
    data = {k: v[:1] for k, v in cpwork.batch("plain", seq=seq).items()}
    shapes = pool.run(cpwork.saved_shapes, path, data)
    assert shapes[0] and not [s for s in shapes[0] if seq in s], shapes[0]
    assert any(seq // 2 in s for s in shapes[0])  # the local rows are what backward keeps


def _with(**extra):
    return {**cpwork.batch("plain"), **extra}


REFUSED = [
    ({"input_ids": models.batch(seq=14), "labels": models.batch(seq=14)},
     "a sequence of 14 tokens under context parallel (cp=2): the zigzag layout cuts it into 2*cp = 4 equal chunks; "
     "pad it to a multiple of 4 (16 tokens: pad ids with label -100 and attention_mask 0 at the padding; a data "
     "collator's pad_to_multiple_of=4 does it: transformers' DataCollatorWithPadding, TRL's SFTConfig / DPOConfig)"),
    (_with(use_cache=True), "a KV cache (use_cache=True / past_key_values) under context parallel (cp=2): generation "
     "appends one token at a time, which cannot be split over the sequence; generate with a tp-only plan"),
    (_with(output_attentions=True), "output_attentions=True under context parallel (cp=2): the attention weights are "
     "never built (each rank holds its queries' rows only); drop the option"),
    (_with(logits_to_keep=1), "logits_to_keep=1 under context parallel (cp=2): the last tokens live on other ranks; "
     "use logits_to_keep=0 and hp_lazy.gather_sequence(out.logits)"),
    (_with(token_type_ids=models.batch()), "argument 'token_type_ids' of shape [2, 16] under context parallel (cp=2): "
     "hp_lazy does not know how to split it along the sequence; leave it out, or report the model"),
    (_with(attention_mask=models.batch()[:, None, None, :].bool().expand(2, 1, 16, 16)),
     "a 4-D attention_mask under context parallel (cp=2): only a 2-D padding mask is split; pass a [batch, seq] mask of 0/1"),
]


UNSPLITTABLE = [
    ("doge", "DogeForCausalLM", "model.layers.0.self_attn",
     "builds its own attention mask (attn_mask) rather than passing the model's, which context parallel builds over "
     "the whole sequence"),
    ("deepseek_v4", "DeepseekV4ForCausalLM", "model.layers.0.self_attn",
     "attends to K/V compressed over the whole sequence (a compressor, DeepSeek-V4's CSA/HCA)"),
]


def test_vision_language_text_stack_splits_and_the_tower_runs_whole(ready) -> None:
    """Qwen2-VL under cp=2: a text-only batch matches one process; the vision tower keeps its own
    attention; an image input is refused by name (never a torch shape error or wrong numbers)."""
    pool, root = ready
    path = models.build("qwen2_vl", root)
    cpwork.check(pool, path, cpwork.batch("padded"))
    assert pool.run(cpwork.attention_implementations, path) == [{"model.language_model": "hp_lazy_cp",
                                                                   "model.visual": "sdpa"}] * 2
    data = {**cpwork.batch("plain"), "pixel_values": models.batch()[:, :12].float().reshape(8, 3),
            "image_grid_thw": models.batch()[:1, :3] * 0 + 1}
    got = pool.run(cpwork.error, path, data)
    assert got == ["ShardingError: Qwen2VLForConditionalGeneration: argument 'pixel_values' (an input of model.visual) under "
                   "context parallel (cp=2): the encoder's features land at their tokens' positions over the whole "
                   "sequence, and each rank holds only its share of those positions; context parallel splits this "
                   "model's text stack only; train batches with these inputs without cp (text-only batches split)"] * 2


@pytest.mark.parametrize(("name", "family", "fqn", "why"), UNSPLITTABLE, ids=[u[0] for u in UNSPLITTABLE])
def test_attention_cp_cannot_split_is_refused_by_layer(ready, name: str, family: str, fqn: str, why: str) -> None:
    """Never a torch shape error: the first attention layer named, with the reason."""
    if not hasattr(__import__("transformers"), models.MORE_CONFIGS[name][0]):
        pytest.skip(f"this transformers has no {models.MORE_CONFIGS[name][0]}")
    pool, root = ready
    path = models.build(name, root)
    got = pool.run(cpwork.error, path, {"input_ids": models.batch()})
    assert got == [f"ShardingError: {fqn} ({family}): context parallel cannot split this attention over the "
                   f"sequence: it {why}; train this family without cp"] * 2


def _attention_refusal(query_rows: int, key_rows: int, **kwargs) -> str:
    """What cp_attention raises for a call on rank 0 of cp=2 over 16 tokens (nothing is exchanged
    before the checks)."""
    import torch

    from hp_lazy.errors import ShardingError
    from hp_lazy.runtime.cp import attention, state
    from hp_lazy.runtime.cp.zigzag import zigzag
    from hp_lazy.runtime.mesh import Group

    call = state.CallState(group=Group.solo("cp"), zig=zigzag(16, 2, 0, torch.device("cpu")), mode="cp_allgather_kv",
                           positions=torch.arange(16)[None], docs=None, key_padding=None)
    q, k = torch.zeros(1, 2, query_rows, 4), torch.zeros(1, 2, key_rows, 4)
    token = state.enter(call)
    try:
        with pytest.raises(ShardingError) as caught:
            attention.cp_attention(torch.nn.Module(), q, k, k, None, **kwargs)
    finally:
        state.leave(token)
    return str(caught.value)


def test_attention_arguments_cp_does_not_split_are_refused() -> None:
    """Inkling passes an additive position_bias built from each rank's local rows and keys: never dropped
    silently (it was), refused naming the argument."""
    import torch

    got = _attention_refusal(8, 8, position_bias=torch.zeros(1, 2, 8, 8))
    assert got == ("Module: passes ['position_bias'] to the attention function, which context parallel does not split "
                   "(each rank holds its rows of the queries and keys); train this family without cp")


def test_keys_from_outside_the_split_sequence_are_refused() -> None:
    """DiffusionGemma's decoder joins a cached prefix to its keys: neither this rank's rows nor the
    whole sequence (it failed in autograd with a shape error)."""
    import torch

    got = _attention_refusal(8, 12)
    assert got == ("Module: attends to 12 keys, neither this rank's 8 rows nor the whole sequence's 16 (keys from "
                   "outside the split sequence, e.g. a cached prefix joined to this call's); context parallel splits "
                   "only attention over the model's own sequence; train this family without cp")
    # the whole sequence's keys (MLA's, expanded from the gathered latent) pass this check to the next
    assert _attention_refusal(8, 16, position_bias=torch.zeros(1, 2, 8, 8)).startswith("Module: passes")


def test_recurrent_layers_cp_cannot_split_are_refused_by_layer(ready) -> None:
    """A linear-attention layer whose forward hp_lazy does not recognise (MiniMax's lightning
    attention with :func:`hp_lazy.runtime.cp.lightning.supports` off): refused at load, naming the
    layer and what splits."""
    pool, root = ready
    got = pool.run(error_unrecognised, models.build("minimax", root), {"input_ids": models.batch()})
    assert got == ["ShardingError: MiniMaxForCausalLM: layer 0 is a 'linear_attention' layer, which mixes tokens along "
                   "the sequence outside attention; context parallel splits only ['chunked_attention', "
                   "'full_attention', 'sliding_attention'] layers and recurrent layers on transformers' Gated DeltaNet, "
                   "KDA, Mamba2, Mamba1, short-convolution kernels and lightning attention; train without cp"] * 2


def test_heads_whose_labels_cp_cannot_split_are_refused(ready) -> None:
    """A sequence classifier (one token per row, labels per row) is refused when it binds; a masked
    LM's labels per call (its loss was taken over each rank's rows with causal-LM shifted labels:
    4.893 against one process's 4.881, silently). Without labels, the masked LM runs."""
    pool, root = ready
    path = models.build("llama_gqa", root)
    assert pool.run(head_error, path, "AutoModelForSequenceClassification") == [
        "ShardingError: LlamaForSequenceClassification: a ForSequenceClassification head under context parallel: it "
        "reads one token per row (the last one, which only one rank holds) and its labels are per row, while context "
        "parallel splits every row over the ranks; train it without cp (tp and sequence parallel keep each row whole)"
    ] * 2
    masked, ids = models.build("esmc", root), models.batch()
    assert pool.run(cpwork.error, masked, {"input_ids": ids, "labels": ids}) == [
        "ShardingError: EsmcForMaskedLM: 'labels' for a ForMaskedLM head under context parallel (cp=2): context "
        "parallel splits the labels of a causal LM (shifted over the whole sequence before the split) only, and this "
        "head's loss would be taken over each rank's rows; call the model without them under hp_lazy.whole_outputs() "
        "and compute the loss from the whole logits, or train without cp"] * 2
    assert pool.run(cpwork.error, masked, {"input_ids": ids}) == ["ok"] * 2


def head_error(rank: int, world: int, path: str, auto: str) -> str:
    """What binding ``auto.from_pretrained(path)`` (3 labels, a new head) raises."""
    import transformers

    try:
        getattr(transformers, auto).from_pretrained(path, num_labels=3, pad_token_id=0)(input_ids=models.batch())
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def error_unrecognised(rank: int, world: int, path: str, data: dict) -> str:
    """:func:`cpwork.error` with no lightning attention recognised."""
    from hp_lazy.runtime.cp import lightning

    with parity.swapped(lightning, "supports", lambda module: False):
        return cpwork.error(rank, world, path, data)


@pytest.mark.parametrize(("data", "expected"), REFUSED, ids=[e.split(" under")[0][:30] for _, e in REFUSED])
def test_what_cp_cannot_split_is_refused_by_name(ready, data, expected: str) -> None:
    pool, root = ready
    path = models.build("llama_gqa", root)
    got = pool.run(cpwork.error, path, data)
    assert got == [f"ShardingError: LlamaForCausalLM: {expected}"] * 2


def test_stock_clip_grad_norm_gives_one_process_norm(ready) -> None:
    pool, root = ready
    path = models.build("qwen3", root)
    data = cpwork.batch("plain")
    want = cpwork.grad_norm(0, 1, path, data)
    assert [abs(n - want) / want for n in pool.run(cpwork.grad_norm, path, data)] < [1e-6, 1e-6]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["plain", "packed"])
@pytest.mark.parametrize("name", ["llama", "jamba"])  # Jamba: Mamba1's own checkpointed blocks nested in the layer's
def test_gradient_checkpointing_recomputes_inside_the_call(ready, reentrant: bool, kind: str, name: str) -> None:
    """The recompute runs in backward, after the forward left its context-parallel state: it runs
    inside that state again (it crashed: "attention ran outside a context-parallel forward")."""
    pool, root = ready
    path, data = models.build(name, root), cpwork.batch(kind)
    ref = cpwork.checkpointed(0, 1, path, data, reentrant)
    results = pool.run(cpwork.checkpointed, path, data, reentrant)
    parity.compare(results[0], ref)
    assert models.rel_err(results[1]["logits"], ref["logits"]) <= parity.TOL


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3_next", "gpt_oss",  # a Gated DeltaNet hybrid, attention sinks
                                  "deepseek_v32", "llama4",  # DSA's top-k; chunked attention and query temperature
                                  "kolibri1_1",  # a selection-mask indexer over the batch rows the Trainer feeds
                                  "jamba"])  # Mamba1 layers beside MoE
def test_stock_trainer_under_cp(ready, tmp_path, name: str) -> None:
    """The stock Trainer (default args: clipping at 1.0, SGD) under cp=2: both ranks read the same
    rows, and losses, logged grad norms and parameters after 3 steps are one process's."""
    import trainwork

    pool, root = ready
    path = models.build(name, root)
    ref = trainwork.trainer(0, 1, path, str(tmp_path / "ref"))
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"))
    trainwork.compare_trainer(got[0], ref)
    assert [g["total_batch"] for g in got] == [ref["total_batch"]] * 2


def test_stock_trainer_with_torch_compile_under_cp(ready, tmp_path) -> None:
    """``TrainingArguments(torch_compile=True)`` (backend eager) under cp=2: one process's numbers."""
    import trainwork

    pool, root = ready
    path = models.build("llama_gqa", root)
    ref = trainwork.trainer(0, 1, path, str(tmp_path / "ref"))
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"), torch_compile="eager")
    assert got[0]["wrapped"] == "OptimizedModule", got[0]["wrapped"]  # the Trainer compiled it
    trainwork.compare_trainer(got[0], ref)


def test_stock_trainer_with_gradient_checkpointing_under_cp(ready, tmp_path) -> None:
    """``TrainingArguments(gradient_checkpointing=True)`` under cp=2 with PEFT LoRA on the model."""
    import trainwork

    pool, root = ready
    path = models.build("llama_gqa", root)
    ref = trainwork.trainer(0, 1, path, str(tmp_path / "ref"), gradient_checkpointing=True, lora=True)
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"), gradient_checkpointing=True, lora=True)
    trainwork.compare_trainer(got[0], ref)


@pytest.mark.parametrize(("name", "rows"), [("llama_gqa", 6),  # the last batch cut
                                            ("qwen3_moe_aux", 8)])  # the router logits, [batch * rows, experts]
def test_trainer_predictions_under_cp(ready, tmp_path, name: str, rows: int) -> None:
    """``compute_metrics`` and ``Trainer.predict`` read one process's logits: the whole sequence in
    order, on every rank (the negative control, the Trainer's own ``prediction_step``, hands it
    rank 0's zigzag rows: half the sequence, silently)."""
    import trainwork

    pool, root = ready
    path = models.build(name, root)
    ref = trainwork.predict(0, 1, path, str(tmp_path / "ref"), rows=rows)
    for got in pool.run(trainwork.predict, path, str(tmp_path / "hp"), rows=rows):
        trainwork.compare_predictions(got, ref)
    stock = pool.run(trainwork.predict, path, str(tmp_path / "stock"), stock=True, rows=rows)[0]
    assert list(stock["logits"].shape) == [rows, 8, models.VOCAB]


@pytest.mark.parametrize("option", [{"label_smoothing": 0.1}, {"loss_func": True}], ids=["label_smoothing", "compute_loss_func"])
def test_trainer_loss_from_the_logits_under_cp(ready, tmp_path, option: dict) -> None:
    """Label smoothing and a ``compute_loss_func`` compute the loss outside the model, from the
    logits and the whole labels: 3 steps of one process's losses, grad norms and parameters."""
    import trainwork

    pool, root = ready
    path = models.build("llama_gqa", root)
    ref = trainwork.trainer(0, 1, path, str(tmp_path / "ref"), **option)
    trainwork.compare_trainer(pool.run(trainwork.trainer, path, str(tmp_path / "hp"), **option)[0], ref)


def test_whole_outputs_for_a_loss_of_the_users(ready) -> None:
    """``hp_lazy.whole_outputs()``: the logits and hidden states of the whole sequence on both ranks,
    a loss of the user's from them, one process's gradients; the block adds one all-gather of this
    rank's rows of each, no more. Without it they are this rank's rows."""
    pool, root = ready
    path, ids = models.build("llama_gqa", root), models.batch()
    ref = parity.whole_outputs_loss(0, 1, path, ids)
    got = pool.run(parity.whole_outputs_loss, path, ids)
    for result in got:
        parity.compare_whole(result, ref)
    cut = pool.run(parity.whole_outputs_loss, path, ids, whole=False, backward=False)
    batch, seq = ids.shape
    assert [list(c["logits"].shape) for c in cut] == [[batch, seq // 2, models.VOCAB]] * 2
    states = models.BASE["num_hidden_layers"] + 1  # each [batch, seq / 2, hidden] gathered too
    per_token = models.VOCAB + states * models.BASE["hidden_size"]
    assert [g["gathered"] - c["gathered"] for g, c in zip(got, cut, strict=True)] == [batch * seq // 2 * per_token * 4] * 2


def test_mla_gathers_the_compressed_latent(ready) -> None:
    """MLA (DeepSeek-V2): the latent and the shared RoPE key travel (kv_lora_rank + qk_rope_head_dim
    values per token), not the heads' expanded K/V; the same gradients as gathering K/V."""
    pool, root = ready
    path = models.build("deepseek_v2", root)
    data = cpwork.batch("plain")
    latent, expanded = pool.run(cpwork.traffic, path, data)[0], pool.run(cpwork.traffic, path, data, latent=False)[0]
    extra = models.MORE_CONFIGS["deepseek_v2"][1]
    layers, tokens = models.BASE["num_hidden_layers"], data["input_ids"].numel() // 2  # this rank's
    heads = models.BASE["num_attention_heads"]
    per_latent = extra["kv_lora_rank"] + extra["qk_rope_head_dim"]
    per_kv = heads * (extra["qk_nope_head_dim"] + extra["qk_rope_head_dim"] + extra["v_head_dim"])
    other = latent["sent"]["all_gather"] - layers * tokens * per_latent  # gathered outside attention: the same in both
    assert expanded["sent"]["all_gather"] - other == 2 * layers * tokens * per_kv  # K/V forward, again in backward
    assert latent["sent"]["reduce_scatter"] == layers * tokens * per_latent
    assert expanded["sent"]["reduce_scatter"] == layers * tokens * per_kv
    assert models.rel_err(latent["loss"], expanded["loss"]) <= parity.TOL
    assert max(models.rel_err(latent["grads"][k], expanded["grads"][k]) for k in expanded["grads"]) <= parity.TOL


def test_an_indexer_reading_more_of_the_cache_is_refused() -> None:
    """GLM-5-Next's pooled DSA indexer reads ``cache.layers`` besides ``update_indexer`` (it crashed
    with an AttributeError under cp): refused by name. DeepSeek-V3.2's reads only the hook."""
    import torch
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    from hp_lazy.runtime.cp import indexed

    assert indexed._cache_reads(DeepseekV32Indexer.forward) == {"update_indexer"}
    assert indexed._cache_reads(Glm5NextTextIndexer.forward) == {"layers", "update_indexer"}

    class Attention(torch.nn.Module):  # MLA (expand_kv) with GLM-5-Next's indexer
        def expand_kv(self):
            return None

    module = Attention()
    module.indexer = Glm5NextTextIndexer.__new__(Glm5NextTextIndexer)
    assert indexed.unsupported(module, "cp_allgather_kv") == (
        "selects its keys with a DSA indexer (Glm5NextTextIndexer) that reads the cache's ['layers'] besides "
        "update_indexer, the one hook through which context parallel hands it the whole sequence's indexer keys")
