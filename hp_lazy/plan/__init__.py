"""What is sharded: placements, contracts, plans and their per-module slices."""

from hp_lazy.plan.model import Contract, ModulePlan, Plan
from hp_lazy.plan.placement import PackedShard, Partial, Placement, Replicate, Shard

__all__ = ["Contract", "ModulePlan", "PackedShard", "Partial", "Placement", "Plan", "Replicate", "Shard"]
