"""``Plan.auto``: transformers' TP plan strings -> hp_lazy contracts, on real modeling sources."""

from __future__ import annotations

import os
import textwrap

import pytest

from hp_lazy.errors import PlanError
from hp_lazy.plan import Plan
from hp_lazy.plan import auto as auto_mod
from hp_lazy.plan.auto import auto_contracts

transformers = pytest.importorskip("transformers")
MODELS = os.path.join(os.path.dirname(transformers.__file__), "models")


def source(family: str) -> tuple[str, str]:
    with open(os.path.join(MODELS, family, f"modeling_{family}.py"), encoding="utf-8") as handle:
        return f"transformers.models.{family}.modeling_{family}", handle.read()


def contracts(family: str, **flags) -> dict[str, dict]:
    found = auto_contracts(*source(family), **flags)
    assert found is not None
    return {c.pattern: c.to_dict() for c in found}


R, P = {"tp": "R"}, {"tp": "P(sum)"}
EMBED = {
    "in_src": {"input": R}, "in_dst": {"input": R}, "out_src": {"output": P}, "out_dst": {"output": R},
    "params": {"weight": {"tp": "S(0)"}},
}
LM_HEAD = {
    "in_src": {"input": R}, "in_dst": {"input": R},
    "out_src": {"output": {"tp": "S(-1)"}}, "out_dst": {"output": R},
    "params": {"weight": {"tp": "S(0)"}, "bias": {"tp": "S(0)"}},
    "optional_params": ["bias"],  # the config decides whether a Linear has a bias
}


def colwise(*names: str) -> dict:
    return {f"{n}.{p}": {"tp": "S(0)"} for n in names for p in ("weight", "bias")}


def test_llama_contracts() -> None:
    got = contracts("llama", tp=2)
    assert got == {
        "lm_head": LM_HEAD,
        "model.embed_tokens": EMBED,
        "model.layers.*.self_attn": {
            "in_src": {"hidden_states": R}, "in_dst": {"hidden_states": R},
            "out_src": {"output": P}, "out_dst": {"output": R},
            "params": {**colwise("q_proj", "k_proj", "v_proj"), "o_proj.weight": {"tp": "S(1)"}},
            "deferred_bias_params": ["o_proj.bias"],
            "optional_params": [f"{n}.bias" for n in ("k_proj", "o_proj", "q_proj", "v_proj")],
        },
        "model.layers.*.mlp": {
            "in_src": {"x": R}, "in_dst": {"x": R}, "out_src": {"output": P}, "out_dst": {"output": R},
            "params": {**colwise("gate_proj", "up_proj"), "down_proj.weight": {"tp": "S(1)"}},
            "deferred_bias_params": ["down_proj.bias"],
            "optional_params": [f"{n}.bias" for n in ("down_proj", "gate_proj", "up_proj")],
        },
    }


def test_llama_slice_classes_and_roots() -> None:
    sliced = Plan.auto(tp=2).slice(*source("llama"))
    assert sliced is not None
    assert sliced.classes == {
        "lm_head": "torch.nn.Linear",
        "model.embed_tokens": "torch.nn.Embedding",
        "model.layers.*.mlp": "LlamaMLP",
        "model.layers.*.self_attn": "LlamaAttention",
    }
    assert sliced.roots == (
        "LlamaModel", "LlamaForCausalLM", "LlamaForSequenceClassification",
        "LlamaForQuestionAnswering", "LlamaForTokenClassification",
    )
    assert sliced.hash != Plan.auto(tp=4).slice(*source("llama")).hash


def test_qwen3_norms_between_colwise_and_rowwise_sum_their_grads() -> None:
    attn = contracts("qwen3")["model.layers.*.self_attn"]
    assert attn["grad_sum_params"] == ["k_norm.*", "q_norm.*"]
    assert "q_norm.weight" not in attn["params"]


def test_phi3_gathered_colwise_and_split_rowwise_become_leaf_contracts() -> None:
    """Phi-3's qkv_proj output is sliced into unequal q/k/v ranges: gathered, as planned. Its MLP
    only halves gate_up_proj's output (``chunk(2, dim=-1)``): one boundary, the packed rows cut in
    both halves (``SS(0,2)``), no gather."""
    got = contracts("phi3")
    assert got["model.layers.*.self_attn.qkv_proj"] == {**LM_HEAD}
    assert got["model.layers.*.mlp"] == {
        "in_src": {"hidden_states": R}, "in_dst": {"hidden_states": R},
        "out_src": {"output": P}, "out_dst": {"output": R},
        "params": {"gate_up_proj.weight": {"tp": "SS(0,2)"}, "gate_up_proj.bias": {"tp": "SS(0,2)"},
                   "down_proj.weight": {"tp": "S(1)"}},
        "deferred_bias_params": ["down_proj.bias"], "optional_params": ["down_proj.bias", "gate_up_proj.bias"],
    }
    assert "model.layers.*.mlp.gate_up_proj" not in got and "model.layers.*.mlp.down_proj" not in got


HALVES = textwrap.dedent(
    '''
    from torch import nn
    from ...modeling_utils import PreTrainedModel

    class Halved(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Linear(8, 16)
            self.down_proj = nn.Linear(8, 8)

        def forward(self, x):
            up = self.gate_up_proj(x)
            gate, up = up.chunk(2, dim=-1)
            return self.down_proj(up * gate)

    class Reread(Halved):
        def forward(self, x):
            up = self.gate_up_proj(x)
            gate, rest = up.chunk(2, dim=-1)
            return self.down_proj(rest * gate) + up.sum()

    class Thirds(Halved):
        def forward(self, x):
            a, b, c = self.gate_up_proj(x).chunk(3, dim=-1)
            return self.down_proj(a * b * c)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.halved = Halved()
            self.reread = Reread()
            self.thirds = Thirds()

    class ToyPreTrainedModel(PreTrainedModel):
        base_model_prefix = "model"

    class ToyModel(ToyPreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.layers = nn.ModuleList([Layer() for _ in range(2)])
    '''
)


def test_only_a_gathered_output_the_forward_just_halves_is_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gathered output read whole again (``up.sum()``) or cut in three stays a gathered leaf."""
    plan = {f"layers.*.{m}.{p}": s for m in ("halved", "reread", "thirds")
            for p, s in (("gate_up_proj", "colwise_gather_output"), ("down_proj", "rowwise_split_input"))}
    monkeypatch.setattr(auto_mod, "config_plans", lambda module, facts, attr="base_model_tp_plan": [("ToyConfig", plan)] if attr == "base_model_tp_plan" else [])
    got = {c.pattern: c.to_dict() for c in auto_contracts(TOY, HALVES)}
    assert got["layers.*.halved"]["params"]["gate_up_proj.weight"] == {"tp": "SS(0,2)"}
    for module in ("reread", "thirds"):
        assert f"layers.*.{module}" not in got
        assert got[f"layers.*.{module}.gate_up_proj"]["out_src"] == {"output": {"tp": "S(-1)"}}


def test_norms_over_split_features_are_cut_with_their_projection() -> None:
    """``self.q_norm(self.q_proj(x))`` normalises every output feature of a colwise projection: ESM C's
    norms are cut ``S(0)`` with it. OLMo 2's plan gathers q/k/v for such norms (colwise_gather_output,
    o_proj rowwise_split_input); Plan.auto reads them as one colwise -> rowwise boundary instead, so
    attention runs on each rank's heads (the norms' statistics are summed at run time)."""
    norms = {f"{n}_norm.{p}": {"tp": "S(0)"} for n in "qk" for p in ("weight", "bias")}
    for family, prefix in (("esmc", "esmc."), ("olmo2", "model.")):
        got = contracts(family)
        attn = got[f"{prefix}layers.*.self_attn"]
        assert attn["params"] == {**colwise("q_proj", "k_proj", "v_proj"), "o_proj.weight": {"tp": "S(1)"}, **norms}
        assert attn["optional_params"] == ["k_norm.bias", "k_proj.bias", "o_proj.bias", "q_norm.bias", "q_proj.bias",
                                           "v_proj.bias"]
        assert not [p for p in got if p.startswith(f"{prefix}layers.*.self_attn.")]  # no gathered leaves
    assert "model.layers.*.self_attn.qkv_proj" in contracts("phi3")  # gathered for no norm: leaves, as planned


def test_an_activation_on_a_colwise_output_is_no_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """``self.act(self.q_proj(x))`` with a weightless module: nothing to cut, no statistics."""
    plan = {"layers.*.attn.q_proj": "colwise", "layers.*.attn.o_proj": "rowwise"}
    got = toy(monkeypatch, plan)["model.layers.*.attn"]["params"]
    assert set(got) == {"q_proj.weight", "q_proj.bias", "o_proj.weight"}
    monkeypatch.setattr(auto_mod.tp_preset, "_is_norm", lambda draft, name: True)  # the control: taken as a norm
    assert "act.weight" in toy(monkeypatch, plan)["model.layers.*.attn"]["params"]


def test_sequence_parallel_variant() -> None:
    got = contracts("llama", sequence_parallel=True)
    assert got["model.layers"] == {
        "in_src": {"input": R}, "in_dst": {"input": {"tp": "S(1)"}},
        "out_src": {"output": {"tp": "S(1)"}}, "out_dst": {"output": R},
        "grad_sum_params": ["*"],
    }
    attn = got["model.layers.*.self_attn"]
    assert attn["in_src"] == {"hidden_states": {"tp": "S(1)"}} and attn["in_dst"] == {"hidden_states": R}
    assert attn["out_src"] == {"output": P} and attn["out_dst"] == {"output": {"tp": "S(1)"}}
    sliced = Plan.auto(tp=2, sequence_parallel=True).slice(*source("llama"))
    assert sliced.classes["model.layers"] == "torch.nn.ModuleList"


def test_loss_parallel_keeps_logits_vocab_sharded() -> None:
    assert contracts("llama", loss_parallel=True)["lm_head"]["out_dst"] == {"output": {"tp": "S(-1)"}}
    assert contracts("llama")["lm_head"]["out_dst"] == {"output": R}


def test_sequence_parallel_runs_modules_holding_per_linear_leaves_whole() -> None:
    """Phi-3's attention gathers its fused qkv_proj's output and splits o_proj's input: it runs on
    the whole sequence (gathered in; no param of its own), its leaves keep tp's contracts, and
    o_proj, whose output the forward returns as it is, leaves reduce-scattered to this rank's piece."""
    got = contracts("phi3", sequence_parallel=True)
    assert got["model.layers.*.self_attn"] == {
        "in_src": {"hidden_states": {"tp": "S(1)"}}, "in_dst": {"hidden_states": R},
        "out_src": {"output": {"tp": "S(1)"}}, "out_dst": {"output": {"tp": "S(1)"}},
    }
    assert got["model.layers.*.self_attn.qkv_proj"] == contracts("phi3")["model.layers.*.self_attn.qkv_proj"]
    o_proj = got["model.layers.*.self_attn.o_proj"]
    assert o_proj["in_src"] == {"input": R} and o_proj["out_src"] == {"output": P}
    assert o_proj["out_dst"] == {"output": {"tp": "S(1)"}}
    assert "model.layers" in got  # the stack


def test_a_module_run_whole_carries_cp_attention_under_cp() -> None:
    """With cp as well, Phi-3's attention is both the module sp runs on the whole (cp) rows and an
    attention module cp splits: one contract carries both (cp's op alone was a second contract on
    the same slot, refused as a slot run split and whole)."""
    whole = contracts("phi3", sequence_parallel=True)["model.layers.*.self_attn"]
    got = contracts("phi3", sequence_parallel=True, cp=2)
    assert got["model.layers.*.self_attn"] == {**whole, "inner": {"call": "attention", "kind": "cp_allgather_kv"}}
    assert {k: v for k, v in got.items() if k != "model.layers.*.self_attn"} == {
        k: v for k, v in contracts("phi3", sequence_parallel=True).items() if k != "model.layers.*.self_attn"}


def test_a_returned_colwise_gather_leaves_by_all_to_all() -> None:
    """Qwen3-Next's Gated DeltaNet gathers every projection's output; out_proj's, which it returns,
    goes S(-1) -> S(1) (an all-to-all) instead of S(-1) -> R; the projections before stay whole."""
    got = contracts("qwen3_next", sequence_parallel=True)
    region = got["model.layers.*.linear_attn"]
    assert region["in_src"] == {"hidden_states": {"tp": "S(1)"}} and region["out_src"] == {"output": {"tp": "S(1)"}}
    assert got["model.layers.*.linear_attn.out_proj"]["out_dst"] == {"output": {"tp": "S(1)"}}
    for leaf in ("in_proj_qkvz", "in_proj_ba"):
        assert got[f"model.layers.*.linear_attn.{leaf}"]["out_dst"] == {"output": R}


def test_leaves_and_boundaries_outside_the_layers_keep_tp_contracts() -> None:
    """MuseGlimmer's vision patch embedding (a gathered leaf) and its vision adapter (a boundary)
    sit outside any layer stack: they see whole values under sequence parallel too."""
    sp, tp = contracts("muse_glimmer", sequence_parallel=True), contracts("muse_glimmer")
    for pattern in ("model.vision_tower.patch_embedder.patch_embedding", "model.vision_adapter"):
        assert sp[pattern] == tp[pattern]


def test_a_leaf_in_a_slot_that_is_also_a_boundary_is_refused() -> None:
    with pytest.raises(PlanError) as info:
        contracts("muse_spark", sequence_parallel=True)
    assert str(info.value).startswith(
        "transformers.models.muse_spark.modeling_muse_spark: MuseSparkTextConfig.base_model_tp_plan"
        "['layers.*.mlp.pre_expert_proj'] = 'rowwise_split_input' sits in 'layers.*.mlp', which sequence_parallel "
        "would run on the whole sequence, but 'layers.*.mlp' is also a tp boundary (MuseSparkTextConfig."
        "base_model_tp_plan) in some layers; a slot runs either split or whole"
    )


RETURNS = textwrap.dedent(
    '''
    from torch import nn

    class Direct(nn.Module):
        def forward(self, x):
            y = self.proj(x)
            return self.out(y), None

    class Named(nn.Module):
        def forward(self, x):
            x = self.proj(x)
            x = self.out(x)
            return x

    class Changed(nn.Module):
        def forward(self, x):
            x = self.out(x)
            x = x * 2
            return x

    class Branched(nn.Module):
        def forward(self, x):
            x = self.out(x)
            if x.dim() == 2:
                x = x[None]
            return x

    class Twice(nn.Module):
        def forward(self, x):
            y = self.out(x)
            x = self.out(x + y)
            return x
    '''
)


def test_the_output_a_forward_returns_as_it_is() -> None:
    from hp_lazy.plan.auto import sp
    from hp_lazy.plan.auto.draft import Draft
    from hp_lazy.plan.model import AutoFlags
    from hp_lazy.plan.resolve import analyze

    draft = Draft(analyze(TOY, RETURNS), AutoFlags())
    classes = ("Direct", "Named", "Changed", "Branched", "Twice")
    assert [sp._returned_child(draft, c) for c in classes] == ["out", "out", None, None, None]


def test_moe_experts_are_split_by_expert_over_tp_and_dense_slots_pick_their_class() -> None:
    """qwen3_moe: ``layers.*.mlp`` is a dense MLP in some layers and an MoE block in others; the
    dense contract binds only the class that has gate/up/down; the experts the ep plan marks are
    split by expert over tp (region tp_experts), whether or not the TP plan still names them
    (transformers 5.24 has moe_tp_experts there, 5.25 does not: one layout on both)."""
    plan = Plan.auto(tp=2).slice(*source("qwen3_moe"))
    experts = plan.contract("model.layers.*.mlp.experts").to_dict()
    assert experts == {
        "in_src": {name: {"tp": "R"} for name in ("hidden_states", "top_k_index", "top_k_weights")},
        "in_dst": {name: {"tp": "R"} for name in ("hidden_states", "top_k_index", "top_k_weights")},
        "out_src": {"output": {"tp": "P(sum)"}}, "out_dst": {"output": {"tp": "R"}},
        "params": {"down_proj": {"tp": "S(0)"}, "gate_up_proj": {"tp": "S(0)"}},
        "skip_source_lowering": True, "region": {"kind": "tp_experts"},
    }
    assert plan.classes["model.layers.*.mlp"] == "Qwen3MoeMLP"
    assert plan.classes["model.layers.*.mlp.experts"] == "Qwen3MoeExperts"


def test_experts_under_ep_and_sequence_parallel_take_their_own_rows() -> None:
    """Experts split over ep inside the sequence-split stack: each tp rank's own rows in and out
    (S(0) on tp, nothing moved over tp), dispatched over ep; the plan check passes them (the slice).
    On transformers 5.24, whose TP plan still cuts them on tp, refused by name."""
    if "moe_tp_experts" in source("qwen3_moe")[1] or "moe_tp_experts" in str(
            transformers.Qwen3MoeConfig.base_model_tp_plan):  # 5.24: the experts cut on tp too, refused
        with pytest.raises(PlanError, match=r"cuts the experts \['down_proj', 'gate_up_proj'\] on tp as well as on "
                           r"ep \(5.24-style experts-TP\), whose slices need every tp rank's tokens"):
            Plan.auto(tp=2, ep=2, sequence_parallel=True).slice(*source("qwen3_moe"))
        return
    plan = Plan.auto(tp=2, ep=2, sequence_parallel=True).slice(*source("qwen3_moe"))
    body = plan.contract("model.layers.*.mlp.experts").to_dict()
    rows = {name: {"tp": "S(0)"} for name in ("hidden_states", "top_k_index", "top_k_weights")}
    assert body["in_src"] == body["in_dst"] == rows
    assert body["out_src"] == body["out_dst"] == {"output": {"tp": "S(0)"}}
    assert body["region"] == {"kind": "ep_dispatch"} and body["params"] == {
        "down_proj": {"ep": "S(0)"}, "gate_up_proj": {"ep": "S(0)"}}


def test_cp_finds_attention_beside_a_plan_of_experts_only() -> None:
    """Jamba's TP plan on transformers 5.24 names its experts only, which tp's experts region takes
    over; cp still finds the attention module next to them (it found none: refused at load)."""
    got = contracts("jamba", tp=2, cp=2)
    assert got["model.layers.*.self_attn"].get("inner") == {"call": "attention", "kind": "cp_allgather_kv"}


def test_an_explicit_plan_cutting_own_rows_experts_on_tp_is_refused() -> None:
    """The same layout written out with the experts also cut on tp: each rank's own rows cannot meet a
    tp slice of the experts (every tp rank's rows would be needed), refused by the plan check."""
    if "moe_tp_experts" in str(transformers.Qwen3MoeConfig.base_model_tp_plan):
        pytest.skip("transformers 5.24: Plan.auto refuses ep with sequence parallel here already")
    sliced = Plan.auto(tp=2, ep=2, sequence_parallel=True).slice(*source("qwen3_moe"))
    bodies = {c.pattern: c.to_dict() for c in sliced.contracts}
    experts = bodies["model.layers.*.mlp.experts"]
    experts["params"] = {name: {**axes, "tp": "S(1)"} for name, axes in experts["params"].items()}
    plan = Plan.from_dict({"version": 1, "mesh": dict(sliced.mesh), "modules": [sliced.module], "boundaries": bodies,
                           "boundary_classes": dict(sliced.classes)})
    with pytest.raises(PlanError, match=r"^model.layers.\*.mlp.experts: in_dst\['hidden_states'\] is S\(0\) on tp, "
                       r"but its body computes with parameters sharded on that axis from whole values"):
        plan.slice(*source("qwen3_moe"))


def test_attention_the_tp_plan_leaves_out_runs_on_the_cp_rows_under_sp() -> None:
    """Kimi Linear's TP plan names no attention projection: under cp its MLA attention carries cp's op
    alone, and with sequence parallel that contract gathers the tp pieces (this cp rank's rows) in
    and cuts the output back."""
    got = contracts("kimi_linear", tp=2, cp=2, sequence_parallel=True)["model.layers.*.self_attn"]
    assert got == {"in_src": {"hidden_states": {"tp": "S(1)"}}, "in_dst": {"hidden_states": R},
                   "out_src": {"output": R}, "out_dst": {"output": {"tp": "S(1)"}},
                   "inner": {"call": "attention", "kind": "cp_allgather_kv"}}
    assert contracts("kimi_linear", tp=2, cp=2)["model.layers.*.self_attn"] == {
        "inner": {"call": "attention", "kind": "cp_allgather_kv"}}


def test_a_leaf_inside_attention_cp_splits_is_run_whole_with_it_under_sp() -> None:
    """Qwen4-Exp's TP plan names its attention's indexer projection only: under cp x tp with sequence
    parallel the attention (cp's op alone) is the module run on the cp rows, and the indexer inside it
    gets no second gather of the sequence (before, Plan.auto gave it one, and its own check refused
    the plan, telling the user to edit it)."""
    got = contracts("qwen4_exp", tp=2, cp=2, sequence_parallel=True)
    assert got["model.layers.*.self_attn"] == {"in_src": {"hidden_states": {"tp": "S(1)"}}, "in_dst": {"hidden_states": R},
                                               "out_src": {"output": R}, "out_dst": {"output": {"tp": "S(1)"}},
                                               "inner": {"call": "attention", "kind": "cp_allgather_kv"}}
    assert "model.layers.*.self_attn.indexer" not in got
    assert got["model.layers.*.self_attn.indexer.index_qk_proj"] == contracts("qwen4_exp")[
        "model.layers.*.self_attn.indexer.index_qk_proj"]
    Plan.auto(tp=2, cp=2, sequence_parallel=True).slice(*source("qwen4_exp"))  # passes its own check


def test_the_token_mixer_around_leaves_is_the_module_run_whole() -> None:
    """Under sequence parallel alone, Qwen4-Exp's n-gram table sits in a block whose class holds a
    Conv1d (its dilated short convolution), and its indexer projection in an attention module: each
    of those is the region run on the whole sequence, not the leaves' own module (the embedding, the
    indexer), which would leave the convolution and the attention on this rank's piece. Its
    hyper-connection blocks return three values along the sequence: each leaves as the piece."""
    got = contracts("qwen4_exp", sequence_parallel=True)
    whole = {"in_src": {"hidden_states": {"tp": "S(1)"}}, "in_dst": {"hidden_states": R},
             "out_src": {"output": R}, "out_dst": {"output": {"tp": "S(1)"}}}
    assert got["model.layers.*.ple"] == got["model.layers.*.self_attn"] == whole
    assert "model.layers.*.ple.ple_embedding" not in got and "model.layers.*.self_attn.indexer" not in got
    hyper = got["model.layers.*.attn_hyper_connection"]
    assert hyper["out_src"] == {f"output{i}": R for i in ("", ".1", ".2")}
    assert hyper["out_dst"] == {f"output{i}": {"tp": "S(1)"} for i in ("", ".1", ".2")}


def test_experts_under_sequence_parallel_take_every_rank_rows() -> None:
    """Inside the sequence-split layer stack the experts' rows (and their top-k ids and weights)
    arrive cut over tp: gathered in, the partial sums reduce-scattered out."""
    plan = Plan.auto(tp=2, sequence_parallel=True).slice(*source("qwen3_moe"))
    body = plan.contract("model.layers.*.mlp.experts").to_dict()
    rows = {"hidden_states": {"tp": "S(0)"}, "top_k_index": {"tp": "S(0)"}, "top_k_weights": {"tp": "S(0)"}}
    assert body["in_src"] == rows and body["in_dst"] == {k: {"tp": "R"} for k in rows}
    assert body["out_src"] == {"output": {"tp": "P(sum)"}} and body["out_dst"] == {"output": {"tp": "S(0)"}}
    assert plan.contract("model.layers").to_dict()["in_dst"] == {"input": {"tp": "S(1)"}}


def test_experts_outside_a_split_stack_stay_replicated_under_sequence_parallel() -> None:
    """GPT-OSS's TP plan (5.25) holds its embedding and experts only: no boundary splits the layer
    stack, so the experts take whole rows, as under tp alone."""
    plan = Plan.auto(tp=2, sequence_parallel=True).slice(*source("gpt_oss"))
    body = plan.contract("model.layers.*.mlp.experts").to_dict()
    assert all(p == {"tp": "R"} for p in body["in_src"].values()) and body["out_dst"] == {"output": {"tp": "R"}}
    assert "model.layers" not in {c.pattern for c in plan.contracts}


def test_mla_is_translated() -> None:
    """MLA: the heads' up projections colwise, o_proj rowwise, the down projections replicated with
    their gradients summed; q_proj and q_a_proj/q_b_proj exist by configuration, so optional."""
    body = contracts("deepseek_v2")["model.layers.*.self_attn"]
    assert body["grad_sum_params"] == ["kv_a_proj_with_mqa.*"]
    assert {k: v for k, v in body["params"].items() if k.endswith("weight")} == {
        "q_proj.weight": {"tp": "S(0)"}, "q_b_proj.weight": {"tp": "S(0)"}, "kv_b_proj.weight": {"tp": "S(0)"},
        "o_proj.weight": {"tp": "S(1)"},
    }
    assert {"q_proj.weight", "q_b_proj.weight"} <= set(body["optional_params"])
    assert "kv_b_proj.weight" not in body["optional_params"] and "o_proj.weight" not in body["optional_params"]


def test_modules_without_a_tp_plan_are_not_sliced() -> None:
    assert Plan.auto(tp=2).slice(*source("bert")) is None
    assert auto_contracts("mypkg.modeling_llama", source("llama")[1]) is None
    assert Plan.auto(tp=2).slice("transformers.models.llama.configuration_llama", "") is None


TOY = "transformers.models.toy.modeling_toy"
TOY_SOURCE = textwrap.dedent(
    '''
    import torch
    from torch import nn
    from ...modeling_utils import PreTrainedModel

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.empty(4, 16, 8))
            self.down_proj = nn.Parameter(torch.empty(4, 8, 8))

        def forward(self, hidden, idx):
            return hidden

    class BaseMLP(nn.Module):
        def forward(self, hidden_states):
            return self.down_proj(self.gate_up_proj(hidden_states))

    class MLP(BaseMLP):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Linear(8, 16)
            self.down_proj = nn.Linear(8, 8)
            self.experts = Experts()

    class Attn(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.q_proj = nn.Linear(8, 8)
            self.o_proj = nn.Linear(8, 8)
            self.sinks = nn.Parameter(torch.zeros(config.heads)) if config.sinks else None
            self.table = nn.Parameter(torch.empty((4, 2)))
            self.act = nn.GELU()

        def forward(self, hidden_states):
            return self.o_proj(self.act(self.q_proj(hidden_states)))

    class Orphan(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

    class Layer(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.mlp = MLP()
            self.attn = Attn(config)
            self.orphan = Orphan()

        def forward(self, h):
            return self.mlp(h)

    class ToyPreTrainedModel(PreTrainedModel):
        base_model_prefix = "model"

    class ToyModel(ToyPreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.layers = nn.ModuleList([Layer(config) for _ in range(2)])

        def forward(self, ids):
            return ids

    class ToyForCausalLM(ToyPreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.model = ToyModel(config)
    '''
)


def toy(monkeypatch: pytest.MonkeyPatch, plan: dict, **flags) -> dict[str, dict]:
    monkeypatch.setattr(auto_mod, "config_plans", lambda module, facts, attr="base_model_tp_plan": [("ToyConfig", plan)] if attr == "base_model_tp_plan" else [])
    return {c.pattern: c.to_dict() for c in auto_contracts(TOY, TOY_SOURCE, **flags)}


def toy_error(monkeypatch: pytest.MonkeyPatch, plan: dict, **flags) -> str:
    with pytest.raises(PlanError) as info:
        toy(monkeypatch, plan, **flags)
    return str(info.value)


def test_packed_colwise_and_raw_expert_params(monkeypatch: pytest.MonkeyPatch) -> None:
    got = toy(monkeypatch, {
        "layers.*.mlp.gate_up_proj": "packed_colwise", "layers.*.mlp.down_proj": "rowwise",
    })
    assert got["model.layers.*.mlp"]["params"] == {
        "gate_up_proj.weight": {"tp": "SS(0,2)"}, "gate_up_proj.bias": {"tp": "SS(0,2)"},
        "down_proj.weight": {"tp": "S(1)"},
    }
    assert got["model.layers.*.mlp"]["in_src"] == {"hidden_states": R}  # forward of a same-module base
    got = toy(monkeypatch, {
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
    })
    assert got["model.layers.*.mlp.experts"]["params"] == {
        "gate_up_proj": {"tp": "SS(-2,2)"}, "down_proj": {"tp": "S(-1)"},
    }
    assert got["model.layers.*.mlp.experts"]["in_src"] == {"hidden": R}


ATTN = {"layers.*.attn.q_proj": "colwise", "layers.*.attn.o_proj": "rowwise", "layers.*.attn": "local_params"}


def test_local_params_cut_per_head_vectors_with_their_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.25: ``self_attn.sinks: colwise`` beside ``self_attn: local_params``. A vector
    (rank 1 in the source, here behind ``if config.sinks else None``) is cut on dim 0, as
    transformers' ``ndim - 2`` rule does, and is optional (a layer may have none)."""
    got = toy(monkeypatch, {**ATTN, "layers.*.attn.sinks": "colwise"})
    attn = got["model.layers.*.attn"]
    assert attn["params"] == {**colwise("q_proj"), "o_proj.weight": {"tp": "S(1)"}, "sinks": {"tp": "S(0)"}}
    assert attn["optional_params"] == ["o_proj.bias", "q_proj.bias", "sinks"]
    # a matrix keeps the expert rule (dim -2), as transformers' ColwiseParallel does for ndim 2
    assert toy(monkeypatch, {**ATTN, "layers.*.attn.table": "colwise"})["model.layers.*.attn"]["params"]["table"] \
        == {"tp": "S(-2)"}
    text = toy_error(monkeypatch, {**ATTN, "layers.*.attn.sinks": "rowwise"})
    assert "['layers.*.attn.sinks'] = 'rowwise' names 'layers.*.attn.sinks', a vector: it has no input dim for " \
           "rowwise to cut" in text


def test_local_params_must_mark_a_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    text = toy_error(monkeypatch, {"layers.*.attn": "local_params", "layers.*.mlp.gate_up_proj": "colwise",
                                   "layers.*.mlp.down_proj": "rowwise"})
    assert text == (
        f"{TOY}: ToyConfig.base_model_tp_plan['layers.*.attn'] = 'local_params' marks a module whose raw parameters "
        "hp_lazy shards only with an enclosing colwise -> rowwise pair, and no such pair sits directly under it; "
        "write an explicit JSON plan for this module (Plan.from_json) instead of Plan.auto"
    )


def test_packed_rowwise_cuts_transposed_experts_on_their_last_dim(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 4 stores its experts ``[E, in, out]``: ``gate_up_proj: packed_rowwise`` cuts the packed
    output dim (-1) and ``down_proj: colwise`` the intermediate (-2), and they pair."""
    got = toy(monkeypatch, {"layers.*.mlp.experts.gate_up_proj": "packed_rowwise",
                            "layers.*.mlp.experts.down_proj": "colwise"})
    assert got["model.layers.*.mlp.experts"]["params"] == {
        "gate_up_proj": {"tp": "SS(-1,2)"}, "down_proj": {"tp": "S(-2)"},
    }
    text = toy_error(monkeypatch, {"layers.*.mlp.gate_up_proj": "colwise", "layers.*.mlp.down_proj": "packed_rowwise"})
    assert "['layers.*.mlp.down_proj'] = 'packed_rowwise' applies to an nn.Linear; Plan.auto reads packed_rowwise " \
           "only on raw (transposed expert) parameters" in text


def test_replicate_keeps_a_module_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inkling's ``embed_tokens: replicate``: no vocab-parallel embedding, even where Plan.auto would
    add transformers' implicit one."""
    from transformers.models.inkling.configuration_inkling import InklingTextConfig

    if InklingTextConfig.base_model_tp_plan.get("embed_tokens") == "replicate":  # transformers 5.25 on
        got = contracts("inkling", tp=2, vocab_parallel_embedding=True)
        assert "model.embed_tokens" not in got and "model.layers.*.mlp" in got
    assert "model.embed_tokens" in contracts("llama", tp=2, vocab_parallel_embedding=True)
    plan = {"layers.*.mlp.gate_up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    assert set(toy(monkeypatch, {**plan, "embed_tokens": "replicate"}, vocab_parallel_embedding=True)) == {
        "model.layers.*.mlp"}


def test_one_pattern_under_two_models_takes_its_rules_class() -> None:
    """Llama 4's text plan (relative to Llama4TextModel) and vision plan (relative to Llama4VisionModel)
    both reach a ``layers.*.self_attn``: each pattern is bound to the class its own rule's base holds
    there, so a vision layer never takes the text contract (nor the reverse)."""
    plan = Plan.auto(tp=2).slice(*source("llama4"))
    assert plan.classes["layers.*.self_attn"] == "Llama4TextAttention"
    assert plan.classes["model.layers.*.self_attn"] == "Llama4VisionAttention"
    experts = plan.contract("layers.*.feed_forward.experts").to_dict()  # packed_rowwise: [E, in, 2 * out]
    assert experts["params"] == {"gate_up_proj": {"tp": "SS(-1,2)"}, "down_proj": {"tp": "S(-2)"}}


def test_a_config_plans_each_stack_it_describes_and_no_other() -> None:
    """T5Gemma's one module config describes its encoder and its decoder (each holds every key, at its
    own prefix): both are planned. A tower that merely has the same key paths under another config
    (Voxtral-Realtime's audio tower beside its text model) is not planned by the text config."""
    t5 = {c.pattern for c in Plan.auto(tp=2).slice(*source("t5gemma")).contracts}
    assert {"model.encoder.layers.*.self_attn", "model.decoder.layers.*.self_attn"} <= t5
    voxtral = {c.pattern for c in Plan.auto(tp=2).slice(*source("voxtral_realtime")).contracts}
    assert "model.language_model.layers.*.self_attn" in voxtral
    assert not [p for p in voxtral if "audio_tower" in p]


def test_head_keys_naming_no_attribute_are_dropped() -> None:
    """``Llama4ForConditionalGeneration._tp_plan['lm_head']``: that class has no ``lm_head`` (its head
    is ``language_model.lm_head``, planned by ``Llama4ForCausalLM``), so the key plans nothing."""
    from hp_lazy.plan.auto.rules import head_rules
    from hp_lazy.plan.resolve import analyze

    rules = head_rules(analyze(*source("llama4")))
    assert [r.owner for r in rules if r.key == "lm_head"] == ["Llama4ForCausalLM._tp_plan"]


def test_colwise_without_rowwise_sibling(monkeypatch: pytest.MonkeyPatch) -> None:
    assert toy_error(monkeypatch, {"layers.*.mlp.gate_up_proj": "colwise"}) == (
        f"{TOY}: ToyConfig.base_model_tp_plan['layers.*.mlp.gate_up_proj'] = 'colwise' has no rowwise sibling under "
        "'layers.*.mlp', so no module encloses a colwise -> rowwise pair; write an explicit JSON plan for this "
        "module (Plan.from_json) instead of Plan.auto"
    )


def test_enclosing_module_without_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    text = toy_error(monkeypatch, {"layers.*.orphan.a": "colwise", "layers.*.orphan.b": "rowwise"})
    assert "['layers.*.orphan.a'] = 'colwise' needs the input of class 'Orphan', but no forward" in text


def test_nested_boundaries_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    text = toy_error(monkeypatch, {
        "layers.*.mlp.gate_up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "colwise", "layers.*.mlp.experts.down_proj": "rowwise",
    })
    assert "contract 'model.layers.*.mlp.experts' (ToyConfig.base_model_tp_plan) lies inside contract " \
           "'model.layers.*.mlp'" in text


def test_unknown_styles_name_key_and_string(monkeypatch: pytest.MonkeyPatch) -> None:
    text = toy_error(monkeypatch, {"layers.*.mlp": "sequence_gather"})
    assert text.startswith(f"{TOY}: ToyConfig.base_model_tp_plan['layers.*.mlp'] = 'sequence_gather' is not a style")
    text = toy_error(monkeypatch, {"layers.*.mlp.experts": "gather"})
    assert "'gather' is not a style Plan.auto translates" in text
    text = toy_error(monkeypatch, {"layers.*.mlp.experts": "mla_kv_a_proj"})  # only inside an attention pair
    assert "['layers.*.mlp.experts'] = 'mla_kv_a_proj' is not inside a module that encloses a colwise -> " \
           "rowwise pair" in text
    text = toy_error(monkeypatch, {"layers.*.mlp": "embedding_colwise"})  # only on an embedding
    assert "['layers.*.mlp'] = 'embedding_colwise' applies to class 'MLP'; Plan.auto shards only nn.Embedding" in text


def test_expert_parallel_at_tp1_reads_no_tp_strings() -> None:
    """At tp=1 nothing is cut over tp: Qwen4-Exp's TP strings are not read and the ep plan alone places
    its experts. At tp=2 its 'embedding_colwise' (5.25; refused before) is translated: the n-gram
    tables are cut along their features and the lookup's slices gathered."""
    plan = Plan.auto(tp=1, ep=2).slice(*source("qwen4_exp"))
    assert [c.pattern for c in plan.contracts] == ["model.layers.*.mlp.experts"]
    assert plan.contracts[0].to_dict()["region"] == {"kind": "ep_dispatch"}
    qwen4 = {c.pattern: c.to_dict() for c in Plan.auto(tp=2, ep=2).slice(*source("qwen4_exp")).contracts}
    table = qwen4["model.layers.*.ple.ple_embedding.ngram_embedding"]
    assert (table["params"], table["out_src"], table["out_dst"]) == (
        {"weight": {"tp": "S(1)"}}, {"output": {"tp": "S(-1)"}}, {"output": {"tp": "R"}})
    assert qwen4["model.layers.*.mlp.experts"]["region"]["kind"] == "ep_dispatch"
    hy = {c.pattern: c.to_dict() for c in Plan.auto(tp=2, ep=2).slice(*source("hy_v4")).contracts}
    assert hy["model.layers.*.self_attn"]["params"]["sinks"] == {"tp": "S(0)"}  # 'local_params' (5.25)
    assert hy["model.layers.*.mlp.experts"]["region"]["kind"] == "ep_dispatch"


def test_an_ep_plan_alone_places_experts_and_locates_attention() -> None:
    """OpenAI-Privacy-Filter (and Zaya, Ergo) declare a ``base_model_ep_plan`` and no TP plan: under ep
    Plan.auto places their experts (it derived nothing, and ep=2 ran them whole on every rank); under tp
    alone it splits the experts the ep plan marks over tp, as for every 5.25 MoE (it derived nothing: all
    experts whole on every tp rank); under cp the ep plan's keys locate the attention modules (no
    attention carried cp's op, and cp refused the model)."""
    plan = Plan.auto(tp=1, ep=2).slice(*source("openai_privacy_filter"))
    assert [c.pattern for c in plan.contracts] == ["layers.*.mlp.experts"]  # a base model (AutoModel) family
    assert plan.contracts[0].to_dict()["region"] == {"kind": "ep_dispatch"}
    tp = Plan.auto(tp=2).slice(*source("openai_privacy_filter")).contracts
    assert [c.pattern for c in tp] == ["layers.*.mlp.experts"] and tp[0].to_dict()["region"] == {"kind": "tp_experts"}
    assert {k: v["tp"] for k, v in tp[0].to_dict()["params"].items()} == dict.fromkeys(  # by expert
        ("down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias"), "S(0)")
    for family, attention in (("openai_privacy_filter", "layers.*.self_attn"), ("ergo", "model.layers.*.self_attn")):
        if not os.path.isdir(os.path.join(MODELS, family)):  # Ergo is new in transformers 5.25
            continue
        cp = {c.pattern: c.to_dict() for c in Plan.auto(tp=1, cp=2).slice(*source(family)).contracts}
        assert list(cp) == [attention], cp
        assert cp[attention]["inner"] == {"call": "attention", "kind": "cp_allgather_kv"}


def test_expert_parallel_keeps_replicated_with_grad_allreduce_whole() -> None:
    """Muse Spark's ep plan keeps the experts' post_expert_norm whole on every rank
    ('replicated_with_grad_allreduce'): the region names it, the expert weights are cut on ep."""
    plan = Plan.auto(tp=1, ep=2).slice(*source("muse_spark"))
    experts = [c for c in plan.contracts if c.region is not None]
    assert [c.pattern for c in experts] == ["layers.*.mlp.experts"]  # MuseSparkTextModel (AutoModel) roots
    body = experts[0].to_dict()
    assert body["region"] == {"kind": "ep_dispatch", "replicated": ["post_expert_norm"]}
    assert {k: v["ep"] for k, v in body["params"].items()} == {"down_proj": "S(0)", "gate_up_proj": "S(0)"}
