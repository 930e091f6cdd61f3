"""Sequence parallel: the decoder-layer stack (an ``nn.ModuleList``) is the boundary.

Its entry op scatters the first layer's hidden states along the sequence (``R -> S(1)`` on tp)
and its exit op gathers the last layer's output (``S(1) -> R``), so the model-level code
(position ids, causal mask, rotary, loss) still sees the whole sequence while every block
between holds ``seq / tp`` tokens.

Gradient policy: parameters that act on sequence-sharded activations and are not sharded
themselves (the blocks' norms, a rowwise bias added after a reduce-scatter) see only this rank's
tokens, so their gradient is a partial sum over tp (:func:`sequence_sharded_params`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.plan.model import Contract
from hp_lazy.runtime.binding import Binding


def install_stack(stack: nn.ModuleList, binding: Binding) -> None:
    if len(stack) == 0:
        raise ShardingError(f"{binding.fqn}: the layer stack is empty; remove its contract from the plan")
    stack[0].register_forward_pre_hook(_stack_entry(binding), with_kwargs=True)
    stack[len(stack) - 1].register_forward_hook(_stack_exit(binding))


def _stack_entry(binding: Binding) -> Callable[..., tuple[tuple, dict]]:
    (name,) = binding.in_ops or ("input",)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (binding.enter(name, args[0]), *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        kwargs[key] = binding.enter(name, kwargs[key])
        return args, kwargs

    return hook


def _stack_exit(binding: Binding) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return binding.exit(output)

    return hook


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
