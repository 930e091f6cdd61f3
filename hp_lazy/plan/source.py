"""One parse per modeling source: slicing (:mod:`hp_lazy.plan.resolve`) and lowering
(:mod:`hp_lazy.lower`) read the same ``ast.Module``.

The tree is shared, so it is read-only: the lowerer copies the class and function nodes it
changes and leaves every node of this tree as parsed.
"""

from __future__ import annotations

import ast
from functools import lru_cache


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
