"""Whatever a user hands in, turning it into a Plan either builds one or raises PlanError naming the
place, with a bounded message: JSON text and files (nesting, BOM, repeated keys, bytes, digits),
data of any shape, ``load_plan``'s forms, and module globs that reach hp_lazy's own dependencies."""

from __future__ import annotations

import copy
import json
import math
import os
import random
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hp_lazy.errors import PlanError
from hp_lazy.hook.api import load_plan
from hp_lazy.plan import Plan
from hp_lazy.plan.fqn import shown
from hp_lazy.plan.parse import MAX_DEGREE, OWN_DEPENDENCIES, check_module

ATTN = "model.layers.*.self_attn"
MAX_MESSAGE = 600


def llama_plan() -> dict[str, Any]:
    """The README's explicit plan, plus lm_head and a class."""
    return {
        "version": 1, "mesh": {"tp": 2}, "modules": ["transformers.models.llama.modeling_llama"],
        "boundaries": {
            ATTN: {
                "in_src": {"hidden_states": {"tp": "R"}}, "in_dst": {"hidden_states": {"tp": "R"}},
                "out_src": {"output": {"tp": "P(sum)"}}, "out_dst": {"output": {"tp": "R"}},
                "params": {"q_proj.weight": {"tp": "S(0)"}, "k_proj.weight": {"tp": "S(0)"},
                           "v_proj.weight": {"tp": "S(0)"}, "o_proj.weight": {"tp": "S(1)"}},
                "deferred_bias_params": ["o_proj.bias"],
            },
            "lm_head": {"out_src": {"output": {"tp": "S(-1)"}}, "out_dst": {"output": {"tp": "R"}},
                        "params": {"weight": {"tp": "S(0)"}}, "skip_source_lowering": True},
        },
        "boundary_classes": {ATTN: "LlamaAttention"},
    }


def two_axis_plan() -> dict[str, Any]:
    return {
        "mesh": {"ep": 2, "tp": 2}, "modules": ["pkg.models.*.modeling_*"],
        "boundaries": {"layers.*.mlp": {"params": {"experts.gate_up_proj": {"ep": "S(0)", "tp": "SS(-1,2)"},
                                                   "experts.down_proj": {"ep": "S(0)", "tp": "S(1)"}},
                                        "grad_sum_params": ["norm.*"], "optional_params": ["bias"]}},
    }


def deep_list(depth: int) -> list:
    root: list = []
    node = root
    for _ in range(depth):
        node.append([])
        node = node[0]
    return root


def error(build: Callable[[], object]) -> str:
    with pytest.raises(PlanError) as info:
        build()
    return str(info.value)


# ---------------------------------------------------------------- JSON text and files


def test_deep_json_text_is_refused_before_json_recurses(tmp_path: Path) -> None:
    expected = r"^plan text: nesting deeper than 16 levels at line 1 column 17; a plan is 5 objects deep"
    with pytest.raises(PlanError, match=expected):
        Plan.from_json("[" * 100_000)
    with pytest.raises(PlanError, match=r"^plan text: nesting deeper than 16 levels at line 2 column 36;"):
        Plan.from_json('{"version": 1,\n "boundaries": {"a": ' + "[" * 100_000)
    path = tmp_path / "deep.json"
    path.write_text('{"mesh": ' + '{"a": ' * 50_000 + "1" + "}" * 50_001)
    with pytest.raises(PlanError, match=r"deep\.json': nesting deeper than 16 levels at line 1 column "):
        Plan.from_json(path)


def test_brackets_inside_strings_are_not_nesting() -> None:
    text = json.dumps({**llama_plan(), "boundary_classes": {ATTN: "LlamaAttention"}})
    assert Plan.from_json(text.replace('"R"', '" R "')) == Plan.from_dict(llama_plan())
    with pytest.raises(PlanError, match=r"^plan: unknown key '\[\[\[\[\[\[\[\[\[\[\[\[\[\[\[\[\[\[\\\\\"\[\[\[\[\["):
        Plan.from_json('{"' + "[" * 18 + '\\\\\\"' + "[" * 30 + '": 1}')


def test_a_bom_starts_json_text_and_files(tmp_path: Path) -> None:
    plan = Plan.from_dict(llama_plan())
    assert Plan.from_json("\ufeff" + plan.to_json()) == plan
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + plan.to_json(indent=2).encode())
    assert Plan.from_json(path) == plan == load_plan(str(path))
    assert load_plan("\ufeff  " + plan.to_json()) == plan


def test_repeated_keys_are_an_error_naming_the_key_and_where() -> None:
    cases = {
        '{"version": 1, "version": 1}': r"^plan: key 'version' appears twice in one object \(JSON would keep the "
                                        r"last\); keep one$",
        '{"mesh": {"tp": 2, "tp": 4}}': r"^plan\.mesh: key 'tp' appears twice",
        '{"boundaries": {"a": {}, "a": {}}}': r"^plan\.boundaries: key 'a' appears twice",
        '{"boundaries": {"a": {"params": {"w": {"tp": "R", "tp": "S(0)"}}}}}':
            r"^plan\.boundaries\['a'\]\.params\['w'\]: key 'tp' appears twice",
        '{"boundaries": {"a": {"inner": {"call": "attention", "call": "x"}}}}':
            r"^plan\.boundaries\['a'\]\.inner: key 'call' appears twice",
        '{"auto": {"tp": 2, "tp": 2}}': r"^plan\.auto: key 'tp' appears twice",
        '{"modules": ["m", {"x": 1, "x": 1}]}': r"^plan\.modules\[1\]: key 'x' appears twice",
    }
    for text, expected in cases.items():
        with pytest.raises(PlanError, match=expected):
            Plan.from_json(text)


def test_the_outer_repeat_is_named_when_an_inner_one_was_overwritten() -> None:
    with pytest.raises(PlanError, match=r"^plan: key 'mesh' appears twice"):
        Plan.from_json('{"mesh": {"tp": 1, "tp": 2}, "mesh": {"tp": 2}}')


def test_integers_past_pythons_digit_limit(tmp_path: Path) -> None:
    limit = sys.get_int_max_str_digits()
    digits = "9" * (limit + 1)
    with pytest.raises(PlanError, match=rf"^plan text: the integer at line 1 column 17 has {limit + 1} digits, more "
                                        rf"than Python reads \({limit}\); fix the file$"):
        Plan.from_json('{"mesh": {"tp": ' + digits + "}}")
    path = tmp_path / "big.json"
    path.write_text('{"version": -' + digits + "}")
    with pytest.raises(PlanError, match=rf"big\.json': the integer at line 1 column 13 has {limit + 1} digits"):
        load_plan(path)
    with pytest.raises(PlanError, match=r"^plan\.mesh\['tp'\]: degree <an int of 4001 digits> is above 1048576; "
                                        r"use the number of ranks on the axis$"):
        Plan.from_json('{"mesh": {"tp": 1' + "0" * 4000 + "}}")


def test_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"version": 1,\n "modules": ["caf\xe9"]}')
    with pytest.raises(PlanError, match=r"latin1\.json': byte 0xe9 at line 2 \(offset 32\) is not UTF-8 \(invalid "
                                        r"continuation byte\); save the file as UTF-8$"):
        Plan.from_json(path)
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(PlanError, match=r"byte 0xff at line 1 \(offset 0\) is not UTF-8 \(invalid start byte\)"):
        load_plan(str(path))


def test_paths_that_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=rf"^plan file '{tmp_path}': cannot be read \(Is a directory\); pass JSON "
                                        r"text, the path of an existing \.json plan file"):
        Plan.from_json(tmp_path)
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)  # no writer: a blocking open would wait forever
    with pytest.raises(PlanError, match=r"cannot be read \(not a regular file\)"):
        Plan.from_json(fifo)
    with pytest.raises(PlanError, match=r"^plan file '/dev/null': cannot be read \(not a regular file\)"):
        Plan.from_json("/dev/null")
    with pytest.raises(PlanError, match=r"^plan file 'a\\x00b': cannot be read \(a path holds no NUL character\)"):
        Plan.from_json("a\0b")
    with pytest.raises(PlanError, match=r"^plan file 'xxxxx.*\.\.\. \(a str of 5000 characters\): cannot be read "
                                        r"\(File name too long\)"):
        Plan.from_json("x" * 5000)
    with pytest.raises(PlanError, match=r"^plan: 5 \(a int\) is neither JSON text nor a path; pass a str or a Path$"):
        Plan.from_json(5)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"^plan: b'\{\}' \(a bytes\) is neither JSON text nor a path"):
        Plan.from_json(b"{}")  # type: ignore[arg-type]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "secret.json"
    path.write_text("{}")
    path.chmod(0)
    with pytest.raises(PlanError, match=r"secret\.json': cannot be read \(Permission denied\)"):
        Plan.from_json(path)


def test_json_text_whose_top_level_is_not_an_object() -> None:
    with pytest.raises(PlanError, match=r"^plan text: the top level is a list; write a JSON object \{\"version\": 1"):
        Plan.from_json("[1, 2]")
    with pytest.raises(PlanError, match=r"^plan text: invalid JSON at line 1 column 2 \(Expecting property name "):
        Plan.from_json("{oops}")


# ---------------------------------------------------------------- data of any shape


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d.update(mesh=deep_list(100_000)),
         r"^plan\.mesh: \[\[\[\[\[\[\[\.\.\.\]\]\]\]\]\]\] is not a non-empty object"),
        (lambda d: d["boundaries"][ATTN]["params"].update(w={"tp": deep_list(100_000)}),
         rf"^plan\.boundaries\['{ATTN}'\]\.params\['w'\]\['tp'\]: placement \[\[\[\[\[\[\[\.\.\.\]\]\]\]\]\]\] is not "
         r"a string"),
        (lambda d: d["boundaries"].update({1: {}, None: {}, (1, 2): {}}),
         r"^plan\.boundaries: pattern 1 is not a non-empty string; fix the plan$"),
        (lambda d: d.update({None: 1}), r"^plan: unknown key None; allowed keys are \['version'"),
        (lambda d: d.update(mesh={"tp": 2, 3: 2}), r"^plan\.mesh: axis 3 is not one of \['dp', 'cp', 'ep', 'tp'\]"),
        (lambda d: d["boundaries"][ATTN]["params"].update({(1, "a"): {}}),
         rf"^plan\.boundaries\['{ATTN}'\]\.params: param \(1, 'a'\) is not a non-empty string"),
        (lambda d: d["boundaries"][ATTN]["params"]["q_proj.weight"].update({0: "R"}),
         r"\.params\['q_proj\.weight'\]: axis 0 is not in the mesh \['tp'\]"),
        (lambda d: d["boundary_classes"].update({2.5: "X"}),
         r"^plan\.boundary_classes\[2\.5\]: the pattern has no entry in plan\.boundaries"),
        (lambda d: d.update(mesh={"tp": 10**5000}), r"^plan\.mesh\['tp'\]: degree <an int of 5001 digits> is above"),
        (lambda d: d.update(version=-(10**5000)), r"^plan\.version: <an int of 5001 digits> is not a supported version"),
        (lambda d: d.update(mesh={"tp": MAX_DEGREE + 1}), r"^plan\.mesh\['tp'\]: degree 1048577 is above 1048576"),
        (lambda d: d.update(mesh={"tp": 2.0}), r"^plan\.mesh\['tp'\]: degree 2\.0 is not a positive integer; use e\.g\. 2$"),
        (lambda d: d.update(mesh={"tp": math.nan}), r"^plan\.mesh\['tp'\]: degree nan is not a positive integer"),
        (lambda d: d.update(mesh={"tp": math.inf}), r"^plan\.mesh\['tp'\]: degree inf is not a positive integer"),
        (lambda d: d.update(version=1.0), r"^plan\.version: 1\.0 is not a supported version; use 1$"),
        (lambda d: d.update(version=True), r"^plan\.version: True is not a supported version; use 1$"),
        (lambda d: d.update(auto={"tp": True}), r"^plan\.auto\.tp: degree True is not a positive integer; use e\.g\. tp=2$"),
        (lambda d: d["boundaries"][ATTN]["params"].update(w={"tp": "S(" + "9" * 5000 + ")"}),
         r"\.params\['w'\]\['tp'\]: placement 'S\(9{74}\.\.\. \(a str of 5003 characters\) is not one of 'R', "),
        (lambda d: d["boundaries"][ATTN]["out_src"].update({"output." + "9" * 5000: {"tp": "R"}}),
         r"\.out_src: name 'output\.9{69}\.\.\. \(a str of 5007 characters\) is longer than 256 characters; shorten it$"),
        (lambda d: d["boundaries"][ATTN]["params"].update(w={"tp": 5}),
         r"\.params\['w'\]\['tp'\]: placement 5 is not a string; use 'R', 'S\(d\)' or 'P\(sum\)'$"),
        (lambda d: d["boundary_classes"].update({ATTN: 5}), rf"^plan\.boundary_classes\['{ATTN}'\]: 5 is not a class"),
        (lambda d: d.update(modules=[5]), r"^plan\.modules: 5 is not a dotted module name \(globs allowed\)"),
        (lambda d: d.update(modules=["pkg.mod\n"]), r"^plan\.modules: 'pkg\.mod\\n' is not a dotted module name"),
        (lambda d: d["boundaries"][ATTN].update(inner={"call": ["attention"], "kind": "cp_ulysses"}),
         r"\.inner\.call: call \['attention'\] is not one of \['attention'\]; use one of those$"),
        (lambda d: d["boundaries"][ATTN].update(grad_sum_params=[None]),
         r"\.grad_sum_params: param None is not a non-empty string"),
        (lambda d: d["boundaries"][ATTN].update(deferred_bias_params="o_proj.bias"),
         r"\.deferred_bias_params: 'o_proj\.bias' is not a list of parameter names"),
        (lambda d: d["boundaries"][ATTN]["in_src"].update({"x\n": {"tp": "R"}}),
         r"\.in_src: name 'x\\n' has an empty or invalid segment 'x\\n'; fix the plan$"),
    ],
)
def test_bad_data_of_any_shape_is_a_plan_error(edit: Callable[[dict], None], expected: str) -> None:
    data = llama_plan()
    edit(data)
    text = error(lambda: Plan.from_dict(data))
    assert len(text) <= MAX_MESSAGE
    assert re.search(expected, text), text


def test_a_self_containing_plan() -> None:
    data: dict[str, Any] = llama_plan()
    data["boundaries"][ATTN]["inner"] = data
    text = error(lambda: Plan.from_dict(data))
    assert text.startswith(f"plan.boundaries['{ATTN}'].inner: unknown key 'version'; allowed keys are ['call', 'kind']")
    data["boundaries"][ATTN]["inner"] = {"call": data}
    assert error(lambda: Plan.from_dict(data)) == (
        f"plan.boundaries['{ATTN}'].inner: {{'call': {{'version': 1, 'mesh': {{'tp': 2}}, 'modules': "
        "['transformers.models.l... (a dict of 1 item) has no ['kind']; write e.g. "
        '{"call": "attention", "kind": "cp_allgather_kv"}'
    )


def test_values_in_messages_are_shortened() -> None:
    long = "model." + "a" * 5233
    data = llama_plan()
    data["boundaries"][long] = {"params": {"w": {"tp": "Q"}}}
    text = error(lambda: Plan.from_dict(data))
    assert text == (
        "plan.boundaries: pattern 'model.aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa... "
        "(a str of 5239 characters) is longer than 256 characters; shorten it"
    )
    data = llama_plan()
    data["injections"] = [{"match": ATTN, "inner_wrapper": "x" * 5000}] * 100
    assert error(lambda: Plan.from_dict(data)).startswith(
        "plan.injections: [{'match': 'model.layers.*.self_attn', 'inner_wrapper': 'xxxxxxxxxxxxxxxxxxxx... "
        "(a list of 100 items) is no longer read"
    )


def test_shown_is_repr_when_short_and_bounded_otherwise() -> None:
    for value in (1, "abc", {"kind": "x", "call": "y"}, [1, (2,), ()], (1,), None, 1.5, {"a": [True]}):
        assert shown(value) == repr(value)
    assert shown("é" * 100) == "'" + "é" * 76 + "... (a str of 100 characters)"
    assert shown(list(range(10**6))).endswith("... (a list of 1000000 items)")
    assert shown(-(10**300)) == "<an int of 301 digits>"

    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert shown(Broken()) == "<Broken object>"


# ---------------------------------------------------------------- load_plan's forms


@pytest.mark.parametrize(
    ("plan", "options", "expected"),
    [
        (5, {}, r"^activate\(5\): a plan of type int is not accepted; pass a Plan, a dict, JSON text"),
        (None, {}, r"^activate\(None\): a plan of type NoneType is not accepted"),
        (["auto"], {}, r"^activate\(\['auto'\]\): a plan of type list is not accepted"),
        (b"auto", {}, r"^activate\(b'auto'\): a plan of type bytes is not accepted"),
        (deep_list(100_000), {}, r"^activate\(\[\[\[\[\[\[\[\.\.\.\]\]\]\]\]\]\]\): a plan of type list"),
        ("auto", {"tp": "2"}, r"^activate\(tp='2'\): degree '2' is not a positive integer; use e\.g\. tp=2$"),
        ("auto", {"tp": True}, r"^activate\(tp=True\): degree True is not a positive integer"),
        ("auto", {"tp": 10**5000}, r"^activate\(tp=<an int of 5001 digits>\): degree <an int of 5001 digits> is "
                                   r"above 1048576"),
        ("auto", {"tp": 2, "sequence_parallel": "yes"}, r"^plan\.auto\.sequence_parallel: 'yes' is not true/false"),
        ({"mesh": [1, 2]}, {"tp": 2}, r"^plan\.mesh: \[1, 2\] is not a non-empty object"),
        ({"mesh": {3: 1}}, {"tp": 2}, r"^plan\.mesh: axis 3 is not one of"),
        ({1: 2}, {"tp": 2}, r"^plan: unknown key 1"),
        ('{"version": 1, "version": 2}', {}, r"^plan: key 'version' appears twice"),
        ("not-a-plan.json", {}, r"^plan file 'not-a-plan\.json': cannot be read \(No such file or directory\)"),
    ],
)
def test_load_plan_refuses_anything_with_a_plan_error(plan: Any, options: dict, expected: str) -> None:
    with pytest.raises(PlanError, match=expected):
        load_plan(plan, **options)


def test_load_plan_takes_json_text_and_keeps_its_tp_override() -> None:
    text = json.dumps(llama_plan())
    assert load_plan(text) == Plan.from_dict(llama_plan())
    assert load_plan(text, tp=4).mesh == {"tp": 4}
    assert load_plan({**llama_plan(), "mesh": None}, tp=4).mesh == {"tp": 4}


# ---------------------------------------------------------------- module globs


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("*", r"^plan\.modules: '\*' starts with the glob '\*', which could match hp_lazy's own dependencies "
              r"\(torch, the standard library\); start with the package's literal name, e\.g\. "
              r"'transformers\.models\.llama\.modeling_llama' or 'transformers\.models\.\*\.modeling_\*'$"),
        ("**", r"^plan\.modules: '\*\*' starts with the glob '\*\*'"),
        ("t*.modeling_x", r"^plan\.modules: 't\*\.modeling_x' starts with the glob 't\*'"),
        ("[t]orch.nn", r"^plan\.modules: '\[t\]orch\.nn' starts with the glob '\[t\]orch'"),
        ("torch", r"^plan\.modules: 'torch' is in 'torch', a package hp_lazy itself runs on \(lowering it would "
                  r"rewrite the code that does the lowering\); name the modeling modules, e\.g\. 'transformers\.models"),
        ("torch.*", r"^plan\.modules: 'torch\.\*' is in 'torch', a package hp_lazy itself runs on"),
        ("torch.nn.modules.linear", r"'torch\.nn\.modules\.linear' is in 'torch'"),
        ("hp_lazy.**", r"'hp_lazy\.\*\*' is in 'hp_lazy'"),
        ("importlib", r"'importlib' is in 'importlib'"),
        ("builtins", r"'builtins' is in 'builtins'"),
        ("sys", r"'sys' is in 'sys'"),
        ("json.*", r"'json\.\*' is in 'json'"),
        ("safetensors.torch", r"'safetensors\.torch' is in 'safetensors'"),
        ("huggingface_hub.*", r"is in 'huggingface_hub'"),
        ("tokenizers", r"is in 'tokenizers'"),
        ("accelerate.**", r"is in 'accelerate'"),
        ("numpy.*", r"is in 'numpy'"),
        ("transformers", r"^plan\.modules: 'transformers' can match transformers' own machinery, which hp_lazy runs "
                         r"on, not only its modeling modules; name them under transformers\.models, e\.g\. "),
        ("transformers.*", r"'transformers\.\*' can match transformers' own machinery"),
        ("transformers.**", r"'transformers\.\*\*' can match transformers' own machinery"),
        ("transformers.utils.import_utils", r"'transformers\.utils\.import_utils' can match transformers' own"),
        ("transformers.models", r"'transformers\.models' can match transformers' own machinery"),
        ("transformers.model?.llama.modeling_llama", r"can match transformers' own machinery"),
        ("transformers.**.modeling_llama", r"can match transformers' own machinery"),
    ],
)
def test_modules_that_reach_hp_lazys_own_dependencies_are_refused(name: str, expected: str) -> None:
    data = llama_plan()
    data["modules"] = ["transformers.models.llama.modeling_llama", name]
    with pytest.raises(PlanError, match=expected):
        Plan.from_dict(data)


@pytest.mark.parametrize(
    "name",
    ["transformers.models.*.modeling_*", "transformers.models.llama.modeling_llama", "transformers.models.**",
     "transformers_modules.**.modeling_x", "mypkg.*", "pkg.models.*.modeling_*", "m"],
)
def test_modeling_modules_and_own_packages_are_accepted(name: str) -> None:
    assert check_module(name) == name


def test_the_auto_plans_modules_validate_and_the_denylist_holds_the_named_packages() -> None:
    assert Plan.auto(tp=2).modules == ("transformers.models.*.modeling_*",)
    assert Plan.from_dict(Plan.auto(tp=2).to_dict()) == Plan.auto(tp=2)
    assert {"torch", "hp_lazy", "safetensors", "huggingface_hub", "tokenizers", "accelerate", "numpy", "sys",
            "importlib", "builtins", "os", "json"} <= OWN_DEPENDENCIES
    assert "transformers" not in OWN_DEPENDENCIES  # allowed under transformers.models only


def test_activate_with_a_star_glob_is_a_plan_error_and_installs_nothing(tmp_path: Path) -> None:
    import hp_lazy

    before = list(sys.meta_path)
    data = llama_plan()
    data["modules"] = ["*"]
    with pytest.raises(PlanError, match=r"^plan\.modules: '\*' starts with the glob"):
        hp_lazy.activate(data, cache_dir=tmp_path)
    assert sys.meta_path == before


# ---------------------------------------------------------------- the mutation fuzzer

SEED = 20260611
DATA_MUTANTS = 2000
TEXT_MUTANTS = 1000
DEEP = deep_list(100_000)
CYCLIC: dict[str, Any] = {"tp": "R"}
CYCLIC["self"] = CYCLIC
OPAQUE = {id(DEEP), id(CYCLIC)}
"""Values put into mutants by reference and never walked into (walking them is the point of the test)."""
VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2, 3, 2**64, 10**5000, -(10**5000), 1.0, 2.5, math.nan, math.inf, -math.inf,
    "", " ", "R", "S(0)", "S(-1)", "S(1)", "SS(0,2)", "SS(0,0)", "P(sum)", "P(max)", "S(" + "9" * 5000 + ")",
    "é", "\ud800", "\x00", "名前", "x" * 5239, ATTN, "lm_head", "_hp_b", "a.__hp_x", "output", "output.1",
    "output." + "9" * 5000, "transformers.models.*.modeling_*", "*", "torch.*", "transformers.utils", "a..b",
    "[z-a]", "LlamaAttention", "torch.nn.Linear", "attention", "cp_ulysses", "ep_dispatch", "o_proj.bias",
    [], {}, [1, 2], ["o_proj.bias"], {"tp": "R"}, {"tp": "S(1)"}, {"call": "attention"}, {"kind": "x"},
    (1, 2), b"bytes", DEEP, CYCLIC,
]
KEYS: list[Any] = [
    1, None, (1, 2), 2.5, True, "", "_hp_", "x" * 300, "tp", "dp", "cp", "ep", "version", "mesh", "modules",
    "boundaries", "boundary_classes", "auto", "injections", "in_src", "params", "inner", "region", "output",
    "output.7", "hidden_states", "weight", "q_proj.weight", ATTN, "model.*", "名前", "\ud800",
]


def _slots(value: Any, depth: int = 0) -> list[tuple[Any, Any]]:
    """Every (container, key or index) in ``value``, not walking into OPAQUE values."""
    out: list[tuple[Any, Any]] = []
    if depth > 7 or id(value) in OPAQUE:
        return out
    items = list(value.items()) if isinstance(value, dict) else list(enumerate(value)) if isinstance(value, list) else []
    for key, item in items:
        out.append((value, key))
        out.extend(_slots(item, depth + 1))
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return value if id(value) in OPAQUE else {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return value if id(value) in OPAQUE else [_copy(item) for item in value]
    return value


def _value(rng: random.Random) -> Any:
    return _copy(rng.choice(VALUES))


def _mutate(rng: random.Random, data: dict[str, Any]) -> None:
    slots = _slots(data) or [(data, "version")]
    parent, key = rng.choice(slots)
    op = rng.randrange(7)
    if isinstance(parent, list):
        if op == 0 and parent:
            del parent[key]
        elif op == 1:
            parent.insert(key, _value(rng))
        elif op == 2:
            parent.extend(_copy(parent[:2]))
        else:
            parent[key] = _value(rng)
        return
    if op == 0:
        del parent[key]
    elif op == 1:
        parent[rng.choice(KEYS)] = _copy(parent[key])  # duplicate under another key
    elif op == 2:
        parent[rng.choice(KEYS)] = parent.pop(key)  # rename
    elif op == 3:
        parent[rng.choice(KEYS)] = _value(rng)  # insert
    elif op == 4 and isinstance(parent[key], list):
        parent[key] = parent[key][: rng.randrange(len(parent[key]) + 1)]
    else:
        parent[key] = _value(rng)


def _mutate_text(rng: random.Random, text: bytes) -> bytes:
    at = rng.randrange(len(text) + 1)
    op = rng.randrange(10)
    if op == 0:
        return text[:at]
    if op == 1 and text:
        flipped = text[min(at, len(text) - 1)] ^ (1 << rng.randrange(8))
        return text[:at] + bytes([flipped]) + text[at + 1:]
    if op == 2:
        return b"\xef\xbb\xbf" + text
    if op == 3:
        opening = [i for i, byte in enumerate(text) if byte == ord("{")] or [0]
        i = rng.choice(opening) + 1
        return text[:i] + b'"tp": 2, "tp": 2, ' + text[i:]
    if op == 4:
        return text[:at] + b"[" * rng.choice((17, 1000, 100_000)) + text[at:]
    if op == 5:
        return text.replace(b"2", b"9" * rng.choice((4000, 5000)), 1)
    if op == 6:
        return text[:at] + rng.choice((b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\x00")) + text[at:]
    if op == 7:
        return text.replace(b"2", rng.choice((b"NaN", b"Infinity", b"-Infinity", b"2.0", b"1e999", b"true")), 1)
    if op == 8:
        return text.replace(b'"R"', rng.choice((b'"\\ud800"', b'"\\u0000"', b'"R\\n"', b'""', b"null")), 1)
    return text[:at] + rng.choice((b"}", b"]", b",", b'"', b"\\")) + text[at:]


def _outcome(build: Callable[[], Plan], failures: list[str]) -> str:
    try:
        plan = build()
    except PlanError as exc:
        if len(str(exc)) > MAX_MESSAGE:
            failures.append(f"message of {len(str(exc))} characters: {str(exc)[:200]}")
        return "PlanError"
    except Exception as exc:  # the failure this test exists to catch: report it, do not stop at it
        failures.append(f"{type(exc).__name__}: {shown(exc)}")
        return "other"
    try:
        assert Plan.from_json(plan.to_json()) == plan and len(plan.hash) == 64
    except Exception as exc:
        failures.append(f"built but does not round-trip: {type(exc).__name__}: {shown(exc)}")
        return "other"
    return "built"


def fuzz(tmp_path: Path) -> tuple[Counter[str], list[str]]:
    """Mutants of three valid plans, as data and as JSON text or a file: what each turned into."""
    rng = random.Random(SEED)
    bases = [llama_plan(), Plan.auto(tp=2).to_dict(), two_axis_plan()]
    counts: Counter[str] = Counter()
    failures: list[str] = []
    for _ in range(DATA_MUTANTS):
        data = copy.deepcopy(rng.choice(bases))
        for _ in range(rng.choice((1, 1, 2, 3))):
            _mutate(rng, data)
        tp = rng.choice((None, None, 2, 4))
        build = (lambda d=data: Plan.from_dict(d)) if tp is None else (lambda d=data, t=tp: load_plan(d, tp=t))
        counts[_outcome(build, failures)] += 1
    path = tmp_path / "mutant.json"
    for _ in range(TEXT_MUTANTS):
        text = json.dumps(rng.choice(bases), indent=rng.choice((None, 1))).encode()
        for _ in range(rng.choice((1, 1, 2))):
            text = _mutate_text(rng, text)
        if rng.random() < 0.5:
            path.write_bytes(text)
            build = (lambda: Plan.from_json(path)) if rng.random() < 0.5 else (lambda: load_plan(str(path)))
        else:
            decoded = text.decode("utf-8", errors="surrogateescape")
            build = lambda s=decoded: Plan.from_json(s)  # noqa: E731
        counts[_outcome(build, failures)] += 1
    return counts, failures


def test_every_mutant_builds_a_plan_or_raises_a_short_plan_error(tmp_path: Path) -> None:
    counts, failures = fuzz(tmp_path)
    assert failures == []
    assert counts["other"] == 0 and sum(counts.values()) == DATA_MUTANTS + TEXT_MUTANTS
    assert counts["built"] >= 200 and counts["PlanError"] >= 2000, counts  # both paths are exercised
