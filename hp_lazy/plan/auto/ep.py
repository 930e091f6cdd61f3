"""The experts preset, from each config's ``base_model_ep_plan``: the modules it marks
``ep_dispatch_experts`` are split by expert, over ``ep`` when the plan asks for expert parallel,
else over ``tp``.

- **ep** (:func:`apply`): the region ``{"kind": "ep_dispatch"}`` on every experts module (on its
  experts-TP contract where 5.24's TP plan has one, else on a contract of its own with replicated
  inputs and output), each ``grouped_gemm`` parameter under it ``S(0)`` on ``ep`` (the expert dim;
  ``ep`` is cut before ``tp``); ``replicated_with_grad_allreduce`` entries stay whole on every ep
  rank. The plan's ``colwise``/``rowwise`` entries are the TP plan's and are read from it.
- **tp without ep** (:func:`split_over_tp`): the region ``tp_experts``, every ``grouped_gemm``
  parameter ``S(0)`` on tp, on every release: transformers 5.25 dropped ``moe_tp_experts`` from
  the TP plans, and where a TP plan still has it (5.24) its entries under those modules give way,
  so one family has one layout whatever the release. Same bytes per layer as experts-TP (one
  all-reduce of the output), whole experts (fewer, full-width GEMMs), and no dependence on how the
  expert weights are stored (packed, interleaved, transposed).
"""

from __future__ import annotations

from hp_lazy.plan.auto.draft import Draft, Entry
from hp_lazy.plan.auto.rules import Rule

EP_PLAN = "base_model_ep_plan"
DISPATCH, PARAM = "ep_dispatch_experts", "grouped_gemm"
REPLICATED = "replicated_with_grad_allreduce"
"""A parameter or submodule of an experts module kept whole on every rank (Region.replicated)."""
TP_ENTRIES = frozenset({"colwise", "packed_colwise", "rowwise"})
"""Entries some ep plans repeat from the TP plan (a dense MLP beside the experts): read from the TP plan."""


def _under(rule: Rule, key: str) -> bool:
    return rule.key == key or rule.key.startswith(key + ".")


def split_over_tp(draft: Draft, rules: list[Rule], ep_rules: list[Rule]) -> list[Rule]:
    """The ``tp_experts`` contracts; returns the TP rules left for the tp preset (those not under
    an experts module)."""
    experts = [r for r in ep_rules if r.style == DISPATCH]
    if not experts:
        return rules
    kept = [r for r in rules if not any(r.base == e.base and _under(r, e.key) for e in experts)]
    for rule in experts:
        mine = [r for r in ep_rules if r.base == rule.base and _under(r, rule.key) and r is not rule]
        for other in mine:
            if other.style not in (PARAM, REPLICATED):
                draft.fail(other, f"is not an entry Plan.auto places inside {DISPATCH!r} experts under tp "
                           f"(it handles {PARAM!r} and {REPLICATED!r})")
        cut = {r.key[len(rule.key) + 1 :]: {"tp": "S(0)"} for r in mine if r.style == PARAM}
        if not cut:
            draft.fail(rule, f"has no {PARAM!r} expert parameters under it to split over tp")
        body = _ends(draft, rule)
        body.update(out_src={"output": {"tp": "P(sum)"}}, params=cut, skip_source_lowering=True)
        body["region"] = _region("tp_experts", rule, mine)
        draft.add(rule.pattern, Entry(body, rule.owner, "tp_experts", rule))
    return kept


def apply(draft: Draft, rules: list[Rule]) -> None:
    """The ``ep_dispatch`` region on every ``ep_dispatch_experts`` module."""
    experts = [r for r in rules if r.style == DISPATCH]
    for rule in rules:
        if rule.style in (PARAM, REPLICATED):
            if not any(e.base == rule.base and rule.key.startswith(e.key + ".") for e in experts):
                draft.fail(rule, f"is not under a module the plan marks {DISPATCH!r}")
        elif rule.style != DISPATCH and rule.style not in TP_ENTRIES:
            draft.fail(rule, f"is not an entry expert parallel places (it handles {DISPATCH!r} modules and "
                       f"their {PARAM!r} and {REPLICATED!r} parameters)")
    for rule in experts:
        draft.class_of(rule, rule.key)  # one class, or refused
        known = draft.entries.get(rule.pattern)
        body = dict(known.body) if known is not None else _ends(draft, rule)
        params = {k: dict(v) for k, v in body.get("params", {}).items()}
        under = [r for r in rules if r.base == rule.base and r.key.startswith(rule.key + ".")]
        mine = [r for r in under if r.style == PARAM]
        if not mine:
            draft.fail(rule, f"has no {PARAM!r} expert parameters under it to cut over ep")
        for param in mine:
            rel = param.key[len(rule.key) + 1 :]
            params[rel] = {**params.get(rel, {}), "ep": "S(0)"}
        body.update(params=params, region=_region("ep_dispatch", rule, under), skip_source_lowering=True)
        draft.entries[rule.pattern] = Entry(body, known.owner if known is not None else rule.owner, "experts", rule)


def _region(kind: str, rule: Rule, under: list[Rule]) -> dict[str, object]:
    region: dict[str, object] = {"kind": kind}
    whole = sorted(r.key[len(rule.key) + 1 :] for r in under if r.style == REPLICATED)
    if whole:
        region["replicated"] = whole
    return region


def _ends(draft: Draft, rule: Rule) -> dict:
    """The entry and exit of an experts module: its inputs replicated over tp (every tp rank
    dispatches the same tokens), its output too (tp=1) or the sum of the tp ranks' experts."""
    inputs = draft.inputs(rule, draft.class_of(rule, rule.key))
    return {"in_src": {x: {"tp": "R"} for x in inputs}, "in_dst": {x: {"tp": "R"} for x in inputs},
            "out_src": {"output": {"tp": "R"}}, "out_dst": {"output": {"tp": "R"}}, "params": {}}
