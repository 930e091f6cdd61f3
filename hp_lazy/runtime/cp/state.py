"""The state of one context-parallel forward: set by the entry, read by attention and RoPE.

A :class:`CallState` lives for one call of the bound root (a context variable, so a forward in
another thread sees its own): the zigzag layout, the global position ids, the document ids of
packed sequences and the key padding mask, and the blockwise attention plans made from them
(:mod:`hp_lazy.runtime.cp.blocks`) — one per (causal, window, chunk) kind and query layout, made on first
use on the host and shared by every layer of that kind.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hp_lazy.runtime.cp.blocks import Plan, Visibility, plan, tile_for
from hp_lazy.runtime.cp.zigzag import Zigzag
from hp_lazy.runtime.mesh import Group

_CURRENT: contextvars.ContextVar[CallState | None] = contextvars.ContextVar("hp_lazy_cp_call", default=None)


@dataclass(eq=False)
class CallState:
    group: Group
    zig: Zigzag
    mode: str
    """The inner op's kind: ``cp_allgather_kv`` or ``cp_ulysses``."""
    positions: torch.Tensor
    """``[B, S]`` global position ids (what RoPE is computed from)."""
    docs: torch.Tensor | None
    """``[B, S]`` packed-sequence ids (transformers' detection: positions that do not step by 1), or None;
    they separate documents only where the model's own mask code would (:attr:`model_separates`)."""
    key_padding: torch.Tensor | None
    """``[B, S]`` bool, True for tokens that may be attended to (a 2-D attention mask), or None."""
    plans: dict[tuple, tuple[Visibility, Plan]] = field(default_factory=dict)
    rows_mask: torch.Tensor | None = None
    """DSA's ``[B, 1, S/C, S]`` visibility of this rank's rows (:mod:`.indexed`), made once per forward."""
    indexer_keys: tuple[torch.Tensor, torch.Tensor] | None = None
    """The last keys a mask indexer had gathered (:mod:`.indexed`) and their gather: a layer reading an
    earlier layer's K/V hands its indexer the same tensor, gathered once (one such gather kept alive)."""
    model_separates: bool = False
    """Whether this forward's model handed its position ids to transformers' mask code (which then
    separates packed documents): set by :func:`hp_lazy.runtime.cp.attention.observe_masks` before
    the first attention call. Families that build their masks without the position ids (gpt-oss,
    AFMoE, ...) let packed documents see each other in one process, and so here."""

    def visibility(self, causal: bool, window: int | None, chunk: int | None = None) -> Visibility:
        """Which keys a query may attend to, for an attention layer of this (causal, window, chunk) kind."""
        docs = self.docs if self.model_separates else None
        if chunk is not None:
            docs = self._chunks(chunk, docs)
        return Visibility(causal, window, docs, self.key_padding, chunk=chunk)

    def _chunks(self, chunk: int, docs: torch.Tensor | None) -> torch.Tensor:
        """``[B, S]`` ids of (document, chunk) pairs for chunked attention: transformers counts the
        chunks from the first non-padding token, over the position ids where it separates packed
        documents (:mod:`.positions`); non-decreasing along each row, as documents are."""
        batch, seq = self.positions.shape
        index = self.positions if docs is not None else torch.arange(seq, device=self.positions.device)
        index = index.expand(batch, seq)
        pad = 0 if self.key_padding is None else (self.key_padding.cumsum(-1) == 0).sum(-1, keepdim=True)
        ids = torch.div(index - pad, chunk, rounding_mode="floor")
        return ids if docs is None else docs * (2 * seq + 1) + ids + seq

    def plan(self, vis: Visibility, runs: list[tuple[int, int, int]], max_keys: int | None) -> Plan:
        """The blockwise calls for query ``runs`` (``(local start, global start, length)``) under ``vis``."""
        key = (vis.causal, vis.window, vis.chunk, tuple(runs), max_keys, vis.rows is not None)
        if key not in self.plans:
            tile = tile_for(runs[0][2])
            self.plans[key] = (vis, plan(runs, self.zig.seq, vis, tile, max_keys))
        return self.plans[key][1]


def current() -> CallState | None:
    return _CURRENT.get()


def enter(state: CallState) -> contextvars.Token[CallState | None]:
    return _CURRENT.set(state)


def leave(token: contextvars.Token[CallState | None]) -> None:
    _CURRENT.reset(token)


def carried(checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """``checkpoint`` (transformers' gradient-checkpointing function) whose recompute in backward
    runs inside the call state of the forward that checkpointed it: the recompute happens after
    the bound root's forward has left its state, and would otherwise find none."""
    if getattr(checkpoint, "hp_carries_cp_state", False):
        return checkpoint

    @functools.wraps(checkpoint)
    def checkpointed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is None:
            return checkpoint(function, *args, **kwargs)

        def run(*inner: Any, **named: Any) -> Any:
            token = enter(state)
            try:
                return function(*inner, **named)
            finally:
                leave(token)

        return checkpoint(run, *args, **kwargs)

    checkpointed.hp_carries_cp_state = True  # type: ignore[attr-defined]
    return checkpointed


def padding_rows(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The ``[B, S/C]`` padding mask of this rank's rows inside a context-parallel forward (whose
    model is called without one: ``mask`` is then None), else ``mask`` as given."""
    state = current()
    if state is None:
        return mask
    return None if state.key_padding is None else state.key_padding.index_select(1, state.zig.local)
