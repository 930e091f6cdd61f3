"""Recurrent layers under context parallel, split over the sequence with transformers' own torch
kernels as the local computation, in the zigzag order the attention layers use (no reordering
all-to-all): the gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo-hybrid, Lara), its
per-channel-decay form (KDA: Kimi Linear, Bailing-hybrid, GLM-5-Next), Mamba2's state space scan
(Bamba, Falcon-H1, Nemotron-H, GraniteMoE-hybrid, Zamba2), Mamba1's selective scan (Jamba) and
the short causal convolutions all of them (and LFM's and Inkling's convolution layers) run first.

A rank holds two chunks of ``c`` tokens of the global sequence: chunk ``r`` and chunk
``2C - 1 - r`` (:mod:`.zigzag`). Every kernel mixes tokens only forward in time, so each chunk needs
only what precedes it:

- **Causal convolution** (kernel ``k``): each chunk is convolved with the ``k - 1`` tokens before
  it prepended (its *halo*; zeros before the first token, as the kernel's own padding). The last
  ``min(k - 1, c)`` tokens of every chunk are all-gathered (``2 x B x D x (k - 1)`` values per rank,
  whatever ``S``), and the halo of chunk ``g`` is read from the chunks before it.
- **Linear recurrences**: the state (``[Dk, Dv]`` per head for the delta rules, ``[P, N]`` for
  Mamba2) evolves linearly and independently along one of its axes (the delta rules' value
  columns, Mamba2's head-dim rows): a chunk maps the state it starts from to ``A S + F`` (Mamba2:
  ``S A + F``), and its outputs to ``out0 + q_eff S``. One kernel call per chunk gives all of it:
  the independent axis is widened by identity slices (values of zeros next to the real ones,
  started from ``[0 | I]``); the real part of the output and final state are ``out0`` and ``F``,
  the identity part ``q_eff`` and ``A``. The ``(A, F)`` of every chunk are all-gathered (per rank
  ``2 x B x H x Dk x (Dk + Dv)``, Mamba2 ``2 x B x H x (P + N) x N``: bytes per layer independent
  of ``S``), every rank composes them in sequence order up to its chunks (the scan of per-chunk
  transitions, ``2C`` small matmuls) and adds ``q_eff S_in`` to its outputs. Autograd runs through
  all of it (the all-gather's backward reduce-scatters the gradients of ``A`` and ``F`` to the
  chunks they came from).
- **Mamba1** decays every entry of its ``[D, N]`` state on its own (a per-channel, per-step
  ``exp(A dt)``), so no axis is independent of the others in the way the identity needs; its maps
  are elementwise instead: ``S_out = P * S_in + F`` with ``P = exp(A sum dt)``. ``F`` and the
  carried part of the outputs are computed in torch beside the kernel (:func:`_selective`), in
  blocks of tokens recomputed in backward; per rank ``2 x B x D x (N + 1)`` values gathered (``F``
  and ``sum dt``: each rank makes ``P`` from ``A``, which it holds).

Packed documents: transformers' torch kernels reset neither the state nor the convolution at a
document boundary unless the caller passes ``cu_seqlens`` / ``seq_idx``; neither does this (and
those arguments are refused under cp). Padding: the model zeroes padded tokens' hidden states with
the 2-D mask from ``create_recurrent_attention_mask``, which under cp returns this rank's rows.

A layer is split when every module-level function its forward calls is one of :data:`KNOWN` and
it calls the convolution (:func:`supports`); lightning attention, which computes its recurrence in
the class's own forward, is split by :mod:`.lightning`; anything else is refused at load.
Installed per modeling module (:func:`install`) by wrapping the module-level functions the layers
call (after any hub kernel took their place) and ``create_recurrent_attention_mask``; outside a
context-parallel forward each wrapper calls through unchanged. The fused Mamba2 path
(``mamba2_split_conv1d_scan_combined``, a CUDA kernel) is declined under cp, so the layer takes its
modular path through the wrapped functions.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from hp_lazy.errors import ShardingError
from hp_lazy.names import IMPL
from hp_lazy.runtime.comm import gather_to
from hp_lazy.runtime.cp.state import CallState, current
from hp_lazy.runtime.mesh import Group

CONV = "causal_conv1d_forward"
CONV_FN = "causal_conv1d_fn"
"""transformers 5.24's convolution (``hidden_states [B, D, L], weight [D, k], bias, activation``)."""
RULE = "torch_chunk_gated_delta_rule"
KDA = "chunk_kimi_delta_attention"
SCAN = "mamba2_scan_forward"
SSD = "mamba2_chunk_scan"
MAMBA = "mamba_scan_forward"
"""Mamba1's scan with its cache (Jamba's mixer calls it): calls :data:`SELECTIVE`."""
SELECTIVE = "mamba_selective_scan"
FUSED = "mamba2_split_conv1d_scan_combined"
MASK = "create_recurrent_attention_mask"
DECODE = ("torch_recurrent_gated_delta_rule", "recurrent_kimi_delta_attention", "causal_conv1d_update",
          "mamba2_selective_state_update", "mamba_selective_state_update")
"""One-token (cached) steps: a cache is refused under cp before any layer runs."""
KNOWN = frozenset({CONV, CONV_FN, RULE, KDA, SCAN, SSD, FUSED, MAMBA, SELECTIVE, "apply_mask_to_padding_states",
                   *DECODE})
"""The module-level functions a recurrent layer's forward may call to be split (transformers 5.24's
layers call the convolution as ``causal_conv1d_fn`` and Mamba2's ``mamba2_chunk_scan`` directly)."""
WRAPPED = "hp_cp_wrapped"
"""Set on a wrapper (its original under it), so a module is wrapped once."""


def supports(module: torch.nn.Module) -> bool:
    """A recurrent layer this room splits: its forward calls the causal convolution, and every
    module-level function it calls is one of :data:`KNOWN` (Mamba2's scan only where the module
    has the SSD kernel it calls)."""
    modeling = sys.modules.get(type(module).__module__)
    if modeling is None:
        return False
    forward = inspect.unwrap(getattr(type(module), IMPL, type(module).forward))  # under transformers' decorators
    names = getattr(getattr(forward, "__code__", None), "co_names", ())
    # module-level callables that are not classes (hub kernel decorators make some of them objects)
    called = {n for n in names if n in vars(modeling) and callable(vars(modeling)[n])
              and not isinstance(vars(modeling)[n], type)}
    direct = CONV_FN in called and hasattr(modeling, CONV)  # install wraps CONV_FN only where CONV is absent
    return bool(called & {CONV, CONV_FN}) and called <= KNOWN and not direct \
        and (SCAN not in called or hasattr(modeling, SSD)) and (MAMBA not in called or hasattr(modeling, SELECTIVE))


def install(modeling: ModuleType) -> None:
    """Wrap ``modeling``'s kernels and recurrent-mask builder (idempotent)."""
    wrappers = ((CONV, _conv), (CONV_FN, _conv_fn), (RULE, _rule), (KDA, _rule), (SSD, _ssd), (FUSED, _declined),
                (SELECTIVE, _selective), (MASK, _mask))
    for name, wrap in wrappers:
        if name == CONV_FN and hasattr(modeling, CONV):  # 5.25: the forward calls CONV, which calls CONV_FN
            continue
        fn = getattr(modeling, name, None)
        if fn is not None and not hasattr(fn, WRAPPED):
            wrapper = wrap(fn)
            setattr(wrapper, WRAPPED, fn)
            setattr(modeling, name, wrapper)


def chunks(state: CallState, x: torch.Tensor, dim: int) -> list[torch.Tensor]:
    """This rank's two chunks of ``x`` along ``dim`` (local order = zigzag runs)."""
    return [x.narrow(dim, local, n) for local, _, n in state.zig.runs()]


def _global(state: CallState) -> list[tuple[int, int]]:
    """For each global chunk in sequence order: (rank, slot) holding it."""
    size = state.group.size
    return [(c, 0) if c < size else (2 * size - 1 - c, 1) for c in range(2 * size)]


def _mine(state: CallState) -> list[int]:
    """The global chunk index of this rank's slots 0 and 1."""
    rank, size = state.group.rank, state.group.size
    return [rank, 2 * size - 1 - rank]


def _refuse(what: str, why: str) -> ShardingError:
    return ShardingError(f"{what} under context parallel: {why}; train this batch without cp, or report the model")


def _conv(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(fn)
    def conv(conv1d: torch.nn.Conv1d, hidden_states: torch.Tensor, cache: Any, layer_idx: int, *args: Any,
             **kwargs: Any) -> torch.Tensor:
        state = current()
        if state is None:
            return fn(conv1d, hidden_states, cache, layer_idx, *args, **kwargs)
        if cache is not None or kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
            raise _refuse(f"{CONV} with a cache or document ids (seq_idx / cu_seqlens)",
                          "the convolution's halo crosses ranks")
        return _with_halo(state, hidden_states, conv1d.kernel_size[0] - 1,
                          lambda x: fn(conv1d, x, None, layer_idx, *args, **kwargs))

    return conv


def _conv_fn(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """transformers 5.24's ``causal_conv1d_fn``: the same halo as :func:`_conv`."""

    @functools.wraps(fn)
    def conv(hidden_states: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        state = current()
        if state is None:
            return fn(hidden_states, weight, *args, **kwargs)
        if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
            raise _refuse(f"{CONV_FN} with document ids (seq_idx / cu_seqlens)", "the convolution's halo crosses ranks")
        return _with_halo(state, hidden_states, weight.shape[-1] - 1, lambda x: fn(x, weight, *args, **kwargs))

    return conv


def _with_halo(state: CallState, hidden_states: torch.Tensor, halo: int,
               run: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``run`` (a causal convolution over ``[B, D, L]``) on this rank's two chunks, each with the
    ``halo`` tokens before it prepended (all-gathered tails of the chunks; zeros before the first)."""
    if halo == 0:
        return run(hidden_states)
    pieces = chunks(state, hidden_states, 2)  # [B, D, c] each
    c = pieces[0].shape[-1]
    keep = min(halo, c)
    tails = gather_to(torch.stack([p[..., c - keep :] for p in pieces]), state.group, 0)  # [2C, B, D, keep]
    holders = _global(state)
    joined = []
    for g, piece in zip(_mine(state), pieces, strict=True):
        before = [tails[2 * r + slot] for r, slot in holders[max(0, g - -(-halo // keep)) : g]]
        prefix = torch.cat([piece.new_zeros(*piece.shape[:-1], halo), *before], dim=-1)[..., -halo:]
        joined.append(torch.cat([prefix, piece], dim=-1))
    out = run(torch.cat(joined, dim=0))[..., halo:]
    return torch.cat(out.chunk(2, dim=0), dim=-1)


def _rule(fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]) -> Callable[..., Any]:
    """A delta rule (gated: ``g [B, L, H]``; KDA: ``g [B, L, H, Dk]``): state ``[H, Dk, Dv]``."""
    name = getattr(inspect.unwrap(fn), "__name__", RULE)

    @functools.wraps(fn)
    def rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is None:
            return fn(query, key, value, *args, **kwargs)
        if args:
            raise _refuse(f"{name} with positional g / beta", "the wrapper reads them by name")
        if kwargs.get("initial_state") is not None or kwargs.get("output_final_state") or \
                kwargs.get("cu_seqlens") is not None:
            raise _refuse(f"{name} with a recurrent state or document ids (initial_state, output_final_state, "
                          "cu_seqlens)", "the state is passed between ranks by hp_lazy")
        g, beta = kwargs.pop("g"), kwargs.pop("beta")
        kwargs.pop("initial_state", None), kwargs.pop("output_final_state", None)
        b, dk = key.shape[0], key.shape[-1]
        heads, dv = value.shape[2], value.shape[-1]  # the state is per value head (query/key heads may be fewer)
        # both chunks as one batch: [2B, c, H, *]; the value columns [v | 0_Dk] from the state [0 | I]
        q, k, gg, bb = (torch.cat(chunks(state, t, 1), dim=0) for t in (query, key, g, beta))
        v = torch.cat(chunks(state, value, 1), dim=0)
        v = torch.cat([v, v.new_zeros(*v.shape[:-1], dk)], dim=-1)
        eye = torch.eye(dk, dtype=torch.float32, device=value.device).expand(2 * b, heads, dk, dk)
        start = torch.cat([eye.new_zeros(2 * b, heads, dk, dv), eye], dim=-1)
        out, final = fn(q, k, v, g=gg, beta=bb, initial_state=start, output_final_state=True, **kwargs)
        assert final is not None, f"{name} returned no final state with output_final_state=True"
        # per chunk: S_out = A S_in + F  ([2B, H, Dk, Dk], [2B, H, Dk, Dv])
        s_in = starts(state, final.float(), final.new_zeros(b, heads, dk, dv, dtype=torch.float32),
                       lambda m, s: torch.matmul(m[..., dv:], s) + m[..., :dv])
        fixed = out[..., :dv] + torch.einsum("blhk,bhkv->blhv", out[..., dv:].float(), s_in).to(out.dtype)
        return torch.cat(fixed.split(b, dim=0), dim=1), None

    return rule


def starts(state: CallState, final: torch.Tensor, zero: torch.Tensor,
           step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The state each of this rank's two chunks starts from, ``[2B, ...]``: the chunks' maps
    (``final``, ``[2B, ...]``, both chunks along the batch) all-gathered and composed in sequence
    order from ``zero`` (``[B, ...]``), ``s_next = step(map, s)``."""
    return compose(state.group, _global(state), _mine(state), final, zero, step)[0]


def compose(group: Group, holders: list[tuple[int, int]], mine: list[int], final: torch.Tensor, zero: torch.Tensor,
            step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], through: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`starts` for any layout: ``holders``, for each chunk in sequence order, the (rank,
    slot) holding it; ``mine``, the sequence index of this rank's slots (``final``: the slots'
    maps along the batch). Returns the starts and, with ``through``, the state after the last chunk."""
    slots = len(mine)
    maps = torch.stack(final.split(zero.shape[0], dim=0))  # [slots, B, ...]
    every = gather_to(maps, group, 0)  # [slots * ranks, B, ...], rank-major
    s = zero
    begun: dict[int, torch.Tensor] = {}
    for index, (r, slot) in enumerate(holders if through else holders[: max(mine) + 1]):
        begun[index] = s
        s = step(every[slots * r + slot], s)
    out = torch.cat([begun[index] for index in mine], dim=0)
    if max(mine) == 0:  # the first piece starts from zero: kept connected, so its backward joins the gather's
        out = out + 0 * every.sum()
    return out, s if through else None


def _ssd(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mamba2's chunked scan (``hidden_states [B, L, H, P], dt, A, B, C``; state ``[H, P, N]``):
    the head-dim rows are independent, so ``N`` rows of zero input started from the identity give
    the chunk's decay (``final[P:] = a I``) and ``exp(cumsum) C`` (``out[P:]``)."""

    @functools.wraps(fn)
    def ssd(hidden_states: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b_in: torch.Tensor, c_in: torch.Tensor,
            *args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is None:
            return fn(hidden_states, dt, a, b_in, c_in, *args, **kwargs)
        if args:
            raise _refuse(f"{SSD} with positional arguments after C", "the wrapper reads them by name")
        if kwargs.get("initial_states") is not None or kwargs.get("return_final_states") or \
                kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
            raise _refuse(f"{SSD} with a recurrent state or document ids (initial_states, return_final_states, "
                          "seq_idx, cu_seqlens)", "the state is passed between ranks by hp_lazy")
        kwargs.pop("initial_states", None), kwargs.pop("return_final_states", None)
        b, heads, p = hidden_states.shape[0], hidden_states.shape[2], hidden_states.shape[3]
        n = b_in.shape[-1]
        x = torch.cat(chunks(state, hidden_states, 1), dim=0)
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], n)], dim=-1)  # [2B, c, H, P + N]
        dt2, b2, c2 = (torch.cat(chunks(state, t, 1), dim=0) for t in (dt, b_in, c_in))
        eye = torch.eye(n, dtype=torch.float32, device=x.device).expand(2 * b, heads, n, n)
        start = torch.cat([eye.new_zeros(2 * b, heads, p, n), eye], dim=2)  # [2B, H, P + N, N]
        out, final = fn(x, dt2, a, b2, c2, initial_states=start, return_final_states=True, **kwargs)
        # per chunk: S_out = S_in M + F  (M = final[P:], [N, N]; F = final[:P], [P, N])
        s_in = starts(state, final.float(), final.new_zeros(b, heads, p, n, dtype=torch.float32),
                       lambda m, s: torch.matmul(s, m[..., p:, :]) + m[..., :p, :])
        fixed = out[..., :p] + torch.einsum("blhn,bhpn->blhp", out[..., p:].float(), s_in).to(out.dtype)
        return torch.cat(fixed.split(b, dim=0), dim=1)

    return ssd


def _selective(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mamba1's selective scan (``hidden_states, dt [B, D, L], A [D, N], B, C [B, N, L]``; state
    ``[D, N]``): every state entry is its own scalar recurrence ``h_t = exp(A dt_t) h_(t-1) + dt_t
    x_t B_t``, so a chunk maps the state it starts from to ``P * S + F`` (elementwise; ``P =
    exp(A sum dt)``), and its outputs to ``out0 + sum_n C_t exp(A cumsum dt) S``. The kernel gives
    ``out0`` (no gate: it applies after the carried part); ``F`` and the carried part are computed
    here in torch (:func:`_final`, :func:`_carried`), so the gradients are exact whatever kernel runs (mamba_ssm's
    returns no gradient for its last state)."""

    @functools.wraps(fn)
    def selective(hidden_states: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b_in: torch.Tensor,
                  c_in: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is None:
            return fn(hidden_states, dt, a, b_in, c_in, *args, **kwargs)
        if args or kwargs.get("return_last_state") or b_in.dim() != 3 or c_in.dim() != 3:
            raise _refuse(f"{SELECTIVE} with positional arguments after C, a returned state or grouped B / C",
                          "the wrapper reads its arguments by name and passes the state between ranks itself")
        gate, bias = kwargs.pop("z", None), kwargs.get("delta_bias")
        b = hidden_states.shape[0]
        x, step, b2, c2 = (torch.cat(chunks(state, t, 2), dim=0) for t in (hidden_states, dt, b_in, c_in))
        out = fn(x, step, a, b2, c2, z=None, **kwargs)
        work = torch.promote_types(x.dtype, torch.float32)  # the kernel's precision: float32, or float64
        step = step.to(work) + (bias.to(work)[:, None] if bias is not None else 0.0)
        step = torch.nn.functional.softplus(step) if kwargs.get("delta_softplus") else step
        a = a.to(work)
        cum = step.cumsum(-1)  # [2B, D, c]
        final = torch.stack(_blocks(_final, a, cum, step * x.to(work), b2.to(work))).sum(0)  # [2B, D, N]
        n = a.shape[-1]  # per chunk (F, sum dt), [2B, D, N + 1]: P = exp(A sum dt) is made on the receiving rank
        s_in = starts(state, torch.cat([final, cum[..., -1:]], dim=-1), final.new_zeros(b, *a.shape),
                       lambda m, s: (a * m[..., n:]).exp() * s + m[..., :n])
        fixed = out + torch.cat(_blocks(_carried, a, cum, s_in, c2.to(work)), dim=-1).to(out.dtype)
        if gate is not None:
            fixed = fixed * torch.nn.functional.silu(torch.cat(chunks(state, gate, 2), dim=0))
        return torch.cat(fixed.split(b, dim=0), dim=-1)

    return selective


CARRY_TOKENS = 256
"""Tokens per block of :func:`_final` / :func:`_carried`: bounds their ``[2B, D, tokens, N]`` decays."""


def _blocks(fn: Callable[..., torch.Tensor], a: torch.Tensor, cum: torch.Tensor, *rest: torch.Tensor
            ) -> list[torch.Tensor]:
    """``fn`` on each block of :data:`CARRY_TOKENS` tokens, recomputed in backward rather than
    saved: no ``[2B, D, c, N]`` tensor is kept."""
    from torch.utils.checkpoint import checkpoint

    c = cum.shape[-1]
    return [checkpoint(fn, a, cum, t0, min(t0 + CARRY_TOKENS, c), *rest, use_reentrant=False)
            for t0 in range(0, c, CARRY_TOKENS)]


def _final(a: torch.Tensor, cum: torch.Tensor, t0: int, t1: int, inputs: torch.Tensor, b_in: torch.Tensor
           ) -> torch.Tensor:
    """The state tokens ``[t0, t1)`` leave at the chunk's end from a zero start:
    ``sum_t exp(A (cum_end - cum_t)) dt_t x_t B_t``, ``[2B, D, N]``."""
    decays = (a[None, :, None, :] * (cum[..., -1:] - cum[..., t0:t1])[..., None]).exp()  # [2B, D, t, N]
    return torch.einsum("bdtn,bdt,bnt->bdn", decays, inputs[..., t0:t1], b_in[..., t0:t1])


def _carried(a: torch.Tensor, cum: torch.Tensor, t0: int, t1: int, s_in: torch.Tensor, c_in: torch.Tensor
             ) -> torch.Tensor:
    """What the state ``s_in`` the chunk starts from adds to outputs ``[t0, t1)``:
    ``sum_n C_t exp(A cum_t) s_in``, ``[2B, D, t]``."""
    decays = (a[None, :, None, :] * cum[..., t0:t1, None]).exp()  # [2B, D, t, N]
    return torch.einsum("bdtn,bdn,bnt->bdt", decays, s_in, c_in[..., t0:t1])


def _declined(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The fused Mamba2 kernel (convolution and scan in one CUDA call): None under cp, which sends
    the layer down its modular path (the wrapped convolution and scan)."""

    @functools.wraps(fn)
    def declined(*args: Any, **kwargs: Any) -> Any:
        return None if current() is not None else fn(*args, **kwargs)

    return declined


def _mask(fn: Callable[..., torch.Tensor | None]) -> Callable[..., torch.Tensor | None]:
    @functools.wraps(fn)
    def mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        state = current()
        if state is None:
            return fn(*args, **kwargs)
        if state.key_padding is None:
            return None
        return state.key_padding.index_select(1, state.zig.local).to(torch.long)

    return mask

