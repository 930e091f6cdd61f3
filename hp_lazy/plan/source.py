"""One parse and one class hierarchy per modeling source.

Slicing (:mod:`hp_lazy.plan.resolve`, :mod:`hp_lazy.plan.auto`) and lowering (:mod:`hp_lazy.lower`)
read the same ``ast.Module`` (:func:`parse_source`) and ask the same :class:`Hierarchy` which
classes of the module a class inherits from and whose ``forward`` it runs, so the class the plan
resolver picks for a pattern and the forward the lowerer rewrites can never disagree.

The tree is shared, so it is read-only: the lowerer copies the class and function nodes it
changes and leaves every node of this tree as parsed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

OTHER = "<other>."
"""Prefix of a class of another module in a linearisation (its own bases are unknown here)."""
NO_FORWARD_BASES = frozenset(
    {"object", "torch.nn.Module", "torch.nn.modules.module.Module", "transformers.modeling_utils.PreTrainedModel"}
)
"""Classes of other modules known to define no forward a subclass runs: the search for a
class's forward passes over them (any other class of another module ends it)."""


def parse_source(source: str, filename: str = "<unknown>") -> ast.Module:
    """The parsed tree of ``source`` (cached by text; do not mutate it). A ``SyntaxError``
    names ``filename``."""
    try:
        return _parsed(source)
    except SyntaxError as exc:
        exc.filename = filename
        raise


@lru_cache(maxsize=16)
def _parsed(source: str) -> ast.Module:
    return ast.parse(source)


def top_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, descending into ``if``/``try`` blocks but not into defs."""
    for node in body:
        yield node
        for attr in ("body", "orelse", "finalbody"):
            if isinstance(node, (ast.If, ast.Try)) and getattr(node, attr, None):
                yield from top_statements(getattr(node, attr))
        for handler in node.handlers if isinstance(node, ast.Try) else []:
            yield from top_statements(handler.body)


def dotted(node: ast.expr) -> str | None:
    """``nn.Linear`` -> ``"nn.Linear"``; None for anything but names and attributes."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def find_forward(cls: ast.ClassDef) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The last ``forward`` defined directly in the class body (the one Python keeps)."""
    found = None
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == "forward":
            found = stmt
    return found


@dataclass(frozen=True, slots=True)
class ClassDecl:
    """A class the module defines at module level."""

    name: str
    node: ast.ClassDef
    index: int | None
    """Its position in the module body; None when it is defined inside a top-level ``if``/``try``."""
    bases: tuple[str, ...]
    """Each base qualified through the module's imports (``"torch.nn.Module"``), a local class by
    its bare name, anything else (a call, a subscript) as its source text."""
    local_bases: tuple[str, ...]
    """The bases that are classes of this module defined above it (what Python finds there)."""


@dataclass(frozen=True, eq=False)
class Hierarchy:
    """The module's classes, their imports-qualified bases and their C3 linearisations."""

    module: str
    imports: Mapping[str, str]
    """Name bound by an import -> the dotted name it stands for (relative imports made absolute)."""
    decls: Mapping[str, ClassDecl]
    """The last definition of each class name (the one later statements see)."""
    _linearizations: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)

    def qualify(self, text: str) -> tuple[str, bool] | None:
        """``"nn.Linear"`` -> ``("torch.nn.Linear", False)``; a local class -> ``(name, True)``."""
        head, _, rest = text.partition(".")
        if head in self.decls and not rest:
            return head, True
        if head not in self.imports:
            return None
        full = self.imports[head] + ("." + rest if rest else "")
        local = full[len(self.module) + 1 :] if full.startswith(self.module + ".") else None
        if local is not None and local in self.decls:
            return local, True
        return full, False

    def linearization(self, name: str) -> tuple[str, ...]:
        """Python's C3 method resolution order of ``name``; a class of another module appears once,
        as ``OTHER + its qualified name``, with its own bases unknown (so it ends its branch)."""
        known = self._linearizations.get(name)
        if known is None:
            known = self._linearizations[name] = self._c3(name)
        return known

    def _c3(self, name: str) -> tuple[str, ...]:
        decl = self.decls.get(name)
        if decl is None:
            return (name,)
        own = [b if b in decl.local_bases else OTHER + b for b in decl.bases]
        seqs = [list(self.linearization(b)) if not b.startswith(OTHER) else [b] for b in own] + [own]
        out = [name]
        while any(seqs):
            seqs = [s for s in seqs if s]
            head = next((s[0] for s in seqs if all(s[0] not in t[1:] for t in seqs)), None)
            if head is None:
                return (name,)  # inconsistent MRO: Python would refuse the class anyway
            out.append(head)
            seqs = [s[1:] if s[0] == head else s for s in seqs]
        return tuple(out)

    def local_mro(self, name: str) -> list[str]:
        """The classes of this module in ``name``'s linearisation, in order."""
        return [c for c in self.linearization(name) if not c.startswith(OTHER)]

    def forward_owner(self, name: str) -> str | None:
        """The class of this module whose ``forward`` ``name`` runs: the first class of its
        linearisation defining one, passing over :data:`NO_FORWARD_BASES`; None when a class of
        another module comes first (or none defines one)."""
        for klass in self.linearization(name):
            if klass.startswith(OTHER):
                if klass[len(OTHER) :] in NO_FORWARD_BASES:
                    continue
                return None
            if find_forward(self.decls[klass].node) is not None:
                return klass
        return None


def absolute(module: str, level: int, name: str | None) -> str:
    """The absolute module a relative ``from`` import of ``module`` names."""
    parts = module.split(".")[:-1]
    base = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join([*base, *([name] if name else [])])


def imports(module: str, tree: ast.Module) -> dict[str, str]:
    names: dict[str, str] = {}
    for node in top_statements(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                head = alias.name.split(".")[0]
                names[alias.asname or head] = alias.name if alias.asname else head
        elif isinstance(node, ast.ImportFrom):
            source = absolute(module, node.level, node.module) if node.level else (node.module or "")
            for alias in node.names:
                if alias.name != "*":
                    names[alias.asname or alias.name] = f"{source}.{alias.name}"
    return names


def hierarchy(module: str, tree: ast.Module) -> Hierarchy:
    """The class hierarchy of ``tree``, the parsed source of module ``module``."""
    nodes = [n for n in top_statements(tree.body) if isinstance(n, ast.ClassDef)]
    positions = {id(n): i for i, n in enumerate(tree.body)}
    last = {n.name: n for n in nodes}
    decls: dict[str, ClassDecl] = {}
    result = Hierarchy(module=module, imports=imports(module, tree), decls=decls)
    for node in nodes:  # names first, so that bases qualify as local
        decls[node.name] = ClassDecl(node.name, node, None, (), ())
    for name, node in last.items():
        bases = []
        for base in node.bases:
            text = dotted(base)
            qualified = result.qualify(text) if text is not None else None
            bases.append(qualified[0] if qualified else (text if text is not None else ast.unparse(base)))
        above = tuple(b for b in bases if b in last and last[b].lineno < node.lineno)
        decls[name] = ClassDecl(name, node, positions.get(id(node)), tuple(bases), above)
    return result
