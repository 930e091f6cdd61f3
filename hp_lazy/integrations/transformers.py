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
counts the Trainer reports become one process's.

Checkpoints: the Trainer saves the model on the main process only, but an hp_lazy model's
``save_pretrained`` gathers its shards (a collective), so ``_save`` makes the other ranks join it
(they write nothing). Its ``optimizer.pt`` is written by the main process alone, which for
parameters sharded over tp or ep would hold rank 0's shards only and resume wrong: ``train``
refuses, before the first step, checkpoints with optimizer state (``save_only_model=False``) and
``resume_from_checkpoint`` for such a model, naming ``save_only_model=True`` and
``torch.distributed.checkpoint`` (which reshards, :mod:`hp_lazy.runtime.checkpoint`) instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from hp_lazy.errors import ShardingError
from hp_lazy.integrations.accelerate import lowered, sharing_degrees
from hp_lazy.names import PATCHED
from hp_lazy.runtime.mesh import get_mesh

Degrees = Callable[[], "Mapping[str, int] | None"]


def install(module: ModuleType, degrees: Degrees) -> None:
    """Patch ``module`` (``transformers.trainer``) once."""
    cls = module.Trainer
    if getattr(cls, PATCHED, False):
        return
    cls.get_tp_size = _get_tp_size(cls.get_tp_size, degrees)
    cls._save = _save(cls._save)
    cls.train = _train(cls.train, degrees)
    setattr(cls, PATCHED, True)


def _shards_parameters(degrees: Mapping[str, int] | None) -> bool:
    return degrees is not None and any(int(degrees.get(axis, 1)) > 1 for axis in ("tp", "ep"))


def _train(stock: Callable[..., Any], degrees: Degrees) -> Callable[..., Any]:
    @functools.wraps(stock)
    def train(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if self.model is not None and lowered(self.model) and _shards_parameters(sharing_degrees(degrees())):
            strategy = str(getattr(self.args.save_strategy, "value", self.args.save_strategy))
            saves_optimizer = strategy != "no" and not self.args.save_only_model
            if resume_from_checkpoint or saves_optimizer:
                what = (f"resume_from_checkpoint={resume_from_checkpoint!r}" if resume_from_checkpoint else
                        f"save_strategy={strategy!r} with save_only_model=False")
                raise ShardingError(
                    f"Trainer.train: {what} on an hp_lazy model whose parameters are sharded over tp/ep: the Trainer "
                    "writes optimizer.pt on the main process alone, which would hold rank 0's shards only and resume "
                    "wrong; pass save_only_model=True (the model is saved whole by save_pretrained on every rank) or "
                    "save_strategy='no', and checkpoint the optimizer with torch.distributed.checkpoint "
                    "(dcp.save(get_state_dict(model, optimizer)) reshards on load)"
                )
        return stock(self, resume_from_checkpoint, *args, **kwargs)

    return train


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
