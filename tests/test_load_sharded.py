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
    from hp_lazy.runtime import record

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    laid_out = record.of(model)  # laid out at load, bound at the first forward
    assert laid_out is not None and not laid_out.bound
    table = laid_out.table
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
    """ep=2 x tp=2: experts cut on ep and, where the release's TP plan still has experts-TP entries
    (transformers 5.24), the packed gate_up as two blocks on tp."""
    import epwork

    path, _ = refs("qwen3_moe8")
    got = parity.once(pool_ep_tp, epwork.activate, ep=2, tp=2).run(_loaded, path, "float32")
    layouts = got[0]["layouts"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert [cut.axis for cut in layouts.shards] == epwork.expert_axes("qwen3_moe")
    assert layouts.shards[-1].blocks == (2 if len(layouts.shards) == 2 else 1)
    _check(got, path, "float32")


def _loaded_without_whole_reads(rank: int, world: int, path: str) -> dict:
    """Negative control: every converted parameter read in slices (hp_lazy's whole read switched off)."""
    from hp_lazy.runtime.checkpoint import convert

    original = convert.rebuilt
    convert.rebuilt = lambda mapping, names: set()
    try:
        return _loaded(rank, world, path, "float32")
    finally:
        convert.rebuilt = original


def test_tensors_a_conversion_rebuilds_are_read_whole(pool2: DistPool, tmp_path) -> None:
    """HRM's checkpoint fuses gate/q/k/v (attn.gqkv_proj) and gate/up, which transformers chunks on
    load: a slice of the fused tensor is not a slice of q, so these are read whole and sliced after;
    read in slices (the negative control) they load rows of the wrong projection, silently."""
    path = models.build("hrm_text", str(tmp_path))
    pool = parity.activated(pool2, tp=2)
    got = pool.run(_loaded, path, "float32")
    assert any(".self_attn.k_proj." in n for n in got[0]["shards"])
    _check(got, path, "float32")
    with pytest.raises(AssertionError, match=r"\(0, 'model\.[LH]_module\.layers\.\d\.(self_attn|mlp)\.\w+_proj\.weight'\)"):
        _check(pool.run(_loaded_without_whole_reads, path), path, "float32")


# --------------------------------------------------------------------------- a transposed checkpoint

VL_TEXT = dict(vocab_size=models.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32, max_position_embeddings=64,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
VL_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                 deepstack_visual_indexes=[0])


@pytest.fixture(scope="module")
def vl_moe(tmp_path_factory) -> dict[str, str]:
    """Qwen3-VL-MoE (transformers transposes its experts on load: Transpose(1, 2, check_dims=True)),
    saved as save_pretrained writes it (the model's layout: gate_up [E, 2I, H] = 4 x 64 x 32, down
    [E, H, I] = 4 x 32 x 32) and as its released checkpoints store it (transposed: gate_up 4 x 32 x 64)."""
    import os

    import transformers
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("vl")
    config = transformers.Qwen3VLMoeConfig(text_config=VL_TEXT, vision_config=VL_VISION)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config)
    model.save_pretrained(root / "model_layout")
    stored = load_file(str(root / "model_layout" / "model.safetensors"))
    transposed = {k: (v.transpose(1, 2).contiguous() if ".experts." in k else v) for k, v in stored.items()}
    assert any(v.shape != stored[k].shape for k, v in transposed.items())
    os.makedirs(root / "transposed")
    save_file(transposed, str(root / "transposed" / "model.safetensors"), metadata={"format": "pt"})
    (root / "transposed" / "config.json").write_text((root / "model_layout" / "config.json").read_text())
    return {"model_layout": str(root / "model_layout"), "transposed": str(root / "transposed")}


def _vl_shards(rank: int, world: int, path: str, keep_transformers_transpose: bool = False) -> dict:
    """This rank's expert shards after ``from_pretrained`` (or the error's text); with
    ``keep_transformers_transpose`` hp_lazy's stored-layout decision is switched off (negative control)."""
    import contextlib

    import transformers

    from hp_lazy.runtime import record
    from hp_lazy.runtime.checkpoint import convert

    original = convert.local_transpose
    if keep_transformers_transpose:
        convert.local_transpose = lambda files: contextlib.nullcontext()
    try:
        model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001 - the text is the result
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        convert.local_transpose = original
    table = record.of(model).table
    params = dict(model.named_parameters())
    return {"shards": {n: params[n].detach().clone() for n in table if ".experts." in n},
            "layouts": {n: table.get(n) for n in table if ".experts." in n}}


def _vl_reference(path: str) -> dict[str, torch.Tensor]:
    import transformers

    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)
    return {n: p.detach() for n, p in model.named_parameters() if ".experts." in n}


@pytest.mark.parametrize("stored", ["model_layout", "transposed"])
def test_transposed_experts_read_under_ep(pool_ep: DistPool, vl_moe, stored: str) -> None:
    """ep cuts dim 0, which the transpose leaves alone: the slice is kept (model layout) or transposed."""
    import epwork

    full = _vl_reference(vl_moe[stored])
    got = parity.once(pool_ep, epwork.activate, ep=2).run(_vl_shards, vl_moe[stored])
    for result in got:
        assert len(result["shards"]) == 4
        for name, shard in result["shards"].items():
            assert shard.shape[0] == 2 and torch.equal(shard, result["layouts"][name].local(full[name])), name


def test_transposed_experts_read_under_tp(pool2: DistPool, vl_moe) -> None:
    """tp splits the experts by expert (dim 0, region tp_experts), which the transpose leaves alone:
    a checkpoint in the model's layout and a transposed one (as Qwen3-VL-MoE's releases store it)
    both read this rank's experts, each rank half of them."""
    pool = parity.activated(pool2, tp=2)
    for stored in ("model_layout", "transposed"):
        full = _vl_reference(vl_moe[stored])
        for result in pool.run(_vl_shards, vl_moe[stored]):
            assert len(result["shards"]) == 4, result
            for name, shard in result["shards"].items():
                assert shard.shape[0] == 2 and torch.equal(shard, result["layouts"][name].local(full[name])), name
