"""The transformers ``Trainer``'s own bookkeeping of ranks that share a batch, for an hp_lazy model.

``Trainer.get_tp_size()`` is the Trainer's notion of how many ranks read the same rows: it divides
the world by it for the global batch size (the "Total train batch size" it logs, its samples per
second), for the token count of a step (gathered over every rank) and for the loss scale
(``num_processes // tp_size``). It reads ``model._tp_size``, which transformers sets only when it
sharded the model itself, and which would also send accelerate down its own TP route (refused on
CPU; see :mod:`hp_lazy.integrations.accelerate`). So, installed by ``activate`` when
``transformers.trainer`` is imported, ``get_tp_size`` answers ``world / dp`` (the ranks of one tp x
cp group) for a model hp_lazy lowered, when the Trainer knows no other tensor parallelism. The
token count and the loss scale change together, so the gradient is the same either way; the
counts the Trainer reports become one process's (``num_input_tokens_seen``, which sums every
process's batch, is divided by it too).

Checkpoints: the Trainer saves the model on the main process only, but an hp_lazy model's
``save_pretrained`` gathers its shards (a collective), so ``_save`` makes the other ranks join it
(they write nothing). Its ``optimizer.pt`` is written by the main process alone, which for
parameters sharded over tp would hold rank 0's shards only and resume wrong. So for such a model
``_save_optimizer_and_scheduler`` writes the optimizer state with ``torch.distributed.checkpoint``
on every rank (``checkpoint-N/optimizer_dcp``: torch's ``get_optimizer_state_dict`` sees each
state as a DTensor over its shard, :mod:`hp_lazy.runtime.checkpoint`), the scheduler as the
Trainer does; ``_load_optimizer_and_scheduler`` reads it back with ``dcp.load`` (which reshards:
a checkpoint saved at another layout resumes too). ``resume_from_checkpoint`` then continues one
process's run: the model from ``model.safetensors`` (full tensors, sliced on load), the optimizer
and scheduler from there, RNG and data order as the Trainer keeps them. A one-process checkpoint's
``optimizer.pt`` holds whole states: it is loaded as the Trainer loads it, and each rank's optimizer
keeps its shards' slices (hp_lazy adopts the optimizer at its first step). Refused, naming the fix:
a checkpoint whose only optimizer state is a main-process ``optimizer.pt`` of this model's shards
(rank 0's), told apart by the states' shapes. Expert
slices cut over ep are presented the same way (on the expert mesh), so an ep model checkpoints too.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from hp_lazy.errors import ShardingError
from hp_lazy.integrations.accelerate import lowered, sharing_degrees
from hp_lazy.names import PATCHED
from hp_lazy.runtime.ep.aux import text_config
from hp_lazy.runtime.mesh import get_mesh
from hp_lazy.runtime.outputs import whole as whole_outputs

Degrees = Callable[[], "Mapping[str, int] | None"]


def install(module: ModuleType, degrees: Degrees) -> None:
    """Patch ``module`` (``transformers.trainer``) once."""
    cls = module.Trainer
    if getattr(cls, PATCHED, False):
        return
    cls.get_tp_size = _get_tp_size(cls.get_tp_size, degrees)
    cls.compute_loss = _compute_loss(cls.compute_loss)
    cls.prediction_step = _prediction_step(cls.prediction_step)
    if hasattr(cls, "_track_num_input_tokens"):
        cls._track_num_input_tokens = _track_num_input_tokens(cls._track_num_input_tokens)
    cls._save = _save(cls._save)
    cls._save_optimizer_and_scheduler = _save_optimizer(cls._save_optimizer_and_scheduler, degrees)
    cls._load_optimizer_and_scheduler = _load_optimizer(cls._load_optimizer_and_scheduler, degrees)
    module.get_model_param_count = _param_count(module.get_model_param_count)  # type: ignore[attr-defined]
    setattr(cls, PATCHED, True)


def install_modeling(module: ModuleType) -> None:
    """``PreTrainedModel`` of ``module`` (``transformers.modeling_utils``), once: ``num_parameters``
    counts one process's parameters for a model hp_lazy bound (not this rank's shards), the
    gradient-checkpointing function a model is given recomputes inside the context-parallel call
    state of its forward (:func:`hp_lazy.runtime.cp.state.carried`), and ``post_init`` records
    which model each module was built in (:func:`hp_lazy.runtime.record.mark_built`)."""
    cls = module.PreTrainedModel
    if getattr(cls, PATCHED, False):
        return
    cls.num_parameters = _num_parameters(cls.num_parameters)
    cls._set_gradient_checkpointing = _set_gradient_checkpointing(cls._set_gradient_checkpointing)
    cls.post_init = _post_init(cls.post_init)
    setattr(cls, PATCHED, True)


def _post_init(stock: Callable[..., None]) -> Callable[..., None]:
    """Each model's ``post_init`` (the end of its ``__init__``) marks its modules as built in it:
    the outermost model's runs last, so a backbone's first forward binds the whole model."""

    @functools.wraps(stock)
    def post_init(self: Any) -> None:
        from hp_lazy.runtime.record import mark_built

        stock(self)
        mark_built(self)

    return post_init


def _set_gradient_checkpointing(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def _set_gradient_checkpointing(self: Any, enable: bool = True, gradient_checkpointing_func: Any = None,
                                    **kwargs: Any) -> Any:
        from hp_lazy.runtime.cp.state import carried

        if gradient_checkpointing_func is None:
            return stock(self, enable, **kwargs)
        return stock(self, enable, carried(gradient_checkpointing_func), **kwargs)

    return _set_gradient_checkpointing


def _num_parameters(stock: Callable[..., int]) -> Callable[..., int]:

    @functools.wraps(stock)
    def num_parameters(self: Any, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        from hp_lazy.runtime.record import unsharded_extra

        count = stock(self, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
        return count + unsharded_extra(self, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)

    return num_parameters


def _param_count(stock: Callable[..., int]) -> Callable[..., int]:
    """The Trainer's "Number of trainable parameters" log: one process's count."""

    @functools.wraps(stock)
    def get_model_param_count(model: Any, trainable_only: bool = False) -> int:
        from hp_lazy.runtime.record import unsharded_extra

        return stock(model, trainable_only=trainable_only) + unsharded_extra(model, only_trainable=trainable_only)

    return get_model_param_count


OPTIMIZER_DIR = "optimizer_dcp"
"""Where, in a Trainer checkpoint, hp_lazy writes the optimizer state of a tp- or ep-sharded model."""
_OPTIMIZER_PT = "optimizer.pt"
_SCHEDULER_PT = "scheduler.pt"


def _cut_over(degrees: Mapping[str, int] | None, axis: str) -> bool:
    return degrees is not None and int(degrees.get(axis, 1)) > 1


def _sharded(trainer: Any, degrees: Degrees) -> Mapping[str, int] | None:
    """The degrees when the Trainer's model is an hp_lazy model with parameters cut over tp or ep
    (and no DeepSpeed / FSDP plugin, which checkpoint their own way); else ``None``."""
    if trainer.model is None or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        return None
    active = sharing_degrees(degrees())
    if not (_cut_over(active, "tp") or _cut_over(active, "ep")) or not lowered(trainer.model):
        return None
    return active


def _optimizer_parts(trainer: Any) -> tuple[Any, Any]:
    """The bare model and optimizer (accelerate's wrappers off): the FQNs torch's
    ``get_optimizer_state_dict`` keys states by are the model's own."""
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    return model, getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def _save_optimizer(stock: Callable[..., Any], degrees: Degrees) -> Callable[..., Any]:
    @functools.wraps(stock)
    def _save_optimizer_and_scheduler(self: Any, output_dir: str) -> None:
        if _sharded(self, degrees) is None:
            return stock(self, output_dir)
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        model, optimizer = _optimizer_parts(self)
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=os.path.join(output_dir, OPTIMIZER_DIR))  # every rank writes its shards
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_PT))
        return None

    return _save_optimizer_and_scheduler


def _load_optimizer(stock: Callable[..., Any], degrees: Degrees) -> Callable[..., Any]:
    @functools.wraps(stock)
    def _load_optimizer_and_scheduler(self: Any, checkpoint: str | None) -> None:
        if checkpoint is None or _sharded(self, degrees) is None:
            return stock(self, checkpoint)
        import torch

        folder = os.path.join(checkpoint, OPTIMIZER_DIR)
        model, optimizer = _optimizer_parts(self)
        if os.path.isdir(folder):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

            state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
            dcp.load(state, checkpoint_id=folder)  # into this rank's shards, from whatever layout was saved
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
        elif os.path.isfile(os.path.join(checkpoint, _OPTIMIZER_PT)):
            from hp_lazy.runtime.checkpoint.hooks import holds_full_states  # DTensor: imported once a model binds

            saved = torch.load(os.path.join(checkpoint, _OPTIMIZER_PT), map_location="cpu", weights_only=True)
            if holds_full_states(optimizer, saved) is False:
                raise ShardingError(
                    f"Trainer: resume_from_checkpoint={checkpoint!r} holds optimizer.pt, written by the main process "
                    "alone; for this model, whose parameters are sharded over tp, it holds rank 0's shards only and "
                    f"would resume wrong; resume from a checkpoint saved with the plan active (it writes "
                    f"{OPTIMIZER_DIR}/ with torch.distributed.checkpoint), or delete optimizer.pt to resume the "
                    "model alone with a fresh optimizer"
                )
            # one process's whole states: each rank keeps its shards' slices when the optimizer first steps
            optimizer.load_state_dict(saved)
        else:
            return stock(self, checkpoint)  # no optimizer state saved: the Trainer's own (it loads nothing)
        scheduler = os.path.join(checkpoint, _SCHEDULER_PT)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        return None

    return _load_optimizer_and_scheduler


def _save(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def _save(self: Any, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False) if self.model is not None else None
        if self.args.should_save or state_dict is not None or model is None or not lowered(model):
            return stock(self, output_dir, state_dict)
        # a non-writer rank: join save_pretrained's gathers (hp_lazy's collectives), write nothing
        model.save_pretrained(output_dir or self.args.output_dir, is_main_process=False)
        return None

    return _save


def _compute_loss(stock: Callable[..., Any]) -> Callable[..., Any]:
    """The MoE aux loss weighed once: the stock ``compute_loss`` multiplies the model's loss by the
    ranks that read different rows (``num_processes // tp_size``) to undo the dp average of a loss
    over the global token count, and the aux loss the model added to it (``router_aux_loss_coef *
    aux_loss``: one process's value on every rank, :mod:`hp_lazy.runtime.ep.aux`) with it, so the
    gradient and the logged loss held it that many times (at dp=2, coefficient 0.5: the loss 17%
    off). The surplus is taken back out: ``(scale - 1) * coef * aux_loss``."""

    @functools.wraps(stock)
    def compute_loss(self: Any, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        model_loss = "labels" in inputs and self.label_smoother is None and self.compute_loss_func is None
        own_loss = "labels" in inputs and not model_loss  # computed here, from the logits
        with whole_outputs() if own_loss else contextlib.nullcontext():
            loss, outputs = stock(self, model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        aux = outputs.get("aux_loss") if isinstance(outputs, Mapping) else None
        if aux is None or not model_loss or num_items_in_batch is None or not self.model_accepts_loss_kwargs \
                or not self.args.average_tokens_across_devices or not lowered(model):
            return (loss, outputs) if return_outputs else loss
        scale = self.accelerator.num_processes // self.get_tp_size() if self.args.n_gpu <= 1 else self.args.n_gpu
        if scale > 1:
            coef = getattr(text_config(self.accelerator.unwrap_model(model)), "router_aux_loss_coef", None)
            if coef is None:
                raise ShardingError(
                    f"{type(model).__name__}: Trainer multiplies the model's loss by {scale} (the ranks reading "
                    "different rows), the aux loss the model added to it too, and hp_lazy finds no "
                    "config.router_aux_loss_coef to take the surplus back out; set output_router_logits=False"
                )
            loss = loss - (scale - 1) * coef * aux
        return (loss, outputs) if return_outputs else loss

    return compute_loss


def _prediction_step(stock: Callable[..., Any]) -> Callable[..., Any]:
    """Predictions (``compute_metrics``, ``preprocess_logits_for_metrics``, ``Trainer.predict``) are
    one process's logits: the forward runs under :func:`hp_lazy.whole_outputs` (they would hold
    this rank's rows under context parallel, its vocab columns under loss parallel). An evaluation
    of the loss alone keeps them cut."""

    @functools.wraps(stock)
    def prediction_step(self: Any, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        with whole_outputs() if not prediction_loss_only else contextlib.nullcontext():
            return stock(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    return prediction_step


def _track_num_input_tokens(stock: Callable[..., None]) -> Callable[..., None]:
    """``include_num_input_tokens_seen``: the Trainer sums every process's batch, and the ranks of a
    tp x cp group read the same rows: each was counted ``get_tp_size()`` times (twice at tp=2)."""

    @functools.wraps(stock)
    def _track_num_input_tokens(self: Any, inputs: Any) -> None:
        before = self.state.num_input_tokens_seen
        stock(self, inputs)
        sharing = self.get_tp_size()
        if sharing > 1 and self.model is not None and lowered(self.model):
            self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // sharing

    return _track_num_input_tokens


def _get_tp_size(stock: Callable[..., int], degrees: Degrees) -> Callable[..., int]:
    @functools.wraps(stock)
    def get_tp_size(self: Any) -> int:
        size = stock(self)
        if size != 1 or self.model is None or not lowered(self.model):
            return size
        active = sharing_degrees(degrees())
        if active is None:
            return size
        mesh = get_mesh(dict(active))
        return mesh.world // mesh.group("dp").size

    return get_tp_size
