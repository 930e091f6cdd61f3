"""runtime/cp/lightning: MiniMax's lightning attention under context parallel. One layer on this
rank's zigzag rows, the state of the chunks before carried in, against one call over the whole
sequence (outputs and every input's and parameter's gradient, float64, at world 1, 2 and 4; block
sizes that divide the chunks and that do not), with the bytes gathered per layer independent of
the sequence length; and MiniMax (lightning + full attention + MoE) against one process: plain,
padded and packed batches at cp=2 and cp=4, Ulysses, gradient checkpointing, compile, PEFT's LoRA
on the lightning projections and TRL's ``SFTTrainer`` with packing. Negative control: the chunks
without the carried state."""

from __future__ import annotations

from typing import Any

import cpwork
import models
import parity
import pytest
import trlwork
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=240)
pool4 = pool_fixture(4, timeout=180)

BATCH, HEADS, HEAD_DIM = 2, 4, 8


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


def _ready(pool: DistPool, cp: int, mode: str = "allgather") -> DistPool:
    return parity.once(pool, cpwork.activate, cp, 1, mode)


def lightning_layer(rank: int, world: int, seq: int, block_size: int, padded: bool = False) -> dict[str, Any]:
    """One ``MiniMaxLightningAttention`` (float64) on this rank's zigzag rows through
    :func:`hp_lazy.runtime.cp.lightning.wrap` (a deep copy of the split module) against one call
    over the whole sequence (each rank computes that too): output rows, the input's and every
    parameter's gradient (summed over the ranks) and the bytes gathered."""
    import copy

    import torch
    import transformers
    from transformers.models.minimax import modeling_minimax

    import hp_lazy
    from hp_lazy.runtime.cp import lightning, state
    from hp_lazy.runtime.cp.zigzag import zigzag
    from hp_lazy.runtime.mesh import Group

    config = transformers.MiniMaxConfig(hidden_size=32, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                                        num_hidden_layers=2, block_size=block_size,
                                        layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    whole = modeling_minimax.MiniMaxLightningAttention(config, 0).double()
    split = copy.deepcopy(whole)
    lightning.wrap(split)  # the class's forward wrapped (whole's calls through), split's hooks in place
    mine = copy.deepcopy(split)  # a copy made after: its own hooks and parameters (a closure would reach split's)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, seq, 32, generator=gen, dtype=torch.float64)
    dout = torch.randn(BATCH, seq, 32, generator=gen, dtype=torch.float64)
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    mask[1, -5:] = 0
    mask = mask if padded else None
    x_whole = x.clone().requires_grad_()
    ref, _ = whole(x_whole, None, mask)
    ref.backward(dout)
    group = hp_lazy.mesh().group("cp") if world > 1 else Group.solo("cp")
    zig = zigzag(seq, world, rank, x.device)
    x_mine = x.index_select(1, zig.local).clone().requires_grad_()
    call = state.CallState(group=group, zig=zig, mode="cp_allgather_kv", positions=torch.arange(seq)[None],
                           docs=None, key_padding=None if mask is None else mask.bool())
    token = state.enter(call)
    try:
        with hp_lazy.collective_counter() as counter:
            out, _ = mine(x_mine, None, None if mask is None else mask.index_select(1, zig.local))
            out.backward(dout.index_select(1, zig.local))
    finally:
        state.leave(token)
    errors = {"out": models.rel_err(out.detach(), ref.detach().index_select(1, zig.local))}
    full = torch.zeros_like(x)
    full.index_copy_(1, zig.local, x_mine.grad)
    errors["grad input"] = models.rel_err(cpwork.gather_sequence_sum(full, world), x_whole.grad)
    for (name, got), want in zip(mine.named_parameters(), whole.parameters(), strict=True):
        errors[f"grad {name}"] = models.rel_err(cpwork.gather_sequence_sum(got.grad, world), want.grad)
    return {"errors": errors, "gathered": counter.bytes_of("all_gather")}


def test_two_chunks_at_world_1() -> None:
    """Zigzag at world 1: two chunks of 8, blocks of 4 (aligned) and 3 (a block across the cut)."""
    for block in (4, 3):
        got = lightning_layer(0, 1, 16, block)
        assert max(got["errors"].values()) <= parity.TOL, (block, got)
    assert len(got["errors"]) == 2 + 4  # output, input, qkv_proj / out_proj / output_gate / norm


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
@pytest.mark.parametrize(("world", "block"), [(2, 4), (2, 3), (4, 4), (4, 3)])
def test_state_passed_between_ranks(pool2: DistPool, pool4: DistPool, world: int, block: int, padded: bool) -> None:
    pool = _ready(pool2 if world == 2 else pool4, world)
    for got in pool.run(lightning_layer, 16, block, padded):
        assert max(got["errors"].values()) <= parity.TOL, got


def test_bytes_per_layer_do_not_grow_with_the_sequence(pool2: DistPool) -> None:
    pool = _ready(pool2, 2)
    short, long = (pool.run(lightning_layer, seq, 4)[0]["gathered"] for seq in (16, 64))
    # forward: the F of this rank's 2 chunks, [2, B, H, D, D] float64 (backward reduce-scatters)
    assert short == long == 2 * BATCH * HEADS * HEAD_DIM * HEAD_DIM * 8


def test_negative_control_chunks_without_the_state_are_wrong(pool2: DistPool) -> None:
    results = _ready(pool2, 2).run(lightning_layer_without_carry, 16, 4)
    assert all(got["errors"]["out"] > 1e-2 for got in results), results  # both ranks' tail chunks


def lightning_layer_without_carry(rank: int, world: int, seq: int, block: int) -> dict[str, Any]:
    """:func:`lightning_layer` with the carried state zeroed: every chunk starts from zeros."""
    from hp_lazy.runtime.cp import lightning

    with parity.no_carry(lightning):
        return lightning_layer(rank, world, seq, block)


@pytest.mark.parametrize("kind", ["plain", "padded", "packed"])
def test_minimax_cp2(pool2: DistPool, root: str, kind: str) -> None:
    cpwork.check(_ready(pool2, 2), models.build("minimax", root), cpwork.batch(kind))


@pytest.mark.parametrize(("name", "kind"), [("minimax", "plain"), ("minimax", "packed"),
                                            ("minimax_blocks3", "padded")])
def test_minimax_cp4(pool4: DistPool, root: str, name: str, kind: str) -> None:
    """Chunks of 2 tokens: the state passes through 3 chunks before the last; blocks of 3 (two
    lightning layers) straddle every chunk boundary."""
    cpwork.check(_ready(pool4, 4), models.build(name, root), cpwork.batch(kind))


def test_minimax_blocks_across_chunks_cp2(pool2: DistPool, root: str) -> None:
    cpwork.check(_ready(pool2, 2), models.build("minimax_blocks3", root), cpwork.batch("packed"))


def test_minimax_ulysses_cp2(pool2: DistPool, root: str) -> None:
    cpwork.check(_ready(pool2, 2, "ulysses"), models.build("minimax", root), cpwork.batch("padded"))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_minimax_gradient_checkpointing(pool2: DistPool, root: str, reentrant: bool) -> None:
    """Each layer recomputed in backward, its state all-gathered again inside the recompute."""
    path, data = models.build("minimax", root), cpwork.batch("padded")
    ref = cpwork.checkpointed(0, 1, path, data, reentrant)
    got = _ready(pool2, 2).run(cpwork.checkpointed, path, data, reentrant)
    parity.compare(got[0], ref)
    assert models.rel_err(got[1]["loss"], ref["loss"]) <= parity.TOL


def test_minimax_sft_trainer_with_packing(pool2: DistPool, root: str, tmp_path) -> None:
    """TRL's ``SFTTrainer`` packing documents into each row, 3 SGD steps: the lightning state runs
    across documents in one process too (transformers' lightning attention takes no document ids)."""
    pytest.importorskip("trl")
    path = models.build("minimax", root)
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"), packing=True)
    got = _ready(pool2, 2).run(trlwork.sft, path, str(tmp_path / "hp"), packing=True)
    trlwork.compare(got[0], ref)
    trlwork.compare(got[1], {k: v for k, v in ref.items() if k != "state"})


def test_minimax_compiled(pool2: DistPool, root: str) -> None:
    """``model.compile()`` at cp=2: one process's numbers, and the only graph breaks are cp's own
    bookkeeping (its call state in a context variable, the entry's padding check); the split adds
    none (its hooks stay registered; the running call is kept in a list dynamo traces)."""
    results = cpwork.check(_ready(pool2, 2), models.build("minimax", root), cpwork.batch("padded"), compile="eager")
    breaks = results[0]["graph_breaks"]
    assert breaks and all("ContextVar" in reason or "Tensor.item()" in reason for reason in breaks), breaks


LORA = ["qkv_proj", "output_gate", "out_proj", "q_proj", "o_proj"]


def test_minimax_lora_cp2(pool2: DistPool, root: str) -> None:
    """PEFT's LoRA on the lightning layer's ``qkv_proj`` (whose activated output the split reads),
    ``output_gate`` and ``out_proj``: every adapter gradient and 3 steps are one process's."""
    pytest.importorskip("peft")
    path, data = models.build("minimax", root), cpwork.batch("padded")
    got = _ready(pool2, 2).run(cpwork.lora_train, path, data, LORA)
    errors = parity.compare(got[0], cpwork.lora_train(0, 1, path, data, LORA))
    assert sum("lora_" in name for name in errors) >= 10, sorted(errors)
