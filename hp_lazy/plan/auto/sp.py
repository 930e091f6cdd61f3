"""The sp preset: sequence parallel over the tp group, applied to the tp preset's contracts.

Between boundaries the activations stay cut along the sequence (``S(1)``): each tp boundary
gathers its input (``x: S(1) -> R``) and reduce-scatters its output (``output: P(sum) -> S(1)``),
and the decoder layers' ``nn.ModuleList`` gets a container contract that cuts the sequence on the
way in, gathers it on the way out and sums the replicated norms' gradients over tp.

Experts split by expert over tp take every tp rank's rows: their inputs are gathered along the
rows and their output reduce-scattered back (:func:`_token_sharded`).

What cannot run on sequence-cut activations is refused, naming the entry: a per-Linear
gather/split inside a layer and 5.24's experts-TP.
"""

from __future__ import annotations

from hp_lazy.plan.auto.draft import Draft, Entry
from hp_lazy.plan.auto.rules import Rule

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
        rule = entry.rule
        if rule is None:
            continue
        if entry.kind in REFUSED:
            draft.fail(rule, REFUSED[entry.kind])
        if entry.kind == "leaf" and not rule.head:
            draft.fail(rule, "puts a per-Linear gather/split inside a layer, which sequence_parallel cannot wrap")
    for entry in list(draft.entries.values()):
        if entry.kind == "boundary":
            assert entry.rule is not None and entry.cls is not None
            x = draft.input_key(entry.rule, entry.cls)
            entry.body["in_src"][x] = {"tp": "S(1)"}
            entry.body["out_dst"]["output"] = {"tp": "S(1)"}
            _container(draft, entry.rule)
    stacks = [pattern for pattern, entry in draft.entries.items() if entry.kind == "container"]
    for pattern, entry in draft.entries.items():
        if entry.kind == "tp_experts" and any(pattern.startswith(stack + ".") for stack in stacks):
            _token_sharded(entry)  # experts outside any split stack (GPT-OSS: no boundary but them) stay tp's


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
