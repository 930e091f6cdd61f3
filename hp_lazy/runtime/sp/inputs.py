"""Per-layer inputs of the whole sequence under sequence parallel.

The model's code hands every decoder layer some tensors of its own besides the hidden states:
the attention mask, the rotary tables, position ids, which only the attention boundary reads (it
gathers the sequence, so they stay whole), and, in some families, per-token inputs the layer's
own code combines with its hidden states outside any boundary (Gemma 3n's and EmbeddingGemma 2's
per-layer embeddings). Those must be cut like the hidden states, or the layer multiplies this
rank's piece of the sequence by the whole sequence.

Which inputs the layer reads outside its boundaries is read from its class's forward: a parameter
loaded anywhere but inside the call of a child module that is a boundary or a token mixer run on
the whole sequence (``self.self_attn(..., attention_mask=attention_mask)``,
``self.cross_attn(..., encoder_hidden_states=encoder_hidden_states)``), or of one that holds such
a module and does not read it itself (:func:`_reads`). A forward pre-hook on
each layer cuts those that arrive as a tensor whose dim 1 is the whole sequence (``scatter_to``:
this rank's piece; backward all-gathers the pieces' gradients, the whole gradient on every rank,
as the stack's entry does).

A boundary there must receive the layer's hidden states, ``[batch, seq / tp, ...]``: a pre-hook
checks it (:func:`_check_rows`); a token-wise boundary also takes them flattened to rows, and rows
the layer selected from them are refused.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import (
    SEQUENCE_CARRIED,
    SEQUENCE_CHECKED,
    SEQUENCE_GATHERED,
    SEQUENCE_INPUTS,
    SEQUENCE_RUNNING,
    SEQUENCE_TOKENS,
)
from hp_lazy.plan.placement import Shard
from hp_lazy.runtime.comm import pairs, wire
from hp_lazy.runtime.leaves import own_forward
from hp_lazy.runtime.mesh import Group
from hp_lazy.runtime.sp.mixers import mixes_tokens, split_stacks
from hp_lazy.runtime.sp.stack import kind_of, positional, stacked_dim
from hp_lazy.runtime.style import BindContext, cuts_input


def refuse_outside_calls(ctx: BindContext) -> None:
    """A contract outside every sequence-split stack (a vision tower's projector, a model-level module)
    takes whole values. A layer that calls one itself would hand it this rank's piece of the sequence,
    which it would read as the whole: such a call is refused by name, on every rank at once (the
    flag is the stack's own state, the same on every tp rank)."""
    stacks = [(f, s) for f, s, _ in split_stacks(ctx)]
    family = type(ctx.root).__qualname__
    if stacks:
        ctx.root.register_forward_pre_hook(_reset([s for _, s in stacks]))
    for fqn, module, contract in ctx.bound if stacks else ():
        inside = any(fqn == f or fqn.startswith(f + ".") for f, _ in stacks)
        if not inside and not cuts_input(contract):
            module.register_forward_pre_hook(_whole_only(fqn, family, [f for f, _ in stacks], [s for _, s in stacks]))


def _reset(stacks: list[nn.Module]) -> Callable[..., None]:
    """Each forward of the root starts outside its stacks (one that raised inside a stack left its flag set)."""
    def hook(module: nn.Module, args: tuple) -> None:
        for stack in stacks:
            setattr(stack, SEQUENCE_RUNNING, False)

    return hook


def _whole_only(fqn: str, family: str, names: list[str], stacks: list[nn.Module]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple) -> None:
        if any(stack.__dict__.get(SEQUENCE_RUNNING) for stack in stacks):
            raise ShardingError(
                f"{fqn} ({family}): its contract lies outside the sequence-parallel layer stack {names} and takes "
                "whole values, but a layer calls it while the stack runs, with this rank's piece of the sequence; "
                "plan it inside the layers, or train this family without sequence_parallel"
            )

    return hook


def cut_layer_inputs(ctx: BindContext) -> None:
    """Cut the per-layer inputs each layer of a sequence-split stack reads outside its boundaries,
    and check the boundaries' own sequence-cut inputs (:func:`_check_rows`)."""
    for stack_fqn, stack, _ in split_stacks(ctx):
        bounded = {id(b) for _, b, _ in ctx.bound if b is not stack}
        for index, layer in enumerate(stack):
            names = _reads(layer, bounded)
            if names and not getattr(layer, SEQUENCE_INPUTS, False):
                layer.register_forward_pre_hook(_cut(stack, f"{stack_fqn}.{index}", names, ctx.groups["tp"]),
                                                with_kwargs=True)
                setattr(layer, SEQUENCE_INPUTS, True)
        for fqn, module, inner in ctx.bound:
            cut = [n for n in inner.in_src if isinstance(inner.placement("in_src", n, "tp"), Shard)]
            inside = fqn.startswith(stack_fqn + ".") and inner.region is None
            if inside and cut and not getattr(module, SEQUENCE_CHECKED, False):
                _check_rows(fqn, module, cut[0], type(ctx.root).__qualname__, stack, ctx.groups["tp"])


def _check_rows(fqn: str, module: nn.Module, name: str, family: str, stack: nn.Module, group: Group) -> None:
    """A boundary inside a sequence-split stack must receive ``name`` as ``[.., S / tp, H]``. A
    token-wise one (no attention or recurrence inside: an MLP, a shared expert) handed this rank's
    hidden states flattened to rows, ``[B * S / tp, H]`` (Ernie-4.5-MoE's, Flint's and HY-V3's
    ``self.shared_experts(h.view(-1, H))``), runs on them as one sequence ``[1, B * S / tp, H]``:
    every rank's rows in, its own back, each row's result one process's. Rows the layer selected
    (HiggsAudio-v2's ``self.mlp(h[~audio_mask])`` where some token is audio), which no gather
    rebuilds, or flattened rows handed to a boundary that mixes tokens, are refused by name. The
    shape check runs on every call (a guard under ``torch.compile``); rows also exchange their
    count over tp (:func:`_rows_of_ranks`: one small gather and a graph break per such call)."""
    tokenwise = not any(mixes_tokens(m) for m in module.modules())
    flattened: list[bool] = []  # per call, pre-hook to forward hook (reentrant: checkpointing)

    def refuse(got: str, tokens: object) -> ShardingError:
        return ShardingError(
            f"{fqn} ({family}): under sequence parallel this boundary's input {name!r} must arrive as the "
            f"layer's hidden states, [batch, seq / tp, ...], which it gathers along the sequence"
            f"{'' if tokenwise else ' (it mixes tokens)'}, or, for a token-wise boundary, as those flattened to "
            f"[{tokens}, hidden]; it got {got}: the layer's code selects tokens before calling "
            "it, and no gather along the sequence rebuilds that; train this family without sequence_parallel"
        )

    def check(mod: nn.Module, args: tuple, kwargs: dict) -> None:  # a boundary that mixes tokens
        value = kwargs.get(name, args[0] if args else None)
        if isinstance(value, torch.Tensor) and value.dim() < 3:
            raise refuse(f"shape {list(value.shape)}", stack.__dict__.get(SEQUENCE_TOKENS))

    def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        value = kwargs.get(name, args[0] if args else None)
        if not isinstance(value, torch.Tensor) or value.dim() >= 3:
            flattened.append(False)
            return None
        tokens = stack.__dict__.get(SEQUENCE_TOKENS)
        if value.dim() != 2:
            raise refuse(f"shape {list(value.shape)}", tokens)
        rows = _rows_of_ranks(value, group)
        if any(n != tokens for n in rows):
            raise refuse(f"{rows} rows on the tp ranks" if len(rows) > 1 else f"shape {list(value.shape)}", tokens)
        flattened.append(True)
        if name in kwargs:
            return args, {**kwargs, name: value.unsqueeze(0)}
        return (value.unsqueeze(0), *args[1:]), kwargs

    def after(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not flattened.pop():
            return None
        if isinstance(output, tuple):
            return (output[0].squeeze(0), *output[1:])
        return output.squeeze(0)

    if tokenwise:
        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True)
    else:
        module.register_forward_pre_hook(check, with_kwargs=True)
    setattr(module, SEQUENCE_CHECKED, True)


@torch.compiler.disable
def _rows_of_ranks(value: torch.Tensor, group: Group) -> list[int]:
    """Every tp rank's row count (8 bytes each, control traffic): rows selected on one rank and not
    on another must be refused on all of them at once, not leave one waiting in the gather."""
    if group.size == 1:
        return [value.shape[0]]
    rows = torch.empty(group.size, dtype=torch.int64, device=value.device)
    wire.gather_control(rows, torch.tensor([value.shape[0]], dtype=torch.int64, device=value.device), group)
    return [int(n) for n in rows.tolist()]


def _takes_whole(module: nn.Module, bounded: set[int]) -> bool:
    """A boundary, or a token mixer run on the whole sequence: the inputs the layer hands it (an
    encoder's states for a cross-attention, a padding mask for a Mamba layer) are read there, whole."""
    return id(module) in bounded or getattr(module, SEQUENCE_GATHERED, False) or SEQUENCE_CARRIED in module.__dict__


def _reads(module: nn.Module, bounded: set[int]) -> tuple[str, ...]:
    """The forward parameters of ``module`` its own code reads on this rank's tokens: outside the
    calls of children that take their inputs whole and, where a child only holds such a module
    (DeepSeek-V4's MoE block holds the shared-experts boundary but routes by ``input_ids`` itself),
    wherever that child reads them."""
    # a child the class's code calls but this instance lacks sits on a branch this layer never takes
    # (Qwen3-Next's and Bamba's layers call either their attention or their recurrent mixer)
    whole = {name for name in called_children(kind_of(module)) if not hasattr(module, name)}
    holders: set[tuple[str, tuple[str, ...], tuple[str, ...]]] = set()
    for name, child in module.named_children():
        if _takes_whole(child, bounded):
            whole.add(name)
        elif any(_takes_whole(m, bounded) for m in child.modules()):
            holders.add((name, _reads(child, bounded), positional(kind_of(child))))
    return read_outside(kind_of(module), frozenset(whole), frozenset(holders))


@functools.cache
def called_children(cls: type) -> frozenset[str]:
    """The ``self.<name>(...)`` calls of ``cls``'s forward (() when the source cannot be read)."""
    fn = _forward_def(cls)
    if fn is None:
        return frozenset()
    return frozenset(name for node in ast.walk(fn) if isinstance(node, ast.Call)
                     and (name := _self_child(node.func)) is not None)


@functools.cache
def _forward_def(cls: type) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """``cls``'s forward parsed, once (:func:`called_children` and :func:`read_outside` read it)."""
    forward = inspect.unwrap(own_forward(cls))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0]
    return fn if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


@functools.cache
def read_outside(cls: type, boundaries: frozenset[str],
                 holders: frozenset[tuple[str, tuple[str, ...], tuple[str, ...]]] = frozenset()) -> tuple[str, ...]:
    """The forward parameters of ``cls`` (after ``self`` and the hidden states) it reads outside
    the calls of its children ``boundaries``; a child in ``holders`` (``(name, what it reads
    itself, its parameters in order)``) reads there only the arguments it reads itself. ()
    when the source cannot be read."""
    fn = _forward_def(cls)
    if fn is None:
        return ()
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs][2:]
    held = {name: (reads, names) for name, reads, names in holders}
    inside: set[int] = set()
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        child = _self_child(node.func)
        if child in boundaries:
            handed = [*node.args, *(k.value for k in node.keywords)]
        elif child in held:  # args[0] is the child's hidden states, read on this rank's tokens
            reads, names = held[child]
            handed = [a for i, a in enumerate(node.args[1:]) if i < len(names) and names[i] not in reads]
            handed += [k.value for k in node.keywords if k.arg is not None and k.arg not in reads]
        else:
            continue
        inside.update(id(n) for arg in handed for n in ast.walk(arg))
    read = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            and n.id in params and id(n) not in inside}
    return tuple(p for p in params if p in read)


def _self_child(node: ast.expr) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _cut(stack: nn.Module, fqn: str, names: tuple[str, ...], group: Group) -> Callable[..., tuple[tuple, dict]]:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 3:
            return args, kwargs
        # the stack holds S / tp tokens of the hidden states here
        dim = 1 if hidden.dim() == 3 else stacked_dim(stack, fqn, hidden, module, args, kwargs, group.size)
        whole = hidden.shape[dim] * group.size
        names_in_order = positional(kind_of(module))
        items = list(args)
        for name in names:
            at = names_in_order.index(name) + 1 if name in names_in_order else len(items)  # args[0]: the hidden states
            where = at if at < len(items) else None
            value = items[where] if where is not None else kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == whole:
                value = pairs.scatter_to(value, group, 1)
                if where is not None:
                    items[where] = value
                else:
                    kwargs[name] = value
        return tuple(items), kwargs

    return hook
