"""The facade: what ``import hp_lazy`` offers, wired from the import-time half (``plan``, ``lower``,
``hook``) and the run-time half (``runtime``).

Only this module knows both halves: ``hook/`` receives the lowerer, the registry and the runtime
module as arguments, and ``runtime/`` never reads the hook's state (:func:`mesh` passes the
active plan's degrees down). Importing it is cheap: torch is imported only by the run-time
functions, when they are called.

Switches: ``HP_LAZY=0`` makes :func:`activate` a no-op (stock imports, bit for bit);
``HP_LAZY_STRICT=1`` turns the already-imported warning into a ``PlanError``; ``HP_LAZY_DEBUG=1``
logs one line per lowered module; ``HP_LAZY_CACHE`` / ``HP_LAZY_CACHE_DIR``: see :mod:`hp_lazy.hook.cache`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from hp_lazy.hook.after import when_imported
from hp_lazy.hook.api import (
    Handle,
    PlanSpec,
    active_plan,
    check_mesh,
    deactivate,
    install,
    load_plan,
)
from hp_lazy.hook.cache import Cache

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hp_lazy.runtime.mesh import Mesh

__all__ = [
    "activate",
    "clip_grad_norm_",
    "deactivate",
    "expert_load",
    "full_grads",
    "layout",
    "full_state_dict",
    "gather_sequence",
    "mesh",
    "no_sync",
    "parallelize",
]

logger = logging.getLogger("hp_lazy")


def activate(
    plan: PlanSpec,
    *,
    tp: int | None = None,
    sequence_parallel: bool = False,
    cp: int | None = None,
    cp_mode: str | None = None,
    ep: int | None = None,
    data_parallel: bool = True,
    bucket_cap_mb: float = 25.0,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Handle:
    """Lower the modules ``plan`` names when they are imported from now on.

    ``plan``: a Plan, a dict, a path to a ``.json`` plan, or ``"auto"`` (transformers' own
    ``base_model_tp_plan``; needs ``tp`` or ``cp``). ``tp`` with an explicit plan overrides its mesh tp.
    ``cp`` (``"auto"`` only): context parallel; every rank of a cp group passes the same full
    batch, which the model splits along the sequence (``hp_lazy.gather_sequence`` joins outputs).
    ``ep`` (``"auto"`` only): expert parallel over ``ep`` of the ranks holding different tokens
    (``ep`` divides ``dp * cp``): each holds ``1/ep`` of every layer's experts and feeds its own rows.
    With more ranks than the plan's degrees, the rest are data parallel: ``data_parallel=True``
    (the default) has hp_lazy average every gradient over them (bucketed, during backward);
    ``False`` leaves that to torch DDP or FSDP2 over ``hp_lazy.mesh().group("dp")``.
    Activating again replaces the active plan; the handle's exit (``with activate(...):``) puts
    the replaced one back. One mesh per process: degrees other than those of a module already
    lowered are a ``PlanError``.
    """
    if os.environ.get("HP_LAZY", "1").strip() == "0":
        logger.debug("hp_lazy: HP_LAZY=0, activate() does nothing")
        return Handle(plan=None)
    resolved = load_plan(plan, tp=tp, sequence_parallel=sequence_parallel, cp=cp, cp_mode=cp_mode, ep=ep)
    cache = Cache(None if cache_dir is None else os.fspath(cache_dir))
    when_imported("accelerate.accelerator", _integrate_accelerate)  # before install: its finder stays first
    when_imported("transformers.trainer", _integrate_trainer)
    when_imported("trl.trainer.utils", _integrate_trl)
    when_imported("trl.trainer.sft_trainer", _integrate_trl_sft)
    from hp_lazy.integrations import ONLINE_CONFIGS, ONLINE_TRAINERS  # names only: no torch import

    for name in (*ONLINE_CONFIGS, *ONLINE_TRAINERS):
        when_imported(name, _integrate_trl_online)
    when_imported("transformers.modeling_utils", _integrate_modeling)
    handle = install(resolved, cache=cache, lower=_lower, bind=_register, runtime=_runtime)
    from hp_lazy.runtime import options

    before = options.current()
    options.set_current(options.RuntimeOptions(data_parallel=data_parallel, bucket_cap_mb=bucket_cap_mb))
    handle.on_exit.append(lambda: options.set_current(before))
    return handle


def _lower(source: str, module_plan: Any, filename: str) -> Any:
    from hp_lazy.lower import lower

    return lower(source, module_plan, filename)


def _register(module_name: str, module_plan: Any, source_sha256: str) -> None:
    from hp_lazy.runtime import registry
    from hp_lazy.runtime.checkpoint import load

    plan = active_plan()
    required: tuple[str, ...] = ()
    if plan is not None and plan.auto_flags is None and plan.hash == module_plan.plan_hash:
        required = tuple(c.pattern for c in plan.boundaries if not c.optional)
    registry.register(module_name, module_plan, source_sha256, required)
    load.patch_transformers(module_name)  # from_pretrained reads each rank's slices (shard-on-read)


def _runtime() -> ModuleType:
    from hp_lazy.runtime import rt

    return rt


def _integrate_accelerate(module: ModuleType) -> None:
    """accelerate (and the transformers Trainer on it): see :mod:`hp_lazy.integrations.accelerate`."""
    from hp_lazy.integrations import accelerate

    accelerate.install(module, degrees=_active_degrees)


def _integrate_trainer(module: ModuleType) -> None:
    """The Trainer's count of ranks sharing a batch: see :mod:`hp_lazy.integrations.transformers`."""
    from hp_lazy.integrations import transformers

    transformers.install(module, degrees=_active_degrees)


def _integrate_modeling(module: ModuleType) -> None:
    """``num_parameters`` and gradient checkpointing of a bound model: see
    :func:`hp_lazy.integrations.transformers.install_modeling`."""
    from hp_lazy.integrations import transformers

    transformers.install_modeling(module)


def _integrate_trl(module: ModuleType) -> None:
    """TRL's fused LM head on a vocab-sharded head: see :mod:`hp_lazy.integrations.trl`."""
    from hp_lazy.integrations import trl

    trl.install(module)


def _integrate_trl_sft(module: ModuleType) -> None:
    """``SFTTrainer``'s predictions and losses from the logits: see :func:`hp_lazy.integrations.trl.install_sft`."""
    from hp_lazy.integrations import trl

    trl.install_sft(module)


def _integrate_trl_online(module: ModuleType) -> None:
    """TRL's GRPO / RLOO trainers and configs with the dp ranks as their processes: see
    :mod:`hp_lazy.integrations.trl_online`."""
    from hp_lazy.integrations import ONLINE_CONFIGS, trl_online

    if module.__name__ in ONLINE_CONFIGS:
        trl_online.install_config(module, degrees=_active_degrees)
    else:
        trl_online.install_trainer(module, degrees=_active_degrees)


def _active_degrees() -> dict[str, int] | None:
    plan = active_plan()
    return None if plan is None else dict(plan.mesh)


def mesh() -> Mesh:
    """The mesh of the active plan: ``mesh().group("dp")`` says which part of the batch this rank
    feeds (``.rank`` of ``.size``) and its ``.pg`` is the process group for DDP; ``device_mesh``
    is the torch ``DeviceMesh`` with named axes (its ``["dp"]`` sub-mesh for FSDP2)."""
    from hp_lazy.errors import ShardingError
    from hp_lazy.runtime.mesh import get_mesh

    plan = active_plan()
    if plan is None:
        raise ShardingError("hp_lazy.mesh(): no plan is active; call hp_lazy.activate(plan) first")
    check_mesh(plan, "hp_lazy.mesh()")
    return get_mesh(dict(plan.mesh))


def parallelize(model: nn.Module, *, data_parallel: bool | None = None) -> nn.Module:
    """Shard ``model`` in place and bind it now (the first forward does it otherwise)."""
    from hp_lazy.runtime.owner import parallelize as bind

    return bind(model, data_parallel=data_parallel)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded tensor gathered (a collective)."""
    from hp_lazy.runtime.state import full_state_dict as gather

    return gather(model)


def full_weights(model: nn.Module, bucket_mb: float = 256.0) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Stream the model's full weights out (RL weight sync, export): buckets of ``(name, tensor)``
    in ``model.state_dict()``'s names, each at most ``bucket_mb`` MiB, gathered one bucket at a
    time; every rank iterates and receives every tensor (a collective per sharded tensor)."""
    from hp_lazy.runtime.state import full_weights as stream

    return stream(model, int(bucket_mb * 2**20))


def layout(model: nn.Module) -> Any:
    """Each parameter's placement per axis and the bytes this rank holds against one process's,
    with what is whole on every rank listed (``print(hp_lazy.layout(model))``); this rank's view of
    a bound model, no collective. :class:`hp_lazy.runtime.report.LayoutReport`."""
    from hp_lazy.runtime.report import of_model

    return of_model(model)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter FQN -> full gradient (a collective)."""
    from hp_lazy.runtime.state import full_grads as gather

    return gather(model)


def expert_load(model: nn.Module) -> dict[str, torch.Tensor]:
    """Router FQN -> per-expert token counts ``[E]`` (int64) of the last forward over the global
    batch: summed over the ranks holding different tokens (``dp * cp``, and tp under sequence
    parallel, whose tp ranks dispatch their own pieces), equal on every rank; one
    all-reduce for all layers (a collective). For aux-loss-free balancing of ``e_score_correction_bias``
    under expert parallel: counts from this rank's own top-k indices differ between ranks."""
    from hp_lazy.runtime.ep import load

    loads = load.recorded(model)
    return load.summed(loads, mesh().group_of(load.token_axes(model)))


def gather_sequence(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Under context parallel, this rank's rows of a per-token output (``out.logits``, hidden
    states) -> the whole sequence, in sequence order, on every rank of the cp group (a collective;
    its backward keeps this rank's rows). Without cp, ``tensor`` itself."""
    from hp_lazy.runtime.cp.gather import gather_sequence as gather

    return gather(tensor, mesh().group("cp"), dim)


@contextlib.contextmanager
def whole_outputs() -> Iterator[None]:
    """Inside the block, a bound model's forward returns one process's per-token outputs on every
    rank: under context parallel the whole sequence in order (``out.logits``, hidden states), under
    loss parallel the logits over the whole vocabulary. Collectives, autograd-aware: a loss the
    caller computes from them on every rank trains as one process's. For code that reads the
    outputs itself (metrics, a loss of its own); the Trainer's predictions and custom losses use it.
    Outside it they stay cut (:func:`gather_sequence`)."""
    from hp_lazy.runtime.outputs import whole

    with whole():
        yield


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a parallel model: the total norm (returned) is one
    process's, every shard counted once over every axis; a collective. After ``parallelize`` the
    stock ``torch.nn.utils.clip_grad_norm_`` and accelerate's ``clip_grad_norm_`` (the Trainer's)
    route here for a bound model's parameters."""
    from hp_lazy.runtime.clip import clip_grad_norm_ as clip

    return clip(parameters, max_norm, norm_type, error_if_nonfinite, foreach)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradient accumulation: backward passes inside the block reduce nothing over dp; the next
    backward outside it reduces everything accumulated (DDP's ``no_sync``)."""
    from hp_lazy.runtime.grads import no_sync as local

    with local(model):
        yield
