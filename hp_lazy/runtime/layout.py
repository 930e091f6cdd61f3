"""Parameter layouts: one side table, keyed by parameter FQN, of full shapes and per-axis shards.

A :class:`ParamLayout` is computed from shapes alone (it works on the meta device and before any
weight is read) and says, for every mesh axis that shards the parameter, which dim is cut, into
how many pieces, and which piece this rank holds. Axes are applied outermost first (``ep`` before
``tp``): the ``tp`` cut is taken of the ``ep`` piece. Layouts, for a group of size ``n`` and rank
``r`` on one axis::

    Shard(d)          [.., D, ..]    -> [.., D/n, ..]       chunk r of n
    PackedShard(d,k)  [.., k*B, ..]  -> [.., k*B/n, ..]     chunk r of each of the k blocks
    Shard(d), replicas=m             -> [.., D*m/n, ..]     chunk r//m of n/m (K/V heads kept
                                                            on m ranks when tp > kv heads)

The table lives in the bound model's record (:mod:`hp_lazy.runtime.record`) and names parameters, never holds
them, so it survives FSDP2 swapping the ``nn.Parameter`` objects; ``full_state_dict`` /
``full_grads`` and the gradient owner read it. Sharding replaces ``param.data`` in place by a
tensor that owns its storage (no view keeps the full tensor alive), so an optimizer built before
sharding keeps valid references.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.plan.placement import Placement, Shard
from hp_lazy.runtime.comm import wire
from hp_lazy.runtime.mesh import Group


@dataclass(frozen=True, kw_only=True)
class AxisShard:
    """The cut one mesh axis makes: ``pieces`` chunks of ``dim`` (each of ``blocks`` blocks)."""

    axis: str
    dim: int
    blocks: int
    size: int  # ranks on the axis
    rank: int
    replicas: int = 1  # ranks that hold the same piece

    @property
    def pieces(self) -> int:
        return self.size // self.replicas

    @property
    def piece(self) -> int:
        return self.rank // self.replicas

    def describe(self) -> str:
        """``S(0)``, ``SS(0,2)``; `` (kept on 2 ranks)`` for a replicated piece."""
        packed = f",{self.blocks}" if self.blocks > 1 else ""
        held = f" (kept on {self.replicas} ranks)" if self.replicas > 1 else ""
        return f"S{'S' if self.blocks > 1 else ''}({self.dim}{packed}){held}"


@dataclass(frozen=True, kw_only=True)
class ParamLayout:
    """Full shape and every axis's cut of one parameter (``shards`` outermost axis first)."""

    fqn: str
    full_shape: tuple[int, ...]
    shards: tuple[AxisShard, ...]

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        for cut in self.shards:
            shape[cut.dim] //= cut.pieces
        return tuple(shape)

    def on(self, axis: str) -> AxisShard | None:
        return next((cut for cut in self.shards if cut.axis == axis), None)

    def describe(self) -> str:
        """``S(0)`` for one axis; ``S(0) on ep, S(1) on tp`` for several."""
        if len(self.shards) == 1:
            return self.shards[0].describe()
        return ", ".join(f"{cut.describe()} on {cut.axis}" for cut in self.shards)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``full``, in a storage of its own."""
        out = full
        for cut in self.shards:
            out = _cut(out, cut)
        fresh = out is not full and out._base is None and out.is_contiguous()  # torch.cat made it
        return out if fresh else out.clone(memory_format=torch.contiguous_format)

    def gather(self, local: torch.Tensor, groups: Mapping[str, Group]) -> torch.Tensor:
        """The full tensor from every rank's shard (a collective over each sharding axis)."""
        out = local.detach().contiguous()
        for cut in reversed(self.shards):
            out = _glue(wire.all_gather_list(out, groups[cut.axis])[:: cut.replicas], cut)
        return out


def _cut(full: torch.Tensor, cut: AxisShard) -> torch.Tensor:
    parts = full.chunk(cut.blocks, dim=cut.dim)
    local = [part.chunk(cut.pieces, dim=cut.dim)[cut.piece] for part in parts]
    return torch.cat(local, dim=cut.dim) if cut.blocks > 1 else local[0]


def _glue(pieces: list[torch.Tensor], cut: AxisShard) -> torch.Tensor:
    if cut.blocks == 1:
        return torch.cat(pieces, dim=cut.dim)
    per_piece = [p.chunk(cut.blocks, dim=cut.dim) for p in pieces]
    return torch.cat([torch.cat([p[b] for p in per_piece], dim=cut.dim) for b in range(cut.blocks)], dim=cut.dim)


def plan_layout(
    fqn: str,
    full_shape: tuple[int, ...],
    placements: Mapping[str, Placement],
    groups: Mapping[str, Group],
    *,
    replicas: Mapping[str, int] | None = None,
) -> ParamLayout:
    """Check that ``full_shape`` divides as ``placements`` asks on every axis and describe the shards.

    Axes of size 1 and replicated axes cut nothing. Two axes may cut the same dim (the second
    cuts the first's piece).
    """
    shape, cuts = list(full_shape), []
    for axis in groups:  # mesh order, outermost first
        placement = placements.get(axis)
        group = groups[axis]
        if not isinstance(placement, Shard) or group.size == 1:
            continue
        cut = _axis_cut(fqn, tuple(shape), placement, group, (replicas or {}).get(axis, 1))
        shape[cut.dim] //= cut.pieces
        cuts.append(cut)
    return ParamLayout(fqn=fqn, full_shape=tuple(full_shape), shards=tuple(cuts))


def _axis_cut(fqn: str, shape: tuple[int, ...], placement: Shard, group: Group, replicas: int) -> AxisShard:
    dim = placement.dim + len(shape) if placement.dim < 0 else placement.dim
    if not 0 <= dim < len(shape):
        raise ShardingError(
            f"{fqn}: placement {placement} on {group.axis} does not fit a parameter of shape {list(shape)}; "
            "fix the plan's params"
        )
    cut = AxisShard(
        axis=group.axis, dim=dim, blocks=placement.blocks, size=group.size, rank=group.rank, replicas=replicas
    )
    if shape[dim] % (cut.pieces * cut.blocks):
        what = f"{group.axis}={cut.pieces}"
        what = f"{cut.blocks} packed blocks x {what}" if cut.blocks > 1 else what
        raise ShardingError(
            f"{fqn}: dim {dim} of size {shape[dim]} is not divisible by {what}; "
            f"use a {group.axis} degree that divides {shape[dim] // cut.blocks}"
        )
    return cut


class LayoutTable:
    """Parameter FQN (relative to the bound root, every tied alias included) -> layout."""

    def __init__(self, groups: Mapping[str, Group]) -> None:
        self.groups = dict(groups)
        self._by_fqn: dict[str, ParamLayout] = {}

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._by_fqn

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_fqn)

    def get(self, fqn: str) -> ParamLayout | None:
        return self._by_fqn.get(fqn)

    def add(self, layout: ParamLayout) -> None:
        """Record ``layout``; a parameter may be named twice only with one layout (tied weights)."""
        earlier = self._by_fqn.get(layout.fqn)
        if earlier is not None and earlier.shards != layout.shards:
            raise ShardingError(
                f"{layout.fqn}: the plan lays this parameter out as {layout.describe()} here and as "
                f"{earlier.describe()} elsewhere (tied weights are one parameter); give it one placement"
            )
        self._by_fqn[layout.fqn] = layout

    def alias(self, fqn: str, layout: ParamLayout) -> None:
        self._by_fqn.setdefault(fqn, replace(layout, fqn=fqn))

    def replace(self, layout: ParamLayout) -> None:
        """A parameter's new layout (its full shape changed: ``resize_token_embeddings``)."""
        self._by_fqn[layout.fqn] = layout


def shard_in_place(param: nn.Parameter, layout: ParamLayout) -> None:
    """Replace ``param.data`` by this rank's shard (the same Parameter object stays)."""
    if tuple(param.shape) == layout.local_shape and tuple(param.shape) != layout.full_shape:
        return  # already sharded (a tied weight reached from its second module)
    if tuple(param.shape) != layout.full_shape:
        raise ShardingError(
            f"{layout.fqn}: the parameter has shape {list(param.shape)}, but its layout expects the full "
            f"shape {list(layout.full_shape)}; shard the model once, from the full checkpoint"
        )
    with torch.no_grad():
        param.data = layout.local(param.data)
    mark_full_shape(param, layout)


def mark_full_shape(param: nn.Parameter, layout: ParamLayout) -> None:
    """Give a cut parameter its full shape as ``ds_shape``: the attribute PEFT reads for the real
    shape of a parameter held in shards (DeepSpeed ZeRO-3's name for it), so the LoRA adapters PEFT
    sizes from a 3-D expert tensor are one process's (:mod:`hp_lazy.runtime.adapters`)."""
    if layout.shards:
        param.ds_shape = torch.Size(layout.full_shape)  # type: ignore[attr-defined]
