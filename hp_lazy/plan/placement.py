"""How one tensor is laid out over one mesh axis: ``Replicate()``, ``Shard(d)``,
``PackedShard(d, k)``, ``Partial("sum")``; written ``"R"``, ``"S(d)"``, ``"SS(d,k)"``, ``"P(sum)"``.

``Shard(d)`` shards tensor dim ``d``; a negative ``d`` counts from the end, exactly as in torch, and
is normalised with :meth:`Placement.normalized` once the tensor rank is known. Nothing else is ever
encoded in the sign of ``d``.

``PackedShard(d, k)`` (a :class:`Shard`, so ``isinstance(p, Shard)`` holds for both) is a shard of a
dim that holds ``k`` equal blocks laid end to end (a fused ``gate_up_proj`` is ``SS(0,2)``): each
rank takes its chunk of every block, so the local tensor is again ``k`` blocks (transformers'
``packed_colwise``). ``Shard.blocks`` is 1.

``Partial("sum")``: every rank holds a summand of the full tensor.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from hp_lazy.errors import PlanError
from hp_lazy.plan.fqn import shown

Kind = Literal["R", "S", "SS", "P"]
AXES: tuple[str, ...] = ("dp", "cp", "ep", "tp")
"""Mesh axes, outermost first (the order of the device mesh dims)."""

_SHARD = re.compile(r"^S\((-?\d+)\)$")
_PACKED = re.compile(r"^SS\((-?\d+),\s*(\d+)\)$")
_PARTIAL = re.compile(r"^P\((\w+)\)$")
REDUCE_OPS: tuple[str, ...] = ("sum",)


class Placement(ABC):
    """Abstract base of the four placements; instances are frozen and compare by value."""

    __slots__ = ()
    kind: ClassVar[Kind]
    """``"R"``, ``"S"``, ``"SS"`` or ``"P"``: the spelling's head, for printing."""

    @classmethod
    def parse(cls, text: object, *, where: str = "placement") -> Placement:
        """Parse ``"R"``, ``"S(d)"``, ``"SS(d,k)"`` or ``"P(sum)"``; ``where`` prefixes the error text."""
        if isinstance(text, Placement):
            return text
        if not isinstance(text, str):
            raise PlanError(f"{where}: placement {shown(text)} is not a string; use 'R', 'S(d)' or 'P(sum)'")
        text = text.strip()
        if text == "R":
            return REPLICATE
        if m := _SHARD.match(text):
            return Shard(int(m.group(1)))
        if m := _PACKED.match(text):
            if int(m.group(2)) < 1:
                raise PlanError(f"{where}: packed shard {shown(text)} needs k >= 1 blocks; e.g. 'SS(0,2)'")
            return PackedShard(int(m.group(1)), int(m.group(2)))
        if m := _PARTIAL.match(text):
            if m.group(1) not in REDUCE_OPS:
                raise PlanError(
                    f"{where}: partial reduction {shown(m.group(1))} in {shown(text)} is not supported; use 'P(sum)'"
                )
            return Partial(m.group(1))
        raise PlanError(
            f"{where}: placement {shown(text)} is not one of 'R', 'S(d)', 'SS(d,k)', 'P(sum)'; fix the plan"
        )

    def normalized(self, ndim: int) -> Placement:
        """``S(-1)`` on a rank-3 tensor becomes ``S(2)``; other placements are returned as is."""
        return self

    @property
    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    @property
    def is_shard(self) -> bool:
        """True for ``S(d)`` and ``SS(d,k)``."""
        return isinstance(self, Shard)

    @property
    def is_partial(self) -> bool:
        return isinstance(self, Partial)

    @abstractmethod
    def __str__(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """``R``: every rank holds the full tensor."""

    kind: ClassVar[Kind] = "R"

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """``S(dim)``: rank ``r`` of ``n`` holds chunk ``r`` of dim ``dim``."""

    dim: int
    kind: ClassVar[Kind] = "S"

    @property
    def blocks(self) -> int:
        """1: a plain shard is one block (:class:`PackedShard` has ``k``)."""
        return 1

    def normalized(self, ndim: int) -> Shard:
        if self.dim >= 0:
            return self
        if -self.dim > ndim:
            raise PlanError(f"placement {self} does not fit a tensor of rank {ndim}")
        return replace(self, dim=self.dim + ndim)

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class PackedShard(Shard):
    """``SS(dim,blocks)``: dim ``dim`` holds ``blocks`` equal blocks; each rank holds its chunk of each."""

    blocks: int = field()  # a field here; the constant 1 on Shard
    kind: ClassVar[Kind] = "SS"

    def __post_init__(self) -> None:
        if self.blocks < 1:
            raise PlanError(f"packed shard SS({self.dim},{self.blocks}) needs k >= 1 blocks; e.g. 'SS(0,2)'")

    def __str__(self) -> str:
        return f"SS({self.dim},{self.blocks})"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """``P(op)``: every rank holds a partial result; the full tensor is their ``op`` (only ``sum``)."""

    op: str = "sum"
    kind: ClassVar[Kind] = "P"

    def __post_init__(self) -> None:
        if self.op not in REDUCE_OPS:
            raise PlanError(f"partial reduction {self.op!r} is not supported; use 'P(sum)'")

    def __str__(self) -> str:
        return f"P({self.op})"


REPLICATE = Replicate()
