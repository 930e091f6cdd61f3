"""lower(): facts, errors, determinism, real transformers sources, runtime behaviour of the output."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import traceback
import types
from dataclasses import replace
from pathlib import Path

import pytest

from hp_lazy.errors import LoweringError, PlanError
from hp_lazy.lower import lower, lower_source
from hp_lazy.lower.facts import forward_facts, module_facts
from hp_lazy.plan.model import Contract, ModulePlan, Region
from hp_lazy.plan.placement import Placement

P = Placement.parse
R, PSUM, S0, S1 = P("R"), P("P(sum)"), P("S(0)"), P("S(1)")


def attn_contract(pattern: str = "model.layers.*.self_attn", name: str = "hidden_states", **kw) -> Contract:
    return Contract(
        pattern=pattern,
        in_src={name: {"tp": R}},
        in_dst={name: {"tp": R}},
        out_src={"output": {"tp": PSUM}},
        out_dst={"output": {"tp": R}},
        params={"q_proj.weight": {"tp": S0}, "o_proj.weight": {"tp": S1}},
        **kw,
    )


def plan(classes: dict, contracts: tuple, roots: tuple = (), module: str = "pkg.mod", **kw) -> ModulePlan:
    return ModulePlan(
        module=module, plan_hash="h", mesh={"tp": 2}, contracts=contracts, classes=classes, roots=roots, **kw
    )


SIMPLE = textwrap.dedent(
    '''
    class Block:
        def forward(self, hidden_states, scale=2):
            y = hidden_states * scale
            return y, None


    class Head:
        def forward(self, x):
            return x
    '''
)


# ---------------------------------------------------------------- facts


def test_forward_facts_ignore_nested_scopes() -> None:
    src = "def forward(self, a, /, b=1, *args, c, d=2, **kw):\n    def f():\n        return\n    g = lambda: 1\n    return a, b\n"
    f = forward_facts(ast.parse(src).body[0], owner="X")
    assert [(p.name, p.kind, p.has_default) for p in f.params] == [
        ("a", "positional_only", False),
        ("b", "positional", True),
        ("c", "keyword_only", False),
        ("d", "keyword_only", True),
    ]
    assert (f.self_name, f.vararg, f.kwarg) == ("self", "args", "kw")
    assert f.output_layout() == ("tuple", 2) and f.every_return_has_value()


def test_forward_facts_falling_off_the_end_is_a_bare_return() -> None:
    f = forward_facts(ast.parse("def forward(self, x):\n    if x:\n        return x\n").body[0])
    assert [r.kind for r in f.returns] == ["value", "bare"]
    f = forward_facts(ast.parse("def forward(self, x):\n    if x:\n        return x\n    else:\n        return 1\n").body[0])
    assert [r.kind for r in f.returns] == ["value", "value"]


def test_module_facts_forward_owner_follows_the_mro() -> None:
    src = textwrap.dedent(
        '''
        """Doc."""
        from __future__ import annotations
        from __future__ import division
        import x
        class A:
            def forward(self): return 1
        class B(A): pass
        class C(x.Mixin, B): pass
        class D(B): pass
        class A2(A):
            def forward(self): return super().forward()
        class E(A2): pass
        '''
    )
    mod = module_facts(ast.parse(src), "m")
    assert mod.docstring == "Doc." and mod.future_imports == ("annotations", "division") and mod.insert_at == 3
    owners = {c.name: c.forward_owner for c in mod.classes}
    assert owners == {"A": "A", "B": "A", "C": None, "D": "A", "A2": "A2", "E": "A2"}
    assert "uses 'super'" in mod.cls("E").copy_blocker


@pytest.mark.parametrize("name", ["_hp_cache", "__hp_rt__"])
def test_reserved_names_are_an_error(name: str) -> None:
    src = SIMPLE + f"\n{name} = 1\n"
    with pytest.raises(LoweringError, match=rf"pkg.mod: line 12: the name '{name}' starts with '_hp_' or '__hp_'.*rename it"):
        lower(src, plan({"b": "Block"}, (attn_contract("b"),)))


# ---------------------------------------------------------------- errors


def test_existing_forward_impl_is_an_error() -> None:
    src = SIMPLE.replace("class Head:", "class Head:\n    def _forward_impl(self): pass")
    with pytest.raises(LoweringError, match=r"pkg.mod: class Head already defines '_forward_impl'"):
        lower(src, plan({"h": "Head"}, (attn_contract("h", "x"),)))


def test_unknown_class_and_root_are_errors() -> None:
    with pytest.raises(LoweringError, match=r"pkg.mod: b maps to class 'Nope', which the module does not define"):
        lower(SIMPLE, plan({"b": "Nope"}, (attn_contract("b"),)))
    with pytest.raises(LoweringError, match=r"pkg.mod: root class 'Nope' is not defined"):
        lower(SIMPLE, plan({}, (), roots=("Nope",)))


def test_one_class_two_different_contracts_is_an_error() -> None:
    other = Contract(pattern="c", in_src={"hidden_states": {"tp": S1}}, in_dst={"hidden_states": {"tp": R}})
    with pytest.raises(PlanError, match=r"pkg.mod: class Block serves b and c with different boundary code"):
        lower(SIMPLE, plan({"b": "Block", "c": "Block"}, (attn_contract("b"), other)))


def test_same_contract_twice_and_leaf_classes_lower_once() -> None:
    tree = lower(SIMPLE, plan({"b": "Block", "c": "Block", "lm": "torch.nn.Linear"}, (attn_contract("b"), attn_contract("c"))))
    assert ast.unparse(tree).count("def _forward_impl") == 1


def test_boundary_decisions_match_what_lower_emits() -> None:
    from hp_lazy.lower import boundary_decisions

    src = SIMPLE + "\nclass Sub(dict):\n    pass\n"
    contracts = (attn_contract("b"), attn_contract("s"), attn_contract("k", skip_source_lowering=True))
    got = boundary_decisions(src, plan({"b": "Block", "s": "Sub", "k": "Head", "lm": "torch.nn.Linear"}, contracts))
    assert {p: (c, d.form) for p, (c, d) in got.items()} == {"b": ("Block", "tp_collective"), "s": ("Sub", "generic")}


def test_unimplemented_region_is_refused_not_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    from hp_lazy.plan import model as plan_model

    monkeypatch.setattr(plan_model, "IMPLEMENTED", frozenset({"cp_allgather_kv", "cp_ulysses"}))
    contract = attn_contract("b", region=Region(kind="ep_dispatch"))
    with pytest.raises(PlanError, match=r"^b\.region: kind 'ep_dispatch' \(expert parallel\) is not implemented yet"):
        lower(SIMPLE, plan({"b": "Block"}, (contract,)))


def test_nothing_to_do_returns_the_source_tree() -> None:
    skip = attn_contract("b", skip_source_lowering=True)
    tree = lower(SIMPLE, plan({"b": "Block"}, (skip,)))
    assert ast.dump(tree) == ast.dump(ast.parse(SIMPLE))


# ---------------------------------------------------------------- determinism


def test_output_does_not_depend_on_plan_order() -> None:
    a, h = attn_contract("b"), attn_contract("h", "x")
    one = plan({"b": "Block", "h": "Head"}, (a, h), roots=("Head", "Block"))
    two = plan({"h": "Head", "b": "Block"}, (h, a), roots=("Block", "Head"))
    assert ast.unparse(lower(SIMPLE, one)) == ast.unparse(lower(SIMPLE, two))


def test_output_does_not_depend_on_placement_dict_order() -> None:
    def contract(names: list[str], axes: list[str]) -> Contract:
        src = {n: {a: S1 for a in axes} for n in names}
        dst = {n: {a: R for a in axes} for n in names}
        return Contract(pattern="b", in_src=src, in_dst=dst, out_src={"output": {"tp": PSUM}}, out_dst={"output": {}})

    mesh_plan = {"classes": {"b": "Block"}, "mesh": {"tp": 2, "cp": 2}}
    texts = {
        ast.unparse(lower(SIMPLE, ModulePlan(module="m", plan_hash="h", contracts=(contract(n, a),), roots=(), **mesh_plan)))
        for n, a in [(["hidden_states", "scale"], ["tp", "cp"]), (["scale", "hidden_states"], ["cp", "tp"])]
    }
    assert len(texts) == 1
    text = texts.pop()
    assert text.index("hidden_states = __hp_rt__.gather_from(hidden_states, _hp_b.cp, 1)") < text.index(
        "scale = __hp_rt__.gather_from(scale, _hp_b.tp, 1)"
    )


# ---------------------------------------------------------------- behaviour of the lowered code


class FakeRuntime(types.ModuleType):
    """Records every runtime call; ops tag their tensors so the order shows."""

    def __init__(self) -> None:
        super().__init__("hp_lazy.runtime.rt")
        self.calls: list[str] = []

    def unbound(self, qualname: str) -> object:
        class Unbound:
            def __getattr__(self, name: str) -> object:
                raise RuntimeError(f"{qualname} is not bound; call hp_lazy.parallelize(model)")

        return Unbound()

    def copy_to(self, x, g):
        self.calls.append(f"copy_to({x}, {g})")
        return f"c({x})"

    def reduce_from(self, x, g):
        self.calls.append(f"reduce_from({x}, {g})")
        return f"r({x})"

    def add_deferred_bias(self, x, b):
        self.calls.append(f"add_deferred_bias({x})")
        return f"b({x})"

    def lazy_root(self, cls) -> None:  # the lazy-module protocol: run-time only, not under test here
        return None

    def ensure_parallel(self, module):
        self.calls.append(f"ensure_parallel({type(module).__name__})")


@pytest.fixture()
def fake_rt(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    rt = FakeRuntime()
    pkg = types.ModuleType("hp_lazy.runtime")
    pkg.rt = rt  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hp_lazy.runtime", pkg)
    monkeypatch.setitem(sys.modules, "hp_lazy.runtime.rt", rt)
    import hp_lazy  # ``import hp_lazy.runtime.rt as x`` reads the attribute chain when it is set

    monkeypatch.setattr(hp_lazy, "runtime", pkg, raising=False)
    return rt


def run_lowered(module_plan: ModulePlan, source: str = SIMPLE, filename: str = "simple.py") -> dict:
    namespace: dict = {"__name__": module_plan.module}
    exec(compile(lower(source, module_plan, filename), filename, "exec"), namespace)
    return namespace


def test_bound_unbound_and_non_boundary_instances(fake_rt: FakeRuntime) -> None:
    ns = run_lowered(plan({"b": "Block"}, (attn_contract("b", deferred_bias_params=("o_proj.bias",)),), roots=("Block",)))
    block = ns["Block"]()
    with pytest.raises(RuntimeError, match="pkg.mod.Block is not bound; call hp_lazy.parallelize"):
        block.forward("h")
    block._hp_b = None  # an instance of a bound model that is not a boundary: original forward
    assert block.forward("h", scale=3) == ("hhh", None)
    block._hp_b = types.SimpleNamespace(tp="G")
    fake_rt.calls.clear()
    assert block.forward("h", 1) == ("b(r(c(h)))", None)
    assert fake_rt.calls == ["ensure_parallel(Block)", "copy_to(h, G)", "reduce_from(c(h), G)", "add_deferred_bias(r(c(h)))"]
    assert ns["Block"]._hp_form == "tp_collective"


def test_traceback_in_forward_impl_points_at_the_original_line(fake_rt: FakeRuntime) -> None:
    ns = run_lowered(plan({"b": "Block"}, (attn_contract("b"),)))
    block = ns["Block"]()
    block._hp_b = None
    with pytest.raises(TypeError) as info:
        block.forward(object())
    frames = traceback.extract_tb(info.tb)
    assert (frames[-1].name, frames[-1].lineno, frames[-1].filename) == ("_forward_impl", 4, "simple.py")
    assert (frames[-2].name, frames[-2].lineno) == ("forward", 3)


# ---------------------------------------------------------------- real transformers sources


def _transformers_source(family: str) -> tuple[str, str]:
    spec = __import__("importlib.util").util.find_spec(f"transformers.models.{family}.modeling_{family}")
    if spec is None or spec.origin is None:
        pytest.skip("transformers is not installed")
    return spec.name, Path(spec.origin).read_text()


@pytest.mark.parametrize(("family", "prefix"), [("llama", "Llama"), ("qwen3", "Qwen3")])
def test_real_modeling_sources_lower_and_compile(family: str, prefix: str) -> None:
    name, source = _transformers_source(family)
    mlp = attn_contract("model.layers.*.mlp", "x")
    attn = attn_contract(deferred_bias_params=("o_proj.bias",))
    classes = {"model.layers.*.self_attn": f"{prefix}Attention", "model.layers.*.mlp": f"{prefix}MLP"}
    tree = lower(source, plan(classes, (attn, mlp), roots=(f"{prefix}ForCausalLM",), module=name), filename=f"{family}.py")
    compile(tree, f"{family}.py", "exec")
    text = ast.unparse(tree)
    assert "ALL_ATTENTION_FUNCTIONS.get_interface(" in text
    assert text.count("_hp_form = 'tp_collective'") == 2
    assert "x = __hp_rt__.copy_to(x, _hp_b.tp)" in text
    assert "__hp_rt__.add_deferred_bias(__hp_rt__.reduce_from(_hp_out[0], _hp_b.tp), _hp_b)" in text
    assert "@deprecate_kwarg('past_key_values', '5.40.0', new_name='cache')\n    def forward" in text


def test_qwen3_moe_keeps_strings_transformers_greps_for_and_refuses_a_region() -> None:
    name, source = _transformers_source("qwen3_moe")
    moe = Contract(pattern="model.layers.*.mlp", in_src={"hidden_states": {"ep": R}}, params={"experts.down_proj": {"ep": S0}})
    module_plan = ModulePlan(
        module=name,
        plan_hash="h",
        mesh={"ep": 2},
        contracts=(moe,),
        classes={"model.layers.*.mlp": "Qwen3MoeSparseMoeBlock"},
        roots=(),
    )
    tree = lower(source, module_plan, filename="qwen3_moe.py")
    compile(tree, "qwen3_moe.py", "exec")
    text = ast.unparse(tree)
    assert "@use_experts_implementation\nclass Qwen3MoeExperts" in text
    assert "hidden_states = __hp_rt__.copy_to(hidden_states, _hp_b.ep)" in text
    region = Contract(pattern=moe.pattern, in_src=moe.in_src, params=moe.params, region=Region(kind="ep_dispatch"))
    with pytest.raises(PlanError, match=r"model.layers.\*.mlp.region: kind 'ep_dispatch' replaces the module's compute at "
                       r"run time \(runtime/ep\), so its class is not rewritten from source; add "
                       r"\"skip_source_lowering\": true"):
        lower(source, replace(module_plan, contracts=(region,)), filename="qwen3_moe.py")


# ---------------------------------------------------------------- one parse per import


INHERITING = SIMPLE + textwrap.dedent(
    """

    class Sub(Block):
        pass


    class Top:
        def forward(self, x):
            return x


    class Child(Top):
        pass
    """
)


def test_lowering_leaves_the_shared_parse_as_parsed() -> None:
    from hp_lazy.plan.source import parse_source

    before = ast.dump(parse_source(INHERITING), include_attributes=True)
    module_plan = plan({"b": "Block", "s": "Sub"}, (attn_contract("b"), attn_contract("s")), roots=("Top", "Child"))
    first = ast.unparse(lower(INHERITING, module_plan))
    assert ast.dump(parse_source(INHERITING), include_attributes=True) == before
    assert ast.unparse(lower(INHERITING, module_plan)) == first
    assert first.count("def _forward_impl") == 2 and "__hp_rt__.install_root(Child)" in first
    assert "def forward(self, x):\n        __hp_rt__.ensure_parallel(self)\n        return x" in first


def test_slice_and_lower_parse_the_source_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import uuid

    from hp_lazy.plan import Plan
    from hp_lazy.plan import source as source_mod

    calls: list[str] = []
    real_parse = ast.parse
    monkeypatch.setattr(source_mod.ast, "parse", lambda text, *a, **k: calls.append(text) or real_parse(text, *a, **k))
    text = SIMPLE + f"\n# {uuid.uuid4()}\n"
    raw = {"mesh": {"tp": 2}, "modules": ["pkg.mod"], "boundaries": {"b": {"params": {"w": {"tp": "S(1)"}},
           "in_src": {"hidden_states": {"tp": "R"}}, "out_src": {"output": {"tp": "P(sum)"}}}},
           "boundary_classes": {"b": "Block"}}
    module_plan = Plan.from_dict(raw).slice("pkg.mod", text)
    compile(lower(text, module_plan, "simple.py"), "simple.py", "exec")
    assert calls.count(text) == 1  # (the other parses are the generated fragments)


# ---------------------------------------------------------------- import hygiene and lower_source


def test_lower_does_not_import_torch() -> None:
    code = "import sys, hp_lazy.lower; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_lower_source_uses_the_plan_slice() -> None:
    from hp_lazy.plan import Plan

    boundary = {
        "in_src": {"hidden_states": {"tp": "R"}},
        "in_dst": {"hidden_states": {"tp": "R"}},
        "out_src": {"output": {"tp": "P(sum)"}},
        "out_dst": {"output": {"tp": "R"}},
        "params": {"w": {"tp": "S(1)"}},
    }
    raw = {"version": 1, "mesh": {"tp": 2}, "modules": ["pkg.mod"], "boundaries": {"b": boundary}, "boundary_classes": {"b": "Block"}}
    text = lower_source(SIMPLE, raw, "pkg.mod")
    module_plan = Plan.from_dict(raw).slice("pkg.mod", SIMPLE)
    assert text == ast.unparse(lower(SIMPLE, module_plan))
    assert "hidden_states = __hp_rt__.copy_to(hidden_states, _hp_b.tp)" in text
    assert lower_source(SIMPLE, raw, "pkg.other") == ast.unparse(ast.parse(SIMPLE))
