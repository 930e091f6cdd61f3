"""Experts split by expert over the tp ranks (``Plan.auto(tp=N)``'s region ``tp_experts``, read
from the release's ``base_model_ep_plan`` on transformers 5.24 and 5.25 alike): each tp rank holds
``1/N`` of the experts whole and runs the (token, slot) pairs routed to them; the exit all-reduce
sums the ranks' parts. One process's loss, logits, routing, every gradient and 3 SGD+wd steps;
expert bytes per rank ``1/N`` (``hp_lazy.layout``); no all-to-all; a confused expert range fails."""

from __future__ import annotations

import epwork
import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)


@pytest.fixture(scope="module")
def tp2(pool2: DistPool, tmp_path_factory):
    return parity.once(pool2, epwork.activate, tp=2), str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tp4(pool4: DistPool, tmp_path_factory):
    return parity.once(pool4, epwork.activate, tp=4), str(tmp_path_factory.mktemp("models"))


def _experts(name: str) -> int:
    extra = models.MORE_CONFIGS[name][1]
    return extra.get("num_experts") or extra.get("num_local_experts") or extra["n_routed_experts"]


@pytest.mark.parametrize(("name", "impl"), [("qwen3_moe8", "grouped_mm"), ("qwen2_moe", "eager"),
                                            ("gpt_oss", "eager"), ("glm4_moe_lite", "grouped_mm"),
                                            ("minicpm5_moe", "eager")])
def test_tp2_matches_one_process(tp2, name: str, impl: str) -> None:
    """Qwen3-MoE (grouped_mm kernel), Qwen2-MoE (shared expert), GPT-OSS (expert biases, its
    router_indices / routing_weights names), GLM-4-MoE-Lite (MLA heads beside, sigmoid routing),
    MiniCPM5-MoE (transformers 5.25's unit_colwise K/V projections)."""
    models.skip_unless_released(name)
    pool, root = tp2
    results, ref = epwork.check(pool, models.build(name, root), impl)
    assert results[0]["local_experts"] == [_experts(name) // 2] * len(ref["routing"])


@pytest.mark.parametrize(("name", "impl"), [("qwen3_moe8", "grouped_mm"), ("gpt_oss", "eager"),
                                            ("minicpm5_moe", "eager")])
def test_tp4_matches_one_process(tp4, name: str, impl: str) -> None:
    """MiniCPM5-MoE at tp=4: 2 K/V heads, each on two ranks (what unit_colwise asks for)."""
    models.skip_unless_released(name)
    pool, root = tp4
    results, ref = epwork.check(pool, models.build(name, root), impl)
    assert results[0]["local_experts"] == [_experts(name) // 4] * len(ref["routing"])


def test_expert_bytes_per_rank_and_collectives(tp2) -> None:
    """Every expert parameter: this rank holds half its bytes; one all-reduce per MoE layer out
    (the exit's) and no all-to-all: the tokens are already on every tp rank."""
    pool, root = tp2
    got = pool.run(epwork.held, models.build("qwen3_moe8", root))
    for mine in got:
        assert mine["experts"] and all(2 * held == full for held, full in mine["experts"].values()), mine["experts"]
        assert "all_to_all" not in mine["ops"]["forward"] and "all_to_all" not in mine["ops"]["backward"]
        assert "model.layers.0.mlp.experts.gate_up_proj" in mine["text"] and "0.500x" in mine["text"]
        assert mine["warnings"] == []  # hp_lazy's own collectives raise no deprecation warning
    assert got[0]["held"] < 0.6 * got[0]["full"], got[0]


def test_confused_expert_ranges_fail_parity(tp2) -> None:
    """Negative control: every rank runs its pairs as if it held the first experts."""
    pool, root = tp2
    path = models.build("qwen3_moe8", root)
    data = epwork.batch()
    ref = epwork.reference(path, data, "eager")
    got = pool.run(epwork.train_misrouted, path, data)[0]
    assert models.rel_err(got["loss"], ref["loss"]) > parity.TOL
    with pytest.raises(AssertionError, match="experts"):
        parity.compare(got, ref)


def test_lora_on_experts_split_over_tp(tp2, tmp_path) -> None:
    """PEFT ``target_parameters`` on experts split by expert over tp: each tp rank holds its experts'
    rows of the adapters, and the entry's backward sums the ranks' parts of every input the experts
    take (the routing weights too: a PEFT layer passes them through positionally)."""
    pool, root = tp2
    path = models.build("qwen3_moe", root)
    ref = epwork.lora_reference(path, epwork.batch())
    epwork.check_lora(pool, path, ref, "before", str(tmp_path / "adapter"))


def test_llama4_transposed_experts_match_one_process(refs, pool2: DistPool) -> None:
    """Llama 4's experts are stored ``[E, in, out]`` and planned 'packed_rowwise' (gate_up_proj: its
    packed output dim cut) beside 'colwise' (down_proj: its intermediate dim cut), under
    'moe_tp_experts': every rank runs its slice of every expert; and Llama4ForConditionalGeneration's
    own ``_tp_plan['lm_head']`` names no module of it (its head is language_model's)."""
    world = 2
    pool = parity.activated(pool2, sequence_parallel=False)
    errors = parity.check_parity(pool, refs, "llama4")
    assert len(errors) > 10 and max(errors.values()) <= parity.TOL
    experts = [n for n in refs("llama4")[1]["grads"] if ".experts." in n]
    assert experts and all(shapes[n] == _llama4_local(n, world) for shapes in pool.run(_shapes, refs("llama4")[0])
                           for n in experts)


def test_lora_on_experts_cut_within_each_expert(refs, pool2: DistPool, tmp_path) -> None:
    """Llama 4's experts cut within each expert (gate_up_proj ``[E, H, 2I]`` on its packed last dim,
    down_proj ``[E, I, H]`` on its middle dim). PEFT reads them as ``[E, out, in]`` (they carry no
    ``is_transposed``), so gate_up_proj's cut is of PEFT's input dim: lora_A's columns, packed alike;
    down_proj's of its output dim: lora_B's rows. The factor left whole holds a partial gradient,
    summed over tp like any whole parameter of the boundary. One process's numbers."""
    pool = parity.activated(pool2, sequence_parallel=False)
    path = refs("llama4")[0]
    tensors = ("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj")

    def local(name: str, full: tuple[int, ...]) -> tuple[int, ...]:
        gate_up = ".base_layer.lora_" in name  # the inner wrapper: PEFT nests the first target innermost
        if gate_up and ".lora_A." in name:
            return (full[0], full[1] // 2)
        if not gate_up and ".lora_B." in name:
            return (full[0] // 2, full[1])
        return full

    ref = epwork.lora_reference(path, epwork.batch(), None, tensors)
    epwork.check_lora(pool, path, ref, "before", str(tmp_path / "adapter"), local, None, tensors)


def _llama4_local(name: str, world: int) -> tuple[int, ...]:
    """[E, hidden, 2 * inter] -> [E, hidden, 2 * inter / tp]; [E, inter, hidden] -> [E, inter / tp, hidden]."""
    experts, hidden, inter = 4, 32, 64
    if name.endswith("gate_up_proj"):
        return (experts, hidden, 2 * inter // world)
    return (experts, inter // world, hidden)


def _shapes(rank: int, world: int, path: str) -> dict[str, tuple[int, ...]]:
    model = parity._load(path)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}
