"""A plan that validates must train right: mutants of Plan.auto's own plans (explicit JSON, one
change each) either are refused loudly (PlanError when parsed or sliced, ShardingError when bound)
or match one process exactly (logits, loss, every gradient) at tp=2. None may run wrong.

Each mutant is a fresh activation and a fresh import of the modeling module in the same two
workers (the module is dropped from ``sys.modules`` between mutants).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=180)

FAMILIES = {"llama_bias": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
            "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM")}


def explicit_plan(family: str) -> dict[str, Any]:
    """Plan.auto(tp=2)'s slice of ``transformers.models.<family>.modeling_<family>`` as a JSON plan."""
    import importlib

    from hp_lazy import Plan

    name = f"transformers.models.{family}.modeling_{family}"
    source = inspect.getsource(importlib.import_module(name))
    sliced = Plan.auto(tp=2).slice(name, source)
    assert sliced is not None
    return {
        "version": 1, "mesh": {"tp": 2}, "modules": [name],
        "boundaries": {c.pattern: c.to_dict() for c in sliced.contracts},
        "boundary_classes": dict(sliced.classes),
    }


def _flip(placement: str) -> str:
    return {"S(0)": "S(1)", "S(1)": "S(0)", "S(-1)": "S(0)"}.get(placement, "S(0)")


def mutants(plan: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(what changed, the mutant) for every single change of every contract."""
    out: list[tuple[str, dict[str, Any]]] = []

    def add(what: str, change) -> None:
        mutant = copy.deepcopy(plan)
        change(mutant)
        out.append((what, mutant))

    for pattern, body in plan["boundaries"].items():
        def at(m, pattern=pattern):
            return m["boundaries"][pattern]

        add(f"{pattern}: contract dropped", lambda m, p=pattern: m["boundaries"].pop(p))
        for side in ("in_src", "in_dst", "out_src", "out_dst"):
            if side in body:
                add(f"{pattern}: {side} dropped", lambda m, s=side, at=at: at(m).pop(s))
        if "in_src" in body:
            add(f"{pattern}: in_src and in_dst dropped", lambda m, at=at: (at(m).pop("in_src"), at(m).pop("in_dst", None)))
        if "out_src" in body:
            add(f"{pattern}: out_src R", lambda m, at=at: at(m)["out_src"].update(output={"tp": "R"}))
        if "out_dst" in body:
            add(f"{pattern}: out_dst S(1)", lambda m, at=at: at(m)["out_dst"].update(output={"tp": "S(1)"}))
        # a partial sum leaving the boundary (the exit all-reduce dropped), or one declared on entry
        add(f"{pattern}: out_dst P(sum)", lambda m, at=at: at(m).setdefault("out_dst", {}).update(output={"tp": "P(sum)"}))
        for name in body.get("in_src", {}):
            add(f"{pattern}: in_src {name} P(sum)", lambda m, n=name, at=at: at(m)["in_src"].update({n: {"tp": "P(sum)"}}))
        if body.get("skip_source_lowering"):
            add(f"{pattern}: skip_source_lowering dropped", lambda m, at=at: at(m).pop("skip_source_lowering"))
        if "region" in body:
            add(f"{pattern}: region dropped", lambda m, at=at: at(m).pop("region"))
        for field in ("deferred_bias_params", "grad_sum_params", "optional_params"):
            if field in body:
                add(f"{pattern}: {field} dropped", lambda m, f=field, at=at: at(m).pop(f))
        for name, spec in body.get("params", {}).items():
            add(f"{pattern}: param {name} dropped", lambda m, n=name, at=at: at(m)["params"].pop(n))
            add(f"{pattern}: param {name} {spec['tp']} flipped",
                lambda m, n=name, at=at: at(m)["params"][n].update(tp=_flip(at(m)["params"][n]["tp"])))
            if name.endswith("weight"):
                renamed = name[: -len("weight")] + "bias"
                add(f"{pattern}: param {name} renamed {renamed}",
                    lambda m, n=name, r=renamed, at=at: at(m)["params"].update({r: at(m)["params"].pop(n)}))
        add(f"{pattern}: unknown param", lambda m, at=at: at(m).setdefault("params", {}).update(nope={"tp": "S(0)"}))
    return out


def _run(rank: int, world: int, family: str, cls: str, plan: dict[str, Any], path: str, ids, cache: str) -> dict:
    import importlib
    import sys

    import hp_lazy
    from hp_lazy.errors import HpLazyError

    name = f"transformers.models.{family}.modeling_{family}"
    hp_lazy.deactivate()
    sys.modules.pop(name, None)
    try:
        hp_lazy.activate(plan, cache_dir=cache)
        model_cls = getattr(importlib.import_module(name), cls)
        model = model_cls.from_pretrained(path)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    except HpLazyError as error:
        return {"refused": f"{type(error).__name__}: {error}"}
    except Exception as error:  # noqa: BLE001 - reported as a defect of hp_lazy by the test
        return {"crashed": f"{type(error).__name__}: {str(error)[:160]}"}
    finally:
        hp_lazy.deactivate()
        sys.modules.pop(name, None)
    result = {"loss": out.loss.detach(), "logits": out.logits.detach()}
    grads = hp_lazy.full_grads(model)
    return {**result, "grads": grads} if rank == 0 else result


def _verdict(got: dict, ref: dict) -> str:
    if "refused" in got[0]:
        return "refused"
    if "crashed" in got[0]:
        return f"wrong: not an hp_lazy error: {got[0]['crashed']}"
    errors = [models.rel_err(got[0]["logits"], ref["logits"]), models.rel_err(got[0]["loss"], ref["loss"])]
    if set(got[0]["grads"]) != set(ref["grads"]):
        return "wrong: gradients of other parameters"
    errors += [models.rel_err(got[0]["grads"][n], g) for n, g in ref["grads"].items()]
    return "match" if max(errors) <= parity.TOL else f"wrong: max rel error {max(errors):.2e}"


@pytest.mark.parametrize("model", sorted(FAMILIES))
def test_every_mutant_is_refused_or_exact(pool2: DistPool, refs, tmp_path, model: str) -> None:
    family, cls = FAMILIES[model]
    path, ref = refs(model)
    found = mutants(explicit_plan(family))
    assert len(found) > 30
    verdicts = {}
    for what, plan in found:
        got = pool2.run(_run, family, cls, plan, path, models.batch(), str(tmp_path / "cache"))
        assert ("refused" in got[0]) == ("refused" in got[1]), (what, got[0].get("refused"), got[1].get("refused"))
        verdicts[what] = _verdict(got, ref)
    wrong = {what: v for what, v in verdicts.items() if v.startswith("wrong")}
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
    got = pool2.run(_run, "llama", "LlamaForCausalLM", plan, path, models.batch(), str(tmp_path / "cache"))
    for result in got:
        assert re.search(text, result.get("refused", "")), result


def test_a_planned_parameter_the_model_lacks_is_refused(pool2: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama_bias")
    plan = dict(mutants(explicit_plan("llama")))[f"{ATTN}: unknown param"]
    got = pool2.run(_run, "llama", "LlamaForCausalLM", plan, path, models.batch(), str(tmp_path / "cache"))
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
    got = pool2.run(_run, "qwen3_moe", "Qwen3MoeForCausalLM", plan, path, models.batch(), str(tmp_path / "cache"))
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
    got = pool2.run(_run, "llama", "LlamaForCausalLM", plan, path, models.batch(), str(tmp_path / "cache"))
    if text is None:
        assert _verdict(got, ref) == "match", got[0].get("refused") or got[0].get("crashed")
        return
    for result in got:
        assert re.search(text, result.get("refused", "")), result
