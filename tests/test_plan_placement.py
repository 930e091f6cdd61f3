"""Typed placements: parsing, printing, the hierarchy, normalisation."""

from __future__ import annotations

import pickle

import pytest

from hp_lazy.errors import PlanError
from hp_lazy.plan import PackedShard, Partial, Placement, Replicate, Shard
from hp_lazy.plan.placement import REPLICATE


@pytest.mark.parametrize(
    ("text", "placement", "kind"),
    [
        ("R", Replicate(), "R"),
        (" S(0) ", Shard(0), "S"),
        ("S(-1)", Shard(-1), "S"),
        ("SS(0, 2)", PackedShard(0, 2), "SS"),
        ("SS(-2,2)", PackedShard(-2, 2), "SS"),
        ("P(sum)", Partial(), "P"),
    ],
)
def test_parse_gives_the_typed_class_and_prints_back(text: str, placement: Placement, kind: str) -> None:
    parsed = Placement.parse(text)
    assert parsed == placement and type(parsed) is type(placement)
    assert parsed.kind == kind == type(placement).kind
    assert Placement.parse(str(parsed)) == parsed
    assert str(parsed) == text.strip().replace(", ", ",")
    assert pickle.loads(pickle.dumps(parsed)) == parsed


def test_packed_shard_is_a_shard_with_blocks() -> None:
    packed, plain = PackedShard(0, 2), Shard(0)
    assert isinstance(packed, Shard) and packed.is_shard and plain.is_shard
    assert (plain.blocks, packed.blocks, packed.dim) == (1, 2, 0)
    assert plain != PackedShard(0, 1)  # the same layout written two ways is two values
    assert not isinstance(plain, PackedShard)


def test_predicates_and_the_replicate_constant() -> None:
    assert REPLICATE == Replicate() and REPLICATE.is_replicate and not REPLICATE.is_shard
    assert Partial().is_partial and Partial().op == "sum" and not Partial().is_replicate
    with pytest.raises(TypeError):
        Placement()  # type: ignore[abstract]


def test_normalized_counts_negative_dims_from_the_end() -> None:
    assert Shard(-1).normalized(3) == Shard(2)
    assert PackedShard(-2, 2).normalized(3) == PackedShard(1, 2)
    assert Shard(1).normalized(3) == Shard(1) and REPLICATE.normalized(2) is REPLICATE
    with pytest.raises(PlanError, match=r"placement S\(-3\) does not fit a tensor of rank 2"):
        Shard(-3).normalized(2)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Q(0)", "where: placement 'Q(0)' is not one of 'R', 'S(d)', 'SS(d,k)', 'P(sum)'; fix the plan"),
        (3, "where: placement 3 is not a string; use 'R', 'S(d)' or 'P(sum)'"),
        ("SS(0,0)", "where: packed shard 'SS(0,0)' needs k >= 1 blocks; e.g. 'SS(0,2)'"),
        ("P(max)", "where: partial reduction 'max' in 'P(max)' is not supported; use 'P(sum)'"),
    ],
)
def test_parse_errors(text: object, expected: str) -> None:
    with pytest.raises(PlanError) as info:
        Placement.parse(text, where="where")
    assert str(info.value) == expected


def test_constructors_check_their_values() -> None:
    with pytest.raises(PlanError, match=r"packed shard SS\(0,0\) needs k >= 1 blocks"):
        PackedShard(0, 0)
    with pytest.raises(PlanError, match=r"partial reduction 'max' is not supported; use 'P\(sum\)'"):
        Partial("max")
