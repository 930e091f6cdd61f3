"""Experts under sequence parallel (``Plan.auto(tp=N, sequence_parallel=True)`` on an MoE family):
between the boundaries each tp rank holds its piece of the sequence, so the experts (split by
expert over tp) gather every rank's rows with their top-k ids and weights, run their own experts
on all of them, and reduce-scatter the partial sums back to the rows each rank holds. One
process's loss, logits, routing, every gradient and 3 SGD+wd steps; the load-balancing aux loss
global over the tp ranks' pieces (padding masked); the bytes each rank moves per MoE layer."""

from __future__ import annotations

import epwork
import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)


@pytest.fixture(scope="module")
def sp2(pool2: DistPool, tmp_path_factory):
    return parity.once(pool2, parity.activate, 2, {"sequence_parallel": True}), str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def sp4(pool4: DistPool, tmp_path_factory):
    return parity.once(pool4, parity.activate, 4, {"sequence_parallel": True}), str(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize(("name", "impl"), [("qwen3_moe8", "grouped_mm"), ("qwen2_moe", "eager"),
                                            ("glm4_moe_lite", "grouped_mm")])
def test_tp2_matches_one_process(sp2, name: str, impl: str) -> None:
    """Qwen3-MoE (grouped_mm), Qwen2-MoE (a shared expert and its gate beside the experts: a
    boundary of their own and a replicated Linear on this rank's tokens), GLM-4-MoE-Lite (MLA
    heads, sigmoid routing with a correction bias, a dense first layer)."""
    pool, root = sp2
    epwork.check(pool, models.build(name, root), impl, sequence=True)


def test_tp4_matches_one_process(sp4) -> None:
    pool, root = sp4
    epwork.check(pool, models.build("qwen3_moe8", root), sequence=True)


def _padded() -> dict:
    data = epwork.batch()
    mask = data["input_ids"].new_ones(data["input_ids"].shape)
    mask[1, -5:] = 0  # row 1 padded at the end: its last 5 tokens, all in the last tp rank's piece
    data["labels"][1, -5:] = -100
    return {**data, "attention_mask": mask}


@pytest.mark.parametrize("padded", [False, True])
def test_aux_loss_is_global(sp2, padded: bool) -> None:
    """output_router_logits=True: the aux loss over every token of the batch (padding masked out),
    its value in out.aux_loss and out.loss on every rank, its gradient one process's."""
    pool, root = sp2
    data = _padded() if padded else epwork.batch()
    epwork.check_aux(pool, models.build("qwen3_moe8", root), data, sequence=True)


def test_local_aux_loss_fails_parity(sp2) -> None:
    """Negative control: transformers' aux loss on each rank's own piece of the sequence."""
    pool, root = sp2
    got, ref = epwork.local_aux(pool, models.build("qwen3_moe8", root), epwork.batch(), sequence=True)
    assert models.rel_err(got["aux"], ref["aux"]) > 1e-4  # measured 7.3e-4: rank 0 routes its half of the tokens
    with pytest.raises(AssertionError, match=r"relative errors above .*'grad model.layers.1.mlp.gate.weight'"):
        parity.compare(got, ref)


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_moe_layer(sp2, sp4, world: int) -> None:
    """Per MoE layer and rank, forward: one all-gather each of this rank's ``T/W`` rows of ``H``
    floats, their top-k ids (int64) and weights, and one reduce-scatter of the ``[T, H]`` partial
    sums: the rows cross once each way, as a dense MLP's under sequence parallel; no all-reduce
    or all-to-all. Counted between the experts module's own forward hooks."""
    pool, root = sp2 if world == 2 else sp4
    got = pool.run(epwork.experts_collectives, models.build("qwen3_moe8", root))
    rows, hidden, k = 2 * 16 // world, models.BASE["hidden_size"], 2
    want = {"all_gather": (3, rows * (hidden * 4 + k * 8 + k * 4)), "reduce_scatter": (1, world * rows * hidden * 4)}
    for mine in got:
        assert sorted(mine) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert all(ops == want for ops in mine.values()), mine
