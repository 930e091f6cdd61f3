"""The stock transformers ``Trainer`` and ``torch.nn.utils.clip_grad_norm_`` at dp=2 x tp=2 with
sequence parallel (world 4), against one process: norms and rowwise biases on sequence-sharded
activations hold partial gradients over tp, summed by the gradient owner before the norm."""

from __future__ import annotations

import math

import models
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
    return parity.activated(pool4, tp=2, sequence_parallel=True)


@pytest.mark.parametrize("ga", [1, 2])
def test_trainer_default_args_sgd(pool: DistPool, refs, tmp_path, ga: int) -> None:
    path, _ = refs("llama_bias")
    ref = _reference(trainwork.trainer, path, str(tmp_path / "ref"), ga=ga)
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"), ga=ga)
    trainwork.compare_trainer(got[0], ref)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_in_a_user_loop(pool: DistPool, refs, norm_type: float) -> None:
    path, _ = refs("llama_bias")
    ref = _reference(trainwork.clip_loop, path, norm_type)
    trainwork.compare_clip(pool.run(trainwork.clip_loop, path, norm_type), ref)


def test_trainer_moe_with_flattened_rows_and_checkpointing(pool: DistPool, tmp_path) -> None:
    """Ernie-4.5-MoE (its shared experts handed ``h.view(-1, H)``, its experts split over tp taking
    every tp rank's rows) through the stock Trainer with gradient checkpointing: the recomputed
    forward runs the rows' count exchange and the one-sequence view again, in step."""
    path = models.build("ernie4_5_moe", str(tmp_path / "models"))
    ref = _reference(trainwork.trainer, path, str(tmp_path / "ref"), gradient_checkpointing=True)
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"), gradient_checkpointing=True)
    trainwork.compare_trainer(got[0], ref)


def test_trainer_attention_run_whole_with_checkpointing(pool: DistPool, refs, tmp_path) -> None:
    """Phi-3's attention (a gathered fused qkv_proj, a split o_proj) runs on the whole sequence under
    sequence parallel, its o_proj reduce-scattering the piece back, through the stock Trainer with
    gradient checkpointing: the recomputed forward gathers and cuts again, in step."""
    path, _ = refs("phi3")
    ref = _reference(trainwork.trainer, path, str(tmp_path / "ref"), gradient_checkpointing=True)
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"), gradient_checkpointing=True)
    trainwork.compare_trainer(got[0], ref)
