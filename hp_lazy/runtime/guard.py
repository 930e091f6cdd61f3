"""A bound model whose ``forward`` someone replaced: where shards could leave lowered code.

Stacks that fuse the LM head into their loss replace ``model.forward`` and compute with
``get_output_embeddings().weight`` themselves (TRL's ``add_fused_lm_head``, Liger's fused linear
cross-entropy, hand-written ones). Under tp that weight (and a vocab-parallel embedding's) is this
rank's rows: a softmax over it is over part of the vocabulary, silently. hp_lazy integrates TRL's
(:mod:`hp_lazy.integrations.trl`, whose wrapper is marked ``names.ROUTED``); any other replacement of
a bound model's ``forward`` is read once (its code, its closures' code) and, when it names an
embedding's or head's weight while that weight is cut over the vocabulary, refused at the next
forward with an error naming the function and the weight.

The check runs in the root prologue (:func:`hp_lazy.runtime.rt.ensure_parallel`), where a replaced
forward that bypasses the top-level model still calls its backbone: a dict lookup per call, the
code read once per function.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import ROUTED
from hp_lazy.runtime import record

_HEADS = frozenset({"get_output_embeddings", "get_input_embeddings", "lm_head", "embed_tokens", "embed_out"})
_VERDICTS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def check(top: nn.Module) -> None:
    """Refuse ``top``'s replaced ``forward`` if it reads a weight cut over the vocabulary."""
    replaced = top.__dict__.get("forward")
    if replaced is None or getattr(replaced, ROUTED, False):
        return
    function = getattr(replaced, "__func__", replaced)
    try:
        verdict = _VERDICTS.get(function)
    except TypeError:  # not weak-referenceable: read every time
        verdict = None
    if verdict is None:
        verdict = _reads_a_weight(function)
        try:
            _VERDICTS[function] = verdict
        except TypeError:
            pass
    if not verdict:
        return
    cut = _vocab_cut(top)
    if cut is None:
        return
    name, describe = cut
    where = _name(function)
    raise ShardingError(
        f"{type(top).__qualname__}.forward was replaced by {where}, which reads an embedding's or head's weight "
        f"directly, but {name} is this rank's shard ({describe}) under tensor parallel: a softmax or lookup over it "
        "covers part of the vocabulary; call the model's own forward (its head is vocab-parallel), use "
        "hp_lazy.full_weights for the whole weight, or mark a forward that only calls modules with "
        f"setattr(fn, {ROUTED!r}, True)"
    )


def _name(function: Any) -> str:
    """Where the function was written (its code's own name: ``functools.wraps`` copies another's)."""
    code = getattr(function, "__code__", None)
    module = getattr(function, "__globals__", {}).get("__name__", "?")
    name = getattr(code, "co_qualname", None) or getattr(function, "__qualname__", repr(function))
    return f"{module}.{name}"


def _reads_a_weight(function: Any) -> bool:
    names: set[str] = set()
    for code in _codes(function):
        names.update(code.co_names)
    return "weight" in names and bool(names & _HEADS)


def _codes(function: Any) -> Iterator[types.CodeType]:
    """The code of ``function``, of the functions defined in it, and of the functions its closure holds."""
    seen: set[int] = set()
    stack: list[Any] = [function]
    while stack:
        item = stack.pop()
        code = getattr(item, "__code__", item if isinstance(item, types.CodeType) else None)
        if code is None or id(code) in seen:
            continue
        seen.add(id(code))
        yield code
        stack.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
        for cell in getattr(item, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, types.FunctionType | types.MethodType):
                stack.append(getattr(value, "__func__", value))


def _vocab_cut(top: nn.Module) -> tuple[str, str] | None:
    """The name and cut of ``top``'s output or input embedding weight if the layout table cuts it."""
    bound = record.of(top)
    table = bound.table if bound is not None else None
    if table is None:
        return None
    for getter in ("get_output_embeddings", "get_input_embeddings"):
        get = getattr(top, getter, None)
        module = get() if callable(get) else None
        weight = getattr(module, "weight", None) if isinstance(module, nn.Module) else None
        name = next((n for n, p in top.named_parameters(remove_duplicate=False) if p is weight), None)
        layout = table.get(name) if name is not None else None
        if name is not None and layout is not None and layout.shards:
            return name, f"{layout.describe()} of {list(layout.full_shape)}"
    return None
