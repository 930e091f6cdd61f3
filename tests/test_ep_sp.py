"""Expert parallel with sequence parallel: ep=2 x tp=2 on 4 ranks, ``activate("auto", ep=2, tp=2,
sequence_parallel=True)`` (dp=2, the ep group carved out of the two dp ranks of each tp rank).
Between the tp boundaries each tp rank holds a piece of its dp rank's sequence, and the experts
(cut on ep, whole on tp: transformers 5.25's plans) take that piece's rows: each tp rank dispatches
its own rows over its ep group, and nothing moves over tp at the experts. Against one process:
loss, logits, routing, every gradient and 3 SGD+wd steps (Qwen3-MoE with 8 experts, Qwen2-MoE's
shared expert, GPT-OSS's biased experts, DeepSeek-V2's MLA, GLM-4-MoE's sigmoid router and
correction bias), the aux loss global over dp and tp, ``hp_lazy.expert_load`` over the tp pieces
too. Bytes: each rank dispatches exactly its piece's (token, slot) pairs. Negative controls: the
tp ranks' rows treated as shared tokens (the ep x tp layout without sp) and the aux loss from each
rank's own tokens. At world 8, ep=2 x cp=2 x tp=2 with sequence parallel: the same numbers and the
aux loss global over dp, cp and tp."""

from __future__ import annotations

import dataclasses
from typing import Any

import epwork
import models
import parity
import pytest
import test_ep_deepseek
from dist import DistPool, pool_fixture

pool4 = pool_fixture(4, timeout=180)
pool8 = pool_fixture(8, timeout=240)  # ep=2 x cp=2 x tp=2


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture
def ready(pool4: DistPool, root: str):
    """Activated per test: a pool restarts its workers after a worker error."""
    parity.once(pool4, epwork.activate, ep=2, tp=2, sequence_parallel=True)
    return pool4, root


@pytest.mark.parametrize(("name", "impl"), [("qwen3_moe8", "grouped_mm"), ("qwen2_moe", "eager"),
                                            ("deepseek_v2", "grouped_mm")])
def test_ep_tp_sp_matches_one_process(ready, name: str, impl: str) -> None:
    """Also torch's stock ``clip_grad_norm_`` on every rank: one process's norm."""
    pool, root = ready
    results, ref = epwork.check(pool, models.build(name, root), impl, sequence=True)
    for got in results:
        assert models.rel_err(got["norm"], ref["norm"]) <= parity.TOL


def test_compiled(ready) -> None:
    """``model.compile()``: one process's numbers; the only graph breaks are the experts modules'
    dispatch (run eagerly, as under ep alone): sequence parallel adds none."""
    pool, root = ready
    results, _ = epwork.check(pool, models.build("qwen3_moe8", root), compile="eager", sequence=True)
    for got in results:
        reasons = {reason.split("\n")[0] for reason in got["graph_breaks"]}
        assert reasons == {"Skip calling `torch.compiler.disable()`d function"}, got["graph_breaks"]


def test_experts_outside_any_split_stack_share_the_tokens(ready) -> None:
    """GPT-OSS's TP plan cuts the embedding only: no boundary in its layers, so sequence parallel cuts
    nothing there, the tp ranks hold the same tokens and split them between them (ep x tp's layout)."""
    pool, root = ready
    epwork.check(pool, models.build("gpt_oss", root), "eager")


def test_sigmoid_router_and_expert_load(ready) -> None:
    """GLM-4-MoE (sigmoid scores, correction bias, group top-k, a shared expert): one process's numbers,
    and aux-loss-free balancing from ``hp_lazy.expert_load``, which sums the counts over dp and over
    the tp pieces: one process's loads, the biases bit-identical to one process's on every rank."""
    import torch

    pool, root = ready
    path, data = test_ep_deepseek.build("glm4_moe", root), epwork.batch()
    epwork.check(pool, path, sequence=True)
    ref = epwork.balance_ref(path, data)
    router = test_ep_deepseek.ROUTER
    for got in pool.run(epwork.balance_ep, path, data):
        for mine, theirs in zip(got["loads"], ref["loads"], strict=True):
            assert torch.equal(mine[router], theirs[router])
        assert torch.equal(got["biases"][router], ref["biases"][router])


def test_aux_loss_is_global(ready) -> None:
    """Counts summed over dp and tp (each tp rank routes its piece), the part scaled by dp."""
    pool, root = ready
    epwork.check_aux(pool, models.build("qwen3_moe8", root), epwork.batch(), sequence=True)


def test_negative_control_local_aux_loss(ready) -> None:
    pool, root = ready
    got, ref = epwork.local_aux(pool, models.build("qwen3_moe8", root), epwork.batch(), sequence=True)
    assert models.rel_err(got["aux"], ref["aux"]) > 1e-4
    with pytest.raises(AssertionError, match=r"relative errors above .*'grad model.layers.\d.mlp.gate.weight'"):
        parity.compare(got, ref)


def train_shared(rank: int, world: int, path: str, data: dict[str, Any]) -> dict[str, Any]:
    """Negative control: each experts module's tp ranks taken to hold the same tokens (ep x tp's
    layout without sequence parallel: each dispatches half its rows and the outputs are joined over tp)."""
    import hp_lazy
    from hp_lazy.names import EP_DISPATCH

    model = hp_lazy.parallelize(epwork.load(path))
    for module in model.modules():
        spec = module.__dict__.get(EP_DISPATCH)
        if spec is not None:
            module.__dict__[EP_DISPATCH] = dataclasses.replace(spec, split=spec.pieces, pieces=None)
    dp, gather, mean = epwork._dp_tools()
    per = data["input_ids"].shape[0] // dp.size
    return epwork.run(model, data, rows=slice(dp.rank * per, (dp.rank + 1) * per), gather=gather, mean=mean,
                      full_grads=hp_lazy.full_grads, full_state_dict=hp_lazy.full_state_dict,
                      join_routing=epwork._tp_sequence(gather))


def test_negative_control_rows_taken_as_shared(ready) -> None:
    pool, root = ready
    path, data = models.build("qwen3_moe8", root), epwork.batch()
    ref = epwork.reference(path, data)
    got = pool.run(train_shared, path, data)[0]
    assert models.rel_err(got["loss"], ref["loss"]) > parity.TOL
    with pytest.raises(AssertionError, match=r"relative errors above .*'grad model.layers.\d.mlp.experts"):
        parity.compare(got, ref)


def sent_rows(rank: int, world: int, path: str, data: dict[str, Any]) -> dict[str, Any]:
    """Per all-to-all torch runs in one forward and backward on this dp rank's rows: the rows this rank
    puts in, and the tp collectives inside the experts modules (counted at torch.distributed)."""
    import torch.distributed as tdist

    import hp_lazy
    from hp_lazy.runtime.comm import wire

    model = hp_lazy.parallelize(epwork.load(path))
    tp = hp_lazy.mesh().group("tp").pg
    inside = [False]
    counted: dict[str, Any] = {"rows": [], "tp inside experts": 0}
    real_a2a, real_ag = tdist.all_to_all_single, wire._gather_single

    def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if input_split_sizes is not None:  # the rows (the counts' exchange is uniform)
            counted["rows"].append(input.shape[0])
        return real_a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    def ag(output, input, group=None, async_op=False):
        counted["tp inside experts"] += int(inside[0] and group is tp)
        return real_ag(output, input, group=group, async_op=async_op)

    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            module.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
            module.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    dp, _, _ = epwork._dp_tools()
    per = data["input_ids"].shape[0] // dp.size
    tdist.all_to_all_single, wire._gather_single = a2a, ag
    try:
        model(**{k: v[dp.rank * per : (dp.rank + 1) * per] for k, v in data.items()}).loss.backward()
    finally:
        tdist.all_to_all_single, wire._gather_single = real_a2a, real_ag
    return counted


def test_each_tp_rank_dispatches_its_own_rows(ready) -> None:
    """Forward, each MoE layer's first all-to-all carries exactly this rank's piece's (token, slot)
    pairs: its dp row's S / tp tokens times top-k (the tp pair together send their row once, as ep x tp
    sends it); nothing is gathered over tp inside the experts (ep x tp without sp gathers their output)."""
    pool, root = ready
    config = {**models.BASE, **models.MORE_CONFIGS["qwen3_moe8"][1]}
    data = epwork.batch()
    pairs = data["input_ids"].shape[1] // 2 * config["num_experts_per_tok"]  # one dp row, half the sequence
    for got in pool.run(sent_rows, models.build("qwen3_moe8", root), data):
        layers = len(got["rows"]) // 4  # forward: rows there and back; backward: the same two
        assert layers == config["num_hidden_layers"] and got["rows"][0::4] == [pairs] * layers, got
        assert got["tp inside experts"] == 0, got


def test_sft_trainer(ready, tmp_path) -> None:
    """TRL's ``SFTTrainer`` on Qwen3-MoE (it turns the aux loss on): loss, grad norm, entropy, token
    accuracy and every parameter after 3 steps against one process."""
    pytest.importorskip("trl")
    import trlwork

    pool, root = ready
    path = models.build("qwen3_moe", root)
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"))
    got = pool.run(trlwork.sft, path, str(tmp_path / "hp"))
    trlwork.compare(got[0], ref)
    for other in got[1:]:
        trlwork.compare(other, {k: v for k, v in ref.items() if k != "state"})


def test_ep_cp_tp_sp_world8(pool8: DistPool, root: str) -> None:
    """ep=2 x cp=2 x tp=2 on 8 ranks: each cp rank's zigzag rows, cut over tp, dispatched over ep (the
    dp pair); the aux loss's counts summed over dp, cp and tp (both rows padded alike: each dp rank's
    loss is over as many labels)."""
    pool = parity.once(pool8, epwork.activate, ep=2, cp=2, tp=2, sequence_parallel=True)
    path, data = models.build("qwen3_moe8", root), epwork.batch()
    epwork.check(pool, path, sequence=True)
    mask = data["input_ids"].new_ones(data["input_ids"].shape)
    mask[:, -5:] = 0
    data["labels"][:, -5:] = -100
    epwork.check_aux(pool, path, {**data, "attention_mask": mask}, sequence=True)


def test_stock_trainer_with_aux_loss(pool4: DistPool, root: str, tmp_path) -> None:
    """The stock ``Trainer`` with ``output_router_logits=True``: the aux loss weighed once, one
    process's over the global batch (losses, logged grad norms, parameters)."""
    import trainwork

    path = models.build("qwen3_moe_aux", root)
    ref = trainwork.trainer(0, 1, path, str(tmp_path / "ref"))
    pool = parity.once(pool4, epwork.activate, ep=2, tp=2, sequence_parallel=True)
    got = pool.run(trainwork.trainer, path, str(tmp_path / "hp"))
    trainwork.compare_trainer(got[0], ref)


def test_stock_trainer_resumes(pool4: DistPool, root: str, tmp_path) -> None:
    """save_steps=2 with the optimizer state (each rank's expert slices through
    torch.distributed.checkpoint), then resume_from_checkpoint, against one process doing the same."""
    import trainwork

    path = models.build("qwen3_moe", root)
    ref = trainwork.trainer_resume(0, 1, path, str(tmp_path / "ref"), optim="adamw_torch")
    pool = parity.once(pool4, epwork.activate, ep=2, tp=2, sequence_parallel=True)
    got = pool.run(trainwork.trainer_resume, path, str(tmp_path / "hp"), optim="adamw_torch")
    assert "optimizer_dcp" in got[0]["files"]
    for run in ("straight", "resumed"):
        assert all(models.rel_err(g[run]["loss"], ref[run]["loss"]) <= parity.TOL for g in got)
        errors = {n: models.rel_err(got[0][run]["state"][n], v) for n, v in ref[run]["state"].items()}
        assert max(errors.values()) <= trainwork.TOL["adamw_torch"], (run, max(errors.items(), key=lambda kv: kv[1]))
