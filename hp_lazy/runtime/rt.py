"""The names lowered code calls, as ``__hp_rt__.<name>`` (docs/contract.md).

This module is the whole contract between the two halves: the lowerer emits calls to these
names only, and the loader puts this module into each lowered module as ``__hp_rt__``.
"""

from __future__ import annotations

from typing import Any, NoReturn

from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.binding import Binding, add_deferred_bias
from hp_lazy.runtime.collectives import (
    all_to_all,
    copy_to,
    gather_from,
    gather_to,
    reduce_from,
    reduce_scatter_to,
    scatter_to,
)

__all__ = [
    "add_deferred_bias",
    "all_to_all",
    "copy_to",
    "ensure_parallel",
    "enter",
    "enter_call",
    "exit",
    "gather_from",
    "gather_to",
    "install_root",
    "reduce_from",
    "reduce_scatter_to",
    "region",
    "scatter_to",
    "unbound",
]


class Unbound:
    """Class-level default of ``_hp_b``: any use means the model was never bound."""

    __slots__ = ("qualname",)

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def __getattr__(self, name: str) -> NoReturn:
        raise ShardingError(
            f"{self.qualname}: this forward was lowered by hp_lazy but runs on an instance that was never "
            "bound (its parameters are not sharded, it has no process group); call "
            "hp_lazy.parallelize(model) on the top-level model before the first forward, or run the "
            "top-level model's forward, which binds it"
        )

    def __repr__(self) -> str:
        return f"<hp_lazy unbound {self.qualname}>"


def unbound(qualname: str) -> Unbound:
    return Unbound(qualname)


def ensure_parallel(module: nn.Module) -> None:
    """Root prologue: bind the model on its first forward; a dict lookup afterwards."""
    if "_hp_bound" not in module.__dict__:
        from hp_lazy.runtime.bind import parallelize

        parallelize(module)


def install_root(cls: type) -> None:
    """Give a root class whose ``forward`` is inherited a prologue, keeping the signature."""
    import functools

    inherited = cls.forward

    @functools.wraps(inherited)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        ensure_parallel(self)
        return inherited(self, *args, **kwargs)

    cls.forward = forward


def enter(binding: Binding, name: str, value: Any) -> Any:
    """Generic form: the entry ops of input ``name``."""
    return binding.enter(name, value)


def enter_call(binding: Binding, fn: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Generic form of a forward inherited from another module: the entry ops of the declared
    inputs, found by name in ``fn``'s signature."""
    import inspect

    bound = inspect.signature(fn).bind_partial(*args, **kwargs)
    for name in binding.in_ops:
        if name in bound.arguments:
            bound.arguments[name] = binding.enter(name, bound.arguments[name])
    return bound.args, bound.kwargs


def exit(binding: Binding, outputs: Any) -> Any:  # noqa: A001 - the contract's name
    """Generic form: every exit op, by output position, plus deferred biases."""
    return binding.exit(outputs)


def region(module: nn.Module, binding: Binding, *args: Any, **kwargs: Any) -> Any:
    """Region form: the injection's local compute function replaces the body."""
    if binding.compute is None:
        raise ShardingError(
            f"{binding.fqn}: the region form needs an injection with 'local_compute_fn' (a dotted path to "
            "fn(module, *args, **kwargs)); add it to the plan's injections"
        )
    return binding.compute(module, *args, **kwargs)
