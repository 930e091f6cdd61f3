"""Expert parallel's style: each experts module's experts split over the ``ep`` ranks.

The ep group is carved out of the ranks that hold different tokens (``dp * cp``,
:mod:`hp_lazy.runtime.mesh`); each feeds its own rows. Bound per model (the walker calls it like
every style, :mod:`hp_lazy.runtime.style`):

- ``validate``: a contract that cuts parameters on ``ep`` must carry the region
  ``{"kind": "ep_dispatch"}`` and sit on a transformers experts module (``num_experts``, the
  forward ``(hidden_states, top_k_index, top_k_weights)``) whose every parameter the plan cuts on
  ``ep`` and whose expert count ``ep`` divides (GPT-OSS's ``(hidden_states, router_indices,
  routing_weights)`` is the same forward under other names); capacity / token-dropping configs are refused
  (the region is dropless, so it would not be their model);
- ``after_partition``: ``num_experts`` becomes the local count (the class's own kernels index
  the local slice with local ids);
- ``attach``: the region (:mod:`.dispatch`) in front of the class's own forward, inside the
  contract's entry/exit ops. Under tp: where the plan also cuts the experts on tp (5.24's
  experts-TP entries), each tp rank dispatches the same tokens over its ep group, computes its tp
  slice of its experts, and the exit all-reduce over tp sums the slices; where tp leaves them
  whole (5.25's plans), each tp rank dispatches its own share of the tokens and the outputs are
  gathered over tp (:func:`~hp_lazy.runtime.ep.dispatch.split_tokens`: all-to-all rows per rank
  1/tp of the former; the experts' gradients are then summed over ``"edp+tp"``, the whole
  parameters' over tp). Under sequence parallel the region's rows arrive cut over tp (``S(0)``:
  each tp rank's piece of the sequence), so each tp rank dispatches its own rows (``pieces``: no
  share to cut, no output to join) with the same gradient rules; experts also cut on tp are
  refused there by the plan (``Plan.auto``'s sp preset; an explicit plan by the consistency check);
- ``gradients``: the expert shards' gradients are summed over the expert-data-parallel ranks only
  (:func:`hp_lazy.runtime.grads.rules_for`); the router and shared experts stay replicated and
  are averaged over dp like every dense parameter, and so are the parameters the region keeps
  whole (``Region.replicated``, transformers' ``replicated_with_grad_allreduce``: a norm inside the
  experts, run on the rows each rank receives; every row is processed on exactly one rank, so the
  dp mean of the ranks' gradients is one process's);
- ``finish``: the load-balancing aux loss (``output_router_logits``) is made global
  (:mod:`.aux`: the modeling module's ``load_balancing_loss_func`` is replaced); where it cannot
  be (a non-standard function, or context parallel, which refuses router logits itself) it is
  refused: computed from this rank's router logits it is not one process's.
"""

from __future__ import annotations

import inspect

from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.names import EP_DISPATCH
from hp_lazy.plan.model import REGION_AXES, Contract, Region
from hp_lazy.plan.placement import Shard
from hp_lazy.runtime import adapters, leaves
from hp_lazy.runtime.binding import Binding
from hp_lazy.runtime.ep import aux
from hp_lazy.runtime.ep.dispatch import Dispatch, ExpertDispatch
from hp_lazy.runtime.mesh import EDP, EDP_TP, Group
from hp_lazy.runtime.style import BindContext, cuts_input, params_matching, routes_own_tokens

FORWARD = ("hidden_states", "top_k_index", "top_k_weights")
ALIASES = (("hidden_states",), ("top_k_index", "router_indices"), ("top_k_weights", "routing_weights"))
"""The experts forwards the region replaces, by their first three parameters' names: transformers'
experts (``FORWARD``) and GPT-OSS's ``(hidden_states, router_indices, routing_weights)``, the same
tensors ([T, H], top-k expert ids [T, K], top-k weights [T, K]) under other names."""
_DROPPING = ("capacity", "drop_tokens", "token_drop")
"""Config attribute names (substrings) of capacity-factor / token-dropping routers."""


def _is_region(contract: Contract) -> bool:
    return contract.region is not None and contract.region.kind == "ep_dispatch"


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _forward_names(module: nn.Module) -> tuple[str, ...]:
    """The first three parameter names of the experts class's own forward (after ``self``)."""
    return tuple(inspect.signature(leaves.own_forward(type(module))).parameters)[1:4]


def _whole(module: nn.Module, contract: Contract) -> set[str]:
    """The names of the module's parameters the region keeps whole (``Region.replicated``)."""
    kept = contract.region.replicated if contract.region is not None else ()
    return {n for n, _ in module.named_parameters() if any(_under(n, k) for k in kept)}


def _check_by_expert(
    fqn: str, family: str, module: nn.Module, contract: Contract, kind: str, axis: str, total: int
) -> None:
    """The region hands each rank whole experts: every parameter it cuts on ``axis`` is cut on its
    expert dim (``S(0)`` of an ``[num_experts, ...]`` tensor), never inside one expert."""
    for name, axes in sorted(contract.params.items()):
        cut = axes.get(axis)
        if not isinstance(cut, Shard):
            continue
        for pname, param in params_matching(module, name):
            if param.ndim < 2 or cut.normalized(param.ndim).dim != 0 or param.shape[0] != total:
                raise ShardingError(
                    f"{fqn} ({family}): the {kind} region splits the experts over {axis} by expert, but the plan "
                    f"cuts {pname} (shape {list(param.shape)}) {cut} on {axis}, not on its expert dim (0, "
                    f"num_experts={total}); write S(0) on {axis} for it, or leave it whole (region \"replicated\")"
                )


def check_region(fqn: str, module: nn.Module, contract: Contract, region: Region, ctx: BindContext) -> None:
    """An experts region (``ep_dispatch`` over ep, ``tp_experts`` over tp) on a module it can run:
    a transformers experts module whose expert count the axis divides, with the forward the region
    replaces, every parameter cut on the axis or kept whole, and a dropless router."""
    family = type(ctx.root).__qualname__
    kind, axis = region.kind, REGION_AXES[region.kind]
    cut = sorted(name for name, axes in contract.params.items() if isinstance(axes.get(axis), Shard))
    ep = ctx.groups[axis].size
    total = getattr(module, "num_experts", None)
    if not isinstance(total, int) or isinstance(total, bool):
        raise ShardingError(
            f"{fqn} ({family}): the {kind} region needs a transformers experts module with an integer "
            f"num_experts, found {type(module).__qualname__} with num_experts={total!r}; leave it out of {axis}"
        )
    if total % ep:
        raise ShardingError(
            f"{fqn} ({family}): num_experts={total} is not divisible by {axis}={ep}; use an {axis} that divides "
            f"{total} (one of {[d for d in range(1, total + 1) if total % d == 0]})"
        )
    names = _forward_names(module)
    if len(names) < 3 or any(name not in known for name, known in zip(names, ALIASES, strict=False)):
        raise ShardingError(
            f"{fqn} ({family}): the {kind} region replaces a forward(hidden states [T, H], top-k expert "
            f"ids [T, K], top-k weights [T, K]) named {FORWARD} or {tuple(a[-1] for a in ALIASES)}, but "
            f"{type(module).__qualname__}.forward takes {names}; leave these experts out of {axis}"
        )
    _check_by_expert(fqn, family, module, contract, kind, axis, total)
    planned = {id(p) for name in cut for _, p in params_matching(module, name)}
    whole = _whole(module, contract)
    missing = [n for n in region.replicated if not any(_under(p, n) for p in whole)]
    if missing:
        raise ShardingError(
            f"{fqn} ({family}): the plan keeps {missing} whole on every {axis} rank, but "
            f"{type(module).__qualname__} has no such parameter or submodule with parameters; fix the plan"
        )
    both = sorted(n for n, p in module.named_parameters() if n in whole and id(p) in planned)
    if both:
        raise ShardingError(
            f"{fqn} ({family}): the plan both cuts {both} on {axis} and keeps them whole on every rank (region "
            "\"replicated\"); an expert shard is one or the other: remove it from one of the two"
        )
    tp_cut = sorted(name for name, axes in contract.params.items() if isinstance(axes.get("tp"), Shard))
    if whole and tp_cut and axis == "ep":
        raise ShardingError(
            f"{fqn} ({family}): the plan keeps {sorted(whole)} whole inside experts it also cuts on tp "
            f"({tp_cut}): they would run on each tp rank's partial expert outputs, which is not one process's "
            "math; leave the experts unsharded on tp (drop their TP entries) or train without tp"
        )
    replicated = [n for n, p in module.named_parameters() if id(p) not in planned and n not in whole]
    if replicated:
        raise ShardingError(
            f"{fqn} ({family}): its parameters {replicated} are not cut on {axis} (the plan cuts {cut}); the "
            f"local experts would use them replicated, with gradients from this rank's {axis} group only; cut every "
            f"expert parameter S(0) on {axis}, mark it replicated (region \"replicated\", transformers' "
            f"'replicated_with_grad_allreduce'), or leave these experts out of {axis}"
        )
    config = getattr(module, "config", None) or getattr(ctx.root, "config", None)
    for attr, value in sorted(vars(config).items()) if config is not None else ():
        if any(word in attr for word in _DROPPING) and value not in (None, False, 0, 0.0):
            raise ShardingError(
                f"{fqn} ({family}): config.{attr}={value!r} drops tokens beyond an expert capacity, but the "
                f"{kind} region is dropless (equal to one process only without dropping); set "
                f"{attr} to None/0 or train without {axis}"
            )


def mount(module: nn.Module, group: Group, *, local: bool, split: Group | None = None,
          pieces: Group | None = None) -> None:
    """The region's spec on the module; ``num_experts`` becomes the count this rank runs (the
    class's own kernels index its slice with local ids)."""
    total: int = module.num_experts  # type: ignore[assignment]
    routing = _forward_names(module)[1:]
    module.__dict__[EP_DISPATCH] = Dispatch(
        group=group, num_local=total // group.size, num_global=total, routing=routing,  # type: ignore[arg-type]
        local=local, split=split, pieces=pieces,
    )
    setattr(module, "num_experts", total // group.size)


def attach_region(module: nn.Module, binding: Binding) -> None:
    """The region in front of the class's own forward, inside the contract's entry/exit ops."""
    module.__class__ = leaves.subclass(type(module), ExpertDispatch)
    leaves.wrap_forward(module, binding)


class ExpertParallelStyle:
    axis = "ep"

    def __init__(self) -> None:
        self.experts: list[tuple[str, nn.Module, set[str]]] = []
        """(FQN, experts module, the names of its parameters kept whole) per bound region."""

    def validate(self, fqn: str, module: nn.Module, contract: Contract, ctx: BindContext) -> None:
        cut = sorted(name for name, axes in contract.params.items() if isinstance(axes.get("ep"), Shard))
        if not _is_region(contract):
            if cut:
                raise ShardingError(
                    f"{fqn}: the plan cuts {cut} on ep but gives the module no \"region\": {{\"kind\": "
                    "\"ep_dispatch\"}}, so its forward would run on a slice of the experts with global expert "
                    "ids; add the region, or use Plan.auto(ep=...)"
                )
            return
        check_region(fqn, module, contract, contract.region, ctx)  # type: ignore[arg-type]

    def replicas(self, fqn: str, module: nn.Module, contract: Contract, ctx: BindContext) -> dict[str, int]:
        return {}

    def after_partition(
        self, fqn: str, module: nn.Module, contract: Contract, ctx: BindContext, replicas: dict[str, int]
    ) -> None:
        if not _is_region(contract):
            return
        tp = ctx.groups.get("tp")
        cut_on_tp = any(isinstance(axes.get("tp"), Shard) for axes in contract.params.values())
        whole = tp if tp is not None and tp.size > 1 and not cut_on_tp else None
        # sequence parallel: rows cut over tp, each tp rank's own; else the tp ranks share the same tokens
        own = cuts_input(contract)
        mount(module, ctx.groups["ep"], local=False, split=None if own else whole, pieces=whole if own else None)
        self.experts.append((fqn, module, _whole(module, contract)))

    def attach(self, fqn: str, module: nn.Module, binding: Binding, ctx: BindContext) -> bool:
        if not _is_region(binding.contract):
            return False
        attach_region(module, binding)
        return True

    def gradients(self, ctx: BindContext) -> None:
        """Expert slices: summed over the ranks holding the same slice (edp). Read from the bound
        regions themselves, not from what this instance saw at bind, so that a refresh (PEFT, a
        resized embedding, a wrapper registered after binding) keeps the rule."""
        for _, module, contract in ctx.bound:
            spec = adapters.base_of(module).__dict__.get(EP_DISPATCH)
            if not _is_region(contract) or spec is None:
                continue
            whole = _whole(module, contract)
            for name, param in module.named_parameters():
                if name not in whole:
                    ctx.add_partial(param, EDP_TP if spec.tp_tokens is not None else EDP)
                elif spec.tp_tokens is not None:  # a tp rank's share of the tokens: summed over tp, dp-averaged
                    ctx.add_partial(param, "tp")

    def finish(self, ctx: BindContext) -> None:
        if not self.experts:
            return
        if ctx.mesh.degree("cp") > 1 or routes_own_tokens(ctx):
            return  # context parallel's finish makes it global over cp and dp; sequence parallel's over tp and dp
        aux.install(ctx.root, [ctx.mesh.group("dp")], ctx.mesh.degree("dp"), under="expert parallel")
