"""Collectives: the wire (:mod:`.wire`, counted c10d calls) and the autograd pairs built on it
(:mod:`.pairs`, named by where the tensor goes)."""

from hp_lazy.runtime.comm.pairs import (
    PAIRS,
    all_to_all,
    all_to_all_v,
    copy_to,
    gather_from,
    gather_kv,
    gather_to,
    reduce_from,
    reduce_scatter_to,
    scatter_to,
)
from hp_lazy.runtime.comm.wire import (
    CollectiveCounter,
    all_gather_list,
    all_reduce_,
    collective_counter,
)

__all__ = [
    "PAIRS",
    "CollectiveCounter",
    "all_gather_list",
    "all_reduce_",
    "all_to_all",
    "all_to_all_v",
    "collective_counter",
    "copy_to",
    "gather_from",
    "gather_kv",
    "gather_to",
    "reduce_from",
    "reduce_scatter_to",
    "scatter_to",
]
