"""Each expert's load over the global batch, for aux-loss-free balancing under expert parallel.

DeepSeek-V3-style balancing nudges each router's ``e_score_correction_bias`` by the load of its
experts after a step (``bias += u * sign(mean_load - load)``). Under ep a rank routes only its own
tokens, so loads counted from its own top-k indices differ between ranks and the replicated
buffers drift apart, silently. The ep region (:mod:`.dispatch`) already counts the (token, slot)
pairs per global expert before it sends them (``counts[E]``, step 2); it keeps them on the experts
module (no numerics change), and :func:`expert_load` sums them over the ranks holding different
tokens (``dp * cp``; the tp ranks of a group dispatch the same tokens, so they are not summed,
except under sequence parallel, where each dispatches its own piece: :func:`token_axes`) in
one all-reduce for every layer: one process's counts over the global batch, on every rank.

``{router FQN: counts[E] (int64)}``: the router is the sibling of the experts module whose 2-D
``weight`` has one row per expert (``mlp.gate`` beside ``mlp.experts``); where there is no single
such module the experts module's FQN is the key.
"""

from __future__ import annotations

import torch
from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import EP_DISPATCH, EP_LOAD
from hp_lazy.runtime.comm import wire
from hp_lazy.runtime.ep.dispatch import Dispatch
from hp_lazy.runtime.mesh import Group


def recorded(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(router FQN, this rank's counts[E])`` per ep-cut experts module, in module order.

    Refuses a model with no experts cut on ep, and one whose experts have not run a forward."""
    family = type(model).__qualname__
    experts = [(fqn, m) for fqn, m in model.named_modules() if EP_DISPATCH in m.__dict__]
    if not experts:
        raise ShardingError(
            f"hp_lazy.expert_load({family}): the model has no experts split over ep (no module runs the "
            "ep_dispatch region), so there is no cross-rank load to report; activate with "
            "hp_lazy.activate(\"auto\", ep=N) before importing the model and bind it (hp_lazy.parallelize(model) "
            "or a first forward), or count the router's top-k indices yourself in one process"
        )
    missing = [fqn for fqn, m in experts if EP_LOAD not in m.__dict__]
    if missing:
        raise ShardingError(
            f"hp_lazy.expert_load({family}): {missing[0]} has run no forward yet ({len(missing)} of "
            f"{len(experts)} experts modules without a load); call hp_lazy.expert_load(model) after model(**batch)"
        )
    return [(_router(model, fqn, m), m.__dict__[EP_LOAD]) for fqn, m in experts]


def token_axes(model: nn.Module) -> tuple[str, ...]:
    """The mesh axes whose ranks count different tokens in ``model``'s ep regions."""
    pieces = any(m.__dict__[EP_DISPATCH].pieces is not None for m in model.modules() if EP_DISPATCH in m.__dict__)
    return ("dp", "cp", "tp") if pieces else ("dp", "cp")


def summed(loads: list[tuple[str, torch.Tensor]], tokens: Group) -> dict[str, torch.Tensor]:
    """The counts summed over ``tokens`` (the dp * cp ranks), one all-reduce for every layer."""
    flat = torch.cat([counts for _, counts in loads]).contiguous()
    wire.all_reduce_(flat, tokens)
    sizes = [counts.numel() for _, counts in loads]
    return {fqn: part for (fqn, _), part in zip(loads, flat.split(sizes), strict=True)}


def _router(model: nn.Module, fqn: str, experts: nn.Module) -> str:
    spec: Dispatch = experts.__dict__[EP_DISPATCH]
    parent_fqn, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_fqn)
    found = [
        child_name
        for child_name, child in parent.named_children()
        if child_name != name and _rows(getattr(child, "weight", None)) == spec.num_global
    ]
    if len(found) != 1:
        return fqn
    return f"{parent_fqn}.{found[0]}" if parent_fqn else found[0]


def _rows(weight: object) -> int | None:
    """The row count of a 2-D weight (a router's: one row per expert), else ``None``."""
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
