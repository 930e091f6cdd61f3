"""Each autograd pair, forward and backward, against one process computing on the full tensor."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist import DistPool, pool_fixture

import hp_lazy
from hp_lazy.errors import ShardingError
from hp_lazy.runtime.comm import pairs as C
from hp_lazy.runtime.comm import wire as W
from hp_lazy.runtime.mesh import Group, get_mesh
from hp_lazy.runtime.tp.loss import vocab_parallel_cross_entropy

pool2 = pool_fixture(2)
pool4 = pool_fixture(4)

Case = tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], torch.Tensor, Callable[[torch.Tensor], torch.Tensor], torch.Tensor]


def _f(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The deterministic, nonlinear downstream loss."""
    return (y.tanh() * w).sum()


def _chunk(t: torch.Tensor, dim: int, i: int, n: int) -> torch.Tensor:
    return t.chunk(n, dim)[i]


def _grad(loss_of: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    leaf = t.detach().clone().requires_grad_()
    loss_of(leaf).backward()
    return leaf.grad


def _case(name: str, g: Group, dims: tuple[int, ...]) -> Case:
    """(local input, op, expected output, local downstream loss, expected local grad).

    "partial" downstreams (after copy_to / gather_to) differ per rank and their losses add up;
    replicated ones (after reduce_from / gather_from) are one loss computed on every rank.
    """
    r, n = g.rank, g.size
    gen = torch.Generator().manual_seed(0)
    shape = (2 * n, n, 3 * n)
    X = torch.randn(shape, generator=gen, dtype=torch.float64)
    P = torch.randn((n, *shape), generator=gen, dtype=torch.float64)  # partial sums, one per rank
    Wr = torch.randn((n, *shape), generator=gen, dtype=torch.float64)  # per-rank downstream weights
    Wf = torch.randn(shape, generator=gen, dtype=torch.float64)  # one downstream weight
    d = dims[0] if dims else 0
    if name == "copy_to":
        ref = _grad(lambda t: sum(_f(t, w) for w in Wr), X)
        return X, lambda x: C.copy_to(x, g), X, lambda y: _f(y, Wr[r]), ref
    if name == "reduce_from":
        ref = _grad(lambda t: _f(t.sum(0), Wf), P)[r]
        return P[r], lambda x: C.reduce_from(x, g), P.sum(0), lambda y: _f(y, Wf), ref
    if name == "sum_over":  # partial statistics summed; each rank uses the sum on its own slice
        ref = _grad(lambda t: sum(_f(t.sum(0), w) for w in Wr), P)[r]
        return P[r], lambda x: C.sum_over(x, g), P.sum(0), lambda y: _f(y, Wr[r]), ref
    if name == "gather_from":
        ref = _chunk(_grad(lambda t: _f(t, Wf), X), d, r, n)
        return _chunk(X, d, r, n), lambda x: C.gather_from(x, g, d), X, lambda y: _f(y, Wf), ref
    if name == "gather_to":
        ref = _chunk(_grad(lambda t: sum(_f(t, w) for w in Wr), X), d, r, n)
        return _chunk(X, d, r, n), lambda x: C.gather_to(x, g, d), X, lambda y: _f(y, Wr[r]), ref
    local_w = _chunk(Wf, d, r, n)
    sharded_loss = lambda t: sum(_f(_chunk(t, d, j, n), _chunk(Wf, d, j, n)) for j in range(n))  # noqa: E731
    if name == "scatter_to":
        ref = _grad(sharded_loss, X)
        return X, lambda x: C.scatter_to(x, g, d), _chunk(X, d, r, n), lambda y: _f(y, local_w), ref
    if name == "reduce_scatter_to":
        ref = _grad(lambda t: sharded_loss(t.sum(0)), P)[r]
        out = _chunk(P.sum(0), d, r, n)
        return P[r], lambda x: C.reduce_scatter_to(x, g, d), out, lambda y: _f(y, local_w), ref
    assert name == "all_to_all"
    src, dst = dims  # S(src) -> S(dst)
    ref = _chunk(_grad(lambda t: sum(_f(_chunk(t, dst, j, n), _chunk(Wf, dst, j, n)) for j in range(n)), X), src, r, n)
    out = _chunk(X, dst, r, n)
    return _chunk(X, src, r, n), lambda x: C.all_to_all(x, g, src, dst), out, lambda y: _f(y, _chunk(Wf, dst, r, n)), ref


def _group(tp: int) -> Group:
    return get_mesh({"tp": tp}).group("tp")


def _unsupported(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")


def _run_pair(rank: int, world: int, name: str, tp: int, dims: tuple[int, ...], fallback: bool = False) -> dict:
    g = _group(tp)
    x_local, op, out_ref, loss_of, grad_ref = _case(name, g, dims)
    x = x_local.detach().clone().requires_grad_()
    native = W._reduce_scatter_single
    if fallback:  # a backend without reduce_scatter: the first call fails, later ones skip it
        W._reduce_scatter_single = _unsupported
    try:
        with hp_lazy.collective_counter() as counter:
            y = op(x)
            torch.testing.assert_close(y, out_ref, rtol=1e-12, atol=1e-12)
            loss_of(y).backward()
        assert W._NO_REDUCE_SCATTER == ({"gloo"} if fallback else set())
    finally:
        W._reduce_scatter_single = native
        W._NO_REDUCE_SCATTER.clear()
    torch.testing.assert_close(x.grad, grad_ref, rtol=1e-12, atol=1e-12)
    assert y.is_contiguous() and x.grad.is_contiguous()
    return dict(counter.counts)


_CASES = [
    ("copy_to", ()),
    ("reduce_from", ()),
    ("sum_over", ()),
    *[(name, (d,)) for name in ("gather_from", "gather_to", "scatter_to", "reduce_scatter_to") for d in (0, 1, -1)],
    *[("all_to_all", dims) for dims in ((0, -1), (-1, 1), (1, 0))],
]


def _table() -> dict[str, tuple[str, str]]:
    rows = re.findall(r"^\| (\w+) \| (\w+) \| (\w+) \|$", C.__doc__ or "", flags=re.M)
    return {name: (fwd, bwd) for name, fwd, bwd in rows if name != "name"}


def _expected_counts(name: str) -> dict[tuple[str, str], int]:
    fwd, bwd = _table()[name]
    wire = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    return {(op, phase): 1 for op, phase in ((fwd, "forward"), (bwd, "backward")) if op in wire}


@pytest.mark.parametrize("name,dims", _CASES)
def test_pair_world2(pool2: DistPool, name: str, dims: tuple[int, ...]) -> None:
    counts = pool2.run(_run_pair, name, 2, dims)
    assert counts == [_expected_counts(name)] * 2


@pytest.mark.parametrize("tp", [4, 2])
@pytest.mark.parametrize("name,dims", _CASES)
def test_pair_world4(pool4: DistPool, name: str, dims: tuple[int, ...], tp: int) -> None:
    """tp=2 at world 4 runs on sub-groups {0,1} and {2,3}: the group rank is not the global rank."""
    counts = pool4.run(_run_pair, name, tp, dims)
    assert counts == [_expected_counts(name)] * 4


def _real_failure(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("Connection closed by peer")


def _reduce_scatter_failure_body(rank: int, world: int) -> str:
    native, W._reduce_scatter_single = W._reduce_scatter_single, _real_failure
    try:
        C.reduce_scatter_to(torch.ones(4), _group(world), 0)
    except RuntimeError as error:
        return f"{error}; fallback taken: {bool(W._NO_REDUCE_SCATTER)}"
    finally:
        W._reduce_scatter_single = native
    return "no error"


def test_reduce_scatter_failure_is_not_mistaken_for_a_missing_op(pool2: DistPool) -> None:
    assert pool2.run(_reduce_scatter_failure_body) == ["Connection closed by peer; fallback taken: False"] * 2


@pytest.mark.parametrize("name,dims", [("gather_to", (1,)), ("reduce_scatter_to", (-1,))])
def test_reduce_scatter_fallback(pool2: DistPool, name: str, dims: tuple[int, ...]) -> None:
    counts = pool2.run(_run_pair, name, 2, dims, fallback=True)
    assert counts == [_expected_counts(name)] * 2


def test_docstring_table_matches_pairs_and_exports() -> None:
    assert _table() == C.PAIRS
    assert len(C.PAIRS) == 10
    for name in C.PAIRS:
        assert callable(getattr(C, name)) and name in C.__all__


def test_size_one_is_a_no_op() -> None:
    g = Group.solo("tp")
    x = torch.randn(4, 6, requires_grad=True)
    with hp_lazy.collective_counter() as counter:
        for op in (C.copy_to, C.reduce_from, C.sum_over):
            assert op(x, g) is x
        for op in (C.gather_from, C.gather_to, C.scatter_to, C.reduce_scatter_to):
            assert op(x, g, -1) is x
        assert C.all_to_all(x, g, 0, 1) is x
        assert W.all_reduce_(x.detach(), g) is not None
        assert W.all_gather_list(x, g) == [x]
    assert counter.total == 0 and str(counter) == "0 collectives"


def test_shape_errors_name_the_axis_shape_and_fix() -> None:
    g = Group(axis="tp", pg=None, size=2, rank=0)  # the checks run before any communication
    with pytest.raises(ShardingError, match=r"scatter_to over tp: dim 1 of shape \[4, 3\] has size 3, "
                       r"not divisible by tp=2; pad it or use a degree that divides 3"):
        C.scatter_to(torch.zeros(4, 3), g, -1)
    with pytest.raises(ShardingError, match=r"gather_from over tp: dim 2 is out of range for a tensor of "
                       r"shape \[4, 3\]; use a dim in \[-2, 1\]"):
        C.gather_from(torch.zeros(4, 3), g, 2)
    with pytest.raises(ShardingError, match=r"all_to_all over tp: dim 1 of shape \[4, 3\] has size 3"):
        C.all_to_all(torch.zeros(4, 3), g, 0, -1)  # S(0) -> S(1): the destination dim is cut


def _counter_body(rank: int, world: int) -> list[Any]:
    g = _group(world)
    x = torch.ones(3, requires_grad=True)
    with hp_lazy.collective_counter() as outer:
        y = C.reduce_from(C.copy_to(x, g), g)  # fwd: all_reduce; bwd: all_reduce
        with hp_lazy.collective_counter() as inner:
            hooked = (y * 2).sum()
            x.register_hook(lambda grad: W.all_reduce_(grad, g))  # a gradient hook: phase "backward"
            hooked.backward()
    strided = torch.arange(8.0).view(2, 4).t()  # non-contiguous
    W.all_reduce_(strided, g)
    return [dict(outer.counts), dict(inner.counts), outer.total, outer.by_phase("backward"), str(outer),
            x.grad.tolist(), strided.tolist(), [t.tolist() for t in W.all_gather_list(torch.tensor([rank]), g)],
            dict(outer.payload), outer.bytes_of("all_reduce")]


def test_counter_phases_nesting_and_in_place_reduce(pool2: DistPool) -> None:
    results = pool2.run(_counter_body)
    fwd, bwd = ("all_reduce", "forward"), ("all_reduce", "backward")
    for outer, inner, total, backward, text, grad, strided, gathered, payload, reduced in results:
        assert outer == {fwd: 1, bwd: 2} and inner == {bwd: 2} and total == 3
        assert payload == {fwd: 3 * 4, bwd: 2 * 3 * 4} and reduced == 9 * 4  # three fp32 values per call
        assert backward == {"all_reduce": 2}
        assert text == "3 collectives: forward 1 (all_reduce 1); backward 2 (all_reduce 2)"
        assert grad == [8.0] * 3  # dL/dx = 2, summed over 2 ranks by copy_to, then by the hook
        assert strided == (torch.arange(8.0).view(2, 4).t() * 2).tolist()
        assert gathered == [[0], [1]]


def _vocab_ce_body(rank: int, world: int, tp: int, reduction: str, shape: tuple[int, ...]) -> list[float]:
    g = _group(tp)
    gen = torch.Generator().manual_seed(1)
    vocab = 5 * g.size
    full = torch.randn((*shape, vocab), generator=gen, dtype=torch.float64) * 4
    labels = torch.randint(0, vocab, shape, generator=gen)
    for j, at in enumerate((1, 2, 4, 5)[: g.size]):
        labels.view(-1)[at] = 5 * j + 2  # every shard owns a label
    labels.view(-1)[::3] = -100  # some ignored tokens
    ref_logits = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, vocab), labels.view(-1), ignore_index=-100, reduction=reduction)
    local = _chunk(full, -1, g.rank, g.size).clone().requires_grad_()
    with hp_lazy.collective_counter() as counter:
        loss = vocab_parallel_cross_entropy(local, labels, g, 5 * g.rank, reduction=reduction)
        loss.backward(torch.ones_like(loss))
    torch.testing.assert_close(loss, ref.view(loss.shape), rtol=1e-12, atol=1e-12)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(local.grad, _chunk(ref_logits.grad, -1, g.rank, g.size), rtol=1e-12, atol=1e-12)
    assert dict(counter.counts) == {("all_reduce", "forward"): 2}
    return loss.detach().reshape(-1).tolist()


@pytest.mark.parametrize("reduction,shape", [("mean", (7,)), ("sum", (2, 5)), ("none", (2, 5))])
def test_vocab_parallel_cross_entropy_world2(pool2: DistPool, reduction: str, shape: tuple[int, ...]) -> None:
    losses = pool2.run(_vocab_ce_body, 2, reduction, shape)
    assert losses[0] == losses[1]


def test_vocab_parallel_cross_entropy_world4_subgroups(pool4: DistPool) -> None:
    pool4.run(_vocab_ce_body, 2, "mean", (3, 4))
    pool4.run(_vocab_ce_body, 4, "mean", (3, 4))


def test_vocab_parallel_cross_entropy_size_one_and_errors() -> None:
    g = Group.solo("tp")
    logits = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 10, -100, 3, -100, 7])
    loss = vocab_parallel_cross_entropy(logits, labels, g, 0)
    ref = F.cross_entropy(logits, labels)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, logits)[0])
    with pytest.raises(ShardingError, match=r"labels of shape \[5\] do not match logits of shape \[6, 11\]"):
        vocab_parallel_cross_entropy(logits, labels[:5], g, 0)
    with pytest.raises(ShardingError, match=r"reduction='avg' is not supported; use 'mean', 'sum' or 'none'"):
        vocab_parallel_cross_entropy(logits, labels, g, 0, reduction="avg")


def test_counter_is_exported_from_the_package() -> None:
    assert hp_lazy.collective_counter is W.collective_counter


# --------------------------------------------------------------------------- the harness itself


def _raise_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def _sleep_on_rank_0(rank: int, world: int) -> int:
    if rank == 0:
        import time

        time.sleep(30)
    return rank


def test_harness_reports_worker_errors_and_recovers(pool2: DistPool) -> None:
    with pytest.raises(AssertionError, match=r"(?s)_raise_on_rank_1 failed on a world of 2\n--- rank 1 raised:\n"
                       r"Traceback.*ValueError: boom on purpose"):
        pool2.run(_raise_on_rank_1)
    assert pool2.run(_rank) == [0, 1]  # a fresh pool


def _rank(rank: int, world: int) -> int:
    return rank


def test_harness_times_out_instead_of_hanging() -> None:
    pool = DistPool(2, timeout=2.0)
    try:
        with pytest.raises(AssertionError, match=r"ranks \[0\] gave no answer within 2 s \(hang\?\)"):
            pool.run(_sleep_on_rank_0)
    finally:
        pool.close()


def _all_to_all_v(rank: int, world: int) -> dict:
    """Rank r sends ``counts[r][j]`` rows to rank j (zeros included: some ranks receive nothing)."""
    from hp_lazy.runtime.mesh import get_mesh

    g = get_mesh({"tp": world}).group("tp")
    counts = [[(r * 3 + j) % 3 for j in range(world)] for r in range(world)]  # rank 0 sends 0 to rank 0
    send = counts[rank]
    recv = [counts[j][rank] for j in range(world)]
    x = (torch.arange(sum(send) * 2, dtype=torch.float64).view(-1, 2) + 100 * rank).requires_grad_()
    with hp_lazy.collective_counter() as counter:
        y = C.all_to_all_v(x, g, send, recv)
        (y * (rank + 1)).sum().backward()
    return {"y": y.detach(), "grad": x.grad, "counts": counts, "calls": dict(counter.counts),
            "payload": dict(counter.payload)}


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_v_routes_rows_and_gradients_back(pool2: DistPool, pool4: DistPool, world: int) -> None:
    got = (pool2 if world == 2 else pool4).run(_all_to_all_v)
    counts = got[0]["counts"]
    xs = [torch.arange(sum(counts[r]) * 2, dtype=torch.float64).view(-1, 2) + 100 * r for r in range(world)]
    for rank, result in enumerate(got):
        pieces = [xs[j].split(counts[j])[rank] for j in range(world)]
        assert torch.equal(result["y"], torch.cat(pieces))
        # every row sent by this rank was weighted by its receiver's (rank + 1)
        weights = torch.cat([torch.full((n, 2), float(j + 1), dtype=torch.float64) for j, n in enumerate(counts[rank])])
        assert torch.equal(result["grad"], weights)
        assert result["calls"] == {("all_to_all", "forward"): 1, ("all_to_all", "backward"): 1}
        row = 2 * 8  # two fp64 values; the rows a rank keeps are not payload
        sent = sum(counts[rank]) - counts[rank][rank]
        received = sum(counts[j][rank] for j in range(world)) - counts[rank][rank]  # sent back in the backward
        assert result["payload"] == {("all_to_all", "forward"): sent * row, ("all_to_all", "backward"): received * row}
    assert any(0 in row for row in counts)  # a zero count is in the test


def _gather_kv(rank: int, world: int) -> dict:
    from hp_lazy.runtime.mesh import get_mesh

    g = get_mesh({"tp": world}).group("tp")
    gen = torch.Generator().manual_seed(0)
    K, V = torch.randn(2, 3, 4 * world, 5, generator=gen, dtype=torch.float64), torch.randn(2, 3, 4 * world, 5, generator=gen, dtype=torch.float64)
    k, v = [t.chunk(world, dim=2)[rank].clone().requires_grad_() for t in (K, V)]
    with hp_lazy.collective_counter() as counter:
        kf, vf = C.gather_kv(k, v, g, 2)
        ((kf * (rank + 1)).sum() + (vf * vf).sum() * (rank + 1)).backward()
    return {"k": kf.detach(), "v": vf.detach(), "dk": k.grad, "dv": v.grad, "K": K, "V": V, "calls": dict(counter.counts)}


def test_gather_kv_is_one_gather_and_one_reduce_scatter(pool4: DistPool) -> None:
    got = pool4.run(_gather_kv)
    K, V, n = got[0]["K"], got[0]["V"], 4
    total = sum(r + 1 for r in range(n))  # the loss of every rank uses the full K and V
    for rank, result in enumerate(got):
        assert torch.equal(result["k"], K) and torch.equal(result["v"], V)
        assert torch.allclose(result["dk"], torch.full_like(result["dk"], float(total)))
        assert torch.allclose(result["dv"], (2 * V * total).chunk(n, dim=2)[rank])
        assert result["calls"] == {("all_gather", "forward"): 1, ("reduce_scatter", "backward"): 1}
