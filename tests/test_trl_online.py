"""TRL's generating trainers (``GRPOTrainer``, ``RLOOTrainer``, ``DistillationTrainer``) under tp, run
as their users run them (``model.generate`` sampling, seeded by accelerate per process; a rule reward;
TRL's reference model for the KL term; a teacher for distillation), 2 steps: every logged number and
every parameter.

- tp=2 (world 2, dp=1) against one process;
- dp=2 x tp=2 (world 4) against a plain data-parallel run of 2 processes, with groups of 4
  completions that span the two dp ranks (rewards normalised over the gathered group);
- ep=2 (world 2: each rank its own rows, nothing shared) against the same plain run, on Qwen3-MoE
  with the aux loss off (hp_lazy's aux loss is the global batch's, a plain run's each rank's own);
- LoRA (TRL's ``peft_config``; the reference model is the base with adapters off) and gradient
  accumulation at tp=2, against one process;
- distillation: TRL's fused student/teacher heads on vocab shards through hp_lazy's vocab-parallel
  divergence (forward KL, reverse KL, JSD with temperature; scales and softcaps in a user loop; the
  bytes it moves), at tp=2 against one process and at dp=2 x tp=2 against a plain run; negative
  control: TRL's kernel on the shards;
- negative control: the trainer's gathers over every rank (each dp rank's completions tp times)
  are silently wrong;
- the trainer's gathers and its accelerator's answers while viewed: the dp group's rows only;
- refused by name: a config sized before ``activate``, vLLM generation. Context parallel is
  refused in ``test_trl_cp.py``.
"""

from __future__ import annotations

import math

import models
import parity
import pytest
import trlwork
from dist import DistPool, WorkerError, pool_fixture

pytest.importorskip("trl")

pool2 = pool_fixture(2, timeout=240)
pool4 = pool_fixture(4, timeout=300)
plain2 = pool_fixture(2, timeout=240)
ep2 = pool_fixture(2, timeout=240)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return models.build("llama", str(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def dp_reference(plain2: DistPool, model_path: str, tmp_path_factory) -> dict[str, dict]:
    """Each trainer's plain run at dp=2 (no hp_lazy), groups of 4 completions over both ranks."""
    out = str(tmp_path_factory.mktemp("plain"))
    refs = {t: plain2.run(trlwork.online, model_path, f"{out}/{t}", t, 4)[0] for t in ("GRPO", "RLOO")}
    plain2.close()
    return refs


@pytest.mark.parametrize("trainer", ["GRPO", "RLOO"])
def test_tp2_matches_one_process(trainer: str, pool2: DistPool, model_path: str, tmp_path) -> None:
    pool = parity.activated(pool2, tp=2)
    ref = trlwork.online(0, 1, model_path, str(tmp_path / "ref"), trainer)
    assert float(ref["grad_norm"][0]) > 0 and float(ref["kl"][1]) != 0  # it trained, and its KL moved
    got = pool.run(trlwork.online, model_path, str(tmp_path / "hp"), trainer)
    trlwork.compare_logged(got[0], ref)
    trlwork.compare_logged(got[1], {k: v for k, v in ref.items() if k != "state"})


@pytest.mark.parametrize("variant", [{"lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
                                     {"accumulation": 2}], ids=["lora", "accumulation"])
def test_tp2_lora_and_accumulation(variant: dict, pool2: DistPool, model_path: str, tmp_path) -> None:
    pool = parity.activated(pool2, tp=2)
    ref = trlwork.online(0, 1, model_path, str(tmp_path / "ref"), **variant)
    trlwork.compare_logged(pool.run(trlwork.online, model_path, str(tmp_path / "hp"), **variant)[0], ref)


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory) -> str:
    return models.build("llama", str(tmp_path_factory.mktemp("teacher")), seed=5)


@pytest.mark.parametrize("config", [{"beta": 0.0}, {"beta": 1.0}, {"beta": 0.5, "temperature": 0.7}],
                         ids=["forward-kl", "reverse-kl", "jsd-temperature"])
def test_distillation_trainer_at_tp2(config: dict, pool2: DistPool, model_path: str, teacher_path: str,
                                     tmp_path) -> None:
    """The student generates and matches the teacher through TRL's fused heads: with both heads cut
    over the vocabulary, hp_lazy's vocab-parallel divergence."""
    pool = parity.activated(pool2, tp=2)
    ref = trlwork.distill(0, 1, model_path, teacher_path, str(tmp_path / "ref"), **config)
    got = pool.run(trlwork.distill, model_path, teacher_path, str(tmp_path / "hp"), **config)
    trlwork.compare_logged(got[0], ref)
    trlwork.compare_logged(got[1], {k: v for k, v in ref.items() if k != "state"})


def test_distillation_trainer_at_dp2_tp2(pool4: DistPool, plain2: DistPool, model_path: str, teacher_path: str,
                                        tmp_path) -> None:
    """Against a plain 2-process run; the loss (a KL near 0.01 nats) in nats, as its fp32 round-off
    is ~1e-4 of itself (TRL's kernel against float64)."""
    ref = plain2.run(trlwork.distill, model_path, teacher_path, str(tmp_path / "ref"))[0]
    plain2.close()
    got = parity.activated(pool4, tp=2).run(trlwork.distill, model_path, teacher_path, str(tmp_path / "hp"))
    trlwork.compare_logged(got[0], ref, nats=("loss",))


def test_distillation_with_trls_kernel_on_the_shards_is_wrong(pool2: DistPool, model_path: str, teacher_path: str,
                                                               tmp_path) -> None:
    """Negative control: a softmax over half the vocabulary (entropy near ln(V/2))."""
    pool = parity.activated(pool2, tp=2)
    ref = trlwork.distill(0, 1, model_path, teacher_path, str(tmp_path / "ref"))
    got = pool.run(trlwork.distill_stock_kernel, model_path, teacher_path, str(tmp_path / "hp"))
    assert abs(float(got[0]["entropy"][0]) - math.log(models.VOCAB / 2)) < 0.1, got[0]["entropy"]
    with pytest.raises(AssertionError, match=r"relative errors above 1e-05: .*'entropy': 0\.1"):
        trlwork.compare_logged(got[0], ref)


@pytest.mark.parametrize("knobs", [
    {"beta": 0.5},
    {"beta": 0.3, "temperature": 0.7, "student_final_logit_softcapping": 3.0, "student_logit_scale": 1.5,
     "teacher_final_logit_softcapping": 2.0, "teacher_logit_scale": 0.5},
], ids=["jsd", "jsd-scaled-softcapped"])
def test_distillation_loss_user_loop(knobs: dict, pool2: DistPool, model_path: str, teacher_path: str) -> None:
    """TRL's distillation loss called by hand on both models' hidden states: loss, entropy and every
    student gradient."""
    ids = models.batch()
    ref = trlwork.divergence_loop(0, 1, model_path, teacher_path, ids, **knobs)
    got = parity.activated(pool2, tp=2).run(trlwork.divergence_loop, model_path, teacher_path, ids, **knobs)
    for rank in got:
        assert models.rel_err(rank["loss"], ref["loss"]) <= parity.TOL
        assert models.rel_err(rank["entropy"], ref["entropy"]) <= parity.TOL
    errors = {n: models.rel_err(got[0]["grads"][n], g) for n, g in ref["grads"].items()}
    assert max(errors.values()) <= parity.TOL, sorted(errors.items(), key=lambda e: -e[1])[:3]


@pytest.mark.parametrize("beta, rows", [(0.5, 7), (1.0, 6)], ids=["jsd", "reverse-kl"])
def test_distillation_loss_bytes(beta: float, rows: int, pool2: DistPool, model_path: str, teacher_path: str) -> None:
    """The fused heads add all-reduces of [2, N], [3, N] and [2, N] fp32 in forward ([1, N] for a KL,
    which needs no per-token term in backward) and one of [N, H] (the student hidden gradient) in
    backward: no weight moves."""
    ids = models.batch()  # [2, 16]: N = 32 positions
    n, hidden = ids.numel(), 32
    got = parity.activated(pool2, tp=2).run(trlwork.divergence_loop, model_path, teacher_path, ids, beta, True)
    for payload in got:
        assert payload == {("all_reduce", "forward"): rows * n * 4, ("all_reduce", "backward"): n * hidden * 4}, \
            payload


def _activate_ep(rank: int, world: int) -> None:
    import hp_lazy

    hp_lazy.activate(hp_lazy.Plan.auto(tp=1, ep=2))


def test_ep2_matches_a_data_parallel_run(ep2: DistPool, plain2: DistPool, tmp_path) -> None:
    path = models.build("qwen3_moe", str(tmp_path / "models"))
    ref = plain2.run(trlwork.online, path, str(tmp_path / "ref"), "GRPO", 4, aux_coef=0.0)[0]
    plain2.close()
    got = parity.once(ep2, _activate_ep).run(trlwork.online, path, str(tmp_path / "hp"), "GRPO", 4, aux_coef=0.0)
    trlwork.compare_logged(got[0], ref)


@pytest.mark.parametrize("trainer", ["GRPO", "RLOO"])
def test_dp_by_tp_matches_a_data_parallel_run(trainer: str, pool4: DistPool, dp_reference, model_path: str,
                                              tmp_path) -> None:
    pool = parity.activated(pool4, tp=2)
    ref = dp_reference[trainer]
    assert 0 < float(ref["frac_reward_zero_std"][0]) < 1 or float(ref["reward_std"][0]) > 0  # groups differ
    got = pool.run(trlwork.online, model_path, str(tmp_path / "hp"), trainer, 4)
    trlwork.compare_logged(got[0], ref)
    for other in got[1:]:
        trlwork.compare_logged(other, {k: v for k, v in ref.items() if k != "state"})


def test_gathers_over_every_rank_are_wrong(pool4: DistPool, dp_reference, model_path: str, tmp_path) -> None:
    """Negative control: each group of 4 is normalised over one dp rank's 2 completions and their
    tp copy, and the loss over tp times the token count."""
    pool = parity.activated(pool4, tp=2)
    got = pool.run(trlwork.online_stock_gathers, model_path, str(tmp_path / "hp"), "GRPO", 4)
    with pytest.raises(AssertionError, match=r"relative errors above 1e-05: .*'grad_norm': 0\.[1-9]"):
        trlwork.compare_logged(got[0], dp_reference["GRPO"])


def _gathers(rank: int, world: int) -> tuple:
    import torch
    import trl.trainer.grpo_trainer as grpo
    from accelerate import Accelerator

    import hp_lazy
    from hp_lazy.integrations import trl_online

    mine = torch.full((3,), float(rank))
    accelerator = Accelerator(cpu=True)
    with trl_online._viewed(accelerator, hp_lazy.mesh().group("dp")):
        viewed = accelerator.gather(mine), accelerator.reduce(mine), accelerator.process_index, accelerator.num_processes
    assert not isinstance(accelerator, trl_online.DataParallelView)  # its own class again
    return (grpo.gather(mine), grpo.gather_object([rank]), *viewed)


def test_the_trainers_gathers_span_the_dp_group_only(pool4: DistPool) -> None:
    """At dp=2 x tp=2 (ranks 2d + t), rank r's dp group is {r % 2, r % 2 + 2}: the trainer's gathers
    receive those 2 ranks' rows (a gather over the world would receive 4), its reduce sums them."""
    import torch

    got = parity.activated(pool4, tp=2).run(_gathers)
    for rank, (gathered, objects, viewed, reduced, index, processes) in enumerate(got):
        peers = [rank % 2, rank % 2 + 2]
        expected = torch.tensor([float(p) for p in peers for _ in range(3)])
        assert torch.equal(gathered, expected) and torch.equal(viewed, expected), (rank, gathered, viewed)
        assert objects == peers and torch.equal(reduced, torch.full((3,), float(sum(peers))))
        assert (index, processes) == (rank // 2, 2)


def _config_then_activate(rank: int, world: int, path: str, out: str) -> None:
    import trl

    import hp_lazy

    args = trl.GRPOConfig(output_dir=out, per_device_train_batch_size=2, num_generations=2, report_to=[],
                          use_cpu=True, max_steps=1)
    hp_lazy.activate(hp_lazy.Plan.auto(tp=2))
    trl.GRPOTrainer(model=trlwork.trainwork.parity._load(path), reward_funcs=trlwork._reward, args=args,
                    train_dataset=trlwork._prompts(), processing_class=trlwork.tokenizer())


def test_a_config_sized_before_activate_is_refused(pool2: DistPool, model_path: str, tmp_path) -> None:
    pool2.close()  # fresh workers: the config first, then activate
    with pytest.raises(WorkerError, match=r"GRPOTrainer: generation_batch_size=4 was sized for 2 processes, but the 1 "
                                          r"dp rank\(s\) of hp_lazy's plan \{'tp': 2\} feed this model .* build the "
                                          r"GRPOConfig after hp_lazy.activate"):
        pool2.run(_config_then_activate, model_path, str(tmp_path / "hp"))


def test_vllm_generation_is_refused(pool2: DistPool, model_path: str, tmp_path) -> None:
    pool = parity.activated(pool2, tp=2)
    with pytest.raises(WorkerError, match=r"GRPOTrainer: use_vllm=True sends this model's parameters to vLLM, and "
                                          r"under hp_lazy's \{'tp': 2\} each rank holds only its shards"):
        pool.run(trlwork.online, model_path, str(tmp_path / "hp"), "GRPO", use_vllm=True)
