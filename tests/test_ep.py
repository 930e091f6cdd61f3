"""Expert parallel at world 2 (ep=2, the two ranks data parallel, each holding half of every
layer's experts and feeding its own row): one process's loss, logits, routing, every gradient
(expert shards gathered by ``hp_lazy.full_grads``) and 3 SGD+weight-decay steps, for Qwen3-MoE
(grouped_mm, eager, batched_mm) and Qwen2-MoE (shared expert); a router hole (every token routed
to rank 0's experts); the collectives per layer; refusals."""

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
    parity.once(pool2, epwork.activate, ep=2)
    return pool2, root


def _check(pool, path: str, impl: str = "grouped_mm") -> dict[str, float]:
    data = epwork.batch()
    ref = epwork.reference(path, data, impl)
    results = pool.run(epwork.train, path, data, impl)
    for got in results:  # routing agreement, fp32: the same top-k experts for every token
        assert len(got["routing"]) == len(ref["routing"]) > 0
        for mine, theirs in zip(got["routing"], ref["routing"], strict=True):
            assert (mine == theirs).all()
        assert models.rel_err(got["loss"], ref["loss"]) <= parity.TOL
        assert models.rel_err(got["logits"], ref["logits"]) <= parity.TOL
        assert models.rel_err(got["norm"], ref["norm"]) <= parity.TOL  # clip_grad_norm_: one process's norm
    return parity.compare(results[0], ref)


@pytest.mark.parametrize(("name", "impl"), [("qwen3_moe", "grouped_mm"), ("qwen3_moe", "eager"),
                                            ("qwen3_moe", "batched_mm"), ("qwen2_moe", "grouped_mm"),
                                            ("deepseek_v2", "grouped_mm"),  # MLA attention, a shared expert
                                            ("gpt_oss", "eager"),  # expert biases, forward(.., router_indices, routing_weights)
                                            ("muse_spark", "eager"), ("muse_spark", "grouped_mm"),  # a norm kept whole in the experts
                                            ("jamba", "grouped_mm")])  # layer classes chosen from a table
def test_ep_matches_one_process(ready, name: str, impl: str) -> None:
    pool, root = ready
    errors = _check(pool, models.build(name, root), impl)
    assert max(errors.values()) <= parity.TOL


def test_the_record_outlives_a_refresh(ready) -> None:
    """One record per bound model (runtime/record): a refresh keeps it and the style instances that
    bound the model, and gives it a new gradient owner with the expert rules."""
    pool, root = ready
    for got in pool.run(epwork.record_across_refresh, models.build("qwen3_moe", root)):
        assert got["same_record"] and got["same_styles"] and got["new_grads"], got
        assert got["axes"] == ["ep"] and got["rules"] == 2  # gate_up_proj and down_proj, summed over edp
        assert got["keys"] == sorted(["_hp_bound", got["owner_key"], "_hp_watch"]), got["keys"]  # one record


def test_fsdp2_with_one_rank_per_expert_slice(ready) -> None:
    """FSDP2 owning dp at ep = dp = 2: each expert slice is held by one rank, so its edp mesh
    (``hp_lazy.mesh().edp_mesh()``) is that rank alone; FSDP2 leaves the slice whole and hp_lazy
    divides its gradient by dp. One process's numbers (``tests/test_ep_fsdp.py``: two ranks per slice)."""
    pool, root = ready
    for got in epwork.check_fsdp(pool, models.build("qwen3_moe", root), epwork.batch()):
        assert all(mesh == ("edp",) and shape[0] == 2 for shape, mesh in got["experts"].values()), got["experts"]


def test_fsdp2_checkpoints_with_one_rank_per_expert_slice(ready, tmp_path) -> None:
    """The checkpoints of that layout (a one-rank edp mesh: FSDP2 keeps each slice whole): AdamW through
    DCP and save_pretrained (:func:`epwork.fsdp_checkpoint_errors`), resumed at the same layout with
    both APIs, under hp_lazy's own dp, in one plain process, and hp_lazy's own checkpoint under FSDP2."""
    pool, root = ready
    errors = epwork.fsdp_checkpoint_errors(pool, models.build("qwen3_moe", root), str(tmp_path))
    print("FSDP2 x ep (edp = 1) resume errors:", errors)
    assert max(v for k, v in errors.items() if "-> same" in k) <= 1e-6, errors  # the same arithmetic
    assert max(errors.values()) <= parity.TOL, errors


@pytest.fixture(scope="module")
def lora_ref(root: str) -> tuple[str, dict]:
    path = models.build("qwen3_moe", root)
    return path, epwork.lora_reference(path, epwork.batch())


@pytest.mark.parametrize("when", ["before", "after"])
def test_lora_on_expert_parameters_matches_one_process(ready, lora_ref, when: str, tmp_path) -> None:
    """PEFT ``target_parameters`` on the experts' 3-D tensors, added before the first forward or
    after ``parallelize``: each rank holds its experts' rows of the adapters (half of lora_A's rows,
    half of lora_B's columns); loss, logits, every adapter gradient and 3 SGD steps equal one
    process's; ``save_pretrained`` writes the one-process adapter a plain PEFT loads;
    ``merge_and_unload`` gives one process's merged weights."""
    pool, _ = ready
    path, ref = lora_ref
    epwork.check_lora(pool, path, ref, when, str(tmp_path / "adapter"))


def test_lora_on_gpt_oss_transposed_experts(ready, tmp_path) -> None:
    """GPT-OSS stores its experts ``[E, in, out]`` (PEFT's ``is_transposed`` order) beside biases the
    adapters leave alone; every layer is an MoE layer."""
    pool, root = ready
    path = models.build("gpt_oss", root)
    ref = epwork.lora_reference(path, epwork.batch(), "eager")
    epwork.check_lora(pool, path, ref, "before", str(tmp_path / "adapter"), impl="eager")


@pytest.mark.parametrize("control", ["unsummed", "contiguous"])
def test_lora_on_expert_parameters_negative_controls(ready, lora_ref, control: str) -> None:
    """The experts' adapters dp-averaged like a dense parameter, or lora_B cut in one block of
    columns (not this rank's experts within each of the r blocks): both differ from one process."""
    pool, _ = ready
    path, ref = lora_ref
    got = pool.run(epwork.lora_train, path, epwork.batch(), "before", "", "grouped_mm", control)[0]
    with pytest.raises(AssertionError, match="relative errors above"):
        parity.compare(got, ref)


@pytest.mark.parametrize("how", ["strip", "second"])
def test_lora_sized_from_a_shard_is_refused(ready, how: str) -> None:
    """An adapter sized from this rank's expert slice (a PEFT that ignores ``ds_shape``, or a second
    adapter PEFT sizes from the wrapper's local ``num_experts``): refused, not trained wrong."""
    pool, root = ready
    tensors = epwork.EXPERT_TENSORS
    for text in pool.run(epwork.lora_error, models.build("qwen3_moe", root), tensors, how):
        assert text.startswith("ShardingError: model.layers.1.mlp.experts: PEFT LoRA on the parameter 'down_proj' "
                               "(target_parameters) has lora_A of shape [4, 32] and lora_B of [32, 4], sized from "
                               "this rank's [2, 32, 32] of the [4, 32, 32] hp_lazy cuts S(0); one process's adapter "
                               "is [8, 32] and [32, 8] (r x 4 experts); add every adapter of these experts at "
                               "once"), text


def test_refresh_keeps_the_expert_rules(ready) -> None:
    """A module registered under the bound model re-binds it (the refresh PEFT, a resized
    embedding or a wrapper set off): expert slices stay summed over their edp ranks, not averaged
    over dp like a dense parameter (every expert gradient was 100% off)."""
    pool, root = ready
    path, data = models.build("qwen3_moe", root), epwork.batch()
    ref = epwork.reference(path, data)
    parity.compare(pool.run(epwork.train, path, data, register=True)[0], ref)


@pytest.mark.parametrize(("name", "impl"), [("qwen3_moe", "eager"), ("qwen3_moe", "grouped_mm"), ("gpt_oss", "eager")])
def test_router_hole(ready, name: str, impl: str) -> None:
    """Every token picks rank 0's experts: rank 1 receives no rows, its experts get zero gradients
    (weight decay still applies), and nothing hangs."""
    pool, root = ready
    path = epwork.hole(models.build(name, root))
    ref = epwork.reference(path, epwork.batch(), impl)
    assert all((idx < 2).all() for idx in ref["routing"])  # the hole is there
    _check(pool, path, impl)


def test_expert_grads_left_none_fail_parity(ready) -> None:
    """Negative control: rank 1's experts receive no rows; tied to the rows only, their gradients stay
    None and weight decay skips them, so the parameters after 3 SGD+wd steps differ from one process's."""
    pool, root = ready
    path = epwork.hole(models.build("qwen3_moe", root))
    ref = epwork.reference(path, epwork.batch(), "eager")
    results = pool.run(epwork.unconnected_experts, path, epwork.batch())
    for name in ("gate_up_proj", "down_proj"):
        key = f"model.layers.1.mlp.experts.{name}"
        assert models.rel_err(results[0]["state"][key], ref["state"][key]) > 1e-3  # measured 2.4e-3 / 3.0e-3 (every other parameter ~1e-7)


def test_collectives_per_layer(ready) -> None:
    pool, root = ready
    counts = pool.run(epwork.count, models.build("qwen3_moe", root), epwork.batch())
    moe_layers = 1  # layer 0 of the tiny Qwen3-MoE is dense
    # per MoE layer: forward the counts and the rows there and back (3 all-to-alls), backward the
    # rows back and there (2); gradients: one bucket averaged over dp (dense), one for the expert
    # shards (edp = 1 rank here: divided by dp, nothing sent) and the loss's none
    assert counts == [{"forward": {"all_to_all": 3 * moe_layers},
                       "backward": {"all_to_all": 2 * moe_layers, "all_reduce": 1}}] * 2


def test_aux_loss_is_global(ready) -> None:
    """output_router_logits=True: the load-balancing aux loss over the global batch (its value in
    out.aux_loss and out.loss on every rank, its gradient one process's)."""
    pool, root = ready
    epwork.check_aux(pool, models.build("qwen3_moe", root), epwork.batch())


def test_local_aux_loss_fails_parity(ready) -> None:
    """Negative control: transformers' aux loss on each rank's own router logits."""
    pool, root = ready
    got, ref = epwork.local_aux(pool, models.build("qwen3_moe", root), epwork.batch())
    with pytest.raises(AssertionError, match=r"relative errors above .*'grad model.layers.1.mlp.gate.weight'"):
        parity.compare(got, ref)


def test_experts_not_divisible_by_ep_refused(ready) -> None:
    pool, root = ready
    out = pool.run(epwork.error, models.build("qwen3_moe3", root), epwork.batch())
    assert all("model.layers.1.mlp.experts (Qwen3MoeForCausalLM): num_experts=3 is not divisible by ep=2; use an "
               "ep that divides 3 (one of [1, 3])" in o for o in out), out


def test_capacity_config_refused(ready) -> None:
    pool, root = ready
    out = pool.run(epwork.error, models.build("qwen3_moe", root), epwork.batch(), router_capacity_factor=1.25)
    assert all("config.router_capacity_factor=1.25 drops tokens beyond an expert capacity, but the ep_dispatch "
               "region is dropless" in o for o in out), out


def _renamed_forward_error(rank: int, world: int, path: str, data) -> str:
    """The error of an experts class whose forward takes other routing arguments (restored after)."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mod

    cls = mod.Qwen3MoeExperts
    original = cls.forward

    def forward(self, hidden_states, expert_ids, expert_weights):
        return original(self, hidden_states, expert_ids, expert_weights)

    cls.forward = forward
    try:
        return epwork.error(rank, world, path, data)
    finally:
        cls.forward = original


def test_experts_forward_it_cannot_read_refused(ready) -> None:
    pool, root = ready
    out = pool.run(_renamed_forward_error, models.build("qwen3_moe", root), epwork.batch())
    assert all("model.layers.1.mlp.experts (Qwen3MoeForCausalLM): the ep_dispatch region replaces a forward(hidden "
               "states [T, H], top-k expert ids [T, K], top-k weights [T, K]) named ('hidden_states', 'top_k_index', "
               "'top_k_weights') or ('hidden_states', 'router_indices', 'routing_weights'), but Qwen3MoeExperts.forward "
               "takes ('hidden_states', 'expert_ids', 'expert_weights'); leave these experts out of ep" in o
               for o in out), out


def _region_refusal(rank: int, world: int, replicated: tuple[str, ...], tp_cut: bool, cut_down: bool = True) -> str:
    """validate() of a real Qwen3-MoE experts module on the ep group against a hand-made contract."""
    import types

    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    import hp_lazy
    from hp_lazy.errors import ShardingError
    from hp_lazy.plan.model import Contract, Region
    from hp_lazy.plan.placement import Shard
    from hp_lazy.runtime.ep.style import ExpertParallelStyle

    config = transformers.Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4)
    axes = {"ep": Shard(0), **({"tp": Shard(1)} if tp_cut else {})}
    params = {"gate_up_proj": axes, **({"down_proj": {"ep": Shard(0)}} if cut_down else {})}
    contract = Contract(pattern="model.layers.*.mlp.experts", params=params,
                        region=Region(kind="ep_dispatch", replicated=replicated))
    ctx = types.SimpleNamespace(groups={"ep": hp_lazy.mesh().group("ep")}, root=Qwen3MoeExperts(config))
    try:
        ExpertParallelStyle().validate("model.layers.1.mlp.experts", ctx.root, contract, ctx)  # type: ignore[arg-type]
    except ShardingError as error:
        return str(error)
    return "accepted"


def test_region_replicated_names_are_checked(ready) -> None:
    pool, _ = ready
    assert pool.run(_region_refusal, ("post_norm",), False)[0] == (
        "model.layers.1.mlp.experts (Qwen3MoeExperts): the plan keeps ['post_norm'] whole on every ep rank, but "
        "Qwen3MoeExperts has no such parameter or submodule with parameters; fix the plan")
    assert pool.run(_region_refusal, ("down_proj",), True, False)[0] == (
        "model.layers.1.mlp.experts (Qwen3MoeExperts): the plan keeps ['down_proj'] whole inside experts it also "
        "cuts on tp (['gate_up_proj']): they would run on each tp rank's partial expert outputs, which is not one "
        "process's math; leave the experts unsharded on tp (drop their TP entries) or train without tp")
    assert pool.run(_region_refusal, ("down_proj",), False)[0] == (
        "model.layers.1.mlp.experts (Qwen3MoeExperts): the plan both cuts ['down_proj'] on ep and keeps them whole "
        "on every rank (region \"replicated\"); an expert shard is one or the other: remove it from one of the two")
    assert pool.run(_region_refusal, ("down_proj",), False, False)[0] == "accepted"  # Muse Spark's layout
