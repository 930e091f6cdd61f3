"""The sp preset: sequence parallel over the tp group, applied to the tp preset's contracts.

Between boundaries the activations stay cut along the sequence (``S(1)``): each tp boundary
gathers its input (``x: S(1) -> R``) and reduce-scatters its output (``output: P(sum) -> S(1)``),
and the decoder layers' ``nn.ModuleList`` gets a container contract that cuts the sequence on the
way in, gathers it on the way out and sums the replicated norms' gradients over tp.

Experts split by expert over tp take every tp rank's rows: their inputs are gathered along the
rows and their output reduce-scattered back (:func:`_token_sharded`). Experts split over ep take
each tp rank's own rows and dispatch them over the ep group (:func:`_own_rows`).

A per-Linear gather or split inside a layer (``colwise_gather_output`` / ``rowwise_split_input``:
Phi-3's fused ``qkv_proj``, Qwen3.5's and Qwen3-Next's Gated DeltaNet projections) needs every
feature of every token, so the module holding it (or the token mixer around that module: an attention
module, a block holding a ``Conv1d``, :func:`_mixer_around`) runs on the whole sequence, as it does
under tp alone (:func:`_whole_sequence`): its input is all-gathered along the sequence (``x: S(1) -> R``, a
contract that shards nothing), its leaves keep their tp contracts, and its output is cut back to
this rank's piece (``output: R -> S(1)``). Where its forward returns one leaf's output as it is,
that leaf hands over this rank's piece itself: a reduce-scatter instead of an all-reduce for a
rowwise leaf, an all-to-all instead of an all-gather for a colwise one. Leaves outside the layer
stack (a vision tower's patch embedding, a projector, the head) see whole values and keep tp's
contracts.

What cannot run on sequence-cut activations is refused, naming the entry: 5.24's experts-TP, and a
leaf whose enclosing module is itself a boundary slot or not one class.
"""

from __future__ import annotations

import ast

from hp_lazy.errors import PlanError
from hp_lazy.plan.auto.draft import Draft, Entry
from hp_lazy.plan.auto.rules import Rule
from hp_lazy.plan.resolve import forward_params, resolve_pattern

CONTAINER_BODY = {
    "in_src": {"input": {"tp": "R"}}, "in_dst": {"input": {"tp": "S(1)"}},
    "out_src": {"output": {"tp": "S(1)"}}, "out_dst": {"output": {"tp": "R"}},
    "grad_sum_params": ["*"],
}
REFUSED = {
    "experts_tp": "is not supported together with sequence_parallel yet",
}


def apply(draft: Draft) -> None:
    for entry in list(draft.entries.values()):
        if entry.rule is not None and entry.kind in REFUSED:
            draft.fail(entry.rule, REFUSED[entry.kind])
    regions = _whole_sequence(draft)
    for pattern, entry in list(draft.entries.items()):
        if entry.kind == "boundary" and entry.rule is not None and _in_layers(entry.rule) \
                and not _inside(pattern, regions):
            assert entry.cls is not None
            x = draft.input_key(entry.rule, entry.cls)
            entry.body["in_src"][x] = {"tp": "S(1)"}
            entry.body["out_dst"]["output"] = {"tp": "S(1)"}
            _container(draft, entry.rule)
    stacks = [pattern for pattern, entry in draft.entries.items() if entry.kind == "container"]
    _cp_attention_whole(draft, stacks, regions)
    for pattern, entry in draft.entries.items():
        if entry.kind == "tp_experts" and _inside(pattern, stacks) and not _inside(pattern, regions):
            _token_sharded(entry)  # experts outside any split stack (GPT-OSS: no boundary but them) stay tp's
        elif entry.kind == "experts" and _inside(pattern, stacks) and not _inside(pattern, regions):
            _own_rows(draft, entry)


def _cp_attention_whole(draft: Draft, stacks: list[str], regions: list[str]) -> None:
    """An attention module in the layers that the TP plan leaves out carries cp's op alone (the cp
    preset's contract, :mod:`.cp`). Under sequence parallel it must see this cp rank's rows, not the
    tp piece: its contract gathers them over tp on the way in and cuts its output back (as
    :mod:`hp_lazy.runtime.sp.mixers` does for an attention module no contract names). Refused where
    its class's first input cannot be read."""
    for pattern, entry in list(draft.entries.items()):
        if entry.kind != "attention" or set(entry.body) != {"inner"} or not _inside(pattern, stacks) \
                or _inside(pattern, regions):
            continue
        cls = draft.classes.get(pattern)
        forward = draft.facts.forward(cls) if cls is not None else None
        params = forward_params(forward) if forward is not None else []
        if not params:
            raise PlanError(f"{draft.facts.module}: {pattern!r} ({cls}) is an attention module context parallel "
                            "splits, which sequence_parallel must run on this cp rank's rows gathered over tp, but its "
                            "forward's first input cannot be read; train it without sequence_parallel")
        entry.body = {**_whole_body(params[0], "R"), "inner": entry.body["inner"]}


def _own_rows(draft: Draft, entry: Entry) -> None:
    """Experts split over ep inside a sequence-split stack: each tp rank holds other tokens and
    dispatches its own rows over its ep group (``S(0)`` on tp in and out: nothing moves over tp).
    Experts also cut on tp (5.24's ``moe_tp_experts`` under ep) need every tp rank's rows: refused."""
    cut = sorted(name for name, axes in entry.body.get("params", {}).items() if "tp" in axes)
    if cut and entry.rule is not None:
        draft.fail(entry.rule, f"cuts the experts {cut} on tp as well as on ep (5.24-style experts-TP), whose "
                   "slices need every tp rank's tokens, which sequence_parallel cuts; this is not supported together "
                   "with sequence_parallel yet")
    for side in ("in_src", "in_dst"):
        for x in entry.body[side]:
            entry.body[side][x] = {"tp": "S(0)"}
    entry.body["out_src"]["output"] = entry.body["out_dst"]["output"] = {"tp": "S(0)"}


def _inside(pattern: str, outer: list[str]) -> bool:
    return any(pattern.startswith(o + ".") for o in outer)


def _whole_sequence(draft: Draft) -> list[str]:
    """The modules inside the layers that hold per-Linear leaves, each run on the whole sequence
    (module docstring): pattern -> a contract that gathers its input along the sequence and cuts
    its output back, shards nothing, and lets the leaf its forward returns as it is leave as
    this rank's piece. Their patterns, for the presets after."""
    held: dict[str, list[tuple[str, Entry]]] = {}
    for pattern, entry in draft.entries.items():
        rule = entry.rule
        if entry.kind == "leaf" and rule is not None and not rule.head and _in_layers(rule):
            parent = rule.key.rpartition(".")[0]
            if parent.rpartition(".")[2] in ("*", "") or parent.rpartition(".")[2].isdigit():
                draft.fail(rule, "puts a per-Linear gather/split straight under a layer, which sequence_parallel "
                           "would have to run whole; plan the layer's projections as colwise -> rowwise pairs")
            held.setdefault(_mixer_around(draft, rule, parent) or rule.prefix + parent, []).append((pattern, entry))
    for region, leaves in held.items():
        rule = leaves[0][1].rule
        assert rule is not None
        parent = region[len(rule.prefix):]
        known = draft.entries.get(region)
        inner = None
        if known is not None and known.kind == "attention" and set(known.body) == {"inner"}:
            inner = draft.entries.pop(region).body["inner"]  # cp's op alone: the whole-sequence contract carries it
        elif known is not None:
            draft.fail(rule, f"sits in {parent!r}, which sequence_parallel would run on the whole sequence, but "
                       f"{parent!r} is also a tp boundary ({draft.entries[region].owner}) in some layers; a slot runs "
                       "either split or whole: plan the leaves' module as a colwise -> rowwise pair")
        names = draft.facts.resolve(rule.base, parent)
        if len(names) != 1:
            draft.fail(rule, f"sits in {parent!r}, which sequence_parallel runs on the whole sequence as one module "
                       f"class, but the slot holds {sorted(names) or 'no class'} statically")
        cls = next(iter(names))
        if any(found - {cls} for found in resolve_pattern(draft.facts, region).values()):
            draft.classes[region] = cls  # a vision tower's layers.*.self_attn is another class
        x = draft.input_key(rule, cls)
        returned = _returned_child(draft, cls)
        out = "R"
        for _, entry in leaves:
            if entry.rule is not None and entry.rule.key.rpartition(".")[2] == returned:
                entry.body["out_dst"]["output"] = {"tp": "S(1)"}
                out = "S(1)"
        body = _whole_body(x, out)
        for index in range(1, 0 if draft.calls_attention(cls) else _returned_count(draft, cls)):
            body["out_src"][f"output.{index}"] = {"tp": "R"}  # each value it returns, this rank's piece
            body["out_dst"][f"output.{index}"] = {"tp": "S(1)"}
        if inner is not None:  # an attention module under cp: its attention runs cp's op on the cp rows
            body["inner"] = inner
        draft.add(region, Entry(body, rule.owner, "whole_sequence", rule, cls))
        _container(draft, rule)
    return list(held)


CONV1D = "torch.nn.Conv1d"


def _mixer_around(draft: Draft, rule: Rule, parent: str) -> str | None:
    """The outermost module below the layer, from the leaves' module up, that mixes tokens along the
    sequence: it calls transformers' attention, or its class holds an ``nn.Conv1d``. Qwen4-Exp's
    indexer projection sits in its attention, and its n-gram embedding table in a block whose dilated
    convolution and n-gram shifts run along the sequence: that module is the region run on the whole
    sequence, and nothing inside it gathers the sequence again (the leaves' own module alone would
    leave the mixing on this rank's piece, refused at bind). Under cp the attention module carries
    cp's op alone, which the region's contract takes over."""
    segments = parent.split(".")
    below = next((i for i, s in enumerate(segments) if s == "*" or s.isdigit()), None)
    if below is None:
        return None
    for end in range(below + 2, len(segments) + 1):
        names = draft.facts.resolve(rule.base, ".".join(segments[:end]))
        cls = next(iter(names)) if len(names) == 1 else ""
        if cls in draft.facts.classes and (draft.calls_attention(cls) or any(
                r.name == CONV1D for refs in draft.facts.children(cls).values() for r in refs)):
            return rule.prefix + ".".join(segments[:end])
    return None


def _returned_count(draft: Draft, cls: str) -> int:
    """How many values the forward of ``cls`` returns in its last statement (a tuple literal), 1
    otherwise. A module run on the whole sequence that is not an attention module returns values
    along the sequence in every position (Qwen4-Exp's hyper-connection blocks: the mixed input, the
    streams and their injection weights): each is cut back to this rank's piece. An attention
    module's second value is its attention weights, left as they are."""
    forward = draft.facts.forward(cls)
    last = forward.body[-1] if forward is not None and forward.body else None
    if isinstance(last, ast.Return) and isinstance(last.value, ast.Tuple):
        return len(last.value.elts)
    return 1


def _whole_body(x: str, out: str) -> dict:
    """A module run on the whole sequence: ``x`` gathered along it on tp, shards nothing, leaves as
    this rank's piece (``out``: what its forward returns on tp, whole or already the piece)."""
    return {"in_src": {x: {"tp": "S(1)"}}, "in_dst": {x: {"tp": "R"}},
            "out_src": {"output": {"tp": out}}, "out_dst": {"output": {"tp": "S(1)"}}}


def _in_layers(rule: Rule) -> bool:
    return any(s == "*" or s.isdigit() for s in rule.key.split("."))


def _returned_child(draft: Draft, cls: str) -> str | None:
    """The child whose output ``cls``'s forward returns as it is (alone, or first of a tuple):
    ``x = self.o_proj(x); return x, w`` or ``return self.o_proj(x), w``. Read from the forward's
    top-level statements: the returned name's last binding must be that call, the forward's only
    call of that child (each call's output leaves as the piece)."""
    forward = draft.facts.forward(cls)
    if forward is None or not forward.body or not isinstance(forward.body[-1], ast.Return):
        return None
    value = forward.body[-1].value
    first = value.elts[0] if isinstance(value, ast.Tuple) and value.elts else value
    if isinstance(first, ast.Name):
        bound = [s for s in forward.body[:-1] if _binds(s, first.id)]
        last = bound[-1] if bound else None
        plain = isinstance(last, ast.Assign) and len(last.targets) == 1 and isinstance(last.targets[0], ast.Name)
        first = last.value if plain and isinstance(last, ast.Assign) else None
    child = _self_call(first) if isinstance(first, ast.expr) else None
    if child is None or sum(_self_call(n) == child for n in ast.walk(forward)) != 1:
        return None
    return child


def _self_call(node: ast.AST) -> str | None:
    """``child`` for a call ``self.child(...)``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
        return node.func.attr
    return None


def _binds(statement: ast.stmt, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in ast.walk(statement))


def _token_sharded(entry: Entry) -> None:
    """Experts split by expert over tp, with each tp rank holding other tokens: the experts module
    takes its rows flattened (``[T, H]``, ``T = B * S / tp``) with their top-k ids and weights; every
    input is gathered along the rows (``S(0) -> R``), each rank runs its experts on every row, and
    the partial sums are reduce-scattered back to the rows each rank holds (``P(sum) -> S(0)``). Rows
    are independent there, so their order after the gather (rank-major) does not matter."""
    for x in entry.body["in_src"]:
        entry.body["in_src"][x] = {"tp": "S(0)"}
    entry.body["out_dst"]["output"] = {"tp": "S(0)"}


def _container(draft: Draft, rule: Rule) -> None:
    segments = rule.key.split(".")
    star = next((i for i, s in enumerate(segments) if s == "*" or s.isdigit()), None)
    container = ".".join(segments[:star]) if star else ""
    if not container or draft.facts.resolve(rule.base, container) != {"torch.nn.ModuleList"}:
        draft.fail(rule, f"makes {rule.pattern!r} a boundary outside an nn.ModuleList of layers, "
                   "which sequence_parallel needs")
    draft.add(rule.prefix + container, Entry(CONTAINER_BODY, "sequence_parallel", "container"))
