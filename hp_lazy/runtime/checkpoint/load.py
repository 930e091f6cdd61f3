"""Shard-on-read: ``from_pretrained`` of a lowered model reads only this rank's slice of every
planned parameter, through transformers' own tp loader.

transformers builds the model on the meta device, then ``PreTrainedModel._load_pretrained_model``
opens the safetensors files lazily (``get_slice``) and, for a parameter that is a DTensor, reads only
the local slice of it (``DtensorShardOperation``: contiguous, strided for packed blocks, per expert)
and installs it as a DTensor Parameter. hp_lazy wraps that one static method: before it runs, the
meta model is laid out and bound (:func:`~hp_lazy.runtime.owner.lay_out_before_load`; parameters
shrink to their local shapes, still on meta) and every planned parameter is presented as a meta
DTensor of its full shape (:mod:`.present`); after it, every DTensor Parameter is replaced by a
plain Parameter of its local tensor, in a storage of its own (a slice of a memory-mapped file can be
a view of the whole tensor's mapping: it is copied).
Missing keys, initialisation and weight tying then run as usual on local shapes; the first forward
(or ``hp_lazy.parallelize``) adds the gradient owner.

Expert slices (cut on ``ep``, and on ``tp`` too) are presented on the expert mesh
(:mod:`.present`), so each rank reads only its experts. A checkpoint tensor that transformers
transposes on load (Qwen3-VL-MoE's experts) is kept or transposed by its stored layout
(:mod:`.convert`), and refused where the slice would come from the wrong dims. A parameter a
conversion builds from whole source tensors (a fused checkpoint tensor chunked or split into q/k/v,
rows permuted for RoPE: :func:`.convert.rebuilt`) is read whole and sliced after the load (its full
tensor held briefly on every rank). Left to the old path (full load, shard at the first forward):
a state dict passed in, ``.bin`` checkpoints (their tensors are read whole), quantizers, and a
``device_map`` (its placement is transformers'; with tp each rank's device is ``LOCAL_RANK``'s, set
before loading).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hp_lazy.runtime import record, registry
from hp_lazy.runtime.checkpoint import convert
from hp_lazy.runtime.layout import ParamLayout, mark_full_shape

_PATCHED: list[Any] = []


def patch_transformers(lowering: str) -> None:
    """Wrap ``PreTrainedModel._load_pretrained_model`` once, when a transformers modeling module is
    about to be lowered (it is going to import ``transformers.modeling_utils`` itself)."""
    if _PATCHED or not lowering.startswith("transformers."):
        return
    modeling_utils = importlib.import_module("transformers.modeling_utils")
    cls = modeling_utils.PreTrainedModel
    original = cls.__dict__.get("_load_pretrained_model")
    if not isinstance(original, staticmethod):
        return  # another transformers: keep the full load (then shard), which is always right
    load = original.__func__

    @functools.wraps(load)
    def _load_pretrained_model(model: Any, state_dict: Any, checkpoint_files: Any, load_config: Any, *args: Any,
                               **kwargs: Any) -> Any:
        if not _shard_on_read(model, state_dict, checkpoint_files, load_config):
            return load(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        whole = _present_meta(model, getattr(load_config, "weight_mapping", None) or ())
        try:
            with convert.local_transpose(checkpoint_files):
                loaded = load(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        finally:
            _to_local(model, whole)
        _give_state_dict_face(model)
        return loaded

    cls._load_pretrained_model = staticmethod(_load_pretrained_model)
    _PATCHED.append(original)


def _shard_on_read(model: nn.Module, state_dict: Any, files: Any, load_config: Any) -> bool:
    if state_dict is not None or not files or not all(str(f).endswith(".safetensors") for f in files):
        return False
    if getattr(load_config, "hf_quantizer", None) is not None or getattr(load_config, "device_map", None):
        return False
    plans = [found[0].plan for m in model.modules() if (found := registry.lowered_for(type(m))) is not None]
    if not any(degree > 1 for plan in plans for degree in dict(plan.mesh).values()):
        return False  # nothing is cut (data parallel alone): the plain load is the sharded one
    return any(p.is_meta for p in model.parameters())


def _present_meta(model: nn.Module, mapping: Any) -> dict[str, ParamLayout]:
    """Every planned parameter as a meta DTensor of its full shape (read in slices), except those
    a weight conversion builds from other tensors (:func:`convert.rebuilt`): a full-shape meta
    tensor, read whole and sliced after the load. Returns the latter's layouts by name."""
    from hp_lazy.runtime.checkpoint.present import Presentation
    from hp_lazy.runtime.owner import lay_out_before_load

    laid_out = lay_out_before_load(model)  # a collective (ranks agree, sub-meshes)
    if laid_out.table is None or not any(True for _ in laid_out.table):
        return {}
    presentation = Presentation(laid_out.table, laid_out.mesh)
    rebuilt = convert.rebuilt(mapping, list(laid_out.table))
    faces: dict[int, nn.Parameter] = {}
    whole: dict[str, ParamLayout] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        layout = laid_out.table.get(name)
        if layout is None:
            continue
        face = faces.get(id(param))
        if face is None and name in rebuilt:
            full = torch.empty(layout.full_shape, dtype=param.dtype, device="meta")
            face = faces[id(param)] = nn.Parameter(full, param.requires_grad)
        elif face is None:  # tied weights: one face for the one parameter
            face = faces[id(param)] = nn.Parameter(presentation.present(name, param.data), param.requires_grad)
        if not isinstance(face, DTensor):
            whole[name] = layout
        _set(model, name, face)
    return whole


def _give_state_dict_face(model: nn.Module) -> None:
    """The loaded model's ``state_dict`` / ``load_state_dict`` face now, not at its first forward: a
    full state dict loaded into it (the Trainer's ``resume_from_checkpoint``) is sliced, not refused
    for its shapes."""
    from hp_lazy.runtime.checkpoint import hooks

    laid_out = record.of(model)
    if laid_out is None:
        return
    hooks.install(model, laid_out.table, laid_out.mesh)
    for name, param in model.named_parameters():  # the new local Parameters: PEFT reads their full shape
        layout = laid_out.table.get(name) if laid_out.table is not None else None
        if layout is not None:
            mark_full_shape(param, layout)


def _to_local(model: nn.Module, whole: dict[str, ParamLayout]) -> None:
    plain: dict[int, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if not isinstance(param, DTensor) and name not in whole:
            continue
        local = plain.get(id(param))
        if local is None:
            if isinstance(param, DTensor):
                tensor = _own_storage(param.to_local().detach())
            elif param.is_meta:  # read whole but not in the checkpoint: initialised later, on the shard
                tensor = torch.empty(whole[name].local_shape, dtype=param.dtype, device="meta")
            else:  # read whole (a converted tensor): this rank's slice of it
                tensor = whole[name].local(param.detach())
            local = plain[id(param)] = nn.Parameter(tensor, param.requires_grad)
            if getattr(param, "_is_hf_initialized", False):
                local._is_hf_initialized = True  # type: ignore[attr-defined]  # read: not initialised again
        _set(model, name, local)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A slice read from a memory-mapped file may be a view of the whole tensor's mapping: copy it."""
    if tensor.is_meta or tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _set(model: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, param)
