"""The stock transformers ``Trainer`` and ``torch.nn.utils.clip_grad_norm_`` at dp=2 x tp=2
(world 4), against one process over the same global batch: each tp group reads its own half
(the ranks of a group the same rows), hp_lazy averages over dp; or torch DDP over the dp group
(``data_parallel=False``). Clipping counts every shard once over dp and tp; evaluation keeps
one copy of each row."""

from __future__ import annotations

import math

import parity
import pytest
import trainwork
from dist import DistPool, pool_fixture

pool4 = pool_fixture(4, timeout=240)
_REFS: dict[tuple, dict] = {}


def _reference(fn, *args, **kwargs) -> dict:
    key = (fn.__name__, args, tuple(sorted(kwargs.items())))
    if key not in _REFS:
        _REFS[key] = fn(0, 1, *args, **kwargs)
    return _REFS[key]


@pytest.fixture
def pool(pool4: DistPool) -> DistPool:
    return parity.activated(pool4, tp=2)


def test_trainer_default_args_sgd(pool: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama")
    ref = _reference(trainwork.trainer, path, str(tmp_path / "ref"))
    assert ref["grad_norm"].min() > 1.0  # clipping changes these steps
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"))
    assert [g["wrapped"] for g in got] == ["LlamaForCausalLM"] * 4
    trainwork.compare_trainer(got[0], ref)
    assert [g["total_batch"] for g in got] == [ref["total_batch"]] * len(got) == [trainwork.GLOBAL_BATCH] * len(got)


def test_trainer_moe_aux_loss(pool: DistPool, refs, tmp_path) -> None:
    """An MoE with ``output_router_logits=True`` in its config (coefficient 0.5): the Trainer's loss
    scale by dp would weigh the global aux loss twice; hp_lazy's ``compute_loss`` takes the surplus out."""
    path, _ = refs("qwen3_moe_aux")
    ref = _reference(trainwork.trainer, path, str(tmp_path / "ref"))
    trainwork.compare_trainer(pool.run(trainwork.trainer, path, str(tmp_path / "hp"))[0], ref)


def test_negative_control_trainer_stock_loss_with_moe_aux(pool: DistPool, refs, tmp_path) -> None:
    path, _ = refs("qwen3_moe_aux")
    ref = _reference(trainwork.trainer, path, str(tmp_path / "ref"))
    got = pool.run(trainwork.trainer_stock_loss, path, str(tmp_path / "hp"))[0]
    assert abs(float(got["loss"][0] / ref["loss"][0]) - 1) > 0.05  # measured 0.17 at dp=2
    with pytest.raises(AssertionError, match="relative errors above"):
        trainwork.compare_trainer(got, ref)


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch"])
def test_trainer_with_accumulation(pool: DistPool, refs, tmp_path, optim: str) -> None:
    path, _ = refs("qwen3")  # q/k norms: partial sums over tp, reduced with the dp average
    ref = _reference(trainwork.trainer, path, str(tmp_path / "ref"), optim=optim, ga=2)
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"), optim=optim, ga=2, parallelize=True)
    trainwork.compare_trainer(got[0], ref, tol=trainwork.TOL[optim])


def test_trainer_with_torch_ddp_over_dp(pool: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama")
    ref = _reference(trainwork.trainer, path, str(tmp_path / "ref"))
    got = pool.run(trainwork.trainer, path, str(tmp_path / "ddp"), data_parallel=False)
    assert [g["wrapped"] for g in got] == ["DistributedDataParallel"] * 4
    trainwork.compare_trainer(got[0], ref)


@pytest.mark.parametrize(("name", "norm_type"), [("llama", 2.0), ("llama", math.inf), ("qwen3", 2.0)])
def test_clip_grad_norm_in_a_user_loop(pool: DistPool, refs, name: str, norm_type: float) -> None:
    path, _ = refs(name)
    ref = _reference(trainwork.clip_loop, path, norm_type)
    got = pool.run(trainwork.clip_loop, path, norm_type)
    trainwork.compare_clip(got, ref)
    if norm_type == 2.0:
        assert all(abs(g["local"] - ref["norm"]) > 1e-3 * ref["norm"] for g in got)


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_clip_grad_norm_with_torch_owning_dp(pool: DistPool, refs, wrap: str) -> None:
    """data_parallel=False: DDP over the dp group (identical gradients on the dp ranks) or FSDP2 over
    the dp sub-mesh (DTensor gradients, a distinct piece on each dp rank)."""
    path, _ = refs("llama")
    ref = _reference(trainwork.clip_loop, path, 2.0)
    trainwork.compare_clip(pool.run(trainwork.clip_loop, path, 2.0, wrap=wrap), ref)


def test_clip_under_no_sync_is_refused(pool: DistPool, refs) -> None:
    path, _ = refs("llama")
    errors = pool.run(trainwork.clip_under_no_sync, path)
    assert all("were accumulated under hp_lazy.no_sync and are not reduced over the ranks yet" in e for e in errors)


def test_trainer_evaluate_with_a_cut_last_batch(pool: DistPool, refs, tmp_path) -> None:
    """The evaluation set does not fill the last global batch: the gathered losses must be
    truncated to the right rows (one copy per dp rank), not to the tp copies."""
    path, _ = refs("llama")
    ref = trainwork.evaluate(0, 1, path, str(tmp_path / "ref"))
    got = pool.run(trainwork.evaluate, path, str(tmp_path / "hp"))
    assert all(abs(g - ref) <= parity.TOL * ref for g in got), (got, ref)


def test_trainer_resumes_from_a_save_steps_checkpoint(pool: DistPool, refs, tmp_path) -> None:
    """AdamW, save_steps=2 with the optimizer state, resume_from_checkpoint at dp=2 x tp=2: one
    process's run (q/k norms: replicated states, tp-partial gradients)."""
    path, _ = refs("qwen3")
    ref = _reference(trainwork.trainer_resume, path, str(tmp_path / "ref"))
    got = pool.run(trainwork.trainer_resume, path, str(tmp_path / "hp"))
    trainwork.compare_resume(got[0], ref, tol=trainwork.TOL["adamw_torch"])
    assert "optimizer_dcp" in got[0]["files"] and "optimizer.pt" not in got[0]["files"]
    assert all(float((g["resumed"]["loss"] - ref["straight"]["loss"]).abs().max()) <= 1e-5 for g in got)
