"""Lightning attention under context parallel (MiniMax-Text-01 / M1's ``linear_attention`` layers),
split over the sequence with transformers' own forward as the local computation, in the zigzag
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
Outside a context-parallel forward the wrapper calls through unchanged.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hp_lazy.names import IMPL
from hp_lazy.runtime.cp.recurrent import chunks, starts
from hp_lazy.runtime.cp.state import CallState, current

READS = frozenset({"qkv_proj", "act_fn", "norm", "slope_rate", "query_decay", "key_decay", "diagonal_decay",
                   "head_dim", "num_attention_heads"})
"""What a lightning attention forward reads off its module (MiniMax's ``MiniMaxLightningAttention``)."""
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


_RUNNING: list[dict[str, Any]] = []
"""The lightning forwards running under cp, innermost last: each one's module, call state, batch,
chunked mask and (once its activation ran) masked qkv. A list, not a context variable: dynamo
traces a list (``torch.compile``)."""


def _carrying(fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is None or not getattr(self, FLAG, False):
            return fn(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)  # no cache: the entry refuses one before any layer runs
        given = bound.arguments
        hidden, mask = given["hidden_states"], given.get("attention_mask")
        given["hidden_states"] = torch.cat(chunks(state, hidden, 1), dim=0)
        if mask is not None:
            given["attention_mask"] = torch.cat(chunks(state, mask, 1), dim=0)
        _RUNNING.append({"module": self, "state": state, "batch": hidden.shape[0],
                         "mask": given.get("attention_mask")})
        try:
            out, *rest = fn(*bound.args, **bound.kwargs)
        finally:
            _RUNNING.pop()
        return (torch.cat(out.split(hidden.shape[0], dim=0), dim=1), *(None for _ in rest))

    return forward


def _read_qkv(act: nn.Module, _inputs: Any, out: torch.Tensor) -> None:
    call = _RUNNING[-1] if _RUNNING else None
    if call is not None and getattr(call["module"], "act_fn", None) is act:
        mask_fn = getattr(sys.modules[type(call["module"]).__module__], MASK_FN)
        call["qkv"] = mask_fn(out, call["mask"])  # as the forward masks it


def _add_carried(norm: nn.Module, inputs: tuple) -> tuple | None:
    call = _RUNNING[-1] if _RUNNING else None
    if call is None or getattr(call["module"], "norm", None) is not norm:
        return None
    return (inputs[0] + _carry(call["module"], call["state"], call.pop("qkv"), call["batch"]), *inputs[1:])


def _carry(module: nn.Module, state: CallState, qkv: torch.Tensor, batch: int) -> torch.Tensor:
    """What the state of the chunks before adds to each chunk's attention output: ``qkv [2B, c,
    H * 3D]`` (activated and masked as the forward's) -> ``[2B, c, H * D]``."""
    heads, dim = int(getattr(module, "num_attention_heads")), int(getattr(module, "head_dim"))  # noqa: B009
    rows, c = qkv.shape[0], qkv.shape[1]
    work = torch.promote_types(qkv.dtype, torch.float32)
    q, k, v = qkv.to(work).reshape(rows, c, heads, 3 * dim).split(dim, dim=-1)  # [2B, c, H, D] each
    slope = getattr(module, "slope_rate").to(work).reshape(heads, 1)  # noqa: B009
    t = torch.arange(1, c + 1, device=qkv.device, dtype=work)
    final = torch.einsum("bthk,ht,bthv->bhkv", k, torch.exp(-slope * (c - t)), v)  # F, [2B, H, D, D]
    decay = torch.exp(-slope * c)[..., None]  # a^c, [H, 1, 1]
    s_in = starts(state, final, final.new_zeros(batch, heads, dim, dim), lambda f, s: decay * s + f)
    carried = torch.einsum("bthk,ht,bhkv->bthv", q, torch.exp(-slope * t), s_in)
    return carried.reshape(rows, c, heads * dim).to(qkv.dtype)
