"""The transition -> op table (hp_lazy.plan.transitions) and the form classifier."""

from __future__ import annotations

import ast

import pytest

from hp_lazy.errors import PlanError
from hp_lazy.lower.classify import classify
from hp_lazy.lower.facts import forward_facts
from hp_lazy.plan.model import Contract, Region
from hp_lazy.plan.placement import Placement
from hp_lazy.plan.transitions import Op, output_index, transition_op

P = Placement.parse


def facts(src: str):
    fn = ast.parse(src).body[0]
    return forward_facts(fn, owner="Block")


ENTRY_SHARDED = [
    ("R", "R", Op("copy_to")),
    ("S(1)", "R", Op("gather_to", (1,))),
    ("R", "S(-1)", Op("scatter_to", (-1,))),
    ("S(1)", "S(2)", Op("all_to_all", (1, 2))),
    ("S(1)", "S(1)", None),
]
PLAIN = [
    ("R", "R", None),
    ("P(sum)", "P(sum)", None),
    ("P(sum)", "R", Op("reduce_from")),
    ("P(sum)", "S(1)", Op("reduce_scatter_to", (1,))),
    ("S(0)", "R", Op("gather_from", (0,))),
    ("R", "S(2)", Op("scatter_to", (2,))),
    ("S(1)", "S(2)", Op("all_to_all", (1, 2))),
]


@pytest.mark.parametrize(("src", "dst", "op"), ENTRY_SHARDED)
def test_entry_into_sharded_params(src: str, dst: str, op: Op | None) -> None:
    assert transition_op(P(src), P(dst), entering_sharded=True) == op


@pytest.mark.parametrize(("src", "dst", "op"), PLAIN)
def test_exit_and_unsharded_entry(src: str, dst: str, op: Op | None) -> None:
    assert transition_op(P(src), P(dst), entering_sharded=False) == op


@pytest.mark.parametrize(("src", "dst", "sharded"), [("R", "P(sum)", False), ("S(0)", "P(sum)", False), ("P(sum)", "R", True)])
def test_unsupported_transition_names_both_placements(src: str, dst: str, sharded: bool) -> None:
    with pytest.raises(PlanError, match=rf"attn: input 'x' on tp: {re_esc(src)} -> {re_esc(dst)}.*has no collective"):
        transition_op(P(src), P(dst), entering_sharded=sharded, where="attn: input 'x' on tp")


def test_packed_shard_is_for_parameters_only() -> None:
    with pytest.raises(PlanError, match=r"packed shard SS\(0,2\) is for parameters only"):
        transition_op(P("SS(0,2)"), P("R"), entering_sharded=False)


def re_esc(text: str) -> str:
    import re

    return re.escape(text)


def contract(**kw) -> Contract:
    conv = {k: {n: {a: P(p) for a, p in ax.items()} for n, ax in v.items()} for k, v in kw.items() if k != "extra"}
    return Contract(pattern="layers.*.attn", **conv, **kw.get("extra", {}))


ATTN = dict(
    in_src={"hidden_states": {"tp": "R"}},
    in_dst={"hidden_states": {"tp": "R"}},
    out_src={"output": {"tp": "P(sum)"}},
    out_dst={"output": {"tp": "R"}},
    params={"o.weight": {"tp": "S(1)"}},
)
TUPLE_FWD = "def forward(self, hidden_states, mask=None, **kwargs):\n    return hidden_states, None\n"


def test_tp_collective_with_ops() -> None:
    d = classify(contract(**ATTN), facts(TUPLE_FWD), {"tp": 2})
    assert d.form == "tp_collective"
    assert [(o.name, o.axis, o.op.call, o.position) for o in d.in_ops] == [("hidden_states", "tp", "copy_to", None)]
    assert [(o.name, o.op.call, o.position) for o in d.out_ops] == [("output", "reduce_from", 0)]
    assert d.in_ops[0].describe() == "hidden_states: tp R -> R into sharded params ==> copy_to"


def test_degree_one_axis() -> None:
    d = classify(contract(**ATTN), facts(TUPLE_FWD), {"tp": 1})
    assert (d.form, d.in_ops, d.out_ops) == ("identity", (), ())


def test_identity_when_nothing_changes() -> None:
    d = classify(contract(in_src={"hidden_states": {"tp": "R"}}), facts(TUPLE_FWD), {"tp": 2})
    assert d.form == "identity"


@pytest.mark.parametrize(
    ("src", "reason"),
    [
        ("def forward(self, hidden_states, *args):\n    return hidden_states\n", "forward takes *args"),
        ("def forward(self, hidden_states):\n    if hidden_states:\n        return\n    return 1\n", "line 3"),
        ("def forward(self, hidden_states):\n    hidden_states.add_(1)\n", "can return without a value"),
        ("def forward(self, hidden_states):\n    return (*hidden_states,)\n", "not fixed by the returns (starred)"),
        ("def forward(self, hidden_states):\n    return [hidden_states]\n", "not fixed by the returns (list)"),
        ("def forward(self, h, **kw):\n    return h\n", "inputs ['hidden_states'] are not named forward parameters"),
    ],
)
def test_structural_gates_fall_back_to_generic(src: str, reason: str) -> None:
    d = classify(contract(**ATTN), facts(src), {"tp": 2})
    assert d.form == "generic"
    assert reason in "; ".join(d.reasons)


def test_tuple_position_must_be_in_every_return() -> None:
    spec = dict(ATTN, out_src={"output.2": {"tp": "P(sum)"}}, out_dst={"output.2": {"tp": "R"}})
    fwd = "def forward(self, hidden_states):\n    if hidden_states:\n        return 1, 2, 3\n    return 1, 2\n"
    d = classify(contract(**spec), facts(fwd), {"tp": 2})
    assert d.form == "generic" and "output position 2 is not in every return" in d.reasons[0]
    ok = "def forward(self, hidden_states):\n    def inner():\n        return 1\n    return 1, 2, 3\n"
    d = classify(contract(**spec), facts(ok), {"tp": 2})
    assert d.form == "tp_collective" and d.out_ops[0].position == 2


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"region": Region(kind="ep_dispatch")},
         r"layers\.\*\.attn\.region: kind 'ep_dispatch' replaces the module's compute at run time \(runtime/ep\)"),
    ],
)
def test_unimplemented_inner_ops_and_regions_are_never_lowered_silently(extra: dict, expected: str) -> None:
    with pytest.raises(PlanError, match=expected):
        classify(contract(**ATTN, extra=extra), facts(TUPLE_FWD), {"tp": 2})


def test_unknown_input_name_is_a_plan_error() -> None:
    fwd = "def forward(self, x):\n    return x\n"
    with pytest.raises(PlanError, match=r"layers.\*.attn: input 'hidden_states' is not a parameter of Block.forward\(x\)"):
        classify(contract(**ATTN), facts(fwd), {"tp": 2})


def test_deferred_bias_needs_a_reduction() -> None:
    spec = dict(ATTN, out_src={}, out_dst={}, extra={"deferred_bias_params": ("o.bias",)})
    with pytest.raises(PlanError, match=r"deferred_bias_params \['o.bias'\] need a P\(sum\) output"):
        classify(contract(**spec), facts(TUPLE_FWD), {"tp": 2})


def test_bad_output_key() -> None:
    spec = dict(ATTN, out_src={"logits": {"tp": "P(sum)"}}, out_dst={})
    with pytest.raises(PlanError, match=r"output key 'logits' is not 'output' or 'output.<i>'"):
        classify(contract(**spec), facts(TUPLE_FWD), {"tp": 2})


def test_output_index() -> None:
    assert (output_index("output"), output_index("output.0"), output_index("output.12")) == (0, 0, 12)
    with pytest.raises(PlanError, match=r"^attn: output key 'output.x' is not 'output' or 'output.<i>'; use 'output'"):
        output_index("output.x", where="attn")


def test_axis_order_entry_outer_first_exit_inner_first() -> None:
    spec = dict(
        in_src={"hidden_states": {"tp": "S(1)", "cp": "S(1)"}},
        in_dst={"hidden_states": {"tp": "R", "cp": "R"}},
        out_src={"output": {"tp": "R", "cp": "R"}},
        out_dst={"output": {"tp": "S(1)", "cp": "S(1)"}},
    )
    d = classify(contract(**spec), facts(TUPLE_FWD), {"tp": 2, "cp": 2})
    assert [o.axis for o in d.in_ops] == ["cp", "tp"]
    assert [o.axis for o in d.out_ops] == ["tp", "cp"]
