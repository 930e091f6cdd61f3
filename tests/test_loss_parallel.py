"""``Plan.auto(tp, loss_parallel=True)``: lm_head keeps its logits vocab-sharded and the loss is
computed from the shards (vocab-parallel cross-entropy); loss and every gradient still equal one
process's, and no rank ever holds the full logits. A call that computes no loss from them (no
labels: generation, a loss of the caller's) and the Trainer's predictions get them whole."""

from __future__ import annotations

import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)


def _train(rank: int, world: int, path: str, ids) -> dict:
    import hp_lazy

    model = parity._load(path)
    with hp_lazy.collective_counter() as counter:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    return {"logits": out.logits.detach(), "loss": out.loss.detach(), "grads": hp_lazy.full_grads(model),
            "forward": counter.by_phase("forward")}


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_vocab_parallel_loss_matches_one_process(name: str, pool2: DistPool, tmp_path) -> None:
    path = models.build(name, str(tmp_path))
    ref = models.reference(path, models.batch())
    parity.activated(pool2, loss_parallel=True)
    results = pool2.run(_train, path, models.batch())
    half = models.VOCAB // 2
    for rank, got in enumerate(results):
        assert got["logits"].shape[-1] == half
        assert models.rel_err(got["logits"], ref["logits"][..., rank * half : (rank + 1) * half]) <= parity.TOL
        assert models.rel_err(got["loss"], ref["loss"]) <= parity.TOL
        # no all-gather of logits: the loss needs two small all-reduces (max, sums) instead
        assert "all_gather" not in got["forward"]
    for pname, grad in ref["grads"].items():
        assert models.rel_err(results[0]["grads"][pname], grad) <= parity.TOL, pname


@pytest.fixture
def ready(pool2: DistPool, tmp_path) -> tuple[DistPool, str]:
    return parity.activated(pool2, loss_parallel=True), models.build("llama", str(tmp_path))


@pytest.mark.parametrize("whole", [False, True], ids=["no_labels", "whole_outputs"])
def test_a_call_without_labels_returns_whole_logits(ready, whole: bool) -> None:
    """No labels, no loss from the shards: the logits come back over the whole vocabulary (one
    all-gather of this rank's columns, the forward's only one), and a loss of the caller's from them
    trains as one process's. Inside ``hp_lazy.whole_outputs()`` likewise."""
    pool, path = ready
    ids = models.batch()
    ref = parity.whole_outputs_loss(0, 1, path, ids)
    got = pool.run(parity.whole_outputs_loss, path, ids, whole=whole)
    for result in got:
        parity.compare_whole(result, ref)
    assert [g["gathered"] for g in got] == [ids.numel() * models.VOCAB // 2 * 4] * 2


def _generate(rank: int, world: int, path: str, ids) -> list[list[int]]:
    model = parity._load(path)
    return model.generate(ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=6, do_sample=False,
                          pad_token_id=0).tolist()


def test_greedy_generation_is_one_process(ready) -> None:
    """``generate`` reads each step's last logits: whole, so both ranks pick one process's tokens
    (on a rank's half of the vocabulary they picked different ones, and the next step's inputs
    diverged)."""
    pool, path = ready
    ids = models.batch()[:, :4]
    ref = _generate(0, 1, path, ids)
    assert pool.run(_generate, path, ids) == [ref, ref]


def test_trainer_predictions(ready, tmp_path) -> None:
    """``compute_metrics`` and ``Trainer.predict`` see one process's logits, over the whole
    vocabulary (the Trainer's own ``prediction_step`` hands it rank 0's half: the negative control)."""
    import trainwork

    pool, path = ready
    ref = trainwork.predict(0, 1, path, str(tmp_path / "ref"))
    for got in pool.run(trainwork.predict, path, str(tmp_path / "hp")):
        trainwork.compare_predictions(got, ref)
    stock = pool.run(trainwork.predict, path, str(tmp_path / "stock"), stock=True)[0]
    assert list(stock["logits"].shape) == [6, 16, models.VOCAB // 2]


@pytest.mark.parametrize("option", [{"label_smoothing": 0.1}, {"loss_func": True}], ids=["label_smoothing", "compute_loss_func"])
def test_trainer_loss_from_the_logits(ready, tmp_path, option: dict) -> None:
    """Label smoothing and a ``compute_loss_func`` take the logits: 3 steps of one process's run."""
    import trainwork

    pool, path = ready
    ref = trainwork.trainer(0, 1, path, str(tmp_path / "ref"), **option)
    trainwork.compare_trainer(pool.run(trainwork.trainer, path, str(tmp_path / "hp"), **option)[0], ref)


def test_sft_trainer_predictions(ready, tmp_path) -> None:
    """TRL's ``SFTTrainer`` recomputes its predictions without labels: whole logits, one process's."""
    pytest.importorskip("trl")
    import trainwork
    import trlwork

    pool, path = ready
    ref = trlwork.sft_predict(0, 1, path, str(tmp_path / "ref"))
    for got in pool.run(trlwork.sft_predict, path, str(tmp_path / "hp")):
        trainwork.compare_predictions(got, ref)


def test_grpo_trainer(ready, tmp_path) -> None:
    """TRL's ``GRPOTrainer`` generates with ``model.generate``: its steps' logits come back whole, so
    both ranks sample one process's completions (before, each sampled from its half of the
    vocabulary and the next forward was refused as different inputs): every logged number and every
    parameter equal one process's."""
    pytest.importorskip("trl")
    import trlwork

    pool, path = ready
    ref = trlwork.online(0, 1, path, str(tmp_path / "ref"), trainer="GRPO")
    trlwork.compare_logged(pool.run(trlwork.online, path, str(tmp_path / "hp"), trainer="GRPO")[0], ref)
