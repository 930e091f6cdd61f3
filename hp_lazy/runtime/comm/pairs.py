"""Autograd-aware collectives, Megatron style: each pair is named by where the tensor goes.

Every pair takes its :class:`~hp_lazy.runtime.mesh.Group` (and dims) explicitly, returns its input
unchanged when the group has size 1 or the input is ``None`` (an optional forward argument that was
not passed, e.g. ``encoder_hidden_states`` of a decoder-only call), works on CPU/gloo and
CUDA/nccl alike (buffers are allocated on the input's device), normalises negative dims against
``x.dim()`` and hands contiguous tensors to the wire. ``W`` below is the group size, ``r`` this rank.

| name | forward | backward |
|---|---|---|
| copy_to | identity | all_reduce |
| reduce_from | all_reduce | identity |
| sum_over | all_reduce | all_reduce |
| gather_from | all_gather | split |
| gather_to | all_gather | reduce_scatter |
| scatter_to | split | all_gather |
| reduce_scatter_to | reduce_scatter | all_gather |
| all_to_all | all_to_all | all_to_all |
| all_to_all_v | all_to_all | all_to_all |
| gather_kv | all_gather | reduce_scatter |

Layouts (``d`` the dim): all_gather ``[.., n, ..] -> [.., W*n, ..]`` in rank order; split
``[.., W*n, ..] -> [.., n, ..]`` (chunk ``r``, no communication); reduce_scatter sums the
full-size partials of every rank and keeps chunk ``r``; ``all_to_all(x, g, src_dim, dst_dim)``
takes ``x`` sharded on ``src_dim`` to the same tensor sharded on ``dst_dim`` (``S(src) -> S(dst)``,
the plan's order): it cuts ``dst_dim`` into ``W`` chunks, sends chunk ``j`` to rank ``j`` and
concatenates what it receives along ``src_dim`` in rank order; its backward is
``all_to_all(dy, g, dst_dim, src_dim)``.

All-reduces never modify their argument (autograd may hand one gradient tensor to several
consumers): they reduce a fresh contiguous copy. Only :func:`all_reduce_` works in place.

Two pairs do not fit "one kind forward, one kind backward" and are classes of their own:
``all_to_all_v(x, g, send_splits, recv_splits)`` (variable row counts per rank, expert-parallel
dispatch; its backward is itself with the splits swapped, Megatron's ``_AllToAll``) and
``gather_kv(k, v, g, dim)`` (K and V all-gathered along the sequence in one collective, context
parallel; backward one reduce-scatter of dK and dV).

Every c10d call goes through :mod:`hp_lazy.runtime.comm.wire`, which counts it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.comm import wire
from hp_lazy.runtime.mesh import Group

__all__ = [
    "PAIRS",
    "all_to_all",
    "all_to_all_v",
    "copy_to",
    "gather_from",
    "gather_kv",
    "gather_to",
    "reduce_from",
    "reduce_scatter_to",
    "scatter_to",
    "sum_over",
]

PAIRS: dict[str, tuple[str, str]] = {
    "copy_to": ("identity", "all_reduce"),
    "reduce_from": ("all_reduce", "identity"),
    "sum_over": ("all_reduce", "all_reduce"),
    "gather_from": ("all_gather", "split"),
    "gather_to": ("all_gather", "reduce_scatter"),
    "scatter_to": ("split", "all_gather"),
    "reduce_scatter_to": ("reduce_scatter", "all_gather"),
    "all_to_all": ("all_to_all", "all_to_all"),
    "all_to_all_v": ("all_to_all", "all_to_all"),
    "gather_kv": ("all_gather", "reduce_scatter"),
}
"""name -> (forward, backward); ``identity`` and ``split`` issue no collective."""

Phase = wire.Phase

def _dim(x: torch.Tensor, dim: int, op: str, g: Group) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ShardingError(
            f"{op} over {g.axis}: dim {dim} is out of range for a tensor of shape {list(x.shape)}; "
            f"use a dim in [{-x.dim()}, {x.dim() - 1}]"
        )
    return dim % x.dim()


def _divisible(x: torch.Tensor, dim: int, op: str, g: Group) -> None:
    if x.shape[dim] % g.size:
        raise ShardingError(
            f"{op} over {g.axis}: dim {dim} of shape {list(x.shape)} has size {x.shape[dim]}, "
            f"not divisible by {g.axis}={g.size}; pad it or use a degree that divides {x.shape[dim]}"
        )



def _run(kind: str, x: torch.Tensor, g: Group, dims: tuple[int, ...], phase: Phase) -> torch.Tensor:
    """Apply one side of a pair; ``dims`` is ``(dim,)`` or, for all_to_all, ``(src_dim, dst_dim)``."""
    if kind == "identity":
        return x.view_as(x)
    if kind == "all_reduce":
        return wire.all_reduce(x.clone(memory_format=torch.contiguous_format), g, phase)
    if kind == "all_gather":
        return wire.all_gather(x, g, dims[0], phase)
    if kind == "split":
        return wire.local_chunk(x, g, dims[0])
    if kind == "reduce_scatter":
        return wire.reduce_scatter(x, g, dims[0], phase)
    if kind == "all_to_all":
        return wire.all_to_all(x, g, split_dim=dims[1], cat_dim=dims[0], phase=phase)
    raise AssertionError(f"unknown collective kind {kind!r}")


class _Pair(torch.autograd.Function):
    """The one-kind-each-way pair ``PAIRS[name]``: its forward kind forward, its backward kind backward.

    The backward reverses ``dims``, which swaps all_to_all's source and destination dims and leaves the
    one-dim ops unchanged.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, name: str, g: Group, dims: tuple[int, ...]) -> torch.Tensor:
        ctx.name, ctx.g, ctx.dims = name, g, dims
        return _run(PAIRS[name][0], x, g, dims, "forward")

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _run(PAIRS[ctx.name][1], dy, ctx.g, ctx.dims[::-1], "backward"), None, None, None


def _apply(x: torch.Tensor, name: str, g: Group, dims: tuple[int, ...]) -> torch.Tensor:
    """The pair as an autograd node when a gradient will flow, else just its forward side (no
    autograd bookkeeping under ``torch.no_grad()`` or on tensors that need no gradient)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Pair.apply(x, name, g, dims)
    return _run(PAIRS[name][0], x, g, dims, "forward")


def copy_to(x: torch.Tensor, g: Group) -> torch.Tensor:
    """Replicated input entering a region with sharded params: identity fwd, all-reduce bwd."""
    return x if x is None or g.size == 1 else _apply(x, "copy_to", g, ())


def reduce_from(x: torch.Tensor, g: Group) -> torch.Tensor:
    """Partial sums -> replicated: all-reduce fwd, identity bwd."""
    return x if x is None or g.size == 1 else _apply(x, "reduce_from", g, ())


def sum_over(x: torch.Tensor, g: Group) -> torch.Tensor:
    """Per-rank partial statistics of a split dim -> their sum, which every rank then uses on its
    own slice (a norm over tp-split features): all-reduce fwd, all-reduce bwd (each rank's
    gradient of the sum is a part)."""
    return x if x is None or g.size == 1 else _apply(x, "sum_over", g, ())


def gather_from(x: torch.Tensor, g: Group, dim: int) -> torch.Tensor:
    """``S(dim) -> R`` leaving a region: all-gather fwd, split (local chunk) bwd."""
    if x is None or g.size == 1:
        return x
    return _apply(x, "gather_from", g, (_dim(x, dim, "gather_from", g),))


def gather_to(x: torch.Tensor, g: Group, dim: int) -> torch.Tensor:
    """``S(dim) -> R`` entering a region with sharded params: all-gather fwd, reduce-scatter bwd."""
    if x is None or g.size == 1:
        return x
    return _apply(x, "gather_to", g, (_dim(x, dim, "gather_to", g),))


def scatter_to(x: torch.Tensor, g: Group, dim: int) -> torch.Tensor:
    """``R -> S(dim)``: keep chunk ``r`` fwd, all-gather bwd."""
    if x is None or g.size == 1:
        return x
    d = _dim(x, dim, "scatter_to", g)
    _divisible(x, d, "scatter_to", g)
    return _apply(x, "scatter_to", g, (d,))


def reduce_scatter_to(x: torch.Tensor, g: Group, dim: int) -> torch.Tensor:
    """``P(sum) -> S(dim)``: reduce-scatter fwd, all-gather bwd."""
    if x is None or g.size == 1:
        return x
    d = _dim(x, dim, "reduce_scatter_to", g)
    _divisible(x, d, "reduce_scatter_to", g)
    return _apply(x, "reduce_scatter_to", g, (d,))


def all_to_all(x: torch.Tensor, g: Group, src_dim: int, dst_dim: int) -> torch.Tensor:
    """``S(src_dim) -> S(dst_dim)``: all-to-all both ways (backward swaps the dims).

    ``[.., n, .., W*m, ..] -> [.., W*n, .., m, ..]`` (``src_dim`` grows, ``dst_dim`` shrinks).
    """
    if x is None or g.size == 1:
        return x
    src, dst = _dim(x, src_dim, "all_to_all", g), _dim(x, dst_dim, "all_to_all", g)
    _divisible(x, dst, "all_to_all", g)
    return _apply(x, "all_to_all", g, (src, dst))




class _AllToAllV(torch.autograd.Function):
    """Variable-split all-to-all whose backward is itself with the splits swapped (so it has a
    double backward too)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: Group, send: tuple[int, ...], recv: tuple[int, ...]) -> torch.Tensor:
        ctx.g, ctx.send, ctx.recv = g, send, recv
        return wire.all_to_all_v(x, g, send, recv, None)  # also run by backward: phase from the engine

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _AllToAllV.apply(dy.contiguous(), ctx.g, ctx.recv, ctx.send), None, None, None


def _splits(x: torch.Tensor, g: Group, splits: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(int(n) for n in splits)
    if len(out) != g.size or any(n < 0 for n in out):
        raise ShardingError(
            f"all_to_all_v over {g.axis}: {what}={list(out)} must hold one non-negative row count per rank "
            f"of the group ({g.size}); pass a list of {g.size} counts"
        )
    return out


def all_to_all_v(x: torch.Tensor, g: Group, send_splits: Sequence[int], recv_splits: Sequence[int]) -> torch.Tensor:
    """Rows ``[sum(send_splits), ...]`` -> ``[sum(recv_splits), ...]`` (run ``j`` goes to rank
    ``j``); backward sends the gradient rows back along the same routes. Zero counts are fine."""
    if x is None or g.size == 1:
        return x
    send, recv = _splits(x, g, send_splits, "send_splits"), _splits(x, g, recv_splits, "recv_splits")
    if sum(send) != x.shape[0]:
        raise ShardingError(
            f"all_to_all_v over {g.axis}: send_splits sum to {sum(send)} but the input has {x.shape[0]} rows "
            "(dim 0); the counts must cover every row"
        )
    if x.requires_grad and torch.is_grad_enabled():
        return _AllToAllV.apply(x, g, send, recv)
    return wire.all_to_all_v(x, g, send, recv, "forward")


class _GatherKV(torch.autograd.Function):
    """K and V gathered along ``dim`` in one all-gather; dK and dV reduce-scattered in one."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, g: Group, dim: int):
        ctx.g, ctx.dim = g, dim
        both = wire.all_gather(torch.stack([k, v]), g, dim + 1, "forward")
        return both[0], both[1]

    @staticmethod
    def backward(ctx, dk: torch.Tensor, dv: torch.Tensor):
        both = wire.reduce_scatter(torch.stack([dk, dv]), ctx.g, ctx.dim + 1, "backward")
        return both[0], both[1], None, None


def gather_kv(k: torch.Tensor, v: torch.Tensor, g: Group, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``S(dim) -> R`` for K and V together (same shape): one all-gather forward, one
    reduce-scatter backward (each rank's queries attend to every key, so dK/dV are partial sums)."""
    if g.size == 1:
        return k, v
    if k.shape != v.shape:
        raise ShardingError(
            f"gather_kv over {g.axis}: K {list(k.shape)} and V {list(v.shape)} differ in shape; "
            "gather them separately with gather_to"
        )
    d = _dim(k, dim, "gather_kv", g)
    if (k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
        return _GatherKV.apply(k, v, g, d)
    both = wire.all_gather(torch.stack([k, v]), g, d + 1, "forward")
    return both[0], both[1]
