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

:func:`shown` is how every plan error message shows a user's value (it lives here, at the bottom of
:mod:`hp_lazy.plan`, so that every layer's messages can use it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
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
                    f"glob {shown(pattern)}: range {low}-{high} in [{body}] runs backwards; "
                    f"write the lower character first, e.g. [{high}-{low}]"
                )
            out.append(f"{re.escape(low)}-{re.escape(high)}")
            k += 3
        else:
            out.append(re.escape(items[k]))
            k += 1
    return f"[^.{''.join(out)}]" if negate else f"(?!\\.)[{''.join(out)}]"


# -- values in messages ----------------------------------------------------------------------------
SHOWN_CHARS = 80
"""The most characters of a value a message shows by default (plus a note of the value's full size)."""
_SHOWN_DEPTH = 6
_BIG_INT_BITS = 256


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters, e.g. ``'aaaa... (a str of 5239 characters)``;
    safe for any value: deep or self-containing nesting, ints past Python's digit limit, a
    ``__repr__`` that raises. Values that fit are shown exactly as ``repr`` shows them."""
    text = ""
    for fragment in _fragments(value, 0, limit):
        text += fragment
        if len(text) > limit:
            return f"{text[: limit - 3]}...{_size_note(value)}"
    return text


def _fragments(value: object, depth: int, limit: int) -> Iterator[str]:
    """The pieces of ``repr(value)``, lazily (a long container stops being read once cut)."""
    if isinstance(value, str):
        yield repr(value[: limit + 1])
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _BIG_INT_BITS:
        yield f"<an int of {_digits(value)} digits>"
    elif isinstance(value, (dict, list, tuple)):
        yield from _container(value, depth, limit)
    else:
        try:
            yield repr(value)[: limit + 1]
        except Exception:  # a user object's own __repr__ failed (or recursed): show its type instead
            yield f"<{type(value).__name__} object>"


def _container(value: dict | list | tuple, depth: int, limit: int) -> Iterator[str]:
    opening, closing = "{}" if isinstance(value, dict) else "[]" if isinstance(value, list) else "()"
    if depth >= _SHOWN_DEPTH:
        yield f"{opening}...{closing}"
        return
    yield opening
    pairs = value.items() if isinstance(value, dict) else ((None, item) for item in value)
    for i, (key, item) in enumerate(pairs):
        yield ", " if i else ""
        if isinstance(value, dict):
            yield from _fragments(key, depth + 1, limit)
            yield ": "
        yield from _fragments(item, depth + 1, limit)
    yield ",)" if isinstance(value, tuple) and len(value) == 1 else closing


def _digits(value: int) -> int:
    return int(abs(value).bit_length() * 0.30103) + 1  # log10(2): exact or one too many


def _size_note(value: object) -> str:
    if isinstance(value, str):
        return f" (a str of {len(value)} characters)"
    if isinstance(value, (dict, list, tuple)):
        return f" (a {type(value).__name__} of {len(value)} item{'' if len(value) == 1 else 's'})"
    return ""
