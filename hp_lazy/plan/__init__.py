"""What is sharded: placements, contracts, plans and their per-module slices.

Layers, each importing only those above it in this list: ``fqn`` (globs), ``placement``,
``transitions`` (src/dst -> op, output keys), ``model`` (contracts, slices), ``parse``
(validation), ``source`` (the one parse and class hierarchy of a modeling source, shared with the
lowerer), ``resolve`` (static class graph), ``auto`` (transformers' TP and EP plans: ``auto.rules``
reads them, one preset per axis — ``auto.tp``, ``auto.sp``, ``auto.cp``, ``auto.ep`` — fills an
``auto.draft``),
``slice``, and ``plan`` (:class:`Plan`, which ties them together).
"""

from hp_lazy.plan.model import AutoFlags, Contract, InnerOp, ModulePlan, Region
from hp_lazy.plan.placement import PackedShard, Partial, Placement, Replicate, Shard
from hp_lazy.plan.plan import Plan

__all__ = [
    "AutoFlags",
    "Contract",
    "InnerOp",
    "ModulePlan",
    "PackedShard",
    "Partial",
    "Placement",
    "Plan",
    "Region",
    "Replicate",
    "Shard",
]
