"""Token mixers outside the tp boundaries under sequence parallel (:mod:`hp_lazy.runtime.sp.mixers`):
a hybrid's recurrent layers (Bamba's Mamba2, Jamba's Mamba1, LFM3's short convolution) and an
attention module the plan leaves out (T5Gemma's cross-attention), which transformers' TP plans
leave whole, run on the whole sequence (gathered in, cut out) while the attention and MLP
boundaries around them keep the sequence split. One process's loss, logits, every
gradient and 3 SGD+wd steps at tp=2 and 4; the collectives that costs; without it the numbers are
silently wrong (negative control); a layer kind with no mixer hp_lazy can find is refused by name.
MiniMax's lightning attention instead runs on each rank's piece with the state of the pieces before
carried in: the same numbers, one all-gather of its ``[B, H, D, D]`` state per layer (none of the
hidden states), the cache of a prefill holding the whole sequence's state, and pieces from a zero
state as the negative control.

Modules the plan itself runs on the whole sequence, because they hold a per-Linear gather or split
(Phi-3's fused ``qkv_proj``, Qwen3-Next's Gated DeltaNet projections: :mod:`hp_lazy.plan.auto.sp`):
the same numbers, the bytes per rank of their own collectives, and their unsharded parameters'
whole gradients left out of the stack's partial sums (negative control)."""

from __future__ import annotations

from typing import Any

import models
import parity
import pytest
from dist import DistPool, WorkerError, pool_fixture

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


def _pool(world: int, pool2: DistPool, pool4: DistPool) -> DistPool:
    return parity.activated(pool2 if world == 2 else pool4, sequence_parallel=True)


@pytest.mark.parametrize(("name", "world"), [("bamba", 2), ("bamba", 4), ("jamba", 2), ("lfm3", 2), ("minimax", 2),
                                            ("minimax", 4)])
def test_recurrent_layers_match_one_process(name: str, world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    errors = parity.check_parity(_pool(world, pool2, pool4), refs, name)
    assert len(errors) > 10 and max(errors.values()) <= parity.TOL


def test_unplanned_cross_attention_matches_one_process(refs, pool2: DistPool, pool4: DistPool) -> None:
    """T5Gemma's TP plan covers self-attention and MLPs; its decoder's cross-attention runs whole.
    On this rank's decoder tokens only, the encoder states' gradient it returns would be this
    rank's part, which the encoder then reads as whole (the encoder's gradients 59% off)."""
    path, ref = refs("t5gemma")
    results = _pool(2, pool2, pool4).run(parity.train_loaded, path, models.batch())
    assert len(parity.compare(results[0], ref)) > 10


def test_collectives_of_a_mamba_layer(refs, pool2: DistPool, pool4: DistPool) -> None:
    """Bamba (layer 0 Mamba2, layer 1 attention; an MLP boundary in each): forward an all-gather
    into every boundary, one into the Mamba2 mixer, one at the stack's exit and the logits'; a
    reduce-scatter out of every boundary; the mixer's exit only cuts (backward: its all-gather)."""
    path, _ = refs("bamba")
    counts = _pool(2, pool2, pool4).run(parity.count_bytes, path, models.batch())
    boundaries = 3
    assert counts[0]["forward"] == {"all_gather": boundaries + 3, "all_reduce": 1, "reduce_scatter": boundaries}
    assert counts[0]["backward"]["all_gather"] == boundaries + 2  # the reduce-scatters', the exit's, the mixer's


def test_mixers_on_this_rank_piece_fail_parity(refs, pool2: DistPool, pool4: DistPool) -> None:
    """Negative control: the Mamba2 layer left on each rank's piece of the sequence."""
    path, ref = refs("bamba")
    got = _pool(2, pool2, pool4).run(parity.train_without_mixers, path, models.batch())[0]
    assert models.rel_err(got["logits"], ref["logits"]) > 1e-2  # measured 1.75e-1


def test_a_layer_kind_with_no_mixer_found_is_refused(refs, pool2: DistPool, pool4: DistPool) -> None:
    """A 'linear_attention' layer that calls neither transformers' attention nor a recurrent kernel
    hp_lazy knows, and is no lightning attention it recognises (MiniMax's, with
    :func:`hp_lazy.runtime.cp.lightning.supports` off)."""
    path, _ = refs("minimax")
    with pytest.raises(WorkerError) as info:
        _pool(2, pool2, pool4).run(train_unrecognised, path, models.batch())
    assert ("ShardingError: model.layers.0 (MiniMaxForCausalLM): layer 0 is a 'linear_attention' layer, which mixes "
            "tokens along the sequence; sequence parallel splits the sequence between the tp boundaries, and hp_lazy "
            "finds no module of this layer it can run on the whole sequence") in str(info.value)


@pytest.mark.parametrize("world", [2, 4])
def test_lightning_layer_moves_its_state_not_the_sequence(world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    """MiniMax's lightning attention runs on this rank's piece: per layer and rank one all-gather of
    the piece's ``[B, H, D, D]`` state (float32), none of the ``[B, S, H]`` hidden states."""
    b, heads, dim = 2, 4, 8
    for mine in _pool(world, pool2, pool4).run(parity.module_collectives, refs("minimax")[0], "layers.0.self_attn"):
        assert mine == {"model.layers.0.self_attn": {"all_gather": (1, b * heads * dim * dim * 4)}}, mine


def _train_without_carry(rank: int, world: int, path: str, ids) -> dict:
    """Negative control: each tp rank's piece of a lightning layer from a zero state."""
    from hp_lazy.runtime.cp import lightning

    with parity.no_carry(lightning):
        return parity.train(rank, world, path, ids)


def test_lightning_pieces_without_the_state_fail_parity(refs, pool2: DistPool, pool4: DistPool) -> None:
    path, ref = refs("minimax")
    got = _pool(2, pool2, pool4).run(_train_without_carry, path, models.batch())[0]
    assert models.rel_err(got["logits"], ref["logits"]) > 1e-2


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_lightning_under_gradient_checkpointing(reentrant: bool, refs, pool2: DistPool, pool4: DistPool) -> None:
    """Each layer recomputed in backward, after the stack's forward has ended: the lightning layer
    still runs on its piece with the state carried (its all-gather again inside the recompute)."""
    import cpwork

    path, _ = refs("minimax")
    data = {"input_ids": models.batch(), "labels": models.batch()}
    ref = cpwork.checkpointed(0, 1, path, data, reentrant)
    got = _pool(2, pool2, pool4).run(cpwork.checkpointed, path, data, reentrant)
    parity.compare(got[0], ref)


def lightning_cache(rank: int, world: int, path: str, ids) -> Any:
    """The lightning state a forward with ``use_cache=True`` leaves in the cache (layer 0)."""
    import torch

    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path)) if world > 1 else parity._load(path)
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True).past_key_values.get_linear_cache(0)


def test_lightning_cache_holds_the_whole_sequences_state(refs, pool2: DistPool, pool4: DistPool) -> None:
    """A prefill with ``use_cache=True``: the cache keeps the state after the last token, composed
    over every rank's piece (the forward alone would store this rank's piece's)."""
    path, _ = refs("minimax")
    ref = lightning_cache(0, 1, path, models.batch())
    for got in _pool(2, pool2, pool4).run(lightning_cache, path, models.batch()):
        assert models.rel_err(got, ref) <= parity.TOL


def train_unrecognised(rank: int, world: int, path: str, ids) -> dict:
    """:func:`parity.train` with no lightning attention recognised."""
    from hp_lazy.runtime.cp import lightning

    with parity.swapped(lightning, "supports", lambda module: False):
        return parity.train(rank, world, path, ids)


@pytest.mark.parametrize(("name", "world"), [("phi3", 2), ("phi3", 4), ("qwen3_next", 2), ("qwen3_next", 4)])
def test_modules_holding_per_linear_leaves_match_one_process(name: str, world: int, refs, pool2: DistPool,
                                                              pool4: DistPool) -> None:
    errors = parity.check_parity(_pool(world, pool2, pool4), refs, name)
    assert len(errors) > 10 and max(errors.values()) <= parity.TOL


@pytest.mark.parametrize("world", [2, 4])
def test_leaves_inside_a_token_mixer_run_whole_with_it(world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    """Qwen4-Exp (transformers 5.25): its plan cuts an n-gram embedding table inside a block whose
    dilated convolution and n-gram shifts run along the sequence, and an indexer projection inside
    its attention; its hyper-connection blocks hold a split projection and return three values along
    the sequence. Each block runs on the whole sequence (refused at bind before: the convolution on
    this rank's piece) and each value it returns leaves as this rank's piece. One process's numbers,
    the Gated DeltaNet's near-cancelling gradients within twice one process's own float32 floor."""
    models.skip_unless_released("qwen4_exp")
    path, ref = refs("qwen4_exp")
    floor = parity.float64_floor(path, ref, experts_implementation="eager")
    results = _pool(world, pool2, pool4).run(parity.train, path, models.batch())
    errors = parity.compare(results[0], ref, floor)
    assert len(errors) > 40 and all(errors[name] <= parity.TOL for name in ("logits", "loss", "losses"))


@pytest.mark.parametrize(("name", "world"), [("qwen3_next", 2), ("qwen3_next", 4), ("bamba", 2)])
def test_hybrids_with_a_padded_batch(name: str, world: int, root: str, pool2: DistPool, pool4: DistPool) -> None:
    """A padding mask beside a mixer run whole: each layer calls its attention or its recurrent mixer,
    and the call its kind never takes (``self.self_attn(...)`` in a linear-attention layer, which has
    no ``self_attn``) reads nothing on this rank's tokens, so the mask stays whole for the mixer
    (it was cut to the rank's piece: a shape error)."""
    import cpwork

    path, data = models.build(name, root), cpwork.batch("padded")
    floor = cpwork.chunking_floor(path, data) if name == "qwen3_next" else None
    cpwork.check(_pool(world, pool2, pool4), path, data, floor)


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_of_a_module_run_whole(world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    """Per rank and layer: the sequence gathered once on the way in, each gathered projection's
    features as under tp alone, and the projection the module returns hands over this rank's piece
    itself: Phi-3's rowwise o_proj a reduce-scatter (no all-reduce), Qwen3-Next's colwise out_proj
    an all-to-all of [B, S, V / tp] (no all-gather of [B, S, V])."""
    pool = _pool(world, pool2, pool4)
    b, s, h, f = 2, 16, models.BASE["hidden_size"], 4  # float32
    qkv = (4 + 2 * 4) * 8  # 4 query and 4 K/V heads of 8
    want = {"all_gather": (2, b * s // world * h * f + b * s * qkv // world * f),
            "reduce_scatter": (1, b * s * h * f)}
    for mine in pool.run(parity.module_collectives, refs("phi3")[0], "self_attn"):
        assert mine == {f"model.layers.{i}.self_attn": want for i in range(2)}, mine
    qkvz, ba, value = 2 * 16 + 2 * 32, 2 * 4, 4 * 8  # 2 key heads and 4 value heads of 8
    want = {"all_gather": (3, b * s // world * h * f + b * s * (qkvz + ba) // world * f),
            "all_to_all": (1, b * s * value // world * f * (world - 1) // world)}
    for mine in pool.run(parity.module_collectives, refs("qwen3_next")[0], "linear_attn"):
        assert mine == {"model.layers.0.linear_attn": want}, mine


def _train_summing_whole_modules(rank: int, world: int, path: str, ids) -> dict:
    """Negative control: the parameters of a module run whole summed over tp like the norms."""
    from hp_lazy.runtime.sp import mixers

    original = mixers.planned_whole
    mixers.planned_whole = lambda ctx: None
    try:
        return parity.train(rank, world, path, ids)
    finally:
        mixers.planned_whole = original


def test_whole_gradients_summed_over_tp_fail_parity(refs, pool2: DistPool, pool4: DistPool) -> None:
    path, ref = refs("qwen3_next")
    got = _pool(2, pool2, pool4).run(_train_summing_whole_modules, path, models.batch())[0]
    errors = parity.relative_errors(got, ref)
    assert errors["grad model.layers.0.linear_attn.A_log"] > 0.5  # twice the gradient: measured 1.0
