"""The transformers ``Trainer``'s own bookkeeping of ranks that share a batch, for an hp_lazy model.

``Trainer.get_tp_size()`` is the Trainer's notion of how many ranks read the same rows: it divides
the world by it for the global batch size (the "Total train batch size" it logs, its samples per
second), for the token count of a step (gathered over every rank) and for the loss scale
(``num_processes // tp_size``). It reads ``model._tp_size``, which transformers sets only when it
sharded the model itself, and which would also send accelerate down its own TP route (refused on
CPU; see :mod:`hp_lazy.integrations.accelerate`). So, installed by ``activate`` when
``transformers.trainer`` is imported, ``get_tp_size`` answers ``world / dp`` (the ranks of one tp x
cp group) for a model hp_lazy lowered, when the Trainer knows no other tensor parallelism. The
token count and the loss scale change together, so the gradient is the same either way; the
counts the Trainer reports become one process's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from hp_lazy.integrations.accelerate import lowered, sharing_degrees
from hp_lazy.names import PATCHED
from hp_lazy.runtime.mesh import get_mesh

Degrees = Callable[[], "Mapping[str, int] | None"]


def install(module: ModuleType, degrees: Degrees) -> None:
    """Patch ``module`` (``transformers.trainer``) once."""
    cls = module.Trainer
    if getattr(cls, PATCHED, False):
        return
    cls.get_tp_size = _get_tp_size(cls.get_tp_size, degrees)
    setattr(cls, PATCHED, True)


def _get_tp_size(stock: Callable[..., int], degrees: Degrees) -> Callable[..., int]:
    @functools.wraps(stock)
    def get_tp_size(self: Any) -> int:
        size = stock(self)
        if size != 1 or self.model is None or not lowered(self.model):
            return size
        active = sharing_degrees(degrees())
        if active is None:
            return size
        mesh = get_mesh(dict(active))
        return mesh.world // mesh.group("dp").size

    return get_tp_size
