"""The one glob rule (hp_lazy.plan.fqn) for FQN patterns and module names."""

from __future__ import annotations

import pytest

from hp_lazy.errors import PlanError
from hp_lazy.plan.fqn import check_glob, compile_glob, compile_globs, is_glob, matches

CASES = [
    # the runtime binder's cases (tests/test_bind_units.py), which must keep their meaning
    ("model.layers.*.self_attn", "model.layers.0.self_attn", True),
    ("model.layers.*.self_attn", "model.layers.0.inner.self_attn", False),  # * is one segment
    ("model.layers.*.self_attn", "model.layers.0.self_attn_x", False),
    ("lm_head", "lm_head", True),
    ("lm_head", "model.lm_head", False),
    ("q_*", "q_proj", True),
    ("layers.?.mlp", "layers.7.mlp", True),
    ("layers.?.mlp", "layers.17.mlp", False),
    ("layers.[01].mlp", "layers.1.mlp", True),
    ("layers.[!01].mlp", "layers.1.mlp", False),
    ("a.**", "a.b.c", True),
    ("**.fooZ", "a.b.fooZ", True),
    ("model.embed_tokens", "model.embed+tokens", False),  # regex characters are literal
    # ranges and negation are real character classes
    ("layers.[0-3].mlp", "layers.2.mlp", True),
    ("layers.[0-3].mlp", "layers.4.mlp", False),
    ("layers.[0-3].mlp", "layers.-.mlp", False),
    ("m.[a-c]*", "m.bias", True),
    ("m.[a-c]*", "m.weight", False),
    ("layers.[!0-3].mlp", "layers.7.mlp", True),
    ("layers.[!0-3].mlp", "layers.2.mlp", False),
    ("a[!x]b", "a.b", False),  # a negated class does not match the separator
    ("a[+-0]b", "a.b", False),  # nor does a range that spans it
    ("x[a-]", "x-", True),  # a trailing '-' is literal
    # '**' is one or more whole segments, '*' may be empty, '[' without ']' is literal
    ("a.**", "a", False),
    ("a.**.z", "a.z", False),
    ("a.**.z", "a.b.c.z", True),
    ("a.*.z", "a..z", True),
    ("a[b", "a[b", True),
    ("a[]b", "a[]b", True),
    ("Model.x", "model.x", False),  # case-sensitive
    ("transformers.models.*.modeling_*", "transformers.models.llama.modeling_llama", True),
    ("transformers.models.*.modeling_*", "transformers.models.llama.configuration_llama", False),
    ("transformers.models.*.modeling_*", "transformers.models.deprecated.x.modeling_x", False),
    ("transformers.models.**.modeling_*", "transformers.models.deprecated.x.modeling_x", True),
]


@pytest.mark.parametrize(("pattern", "name", "expected"), CASES)
def test_glob_semantics(pattern: str, name: str, expected: bool) -> None:
    assert matches(pattern, name) is expected
    assert (compile_glob(pattern).match(name) is not None) is expected
    assert (compile_globs([pattern, "zz.never"]).match(name) is not None) is expected


def test_is_glob_and_literals() -> None:
    assert is_glob("a.*") and is_glob("a?") and is_glob("a[0]") and not is_glob("model.layers.0.mlp")
    assert compile_globs([]) is None
    assert compile_glob("a.*") is compile_glob("a.*")  # cached


def test_backwards_range_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match=r"^glob 'a\.\[z-a\]': range z-a in \[z-a\] runs backwards; write the lower "
                                        r"character first, e.g\. \[a-z\]$"):
        compile_glob("a.[z-a]")
    with pytest.raises(PlanError, match=r"^plan\.modules: glob 'm\[9-0\]': range 9-0"):
        check_glob("plan.modules", "m[9-0]")
    assert check_glob("plan.modules", "m[0-9]") == "m[0-9]"
