"""Sequence parallel: the decoder-layer stack (an ``nn.ModuleList``) is the boundary.

Its entry op scatters the first layer's hidden states along the sequence (``R -> S(1)`` on tp)
and its exit op gathers the last layer's output (``S(1) -> R``), so the model-level code
(position ids, causal mask, rotary, loss) still sees the whole sequence while every block
between holds ``seq / tp`` tokens. Hidden states that stack several per-token streams with
``[B, S, H]`` are cut and joined at their own sequence dim: before the features where the streams
lead (Gemma 3n's AltUp, ``[A, B, S, H]``), after the batch where they follow the tokens
(DeepSeek-V4's and GLM-5-Next's hyper-connections, ``[B, S, N, H]``); which one it is, the length
of the layer's ``position_ids`` tells (:func:`sequence_dim`). Per-layer inputs and token mixers
outside the boundaries: :mod:`.inputs`, :mod:`.mixers`.

Gradient policy: parameters that act on sequence-sharded activations and are not sharded
themselves (the blocks' norms, a rowwise bias added after a reduce-scatter) see only this rank's
tokens, so their gradient is a partial sum over tp (:func:`sequence_sharded_params`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import SEQUENCE_DIM, SEQUENCE_RUNNING, SEQUENCE_TOKENS
from hp_lazy.plan.model import Contract
from hp_lazy.plan.placement import Shard
from hp_lazy.runtime.binding import Binding
from hp_lazy.runtime.comm import pairs
from hp_lazy.runtime.leaves import own_forward
from hp_lazy.runtime.mesh import Group


def install_stack(stack: nn.ModuleList, binding: Binding, owner: nn.Module) -> None:
    """``owner``: the module holding the stack (the text model), whose output records the hidden
    states between the boundaries."""
    if len(stack) == 0:
        raise ShardingError(f"{binding.fqn}: the layer stack is empty; remove its contract from the plan")
    stack[0].register_forward_pre_hook(_stack_entry(binding, stack), with_kwargs=True)
    stack[len(stack) - 1].register_forward_hook(_stack_exit(binding, stack), with_kwargs=True)
    owner.register_forward_hook(_hidden_states_joined(binding, stack), with_kwargs=True)


def _stack_entry(binding: Binding, stack: nn.ModuleList) -> Callable[..., tuple[tuple, dict]]:
    (name,) = binding.in_ops or ("input",)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        key = None if args else "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        x = args[0] if key is None else kwargs[key]
        stacked = _stacked(binding, stack, x, module, args, kwargs, 1)
        _check_divisible(binding, x, 1 if stacked is None else stacked, kwargs)
        x = binding.enter(name, x) if stacked is None else pairs.scatter_to(x, binding.groups["tp"], stacked)
        if isinstance(x, torch.Tensor) and x.dim() >= 3:  # tokens this rank holds: batch x its piece
            seq = 1 if stacked is None else stacked
            setattr(stack, SEQUENCE_TOKENS, x.shape[seq - 1] * x.shape[seq])
        setattr(stack, SEQUENCE_RUNNING, True)
        if key is None:
            return (x, *args[1:]), kwargs
        kwargs[key] = x
        return args, kwargs

    return hook


def _check_divisible(binding: Binding, x: Any, seq: int, kwargs: dict) -> None:
    """Refuse, naming the stack, a sequence the tp ranks cannot split into equal pieces."""
    tp = binding.groups["tp"].size
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[seq] % tp == 0:
        return
    cached = kwargs.get("past_key_values") is not None or kwargs.get("use_cache") is True
    fix = ("generation appends one token at a time (a KV cache is passed), which sequence parallel cannot split; "
           "generate with a plan without sequence_parallel" if cached else
           f"pad the batch to a multiple of {tp} tokens (e.g. the collator's pad_to_multiple_of={tp})")
    raise ShardingError(f"{binding.fqn}: {x.shape[seq]} tokens under sequence parallel do not split into tp={tp} "
                        f"equal pieces; {fix}")


def _stack_exit(binding: Binding, stack: nn.ModuleList) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        setattr(stack, SEQUENCE_RUNNING, False)
        first = output[0] if isinstance(output, tuple) else output
        stacked = _stacked(binding, stack, first, module, args, kwargs, binding.groups["tp"].size)
        if stacked is None:
            return binding.exit(output)
        joined = pairs.gather_from(first, binding.groups["tp"], stacked)
        return (joined, *output[1:]) if isinstance(output, tuple) else joined

    return hook


def _hidden_states_joined(binding: Binding, stack: nn.ModuleList) -> Callable[..., Any]:
    """``output_hidden_states=True``: transformers records each layer's input, this rank's piece of
    the sequence between the boundaries; the owner's ``out.hidden_states`` are joined over tp like
    its last hidden state (all-gather forward, this rank's piece of the gradient backward)."""
    group = binding.groups["tp"]

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        states = output.get("hidden_states") if isinstance(output, Mapping) else None
        last = output.get("last_hidden_state") if states else None
        if states and isinstance(last, torch.Tensor) and last.dim() >= 2:
            output["hidden_states"] = tuple(_joined(binding, stack, state, group, last.shape[1]) for state in states)

    return hook


def _joined(binding: Binding, stack: nn.ModuleList, state: Any, group: Group, whole: int) -> Any:
    dim = 1 if not isinstance(state, torch.Tensor) or state.dim() <= 3 else stack.__dict__.get(SEQUENCE_DIM, 1)
    if not isinstance(state, torch.Tensor) or state.shape[dim] == whole:
        return state
    if state.shape[dim] * group.size == whole:
        return pairs.gather_from(state, group, dim)
    raise ShardingError(
        f"{binding.fqn}: out.hidden_states holds a tensor of shape {list(state.shape)} under sequence parallel, "
        f"neither the whole sequence ({whole} tokens at dim {dim}) nor one of its tp={group.size} pieces; "
        "pass output_hidden_states=False"
    )


def _stacked(binding: Binding, stack: nn.ModuleList, x: Any, layer: nn.Module, args: tuple, kwargs: dict,
             parts: int) -> int | None:
    """The sequence dim of hidden states ``x`` (``1 / parts`` of the sequence) that stack several
    per-token streams with ``[B, S, H]``, where the contract's ``S(1)`` names ``[B, S, H]``'s; None
    for ``[B, S, H]`` itself."""
    shard = binding.contract.placement("in_dst", next(iter(binding.contract.in_dst), "input"), "tp")
    if not isinstance(x, torch.Tensor) or x.dim() <= 3 or not isinstance(shard, Shard) or shard.dim != 1:
        return None
    return stacked_dim(stack, binding.fqn, x, layer, args, kwargs, parts)


def stacked_dim(stack: nn.Module, fqn: str, x: torch.Tensor, layer: nn.Module, args: tuple, kwargs: dict,
                parts: int) -> int:
    """:func:`sequence_dim` of ``x`` (``1 / parts`` of the sequence), read once per stack: at its
    entry, from the whole sequence (this rank's piece may be as long as the stream count)."""
    dim = stack.__dict__.get(SEQUENCE_DIM)
    if dim is None:
        dim = sequence_dim(fqn, x, whole_length(layer, args, kwargs), parts)
        setattr(stack, SEQUENCE_DIM, dim)
    return int(dim)


def whole_length(layer: nn.Module, args: tuple, kwargs: dict) -> int | None:
    """The whole sequence's length as the model's code hands it to a layer: the last dim of its
    ``position_ids`` (``[B, S]``, or ``[3, B, S]`` for multimodal RoPE), which the attention
    boundary reads whole; None where the layer is given none."""
    positions = kwargs.get("position_ids")
    if positions is None:
        names = positional(kind_of(layer))
        if "position_ids" in names and names.index("position_ids") + 1 < len(args):
            positions = args[names.index("position_ids") + 1]
    return int(positions.shape[-1]) if isinstance(positions, torch.Tensor) and positions.dim() >= 1 else None


def sequence_dim(fqn: str, x: torch.Tensor, length: int | None, parts: int = 1) -> int:
    """Which dim of stacked hidden states ``x`` (``1 / parts`` of the sequence, ``length`` tokens
    in all) is the sequence: right after the batch (``[B, S, N, H]``) or right before the features
    (``[A, B, S, H]``). Refused where the layer's inputs do not tell one from the other."""
    candidates = sorted({d for d in (1, x.dim() - 2) if length is not None and x.shape[d] * parts == length})
    if len(candidates) == 1:
        return candidates[0]
    told = ("the layer is given no position_ids to tell which" if length is None else
            f"its position_ids' {length} tokens match {'both' if candidates else 'neither'}")
    raise ShardingError(
        f"{fqn}: under sequence parallel the layers' hidden states stack several streams per token, shape "
        f"{list(x.shape)} ({parts} part(s) of the sequence), and their sequence dim is cut: dim 1 ([B, S, N, H]) or "
        f"dim {x.dim() - 2} ([A, B, S, H]); {told}; pass the layers position_ids of the batch's length, with a "
        "batch size and stream count other than that length, or train this family without sequence_parallel"
    )


def kind_of(module: nn.Module) -> type:
    """``type(module)`` as the plain class the caches key on (mypy reads ``type[Module]`` as unhashable)."""
    return module.__class__


@functools.cache
def positional(cls: type) -> tuple[str, ...]:
    """A layer class's forward parameters after ``self`` and the hidden states, in order."""
    params = list(inspect.signature(inspect.unwrap(own_forward(cls))).parameters)
    return tuple(params[2:])


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
