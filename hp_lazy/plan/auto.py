"""``Plan.auto``: contracts derived from transformers' own TP plan strings, per modeling module.

Sources: every config class's ``base_model_tp_plan`` (keys relative to the base model, e.g.
``"layers.*.self_attn.q_proj": "colwise"``) and the model classes' ``_tp_plan`` (keys relative to
that class, e.g. ``{"lm_head": "colwise_gather_output"}``), read by :mod:`hp_lazy.plan.auto_rules`.

Translation (layouts for ``[batch, seq, hidden]`` activations):

- a parent module whose children hold ``colwise``/``packed_colwise`` *and* ``rowwise`` strings is
  the boundary: ``x: R -> R`` in (copy_to), ``output: P(sum) -> R`` out (reduce_from); with
  sequence parallel ``x: S(1) -> R`` (gather) and ``output: P(sum) -> S(1)`` (reduce-scatter),
  plus a container contract on the decoder-layer ``nn.ModuleList``.
  Params: colwise ``c.weight``/``c.bias`` ``S(0)``; packed ``SS(0,2)``; rowwise ``c.weight``
  ``S(1)`` with ``c.bias`` deferred; a key naming a raw (expert) parameter shards it on its
  output dim ``-2`` (``SS(-2,2)`` packed) or input dim ``-1`` (rowwise).
  ``replicated_with_grad_allreduce`` and ``mla_kv_a_proj`` (MLA's replicated K/V down projection)
  children go to the boundary's ``grad_sum_params``.
- ``colwise_gather_output`` / ``rowwise_split_input`` on a Linear: a leaf contract on that Linear
  (``input: R``, ``output: S(-1) -> R`` / ``input: R -> S(-1)``, ``output: P(sum) -> R``).
- ``embedding_rowwise`` (and, as transformers does, the base model's ``embed_tokens`` when it is a
  plain ``nn.Embedding``): vocab-parallel embedding, ``weight: S(0)``, ``output: P(sum) -> R``.

With ``ep > 1`` each config's ``base_model_ep_plan`` is read too: an ``ep_dispatch_experts``
module (the experts) gets the region ``{"kind": "ep_dispatch"}`` (on its experts-TP contract when
the TP plan has one, else on a contract of its own with replicated inputs and output), and each
``grouped_gemm`` parameter under it ``S(0)`` on ``ep`` (the expert dim; ``ep`` is cut before
``tp``). The plan's ``colwise``/``rowwise`` entries are the TP plan's and are read from it.

Everything else raises a :class:`PlanError` naming the module, the plan's owner, the key and the
string, and pointing at an explicit JSON plan.
"""

from __future__ import annotations

import ast
import re
from typing import NoReturn

from hp_lazy.errors import PlanError
from hp_lazy.plan.auto_rules import FIX, Rule, base_rules, config_plans, head_rules
from hp_lazy.plan.model import CP_MODES, AutoFlags, Contract
from hp_lazy.plan.parse import contract_from_dict
from hp_lazy.plan.resolve import ModuleFacts, analyze, forward_params

_MODULE = re.compile(r"^transformers\.models\.(\w+)\.modeling_(\w+)$")
SUMMED = frozenset({"replicated_with_grad_allreduce", "mla_kv_a_proj"})
"""Replicated children whose gradient is summed over tp. ``mla_kv_a_proj``: MLA's joint K/V down
projection (``kv_a_proj_with_mqa``), whose output (the compressed latent and the shared RoPE key)
feeds every rank's heads, so each rank's gradient is its heads' part."""
GROUPED = frozenset({"colwise", "packed_colwise", "rowwise"}) | SUMMED
LEAF = frozenset({"colwise_gather_output", "rowwise_split_input"})
MOE = "moe_tp_experts"
SUPPORTED = GROUPED | LEAF | {"embedding_rowwise", MOE}
EP_PLAN = "base_model_ep_plan"
EP_DISPATCH, EP_PARAM = "ep_dispatch_experts", "grouped_gemm"
EP_REPLICATED = "replicated_with_grad_allreduce"
"""A parameter or submodule of an experts module kept whole on every ep rank (Region.replicated)."""
EP_TP_ENTRIES = frozenset({"colwise", "packed_colwise", "rowwise"})
"""Entries some ep plans repeat from the TP plan (a dense MLP beside the experts): read from the TP plan."""
LINEAR = "torch.nn.Linear"
EMBEDDING = "torch.nn.Embedding"


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


def auto_parts(module_name: str, source: str, flags: AutoFlags) -> tuple[tuple[Contract, ...], dict[str, str]] | None:
    """:func:`auto_contracts` plus the boundary class of each pattern whose slot holds several
    classes (a layer's ``mlp`` that is a dense MLP in some layers and an MoE block in others)."""
    if not _MODULE.match(module_name):
        return None
    facts = analyze(module_name, source)
    plans = config_plans(module_name, facts)
    if not plans:
        return None
    rules = [r for name, plan in plans for r in base_rules(facts, name, plan)]
    rules += head_rules(facts)
    ep_rules = []
    if flags.ep > 1 or flags.tp > 1:  # tp alone splits the experts the ep plan marks too (tp_experts)
        ep_rules = [r for name, plan in config_plans(module_name, facts, EP_PLAN)
                    for r in base_rules(facts, name, plan, EP_PLAN)]
    builder = _Builder(facts, flags)
    return builder.build(rules, ep_rules), dict(builder.classes)


class _Builder:
    def __init__(self, facts: ModuleFacts, flags: AutoFlags) -> None:
        self.vocab_embedding = flags.vocab_parallel_embedding
        self.classes: dict[str, str] = {}  # pattern -> class, where its slot holds several classes
        self.moe: set[tuple[str, str]] = set()  # (base, key) of moe_tp_experts modules
        self.facts = facts
        self.mesh = {"tp": flags.tp, **({"cp": flags.cp} if flags.cp > 1 else {}),
                     **({"ep": flags.ep} if flags.ep > 1 else {})}
        self.inner = {"call": "attention", "kind": CP_MODES[flags.cp_mode]} if flags.cp > 1 else None
        self.sp = flags.sequence_parallel
        self.loss_parallel = flags.loss_parallel
        self.bodies: dict[str, tuple[dict, str]] = {}

    def build(self, rules: list[Rule], ep_rules: list[Rule] | None = None) -> tuple[Contract, ...]:
        ep_rules = ep_rules or []
        if self.mesh["tp"] > 1:
            rules = self._experts_by_expert(rules, ep_rules)
            ep_rules = ep_rules if "ep" in self.mesh else []
        if self.mesh["tp"] == 1 and (self.inner is not None or ep_rules):
            # context and expert parallel at tp=1 shard nothing over tp: the TP plan only locates the
            # attention modules (cp), and strings Plan.auto cannot translate for tp do not matter
            if self.inner is not None:
                self._attention_only(rules)
            self._expert_parallel(ep_rules)
            self._check_nesting()
            return tuple(contract_from_dict(p, body, self.mesh) for p, (body, _) in sorted(self.bodies.items()))
        for rule in rules:
            if not isinstance(rule.style, str) or rule.style not in SUPPORTED:
                self._fail(rule, "is not a style Plan.auto translates (it handles colwise/packed_colwise -> "
                           "rowwise pairs, replicated_with_grad_allreduce, mla_kv_a_proj, colwise_gather_output, "
                           "rowwise_split_input and embedding_rowwise)")
        grouped = [r for r in rules if r.style in GROUPED]
        self.moe = {(r.base, r.key) for r in rules if r.style == MOE}
        for rule in rules:
            if rule.style == MOE and self.sp:
                self._fail(rule, "is not supported together with sequence_parallel yet")
            if rule.style in LEAF:
                self._add(rule.pattern, self._leaf(rule), rule.owner)
            elif rule.style == "embedding_rowwise" and self.vocab_embedding:
                self._add(rule.pattern, self._embedding(rule), rule.owner)
        boundaries = self._boundaries(grouped)
        for rule in rules:
            if rule.style == MOE and rule.prefix + rule.key not in self.bodies:
                self._fail(rule, "has no packed_colwise/colwise -> rowwise expert parameters under it to shard")
        if self.vocab_embedding:
            self._implicit_embeddings(rules)
        if self.inner is not None:
            self._attention_only(rules)
        self._expert_parallel(ep_rules)
        self._check_nesting()
        if self.sp:
            self._containers(grouped, boundaries, rules)
        return tuple(contract_from_dict(p, body, self.mesh) for p, (body, _) in sorted(self.bodies.items()))

    def _fail(self, rule: Rule, why: str) -> NoReturn:
        raise PlanError(f"{self.facts.module}: {rule.owner}[{rule.key!r}] = {rule.style!r} {why}; {FIX}")

    def _add(self, pattern: str, body: dict, owner: str) -> None:
        known = self.bodies.setdefault(pattern, (body, owner))
        if known[0] != body:
            raise PlanError(
                f"{self.facts.module}: {known[1]} and {owner} give {pattern!r} different contracts "
                f"({known[0]!r} vs {body!r}); {FIX}"
            )

    def _class_of(self, rule: Rule, key: str) -> str:
        names = self.facts.resolve(rule.base, key)
        if len(names) != 1:
            found = f"classes {sorted(names)}" if names else "no class"
            self._fail(rule, f"needs {key!r} of {rule.base} to be one module class, found {found} statically")
        return next(iter(names))

    def _is_linear(self, name: str) -> bool:
        return name == LINEAR or (name in self.facts.classes and LINEAR in self.facts.external_bases(name))

    def _input_key(self, rule: Rule, name: str) -> str:
        if name not in self.facts.classes:
            return "input"
        forward = self.facts.forward(name)
        params = forward_params(forward) if forward is not None else []
        if not params:
            self._fail(rule, f"needs the input of class {name!r}, but no forward with a named first parameter "
                       "is defined in the module (or its same-module bases)")
        return params[0]

    def _cross_inputs(self, name: str, first: str) -> list[str]:
        """Other activations a boundary's forward takes (``encoder_hidden_states``,
        ``key_value_states``): they meet colwise projections too, so they enter with ``copy_to``."""
        forward = self.facts.forward(name)
        params = forward_params(forward) if forward is not None else []
        return [p for p in params if p != first and (p.endswith("hidden_states") or p == "key_value_states")]

    def _leaf(self, rule: Rule) -> dict:
        name = self._class_of(rule, rule.key)
        if not self._is_linear(name):
            self._fail(rule, f"applies to class {name!r}, which is not an nn.Linear")
        if self.sp and not rule.head:
            self._fail(rule, "puts a per-Linear gather/split inside a layer, which sequence_parallel cannot wrap")
        x = self._input_key(rule, name)
        if rule.style == "rowwise_split_input":
            return {"in_src": {x: {"tp": "R"}}, "in_dst": {x: {"tp": "S(-1)"}},
                    "out_src": {"output": {"tp": "P(sum)"}}, "out_dst": {"output": {"tp": "R"}},
                    "params": {"weight": {"tp": "S(1)"}}, "deferred_bias_params": ["bias"], "optional_params": ["bias"]}
        out_dst = "S(-1)" if (self.loss_parallel and rule.head) else "R"
        return {"in_src": {x: {"tp": "R"}}, "in_dst": {x: {"tp": "R"}},
                "out_src": {"output": {"tp": "S(-1)"}}, "out_dst": {"output": {"tp": out_dst}},
                "params": {"weight": {"tp": "S(0)"}, "bias": {"tp": "S(0)"}}, "optional_params": ["bias"]}

    def _embedding(self, rule: Rule) -> dict:
        name = self._class_of(rule, rule.key)
        body = self._embedding_body(name)
        if body is None:
            self._fail(rule, f"applies to class {name!r}; Plan.auto shards only nn.Embedding and its subclasses")
        return body

    def _embedding_body(self, name: str | None) -> dict | None:
        """nn.Embedding itself, or a local subclass (e.g. a scaled embedding), which is bound at run
        time as a vocab-parallel leaf rather than rewritten."""
        if name == EMBEDDING:
            return _EMBEDDING_BODY
        if name is not None and name in self.facts.classes and EMBEDDING in self.facts.external_bases(name):
            return {**_EMBEDDING_BODY, "skip_source_lowering": True}
        return None

    def _implicit_embeddings(self, rules: list[Rule]) -> None:
        """transformers adds ``embed_tokens: embedding_rowwise`` whenever a TP plan exists."""
        for base, prefix in sorted({(r.base, r.prefix) for r in rules if not r.head}):
            pattern = prefix + "embed_tokens"
            found = self.facts.resolve(base, "embed_tokens")
            body = self._embedding_body(next(iter(found))) if len(found) == 1 else None
            if pattern not in self.bodies and body is not None:
                self._add(pattern, body, "embed_tokens (transformers' implicit embedding_rowwise)")

    def _boundaries(self, grouped: list[Rule]) -> list[Rule]:
        """The parents holding colwise and rowwise children; returns one rule per boundary."""
        parents: dict[tuple[str, str], list[Rule]] = {}
        for rule in grouped:
            parent = rule.key.rpartition(".")[0]
            parents.setdefault((rule.base, parent), []).append(rule)
        pairs = {k for k, rs in parents.items() if {r.style for r in rs} & {"colwise", "packed_colwise"}
                 and "rowwise" in {r.style for r in rs}}
        bodies: dict[tuple[str, str], dict] = {}
        for (base, _parent), rs in parents.items():
            for rule in rs:
                home = self._home(rule, pairs, base)
                body = bodies.setdefault(
                    home, {"params": {}, "deferred_bias_params": [], "grad_sum_params": [], "optional_params": []}
                )
                self._child(rule, home[1], body)
        heads = []
        for (base, parent) in sorted(bodies):
            rule = next(r for r in grouped if r.base == base and r.key.startswith(parent + "."))
            self._add(rule.prefix + parent, self._boundary_body(rule, parent, bodies[(base, parent)]), rule.owner)
            heads.append(Rule(rule.owner, base, rule.prefix, parent, "boundary", False))
        return heads

    def _home(self, rule: Rule, pairs: set[tuple[str, str]], base: str) -> tuple[str, str]:
        parent = rule.key.rpartition(".")[0]
        if not parent:
            self._fail(rule, f"names a direct child of the base model {base}, which Plan.auto cannot enclose")
        if (base, parent) in pairs:
            return (base, parent)
        if rule.style in SUMMED:
            for home in sorted(pairs, key=lambda p: -len(p[1])):
                if home[0] == base and parent.startswith(home[1] + "."):
                    return home
            self._fail(rule, "is not inside a module that encloses a colwise -> rowwise pair")
        self._fail(rule, f"has no {'rowwise' if rule.style != 'rowwise' else 'colwise'} sibling under "
                   f"{parent or rule.base!r}, so no module encloses a colwise -> rowwise pair")

    def _child(self, rule: Rule, parent: str, body: dict) -> None:
        rel = rule.key[len(parent) + 1 :] if parent else rule.key
        is_module = bool(self.facts.resolve(rule.base, rule.key))
        params, style = body["params"], str(rule.style)
        if style in SUMMED:
            body["grad_sum_params"].append(f"{rel}.*" if is_module else rel)
        elif not is_module:
            if not self._is_param(rule):
                self._fail(rule, f"names {rule.key!r}, which is neither a child module nor an nn.Parameter of "
                           f"{rule.base} in the source")
            params[rel] = {"tp": {"colwise": "S(-2)", "packed_colwise": "SS(-2,2)", "rowwise": "S(-1)"}[style]}
        else:
            name = self._class_of(rule, rule.key)
            if not self._is_linear(name):
                self._fail(rule, f"applies to class {name!r}, which is not an nn.Linear")
            shard = {"colwise": "S(0)", "packed_colwise": "SS(0,2)", "rowwise": "S(1)"}[style]
            params[f"{rel}.weight"] = {"tp": shard}
            if style == "rowwise":
                body["deferred_bias_params"].append(f"{rel}.bias")
            else:
                params[f"{rel}.bias"] = {"tp": shard}
            body["optional_params"].append(f"{rel}.bias")  # the config may turn biases off
            if self._conditional(rule.base, parent, rel):  # MLA: q_proj or q_a_proj -> q_b_proj, by config
                body["optional_params"].append(f"{rel}.weight")

    def _conditional(self, base: str, parent: str, rel: str) -> bool:
        owners = self.facts.resolve(base, parent) if parent else {base}
        return any(rel.split(".")[0] in self.facts.conditional(o) for o in owners if o in self.facts.classes)

    def _is_param(self, rule: Rule) -> bool:
        owner_key, _, leaf = rule.key.rpartition(".")
        owners = self.facts.resolve(rule.base, owner_key) if owner_key else {rule.base}
        return any(leaf in self.facts.params(o) for o in owners if o in self.facts.classes)

    def _boundary_class(self, rule: Rule, parent: str, body: dict) -> str:
        """The class at ``parent``; where the slot holds several (dense MLP or MoE block by layer),
        the one class that has every planned child."""
        names = self.facts.resolve(rule.base, parent)
        if len(names) > 1:
            children = {name.split(".")[0] for name in [*body["params"], *body["grad_sum_params"]]}
            fits = [n for n in sorted(names) if n in self.facts.classes
                    and children <= set(self.facts.children(n)) | self.facts.params(n)]
            if len(fits) == 1:
                self.classes[rule.prefix + parent] = fits[0]
                return fits[0]
        return self._class_of(rule, parent)

    def _experts_body(self, rule: Rule, name: str, body: dict) -> dict:
        """transformers' ``moe_tp_experts``: every rank runs its slice of every expert; all inputs
        (hidden states, routing weights) enter with copy_to, the partial sums are reduced at exit.
        Bound at run time around the class's own forward, which transformers' experts decorator
        dispatches to its kernels."""
        forward = self.facts.forward(name)
        inputs = forward_params(forward) if forward is not None else []
        if not inputs:
            self._fail(rule, f"needs the forward parameters of the experts class {name!r}")
        out = {"in_src": {x: {"tp": "R"} for x in inputs}, "in_dst": {x: {"tp": "R"} for x in inputs},
               "out_src": {"output": {"tp": "P(sum)"}}, "out_dst": {"output": {"tp": "R"}},
               "params": body["params"], "skip_source_lowering": True}
        if body["grad_sum_params"]:
            out["grad_sum_params"] = sorted(body["grad_sum_params"])
        return out

    def _boundary_body(self, rule: Rule, parent: str, body: dict) -> dict:
        name = self._boundary_class(rule, parent, body)
        if name not in self.facts.classes:
            self._fail(rule, f"needs its enclosing module {parent!r} to be a class of the module, found {name!r}")
        if (rule.base, parent) in self.moe:
            return self._experts_body(rule, name, body)
        x = self._input_key(rule, name)
        src, dst = ("S(1)", "S(1)") if self.sp else ("R", "R")
        out = {"in_src": {x: {"tp": src}}, "in_dst": {x: {"tp": "R"}},
               "out_src": {"output": {"tp": "P(sum)"}}, "out_dst": {"output": {"tp": dst}}, "params": body["params"]}
        for extra in self._cross_inputs(name, x):  # cross-attention: also projected by the colwise k/v
            out["in_src"][extra] = out["in_dst"][extra] = {"tp": "R"}
        if self.inner is not None and self._calls_attention(name):
            out["inner"] = dict(self.inner)
        for field in ("deferred_bias_params", "grad_sum_params", "optional_params"):
            if body[field]:
                out[field] = sorted(body[field])
        return out

    def _attention_only(self, rules: list[Rule]) -> None:
        """Context parallel needs its inner op on every attention module, also where the TP plan
        makes no boundary of it (fused ``qkv_proj`` planned as leaves, or a plan naming only the
        embedding): a contract with the op alone, for the parents of planned keys and for the
        children of the decoder layers (``layers.*.<child>``) whose forward calls attention."""
        found: set[tuple[str, str, str]] = set()
        for rule in rules:
            parent = rule.key.rpartition(".")[0]
            if parent and not rule.head:
                found.add((rule.base, rule.prefix, parent))
            for layer in sorted(self.facts.resolve(rule.base, "layers.*")) if not rule.head else ():
                if layer in self.facts.classes:
                    found.update((rule.base, rule.prefix, f"layers.*.{child}") for child in self.facts.children(layer))
        for base, prefix, key in sorted(found):
            names = self.facts.resolve(base, key)
            if prefix + key not in self.bodies and len(names) == 1 and self._calls_attention(next(iter(names))):
                self._add(prefix + key, {"inner": dict(self.inner or {})}, f"{base} (cp attention)")

    def _calls_attention(self, name: str) -> bool:
        """Its forward dispatches through transformers' attention interface (context parallel's call site)."""
        forward = self.facts.forward(name)
        return forward is not None and any(
            isinstance(node, ast.Name) and node.id == "ALL_ATTENTION_FUNCTIONS" for node in ast.walk(forward)
        )

    def _experts_by_expert(self, rules: list[Rule], ep_rules: list[Rule]) -> list[Rule]:
        """Under tp without ep, every module the ep plan marks ``ep_dispatch_experts`` is split by
        expert over the tp ranks, on every release: transformers 5.25 dropped ``moe_tp_experts`` from the TP
        plans, and where a TP plan still has it (5.24) its entries under those modules give way, so
        one family has one layout whatever the release: the region ``tp_experts``, every
        ``grouped_gemm`` parameter ``S(0)`` on tp. Same bytes per layer as experts-TP (one
        all-reduce of the output), whole experts (fewer, full-width GEMMs), and no dependence on
        how the expert weights are stored (packed, interleaved, transposed). With ep,
        :meth:`_expert_parallel` cuts them on ep, and on tp only where the TP plan still has
        experts-TP entries. Returns the TP rules left for the rest of the plan."""
        experts = [r for r in ep_rules if r.style == EP_DISPATCH]

        def under(rule: Rule, key: str) -> bool:
            return rule.key == key or rule.key.startswith(key + ".")

        if not experts or "ep" in self.mesh:
            return rules  # under ep the TP plan's experts-TP entries (5.24) still cut each rank's experts on tp
        kept = [r for r in rules if not any(r.base == e.base and under(r, e.key) for e in experts)]
        for rule in experts:
            if self.sp:
                self._fail(rule, "(experts split by expert over tp) is not supported together with sequence_parallel "
                           "yet: each tp rank holds other tokens there")
        for rule in experts:
            mine = [r for r in ep_rules if r.base == rule.base and under(r, rule.key) and r is not rule]
            for other in mine:
                if other.style not in (EP_PARAM, EP_REPLICATED):
                    self._fail(other, f"is not an entry Plan.auto places inside {EP_DISPATCH!r} experts under tp "
                               f"(it handles {EP_PARAM!r} and {EP_REPLICATED!r})")
            cut = {r.key[len(rule.key) + 1 :]: {"tp": "S(0)"} for r in mine if r.style == EP_PARAM}
            if not cut:
                self._fail(rule, f"has no {EP_PARAM!r} expert parameters under it to split over tp")
            name = self._class_of(rule, rule.key)
            body = self._ep_body(rule, name)
            body.update(out_src={"output": {"tp": "P(sum)"}}, params=cut, skip_source_lowering=True)
            region: dict[str, object] = {"kind": "tp_experts"}
            whole = sorted(r.key[len(rule.key) + 1 :] for r in mine if r.style == EP_REPLICATED)
            if whole:
                region["replicated"] = whole
            body["region"] = region
            self._add(rule.pattern, body, rule.owner)
        return kept

    def _expert_parallel(self, rules: list[Rule]) -> None:
        """The ``ep_dispatch`` region on every ``ep_dispatch_experts`` module, its ``grouped_gemm``
        parameters ``S(0)`` on ``ep``."""
        experts = [r for r in rules if r.style == EP_DISPATCH]
        for rule in rules:
            if rule.style in (EP_PARAM, EP_REPLICATED):
                if not any(e.base == rule.base and rule.key.startswith(e.key + ".") for e in experts):
                    self._fail(rule, f"is not under a module the plan marks {EP_DISPATCH!r}")
            elif rule.style != EP_DISPATCH and rule.style not in EP_TP_ENTRIES:
                self._fail(rule, f"is not an entry expert parallel places (it handles {EP_DISPATCH!r} modules and "
                           f"their {EP_PARAM!r} and {EP_REPLICATED!r} parameters)")
        for rule in experts:
            name = self._class_of(rule, rule.key)
            known = self.bodies.get(rule.pattern)
            body = dict(known[0]) if known is not None else self._ep_body(rule, name)
            params = {k: dict(v) for k, v in body.get("params", {}).items()}
            under = [r for r in rules if r.base == rule.base and r.key.startswith(rule.key + ".")]
            mine = [r for r in under if r.style == EP_PARAM]
            if not mine:
                self._fail(rule, f"has no {EP_PARAM!r} expert parameters under it to cut over ep")
            for param in mine:
                rel = param.key[len(rule.key) + 1 :]
                params[rel] = {**params.get(rel, {}), "ep": "S(0)"}
            region: dict[str, object] = {"kind": "ep_dispatch"}
            whole = sorted(r.key[len(rule.key) + 1 :] for r in under if r.style == EP_REPLICATED)
            if whole:
                region["replicated"] = whole
            body.update(params=params, region=region, skip_source_lowering=True)
            self.bodies[rule.pattern] = (body, known[1] if known is not None else rule.owner)

    def _ep_body(self, rule: Rule, name: str) -> dict:
        """The entry and exit of an experts module: its inputs replicated over tp (every tp rank
        dispatches the same tokens), its output too (tp=1) or the sum of the tp ranks' experts."""
        forward = self.facts.forward(name)
        inputs = forward_params(forward) if forward is not None else []
        if not inputs:
            self._fail(rule, f"needs the forward parameters of the experts class {name!r}")
        return {"in_src": {x: {"tp": "R"} for x in inputs}, "in_dst": {x: {"tp": "R"} for x in inputs},
                "out_src": {"output": {"tp": "R"}}, "out_dst": {"output": {"tp": "R"}}, "params": {}}

    def _check_nesting(self) -> None:
        patterns = sorted(self.bodies)
        for outer in patterns:
            if set(self.bodies[outer][0]) == {"inner"}:
                continue  # an op-only contract (cp attention) changes no placement inside it
            for inner in patterns:
                if inner.startswith(outer + ".") and self._contains(outer, inner[len(outer) + 1 :]):
                    raise PlanError(
                        f"{self.facts.module}: contract {inner!r} ({self.bodies[inner][1]}) lies inside contract "
                        f"{outer!r} ({self.bodies[outer][1]}); Plan.auto does not nest tensor-parallel "
                        f"boundaries; {FIX}"
                    )

    def _contains(self, outer: str, rest: str) -> bool:
        """Whether the class chosen for ``outer`` (when its slot holds several) reaches ``rest``."""
        chosen = self.classes.get(outer)
        return chosen is None or bool(self.facts.resolve(chosen, rest))

    def _containers(self, grouped: list[Rule], boundaries: list[Rule], rules: list[Rule]) -> None:
        for rule in boundaries:
            segments = rule.key.split(".")
            star = next((i for i, s in enumerate(segments) if s == "*" or s.isdigit()), None)
            container = ".".join(segments[:star]) if star else ""
            if not container or self.facts.resolve(rule.base, container) != {"torch.nn.ModuleList"}:
                self._fail(rule, f"makes {rule.pattern!r} a boundary outside an nn.ModuleList of layers, "
                           "which sequence_parallel needs")
            self._add(rule.prefix + container, _CONTAINER_BODY, "sequence_parallel")


_EMBEDDING_BODY = {
    "in_src": {"input": {"tp": "R"}}, "in_dst": {"input": {"tp": "R"}},
    "out_src": {"output": {"tp": "P(sum)"}}, "out_dst": {"output": {"tp": "R"}},
    "params": {"weight": {"tp": "S(0)"}},
}
_CONTAINER_BODY = {
    "in_src": {"input": {"tp": "R"}}, "in_dst": {"input": {"tp": "S(1)"}},
    "out_src": {"output": {"tp": "S(1)"}}, "out_dst": {"output": {"tp": "R"}},
    "grad_sum_params": ["*"],
}
