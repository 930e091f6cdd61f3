"""TRL's trainers, run the way their users run them, on the ranks of a pool (under an active plan)
and in the pytest process (one process, no hp_lazy: the reference).

TRL computes its loss and metrics through a fused LM head (``trl.trainer.utils.add_fused_lm_head``
replaces ``model.forward`` and reads ``get_output_embeddings().weight`` directly), which is where a
vocab-sharded head must not be read as if it were whole.
"""

from __future__ import annotations

from typing import Any

import models
import trainwork

SEQ = 16


def tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary (no download): token ``i`` is ``t<i>``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(models.VOCAB)}
    core = Tokenizer(WordLevel(vocab, unk_token="t1"))
    core.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t1", pad_token="t0", eos_token="t2")


def _dataset(completion_only: bool):
    """16 rows of pre-tokenized ids; with ``completion_only``, prompt/completion texts (the first 6
    tokens are the prompt, which the loss leaves out)."""
    from datasets import Dataset

    ids = models.batch(seed=3, batch_size=trainwork.ROWS, seq=SEQ).tolist()
    if completion_only:
        text = [[f"t{i}" for i in row] for row in ids]
        return Dataset.from_dict({"prompt": [" ".join(r[:6]) for r in text], "completion": [" ".join(r[6:]) for r in text]})
    return Dataset.from_dict({"input_ids": ids})


def sft(rank: int, world: int, path: str, out: str, packing: bool = False, completion_only: bool = False,
        optim: str = "sgd", lora: dict[str, Any] | None = None, checkpointing: bool = False,
        label_smoothing: float = 0.0, loss_func: bool = False) -> dict[str, Any]:
    """``SFTTrainer(model=..., args=SFTConfig(...), train_dataset=...).train()``, 3 steps: every rank
    returns the logged loss, grad norm, entropy and token accuracy per step, rank 0 the parameters.
    ``lora``: a ``LoraConfig``'s arguments, handed to TRL as ``peft_config`` (TRL wraps the model);
    ``checkpointing``: ``gradient_checkpointing=True`` (TRL's default is off); ``label_smoothing``
    (``label_smoothing_factor``) and ``loss_func`` (``compute_loss_func``): the loss from the logits."""
    import torch
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    import hp_lazy
    from hp_lazy.api import active_plan

    model = trainwork.parity._load(path)
    dp = hp_lazy.mesh().group("dp").size if active_plan() is not None else 1
    args = SFTConfig(
        output_dir=out, per_device_train_batch_size=trainwork.GLOBAL_BATCH // dp, max_steps=3, logging_steps=1,
        report_to=[], optim=optim, learning_rate=0.1 if optim == "sgd" else 1e-3, weight_decay=0.01,
        save_strategy="no", use_cpu=True, disable_tqdm=True, packing=packing, max_length=SEQ * 2 if packing else SEQ,
        completion_only_loss=completion_only if completion_only else None, dataset_num_proc=None, seed=0,
        padding_free=False, bf16=False,  # TRL turns bf16 autocast on by default: parity is checked in fp32
        gradient_checkpointing=checkpointing, label_smoothing_factor=label_smoothing,
    )
    peft = None
    if lora:
        torch.manual_seed(7)  # the adapters' init: the same draws in every process
        peft = LoraConfig(**lora)
    run = SFTTrainer(model=model, args=args, train_dataset=_dataset(completion_only), processing_class=tokenizer(),
                     peft_config=peft, compute_loss_func=trainwork.shifted_ce if loss_func else None)
    return _trained(rank, run, model, ("loss", "grad_norm", "entropy", "mean_token_accuracy"))


def sft_predict(rank: int, world: int, path: str, out: str) -> dict[str, Any]:
    """``SFTTrainer(..., compute_metrics=token_metrics)``: ``.evaluate()``'s metrics and
    ``.predict()``'s logits on 6 rows (the last global batch cut)."""
    import torch
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=out, per_device_eval_batch_size=trainwork.GLOBAL_BATCH // trainwork._dp_size(), report_to=[],
                     use_cpu=True, disable_tqdm=True, max_length=SEQ, dataset_num_proc=None, padding_free=False,
                     bf16=False)
    rows = _dataset(False).select(range(6))
    run = SFTTrainer(model=trainwork.parity._load(path), args=args, train_dataset=rows, eval_dataset=rows,
                     processing_class=tokenizer(), compute_metrics=trainwork.token_metrics)
    metrics = run.evaluate()
    predicted = run.predict(rows)
    return {"metrics": {k: metrics[f"eval_{k}"] for k in ("loss", "accuracy", "mean_logit")},
            "logits": torch.as_tensor(predicted.predictions), "labels": torch.as_tensor(predicted.label_ids),
            "others": []}


def _trained(rank: int, run: Any, model: Any, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """``run.train()``; the logged numbers (``keys``, or every float logged) per step, and on rank 0
    the parameters (gathered whole under a plan)."""
    import torch

    import hp_lazy
    from hp_lazy.api import active_plan

    run.train()
    logged = [h for h in run.state.log_history if "loss" in h]
    keys = keys or tuple(sorted(k for k in logged[0] if k not in SKIP_LOGGED and isinstance(logged[0][k], float)))
    result: dict[str, Any] = {k: torch.tensor([h[k] for h in logged], dtype=torch.float64) for k in keys}
    state = hp_lazy.full_state_dict(model) if active_plan() is not None else {
        k: v.detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        result["state"] = state
    return result


def compare(got: dict[str, Any], ref: dict[str, Any], tol: float = 1e-5) -> dict[str, float]:
    keys = ("loss", "grad_norm", "entropy", "mean_token_accuracy")
    errors = {k: models.rel_err(got[k], ref[k]) for k in keys}
    if "state" in got:
        errors.update({f"param {n}": models.rel_err(got["state"][n], v) for n, v in ref["state"].items()})
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"relative errors above {tol}: {dict(list(bad.items())[:6])}"
    return errors


def stock_sft(rank: int, world: int, path: str, out: str) -> dict[str, Any]:
    """Negative control: TRL's own kernel on the vocab shard (hp_lazy's dispatcher taken out)."""
    import trl.trainer.utils as utils

    routed = utils._ChunkedLogProbFunction
    utils._ChunkedLogProbFunction = routed.__wrapped__
    try:
        return sft(rank, world, path, out)
    finally:
        utils._ChunkedLogProbFunction = routed


def fused_head(rank: int, world: int, path: str, ids, outputs: tuple[str, ...], temperature: float = 1.0,
               softcap: float | None = None, scale: float = 1.0) -> dict[str, Any]:
    """A user loop on ``add_fused_lm_head``: the first call is the fused one (the backbone's forward
    binds the model), then backward; every per-token field and, on rank 0, every full gradient."""
    from trl.trainer.utils import add_fused_lm_head

    import hp_lazy
    from hp_lazy.api import active_plan

    model = trainwork.parity._load(path)
    model.config.final_logit_softcapping = softcap
    model.config.logit_scale = scale
    add_fused_lm_head(model, temperature=temperature, outputs=outputs)
    out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    (out.loss + (out.entropy.sum() / 100 if out.entropy is not None else 0)).backward()
    fields = {k: getattr(out, k).detach().double() for k in ("log_probs", *outputs) if getattr(out, k) is not None}
    if active_plan() is None:
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    else:
        grads = hp_lazy.full_grads(model)
    result = {"fields": fields, "loss": out.loss.detach()}
    if rank == 0:
        result["grads"] = grads
    return result


def counted_fused_head(rank: int, world: int, path: str, ids) -> dict[str, dict[str, int]]:
    """Collectives and their payload of one fused-head call and backward on a bound model, the
    lowered backbone's excluded (counted apart on the same call without the head)."""
    from trl.trainer.utils import add_fused_lm_head

    import hp_lazy

    model = hp_lazy.parallelize(trainwork.parity._load(path))
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    with hp_lazy.collective_counter() as whole:
        model(input_ids=ids, labels=ids, fused_lm_head=True).loss.backward()
    with hp_lazy.collective_counter() as backbone:
        model.model(input_ids=ids).last_hidden_state.sum().backward()
    return {"whole": dict(whole.payload), "backbone": dict(backbone.payload)}


def sft_local_aux(rank: int, world: int, path: str, out: str) -> dict[str, Any]:
    """Negative control under ep: TRL's aux loss through Mixtral's function on this rank's rows."""
    import contextlib

    from hp_lazy.integrations import trl as integration

    routed = integration._global_aux
    integration._global_aux = lambda model: contextlib.nullcontext()
    try:
        return sft(rank, world, path, out)
    finally:
        integration._global_aux = routed


def reward(rank: int, world: int, path: str, out: str) -> dict[str, Any]:
    """``RewardTrainer`` on a sequence classifier loaded from the causal LM at ``path`` (its one-label
    ``score`` head new: drawn with seed 0 on rank 0, another seed on every other rank), 3 SGD steps:
    the logged loss, grad norm and accuracy per step, rank 0 the parameters."""
    import torch
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    torch.manual_seed(0 if rank == 0 else 100 + rank)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, pad_token_id=0, dtype=torch.float32)
    args = RewardConfig(
        output_dir=out, per_device_train_batch_size=trainwork.GLOBAL_BATCH // trainwork._dp_size(), max_steps=3, logging_steps=1,
        report_to=[], optim="sgd", learning_rate=0.1, weight_decay=0.01, save_strategy="no", use_cpu=True,
        disable_tqdm=True, dataset_num_proc=None, seed=0, bf16=False, max_length=SEQ + 2,
    )
    run = RewardTrainer(model=model, args=args, train_dataset=_preferences(), processing_class=tokenizer())
    return _trained(rank, run, model)


def _preferences():
    """8 rows of prompt (5 tokens) / chosen / rejected (6 tokens each) texts."""
    from datasets import Dataset

    ids = models.batch(seed=5, batch_size=8, seq=17).tolist()
    text = [[f"t{i}" for i in row] for row in ids]
    return Dataset.from_dict({"prompt": [" ".join(r[:5]) for r in text], "chosen": [" ".join(r[5:11]) for r in text],
                              "rejected": [" ".join(r[11:]) for r in text]})


SKIP_LOGGED = ("learning_rate", "epoch", "step", "num_tokens", "step_time")


def dpo(rank: int, world: int, path: str, out: str, pad_to: int | None = None) -> dict[str, Any]:
    """``DPOTrainer(model=..., args=DPOConfig(...), train_dataset=...).train()``, 2 steps (the reference
    model loaded by TRL from the same checkpoint): every logged number per step, rank 0 the parameters."""
    from trl import DPOConfig, DPOTrainer

    import hp_lazy
    from hp_lazy.api import active_plan

    model = trainwork.parity._load(path)
    dp = hp_lazy.mesh().group("dp").size if active_plan() is not None else 1
    args = DPOConfig(
        output_dir=out, per_device_train_batch_size=trainwork.GLOBAL_BATCH // dp, max_steps=2, logging_steps=1,
        report_to=[], optim="sgd", learning_rate=0.1, weight_decay=0.01, save_strategy="no", use_cpu=True,
        disable_tqdm=True, bf16=False, seed=0, dataset_num_proc=None, pad_to_multiple_of=pad_to,
    )
    run = DPOTrainer(model=model, args=args, train_dataset=_preferences(), processing_class=tokenizer())
    return _trained(rank, run, model)


def compare_logged(got: dict[str, Any], ref: dict[str, Any], tol: float = 1e-5,
                   nats: tuple[str, ...] = ("kl",)) -> dict[str, float]:
    """Every logged number and (when given) every parameter. DPO's rewards are beta times a difference
    of log-probabilities (~40 here) and their margins a difference of those: their errors are
    relative to that scale, not to their own small values. The divergences in ``nats`` (GRPO's KL
    after a step, near 1e-5 nats; a distillation loss) are sums of log-probability differences that
    nearly cancel, so fp32 puts ~1e-4 relative error on them in one process (TRL's own kernel against
    float64): their errors are taken in nats, on the scale of the logged entropy."""
    assert set(got) - {"state"} == set(ref) - {"state"}, set(got) ^ set(ref)
    errors = {k: models.rel_err(got[k], v) for k, v in ref.items() if k != "state" and not k.startswith("rewards/")}
    scale = 0.1 * float(ref["logps/chosen"].abs().max()) if "logps/chosen" in ref else 1.0
    errors.update({k: float((got[k] - v).abs().max()) / scale for k, v in ref.items() if k.startswith("rewards/")})
    if float(ref["loss"].abs().max()) < tol:  # zero by construction (RLOO: each group's advantages sum to zero)
        errors["loss"] = float((got["loss"] - ref["loss"]).abs().max())
    for name in (n for n in nats if n in ref and "entropy" in ref):
        errors[name] = float((got[name] - ref[name]).abs().max()) / float(ref["entropy"].abs().max())
    if "state" in got:
        errors.update({f"param {n}": models.rel_err(got["state"][n], v) for n, v in ref["state"].items()})
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"relative errors above {tol}: {dict(list(bad.items())[:6])}"
    return errors


def _reward(prompts: Any, completions: Any, **kwargs: Any) -> list[float]:
    """A reward that tells completions apart: the number of distinct tokens in the completion."""
    return [float(len(set(str(c).split()))) for c in completions]


def _prompts():
    from datasets import Dataset

    ids = models.batch(seed=7, batch_size=8, seq=6).tolist()
    return Dataset.from_dict({"prompt": [" ".join(f"t{i}" for i in row) for row in ids]})


def _generating_args(out: str, **more: Any) -> dict[str, Any]:
    """The config fields of a generating trainer's 2-step run: a global batch of 4 prompts over the
    data-parallel processes (hp_lazy's dp ranks under a plan, every rank of a plain run)."""
    import torch.distributed as dist

    import hp_lazy
    from hp_lazy.api import active_plan

    dp = (hp_lazy.mesh().group("dp").size if active_plan() is not None
          else dist.get_world_size() if dist.is_initialized() else 1)
    return dict(output_dir=out, per_device_train_batch_size=trainwork.GLOBAL_BATCH // dp, max_completion_length=6,
                max_steps=2, logging_steps=1, report_to=[], optim="sgd", learning_rate=0.1, weight_decay=0.01,
                save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False, seed=0, **more)


def online(rank: int, world: int, path: str, out: str, trainer: str = "GRPO", num_generations: int = 2,
           use_vllm: bool = False, lora: dict[str, Any] | None = None, accumulation: int = 1,
           aux_coef: float | None = None) -> dict[str, Any]:
    """``GRPOTrainer`` or ``RLOOTrainer`` (``trainer``) with ``model.generate`` (sampling, seeded by
    accelerate per process) and a rule reward, 2 steps of a global batch of 4 completions per
    accumulation step: every logged number but the step time, rank 0 the parameters. A plain
    multi-process run (no plan) is data parallel over every rank. ``lora``: a ``LoraConfig``'s
    arguments, handed to TRL as ``peft_config`` (the reference model is the base, adapters off).
    ``aux_coef``: ``router_aux_loss_coef`` (None: the model config's)."""
    import torch
    import trl
    from peft import LoraConfig

    model = trainwork.parity._load(path)
    args = getattr(trl, f"{trainer}Config")(**_generating_args(
        out, num_generations=num_generations, beta=0.1, use_vllm=use_vllm, gradient_accumulation_steps=accumulation,
        router_aux_loss_coef=aux_coef))
    torch.manual_seed(7)  # the adapters' init, if any: the same draws in every process
    run = getattr(trl, f"{trainer}Trainer")(model=model, reward_funcs=_reward, args=args, train_dataset=_prompts(),
                                            processing_class=tokenizer(), peft_config=lora and LoraConfig(**lora))
    return _trained(rank, run, model)


def online_stock_gathers(rank: int, world: int, path: str, out: str, trainer: str, num_generations: int) -> Any:
    """Negative control: :func:`online` with the trainer's gathers and accelerator over every rank
    (hp_lazy's seed and batch sizing kept, so nothing is refused): each dp rank's completions are
    gathered tp times."""
    import importlib

    import accelerate.utils

    module = importlib.import_module(f"trl.trainer.{trainer.lower()}_trainer")
    cls = getattr(module, f"{trainer}Trainer")
    viewed = {n: f for n, f in vars(cls).items() if hasattr(f, "__wrapped__") and n != "__init__"}
    gathers = module.gather, module.gather_object
    module.gather, module.gather_object = accelerate.utils.gather, accelerate.utils.gather_object
    for name, fn in viewed.items():
        setattr(cls, name, fn.__wrapped__)
    try:
        return online(rank, world, path, out, trainer, num_generations)
    finally:
        module.gather, module.gather_object = gathers
        for name, fn in viewed.items():
            setattr(cls, name, fn)


def distill(rank: int, world: int, path: str, teacher: str, out: str, **config: Any) -> dict[str, Any]:
    """``DistillationTrainer``: the student generates (sampling, seeded per process) and matches a
    teacher's next-token distributions, 2 steps of a global batch of 4 prompts: every logged number
    but the step time, rank 0 the parameters. ``config``: more ``DistillationConfig`` fields
    (``beta``, ``temperature``)."""
    import trl

    args = trl.DistillationConfig(**_generating_args(out, **config))
    model = trainwork.parity._load(path)
    run = trl.DistillationTrainer(model=model, teacher_model=trainwork.parity._load(teacher), args=args,
                                  train_dataset=_prompts(), processing_class=tokenizer())
    return _trained(rank, run, model)


def divergence_loop(rank: int, world: int, path: str, teacher: str, ids, beta: float, count: bool = False,
                    **knobs: Any) -> dict[str, Any]:
    """A user loop on TRL's distillation loss (``_chunked_divergence_loss``, TRL's fused student and
    teacher heads) over both models' last hidden states, then backward; the loss, the entropy sum
    and, on rank 0, every full gradient of the student. ``knobs``: the loss's temperature, logit
    scales and softcaps. ``count``: instead, the collectives and their payload of the loss and its
    backward alone (the hidden states made leaves)."""
    import torch
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    import hp_lazy
    from hp_lazy.api import active_plan

    student, reference = trainwork.parity._load(path), trainwork.parity._load(teacher)
    hidden = student.model(input_ids=ids).last_hidden_state
    with torch.no_grad():
        teacher_hidden = reference.model(input_ids=ids).last_hidden_state
    mask = torch.ones(ids.shape, dtype=torch.long)
    mask[0, :3] = 0  # prompt positions: out of the loss

    def loss_of(h: Any) -> Any:
        return _chunked_divergence_loss(h, teacher_hidden, student.lm_head.weight, reference.lm_head.weight, mask,
                                        beta, **knobs)

    if count:
        with hp_lazy.collective_counter() as counter:
            loss_of(hidden.detach().requires_grad_())[0].backward()
        return dict(counter.payload)
    loss, entropy_sum, _ = loss_of(hidden)
    loss.backward()
    grads = ({n: p.grad.detach().clone() for n, p in student.named_parameters()} if active_plan() is None
             else hp_lazy.full_grads(student))  # gathered by every rank
    return {"loss": loss.detach(), "entropy": entropy_sum, **({"grads": grads} if rank == 0 else {})}


def distill_stock_kernel(rank: int, world: int, path: str, teacher: str, out: str) -> dict[str, Any]:
    """Negative control: :func:`distill` with TRL's own kernel on the vocab shards."""
    import trl.trainer.distillation_trainer as module

    routed = module.ChunkedDivergenceFunction
    module.ChunkedDivergenceFunction = routed.__wrapped__
    try:
        return distill(rank, world, path, teacher, out)
    finally:
        module.ChunkedDivergenceFunction = routed
