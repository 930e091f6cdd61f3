"""Data parallel alone (tp=1 at world 4, dp=4): hp_lazy's own bucketed dp average against one
process over the global batch, with gradient accumulation; an MoE's load-balancing aux loss over
the global batch (each rank routes its own rows; transformers' loss on them is the negative
control); and multi-axis parameter layouts (one weight cut on ep and on tp) that round-trip
through full_state_dict."""

from __future__ import annotations

import dpwork
import epwork
import models
import parity
import pytest
import torch
from dist import DistPool, pool_fixture

pool4 = pool_fixture(4, timeout=240)


def test_dp4_own_reduction(pool4: DistPool, refs) -> None:
    parity.activated(pool4, tp=1)
    got = dpwork.check(pool4, refs, "llama", "hp", dp=4)
    assert got[0]["buckets"] == 1  # the whole tiny model fits one 25 MB bucket
    assert [g["backward"] for g in got] == [{"all_reduce": 1}] * 4


def test_dp4_accumulation_adamw(pool4: DistPool, refs) -> None:
    parity.activated(pool4, tp=1)
    dpwork.check(pool4, refs, "qwen3", "hp", dp=4, kind="adamw", micro=2)


def test_dp4_moe_aux_loss_is_global(pool4: DistPool, tmp_path_factory) -> None:
    """``output_router_logits=True`` at dp=4: ``out.aux_loss`` and ``out.loss`` one process's on
    every rank, every gradient and 3 SGD+wd steps (one row per rank, 12 labels each)."""
    parity.activated(pool4, tp=1)
    epwork.check_aux(pool4, models.build("qwen3_moe", str(tmp_path_factory.mktemp("moe"))), epwork.batch(rows=4))


def test_dp4_local_aux_loss_fails_parity(pool4: DistPool, tmp_path_factory) -> None:
    parity.activated(pool4, tp=1)
    path = models.build("qwen3_moe", str(tmp_path_factory.mktemp("moe")))
    got, ref = epwork.local_aux(pool4, path, epwork.batch(rows=4))
    assert models.rel_err(got["aux"], ref["aux"]) > 1e-4
    with pytest.raises(AssertionError, match=r"relative errors above .*'grad model.layers.\d.mlp.gate.weight'"):
        parity.compare(got, ref)


def _multi_axis(rank: int, world: int, placements: dict[str, str]) -> dict:
    from torch import nn

    import hp_lazy.runtime.layout as L
    from hp_lazy.plan.placement import Placement
    from hp_lazy.runtime.mesh import get_mesh
    from hp_lazy.runtime.state import full_state_dict

    mesh = get_mesh({"ep": 2, "tp": 2})  # world 4: dp=2 x tp=2, ep carved out of dp
    groups = {"ep": mesh.group("ep"), "tp": mesh.group("tp")}
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    module = nn.Module()
    module.w = nn.Parameter(full.clone())
    parsed = {axis: Placement.parse(text) for axis, text in placements.items()}
    layout = L.plan_layout("w", (8, 6), parsed, groups)
    L.shard_in_place(module.w, layout)
    table = L.LayoutTable(groups)
    table.add(layout)
    from hp_lazy.names import OWNER
    from hp_lazy.runtime.record import BoundModel

    module.__dict__[OWNER] = BoundModel(mesh=mesh, table=table, roots=())
    return {"local": module.w.detach().clone(), "full": full_state_dict(module)["w"],
            "ranks": (groups["ep"].rank, groups["tp"].rank), "owns": module.w.untyped_storage().nbytes() == module.w.numel() * 4}


@pytest.mark.parametrize("placements,local", [
    ({"ep": "S(0)", "tp": "S(1)"}, lambda f, e, t: f[4 * e: 4 * e + 4, 3 * t: 3 * t + 3]),
    ({"ep": "S(0)", "tp": "S(0)"}, lambda f, e, t: f[4 * e + 2 * t: 4 * e + 2 * t + 2]),
])
def test_parameter_sharded_on_two_axes_round_trips(pool4: DistPool, placements, local) -> None:
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    for got in pool4.run(_multi_axis, placements):
        ep, tp = got["ranks"]
        assert torch.equal(got["local"], local(full, ep, tp)), (placements, got["ranks"])
        assert torch.equal(got["full"], full) and got["owns"]


def _bind_inner_then_outer(rank: int, world: int, path: str) -> None:
    import hp_lazy

    model = parity._load(path)
    hp_lazy.parallelize(model.model)  # the base model alone: it gets the gradient owner
    ids = dpwork.global_batch(4)[:2]
    model(input_ids=ids, labels=ids)  # the outer forward would bind (and own the gradients) again


def test_binding_a_submodule_then_the_model_is_refused(pool4: DistPool, refs) -> None:
    from dist import WorkerError

    parity.activated(pool4, tp=1)
    path, _ = refs("llama")
    with pytest.raises(WorkerError, match=r"LlamaForCausalLM: its submodule 'model' was bound by an earlier "
                                          r"hp_lazy.parallelize call"):
        pool4.run(_bind_inner_then_outer, path)


class _NoWeightGrad(torch.autograd.Function):
    """``hidden * 1`` with ``weight`` an input whose gradient it leaves undefined (``None``), as TRL's
    fused kernels do for a teacher's head."""

    @staticmethod
    def forward(ctx, hidden, weight):
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _undefined_grad(rank: int, world: int, path: str, ids) -> dict:
    import hp_lazy

    model = parity._load(path)
    if world > 1:
        hp_lazy.parallelize(model)  # the backbone runs first: bind the whole model
    rows = ids.shape[0] // world  # this rank's rows (all of them in one process)
    hidden = model.model(input_ids=ids[rank * rows : (rank + 1) * rows]).last_hidden_state
    _NoWeightGrad.apply(hidden, model.lm_head.weight).square().mean().backward()
    grads = hp_lazy.full_grads(model) if world > 1 else {n: p.grad for n, p in model.named_parameters()}
    return {n: g for n, g in grads.items() if g is not None}


def test_a_gradient_left_undefined_by_an_autograd_function(pool4: DistPool, refs) -> None:
    """lm_head.weight reaches the backward only through a Function that leaves its gradient
    undefined: it has none, as in one process, and every other gradient is one process's (hp_lazy's
    bucket asserted on the parameter's missing .grad before)."""
    path, _ = refs("llama")
    ids = dpwork.global_batch(4)
    ref = _undefined_grad(0, 1, path, ids)
    got = parity.activated(pool4, tp=1).run(_undefined_grad, path, ids)[0]
    assert "lm_head.weight" not in ref and set(got) == set(ref), set(got) ^ set(ref)
    errors = {n: models.rel_err(got[n], g) for n, g in ref.items()}
    assert len(errors) > 10 and max(errors.values()) <= parity.TOL, sorted(errors.items(), key=lambda e: -e[1])[:2]


def _backbone_first(rank: int, world: int, path: str, ids) -> dict:
    """A loop that runs the backbone, then the head itself (no parallelize, no Trainer)."""
    import hp_lazy

    model = parity._load(path)
    rows = ids.shape[0] // world  # this rank's rows (all of them in one process)
    hidden = model.model(input_ids=ids[rank * rows : (rank + 1) * rows]).last_hidden_state
    model.lm_head(hidden).square().mean().backward()
    return hp_lazy.full_grads(model) if world > 1 else {n: p.grad for n, p in model.named_parameters()}


def test_a_backbone_run_first_binds_the_whole_model(pool4: DistPool, refs) -> None:
    """The backbone's first forward binds the model it was built in, so the head's gradient is
    averaged over dp too (it was left to each rank: 0.5 off one process, different on every rank)."""
    path, _ = refs("llama")
    ids = dpwork.global_batch(4)
    ref = _backbone_first(0, 1, path, ids)
    got = parity.activated(pool4, tp=1).run(_backbone_first, path, ids)
    for rank in got:
        errors = {n: models.rel_err(rank[n], g) for n, g in ref.items()}
        assert len(errors) > 10 and max(errors.values()) <= parity.TOL, sorted(errors.items(), key=lambda e: -e[1])[:2]
