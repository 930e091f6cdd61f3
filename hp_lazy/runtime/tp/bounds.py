"""Out-of-range ids and labels raise what the plain model raises, from a local check.

A vocab-parallel embedding looks up only its own rows and the vocab-parallel loss only its own
columns, so an id or label outside ``[0, vocab)`` would be nobody's row: zeroed, silently. The
plain model's ``F.embedding`` raises ``IndexError: index out of range in self`` and
``F.cross_entropy`` raises ``IndexError: Target <t> is out of bounds.``; these checks raise the
same, on every rank of the group (each rank holds the same ids), with no collective.

In eager mode the check is one ``aminmax`` and a host read. Inside ``torch.compile`` a Python
branch on tensor data would break the graph, so the compiled check is ``torch._assert_async``: the
step fails with a ``RuntimeError`` carrying the same text instead of an ``IndexError``.
"""

from __future__ import annotations

import torch


def check_ids(ids: torch.Tensor, vocab: int) -> None:
    """Token ids must lie in ``[0, vocab)``, as ``F.embedding`` requires."""
    if ids.numel() == 0:
        return
    if torch.compiler.is_compiling():
        torch._assert_async(((ids >= 0) & (ids < vocab)).all(), "index out of range in self")
        return
    low, high = torch.aminmax(ids)
    if int(low) < 0 or int(high) >= vocab:
        raise IndexError("index out of range in self")


def check_targets(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Labels other than ``ignore_index`` must lie in ``[0, vocab)``, as ``F.cross_entropy`` requires."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), "Target is out of bounds.")
        return
    if bool(bad.any()):
        raise IndexError(f"Target {int(labels[bad][0])} is out of bounds.")
