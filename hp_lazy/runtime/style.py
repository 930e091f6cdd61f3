"""The protocol every parallelism implements, and the context the walker hands it.

The walker (:mod:`hp_lazy.runtime.bind`) knows no axis by name: it matches contracts to modules,
lays parameters out from their placements (:mod:`hp_lazy.runtime.layout`), compiles entry/exit
ops, and asks the style of each mesh axis in the plan (``bind.STYLES``) for what only that
parallelism knows. torch's ``ParallelStyle`` is the model for the idea; here a style works on a
whole model's matched boundaries, so it can also set the model's loss and gradient policy.

One room per parallelism: ``runtime/tp/`` (tensor parallel; sequence parallel's layer stack in
``runtime/sp/``), and later ``runtime/cp/`` and ``runtime/ep/``, each adding one style here.
Data parallel has no boundaries: its whole policy is the gradient owner's dp average.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from torch import nn

from hp_lazy.plan.fqn import compile_glob, is_glob
from hp_lazy.plan.model import Contract, ModulePlan
from hp_lazy.plan.placement import Shard
from hp_lazy.runtime import adapters
from hp_lazy.runtime.layout import LayoutTable, ParamLayout
from hp_lazy.runtime.mesh import Group, Mesh

if TYPE_CHECKING:
    from hp_lazy.runtime.binding import Binding

Bound = tuple[str, nn.Module, Contract]
"""(FQN, module, contract) of one matched boundary."""


@dataclass(eq=False, kw_only=True)
class BindContext:
    """What binding one root knows so far; styles read it and add to it."""

    root: nn.Module
    plan: ModulePlan
    mesh: Mesh
    groups: dict[str, Group]
    """Plan axis -> this rank's group (size 1 for an axis of degree 1)."""
    table: LayoutTable
    bound: list[Bound] = field(default_factory=list)
    by_param: dict[int, ParamLayout] = field(default_factory=dict)
    """id(parameter) -> its layout (tied weights are one parameter)."""
    partial: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    """id(parameter) -> (axis, slots, slot): its gradient is a partial sum over the axis."""
    whole_sequence: set[int] = field(default_factory=set)
    """id(parameter) of the token mixers a sequence-parallel stack runs on the whole sequence
    (:mod:`hp_lazy.runtime.sp.mixers`): whole gradients on every tp rank, not partial sums."""

    def add_partial(self, param: nn.Parameter, axis: str, slots: int = 1, slot: int = 0) -> None:
        self.partial.setdefault(id(param), (axis, slots, slot))


class ParallelStyle(Protocol):
    """One parallelism, as the walker calls it, in this order for every matched boundary and
    then once per root. (Preparing the root's inputs — context parallel sharding the batch — is
    the next method, added with the first style that needs it and its call site in the root
    prologue.)"""

    axis: str

    def validate(self, fqn: str, module: nn.Module, contract: Contract, ctx: BindContext) -> None:
        """Refuse what this parallelism cannot do on this live module (before anything changes)."""

    def replicas(self, fqn: str, module: nn.Module, contract: Contract, ctx: BindContext) -> dict[str, int]:
        """Parameter name -> how many ranks of this axis hold each of its pieces (default 1)."""

    def after_partition(
        self, fqn: str, module: nn.Module, contract: Contract, ctx: BindContext, replicas: dict[str, int]
    ) -> None:
        """Fix what the module caches about shapes its parameters no longer have (head counts);
        ``replicas`` is what :meth:`replicas` said before the parameters were cut."""

    def attach(self, fqn: str, module: nn.Module, binding: Binding, ctx: BindContext) -> bool:
        """Install this parallelism's own forward on a leaf module; False if it has none for it."""

    def gradients(self, ctx: BindContext) -> None:
        """Mark the parameters whose gradient is a partial sum over this axis (``ctx.add_partial``)."""

    def finish(self, ctx: BindContext) -> None:
        """Model-level policy once every boundary is bound (the loss on sharded logits)."""


def params_matching(module: nn.Module, name: str) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` under ``module`` for a dotted name or an FQN glob, by the name
    ``named_parameters`` gives it (through PEFT tuner layers: ``q_proj.weight`` is found as
    ``q_proj.base_layer.weight``; adapters never match a plan's names)."""
    if not is_glob(name):
        param = get_param(module, name)
        return [] if param is None else [(adapters.real_name(module, name), param)]
    regex = compile_glob(name)
    extra = adapters.adapter_ids(module)
    return [(n, p) for n, p in module.named_parameters() if regex.match(adapters.plain(n)) and id(p) not in extra]


def get_param(module: nn.Module, name: str) -> nn.Parameter | None:
    found = adapters.resolve(module, name)
    return None if found is None else found[0]._parameters.get(found[1])


def cuts_input(contract: Contract, axis: str = "tp") -> bool:
    """Some input of ``contract`` arrives cut on ``axis`` (a sequence-parallel piece, or rows)."""
    return any(isinstance(contract.placement("in_src", name, axis), Shard) for name in contract.in_src)


def routes_own_tokens(ctx: BindContext) -> bool:
    """Experts (split over tp or over ep) whose rows arrive cut over tp (sequence parallel): each tp
    rank routes its own tokens, so the router's statistics are summed over tp."""
    return any(c.region is not None and cuts_input(c) for _, _, c in ctx.bound)
