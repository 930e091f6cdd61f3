"""``torch.compile`` of an hp_lazy model before its first forward (``torch.compile(model)`` and
``model.compile()``) and after ``parallelize``: binding happens outside the traced region, the step
is one graph with no graph break, and logits, loss, every gradient and three SGD steps equal one
process's (backend ``eager``: dynamo's capture is what is under test, and it is cheap on CPU).

Under context and expert parallel the compiled step is exact too, with graph breaks: cp's per-call
state (a context variable, host-side plans of the blockwise attention) and each experts module
under ep (its dispatch runs eagerly: the row counts are data, read to the host)."""

from __future__ import annotations

import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=180)
cp_pool = pool_fixture(2, timeout=180)  # activations of their own (pool2 keeps its tp plan)
ep_pool = pool_fixture(2, timeout=180)
sp_pool = pool_fixture(2, timeout=180)


def _compiled(rank: int, world: int, path: str, ids, how: str) -> dict:
    import torch
    from torch._dynamo.utils import counters

    import hp_lazy

    torch._dynamo.reset()
    counters.clear()
    model = parity._load(path)
    if how == "after parallelize":
        hp_lazy.parallelize(model)
    if how == "model.compile()":
        model.compile(backend="eager", fullgraph=True)
        compiled = model
    else:
        compiled = torch.compile(model, backend="eager", fullgraph=True)

    result = _train(compiled, ids)
    result["graph_breaks"] = sum(counters["graph_break"].values())
    result["graphs"] = counters["stats"]["unique_graphs"]
    return result if rank == 0 else {"graph_breaks": result["graph_breaks"]}


def _train(compiled, ids) -> dict:
    import hp_lazy

    def strip(d: dict) -> dict:  # torch.compile(model)'s wrapper names parameters "_orig_mod.<name>"
        return {k.removeprefix("_orig_mod."): v for k, v in d.items()}

    return models.run_training(
        compiled, ids,
        full_grads=lambda m: strip(hp_lazy.full_grads(m)),
        full_state_dict=lambda m: strip(hp_lazy.full_state_dict(m)),
    )


@pytest.mark.parametrize("how", ["torch.compile before the first forward", "model.compile()", "after parallelize"])
def test_compile_is_one_graph_and_exact(how: str, refs, pool2: DistPool) -> None:
    path, ref = refs("llama")
    results = parity.activated(pool2, sequence_parallel=False).run(_compiled, path, models.batch(), how)
    assert [r["graph_breaks"] for r in results] == [0, 0]
    assert results[0]["graphs"] == 1  # fullgraph=True: the whole step, collectives inside, one graph
    errors = parity.compare(results[0], ref)
    assert max(errors.values()) <= parity.TOL


def _compiled_peft(rank: int, world: int, path: str, ids, when: str) -> dict:
    """``torch.compile(peft_model)`` with PEFT applied before binding or after ``parallelize``
    (then the model changed since binding: hp_lazy binds the adapters before tracing too)."""
    import test_peft
    import torch
    from torch._dynamo.utils import counters

    import hp_lazy

    torch._dynamo.reset()
    counters.clear()
    model = parity._load(path)
    if when == "after":
        hp_lazy.parallelize(model)
    peft_model = test_peft._peft(model)
    compiled = torch.compile(peft_model, backend="eager", fullgraph=True)
    from hp_lazy.runtime import owner

    traced: list[bool] = []  # 2.13 ran a lazy submodule's hook outside the graph; 2.14 traced (and refused) the binding
    spied = {name: getattr(owner, name) for name in ("parallelize", "refresh")}

    def spy(fn):
        def call(*args, **kwargs):
            traced.append(torch.compiler.is_compiling())
            return fn(*args, **kwargs)
        return call

    for name, fn in spied.items():
        setattr(owner, name, spy(fn))
    try:
        result = _train(compiled, ids)
    finally:
        for name, fn in spied.items():
            setattr(owner, name, fn)
    result["graph_breaks"] = sum(counters["graph_break"].values())
    result["graphs"] = counters["stats"]["unique_graphs"]
    result["bound_in_trace"] = any(traced)
    return result if rank == 0 else {"graph_breaks": result["graph_breaks"], "bound_in_trace": any(traced)}


@pytest.fixture(scope="module")
def peft_ref(refs) -> tuple[str, dict]:
    import test_peft

    path = models.build("llama_bias", refs.root)
    return path, test_peft._reference(path, models.batch())


@pytest.mark.parametrize("when", ["before", "after"])
def test_compiled_peft_model(when: str, peft_ref, pool2: DistPool) -> None:
    path, ref = peft_ref
    pool = parity.activated(pool2, sequence_parallel=False)
    results = pool.run(_compiled_peft, path, models.batch(), when)
    assert [r["graph_breaks"] for r in results] == [0, 0] and results[0]["graphs"] == 1
    assert [r["bound_in_trace"] for r in results] == [False, False]  # PeftModel binds it before tracing
    assert max(parity.compare(results[0], ref).values()) <= parity.TOL


@pytest.mark.parametrize("kind", ["plain", "packed"])
def test_compiled_model_under_cp(kind: str, cp_pool: DistPool, refs) -> None:
    """``model.compile()`` at cp=2: one process's numbers; the graph breaks are cp's bookkeeping."""
    import cpwork

    parity.once(cp_pool, cpwork.activate, 2, 1)
    results = cpwork.check(cp_pool, models.build("llama", refs.root), cpwork.batch(kind), compile="eager")
    assert results[0]["graph_breaks"], results[0]["graph_breaks"]  # compiled, in pieces (not a silent eager run)


def test_compiled_model_under_ep(ep_pool: DistPool, refs) -> None:
    """``model.compile()`` at ep=2: one process's numbers, and the only graph breaks are the
    experts modules' dispatch (run eagerly: before, dynamo failed inside its variable all-to-all)."""
    import epwork

    parity.once(ep_pool, epwork.activate, ep=2)
    results, _ = epwork.check(ep_pool, models.build("qwen3_moe", refs.root), compile="eager")
    for got in results:
        reasons = {reason.split("\n")[0] for reason in got["graph_breaks"]}
        assert reasons == {"Skip calling `torch.compiler.disable()`d function"}, got["graph_breaks"]


@pytest.mark.parametrize("name", ["llama", "bamba"])
def test_compiled_model_under_sequence_parallel(name: str, sp_pool: DistPool, refs) -> None:
    """Sequence parallel's hooks (the stack's cut and join, the first-call check of each boundary's
    input, Bamba's Mamba2 layer run on the whole sequence) trace into one graph, exact."""
    path, ref = refs(name)
    results = parity.activated(sp_pool, sequence_parallel=True).run(_compiled, path, models.batch(),
                                                                    "torch.compile before the first forward")
    assert [r["graph_breaks"] for r in results] == [0, 0]
    assert max(parity.compare(results[0], ref).values()) <= parity.TOL
