"""The tp preset: transformers' TP plan strings as tensor-parallel contracts (layouts for
``[batch, seq, hidden]`` activations).

- A parent module whose children hold ``colwise``/``packed_colwise`` *and* ``rowwise`` strings is
  the boundary: ``x: R -> R`` in (copy_to), ``output: P(sum) -> R`` out (reduce_from). Params:
  colwise ``c.weight``/``c.bias`` ``S(0)``; packed ``SS(0,2)``; rowwise ``c.weight`` ``S(1)`` with
  ``c.bias`` deferred; a key naming a raw parameter cuts the dim transformers cuts (``ndim - 2``
  for colwise, the last for rowwise): an expert tensor on dim ``-2`` (``SS(-2,2)`` packed) or
  ``-1`` (``SS(-1,2)`` for ``packed_rowwise``, Llama 4's transposed experts), a per-head vector
  (attention sinks, a gate bias: its rank read from the source) on dim ``0``. ``replicated_with_grad_allreduce`` and
  ``mla_kv_a_proj`` (MLA's replicated K/V down projection) children go to the boundary's
  ``grad_sum_params``. Other activations the boundary's forward takes (cross-attention's
  ``encoder_hidden_states``) enter replicated too.
- ``moe_tp_experts`` (transformers 5.24): every rank runs its slice of every expert, bound at run
  time around the experts class's own forward; all inputs enter with copy_to, the partial sums are
  reduced at exit.
- ``colwise_gather_output`` / ``rowwise_split_input`` on a Linear: a leaf contract on that Linear
  (``input: R``, ``output: S(-1) -> R`` / ``input: R -> S(-1)``, ``output: P(sum) -> R``); the
  model's head keeps its output sharded under ``loss_parallel``.
- ``embedding_rowwise`` (and, as transformers does, the base model's ``embed_tokens`` when it is a
  plain ``nn.Embedding`` or a local subclass of it): vocab-parallel embedding, ``weight: S(0)``,
  ``output: P(sum) -> R``. ``embedding_colwise`` (5.25): a leaf cut along the features,
  ``weight: S(1)``, ``output: S(-1) -> R`` (one all-gather; no vocabulary masking).
- A norm the boundary's forward applies straight to a colwise projection's output
  (``self.q_norm(self.q_proj(x))``, no reshape between: ESM C, OLMo 2/3) normalises features tp
  splits: its ``weight``/``bias`` are cut ``S(0)`` like the projection's rows, and the runtime sums
  its row statistics over tp (:mod:`hp_lazy.runtime.tp.norms`). Where transformers' plan gathers
  the projections for such a norm instead (``colwise_gather_output`` on q/k/v and
  ``rowwise_split_input`` on o: OLMo 2/3, OLMoE, FlexOlmo, MiniMax-M2), Plan.auto reads the siblings
  as a plain colwise -> rowwise pair: the gather would run attention whole on every rank.
- Likewise a gathered projection whose output the forward only halves along the features
  (``gate, up = self.gate_up_proj(x).chunk(2, dim=-1)``: GLM's and Phi-3's MLPs) and its split
  rowwise sibling are read as ``packed_colwise`` -> ``rowwise``: each rank holds its slice of both
  halves, and the MLP moves one ``[B, S, H]`` all-reduce instead of an all-gather of ``[B, S, 2I]``
  besides it (and can run under sequence parallel).
- ``local_params`` (transformers 5.25) marks a module whose own raw parameters its children's
  entries shard (``self_attn.sinks: colwise``): hp_lazy's boundary binds them with the module, so
  the marker must land on a boundary. ``replicate`` keeps a module whole on every rank: no contract,
  and no implicit vocab-parallel ``embed_tokens`` where it names that.

Everything else raises a :class:`PlanError` naming the module, the plan's owner, the key and the
string, and pointing at an explicit JSON plan.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import replace

from hp_lazy.plan.auto.draft import Draft, Entry
from hp_lazy.plan.auto.rules import Rule
from hp_lazy.plan.resolve import forward_params, resolve_pattern

SUMMED = frozenset({"replicated_with_grad_allreduce", "mla_kv_a_proj"})
"""Replicated children whose gradient is summed over tp. ``mla_kv_a_proj``: MLA's joint K/V down
projection (``kv_a_proj_with_mqa``), whose output (the compressed latent and the shared RoPE key)
feeds every rank's heads, so each rank's gradient is its heads' part."""
COLWISE = frozenset({"colwise", "packed_colwise"})
ROWWISE = frozenset({"rowwise", "packed_rowwise"})
GROUPED = COLWISE | ROWWISE | SUMMED
LEAF = frozenset({"colwise_gather_output", "rowwise_split_input"})
MOE = "moe_tp_experts"
LOCAL, REPLICATE = "local_params", "replicate"
SUPPORTED = GROUPED | LEAF | {"embedding_rowwise", "embedding_colwise", MOE, LOCAL, REPLICATE}
RAW_SHARDS = {"colwise": "S(-2)", "packed_colwise": "SS(-2,2)", "rowwise": "S(-1)", "packed_rowwise": "SS(-1,2)"}
"""A raw parameter's cut by style: transformers' ``ndim - 2`` for colwise, the last dim for rowwise."""
VECTOR_SHARDS = {"colwise": "S(0)", "packed_colwise": "SS(0,2)"}
EMBEDDING_BODY = {
    "in_src": {"input": {"tp": "R"}}, "in_dst": {"input": {"tp": "R"}},
    "out_src": {"output": {"tp": "P(sum)"}}, "out_dst": {"output": {"tp": "R"}},
    "params": {"weight": {"tp": "S(0)"}},
}
EMBEDDING_COLWISE_BODY = {
    "in_src": {"input": {"tp": "R"}}, "in_dst": {"input": {"tp": "R"}},
    "out_src": {"output": {"tp": "S(-1)"}}, "out_dst": {"output": {"tp": "R"}},
    "params": {"weight": {"tp": "S(1)"}},
}
"""``embedding_colwise`` (transformers 5.25, Qwen4-Exp's n-gram tables): each rank holds a slice of
every row's features and looks up its slice; the slices are gathered."""


def apply(draft: Draft, rules: list[Rule]) -> None:
    """The tp contracts of ``rules`` (the TP plan's entries and the model classes' ``_tp_plan``)."""
    for rule in rules:
        if not isinstance(rule.style, str) or rule.style not in SUPPORTED:
            draft.fail(rule, "is not a style Plan.auto translates (it handles colwise/packed_colwise -> "
                       "rowwise/packed_rowwise pairs, replicated_with_grad_allreduce, mla_kv_a_proj, "
                       "colwise_gather_output, rowwise_split_input, embedding_rowwise, embedding_colwise, "
                       "moe_tp_experts, "
                       "local_params and replicate)")
    ungathered = _ungathered(draft, [r for r in rules if r.style in LEAF])
    rules = [ungathered.get(id(r), r) for r in rules]
    for rule in rules:
        if rule.style in LEAF:
            draft.add(rule.pattern, Entry(_leaf(draft, rule), rule.owner, "leaf", rule))
        elif rule.style == "embedding_rowwise" and draft.flags.vocab_parallel_embedding:
            draft.add(rule.pattern, Entry(_embedding(draft, rule), rule.owner, "embedding", rule))
        elif rule.style == "embedding_colwise":
            draft.add(rule.pattern, Entry(_embedding(draft, rule, EMBEDDING_COLWISE_BODY), rule.owner, "leaf", rule))
    moe = {(r.base, r.key): r for r in rules if r.style == MOE}
    _Boundaries(draft, moe).add([r for r in rules if r.style in GROUPED])
    for rule in rules:
        if rule.style == MOE and rule.pattern not in draft.entries:
            draft.fail(rule, "has no packed_colwise/colwise -> rowwise expert parameters under it to shard")
        marked = draft.entries.get(rule.pattern)
        if rule.style == LOCAL and (marked is None or marked.kind != "boundary"):
            draft.fail(rule, "marks a module whose raw parameters hp_lazy shards only with an enclosing "
                       "colwise -> rowwise pair, and no such pair sits directly under it")
    if draft.flags.vocab_parallel_embedding:
        _implicit_embeddings(draft, rules)


UNGATHER = {"colwise_gather_output": "colwise", "rowwise_split_input": "rowwise"}


def _ungathered(draft: Draft, leaves: list[Rule]) -> dict[int, Rule]:
    """Gathered colwise and split rowwise siblings around a norm of a gathered output (OLMo 2's
    q/k norms), as the colwise/rowwise rules of one boundary: id(rule) -> its plain-style copy."""
    siblings: dict[tuple[str, str], list[Rule]] = {}
    for rule in leaves:
        parent = rule.key.rpartition(".")[0]
        if parent and not rule.head:
            siblings.setdefault((rule.base, parent), []).append(rule)
    out: dict[int, Rule] = {}
    for (base, parent), group in siblings.items():
        if {r.style for r in group} != set(UNGATHER):
            continue
        names = draft.facts.resolve(base, parent)
        gathered = {r.key.rpartition(".")[2] for r in group if r.style == "colwise_gather_output"}
        if len(names) != 1:
            continue
        name = next(iter(names))
        if set(_split_norms(draft, name, gathered).values()) & gathered:
            out.update({id(r): replace(r, style=UNGATHER[str(r.style)]) for r in group})
        elif gathered and _halved(draft, name, gathered) == gathered:
            out.update({id(r): replace(r, style="packed_colwise" if r.style == "colwise_gather_output"
                                       else "rowwise") for r in group})
    return out


def _halved(draft: Draft, name: str, colwise: set[str]) -> set[str]:
    """The colwise children of class ``name`` whose output its forward only cuts in two halves along
    the features (``gate, up = self.gate_up_proj(x).chunk(2, dim=-1)``: GLM's and Phi-3's MLPs,
    which transformers' plan gathers for that ``chunk``): packed ``[gate; up]`` rows, so each rank
    can hold its slice of both halves (``SS(0,2)``) and the gather is not needed.

    Read from the forward's top-level statements in order: a name bound to ``self.<child>(...)``
    must be read only as the receiver of that ``chunk`` until it is bound again."""
    forward = draft.facts.forward(name)
    if forward is None:
        return set()
    live: dict[str, str] = {}  # variable -> the child whose whole output it holds
    found: set[str] = set()
    refused: set[str] = set()
    for stmt in forward.body:
        chunked: set[int] = set()
        for node in ast.walk(stmt):
            receiver = _halving(node)
            if receiver is None:
                continue
            child = _self_call(receiver)
            if child in colwise:
                found.add(child)
                chunked.add(id(receiver))
            elif isinstance(receiver, ast.Name) and receiver.id in live:
                found.add(live[receiver.id])
                chunked.add(id(receiver))
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in live \
                    and id(node) not in chunked:
                refused.add(live[node.id])
            child = _self_call(node)
            if child in colwise and id(node) not in chunked and not _bound(stmt, node):
                refused.add(child)
        for target in _targets(stmt):
            live.pop(target, None)
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            child = _self_call(stmt.value)
            if child in colwise:
                live[stmt.targets[0].id] = child
    return found - refused


def _halving(node: ast.AST) -> ast.expr | None:
    """``x`` of ``x.chunk(2, dim=-1)`` / ``x.chunk(2, -1)`` / ``torch.chunk(x, 2, dim=-1)``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "chunk"):
        return None
    args = list(node.args)
    if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
        if not args:
            return None
        receiver = args.pop(0)
    else:
        receiver = node.func.value
    dims = [k.value for k in node.keywords if k.arg == "dim"] + args[1:]
    if len(args) < 1 or len(dims) != 1 or len(node.keywords) != sum(k.arg == "dim" for k in node.keywords):
        return None
    if _constant(args[0]) != 2 or _constant(dims[0]) != -1:
        return None
    return receiver


def _constant(node: ast.expr) -> object:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value  # type: ignore[operator]
    return node.value if isinstance(node, ast.Constant) else None


def _bound(stmt: ast.stmt, call: ast.AST) -> bool:
    """``call`` is the whole value of a one-name assignment (tracked as live)."""
    return isinstance(stmt, ast.Assign) and stmt.value is call and len(stmt.targets) == 1 \
        and isinstance(stmt.targets[0], ast.Name)


def _targets(stmt: ast.stmt) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _split_norms(draft: Draft, name: str, colwise: set[str]) -> dict[str, str]:
    """Norm child -> colwise child, for each ``self.<norm>(self.<colwise>(...))`` in the forward
    of class ``name``: a norm over every output feature of the projection, which tp splits."""
    forward = draft.facts.forward(name)
    if forward is None:
        return {}
    found: dict[str, str] = {}
    for node in ast.walk(forward):
        outer = _self_call(node)
        if outer is None or len(node.args) != 1:  # type: ignore[attr-defined]
            continue
        inner = _self_call(node.args[0])  # type: ignore[attr-defined]
        classes = draft.facts.resolve(name, outer)
        if inner in colwise and classes and all(_is_norm(draft, c) for c in classes):
            found[outer] = inner
    return found


NORMS = frozenset({"torch.nn.LayerNorm", "torch.nn.RMSNorm", "torch.nn.modules.normalization.LayerNorm",
                   "torch.nn.modules.normalization.RMSNorm"})


def _is_norm(draft: Draft, name: str) -> bool:
    """torch's LayerNorm / RMSNorm, a local subclass of one, or a local class with a ``weight`` of
    its own (transformers' RMSNorms); not an activation or any other weightless module."""
    if name in NORMS:
        return True
    facts = draft.facts
    return name in facts.classes and not draft.is_linear(name) and (
        "weight" in facts.params(name) or bool(facts.external_bases(name) & NORMS))


def _self_call(node: ast.AST) -> str | None:
    """``attr`` of a call ``self.<attr>(...)``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
            and node.func.value.id == "self":
        return node.func.attr
    return None


def _leaf(draft: Draft, rule: Rule) -> dict:
    name = draft.class_of(rule, rule.key)
    if not draft.is_linear(name):
        draft.fail(rule, f"applies to class {name!r}, which is not an nn.Linear")
    x = draft.input_key(rule, name)
    if rule.style == "rowwise_split_input":
        return {"in_src": {x: {"tp": "R"}}, "in_dst": {x: {"tp": "S(-1)"}},
                "out_src": {"output": {"tp": "P(sum)"}}, "out_dst": {"output": {"tp": "R"}},
                "params": {"weight": {"tp": "S(1)"}}, "deferred_bias_params": ["bias"], "optional_params": ["bias"]}
    out_dst = "S(-1)" if (draft.flags.loss_parallel and rule.head) else "R"
    return {"in_src": {x: {"tp": "R"}}, "in_dst": {x: {"tp": "R"}},
            "out_src": {"output": {"tp": "S(-1)"}}, "out_dst": {"output": {"tp": out_dst}},
            "params": {"weight": {"tp": "S(0)"}, "bias": {"tp": "S(0)"}}, "optional_params": ["bias"]}


def _embedding(draft: Draft, rule: Rule, body: dict = EMBEDDING_BODY) -> dict:
    name = draft.class_of(rule, rule.key)
    found = _embedding_body(draft, name, body)
    if found is None:
        draft.fail(rule, f"applies to class {name!r}; Plan.auto shards only nn.Embedding and its subclasses")
    return found


def _embedding_body(draft: Draft, name: str | None, body: dict = EMBEDDING_BODY) -> dict | None:
    """nn.Embedding itself, or a local subclass (e.g. a scaled embedding), which is bound at run
    time as a leaf rather than rewritten."""
    plain = draft.is_embedding(name)
    if plain is None:
        return None
    body = copy.deepcopy(body)  # each entry its own: the sp preset edits a leaf's placements in place
    return body if plain else {**body, "skip_source_lowering": True}


def _implicit_embeddings(draft: Draft, rules: list[Rule]) -> None:
    """transformers adds ``embed_tokens: embedding_rowwise`` whenever a TP plan exists."""
    whole = {r.pattern for r in rules if r.style == REPLICATE}
    for base, prefix in sorted({(r.base, r.prefix) for r in rules if not r.head}):
        pattern = prefix + "embed_tokens"
        if pattern in whole:
            continue
        found = draft.facts.resolve(base, "embed_tokens")
        body = _embedding_body(draft, next(iter(found))) if len(found) == 1 else None
        if pattern not in draft.entries and body is not None:
            owner = "embed_tokens (transformers' implicit embedding_rowwise)"
            draft.add(pattern, Entry(body, owner, "embedding"))


class _Boundaries:
    """The parents holding colwise and rowwise children, one contract each."""

    def __init__(self, draft: Draft, moe: dict[tuple[str, str], Rule]) -> None:
        self.draft = draft
        self.facts = draft.facts
        self.moe = moe  # (base, key) of each moe_tp_experts module -> its rule

    def add(self, grouped: list[Rule]) -> None:
        parents: dict[tuple[str, str], list[Rule]] = {}
        for rule in grouped:
            parent = rule.key.rpartition(".")[0]
            parents.setdefault((rule.base, parent), []).append(rule)
        pairs = {k for k, rs in parents.items() if {r.style for r in rs} & COLWISE and {r.style for r in rs} & ROWWISE}
        bodies: dict[tuple[str, str], dict] = {}
        for (base, _parent), rs in parents.items():
            for rule in rs:
                home = self._home(rule, pairs, base)
                body = bodies.setdefault(
                    home, {"params": {}, "deferred_bias_params": [], "grad_sum_params": [], "optional_params": []}
                )
                self._child(rule, home[1], body)
        for (base, parent) in sorted(bodies):
            rule = next(r for r in grouped if r.base == base and r.key.startswith(parent + "."))
            head = Rule(rule.owner, base, rule.prefix, parent, "boundary", False)
            name = self._boundary_class(rule, parent, bodies[(base, parent)])
            if name not in self.facts.classes:
                self.draft.fail(rule, f"needs its enclosing module {parent!r} to be a class of the module, "
                                f"found {name!r}")
            if (base, parent) in self.moe:
                body = self._experts_body(rule, name, bodies[(base, parent)])
                entry = Entry(body, rule.owner, "experts_tp", self.moe[(base, parent)])
            else:
                entry = Entry(self._boundary_body(rule, name, bodies[(base, parent)]), rule.owner, "boundary", head,
                              name)
            self.draft.add(head.pattern, entry)

    def _home(self, rule: Rule, pairs: set[tuple[str, str]], base: str) -> tuple[str, str]:
        parent = rule.key.rpartition(".")[0]
        if not parent:
            self.draft.fail(rule, f"names a direct child of the base model {base}, which Plan.auto cannot enclose")
        if (base, parent) in pairs:
            return (base, parent)
        if rule.style in SUMMED:
            for home in sorted(pairs, key=lambda p: -len(p[1])):
                if home[0] == base and parent.startswith(home[1] + "."):
                    return home
            self.draft.fail(rule, "is not inside a module that encloses a colwise -> rowwise pair")
        self.draft.fail(rule, f"has no {'colwise' if rule.style in ROWWISE else 'rowwise'} sibling under "
                        f"{parent or rule.base!r}, so no module encloses a colwise -> rowwise pair")

    def _child(self, rule: Rule, parent: str, body: dict) -> None:
        rel = rule.key[len(parent) + 1 :] if parent else rule.key
        is_module = bool(self.facts.resolve(rule.base, rule.key))
        params, style = body["params"], str(rule.style)
        if style in SUMMED:
            body["grad_sum_params"].append(f"{rel}.*" if is_module else rel)
        elif not is_module:
            if not self._is_param(rule):
                self.draft.fail(rule, f"names {rule.key!r}, which is neither a child module nor an nn.Parameter "
                                f"of {rule.base} in the source")
            params[rel] = {"tp": self._raw_shard(rule, style)}
            if self._conditional(rule.base, parent, rel):  # MiMo: sinks only on sliding-window layers
                body["optional_params"].append(rel)
        else:
            name = self.draft.class_of(rule, rule.key)
            if not self.draft.is_linear(name):
                self.draft.fail(rule, f"applies to class {name!r}, which is not an nn.Linear")
            if style == "packed_rowwise":
                self.draft.fail(rule, "applies to an nn.Linear; Plan.auto reads packed_rowwise only on raw "
                                "(transposed expert) parameters, whose packed output dim it cuts")
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

    def _raw_shard(self, rule: Rule, style: str) -> str:
        """The layout of a raw parameter: by style, and for a vector (rank 1 in the source) dim 0."""
        owner_key, _, leaf = rule.key.rpartition(".")
        owners = self.facts.resolve(rule.base, owner_key) if owner_key else {rule.base}
        ranks = {self.facts.param_rank(o, leaf) for o in owners if o in self.facts.classes}
        if ranks != {1}:
            return RAW_SHARDS[style]
        if style not in VECTOR_SHARDS:
            self.draft.fail(rule, f"names {rule.key!r}, a vector: it has no input dim for {style} to cut")
        return VECTOR_SHARDS[style]

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
                self.draft.classes[rule.prefix + parent] = fits[0]
                return fits[0]
        name = self.draft.class_of(rule, parent)
        if self._elsewhere(rule.prefix + parent, name):  # Llama 4: text and vision layers under one pattern
            self.draft.classes[rule.prefix + parent] = name
        return name

    def _elsewhere(self, pattern: str, name: str) -> bool:
        """``pattern`` reaches a class other than ``name`` from another model class of the module (the
        text and the vision model of one family, each with ``layers.*.self_attn``): the rule's own base
        decides, as the bound module's class will."""
        return any(found - {name} for found in resolve_pattern(self.facts, pattern).values())

    def _experts_body(self, rule: Rule, name: str, body: dict) -> dict:
        inputs = self.draft.inputs(rule, name)
        out = {"in_src": {x: {"tp": "R"} for x in inputs}, "in_dst": {x: {"tp": "R"} for x in inputs},
               "out_src": {"output": {"tp": "P(sum)"}}, "out_dst": {"output": {"tp": "R"}},
               "params": body["params"], "skip_source_lowering": True}
        if body["grad_sum_params"]:
            out["grad_sum_params"] = sorted(body["grad_sum_params"])
        return out

    def _boundary_body(self, rule: Rule, name: str, body: dict) -> dict:
        x = self.draft.input_key(rule, name)
        colwise = {k.rpartition(".")[0] for k, v in body["params"].items()
                   if k.endswith(".weight") and v == {"tp": "S(0)"}}
        planned = {k.split(".")[0] for k in [*body["params"], *body["grad_sum_params"]]}
        for norm in sorted(set(_split_norms(self.draft, name, colwise)) - planned):  # ESM C's q/k norms
            body["params"][f"{norm}.weight"] = body["params"][f"{norm}.bias"] = {"tp": "S(0)"}
            body["optional_params"].append(f"{norm}.bias")
        out = {"in_src": {x: {"tp": "R"}}, "in_dst": {x: {"tp": "R"}},
               "out_src": {"output": {"tp": "P(sum)"}}, "out_dst": {"output": {"tp": "R"}}, "params": body["params"]}
        for extra in self._cross_inputs(name, x):  # cross-attention: also projected by the colwise k/v
            out["in_src"][extra] = out["in_dst"][extra] = {"tp": "R"}
        for field in ("deferred_bias_params", "grad_sum_params", "optional_params"):
            if body[field]:
                out[field] = sorted(body[field])
        return out

    def _cross_inputs(self, name: str, first: str) -> list[str]:
        """Other activations a boundary's forward takes (``encoder_hidden_states``,
        ``key_value_states``): they meet colwise projections too, so they enter with ``copy_to``."""
        forward = self.facts.forward(name)
        params = forward_params(forward) if forward is not None else []
        return [p for p in params if p != first and (p.endswith("hidden_states") or p == "key_value_states")]
