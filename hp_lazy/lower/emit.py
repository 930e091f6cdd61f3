"""Builders of the generated AST fragments (shapes: docs/contract.md).

Fragments are written as short source text and parsed, which keeps them readable; every node
they produce is then placed at the line of the definition it stands for (:func:`relocate`).
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

from hp_lazy.lower.classify import BoundOp, FormDecision
from hp_lazy.lower.facts import ForwardFacts
from hp_lazy.names import BINDING, CALL, FORM, IMPL, OUT, RT, RT_MODULE

RT_IMPORT = f"import {RT_MODULE} as {RT}"
_LOCATION = ("lineno", "col_offset", "end_lineno", "end_col_offset")


@dataclass(frozen=True, slots=True)
class ForwardSpec:
    """Everything that shapes one class's new ``forward``."""

    decision: FormDecision
    facts: ForwardFacts
    deferred_bias: bool
    root: bool
    synthesised: bool
    """The forward comes from another module: ``_forward_impl`` calls ``super().forward``."""


def parse_stmts(text: str) -> list[ast.stmt]:
    return ast.parse(text).body


def relocate(nodes: list[ast.stmt], ref: ast.AST) -> list[ast.stmt]:
    """Put every node of these new subtrees at the first line of ``ref`` (one-line span, so a
    traceback through generated code shows the ``def`` line it stands for)."""
    line, col = getattr(ref, "lineno", 1), getattr(ref, "col_offset", 0)
    where = dict(zip(_LOCATION, (line, col, line, col), strict=True))
    for top in nodes:
        for node in ast.walk(top):
            if "lineno" in node._attributes:
                for attr, value in where.items():
                    setattr(node, attr, value)
    return nodes


def call_args(facts: ForwardFacts) -> str:
    """Re-pass every parameter: positionally where it must or has no default, by name otherwise."""
    pos: list[str] = []
    kw: list[str] = []
    for p in facts.params:
        by_name = p.kind == "keyword_only" or (p.kind == "positional" and p.has_default and not facts.vararg)
        (kw if by_name else pos).append(f"{p.name}={p.name}" if by_name else p.name)
    star = [f"*{facts.vararg}"] if facts.vararg else []
    dstar = [f"**{facts.kwarg}"] if facts.kwarg else []
    return ", ".join([*pos, *star, *kw, *dstar])


def impl_call(facts: ForwardFacts) -> str:
    return f"{facts.self_name}.{IMPL}({call_args(facts)})"


def _op_call(expr: str, op: BoundOp) -> str:
    dims = "".join(f", {d}" for d in op.op.dims)
    return f"{RT}.{op.op.call}({expr}, {BINDING}.{op.axis}{dims})"


def static_entry(decision: FormDecision) -> list[str]:
    lines: list[str] = []
    for op in decision.in_ops:
        lines += [repr(op.describe()), f"{op.name} = {_op_call(op.name, op)}"]
    return lines


def _rebuild(exprs: dict[int, str], layout: str) -> str:
    """``_hp_out`` with the given positions replaced (a single value: position 0 is the value)."""
    if layout == "single":
        return exprs[0]
    last = max(exprs)
    elts = [exprs.get(i, f"{OUT}[{i}]") for i in range(last + 1)]
    return f"({', '.join(elts)}, *{OUT}[{last + 1}:])"


def _base(pos: int, layout: str) -> str:
    return OUT if layout == "single" else f"{OUT}[{pos}]"


def _position(op: BoundOp) -> int:
    """The tuple position of an exit op (set on every output op)."""
    return op.position or 0


def static_exit(spec: ForwardSpec) -> list[str]:
    layout = spec.facts.output_layout()[0]
    notes = _exit_notes(spec)
    exprs: dict[int, str] = {}
    for op in spec.decision.out_ops:
        pos = _position(op)
        exprs[pos] = _op_call(exprs.get(pos, _base(pos, layout)), op)
    if spec.deferred_bias:
        exprs[0] = f"{RT}.add_deferred_bias({exprs.get(0, _base(0, layout))}, {BINDING})"
    return [*map(repr, notes), f"{OUT} = {_rebuild(exprs, layout)}"]


def _exit_notes(spec: ForwardSpec) -> list[str]:
    """One note per exit op; deferred biases join the last note of output 0 (or get their own)."""
    notes = [op.describe() for op in spec.decision.out_ops]
    if spec.deferred_bias:
        at0 = [i for i, op in enumerate(spec.decision.out_ops) if op.position == 0]
        if at0:
            notes[at0[-1]] += ", then deferred biases"
        else:
            notes.append("output: deferred biases")
    return notes


def generic_entry(spec: ForwardSpec) -> list[str]:
    facts = spec.facts
    lines = [f"{CALL} = {RT}.begin({BINDING})"]  # what this call's entry ops leave for its exit ops
    names = list(dict.fromkeys(op.name for op in spec.decision.in_ops))
    for name in names:
        lines += [repr(op.describe()) for op in spec.decision.in_ops if op.name == name]
        if name in facts.param_names:
            lines.append(f"{name} = {RT}.enter({BINDING}, {name!r}, {name}, {CALL})")
        elif not spec.synthesised:
            kw = facts.kwarg
            entered = f"{RT}.enter({BINDING}, {name!r}, {kw}[{name!r}], {CALL})"
            lines += [f"if {name!r} in {kw}:", f"    {kw}[{name!r}] = {entered}"]
    if spec.synthesised and names:
        star, dstar = facts.vararg, facts.kwarg
        lines.append(f"{star}, {dstar} = {RT}.enter_call({BINDING}, super().forward, {star}, {dstar}, {CALL})")
    return lines


def generic_exit(spec: ForwardSpec) -> list[str]:
    notes = [repr(op.describe()) for op in spec.decision.out_ops]
    if spec.deferred_bias:
        notes.append(repr("output: deferred biases are added by exit, once, after the reduction"))
    return [*notes, f"{OUT} = {RT}.exit({BINDING}, {OUT}, {CALL})"]


def forward_body(spec: ForwardSpec) -> list[str]:
    """Source lines of the new forward's body (without the docstring)."""
    form, facts = spec.decision.form, spec.facts
    lines = [f"{RT}.ensure_parallel({facts.self_name})"] if spec.root else []
    lines += [f"{BINDING} = {facts.self_name}.{BINDING}", f"if {BINDING} is None:", f"    return {impl_call(facts)}"]
    generic = form == "generic"
    if generic:
        lines.append(repr(f"generic form: {'; '.join(spec.decision.reasons)}"))
    lines += generic_entry(spec) if generic else static_entry(spec.decision)
    if not spec.decision.out_ops and not spec.deferred_bias:
        return [*lines, f"return {impl_call(facts)}"]
    lines.append(f"{OUT} = {impl_call(facts)}")
    lines += generic_exit(spec) if generic else static_exit(spec)
    return [*lines, f"return {OUT}"]


def build_forward(impl: ast.FunctionDef, spec: ForwardSpec, decorators: list[ast.expr]) -> ast.FunctionDef:
    """A ``forward`` with ``impl``'s signature, the given decorators and the body of ``spec``."""
    new = copy.copy(impl)
    new.name = "forward"
    new.args = copy.deepcopy(impl.args)
    new.returns = copy.deepcopy(impl.returns)
    new.decorator_list = decorators
    body = relocate(parse_stmts("\n".join(forward_body(spec))), impl)
    if spec.facts.has_docstring:
        body.insert(0, copy.deepcopy(impl.body[0]))
    new.body = body
    return new


def prologue(self_name: str, ref: ast.AST) -> ast.stmt:
    return relocate(parse_stmts(f"{RT}.ensure_parallel({self_name})"), ref)[0]


def install_root(class_name: str, ref: ast.AST) -> ast.stmt:
    return relocate(parse_stmts(f"{RT}.install_root({class_name})"), ref)[0]


def lazy_root(class_name: str, ref: ast.AST) -> ast.stmt:
    return relocate(parse_stmts(f"{RT}.lazy_root({class_name})"), ref)[0]


def class_attributes(form: str, qualname: str, ref: ast.AST) -> list[ast.stmt]:
    text = f"{FORM} = {form!r}\n{BINDING} = {RT}.unbound({qualname!r})"
    return relocate(parse_stmts(text), ref)


def synthesised_impl(ref: ast.AST) -> ast.FunctionDef:
    """``_forward_impl`` of a class whose forward lives in another module."""
    text = f"def {IMPL}(self, *args, **kwargs):\n    return super().forward(*args, **kwargs)"
    (node,) = relocate(parse_stmts(text), ref)
    assert isinstance(node, ast.FunctionDef)
    return node


def runtime_import(ref: ast.AST | None) -> ast.stmt:
    node = parse_stmts(RT_IMPORT)[0]
    return relocate([node], ref)[0] if ref is not None else ast.fix_missing_locations(node)
