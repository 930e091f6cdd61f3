"""dp x tp at world 4 (tp=2, dp=2): two tensor-parallel groups ({0, 1} and {2, 3}), each dp rank
feeding its own rows of one global batch; gradients reduced over dp by hp_lazy itself (the
default), by torch DDP or by FSDP2 (``data_parallel=False``), against one process over the whole
batch: loss, every gradient, three optimizer steps. Qwen3's q/k norms hold partial gradients
over tp, which must compose with the dp reduction."""

from __future__ import annotations

import dpwork
import epwork
import models
import parity
import pytest
import torch
from dist import DistPool, WorkerError, pool_fixture

pool4 = pool_fixture(4, timeout=240)


def _shards(rank: int, world: int, path: str) -> dict:
    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    mesh = hp_lazy.mesh()  # what a user hands DDP: mesh.group("dp").pg
    return {"q": model.model.layers[0].self_attn.q_proj.weight.detach().clone(),
            "tp_rank": mesh.group("tp").rank, "dp_rank": mesh.group("dp").rank}


def test_two_tp_groups_in_a_four_rank_world(pool4: DistPool, refs) -> None:
    parity.activated(pool4, tp=2)
    errors = parity.check_parity(pool4, refs, "llama")  # every rank's logits and loss, rank 0's grads
    assert max(errors.values()) <= parity.TOL
    path, _ = refs("llama")
    got = pool4.run(_shards, path)
    assert [(g["dp_rank"], g["tp_rank"]) for g in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert torch.equal(got[0]["q"], got[2]["q"]) and torch.equal(got[1]["q"], got[3]["q"])
    assert not torch.equal(got[0]["q"], got[1]["q"])


def _check(pool4: DistPool, refs, name: str, wrap: str, kind: str = "sgd", micro: int = 1) -> list[dict]:
    parity.activated(pool4, tp=2)
    return dpwork.check(pool4, refs, name, wrap, dp=2, kind=kind, micro=micro)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_hp_lazy_owns_dp(pool4: DistPool, refs, name: str) -> None:
    got = _check(pool4, refs, name, "hp")
    # backward: 2L+1 tp all-reduces (L=2) plus one per gradient bucket (dp, and dp x tp for
    # Qwen3's q/k norms), and nothing else
    buckets = got[0]["buckets"]
    assert buckets == (2 if name == "qwen3" else 1)
    assert [g["backward"] for g in got] == [{"all_reduce": 5 + buckets}] * 4


def test_moe_aux_loss_is_global_over_dp(pool4: DistPool, tmp_path_factory) -> None:
    """``output_router_logits=True``: tp peers route the same rows, dp ranks different ones; the
    aux loss is one process's over the global batch (counts all-reduced over dp)."""
    parity.activated(pool4, tp=2)
    epwork.check_aux(pool4, models.build("qwen3_moe", str(tmp_path_factory.mktemp("moe"))), epwork.batch())


def test_hp_lazy_owns_dp_adamw_with_accumulation(pool4: DistPool, refs) -> None:
    _check(pool4, refs, "qwen3", "hp", kind="adamw", micro=2)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_torch_ddp_over_the_dp_group(pool4: DistPool, refs, name: str) -> None:
    _check(pool4, refs, name, "ddp")


def test_torch_ddp_with_accumulation(pool4: DistPool, refs) -> None:
    _check(pool4, refs, "qwen3", "ddp", kind="adamw", micro=2)


def test_fsdp2_over_the_dp_submesh(pool4: DistPool, refs) -> None:
    _check(pool4, refs, "qwen3", "fsdp")


def test_nobody_reducing_dp_fails(pool4: DistPool, refs) -> None:
    """Negative control: with data_parallel=False and no wrapper, dp ranks keep their own gradients."""
    with pytest.raises(AssertionError, match="relative errors above"):
        _check(pool4, refs, "llama", "none")


def _wrapped_over_own_dp(rank: int, world: int, path: str, wrap: str) -> None:
    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))  # data_parallel=True: hp_lazy averages over dp
    net = dpwork._wrapped(model, wrap)
    ids = dpwork.global_batch(2)[:2]
    net(input_ids=ids, labels=ids)


@pytest.mark.parametrize(("wrap", "text"), [
    ("ddp", r"runs inside torch DistributedDataParallel, but hp_lazy already averages"),
    ("fsdp", r"was replaced after hp_lazy bound the model \(by FSDP2's fully_shard\?\)"),
])
def test_a_dp_wrapper_on_top_of_hp_lazy_dp_is_refused(pool4: DistPool, refs, wrap: str, text: str) -> None:
    parity.activated(pool4, tp=2)
    path, _ = refs("qwen3")
    with pytest.raises(WorkerError, match=text):
        pool4.run(_wrapped_over_own_dp, path, wrap)


def _wrapped_over_the_world(rank: int, world: int, path: str, wrap: str) -> None:
    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path), data_parallel=False)
    net = dpwork._wrapped(model, wrap)
    ids = dpwork.global_batch(2)[:2]
    net(input_ids=ids, labels=ids)


@pytest.mark.parametrize(("wrap", "text"), [
    ("ddp_default", r"inside torch DistributedDataParallel over ranks \[0, 1, 2, 3\], but its parameters are shards "
                    r"that only the data-parallel ranks \[\d, \d\] hold alike .* process_group=hp_lazy.mesh\(\).group\('dp'\).pg"),
    ("fsdp_default", r"LlamaForCausalLM is sharded by FSDP2 over ranks \[0, 1, 2, 3\], but hp_lazy's shards are held alike only by the "
                     r"data-parallel ranks \[\d, \d\]; pass fully_shard\(module, mesh=hp_lazy.mesh\(\).device_mesh\['dp'\]\)"),
])
def test_a_dp_wrapper_over_the_whole_world_is_refused(pool4: DistPool, refs, wrap: str, text: str) -> None:
    """``DistributedDataParallel(model)`` without ``process_group`` (or FSDP2 on the default mesh)
    with data_parallel=False: refused at the first forward, naming the group to pass (DDP
    averaged different tp shards together, silently)."""
    parity.activated(pool4, tp=2)
    path, _ = refs("llama")
    with pytest.raises(WorkerError, match=text):
        pool4.run(_wrapped_over_the_world, path, wrap)
