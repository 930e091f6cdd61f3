"""hp_lazy: tensor/sequence parallel transformers by rewriting modeling code at import time.

``import hp_lazy; hp_lazy.activate("auto", tp=2)`` before importing a model; see README.md.
Importing this package is cheap: torch is imported only by the run-time names below.
"""

from __future__ import annotations

from typing import Any

from hp_lazy.errors import HpLazyError, LoweringError, PlanError, ShardingError
from hp_lazy.plan import Plan

__version__ = "0.1.0"

__all__ = [
    "HpLazyError",
    "LoweringError",
    "Plan",
    "PlanError",
    "ShardingError",
    "activate",
    "clip_grad_norm_",
    "collective_counter",
    "deactivate",
    "expert_load",
    "full_grads",
    "full_state_dict",
    "full_weights",
    "gather_sequence",
    "layout",
    "lower_source",
    "mesh",
    "no_sync",
    "parallelize",
    "whole_outputs",
]

_LAZY = {
    "activate": "hp_lazy.api",
    "clip_grad_norm_": "hp_lazy.api",
    "deactivate": "hp_lazy.api",
    "lower_source": "hp_lazy.lower",
    "parallelize": "hp_lazy.api",
    "full_state_dict": "hp_lazy.api",
    "full_grads": "hp_lazy.api",
    "full_weights": "hp_lazy.api",
    "expert_load": "hp_lazy.api",
    "gather_sequence": "hp_lazy.api",
    "layout": "hp_lazy.api",
    "no_sync": "hp_lazy.api",
    "collective_counter": "hp_lazy.runtime.comm",
    "mesh": "hp_lazy.api",
    "whole_outputs": "hp_lazy.api",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hp_lazy' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
