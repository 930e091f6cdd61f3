"""Norms and statistics over features tp splits: OLMo 2/3's and ESM C's q/k norms run over every head of a
projection (``q_norm(q_proj(x))``), so under tp each rank holds a slice of the features the norm
reads. The norm's weight (and bias) is cut like the projection's rows (``S(0)``; K/V slices kept on
``tp / kv`` ranks as their projection's are), and its row statistics are summed over tp: one
all-reduce of a ``[..., 1]`` tensor per statistic, forward and backward (RMS: the mean square;
LayerNorm: the mean, then the centred mean square), never the features themselves. Each rank then
normalises its slice exactly as the whole row would be.

Which math a norm class runs is read from the module at bind: its own forward on a probe row of
the full width is compared with the three forms below; a class that matches none is refused,
naming it (a module whose every feature depends on that feature alone, a learned scale, is left
to run on its slice as it is)::

    "layer"       (x - mean) / sqrt(var + eps) * w (+ b)      nn.LayerNorm and subclasses
    "rms"         x / sqrt(mean(x^2) + eps) * w               Llama / OLMo 2 RMSNorm
    "rms_offset"  x / sqrt(mean(x^2) + eps) * (1 + w)         Gemma RMSNorm

Gemma 3n's activation sparsity (``_gaussian_topk``: keep the gate activations above
``mean + std * ppf(sparsity)`` of the intermediate features, which colwise ``gate_proj`` splits) runs
the same way: mean and variance summed over tp, on each rank's slice.

Statistics are taken in float32 (float64 for float64 inputs) and the output has the input's dtype,
as transformers' norms do.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import SPLIT
from hp_lazy.runtime.comm.pairs import sum_over
from hp_lazy.runtime.layout import ParamLayout
from hp_lazy.runtime.leaves import subclass
from hp_lazy.runtime.mesh import Group

if TYPE_CHECKING:
    _Module = nn.Module
else:
    _Module = object

EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")
FORMS = ("layer", "rms", "rms_offset")
PROBE_TOL = 1e-5


@dataclass(frozen=True)
class SplitNorm:
    """How one norm runs on its slice: its form and epsilon, the whole row's width, the group and
    how many ranks hold each slice (K/V heads kept on several)."""

    form: str
    eps: float
    features: int
    group: Group
    replicas: int

    def stat(self, partial: torch.Tensor) -> torch.Tensor:
        """The whole row's mean of a per-slice sum ``[..., 1]``."""
        return sum_over(partial, self.group) / (self.replicas * self.features)


def _apply(form: str, x: torch.Tensor, eps: float, weight: torch.Tensor | None, bias: torch.Tensor | None,
           mean_of) -> torch.Tensor:
    """One form on ``x`` (float32 or wider), with ``mean_of`` taking a row mean (local, or over tp)."""
    if form == "layer":
        centred = x - mean_of(x.sum(-1, keepdim=True))
        out = centred * torch.rsqrt(mean_of((centred * centred).sum(-1, keepdim=True)) + eps)
    else:
        out = x * torch.rsqrt(mean_of((x * x).sum(-1, keepdim=True)) + eps)
    if weight is not None:
        w = weight.to(x.dtype)
        out = out * (1.0 + w if form == "rms_offset" else w)
    if bias is not None and form == "layer":
        out = out + bias.to(x.dtype)
    return out


class _SplitNormForward(_Module):
    """Mixin: the norm's form on this rank's slice, statistics summed over tp."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        split: SplitNorm = self.__dict__[SPLIT]
        x = hidden_states.to(torch.promote_types(hidden_states.dtype, torch.float32))
        out = _apply(split.form, x, split.eps, getattr(self, "weight", None), getattr(self, "bias", None), split.stat)
        return out.to(hidden_states.dtype)


def _eps(fqn: str, module: nn.Module) -> float:
    for attr in EPS_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise ShardingError(
        f"{fqn}: {type(module).__name__} normalises features tp splits, but hp_lazy finds no epsilon on it "
        f"(looked for {list(EPS_ATTRS)}); leave its input whole (gather the projection before it: "
        "colwise_gather_output)"
    )


def _probe(module: nn.Module, features: int, gen: torch.Generator) -> nn.Module:
    """A float32 CPU copy of ``module`` (the model may still be on meta) with a random weight and
    bias of ``features``."""
    probe = copy.deepcopy(module).to_empty(device="cpu").float()
    for name in ("weight", "bias"):
        if probe._parameters.get(name) is not None:
            probe._parameters[name] = nn.Parameter(torch.randn(features, generator=gen))
    return probe


def per_feature(module: nn.Module, features: int) -> bool:
    """Whether ``module`` computes each feature from that feature alone (a learned scale ``x * w``):
    its forward on the first half of a probe row, with the first half of its weight, is the first
    half of its output on the whole row. Such a module runs on its slice as it is."""
    with torch.no_grad():
        whole = _probe(module, features, torch.Generator().manual_seed(0))
        x = torch.randn(3, features, generator=torch.Generator().manual_seed(1))
        half = copy.deepcopy(whole)
        for name in ("weight", "bias"):
            param = half._parameters.get(name)
            if param is not None:
                half._parameters[name] = nn.Parameter(param[: features // 2].clone())
        try:
            got = half(x[:, : features // 2])
        except (RuntimeError, ValueError):  # a norm that knows its width (nn.LayerNorm)
            return False
        own = whole(x)[:, : features // 2]
    return isinstance(got, torch.Tensor) and got.shape == own.shape and torch.allclose(got, own, rtol=PROBE_TOL,
                                                                                       atol=PROBE_TOL)


def identify(fqn: str, module: nn.Module, features: int) -> tuple[str, float]:
    """``(form, eps)`` of ``module``: its own forward on a probe row ``[3, features]`` (float32,
    random weight and bias of the whole width, on a CPU copy) against each form."""
    eps = _eps(fqn, module)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe = _probe(module, features, gen)
        x = torch.randn(3, features, generator=gen) * 2 + 0.5
        own = probe(x).float()
        weight, bias = probe._parameters.get("weight"), probe._parameters.get("bias")
        for form in FORMS:
            got = _apply(form, x, eps, weight, bias, lambda s: s / features)
            if got.shape == own.shape and torch.allclose(got, own, rtol=PROBE_TOL, atol=PROBE_TOL):
                return form, eps
    raise ShardingError(
        f"{fqn}: {type(module).__name__} normalises the {features} features of a projection tp splits, but its "
        f"forward matches none of the norms hp_lazy can split ({', '.join(FORMS)}: LayerNorm, RMSNorm with w or "
        "1 + w); leave its input whole (colwise_gather_output on the projection, rowwise_split_input after)"
    )


def install_split_norm(fqn: str, module: nn.Module, layout: ParamLayout, group: Group) -> None:
    """Run ``module`` (whose weight ``layout`` cuts on dim 0 over tp) on its feature slice."""
    cut = layout.on("tp")
    assert cut is not None and cut.dim == 0
    features = layout.full_shape[0]
    if per_feature(module, features):  # a learned scale: exact on its slice, no statistics
        return
    form, eps = identify(fqn, module, features)
    module.__dict__[SPLIT] = SplitNorm(form, eps, features, group, cut.replicas)
    module.__class__ = subclass(type(module), _SplitNormForward)


class _SplitGaussianTopK(_Module):
    """Mixin: Gemma 3n's ``_gaussian_topk`` with the mean and std of the whole intermediate row."""

    activation_sparsity: float

    def _gaussian_topk(self, inputs: torch.Tensor) -> torch.Tensor:
        group: Group = self.__dict__[SPLIT]
        return _topk(inputs, self.activation_sparsity, inputs.shape[-1] * group.size, lambda s: sum_over(s, group))


def _topk(inputs: torch.Tensor, sparsity: float, features: int, total) -> torch.Tensor:
    """``relu(x - (mean + std * ppf(sparsity)))`` over a row of ``features``, ``total`` summing a
    per-slice statistic over the row."""
    level = torch.tensor(sparsity, dtype=torch.float32, device=inputs.device)
    multiplier = torch.distributions.normal.Normal(0, 1).icdf(level).type(inputs.dtype)
    mean = total(inputs.sum(-1, keepdim=True)) / features
    centred = inputs - mean
    std = torch.sqrt(total((centred * centred).sum(-1, keepdim=True)) / features)
    return torch.relu(inputs - (mean + std * multiplier))


def runs_gaussian_topk(module: nn.Module) -> bool:
    """Whether the module's own ``_gaussian_topk`` is Gemma 3n's (checked on a probe row, on the CPU)."""
    method = getattr(type(module), "_gaussian_topk", None)
    sparsity = getattr(module, "activation_sparsity", None)
    if not callable(method) or not isinstance(sparsity, (int, float)):
        return False
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)) * 2 + 0.5
    with torch.no_grad():
        own = method(module, x)
    ours = _topk(x, sparsity, 16, lambda s: s)
    return isinstance(own, torch.Tensor) and own.shape == ours.shape and torch.allclose(own, ours, rtol=PROBE_TOL,
                                                                                        atol=PROBE_TOL)


def install_split_topk(module: nn.Module, group: Group) -> None:
    """Gemma 3n's activation sparsity on a tp-split intermediate: statistics summed over tp."""
    module.__dict__[SPLIT] = group
    module.__class__ = subclass(type(module), _SplitGaussianTopK)
