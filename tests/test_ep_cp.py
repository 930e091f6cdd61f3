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
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture
def ready(pool2: DistPool, root: str):
    """Activated per test: a pool restarts its workers after a worker error."""
    parity.once(pool2, epwork.activate, ep=2, cp=2)
    return pool2, root


@pytest.mark.parametrize(("name", "impl"), [("qwen3_moe", "grouped_mm"), ("qwen2_moe", "eager")])
def test_ep_cp_matches_one_process(ready, name: str, impl: str) -> None:
    pool, root = ready
    epwork.check(pool, models.build(name, root), impl)
