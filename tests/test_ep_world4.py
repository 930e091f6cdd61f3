"""Expert parallel x tensor parallel at world 4 (ep=2, tp=2: dp=2, the ep group carved out of the
two dp ranks of each tp rank). The experts are cut on ep. Where the TP plan also cuts them
(transformers 5.24's experts-TP entries), each tp rank dispatches its dp rank's tokens over its ep
group, computes its tp slice of its local experts, and the experts' exit all-reduce over tp sums
the slices; where it leaves them whole (5.25's plans, GPT-OSS and Muse Spark on both), each tp
rank dispatches its own share of the tokens and the outputs are gathered over tp. One process's
loss, logits, routing, every gradient and 3 SGD+wd steps; the all-to-all bytes of the shares;
PEFT LoRA on the experts' tensors."""

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
    parity.once(pool4, epwork.activate, ep=2, tp=2)
    return pool4, root


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



@pytest.mark.parametrize(("name", "dtype"), [("gpt_oss", "float32"), ("muse_spark", "float64")])
def test_ep_tp_with_experts_the_tp_plan_leaves_whole(ready, name: str, dtype: str) -> None:
    """Experts the TP plan does not cut (GPT-OSS's TP plan cuts the embedding only; Muse Spark's cuts
    the projections around the experts): every tp rank dispatches the same tokens over its ep group
    and computes whole local experts; Muse Spark's post_expert_norm stays whole on every rank.

    Muse Spark runs in float64: its router casts to float32 in any dtype, and in a float32 model the
    family's own floor (one process, no hp_lazy, the rows fed one at a time as dp feeds them) is
    1.5e-6 on the gradients and 1.3e-5 on the parameters after the 3 steps, above the bound; in
    float64 that floor is 2.1e-7 / 3.7e-6, and hp_lazy's errors here equal it."""
    pool, root = ready
    results, ref = epwork.check(pool, models.build(name, root), "eager", dtype=dtype)
    assert results[0]["local_experts"] == [models.MORE_CONFIGS[name][1]["num_local_experts"] // 2] * len(ref["routing"])


def test_tp_ranks_dispatch_their_share_of_the_tokens(ready) -> None:
    """Experts the TP plan leaves whole (every family on transformers 5.25): each tp rank dispatches
    half its dp rank's tokens, so the all-to-all bytes per rank are half of every tp rank
    dispatching all of them (what ep=2 alone sends), counted on torch.distributed itself. The
    price is one all-gather of the experts' output over tp (and its gradient's in backward)."""
    pool, root = ready
    path = models.build("gpt_oss", root)  # its TP plan leaves the experts whole on 5.24 too
    data = epwork.batch(rows=2, seq=16)
    shared = pool.run(epwork.a2a_bytes, path, data)
    before = pool.run(epwork.a2a_bytes, path, data, split=False)
    ratios = [now["all_to_all"] / then["all_to_all"] for now, then in zip(shared, before, strict=True)]
    assert sum(ratios) / len(ratios) <= 0.55, (shared, before)  # each rank's share varies with the routing
    for peers in ((0, 1), (2, 3)):  # the tp ranks of one dp rank send, together, what one of them sent
        together = sum(shared[r]["all_to_all"] for r in peers)
        assert together <= 1.02 * before[peers[0]]["all_to_all"], (shared, before)


def test_lora_on_expert_parameters_under_ep_tp(ready, tmp_path) -> None:
    """PEFT ``target_parameters`` at ep=2 x tp=2: each rank holds its ep slice's rows of the expert
    adapters, the tp ranks of a dp rank dispatch their shares of its tokens, and the adapters'
    gradients are summed over edp and tp like the experts'. Where the release's TP plan also cuts
    the experts within each expert on tp too (5.24's experts-TP), both cuts at once: refused."""
    pool, root = ready
    path = models.build("qwen3_moe", root)
    if epwork.expert_axes("qwen3_moe") == ["ep", "tp"]:  # transformers 5.24
        for text in pool.run(epwork.lora_error, path, epwork.EXPERT_TENSORS):
            assert text.startswith("ShardingError: model.layers.1.mlp.experts: PEFT LoRA on the parameter "
                                   "'down_proj' (target_parameters), which hp_lazy cuts S(0) on ep, S(2) on tp of "
                                   "[4, 32, 32]: hp_lazy cuts such adapters where the experts are cut by expert (ep, "
                                   "or Plan.auto's by-expert split over tp) or within each expert on tp alone, not both "
                                   "at once"), text
        return
    epwork.check_lora(pool, path, epwork.lora_reference(path, epwork.batch()), "after", str(tmp_path / "adapter"))


def test_fsdp2_over_ep_tp(ready) -> None:
    """FSDP2 owning dp at ep=2 x tp=2: the layers over dp on top of their tp shards, each experts
    module over its edp mesh — on 5.25 whole on tp, each tp rank dispatching its share of the tokens
    (hp_lazy sums the experts' gradients over tp), on 5.24 cut on tp too; hp_lazy scales FSDP2's
    average over edp to one process's."""
    pool, root = ready
    epwork.check_fsdp(pool, models.build("qwen3_moe", root), epwork.batch())
