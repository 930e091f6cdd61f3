"""``resize_token_embeddings`` on a model whose embedding or head is vocab-sharded.

transformers' resize reads ``weight.size()``, makes a new ``[n, hidden]`` weight, initialises the
added rows (by default from the mean and covariance of the old rows), copies the old rows and
puts the new data into the *same* module and Parameter. On a shard that would take this rank's
rows for the whole vocabulary. Here the sharded weights are gathered first (full on every rank,
so the added rows are drawn exactly as in one process), resize runs unchanged, and they are cut
again at the new size: the layout table, the vocab range and padding row, the vocab-parallel
loss's first column and the gradient owner follow. A new size tp does not divide is refused
before anything changes (``pad_to_multiple_of``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import LEAF, VOCAB_RANGE, WATCH
from hp_lazy.runtime import record
from hp_lazy.runtime.layout import LayoutTable, ParamLayout, shard_in_place
from hp_lazy.runtime.leaves import wrap_forward
from hp_lazy.runtime.tp.embedding import global_padding_idx, set_vocab_range
from hp_lazy.runtime.tp.loss import VocabParallelCausalLMLoss


def _sharded_heads(model: nn.Module, table: LayoutTable) -> list[tuple[Any, list[str], ParamLayout]]:
    """(module, every name of its weight, layout) of the input and output embeddings the plan cuts
    (an ``nn.Embedding`` or ``nn.Linear``; tied weights once)."""
    found: list[tuple[Any, list[str], ParamLayout]] = []
    heads = (model.get_input_embeddings(), model.get_output_embeddings())  # type: ignore[operator]
    for module in {id(m): m for m in heads if m is not None}.values():
        weight = module.weight
        names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is weight]
        layout = next((table.get(n) for n in names if table.get(n) is not None), None)
        if layout is not None and layout.shards and all(weight is not f[0].weight for f in found):
            found.append((module, names, layout))
    return found


def resize_sharded(model: nn.Module, resize: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``resize(model, *args, **kwargs)`` (transformers' own) on the full weights, then re-cut."""
    bound = record.of(model)
    table: LayoutTable | None = bound.table if bound is not None else None
    heads = _sharded_heads(model, table) if table is not None else []
    rows = _new_rows(resize, args, kwargs)
    if table is None or not heads or rows is None:
        return resize(model, *args, **kwargs)
    for _, names, layout in heads:
        _check_divides(names[0], layout, rows)
    pads = {}
    for head, _, layout in heads:
        if VOCAB_RANGE in head.__dict__:
            pads[id(head)] = head.padding_idx = global_padding_idx(head)
        head.weight.data = layout.gather(head.weight.data, table.groups)
    out = resize(model, *args, **kwargs)
    group = table.groups["tp"]
    for old, names, layout in heads:
        module: Any = _successor(model, old)
        new = ParamLayout(fqn=names[0], full_shape=tuple(module.weight.shape), shards=layout.shards)
        shard_in_place(module.weight, new)
        for name in names:
            table.replace(replace(new, fqn=name))
        if id(module) in pads:
            set_vocab_range(module, group, module.padding_idx)
        loss = getattr(model, "loss_function", None)
        if isinstance(loss, VocabParallelCausalLMLoss) and not isinstance(module, nn.Embedding):
            loss.vocab_start = group.rank * new.local_shape[0]
    model.__dict__[WATCH].dirty = True  # the gradient owner's buckets are sized by the old shards
    return out


def _successor(model: nn.Module, old: nn.Module) -> Any:
    """The module now in ``old``'s place: transformers replaces an untied ``nn.Linear`` head by a
    new one, which takes over the old one's leaf binding (entry/exit ops around its forward)."""
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):  # type: ignore[operator]
        if module is old:
            return old
    new = model.get_output_embeddings()  # type: ignore[operator]
    binding = old.__dict__.get(LEAF)
    if binding is None or not isinstance(new, nn.Module) or not isinstance(old, nn.Linear):
        raise ShardingError(
            f"{type(model).__qualname__}.resize_token_embeddings replaced {type(old).__name__} by "
            f"{type(new).__name__}, which hp_lazy cannot re-bind; resize before hp_lazy.parallelize(model) "
            "and the first forward"
        )
    wrap_forward(new, binding)
    return new


def _new_rows(resize: Callable[..., Any], args: tuple, kwargs: dict) -> int | None:
    """The vocabulary size transformers' resize will make (None: it changes nothing)."""
    bound = inspect.signature(resize).bind(None, *args, **kwargs).arguments
    rows, multiple = bound.get("new_num_tokens"), bound.get("pad_to_multiple_of")
    if rows is None:
        return None
    return -(-rows // multiple) * multiple if multiple else rows


def _check_divides(name: str, layout: ParamLayout, rows: int) -> None:
    for cut in layout.shards:
        if cut.dim == 0 and rows % (cut.pieces * cut.blocks):
            raise ShardingError(
                f"{name}: resize_token_embeddings to {rows} rows, which {cut.axis}={cut.pieces} does not divide "
                f"(the weight is laid out {layout.describe()}); call resize_token_embeddings(n, "
                f"pad_to_multiple_of={cut.pieces * cut.blocks})"
            )
