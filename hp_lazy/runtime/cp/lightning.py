"""Lightning attention under context and sequence parallel (MiniMax-Text-01 / M1's ``linear_attention``
layers), split over the sequence with transformers' own forward as the local computation, in the zigzag
order the attention layers use.

Lightning attention is a linear attention with a per-head scalar decay ``a = exp(-slope)``: the
state ``S [H, D, D]`` evolves ``S_t = a S_(t-1) + k_t^T v_t`` and ``o_t = q_t S_t``; transformers
computes it in blocks (``(q k^T * decay) v`` inside a block, ``(q * a^i) S`` from the blocks
before), which is the same recurrence whatever the block boundaries. So a chunk of ``c`` tokens
that starts from ``S_in`` instead of zeros outputs ``o0_t + (q_t a^t) S_in`` (``t = 1 .. c``) and
leaves ``a^c S_in + F``, with ``o0`` its outputs from zeros and ``F = sum_t a^(c - t) k_t^T v_t``.

The class's forward computes the recurrence inline (no module-level kernel to wrap, unlike
:mod:`.recurrent`), so :func:`wrap` wraps the class's forward, which, on an instance cp splits:

- run on this rank's two chunks as a batch of ``2B`` (``[B, 2c, D] -> [2B, c, D]``, the 2-D
  padding mask likewise): transformers' block loop gives ``o0`` of each chunk from zeros;
- read ``q, k, v`` where the forward makes them (a hook on its activation, the padding mask
  applied as the forward applies it) and compute every chunk's ``F`` (``[2B, H, D, D]``);
- all-gather the ``F`` of every chunk (per rank ``2 x B x H x D x D`` values, whatever ``S``),
  compose them in sequence order up to this rank's chunks (:func:`~.recurrent.starts`) and add
  ``(q a^t) S_in`` to the attention output on its way into the module's ``norm`` (a pre-hook),
  before anything that is not linear in it;
- join the ``2B`` rows back to ``[B, 2c, D]``.

Autograd runs through all of it (the all-gather's backward reduce-scatters the gradients of ``F``
to the chunks they came from). The carry computes in float32 (float64 for float64 inputs).

Under sequence parallel (:func:`split_sequence`, from :mod:`hp_lazy.runtime.sp.mixers`) the same
carry runs over the tp ranks' consecutive pieces, one chunk each: no hidden state is gathered, the
parameters' gradients are each rank's tokens' part (summed over tp with the stack's norms), and a
cache handed in empty (a prefill with ``use_cache=True``) is left the whole sequence's final state.
Outside a split forward the wrapper calls through unchanged.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import IMPL, SEQUENCE_CARRIED
from hp_lazy.runtime.cp.recurrent import chunks, compose, starts
from hp_lazy.runtime.cp.state import CallState, current
from hp_lazy.runtime.mesh import Group

READS = frozenset({"qkv_proj", "act_fn", "norm", "slope_rate", "query_decay", "key_decay", "diagonal_decay",
                   "head_dim", "num_attention_heads", "get_linear_cache", "set_linear_cache"})
"""What a lightning attention forward reads off its module and its cache (MiniMax's
``MiniMaxLightningAttention``; the split reads and sets the cache's state the same way)."""
MASK_FN = "apply_mask_to_padding_states"
FLAG = "hp_cp_lightning"
"""Set on a split instance (its hooks are in place); other instances of the class call through."""
WRAPPED = "hp_cp_wrapped"
"""Set on the class's wrapped forward (its original under it), so a class is wrapped once."""


def supports(module: nn.Module) -> bool:
    """A lightning attention: its forward reads :data:`READS` and masks padding with the modeling
    module's :data:`MASK_FN`; its activation and norm are modules (hooked), its slopes ``[H, 1, 1]``."""
    forward = inspect.unwrap(getattr(type(module), IMPL, type(module).forward))
    names = set(getattr(getattr(forward, "__code__", None), "co_names", ()))
    slope = getattr(module, "slope_rate", None)
    return READS | {MASK_FN} <= names and isinstance(getattr(module, "act_fn", None), nn.Module) \
        and isinstance(getattr(module, "norm", None), nn.Module) and isinstance(slope, torch.Tensor) \
        and slope.dim() == 3 and hasattr(sys.modules.get(type(module).__module__), MASK_FN)


def wrap(module: nn.Module) -> None:
    """Split ``module`` under cp: its class's forward wrapped (once per class), its activation and
    norm given the hooks that read q, k, v and add the carried part (once per instance). All of
    it calls through outside a context-parallel forward; a deep copy of the module keeps working
    (no closure holds the instance)."""
    cls = type(module)
    if not hasattr(cls.forward, WRAPPED):
        forward = _carrying(cls.forward)
        setattr(forward, WRAPPED, cls.forward)
        cls.forward = forward
    if not getattr(module, FLAG, False):
        getattr(module, "act_fn").register_forward_hook(_read_qkv)  # noqa: B009 (nn.Module's attribute typing)
        getattr(module, "norm").register_forward_pre_hook(_add_carried)  # noqa: B009
        setattr(module, FLAG, True)


def split_sequence(module: nn.Module, group: Group) -> None:
    """Split ``module`` under sequence parallel: inside its layer stack (which cuts the sequence
    into ``group``'s consecutive pieces, and outside which it is never called) it runs on this
    rank's piece, the state of the pieces before carried in, as under cp with one chunk per rank.
    The layer hands it its padding mask whole, which it cuts (:data:`~hp_lazy.names.SEQUENCE_CARRIED`)."""
    wrap(module)
    module.__dict__[SEQUENCE_CARRIED] = group


_RUNNING: list[dict[str, Any]] = []
"""The lightning forwards running split, innermost last: each one's module, the composition of its
chunks' states (:func:`~.recurrent.compose`), batch, mask of its rows and (once its activation
ran) masked qkv. A list, not a context variable: dynamo traces a list (``torch.compile``)."""


def _carrying(fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = current()
        group = self.__dict__.get(SEQUENCE_CARRIED)
        if state is not None and getattr(self, FLAG, False):
            return _over_chunks(fn, signature.bind(self, *args, **kwargs), state)
        if group is not None and group.size > 1:  # inside its stack (a recompute in backward too): a piece
            return _over_pieces(fn, signature.bind(self, *args, **kwargs), group)
        return fn(self, *args, **kwargs)

    return forward


def _over_chunks(fn: Callable[..., Any], bound: inspect.BoundArguments, state: CallState) -> Any:
    """cp: this rank's two zigzag chunks as a batch of ``2B`` (no cache: the entry refuses one)."""
    given = bound.arguments
    hidden, mask = given["hidden_states"], given.get("attention_mask")
    given["hidden_states"] = torch.cat(chunks(state, hidden, 1), dim=0)
    if mask is not None:
        given["attention_mask"] = torch.cat(chunks(state, mask, 1), dim=0)
    out, *rest = _run(fn, bound, lambda f, z, step: starts(state, f, z, step), hidden.shape[0])
    return (torch.cat(out.split(hidden.shape[0], dim=0), dim=1), *(None for _ in rest))


def _over_pieces(fn: Callable[..., Any], bound: inspect.BoundArguments, group: Group) -> Any:
    """sp: this rank's piece, ``[B, S / tp, H]``, after the pieces of the ranks before it."""
    given, module = bound.arguments, bound.arguments["self"]
    name = "cache" if "cache" in given else "past_key_values"
    cache, index = given.get(name), getattr(module, "layer_idx", None)
    if cache is not None and cache.get_linear_cache(index) is not None:
        raise ShardingError(f"{type(module).__qualname__} (layer {index}) under sequence parallel: the cache holds "
                            "the lightning state of earlier tokens (generation), which the tp ranks' pieces do not "
                            "continue; generate with a plan without sequence_parallel")
    hidden, mask = given["hidden_states"], given.get("attention_mask")
    if mask is not None and mask.shape[1] != hidden.shape[1]:  # the layer's whole mask: this rank's piece
        given["attention_mask"] = mask.chunk(group.size, dim=1)[group.rank]
    holders, ended = [(r, 0) for r in range(group.size)], []

    def starts_of(final: torch.Tensor, zero: torch.Tensor, step: Callable[..., torch.Tensor]) -> torch.Tensor:
        begun, end = compose(group, holders, [group.rank], final, zero, step, through=cache is not None)
        ended.append(end)
        return begun

    out, *rest = _run(fn, bound, starts_of, hidden.shape[0])
    if cache is not None:  # the forward stored this piece's own state: the whole sequence's instead
        cache.set_linear_cache(index, ended[-1].to(out.dtype) if ended[-1] is not None else None)
    return (out, *(None for _ in rest))


def _run(fn: Callable[..., Any], bound: inspect.BoundArguments, starts_of: Callable[..., torch.Tensor],
         batch: int) -> Any:
    _RUNNING.append({"module": bound.arguments["self"], "starts": starts_of, "batch": batch,
                     "mask": bound.arguments.get("attention_mask")})
    try:
        return fn(*bound.args, **bound.kwargs)
    finally:
        _RUNNING.pop()


def _read_qkv(act: nn.Module, _inputs: Any, out: torch.Tensor) -> None:
    call = _RUNNING[-1] if _RUNNING else None
    if call is not None and getattr(call["module"], "act_fn", None) is act:
        mask_fn = getattr(sys.modules[type(call["module"]).__module__], MASK_FN)
        call["qkv"] = mask_fn(out, call["mask"])  # as the forward masks it


def _add_carried(norm: nn.Module, inputs: tuple) -> tuple | None:
    call = _RUNNING[-1] if _RUNNING else None
    if call is None or getattr(call["module"], "norm", None) is not norm:
        return None
    return (inputs[0] + _carry(call["module"], call["starts"], call.pop("qkv"), call["batch"]), *inputs[1:])


def _carry(module: nn.Module, starts_of: Callable[..., torch.Tensor], qkv: torch.Tensor, batch: int
           ) -> torch.Tensor:
    """What the state of the chunks before adds to each chunk's attention output: ``qkv [nB, c,
    H * 3D]`` (this rank's ``n`` chunks along the batch, activated and masked as the forward's) ->
    ``[nB, c, H * D]``; ``starts_of(final, zero, step)`` composes the chunks' states."""
    heads, dim = int(getattr(module, "num_attention_heads")), int(getattr(module, "head_dim"))  # noqa: B009
    rows, c = qkv.shape[0], qkv.shape[1]
    work = torch.promote_types(qkv.dtype, torch.float32)
    q, k, v = qkv.to(work).reshape(rows, c, heads, 3 * dim).split(dim, dim=-1)  # [nB, c, H, D] each
    slope = getattr(module, "slope_rate").to(work).reshape(heads, 1)  # noqa: B009
    t = torch.arange(1, c + 1, device=qkv.device, dtype=work)
    final = torch.einsum("bthk,ht,bthv->bhkv", k, torch.exp(-slope * (c - t)), v)  # F, [nB, H, D, D]
    decay = torch.exp(-slope * c)[..., None]  # a^c, [H, 1, 1]
    s_in = starts_of(final, final.new_zeros(batch, heads, dim, dim), lambda f, s: decay * s + f)
    carried = torch.einsum("bthk,ht,bhkv->bthv", q, torch.exp(-slope * t), s_in)
    return carried.reshape(rows, c, heads * dim).to(qkv.dtype)
