"""Token mixers a sequence-parallel stack holds outside its tp boundaries.

Between the boundaries each tp rank holds its piece of the sequence. Code there must treat every
token alike: a norm, a residual add, a router. A module that mixes tokens along the sequence and
sits in no boundary (a hybrid's Mamba2 or Gated DeltaNet layer, which transformers' TP plans leave
whole; an attention module the plan does not cover) would see only this rank's piece and compute
something else, silently.

Each such module found at bind runs on the whole sequence instead, as it does under tp alone:
its hidden states are all-gathered along the sequence on the way in (``gather_from``: backward
keeps this rank's piece of the gradient) and cut back to this rank's piece on the way out
(``scatter_to``: backward all-gathers the pieces' gradients). Every rank then computes the same
whole output and the whole gradient of its parameters, so those are left out of the stack's
partial sums over tp (:attr:`BindContext.whole_sequence`). Per module: one all-gather of this
rank's ``[B, S / tp, H]`` forward and one backward, what a boundary's entry and exit move.

A module the plan itself runs on the whole sequence (one holding per-Linear leaves:
:mod:`hp_lazy.plan.auto.sp`) gathers and cuts in its own contract; its parameters that no
contract inside it shards see the whole sequence on every rank too (:func:`planned_whole`).

Mixers are found by what the module's forward calls or reads: transformers' attention interface, a
recurrent kernel :mod:`hp_lazy.runtime.cp.recurrent` knows (its causal convolution with the delta
rules, Mamba2's or Mamba1's scan), or a lightning attention (:mod:`hp_lazy.runtime.cp.lightning`,
MiniMax's). A lightning attention does not run whole: it runs on this rank's piece with the
``D x D`` state of the pieces before carried in (one all-gather of ``[B, H, D, D]`` per layer, none
of the hidden states; its parameters' gradients are this rank's tokens' part, summed over tp like
the norms'); under context parallel too it runs whole on tp, on this cp rank's rows, which its cp
split carries the state over. A layer whose ``config.layer_types`` kind is neither attention nor token-wise and in
which none was found, or a ``Conv1d`` outside both, is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import SEQUENCE_GATHERED
from hp_lazy.plan.model import Contract
from hp_lazy.plan.placement import Shard
from hp_lazy.runtime.comm import pairs
from hp_lazy.runtime.cp import lightning, recurrent
from hp_lazy.runtime.leaves import calls_attention
from hp_lazy.runtime.mesh import Group
from hp_lazy.runtime.style import BindContext, cuts_input

ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
TOKENWISE_LAYERS = frozenset({"mlp", "moe", "dense"})


def splits_sequence(contract: Contract) -> bool:
    """A layer-stack contract that cuts the sequence over tp between its entry and exit."""
    return any(isinstance(axes.get("tp"), Shard) for axes in contract.in_dst.values())


def split_stacks(ctx: BindContext) -> list[tuple[str, nn.ModuleList, Contract]]:
    """The bound layer stacks that cut the sequence over tp: (FQN, stack, contract)."""
    return [(f, s, c) for f, s, c in ctx.bound if isinstance(s, nn.ModuleList) and splits_sequence(c)]


def runs_whole(contract: Contract) -> bool:
    """A contract that gathers an input cut along the sequence on tp and shards nothing there."""
    gathers = any(isinstance(contract.placement("in_src", n, "tp"), Shard)
                  and not isinstance(contract.placement("in_dst", n, "tp"), Shard) for n in contract.in_dst)
    return gathers and not any(isinstance(p.get("tp"), Shard) for p in contract.params.values())


def planned_whole(ctx: BindContext) -> None:
    """The parameters of the modules the plan runs on the whole sequence inside a sequence-split
    stack: whole gradients on every rank, left out of the stack's partial sums over tp."""
    stacks = [f for f, _, _ in split_stacks(ctx)]
    whole = [f for f, _, c in ctx.bound if any(f.startswith(s + ".") for s in stacks) and runs_whole(c)]
    for fqn, module, contract in ctx.bound:
        if fqn in whole:
            ctx.whole_sequence.update(id(p) for p in module.parameters())
        out = contract.placement("out_dst", "output", "tp")
        cut_in = cuts_input(contract)
        if isinstance(out, Shard) and out.dim != -1 and not cut_in and not any(fqn.startswith(w + ".") for w in whole):
            raise ShardingError(
                f"{fqn} ({type(ctx.root).__qualname__}): its contract takes whole values and leaves as {out} on tp, "
                "this rank's piece of the sequence, which only a module the plan runs on the whole sequence inside a "
                "sequence-split layer stack returns; here no such module holds it: set out_dst['output'] to 'R' on tp"
            )


def mixes_tokens(module: nn.Module) -> bool:
    return calls_attention(module) or recurrent.supports(module) or lightning.supports(module)


def gather_mixers(ctx: BindContext) -> None:
    """Run every token mixer outside the boundaries of a sequence-split stack on the whole sequence
    (module docstring); refuse what mixes tokens and cannot be found as a module."""
    planned_whole(ctx)
    family = type(ctx.root).__qualname__
    for fqn, stack, _ in split_stacks(ctx):
        group = ctx.groups["tp"]
        bounded = {id(m) for _, b, _ in ctx.bound if b is not stack for m in b.modules()}
        kinds = list(getattr(getattr(ctx.root, "config", None), "layer_types", None) or ())
        for i, layer in enumerate(stack):
            found = _gather_layer(f"{fqn}.{i}", layer, bounded, group, family, ctx)
            kind = kinds[i] if i < len(kinds) else None
            if kind is not None and kind not in ATTENTION_LAYERS | TOKENWISE_LAYERS and not found \
                    and not _planned_mixer(layer, bounded):
                raise ShardingError(
                    f"{fqn}.{i} ({family}): layer {i} is a {kind!r} layer, which mixes tokens along the sequence; "
                    "sequence parallel splits the sequence between the tp boundaries, and hp_lazy finds no module "
                    "of this layer it can run on the whole sequence (transformers' attention or a known recurrent "
                    "kernel); train this family without sequence_parallel"
                )


def _gather_layer(
    fqn: str, layer: nn.Module, bounded: set[int], group: Group, family: str, ctx: BindContext
) -> bool:
    found = False
    skip: set[int] = set()
    for name, module in layer.named_modules():
        if id(module) in bounded or id(module) in skip:
            skip.update(id(m) for m in module.modules())
            continue
        where = f"{fqn}.{name}" if name else fqn
        if mixes_tokens(module):
            inner = [n for n, m in module.named_modules() if id(m) in bounded]
            if inner:
                raise ShardingError(
                    f"{where} ({family}): this {type(module).__name__} mixes tokens along the sequence and holds "
                    f"tp boundaries {inner[:3]}; sequence parallel can run it on the whole sequence only with no "
                    "boundary inside; train this family without sequence_parallel"
                )
            # its state carried over the pieces: partial gradients, summed; under cp the rows are cp's
            # zigzag chunks, which its cp split carries over (run whole on tp)
            if lightning.supports(module) and ctx.mesh.degree("cp") == 1:
                lightning.split_sequence(module, group)
            else:
                _run_whole(module, group)
                ctx.whole_sequence.update(id(p) for p in module.parameters())
            skip.update(id(m) for m in module.modules())
            found = True
        elif isinstance(module, nn.Conv1d):
            raise ShardingError(
                f"{where} ({family}): a Conv1d outside the tp boundaries of a sequence-parallel stack convolves "
                f"along the sequence, which each rank holds only a piece of, inside {type(layer).__name__} code "
                "hp_lazy cannot run on the whole sequence; train this family without sequence_parallel"
            )
    return found


def _planned_mixer(layer: nn.Module, bounded: set[int]) -> bool:
    """The layer's token mixer is itself a boundary (a recurrent mixer the TP plan covers)."""
    return any(id(m) in bounded and mixes_tokens(m) for m in layer.modules())


def _run_whole(module: nn.Module, group: Group) -> None:
    if getattr(module, SEQUENCE_GATHERED, False):
        return
    module.register_forward_pre_hook(_gather_in(group), with_kwargs=True)
    module.register_forward_hook(_cut_out(group))
    setattr(module, SEQUENCE_GATHERED, True)


def _gather_in(group: Group) -> Callable[..., tuple[tuple, dict]]:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (pairs.gather_from(args[0], group, 1), *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        kwargs[key] = pairs.gather_from(kwargs[key], group, 1)
        return args, kwargs

    return hook


def _cut_out(group: Group) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return (pairs.scatter_to(output[0], group, 1), *output[1:])
        return pairs.scatter_to(output, group, 1)

    return hook
