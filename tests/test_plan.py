"""Plan JSON: round trips, canonical hashing, and the text of every validation error."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hp_lazy.errors import PlanError
from hp_lazy.plan import AutoFlags, InnerOp, Plan, Region, Shard
from hp_lazy.plan import model as plan_model

ATTN = "model.layers.*.self_attn"


def llama_plan() -> dict:
    return {
        "version": 1,
        "mesh": {"tp": 2},
        "modules": ["transformers.models.llama.modeling_llama"],
        "boundaries": {
            ATTN: {
                "in_src": {"hidden_states": {"tp": "R"}},
                "in_dst": {"hidden_states": {"tp": "R"}},
                "out_src": {"output": {"tp": "P(sum)"}},
                "out_dst": {"output": {"tp": "R"}},
                "params": {"q_proj.weight": {"tp": "S(0)"}, "o_proj.weight": {"tp": "S(1)"}},
                "deferred_bias_params": ["o_proj.bias"],
            },
            "lm_head": {
                "out_src": {"output": {"tp": "S(-1)"}},
                "out_dst": {"output.1": {"tp": "R"}},
                "params": {"weight": {"tp": " S(0) "}, "gate_up_proj.weight": {"tp": "SS(0, 2)"}},
                "grad_sum_params": ["q_norm.*"],
                "skip_source_lowering": True,
            },
        },
        "boundary_classes": {ATTN: "LlamaAttention"},
    }


def error_text(data: dict) -> str:
    with pytest.raises(PlanError) as info:
        Plan.from_dict(data)
    return str(info.value)


def test_from_dict_builds_contracts_with_parsed_placements() -> None:
    plan = Plan.from_dict(llama_plan())
    attn = next(c for c in plan.boundaries if c.pattern == ATTN)
    assert attn.placement("params", "o_proj.weight", "tp") == Shard(1)
    assert attn.placement("out_src", "output", "tp").is_partial
    assert attn.placement("params", "k_proj.weight", "tp").is_replicate  # absent -> R
    assert attn.deferred_bias_params == ("o_proj.bias",)
    assert plan.mesh == {"tp": 2} and plan.auto_flags is None
    assert plan.boundary_classes == {ATTN: "LlamaAttention"}
    assert attn.inner is None and attn.region is None


def test_round_trip_normalises_placement_text() -> None:
    plan = Plan.from_dict(llama_plan())
    data = plan.to_dict()
    assert data["boundaries"]["lm_head"]["params"] == {
        "weight": {"tp": "S(0)"},
        "gate_up_proj.weight": {"tp": "SS(0,2)"},
    }
    assert Plan.from_dict(data) == plan
    assert Plan.from_dict(data).to_dict() == data
    assert Plan.from_json(plan.to_json()) == plan


def test_from_json_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(llama_plan(), indent=2))
    assert Plan.from_json(path) == Plan.from_json(str(path)) == Plan.from_dict(llama_plan())


def test_from_json_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"invalid JSON at line 1 column 2"):
        Plan.from_json("{oops}")
    with pytest.raises(PlanError, match=r"^plan file '.*missing.json': cannot be read \(No such file or directory\)"):
        Plan.from_json(tmp_path / "missing.json")


def test_hash_is_canonical_sha256() -> None:
    plan = Plan.from_dict(llama_plan())
    assert len(plan.hash) == 64 and int(plan.hash, 16) >= 0
    reordered = json.loads(json.dumps(llama_plan()), object_pairs_hook=lambda pairs: dict(reversed(pairs)))
    assert list(reordered) != list(llama_plan())
    assert Plan.from_dict(reordered).hash == plan.hash
    assert plan.to_json() == json.dumps(plan.to_dict(), sort_keys=True, separators=(",", ":"))


def test_hash_changes_with_content_and_normalised_spelling_does_not() -> None:
    base = Plan.from_dict(llama_plan()).hash
    changed = llama_plan()
    changed["boundaries"][ATTN]["params"]["q_proj.weight"] = {"tp": "S(1)"}
    assert Plan.from_dict(changed).hash != base
    spaced = llama_plan()
    spaced["boundaries"]["lm_head"]["params"]["weight"] = {"tp": "S(0)"}
    assert Plan.from_dict(spaced).hash == base


def test_auto_plan_fields_and_round_trip() -> None:
    plan = Plan.auto(tp=4, sequence_parallel=True)
    assert plan.mesh == {"tp": 4}
    assert plan.modules == ("transformers.models.*.modeling_*",)
    assert plan.auto_flags == AutoFlags(tp=4, sequence_parallel=True, loss_parallel=False, vocab_parallel_embedding=True)
    assert plan.to_dict()["auto"] == {
        "tp": 4, "sequence_parallel": True, "loss_parallel": False, "vocab_parallel_embedding": True
    }
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.hash != Plan.auto(tp=4).hash
    assert plan.targets("transformers.models.llama.modeling_llama")
    assert not plan.targets("transformers.models.llama.configuration_llama")


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d.update(extra=1), "plan: unknown key 'extra'; allowed keys are ['version', 'mesh'"),
        (lambda d: d.update(version=2), "plan.version: 2 is not a supported version; use 1"),
        (lambda d: d["boundaries"][ATTN].update(inputs={}), f"plan.boundaries['{ATTN}']: unknown key 'inputs'"),
        (lambda d: d.update(mesh={"xp": 2}), "plan.mesh: axis 'xp' is not one of ['dp', 'cp', 'ep', 'tp']; rename it"),
        (lambda d: d.update(mesh={"tp": 0}), "plan.mesh['tp']: degree 0 is not a positive integer; use e.g. 2"),
        (lambda d: d.update(mesh={"tp": True}), "plan.mesh['tp']: degree True is not a positive integer"),
        (lambda d: d.update(mesh={}), "plan.mesh: {} is not a non-empty object"),
        (lambda d: d.update(modules=[]), "plan.modules: [] is not a non-empty list of module names"),
        (
            lambda d: d["boundaries"][ATTN]["params"].update({"v_proj.weight": {"tp": "Q(0)"}}),
            f"plan.boundaries['{ATTN}'].params['v_proj.weight']['tp']: placement 'Q(0)' is not one of",
        ),
        (
            lambda d: d["boundaries"][ATTN]["in_src"].update(x={"cp": "R"}),
            f"plan.boundaries['{ATTN}'].in_src['x']: axis 'cp' is not in the mesh ['tp']; add it to plan.mesh",
        ),
        (
            lambda d: d["boundaries"][ATTN]["out_src"].update(result={"tp": "R"}),
            "output key 'result' is not 'output' or 'output.<i>'",
        ),
        (
            lambda d: d["boundaries"][ATTN].update(deferred_bias_params=["o_proj.weight"]),
            f"plan.boundaries['{ATTN}'].deferred_bias_params: 'o_proj.weight' does not end in '.bias'",
        ),
        (
            lambda d: d["boundaries"][ATTN].update(deferred_bias_params=["q_proj.bias"]),
            "'q_proj.bias' needs its sibling 'q_proj.weight' sharded rowwise (S(1) or S(-1)) in params, "
            "found {tp: S(0)}; add \"q_proj.weight\": {\"tp\": \"S(1)\"}",
        ),
        (
            lambda d: d["boundaries"][ATTN].update(deferred_bias_params=["down_proj.bias"]),
            "'down_proj.bias' needs its sibling 'down_proj.weight' sharded rowwise (S(1) or S(-1)) in params, "
            "found nothing",
        ),
        (
            lambda d: d["boundaries"][ATTN]["params"].update({"_hp_cache.weight": {"tp": "R"}}),
            "param '_hp_cache.weight' uses the reserved prefix '_hp_'/'__hp_' (hp_lazy generates such names)",
        ),
        (
            lambda d: d["boundaries"].update({"model.__hp_x": {}}),
            "plan.boundaries: pattern 'model.__hp_x' uses the reserved prefix",
        ),
        (
            lambda d: d["boundaries"][ATTN]["in_src"].update(_hp_b={"tp": "R"}),
            "name '_hp_b' uses the reserved prefix",
        ),
        (
            lambda d: d["boundaries"][ATTN].update(skip_source_lowering="yes"),
            "skip_source_lowering: 'yes' is not true/false",
        ),
        (
            lambda d: d["boundary_classes"].update({"model.norm": "LlamaRMSNorm"}),
            "plan.boundary_classes['model.norm']: the pattern has no entry in plan.boundaries",
        ),
        (lambda d: d.update(modules=["pkg.modeling_[z-a]"]), "plan.modules: glob 'pkg.modeling_[z-a]': range z-a"),
        (
            lambda d: d["boundaries"].update({"model.layers.[9-0]": {}}),
            "plan.boundaries: glob 'model.layers.[9-0]': range 9-0 in [9-0] runs backwards; write the lower "
            "character first, e.g. [0-9]",
        ),
        (lambda d: d.update(boundaries={}), "plan.boundaries: the plan has no boundary"),
        (lambda d: d["boundaries"].update({"model..x": {}}), "pattern 'model..x' has an empty or invalid segment ''"),
        (lambda d: d.update(auto={"tp": 2, "sp": True}), "plan.auto: unknown key 'sp'"),
        (lambda d: d.update(auto={"tp": 4}), "plan.mesh: tp=2 differs from plan.auto.tp=4; make them equal"),
    ],
)
def test_validation_errors_name_place_value_rule_and_fix(edit, expected: str) -> None:
    data = copy.deepcopy(llama_plan())
    edit(data)
    assert expected in error_text(data)


def test_auto_rejects_bad_degree() -> None:
    with pytest.raises(PlanError, match=r"plan.auto.tp: degree 0 is not a positive integer; use e.g. tp=2"):
        Plan.auto(tp=0)
    with pytest.raises(PlanError, match=r"plan.auto.loss_parallel: 'yes' is not true/false"):
        Plan.auto(tp=2, loss_parallel="yes")  # type: ignore[arg-type]


def test_plan_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        Plan.from_dict({"mesh": {"tp": -1}})


def test_plan_package_does_not_import_distributed_or_transformers() -> None:
    import subprocess
    import sys

    code = (
        "import sys, hp_lazy.plan, hp_lazy.plan.parse, hp_lazy.plan.resolve, hp_lazy.plan.slice, hp_lazy.plan.auto;"
        "bad=[m for m in sys.modules if m.startswith(('torch', 'transformers'))]; print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- inner ops and regions


def with_inner(**body: object) -> dict:
    data = llama_plan()
    data["boundaries"][ATTN].update(body)
    return data


def test_injections_key_was_replaced_by_typed_fields() -> None:
    data = llama_plan()
    data["injections"] = [{"match": ATTN, "inner_wrapper": "cp_allgather_kv"}]
    text = error_text(data)
    assert text.startswith("plan.injections: [{'match': 'model.layers.*.self_attn', 'inner_wrapper'")
    assert "the untyped injections list was replaced by typed fields of a boundary's body" in text
    assert '"inner": {"call": "attention", "kind": "cp_allgather_kv"} (context parallel)' in text
    assert '"region": {"kind": "ep_dispatch"} (expert parallel); remove the key' in text


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"inner": "cp"}, f"plan.boundaries['{ATTN}'].inner: 'cp' is not an object; write a JSON object with "
                          "keys from ['call', 'kind']"),
        ({"inner": {"call": "attention", "kind": "cp_allgather_kv", "wrapper": "x"}},
         f"plan.boundaries['{ATTN}'].inner: unknown key 'wrapper'; allowed keys are ['call', 'kind']"),
        ({"inner": {"kind": "cp_ulysses"}},
         f"plan.boundaries['{ATTN}'].inner: {{'kind': 'cp_ulysses'}} has no ['call']; write e.g. "
         '{"call": "attention", "kind": "cp_allgather_kv"}'),
        ({"inner": {"call": "mlp", "kind": "cp_ulysses"}},
         f"plan.boundaries['{ATTN}'].inner.call: call 'mlp' is not one of ['attention']; use one of those"),
        ({"inner": {"call": "attention", "kind": "ring"}},
         f"plan.boundaries['{ATTN}'].inner.kind: kind 'ring' is not one of ['cp_allgather_kv', 'cp_ulysses']"),
        ({"region": {"kind": "moe"}},
         f"plan.boundaries['{ATTN}'].region.kind: kind 'moe' is not one of ['ep_dispatch', 'tp_experts']; use one of those"),
        ({"region": {}}, f"plan.boundaries['{ATTN}'].region: {{}} has no ['kind']; write e.g. {{\"kind\": \"ep_dispatch\"}}"),
        ({"region": {"kind": "ep_dispatch", "replicated": "norm"}},
         f"plan.boundaries['{ATTN}'].region.replicated: 'norm' is not a list; write e.g. [\"post_expert_norm\"]"),
        ({"region": {"kind": "ep_dispatch", "replicated": [""]}},
         f"plan.boundaries['{ATTN}'].region.replicated: parameter or submodule '' is not a non-empty string"),
    ],
)
def test_inner_and_region_are_validated_strictly(body: dict, expected: str) -> None:
    assert expected in error_text(with_inner(**body))


def test_every_kind_is_implemented_and_an_unknown_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import hp_lazy

    assert set(plan_model.IMPLEMENTED) == {"cp_allgather_kv", "cp_ulysses", "ep_dispatch", "tp_experts"}
    monkeypatch.setattr(plan_model, "IMPLEMENTED", frozenset({"cp_allgather_kv", "cp_ulysses"}))
    text = error_text(with_inner(region={"kind": "ep_dispatch"}))
    assert text == (f"plan.boundaries['{ATTN}'].region: kind 'ep_dispatch' (expert parallel) is not implemented yet in "
                    f"hp_lazy {hp_lazy.__version__}; remove the key")


def test_the_allgather_inner_op_needs_a_cp_axis() -> None:
    text = error_text(with_inner(inner={"call": "attention", "kind": "cp_allgather_kv"}))
    assert text == (f"plan.boundaries['{ATTN}'].inner: kind 'cp_allgather_kv' splits the sequence over the cp axis, "
                    "but plan.mesh {'tp': 2} has no cp above 1; add \"cp\": N to plan.mesh or remove the inner op")
    data = with_inner(inner={"call": "attention", "kind": "cp_allgather_kv"})
    data["mesh"] = {"cp": 2, "tp": 2}
    attn = next(c for c in Plan.from_dict(data).boundaries if c.pattern == ATTN)
    assert attn.inner == InnerOp(call="attention", kind="cp_allgather_kv")


def test_the_ep_dispatch_region_needs_an_ep_axis() -> None:
    text = error_text(with_inner(region={"kind": "ep_dispatch"}))
    assert text == (f"plan.boundaries['{ATTN}'].region: kind 'ep_dispatch' splits the experts over the ep axis, "
                    "but plan.mesh {'tp': 2} has no ep above 1; add \"ep\": N to plan.mesh or remove the region")


def test_implemented_kinds_are_one_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_model, "IMPLEMENTED", frozenset({"cp_allgather_kv", "ep_dispatch"}))
    data = with_inner(inner={"call": "attention", "kind": "cp_allgather_kv"}, region={"kind": "ep_dispatch"})
    data["mesh"] = {"cp": 2, "ep": 2, "tp": 2}
    plan = Plan.from_dict(data)
    attn = next(c for c in plan.boundaries if c.pattern == ATTN)
    assert attn.inner == InnerOp(call="attention", kind="cp_allgather_kv")
    assert attn.region == Region(kind="ep_dispatch")
    assert plan.to_dict()["boundaries"][ATTN]["inner"] == {"call": "attention", "kind": "cp_allgather_kv"}
    assert Plan.from_dict(plan.to_dict()) == plan


def test_the_tp_experts_region_needs_a_tp_axis() -> None:
    data = with_inner(region={"kind": "tp_experts"})
    data["mesh"] = {"tp": 1}
    text = error_text(data)
    assert text == (f"plan.boundaries['{ATTN}'].region: kind 'tp_experts' splits the experts over the tp axis, "
                    "but plan.mesh {'tp': 1} has no tp above 1; add \"tp\": N to plan.mesh or remove the region")


def test_region_replicated_names_round_trip() -> None:
    data = with_inner(region={"kind": "ep_dispatch", "replicated": ["post_expert_norm"]})
    data["mesh"] = {"ep": 2, "tp": 2}
    plan = Plan.from_dict(data)
    attn = next(c for c in plan.boundaries if c.pattern == ATTN)
    assert attn.region == Region(kind="ep_dispatch", replicated=("post_expert_norm",))
    assert plan.to_dict()["boundaries"][ATTN]["region"] == {"kind": "ep_dispatch", "replicated": ["post_expert_norm"]}
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.hash != Plan.from_dict({**data, "boundaries": {**data["boundaries"], ATTN: {
        **data["boundaries"][ATTN], "region": {"kind": "ep_dispatch"}}}}).hash  # the cache key sees it


def test_inner_op_and_region_values_are_checked_on_construction() -> None:
    with pytest.raises(PlanError, match=r"InnerOp: kind 'ring' is not one of \['cp_allgather_kv', 'cp_ulysses'\]"):
        InnerOp(call="attention", kind="ring")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"Region: kind 'moe' is not one of \['ep_dispatch', 'tp_experts'\]"):
        Region(kind="moe")  # type: ignore[arg-type]


def test_multi_axis_parameter_placement_is_accepted() -> None:
    data = {
        "mesh": {"ep": 2, "tp": 2},
        "modules": ["m"],
        "boundaries": {"layers.*.mlp": {"params": {"experts.gate_up_proj": {"ep": "S(0)", "tp": "SS(-1,2)"}}}},
    }
    contract = Plan.from_dict(data).boundaries[0]
    assert contract.placement("params", "experts.gate_up_proj", "ep") == Shard(0)
    assert str(contract.placement("params", "experts.gate_up_proj", "tp")) == "SS(-1,2)"
    assert Plan.from_dict(data).to_dict()["boundaries"]["layers.*.mlp"]["params"] == {
        "experts.gate_up_proj": {"ep": "S(0)", "tp": "SS(-1,2)"}
    }
