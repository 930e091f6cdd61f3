"""What is sharded: placements, contracts, plans and their per-module slices."""

from hp_lazy.plan.model import Contract, InnerOp, ModulePlan, Plan, Region
from hp_lazy.plan.placement import PackedShard, Partial, Placement, Replicate, Shard

__all__ = [
    "Contract", "InnerOp", "ModulePlan", "PackedShard", "Partial", "Placement", "Plan", "Region", "Replicate", "Shard",
]
