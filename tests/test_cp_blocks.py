"""runtime/cp/blocks: blockwise attention merged by log-sum-exp against one dense attention, on
both kernels (the CPU fused flash kernel and the plain-ops kernel other devices run), over every
visibility rule context parallel meets, with attention sinks and logit softcapping; and no
``[S/C x S]`` tensor at S = 8k."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hp_lazy.runtime.cp import blocks
from hp_lazy.runtime.cp.blocks import FLASH_CPU, MATH, BlockAttention, Visibility, plan, tile_for

S, C, B = 64, 2, 2


def _docs() -> torch.Tensor:
    docs = torch.zeros(B, S, dtype=torch.long)
    docs[0, 13:] += 1
    docs[0, 40:] += 1
    docs[1, 33:] += 1  # a boundary inside a tile, another on one
    docs[1, 48:] += 1
    return docs


def _padding() -> torch.Tensor:
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, :11] = False  # left padding: the first rows see no key under a causal rule
    pad[1, 50:] = False
    return pad


VISIBILITY = {
    "causal": Visibility(True, None, None, None),
    "bidirectional": Visibility(False, None, None, None),
    "causal_window": Visibility(True, 9, None, None),
    "bidirectional_window": Visibility(False, 9, None, None),
    "packed": Visibility(True, None, _docs(), None),
    "padded": Visibility(True, None, None, _padding()),
    "bidirectional_padded": Visibility(False, None, None, _padding()),
    "everything": Visibility(True, 17, _docs(), _padding()),
}


def _runs(mode: str, rank: int) -> list[tuple[int, int, int]]:
    if mode == "whole":  # Ulysses: every row, in sequence order
        return [(0, 0, S)]
    c = S // (2 * C)
    return [(0, rank * c, c), (c, (2 * C - 1 - rank) * c, c)]


def _reference(q, k, v, vis, runs, scale, sinks=None, softcap=None):  # type: ignore[no-untyped-def]
    """Dense attention in float64, transformers' eager order (softcap, mask, a sink column per
    head, softmax, the sink column dropped); a row that sees no key gives 0 (the fused kernel's
    convention)."""
    rows = torch.cat([torch.arange(start, start + n) for _, start, n in runs])
    mask = torch.cat([vis.mask(start, start + n, 0, S, q.device) for _, start, n in runs], dim=2)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    seen = mask.any(-1, keepdim=True)
    s = s.masked_fill(~mask, float("-inf")).masked_fill(~seen, 0.0)
    assert rows.numel() == q.shape[2]
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    return (torch.softmax(s, -1)[..., : v.shape[2]] * seen) @ v


def _inputs(heads: int, kv: int, dk: int, dv: int, rows: int, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, rows, dk, generator=g, dtype=torch.float64)
    k = torch.randn(B, kv, S, dk, generator=g, dtype=torch.float64)
    v = torch.randn(B, kv, S, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, heads, rows, dv, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _errors(vis: Visibility, runs, kernel, heads=4, kv=2, dk=8, dv=8, sinks=False, softcap=None):  # type: ignore[no-untyped-def]
    """Relative max errors of the output and the gradients (q, k, v, then the sinks' if any)."""
    rows = sum(n for _, _, n in runs)
    q, k, v, dout = _inputs(heads, kv, dk, dv, rows)
    inputs = (q, k, v, *((torch.linspace(-1.0, 2.0, heads, dtype=torch.float64),) if sinks else ()))
    scale = dk**-0.5
    ref = [t.clone().requires_grad_() for t in inputs]
    expected = _reference(*ref[:3], vis, runs, scale, *ref[3:], softcap=softcap)
    expected.backward(dout)
    mine = [t.float().requires_grad_() for t in inputs]
    calls = plan(runs, S, vis, tile_for(runs[0][2]), kernel.max_keys)
    out = BlockAttention.apply(*mine[:3], scale, calls, vis, kernel, lambda a, b, phase: (a, b), *mine[3:])
    out.backward(dout.float())
    pairs = [(out, expected), *((m.grad, r.grad) for m, r in zip(mine, ref, strict=True))]
    return [float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max()) for a, b in pairs], calls


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocks, "TILE", 8)  # several tiles per run: every kind of call happens


@pytest.mark.parametrize("kernel", [FLASH_CPU, MATH], ids=["flash_cpu", "math"])
@pytest.mark.parametrize("name", sorted(VISIBILITY))
@pytest.mark.parametrize("mode", ["zigzag0", "zigzag1", "whole"])
def test_blocks_match_dense_attention(kernel, name: str, mode: str) -> None:  # type: ignore[no-untyped-def]
    runs = _runs("whole" if mode == "whole" else "zigzag", int(mode[-1]) if mode != "whole" else 0)
    errors, calls = _errors(VISIBILITY[name], runs, kernel)
    assert max(errors) <= 1e-5, (name, mode, errors)
    kinds = {c.kind for c in calls.calls}
    if name == "causal":
        assert kinds == {"full", "causal"}  # no mask at all
    if name == "everything":
        assert "masked" in kinds


@pytest.mark.parametrize("heads,kv", [(4, 4), (4, 1), (6, 2)])
def test_gqa_without_expanding_full_calls(heads: int, kv: int) -> None:
    errors, _ = _errors(VISIBILITY["everything"], _runs("zigzag", 1), FLASH_CPU, heads=heads, kv=kv)
    assert max(errors) <= 1e-5, errors


def test_math_kernel_takes_different_key_and_value_widths() -> None:
    """MLA: K 12 wide, V 8 wide (the fused CPU kernel needs them equal)."""
    errors, _ = _errors(VISIBILITY["packed"], _runs("zigzag", 0), MATH, dk=12, dv=8)
    assert max(errors) <= 1e-5, errors
    assert blocks.kernel_for(torch.zeros(1, 1, 1, 12), torch.zeros(1, 1, 1, 12), torch.zeros(1, 1, 1, 8)) is MATH


@pytest.mark.parametrize("kernel", [FLASH_CPU, MATH], ids=["flash_cpu", "math"])
@pytest.mark.parametrize("name", ["causal", "causal_window", "padded", "everything"])
@pytest.mark.parametrize("mode", ["zigzag1", "whole"])
def test_sinks_join_the_merge_with_their_gradient(kernel, name: str, mode: str) -> None:  # type: ignore[no-untyped-def]
    """gpt-oss's attention sinks: one more key per head with a zero value; the sinks' gradient too."""
    runs = _runs("whole" if mode == "whole" else "zigzag", 1)
    errors, _ = _errors(VISIBILITY[name], runs, kernel, sinks=True)
    assert len(errors) == 5 and max(errors) <= 1e-5, (name, mode, errors)


@pytest.mark.parametrize("name", ["causal", "packed", "everything", "bidirectional"])
def test_softcapped_scores_in_the_math_kernel(name: str) -> None:
    """Gemma 2's ``cap * tanh(s / cap)`` before the mask; the fused kernel cannot take it."""
    kernel = blocks.kernel_for(torch.zeros(1), torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8), softcap=1.5)
    assert isinstance(kernel, blocks.MathKernel) and kernel.softcap == 1.5
    errors, _ = _errors(VISIBILITY[name], _runs("zigzag", 0), kernel, softcap=1.5, sinks=name == "everything")
    assert max(errors) <= 1e-5, (name, errors)


def test_negative_control_softcap_or_sinks_dropped_are_wrong() -> None:
    runs = _runs("zigzag", 0)
    errors, _ = _errors(VISIBILITY["causal"], runs, FLASH_CPU, softcap=1.5)  # the fused kernel ignores the cap
    assert max(errors) > 1e-2, errors
    rows = sum(n for _, _, n in runs)
    q, k, v, _ = _inputs(4, 2, 8, 8, rows)
    sinks = torch.linspace(-1.0, 2.0, 4, dtype=torch.float64)
    calls = plan(runs, S, VISIBILITY["causal"], tile_for(runs[0][2]), FLASH_CPU.max_keys)
    expected = _reference(q, k, v, VISIBILITY["causal"], runs, 8**-0.5, sinks)
    without = BlockAttention.apply(q, k, v, 8**-0.5, calls, VISIBILITY["causal"], FLASH_CPU, lambda a, b, p: (a, b))
    assert float((without - expected).abs().max() / expected.abs().max()) > 1e-2


def test_negative_control_a_masked_tile_taken_as_full_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    real = blocks._classify
    monkeypatch.setattr(blocks, "_classify", lambda *a: "full" if real(*a) == "masked" else real(*a))
    errors, _ = _errors(VISIBILITY["packed"], _runs("zigzag", 0), FLASH_CPU)
    assert max(errors) > 1e-3


def test_full_calls_are_capped_for_the_math_kernel() -> None:
    calls = plan([(0, 0, S)], S, VISIBILITY["bidirectional"], 8, max_keys=16)
    assert {c.keys[1] - c.keys[0] for c in calls.calls} == {16}
    assert len(plan([(0, 0, S)], S, VISIBILITY["bidirectional"], 8).calls) == S // 8  # one call per row tile


class _Largest(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = (0, "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                self.largest = (t.numel(), str(func))
        return out


@pytest.mark.parametrize("name", ["causal", "everything"])
def test_no_tensor_of_s_over_c_by_s_elements_at_8k(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(blocks, "TILE", 1024)
    seq, cp, c = 8192, 2, 8192 // 4
    docs = torch.zeros(1, seq, dtype=torch.long)
    docs[0, 3000:] = 1
    pad = torch.ones(1, seq, dtype=torch.bool)
    pad[0, :100] = False
    vis = Visibility(True, None, None, None) if name == "causal" else Visibility(True, 3000, docs, pad)
    runs = [(0, 0, c), (c, (2 * cp - 1) * c, c)]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 2 * c, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 1, seq, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 1, seq, 8, generator=g, requires_grad=True)
    calls = plan(runs, seq, vis, tile_for(c), FLASH_CPU.max_keys)
    with _Largest() as seen:
        out = BlockAttention.apply(q, k, v, 8**-0.5, calls, vis, FLASH_CPU, lambda a, b, phase: (a, b))
        out.sum().backward()
    assert seen.largest[0] < seq * seq // cp, seen.largest
    # the widest is a tile's mask (B x TILE x TILE) or K/V-sized (linear in S), whatever S is
    assert seen.largest[0] <= max(1024 * 1024, 2 * seq * 8 * 2), seen.largest
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
