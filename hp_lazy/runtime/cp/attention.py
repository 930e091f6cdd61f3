"""The context-parallel attention function, registered with transformers' attention interface.

Each rank holds its zigzag rows of Q, K and V (``[B, H, S/C, D]``, RoPE applied with the global
positions). K and V are all-gathered along the sequence in one collective (before ``repeat_kv``:
under GQA only the K/V heads travel) and put in sequence order; the local query rows attend to
them blockwise (:mod:`hp_lazy.runtime.cp.blocks`): tiles of (query rows, keys) classified from the
visibility rule — causal, sliding window, packed documents, key padding, all over global token
positions — as skipped, unmasked, the kernel's own causal diagonal, or masked with a mask of one
tile; the calls are merged by log-sum-exp. One algorithm on every device (the CPU fused kernel,
plain tensor ops elsewhere); no tensor of ``S/C x S`` elements exists in forward or backward.
Attention sinks (``s_aux``) join the merge as one more key; logit softcapping (``softcap``) runs
in the plain-ops kernel, which applies it to each tile's scores; DSA's top-k selection
(``indices`` and the rows' mask :mod:`~hp_lazy.runtime.cp.indexed` hands the module) masks every
tile it covers.

Memory: the gathered K/V are not kept for backward; only the local Q, K, V, output and
log-sum-exp are saved, and backward gathers K/V again, runs each call's kernel backward with the
merged output and log-sum-exp (each call's exact share, nothing recomputed) and reduce-scatters
dK/dV (each rank's queries contributed to every rank's keys). Per layer: forward one all-gather
of K and V together; backward one all-gather and one reduce-scatter (two of each when K and V
differ in head dim). Activation memory per rank falls as 1/C.

Ulysses (``cp_ulysses``): an all-to-all takes Q, K and V (K and V in one call) from sequence
shards of every head to the whole sequence of ``heads / C`` heads; the same blockwise attention
runs over the whole sequence in sequence order; a second all-to-all takes the output back. K/V
heads fewer than ``C`` are replicated first. Per layer: forward two all-to-alls in, one out;
backward the same. No zigzag balancing is needed (every rank computes whole rows); the zigzag
rows are used anyway, so both modes share the entry.

Registered under :data:`KEY`, a name transformers' mask code does not know: ``create_causal_mask``
then returns ``None`` and builds no (wrong, local) mask, and the modeling code's own
``ALL_ATTENTION_FUNCTIONS.get_interface(...)`` call dispatches here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.comm import all_to_all, wire
from hp_lazy.runtime.cp import blocks, indexed, positions
from hp_lazy.runtime.cp.state import CallState, current
from hp_lazy.runtime.cp.zigzag import Zigzag
from hp_lazy.runtime.mesh import Group

KEY = "hp_lazy_cp"
UNDERSTOOD = frozenset({"s_aux", "softcap", "position_ids", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k",
                        "max_length_q", "max_length_k", "seq_idx", "deterministic", "output_attentions"})
"""Keyword arguments of the attention function that :func:`cp_attention` reads (sinks, softcap) or
that carry nothing it needs (the positions and packing it takes from the entry's state). Any
other tensor of attention's shape (3-D or more: an additive ``position_bias``, a DSA ``indices``)
is refused; what the model's own ``**kwargs`` carry down (``num_items_in_batch``, the labels) is
not attention's. The bind-time check (:mod:`.style`) refuses such keywords where the module's
source names them."""


def register() -> None:
    """Make :data:`KEY` a known attention implementation and watch transformers' mask code (idempotent)."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(KEY, cp_attention)
    observe_masks()


def observe_masks() -> None:
    """Wrap ``transformers.masking_utils._preprocess_mask_arguments``, which every mask builder
    (causal, sliding, chunked, bidirectional) calls first, to note in the current context-parallel
    forward whether the model gave it position ids without a 2-D mask and cache: the condition
    under which transformers separates packed documents. The wrapped function runs unchanged."""
    from transformers import masking_utils

    preprocess: Callable[..., Any] | None = getattr(masking_utils, "_preprocess_mask_arguments", None)
    if getattr(preprocess, "hp_observed", False):
        return
    signature = inspect.signature(preprocess) if callable(preprocess) else None
    if signature is None or not {"attention_mask", "cache", "position_ids"} <= set(signature.parameters):
        raise ShardingError(
            f"context parallel reads whether a model separates packed documents from the arguments of transformers' "
            f"masking_utils._preprocess_mask_arguments (attention_mask, cache, position_ids), which this transformers "
            f"{'does not have' if signature is None else f'defines as {signature}'}; use a transformers release "
            "hp_lazy supports (see the README)"
        )
    assert preprocess is not None

    @functools.wraps(preprocess)
    def observed(*args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is not None:
            given = signature.bind(*args, **kwargs).arguments
            if given.get("position_ids") is not None and given.get("attention_mask") is None \
                    and given.get("cache") is None:
                state.model_separates = True
        return preprocess(*args, **kwargs)

    observed.hp_observed = True  # type: ignore[attr-defined]
    masking_utils._preprocess_mask_arguments = observed


def _gather(k: torch.Tensor, v: torch.Tensor, g: Group, phase: wire.Phase) -> tuple[torch.Tensor, torch.Tensor]:
    if k.shape == v.shape:
        both = wire.all_gather(torch.stack([k, v]), g, 3, phase)
        return both[0], both[1]
    return wire.all_gather(k, g, 2, phase), wire.all_gather(v, g, 2, phase)


def _scatter(dk: torch.Tensor, dv: torch.Tensor, g: Group) -> tuple[torch.Tensor, torch.Tensor]:
    if dk.shape == dv.shape:
        both = wire.reduce_scatter(torch.stack([dk, dv]), g, 3, "backward")
        return both[0], both[1]
    return wire.reduce_scatter(dk, g, 2, "backward"), wire.reduce_scatter(dv, g, 2, "backward")


def _exchange(g: Group, zig: Zigzag, whole: bool) -> blocks.Exchange:
    """K/V of this rank's rows to the whole sequence in sequence order (an all-gather; MLA's
    K/V expanded from the gathered latent are whole already), and key gradients back."""

    def exchange(k: torch.Tensor, v: torch.Tensor, phase: str) -> tuple[torch.Tensor, torch.Tensor]:
        if phase == "grad":
            dk, dv = k.index_select(2, zig.gathered), v.index_select(2, zig.gathered)
            return (dk, dv) if whole else _scatter(dk, dv, g)
        kg, vg = (k, v) if whole else _gather(k, v, g, "forward" if phase == "forward" else "backward")
        return kg.index_select(2, zig.inverse), vg.index_select(2, zig.inverse)

    return exchange


def _same(k: torch.Tensor, v: torch.Tensor, phase: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Ulysses: K/V are the whole sequence in sequence order already."""
    return k, v


def cp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[B, H, S/C, D]`` in, ``[B, S/C, H, Dv]`` out."""
    state = current()
    where = type(module).__qualname__
    if state is None:
        raise ShardingError(
            f"{where}: context-parallel attention ran outside a context-parallel forward of the bound model (a "
            "layer called on its own?); call the top-level model, whose forward splits the sequence"
        )
    selects = bool(getattr(module, indexed.FLAG, False))  # DSA: the mask and top-k indices its wrapper set up
    if attention_mask is not None and not selects:
        raise ShardingError(
            f"{where}: got a {attention_mask.dim()}-D attention mask inside a context-parallel forward; pass a 2-D "
            "padding mask (or none) to the top-level model, which builds the masks over the whole sequence"
        )
    if dropout:
        raise ShardingError(
            f"{where}: attention dropout {dropout} under context parallel would draw different masks per rank than "
            "one process; set the config's attention_dropout to 0 (or call model.eval())"
        )
    understood = UNDERSTOOD | {"indices"} if selects else UNDERSTOOD
    extra = sorted(k for k, v in kwargs.items() if k not in understood and isinstance(v, torch.Tensor) and v.dim() >= 3)
    if extra:
        raise ShardingError(
            f"{where}: passes {extra} to the attention function, which context parallel does not split (each rank "
            "holds its rows of the queries and keys); train this family without cp"
        )
    sinks = kwargs.get("s_aux")
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise ShardingError(
            f"{where}: attention sinks (s_aux) of shape {tuple(sinks.shape)} under context parallel; expected one per "
            f"query head of this rank, ({query.shape[1]},)"
        )
    if key.shape[2] not in (query.shape[2], state.zig.seq):
        raise ShardingError(
            f"{where}: attends to {key.shape[2]} keys, neither this rank's {query.shape[2]} rows nor the whole "
            f"sequence's {state.zig.seq} (keys from outside the split sequence, e.g. a cached prefix joined to this "
            "call's); context parallel splits only attention over the model's own sequence; train this family "
            "without cp"
        )
    causal = bool(getattr(module, "is_causal", True)) if is_causal is None else bool(is_causal)
    vis = state.visibility(causal, sliding_window, positions.chunk_of(module))
    scale = blocks.default_scale(query, scaling)
    rescale = positions.query_rescale(module, state.zig)  # Llama 4's temperature, from the global rows
    if rescale is not None:
        query = query * rescale.to(query.dtype).view(1, 1, -1, 1)
    if selects:
        rows, seq = query.shape[2], state.zig.seq
        if attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4 \
                or tuple(attention_mask.shape[1:]) != (1, rows, seq) or state.mode == "cp_ulysses":
            got = None if attention_mask is None else (attention_mask.dtype, tuple(attention_mask.shape))
            raise ShardingError(
                f"{where}: DSA attention under context parallel expects the [B, 1, {rows}, {seq}] bool mask of its "
                f"rows over the whole sequence (with cp_mode='allgather'), got {got} ({state.mode}); a wrapper of "
                "this module changed its mask"
            )
        vis = dataclasses.replace(vis, rows=indexed.selected(attention_mask, kwargs.get("indices")))
    kernel = blocks.kernel_for(query, key, value, kwargs.get("softcap"))
    if state.mode == "cp_ulysses":
        return _ulysses(where, query, key, value, state, vis, kernel, scale, sinks), None
    # MLA: K/V expanded from the gathered latent (latent.py), the whole sequence in all-gather order
    whole = key.shape[2] == state.zig.seq != query.shape[2]
    calls = state.plan(vis, state.zig.runs(), kernel.max_keys)
    exchange = _exchange(state.group, state.zig, whole)
    out = blocks.BlockAttention.apply(query, key, value, scale, calls, vis, kernel, exchange, sinks)
    return out.transpose(1, 2).contiguous(), None


def _ulysses(
    where: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, state: CallState,
    vis: blocks.Visibility, kernel: blocks.Kernel, scale: float, sinks: torch.Tensor | None,
) -> torch.Tensor:
    g, zig = state.group, state.zig
    heads, kv = query.shape[1], key.shape[1]
    if heads % g.size:
        raise ShardingError(
            f"{where}: cp_mode='ulysses' splits this rank's {heads} attention heads over cp={g.size}, which does not "
            f"divide them; use cp_mode='allgather', or a cp (x tp) that divides the heads"
        )
    if sinks is not None:  # this rank's heads after the all-to-all (the gradient flows into that slice)
        sinks = sinks.narrow(0, g.rank * (heads // g.size), heads // g.size)
    if kv % g.size:  # fewer K/V heads than ranks: each rank gets the copies its query heads use
        key, value = key.repeat_interleave(heads // kv, dim=1), value.repeat_interleave(heads // kv, dim=1)
    q = all_to_all(query, g, 2, 1).index_select(2, zig.inverse)
    if key.shape == value.shape:
        both = all_to_all(torch.stack([key, value]), g, 3, 2).index_select(3, zig.inverse)
        k, v = both[0], both[1]
    else:
        k = all_to_all(key, g, 2, 1).index_select(2, zig.inverse)
        v = all_to_all(value, g, 2, 1).index_select(2, zig.inverse)
    calls = state.plan(vis, [(0, 0, zig.seq)], kernel.max_keys)
    out = blocks.BlockAttention.apply(q, k, v, scale, calls, vis, kernel, _same, sinks)
    out = all_to_all(out.index_select(2, zig.gathered), g, 1, 2)  # [B, H, S/C, Dv], this rank's rows
    return out.transpose(1, 2).contiguous()
