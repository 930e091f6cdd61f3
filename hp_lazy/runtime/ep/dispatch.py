"""The ``ep_dispatch`` region: an experts module's forward with its experts split over ``ep`` ranks.

It replaces ``experts.forward(hidden[T,H], top_k_index[T,K], top_k_weights[T,K])`` on the
instance (the class's own forward, which transformers' experts decorator dispatches to its
eager / grouped_mm / batched_mm kernels, runs on the local experts). Rank ``r`` of ``P`` holds
the global experts ``[r*El, (r+1)*El)``. Per call, with ``N = T*K`` (token, slot) pairs:

1. a stable argsort of the pairs by expert (so by owner rank); the rows ``x[order // K]``;
2. the per-expert counts ``[P, El]`` exchanged in one small all-to-all (no autograd), started
   before step 1 so that it is in flight while the rows are sorted and gathered, and read to the
   host once (the only host sync of the layer: ``all_to_all_single`` takes its splits as host lists);
3. a variable-split all-to-all of the rows (:func:`~hp_lazy.runtime.comm.all_to_all_v`, whose
   backward sends the gradient rows back along the same routes);
4. the received rows, sorted by local expert, through the class's own forward with local
   expert ids and unit weights (top-1), then back in arrival order;
5. the reverse all-to-all; the routing weights applied here, on the sender, and the top-k
   slots summed (so the router's gradient stays local and exact).

Dropless, no sentinel rows. Every rank issues every collective whatever the counts, and the
output is kept connected to the received rows and to every expert parameter (``+ 0 * sum``):
a rank that receives no rows still runs the backward all-to-all its peers wait for, and its
experts get zero gradients rather than ``None`` (weight decay still applies to them).
Collectives per layer: forward 3 all-to-alls (counts, rows, rows back), backward 2. Under
``torch.compile`` the region runs eagerly (:func:`_eager`): a graph break per experts module.
The per-expert counts of step 2 are kept on the module for :func:`~hp_lazy.runtime.ep.load.expert_load`.

:func:`keep_local` is the region ``tp_experts``: the experts split by expert over ranks that hold
the *same* tokens (the tp group). Nothing is sent: each rank runs the pairs routed to its own
experts (one host sync, the count of those pairs), puts zeros in the others' slots, and the
contract's exit all-reduce over tp sums the ranks' outputs; the entry's copy_to sums the input
and routing-weight gradients. Per layer: the bytes of experts-TP (forward one all-reduce of
``[T, H]``, backward one of ``[T, H]`` and one of ``[T, K]``) with whole experts, so each rank runs
fewer, full-width expert GEMMs instead of a slice of every expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hp_lazy.names import EP_DISPATCH, EP_LOAD
from hp_lazy.runtime.comm import all_to_all_v, wire
from hp_lazy.runtime.mesh import Group

if TYPE_CHECKING:
    from torch import nn

    _Module = nn.Module
else:
    _Module = object


@dataclass(frozen=True)
class Dispatch:
    """What the region of one experts module needs: the ep group and the expert counts."""

    group: Group
    num_local: int
    num_global: int
    routing: tuple[str, str] = ("top_k_index", "top_k_weights")
    """The names of the class's forward parameters holding the top-k ids and weights."""
    local: bool = False
    """The ranks of ``group`` hold the same tokens (region ``tp_experts``): :func:`keep_local`."""
    split: Group | None = None
    """The tp group, when its ranks hold the same tokens and whole (tp-replicated) experts: each
    dispatches its share of the tokens (:func:`split_tokens`)."""
    pieces: Group | None = None
    """The tp group, when its ranks hold other tokens (sequence parallel) and whole experts: each
    dispatches its own rows (:func:`dispatch`), as a ``split`` rank does its share."""

    @property
    def tp_tokens(self) -> Group | None:
        """The tp group where its ranks dispatch different rows to the same experts (their
        gradients summed over tp), else None."""
        return self.split if self.split is not None else self.pieces


class ExpertDispatch(_Module):
    """Mixin in front of an experts class: ``forward`` is the region (the module docstring)."""

    def forward(self, hidden_states: torch.Tensor, *args: torch.Tensor, **kwargs: torch.Tensor) -> Any:
        spec: Dispatch = getattr(self, EP_DISPATCH)
        if len(args) == 2 and not kwargs:  # how the MoE blocks call their experts
            index, weights = args
        else:
            routing = {**dict(zip(spec.routing, args, strict=False)), **kwargs}
            if len(args) + len(kwargs) != 2 or set(routing) != set(spec.routing):
                raise TypeError(
                    f"{type(self).__qualname__}.forward under expert parallel takes (hidden_states, "
                    f"{', '.join(spec.routing)}), got {len(args)} more positional and keywords {sorted(kwargs)}"
                )
            index, weights = routing[spec.routing[0]], routing[spec.routing[1]]
        run = keep_local if spec.local else split_tokens if spec.split is not None else dispatch  # pieces: own rows
        return _eager(run, self, super().forward, spec, hidden_states, index, weights)


@torch.compiler.disable
def _eager(run: Any, *args: Any) -> torch.Tensor:
    """The region, run eagerly under ``torch.compile``: its row counts are data (read to the host
    once per layer), which dynamo cannot carry into the variable-split all-to-alls (torch 2.13-2.14
    fail inside dynamo on them). The model compiles around each experts module: a graph break there."""
    return run(*args)


def connect(out: torch.Tensor, rows: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """``out`` plus an exact zero that depends on ``rows`` and on every expert parameter."""
    zero = rows.sum() * 0.0
    for param in params:
        zero = zero + param.sum() * 0.0
    return out + zero.to(out.dtype)


def dispatch(
    module: Any, experts_forward: Any, spec: Dispatch, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    group, local = spec.group, spec.num_local
    tokens, k = idx.shape
    flat = idx.reshape(-1)
    counts = torch.bincount(flat, minlength=spec.num_global).view(group.size, local)
    module.__dict__[EP_LOAD] = counts.detach().reshape(-1)  # read by hp_lazy.expert_load (:mod:`.load`)
    exchange = wire.all_to_all_async(counts.reshape(-1), group, "forward")  # in flight while the rows are sorted
    order = torch.argsort(flat, stable=True)
    send = x[order // k]
    got = exchange.wait().view(group.size, local)
    send_splits, recv_splits = torch.stack([counts.sum(1), got.sum(1)]).tolist()  # the one host sync
    recv = all_to_all_v(send, group, send_splits, recv_splits)
    ids = torch.arange(local, device=idx.device).repeat(group.size).repeat_interleave(got.reshape(-1))
    by_expert = torch.argsort(ids, stable=True)
    rows = recv[by_expert]
    out = experts_forward(rows, ids[by_expert][:, None], rows.new_ones(rows.shape[0], 1))
    out = connect(out, rows, [p for p in module.parameters()])
    out = out[_inverse(by_expert)]  # back in arrival order (source rank, local expert)
    back = all_to_all_v(out, group, recv_splits, send_splits)
    pairs = back[_inverse(order)].view(tokens, k, -1)
    return (pairs * w.unsqueeze(-1).to(pairs.dtype)).sum(1)


def keep_local(
    module: Any, experts_forward: Any, spec: Dispatch, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    tokens, k = idx.shape
    flat = idx.reshape(-1)
    module.__dict__[EP_LOAD] = torch.bincount(flat, minlength=spec.num_global).detach()
    first = spec.group.rank * spec.num_local
    mine = ((flat >= first) & (flat < first + spec.num_local)).nonzero().squeeze(1)  # the one host sync
    ids = flat[mine] - first
    by_expert = torch.argsort(ids, stable=True)
    pairs = mine[by_expert]
    rows = x[pairs // k]
    out = experts_forward(rows, ids[by_expert][:, None], rows.new_ones(rows.shape[0], 1))
    out = connect(out, rows, [p for p in module.parameters()])
    slots = out.new_zeros(tokens * k, out.shape[-1]).index_add(0, pairs, out).view(tokens, k, -1)
    return (slots * w.unsqueeze(-1).to(slots.dtype)).sum(1)


def split_tokens(
    module: Any, experts_forward: Any, spec: Dispatch, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """Expert parallel under tp with tp-replicated experts: the tp ranks hold the same tokens, so
    each dispatches its share (contiguous, sizes differing by at most one) over the ep group and
    the outputs are gathered over tp. All-to-all rows per rank are 1/tp of each rank dispatching
    every token; the gather's backward keeps this rank's rows (the tp ranks' output gradients are
    the same), the share's backward gathers the rows' gradients (each rank computed its own)."""
    g = spec.split
    assert g is not None
    sizes = [len(part) for part in torch.arange(x.shape[0]).tensor_split(g.size)]
    start = sum(sizes[: g.rank])
    mine = slice(start, start + sizes[g.rank])
    out = dispatch(module, experts_forward, spec, _Share.apply(x, g, sizes), idx[mine], _Share.apply(w, g, sizes))
    module.__dict__[EP_LOAD] = torch.bincount(idx.reshape(-1), minlength=spec.num_global).detach()  # every token
    return _Joined.apply(out, g, sizes)


def _rows_of(x: torch.Tensor, g: Group, sizes: list[int], phase: wire.Phase) -> torch.Tensor:
    """Every tp rank's rows (``sizes[r]`` of them) in rank order: one all-gather, padded to the largest."""
    most = max(sizes)
    padded = torch.cat([x, x.new_zeros(most - x.shape[0], *x.shape[1:])]) if x.shape[0] < most else x
    full = wire.all_gather(padded.contiguous(), g, 0, phase)
    return torch.cat([full[r * most : r * most + n] for r, n in enumerate(sizes)])


class _Share(torch.autograd.Function):
    """This tp rank's rows of a tensor every tp rank holds; backward: the full gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: Group, sizes: list[int]) -> torch.Tensor:
        ctx.g, ctx.sizes = g, sizes
        start = sum(sizes[: g.rank])
        return x[start : start + sizes[g.rank]].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _rows_of(grad, ctx.g, ctx.sizes, "backward"), None, None


class _Joined(torch.autograd.Function):
    """Every tp rank's rows, joined; backward: this rank's rows of the (tp-replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: Group, sizes: list[int]) -> torch.Tensor:
        ctx.g, ctx.sizes = g, sizes
        return _rows_of(x, g, sizes, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start = sum(ctx.sizes[: ctx.g.rank])
        return grad[start : start + ctx.sizes[ctx.g.rank]].contiguous(), None, None


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv
