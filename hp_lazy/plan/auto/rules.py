"""The TP plan entries ``Plan.auto`` translates, read from one transformers modeling module.

``config_plans``: each config class's ``base_model_tp_plan`` (keys relative to the base model,
e.g. ``"layers.*.self_attn.q_proj": "colwise"``), from the configuration modules the modeling
module imports. ``base_rules`` finds the model class those keys are relative to and its FQN
prefix (``"model."``); ``head_rules`` reads the model classes' ``_tp_plan`` (keys relative to
that class, e.g. ``{"lm_head": "colwise_gather_output"}``) statically from the source.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from hp_lazy.errors import PlanError
from hp_lazy.plan.fqn import is_glob
from hp_lazy.plan.resolve import ModuleFacts

CHILDLESS_BASES = frozenset({
    "transformers.modeling_utils.PreTrainedModel", "transformers.generation.GenerationMixin",
    "transformers.generation.utils.GenerationMixin", "torch.nn.Module", "torch.nn.modules.module.Module", "object",
})
"""Classes of other modules known to set no child module in ``__init__``."""
FIX = "write an explicit JSON plan for this module (Plan.from_json) instead of Plan.auto"


UNIT_STYLES = {"unit_colwise": "colwise", "unit_rowwise": "rowwise"}
"""transformers 5.25's head-unit styles (every rank holds whole heads; fewer K/V heads than tp ranks
are repeated over them) read as their plain styles: hp_lazy's attention binding always cuts by whole
heads and keeps each K/V head on ``tp / kv`` ranks (:func:`hp_lazy.runtime.tp.heads.kv_replicas`),
and refuses a head count tp does not divide, naming the module and the degrees that fit."""


@dataclass(frozen=True)
class Rule:
    """One transformers TP entry: ``key`` relative to class ``base``, whose FQN is ``prefix + key``."""

    owner: str  # "LlamaConfig.base_model_tp_plan" / "LlamaForCausalLM._tp_plan"
    base: str
    prefix: str
    key: str
    style: object
    head: bool

    @property
    def pattern(self) -> str:
        return self.prefix + self.key


def config_plans(
    module_name: str, facts: ModuleFacts, attr: str = "base_model_tp_plan"
) -> list[tuple[str, dict[str, object]]]:
    """``(config class, plan)`` for each config class of the module declaring ``attr``
    (``base_model_tp_plan``, or ``base_model_ep_plan`` for expert parallel)."""
    package, _, leaf = module_name.rpartition(".")
    names = sorted({v.rpartition(".")[0] for v in facts.imports.values() if v.startswith(package + ".configuration_")})
    names = names or [f"{package}.configuration_{leaf[len('modeling_'):]}"]
    found: list[tuple[str, dict[str, object]]] = []
    for name in names:
        try:
            config_module = importlib.import_module(name)
        except ImportError as exc:
            raise PlanError(
                f"{module_name}: cannot import its configuration module {name!r} ({exc}); "
                f"install what it needs, or {FIX}"
            ) from exc
        for cls_name, obj in vars(config_module).items():
            plan = getattr(obj, attr, None) if isinstance(obj, type) else None
            if getattr(obj, "__module__", None) == name and isinstance(plan, dict) and plan:
                found.append((cls_name, dict(plan)))
    return found


def _resolves(facts: ModuleFacts, start: str, key: str) -> bool:
    parent = key.rpartition(".")[0]
    return bool(facts.resolve(start, key) or (parent and facts.resolve(start, parent)))


def base_rules(
    facts: ModuleFacts, config: str, plan: dict[str, object], attr: str = "base_model_tp_plan"
) -> list[Rule]:
    owner = f"{config}.{attr}"
    roots = set(facts.pretrained_roots())
    scored = []
    for name, cls in facts.classes.items():
        if facts.is_pretrained(name) and name not in roots:
            annotated = str(facts.constant(name, "config") or "").rpartition(".")[2] == config
            count = sum(_resolves(facts, name, key) for key in plan)
            scored.append((annotated, count, -cls.lineno, name))
    best = max((s for s in scored if s[1] > 0), default=None)
    if best is None:
        if config not in {v.rpartition(".")[2] for v in facts.imports.values()}:
            return []  # a config of the family that this modeling module does not use
        raise PlanError(
            f"{facts.module}: no model class of the module holds the keys of {owner} "
            f"(e.g. {next(iter(plan))!r}); {FIX}"
        )
    return [Rule(owner, base, prefix, key, UNIT_STYLES.get(style, style) if isinstance(style, str) else style, False)
            for base, prefix in _bases(facts, scored, best, len(plan)) for key, style in plan.items()]


def _bases(facts: ModuleFacts, scored: list[tuple], best: tuple, keys: int) -> list[tuple[str, str]]:
    """``(base class, FQN prefix)`` the plan applies to: the best-scoring class, or every class tied
    with it where each holds every key and sits at its own prefix (T5Gemma's encoder and decoder
    stacks, one module config for both)."""
    ties = [s for s in scored if s[:2] == best[:2]] if best[1] == keys else [best]
    prefixes = {s[3]: _prefix_to(facts, s[3]) for s in ties}
    if len(ties) > 1 and ("" in prefixes.values() or len(set(prefixes.values())) < len(ties)):
        ties = [best]
    return [(s[3], prefixes[s[3]]) for s in sorted(ties, reverse=True)]  # best is always among the ties


def _prefix_to(facts: ModuleFacts, base: str) -> str:
    """``"model."`` when a class holds the base model under its ``base_model_prefix``."""
    best: list[str] | None = None
    for top in facts.classes:
        if not facts.is_pretrained(top):
            continue
        for path in _paths(facts, top, base):
            if path[0] != facts.constant(top, "base_model_prefix"):
                continue
            if best is None or (len(path), path) < (len(best), best):
                best = path
    return "".join(f"{p}." for p in best) if best else ""


def _paths(facts: ModuleFacts, top: str, target: str, depth: int = 3) -> list[list[str]]:
    out: list[tuple[str, list[str]]] = []
    frontier: list[tuple[str, list[str]]] = [(top, [])]
    for _ in range(depth):
        nxt: list[tuple[str, list[str]]] = []
        for cls, path in frontier:
            for attr, refs in facts.children(cls).items():
                for ref in refs:
                    if ref.local and ref.elements is None:
                        (out if ref.name == target else nxt).append((ref.name, [*path, attr]))
        frontier = nxt
    return [path for _, path in out]


def head_rules(facts: ModuleFacts) -> list[Rule]:
    """The model classes' ``_tp_plan`` entries, less keys naming an attribute the class never sets
    (``Llama4ForConditionalGeneration._tp_plan['lm_head']``: its head is ``language_model.lm_head``,
    planned by ``Llama4ForCausalLM``): no module of that class can sit there, so transformers'
    own plan applies nothing either."""
    rules = []
    for name, cls in facts.classes.items():
        plan = cls.constants.get("_tp_plan")
        if isinstance(plan, dict):
            rules += [Rule(f"{name}._tp_plan", name, "", key, style, True) for key, style in plan.items()
                      if not _never_set(facts, name, key)]
    return rules


def _never_set(facts: ModuleFacts, name: str, key: str) -> bool:
    """``key``'s first attribute is set by no ``__init__`` of ``name``, whose bases are all of this
    module or :data:`CHILDLESS_BASES`."""
    first = key.split(".")[0]
    if is_glob(first) or facts.assigns(name, first):
        return False
    return facts.external_bases(name) <= CHILDLESS_BASES
