"""Parameter shards: plain local tensors, cut from the full tensor and glued back.

A sharded parameter stays the same ``nn.Parameter`` object (``param.data`` is replaced), so an
optimizer built before sharding keeps valid references; it carries its :class:`ShardSpec` as
``param._hp_shard`` so the state helpers can rebuild the full tensor.

Layouts, for a tp group of size ``n`` and local rank ``r``::

    S(d)      full [.., D, ..]      -> local [.., D/n, ..]        chunk r of n
    SS(d,k)   full [.., k*B, ..]    -> local [.., k*B/n, ..]      chunk r of each of the k blocks
    S(d) with ``replicas`` = m      -> local [.., D*m/n, ..]      chunk r//m of n/m (KV heads
              replicated over m ranks when tp > num_key_value_heads)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.plan.placement import Placement
from hp_lazy.runtime import collectives
from hp_lazy.runtime.mesh import Group


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    fqn: str
    placement: Placement  # "S" or "SS", dim normalised (>= 0)
    group: Group
    full_shape: tuple[int, ...]
    replicas: int = 1

    @property
    def pieces(self) -> int:
        """How many distinct chunks the dim is cut into."""
        return self.group.size // self.replicas

    @property
    def piece(self) -> int:
        return self.group.rank // self.replicas


def make_spec(fqn: str, full: torch.Tensor, placement: Placement, group: Group, *, replicas: int = 1) -> ShardSpec:
    """Check that ``full`` divides as ``placement`` asks and describe the shard."""
    placement = placement.normalized(full.dim())
    if placement.dim is None or placement.dim >= full.dim():
        raise ShardingError(
            f"{fqn}: placement {placement} does not fit a parameter of shape {tuple(full.shape)}; fix the plan's params"
        )
    size = full.shape[placement.dim]
    pieces = group.size // replicas
    blocks = placement.blocks or 1
    if size % (pieces * blocks):
        what = f"{blocks} packed blocks x tp={group.size}" if blocks > 1 else f"tp={group.size}"
        raise ShardingError(
            f"{fqn}: dim {placement.dim} of size {size} is not divisible by {what}; "
            f"use a tp that divides {size // blocks}"
        )
    return ShardSpec(fqn=fqn, placement=placement, group=group, full_shape=tuple(full.shape), replicas=replicas)


def local_shard(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's piece of ``full`` (a contiguous copy)."""
    dim, blocks = spec.placement.dim, spec.placement.blocks or 1
    assert dim is not None
    parts = full.chunk(blocks, dim=dim)
    local = [part.chunk(spec.pieces, dim=dim)[spec.piece] for part in parts]
    return torch.cat(local, dim=dim).contiguous() if blocks > 1 else local[0].contiguous()


def shard_parameter(param: nn.Parameter, spec: ShardSpec) -> None:
    """Replace ``param.data`` by its local shard, in place; idempotent per parameter (a tied
    weight is one Parameter, so both of its modules must ask for the same layout)."""
    done = getattr(param, "_hp_shard", None)
    if done is not None:
        if (done.placement, done.replicas) != (spec.placement, spec.replicas):
            raise ShardingError(
                f"{spec.fqn}: this parameter is tied to {done.fqn}, sharded {done.placement}, but the plan "
                f"asks for {spec.placement} here; give tied parameters one placement"
            )
        return
    with torch.no_grad():
        param.data = local_shard(param.data, spec)
    param._hp_shard = spec  # type: ignore[attr-defined]


def full_tensor(local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """All-gather the shards of every rank of ``spec.group`` into the full tensor (a collective)."""
    dim, blocks = spec.placement.dim, spec.placement.blocks or 1
    assert dim is not None
    gathered = collectives.all_gather_list(local.detach().contiguous(), spec.group)
    distinct = gathered[:: spec.replicas]
    if blocks == 1:
        return torch.cat(distinct, dim=dim)
    per_rank = [g.chunk(blocks, dim=dim) for g in distinct]
    return torch.cat([torch.cat([p[b] for p in per_rank], dim=dim) for b in range(blocks)], dim=dim)
