"""Placement strings: ``"R"``, ``"S(d)"``, ``"SS(d,k)"``, ``"P(sum)"``.

``SS(d,k)`` is a *packed* shard of dim ``d``: the dim holds ``k`` equal blocks laid end to end
(a fused ``gate_up_proj`` is ``SS(0,2)``), and each rank takes its chunk of every block, so the
local tensor is again ``k`` blocks (transformers' ``packed_colwise``).

``S(d)`` shards tensor dim ``d``; a negative ``d`` counts from the end, exactly as in torch, and is
normalised with :meth:`Placement.normalized` once the tensor rank is known. Nothing else is ever
encoded in the sign of ``d``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from hp_lazy.errors import PlanError

Kind = Literal["R", "S", "SS", "P"]
AXES: tuple[str, ...] = ("dp", "cp", "ep", "tp")
"""Mesh axes, outermost first (the order of the device mesh dims)."""

_SHARD = re.compile(r"^S\((-?\d+)\)$")
_PACKED = re.compile(r"^SS\((-?\d+),\s*(\d+)\)$")
_PARTIAL = re.compile(r"^P\((\w+)\)$")
_REDUCE_OPS = ("sum",)


@dataclass(frozen=True, slots=True)
class Placement:
    """How one tensor is laid out over one mesh axis."""

    kind: Kind
    dim: int | None = None  # set for "S" and "SS"
    blocks: int | None = None  # set for "SS"
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
        if m := _PACKED.match(text):
            if int(m.group(2)) < 1:
                raise PlanError(f"{where}: packed shard {text!r} needs k >= 1 blocks; e.g. 'SS(0,2)'")
            return cls("SS", dim=int(m.group(1)), blocks=int(m.group(2)))
        if m := _PARTIAL.match(text):
            if m.group(1) not in _REDUCE_OPS:
                raise PlanError(
                    f"{where}: partial reduction {m.group(1)!r} in {text!r} is not supported; use 'P(sum)'"
                )
            return cls("P", op=m.group(1))
        raise PlanError(f"{where}: placement {text!r} is not one of 'R', 'S(d)', 'SS(d,k)', 'P(sum)'; fix the plan")

    def normalized(self, ndim: int) -> "Placement":
        """``S(-1)`` on a rank-3 tensor becomes ``S(2)``; other placements are returned as is."""
        if self.kind not in ("S", "SS") or self.dim is None or self.dim >= 0:
            return self
        if -self.dim > ndim:
            raise PlanError(f"placement {self} does not fit a tensor of rank {ndim}")
        return Placement(self.kind, dim=self.dim + ndim, blocks=self.blocks)

    @property
    def is_replicate(self) -> bool:
        return self.kind == "R"

    @property
    def is_shard(self) -> bool:
        """True for ``S(d)`` and ``SS(d,k)``."""
        return self.kind in ("S", "SS")

    @property
    def is_partial(self) -> bool:
        return self.kind == "P"

    def __str__(self) -> str:
        if self.kind == "S":
            return f"S({self.dim})"
        if self.kind == "SS":
            return f"SS({self.dim},{self.blocks})"
        if self.kind == "P":
            return f"P({self.op})"
        return "R"


REPLICATE = Placement("R")
