"""TRL's generating trainers (``GRPOTrainer``, ``RLOOTrainer``, ``DistillationTrainer``) on a model
whose ranks share a batch.

These trainers take every process for a data-parallel one, which under tensor parallelism is
wrong in four places (the config's sizing: GRPO and RLOO; the rest: all three):

- ``set_seed(args.seed, device_specific=True)`` seeds each process with its ``process_index``, so
  the ranks of one tp group would sample different completions;
- the config sizes the generation batch by ``world_size``
  (``per_device_train_batch_size * world_size * steps_per_generation``), tp times too many rows;
- rewards, KL terms and token counts go through accelerate's ``gather`` / ``gather_object`` /
  ``reduce`` over every rank, which holds each dp rank's completions tp times. A group of
  ``num_generations`` completions that spans dp ranks is then normalised over the wrong rows
  (silently wrong advantages), and the token count that scales the loss is tp times too large;
- ``advantages[process_index * n : (process_index + 1) * n]`` picks a slice by global rank.

So the trainer sees the dp ranks as its processes. For a trainer or config built while a plan
shares batches (tp or cp > 1; :func:`hp_lazy.integrations.accelerate.data_group`):

- the config's ``__post_init__`` reads ``world_size`` as the dp size;
- ``set_seed(..., device_specific=True)`` in the trainer's module adds the dp rank;
- ``gather`` and ``gather_object`` in the trainer's module gather over the dp group: one copy of
  each dp rank's rows, the bytes of a dp-only run;
- while one of the trainer class's own methods runs, its accelerator answers ``process_index``
  and ``num_processes`` by dp, and ``gather`` / ``reduce`` go over the dp group
  (:class:`DataParallelView`, swapped in as the accelerator's class for the call).

The run is then the dp-only run of the same dp: one process's at dp = 1. The Trainer's own
methods (its loop, its loss scale through ``get_tp_size``) are untouched.

``DistillationTrainer`` also hands both models' ``lm_head`` weights to TRL's fused kernel
(``ChunkedDivergenceFunction``, looked up in its module): two heads cut over the same vocab rows go
to :func:`hp_lazy.runtime.tp.divergence.per_token` instead, whole heads to TRL's kernel, a mix is
refused.

Refused when the trainer is built, by name: context parallel (generation appends one token at a
time), vLLM generation (its weight sync would read this rank's shards), and a config built before
``activate`` (its generation batch sized for every rank).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

from hp_lazy.errors import ShardingError
from hp_lazy.integrations import ONLINE_CONFIGS, ONLINE_TRAINERS
from hp_lazy.integrations.accelerate import data_group, lowered, sharing_degrees
from hp_lazy.names import DP_VIEW, PATCHED
from hp_lazy.runtime.mesh import Group

Degrees = Callable[[], "Mapping[str, int] | None"]
KERNEL = "ChunkedDivergenceFunction"
"""The name ``trl.trainer.distillation_trainer`` calls its fused student/teacher head kernel by."""


def install_config(module: ModuleType, degrees: Degrees) -> None:
    """Size ``module``'s RL config's generation batch by the dp ranks."""
    cls = getattr(module, ONLINE_CONFIGS.get(module.__name__, ""), None)
    if cls is None or cls.__dict__.get(PATCHED, False):
        return
    stock = cls.__post_init__

    @functools.wraps(stock)
    def __post_init__(self: Any) -> None:
        dp = data_group(degrees())
        if dp is None:
            stock(self)
            return
        with _world_size(type(self), dp.size):
            stock(self)

    cls.__post_init__ = __post_init__
    setattr(cls, PATCHED, True)


@contextlib.contextmanager
def _world_size(cls: type, size: int) -> Iterator[None]:
    """``cls().world_size`` answers ``size`` for the block (TrainingArguments' property shadowed)."""
    own = cls.__dict__.get("world_size")
    cls.world_size = property(lambda self: size)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if own is None:
            del cls.world_size  # type: ignore[attr-defined]
        else:
            cls.world_size = own  # type: ignore[attr-defined]


def install_trainer(module: ModuleType, degrees: Degrees) -> None:
    """Give ``module``'s RL trainer the dp ranks as its processes (see the module docstring)."""
    cls = getattr(module, ONLINE_TRAINERS.get(module.__name__, ""), None)
    if cls is None or cls.__dict__.get(PATCHED, False):  # its own mark, not the Trainer's it inherits
        return
    for name, fn in list(vars(cls).items()):
        if inspect.isfunction(fn) and not name.startswith("__"):
            setattr(cls, name, _viewed_method(fn, degrees))
    cls.__init__ = _checked_init(cls, cls.__init__, degrees)
    for name, over in (("gather", dp_gather), ("gather_object", dp_gather_object)):  # those it imported
        if hasattr(module, name):
            setattr(module, name, _over_dp(getattr(module, name), degrees, over))
    if hasattr(module, "set_seed"):
        module.set_seed = _seeded_by_dp(module.set_seed, degrees)  # type: ignore[attr-defined]
    if hasattr(module, KERNEL):  # DistillationTrainer's fused student/teacher head
        setattr(module, KERNEL, _divergence_dispatcher(getattr(module, KERNEL)))
    setattr(cls, PATCHED, True)


def _divergence_dispatcher(stock: Any) -> type:
    class VocabParallelAware:
        """``apply`` like TRL's kernel; vocab-parallel when both heads are the same hp_lazy vocab shard."""

        __wrapped__ = stock

        @staticmethod
        def apply(student_hidden: Any, student_weight: Any, student_bias: Any, teacher_hidden: Any,
                  teacher_weight: Any, teacher_bias: Any, beta: float, temperature: float = 1.0,
                  student_logit_scale: float = 1.0, student_final_logit_softcapping: float | None = None,
                  teacher_logit_scale: float = 1.0, teacher_final_logit_softcapping: float | None = None) -> Any:
            from hp_lazy.runtime.tp import divergence, logprobs

            shard, teacher_shard = logprobs.shard_of(student_weight), logprobs.shard_of(teacher_weight)
            if shard is None and teacher_shard is None:
                return stock.apply(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                                   teacher_bias, beta, temperature, student_logit_scale,
                                   student_final_logit_softcapping, teacher_logit_scale,
                                   teacher_final_logit_softcapping)
            if shard is None or teacher_shard != shard:
                raise ShardingError(
                    f"DistillationTrainer: the student's lm_head weight is {_rows(shard, student_weight)} on this "
                    f"rank and the teacher's {_rows(teacher_shard, teacher_weight)}: the kernel needs both over the "
                    "same words; load the student and the teacher under the same hp_lazy plan (from_pretrained "
                    "after hp_lazy.activate)"
                )

            def transform(scale: float, softcap: float | None) -> logprobs.Transform:
                return logprobs.Transform(scale=scale, softcap=None if softcap is None else softcap or 1.0,
                                          inv_t=1 / temperature)  # a softcap of 0 as TRL reads it

            return divergence.per_token(
                student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, shard,
                beta, transform(student_logit_scale, student_final_logit_softcapping),
                transform(teacher_logit_scale, teacher_final_logit_softcapping),
            )

    setattr(VocabParallelAware, PATCHED, True)
    return VocabParallelAware


def _rows(shard: Any, weight: Any) -> str:
    if shard is None:
        return f"whole ({weight.shape[0]} rows)"
    return f"rows {shard.start}..{shard.start + weight.shape[0] - 1} of {shard.vocab}"


def _checked_init(cls: type, stock: Callable[..., None], degrees: Degrees) -> Callable[..., None]:
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        shared = {a: n for a, n in (sharing_degrees(degrees()) or {}).items() if a in ("tp", "cp") and n > 1}
        config = signature.bind_partial(self, *args, **kwargs).arguments.get("args")
        if shared and getattr(config, "use_vllm", False):  # before TRL starts vLLM
            raise ShardingError(
                f"{cls.__name__}: use_vllm=True sends this model's parameters to vLLM, and under hp_lazy's "
                f"{shared} each rank holds only its shards; generate with transformers (use_vllm=False)"
            )
        stock(self, *args, **kwargs)
        if shared and lowered(self.model):
            _refuse(cls.__name__, self.args, shared, data_group(degrees()))

    return __init__


def _refuse(name: str, args: Any, shared: Mapping[str, int], dp: Group | None) -> None:
    if shared.get("cp", 1) > 1:
        raise ShardingError(
            f"{name}: hp_lazy splits this model's sequence over cp={shared['cp']}, but {name} generates its "
            "completions with model.generate, which appends one token at a time and cannot be split over the sequence; "
            "activate a plan without cp (tp, ep and dp run this trainer exactly)"
        )
    if dp is None or not hasattr(args, "generation_batch_size"):  # DistillationTrainer sizes it as it runs
        return
    per_rank, steps, size = args.per_device_train_batch_size, args.steps_per_generation, args.generation_batch_size
    if size != per_rank * dp.size * steps:
        raise ShardingError(
            f"{name}: generation_batch_size={size} was sized for {size // (per_rank * steps)} processes, but the "
            f"{dp.size} dp rank(s) of hp_lazy's plan {dict(shared)} feed this model (the ranks of a tp group share "
            f"each batch); build the {type(args).__name__} after hp_lazy.activate, which sizes it by the dp ranks"
        )


def _viewed_method(fn: Callable[..., Any], degrees: Degrees) -> Callable[..., Any]:
    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        accelerator = getattr(self, "accelerator", None)  # None in __init__ before the Trainer's
        dp = None if accelerator is None or isinstance(accelerator, DataParallelView) else data_group(degrees())
        if dp is None:
            return fn(self, *args, **kwargs)
        with _viewed(accelerator, dp):
            return fn(self, *args, **kwargs)

    return method


class DataParallelView:
    """Mixed in front of an ``Accelerator``'s class while an RL trainer's own method runs: the
    processes are the dp ranks (the ranks of a tp group are one process)."""

    _real: type

    @property
    def num_processes(self) -> int:
        return self.__dict__[DP_VIEW].size

    @property
    def process_index(self) -> int:
        return self.__dict__[DP_VIEW].rank

    def gather(self, tensor: Any) -> Any:
        return dp_gather(tensor, self.__dict__[DP_VIEW])

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return dp_reduce(tensor, self.__dict__[DP_VIEW], reduction)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """The accelerator's own (which drops the tp copies of every rank's gather)."""
        with _unviewed(self):
            return self.gather_for_metrics(input_data, use_gather_object)


_VIEWS: dict[type, type] = {}


@contextlib.contextmanager
def _viewed(accelerator: Any, dp: Group) -> Iterator[None]:
    real = type(accelerator)
    view = _VIEWS.setdefault(real, type(real.__name__, (DataParallelView, real), {"_real": real}))
    accelerator.__class__, accelerator.__dict__[DP_VIEW] = view, dp
    try:
        yield
    finally:
        accelerator.__class__ = real
        del accelerator.__dict__[DP_VIEW]


@contextlib.contextmanager
def _unviewed(accelerator: Any) -> Iterator[None]:
    view = type(accelerator)
    accelerator.__class__ = view._real
    try:
        yield
    finally:
        accelerator.__class__ = view


def _over_dp(stock: Callable[[Any], Any], degrees: Degrees, over: Callable[[Any, Group], Any]) -> Callable[[Any], Any]:
    @functools.wraps(stock)
    def gather(data: Any) -> Any:
        dp = data_group(degrees())
        return stock(data) if dp is None else over(data, dp)

    return gather


def _seeded_by_dp(stock: Callable[..., None], degrees: Degrees) -> Callable[..., None]:
    @functools.wraps(stock)
    def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
        dp = data_group(degrees()) if device_specific else None
        if dp is None:
            stock(seed, device_specific, deterministic)
        else:
            stock(seed + dp.rank, False, deterministic)

    return set_seed


def dp_gather(data: Any, dp: Group) -> Any:
    """accelerate's ``gather`` over the dp group: every tensor's dp ranks' rows, in dp-rank order
    (a 0-dim tensor becomes ``[dp]``); the data itself at dp = 1, as in one process."""
    if dp.size == 1:
        return data
    from accelerate.utils import recursively_apply

    from hp_lazy.runtime.comm import wire

    def one(tensor: Any) -> Any:
        rows = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
        return wire.all_gather(rows, dp, 0, None)

    return recursively_apply(one, data, error_on_other_type=True)


def dp_gather_object(data: list[Any], dp: Group) -> list[Any]:
    """accelerate's ``gather_object`` over the dp group: the dp ranks' lists joined, dp-rank order."""
    if dp.size == 1:
        return data
    import torch.distributed as dist

    parts: list[Any] = [None] * dp.size
    dist.all_gather_object(parts, data, group=dp.pg)
    return [item for part in parts for item in part]


def dp_reduce(data: Any, dp: Group, reduction: str) -> Any:
    """accelerate's ``reduce`` (``"sum"``, ``"mean"`` or ``"max"``) over the dp group, on a copy."""
    import torch.distributed as dist
    from accelerate.utils import recursively_apply

    from hp_lazy.runtime.comm import wire

    def one(tensor: Any) -> Any:
        out = tensor.clone()
        if dp.size > 1:
            wire.all_reduce(out, dp, None, dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM)
        return out / dp.size if reduction == "mean" else out

    return recursively_apply(one, data, error_on_other_type=True)
