"""Where a bound model meets the calls users save and resume with.

- ``model.state_dict()`` gives every sharded parameter as a DTensor over its shard
  (:mod:`.present`); ``model.load_state_dict(sd)`` takes those DTensors (after ``dcp.load`` wrote
  into them: any saved layout is resharded by DCP) or full tensors (sliced here), and refuses
  anything else naming the tensor. So ``dcp.save/dcp.load`` and torch's
  ``get_state_dict/set_state_dict`` work unchanged.
- Optimizers: a global step pre-hook adopts every optimizer that steps a sharded parameter (also the
  zero-gradient step torch's ``get_state_dict`` runs to initialise a fresh one): its
  ``state_dict()`` presents per-element states (AdamW's moments, momentum) like their parameter,
  its ``load_state_dict`` takes them back the same way as the model's.
- ``model.save_pretrained(d)``, called on every rank: transformers' own hook for sharded models
  (``gather_sharded_state_dict_for_save``) is answered on the instance: the sharded tensors are
  gathered one at a time (every rank enters each gather; ranks that do not write drop each full
  tensor at once), the writing rank (transformers': rank 0) keeps them and writes the standard
  checkpoint; the ranks meet in a barrier after the write.

Inside :func:`local_shards`, ``state_dict()`` gives and ``load_state_dict`` takes the plain local
shards, as before hp_lazy had checkpoints (``hp_lazy.full_state_dict`` gathers from those).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hp_lazy.names import OPTIM_ADOPTED
from hp_lazy.runtime.checkpoint.present import Presentation
from hp_lazy.runtime.layout import LayoutTable
from hp_lazy.runtime.mesh import Mesh, check_arrival

_MODELS: weakref.WeakKeyDictionary[nn.Module, Presentation] = weakref.WeakKeyDictionary()
_STATE = threading.local()
_STEP_HOOK: list[Any] = []

# transformers' PreTrainedModel methods that save_pretrained calls on the model it saves
_GATHER_FOR_SAVE = "gather_sharded_state_dict_for_save"
_BARRIER_AFTER_SAVE = "barrier_after_gathered_checkpoint_save"


@contextlib.contextmanager
def local_shards() -> Iterator[None]:
    """Inside, ``state_dict()`` / ``load_state_dict`` of bound models and their optimizers give and
    take this rank's plain local shards (no DTensors, no checks)."""
    before = getattr(_STATE, "plain", False)
    _STATE.plain = True
    try:
        yield
    finally:
        _STATE.plain = before


def _plain() -> bool:
    return bool(getattr(_STATE, "plain", False))


def install(model: nn.Module, table: LayoutTable | None, mesh: Mesh) -> None:
    """Give bound (or sharded-on-read) ``model`` its state-dict face (a collective when K/V pieces
    are kept on several ranks: their sub-mesh is built here, on every rank). Called again with
    another table (bound after PEFT replaced submodules), the face follows the new table."""
    if table is None or not any(True for _ in table):
        return
    known = _MODELS.get(model)
    if known is not None:
        if known.table is not table:
            _MODELS[model] = Presentation(table, mesh)
        return
    _MODELS[model] = Presentation(table, mesh)
    model.register_state_dict_post_hook(_present_model)
    model.register_load_state_dict_pre_hook(_accept_model)
    if hasattr(type(model), _GATHER_FOR_SAVE):
        saver = _Saver(mesh)
        setattr(model, _GATHER_FOR_SAVE, saver.gather)
        setattr(model, _BARRIER_AFTER_SAVE, saver.barrier)
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_adopt))


# -- the model


def _present_model(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    presentation = _MODELS.get(module)
    if presentation is None or _plain():
        return
    for fqn in presentation.table:
        key = prefix + fqn
        value = state_dict.get(key)
        if value is None or isinstance(value, nn.Parameter):
            continue  # not saved (a non-persistent entry), or keep_vars=True: the live parameter asked for
        layout = presentation.table.get(fqn)
        if layout is not None and tuple(value.shape) == layout.full_shape != layout.local_shape:
            continue  # gathered already (PEFT keeps a targeted lm_head's base full): the same on every rank
        state_dict[key] = presentation.present(fqn, value)


def _accept_model(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    presentation = _MODELS.get(module)
    if presentation is None or _plain():
        return
    live = dict(module.named_parameters())  # FSDP2's DTensors, where it shards over dp
    for fqn in presentation.table:
        key = prefix + fqn
        if key in state_dict:
            state_dict[key] = presentation.accept(fqn, state_dict[key], like=live.get(fqn))


class _Saver:
    """transformers' save hooks for one bound model: gather one tensor at a time, barrier after."""

    def __init__(self, mesh: Mesh) -> None:
        self.gathered = False
        self.mesh = mesh

    def gather(
        self, model_to_save: nn.Module, state_dict: dict[str, Any], distributed_config: Any = None,
        *, save_on_this_rank: bool = True,
    ) -> dict[str, Any]:
        if any(isinstance(v, DTensor) for v in state_dict.values()):  # shards to gather: a collective
            self._check_arrival(model_to_save)
        out: dict[str, Any] = {}
        tied: dict[tuple[int, int, tuple[int, ...]], torch.Tensor | None] = {}
        for key in list(state_dict):
            value = state_dict.pop(key)  # the shard's DTensor is dropped as its full tensor appears
            if isinstance(value, DTensor):
                local = value._local_tensor
                alias = (local.untyped_storage().data_ptr(), int(local.storage_offset()), tuple(local.shape))
                if alias in tied:  # tied weights stay one tensor (transformers drops the alias)
                    value = tied[alias]
                else:
                    value = value.full_tensor()  # every rank, in state-dict order
                    tied[alias] = value if save_on_this_rank else None
                    self.gathered = True
            if save_on_this_rank:
                out[key] = value.detach().cpu().contiguous() if isinstance(value, torch.Tensor) else value
        return out

    def _check_arrival(self, model_to_save: nn.Module) -> None:
        check_arrival(
            self.mesh, f"{type(model_to_save).__name__}.save_pretrained",
            "call save_pretrained on every rank (transformers writes on rank 0 only), not under "
            "`if rank == 0:`; or gather with hp_lazy.full_state_dict(model) on every rank and pass it on one: "
            "save_pretrained(d, state_dict=full)",
        )

    def barrier(self, distributed_config: Any = None) -> None:
        if self.gathered and dist.is_initialized():
            dist.barrier()  # the ranks that did not write return when the checkpoint is complete
        self.gathered = False


# -- optimizers


def _owners() -> dict[int, tuple[Presentation, str, nn.Parameter]]:
    """id(parameter) -> (its model's presentation, its name, itself) over every live bound model."""
    found: dict[int, tuple[Presentation, str, nn.Parameter]] = {}
    for model, presentation in list(_MODELS.items()):
        for name, param in model.named_parameters():
            if name in presentation.table:
                found.setdefault(id(param), (presentation, name, param))
    return found


def _adopt(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: hook the optimizer's state dict if it steps sharded parameters."""
    if optimizer.__dict__.get(OPTIM_ADOPTED) is not None:
        return
    owners = _owners()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    mine = any(id(p) in owners for p in params)
    optimizer.__dict__[OPTIM_ADOPTED] = mine
    if not mine:
        return
    optimizer.register_state_dict_post_hook(_present_optimizer)
    optimizer.register_load_state_dict_pre_hook(_accept_optimizer)
    for param in params:  # a state loaded before the optimizer first stepped (plain load_state_dict)
        owner = owners.get(id(param))
        entry = optimizer.state.get(param)
        if owner is not None and entry:
            entry.update(_accepted(owner, entry))


def _by_param(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> dict[Any, nn.Parameter]:
    """State-dict key (index or FQN) -> parameter: the keys of ``groups`` in the optimizer's order."""
    keys = chain.from_iterable(g["params"] for g in groups)
    return dict(zip(keys, chain.from_iterable(g["params"] for g in optimizer.param_groups), strict=False))


def _map_sharded_state(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], fn: Callable[[Any, dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """``state_dict`` with ``fn(owner, entry)`` as the new entry of every sharded parameter's state
    (new dicts: the entries are the optimizer's live state)."""
    owners = _owners()
    params = _by_param(optimizer, state_dict["param_groups"])
    state = dict(state_dict["state"])
    for key, entry in state.items():
        owner = owners.get(id(params.get(key)))
        if owner is not None:
            state[key] = fn(owner, entry)
    return {**state_dict, "state": state}


def holds_full_states(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> bool | None:
    """Whether the per-element states an optimizer ``state_dict`` (``optimizer.pt``) holds for this
    optimizer's sharded parameters are whole (one process's: sliced on load) — ``False`` when any
    is shaped like this rank's shard (a main process's shards alone), ``None`` when it holds none."""
    owners = _owners()
    params = _by_param(optimizer, state_dict["param_groups"])
    verdicts = set()
    for key, entry in state_dict["state"].items():
        owner = owners.get(id(params.get(key)))
        if owner is None:
            continue
        presentation, fqn, _ = owner
        layout = presentation.table.get(fqn)
        assert layout is not None  # an owner's name is in its table
        for value in entry.values():
            if _per_element(value) and layout.full_shape != layout.local_shape:
                verdicts.add(tuple(value.shape) == layout.full_shape)
    return None if not verdicts else all(verdicts)


def _present_optimizer(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
    if _plain():
        return None

    def present(owner: Any, entry: dict[str, Any]) -> dict[str, Any]:
        presentation, fqn, _ = owner
        return {name: presentation.present(fqn, v, f"optimizer state {name!r}") if _per_element(v) else v
                for name, v in entry.items()}

    return _map_sharded_state(optimizer, state_dict, present)


def _accept_optimizer(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
    if _plain():
        return None
    return _map_sharded_state(optimizer, state_dict, lambda owner, entry: {**entry, **_accepted(owner, entry)})


def _accepted(owner: tuple[Presentation, str, nn.Parameter], entry: dict[str, Any]) -> dict[str, Any]:
    presentation, fqn, param = owner
    return {
        name: presentation.accept(fqn, v, f"optimizer state {name!r}", like=param)
        for name, v in entry.items()
        if _per_element(v)
    }


def _per_element(value: Any) -> bool:
    """A state tensor with a dim (AdamW's moments); 0-dim ones (``step``) are the same on every rank."""
    return isinstance(value, torch.Tensor) and value.dim() > 0
