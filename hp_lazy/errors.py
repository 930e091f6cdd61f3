"""The one exception hierarchy of hp_lazy.

Every message names the module FQN (or source module), the offending value, the constraint it
breaks and the fix, in that order, e.g.::

    model.layers.*.self_attn: num_key_value_heads=2 is not divisible by tp=4; use tp in {1, 2}
"""

from __future__ import annotations


class HpLazyError(Exception):
    """Base class of every error hp_lazy raises on purpose."""


class PlanError(HpLazyError, ValueError):
    """The plan is malformed, or does not fit the modeling source it is applied to."""


class LoweringError(HpLazyError):
    """A boundary class cannot be rewritten (source shape the lowerer does not handle)."""


class ShardingError(HpLazyError, RuntimeError):
    """Run time: a model, a mesh or a tensor does not fit the plan (sizes, binding, ranks)."""
