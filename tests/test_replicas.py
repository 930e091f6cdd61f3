"""Parameters every rank holds whole start alike (``hp_lazy.runtime.replicas``): a sequence
classifier's new ``score`` head, drawn at random with each rank's own seed (as torchrun's
processes are), trained by the stock Trainer at dp=2 x tp=2 against one process that drew rank
0's head. Without the check each rank trains its own head (the negative control)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import models
import parity
import pytest
import trainwork
from dist import DistPool, pool_fixture

pool4 = pool_fixture(4, timeout=240)
LABELS = 3


@pytest.fixture
def pool(pool4: DistPool) -> DistPool:
    return parity.activated(pool4, tp=2)


class Rows(trainwork.Rows):
    """Rows labelled with one of :data:`LABELS` classes."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": int(self.ids[i][0]) % LABELS}


def classifier(rank: int, world: int, path: str, out: str, check: bool = True) -> dict[str, Any]:
    """``AutoModelForSequenceClassification.from_pretrained`` (its ``score`` head new, drawn with
    seed 0 on rank 0 and another seed on every other rank), the stock Trainer for 3 SGD steps:
    the logged losses, the head each rank started from, rank 0 the final parameters, and what
    hp_lazy warned. ``check=False``: the ranks' heads left as drawn (the negative control)."""
    import torch
    from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

    import hp_lazy
    from hp_lazy.runtime import replicas

    torch.manual_seed(0 if rank == 0 else 100 + rank)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=LABELS, pad_token_id=0,
                                                               dtype=torch.float32)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=trainwork.GLOBAL_BATCH // trainwork._dp_size(),
                             max_steps=3, logging_steps=1, report_to=[], optim="sgd", learning_rate=0.1,
                             weight_decay=0.01, save_strategy="no", use_cpu=True, disable_tqdm=True)
    warned = _Warnings()
    logging.getLogger("hp_lazy").addHandler(warned)
    try:
        with parity.swapped(replicas, "agree", lambda *a: []) if not check else contextlib.nullcontext():
            run = Trainer(model=model, args=args, train_dataset=Rows())
            if world > 1:
                hp_lazy.parallelize(model)  # bound now: the head each rank starts from
            start = model.score.weight.detach().clone()
            run.train()
    finally:
        logging.getLogger("hp_lazy").removeHandler(warned)
    result = {"loss": torch.tensor([h["loss"] for h in run.state.log_history if "loss" in h], dtype=torch.float64),
              "start": start, "warned": warned.messages}
    state = hp_lazy.full_state_dict(model) if world > 1 else {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 0:
        result["state"] = state
    return result


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_new_head_starts_as_rank_zeros_on_every_rank(pool: DistPool, tmp_path) -> None:
    path = models.build("llama", str(tmp_path))
    ref = classifier(0, 1, path, str(tmp_path / "ref"))
    got = pool.run(classifier, path, str(tmp_path / "hp"))
    for result in got:
        assert models.rel_err(result["start"], ref["start"]) == 0.0
        # the Trainer logs a classifier's loss times dp (its mean over rows, scaled as if it were a sum
        # over the global count); a plain 2-process DDP run logs the same: 2.1638 against 1.0819
        assert models.rel_err(result["loss"], ref["loss"] * 2) <= parity.TOL
    errors = {n: models.rel_err(got[0]["state"][n], v) for n, v in ref["state"].items()}
    assert max(errors.values()) <= parity.TOL, {n: e for n, e in errors.items() if e > parity.TOL}
    assert got[0]["warned"] == [
        "hp_lazy: score.weight differed between the ranks, which each hold it whole (drawn at random when the model "
        "was built, with each rank's own seed); every rank now holds rank 0's, as DDP does when it is built. Seed "
        "every rank alike (transformers.set_seed) before building the model to make this draw yours"]
    assert [r["warned"] for r in got[1:]] == [[]] * 3  # once, on rank 0


def test_negative_control_each_rank_keeps_its_own_head(pool: DistPool, tmp_path) -> None:
    path = models.build("llama", str(tmp_path))
    ref = classifier(0, 1, path, str(tmp_path / "ref"))
    got = pool.run(classifier, path, str(tmp_path / "hp"), check=False)
    assert all(models.rel_err(r["start"], ref["start"]) > 0.5 for r in got[1:])
    assert models.rel_err(got[0]["state"]["score.weight"], ref["state"]["score.weight"]) > 1e-3
