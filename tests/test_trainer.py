"""The stock transformers ``Trainer`` and ``torch.nn.utils.clip_grad_norm_`` at tp=2 (world 2),
against one process: losses, logged grad norms and parameters after 3 steps; the norm and the
clipped gradients of a user loop (norm 2 and inf; a K/V head held by both ranks counted once).
Negative controls: the stock stack without hp_lazy's routing gives the wrong numbers."""

from __future__ import annotations

import math

import models
import parity
import pytest
import trainwork
from dist import DistPool, WorkerError, pool_fixture

pool2 = pool_fixture(2, timeout=240)
_REFS: dict[tuple, dict] = {}


def _reference(fn, *args, **kwargs) -> dict:
    key = (fn.__name__, args, tuple(sorted(kwargs.items())))
    if key not in _REFS:
        _REFS[key] = fn(0, 1, *args, **kwargs)
    return _REFS[key]


@pytest.fixture
def pool(pool2: DistPool) -> DistPool:
    return parity.activated(pool2, tp=2)


def test_trainer_default_args_sgd(pool: DistPool, refs, tmp_path) -> None:
    """Default TrainingArguments (clipping at 1.0 on), SGD; the model is bound by the Trainer's
    accelerate preparation (no hp_lazy.parallelize call), never wrapped in DDP."""
    path, _ = refs("llama")
    ref = _reference(trainwork.trainer, path, str(tmp_path / "ref"))
    assert ref["grad_norm"].min() > 1.0  # clipping changes these steps
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"))
    assert [g["wrapped"] for g in got] == ["LlamaForCausalLM"] * 2
    trainwork.compare_trainer(got[0], ref)
    assert [g["total_batch"] for g in got] == [ref["total_batch"]] * len(got) == [trainwork.GLOBAL_BATCH] * len(got)
    assert all(float((g["loss"] - ref["loss"]).abs().max()) <= 1e-5 for g in got)


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch"])
def test_trainer_with_accumulation(pool: DistPool, refs, tmp_path, optim: str) -> None:
    """Two micro-batches per step (hp_lazy.no_sync on the first); parallelize called before."""
    path, _ = refs("llama")
    ref = _reference(trainwork.trainer, path, str(tmp_path / "ref"), optim=optim, ga=2)
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"), optim=optim, ga=2, parallelize=True)
    trainwork.compare_trainer(got[0], ref, tol=trainwork.TOL[optim])


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch"])
def test_trainer_with_peft_lora(pool: DistPool, refs, tmp_path, optim: str) -> None:
    """get_peft_model on the loaded model, then the stock Trainer (clipping on): the adapters train
    like one process's, the frozen base stays the checkpoint's."""
    path, _ = refs("llama")
    ref = _reference(trainwork.trainer, path, str(tmp_path / "ref"), optim=optim, lora=True)
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"), optim=optim, lora=True)
    assert sum("lora_" in n for n in ref["state"]) >= 30
    trainwork.compare_trainer(got[0], ref, tol=trainwork.TOL[optim])


def test_trainer_after_deactivate(pool: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama")
    ref = _reference(trainwork.trainer, path, str(tmp_path / "ref"))
    trainwork.compare_trainer(pool.run(trainwork.trainer_after_deactivate, path, str(tmp_path / "hp"))[0], ref)


def test_the_stock_stack_is_refused(pool: DistPool, refs, tmp_path) -> None:
    """Negative control: accelerate's own prepare wraps DDP over both tp ranks (which gave silently
    different numbers: rank 0's shards broadcast to its peer, each its own batch); hp_lazy's
    wrapper check refuses it at the first forward, naming the group to pass."""
    path, _ = refs("llama")
    with pytest.raises(WorkerError, match=r"this model runs inside torch DistributedDataParallel over ranks \[0, 1\], "
                                          r"but its parameters are shards that only the data-parallel ranks \[\d\] "
                                          r"hold alike .* process_group=hp_lazy.mesh\(\).group\('dp'\).pg"):
        pool.run(trainwork.stock_trainer, path, str(tmp_path / "stock"))


@pytest.mark.parametrize(("name", "norm_type"), [("llama", 2.0), ("llama", math.inf), ("llama_mqa", 2.0)])
def test_clip_grad_norm_in_a_user_loop(pool: DistPool, refs, name: str, norm_type: float) -> None:
    path, _ = refs(name)
    ref = _reference(trainwork.clip_loop, path, norm_type)
    got = pool.run(trainwork.clip_loop, path, norm_type)
    trainwork.compare_clip(got, ref)
    # torch's own function on the shards: each rank its own (wrong) norm
    assert all(abs(g["local"] - ref["norm"]) > 1e-3 * ref["norm"] for g in got) or norm_type == math.inf


def test_clip_refusals(pool: DistPool, refs) -> None:
    path, _ = refs("llama")
    found = pool.run(trainwork.clip_errors, path)[0]
    assert found["no_sync"] == "no error"  # tp only, no partial sums: nothing waits for a reduction
    assert "1 of the 22 gradients (e.g. one of shape [3]) belong to no model hp_lazy bound" in found["foreign"]
    assert "norm_type=0.0 is not implemented for a parallel model" in found["norm0"]
    assert found["plain"] == f"{math.sqrt(3):.6f}"


def test_dispatch_batches_is_refused(pool: DistPool, refs, tmp_path) -> None:
    with pytest.raises(WorkerError, match=r"dispatch_batches=True splits each batch over all ranks"):
        pool.run(trainwork.dispatching_loader)



def test_trainer_checkpoints_save_the_whole_model(pool: DistPool, refs, tmp_path) -> None:
    """save_steps checkpoints with save_only_model=True: every rank joins save_pretrained's gathers and
    a plain process loads the checkpoint equal to the trained model."""
    path, _ = refs("llama")
    got = pool.run(trainwork.trainer_checkpoint, path, str(tmp_path / "hp"))
    assert got[0]["equal"] <= 1e-7 and got[0]["files"] == ["config.json", "generation_config.json", "model.safetensors", "training_args.bin"]


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch"])
def test_trainer_resumes_from_a_save_steps_checkpoint(pool: DistPool, refs, tmp_path, optim: str) -> None:
    """save_steps=2 with the optimizer state (default save_only_model=False), then
    resume_from_checkpoint: steps 3-4 and the final parameters equal one process's straight run."""
    path, _ = refs("llama")
    ref = _reference(trainwork.trainer_resume, path, str(tmp_path / "ref"), optim=optim)
    trainwork.compare_resume(ref, ref, tol=trainwork.TOL[optim])  # one process resumes itself exactly
    got = pool.run(trainwork.trainer_resume, path, str(tmp_path / "hp"), optim=optim)
    trainwork.compare_resume(got[0], ref, tol=trainwork.TOL[optim])
    assert "optimizer_dcp" in got[0]["files"] and "optimizer.pt" not in got[0]["files"]
    assert all(float((g["resumed"]["loss"] - ref["straight"]["loss"]).abs().max()) <= 1e-5 for g in got)


def test_trainer_resume_with_the_main_process_optimizer_pt_is_wrong(pool: DistPool, refs, tmp_path) -> None:
    """Negative control: the Trainer's own optimizer.pt (rank 0's shards, loaded by both ranks)
    resumes without an error and with the wrong parameters; hp_lazy refuses such a checkpoint."""
    path, _ = refs("llama")
    ref = _reference(trainwork.trainer_resume, path, str(tmp_path / "ref"))
    got = pool.run(trainwork.trainer_resume, path, str(tmp_path / "old"), old_optimizer_pt=True)
    assert "optimizer.pt" in got[0]["files"]
    with pytest.raises(AssertionError, match="relative errors above"):
        trainwork.compare_resume(got[0], ref, tol=trainwork.TOL["adamw_torch"])
    with pytest.raises(WorkerError, match=r"holds optimizer.pt, written by the main process alone; for this model, "
                                          r"whose parameters are sharded over tp, it holds rank 0's shards only"):
        pool.run(trainwork.trainer_resume_only, path, str(tmp_path / "old" / "checkpoint-2"))


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch"])
def test_trainer_resumes_a_one_process_checkpoint(pool: DistPool, refs, tmp_path, optim: str) -> None:
    """A checkpoint one process wrote (its optimizer.pt holds whole states) resumed at tp=2: steps 3-4
    and the final parameters equal the one-process run (it was refused with a false reason)."""
    path, _ = refs("llama")
    ref = _reference(trainwork.trainer_resume, path, str(tmp_path / "ref"), optim=optim)
    assert "optimizer.pt" in ref["files"]
    got = pool.run(trainwork.trainer_resume_only, path, str(tmp_path / "ref" / "checkpoint-2"),
                   str(tmp_path / "hp"), optim=optim)
    assert got[0]["step"] == [3, 4] or got[0]["step"] == [1, 2, 3, 4], got[0]["step"]
    tol = trainwork.TOL[optim]
    assert models.rel_err(got[0]["loss"][-2:], ref["straight"]["loss"][-2:]) <= tol
    errors = {n: models.rel_err(got[0]["state"][n], v) for n, v in ref["straight"]["state"].items()}
    assert max(errors.values()) <= tol, sorted(errors.items(), key=lambda e: -e[1])[:3]


def test_parameter_counts_are_one_process(pool: DistPool, refs) -> None:
    """``num_parameters()`` and the Trainer's logged count are the model's, not this rank's shards."""
    path, _ = refs("llama")
    ref = trainwork.parameter_counts(0, 1, path)
    for got in pool.run(trainwork.parameter_counts, path):
        assert got[:3] == ref[:3]
        assert got[3] < ref[3]  # what each rank holds: its shards
