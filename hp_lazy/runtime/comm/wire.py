"""The wire: one function per c10d call, each counted by :func:`collective_counter`.

No autograd here: :mod:`hp_lazy.runtime.comm.pairs` builds the autograd pairs on top, and the
gradient owner (:mod:`hp_lazy.runtime.grads`) calls the asynchronous all-reduce directly. Every
function takes its :class:`~hp_lazy.runtime.mesh.Group` explicitly and allocates on the input's
device; a counter that is not active costs one truth test of an empty list.

Reduce-scatter uses c10d's ``reduce_scatter_tensor`` (``reduce_scatter_single`` where it exists).
Gloo implements it in torch 2.13; where a backend rejects it, the call falls back, once and for
good, to an all-reduce of the full tensor followed by taking chunk ``r`` (same result, twice the
traffic), still counted as one ``reduce_scatter``.
"""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from hp_lazy.runtime.mesh import Group

__all__ = [
    "CollectiveCounter",
    "Pending",
    "all_gather",
    "all_gather_list",
    "all_reduce",
    "all_reduce_",
    "all_reduce_async",
    "all_to_all",
    "all_to_all_async",
    "all_to_all_v",
    "collective_counter",
    "local_chunk",
    "reduce_scatter",
]

Phase = str  # "forward" | "backward"

class CollectiveCounter:
    """Counts of the collectives issued while active, keyed by ``(op, phase)``, and their payload.

    ``payload[(op, phase)]`` sums the bytes this rank hands to those calls: the tensor reduced
    (all-reduce), its own part (all-gather), the full input (reduce-scatter), the rows it sends to
    other ranks (all-to-all: its own chunk stays). What the wire carries per algorithm differs
    (a ring all-reduce moves ``2 (W-1)/W`` of its payload); the payload is what a layout changes.
    """

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, Phase]] = collections.Counter()
        self.payload: collections.Counter[tuple[str, Phase]] = collections.Counter()

    def __getitem__(self, key: tuple[str, Phase]) -> int:
        return self.counts[key]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by_phase(self, phase: Phase) -> dict[str, int]:
        """``{op: count}`` for one phase, e.g. ``by_phase("backward") == {"all_reduce": 4}``."""
        return {op: n for (op, p), n in sorted(self.counts.items()) if p == phase}

    def bytes_of(self, op: str) -> int:
        """The payload of every ``op`` call, both phases."""
        return sum(n for (o, _), n in self.payload.items() if o == op)

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


def _record(
    op: str, phase: Phase | None, t: torch.Tensor, exchange: Group | None = None, splits: Sequence[int] | None = None
) -> None:
    """Count one call of ``op`` on ``t`` (nothing is computed unless a counter is active). For an
    all-to-all over ``exchange`` the payload leaves out the rank's own chunk: the equal chunks of
    ``t``, or the run of ``splits`` (rows per destination) that stays."""
    if not _ACTIVE:
        return
    nbytes = t.numel() * t.element_size()
    if exchange is not None:
        total = int(sum(splits)) if splits is not None else exchange.size
        own = int(splits[exchange.rank]) if splits is not None else 1
        nbytes = nbytes * (total - own) // total if total else 0
    key = (op, phase or _current_phase())
    for counter in _ACTIVE:
        counter.counts[key] += 1
        counter.payload[key] += nbytes


def _current_phase() -> Phase:
    """``"backward"`` while the autograd engine runs (e.g. in a gradient hook), else ``"forward"``."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return "backward" if task is not None and task() != -1 else "forward"




# --------------------------------------------------------------------------- c10d calls

_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_NO_REDUCE_SCATTER: set[str] = set()  # backends that rejected reduce_scatter_tensor
_UNSUPPORTED = re.compile(r"not support|unsupported|not implemented|unimplemented", re.I)


def all_reduce(
    t: torch.Tensor, g: Group, phase: Phase | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.Tensor:
    """All-reduce ``t`` in place (``t`` must be contiguous); returns ``t``."""
    _record("all_reduce", phase, t)
    dist.all_reduce(t, op=op, group=g.pg)
    return t


class Pending:
    """A collective in flight (an all-reduce, an all-to-all): :meth:`wait` returns its result."""

    __slots__ = ("tensor", "_work")

    def __init__(self, tensor: torch.Tensor, work: dist.Work | None) -> None:
        self.tensor, self._work = tensor, work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self.tensor


def all_reduce_async(t: torch.Tensor, g: Group) -> Pending:
    """Start summing the contiguous ``t`` over ``g`` in place; counted in the phase it starts in."""
    if g.size == 1:
        return Pending(t, None)
    _record("all_reduce", None, t)
    return Pending(t, dist.all_reduce(t, group=g.pg, async_op=True))


def all_gather(x: torch.Tensor, g: Group, dim: int, phase: Phase | None) -> torch.Tensor:
    """``[.., n, ..] -> [.., W*n, ..]`` along ``dim``, rank order."""
    out = _gather_stacked(x, g, phase)
    return out.view(g.size * x.shape[0], *x.shape[1:]) if dim == 0 else torch.cat(out.unbind(0), dim=dim)


def gather_control(out: torch.Tensor, x: torch.Tensor, g: Group) -> None:
    """Every rank's ``x`` into ``out`` (``[W * n]``), uncounted: control traffic (the input
    check), through torch's current single-tensor gather (``all_gather_single`` where torch has it;
    ``all_gather_into_tensor`` warns that it is deprecated)."""
    _gather_single(out, x, group=g.pg)


def _gather_stacked(x: torch.Tensor, g: Group, phase: Phase | None) -> torch.Tensor:
    """``[...] -> [W, ...]``: every rank's ``x`` in rank order."""
    _record("all_gather", phase, x)
    out = x.new_empty((g.size, *x.shape))
    _gather_single(out, x.unsqueeze(0).contiguous(), group=g.pg)
    return out


def reduce_scatter(x: torch.Tensor, g: Group, dim: int, phase: Phase | None) -> torch.Tensor:
    """Sum ``[.., W*n, ..]`` over the group and keep chunk ``r``: ``[.., n, ..]``."""
    _record("reduce_scatter", phase, x)
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
    return local_chunk(full, g, 0).movedim(0, dim).contiguous()


def all_to_all(x: torch.Tensor, g: Group, split_dim: int, cat_dim: int, phase: Phase | None) -> torch.Tensor:
    """Chunk ``j`` of ``split_dim`` goes to rank ``j``; received chunks are concatenated on ``cat_dim``."""
    _record("all_to_all", phase, x, g)
    n = x.shape[split_dim] // g.size
    send = x.unflatten(split_dim, (g.size, n)).movedim(split_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=g.pg)
    return torch.cat(recv.unbind(0), dim=cat_dim)


def all_to_all_async(x: torch.Tensor, g: Group, phase: Phase | None) -> Pending:
    """Start sending the ``j``-th of ``W`` equal runs of the rows of ``x`` to rank ``j``; :meth:`Pending.wait`
    gives the runs received, in rank order. No autograd (control traffic: the expert counts)."""
    _record("all_to_all", phase, x, g)
    recv = torch.empty_like(x)
    return Pending(recv, dist.all_to_all_single(recv, x.contiguous(), group=g.pg, async_op=True))


def all_to_all_v(
    x: torch.Tensor, g: Group, send_splits: Sequence[int], recv_splits: Sequence[int], phase: Phase | None
) -> torch.Tensor:
    """Rows ``[sum(send_splits), ...]`` -> ``[sum(recv_splits), ...]``: the ``j``-th run of
    ``send_splits[j]`` rows goes to rank ``j``; what rank ``j`` sends lands as the ``j``-th run.

    Issued on every rank whatever the counts: a rank that sends or receives zero rows still
    takes part (an empty tensor on the wire), so no rank is left waiting.
    """
    _record("all_to_all", phase, x, g, send_splits)
    recv = x.new_empty((int(sum(recv_splits)), *x.shape[1:]))
    dist.all_to_all_single(
        recv, x.contiguous(), output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits), group=g.pg
    )
    return recv


def local_chunk(x: torch.Tensor, g: Group, dim: int) -> torch.Tensor:
    """Chunk ``r`` of ``W`` along ``dim``, no communication."""
    n = x.shape[dim] // g.size
    return x.narrow(dim, g.rank * n, n).contiguous()


# --------------------------------------------------------------------------- for hooks and state helpers


def all_reduce_(t: torch.Tensor, g: Group) -> torch.Tensor:
    """Sum ``t`` over the group in place (no autograd; for gradient hooks); returns ``t``.

    Counted in the phase it runs in: ``"backward"`` inside the autograd engine.
    """
    if g.size == 1:
        return t
    if t.is_contiguous():
        return all_reduce(t, g, None)
    return t.copy_(all_reduce(t.contiguous(), g, None))


def all_gather_list(t: torch.Tensor, g: Group) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on every rank), in rank order; no autograd."""
    if g.size == 1:
        return [t]
    return list(_gather_stacked(t.detach(), g, None).unbind(0))
