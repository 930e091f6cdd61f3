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
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from hp_lazy.hook.api import (
    Handle,
    PlanSpec,
    active_plan,
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
    "deactivate",
    "full_grads",
    "full_state_dict",
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
    data_parallel: bool = True,
    bucket_cap_mb: float = 25.0,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Handle:
    """Lower the modules ``plan`` names when they are imported from now on.

    ``plan``: a Plan, a dict, a path to a ``.json`` plan, or ``"auto"`` (transformers' own
    ``base_model_tp_plan``; needs ``tp``). ``tp`` with an explicit plan overrides its mesh tp.
    With more ranks than the plan's degrees, the rest are data parallel: ``data_parallel=True``
    (the default) has hp_lazy average every gradient over them (bucketed, during backward);
    ``False`` leaves that to torch DDP or FSDP2 over ``hp_lazy.mesh().group("dp")``.
    Activating again replaces the active plan.
    """
    if os.environ.get("HP_LAZY", "1").strip() == "0":
        logger.debug("hp_lazy: HP_LAZY=0, activate() does nothing")
        return Handle(plan=None)
    resolved = load_plan(plan, tp=tp, sequence_parallel=sequence_parallel)
    _set_runtime_options(data_parallel=data_parallel, bucket_cap_mb=bucket_cap_mb)
    cache = Cache(None if cache_dir is None else os.fspath(cache_dir))
    return install(resolved, cache=cache, lower=_lower, bind=_register, runtime=_runtime)


def _lower(source: str, module_plan: Any, filename: str) -> Any:
    from hp_lazy.lower import lower

    return lower(source, module_plan, filename)


def _register(module_name: str, module_plan: Any, source_sha256: str) -> None:
    from hp_lazy.runtime import registry
    from hp_lazy.runtime.checkpoint import load

    registry.register(module_name, module_plan, source_sha256)
    load.patch_transformers(module_name)  # from_pretrained reads each rank's slices (shard-on-read)


def _runtime() -> ModuleType:
    from hp_lazy.runtime import rt

    return rt


def _set_runtime_options(**values: Any) -> None:
    """Run-time options live with the runtime (``runtime/options`` imports nothing heavy)."""
    from hp_lazy.runtime import options

    options.set_current(options.RuntimeOptions(**values))


def mesh() -> Mesh:
    """The mesh of the active plan: ``mesh().group("dp")`` says which part of the batch this rank
    feeds (``.rank`` of ``.size``) and its ``.pg`` is the process group for DDP; ``device_mesh``
    is the torch ``DeviceMesh`` with named axes (its ``["dp"]`` sub-mesh for FSDP2)."""
    from hp_lazy.errors import ShardingError
    from hp_lazy.runtime.mesh import get_mesh

    plan = active_plan()
    if plan is None:
        raise ShardingError("hp_lazy.mesh(): no plan is active; call hp_lazy.activate(plan) first")
    return get_mesh(dict(plan.mesh))


def parallelize(model: nn.Module, *, data_parallel: bool | None = None) -> nn.Module:
    """Shard ``model`` in place and bind it now (the first forward does it otherwise)."""
    from hp_lazy.runtime.bind import parallelize as bind

    return bind(model, data_parallel=data_parallel)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded tensor gathered (a collective)."""
    from hp_lazy.runtime.state import full_state_dict as gather

    return gather(model)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter FQN -> full gradient (a collective)."""
    from hp_lazy.runtime.state import full_grads as gather

    return gather(model)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradient accumulation: backward passes inside the block reduce nothing over dp; the next
    backward outside it reduces everything accumulated (DDP's ``no_sync``)."""
    from hp_lazy.runtime.grads import no_sync as local

    with local(model):
        yield
