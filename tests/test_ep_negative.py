"""Negative control for expert parallel's zero-row guard, in a pool with a short timeout: with
every token routed to rank 0's experts and the guard removed, rank 1's eager experts return a
fresh zeros tensor for its empty rows, its graph skips the backward all-to-alls that rank 0 waits
in, and the step fails (desync / timeout) instead of hanging CI. The same run with the guard
passes in tests/test_ep.py (test_router_hole)."""

from __future__ import annotations

import epwork
import models
import pytest
from dist import DistPool, WorkerError, pool_fixture

pool2 = pool_fixture(2, timeout=15)


def test_disconnected_zero_row_path_desynchronises(pool2: DistPool, tmp_path) -> None:
    pool2.run(epwork.activate, ep=2)
    path = epwork.hole(models.build("qwen3_moe", str(tmp_path)))
    with pytest.raises(WorkerError):
        pool2.run(epwork.disconnected, path, epwork.batch())
