"""Static FQN -> class resolution from a module's source: pure ``ast``, the module is never imported.

Per class, :func:`analyze` collects what ``__init__`` assigns to ``self.<attr>``: a class call
(``self.self_attn = LlamaAttention(config)``), a ``nn.ModuleList`` of class calls (a list literal, a
list comprehension or a generator, a local list or the attribute itself filled by ``.append`` in a
loop), or an ``nn.Parameter``. The class called may be chosen at run time from a static set: a
local alias (``ffn_class = SparseMoeBlock if n > 1 else MLP``) or an entry of a literal table
(``MIXER_TYPES[kind](config)``, module-level or local); every class of the set is a candidate.
Attributes of bases defined in the same module are inherited. Names are qualified through the
module's imports (``from torch import nn`` -> ``nn.Linear`` is ``"torch.nn.Linear"``; relative
imports become absolute against the module's package).

A pattern such as ``"model.layers.*.self_attn"`` is then walked from a start class, one segment per
attribute, with the globs of :mod:`hp_lazy.plan.fqn`: a segment matches attribute names, or, on a
``ModuleList``, the element positions (``"0"``, ``"*"``, ``"[0-3]"``); a ``"**"`` segment takes one
or more such steps.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from hp_lazy.errors import PlanError
from hp_lazy.plan.fqn import is_glob, matches
from hp_lazy.plan.source import NO_FORWARD_BASES, Hierarchy, dotted, hierarchy, parse_source, top_statements

MODULE_LISTS = frozenset({"torch.nn.ModuleList", "torch.nn.modules.container.ModuleList"})
PARAMETERS = frozenset({"torch.nn.Parameter", "torch.nn.parameter.Parameter"})
FACTORIES = frozenset({"_from_config", "from_config"})
PRETRAINED = "transformers.modeling_utils.PreTrainedModel"
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
INDEX_PROBE = 1024
"""A ModuleList built by a comprehension has no static length: a segment steps into it when it
matches one of the positions below this."""


@dataclass(frozen=True)
class Ref:
    """A statically known child module: a class (bare name if local, dotted if imported), or a
    ModuleList whose ``elements`` are the groups of classes each position may hold."""

    name: str
    local: bool
    elements: tuple[tuple[Ref, ...], ...] | None = None
    literal: bool = False
    """For a ModuleList: ``elements`` are positions of a list literal (else one group for all)."""


@dataclass(frozen=True, eq=False)
class ClassFacts:
    name: str
    lineno: int
    bases: tuple[str, ...]
    """Bare names of local bases, dotted names of imported ones, raw text of anything else."""
    children: Mapping[str, tuple[Ref, ...]]
    params: tuple[str, ...]
    forward: FunctionNode | None
    constants: Mapping[str, object]
    """Class-level literals: ``base_model_prefix``, ``_tp_plan``, and ``config`` (annotation text)."""
    conditional: frozenset[str] = frozenset()
    """Children ``__init__`` may leave out by configuration: assigned under an ``if`` or from a
    conditional expression with a ``None`` branch (MLA's ``q_proj`` / ``q_a_proj``)."""
    assigned: frozenset[str] = frozenset()
    """Every ``self.<attr>`` ``__init__`` assigns, whatever the value (``"*"``: it also calls
    ``setattr`` or ``add_module``, so any name may be set)."""
    ranks: Mapping[str, int] = field(default_factory=dict)
    """Parameters whose number of dims the source states: ``nn.Parameter(torch.zeros(heads))`` is 1,
    ``nn.Parameter(torch.empty((e, n, m)))`` is 3 (:func:`_rank`)."""


@dataclass(frozen=True, eq=False)
class ModuleFacts:
    module: str
    hierarchy: Hierarchy
    """The module's classes and their linearisations, shared with the lowerer."""
    classes: Mapping[str, ClassFacts] = field(default_factory=dict)
    tables: Mapping[str, tuple[ast.expr, ...]] = field(default_factory=dict)
    """Module-level names bound to a dict, list or tuple literal: its values (``MIXER_TYPES =
    {"mamba": NemotronHMamba2Mixer, ...}``), so ``MIXER_TYPES[kind](config)`` builds one of them."""

    @property
    def imports(self) -> Mapping[str, str]:
        return self.hierarchy.imports

    def qualify(self, dotted: str) -> tuple[str, bool] | None:
        """``"nn.Linear"`` -> ``("torch.nn.Linear", False)``; a local class -> ``(name, True)``."""
        return self.hierarchy.qualify(dotted)

    def mro(self, name: str) -> list[str]:
        """The class and its local bases in Python's method resolution order."""
        return self.hierarchy.local_mro(name) if name in self.classes else []

    def external_bases(self, name: str) -> set[str]:
        return {b for c in self.mro(name) for b in self.classes[c].bases if b not in self.classes}

    def children(self, name: str) -> dict[str, tuple[Ref, ...]]:
        merged: dict[str, tuple[Ref, ...]] = {}
        for cls in reversed(self.mro(name)):
            merged.update(self.classes[cls].children)
        return merged

    def conditional(self, name: str) -> set[str]:
        """Children of ``name`` (or a local base) that its ``__init__`` may leave out by configuration."""
        return {c for cls in self.mro(name) for c in self.classes[cls].conditional}

    def params(self, name: str) -> set[str]:
        return {p for cls in self.mro(name) for p in self.classes[cls].params}

    def assigns(self, name: str, attr: str) -> bool:
        """Whether ``__init__`` of ``name`` or of a local base may set ``self.<attr>``."""
        return any({attr, "*"} & self.classes[cls].assigned for cls in self.mro(name))

    def param_rank(self, name: str, param: str) -> int | None:
        """The number of dims of parameter ``param`` of class ``name`` where its source states it."""
        for cls in self.mro(name):
            if param in self.classes[cls].params:
                return self.classes[cls].ranks.get(param)
        return None

    def constant(self, name: str, key: str) -> object:
        """A class-level literal, looked up through local bases (None if absent)."""
        for cls in self.mro(name):
            if key in self.classes[cls].constants:
                return self.classes[cls].constants[key]
        return None

    def forward(self, name: str) -> FunctionNode | None:
        """The ``forward`` the class runs, when a class of this module defines it
        (:meth:`~hp_lazy.plan.source.Hierarchy.forward_owner`, as the lowerer reads it)."""
        owner = self.hierarchy.forward_owner(name) if name in self.classes else None
        return None if owner is None else self.classes[owner].forward

    def has_forward(self, name: str) -> bool:
        """Own or inherited forward; an imported base other than ``nn.Module`` is taken to have one."""
        return self.forward(name) is not None or bool(self.external_bases(name) - NO_FORWARD_BASES)

    def is_pretrained(self, name: str) -> bool:
        return PRETRAINED in self.external_bases(name)

    def pretrained_roots(self) -> list[str]:
        """Local classes whose own bases name transformers' ``PreTrainedModel``."""
        return [c.name for c in self.classes.values() if PRETRAINED in c.bases]

    def resolve(self, start: str, pattern: str) -> set[str]:
        """Class names ``pattern`` reaches from local class ``start`` (empty: no static match)."""
        refs = {Ref(start, True)}
        for segment in pattern.split("."):
            refs = self._steps(refs, segment)
            if not refs:
                return set()
        return {ref.name for ref in refs}

    def _steps(self, refs: set[Ref], segment: str) -> set[Ref]:
        if segment != "**":
            return {child for ref in refs for child in self._step(ref, segment)}
        found: set[Ref] = set()
        frontier = refs
        while frontier:  # one or more segments, each matching anything
            frontier = {child for ref in frontier for child in self._step(ref, "*")} - found
            found |= frontier
        return found

    def _step(self, ref: Ref, segment: str) -> Iterator[Ref]:
        if ref.elements is not None:
            yield from _elements(ref, segment)
            return
        if not ref.local:
            return
        for attr, refs in self.children(ref.name).items():
            if matches(segment, attr):
                yield from refs


def _elements(ref: Ref, segment: str) -> Iterator[Ref]:
    """The element classes of a ModuleList at the positions ``segment`` matches."""
    if ref.literal:
        for index, group in enumerate(ref.elements or ()):
            if matches(segment, str(index)):
                yield from group
    elif ref.elements and _matches_an_index(segment):
        yield from ref.elements[0]


@lru_cache(maxsize=256)
def _matches_an_index(segment: str) -> bool:
    if not is_glob(segment):
        return segment.isdigit()
    return any(matches(segment, str(index)) for index in range(INDEX_PROBE))


def _tables(tree: ast.Module) -> dict[str, tuple[ast.expr, ...]]:
    out: dict[str, tuple[ast.expr, ...]] = {}
    for node in top_statements(tree.body):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            values = _literal_values(node.value)
            if values is not None:
                out[node.targets[0].id] = values
    return out


def _literal_values(node: ast.expr) -> tuple[ast.expr, ...] | None:
    if isinstance(node, ast.Dict):
        return tuple(node.values)
    if isinstance(node, (ast.List, ast.Tuple)):
        return tuple(node.elts)
    return None


class _ClassScanner:
    """Reads one class body: ``__init__`` assignments, ``forward``, class-level literals."""

    def __init__(self, facts: ModuleFacts, node: ast.ClassDef) -> None:
        self.facts = facts
        self.node = node
        self.children: dict[str, tuple[Ref, ...]] = {}
        self.params: list[str] = []
        self.ranks: dict[str, int] = {}
        self.assigned: set[str] = set()
        self.conditional: set[str] = set()
        self.bound: dict[str, list[ast.expr]] = {}
        """``__init__``'s local names -> every value assigned to them (``layer_class = X if c else Y``)."""
        self.appended: dict[str, list[ast.expr]] = {}
        """A local list or ``self.<attr>`` -> the values ``.append`` adds (a ModuleList built in a loop)."""

    def scan(self) -> ClassFacts:
        methods = {n.name: n for n in self.node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if "__init__" in methods:
            self._scan_init(methods["__init__"])
        return ClassFacts(
            name=self.node.name,
            lineno=self.node.lineno,
            bases=self.facts.hierarchy.decls[self.node.name].bases,
            children=self.children,
            params=tuple(self.params),
            forward=methods.get("forward"),
            constants=self._constants(),
            conditional=frozenset(self.conditional),
            assigned=frozenset(self.assigned),
            ranks=self.ranks,
        )

    def _constants(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for node in self.node.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                try:
                    out[node.targets[0].id] = ast.literal_eval(node.value)
                except (ValueError, TypeError, SyntaxError, RecursionError):
                    out[node.targets[0].id] = dotted(node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "config":
                out["config"] = dotted(node.annotation)
        return out

    def _scan_init(self, init: FunctionNode) -> None:
        if not init.args.args:
            return
        self_name = init.args.args[0].arg
        guarded = {id(n) for branch in _walk_body(init.body) if isinstance(branch, ast.If)
                   for n in _walk_body([*branch.body, *branch.orelse])}
        for node in _walk_body(init.body):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self.bound.setdefault(node.targets[0].id, []).append(node.value)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                  and len(node.args) == 1):
                owner = dotted(node.func.value)
                if owner is not None:
                    key = owner[len(self_name) + 1 :] if owner.startswith(self_name + ".") else owner
                    self.appended.setdefault(key, []).append(node.args[0])
        setters = DYNAMIC_SETTERS | {f"{self_name}.{m}" for m in MODULE_SETTERS}
        for node in _walk_body(init.body):
            if isinstance(node, ast.Assign):
                targets = node.targets
            else:
                targets = [node.target] if isinstance(node, ast.AnnAssign) else []
            value = getattr(node, "value", None)
            self.assigned |= _self_attrs(targets, self_name)
            if isinstance(node, ast.Call) and dotted(node.func) in setters:
                self.assigned.add("*")  # a name made at run time: any attribute may be set
            for target in targets:
                if isinstance(target, ast.Attribute) and dotted(target.value) == self_name and value is not None:
                    self._assign(target.attr, value)
                    if id(node) in guarded or _may_be_none(value):
                        self.conditional.add(target.attr)
        for attr, refs in list(self.children.items()):  # self.layers = nn.ModuleList(); self.layers.append(...)
            grown = tuple(self._grown(r, attr) for r in refs)
            self.children[attr] = grown

    def _assign(self, attr: str, value: ast.expr) -> None:
        made = [v for v in ((value.body, value.orelse) if isinstance(value, ast.IfExp) else (value,))
                if isinstance(v, ast.Call) and self._qualified(v.func) in PARAMETERS]
        if made:  # nn.Parameter(...), or nn.Parameter(...) if cond else None
            self.params.append(attr)
            ranks = {_rank(v) for v in made}
            rank = ranks.pop() if len(ranks) == 1 else None
            if rank is not None:
                self.ranks[attr] = rank
            return
        refs = self._refs(value)
        if refs:
            merged = self.children.get(attr, ()) + tuple(r for r in refs if r not in self.children.get(attr, ()))
            self.children[attr] = merged

    def _qualified(self, node: ast.expr) -> str | None:
        text = dotted(node)
        qualified = self.facts.qualify(text) if text else None
        return qualified[0] if qualified else None

    def _refs(self, node: ast.expr, depth: int = 0) -> tuple[Ref, ...]:
        if depth > 8:
            return ()
        if isinstance(node, ast.IfExp):
            return _union(self._refs(node.body, depth + 1), self._refs(node.orelse, depth + 1))
        if isinstance(node, ast.Name) and node.id in self.bound:  # a local holding a built module
            return _union(*(self._refs(v, depth + 1) for v in self.bound[node.id]))
        if not isinstance(node, ast.Call):
            return ()
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in FACTORIES:
            func = func.value  # LlamaModel._from_config(config) builds a LlamaModel
        text = dotted(func)
        qualified = self.facts.qualify(text) if text else None
        if qualified is None:  # a class chosen at run time: a local alias, a table entry
            return self._classes(func, depth + 1)
        name, local = qualified
        if name in MODULE_LISTS:
            return (self._module_list(name, node, depth),)
        return (Ref(name, local),)

    def _classes(self, node: ast.expr, depth: int) -> tuple[Ref, ...]:
        """The classes an expression may name: a class, a local alias of one (``ffn_class = A if c
        else B``), an entry of a literal table (``MIXER_TYPES[kind]``, a local dict of classes)."""
        if depth > 8:
            return ()
        if isinstance(node, ast.IfExp):
            return _union(self._classes(node.body, depth + 1), self._classes(node.orelse, depth + 1))
        if isinstance(node, ast.Subscript):
            return _union(*(self._classes(v, depth + 1) for v in self._table(node.value)))
        if isinstance(node, ast.Name) and node.id in self.bound:
            return _union(*(self._classes(v, depth + 1) for v in self.bound[node.id]))
        text = dotted(node)
        qualified = self.facts.qualify(text) if text else None
        if qualified is None or qualified[0] in MODULE_LISTS:
            return ()
        return (Ref(*qualified),)

    def _table(self, node: ast.expr) -> tuple[ast.expr, ...]:
        """The values of a literal dict / list / tuple, given inline, as a local or at module level."""
        values = _literal_values(node)
        if values is not None:
            return values
        if isinstance(node, ast.Name):
            if node.id in self.bound:
                return tuple(v for bound in self.bound[node.id] for v in (_literal_values(bound) or ()))
            return tuple(self.facts.tables.get(node.id, ()))
        return ()

    def _module_list(self, name: str, call: ast.Call, depth: int = 0) -> Ref:
        arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "modules"), None)
        if isinstance(arg, (ast.List, ast.Tuple)):
            return Ref(name, False, tuple(self._refs(e, depth + 1) for e in arg.elts), literal=True)
        if isinstance(arg, (ast.ListComp, ast.GeneratorExp)):
            return Ref(name, False, (self._refs(arg.elt, depth + 1),))
        if isinstance(arg, ast.Name) and arg.id in self.appended:  # a local list filled in a loop
            return Ref(name, False, (_union(*(self._refs(v, depth + 1) for v in self.appended[arg.id])),))
        return Ref(name, False, ())

    def _grown(self, ref: Ref, attr: str) -> Ref:
        """A ModuleList attribute with the elements ``self.<attr>.append(...)`` adds to it."""
        if ref.name not in MODULE_LISTS or attr not in self.appended or ref.literal:
            return ref
        added = _union(*(self._refs(v) for v in self.appended[attr]))
        old = ref.elements[0] if ref.elements else ()
        return Ref(ref.name, False, (_union(old, added),)) if added else ref


def _union(*groups: tuple[Ref, ...]) -> tuple[Ref, ...]:
    """The refs of every group, each once, in order."""
    return tuple(dict.fromkeys(ref for group in groups for ref in group))


DYNAMIC_SETTERS = frozenset({"setattr"})
MODULE_SETTERS = ("add_module", "register_module", "register_parameter")
"""Calls in ``__init__`` that set an attribute named at run time."""
SIZED = frozenset({"zeros", "ones", "empty", "randn", "rand", "full"})
"""torch factories whose leading arguments are the size: ``zeros(a, b)``, ``zeros((a, b))``,
``full((a,), v)``."""


def _rank(parameter: ast.Call) -> int | None:
    """The number of dims of ``nn.Parameter(torch.<factory>(size...))``, or None where the source
    does not state it (a tensor made elsewhere, a starred size)."""
    made = parameter.args[0] if parameter.args else None
    if not isinstance(made, ast.Call) or not isinstance(made.func, ast.Attribute) or made.func.attr not in SIZED:
        return None
    args = made.args
    if args and isinstance(args[0], (ast.Tuple, ast.List)):
        sizes = args[0].elts
    elif made.func.attr == "full":
        sizes = args[:1]
    else:
        sizes = args
    if not sizes or any(isinstance(a, ast.Starred) for a in sizes):
        return None
    if len(sizes) == 1 and "shape" in (dotted(sizes[0]) or "").rpartition(".")[2]:
        return None  # torch.zeros(self.shape): a tuple in a name
    return len(sizes)


def _self_attrs(targets: list[ast.expr], self_name: str) -> set[str]:
    """The ``self.<attr>`` names among assignment targets, tuple unpacking included."""
    out: set[str] = set()
    for target in targets:
        if isinstance(target, (ast.Tuple, ast.List)):
            out |= _self_attrs(list(target.elts), self_name)
        elif isinstance(target, ast.Attribute) and dotted(target.value) == self_name:
            out.add(target.attr)
    return out


def _may_be_none(value: ast.expr) -> bool:
    return isinstance(value, ast.IfExp) and any(
        isinstance(v, ast.Constant) and v.value is None for v in (value.body, value.orelse))


def _walk_body(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of a function body except those of nested functions, classes and lambdas."""
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


@lru_cache(maxsize=16)
def analyze(module: str, source: str) -> ModuleFacts:
    """Static facts of every top-level class of ``source`` (the text of module ``module``)."""
    try:
        tree = parse_source(source)
    except SyntaxError as exc:
        raise PlanError(f"{module}: the source does not parse ({exc.msg}, line {exc.lineno}); fix the module") from exc
    shape = hierarchy(module, tree)
    classes: dict[str, ClassFacts] = {}
    facts = ModuleFacts(module=module, hierarchy=shape, classes=classes, tables=_tables(tree))
    for name in shape.decls:  # names first, so that children qualify as local
        classes[name] = ClassFacts(name, shape.decls[name].node.lineno, (), {}, (), None, {})
    for name, decl in shape.decls.items():
        classes[name] = _ClassScanner(facts, decl.node).scan()
    return facts


def forward_params(fn: FunctionNode) -> list[str]:
    """Positional-or-keyword parameter names of a method, without ``self``."""
    return [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]][1:]


def resolve_pattern(facts: ModuleFacts, pattern: str) -> dict[str, set[str]]:
    """Start class -> classes ``pattern`` reaches from it, over every class of the module. A pattern
    whose first segment is a class's base-model prefix (``base_model_prefix = "model"``) is also
    resolved from that class with the segment stripped (the base model used as the top level)."""
    found: dict[str, set[str]] = {}
    head, _, rest = pattern.partition(".")
    for name in facts.classes:
        hits = facts.resolve(name, pattern)
        if rest and facts.constant(name, "base_model_prefix") == head:
            hits |= facts.resolve(name, rest)
        if hits:
            found[name] = hits
    return found
