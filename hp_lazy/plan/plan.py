"""``Plan``: a whole plan, its constructors (JSON data, JSON text or a file, ``Plan.auto``), its
canonical JSON and hash, and its per-module slice.

This is the top of :mod:`hp_lazy.plan`: it imports the modules below it (``parse`` for
validation, ``slice`` for the per-module part) and none of them imports it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from hp_lazy.errors import PlanError
from hp_lazy.plan.fqn import compile_globs, is_glob, shown
from hp_lazy.plan.model import (
    AutoFlags,
    Contract,
    ModulePlan,
    canonical_json,
    sha256_json,
)
from hp_lazy.plan.parse import plan_fields
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
        """JSON text (starting with ``{``, a BOM allowed) or the path of a UTF-8 JSON file (:func:`read_json`)."""
        return cls(**plan_fields(read_json(path_or_text)))

    @classmethod
    def auto(
        cls, tp: int = 2, sequence_parallel: bool = False, loss_parallel: bool = False,
        vocab_parallel_embedding: bool = True, cp: int = 1, cp_mode: str = "allgather", ep: int = 1,
    ) -> Plan:
        """Contracts derived from transformers' own ``base_model_tp_plan`` (and the model classes'
        ``_tp_plan``) when each ``transformers.models.<x>.modeling_<x>`` is imported.

        ``loss_parallel``: keep the logits vocab-sharded and compute the loss from the shards.
        ``vocab_parallel_embedding=False``: keep ``embed_tokens`` replicated (one all-reduce less
        per forward, the embedding's memory on every rank); not possible when it is tied to a
        sharded lm_head.
        ``cp``: context-parallel degree (the sequence split over ``cp`` ranks; world = dp * cp * tp);
        every attention boundary gets the inner op of ``cp_mode`` (``"allgather"``: K/V all-gathered).
        ``ep``: expert-parallel degree, carved out of the ranks that hold different tokens (``ep``
        divides ``dp * cp``): each config's ``base_model_ep_plan`` names the experts modules, which
        get the ``ep_dispatch`` region, their expert weights cut ``S(0)`` on ``ep``.
        """
        flags: dict[str, Any] = {"tp": tp, "sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel,
                                 "vocab_parallel_embedding": vocab_parallel_embedding}
        if cp != 1 or cp_mode != "allgather":
            flags.update(cp=cp, cp_mode=cp_mode)
        if ep != 1:
            flags["ep"] = ep
        return cls.from_dict({"version": 1, "auto": flags})

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


# -- JSON text and files -------------------------------------------------------------------------
MAX_JSON_DEPTH = 16
"""The deepest nesting of JSON text read as a plan; a valid plan is 5 objects deep."""
MAX_PATH_SHOWN = 240
_BOM = "\ufeff"


def read_json(path_or_text: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in ``path_or_text``: JSON text (its first character after an optional BOM and
    whitespace is ``{`` or ``[``) or the path of a UTF-8 JSON file (a BOM allowed).

    Stricter than :mod:`json`: a key twice in one object, nesting deeper than :data:`MAX_JSON_DEPTH`,
    an integer past Python's digit limit and a top level that is not an object are each a ``PlanError``.
    """
    source = path_or_text.__fspath__() if isinstance(path_or_text, os.PathLike) else path_or_text
    if not isinstance(source, str):
        raise PlanError(
            f"plan: {shown(path_or_text)} (a {type(path_or_text).__name__}) is neither JSON text nor a path; "
            "pass a str or a Path"
        )
    text = source.removeprefix(_BOM)
    if text.lstrip()[:1] in ("{", "["):
        label = "plan text"
    else:
        label = f"plan file {shown(source, limit=MAX_PATH_SHOWN)}"
        text = _read_file(label, source)
    _check_depth(label, text)
    data = _loads(label, text)
    if not isinstance(data, dict):
        raise PlanError(
            f"{label}: the top level is a {type(data).__name__}; write a JSON object {{\"version\": 1, ...}}"
        )
    return data


def _read_file(label: str, path: str) -> str:
    """The text of the file at ``path`` (UTF-8; a leading BOM dropped)."""
    if "\0" in path:
        raise PlanError(f"{label}: cannot be read (a path holds no NUL character); pass JSON text or a file's path")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
        with open(fd, "rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            if not stat.S_ISREG(mode):
                raise PlanError(f"{label}: cannot be read (not a regular file); pass the path of a .json plan file")
            os.set_blocking(fd, True)
            data = handle.read()
    except OSError as exc:  # missing, a directory, no permission: only trying tells
        raise PlanError(
            f"{label}: cannot be read ({exc.strerror or exc}); pass JSON text, the path of an existing .json "
            "plan file, a dict, a Plan, or 'auto'"
        ) from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise PlanError(
            f"{label}: byte {data[exc.start]:#04x} at line {line} (offset {exc.start}) is not UTF-8 "
            f"({exc.reason}); save the file as UTF-8"
        ) from None


_JSON_SPECIAL = re.compile(r'[\[\]{}"\\]')


def _check_depth(label: str, text: str) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` before :mod:`json` recurses into it."""
    depth, in_string, escaped = 0, False, -1
    for match in _JSON_SPECIAL.finditer(text):
        at, char = match.start(), match.group()
        if at == escaped:
            continue
        if in_string:
            escaped = at + 1 if char == "\\" else escaped
            in_string = char != '"'
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise PlanError(
                    f"{label}: nesting deeper than {MAX_JSON_DEPTH} levels at {_line_col(text, at)}; a plan is 5 "
                    "objects deep (plan.boundaries[pattern].params[name][axis]); fix the file"
                )
        elif char in "]}":
            depth -= 1


def _line_col(text: str, at: int) -> str:
    return f"line {text.count(chr(10), 0, at) + 1} column {at - text.rfind(chr(10), 0, at)}"


def _loads(label: str, text: str) -> object:
    repeated: list[tuple[dict[str, Any], str]] = []  # (object, key); holds each object so its id stays its own

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in items:
            if key in obj:
                repeated.append((obj, key))
            obj[key] = value
        return obj

    def integer(digits: str) -> int:
        limit = sys.get_int_max_str_digits()
        if limit and len(digits.lstrip("-")) > limit:
            raise PlanError(
                f"{label}: the integer at {_line_col(text, text.find(digits))} has {len(digits.lstrip('-'))} "
                f"digits, more than Python reads ({limit}); fix the file"
            )
        return int(digits)

    try:
        data = json.loads(text, object_pairs_hook=pairs, parse_int=integer)
    except json.JSONDecodeError as exc:
        raise PlanError(
            f"{label}: invalid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); fix the file"
        ) from None
    if repeated:
        where, key = _first_repeated(data, repeated)
        raise PlanError(f"{where}: key {shown(key)} appears twice in one object (JSON would keep the last); keep one")
    return data


def _first_repeated(data: object, repeated: list[tuple[dict[str, Any], str]]) -> tuple[str, str]:
    """Where (``plan.boundaries['x'].params``) the first object with a repeated key sits, and the key."""
    keys = {id(obj): key for obj, key in reversed(repeated)}
    stack: list[tuple[str, object, str]] = [("plan", data, "fields")]
    while stack:
        where, value, kind = stack.pop()
        if isinstance(value, dict):
            if id(value) in keys:
                return where, keys[id(value)]
            for key, item in reversed(value.items()):
                step = f"{where}.{key}" if kind == "fields" else f"{where}[{shown(key)}]"
                stack.append((step, item, "fields" if kind == "contracts" else _CHILD_KIND.get((kind, key), "map")))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item, "map") for i, item in reversed(list(enumerate(value))))
    return "plan", repeated[0][1]  # not reached: the outermost object holding a repeated key is in the data


_CHILD_KIND = {("fields", "boundaries"): "contracts", ("fields", "auto"): "fields", ("fields", "inner"): "fields",
               ("fields", "region"): "fields"}
"""What the keys of a child object are: fixed ``fields`` (shown ``.key``) or names (shown ``['key']``)."""
