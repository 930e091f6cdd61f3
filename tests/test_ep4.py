"""Expert parallel at world 4 with ep=4 (four dp ranks, each holding a quarter of every layer's
experts and feeding its own row): P=4 catches index bugs P=2 can hide. One process's loss,
logits, routing, every gradient and 3 SGD+wd steps; and a router hole (every token routed to
the first half of the experts: ranks 2 and 3 receive no rows)."""

from __future__ import annotations

import epwork
import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool4 = pool_fixture(4, timeout=180)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture
def ready(pool4: DistPool, root: str):
    """Activated per test: a pool restarts its workers after a worker error."""
    parity.once(pool4, epwork.activate, ep=4)
    return pool4, root


@pytest.mark.parametrize("hole", [False, True])
def test_ep4_matches_one_process(ready, hole: bool) -> None:
    pool, root = ready
    path = models.build("qwen3_moe8", root)
    path = epwork.hole(path) if hole else path
    data = epwork.batch(rows=4)
    ref = epwork.reference(path, data, "eager")
    if hole:
        assert all((idx < 4).all() for idx in ref["routing"])
    results = pool.run(epwork.train, path, data, "eager")
    for got in results:
        for mine, theirs in zip(got["routing"], ref["routing"], strict=True):
            assert (mine == theirs).all()
        assert models.rel_err(got["loss"], ref["loss"]) <= parity.TOL
        assert models.rel_err(got["logits"], ref["logits"]) <= parity.TOL
    assert results[0]["local_experts"] == [2, 2]
    parity.compare(results[0], ref)
