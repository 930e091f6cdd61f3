"""Shard-on-read: under an active plan, ``from_pretrained`` materialises on each rank only its own
slice of every planned parameter (transformers' own tp loader reads the slices): the local shards
equal the slices of the full checkpoint — dense, packed experts, tied and K/V heads — with
``dtype`` conversion and from a checkpoint in several files, and no shard's storage is larger than
the shard."""

from __future__ import annotations

import models
import parity
import pytest
import torch
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)
pool_ep = pool_fixture(2, timeout=120)
pool_ep_tp = pool_fixture(4, timeout=180)


def _loaded(rank: int, world: int, path: str, dtype: str) -> dict:
    import transformers

    import hp_lazy
    from hp_lazy.names import LAID_OUT

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    laid_out = model.__dict__.get(LAID_OUT)
    table = laid_out.table if laid_out is not None else None
    params = dict(model.named_parameters(remove_duplicate=False))
    shards = {name: params[name].detach().clone() for name in (table or ())}
    oversized = {
        name: (params[name].untyped_storage().nbytes(), params[name].numel() * params[name].element_size())
        for name in (table or ())
        if params[name].untyped_storage().nbytes() != params[name].numel() * params[name].element_size()
    }
    hp_lazy.parallelize(model)
    ids = models.batch()
    loss = float(model(input_ids=ids, labels=ids).loss)
    return {"shards": shards, "layouts": {n: table.get(n) for n in (table or ())}, "oversized": oversized,
            "dtypes": {str(p.dtype) for p in params.values()}, "loss": loss}


def _check(got: list[dict], path: str, dtype: str) -> None:
    import transformers

    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    full = dict(plain.named_parameters(remove_duplicate=False))
    ids = models.batch()
    with torch.no_grad():
        ref_loss = float(plain(input_ids=ids, labels=ids).loss)
    for rank, result in enumerate(got):
        assert result["shards"], "nothing was sharded on read"
        assert not result["oversized"], result["oversized"]
        assert result["dtypes"] == {str(getattr(torch, dtype))}
        for name, shard in result["shards"].items():
            layout = result["layouts"][name]
            assert tuple(shard.shape) == layout.local_shape and shard.shape != full[name].shape, name
            assert torch.equal(shard, layout.local(full[name].detach())), (rank, name)
        assert abs(result["loss"] - ref_loss) <= 1e-5 * abs(ref_loss) if dtype == "float32" else True


@pytest.mark.parametrize("name", ["llama", "gemma", "qwen3_moe"])
def test_local_shards_are_the_checkpoint_slices(pool2: DistPool, refs, name: str) -> None:
    path, _ = refs(name)
    _check(parity.activated(pool2, tp=2).run(_loaded, path, "float32"), path, "float32")


def test_dtype_and_a_checkpoint_in_several_files(pool2: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama")
    sharded = str(tmp_path / "sharded")
    parity._load(path).save_pretrained(sharded, max_shard_size="40KB")
    _check(parity.activated(pool2, tp=2).run(_loaded, sharded, "bfloat16"), sharded, "bfloat16")


def _inner_first(rank: int, world: int, path: str) -> str:
    import hp_lazy
    from hp_lazy.errors import ShardingError

    model = parity._load(path)
    try:
        hp_lazy.parallelize(model.model)
    except ShardingError as error:
        return str(error)
    return "not refused"


def test_binding_a_submodule_of_a_model_laid_out_on_load_is_refused(pool2: DistPool, refs) -> None:
    path, _ = refs("llama")
    assert parity.activated(pool2, tp=2).run(_inner_first, path) == [
        "LlamaModel: from_pretrained laid this module out as part of LlamaForCausalLM (its parameters are "
        "already this rank's shards); call parallelize on that top-level model"
    ] * 2


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2"])
def test_expert_slices_are_read_on_their_own_ranks(pool_ep: DistPool, refs, name: str) -> None:
    """ep=2: each rank reads half of every layer's experts (DTensors on the expert mesh)."""
    import epwork

    path, _ = refs(name)
    got = parity.once(pool_ep, epwork.activate, ep=2).run(_loaded, path, "float32")
    assert all(any("experts" in n for n in g["shards"]) for g in got)
    _check(got, path, "float32")


def test_expert_slices_under_ep_and_tp_are_read_on_their_own_ranks(pool_ep_tp: DistPool, refs) -> None:
    """ep=2 x tp=2: experts cut on ep and, the packed gate_up as two blocks, on tp."""
    import epwork

    path, _ = refs("qwen3_moe8")
    got = parity.once(pool_ep_tp, epwork.activate, ep=2, tp=2).run(_loaded, path, "float32")
    layouts = got[0]["layouts"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert [cut.axis for cut in layouts.shards] == ["ep", "tp"] and layouts.shards[1].blocks == 2
    _check(got, path, "float32")
