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
    "collective_counter",
    "deactivate",
    "full_grads",
    "full_state_dict",
    "lower_source",
    "mesh",
    "parallelize",
]

_LAZY = {
    "activate": "hp_lazy.hook.api",
    "deactivate": "hp_lazy.hook.api",
    "lower_source": "hp_lazy.lower",
    "parallelize": "hp_lazy.runtime.bind",
    "full_state_dict": "hp_lazy.runtime.state",
    "full_grads": "hp_lazy.runtime.state",
    "collective_counter": "hp_lazy.runtime.collectives",
    "mesh": "hp_lazy.runtime.mesh",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hp_lazy' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
