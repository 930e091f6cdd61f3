"""TRL under context parallel (cp=2 at world 2, both ranks passing the same full batch): TRL's fused
LM head runs on each rank's zigzag rows (hp_lazy's entry splits the fused call and hands TRL
pre-shifted labels), its per-token outputs come back whole. ``SFTTrainer`` (plain, packing,
completion-only, label smoothing, a ``compute_loss_func``; packing on Kolibri 1.1's sparse attention;
its predictions) and the fused head in a user loop, against one process. GRPO, RLOO and DistillationTrainer, which generate, are refused by name."""

from __future__ import annotations

import cpwork
import models
import parity
import pytest
import trlwork
from dist import DistPool, WorkerError, pool_fixture

pytest.importorskip("trl")

pool2 = pool_fixture(2, timeout=240)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return models.build("llama", str(tmp_path_factory.mktemp("models")))


@pytest.fixture
def ready(pool2: DistPool, model_path: str):
    """Activated per test: a pool restarts its workers after a worker error."""
    return parity.once(pool2, cpwork.activate, 2, 1), model_path


@pytest.mark.parametrize("variant", [{}, {"packing": True}, {"completion_only": True},
                                     {"label_smoothing": 0.1}, {"loss_func": True}],  # the loss from the logits
                         ids=["plain", "packing", "completion_only", "label_smoothing", "compute_loss_func"])
def test_sft_trainer_under_cp(ready, tmp_path, variant: dict) -> None:
    pool, path = ready
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"), **variant)
    got = pool.run(trlwork.sft, path, str(tmp_path / "hp"), **variant)
    trlwork.compare(got[0], ref)
    trlwork.compare(got[1], {k: v for k, v in ref.items() if k != "state"})


def test_sft_trainer_packing_under_cp_with_a_selection_mask_indexer(ready, tmp_path) -> None:
    """Kolibri 1.1 (its indexer selects each row's keys over the whole sequence: hp_lazy hands it every
    rank's keys and the rows' mask) through SFTTrainer with packing: documents restart their positions
    inside a row, and the selection follows them."""
    pool, _ = ready
    path = models.build("kolibri1_1", str(tmp_path / "models"))
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"), packing=True)
    got = pool.run(trlwork.sft, path, str(tmp_path / "hp"), packing=True)
    trlwork.compare(got[0], ref)
    trlwork.compare(got[1], {k: v for k, v in ref.items() if k != "state"})


def test_sft_trainer_predictions_under_cp(ready, tmp_path) -> None:
    """``SFTTrainer``'s ``compute_metrics`` and ``predict``: one process's logits, the whole sequence
    (its ``prediction_step`` recomputes them without labels, outside the fused head)."""
    import trainwork

    pool, path = ready
    ref = trlwork.sft_predict(0, 1, path, str(tmp_path / "ref"))
    for got in pool.run(trlwork.sft_predict, path, str(tmp_path / "hp")):
        trainwork.compare_predictions(got, ref)


def test_fused_head_user_loop_under_cp(ready) -> None:
    """The fused call is the first forward; every per-token field whole and in sequence order."""
    pool, path = ready
    ids = models.batch()
    knobs = {"outputs": ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), "temperature": 0.7}
    ref = trlwork.fused_head(0, 1, path, ids, **knobs)
    got = pool.run(trlwork.fused_head, path, ids, **knobs)
    for name, value in ref["fields"].items():
        for rank in got:
            assert models.rel_err(rank["fields"][name], value) <= parity.TOL, name
    assert all(models.rel_err(rank["loss"], ref["loss"]) <= parity.TOL for rank in got)
    errors = {n: models.rel_err(got[0]["grads"][n], g) for n, g in ref["grads"].items()}
    assert max(errors.values()) <= parity.TOL, sorted(errors.items(), key=lambda e: -e[1])[:3]


def test_dpo_trainer_under_cp(ready, tmp_path) -> None:
    """DPO's chosen and rejected rows padded to a multiple of 2 * cp by TRL's collator."""
    pool, path = ready
    ref = trlwork.dpo(0, 1, path, str(tmp_path / "ref"), pad_to=4)
    trlwork.compare_logged(pool.run(trlwork.dpo, path, str(tmp_path / "hp"), pad_to=4)[0], ref)


def test_an_unpadded_length_is_refused_naming_the_collator_option(ready, tmp_path) -> None:
    pool, path = ready
    with pytest.raises(WorkerError, match=r"a sequence of 18 tokens under context parallel \(cp=2\): the zigzag layout "
                                          r"cuts it into 2\*cp = 4 equal chunks; pad it to a multiple of 4 .* "
                                          r"pad_to_multiple_of=4 does it"):
        pool.run(trlwork.dpo, path, str(tmp_path / "hp"))


@pytest.mark.parametrize("trainer", ["GRPO", "RLOO", "Distillation"])
def test_generating_trainers_are_refused(trainer: str, ready, tmp_path) -> None:
    """They generate with model.generate, which cp cannot split: refused when the trainer is built."""
    pool, path = ready
    with pytest.raises(WorkerError, match=rf"{trainer}Trainer: hp_lazy splits this model's sequence over cp=2, but "
                                          rf"{trainer}Trainer generates its completions with model.generate, which "
                                          r"appends one token at a time .* activate a plan without cp"):
        if trainer == "Distillation":  # the model its own teacher
            pool.run(trlwork.distill, path, path, str(tmp_path / "hp"))
        else:
            pool.run(trlwork.online, path, str(tmp_path / "hp"), trainer)
