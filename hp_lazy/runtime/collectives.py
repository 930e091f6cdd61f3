"""Autograd-aware collectives, Megatron style: each pair is named by where the tensor goes.

Every pair takes its :class:`~hp_lazy.runtime.mesh.Group` (and dims) explicitly, returns its input
unchanged when the group has size 1 or the input is ``None`` (an optional forward argument that was
not passed, e.g. ``encoder_hidden_states`` of a decoder-only call), works on CPU/gloo and CUDA/nccl alike (buffers are allocated
on the input's device), normalises negative dims against ``x.dim()`` and hands contiguous tensors
to the wire. ``W`` below is the group size, ``r`` this rank.

| name | forward | backward |
|---|---|---|
| copy_to | identity | all_reduce |
| reduce_from | all_reduce | identity |
| gather_from | all_gather | split |
| gather_to | all_gather | reduce_scatter |
| scatter_to | split | all_gather |
| reduce_scatter_to | reduce_scatter | all_gather |
| all_to_all | all_to_all | all_to_all |

Layouts (``d`` the dim): all_gather ``[.., n, ..] -> [.., W*n, ..]`` in rank order; split
``[.., W*n, ..] -> [.., n, ..]`` (chunk ``r``, no communication); reduce_scatter sums the
full-size partials of every rank and keeps chunk ``r``; ``all_to_all(x, g, src_dim, dst_dim)``
takes ``x`` sharded on ``src_dim`` to the same tensor sharded on ``dst_dim`` (``S(src) -> S(dst)``,
the plan's order): it cuts ``dst_dim`` into ``W`` chunks, sends chunk ``j`` to rank ``j`` and
concatenates what it receives along ``src_dim`` in rank order; its backward is
``all_to_all(dy, g, dst_dim, src_dim)``.

All-reduces never modify their argument (autograd may hand one gradient tensor to several
consumers): they reduce a fresh contiguous copy. Only :func:`all_reduce_` works in place.

Reduce-scatter uses c10d's ``reduce_scatter_tensor`` (``reduce_scatter_single`` where it exists).
Gloo implements it in torch 2.13; where a backend rejects it, the call falls back, once and for
good, to an all-reduce of the full tensor followed by taking chunk ``r`` (same result, twice the
traffic), still counted as one ``reduce_scatter``.

Every c10d call goes through one internal function per kind, which feeds
:func:`collective_counter`; a counter that is not active costs one truth test of an empty list.
"""

from __future__ import annotations

import collections
import contextlib
import re
from typing import Iterator

import torch
import torch.distributed as dist

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.mesh import Group

__all__ = [
    "PAIRS",
    "CollectiveCounter",
    "all_gather_list",
    "all_reduce_",
    "all_to_all",
    "collective_counter",
    "copy_to",
    "gather_from",
    "gather_to",
    "reduce_from",
    "reduce_scatter_to",
    "scatter_to",
    "vocab_parallel_cross_entropy",
]

PAIRS: dict[str, tuple[str, str]] = {
    "copy_to": ("identity", "all_reduce"),
    "reduce_from": ("all_reduce", "identity"),
    "gather_from": ("all_gather", "split"),
    "gather_to": ("all_gather", "reduce_scatter"),
    "scatter_to": ("split", "all_gather"),
    "reduce_scatter_to": ("reduce_scatter", "all_gather"),
    "all_to_all": ("all_to_all", "all_to_all"),
}
"""name -> (forward, backward); ``identity`` and ``split`` issue no collective."""

Phase = str  # "forward" | "backward"


# --------------------------------------------------------------------------- counting


class CollectiveCounter:
    """Counts of the collectives issued while active, keyed by ``(op, phase)``."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, Phase]] = collections.Counter()

    def __getitem__(self, key: tuple[str, Phase]) -> int:
        return self.counts[key]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by_phase(self, phase: Phase) -> dict[str, int]:
        """``{op: count}`` for one phase, e.g. ``by_phase("backward") == {"all_reduce": 4}``."""
        return {op: n for (op, p), n in sorted(self.counts.items()) if p == phase}

    def __str__(self) -> str:
        parts = []
        for phase in ("forward", "backward"):
            ops = self.by_phase(phase)
            if ops:
                listed = ", ".join(f"{op} {n}" for op, n in ops.items())
                parts.append(f"{phase} {sum(ops.values())} ({listed})")
        return f"{self.total} collectives" + (": " + "; ".join(parts) if parts else "")

    def __repr__(self) -> str:
        return f"CollectiveCounter({dict(self.counts)!r})"


_ACTIVE: list[CollectiveCounter] = []


@contextlib.contextmanager
def collective_counter() -> Iterator[CollectiveCounter]:
    """Count every collective hp_lazy issues inside the block (nested counters all count)."""
    counter = CollectiveCounter()
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.remove(counter)


def _record(op: str, phase: Phase | None) -> None:
    if _ACTIVE:
        key = (op, phase or _current_phase())
        for counter in _ACTIVE:
            counter.counts[key] += 1


def _current_phase() -> Phase:
    """``"backward"`` while the autograd engine runs (e.g. in a gradient hook), else ``"forward"``."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return "backward" if task is not None and task() != -1 else "forward"


# --------------------------------------------------------------------------- the wire (one function per c10d call)

_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_NO_REDUCE_SCATTER: set[str] = set()  # backends that rejected reduce_scatter_tensor
_UNSUPPORTED = re.compile(r"not support|unsupported|not implemented|unimplemented", re.I)


def _all_reduce(t: torch.Tensor, g: Group, phase: Phase | None, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``t`` in place (``t`` must be contiguous); returns ``t``."""
    _record("all_reduce", phase)
    dist.all_reduce(t, op=op, group=g.pg)
    return t


def _all_gather(x: torch.Tensor, g: Group, dim: int, phase: Phase | None) -> torch.Tensor:
    """``[.., n, ..] -> [.., W*n, ..]`` along ``dim``, rank order."""
    out = _gather_stacked(x, g, phase)
    return out.view(g.size * x.shape[0], *x.shape[1:]) if dim == 0 else torch.cat(out.unbind(0), dim=dim)


def _gather_stacked(x: torch.Tensor, g: Group, phase: Phase | None) -> torch.Tensor:
    """``[...] -> [W, ...]``: every rank's ``x`` in rank order."""
    _record("all_gather", phase)
    out = x.new_empty((g.size, *x.shape))
    _gather_single(out, x.unsqueeze(0).contiguous(), group=g.pg)
    return out


def _reduce_scatter(x: torch.Tensor, g: Group, dim: int, phase: Phase | None) -> torch.Tensor:
    """Sum ``[.., W*n, ..]`` over the group and keep chunk ``r``: ``[.., n, ..]``."""
    _record("reduce_scatter", phase)
    full = x.movedim(dim, 0).contiguous()
    backend = str(dist.get_backend(g.pg))
    if backend not in _NO_REDUCE_SCATTER:
        out = full.new_empty((full.shape[0] // g.size, *full.shape[1:]))
        try:
            _reduce_scatter_single(out, full, group=g.pg)
            return out.movedim(0, dim).contiguous()
        except (RuntimeError, NotImplementedError) as error:
            if not _UNSUPPORTED.search(str(error)):
                raise
            _NO_REDUCE_SCATTER.add(backend)
    full = full.clone()  # fallback: never reduce into the caller's tensor
    dist.all_reduce(full, group=g.pg)
    return _local_chunk(full, g, 0).movedim(0, dim).contiguous()


def _all_to_all(x: torch.Tensor, g: Group, split_dim: int, cat_dim: int, phase: Phase | None) -> torch.Tensor:
    """Chunk ``j`` of ``split_dim`` goes to rank ``j``; received chunks are concatenated on ``cat_dim``."""
    _record("all_to_all", phase)
    n = x.shape[split_dim] // g.size
    send = x.unflatten(split_dim, (g.size, n)).movedim(split_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=g.pg)
    return torch.cat(recv.unbind(0), dim=cat_dim)


def _local_chunk(x: torch.Tensor, g: Group, dim: int) -> torch.Tensor:
    n = x.shape[dim] // g.size
    return x.narrow(dim, g.rank * n, n).contiguous()


# --------------------------------------------------------------------------- checks


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


# --------------------------------------------------------------------------- autograd pairs


def _run(kind: str, x: torch.Tensor, g: Group, dims: tuple[int, ...], phase: Phase) -> torch.Tensor:
    """Apply one side of a pair; ``dims`` is ``(dim,)`` or, for all_to_all, ``(src_dim, dst_dim)``."""
    if kind == "identity":
        return x.view_as(x)
    if kind == "all_reduce":
        return _all_reduce(x.clone(memory_format=torch.contiguous_format), g, phase)
    if kind == "all_gather":
        return _all_gather(x, g, dims[0], phase)
    if kind == "split":
        return _local_chunk(x, g, dims[0])
    if kind == "reduce_scatter":
        return _reduce_scatter(x, g, dims[0], phase)
    if kind == "all_to_all":
        return _all_to_all(x, g, split_dim=dims[1], cat_dim=dims[0], phase=phase)
    raise AssertionError(f"unknown collective kind {kind!r}")


class _Pair(torch.autograd.Function):
    """The pair ``PAIRS[name]``: its forward kind forward, its backward kind backward.

    The backward reverses ``dims``, which swaps all_to_all's source and destination dims and leaves the
    one-dim ops unchanged.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, name: str, g: Group, dims: tuple[int, ...]) -> torch.Tensor:  # type: ignore[override]
        ctx.name, ctx.g, ctx.dims = name, g, dims
        return _run(PAIRS[name][0], x, g, dims, "forward")

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
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


# --------------------------------------------------------------------------- outside autograd


def all_reduce_(t: torch.Tensor, g: Group) -> torch.Tensor:
    """Sum ``t`` over the group in place (no autograd; for gradient hooks); returns ``t``.

    Counted in the phase it runs in: ``"backward"`` inside the autograd engine.
    """
    if g.size == 1:
        return t
    if t.is_contiguous():
        return _all_reduce(t, g, None)
    return t.copy_(_all_reduce(t.contiguous(), g, None))


def all_gather_list(t: torch.Tensor, g: Group) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on every rank), in rank order; no autograd."""
    if g.size == 1:
        return [t]
    return list(_gather_stacked(t.detach(), g, None).unbind(0))


# --------------------------------------------------------------------------- vocab-parallel loss


class _VocabParallelCE(torch.autograd.Function):
    """Per-token CE of logits sharded on the vocab: ``[N, V/W]`` (this rank's columns) -> ``[N]``.

    Two all-reduces in forward (max; then sum-exp and target logit together), none in backward.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, g: Group, vocab_start: int, ignore_index: int) -> torch.Tensor:  # type: ignore[override]
        x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        top = x.detach().amax(dim=-1)
        _reduce_if_parallel(top, g, dist.ReduceOp.MAX)
        shifted = x - top.unsqueeze(-1)
        local = labels - vocab_start
        valid = labels != ignore_index
        mine = valid & (local >= 0) & (local < x.shape[-1])
        idx = torch.where(mine, local, 0).unsqueeze(-1)
        target = torch.where(mine, shifted.gather(-1, idx).squeeze(-1), 0.0)
        probs = shifted.exp_()
        sums = torch.stack([probs.sum(dim=-1), target])
        _reduce_if_parallel(sums, g, dist.ReduceOp.SUM)
        loss = torch.where(valid, sums[0].log() - sums[1], 0.0)
        probs.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(probs, idx, mine, valid)
        ctx.dtype = logits.dtype
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):  # type: ignore[override]
        probs, idx, mine, valid = ctx.saved_tensors
        dloss = dloss.to(probs.dtype)
        grad = probs * torch.where(valid, dloss, 0.0).unsqueeze(-1)
        grad.scatter_add_(-1, idx, -torch.where(mine, dloss, 0.0).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


def _reduce_if_parallel(t: torch.Tensor, g: Group, op: dist.ReduceOp) -> None:
    if g.size > 1:
        _all_reduce(t, g, "forward", op)


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    labels: torch.Tensor,
    g: Group,
    vocab_start: int,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(full_logits.flatten(0, -2), labels.flatten(), ...)`` from vocab shards.

    ``local_logits [..., V/W]`` holds the full vocab's columns ``[vocab_start, vocab_start + V/W)``;
    ``labels [...]`` are global ids. Same value and gradient as the full-logits loss (computed in
    fp32 for half inputs); ``reduction`` is ``"mean"`` (over non-ignored tokens), ``"sum"`` or
    ``"none"`` (shape of ``labels``).
    """
    if labels.shape != local_logits.shape[:-1]:
        raise ShardingError(
            f"vocab_parallel_cross_entropy over {g.axis}: labels of shape {list(labels.shape)} do not "
            f"match logits of shape {list(local_logits.shape)}; labels must be the logits' shape "
            "without the last (vocab) dim"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ShardingError(
            f"vocab_parallel_cross_entropy: reduction={reduction!r} is not supported; use 'mean', 'sum' or 'none'"
        )
    flat_labels = labels.reshape(-1)
    loss = _VocabParallelCE.apply(
        local_logits.reshape(-1, local_logits.shape[-1]), flat_labels, g, int(vocab_start), ignore_index
    )
    if reduction == "none":
        return loss.view(labels.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (flat_labels != ignore_index).sum()
