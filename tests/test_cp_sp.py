"""Context parallel with sequence parallel: cp=2 x tp=2 on 4 ranks, ``activate("auto", cp=2, tp=2,
sequence_parallel=True)``. Each cp rank holds its zigzag rows, and inside its tp group each tp rank
holds a piece of those between the tp boundaries. Against one process: loss, gathered logits, every
gradient and 3 SGD+wd steps, for attention families (GQA, sliding windows, sinks, MLA, Phi-3's
attention run whole on tp, Kimi Linear's attention the TP plan leaves out), hybrids whose token mixers
run on the cp rows gathered over tp (Gated DeltaNet, KDA, Mamba2, Mamba1, lightning attention), MoEs
with the aux loss made global over cp and tp, Ulysses, gradient checkpointing, ``torch.compile``,
torch's ``clip_grad_norm_``, PEFT's LoRA and TRL's ``SFTTrainer``. Bytes per rank: no tp collective
moves more than this cp rank's rows, no cp collective more than this tp rank's heads. A length the two cuts do not both divide is refused with
the multiple to pad to. Negative control: the aux loss's counts summed over cp only."""

from __future__ import annotations

from typing import Any

import cpwork
import epwork
import models
import parity
import pytest
import trlwork
from dist import DistPool, pool_fixture

pool = pool_fixture(4, timeout=240)
ulysses = pool_fixture(4, timeout=180)


def _ready(p: DistPool, mode: str = "allgather") -> DistPool:
    return parity.once(p, cpwork.activate, 2, 2, mode, True)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize(("name", "kind"), [("llama_gqa", "plain"), ("llama_gqa", "padded"), ("qwen3_sliding", "packed"),
                                            # sinks; experts over tp (its plan splits no layer: sp cuts nothing)
                                            ("gpt_oss", "packed"),
                                            ("deepseek_v2", "padded"),  # MLA: the latent gathered over cp
                                            ("phi3", "packed"),  # attention run whole on tp (a fused qkv_proj)
                                            ("jamba", "packed"),  # Mamba1 on the cp rows, gathered over tp
                                            ("bamba", "padded"),  # Mamba2
                                            ("minimax", "padded")])  # lightning attention: its state over cp
def test_cp2_tp2_sp(pool: DistPool, root: str, name: str, kind: str) -> None:
    cpwork.check(_ready(pool), models.build(name, root), cpwork.batch(kind))


def test_attention_the_tp_plan_leaves_out_cp2_tp2_sp(pool: DistPool, root: str) -> None:
    """Kimi Linear's MLA attention carries cp's op alone (its TP plan names the MLPs only): under sp its
    contract gathers this cp rank's rows over tp and cuts its output back (it ran on the tp piece:
    refused as keys from outside the sequence); KDA beside it."""
    path, data = models.build("kimi_linear", root), cpwork.batch("padded")
    cpwork.check(_ready(pool), path, data, cpwork.chunking_floor(path, data))


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_qwen3_next_cp2_tp2_sp(pool: DistPool, root: str, kind: str) -> None:
    """Gated DeltaNet in a module the plan runs whole on tp; its padding mask is this cp rank's rows."""
    path, data = models.build("qwen3_next", root), cpwork.batch(kind)
    cpwork.check(_ready(pool), path, data, cpwork.chunking_floor(path, data))


def test_ulysses_cp2_tp2_sp(ulysses: DistPool, root: str) -> None:
    cpwork.check(_ready(ulysses, "ulysses"), models.build("llama", root), cpwork.batch("padded"))


def test_stock_clip_grad_norm_cp2_tp2_sp(pool: DistPool, root: str) -> None:
    """torch's ``clip_grad_norm_`` on the model's parameters (shards of tp, replicas of cp): one
    process's total norm on every rank."""
    path, data = models.build("llama_gqa", root), cpwork.batch("padded")
    want = cpwork.grad_norm(0, 1, path, data)
    for norm in _ready(pool).run(cpwork.grad_norm, path, data):
        assert abs(norm - want) <= parity.TOL * want, (norm, want)


LORA = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def test_peft_lora_cp2_tp2_sp(pool: DistPool, root: str) -> None:
    """PEFT's LoRA on projections tp cuts (colwise and rowwise): every adapter gradient and 3 steps
    are one process's."""
    pytest.importorskip("peft")
    path, data = models.build("llama_gqa", root), cpwork.batch("padded")
    got = _ready(pool).run(cpwork.lora_train, path, data, LORA)
    errors = parity.compare(got[0], cpwork.lora_train(0, 1, path, data, LORA))
    assert sum("lora_" in name for name in errors) >= 20, sorted(errors)
    for other in got[1:]:
        assert models.rel_err(other["loss"], got[0]["loss"]) <= parity.TOL


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_cp2_tp2_sp(pool: DistPool, root: str, reentrant: bool) -> None:
    path, data = models.build("qwen3_sliding", root), cpwork.batch("packed")
    ref = cpwork.checkpointed(0, 1, path, data, reentrant)
    got = _ready(pool).run(cpwork.checkpointed, path, data, reentrant)
    parity.compare(got[0], ref)


def _padded() -> dict[str, Any]:
    data = epwork.batch()
    mask = data["input_ids"].new_ones(data["input_ids"].shape)
    mask[1, -5:] = 0
    data["labels"][1, -5:] = -100
    return {**data, "attention_mask": mask}


def test_aux_loss_is_global_cp2_tp2_sp(pool: DistPool, root: str) -> None:
    """Experts over tp route each tp rank's piece of its cp rows: counts summed over cp and tp."""
    epwork.check_aux(_ready(pool), models.build("qwen3_moe", root), _padded())


def train_cp_counts(rank: int, world: int, path: str, data: dict) -> dict:
    """Negative control: the aux loss with its counts summed over cp only (cp's own install, as
    without sequence parallel): each tp rank's piece counted alone."""
    import importlib

    import hp_lazy
    from hp_lazy.runtime.cp.state import padding_rows
    from hp_lazy.runtime.ep import aux

    module = importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
    original = getattr(module.load_balancing_loss_func, "hp_original", module.load_balancing_loss_func)
    tp = hp_lazy.mesh().group("tp")
    local = aux.global_load_balancing(original, [hp_lazy.mesh().group("cp")], 1,
                                      lambda mask: aux.pieces(tp)(padding_rows(mask)), share=2)
    with parity.swapped(module, "load_balancing_loss_func", local):
        return epwork.train(rank, world, path, data, config=epwork.AUX)


def test_negative_control_aux_counts_over_cp_only(pool: DistPool, root: str) -> None:
    path = models.build("qwen3_moe", root)
    ref = epwork.reference(path, _padded(), config=epwork.AUX)
    got = _ready(pool).run(train_cp_counts, path, _padded())[0]
    assert models.rel_err(got["aux"], ref["aux"]) > 1e-4
    with pytest.raises(AssertionError, match=r"relative errors above .*'grad model.layers.\d.mlp.gate.weight'"):
        parity.compare(got, ref)


def test_sft_trainer_moe_cp2_tp2_sp(pool: DistPool, root: str, tmp_path) -> None:
    """TRL's ``SFTTrainer`` on an MoE (aux loss on): loss, grad norm, entropy, token accuracy and
    every parameter after 3 steps, against one process."""
    pytest.importorskip("trl")
    path = models.build("qwen3_moe", root)
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"))
    got = _ready(pool).run(trlwork.sft, path, str(tmp_path / "hp"))
    trlwork.compare(got[0], ref)
    for other in got[1:]:
        trlwork.compare(other, {k: v for k, v in ref.items() if k != "state"})


def traffic(rank: int, world: int, path: str, data: dict[str, Any]) -> dict[str, Any]:
    """Elements this rank puts into each all-gather and reduce-scatter torch runs, by group (tp or
    cp), counted at the torch functions hp_lazy calls (not hp_lazy's own counter)."""
    import hp_lazy
    from hp_lazy.runtime.comm import wire

    model = hp_lazy.parallelize(cpwork.load(path))
    groups = {hp_lazy.mesh().group(axis).pg: axis for axis in ("tp", "cp")}
    sizes: dict[str, list[int]] = {}
    real = wire._gather_single, wire._reduce_scatter_single

    def gather(out, x, group=None):
        sizes.setdefault(f"{groups.get(group, 'other')} all_gather", []).append(x.numel())
        return real[0](out, x, group=group)

    def reduce_scatter(out, x, group=None):
        sizes.setdefault(f"{groups.get(group, 'other')} reduce_scatter", []).append(x.numel())
        return real[1](out, x, group=group)

    wire._gather_single, wire._reduce_scatter_single = gather, reduce_scatter
    try:
        model(**data).loss.backward()
    finally:
        wire._gather_single, wire._reduce_scatter_single = real
    return sizes


def test_bytes_per_rank_cp2_tp2_sp(pool: DistPool, root: str) -> None:
    """Over tp each collective moves this cp rank's rows, ``S / cp`` (a gather: its ``1 / tp`` piece
    in; a reduce-scatter: the ``S / cp`` rows' partial sums in), never the sequence's; over cp, the
    K/V of this tp rank's heads only. Over tp per layer: the attention's and the MLP's gather and
    reduce-scatter each way; besides, the stack's exit gather and its entry's backward gather, and
    the vocab-sharded logits gathered once. Over cp per layer: K and V gathered together, forward
    and again in backward (the gathered K/V are not saved), their gradients reduce-scattered."""
    config = {**models.BASE, **models.CONFIGS["llama_gqa"][1]}
    b, s, h, layers = 2, 16, config["hidden_size"], config["num_hidden_layers"]
    head_dim = h // config["num_attention_heads"]
    rows = b * s // 2  # this cp rank's rows
    kv = 2 * b * (config["num_key_value_heads"] // 2) * (s // 2) * head_dim  # K and V: this tp rank's heads
    for sizes in _ready(pool).run(traffic, models.build("llama_gqa", root), cpwork.batch("plain")):
        assert sorted(sizes["tp all_gather"]) == [rows // 2 * h] * (4 * layers + 2) + [rows * config["vocab_size"] // 2]
        assert sizes["tp reduce_scatter"] == [rows * h] * 4 * layers
        assert sizes["cp all_gather"] == [kv] * 2 * layers
        assert sizes["cp reduce_scatter"] == [2 * kv] * layers


def test_sequence_length_names_both_cuts(pool: DistPool, root: str) -> None:
    """A length the zigzag chunks and the tp pieces do not both divide is refused on every rank at the entry."""
    data = {"input_ids": models.batch(seq=14), "labels": models.batch(seq=14)}
    for text in _ready(pool).run(cpwork.error, models.build("llama_gqa", root), data):
        assert text == (
            "ShardingError: LlamaForCausalLM: a sequence of 14 tokens under context parallel (cp=2): the zigzag layout "
            "cuts it into 2*cp = 4 equal chunks and sequence parallel each rank's S/cp rows into tp = 2 equal pieces; "
            "pad it to a multiple of 4 (16 tokens: pad ids with label -100 and attention_mask 0 at the padding; a "
            "data collator's pad_to_multiple_of=4 does it: transformers' DataCollatorWithPadding, TRL's SFTConfig / "
            "DPOConfig)")


def test_sequence_multiple_is_both_cuts_lcm() -> None:
    """cp=2 with tp=4 pieces: 12 tokens make 4 zigzag chunks but 6 rows a rank, which 4 pieces do not
    divide; the multiple is lcm(2 * cp, cp * tp) = 8. (The refusal comes before any collective: the
    group here names a size and a rank, and has no process group to call.)"""
    import torch

    from hp_lazy.errors import ShardingError
    from hp_lazy.runtime.cp.entry import ContextEntry
    from hp_lazy.runtime.mesh import Group

    entry = ContextEntry("LlamaForCausalLM", Group(axis="cp", pg=None, size=2, rank=0), pieces=4)
    ids = torch.zeros(1, 12, dtype=torch.long)
    with pytest.raises(ShardingError, match=r"tp = 4 equal pieces; pad it to a multiple of 8 \(16 tokens"):
        entry._split({"input_ids": ids}, use_cache=False)
    call, _, _ = entry._split({"input_ids": torch.zeros(1, 16, dtype=torch.long)}, use_cache=False)
    assert call["input_ids"].shape == (1, 8)


def test_compile_cp2_tp2_sp(pool: DistPool, root: str) -> None:
    """``model.compile()``: one process's numbers, and the only graph breaks are cp's own bookkeeping
    (its call state in a context variable, the entry's padding check): sequence parallel adds none."""
    results = cpwork.check(_ready(pool), models.build("llama_gqa", root), cpwork.batch("padded"), compile="eager")
    breaks = results[0]["graph_breaks"]
    assert breaks and all("ContextVar" in reason or "Tensor.item()" in reason for reason in breaks), breaks
