"""Gradient norm and clipping of a parallel model: one process's total norm, from the shards.

The norm of the full gradient is computed from every rank's local pieces, each distinct piece
counted exactly once, and combined over the world in one all-reduce (``SUM`` of ``|g|^p``;
``MAX`` for ``inf``). Which ranks hold the same piece comes from the layout table (the cut of each
parameter on every axis, K/V heads kept on ``replicas`` ranks) and the mesh:

- a piece cut on ``tp`` with ``replicas = m`` is counted by the tp ranks ``r`` with ``r % m == 0``;
  a parameter not cut on tp (norms, replicated embeddings) by tp rank 0 only — after the gradient
  owner's reduction its gradient is identical on every tp rank;
- over ``dp`` (and ``cp``) every rank holds the same averaged gradient (hp_lazy's own dp average
  or DDP's): counted on dp rank 0; an FSDP2 gradient (a DTensor sharded over the dp sub-mesh) is a
  distinct piece on every dp rank and counted on each; a piece cut on ``ep`` on the first ep run,
  or, FSDP2's chunk of it over the slice's edp mesh, on every token rank.

Clipping then scales every local gradient by the same coefficient (torch's
``clip_grads_with_norm_``, run once per DTensor mesh where FSDP2 holds gradients on two), which is
exactly one process's clipping.

Why this mechanism, and not DTensor gradients that torch's function would get right by itself:
hp_lazy's parameters are plain local tensors by design (no DTensor dispatch in the step), and a
parameter's ``.grad`` must have the parameter's type. So hp_lazy owns the arithmetic
(:func:`clip_grad_norm_`, exported as ``hp_lazy.clip_grad_norm_``), and the stock calls are routed
to it, so that none of them is silently wrong: :func:`install` (run by ``parallelize``) wraps
torch's ``torch.nn.utils.get_total_norm`` — the function behind ``torch.nn.utils.clip_grad_norm_``
(looked up at call time, so a ``from torch.nn.utils import clip_grad_norm_`` made earlier is
covered), accelerate's ``Accelerator.clip_grad_norm_`` and so the transformers Trainer's clipping
and logged ``grad_norm``. The wrapper changes nothing for tensors that are no gradient of a model
hp_lazy bound; a call mixing both kinds, a norm type other than ``p > 0`` or ``inf``, and gradients
accumulated under ``hp_lazy.no_sync`` but not reduced yet are ``ShardingError``\\ s (on torch < 2.6,
which has no ``get_total_norm``, the stock ``clip_grad_norm_`` refuses a bound model's parameters).

Every rank of the model's mesh must make the call (it is a collective), with the corresponding
parameters.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.runtime import record
from hp_lazy.runtime.comm import wire
from hp_lazy.runtime.grads import owner_of
from hp_lazy.runtime.layout import ParamLayout
from hp_lazy.runtime.mesh import EDP, WORLD_AXES, Mesh
from hp_lazy.runtime.record import tables

__all__ = ["clip_grad_norm_", "get_total_norm", "install", "register"]

_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Every model ``parallelize`` bound (weakly); its gradient owner holds its mesh."""


def register(model: nn.Module) -> None:
    _MODELS.add(model)


@dataclass(frozen=True)
class _Piece:
    fqn: str
    model: nn.Module
    layout: ParamLayout | None
    mesh: Mesh


def _known() -> dict[int, _Piece]:
    """id(grad) -> what it is, for every gradient of every bound model."""
    found: dict[int, _Piece] = {}
    for model in list(_MODELS):
        bound = record.of(model)
        assert bound is not None  # registered at bind
        mesh = bound.mesh
        layouts = {prefix + fqn: table.get(fqn) for prefix, table in tables(model) for fqn in table}
        for fqn, param in model.named_parameters():
            if param.grad is not None:
                found[id(param.grad)] = _Piece(fqn, model, layouts.get(fqn), mesh)
    return found


def bound_params(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``params`` is a parameter of a model hp_lazy bound."""
    ids = {id(p) for p in params}
    return any(id(p) in ids for model in list(_MODELS) for p in model.parameters())


def get_total_norm(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor | None:
    """The norm of the full gradients ``tensors`` (gradients of bound models), or ``None`` when
    none of them is such a gradient (the caller then uses torch's own)."""
    grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    known = _known()
    pieces = [known[id(g)] for g in grads if id(g) in known]
    if not pieces:
        return None
    if len(pieces) < len(grads):
        other = next(g for g in grads if id(g) not in known)
        raise ShardingError(
            f"clip_grad_norm_/get_total_norm: {len(grads) - len(pieces)} of the {len(grads)} gradients (e.g. one of "
            f"shape {list(other.shape)}) belong to no model hp_lazy bound, the others to {pieces[0].fqn} and more of "
            "a parallel model; hp_lazy cannot tell which ranks hold the same values of the foreign ones; clip the "
            "parallel model's parameters in a call of their own"
        )
    _check_reduced(pieces)
    total = _global_norm(grads, pieces, float(norm_type))
    if error_if_nonfinite and (total.isnan() or total.isinf()):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return total


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with one process's total norm for a parallel model
    (returned, before clipping); for parameters of no bound model it is torch's own."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    with torch.no_grad():
        total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        if total is None:  # no gradient of a bound model: torch's own
            total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


def _check_reduced(pieces: list[_Piece]) -> None:
    for model in {id(p.model): p.model for p in pieces}.values():
        owner = owner_of(model)
        waiting = owner.unreduced() if owner is not None else []
        if waiting:
            raise ShardingError(
                f"clip_grad_norm_: the gradients of {waiting[0]} (and {len(waiting) - 1} more) were accumulated under "
                "hp_lazy.no_sync and are not reduced over the ranks yet; clip after the backward that runs outside "
                "no_sync (the last micro-batch's)"
            )


def _global_norm(grads: list[torch.Tensor], pieces: list[_Piece], p: float) -> torch.Tensor:
    if not (p == math.inf or (p > 0 and math.isfinite(p))):
        raise ShardingError(
            f"clip_grad_norm_: norm_type={p} is not implemented for a parallel model (its pieces are counted once "
            "each for p-norms with p > 0 and for inf); use norm_type=2.0 or float('inf')"
        )
    locals_ = [_local(g, piece) for g, piece in zip(grads, pieces, strict=True)]
    device, dtype = locals_[0][0].device, locals_[0][0].dtype
    if p == math.inf:
        norms = [torch.linalg.vector_norm(t, p).to(device, dtype) for t, _ in locals_]
        local = torch.stack(norms).max() if norms else torch.zeros((), device=device, dtype=dtype)
        op = dist.ReduceOp.MAX
    else:
        norms = [torch.linalg.vector_norm(t, p).to(device, dtype) ** p for t, counted in locals_ if counted]
        local = torch.stack(norms).sum() if norms else torch.zeros((), device=device, dtype=dtype)
        op = dist.ReduceOp.SUM
    world = pieces[0].mesh.group_of(WORLD_AXES)
    if world.size > 1:
        local = wire.all_reduce(local.reshape(1).contiguous(), world, None, op=op).reshape(())
    return local if p == math.inf else local ** (1.0 / p)


def _local(grad: torch.Tensor, piece: _Piece) -> tuple[torch.Tensor, bool]:
    """This rank's values of ``grad`` and whether this rank counts them."""
    dp_sharded = False
    if hasattr(grad, "to_local") and hasattr(grad, "placements"):  # a DTensor (FSDP2 over dp)
        dp_sharded = _fsdp_sharded(grad, piece)
        grad = grad.to_local()
    return grad, _counted(piece, dp_sharded)


def _fsdp_sharded(grad: Any, piece: _Piece) -> bool:
    names = tuple(grad.device_mesh.mesh_dim_names or ())
    expert = piece.layout is not None and piece.layout.on("ep") is not None
    if names != ((EDP,) if expert else ("dp",)) or any(p.is_partial() for p in grad.placements):
        raise ShardingError(
            f"clip_grad_norm_: the gradient of {piece.fqn} is a DTensor on the mesh {names} with placements "
            f"{tuple(grad.placements)}; hp_lazy counts DTensor gradients only as FSDP2 leaves them on hp_lazy's dp "
            "sub-mesh (fully_shard(..., mesh=hp_lazy.mesh().device_mesh['dp'])), and an expert slice's on its "
            "edp mesh (hp_lazy.mesh().edp_mesh())"
        )
    return any(p.is_shard() for p in grad.placements)


def _counted(piece: _Piece, dp_sharded: bool) -> bool:
    """This rank is the first of the ranks holding the same values of the piece."""
    mesh, layout = piece.mesh, piece.layout
    tp = mesh.group("tp")
    cut = layout.on("tp") if layout is not None else None
    if tp.rank % (cut.replicas if cut is not None else tp.size):
        return False
    dp, cp = mesh.group("dp"), mesh.group("cp")
    ep = layout.on("ep") if layout is not None else None
    if dp_sharded:  # FSDP2's chunk: distinct on every dp rank, an expert slice's on every token rank (edp x ep)
        return ep is not None or cp.rank == 0
    token = dp.rank * cp.size + cp.rank  # ep groups are runs of ep consecutive token ranks
    if ep is not None:
        return token < ep.size and (token % ep.size) % ep.replicas == 0
    return token == 0


# -- routing the stock calls ------------------------------------------------------------------------
_INSTALLED: list[bool] = []


def install() -> None:
    """Route torch's ``get_total_norm`` (and so ``clip_grad_norm_``) through :func:`get_total_norm`;
    idempotent, and nothing changes for tensors that are no gradient of a bound model."""
    from torch.nn import utils
    from torch.nn.utils import clip_grad

    if _INSTALLED:
        return
    _INSTALLED.append(True)
    stock = getattr(clip_grad, "_get_total_norm", None)
    if stock is None:  # torch < 2.6: no get_total_norm to route; refuse what would be wrong
        utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = _refused(clip_grad.clip_grad_norm_)
        return

    def routed(
        tensors: torch.Tensor | Iterable[torch.Tensor],
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        with torch.no_grad():
            total = get_total_norm(tensors, norm_type, error_if_nonfinite, foreach) if tensors else None
        return stock(tensors, norm_type, error_if_nonfinite, foreach) if total is None else total

    routed.__doc__ = stock.__doc__
    routed.__wrapped__ = stock  # type: ignore[attr-defined]
    clip_grad._get_total_norm = routed  # clip_grad_norm_ calls it by this name
    utils.get_total_norm = routed
    scale = getattr(clip_grad, "_clip_grads_with_norm_", None)
    if scale is not None:
        clip_grad._clip_grads_with_norm_ = utils.clip_grads_with_norm_ = _per_mesh(scale)


def _per_mesh(stock: Callable[..., None]) -> Callable[..., None]:
    """torch's scaling of the gradients by the clip coefficient, once per DTensor mesh: one
    ``_foreach_mul_`` over FSDP2 gradients on two meshes (the dense parameters' dp, the experts'
    edp) is refused by DTensor."""

    def clip_grads_with_norm_(parameters: Any, max_norm: float, total_norm: torch.Tensor,
                              foreach: bool | None = None) -> None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        by_mesh: dict[int, list[torch.Tensor]] = {}
        for param in params:
            by_mesh.setdefault(id(getattr(param.grad, "device_mesh", None)), []).append(param)
        for group in by_mesh.values() if len(by_mesh) > 1 else [params]:
            stock(group, max_norm, total_norm, foreach)

    clip_grads_with_norm_.__doc__ = stock.__doc__
    clip_grads_with_norm_.__wrapped__ = stock  # type: ignore[attr-defined]
    return clip_grads_with_norm_


def _refused(stock: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if bound_params(params):
            raise ShardingError(
                f"torch.nn.utils.clip_grad_norm_: torch {torch.__version__} has no get_total_norm for hp_lazy to "
                "route, so the norm would be this rank's shards only; install torch >= 2.6"
            )
        return stock(params, *args, **kwargs)

    clip_grad_norm_.__wrapped__ = stock  # type: ignore[attr-defined]
    return clip_grad_norm_
