"""The stock transformers ``Trainer`` on an expert-parallel model (ep=2 at world 2: two dp ranks,
each holding half of every layer's experts and reading its half of the batch), against one
process: losses, logged grad norms (clipping on) and parameters; and ``save_steps`` checkpoints
with the optimizer state (each rank writes its expert slices through torch.distributed.checkpoint)
that resume to one process's straight run."""

from __future__ import annotations

import epwork
import models
import parity
import pytest
import trainwork
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=240)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return models.build("qwen3_moe", str(tmp_path_factory.mktemp("models")))


@pytest.fixture
def ready(pool2: DistPool, model_path: str):
    """Activated per test: a pool restarts its workers after a worker error."""
    return parity.once(pool2, epwork.activate, ep=2), model_path


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch"])
def test_trainer_under_ep(ready, tmp_path, optim: str) -> None:
    pool, path = ready
    ref = trainwork.trainer(0, 1, path, str(tmp_path / "ref"), optim=optim)
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"), optim=optim)
    trainwork.compare_trainer(got[0], ref, tol=trainwork.TOL[optim])
    assert [g["total_batch"] for g in got] == [ref["total_batch"]] * 2


def test_trainer_moe_aux_loss_under_ep(pool2: DistPool, tmp_path) -> None:
    """``output_router_logits=True`` in the config: the aux loss weighed once (hp_lazy's
    ``compute_loss``), one process's over the global batch."""
    path = models.build("qwen3_moe_aux", str(tmp_path / "models"))
    ref = trainwork.trainer(0, 1, path, str(tmp_path / "ref"))
    got = parity.once(pool2, epwork.activate, ep=2).run(trainwork.trainer, path, str(tmp_path / "hp"))
    trainwork.compare_trainer(got[0], ref)


def test_trainer_with_torch_compile_under_ep(ready, tmp_path) -> None:
    """``TrainingArguments(torch_compile=True)`` (backend eager) under ep=2: one process's numbers
    (the experts' dispatch runs eagerly between the compiled graphs)."""
    pool, path = ready
    ref = trainwork.trainer(0, 1, path, str(tmp_path / "ref"))
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"), torch_compile="eager")
    assert got[0]["wrapped"] == "OptimizedModule", got[0]["wrapped"]  # the Trainer compiled it
    trainwork.compare_trainer(got[0], ref)


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch"])
def test_trainer_resumes_under_ep(ready, tmp_path, optim: str) -> None:
    """save_steps=2 with the optimizer state, then resume_from_checkpoint, against one process doing
    the same. Not against one process's straight run: transformers' own resume loads
    ``model.safetensors`` with ``load_state_dict`` and no weight conversion, so a Qwen3-MoE's experts
    (saved per expert, held fused) are not restored — in one process too (a warning, then the
    loaded model's experts): hp_lazy reproduces that run, and the optimizer state it restores is
    the experts' own (each rank's slices through torch.distributed.checkpoint)."""
    pool, path = ready
    ref = trainwork.trainer_resume(0, 1, path, str(tmp_path / "ref"), optim=optim)
    got = pool.run(trainwork.trainer_resume, path, str(tmp_path / "hp"), optim=optim)
    assert "optimizer_dcp" in got[0]["files"] and "optimizer.pt" not in got[0]["files"]
    tol = trainwork.TOL[optim]
    for run in ("straight", "resumed"):
        assert got[0][run]["step"] == ref[run]["step"]
        assert all(models.rel_err(g[run]["loss"], ref[run]["loss"]) <= parity.TOL for g in got)
        errors = {n: models.rel_err(got[0][run]["state"][n], v) for n, v in ref[run]["state"].items()}
        assert max(errors.values()) <= tol, (run, sorted(errors.items(), key=lambda kv: -kv[1])[:3])
    lost = models.rel_err(ref["resumed"]["state"]["model.layers.1.mlp.experts.down_proj"],
                          ref["straight"]["state"]["model.layers.1.mlp.experts.down_proj"])
    assert lost > 1e-4  # transformers' resume of this MoE, one process: the experts are not restored


def test_trainer_resumes_lora_on_experts_under_ep(ready, tmp_path) -> None:
    """PEFT LoRA on attention and on the experts' tensors, the stock save_steps / resume cycle with
    AdamW: PEFT's adapter file and each rank's slices of the adapters' moments (DCP) come back, so
    the resumed run equals one process's straight run (the base is frozen: nothing else to restore)."""
    pool, path = ready
    ref = trainwork.trainer_resume(0, 1, path, str(tmp_path / "ref"), lora=True)
    got = pool.run(trainwork.trainer_resume, path, str(tmp_path / "hp"), lora=True)
    assert "adapter_model.safetensors" in got[0]["files"] and "optimizer_dcp" in got[0]["files"]
    experts = [n for n in ref["straight"]["state"] if ".experts." in n and "lora_" in n]
    assert len(experts) == 4
    errors = trainwork.compare_resume(got[0], ref, trainwork.TOL["adamw_torch"])
    assert max(errors[f"resumed {n}"] for n in experts) <= trainwork.TOL["adamw_torch"]


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch"])
def test_trainer_resumes_a_one_process_checkpoint_under_ep(ready, tmp_path, optim: str) -> None:
    """A checkpoint one process wrote (whole optimizer states in optimizer.pt) resumed at ep=2: each
    rank keeps its expert slices' states; against one process resuming the same checkpoint."""
    pool, path = ready
    ref_run = trainwork.trainer_resume(0, 1, path, str(tmp_path / "ref"), optim=optim)
    assert "optimizer.pt" in ref_run["files"]
    checkpoint = str(tmp_path / "ref" / "checkpoint-2")
    ref = trainwork.trainer_resume_only(0, 1, path, checkpoint, str(tmp_path / "one"), optim=optim)
    got = pool.run(trainwork.trainer_resume_only, path, checkpoint, str(tmp_path / "hp"), optim=optim)
    tol = trainwork.TOL[optim]
    assert models.rel_err(got[0]["loss"], ref["loss"]) <= tol
    errors = {n: models.rel_err(got[0]["state"][n], v) for n, v in ref["state"].items()}
    assert max(errors.values()) <= tol, sorted(errors.items(), key=lambda e: -e[1])[:3]


def test_trainer_under_ep_gpt_oss(ready, tmp_path) -> None:
    """The Trainer (clipping on, SGD) on GPT-OSS under ep: experts with biases, called with
    (hidden_states, router_indices, routing_weights), through the user's stack."""
    pool, _ = ready
    path = models.build("gpt_oss", str(tmp_path / "models"))
    ref = trainwork.trainer(0, 1, path, str(tmp_path / "ref"), optim="sgd")
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"), optim="sgd")
    trainwork.compare_trainer(got[0], ref, tol=trainwork.TOL["sgd"])
