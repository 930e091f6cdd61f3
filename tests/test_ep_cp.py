"""Expert parallel x context parallel at world 2 (cp=2, ep=2: the ep group is the cp group, whose
ranks hold different halves of every sequence). Both ranks pass the whole batch; context
parallel splits it along the sequence and each rank dispatches its own tokens. One process's
loss, logits and routing (joined with ``hp_lazy.gather_sequence``), every gradient (expert shards
summed over nobody: each is held once; dense ones summed over cp) and 3 SGD+wd steps."""

from __future__ import annotations

import epwork
import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)


@pytest.fixture(scope="module")
def ready(pool2: DistPool, tmp_path_factory):
    if getattr(pool2, "_hp_activated", None) is not pool2._procs or not pool2._procs:
        pool2.run(epwork.activate, ep=2, cp=2)
        pool2._hp_activated = pool2._procs
    return pool2, str(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize(("name", "impl"), [("qwen3_moe", "grouped_mm"), ("qwen2_moe", "eager")])
def test_ep_cp_matches_one_process(ready, name: str, impl: str) -> None:
    pool, root = ready
    path = models.build(name, root)
    data = epwork.batch()
    ref = epwork.reference(path, data, impl)
    results = pool.run(epwork.train, path, data, impl)
    for got in results:
        for mine, theirs in zip(got["routing"], ref["routing"], strict=True):
            assert (mine == theirs).all()
        assert models.rel_err(got["loss"], ref["loss"]) <= parity.TOL
        assert models.rel_err(got["logits"], ref["logits"]) <= parity.TOL
    parity.compare(results[0], ref)
