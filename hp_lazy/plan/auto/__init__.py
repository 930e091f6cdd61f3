"""``Plan.auto``: contracts derived from transformers' own plans, per modeling module, composed
from one preset per axis over one mesh (:attr:`~hp_lazy.plan.model.AutoFlags.mesh`).

Sources (:mod:`.rules`): every config class's ``base_model_tp_plan`` and ``base_model_ep_plan``
(keys relative to the base model, e.g. ``"layers.*.self_attn.q_proj": "colwise"``) and the model
classes' ``_tp_plan`` (keys relative to that class, e.g. ``{"lm_head": "colwise_gather_output"}``).

The presets fill one :class:`~.draft.Draft`, in this order:

1. :mod:`.ep` under tp without ep: the experts the ep plan marks, split by expert over tp; the TP
   plan's entries under them give way.
2. :mod:`.tp`: the TP plan's boundaries, leaves, embeddings (and 5.24's experts-TP).
3. :mod:`.cp`: the attention op on every attention module.
4. :mod:`.ep` under ep: the dispatch region on every experts module.
5. the nesting check (no contract inside another), then :mod:`.sp`: the sequence cut between the
   tp boundaries.

At tp=1 the tp preset runs only when no other axis asks for anything: context and expert
parallel shard nothing over tp, and TP strings Plan.auto cannot translate do not matter to them.
Adding an axis means a preset here and its room in :mod:`hp_lazy.runtime`.
"""

from __future__ import annotations

import re

from hp_lazy.errors import PlanError
from hp_lazy.plan.auto import cp as cp_preset
from hp_lazy.plan.auto import ep as ep_preset
from hp_lazy.plan.auto import sp as sp_preset
from hp_lazy.plan.auto import tp as tp_preset
from hp_lazy.plan.auto.draft import Draft
from hp_lazy.plan.auto.rules import Rule, base_rules, config_plans, head_rules
from hp_lazy.plan.model import AutoFlags, Contract
from hp_lazy.plan.resolve import ModuleFacts, analyze

_MODULE = re.compile(r"^transformers\.models\.(\w+)\.modeling_(\w+)$")


def auto_contracts(
    module_name: str, source: str, tp: int = 2, sequence_parallel: bool = False, loss_parallel: bool = False,
    vocab_parallel_embedding: bool = True, cp: int = 1,
) -> tuple[Contract, ...] | None:
    """Contracts for one ``transformers.models.<x>.modeling_<x>`` module, or None when the module
    is not such a module or its configs declare no ``base_model_tp_plan``."""
    flags = AutoFlags(
        tp=tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
        vocab_parallel_embedding=vocab_parallel_embedding, cp=cp,
    )
    parts = auto_parts(module_name, source, flags)
    return None if parts is None else parts[0]


Parts = tuple[tuple[Contract, ...], dict[str, str], dict[str, str]]


def auto_parts(module_name: str, source: str, flags: AutoFlags) -> Parts | None:
    """:func:`auto_contracts` plus the boundary class of each pattern whose slot holds several
    classes (a layer's ``mlp`` that is a dense MLP in some layers and an MoE block in others), and
    the base classes whose TP plan Plan.auto cannot translate while the module's other plans translate
    (Gemma 4's vision tower beside its text model): class -> why, refused when a model holding one is
    bound (:func:`translatable`)."""
    if not _MODULE.match(module_name):
        return None
    facts = analyze(module_name, source)
    plans = config_plans(module_name, facts)
    wants_ep_plan = flags.ep > 1 or flags.tp > 1 or flags.cp > 1
    ep_plans = config_plans(module_name, facts, ep_preset.EP_PLAN) if wants_ep_plan else []
    if not plans and not ep_plans:  # an ep plan alone (Zaya, Ergo) still places experts and locates attention
        return None
    rules = [r for name, plan in plans for r in base_rules(facts, name, plan)] + (head_rules(facts) if plans else [])
    # tp alone splits the experts the ep plan marks too
    ep_rules = [r for name, plan in ep_plans for r in base_rules(facts, name, plan, ep_preset.EP_PLAN)]
    draft = Draft(facts, flags)
    located = rules + ep_rules  # every TP- and EP-plan key: cp finds the attention modules near them
    if flags.tp > 1 and flags.ep == 1:
        rules = ep_preset.split_over_tp(draft, rules, ep_rules)
    if flags.ep == 1:
        ep_rules = []
    refused: dict[str, str] = {}
    if flags.tp > 1 or not (flags.cp > 1 or ep_rules):
        kept, refused = translatable(facts, flags, rules)
        tp_preset.apply(draft, kept)
    if flags.cp > 1:  # before split_over_tp took the experts' keys out (5.24's Jamba plans only those)
        cp_preset.apply(draft, located)
    if ep_rules:
        ep_preset.apply(draft, ep_rules)
    draft.check_nesting()
    if flags.sequence_parallel:
        sp_preset.apply(draft)
    return draft.contracts(), dict(draft.classes), refused


def translatable(facts: ModuleFacts, flags: AutoFlags, rules: list[Rule]) -> tuple[list[Rule], dict[str, str]]:
    """The rules of every config's TP plan the tp preset translates on its own, and, for each plan it
    cannot, its base class -> the error. With one config plan, or when none translates, the error
    is raised here as it is."""
    groups: dict[str, list[Rule]] = {}
    for rule in rules:
        if not rule.head:
            groups.setdefault(rule.owner, []).append(rule)
    if len(groups) < 2:
        return rules, {}
    refused: dict[str, str] = {}
    first: PlanError | None = None
    for group in groups.values():
        try:
            tp_preset.apply(Draft(facts, flags), group)
        except PlanError as error:
            first = first or error
            refused.update({base: str(error) for base in sorted({r.base for r in group})})
    if first is not None and len(refused) == len({r.base for group in groups.values() for r in group}):
        raise first
    return [r for r in rules if r.head or r.base not in refused], refused
