"""Which tokens of a sequence a cp rank holds: the zigzag (head-tail) layout.

The sequence of ``S`` tokens is cut into ``2C`` chunks of ``c = S / 2C``; rank ``r`` of ``C`` holds
chunks ``r`` and ``2C - 1 - r``, so under a causal mask every rank attends to the same number of
(query, key) pairs: ``(2C + 1) c**2``. Index tensors, all of global token positions:

- ``local [S/C]``: the tokens this rank holds, in its row order;
- ``gathered [S]``: the token of each row of an all-gather over the cp group (rank order);
- ``inverse [S]``: ``gathered[inverse] == arange(S)`` (all-gathered rows back to sequence order).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True, eq=False)
class Zigzag:
    seq: int
    size: int
    rank: int
    local: torch.Tensor
    gathered: torch.Tensor
    inverse: torch.Tensor

    @property
    def local_len(self) -> int:
        return self.seq // self.size

    def runs(self) -> list[tuple[int, int, int]]:
        """This rank's rows as ``(local start, global start, length)``: its two chunks."""
        c = self.seq // (2 * self.size)
        return [(0, self.rank * c, c), (c, (2 * self.size - 1 - self.rank) * c, c)]


def _rows(seq: int, size: int, rank: int) -> torch.Tensor:
    c = seq // (2 * size)
    head, tail = rank * c, (2 * size - 1 - rank) * c
    return torch.cat([torch.arange(head, head + c), torch.arange(tail, tail + c)])


@lru_cache(maxsize=64)
def zigzag(seq: int, size: int, rank: int, device: torch.device) -> Zigzag:
    """The layout of a sequence of ``seq`` tokens (a multiple of ``2 * size``) on rank ``rank``."""
    gathered = torch.cat([_rows(seq, size, r) for r in range(size)])
    return Zigzag(
        seq=seq,
        size=size,
        rank=rank,
        local=_rows(seq, size, rank).to(device),
        gathered=gathered.to(device),
        inverse=torch.argsort(gathered).to(device),
    )
