"""TRL's ``SFTTrainer`` on an expert-parallel MoE (ep=2 at world 2: two dp ranks, each holding half
of every layer's experts and reading its half of the batch), against one process: logged loss
(which includes the load-balancing aux loss TRL turns on), grad norm, entropy, token accuracy and
every parameter after 3 steps. Negative control: TRL's aux loss on each rank's rows alone."""

from __future__ import annotations

import epwork
import models
import parity
import pytest
import trlwork
from dist import DistPool, pool_fixture

pytest.importorskip("trl")

pool2 = pool_fixture(2, timeout=240)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return models.build("qwen3_moe", str(tmp_path_factory.mktemp("models")))


@pytest.fixture
def ready(pool2: DistPool, model_path: str):
    """Activated per test: a pool restarts its workers after a worker error."""
    return parity.once(pool2, epwork.activate, ep=2), model_path


def test_sft_trainer_under_ep(ready, tmp_path) -> None:
    pool, path = ready
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"))
    got = pool.run(trlwork.sft, path, str(tmp_path / "hp"))
    trlwork.compare(got[0], ref)
    trlwork.compare(got[1], {k: v for k, v in ref.items() if k != "state"})


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_sft_trainer_lora_on_experts_under_ep(ready, tmp_path, checkpointing: bool) -> None:
    """TRL's ``peft_config`` with ``target_parameters`` on the experts' 3-D tensors (TRL's recipe for
    MoE LoRA) beside attention adapters: TRL wraps the model; one process's logged numbers and every
    parameter (the adapters gathered) after 3 steps; with gradient checkpointing too (each layer's
    dispatch runs again in backward, on every rank in the same order)."""
    pool, path = ready
    lora = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"],
            "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"), lora=lora, checkpointing=checkpointing)
    assert sum(".experts." in n and "lora_B" in n for n in ref["state"]) == 2
    got = pool.run(trlwork.sft, path, str(tmp_path / "hp"), lora=lora, checkpointing=checkpointing)
    trlwork.compare(got[0], ref)


def test_a_local_aux_loss_is_wrong(ready, tmp_path) -> None:
    pool, path = ready
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"))
    got = pool.run(trlwork.sft_local_aux, path, str(tmp_path / "local"))
    with pytest.raises(AssertionError, match="relative errors above"):
        trlwork.compare(got[0], ref)


def test_dpo_trainer_under_ep(ready, tmp_path) -> None:
    pool, path = ready
    ref = trlwork.dpo(0, 1, path, str(tmp_path / "ref"))
    assert "aux_loss" in ref  # TRL turns the MoE's load-balancing loss on
    trlwork.compare_logged(pool.run(trlwork.dpo, path, str(tmp_path / "hp"))[0], ref)
