"""What a bound model returns: one process's per-token outputs, for the code that reads them.

Two layouts keep a forward's per-token outputs cut, because the loss is computed from the cuts:

- context parallel: ``out.logits`` (and ``out.hidden_states``) hold this rank's zigzag rows,
  ``[batch, seq/cp, ...]``;
- loss parallel (``Plan.auto(..., loss_parallel=True)``): ``out.logits`` holds this rank's vocab
  columns, ``[batch, seq, vocab/tp]``.

Code that reads the outputs itself (the Trainer's predictions and ``compute_metrics``, label
smoothing, a ``compute_loss_func``, generation, a loss of the user's) needs one process's values.
So:

- inside :func:`whole` (``hp_lazy.whole_outputs()``), the root's forward returns them whole: the
  sequence gathered over cp in sequence order (:func:`sequence_whole`, at the model's cp entry),
  the logits gathered over tp along the vocab (:func:`vocab_whole`). Every rank of the group then
  holds the same values; each gather's backward keeps this rank's rows / columns of the gradient,
  so a loss computed from them on every rank trains as one process does;
- under loss parallel, a forward given no labels computes no loss from the shards, and returns its
  logits whole too (generation, TRL's non-fused losses, a loss of the caller's).

The flag is a plain module global (not a ``ContextVar``): the root's forward reads it inside
``torch.compile``d code, which guards on a global without a graph break.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import VOCAB_SHARDED
from hp_lazy.runtime.comm import gather_from
from hp_lazy.runtime.cp.gather import gather_sequence
from hp_lazy.runtime.mesh import Group

_depth = 0
_ALREADY_GLOBAL = ("loss", "aux_loss")
"""Fields the entry already made one process's (summed over cp)."""


@contextlib.contextmanager
def whole() -> Iterator[None]:
    """Inside the block, a bound model's per-token outputs come back whole (see the module doc)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def wanted() -> bool:
    return _depth > 0


def sequence_whole(out: Any, group: Group, batch: int, rows: int, owner: str) -> Any:
    """``out``'s per-token tensors, this rank's ``rows`` of each of ``batch`` sequences, gathered
    over ``group`` into sequence order: ``[batch, rows, ...]`` (logits, hidden states) and
    ``[batch * rows, ...]`` (router logits, flattened tokens). Anything else is refused by name."""
    fields = _fields(out, owner, "context parallel")
    for key, value in fields.items():
        if key not in _ALREADY_GLOBAL and value is not None:
            out[key] = _gather_rows(value, group, batch, rows, f"{owner}: out.{key}")
    return out


def _gather_rows(value: Any, group: Group, batch: int, rows: int, what: str) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_gather_rows(v, group, batch, rows, what) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() >= 2 and value.shape[:2] == (batch, rows):
        return gather_sequence(value, group, dim=1)
    if value.dim() >= 1 and value.shape[0] == batch * rows:
        tokens = value.reshape(batch, rows, *value.shape[1:])
        return gather_sequence(tokens, group, dim=1).reshape(batch * rows * group.size, *value.shape[1:])
    raise ShardingError(
        f"{what} of shape {list(value.shape)} under context parallel (cp={group.size}): hp_lazy returns whole only "
        f"per-token outputs ([batch={batch}, rows={rows}, ...] or [batch * rows, ...]) and cannot tell this one's "
        "rows; leave it out of the outputs (output_hidden_states / output_router_logits off) or read the outputs "
        "outside hp_lazy.whole_outputs()"
    )


def keep_vocab_whole_for_callers(root: nn.Module, group: Group) -> None:
    """Under loss parallel: ``root``'s logits come back whole (over ``group``) from a call given no
    labels, and inside :func:`whole`; a forward hook, installed once per model."""
    first = VOCAB_SHARDED not in root.__dict__
    root.__dict__[VOCAB_SHARDED] = group
    if first:
        labels_at = _position_of(type(root).forward, "labels")
        root.register_forward_hook(functools.partial(_vocab_hook, labels_at=labels_at), with_kwargs=True)


def _vocab_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any], out: Any, labels_at: int | None) -> Any:
    labels = kwargs.get("labels", args[labels_at] if labels_at is not None and len(args) > labels_at else None)
    if wanted() or (labels is None and kwargs.get("shift_labels") is None):  # no loss computed from the shards
        return vocab_whole(out, module.__dict__[VOCAB_SHARDED], type(module).__name__)
    return None


def _position_of(forward: Any, name: str) -> int | None:
    """Where ``name`` sits among ``forward``'s positional arguments after ``self``."""
    params = list(inspect.signature(forward).parameters.values())[1:]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return next((i for i, p in enumerate(params) if p.name == name and p.kind in positional), None)


def vocab_whole(out: Any, group: Group, owner: str) -> Any:
    """``out.logits`` (this rank's vocab columns, ``[..., vocab/tp]``) gathered over ``group``:
    ``[..., vocab]``."""
    fields = _fields(out, owner, "loss parallel")
    logits = fields.get("logits")
    if isinstance(logits, torch.Tensor):
        out["logits"] = gather_from(logits, group, -1)
    return out


def _fields(out: Any, owner: str, layout: str) -> Mapping[str, Any]:
    if isinstance(out, Mapping):
        return dict(out)
    raise ShardingError(
        f"{owner}: the forward returned a {type(out).__name__} (return_dict=False) under {layout}, whose logits "
        "hp_lazy makes whole for the caller here (hp_lazy.whole_outputs(), or a call without labels under loss "
        "parallel) but cannot find by position; pass return_dict=True"
    )
