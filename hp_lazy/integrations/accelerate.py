"""accelerate (and so the transformers ``Trainer``) on a model hp_lazy makes parallel.

What the stock stack does with a model it does not know to be tensor parallel, and what this
module changes (installed on ``accelerate.accelerator`` by ``activate``, when it is imported):

- ``Accelerator.prepare_model`` wraps the model in DDP over *all* ranks (``MULTI_CPU``, or
  ``MULTI_GPU`` without accelerate's own TP): DDP would broadcast rank 0's shards over the other tp
  ranks and average different shards. For a model with hp_lazy-lowered classes, it binds the model
  (``hp_lazy.parallelize``, if the first forward has not yet) and wraps nothing: hp_lazy averages
  the gradients over dp itself (its gradient owner); with ``activate(..., data_parallel=False)``
  it wraps DDP over the dp group only. FSDP, DeepSpeed, Megatron-LM and XLA plugins are refused.
- ``prepare_data_loader`` shards every data loader over all ranks, so each tp rank would read a
  different batch. While a plan with tp (or cp) > 1 is active, it shards over the dp ranks only:
  the ranks of one tp group read the same batch (``num_processes = dp``, ``process_index`` = the
  dp rank), the contract of a hand-written hp_lazy loop.
- ``Accelerator.gather_for_metrics`` (the Trainer's evaluation) gathers from every rank, then
  truncates the last batch to the data set as if each rank had read its own rows: the copies the
  other ranks of a tp group hold are dropped first (one per dp rank is kept), so that the
  truncation keeps the right rows.
- ``Accelerator.no_sync`` (gradient accumulation) becomes ``hp_lazy.no_sync`` for an unwrapped
  hp_lazy model; ``Accelerator.clip_grad_norm_`` becomes ``hp_lazy.clip_grad_norm_`` for its
  parameters (one process's norm; see :mod:`hp_lazy.runtime.clip`).

Why not accelerate's own tensor-parallel route (``ParallelismConfig(tp_size=...)``, which the
Trainer takes when ``model.tp_size > 1``): it refuses ``MULTI_CPU`` ("ParallelismConfig is only
compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device}..."), expects DTensor
parameters (it skips a plain-tensor model with a warning) and builds a second device mesh. So
hp_lazy leaves ``model.tp_size`` unset and tells the Trainer how many ranks share a batch through
:mod:`hp_lazy.integrations.transformers` instead. Everything else accelerate and the Trainer do is
untouched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hp_lazy.errors import ShardingError
from hp_lazy.names import PATCHED
from hp_lazy.runtime import clip, registry
from hp_lazy.runtime.grads import no_sync as hp_no_sync
from hp_lazy.runtime.grads import owner_of
from hp_lazy.runtime.mesh import Group, get_mesh
from hp_lazy.runtime.owner import parallelize

Degrees = Callable[[], "Mapping[str, int] | None"]
_REFUSED = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")


def install(module: ModuleType, degrees: Degrees) -> None:
    """Patch ``module`` (``accelerate.accelerator``) once; ``degrees()`` gives the active plan's
    mesh degrees (``None`` when no plan is active)."""
    cls = module.Accelerator
    if getattr(cls, PATCHED, False):
        return
    cls.prepare_model = _prepare_model(cls.prepare_model)
    cls.no_sync = _no_sync(cls.no_sync)
    cls.clip_grad_norm_ = _clip_grad_norm(cls.clip_grad_norm_)
    cls.gather_for_metrics = _gather_for_metrics(cls.gather_for_metrics, degrees)
    module.prepare_data_loader = _prepare_data_loader(module.prepare_data_loader, degrees)  # type: ignore[attr-defined]
    setattr(cls, PATCHED, True)


def _owner_root(model: nn.Module) -> nn.Module | None:
    """The model hp_lazy bound inside ``model`` (DDP or PEFT around it), if any."""
    return next((m for m in model.modules() if owner_of(m) is not None), None)


def lowered(model: nn.Module) -> bool:
    return any(registry.lowered_for(type(m)) is not None for m in model.modules())


def _prepare_model(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def prepare_model(self: Any, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> Any:
        if getattr(model, "_is_accelerate_prepared", False) or not lowered(model):
            return stock(self, model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        _refuse_plugins(self, model)
        root = _owner_root(model)
        if root is None:
            parallelize(model)  # a PEFT wrapper: its laid-out model inside is bound, the wrapper returned
            root = _owner_root(model)
            assert root is not None, "parallelize gives every lowered model inside a gradient owner"
        prepared = stock(self, model, device_placement=device_placement, evaluation_mode=True)  # no DDP
        return prepared if evaluation_mode else _ddp_over_dp(self, prepared, root)

    return prepare_model


def _refuse_plugins(accelerator: Any, model: nn.Module) -> None:
    kind = str(getattr(accelerator.distributed_type, "name", accelerator.distributed_type))
    if kind in _REFUSED:
        raise ShardingError(
            f"{type(model).__qualname__}: accelerate's distributed_type={kind} would shard or wrap this hp_lazy "
            "parallel model over all ranks; drop the FSDP/DeepSpeed/Megatron/XLA config (hp_lazy averages gradients "
            "over dp itself), or activate with data_parallel=False and fully_shard over "
            "hp_lazy.mesh().device_mesh['dp'] yourself"
        )


def _ddp_over_dp(accelerator: Any, prepared: nn.Module, root: nn.Module) -> nn.Module:
    """DDP over the dp group when the user handed dp to torch (``data_parallel=False``)."""
    owner = owner_of(root)
    assert owner is not None  # the root hp_lazy bound
    dp = owner.mesh.group("dp")
    if owner.data_parallel or dp.size == 1:
        return prepared
    handler = getattr(accelerator, "ddp_handler", None)
    kwargs = handler.to_kwargs() if handler is not None else {}
    wrapped = DistributedDataParallel(prepared, process_group=dp.pg, **kwargs)
    accelerator._models[-1] = wrapped  # what accelerate keeps for a model it wrapped itself
    return wrapped


def _no_sync(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def no_sync(self: Any, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        root = _owner_root(model)
        if root is None or isinstance(model, DistributedDataParallel):
            return stock(self, model)
        return hp_no_sync(root)

    return no_sync


def _clip_grad_norm(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def clip_grad_norm_(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        params = list(parameters)
        if not clip.bound_params(params):
            return stock(self, params, max_norm, norm_type)
        self.unscale_gradients()
        return clip.clip_grad_norm_(params, max_norm, norm_type)

    return clip_grad_norm_


def _gather_for_metrics(stock: Callable[..., Any], degrees: Degrees) -> Callable[..., Any]:
    @functools.wraps(stock)
    def gather_for_metrics(self: Any, input_data: Any, use_gather_object: bool = False) -> Any:
        ranks = _data_ranks(degrees(), getattr(self.state, "device_mesh", None))
        if ranks is None:
            return stock(self, input_data, use_gather_object)
        import accelerate.accelerator as module

        world, dp = self.num_processes, ranks[0]
        plain_gather, plain_objects = type(self).gather, module.gather_object
        self.gather = lambda data: module.recursively_apply(
            lambda t: _one_per_dp_rank(t, world, dp), plain_gather(self, data)
        )
        module.gather_object = lambda data: _one_per_dp_rank(plain_objects(data), world, dp)
        try:
            return stock(self, input_data, use_gather_object)
        finally:
            del self.gather
            module.gather_object = plain_objects

    return gather_for_metrics


def _one_per_dp_rank(gathered: Any, world: int, dp: int) -> Any:
    """Of the ``world`` equal parts of ``gathered`` (rank order), those of the first rank of each
    dp rank's group (dp is the outermost mesh axis: ranks ``d * world/dp ...`` share rows)."""
    if len(gathered) % world:
        raise ShardingError(
            f"accelerate gather_for_metrics: {len(gathered)} gathered items do not split into {world} equal parts, "
            "so hp_lazy cannot drop the tensor-parallel copies; keep even_batches=True (the default)"
        )
    size, stride = len(gathered) // world, world // dp
    parts = [gathered[r * size : (r + 1) * size] for r in range(0, world, stride)]
    if isinstance(gathered, list):
        return [item for part in parts for item in part]
    import torch

    return torch.cat(parts)


def _prepare_data_loader(stock: Callable[..., Any], degrees: Degrees) -> Callable[..., Any]:
    @functools.wraps(stock)
    def prepare_data_loader(dataloader: Any, device: Any = None, num_processes: int | None = None,
                            process_index: int | None = None, *args: Any, **kwargs: Any) -> Any:
        ranks = _data_ranks(degrees(), kwargs.get("torch_device_mesh"))
        if ranks is not None:
            _refuse_unshardable(dataloader, kwargs)
            num_processes, process_index = ranks
        return stock(dataloader, device, num_processes, process_index, *args, **kwargs)

    return prepare_data_loader


def sharing_degrees(active: Mapping[str, int] | None) -> Mapping[str, int] | None:
    """The mesh degrees that decide which ranks share a batch: the active plan's, else (after
    ``deactivate``) those the lowered modules were made for; ``None`` when nothing was lowered or
    this is a single process (nothing to share)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if active is not None:
        return active
    made_for = registry.meshes()
    if len(made_for) > 1:
        raise ShardingError(
            f"hp_lazy: no plan is active and modules were lowered for several meshes {made_for}, so it is unknown "
            "which ranks share a batch; keep the plan active (hp_lazy.activate) while the model trains"
        )
    return made_for[0] if made_for else None


def _data_ranks(active: Mapping[str, int] | None, accelerate_mesh: Any) -> tuple[int, int] | None:
    """``(dp size, dp rank)`` when some ranks share a batch (tp or cp > 1); ``None`` otherwise."""
    dp = data_group(active) if accelerate_mesh is None else None
    return None if dp is None else (dp.size, dp.rank)


def data_group(active: Mapping[str, int] | None) -> Group | None:
    """This rank's dp group when some ranks share a batch (tp or cp > 1); ``None`` otherwise."""
    degrees = sharing_degrees(active)
    if degrees is None:
        return None
    mesh = get_mesh(dict(degrees))
    dp = mesh.group("dp")
    return None if dp.size == mesh.world else dp


def _refuse_unshardable(dataloader: Any, kwargs: Mapping[str, Any]) -> None:
    from torch.utils.data import IterableDataset

    dispatch = kwargs.get("dispatch_batches")
    if dispatch is None:
        dispatch = bool(kwargs.get("put_on_device")) and isinstance(dataloader.dataset, IterableDataset)
    if dispatch:
        raise ShardingError(
            "accelerate data loader: dispatch_batches=True splits each batch over all ranks, so the ranks of one "
            "hp_lazy tensor-parallel group would get different rows; pass dispatch_batches=False (Trainer: "
            "accelerator_config={'dispatch_batches': False}) so that each dp rank reads its own shard"
        )
    sampler = getattr(dataloader, "batch_sampler", None)
    if type(sampler).__name__ == "BatchRebalanceSampler":
        raise ShardingError(
            "Trainer train_sampling_strategy='batch_rebalance': its sampler splits batches over all ranks, so the "
            "ranks of one hp_lazy tensor-parallel group would get different rows; use 'random' or 'sequential'"
        )
