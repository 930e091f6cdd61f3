"""Sequence parallel: the decoder-layer stack (an ``nn.ModuleList``) is the boundary.

Its entry op scatters the first layer's hidden states along the sequence (``R -> S(1)`` on tp)
and its exit op gathers the last layer's output (``S(1) -> R``), so the model-level code
(position ids, causal mask, rotary, loss) still sees the whole sequence while every block
between holds ``seq / tp`` tokens. Hidden states that stack several per-token streams in front of
``[B, S, H]`` (Gemma 3n's AltUp, ``[A, B, S, H]``) are cut and joined at their own sequence dim,
the one before the features. Per-layer inputs and token mixers outside the boundaries:
:mod:`.inputs`, :mod:`.mixers`.

Gradient policy: parameters that act on sequence-sharded activations and are not sharded
themselves (the blocks' norms, a rowwise bias added after a reduce-scatter) see only this rank's
tokens, so their gradient is a partial sum over tp (:func:`sequence_sharded_params`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.plan.model import Contract
from hp_lazy.plan.placement import Shard
from hp_lazy.runtime.binding import Binding
from hp_lazy.runtime.comm import pairs


def install_stack(stack: nn.ModuleList, binding: Binding) -> None:
    if len(stack) == 0:
        raise ShardingError(f"{binding.fqn}: the layer stack is empty; remove its contract from the plan")
    stack[0].register_forward_pre_hook(_stack_entry(binding), with_kwargs=True)
    stack[len(stack) - 1].register_forward_hook(_stack_exit(binding))


def _stack_entry(binding: Binding) -> Callable[..., tuple[tuple, dict]]:
    (name,) = binding.in_ops or ("input",)

    def enter(x: Any) -> Any:
        stacked = _stacked(binding, x)
        return binding.enter(name, x) if stacked is None else pairs.scatter_to(x, binding.groups["tp"], stacked)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (enter(args[0]), *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        kwargs[key] = enter(kwargs[key])
        return args, kwargs

    return hook


def _stack_exit(binding: Binding) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        first = output[0] if isinstance(output, tuple) else output
        stacked = _stacked(binding, first)
        if stacked is None:
            return binding.exit(output)
        joined = pairs.gather_from(first, binding.groups["tp"], stacked)
        return (joined, *output[1:]) if isinstance(output, tuple) else joined

    return hook


def _stacked(binding: Binding, x: Any) -> int | None:
    """The sequence dim of hidden states that stack several per-token streams in front of
    ``[B, S, H]`` (Gemma 3n's AltUp predictions, ``[A, B, S, H]``): the one before the features,
    where the contract's ``S(1)`` names ``[B, S, H]``'s; None for ``[B, S, H]`` itself."""
    shard = binding.contract.placement("in_dst", next(iter(binding.contract.in_dst), "input"), "tp")
    if not isinstance(x, torch.Tensor) or x.dim() <= 3 or not isinstance(shard, Shard) or shard.dim != 1:
        return None
    return x.dim() - 2


def scatters_output(contract: Contract) -> bool:
    """The boundary's output leaves sequence-sharded (``P(sum) -> S(1)``): a bias added after
    the reduction meets only this rank's tokens."""
    out = contract.out_dst.get("output", {}).get("tp")
    return out is not None and out.is_shard


def sequence_sharded_params(module: nn.Module, contract: Contract, claimed: set[int]) -> list[nn.Parameter]:
    """``grad_sum_params: ["*"]``: every parameter under ``module`` that no contract with params claims."""
    if not any(name in ("*", "**") for name in contract.grad_sum_params):
        return []
    return [p for p in module.parameters() if id(p) not in claimed]
