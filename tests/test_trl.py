"""TRL at tp=2 (world 2), against one process: ``SFTTrainer`` (packing off and on,
``completion_only_loss``) — logged loss, grad norm, entropy and token accuracy per step and every
parameter after 3 steps — and TRL's fused LM head in a user loop (every per-token field and every
gradient, with temperature, logit scale and softcapping), with the bytes its collectives move;
``DPOTrainer``; ``RewardTrainer`` on a sequence classifier with a new head each rank drew.
Negative control: TRL's own kernel on the vocab shard is silently wrong."""

from __future__ import annotations

import math

import models
import parity
import pytest
import trlwork
from dist import DistPool, pool_fixture

pytest.importorskip("trl")

pool2 = pool_fixture(2, timeout=240)


@pytest.fixture
def pool(pool2: DistPool) -> DistPool:
    return parity.activated(pool2, tp=2)


@pytest.mark.parametrize("variant", [{}, {"packing": True}, {"completion_only": True}],
                         ids=["plain", "packing", "completion_only"])
def test_sft_trainer(pool: DistPool, refs, tmp_path, variant: dict) -> None:
    path, _ = refs("llama")
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"), **variant)
    assert ref["loss"][0] > math.log(models.VOCAB) - 0.1  # a softmax over the whole vocabulary
    got = pool.run(trlwork.sft, path, str(tmp_path / "hp"), **variant)
    trlwork.compare(got[0], ref)
    trlwork.compare(got[1], {k: v for k, v in ref.items() if k != "state"})


def test_sft_trainer_adamw(pool: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama")
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"), optim="adamw_torch")
    trlwork.compare(pool.run(trlwork.sft, path, str(tmp_path / "hp"), optim="adamw_torch")[0], ref, tol=1e-4)


def test_stock_kernel_on_the_shard_is_wrong(pool: DistPool, refs, tmp_path) -> None:
    """Negative control: without hp_lazy's dispatcher, TRL takes a softmax over V/2 words."""
    path, _ = refs("llama")
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"))
    got = pool.run(trlwork.stock_sft, path, str(tmp_path / "stock"))
    assert abs(float(got[0]["loss"][0]) - math.log(models.VOCAB / 2)) < 0.15
    with pytest.raises(AssertionError, match="relative errors above"):
        trlwork.compare(got[0], ref)


@pytest.mark.parametrize("knobs", [
    {"outputs": ("entropy", "is_top1")},
    {"outputs": ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), "temperature": 0.7, "softcap": 3.0,
     "scale": 1.5},
], ids=["sft-fields", "every-field-scaled"])
def test_fused_head_user_loop(pool: DistPool, refs, knobs: dict) -> None:
    """The fused call is the model's first forward (its backbone binds the whole model)."""
    path, _ = refs("llama")
    ids = models.batch()
    ref = trlwork.fused_head(0, 1, path, ids, **knobs)
    got = pool.run(trlwork.fused_head, path, ids, **knobs)
    for name, value in ref["fields"].items():
        for rank in got:
            assert models.rel_err(rank["fields"][name], value) <= parity.TOL, name
    errors = {n: models.rel_err(got[0]["grads"][n], g) for n, g in ref["grads"].items()}
    assert max(errors.values()) <= parity.TOL, sorted(errors.items(), key=lambda e: -e[1])[:3]


def test_fused_head_bytes(pool: DistPool, refs) -> None:
    """The head adds two all-reduces of [2, N] and [5, N] fp32 in forward and one of [N, H] (the
    hidden gradient) in backward: no weight moves."""
    path, _ = refs("llama")
    ids = models.batch()  # [2, 16]: N = 2 * 15 scored positions
    n, hidden = ids.shape[0] * (ids.shape[1] - 1), 32
    for rank in pool.run(trlwork.counted_fused_head, path, ids):
        extra = {k: rank["whole"].get(k, 0) - rank["backbone"].get(k, 0) for k in rank["whole"]}
        assert extra[("all_reduce", "forward")] == 7 * n * 4
        assert extra[("all_reduce", "backward")] == n * hidden * 4
        assert all(v == 0 for k, v in extra.items() if k[0] != "all_reduce")


def test_dpo_trainer(pool: DistPool, refs, tmp_path) -> None:
    """DPOTrainer (the reference model loaded by TRL from the checkpoint, bound too): every logged
    number (rewards, log-probs, the fused head's mean logits) and every parameter after 2 steps."""
    path, _ = refs("llama")
    ref = trlwork.dpo(0, 1, path, str(tmp_path / "ref"))
    assert float(ref["rewards/accuracies"][-1]) > 0  # the second step sees the first's update
    trlwork.compare_logged(pool.run(trlwork.dpo, path, str(tmp_path / "hp"))[0], ref)


def test_reward_trainer_with_a_head_each_rank_drew(pool: DistPool, refs, tmp_path) -> None:
    """``RewardTrainer`` on a sequence classifier whose one-label ``score`` head is new, drawn with
    another seed on every rank (hp_lazy makes it rank 0's at bind, as DDP would): every logged number
    and every parameter after 3 steps equal one process that drew rank 0's head. Rewards (~0.05)
    and their margins, differences of them, are compared on the rewards' scale."""
    path, _ = refs("llama")
    ref = trlwork.reward(0, 1, path, str(tmp_path / "ref"))
    got = pool.run(trlwork.reward, path, str(tmp_path / "hp"))[0]
    scale = max(float(ref[k].abs().max()) for k in ("max_reward", "min_reward"))
    errors = {k: float((got[k] - v).abs().max()) / scale if "reward" in k or k == "margin" else models.rel_err(got[k], v)
              for k, v in ref.items() if k != "state"}
    errors.update({f"param {n}": models.rel_err(got["state"][n], v) for n, v in ref["state"].items()})
    assert {"loss", "accuracy", "margin", "param score.weight"} <= set(errors)
    bad = {k: v for k, v in errors.items() if not v <= parity.TOL}
    assert not bad, bad


def _trl_then_activate(rank: int, world: int) -> None:
    import trl.trainer.sft_trainer  # noqa: F401  (it binds add_fused_lm_head before hp_lazy is active)

    import hp_lazy

    hp_lazy.activate(hp_lazy.Plan.auto(tp=2))


def test_sft_trainer_with_trl_imported_before_activate(pool2: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama")
    pool2.close()  # fresh workers: TRL first, then activate
    parity.once(pool2, _trl_then_activate)
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"))
    trlwork.compare(pool2.run(trlwork.sft, path, str(tmp_path / "hp"))[0], ref)
