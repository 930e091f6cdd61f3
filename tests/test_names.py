"""names.py is the one source of the names it claims: no other module of the package spells a
reserved-prefix name (``_hp_*``, ``__hp_*``), as an identifier, an attribute or inside a string
(code templates included); every such name the package uses is declared there. The other half,
that lowered code calls only what the runtime exports, is ``tests/test_architecture.py``."""

from __future__ import annotations

import ast
import pathlib
import re

from hp_lazy import names

PACKAGE = pathlib.Path(names.__file__).parent
SPELLED = re.compile(r"(?<![\w.])_{1,2}hp_\w+")
"""A reserved-prefix name inside a string (``"_hp_b"``, ``f"{x} = _hp_out[0]"``), not the bare
prefix an error message quotes (``'_hp_'``)."""
DECLARED = {v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            out.add(id(body[0].value))
    for node in ast.walk(tree):  # attribute docstrings: a string statement after an assignment
        for block in (getattr(node, "body", None), getattr(node, "orelse", None)):
            if isinstance(block, list):
                out |= {id(s.value) for s in block if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)}
    return out


def spellings(source: str) -> list[tuple[int, str]]:
    """(line, name) of every reserved-prefix name the code spells outside docstrings and comments."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found += [(node.lineno, m) for m in SPELLED.findall(node.value)]
        elif isinstance(node, ast.Attribute) and node.attr.startswith(names.RESERVED_PREFIXES):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id.startswith(names.RESERVED_PREFIXES):
            found.append((node.lineno, node.id))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith(names.RESERVED_PREFIXES):
            found.append((node.lineno, node.name))
    return sorted(found)


def test_no_module_but_names_spells_a_reserved_name() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "names.py":
            offenders += [f"{path.relative_to(PACKAGE)}:{line}: {name}" for line, name in spellings(path.read_text())]
    assert offenders == [], "use the constants of hp_lazy/names.py instead:\n" + "\n".join(offenders)


def test_every_declared_name_is_reserved_or_the_runtime() -> None:
    odd = {v for v in DECLARED if not v.startswith(names.RESERVED_PREFIXES)}
    assert odd == {names.RT_MODULE, names.IMPL, names.ROUTED, names.LAZY_HOOK, names.LAZY_INIT}
    assert names.GENERATED <= DECLARED and names.ATTACHED <= DECLARED


def test_the_check_finds_a_spelling() -> None:
    """Negative control: each way of spelling a name is caught, a docstring and the bare prefix are not."""
    source = '''
"""Module docstring naming _hp_b."""
x = "_hp_b"
y = f"{a} = _hp_out[0]"
z = obj._hp_cuts
def f():
    """_hp_out in a docstring."""
    return "reserved prefix '_hp_'"
'''
    assert [name for _, name in spellings(source)] == ["_hp_b", "_hp_out", "_hp_cuts"]
