"""The cp preset: context parallel's inner op on every attention module.

Every module whose forward dispatches through transformers' attention interface gets the op of
``cp_mode`` (``{"call": "attention", "kind": ...}``): on the tp preset's boundaries where they are
attention modules, and as a contract of the op alone where the TP plan makes no boundary of them
(fused ``qkv_proj`` planned as leaves, a plan naming only the embedding, or tp=1). The TP and EP
plans only locate the attention modules here: the parents of their keys and the children of the
decoder layers (``layers.*.<child>``); a family with an ep plan and no TP plan (Ergo) is located by
the ep plan's keys alone. Context parallel places nothing on the mesh: the sequence is cut
at the model's entry (:mod:`hp_lazy.runtime.cp`).
"""

from __future__ import annotations

from hp_lazy.plan.auto.draft import Draft, Entry
from hp_lazy.plan.auto.rules import Rule
from hp_lazy.plan.model import CP_MODES


def apply(draft: Draft, rules: list[Rule]) -> None:
    inner = {"call": "attention", "kind": CP_MODES[draft.flags.cp_mode]}
    for entry in draft.entries.values():
        if entry.kind == "boundary" and draft.calls_attention(entry.cls):
            entry.body["inner"] = dict(inner)
    found: set[tuple[str, str, str]] = set()
    for rule in rules:
        parent = rule.key.rpartition(".")[0]
        if parent and not rule.head:
            found.add((rule.base, rule.prefix, parent))
        for layer in sorted(draft.facts.resolve(rule.base, "layers.*")) if not rule.head else ():
            if layer in draft.facts.classes:
                found.update((rule.base, rule.prefix, f"layers.*.{child}") for child in draft.facts.children(layer))
    for base, prefix, key in sorted(found):
        # the attention class of the slot: a hybrid's slot holds a recurrent mixer in some layers
        # (chosen at run time from a table or a conditional), which cp splits at bind (runtime/cp/recurrent)
        attending = sorted(n for n in draft.facts.resolve(base, key) if draft.calls_attention(n))
        if prefix + key not in draft.entries and len(attending) == 1:
            draft.add(prefix + key, Entry({"inner": dict(inner)}, f"{base} (cp attention)", "attention"))
            # the class the text stack's key reaches: a vision tower's layers.*.self_attn is another class
            draft.classes[prefix + key] = attending[0]
