"""The contracts ``Plan.auto`` is building for one modeling module, and what every preset asks of
the module's source (which class a key reaches, a class's inputs, whether it calls attention)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Literal, NoReturn

from hp_lazy.errors import PlanError
from hp_lazy.plan.auto.rules import FIX, Rule
from hp_lazy.plan.model import AutoFlags, Contract
from hp_lazy.plan.parse import contract_from_dict
from hp_lazy.plan.resolve import ModuleFacts, forward_params

LINEAR = "torch.nn.Linear"
EMBEDDING = "torch.nn.Embedding"
Kind = Literal["boundary", "leaf", "embedding", "experts_tp", "tp_experts", "experts", "attention", "container",
               "whole_sequence"]
"""What made an entry: a tp boundary around a colwise -> rowwise pair, a per-Linear leaf, a
vocab-parallel embedding, 5.24's experts-TP, experts split by expert over tp, experts under ep,
a cp op alone on an attention module, a sequence-parallel container, a module holding leaves
that sequence parallel runs on the whole sequence."""


@dataclass
class Entry:
    """One contract being built: its JSON body, who asked for it (for messages), and, where a
    later preset needs them, the rule it came from and the class it lands on."""

    body: dict
    owner: str
    kind: Kind
    rule: Rule | None = None
    cls: str | None = None


class Draft:
    """Pattern -> :class:`Entry` for one module, filled by the presets in turn."""

    def __init__(self, facts: ModuleFacts, flags: AutoFlags) -> None:
        self.facts = facts
        self.flags = flags
        self.mesh = flags.mesh
        self.entries: dict[str, Entry] = {}
        self.classes: dict[str, str] = {}
        """Pattern -> class, where the pattern's slot holds several classes (a layer's ``mlp`` that
        is a dense MLP in some layers and an MoE block in others)."""

    def fail(self, rule: Rule, why: str) -> NoReturn:
        raise PlanError(f"{self.facts.module}: {rule.owner}[{rule.key!r}] = {rule.style!r} {why}; {FIX}")

    def add(self, pattern: str, entry: Entry) -> None:
        """Add a contract; a pattern asked for twice must get the same body both times."""
        known = self.entries.setdefault(pattern, entry)
        if known.body != entry.body:
            raise PlanError(
                f"{self.facts.module}: {known.owner} and {entry.owner} give {pattern!r} different contracts "
                f"({known.body!r} vs {entry.body!r}); {FIX}"
            )

    def contracts(self) -> tuple[Contract, ...]:
        return tuple(contract_from_dict(p, e.body, self.mesh) for p, e in sorted(self.entries.items()))

    # -- the source, as the presets ask it
    def class_of(self, rule: Rule, key: str) -> str:
        names = self.facts.resolve(rule.base, key)
        if len(names) != 1:
            found = f"classes {sorted(names)}" if names else "no class"
            self.fail(rule, f"needs {key!r} of {rule.base} to be one module class, found {found} statically")
        return next(iter(names))

    def is_linear(self, name: str) -> bool:
        return name == LINEAR or (name in self.facts.classes and LINEAR in self.facts.external_bases(name))

    def is_embedding(self, name: str | None) -> bool | None:
        """True for nn.Embedding, False for a local subclass of it (bound at run time as a leaf
        rather than rewritten), None for anything else."""
        if name == EMBEDDING:
            return True
        if name is not None and name in self.facts.classes and EMBEDDING in self.facts.external_bases(name):
            return False
        return None

    def input_key(self, rule: Rule, name: str) -> str:
        """The name of the first input of class ``name`` (``"input"`` for torch's modules)."""
        if name not in self.facts.classes:
            return "input"
        forward = self.facts.forward(name)
        params = forward_params(forward) if forward is not None else []
        if not params:
            self.fail(rule, f"needs the input of class {name!r}, but no forward with a named first parameter "
                      "is defined in the module (or its same-module bases)")
        return params[0]

    def inputs(self, rule: Rule, name: str) -> list[str]:
        """Every named input of the experts class ``name``."""
        forward = self.facts.forward(name)
        inputs = forward_params(forward) if forward is not None else []
        if not inputs:
            self.fail(rule, f"needs the forward parameters of the experts class {name!r}")
        return inputs

    def calls_attention(self, name: str | None) -> bool:
        """Its forward dispatches through transformers' attention interface (context parallel's call site)."""
        forward = self.facts.forward(name) if name is not None else None
        return forward is not None and any(
            isinstance(node, ast.Name) and node.id == "ALL_ATTENTION_FUNCTIONS" for node in ast.walk(forward)
        )

    # -- what every plan must satisfy
    def check_nesting(self) -> None:
        patterns = sorted(self.entries)
        for outer in patterns:
            if self.entries[outer].kind == "attention":
                continue  # an op-only contract (cp attention) changes no placement inside it
            for inner in patterns:
                if inner.startswith(outer + ".") and self._contains(outer, inner[len(outer) + 1 :]):
                    raise PlanError(
                        f"{self.facts.module}: contract {inner!r} ({self.entries[inner].owner}) lies inside contract "
                        f"{outer!r} ({self.entries[outer].owner}); Plan.auto does not nest tensor-parallel "
                        f"boundaries; {FIX}"
                    )

    def _contains(self, outer: str, rest: str) -> bool:
        """Whether the class chosen for ``outer`` (when its slot holds several) reaches ``rest``."""
        chosen = self.classes.get(outer)
        return chosen is None or bool(self.facts.resolve(chosen, rest))
