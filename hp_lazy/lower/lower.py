"""``lower(source, module_plan) -> ast.Module``: the pure rewrite of one modeling module.

Per lowered class (docs/contract.md): the original ``forward`` becomes ``_forward_impl`` in place
(same lines, no decorators), a new ``forward`` with the same signature and the decorators follows
it, and the class gets ``_hp_form`` and ``_hp_b``. Roots get ``ensure_parallel`` in
their forward and ``lazy_root`` after the class (``install_root`` when their forward is inherited,
which does both). Nothing else moves.

The source is parsed once per text (:func:`hp_lazy.plan.source.parse_source`, shared with the
plan slice); the rewrite copies the class and function nodes it changes and shares the rest, so
the parsed tree stays as parsed and the returned tree is for compiling or printing, not editing.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

from hp_lazy.errors import LoweringError, PlanError
from hp_lazy.lower import emit
from hp_lazy.lower.classify import FormDecision, classify
from hp_lazy.lower.facts import ClassFacts, ForwardFacts, ModuleFacts, forward_facts, module_facts
from hp_lazy.names import IMPL
from hp_lazy.plan.model import Contract, ModulePlan
from hp_lazy.plan.source import find_forward, parse_source

_FnDef = ast.FunctionDef
_AnyFnDef = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True, slots=True)
class _Source:
    """The forward a lowered class runs: the definition that becomes ``_forward_impl``, whether
    it is the class's own node, and whether it was synthesised (a forward of another module)."""

    impl: _FnDef
    facts: ForwardFacts
    own: bool
    synthesised: bool


@dataclass(frozen=True, slots=True)
class _Target:
    spec: emit.ForwardSpec
    source: _Source


def lower(source: str, module_plan: ModulePlan, filename: str = "<unknown>") -> ast.Module:
    """Rewrite the boundary classes and roots of one module; the parsed source as is when
    nothing applies. Raises ``LoweringError``/``PlanError`` naming the module and the fix."""
    tree = parse_source(source, filename)
    mod = module_facts(tree, module_plan.module)
    _check_roots(module_plan, mod)
    targets = _targets(module_plan, mod, tree)
    out = ast.Module(body=list(tree.body), type_ignores=list(tree.type_ignores))
    if not targets and not module_plan.roots:
        return out
    after: list[tuple[int, ast.stmt]] = []
    for cls in mod.classes:
        node = _class_node(tree, cls)
        if cls.name in targets:
            out.body[cls.index] = _lowered_class(node, targets[cls.name], module_plan.module)
        elif cls.name in module_plan.roots and (fn := find_forward(node)) is not None:
            out.body[cls.index] = _with_prologue(node, fn)
            if dict(module_plan.mesh).get("cp", 1) > 1:  # the cp entry splits the batch around the forward
                after.append((cls.index, emit.install_root(cls.name, node)))
                continue
        elif cls.name in module_plan.roots:
            after.append((cls.index, emit.install_root(cls.name, node)))
            continue
        if cls.name in module_plan.roots:  # torch.compile(model) binds it before tracing
            after.append((cls.index, emit.lazy_root(cls.name, node)))
    for index, stmt in sorted(after, key=lambda p: -p[0]):
        out.body.insert(index + 1, stmt)
    _insert_import(out, mod)
    return out


def boundary_decisions(source: str, module_plan: ModulePlan) -> dict[str, tuple[str, FormDecision]]:
    """pattern -> (class, decision) for every contract whose class this module's source lowers,
    decided exactly as :func:`lower` does (``hp_lazy check``, the runtime binder)."""
    tree = parse_source(source)
    mod = module_facts(tree, module_plan.module)
    out = {}
    for cls, contracts in _class_contracts(module_plan, mod):
        facts = _forward_source(tree, mod, cls, module_plan.module).facts
        out.update({c.pattern: (cls.name, classify(c, facts, module_plan.mesh)) for c in contracts})
    return dict(sorted(out.items()))


def _class_node(tree: ast.Module, cls: ClassFacts | None) -> ast.ClassDef:
    node = tree.body[cls.index] if cls is not None else None
    assert isinstance(node, ast.ClassDef), cls
    return node


def _check_roots(plan: ModulePlan, mod: ModuleFacts) -> None:
    for root in sorted(plan.roots):
        if mod.cls(root) is None:
            raise LoweringError(
                f"{plan.module}: root class {root!r} is not defined at the top level of the module; "
                "list only classes the module defines in ModulePlan.roots"
            )


def _class_contracts(plan: ModulePlan, mod: ModuleFacts) -> list[tuple[ClassFacts, list[Contract]]]:
    """Each class this module's source lowers, with the contracts that land on it."""
    by_pattern = {c.pattern: c for c in plan.contracts}
    out: dict[str, list[Contract]] = {}
    for pattern, cls in sorted(plan.classes.items()):
        if "." in cls:
            continue  # defined elsewhere: a leaf bound at run time
        if mod.cls(cls) is None:
            raise LoweringError(
                f"{plan.module}: {pattern} maps to class {cls!r}, which the module does not define at top level; "
                "fix boundary_classes or use the dotted name of the class's own module"
            )
        if pattern not in by_pattern:
            raise PlanError(
                f"{plan.module}: {pattern} maps to class {cls!r} but the plan has no contract for it; add one"
            )
        if not by_pattern[pattern].skip_source_lowering:
            out.setdefault(cls, []).append(by_pattern[pattern])
    return [(c, out[c.name]) for c in mod.classes if c.name in out]


def _targets(plan: ModulePlan, mod: ModuleFacts, tree: ast.Module) -> dict[str, _Target]:
    """Classes to rewrite, with their one form decision (identity classes are left out)."""
    out = {}
    for cls, contracts in _class_contracts(plan, mod):
        name = cls.name
        source = _forward_source(tree, mod, cls, plan.module)
        decisions = [(c, classify(c, source.facts, plan.mesh)) for c in sorted(contracts, key=lambda c: c.pattern)]
        first, decision = decisions[0]
        for other, d in decisions[1:]:
            if _key(d, other) != _key(decision, first):
                raise PlanError(
                    f"{plan.module}: class {name} serves {first.pattern} and {other.pattern} with different "
                    f"boundary code ({decision.form} vs {d.form}); give them the same in/out placements and "
                    "deferred biases, or mark both skip_source_lowering"
                )
        if decision.form != "identity":
            deferred = bool(first.deferred_bias_params)
            spec = emit.ForwardSpec(decision, source.facts, deferred, name in plan.roots, source.synthesised)
            out[name] = _Target(spec, source)
    return out


def _forward_source(tree: ast.Module, mod: ModuleFacts, cls: ClassFacts, module: str) -> _Source:
    node = _class_node(tree, cls)
    if cls.defines_impl:
        raise LoweringError(
            f"{module}: class {cls.name} already defines {IMPL!r}, the name hp_lazy gives the original "
            "forward; rename it in the source or mark the contract skip_source_lowering"
        )
    own = find_forward(node)
    impl: _AnyFnDef
    if own is not None:
        impl, synthesised = own, False
    elif cls.forward_owner is not None and cls.copy_blocker is None:
        owner = find_forward(mod.hierarchy.decls[cls.forward_owner].node)
        assert owner is not None  # forward_owner names a class that defines forward
        impl, synthesised = copy.deepcopy(owner), False
    else:
        impl, synthesised = emit.synthesised_impl(node), True
    if isinstance(impl, ast.AsyncFunctionDef) or forward_facts(impl).is_generator:
        raise LoweringError(
            f"{module}: {cls.name}.forward (line {impl.lineno}) is async or a generator; hp_lazy cannot place "
            "its outputs; mark the contract skip_source_lowering"
        )
    return _Source(impl, forward_facts(impl, owner=cls.name), own is not None, synthesised)


def _key(decision: FormDecision, contract: Contract) -> tuple:
    return decision.form, decision.in_ops, decision.out_ops, bool(contract.deferred_bias_params)


def _lowered_class(node: ast.ClassDef, target: _Target, module: str) -> ast.ClassDef:
    """A copy of ``node`` whose forward is ``_forward_impl`` (renamed, undecorated) followed by
    the new ``forward``; ``node`` and its original forward are left as they are."""
    source, spec = target.source, target.spec
    new = emit.build_forward(source.impl, spec, source.impl.decorator_list)
    impl = copy.copy(source.impl) if source.own else source.impl
    impl.name, impl.decorator_list = IMPL, []
    cls = _copy_class(node)
    if source.own:
        at = cls.body.index(source.impl)
        cls.body[at : at + 1] = [impl, new]
    else:
        cls.body += [impl, new]
    attrs = emit.class_attributes(spec.decision.form, f"{module}.{node.name}", node)
    cls.body[_after_docstring(cls) : _after_docstring(cls)] = attrs
    return cls


def _copy_class(node: ast.ClassDef) -> ast.ClassDef:
    cls = copy.copy(node)
    cls.body = list(node.body)
    return cls


def _after_docstring(node: ast.ClassDef | _AnyFnDef) -> int:
    return 1 if ast.get_docstring(node, clean=False) is not None else 0


def _with_prologue(node: ast.ClassDef, fn: _AnyFnDef) -> ast.ClassDef:
    """A copy of root class ``node`` whose forward first calls ``ensure_parallel``."""
    new = copy.copy(fn)
    self_name = (fn.args.posonlyargs or fn.args.args)[0].arg
    new.body = list(fn.body)
    new.body.insert(_after_docstring(fn), emit.prologue(self_name, fn))
    cls = _copy_class(node)
    cls.body[cls.body.index(fn)] = new
    return cls


def _insert_import(tree: ast.Module, mod: ModuleFacts) -> None:
    at = mod.insert_at
    ref = tree.body[at - 1] if at else (tree.body[0] if tree.body else None)
    tree.body.insert(at, emit.runtime_import(ref))
