"""dp x tp with sequence parallel at world 4: the norms and rowwise biases on sequence-sharded
activations hold partial gradients over tp, which must compose with every dp reducer
(hp_lazy's own, torch DDP, FSDP2) — exactly the case that was silently wrong before."""

from __future__ import annotations

import dpwork
import parity
import pytest
from dist import DistPool, pool_fixture

pool4 = pool_fixture(4, timeout=240)


@pytest.mark.parametrize("wrap", ["hp", "ddp", "fsdp"])
def test_dp_x_sequence_parallel(pool4: DistPool, refs, wrap: str) -> None:
    parity.activated(pool4, tp=2, sequence_parallel=True)
    dpwork.check(pool4, refs, "qwen3", wrap, dp=2)


def test_dp_x_sequence_parallel_biases(pool4: DistPool, refs) -> None:
    parity.activated(pool4, tp=2, sequence_parallel=True)
    dpwork.check(pool4, refs, "llama_bias", "hp", dp=2)
