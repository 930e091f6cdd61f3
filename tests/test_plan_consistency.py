"""The consistency rules a contract must keep (hp_lazy.plan.consistency), each with its text; the
cases are the mutants that once validated and trained wrong."""

from __future__ import annotations

import re
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


# The rules below came from benchmarks/mutants.py (every single change of every field): each case
# validated before and then trained wrong or died in torch with a shape error.
STACK: dict[str, Any] = {"in_src": {"input": R}, "in_dst": {"input": {"tp": "S(1)"}},
                         "out_src": {"output": {"tp": "S(1)"}}, "out_dst": {"output": R}, "grad_sum_params": ["*"]}
IN_STACK = {**ATTN, "in_src": {"hidden_states": {"tp": "S(1)"}}, "out_dst": {"output": {"tp": "S(1)"}}}
HEAD: dict[str, Any] = {"in_src": {"input": R}, "in_dst": {"input": R}, "out_src": {"output": {"tp": "S(-1)"}},
                        "out_dst": {"output": R}, "params": {"weight": {"tp": "S(0)"}}}


@pytest.mark.parametrize(("pattern", "body", "cls", "text"), [
    ("model.layers.*.self_attn", {**ATTN, "in_dst": {"hidden_states": {"tp": "S(0)"}}}, "Attention",
     r"model.layers.\*.self_attn: in_dst\['hidden_states'\] is S\(0\) on tp, but its body computes with parameters "
     r"sharded on that axis from whole values; set in_dst\['hidden_states'\] to 'R' on tp"),
    ("lm_head", {**HEAD, "in_dst": {"input": {"tp": "S(-1)"}}}, "torch.nn.Linear",
     r"lm_head: in_dst\['input'\] is S\(-1\) on tp, but its body computes"),
    ("o_proj", {"in_src": {"input": R}, "in_dst": {"input": R}, "out_src": {"output": P}, "out_dst": {"output": R},
                "params": {"weight": {"tp": "S(1)"}}}, "torch.nn.Linear",
     r"o_proj: in_dst\['input'\] is R on tp, but a rowwise Linear \(weight cut on its input features\) multiplies "
     r"this rank's columns of the input; set in_dst\['input'\] to 'S\(-1\)' on tp"),
])
def test_sharded_parameters_take_whole_inputs(pattern: str, body: dict, cls: str, text: str) -> None:
    """in_dst S(0) on attention validated and trained 1.5 off; the other cuts died in torch's matmul."""
    with pytest.raises(PlanError, match=text):
        check(pattern, body, cls)


def test_a_shard_leaves_on_the_last_dim_only() -> None:
    """A colwise head declared S(0) or S(1) on exit gave logits of the wrong shape, silently."""
    for dim in ("S(0)", "S(1)"):
        with pytest.raises(PlanError, match=rf"lm_head: out_src\['output'\] is {re.escape(dim)} on tp, but a "
                                            r"computation on shards of the parameters yields shards of the output's "
                                            r"last dim \(features\), never of another; set it to 'S\(-1\)'"):
            check("lm_head", {**HEAD, "out_src": {"output": {"tp": dim}}}, "torch.nn.Linear")


def test_a_subclass_of_embedding_keeps_the_embedding_rules() -> None:
    """Gemma's scaled word embedding: slicing passes the torch class it derives from."""
    from hp_lazy import Plan

    source = ("import torch\nfrom torch import nn\nclass Scaled(nn.Embedding):\n    pass\n"
              "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
              "        self.embed = Scaled(8, 4)\n    def forward(self, x):\n        return self.embed(x)\n")
    plan = Plan.from_dict({"version": 1, "mesh": MESH, "modules": ["pkg.mod"],
                           "boundaries": {"embed": {**EMBED, "out_src": {"output": {"tp": "S(-1)"}}}}})
    with pytest.raises(PlanError, match=r"embed: a Embedding with its weight S\(0\) on tp produces P\(sum\)"):
        plan.slice("pkg.mod", source)


def test_parameters_are_never_partial_and_colwise_biases_follow() -> None:
    with pytest.raises(PlanError, match=r"params\['q_proj.weight'\] is P\(sum\) on tp, but a parameter is stored "
                                        r"whole or cut, never as a partial sum"):
        check("model.layers.*.self_attn", {**ATTN, "params": {**ATTN["params"], "q_proj.weight": P}})
    with pytest.raises(PlanError, match=r"q_proj.weight is S\(0\) on tp \(colwise\) but q_proj.bias is R; a colwise "
                                        r"Linear's bias is cut with its output features: plan q_proj.bias as 'S\(0\)'"):
        check("model.layers.*.self_attn", {**ATTN, "params": {**ATTN["params"], "q_proj.bias": R}})


@pytest.mark.parametrize(("change", "text"), [
    ({"in_src": {"input": P}}, r"model.layers: in_src\['input'\] is P\(sum\) on tp, a partial sum crossing"),
    ({"in_src": {"input": {"tp": "S(1)"}}},
     r"model.layers: in_src\['input'\] is S\(1\) on tp, but the layer stack scatters the sequence itself: the value "
     r"arriving is whole on every rank; set in_src\['input'\] to 'R' on tp"),
    ({"out_dst": {"output": {"tp": "S(1)"}}}, r"model.layers: out_dst\['output'\] is S\(1\) on tp, .* the value leaving"),
    ({"grad_sum_params": []}, r"model.layers: the stack shards the sequence on tp, so every replicated parameter "
                              r"inside it \(the norms\) sees only this rank's tokens .* set grad_sum_params to \['\*'\]"),
])
def test_the_sequence_parallel_stack_takes_and_gives_whole_values(change: dict, text: str) -> None:
    """P(sum) into the stack trained 0.94 off; grad_sum_params dropped, 1.02 off."""
    with pytest.raises(PlanError, match=text):
        check("model.layers.*.self_attn", IN_STACK, extra=(("model.layers", {**STACK, **change}, "torch.nn.ModuleList"),))


@pytest.mark.parametrize(("change", "text"), [
    ({"out_dst": {"output": R}}, r"model.layers.\*.self_attn: out_dst\['output'\] is R on tp, but the stack around "
                                 r"it holds the sequence as S\(1\) there; set out_dst\['output'\] to 'S\(1\)' on tp"),
    ({"in_src": {"hidden_states": R}}, r"model.layers.\*.self_attn: in_src declares hidden_states: R on tp, but the "
                                       r"stack around it holds the sequence as S\(1\) there"),
])
def test_a_boundary_inside_the_stack_takes_and_gives_its_shard(change: dict, text: str) -> None:
    with pytest.raises(PlanError, match=text):
        check("model.layers.*.self_attn", {**IN_STACK, **change}, extra=(("model.layers", STACK, "torch.nn.ModuleList"),))


def test_context_parallel_places_nothing_on_cp() -> None:
    mesh = {"cp": 2}
    body = {"out_src": {"output": {"cp": "S(1)"}}, "inner": {"call": "attention", "kind": "cp_allgather_kv"}}
    with pytest.raises(PlanError, match=r"model.layers.\*.self_attn: out_src\['output'\] is S\(1\) on cp, but context "
                                        r"parallel splits the sequence once at the model's entry"):
        check_plan([(contract_from_dict("model.layers.*.self_attn", body, mesh), "Attention")], mesh)


def test_tp_experts_leave_a_partial_sum() -> None:
    body = {"in_src": {"hidden_states": R}, "in_dst": {"hidden_states": R}, "out_src": {"output": {"tp": "S(-1)"}},
            "out_dst": {"output": R}, "params": {"down_proj": {"tp": "S(0)"}}, "region": {"kind": "tp_experts"},
            "skip_source_lowering": True}
    with pytest.raises(PlanError, match=r"experts: out_src\['output'\] is S\(-1\) on tp, but the tp_experts region "
                                        r"runs each rank's experts on every token"):
        check("experts", body, "Experts")


def test_a_class_lowered_for_one_boundary_is_not_bound_at_run_time_for_another() -> None:
    """DeepSeek-V2's MLP class serves the dense layers' mlp and the MoE layers' shared_experts:
    marking one skip_source_lowering applied its entry and exit twice (0.98 off)."""
    from hp_lazy import Plan

    source = ("from torch import nn\nclass MLP(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
              "        self.up = nn.Linear(4, 8)\n        self.down = nn.Linear(8, 4)\n"
              "    def forward(self, x):\n        return self.down(self.up(x))\n"
              "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
              "        self.mlp = MLP()\n        self.shared = MLP()\n    def forward(self, x):\n"
              "        return self.mlp(x) + self.shared(x)\n")
    body = {"in_src": {"x": R}, "in_dst": {"x": R}, "out_src": {"output": P}, "out_dst": {"output": R},
            "params": {"up.weight": {"tp": "S(0)"}, "down.weight": {"tp": "S(1)"}}}
    plan = Plan.from_dict({"version": 1, "mesh": MESH, "modules": ["pkg.mod"],
                           "boundaries": {"mlp": body, "shared": {**body, "skip_source_lowering": True}}})
    with pytest.raises(PlanError, match=r"pkg.mod: boundary 'shared' binds class 'MLP' at run time "
                                        r"\(skip_source_lowering\), but 'mlp' rewrites that class's forward from source, "
                                        r"which would apply the entry and exit ops a second time"):
        plan.slice("pkg.mod", source)


S1 = {"tp": "S(1)"}
WHOLE: dict[str, Any] = {"in_src": {"hidden_states": S1}, "in_dst": {"hidden_states": R},
                         "out_src": {"output": S1}, "out_dst": {"output": S1}}
QKV: dict[str, Any] = {"in_src": {"input": R}, "in_dst": {"input": R}, "out_src": {"output": {"tp": "S(-1)"}},
                       "out_dst": {"output": R}, "params": {"weight": {"tp": "S(0)"}}}
O_PROJ: dict[str, Any] = {"in_src": {"input": R}, "in_dst": {"input": {"tp": "S(-1)"}}, "out_src": {"output": P},
                          "out_dst": {"output": S1}, "params": {"weight": {"tp": "S(1)"}}}


def check_whole(region: dict, qkv: dict = QKV, o_proj: dict = O_PROJ) -> None:
    """Phi-3's attention under sequence parallel: run on the whole sequence, its leaves inside."""
    check("model.layers.*.self_attn", region, extra=(
        ("model.layers", STACK, "torch.nn.ModuleList"),
        ("model.layers.*.self_attn.qkv_proj", qkv, "torch.nn.Linear"),
        ("model.layers.*.self_attn.o_proj", o_proj, "torch.nn.Linear"),
    ))


def test_a_module_run_whole_inside_the_stack_passes() -> None:
    check_whole(WHOLE)
    check_whole({**WHOLE, "out_src": {"output": R}}, o_proj={**O_PROJ, "out_dst": {"output": R}})  # cut at its exit


@pytest.mark.parametrize(("region", "qkv", "o_proj", "text"), [
    ({**WHOLE, "out_dst": {"output": R}}, QKV, O_PROJ,
     r"model.layers.\*.self_attn: out_dst\['output'\] is R on tp, but this module runs on the whole sequence inside "
     r"the stack 'model.layers', whose code after it holds the sequence as S\(1\); set out_dst\['output'\] to 'S\(1\)'"),
    ({**WHOLE, "out_src": {"output": R}}, QKV, O_PROJ,
     r"model.layers.\*.self_attn: out_src\['output'\] is R on tp while \['model.layers.\*.self_attn.o_proj'\] inside "
     r"it leave\(s\) as S\(1\); a module run on the whole sequence returns whole values"),
    (WHOLE, QKV, {**O_PROJ, "out_dst": {"output": R}},
     r"model.layers.\*.self_attn: out_src\['output'\] is S\(1\) on tp while no contract inside it leave\(s\) as S\(1\)"),
    (WHOLE, {**QKV, "out_dst": {"output": S1}}, O_PROJ,
     r"model.layers.\*.self_attn: out_src\['output'\] is S\(1\) on tp while \['model.layers.\*.self_attn.qkv_proj', "
     r"'model.layers.\*.self_attn.o_proj'\] inside it leave\(s\) as S\(1\)"),
    (WHOLE, {**QKV, "in_src": {"input": S1}}, O_PROJ,
     r"model.layers.\*.self_attn.qkv_proj: in_src\['input'\] is S\(1\) on tp, but 'model.layers.\*.self_attn' around it "
     r"gathers the sequence and runs on whole values; set in_src\['input'\] to 'R' on tp"),
])
def test_a_module_run_whole_hands_over_one_piece(region: dict, qkv: dict, o_proj: dict, text: str) -> None:
    """Each case validated before these rules (benchmarks/mutants.py, phi3.tp2_sp and qwen3_next.tp2_sp)."""
    with pytest.raises(PlanError, match=text):
        check_whole(region, qkv, o_proj)


def test_experts_inside_the_stack_take_every_input_as_rows() -> None:
    """Top-k ids declared whole beside rows cut over tp died in torch's indexing (the mutant sweep's
    qwen3_next.tp2_sp), before this rule."""
    rows = {"tp": "S(0)"}
    names = ("hidden_states", "top_k_index", "top_k_weights")
    experts = {"in_src": {n: rows for n in names}, "in_dst": {n: R for n in names},
               "out_src": {"output": P}, "out_dst": {"output": rows},
               "params": {"gate_up_proj": {"tp": "S(0)"}, "down_proj": {"tp": "S(0)"}},
               "skip_source_lowering": True, "region": {"kind": "tp_experts"}}
    stack = (("model.layers", STACK, "torch.nn.ModuleList"),)
    check("model.layers.*.mlp.experts", experts, "Experts", stack)
    with pytest.raises(PlanError, match=r"model.layers.\*.mlp.experts: in_src\['top_k_index'\] is R on tp, but experts "
                                        r"split by expert over tp inside the stack 'model.layers' take every input per "
                                        r"row, as this rank's rows \(S\(0\)\)"):
        check("model.layers.*.mlp.experts", {**experts, "in_src": {**experts["in_src"], "top_k_index": R}}, "Experts",
              stack)
