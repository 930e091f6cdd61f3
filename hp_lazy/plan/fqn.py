"""Dotted-name globs: the one matching rule for FQN patterns and module names in hp_lazy.

A pattern is matched segment by segment (segments are split on ``.``):

- ``*`` matches any run of characters inside one segment (the empty run too), ``?`` one character;
- ``[abc]``, ``[a-z]``, ``[0-3]`` match one character of the class and ``[!x]`` one character not
  in it; a class never matches ``.``; a ``[`` without a closing ``]`` (or with nothing inside) is
  a literal ``[``;
- a segment that is exactly ``**`` matches one or more whole segments;
- every other character is literal (``+``, ``(``, ``\\``), and matching is case-sensitive.

So ``model.layers.*.self_attn`` matches ``model.layers.0.self_attn`` but not
``model.layers.0.inner.self_attn``, and ``transformers.models.*.modeling_*`` matches
``transformers.models.llama.modeling_llama``; write ``transformers.**`` to span packages.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

from hp_lazy.errors import PlanError

GLOB_CHARS = frozenset("*?[")
_ANY_SEGMENTS = r"[^.]+(?:\.[^.]+)*"


def is_glob(text: str) -> bool:
    """Whether ``text`` has a glob character (``*``, ``?``, ``[``); else it matches only itself."""
    return not GLOB_CHARS.isdisjoint(text)


@lru_cache(maxsize=4096)
def compile_glob(pattern: str) -> re.Pattern[str]:
    """The regex of ``pattern``; use ``.match(name)`` (it is anchored at both ends).
    Raises :class:`PlanError` for a character class whose range runs backwards (``[z-a]``)."""
    return re.compile(glob_regex_text(pattern))


def compile_globs(patterns: Iterable[str]) -> re.Pattern[str] | None:
    """One regex matching a name that any of ``patterns`` matches (None for no pattern)."""
    texts = [f"(?:{glob_regex_text(p)})" for p in patterns]
    return re.compile("|".join(texts)) if texts else None


def matches(pattern: str, name: str) -> bool:
    """Whether dotted ``name`` matches ``pattern`` (a plain pattern only matches itself)."""
    if not is_glob(pattern):
        return name == pattern
    return compile_glob(pattern).match(name) is not None


def check_glob(where: str, pattern: str) -> str:
    """``pattern`` if it compiles; else a :class:`PlanError` prefixed with ``where``."""
    try:
        compile_glob(pattern)
    except PlanError as exc:
        raise PlanError(f"{where}: {exc}") from None
    return pattern


def glob_regex_text(pattern: str) -> str:
    """The regular expression text of ``pattern`` (``\\A ... \\Z``)."""
    parts = [_ANY_SEGMENTS if seg == "**" else _segment(pattern, seg) for seg in pattern.split(".")]
    return r"\A" + r"\.".join(parts) + r"\Z"


def _segment(pattern: str, segment: str) -> str:
    out, i = [], 0
    while i < len(segment):
        ch = segment[i]
        close = segment.find("]", i + 1)
        body = segment[i + 1 : close] if ch == "[" and close > i else ""
        if ch == "*":
            out.append("[^.]*")
        elif ch == "?":
            out.append("[^.]")
        elif body and body != "!":
            out.append(_char_class(pattern, body))
            i = close
        else:
            out.append(re.escape(ch))
        i += 1
    return "".join(out)


def _char_class(pattern: str, body: str) -> str:
    """``[a-z0]`` -> ``(?!\\.)[a\\-z0]``-style text with real ranges; ``[!x]`` -> ``[^.x]``."""
    negate = body.startswith("!")
    items = body[1:] if negate else body
    out, k = [], 0
    while k < len(items):
        if k + 2 < len(items) and items[k + 1] == "-":
            low, high = items[k], items[k + 2]
            if low > high:
                raise PlanError(
                    f"glob {pattern!r}: range {low}-{high} in [{body}] runs backwards; "
                    f"write the lower character first, e.g. [{high}-{low}]"
                )
            out.append(f"{re.escape(low)}-{re.escape(high)}")
            k += 3
        else:
            out.append(re.escape(items[k]))
            k += 1
    return f"[^.{''.join(out)}]" if negate else f"(?!\\.)[{''.join(out)}]"
