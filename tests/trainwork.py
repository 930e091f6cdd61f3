"""Runs shared by the Trainer and clipping test modules: the stock transformers ``Trainer`` and a
user loop with the stock ``torch.nn.utils.clip_grad_norm_``, on the ranks of a pool (under an
active plan) and in the pytest process (one process, plain transformers: the reference).

Every run sees one global batch: the dp ranks split it, the ranks of a tp group read the same
rows (the Trainer's data loader does it through hp_lazy's accelerate integration).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import dpwork
import models
import parity

GLOBAL_BATCH = 4
TOL = {"sgd": parity.TOL, "adamw_torch": 1e-4}
"""AdamW divides by sqrt(v) + eps: fp32 round-off in a small gradient entry moves its update by
much more than its relative size. Seen: hp_lazy vs one process 4.6e-5 (one parameter, 3 steps);
one process against itself with gradient accumulation 2 instead of 1 (same math, other
summation order) 2.5e-5; SGD 5.7e-8."""
ROWS = 16  # the data set: 4 global batches of 4 rows x 16 tokens


def _dp_size() -> int:
    import hp_lazy
    from hp_lazy.api import active_plan

    return hp_lazy.mesh().group("dp").size if active_plan() is not None else 1


class Rows:
    """A map-style data set of causal-LM rows (input_ids = labels)."""

    def __init__(self) -> None:
        self.ids = models.batch(seed=3, batch_size=ROWS)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def shifted_ce(outputs, labels, num_items_in_batch=None):
    """A ``compute_loss_func``: next-token cross-entropy from ``outputs.logits``, summed over the
    global count of labels when the Trainer passes it (as transformers' own causal-LM loss)."""
    import torch.nn.functional as F

    logits, targets = outputs["logits"][:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten()
    if num_items_in_batch is None:
        return F.cross_entropy(logits, targets)
    return F.cross_entropy(logits, targets, reduction="sum") / num_items_in_batch


def trainer(rank: int, world: int, path: str, out: str, optim: str = "sgd", ga: int = 1,
            parallelize: bool = False, max_grad_norm: float = 1.0, data_parallel: bool | None = None,
            lora: bool = False, gradient_checkpointing: bool = False, torch_compile: str | None = None,
            label_smoothing: float = 0.0, loss_func: bool = False) -> dict[str, Any]:
    """``Trainer(model=model, args=TrainingArguments(...), train_dataset=...).train()``, 3 steps;
    every rank returns its log (loss and grad_norm per step), rank 0 the full parameters too.
    ``lora``: the model is PEFT's ``get_peft_model`` of the loaded one (adapters trained, base frozen);
    ``torch_compile``: ``TrainingArguments(torch_compile=True, torch_compile_backend=...)``;
    ``label_smoothing``: ``label_smoothing_factor``, and ``loss_func``: ``compute_loss_func=shifted_ce``
    (both compute the loss outside the model, from the logits)."""
    import test_peft
    import torch
    from transformers import Trainer, TrainingArguments

    import hp_lazy

    model = parity._load(path)
    if lora:
        model = test_peft._peft(model)
    if parallelize or data_parallel is not None:
        hp_lazy.parallelize(model, data_parallel=data_parallel)  # False: torch DDP over the dp group
    lr = 0.1 if optim == "sgd" else 1e-3
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // (_dp_size() * ga), gradient_accumulation_steps=ga,
        max_steps=3, logging_steps=1, report_to=[], optim=optim, learning_rate=lr, weight_decay=0.01,
        max_grad_norm=max_grad_norm, save_strategy="no", use_cpu=True, disable_tqdm=True,
        gradient_checkpointing=gradient_checkpointing, label_smoothing_factor=label_smoothing,
        include_num_input_tokens_seen="all",
        **({"torch_compile": True, "torch_compile_backend": torch_compile} if torch_compile else {}),
    )
    run = Trainer(model=model, args=args, train_dataset=Rows(), compute_loss_func=shifted_ce if loss_func else None)
    run.train()
    logged = [h for h in run.state.log_history if "loss" in h]
    result: dict[str, Any] = {
        "loss": torch.tensor([h["loss"] for h in logged], dtype=torch.float64),
        "grad_norm": torch.tensor([h["grad_norm"] for h in logged], dtype=torch.float64),
        "tokens": [h["num_input_tokens_seen"] for h in logged],
        "wrapped": type(run.model_wrapped).__name__,
        "total_batch": run.get_total_train_batch_size(args),
    }
    state = hp_lazy.full_state_dict(model)
    if rank == 0:
        result["state"] = state
    return result


class FewRows(Rows):
    """6 rows: the last evaluation batch of 4 is cut to 2 (``gather_for_metrics``'s remainder)."""

    def __init__(self, rows: int = 6) -> None:
        super().__init__()
        self.rows = rows

    def __len__(self) -> int:
        return self.rows


def token_metrics(prediction) -> dict[str, float]:
    """A ``compute_metrics``: next-token accuracy and the mean logit, over every prediction."""
    logits, labels = _logits(prediction.predictions), prediction.label_ids
    return {"accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean()), "mean_logit": float(logits.mean())}


def predict(rank: int, world: int, path: str, out: str, stock: bool = False, rows: int = 6) -> dict[str, Any]:
    """``Trainer(..., compute_metrics=token_metrics)``: ``.evaluate()``'s metrics and ``.predict()``'s
    logits, on :class:`FewRows` (the last global batch cut). ``stock``: ``.predict()``'s logits
    through the Trainer's own ``prediction_step``, without hp_lazy's (the negative control)."""
    import torch
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=out, per_device_eval_batch_size=GLOBAL_BATCH // _dp_size(), report_to=[],
                             use_cpu=True, disable_tqdm=True)
    run = Trainer(model=parity._load(path), args=args, eval_dataset=FewRows(rows), compute_metrics=token_metrics)
    if stock:  # the metrics would not run: the labels are whole, the logits cut
        run.compute_metrics = None
        with parity.swapped(Trainer, "prediction_step", Trainer.prediction_step.__wrapped__):
            return {"logits": torch.as_tensor(_logits(run.predict(FewRows(rows)).predictions))}
    metrics = run.evaluate()
    predicted = run.predict(FewRows(rows))
    return {"metrics": {k: metrics[f"eval_{k}"] for k in ("loss", "accuracy", "mean_logit")},
            "logits": torch.as_tensor(_logits(predicted.predictions)), "labels": torch.as_tensor(predicted.label_ids),
            "others": [torch.as_tensor(x) for x in _leaves(predicted.predictions) if x.ndim != 3]}


def _logits(predictions: Any) -> Any:
    """The logits, ``[rows, seq, vocab]``, among the predictions (an MoE's aux loss and router logits beside them)."""
    return next(leaf for leaf in _leaves(predictions) if leaf.ndim == 3)


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def compare_predictions(got: dict[str, Any], ref: dict[str, Any]) -> None:
    """:func:`predict` on a rank against one process's: every prediction field, the labels, the metrics."""
    assert len(got["others"]) == len(ref["others"]), (len(got["others"]), len(ref["others"]))
    for mine, want in zip([got["logits"], *got["others"]], [ref["logits"], *ref["others"]], strict=True):
        assert mine.shape == want.shape, (mine.shape, want.shape)
        assert models.rel_err(mine, want) <= parity.TOL
    assert bool((got["labels"] == ref["labels"]).all())
    for key, value in ref["metrics"].items():
        assert abs(got["metrics"][key] - value) <= parity.TOL * abs(value), (key, got["metrics"][key], value)


def evaluate(rank: int, world: int, path: str, out: str) -> float:
    """``Trainer(model=model, args=..., eval_dataset=...).evaluate()["eval_loss"]``."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=out, per_device_eval_batch_size=GLOBAL_BATCH // _dp_size(), report_to=[],
                             use_cpu=True, disable_tqdm=True)
    return float(Trainer(model=parity._load(path), args=args, eval_dataset=FewRows()).evaluate()["eval_loss"])


def compare_trainer(got: dict[str, Any], ref: dict[str, Any], tol: float = parity.TOL) -> dict[str, float]:
    errors = {"loss": models.rel_err(got["loss"], ref["loss"]), "grad_norm": models.rel_err(got["grad_norm"], ref["grad_norm"])}
    errors.update({f"param {n}": models.rel_err(got["state"][n], v) for n, v in ref["state"].items()})
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"relative errors above {tol}: {dict(list(bad.items())[:6])}"
    assert got["tokens"] == ref["tokens"], (got["tokens"], ref["tokens"])  # include_num_input_tokens_seen
    return errors


@contextlib.contextmanager
def stock_stack() -> Iterator[None]:
    """Negative control: accelerate's and torch's own functions, as before hp_lazy routed them."""
    import accelerate.accelerator as acc
    import transformers.trainer as trainer
    from torch.nn import utils
    from torch.nn.utils import clip_grad

    routed = [(acc.Accelerator, n) for n in ("prepare_model", "no_sync", "clip_grad_norm_", "gather_for_metrics")]
    routed += [(trainer.Trainer, "get_tp_size"), (acc, "prepare_data_loader"), (clip_grad, "_get_total_norm"),
               (utils, "get_total_norm")]
    saved = [getattr(owner, name) for owner, name in routed]
    try:
        for (owner, name), fn in zip(routed, saved, strict=True):
            setattr(owner, name, fn.__wrapped__)
        yield
    finally:
        for (owner, name), fn in zip(routed, saved, strict=True):
            setattr(owner, name, fn)


def stock_trainer(rank: int, world: int, path: str, out: str) -> dict[str, Any]:
    with stock_stack():
        return trainer(rank, world, path, out, parallelize=True)


def trainer_stock_loss(rank: int, world: int, path: str, out: str) -> dict[str, Any]:
    """Negative control: the Trainer's own ``compute_loss``, which weighs an MoE's aux loss once per
    rank reading different rows."""
    import transformers.trainer as module

    routed = module.Trainer.compute_loss
    module.Trainer.compute_loss = routed.__wrapped__
    try:
        return trainer(rank, world, path, out)
    finally:
        module.Trainer.compute_loss = routed


def clip_loop(rank: int, world: int, path: str, norm_type: float, max_norm: float = 0.5,
              wrap: str = "hp") -> dict[str, Any]:
    """A user loop: forward, backward, ``torch.nn.utils.clip_grad_norm_``; the total norm on every
    rank, what torch's unrouted function says on this rank (the old, wrong number), and the
    clipped full gradients on rank 0."""
    import torch
    from torch.nn.utils import clip_grad

    import hp_lazy

    model = _loop_model(path, data_parallel=(wrap == "hp"))
    ids = models.batch(seed=3, batch_size=ROWS)[:GLOBAL_BATCH]
    dp = hp_lazy.mesh().group("dp") if world > 1 else None
    mine = ids.chunk(dp.size)[dp.rank] if dp is not None else ids
    net = dpwork._wrapped(model, wrap) if world > 1 else model  # "ddp"/"fsdp" over the dp group
    net(input_ids=mine, labels=mine).loss.backward()
    unrouted = getattr(clip_grad._get_total_norm, "__wrapped__", clip_grad._get_total_norm)
    local = unrouted([p.grad for p in model.parameters() if p.grad is not None], norm_type)
    total = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm, norm_type=norm_type)
    result = {"norm": float(total), "local": float(local)}
    grads = hp_lazy.full_grads(model) if world > 1 else {n: p.grad.clone() for n, p in model.named_parameters()}
    if rank == 0:
        result["grads"] = grads
    return result


def _loop_model(path: str, data_parallel: bool = True):
    import hp_lazy
    from hp_lazy.api import active_plan

    model = parity._load(path)
    return hp_lazy.parallelize(model, data_parallel=data_parallel) if active_plan() is not None else model


def compare_clip(got: list[dict[str, Any]], ref: dict[str, Any]) -> float:
    """Every rank's norm equals one process's; rank 0's clipped full gradients too."""
    for r in got:
        assert abs(r["norm"] - ref["norm"]) <= parity.TOL * ref["norm"], (r["norm"], ref["norm"])
    errors = {n: models.rel_err(got[0]["grads"][n], g) for n, g in ref["grads"].items()}
    bad = {k: v for k, v in errors.items() if not v <= parity.TOL}
    assert not bad, f"clipped gradients off: {dict(list(bad.items())[:4])}"
    return max(abs(r["norm"] - ref["norm"]) / ref["norm"] for r in got)


def clip_under_no_sync(rank: int, world: int, path: str) -> str:
    """Clipping gradients hp_lazy has not reduced over dp yet is refused."""
    import torch

    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    ids = models.batch(seed=3, batch_size=2)
    with hp_lazy.no_sync(model):
        model(input_ids=ids, labels=ids).loss.backward()
    error = _raised(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    model(input_ids=ids, labels=ids).loss.backward()  # reduces what was accumulated
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return error


def clip_errors(rank: int, world: int, path: str) -> dict[str, str]:
    """The refusals: a call mixing foreign tensors, under no_sync, norm_type 0."""
    import torch

    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    ids = models.batch(seed=3, batch_size=2)
    found = {}
    with hp_lazy.no_sync(model):
        model(input_ids=ids, labels=ids).loss.backward()
    found["no_sync"] = _raised(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    model(input_ids=ids, labels=ids).loss.backward()  # reduces what was accumulated
    foreign = torch.nn.Parameter(torch.ones(3))
    foreign.grad = torch.ones(3)
    found["foreign"] = _raised(lambda: torch.nn.utils.clip_grad_norm_([*model.parameters(), foreign], 1.0))
    found["norm0"] = _raised(lambda: hp_lazy.clip_grad_norm_(model.parameters(), 1.0, norm_type=0))
    plain = torch.nn.utils.clip_grad_norm_([foreign], 1.0)  # no hp_lazy gradient: torch's own
    found["plain"] = f"{float(plain):.6f}"
    return found


def _raised(fn) -> str:
    from hp_lazy.errors import ShardingError

    try:
        fn()
    except ShardingError as err:
        return str(err)
    return "no error"


def dispatching_loader(rank: int, world: int) -> None:
    """accelerate's dispatcher splits batches over all ranks: refused under a tp plan."""
    import torch
    from accelerate import Accelerator, DataLoaderConfiguration

    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True)).prepare(loader)


def trainer_after_deactivate(rank: int, world: int, path: str, out: str) -> dict[str, Any]:
    """The model's module was lowered, then the plan deactivated: the Trainer still shards the
    data by the mesh the module was lowered for."""
    import warnings

    import hp_lazy
    from hp_lazy.api import active_plan

    plan = active_plan()
    hp_lazy.deactivate()
    try:
        return trainer(rank, world, path, out)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the lowered module stays imported
            hp_lazy.activate(plan)



def trainer_checkpoint(rank: int, world: int, path: str, out: str) -> dict[str, Any]:
    """2 SGD steps with a ``save_steps=2``, ``save_only_model=True`` checkpoint (every rank); the
    checkpoint's tensors against the trained model's full state dict."""
    import os

    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import Trainer, TrainingArguments

    import hp_lazy

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // _dp_size(), max_steps=2,
                             report_to=[], optim="sgd", learning_rate=0.1, save_strategy="steps", save_steps=2,
                             use_cpu=True, disable_tqdm=True, save_only_model=True)
    model = parity._load(path)
    Trainer(model=model, args=args, train_dataset=Rows()).train()
    full = hp_lazy.full_state_dict(model)
    dist.barrier()
    saved = load_file(os.path.join(out, "checkpoint-2", "model.safetensors"))
    assert set(saved) <= set(full), sorted(set(saved) - set(full))
    equal = max(float((saved[k] - full[k]).abs().max()) for k in saved)
    files = sorted(f for f in os.listdir(os.path.join(out, "checkpoint-2")) if not f.startswith(("trainer_", "rng_")))
    return {"equal": equal, "files": files}


def trainer_resume(rank: int, world: int, path: str, out: str, optim: str = "adamw_torch",
                   old_optimizer_pt: bool = False, lora: bool = False) -> dict[str, Any]:
    """The stock ``save_steps`` / ``resume_from_checkpoint`` cycle: 4 steps with a checkpoint every
    2 (model, optimizer, scheduler, RNG), then a fresh model and Trainer resumed from
    ``checkpoint-2`` to step 4. Both runs' logs (steps 3 and 4 of the resumed one) and final
    parameters; the checkpoint's files. ``old_optimizer_pt``: the negative control, the Trainer's
    own main-process ``optimizer.pt`` (rank 0's plain shards, loaded by every rank). ``lora``: the
    model wrapped by :func:`epwork.lora` (adapters on attention and on the experts' tensors)."""
    import os

    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from transformers import Trainer, TrainingArguments

    import hp_lazy
    from hp_lazy.integrations.transformers import _optimizer_parts
    from hp_lazy.runtime.checkpoint.hooks import local_shards

    lr = 0.1 if optim == "sgd" else 1e-3
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // _dp_size(), max_steps=4, logging_steps=1,
        report_to=[], optim=optim, learning_rate=lr, weight_decay=0.01, save_strategy="steps", save_steps=2,
        use_cpu=True, disable_tqdm=True,
    )

    def run(resume: str | None) -> dict[str, Any]:
        model = parity._load(path)
        if lora:
            import epwork

            model = epwork.lora(model)
        trainer = Trainer(model=model, args=args, train_dataset=Rows())
        trainer.train(resume_from_checkpoint=resume)
        logged = [h for h in trainer.state.log_history if "loss" in h]
        return {"loss": torch.tensor([h["loss"] for h in logged], dtype=torch.float64),
                "step": [h["step"] for h in logged], "state": hp_lazy.full_state_dict(model)}

    import transformers.trainer as trainer_module

    cls = trainer_module.Trainer
    routed = ("_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler")
    saved = [getattr(cls, name) for name in routed]
    if old_optimizer_pt:
        for name, fn in zip(routed, saved, strict=True):
            stock = getattr(fn, "__wrapped__", fn)

            def in_local_shards(self: Any, where: Any, stock: Any = stock) -> Any:
                if where is not None and stock.__name__.startswith("_load"):
                    get_optimizer_state_dict(*_optimizer_parts(self))  # a zero step: hp_lazy sees the optimizer
                with local_shards():
                    return stock(self, where)

            setattr(cls, name, in_local_shards)
    try:
        straight = run(None)
        resumed = run(os.path.join(out, "checkpoint-2"))
    finally:
        for name, fn in zip(routed, saved, strict=True):
            setattr(cls, name, fn)
    result: dict[str, Any] = {"straight": straight, "resumed": resumed,
                              "files": sorted(os.listdir(os.path.join(out, "checkpoint-2")))}
    if rank != 0:
        del straight["state"], resumed["state"]
    return result


def compare_resume(got: dict[str, Any], ref: dict[str, Any], tol: float) -> dict[str, float]:
    """The resumed run (its log: steps 1-2 restored from the checkpoint, 3-4 trained; final
    parameters) and the straight one against one process's straight run."""
    errors = {"straight loss": models.rel_err(got["straight"]["loss"], ref["straight"]["loss"]),
              "resumed loss": models.rel_err(got["resumed"]["loss"], ref["straight"]["loss"])}
    for run in ("straight", "resumed"):
        errors.update({f"{run} {n}": models.rel_err(got[run]["state"][n], v) for n, v in ref["straight"]["state"].items()})
    assert got["resumed"]["step"] == [1, 2, 3, 4], got["resumed"]["step"]  # 1-2 from trainer_state.json
    bad = {k: v for k, v in errors.items() if not v <= tol}
    # the same ranks resumed and straight: the same arithmetic, so AdamW's round-off cannot hide a lost state
    itself = {n: models.rel_err(got["resumed"]["state"][n], v) for n, v in got["straight"]["state"].items()}
    bad.update({f"resumed against straight {n}": v for n, v in itself.items() if not v <= parity.TOL})
    assert not bad, f"relative errors above {tol}: {dict(list(bad.items())[:6])}"
    return errors


def trainer_resume_only(rank: int, world: int, path: str, checkpoint: str, out: str | None = None,
                        optim: str = "adamw_torch") -> dict[str, Any]:
    """``Trainer.train(resume_from_checkpoint=checkpoint)`` with the run's arguments (output in
    ``out``, else beside the checkpoint): its log and, on rank 0, the final parameters."""
    import os

    import torch
    from transformers import Trainer, TrainingArguments

    import hp_lazy

    args = TrainingArguments(
        output_dir=out or os.path.dirname(checkpoint), per_device_train_batch_size=GLOBAL_BATCH // _dp_size(),
        max_steps=4, logging_steps=1, report_to=[], optim=optim, learning_rate=0.1 if optim == "sgd" else 1e-3,
        weight_decay=0.01, save_strategy="no", use_cpu=True, disable_tqdm=True,
    )
    model = parity._load(path)
    trainer = Trainer(model=model, args=args, train_dataset=Rows())
    trainer.train(resume_from_checkpoint=checkpoint)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    state = hp_lazy.full_state_dict(model)
    return {"loss": torch.tensor([h["loss"] for h in logged], dtype=torch.float64),
            "step": [h["step"] for h in logged], "state": state if rank == 0 else None}


def parameter_counts(rank: int, world: int, path: str) -> list[int]:
    """``num_parameters`` (plain, and trainable without embeddings) and the Trainer's logged count
    (``get_model_param_count``) of the loaded model, bound when a plan is active."""
    import transformers.trainer as trainer

    import hp_lazy
    from hp_lazy.api import active_plan

    model = parity._load(path)
    if active_plan() is not None:
        hp_lazy.parallelize(model)
    return [model.num_parameters(), model.num_parameters(only_trainable=True, exclude_embeddings=True),
            trainer.get_model_param_count(model, trainable_only=True), sum(p.numel() for p in model.parameters())]
