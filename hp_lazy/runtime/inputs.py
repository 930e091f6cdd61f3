"""Every rank of a tp group must pass the same inputs: checked across the group, cheaply.

Ranks of one tensor-parallel group compute one model's forward together, so they must be fed the
same batch. Different sequence lengths or batch sizes under sequence parallel would abort a rank
inside the backend with no Python traceback; different ids would train on a mix of batches with a
different loss per rank. :class:`InputCheck` runs in the bound root's prologue: on the first
forward, and on any forward whose input shapes differ from the last checked ones, it all-gathers
one small digest of the inputs' names, shapes and dtypes and of their values over the group (two
numbers per rank) and raises a :class:`~hp_lazy.errors.ShardingError` naming each differing input
and every rank's shape. A step whose shapes are the ones checked costs a tuple comparison and no
collective. ``HP_LAZY_CHECK_INPUTS``: ``1`` compares the values on every forward (one small
all-gather per step), ``0`` compares shapes only (the values are not read: no pass over the
inputs, no host sync on the first forward); unset, the default above.

The check is skipped inside ``torch.compile`` (a graph would break on it): a compiled model is
checked by its eager first forward, which ``parallelize``-then-compile or lazy binding both run.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.comm import wire
from hp_lazy.runtime.mesh import Group

VALUES_ENV = "HP_LAZY_CHECK_INPUTS"

Signature = tuple[tuple[str, tuple[int, ...], str], ...]


def tensors(values: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensor inputs among a forward's arguments (``*args`` items and ``**kwargs`` values too)."""
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    yield f"{name}[{i}]", item
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, torch.Tensor):
                    yield str(key), item


def _value_digest(t: torch.Tensor) -> float:
    flat = torch.nan_to_num(t.detach().reshape(-1).to(torch.float64))  # a NaN equals itself here
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64).remainder_(1021).add_(1)
    return float(flat.sum()) + float((flat * weights).sum())


class InputCheck:
    """Compare this rank's forward inputs with the other ranks of ``group`` (see the module doc)."""

    def __init__(self, owner: str, group: Group, *, values: bool | None = None) -> None:
        self.owner = owner
        self.group = group
        mode = os.environ.get(VALUES_ENV, "").strip()
        self.every = mode not in ("", "0") if values is None else values
        """Values compared on every forward, not only when the shapes change."""
        self.values = mode != "0" or bool(values)
        """Values compared at all (``HP_LAZY_CHECK_INPUTS=0``: shapes only)."""
        self.checked: Signature | None = None

    def __call__(self, args: Mapping[str, Any]) -> None:
        found = list(tensors(args))
        signature: Signature = tuple((n, tuple(t.shape), str(t.dtype)) for n, t in found)
        if signature == self.checked and not self.every:
            return
        digests = [_value_digest(t) for _, t in found] if self.values else []
        mine = [float(zlib.crc32(repr(signature).encode())), sum(d * (i + 1) for i, d in enumerate(digests))]
        device = found[0][1].device if found else torch.device("cpu")
        local = torch.tensor(mine, dtype=torch.float64, device=device)
        everyone = torch.empty(self.group.size * 2, dtype=torch.float64, device=device)
        wire.gather_control(everyone, local, self.group)
        rows = everyone.view(self.group.size, 2).tolist()
        if all(row == rows[0] for row in rows):
            self.checked = signature
            return
        theirs: list[Any] = [None] * self.group.size
        dist.all_gather_object(theirs, (signature, digests), group=self.group.pg)
        raise ShardingError(self._message(theirs))

    def _message(self, theirs: list[tuple[Signature, list[float]]]) -> str:
        per_rank = [{n: (shape, dtype) for n, shape, dtype in sig} for sig, _ in theirs]
        names = list(dict.fromkeys(n for sig in per_rank for n in sig))
        parts = []
        for name in names:
            seen = [sig.get(name) for sig in per_rank]
            if any(s != seen[0] for s in seen):
                shown = ", ".join(
                    f"rank {r}: " + ("absent" if s is None else f"{list(s[0])} {s[1].replace('torch.', '')}")
                    for r, s in enumerate(seen)
                )
                parts.append(f"input {name!r} ({shown})")
        if not parts:  # same shapes everywhere: the values differ
            for i, name in enumerate(names):
                values = [digests[i] if i < len(digests) else None for _, digests in theirs]
                if any(v != values[0] for v in values):
                    parts.append(f"input {name!r} has the same shape on every rank but different values")
        return (
            f"{self.owner}: the {self.group.size} ranks of its {self.group.axis} group were given different "
            f"inputs: {'; '.join(parts)}; every rank of a {self.group.axis} group computes one forward together and "
            "must pass the same batch: split the global batch over the dp ranks only "
            "(hp_lazy.mesh().group('dp'): .rank of .size)"
        )


def install(root: nn.Module, group: Group) -> None:
    """Give bound root ``root`` its check over ``group`` (nothing for a group of one rank)."""
    from hp_lazy.names import INPUT_CHECK

    if group.size > 1:
        root.__dict__[INPUT_CHECK] = InputCheck(type(root).__qualname__, group)
