"""Pieces of the binder that need no process group."""

from __future__ import annotations

import pytest

from hp_lazy.runtime.bind import glob_regex


@pytest.mark.parametrize(
    ("pattern", "name", "matches"),
    [
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
    ],
)
def test_fqn_globs(pattern: str, name: str, matches: bool) -> None:
    assert bool(glob_regex(pattern).match(name)) is matches
