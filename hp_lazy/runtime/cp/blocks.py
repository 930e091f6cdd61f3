"""Blockwise attention merged by log-sum-exp: context parallel's one attention algorithm, on every
device, with no ``[S/C x S]`` tensor.

The query rows a rank holds are cut into tiles of at most :data:`TILE` rows, the keys (in global
order) into tiles of :data:`TILE` keys, and each (query tile, key tile) pair is classified from
the visibility rule alone (causal, sliding window, packed documents, key padding): *empty*
(skipped), *full* (no mask; consecutive full tiles are one call), *causal* (an aligned square
diagonal tile: the kernel's own ``is_causal``) or *masked* (a ``[B, 1, tile, tile]`` mask built
for that tile and dropped after it). Each call returns its output and log-sum-exp; the calls of a
query tile are merged by log-sum-exp. Backward runs each call's kernel backward with the merged
output and log-sum-exp, which gives each call's exact share of the gradient: nothing is
recomputed, nothing quadratic in S is kept or built. The plan of calls is host work, made once per
forward and visibility kind (:meth:`~hp_lazy.runtime.cp.state.CallState.plan`) and shared by
every layer.

GQA without expanding K/V: a full call takes the query heads that share a K/V head as one head of
``g x rows`` rows (every row sees the same keys, so the rows' order does not matter); only the
bounded masked and causal tiles expand their K/V tile.

Kernels (:class:`Kernel`): the CPU fused flash kernel (its log-sum-exp output; masks as an
additive float bias), and :class:`MathKernel`, the same contract in plain tensor ops for every
other device and for what the fused kernel does not take (K and V of different head dims: MLA;
logit softcapping, ``cap * tanh(s / cap)`` on the scores before the softmax, Gemma 2) — the CPU
tests run both.

Attention sinks (gpt-oss and its kin: one learned logit per head that every query row sees, with
a zero value) are one more key of the merge: after the calls, ``lse' = logaddexp(lse, sink)`` and
the output is scaled by ``exp(lse - lse')``. Backward then runs unchanged with that output and
``lse'`` (the sink is a key like the others, its value zero), and the sink's own gradient is
``-sum exp(sink - lse') * (dout . out)`` over the rows this rank holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

TILE = 1024
"""Rows and keys per tile: bounds every mask (``B x TILE x TILE``) and every expanded K/V tile."""
MATH_KEYS = TILE
"""The most keys :class:`MathKernel` takes in one call (it holds ``rows x keys`` scores)."""
Kind = Literal["full", "causal", "masked"]


@dataclass(frozen=True, eq=False)
class Visibility:
    """Which keys a query may attend to, transformers' attention-function semantics: ``k <= q``
    (causal), ``|q - k| < window`` (one-sided when causal), the same packed document, and a key
    that is not padding. ``docs`` and ``key_padding`` are ``[B, S]`` over the whole sequence.
    ``rows`` (DSA's selection, :mod:`.indexed`): ``[B, 1, n, S]`` over the local query rows and
    the whole sequence's keys, one more condition; every tile it covers is masked. ``chunk``:
    chunked attention's chunk size, whose chunks ``docs`` then also separates (it keys the plans)."""

    causal: bool
    window: int | None
    docs: torch.Tensor | None
    key_padding: torch.Tensor | None
    rows: torch.Tensor | None = None
    chunk: int | None = None

    @property
    def plain(self) -> bool:
        return self.window is None and self.docs is None and self.key_padding is None and self.rows is None

    def mask(
        self, q0: int, q1: int, k0: int, k1: int, device: torch.device, local: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """``[B or 1, 1, q1 - q0, k1 - k0]`` bool over global positions (one tile); ``local``: the
        tile's local query rows (where :attr:`rows` is set)."""
        out = self.mask_at(torch.arange(q0, q1, device=device), torch.arange(k0, k1, device=device))
        if self.rows is not None:
            assert local is not None, "a tile of a visibility with rows needs its local rows"
            out = out & self.rows[:, :, local[0] : local[1], k0:k1]
        return out

    def mask_at(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[B or 1, 1, n, m]`` bool for the query and key global positions given (``[n]``, ``[m]``)."""
        q, k = queries[:, None], keys[None, :]
        mask = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=queries.device)
        if self.causal:
            mask &= k <= q
        if self.window is not None:
            mask &= k > q - self.window
            if not self.causal:  # a bidirectional window reaches as far forward as back
                mask &= k < q + self.window
        out = mask[None, None]
        if self.docs is not None:
            out = out & (self.docs[:, queries, None] == self.docs[:, None, keys])[:, None]
        if self.key_padding is not None:
            out = out & self.key_padding[:, None, None, keys]
        return out


@dataclass(frozen=True)
class Call:
    rows: tuple[int, int]
    """Local query rows ``[start, end)``."""
    keys: tuple[int, int]
    """Global key positions ``[start, end)``."""
    kind: Kind
    span: tuple[int, int]
    """Global positions of the rows (for the mask of a masked call)."""


@dataclass(frozen=True)
class Plan:
    """The calls of one forward's attention layers of one visibility kind, in order."""

    calls: tuple[Call, ...]


def tile_for(length: int) -> int:
    """The tile for query runs of ``length`` rows: at most :data:`TILE`, and dividing ``length``
    where a near-:data:`TILE` divisor exists, so the diagonal tiles of a causal run are aligned
    squares (the kernel's ``is_causal``, no mask)."""
    if length <= TILE:
        return length
    pieces = -(-length // TILE)
    return length // pieces if length % pieces == 0 else TILE


def plan(
    runs: list[tuple[int, int, int]], seq: int, vis: Visibility, tile: int, max_keys: int | None = None
) -> Plan:
    """The calls for query ``runs`` of ``(local start, global start, length)`` over keys
    ``[0, seq)`` in tiles of ``tile``; ``max_keys`` caps one full call's keys (None: no cap)."""
    docs = _ranges(vis.docs.cpu(), seq, tile) if vis.docs is not None else None
    pad = _padding(vis.key_padding.cpu(), seq, tile) if vis.key_padding is not None else None
    calls: list[Call] = []
    for local, start, length in runs:
        for r0 in range(0, length, tile):
            r1 = min(length, r0 + tile)
            rows, span = (local + r0, local + r1), (start + r0, start + r1)
            run: int | None = None  # where the current run of full key tiles started
            for k0 in range(0, seq, tile):
                k1 = min(seq, k0 + tile)
                kind = _classify(vis, span, (k0, k1), tile, docs, pad)
                if vis.rows is not None and kind != "empty":  # a selection within the tile: masked
                    kind = "masked"
                if kind == "full":
                    if run is not None and max_keys is not None and k1 - run > max_keys:
                        calls.append(Call(rows, (run, k0), "full", span))
                        run = None
                    run = k0 if run is None else run
                    continue
                if run is not None:
                    calls.append(Call(rows, (run, k0), "full", span))
                    run = None
                if kind != "empty":
                    calls.append(Call(rows, (k0, k1), kind, span))
            if run is not None:
                calls.append(Call(rows, (run, seq), "full", span))
    return Plan(tuple(calls))


def _ranges(docs: torch.Tensor, seq: int, tile: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per tile of the sequence: the ``[B]`` smallest and largest document id."""
    return [(docs[:, t : t + tile].amin(1), docs[:, t : t + tile].amax(1)) for t in range(0, seq, tile)]


def _padding(pad: torch.Tensor, seq: int, tile: int) -> tuple[list[bool], list[bool]]:
    """Per tile of the sequence: whether any key, and whether every key, may be attended to."""
    tiles = [pad[:, t : t + tile] for t in range(0, seq, tile)]
    return [bool(t.any()) for t in tiles], [bool(t.all()) for t in tiles]


def _classify(
    vis: Visibility, span: tuple[int, int], keys: tuple[int, int], tile: int,
    docs: list[tuple[torch.Tensor, torch.Tensor]] | None, pad: tuple[list[bool], list[bool]] | None,
) -> Kind | Literal["empty"]:
    """Empty when no (query, key) pair of the tile is visible in any batch row, full when all are."""
    (q0, q1), (k0, k1) = span, keys
    first, last, low, high = q0, q1 - 1, k0, k1 - 1
    full = True
    if vis.causal:
        if low > last:
            return "empty"
        full &= high <= first
    if vis.window is not None:
        w = vis.window
        if high <= first - w:
            return "empty"
        full &= low > last - w
        if not vis.causal:
            if low >= last + w:
                return "empty"
            full &= high < first + w
    if docs is not None:
        (rlo, rhi), (klo, khi) = _span(docs, q0, q1, tile), _span(docs, k0, k1, tile)
        if bool(((rhi < klo) | (khi < rlo)).all()):
            return "empty"
        full &= bool(((rlo == rhi) & (klo == khi) & (rlo == klo)).all())
    if pad is not None:
        if not pad[0][k0 // tile]:
            return "empty"
        full &= pad[1][k0 // tile]
    if full:
        return "full"
    if vis.plain and (q0, q1) == (k0, k1):
        return "causal"
    return "masked"


def _span(
    ranges: list[tuple[torch.Tensor, torch.Tensor]], p0: int, p1: int, tile: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds ``[B]`` of the document ids over positions ``[p0, p1)``: over the tiles that cover
    them (exact for aligned tiles, a superset otherwise, which only ever makes a tile masked)."""
    tiles = ranges[p0 // tile : (p1 - 1) // tile + 1]
    if len(tiles) == 1:
        return tiles[0]
    return torch.stack([t[0] for t in tiles]).amin(0), torch.stack([t[1] for t in tiles]).amax(0)


class Kernel(Protocol):
    """One attention call: ``q [B, H, n, D]``, ``k [B, H, m, D]``, ``v [B, H, m, Dv]`` (equal
    heads), an optional bool mask ``[B or 1, 1, n, m]``; returns the output in ``q``'s dtype and
    the log-sum-exp ``[B, H, n]`` in float32 (``-inf`` for a row that sees no key)."""

    max_keys: int | None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype outputs and log-sum-exps are merged in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _unseen(lse: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``lse`` with ``-inf`` where the mask hides every key of a row."""
    if mask is None:
        return lse
    return lse.masked_fill(~mask.any(-1), float("-inf"))


class FlashCPU:
    """The CPU fused flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``)."""

    max_keys: int | None = None
    op = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    op_backward = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        out, lse = self.op(q, k, v, 0.0, causal, attn_mask=_bias(mask, q.dtype), scale=scale)
        return out, _unseen(lse.to(acc(q.dtype)), mask)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
        causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return self.op_backward(dout, q, k, v, out, lse.to(acc(q.dtype)), 0.0, causal, attn_mask=_bias(mask, q.dtype),
                                scale=scale)


class MathKernel:
    """The kernel contract in plain tensor ops (float32 accumulation), for any device; with
    ``softcap``, the scores are ``softcap * tanh(s / softcap)`` before the mask and the softmax
    (transformers' eager attention order)."""

    max_keys: int | None = MATH_KEYS

    def __init__(self, softcap: float | None = None) -> None:
        self.softcap = softcap

    def _scores(self, q: Tensor, k: Tensor, scale: float) -> tuple[Tensor, Tensor | None]:
        """The scores and, under softcapping, ``tanh(s / softcap)`` (for the backward)."""
        s = torch.matmul(q.to(acc(q.dtype)), k.to(acc(q.dtype)).transpose(-1, -2)) * scale
        if self.softcap is None:
            return s, None
        t = torch.tanh(s / self.softcap)
        return t * self.softcap, t

    def _probs(
        self, q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float, lse: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        s, t = self._scores(q, k, scale)
        if causal:
            n, m = s.shape[-2:]
            s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
        return p, lse, t

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        p, lse, _ = self._probs(q, k, mask, causal, scale)
        return torch.matmul(p, v.to(acc(q.dtype))).to(q.dtype), lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
        causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        p, _, t = self._probs(q, k, mask, causal, scale, lse.to(acc(q.dtype)))
        do = dout.to(acc(q.dtype))
        dp = torch.matmul(do, v.to(acc(q.dtype)).transpose(-1, -2))
        ds = p * (dp - (do * out.to(acc(q.dtype))).sum(-1, keepdim=True))
        if t is not None:  # through cap * tanh(s / cap)
            ds = ds * (1 - t * t)
        dq = torch.matmul(ds, k.to(acc(q.dtype))) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc(q.dtype))) * scale
        dv = torch.matmul(p.transpose(-1, -2), do)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


FLASH_CPU, MATH = FlashCPU(), MathKernel()


def kernel_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float | None = None) -> Kernel:
    """The fused kernel where the device has one this contract can use, else :data:`MATH` (or a
    softcapping :class:`MathKernel`)."""
    if softcap:
        return MathKernel(float(softcap))
    if q.device.type == "cpu" and k.shape[-1] == v.shape[-1]:
        return FLASH_CPU
    return MATH


# -- the calls of a plan -------------------------------------------------------------------------


def _grouped(t: torch.Tensor, kv: int) -> torch.Tensor:
    """``[B, H, n, D]`` -> ``[B, kv, g * n, D]``: the query heads sharing a K/V head as one."""
    b, h, n, d = t.shape
    return t.reshape(b, kv, (h // kv) * n, d)


def _ungrouped(t: torch.Tensor, heads: int) -> torch.Tensor:
    b, kv, gn = t.shape[:3]
    return t.reshape(b, heads, gn * kv // heads, *t.shape[3:])


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def _operands(
    call: Call, q: Tensor, keys: Tensor, values: Tensor, vis: Visibility
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The call's query rows, keys, values and mask in the layout the kernel takes."""
    r0, r1 = call.rows
    k0, k1 = call.keys
    kv, groups = keys.shape[1], q.shape[1] // keys.shape[1]
    rows = q[:, :, r0:r1]
    k, v = keys[:, :, k0:k1], values[:, :, k0:k1]
    if call.kind == "full":
        return _grouped(rows.contiguous(), kv), k.contiguous(), v.contiguous(), None
    mask = vis.mask(call.span[0], call.span[1], k0, k1, q.device, call.rows) if call.kind == "masked" else None
    return rows.contiguous(), _expand(k, groups).contiguous(), _expand(v, groups).contiguous(), mask


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: Plan, vis: Visibility, kernel: Kernel,
    scale: float, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, H, n, D]`` over ``keys``/``values`` ``[B, kv, S, *]`` in global order (and the
    ``[H]`` ``sinks``, if any): output ``[B, H, n, Dv]`` (``q``'s dtype) and log-sum-exp
    ``[B, H, n]`` (float32)."""
    b, h, n, _ = q.shape
    out = torch.zeros(b, h, n, values.shape[-1], dtype=acc(q.dtype), device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc(q.dtype), device=q.device)
    for call in plan.calls:
        rows, k, v, mask = _operands(call, q, keys, values, vis)
        o, part = kernel.forward(rows, k, v, mask, call.kind == "causal", scale)
        if call.kind == "full":
            o, part = _ungrouped(o, h), _ungrouped(part, h)
        r0, r1 = call.rows
        old, old_lse = out[:, :, r0:r1], lse[:, :, r0:r1]
        merged = torch.logaddexp(old_lse, part)
        safe = merged.masked_fill(torch.isinf(merged), 0.0)
        out[:, :, r0:r1] = (old * (old_lse - safe).exp().unsqueeze(-1)
                            + o.to(out.dtype) * (part - safe).exp().unsqueeze(-1))
        lse[:, :, r0:r1] = merged
    if sinks is not None:
        merged = torch.logaddexp(lse, sinks.detach().to(lse.dtype).view(1, h, 1))
        out, lse = out * (lse - merged).exp().unsqueeze(-1), merged
    return out.to(q.dtype), lse


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`attend` for its ``[H]`` sinks, over the rows given: the sink is a
    key with score ``sink`` and a zero value, so its score gradient is ``p_sink * (0 - dout . out)``."""
    p = (sinks.detach().to(lse.dtype).view(1, -1, 1) - lse).exp()
    dot = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return -(p * dot).sum((0, 2)).to(sinks.dtype)


def attend_backward(
    dout: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, plan: Plan, vis: Visibility, kernel: Kernel, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`attend` for ``q``, ``keys`` and ``values`` (in their layouts)."""
    h, kv = q.shape[1], keys.shape[1]
    groups = h // kv
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    dq = torch.zeros_like(q, dtype=acc(q.dtype))
    dkeys = torch.zeros_like(keys, dtype=dq.dtype)
    dvalues = torch.zeros_like(values, dtype=dq.dtype)
    for call in plan.calls:
        rows, k, v, mask = _operands(call, q, keys, values, vis)
        r0, r1 = call.rows
        k0, k1 = call.keys
        parts = [t[:, :, r0:r1].contiguous() for t in (dout, out)]
        row_lse = safe[:, :, r0:r1].contiguous()
        if call.kind == "full":
            parts = [_grouped(t, kv) for t in parts]
            row_lse = row_lse.reshape(row_lse.shape[0], kv, -1)
        gq, gk, gv = kernel.backward(parts[0], rows, k, v, parts[1], row_lse, mask, call.kind == "causal", scale)
        if call.kind == "full":
            dq[:, :, r0:r1] += _ungrouped(gq, h).to(dq.dtype)
            dkeys[:, :, k0:k1] += gk.to(dq.dtype)
            dvalues[:, :, k0:k1] += gv.to(dq.dtype)
        else:
            dq[:, :, r0:r1] += gq.to(dq.dtype)
            dkeys[:, :, k0:k1] += _fold(gk.to(dq.dtype), groups)
            dvalues[:, :, k0:k1] += _fold(gv.to(dq.dtype), groups)
    return dq.to(q.dtype), dkeys.to(keys.dtype), dvalues.to(values.dtype)


Exchange = Callable[[torch.Tensor, torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]
"""``(k, v, phase) -> (keys, values)`` over the whole sequence in global order, or, for phase
``"grad"``, the gradients of those back to this rank's ``k``/``v`` layout."""


class BlockAttention(torch.autograd.Function):
    """:func:`attend` as an autograd function: saves the local Q, K, V, the output and the
    log-sum-exp; ``exchange`` brings K/V to the whole sequence (an all-gather, or nothing) in
    forward and again in backward, and takes the key gradients back (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, plan, vis, kernel, exchange, sinks=None):
        keys, values = exchange(k, v, "forward")
        out, lse = attend(q, keys, values, plan, vis, kernel, scale, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.scale, ctx.plan, ctx.vis, ctx.kernel, ctx.exchange = scale, plan, vis, kernel, exchange
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        keys, values = ctx.exchange(k, v, "backward")
        dout = dout.contiguous()
        dq, dkeys, dvalues = attend_backward(dout, q, keys, values, out, lse, ctx.plan, ctx.vis, ctx.kernel,
                                             ctx.scale)
        dk, dv = ctx.exchange(dkeys, dvalues, "grad")
        dsinks = None if sinks is None or not ctx.needs_input_grad[8] else sink_grad(dout, out, lse, sinks)
        return dq, dk, dv, None, None, None, None, None, dsinks


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
