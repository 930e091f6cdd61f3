"""The MoE load-balancing aux loss under context parallel (``output_router_logits=True``, which
TRL's trainers turn on for every MoE): each cp rank routes its zigzag rows, and the loss is one
process's over the global batch (:func:`hp_lazy.runtime.ep.aux.install` from the cp style's finish,
padding read from the call's state, each rank's ``1/cp`` share summed by the entry). Against one
process: ``out.aux_loss`` and ``out.loss`` on every rank, every gradient and 3 SGD+wd steps, at
cp=2 (plain and padded), cp=2 x dp=2, ep=2 x cp=2, through the stock ``Trainer`` and TRL's
``SFTTrainer``. Negative control: transformers' aux loss on each rank's own rows."""

from __future__ import annotations

import cpwork
import epwork
import models
import parity
import pytest
import trainwork
import trlwork
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=240)
pool4 = pool_fixture(4, timeout=180)
ep_pool2 = pool_fixture(2, timeout=180)  # activated with ep=2 x cp=2


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


def _padded(rows: tuple[int, ...] = (1,)) -> dict:
    """``rows`` padded at the end: their last 5 tokens, in the last chunk (rank 0's at cp=2)."""
    data = epwork.batch()
    mask = data["input_ids"].new_ones(data["input_ids"].shape)
    for row in rows:
        mask[row, -5:] = 0
        data["labels"][row, -5:] = -100
    return {**data, "attention_mask": mask}


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_aux_loss_is_global_cp2(pool2: DistPool, root: str, padded: bool) -> None:
    pool = parity.once(pool2, cpwork.activate, 2, 1)
    epwork.check_aux(pool, models.build("qwen3_moe", root), _padded() if padded else epwork.batch())


def train_local_counts(rank: int, world: int, path: str, data: dict) -> dict:
    """Negative control: the aux loss from each rank's own rows (the counts reduced over nobody)."""
    import importlib

    from hp_lazy.runtime.cp.state import padding_rows
    from hp_lazy.runtime.ep import aux

    module = importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
    original = getattr(module.load_balancing_loss_func, "hp_original", module.load_balancing_loss_func)
    local = aux.global_load_balancing(original, [], 1, padding_rows, share=world)
    with parity.swapped(module, "load_balancing_loss_func", local):
        return epwork.train(rank, world, path, data, config=epwork.AUX)


def test_negative_control_local_aux_loss_cp2(pool2: DistPool, root: str) -> None:
    """Each rank's aux loss from its own rows: the value and the router's gradients are off."""
    pool = parity.once(pool2, cpwork.activate, 2, 1)
    path = models.build("qwen3_moe", root)
    ref = epwork.reference(path, epwork.batch(), config=epwork.AUX)
    got = pool.run(train_local_counts, path, epwork.batch())[0]
    assert models.rel_err(got["aux"], ref["aux"]) > 1e-4
    with pytest.raises(AssertionError, match=r"relative errors above .*'grad model.layers.\d.mlp.gate.weight'"):
        parity.compare(got, ref)


def test_an_aux_loss_not_made_global_is_refused(pool2: DistPool, root: str) -> None:
    """transformers' own aux loss on each rank's rows (the global one swapped back out): refused by
    the entry, naming the option, instead of summed over cp."""
    from dist import WorkerError

    pool = parity.once(pool2, cpwork.activate, 2, 1)
    with pytest.raises(WorkerError) as info:
        epwork.local_aux(pool, models.build("qwen3_moe", root), epwork.batch())
    assert ("ShardingError: Qwen3MoeForCausalLM: an aux loss (out.aux_loss) not from transformers' "
            "load_balancing_loss_func under context parallel (cp=2): it is computed from this rank's tokens only; "
            "drop output_router_logits") in str(info.value)


def test_aux_loss_is_global_cp2_dp2(pool4: DistPool, root: str) -> None:
    """cp=2 x dp=2 on 4 ranks: counts summed over cp and dp, the part scaled by dp (DDP's average).
    Both rows padded alike: each dp rank's language-model loss is over its own labels, so the dp
    mean of the losses is one process's only where the rows count as many labels."""
    pool = parity.once(pool4, cpwork.activate, 2, 1)
    epwork.check_aux(pool, models.build("qwen3_moe", root), _padded((0, 1)))


def test_aux_loss_is_global_ep2_cp2(ep_pool2: DistPool, root: str) -> None:
    """ep=2 x cp=2 (the ep group is the cp group): expert parallel leaves the aux loss to cp's."""
    pool = parity.once(ep_pool2, epwork.activate, ep=2, cp=2)
    epwork.check_aux(pool, models.build("qwen3_moe", root), _padded())


def test_sft_trainer_moe_cp2(pool2: DistPool, root: str, tmp_path) -> None:
    """TRL's ``SFTTrainer`` on an MoE (it turns the aux loss on and adds it through Mixtral's
    function): loss, grad norm, entropy, token accuracy and every parameter after 3 steps."""
    pytest.importorskip("trl")
    path = models.build("qwen3_moe", root)
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"))
    got = parity.once(pool2, cpwork.activate, 2, 1).run(trlwork.sft, path, str(tmp_path / "hp"))
    trlwork.compare(got[0], ref)
    trlwork.compare(got[1], {k: v for k, v in ref.items() if k != "state"})


def test_negative_control_sft_trainer_local_aux_cp2(pool2: DistPool, root: str, tmp_path) -> None:
    """TRL's aux loss through Mixtral's own function on each rank's rows (its shares summed over cp)."""
    pytest.importorskip("trl")
    path = models.build("qwen3_moe", root)
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"))
    got = parity.once(pool2, cpwork.activate, 2, 1).run(trlwork.sft_local_aux, path, str(tmp_path / "local"))
    with pytest.raises(AssertionError, match="relative errors above"):
        trlwork.compare(got[0], ref)


def test_trainer_moe_aux_loss_cp2(pool2: DistPool, root: str, tmp_path) -> None:
    """The stock ``Trainer`` on an MoE whose config turns the aux loss on: losses, grad norms and
    every parameter after 3 steps (no dp: the Trainer scales nothing)."""
    path = models.build("qwen3_moe_aux", root)
    ref = trainwork.trainer(0, 1, path, str(tmp_path / "ref"))
    got = parity.once(pool2, cpwork.activate, 2, 1).run(trainwork.trainer, path, str(tmp_path / "hp"))
    trainwork.compare_trainer(got[0], ref)
