"""The record of one bound model: everything hp_lazy keeps about it, under one key.

A top-level model hp_lazy laid out or bound holds one :class:`BoundModel` in its ``__dict__``
(``names.OWNER``): the mesh, the layout table, its outermost lowered roots, the style instance of
each parallel axis that bound it (a refresh re-runs the same instances), the gradient owner once the
model is bound (``None`` while it is laid out before its weights are read), and the watch that tells
a submodule replaced since. :mod:`hp_lazy.runtime.owner` runs its lifecycle; everything else reads
it through :func:`of` and :func:`records`.

Every module of the model also holds the :class:`Watch` (``names.WATCH``), so that a submodule finds
its top-level model; lowered modules hold ``names.BOUND`` (one truth test in their prologue). Before
any binding, a module finds the outermost transformers model it was built in (:func:`built_in`), so
that a backbone run first (a loop that calls ``model.model`` and then the head) binds the whole model.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from hp_lazy.names import OWNER, WATCH
from hp_lazy.runtime.layout import LayoutTable
from hp_lazy.runtime.mesh import Mesh

if TYPE_CHECKING:
    from hp_lazy.runtime.style import ParallelStyle


class Watch:
    """Shared by every module of one bound model: ``dirty`` once a submodule is replaced (PEFT
    wrapping a planned Linear, or ``merge_and_unload`` putting it back)."""

    __slots__ = ("dirty", "top")

    def __init__(self, top: nn.Module) -> None:
        self.dirty = False
        self.top = weakref.ref(top)


@dataclass(eq=False, kw_only=True)
class BoundModel:
    mesh: Mesh
    table: LayoutTable | None
    roots: tuple[nn.Module, ...]
    """The outermost lowered roots (each gets the tp group's input check)."""
    styles: dict[str, ParallelStyle] = field(default_factory=dict)
    """Mesh axis -> the style instance that bound it (axes of degree > 1 only)."""
    partial: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    """Parameter FQN -> (axis, slots, slot): its gradient is a partial sum over the axis."""
    grads: Any = None
    """The :class:`~hp_lazy.runtime.grads.GradOwner` (typed loosely: the gradient owner reads this
    record); ``None`` while the model is laid out but not yet bound (shard-on-read)."""

    @property
    def bound(self) -> bool:
        return self.grads is not None


def of(module: nn.Module) -> BoundModel | None:
    """The record of ``module`` if it is a top-level model hp_lazy laid out or bound."""
    return module.__dict__.get(OWNER)


def records(model: nn.Module) -> Iterator[tuple[str, BoundModel]]:
    """``(prefix, record)`` of every laid-out or bound model inside ``model`` (``model`` itself, or
    one wrapped in DDP / PEFT: the prefix is its module path plus a dot)."""
    for name, module in model.named_modules():
        found = of(module)
        if found is not None:
            yield (name + "." if name else ""), found


def top_of(module: nn.Module) -> nn.Module | None:
    """The top-level bound model ``module`` belongs to (through the watch every module holds)."""
    watch = module.__dict__.get(WATCH)
    return watch.top() if watch is not None else None


_BUILT_IN: weakref.WeakKeyDictionary[nn.Module, weakref.ref[nn.Module]] = weakref.WeakKeyDictionary()
"""Module -> the outermost transformers model it was built in. A side table, not the module's
``__dict__``: a model hp_lazy never binds still pickles, and a deep copy's modules are not pointed
at the original."""


def mark_built(model: nn.Module) -> None:
    """Every module of ``model`` was built in it (``post_init`` of each transformers model: the
    outermost one, whose runs last, is what stays)."""
    ref = weakref.ref(model)
    for module in model.modules():
        _BUILT_IN[module] = ref


def built_in(module: nn.Module) -> nn.Module | None:
    """The outermost transformers model ``module`` was built in, if it is alive."""
    ref = _BUILT_IN.get(module)
    return ref() if ref is not None else None


def tables(model: nn.Module) -> Iterator[tuple[str, LayoutTable]]:
    """``(prefix, table)`` for every bound model inside ``model`` that has a layout table."""
    for prefix, record in records(model):
        if record.table is not None:
            yield prefix, record.table


def unsharded_extra(model: nn.Module, *, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """Elements the parameters of ``model`` hold on one process beyond this rank's shards (0 for a
    model hp_lazy did not bind): added to a count over ``model.parameters()`` it gives one
    process's count (``num_parameters``, the Trainer's logged parameter count)."""
    found = list(tables(model))
    if not found:
        return 0
    embeddings = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    extra = 0
    for name, param in model.named_parameters():
        if (only_trainable and not param.requires_grad) or (exclude_embeddings and name in embeddings):
            continue
        layout = next((t.get(name[len(p):]) for p, t in found if name.startswith(p) and name[len(p):] in t), None)
        if layout is not None:
            extra += math.prod(layout.full_shape) - param.numel()
    return extra
