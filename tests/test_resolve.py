"""Static FQN -> class resolution (pure ast) and ``Plan.slice`` on small sources."""

from __future__ import annotations

import textwrap

import pytest

from hp_lazy.errors import PlanError
from hp_lazy.plan import Plan
from hp_lazy.plan.resolve import analyze, forward_params, resolve_pattern

MOD = "pkg.models.toy.modeling_toy"

SOURCE = textwrap.dedent(
    '''
    import torch
    import torch.nn as tnn
    from torch import nn
    from ...modeling_utils import PreTrainedModel
    from .layers import FancyNorm as Norm
    from ..shared import blocks


    class Attention(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.q_proj = nn.Linear(4, 4)
            self.o_proj = tnn.Linear(4, 4)
            self.q_norm = Norm(4)
            self.sink = nn.Parameter(torch.zeros(4))

        def forward(self, hidden_states, mask=None):
            return self.o_proj(self.q_proj(hidden_states))


    class BaseMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(4, 8)

        def forward(self, x):
            return self.up(x)


    class MLP(BaseMLP):
        def __init__(self):
            super().__init__()
            self.down = blocks.RowLinear(8, 4)


    class NoForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)


    class Layer(nn.Module):
        def __init__(self, cfg, i):
            super().__init__()
            self.self_attn = Attention(cfg)
            self.mlp = MLP()
            self.idle = NoForward()

        def forward(self, h):
            return self.mlp(self.self_attn(h))


    class ToyPreTrainedModel(PreTrainedModel):
        base_model_prefix = "model"


    class ToyModel(ToyPreTrainedModel):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.embed_tokens = nn.Embedding(10, 4)
            self.layers = nn.ModuleList([Layer(cfg, i) for i in range(2)])
            self.extra = nn.ModuleList(MLP() for _ in range(2))
            self.pair = nn.ModuleList([Attention(cfg), MLP()])

        def forward(self, ids):
            return ids


    class ToyForCausalLM(ToyPreTrainedModel):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.model = ToyModel(cfg)
            self.lm_head = nn.Linear(4, 10)

        def forward(self, ids):
            return self.lm_head(self.model(ids))


    class ToyForOther(ToyForCausalLM):
        pass
    '''
)


def resolved(pattern: str) -> dict[str, set[str]]:
    return resolve_pattern(analyze(MOD, SOURCE), pattern)


def test_imports_are_qualified_including_relative_ones() -> None:
    facts = analyze(MOD, SOURCE)
    assert facts.imports["nn"] == "torch.nn"
    assert facts.imports["tnn"] == "torch.nn"
    assert facts.imports["torch"] == "torch"
    assert facts.imports["PreTrainedModel"] == "pkg.modeling_utils.PreTrainedModel"
    assert facts.imports["Norm"] == "pkg.models.toy.layers.FancyNorm"
    assert facts.imports["blocks"] == "pkg.models.shared.blocks"


def test_children_params_and_forward() -> None:
    facts = analyze(MOD, SOURCE)
    attn = facts.children("Attention")
    assert {k: [r.name for r in v] for k, v in attn.items()} == {
        "q_proj": ["torch.nn.Linear"],
        "o_proj": ["torch.nn.Linear"],
        "q_norm": ["pkg.models.toy.layers.FancyNorm"],
    }
    assert facts.params("Attention") == {"sink"}
    assert forward_params(facts.forward("Attention")) == ["hidden_states", "mask"]
    assert forward_params(facts.forward("MLP")) == ["x"]  # inherited from BaseMLP


def test_module_list_comprehension_generator_and_literal() -> None:
    assert resolved("model.layers.*.self_attn") == {"ToyForCausalLM": {"Attention"}, "ToyForOther": {"Attention"},
                                                    "ToyModel": {"Attention"}}
    assert resolved("model.layers.1.mlp")["ToyForCausalLM"] == {"MLP"}
    assert resolved("model.extra.*")["ToyForCausalLM"] == {"MLP"}
    assert resolved("model.pair.0")["ToyForCausalLM"] == {"Attention"}
    assert resolved("model.pair.1")["ToyForCausalLM"] == {"MLP"}
    assert resolved("model.pair.2") == {}
    assert resolved("model.layers")["ToyForCausalLM"] == {"torch.nn.ModuleList"}


def test_bases_leaves_and_prefix_stripping() -> None:
    assert resolved("model.layers.*.mlp.up")["ToyModel"] == {"torch.nn.Linear"}  # attr set in a base's __init__
    assert resolved("model.layers.*.mlp.down")["ToyModel"] == {"pkg.models.shared.blocks.RowLinear"}
    assert resolved("lm_head") == {"ToyForCausalLM": {"torch.nn.Linear"}, "ToyForOther": {"torch.nn.Linear"}}
    q_star = resolved("model.layers.*.self_attn.q_*")["ToyModel"]
    assert q_star == {"torch.nn.Linear", "pkg.models.toy.layers.FancyNorm"}
    assert resolved("layers.*.mlp") == {"ToyModel": {"MLP"}}  # no prefix: only the base model has it
    assert resolved("model.layers.*") == {k: {"Layer"} for k in ("ToyForCausalLM", "ToyForOther", "ToyModel")}
    assert resolved("model.missing") == {}


def plan(boundaries: dict, classes: dict | None = None, modules: list[str] | None = None, **extra) -> Plan:
    data = {"mesh": {"tp": 2}, "modules": modules or [MOD], "boundaries": boundaries, **extra}
    if classes:
        data["boundary_classes"] = classes
    return Plan.from_dict(data)


ROW = {
    "in_src": {"hidden_states": {"tp": "R"}},
    "out_src": {"output": {"tp": "P(sum)"}},
    "params": {"o_proj.weight": {"tp": "S(1)"}},
    "deferred_bias_params": ["o_proj.bias"],
}


def test_slice_fills_the_module_plan() -> None:
    head = {"in_src": {"input": {"tp": "R"}}, "out_src": {"output": {"tp": "S(-1)"}}, "params": {"weight": {"tp": "S(0)"}}}
    p = plan({"model.layers.*.self_attn": ROW, "lm_head": head})
    sliced = p.slice(MOD, SOURCE)
    assert sliced is not None
    assert sliced.classes == {"lm_head": "torch.nn.Linear", "model.layers.*.self_attn": "Attention"}
    assert [c.pattern for c in sliced.contracts] == ["lm_head", "model.layers.*.self_attn"]
    assert sliced.roots == ("ToyModel", "ToyForCausalLM", "ToyForOther")
    assert sliced.plan_hash == p.hash and len(sliced.hash) == 64
    assert sliced.mesh == {"tp": 2}
    assert p.slice("pkg.models.other.modeling_other", SOURCE) is None


def test_slice_hash_tracks_slice_content_only() -> None:
    a = plan({"model.layers.*.self_attn": ROW}, modules=[MOD, "other.mod"])
    b = plan({"model.layers.*.self_attn": ROW, "model.vision.x": {}}, modules=[MOD, "other.mod"])
    assert a.hash != b.hash
    assert a.slice(MOD, SOURCE).hash == b.slice(MOD, SOURCE).hash  # model.vision.x applies elsewhere
    c = plan({"model.layers.*.self_attn": {**ROW, "grad_sum_params": ["q_norm.*"]}}, modules=[MOD, "other.mod"])
    assert c.slice(MOD, SOURCE).hash != a.slice(MOD, SOURCE).hash


def test_roots_for_plain_modules_are_the_start_classes() -> None:
    source = "from torch import nn\nclass A(nn.Module):\n    def __init__(self):\n        self.b = B()\n" \
             "class B(nn.Module):\n    def forward(self, x):\n        return x\n"
    sliced = plan({"b": {}}, modules=["m"]).slice("m", source)
    assert sliced.roots == ("A",) and sliced.classes == {"b": "B"}


def test_boundary_classes_override_resolution() -> None:
    sliced = plan({"model.layers.*.mlp": {}}, {"model.layers.*.mlp": f"{MOD}.BaseMLP"}).slice(MOD, SOURCE)
    assert sliced.classes == {"model.layers.*.mlp": "BaseMLP"}
    sliced = plan({"model.layers.*.mlp.down": {}}, {"model.layers.*.mlp.down": "torch.nn.Linear"}).slice(MOD, SOURCE)
    assert sliced.classes == {"model.layers.*.mlp.down": "torch.nn.Linear"}


def slice_error(p: Plan) -> str:
    with pytest.raises(PlanError) as info:
        p.slice(MOD, SOURCE)
    return str(info.value)


def test_pattern_matching_no_class_is_an_error_for_a_single_module_plan() -> None:
    text = slice_error(plan({"model.layers.*.attn": {}}))
    assert text.startswith(f"{MOD}: boundary 'model.layers.*.attn' matches no class of the module")
    assert "fix the pattern, or name the class in boundary_classes" in text
    assert plan({"model.layers.*.attn": {}}, modules=["pkg.models.*.modeling_*"]).slice(MOD, SOURCE) is None


def test_two_resolutions_to_different_classes_is_an_error() -> None:
    text = slice_error(plan({"model.pair.*": {}}))
    assert "boundary 'model.pair.*' resolves to different classes ['Attention', 'MLP']" in text
    assert "set boundary_classes['model.pair.*']" in text


def test_class_without_forward_is_an_error() -> None:
    text = slice_error(plan({"model.layers.*.idle": {}}))
    assert text == (
        f"{MOD}: boundary 'model.layers.*.idle' is class 'NoForward', which has no forward of its own or "
        "inherited; point the pattern at a module that defines forward"
    )


def test_override_naming_a_missing_class_is_an_error() -> None:
    text = slice_error(plan({"model.layers.*.mlp": {}}, {"model.layers.*.mlp": "Missing"}))
    assert "boundary_classes['model.layers.*.mlp'] = 'Missing' is not a class defined in the module" in text


def test_shared_class_needs_identical_contracts_except_params() -> None:
    out = {"output": {"tp": "P(sum)"}}
    first = {"in_src": {"x": {"tp": "R"}}, "out_src": out, "params": {"up.weight": {"tp": "S(0)"}}}
    same_but_params = {"in_src": {"x": {"tp": "R"}}, "out_src": out, "params": {"up.weight": {"tp": "S(1)"}}}
    assert plan({"model.extra.*": first, "model.layers.*.mlp": same_but_params}).slice(MOD, SOURCE) is not None
    other = {"in_src": {"x": {"tp": "R"}, "y": {"tp": "R"}}, "out_src": out, "params": {"up.weight": {"tp": "S(0)"}}}
    text = slice_error(plan({"model.extra.*": first, "model.layers.*.mlp": other}))
    assert "boundaries 'model.extra.*' and 'model.layers.*.mlp' both lower class 'MLP' but differ in in_src" in text
    assert "give them identical contracts (only params may differ), or mark both skip_source_lowering" in text
    # one bound at run time while the other rewrites the class: the lowered forward would apply it too
    skipped = {**other, "skip_source_lowering": True}
    text = slice_error(plan({"model.extra.*": first, "model.layers.*.mlp": skipped}))
    assert ("boundary 'model.layers.*.mlp' binds class 'MLP' at run time (skip_source_lowering), but 'model.extra.*' "
            "rewrites that class's forward from source, which would apply the entry and exit ops a second time") in text
    both = {"model.extra.*": {**first, "skip_source_lowering": True}, "model.layers.*.mlp": skipped}
    assert plan(both).slice(MOD, SOURCE) is not None  # every boundary of the class bound at run time


def test_unparsable_source_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match=r"m: the source does not parse"):
        plan({"a": {}}, modules=["m"]).slice("m", "class (:\n")


def test_segments_use_the_fqn_glob_rule() -> None:
    assert resolved("model.pair.[01]")["ToyForCausalLM"] == {"Attention", "MLP"}
    assert resolved("model.pair.[!0]")["ToyForCausalLM"] == {"MLP"}
    assert resolved("model.layers.[0-3].mlp")["ToyForCausalLM"] == {"MLP"}
    assert resolved("model.layers.?.self_attn.[o-q]_proj")["ToyModel"] == {"torch.nn.Linear"}
    assert resolved("model.layers.q*.mlp") == {}  # a ModuleList is entered by position only
    assert resolved("model.*.*.mlp")["ToyForCausalLM"] == {"MLP"}  # '*' matches an attribute too
    assert resolved("model.layers.*.inner.self_attn") == {}  # '*' is one segment


def test_double_star_spans_one_or_more_segments() -> None:
    assert resolved("model.**.up")["ToyForCausalLM"] == {"torch.nn.Linear"}
    assert resolved("**.q_proj")["ToyModel"] == {"torch.nn.Linear"}
    assert "Layer" not in resolved("**.self_attn")  # Layer holds self_attn at depth 1: '**' needs one more
    assert resolved("**.self_attn")["ToyModel"] == {"Attention"}


RUNTIME_CHOICE = textwrap.dedent(
    '''
    from torch import nn


    class Mamba(nn.Module):
        def forward(self, x):
            return x


    class Attention(nn.Module):
        def forward(self, x):
            return x


    class Moe(nn.Module):
        def forward(self, x):
            return x


    class MLP(nn.Module):
        def forward(self, x):
            return x


    MIXERS = {"mamba": Mamba, "attention": Attention}


    class Block(nn.Module):
        def __init__(self, config, i):
            super().__init__()
            self.mixer = MIXERS[config.kinds[i]](config)
            ffn_class = Moe if config.experts > 1 else MLP
            self.feed_forward = ffn_class(config)

        def forward(self, x):
            return self.feed_forward(self.mixer(x))


    class LoopModel(nn.Module):
        def __init__(self, config):
            super().__init__()
            layers = []
            for i in range(config.n):
                layer_class = {"a": Block, "b": MLP}[config.kinds[i]]
                layers.append(layer_class(config, i))
            self.layers = nn.ModuleList(layers)
            self.extra = nn.ModuleList()
            for i in range(2):
                self.extra.append(Moe(config))

        def forward(self, x):
            return x
    '''
)


def test_classes_chosen_at_run_time_are_every_candidate() -> None:
    """A table entry (module-level or inline dict), a local alias of a conditional expression, a local
    list filled by append, and a ModuleList attribute filled by append (Jamba, Nemotron-H, Inkling)."""
    facts = analyze(MOD, RUNTIME_CHOICE)
    assert facts.resolve("Block", "mixer") == {"Mamba", "Attention"}
    assert facts.resolve("Block", "feed_forward") == {"Moe", "MLP"}
    assert facts.resolve("LoopModel", "layers.*") == {"Block", "MLP"}
    assert facts.resolve("LoopModel", "layers.0.feed_forward") == {"Moe", "MLP"}
    assert facts.resolve("LoopModel", "extra.1") == {"Moe"}
    assert facts.resolve("LoopModel", "layers.*.mixer") == {"Mamba", "Attention"}


RANKS = textwrap.dedent(
    '''
    import torch
    from torch import nn

    class Attn(nn.Module):
        def __init__(self, config, shape):
            super().__init__()
            self.sinks = nn.Parameter(torch.zeros(config.heads)) if config.sinks else None
            self.scale = nn.Parameter(torch.full((config.heads,), 0.5))
            self.experts = nn.Parameter(torch.empty(4, 8, 2))
            self.packed = nn.Parameter(torch.empty((4, 8)))
            self.made = nn.Parameter(torch.empty(shape))
            self.unknown = nn.Parameter(config.init)
            self.a, (self.b, self.c) = 1, (2, 3)

    class Dynamic(Attn):
        def __init__(self, config):
            super().__init__(config, (1,))
            setattr(self, config.name, nn.Linear(2, 2))
    '''
)


def test_parameter_ranks_and_assigned_attributes() -> None:
    """What ``Plan.auto`` reads for raw parameters (a vector is cut on dim 0) and for ``_tp_plan``
    keys naming nothing (dropped only where no ``__init__`` may set the name)."""
    facts = analyze(MOD, RANKS)
    ranks = {p: facts.param_rank("Attn", p) for p in sorted(facts.params("Attn"))}
    assert ranks == {"experts": 3, "made": None, "packed": 2, "scale": 1, "sinks": 1, "unknown": None}
    assert "sinks" in facts.conditional("Attn")
    assert all(facts.assigns("Attn", a) for a in ("a", "b", "c", "sinks"))
    assert not facts.assigns("Attn", "lm_head")
    assert facts.assigns("Dynamic", "lm_head")  # setattr: any name
