"""A plan that validates must train right: mutants of Plan.auto's own plans (explicit JSON, one
change each) either are refused loudly (PlanError when parsed or sliced, ShardingError when bound)
or match one process exactly (logits, loss, every gradient) at tp=2. None may run wrong, nor fail with
anything but hp_lazy's error on every rank. The mutants and the worker are ``mutate.py``'s: the likely
edits and every single change of every field; ``benchmarks/mutants.py`` runs the latter over more
families and over sequence, context and expert parallel plans.

Each mutant is a fresh activation and a fresh import of the modeling module in the same two
workers (the module is dropped from ``sys.modules`` between mutants).
"""

from __future__ import annotations

import copy
from typing import Any

import models
import mutate
import pytest
from dist import DistPool, pool_fixture
from mutate import mutants

pool2 = pool_fixture(2, timeout=180)

FAMILIES = {"llama_bias": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
            "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM")}


def explicit_plan(family: str) -> dict[str, Any]:
    return mutate.explicit_plan(family, tp=2)


@pytest.mark.parametrize("model", sorted(FAMILIES))
def test_every_mutant_is_refused_or_exact(pool2: DistPool, refs, tmp_path, model: str) -> None:
    family, cls = FAMILIES[model]
    path, ref = refs(model)
    plan = explicit_plan(family)
    found = mutants(plan)  # the likely edits; then every single change of every field (qwen3 adds nothing new)
    found += [] if model == "qwen3" else mutate.exhaustive(plan)
    assert len(found) > 30
    verdicts = {}
    for what, plan in found:
        got = pool2.run(mutate.run, family, cls, plan, path, models.batch(), str(tmp_path / "cache"))
        verdicts[what] = mutate.verdict(got, ref)
    wrong = {what: v for what, v in verdicts.items() if v not in ("refused", "match")}
    assert not wrong, "\n".join(f"{what}: {v}" for what, v in wrong.items())
    counts = {kind: sum(v == kind for v in verdicts.values()) for kind in ("refused", "match")}
    assert counts["refused"] > 10 and counts["match"] > 0, verdicts  # both kinds occur: the test can fail
    print(f"{model}: {len(verdicts)} mutants, {counts['refused']} refused, {counts['match']} exact, 0 wrong")


def _without(plan: dict[str, Any], pattern: str, *, params: tuple[str, ...] = (), fields: tuple[str, ...] = ()) -> dict:
    """``plan`` with ``params`` gone from one contract (and from its optional_params) and ``fields`` dropped:
    mutants that pass the static rules, so that binding has to catch them."""
    mutant = copy.deepcopy(plan)
    body = mutant["boundaries"][pattern]
    for name in params:
        body["params"].pop(name, None)
        body["optional_params"] = [n for n in body.get("optional_params", []) if n != name]
    for field in fields:
        names = body.pop(field, [])
        body["optional_params"] = [n for n in body.get("optional_params", []) if n not in names]
    return mutant


ATTN = "model.layers.*.self_attn"


@pytest.mark.parametrize(("change", "text"), [
    ({"params": ("k_proj.weight", "k_proj.bias")},
     r"model.layers.0.self_attn.k_proj: projects to 32 features \(4 heads or 4 kv heads of 8\) but the plan does "
     r"not shard it"),
    ({"fields": ("deferred_bias_params",)},
     r"model.layers.0.self_attn: o_proj.weight is rowwise \(S\(1\) on tp\) and the module has 'o_proj.bias', which "
     r"the plan does not defer"),
])
def test_refusals_at_bind_name_the_module_and_the_fix(pool2: DistPool, refs, tmp_path, change: dict, text: str) -> None:
    import re

    path, _ = refs("llama_bias")
    plan = _without(explicit_plan("llama"), ATTN, **change)
    got = pool2.run(mutate.run, "llama", "LlamaForCausalLM", plan, path, models.batch(), str(tmp_path / "cache"))
    for result in got:
        assert re.search(text, result.get("refused", "")), result


def test_a_planned_parameter_the_model_lacks_is_refused(pool2: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama_bias")
    plan = dict(mutants(explicit_plan("llama")))[f"{ATTN}: unknown param"]
    got = pool2.run(mutate.run, "llama", "LlamaForCausalLM", plan, path, models.batch(), str(tmp_path / "cache"))
    assert all("the plan shards parameter 'nope' but the module has none" in r.get("refused", "") for r in got), got


EXPERTS = "model.layers.*.mlp.experts"


@pytest.mark.parametrize(("what", "text"), [
    ("region dropped", r"model.layers.(\d).mlp.experts.\w+: the plan cuts this \[num_experts=4, ...\] tensor by "
                       r"expert \(S\(0\) on tp\), but model.layers.\1.mlp.experts has no experts region"),
    ("param down_proj S(0) flipped", r"model.layers.\d.mlp.experts \(Qwen3MoeForCausalLM\): the tp_experts region "
                                     r"splits the experts over tp by expert, but the plan cuts down_proj \(shape "
                                     r"\[4, \d+, \d+\]\) S\(1\) on tp, not on its expert dim \(0, num_experts=4\)"),
    ("skip_source_lowering dropped", r"PlanError: model.layers.\*.mlp.experts.region: kind 'tp_experts' replaces the "
                                     r"module's compute at run time .* add \"skip_source_lowering\": true"),
])
def test_experts_mutants_are_refused_by_name(pool2: DistPool, refs, tmp_path, what: str, text: str) -> None:
    import re

    path, _ = refs("qwen3_moe")
    plan = dict(mutants(explicit_plan("qwen3_moe")))[f"{EXPERTS}: {what}"]
    got = pool2.run(mutate.run, "qwen3_moe", "Qwen3MoeForCausalLM", plan, path, models.batch(), str(tmp_path / "cache"))
    for result in got:
        assert re.search(text, result.get("refused", "")), result


def _shared(plan: dict[str, Any], *others: str) -> dict[str, Any]:
    """``plan`` also naming other modeling modules: contracts that resolve nowhere there are sliced away
    quietly (the plan may serve several families), so a wrong one is only seen at bind."""
    mutant = copy.deepcopy(plan)
    mutant["modules"] += [f"transformers.models.{f}.modeling_{f}" for f in others]
    return mutant


def _renamed(plan: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    mutant = copy.deepcopy(plan)
    mutant["boundaries"][new] = mutant["boundaries"].pop(old)
    mutant["boundary_classes"][new] = mutant["boundary_classes"].pop(old)
    return mutant


@pytest.mark.parametrize(("case", "text"), [
    ("pattern typo", r"LlamaForCausalLM: the plan's boundaries 'model.layer.\*.self_attn' \(no module at a path it "
                     r"matches is a LlamaAttention\) match no module of this model .* so what they plan would run "
                     r"whole on every rank; fix the pattern .* or mark a boundary \"optional\""),
    ("class the model lacks", r"LlamaForCausalLM: the plan's boundaries 'model.layers.\*.self_attn' \(sliced away: "
                              r"no class of \['transformers.models.llama.modeling_llama'\] resolves it, or none is the "
                              r"one its boundary_classes names\) match no module of this model"),
    ("optional", None),
])
def test_a_boundary_that_matches_nothing_is_refused(pool2: DistPool, refs, tmp_path, case: str, text: str | None) -> None:
    import re

    path, ref = refs("llama_bias")
    plan = _shared(explicit_plan("llama"), "mistral")
    if case == "class the model lacks":  # a class of the other family: sliced away in llama's module
        plan["boundary_classes"][ATTN] = "MistralAttention"
    else:
        plan = _renamed(plan, ATTN, "model.layer.*.self_attn")
        plan["boundaries"][ATTN] = copy.deepcopy(plan["boundaries"]["model.layer.*.self_attn"])
        plan["boundary_classes"][ATTN] = plan["boundary_classes"]["model.layer.*.self_attn"]
        if case == "optional":  # a boundary only some of the plan's families have: marked, it may match nothing
            plan["boundaries"]["model.layer.*.self_attn"]["optional"] = True
    got = pool2.run(mutate.run, "llama", "LlamaForCausalLM", plan, path, models.batch(), str(tmp_path / "cache"))
    if text is None:
        assert mutate.verdict(got, ref) == "match", got[0].get("refused") or got[0].get("crashed")
        return
    for result in got:
        assert re.search(text, result.get("refused", "")), result


def test_only_the_head_leaves_its_output_sharded(pool2: DistPool, refs, tmp_path) -> None:
    """Phi-3's fused qkv_proj is a leaf contract; out_dst S(-1) there (allowed on a head, for the
    vocab-parallel loss) left the attention reading a sharded projection: 1.2 off. Refused at bind."""
    path, ref = refs("phi3")
    plan = mutate.explicit_plan("phi3", tp=2)
    qkv = "model.layers.*.self_attn.qkv_proj"
    assert qkv in plan["boundaries"], sorted(plan["boundaries"])
    plan["boundaries"][qkv]["out_dst"] = {"output": {"tp": "S(-1)"}}
    got = pool2.run(mutate.run, "phi3", "Phi3ForCausalLM", plan, path, models.batch(), str(tmp_path / "cache"))
    for result in got:
        assert ("model.layers.0.self_attn.qkv_proj: out_dst['output'] is S(-1) on tp, which keeps this Linear's "
                "output sharded after the boundary, but only the model's head may leave its logits vocab-sharded"
                ) in result.get("refused", ""), result
    head = mutate.explicit_plan("phi3", tp=2)  # the head itself may: the vocab-parallel loss, one process's numbers
    head["boundaries"]["lm_head"]["out_dst"] = {"output": {"tp": "S(-1)"}}
    got = pool2.run(mutate.run, "phi3", "Phi3ForCausalLM", head, path, models.batch(), str(tmp_path / "cache"))
    assert mutate.verdict(got, ref) == "match", got[0].get("refused") or got[0].get("crashed")


def test_halved_gate_up_cut_as_one_block_runs_wrong_so_plan_auto_packs_it(pool2: DistPool, refs, tmp_path) -> None:
    """Negative control for GLM-4's packed MLP: gate_up_proj cut ``S(0)`` (one block: rank 0 all
    gate rows, rank 1 all up rows) instead of ``SS(0,2)`` is a valid plan that trains wrong; Plan.auto's
    own (``SS(0,2)``) matches one process."""
    path, ref = refs("glm4")
    plan = mutate.explicit_plan("glm4", tp=2)
    mlp = plan["boundaries"]["model.layers.*.mlp"]
    assert mlp["params"]["gate_up_proj.weight"] == {"tp": "SS(0,2)"}
    got = pool2.run(mutate.run, "glm4", "Glm4ForCausalLM", plan, path, models.batch(), str(tmp_path / "cache"))
    assert mutate.verdict(got, ref) == "match", got[0].get("refused") or got[0].get("crashed")
    mlp["params"]["gate_up_proj.weight"] = mlp["params"]["gate_up_proj.bias"] = {"tp": "S(0)"}
    got = pool2.run(mutate.run, "glm4", "Glm4ForCausalLM", plan, path, models.batch(), str(tmp_path / "cache2"))
    assert mutate.verdict(got, ref).startswith("wrong"), mutate.verdict(got, ref)
