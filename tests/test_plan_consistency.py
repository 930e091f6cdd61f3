"""The consistency rules a contract must keep (hp_lazy.plan.consistency), each with its text; the
cases are the mutants that once validated and trained wrong."""

from __future__ import annotations

from typing import Any

import pytest

from hp_lazy.errors import PlanError
from hp_lazy.plan.consistency import check_plan
from hp_lazy.plan.parse import contract_from_dict

R, P = {"tp": "R"}, {"tp": "P(sum)"}
MESH = {"tp": 2}
ATTN: dict[str, Any] = {
    "in_src": {"hidden_states": R}, "in_dst": {"hidden_states": R},
    "out_src": {"output": P}, "out_dst": {"output": R},
    "params": {"q_proj.weight": {"tp": "S(0)"}, "q_proj.bias": {"tp": "S(0)"}, "o_proj.weight": {"tp": "S(1)"}},
    "deferred_bias_params": ["o_proj.bias"], "optional_params": ["q_proj.bias", "o_proj.bias"],
}
EMBED: dict[str, Any] = {
    "in_src": {"input": R}, "in_dst": {"input": R}, "out_src": {"output": P}, "out_dst": {"output": R},
    "params": {"weight": {"tp": "S(0)"}},
}


def check(pattern: str, body: dict[str, Any], cls: str = "Attention", extra: tuple = ()) -> None:
    contracts = [(contract_from_dict(pattern, body, MESH), cls)]
    contracts += [(contract_from_dict(p, b, MESH), c) for p, b, c in extra]
    check_plan(contracts, MESH)


def without(body: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in keys}


def test_the_auto_shapes_pass() -> None:
    check("model.layers.*.self_attn", ATTN)
    check("model.embed_tokens", EMBED, "torch.nn.Embedding")


def test_inputs_dropped_is_refused() -> None:
    with pytest.raises(PlanError, match=r"model.layers.\*.self_attn: the contract shards parameters on tp but declares "
                                        r"no input, so the gradient of its input would stay a partial sum over tp"):
        check("model.layers.*.self_attn", without(ATTN, "in_src", "in_dst"))


def test_replicated_output_of_sharded_compute_is_refused() -> None:
    with pytest.raises(PlanError, match=r"the contract shards parameters on tp but its output leaves as R on tp"):
        check("model.layers.*.self_attn", without(ATTN, "out_src"))


def test_embedding_without_partial_output_is_refused() -> None:
    body = {**EMBED, "out_src": {"output": {"tp": "S(-1)"}}}
    with pytest.raises(PlanError, match=r"model.embed_tokens: a Embedding with its weight S\(0\) on tp produces P\(sum\) "
                                        r"\(vocab rows\), but out_src\['output'\] says S\(-1\)"):
        check("model.embed_tokens", body, "torch.nn.Embedding")


def test_rowwise_leaf_without_partial_output_is_refused() -> None:
    body = {"in_src": {"input": R}, "in_dst": {"input": {"tp": "S(-1)"}}, "out_src": {"output": {"tp": "S(-1)"}},
            "params": {"weight": {"tp": "S(1)"}}}
    with pytest.raises(PlanError, match=r"down_proj: a Linear with its weight S\(1\) on tp produces P\(sum\) \(rowwise\)"):
        check("down_proj", body, "torch.nn.Linear")


def test_partial_output_without_sharded_params_is_refused() -> None:
    with pytest.raises(PlanError, match=r"model.embed_tokens: the output is declared P\(sum\) on tp, but the contract "
                                        r"shards no parameter on tp"):
        check("model.embed_tokens", without(EMBED, "params"), "torch.nn.Embedding")


def test_a_bias_cut_without_its_weight_is_refused() -> None:
    body = {**ATTN, "params": {k: v for k, v in ATTN["params"].items() if k != "q_proj.weight"}}
    with pytest.raises(PlanError, match=r"q_proj.bias is S\(0\) on tp but its weight q_proj.weight is not planned"):
        check("model.layers.*.self_attn", body)


def test_optional_names_must_be_planned() -> None:
    with pytest.raises(PlanError, match=r"optional_params names 'k_proj.bias', which is neither in params nor in "
                                        r"deferred_bias_params"):
        check("model.layers.*.self_attn", {**ATTN, "optional_params": ["k_proj.bias"]})


def test_sequence_shards_outside_a_stack_are_refused() -> None:
    body = {**ATTN, "out_dst": {"output": {"tp": "S(1)"}}}
    with pytest.raises(PlanError, match=r"model.layers.\*.self_attn: out_dst\['output'\] is S\(1\) on tp, but no "
                                        r"contract around it scatters and gathers that dim"):
        check("model.layers.*.self_attn", body)
    stack = {"in_src": {"input": R}, "in_dst": {"input": {"tp": "S(1)"}}, "out_src": {"output": {"tp": "S(1)"}},
             "out_dst": {"output": R}, "grad_sum_params": ["*"]}
    inside = {**body, "in_src": {"hidden_states": {"tp": "S(1)"}}}
    check("model.layers.*.self_attn", inside, extra=(("model.layers", stack, "torch.nn.ModuleList"),))


def test_a_vocab_sharded_head_may_leave_sharded() -> None:
    head = {"in_src": {"input": R}, "in_dst": {"input": R}, "out_src": {"output": {"tp": "S(-1)"}},
            "out_dst": {"output": {"tp": "S(-1)"}}, "params": {"weight": {"tp": "S(0)"}}}
    check("lm_head", head, "torch.nn.Linear")


@pytest.mark.parametrize("where", ["injections", "boundary"])
def test_a_plan_never_names_code(where: str) -> None:
    """Plans are data: a dotted path to a function (what ``injections[].local_compute_fn`` once
    imported and called at bind time) is refused, and nothing is imported."""
    import sys

    from hp_lazy import Plan

    target = "hp_lazy_never_imported_module.run"
    data: dict[str, Any] = {"version": 1, "mesh": MESH, "modules": ["pkg.mod"], "boundaries": {"attn": dict(ATTN)}}
    if where == "injections":
        data["injections"] = [{"match": "attn", "local_compute_fn": target}]
    else:
        data["boundaries"]["attn"]["local_compute_fn"] = target
    with pytest.raises(PlanError, match=r"injections|unknown key 'local_compute_fn'"):
        Plan.from_dict(data)
    assert "hp_lazy_never_imported_module" not in sys.modules


def test_a_partial_sum_leaving_a_boundary_is_refused() -> None:
    """The exit all-reduce dropped (out_dst P(sum)): validated, bound and run before, 0.5 off."""
    body = {**ATTN, "out_dst": {"output": P}}
    with pytest.raises(PlanError) as info:
        check("model.layers.*.self_attn", body)
    assert str(info.value) == (
        "model.layers.*.self_attn: out_dst['output'] is P(sum) on tp, a partial sum crossing the boundary: the output "
        "would leave each rank holding its part while the code after it reads a whole value; set out_dst['output'] "
        "to 'R' on tp (an all-reduce at the exit), or to the sequence shard 'S(1)' inside a sequence-parallel layer "
        "stack (a reduce-scatter)")
    embed = {**EMBED, "out_dst": {"output": P}}
    with pytest.raises(PlanError, match=r"^model.embed_tokens: out_dst\['output'\] is P\(sum\) on tp"):
        check("model.embed_tokens", embed, "torch.nn.Embedding")


def test_a_partial_sum_declared_on_entry_is_refused() -> None:
    """Into sharded parameters the entry check refuses it; into a boundary that shards nothing (where
    P(sum) -> R would be an all-reduce), the crossing check: nothing before a boundary makes one."""
    with pytest.raises(PlanError, match=r"P\(sum\) -> R into sharded params has no collective"):
        check("model.layers.*.self_attn", {**ATTN, "in_src": {"hidden_states": P}})
    body = {"in_src": {"hidden_states": P}, "in_dst": {"hidden_states": R}}
    with pytest.raises(PlanError) as info:
        check("model.norm", body, "Norm")
    assert str(info.value) == (
        "model.norm: in_src['hidden_states'] is P(sum) on tp, a partial sum crossing the boundary: "
        "every value reaches a boundary whole or sharded, and the entry would sum it over the ranks; declare "
        "in_src['hidden_states'] as what arrives, 'R' on tp (or the stack's sequence shard)")
