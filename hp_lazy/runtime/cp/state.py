"""The state of one context-parallel forward: set by the entry, read by attention and RoPE.

A :class:`CallState` lives for one call of the bound root (a context variable, so a forward in
another thread sees its own): the zigzag layout, the global position ids, the document ids of
packed sequences and the key padding mask, and the attention masks built from them — one per
(causal, window) kind, built on first use and shared by every layer of that kind.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

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
    """``[B, S]`` packed-sequence ids (transformers' detection: positions that do not step by 1), or None."""
    key_padding: torch.Tensor | None
    """``[B, S]`` bool, True for tokens that may be attended to (a 2-D attention mask), or None."""
    masks: dict[tuple[bool, bool, int | None], torch.Tensor | None] = field(default_factory=dict)

    def mask(self, causal: bool, window: int | None, *, whole: bool = False) -> torch.Tensor | None:
        """``[B or 1, 1, S/C, S]`` bool: local query rows x all-gathered key rows (``whole``: ``[.., S, S]``,
        every query and key in sequence order, for Ulysses); None for no mask."""
        key = (whole, causal, window)
        if key not in self.masks:
            self.masks[key] = self._build(causal, window, whole)
        return self.masks[key]

    def _build(self, causal: bool, window: int | None, whole: bool = False) -> torch.Tensor | None:
        everyone = torch.arange(self.zig.seq, device=self.zig.local.device)
        rows, cols = (everyone, everyone) if whole else (self.zig.local, self.zig.gathered)
        q = rows[:, None]
        k = cols[None, :]
        mask: torch.Tensor | None = None
        if causal:
            mask = k <= q
        if window is not None:  # transformers' attention-function convention: |q - k| < window
            near = k > q - window
            if not causal:  # a bidirectional window reaches as far forward as back
                near = near & (k < q + window)
            mask = near if mask is None else mask & near
        mask = None if mask is None else mask[None, None]
        if self.docs is not None:
            same = self.docs[:, rows][:, None, :, None] == self.docs[:, cols][:, None, None, :]
            mask = same if mask is None else mask & same
        if self.key_padding is not None:
            keys = self.key_padding[:, cols][:, None, None, :]
            mask = keys if mask is None else mask & keys
        return mask


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
