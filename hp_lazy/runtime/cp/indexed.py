"""Sparse attention with an indexer under context parallel: each row's keys selected over the whole sequence.

Two kinds of indexed attention module, told apart by what their indexer takes:

- **DSA** (DeepSeek-V3.2, GLM-MoE-DSA, AXK2, Mistral-Large-4, HY-V4): MLA whose every query
  attends only to the ``index_topk`` keys its *indexer* scores highest: a small projection of each
  token to one indexer key, scored against the query rows under the causal mask
  (``attention_mask[:, 0]``), top-k over the keys; layers whose indexer is ``None`` reuse the
  previous layer's top-k. transformers hands the top-k to the attention function as ``indices``
  (``[B, rows, topk]`` key positions) under any implementation but eager/SDPA, whose mask it folds
  them into instead. The indexer takes a ``cache``.
- **A selection mask** (Kolibri 1.1): the indexer takes the attention's own ``key_states`` and
  ``attention_mask`` and returns the mask of the keys each row keeps (a pool of key blocks from
  the pool-source layers, then the top-k of the pool plus sink and local tokens), which the module
  hands to the attention function as its mask. Layers without an indexer (sliding windows) select
  nothing: they are plain attention.

Under cp each rank holds its zigzag rows; the keys a query may select are the whole sequence's.
So, per indexed module (:func:`wrap`):

- the module receives, for the ``attention_mask`` the model passes as ``None`` under cp, the
  visibility of its rows over the whole sequence's keys (causal, packed documents, key padding):
  ``[B, 1, S/C, S]`` bool, keys in sequence order;
- the indexer's keys are all-gathered over cp and put in sequence order. DSA's through the one
  hook its code has for keys beyond its own rows: ``cache.update_indexer(k, layer_idx)`` (a cache
  object that only gathers; the indexer runs without gradients, so the gather carries none). A
  mask indexer's ``key_states`` argument is gathered before its forward runs (an autograd gather:
  a reduce-scatter of the keys' gradient in backward, should an indexer ever differentiate
  through them). Sequence order matters beyond the indices' meaning: scores tie (DSA's ReLU
  scores at 0 wherever every indexer head scores a key negative; Kolibri's pool and top-k), and
  the top-k breaks ties by position, as in one process only if the keys stand where one process
  has them;
- :func:`~hp_lazy.runtime.cp.attention.cp_attention` takes ``indices`` (DSA) and the mask
  (:func:`selected`) and runs the blockwise attention with every non-empty tile masked by the
  selection (the MLA K/V, gathered in rank order by :mod:`.latent`, and a mask indexer's K/V,
  gathered by the attention function, are put in sequence order as for any attention).

The price is the indexer's own: transformers' indexers score every (row, key) pair (``[B, rows,
heads, S]`` floats); each rank holds ``1/C`` of one process's, plus the ``[B, S/C, S]`` selection
mask. Only with ``cp_mode='allgather'`` (Ulysses splits heads, and would need every rank's whole
rows).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hp_lazy.runtime.comm import gather_to, wire
from hp_lazy.runtime.cp.state import CallState, current

FLAG = "hp_cp_indexed"
"""Set on an instance :func:`wrap` prepared: :func:`~hp_lazy.runtime.cp.attention.cp_attention`
accepts its mask and ``indices``."""


KEYS = "key_states"
"""The argument through which a selection-mask indexer takes the attention's keys."""


def is_indexed(module: nn.Module, passes_indices: bool) -> bool:
    """An attention module that selects its keys: it has an indexer, or it has an ``indexer``
    attribute that is ``None`` and passes a selection to the attention function (DSA: the previous
    layer's top-k as ``indices``; MiniMax-M3: ``block_indices``). A ``None`` indexer on a module that
    passes none (Kolibri's sliding layers) selects nothing."""
    return getattr(module, "indexer", None) is not None or (hasattr(module, "indexer") and passes_indices)


def _takes_keys(indexer: nn.Module | None) -> bool:
    return indexer is not None and KEYS in inspect.signature(type(indexer).forward).parameters


def unsupported(module: nn.Module, mode: str) -> str | None:
    """Why context parallel cannot split this indexed attention, or None."""
    if mode != "cp_allgather_kv":
        return ("selects its keys with an indexer, which context parallel splits with cp_mode='allgather' only "
                "(Ulysses would need every rank's whole rows of the selection); use cp_mode='allgather'")
    indexer = getattr(module, "indexer", None)
    if _takes_keys(indexer):  # a selection mask over the attention's own keys (Kolibri 1.1)
        return None
    if not callable(getattr(type(module), "expand_kv", None)):
        return ("selects its keys with an indexer over attention that is not MLA (no expand_kv); context parallel "
                "splits DeepSeek-V3.2's kind of DSA (an MLA latent; each token's top-k keys over the whole "
                f"sequence handed to the attention function as indices) and indexers that take the attention's "
                f"{KEYS} and return a selection mask (Kolibri 1.1)")
    if indexer is not None and "cache" not in inspect.signature(type(indexer).forward).parameters:
        return (f"selects its keys with a DSA indexer ({type(indexer).__name__}) that takes no cache, the hook "
                "through which context parallel hands it the whole sequence's indexer keys")
    reads = sorted(_cache_reads(type(indexer).forward) - {"update_indexer"}) if indexer is not None else []
    if reads:  # GLM-5-Next's pooled indexer reads the cache's layers and lengths
        return (f"selects its keys with a DSA indexer ({type(indexer).__name__}) that reads the cache's "
                f"{reads} besides update_indexer, the one hook through which context parallel hands it the "
                "whole sequence's indexer keys")
    return None


def _cache_reads(forward: Callable[..., Any]) -> set[str]:
    """The attributes a forward reads of its ``cache`` argument (from its source; none if unreadable)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return set()
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cache"}


class _GatheredKeys:
    """The cache the indexer sees under cp: ``update_indexer`` returns every rank's keys."""

    def __init__(self, state: CallState) -> None:
        self.state = state

    def update_indexer(self, k: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """``[B, S/C, D]`` (this rank's rows) -> ``[B, S, D]`` in sequence order, no gradient."""
        gathered = wire.all_gather(k.detach().contiguous(), self.state.group, 1, "forward")
        return gathered.index_select(1, self.state.zig.inverse)


def wrap(module: nn.Module) -> None:
    """Give ``module`` (an instance) and its indexer forwards that see the whole sequence's keys."""
    module.forward = _rebound(module.forward, _give_mask)
    setattr(module, FLAG, True)
    indexer = getattr(module, "indexer", None)
    if indexer is not None:
        indexer.forward = _rebound(indexer.forward, _gather_keys if _takes_keys(indexer) else _give_keys)


def _give_mask(arguments: dict[str, Any], state: CallState) -> None:
    """The rows' mask, one per batch row as one process's mask is: a mask of one row broadcast over the
    batch (the causal case) would have Kolibri's indexer, which loops over the mask's batch rows,
    select for the first row only (an expanded view, no copy)."""
    if arguments.get("attention_mask") is None:
        mask = rows_mask(state)
        hidden = arguments.get("hidden_states")
        batch = hidden.shape[0] if isinstance(hidden, torch.Tensor) else mask.shape[0]
        arguments["attention_mask"] = mask.expand(batch, *mask.shape[1:])


def _give_keys(arguments: dict[str, Any], state: CallState) -> None:
    arguments["cache"] = _GatheredKeys(state)


def _gather_keys(arguments: dict[str, Any], state: CallState) -> None:
    """A mask indexer's ``key_states`` ``[B, H, S/C, D]`` (this rank's rows) -> ``[B, H, S, D]`` in
    sequence order; the same tensor as the last indexer's (Kolibri's layers reading an earlier
    layer's K/V) is not gathered again."""
    keys = arguments[KEYS]
    if keys.shape[2] == state.zig.seq:  # keys already whole (expanded from a latent gathered by .latent)
        return
    if state.indexer_keys is None or state.indexer_keys[0] is not keys:
        gathered = gather_to(keys.contiguous(), state.group, 2).index_select(2, state.zig.inverse)
        state.indexer_keys = (keys, gathered)
    arguments[KEYS] = state.indexer_keys[1]


def _rebound(fn: Callable[..., Any], edit: Callable[[dict[str, Any], CallState], None]) -> Callable[..., Any]:
    """``fn`` whose bound arguments ``edit`` changes inside a context-parallel forward."""
    signature = inspect.signature(fn)

    def call(*args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is None:
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        edit(bound.arguments, state)
        return fn(*bound.args, **bound.kwargs)

    return call


def rows_mask(state: CallState) -> torch.Tensor:
    """``[B, 1, S/C, S]`` bool: which keys (sequence order) this rank's rows may attend to; made by
    the first DSA layer of a forward, shared by the others (no layer changes it: ``selected`` makes
    a new tensor)."""
    if state.rows_mask is None:
        vis = state.visibility(True, None)
        state.rows_mask = vis.mask_at(state.zig.local, torch.arange(state.zig.seq, device=state.zig.local.device))
    return state.rows_mask


def selected(mask: torch.Tensor, indices: torch.Tensor | None) -> torch.Tensor:
    """The keys each row attends to (sequence order): the module's mask and, where given, its
    top-k ``indices`` into those keys."""
    if indices is None:
        return mask
    chosen = torch.zeros(indices.shape[0], *mask.shape[2:], dtype=torch.bool, device=mask.device)
    return mask & chosen.scatter_(-1, indices.long(), True).unsqueeze(1)
