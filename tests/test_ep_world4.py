"""Expert parallel x tensor parallel at world 4 (ep=2, tp=2: dp=2, the ep group carved out of the
two dp ranks of each tp rank). The experts are cut on ep and, inside each ep slice, on tp as
experts-TP cuts them: each tp rank dispatches its dp rank's tokens over its ep group, computes
its tp slice of its local experts, and the experts' exit all-reduce over tp sums the slices.
One process's loss, logits, routing, every gradient and 3 SGD+wd steps."""

from __future__ import annotations

import epwork
import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool4 = pool_fixture(4, timeout=180)


@pytest.fixture(scope="module")
def ready(pool4: DistPool, tmp_path_factory):
    parity.once(pool4, epwork.activate, ep=2, tp=2)
    return pool4, str(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize(("name", "impl"), [("qwen3_moe8", "grouped_mm"), ("qwen2_moe", "eager")])
def test_ep_tp_matches_one_process(ready, name: str, impl: str) -> None:
    pool, root = ready
    results, ref = epwork.check(pool, models.build(name, root), impl)
    assert results[0]["local_experts"] == [models.MORE_CONFIGS[name][1]["num_experts"] // 2] * len(ref["routing"])


@pytest.mark.parametrize("name", ["deepseek_v2", "glm4_moe_lite"])
def test_ep_tp_with_mla_attention(ready, name: str) -> None:
    """MLA heads cut on tp beside experts cut on ep and tp; GLM-4-MoE-Lite routes with sigmoid scores,
    a correction bias and a shared expert."""
    pool, root = ready
    results, ref = epwork.check(pool, models.build(name, root))
    assert results[0]["local_experts"] == [models.MORE_CONFIGS[name][1]["n_routed_experts"] // 2] * len(ref["routing"])
