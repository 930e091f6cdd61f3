"""``Plan``: a whole plan, its constructors (JSON data, a JSON file, ``Plan.auto``), its canonical
JSON and hash, and its per-module slice.

This is the top of :mod:`hp_lazy.plan`: it imports the modules below it (``parse`` for
validation, ``slice`` for the per-module part) and none of them imports it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from hp_lazy.plan.fqn import compile_globs, is_glob
from hp_lazy.plan.model import (
    AutoFlags,
    Contract,
    ModulePlan,
    canonical_json,
    sha256_json,
)
from hp_lazy.plan.parse import plan_fields, read_json
from hp_lazy.plan.slice import slice_plan


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A validated, normalised plan. Build it with ``Plan.from_dict``/``from_json``/``auto``."""

    version: int = 1
    mesh: Mapping[str, int] = field(default_factory=dict)
    modules: tuple[str, ...] = ()
    """Module names or globs (:mod:`hp_lazy.plan.fqn`) whose import is lowered."""
    boundaries: tuple[Contract, ...] = ()
    boundary_classes: Mapping[str, str] = field(default_factory=dict)
    auto_flags: AutoFlags | None = None
    """Set by ``Plan.auto``: the contracts of each transformers module are derived from its
    config's TP plan when it is imported (JSON key ``"auto"``)."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Validate and normalise JSON data (DESIGN.md section 2); raises ``PlanError``."""
        return cls(**plan_fields(data))

    @classmethod
    def from_json(cls, path_or_text: str | os.PathLike[str]) -> Plan:
        """JSON text (starting with ``{``) or the path of a JSON file."""
        return cls(**plan_fields(read_json(path_or_text)))

    @classmethod
    def auto(
        cls, tp: int = 2, sequence_parallel: bool = False, loss_parallel: bool = False,
        vocab_parallel_embedding: bool = True,
    ) -> Plan:
        """Contracts derived from transformers' own ``base_model_tp_plan`` (and the model classes'
        ``_tp_plan``) when each ``transformers.models.<x>.modeling_<x>`` is imported.

        ``loss_parallel``: keep the logits vocab-sharded and compute the loss from the shards.
        ``vocab_parallel_embedding=False``: keep ``embed_tokens`` replicated (one all-reduce less
        per forward, the embedding's memory on every rank); not possible when it is tied to a
        sharded lm_head.
        """
        flags = {"tp": tp, "sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel,
                 "vocab_parallel_embedding": vocab_parallel_embedding}
        return cls.from_dict({"version": 1, "mesh": {"tp": tp}, "auto": flags})

    def to_dict(self) -> dict[str, Any]:
        """The normalised JSON data; ``Plan.from_dict(p.to_dict()) == p``."""
        out: dict[str, Any] = {
            "version": self.version,
            "mesh": dict(self.mesh),
            "modules": list(self.modules),
            "boundaries": {c.pattern: c.to_dict() for c in self.boundaries},
        }
        if self.boundary_classes:
            out["boundary_classes"] = dict(self.boundary_classes)
        if self.auto_flags is not None:
            out["auto"] = self.auto_flags.to_dict()
        return out

    def to_json(self, indent: int | None = None) -> str:
        """Canonical JSON (sorted keys, no whitespace) unless ``indent`` is given."""
        data = self.to_dict()
        return canonical_json(data) if indent is None else json.dumps(data, sort_keys=True, indent=indent)

    @cached_property
    def hash(self) -> str:
        """Hex sha256 of the canonical JSON of the normalised plan."""
        return sha256_json(self.to_dict())

    def targets(self, module_name: str) -> bool:
        """Whether importing ``module_name`` is lowered: a name check against ``modules``, no I/O."""
        globs = self._module_globs
        return module_name in self.modules or (globs is not None and globs.match(module_name) is not None)

    @cached_property
    def _module_globs(self) -> re.Pattern[str] | None:
        return compile_globs(m for m in self.modules if is_glob(m))

    def slice(self, module_name: str, source: str) -> ModulePlan | None:
        """The part of the plan that applies to one module's source; None if it targets nothing there."""
        return slice_plan(self, module_name, source)
