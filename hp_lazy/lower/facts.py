"""Read-only analysis of a modeling source, run before any rewrite.

:func:`forward_facts` reads one ``forward`` definition (its parameters, decorators and the shape
of every ``return``); :func:`module_facts` reads the module (docstring, ``from __future__``
imports, top-level classes and where each one's ``forward`` comes from). Neither mutates the tree.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from hp_lazy.errors import LoweringError
from hp_lazy.names import IMPL, RESERVED_PREFIXES
from hp_lazy.plan.source import Hierarchy, find_forward, hierarchy

ParamKind = Literal["positional_only", "positional", "keyword_only"]
ReturnKind = Literal["tuple", "value", "bare", "starred", "list"]


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    kind: ParamKind
    has_default: bool


@dataclass(frozen=True, slots=True)
class ReturnShape:
    """One ``return`` statement: ``tuple`` of ``arity`` elements, one ``value``, a ``bare``
    return (also used for falling off the end), a tuple with a ``starred`` element, or a ``list``."""

    kind: ReturnKind
    arity: int
    lineno: int


@dataclass(frozen=True, slots=True)
class ForwardFacts:
    """What the classifier and the emitter need to know about one ``forward``."""

    owner: str
    self_name: str
    params: tuple[Param, ...]
    """Named parameters after ``self``, in signature order (``*args``/``**kwargs`` excluded)."""
    vararg: str | None
    kwarg: str | None
    decorators: tuple[str, ...]
    returns: tuple[ReturnShape, ...]
    has_docstring: bool
    is_async: bool
    is_generator: bool
    lineno: int

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def output_layout(self) -> tuple[Literal["single", "tuple", "unknown"], int]:
        """``("single", 1)``: every return is one value; ``("tuple", n)``: every return is a tuple
        literal of at least ``n`` elements; ``("unknown", 0)`` otherwise."""
        kinds = {r.kind for r in self.returns}
        if kinds == {"value"}:
            return "single", 1
        if kinds == {"tuple"}:
            return "tuple", min(r.arity for r in self.returns)
        return "unknown", 0

    def every_return_has_value(self) -> bool:
        return bool(self.returns) and all(r.kind != "bare" for r in self.returns)


class _ReturnVisitor(ast.NodeVisitor):
    """Collects returns and yields of one function body; nested scopes are not entered."""

    def __init__(self) -> None:
        self.returns: list[ReturnShape] = []
        self.generator = False

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:  # nested scopes are not entered
        pass

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        pass

    def visit_Lambda(self, node: ast.Lambda) -> None:
        pass

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        pass

    def visit_Yield(self, node: ast.Yield) -> None:
        self.generator = True

    def visit_YieldFrom(self, node: ast.YieldFrom) -> None:
        self.generator = True

    def visit_Return(self, node: ast.Return) -> None:
        self.returns.append(_shape(node.value, node.lineno))
        if node.value is not None:
            self.visit(node.value)


def _shape(value: ast.expr | None, lineno: int) -> ReturnShape:
    if value is None:
        return ReturnShape("bare", 0, lineno)
    if isinstance(value, ast.Tuple):
        starred = any(isinstance(e, ast.Starred) for e in value.elts)
        return ReturnShape("starred" if starred else "tuple", len(value.elts), lineno)
    if isinstance(value, ast.List):
        return ReturnShape("list", len(value.elts), lineno)
    return ReturnShape("value", 1, lineno)


def _terminates(body: list[ast.stmt]) -> bool:
    """True when control cannot fall off the end of ``body`` (conservative)."""
    if not body:
        return False
    last = body[-1]
    if isinstance(last, (ast.Return, ast.Raise)):
        return True
    if isinstance(last, ast.If):
        return _terminates(last.body) and _terminates(last.orelse)
    if isinstance(last, (ast.With, ast.AsyncWith)):
        return _terminates(last.body)
    return False


def _params(args: ast.arguments) -> tuple[str, tuple[Param, ...]]:
    positional = [*args.posonlyargs, *args.args]
    if not positional:
        raise LoweringError("forward has no 'self' parameter; a boundary forward must be a method")
    n_defaults = len(args.defaults)
    first_default = len(positional) - n_defaults
    params = [
        Param(a.arg, "positional_only" if i < len(args.posonlyargs) else "positional", i >= first_default)
        for i, a in enumerate(positional)
    ]
    keyword_only = zip(args.kwonlyargs, args.kw_defaults, strict=True)
    params += [Param(a.arg, "keyword_only", d is not None) for a, d in keyword_only]
    return params[0].name, tuple(params[1:])


def forward_facts(node: ast.FunctionDef | ast.AsyncFunctionDef, owner: str = "") -> ForwardFacts:
    """Facts of one ``forward`` definition (``owner``: the class name, for error messages)."""
    visitor = _ReturnVisitor()
    for stmt in node.body:
        visitor.visit(stmt)
    returns = list(visitor.returns)
    if not _terminates(node.body):
        returns.append(ReturnShape("bare", 0, getattr(node, "end_lineno", node.lineno) or node.lineno))
    self_name, params = _params(node.args)
    return ForwardFacts(
        owner=owner,
        self_name=self_name,
        params=params,
        vararg=node.args.vararg.arg if node.args.vararg else None,
        kwarg=node.args.kwarg.arg if node.args.kwarg else None,
        decorators=tuple(ast.unparse(d) for d in node.decorator_list),
        returns=tuple(returns),
        has_docstring=ast.get_docstring(node, clean=False) is not None,
        is_async=isinstance(node, ast.AsyncFunctionDef),
        is_generator=visitor.generator,
        lineno=node.lineno,
    )


@dataclass(frozen=True, slots=True)
class ClassFacts:
    """A top-level class. ``forward_owner`` is the class of this module whose ``forward`` the
    class runs (itself, or a same-module base found before any other-module base in the MRO);
    ``None`` when the forward comes from another module. ``copy_blocker`` says why a base's
    forward cannot be copied into this class (zero-argument ``super()``, private names)."""

    name: str
    index: int
    lineno: int
    bases: tuple[str, ...]
    defines_forward: bool
    defines_impl: bool
    forward_owner: str | None
    copy_blocker: str | None


@dataclass(frozen=True, slots=True)
class ModuleFacts:
    module: str
    docstring: str | None
    future_imports: tuple[str, ...]
    insert_at: int
    """Index in the module body after the docstring and ``from __future__`` imports."""
    classes: tuple[ClassFacts, ...]
    hierarchy: Hierarchy
    """The module's classes and their linearisations, shared with the plan resolver."""

    def cls(self, name: str) -> ClassFacts | None:
        return next((c for c in self.classes if c.name == name), None)


def _defines(cls: ast.ClassDef, name: str) -> bool:
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            return True
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            return True
    return False


def _copy_blocker(cls: ast.ClassDef) -> str | None:
    """Why the ``forward`` of ``cls`` cannot be copied into a subclass (None: it can)."""
    fn = find_forward(cls)
    for node in ast.walk(fn) if fn is not None else ():
        if isinstance(node, ast.Name) and node.id in ("super", "__class__"):
            return f"it uses {node.id!r} (line {node.lineno})"
        if isinstance(node, ast.Attribute) and node.attr.startswith("__") and not node.attr.endswith("__"):
            return f"it uses the private name {node.attr!r} (line {node.lineno})"
    return None


def _class_facts(tree: ast.Module, module: str) -> tuple[Hierarchy, tuple[ClassFacts, ...]]:
    """The classes of the module body (a class defined under a top-level ``if``/``try`` is not
    rewritten), each with the owner of the forward it runs, read from the hierarchy the plan
    resolver reads too (:class:`hp_lazy.plan.source.Hierarchy`)."""
    shape = hierarchy(module, tree)
    out = []
    for name, decl in shape.decls.items():
        if decl.index is None:
            continue
        owner = shape.forward_owner(name)
        blocker = _copy_blocker(shape.decls[owner].node) if owner is not None and owner != name else None
        out.append(
            ClassFacts(
                name=name,
                index=decl.index,
                lineno=decl.node.lineno,
                bases=decl.bases,
                defines_forward=find_forward(decl.node) is not None,
                defines_impl=_defines(decl.node, IMPL),
                forward_owner=owner,
                copy_blocker=blocker,
            )
        )
    return shape, tuple(sorted(out, key=lambda c: c.index))


def _identifiers(tree: ast.AST) -> Iterator[tuple[str, int]]:
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            yield node.id, line
        elif isinstance(node, ast.Attribute):
            yield node.attr, line
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, line
        elif isinstance(node, ast.arg):
            yield node.arg, line
        elif isinstance(node, ast.alias):
            yield (node.asname or node.name.split(".")[0]), line
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg, line
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            yield from ((n, line) for n in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            yield node.name, line


def check_reserved(tree: ast.Module, module: str) -> None:
    """Raise :class:`LoweringError` on the first identifier that uses a reserved prefix."""
    hits = sorted((line, name) for name, line in _identifiers(tree) if name.startswith(RESERVED_PREFIXES))
    if hits:
        line, name = hits[0]
        raise LoweringError(
            f"{module}: line {line}: the name {name!r} starts with '_hp_' or '__hp_', prefixes reserved "
            "for the code hp_lazy generates; rename it in the source or remove the module from the plan"
        )


def module_facts(tree: ast.Module, module: str) -> ModuleFacts:
    """Facts of a parsed module; raises :class:`LoweringError` on reserved names."""
    check_reserved(tree, module)
    body = tree.body
    docstring = ast.get_docstring(tree, clean=False)
    at = 1 if docstring is not None else 0
    futures: list[str] = []
    while at < len(body) and isinstance(stmt := body[at], ast.ImportFrom) and stmt.module == "__future__":
        futures += [a.name for a in stmt.names]
        at += 1
    shape, classes = _class_facts(tree, module)
    return ModuleFacts(
        module=module,
        docstring=docstring,
        future_imports=tuple(futures),
        insert_at=at,
        classes=classes,
        hierarchy=shape,
    )
