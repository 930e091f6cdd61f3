"""Placement strings: ``"R"``, ``"S(d)"``, ``"P(sum)"``.

``S(d)`` shards tensor dim ``d``; a negative ``d`` counts from the end, exactly as in torch, and is
normalised with :meth:`Placement.normalized` once the tensor rank is known. Nothing else is ever
encoded in the sign of ``d``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from hp_lazy.errors import PlanError

Kind = Literal["R", "S", "P"]
AXES: tuple[str, ...] = ("dp", "cp", "ep", "tp")
"""Mesh axes, outermost first (the order of the device mesh dims)."""

_SHARD = re.compile(r"^S\((-?\d+)\)$")
_PARTIAL = re.compile(r"^P\((\w+)\)$")
_REDUCE_OPS = ("sum",)


@dataclass(frozen=True, slots=True)
class Placement:
    """How one tensor is laid out over one mesh axis."""

    kind: Kind
    dim: int | None = None  # set for "S"
    op: str | None = None  # set for "P"

    @classmethod
    def parse(cls, text: object, *, where: str = "placement") -> "Placement":
        """Parse ``"R"``, ``"S(d)"`` or ``"P(sum)"``; ``where`` prefixes the error text."""
        if isinstance(text, Placement):
            return text
        if not isinstance(text, str):
            raise PlanError(f"{where}: placement {text!r} is not a string; use 'R', 'S(d)' or 'P(sum)'")
        text = text.strip()
        if text == "R":
            return REPLICATE
        if m := _SHARD.match(text):
            return cls("S", dim=int(m.group(1)))
        if m := _PARTIAL.match(text):
            if m.group(1) not in _REDUCE_OPS:
                raise PlanError(
                    f"{where}: partial reduction {m.group(1)!r} in {text!r} is not supported; use 'P(sum)'"
                )
            return cls("P", op=m.group(1))
        raise PlanError(f"{where}: placement {text!r} is not one of 'R', 'S(d)', 'P(sum)'; fix the plan")

    def normalized(self, ndim: int) -> "Placement":
        """``S(-1)`` on a rank-3 tensor becomes ``S(2)``; other placements are returned as is."""
        if self.kind != "S" or self.dim is None or self.dim >= 0:
            return self
        if -self.dim > ndim:
            raise PlanError(f"placement {self} does not fit a tensor of rank {ndim}")
        return Placement("S", dim=self.dim + ndim)

    @property
    def is_replicate(self) -> bool:
        return self.kind == "R"

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    @property
    def is_partial(self) -> bool:
        return self.kind == "P"

    def __str__(self) -> str:
        if self.kind == "S":
            return f"S({self.dim})"
        if self.kind == "P":
            return f"P({self.op})"
        return "R"


REPLICATE = Placement("R")
