"""Run-time implementations for modules hp_lazy does not rewrite from source.

torch leaves (``nn.Embedding``, ``nn.Linear``), classes imported from elsewhere and contracts
marked ``skip_source_lowering`` get a subclass (``module.__class__`` is swapped, so ``isinstance``,
``state_dict`` names and optimizer references are unchanged) whose forward applies the same
entry/exit ops a lowered forward would:

- ``nn.Embedding`` with its weight ``S(0)`` on tp is vocab-parallel: ids outside this rank's rows
  are masked, looked up locally and zeroed; the exit op sums the partial rows (``P(sum)``);
- ``nn.ModuleList`` (the decoder-layer stack under sequence parallel) applies its entry op to the
  first layer's hidden states and its exit op to the last layer's output;
- anything else wraps its own forward: entry ops on the declared inputs, exit ops on the output.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.binding import Binding


def install(module: nn.Module, binding: Binding) -> None:
    module._hp_b = binding
    if isinstance(module, nn.ModuleList):
        _install_stack(module, binding)
    elif isinstance(module, nn.Embedding) and _vocab_sharded(binding):
        _install_vocab_parallel(module, binding)
    else:
        module._hp_inputs = _input_positions(type(module), binding)
        module.__class__ = _subclass(type(module), _LeafForward)


def _vocab_sharded(binding: Binding) -> bool:
    placement = binding.contract.params.get("weight", {}).get("tp")
    return placement is not None and placement.kind == "S" and placement.normalized(2).dim == 0


class _LeafForward:
    """Mixin: ``forward`` = entry ops on declared inputs -> the class's own forward -> exit ops."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        binding: Binding = self._hp_b
        args = list(args)
        for name, position in self._hp_inputs:
            if position is not None and position < len(args):
                args[position] = binding.enter(name, args[position])
            elif name in kwargs:
                kwargs[name] = binding.enter(name, kwargs[name])
        return binding.exit(super().forward(*args, **kwargs))


def _input_positions(cls: type, binding: Binding) -> tuple[tuple[str, int | None], ...]:
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = sorted(set(binding.contract.in_src) | set(binding.contract.in_dst))
    if len(names) == 1 and names[0] not in positional and names[0] == "input" and positional:
        return ((names[0], 0),)  # "input" names the first input of any leaf
    return tuple((name, positional.index(name) if name in positional else None) for name in names)


class _VocabParallelEmbedding:
    """Mixin for an ``nn.Embedding`` (or a subclass whose forward is linear in the lookup, e.g. a
    scaled embedding) holding rows ``[start, end)`` of the vocabulary: ids of other ranks are
    looked up as row 0 and zeroed, and the exit op sums the partial results."""

    def forward(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        start, end = self._hp_vocab
        outside = (input < start) | (input >= end)
        out = super().forward((input - start).masked_fill(outside, 0), *args, **kwargs)
        return self._hp_b.exit(out.masked_fill(outside.unsqueeze(-1), 0.0))


def _install_vocab_parallel(module: nn.Embedding, binding: Binding) -> None:
    group = binding.groups["tp"]
    rows = module.weight.shape[0]  # already the local shard
    start = group.rank * rows
    module._hp_vocab = (start, start + rows)
    pad = module.padding_idx  # F.embedding skips the gradient of this (now local) row
    module.padding_idx = pad - start if pad is not None and start <= pad < start + rows else None
    module.__class__ = _subclass(type(module), _VocabParallelEmbedding)


def _install_stack(stack: nn.ModuleList, binding: Binding) -> None:
    if len(stack) == 0:
        raise ShardingError(f"{binding.fqn}: the layer stack is empty; remove its contract from the plan")
    first, last = stack[0], stack[len(stack) - 1]
    first.register_forward_pre_hook(_stack_entry(binding), with_kwargs=True)
    last.register_forward_hook(_stack_exit(binding))


def _stack_entry(binding: Binding):
    (name,) = binding.in_ops or ("input",)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (binding.enter(name, args[0]), *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        kwargs[key] = binding.enter(name, kwargs[key])
        return args, kwargs

    return hook


def _stack_exit(binding: Binding):
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return binding.exit(output)

    return hook


class _NoBiasLinear:
    """Mixin for ``nn.Linear`` whose bias is added by its boundary after the reduction."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight)


class _NoBiasModule:
    """Mixin for any other module owning a deferred bias: the bias is hidden during forward."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bias = self._parameters["bias"]
        self._parameters["bias"] = None
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._parameters["bias"] = bias


def suppress_bias(owner: nn.Module) -> None:
    """Keep ``owner.bias`` registered (state_dict, optimizer) but out of ``owner``'s forward."""
    if issubclass(type(owner), (_NoBiasLinear, _NoBiasModule)):
        return
    mixin = _NoBiasLinear if type(owner).forward is nn.Linear.forward else _NoBiasModule
    owner.__class__ = _subclass(type(owner), mixin)


@lru_cache(maxsize=None)
def _subclass(cls: type, mixin: type) -> type:
    return type(cls.__name__, (mixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
