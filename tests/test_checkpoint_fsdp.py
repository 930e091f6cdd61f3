"""Distributed checkpoints of FSDP2 on top of hp_lazy's tensor parallel (``fully_shard(layer,
mesh=hp_lazy.mesh().device_mesh["dp"])``, the 2-D layout users train with): FSDP2 holds each tp shard
as a DTensor over dp, and ``model.state_dict()``, torch's ``get_state_dict``/``set_state_dict``,
``dcp.save``/``dcp.load`` and ``save_pretrained`` see every parameter and AdamW moment as the full
tensor, this rank holding FSDP2's chunk of its tp shard.

World 4, dp=2 x tp=2, AdamW, one global batch of 4 rows (each dp rank its 2): 3 steps, save, 3 more =
the uninterrupted run. Resumed (fresh model, fresh optimizer) at the same layout through both APIs, at
tp=4 without FSDP2 (K/V heads kept on two ranks each), in one plain process, and the other way: a
checkpoint of hp_lazy's own dp average resumed under FSDP2. Negative control: the face FSDP2 alone gives
(each tp rank's shard under the same name and offsets): DCP keeps one tp rank's and the resume is wrong.
"""

from __future__ import annotations

import ckptwork
import models
import parity
import pytest
import torch
from dist import DistPool, pool_fixture

pool4 = pool_fixture(4, timeout=180)
pool8 = pool_fixture(8, timeout=240)

STEPS = 3
SAME = 1e-6  # the same layout: the same arithmetic
OTHER = 1e-5  # another layout: other reduction orders (fp32 round-off)


def _rows():
    import hp_lazy

    dp = hp_lazy.mesh().group("dp")
    return models.batch(seed=3, batch_size=4).chunk(dp.size)[dp.rank]


def _model(path: str, fsdp: bool, dim: int = 0):
    """The tiny model under hp_lazy's plan, FSDP2 over dp on each layer and the root (chunking dim
    ``dim`` of each shard where it has one), or hp_lazy's own dp average; and AdamW over what it holds."""
    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path), data_parallel=not fsdp)
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        dp_mesh = hp_lazy.mesh().device_mesh["dp"]
        placed = {"shard_placement_fn": lambda p: Shard(dim if p.dim() > dim else 0)} if dim else {}
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh, **placed)
        fully_shard(model, mesh=dp_mesh, **placed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _steps(model, opt, ids) -> None:
    for _ in range(STEPS):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()


def _full(rank: int, model) -> dict | None:
    import hp_lazy

    full = hp_lazy.full_state_dict(model)  # a collective
    return full if rank == 0 else None


def _train_and_save(rank: int, world: int, path: str, ckpt: str, fsdp: bool, old_face: bool = False) -> dict | None:
    from hp_lazy.runtime.checkpoint.hooks import local_shards

    model, opt = _model(path, fsdp)
    _steps(model, opt, _rows())
    if old_face:  # FSDP2's own DTensors of the tp shards, as DCP would take them without hp_lazy's face
        import torch.distributed.checkpoint as dcp

        with local_shards():
            dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt)
    else:
        ckptwork.save(model, opt, ckpt)
    _steps(model, opt, _rows())
    return _full(rank, model)


def _resume(rank: int, world: int, path: str, ckpt: str, fsdp: bool, api: str, old_face: bool = False):
    from hp_lazy.runtime.checkpoint.hooks import local_shards

    model, opt = _model(path, fsdp)
    if old_face:
        import torch.distributed.checkpoint as dcp

        with local_shards():
            msd = model.state_dict()
            dcp.load({"model": msd}, checkpoint_id=ckpt)
            model.load_state_dict(msd)
    else:
        ckptwork.load(model, opt, ckpt, api)
    _steps(model, opt, _rows())
    return _full(rank, model)


def test_fsdp_over_tp_resumes_at_every_layout(pool4: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama_gqa")
    fsdp_ckpt, own_ckpt = str(tmp_path / "fsdp"), str(tmp_path / "own")
    ref = ckptwork.at(pool4, 2).run(_train_and_save, path, fsdp_ckpt, True)[0]
    own_ref = pool4.run(_train_and_save, path, own_ckpt, False)[0]
    errors = {f"fsdp dp2xtp2 -> same ({api})": ckptwork.errors(pool4.run(_resume, path, fsdp_ckpt, True, api)[0], ref)
              for api in ("dsd", "plain")}  # get/set_state_dict, and the model's own state_dict()
    errors["hp_lazy dp2xtp2 -> fsdp dp2xtp2"] = ckptwork.errors(
        pool4.run(_resume, path, own_ckpt, True, "dsd")[0], own_ref)
    errors["fsdp dp2xtp2 -> tp4 (K/V kept on 2 ranks)"] = ckptwork.errors(
        ckptwork.at(pool4, 4).run(_resume, path, fsdp_ckpt, False, "dsd")[0], ref)
    errors["fsdp dp2xtp2 -> one plain process"] = ckptwork.errors(
        ckptwork.resume_plain(parity._load(path), fsdp_ckpt, lambda m, o: _steps(m, o, models.batch(seed=3, batch_size=4))), ref)
    print("FSDP2 x tp resume errors:", errors)
    assert max(v for k, v in errors.items() if "-> same" in k) <= SAME, errors
    assert max(errors.values()) <= OTHER, errors


def test_fsdp_own_face_keeps_one_tp_ranks_shards(pool4: DistPool, refs, tmp_path) -> None:
    """Negative control: FSDP2's DTensors of the tp shards handed to DCP as they are (hp_lazy's face
    off) name each tp rank's different shard by the same key and offsets; DCP keeps one, and the
    resume trains from a model half made of the other rank's shards."""
    path, _ = refs("llama_gqa")
    ckpt = str(tmp_path / "old")
    ref = ckptwork.at(pool4, 2).run(_train_and_save, path, ckpt, True, True)[0]
    got = pool4.run(_resume, path, ckpt, True, "plain", True)[0]
    assert ckptwork.errors(got, ref) > 1e-2


def _save_pretrained_and_reload(rank: int, world: int, path: str, out: str, dim: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    import hp_lazy

    model, opt = _model(path, True, dim)
    _steps(model, opt, _rows())
    model.save_pretrained(out)  # every rank: the shards gathered one at a time, rank 0 writes
    dcp.save(model.state_dict(), checkpoint_id=out + "_dcp")
    full = hp_lazy.full_state_dict(model)
    fresh, _ = _model(path, True, dim)
    # full tensors in, as torch's helpers take them under FSDP2: each rank keeps its chunk of its tp shard
    set_model_state_dict(fresh, dict(full), options=StateDictOptions(full_state_dict=True))  # (it fills the dict)
    reloaded = hp_lazy.full_state_dict(fresh)  # a collective
    placed = str(model.get_parameter("model.layers.0.self_attn.o_proj.weight").placements)  # FSDP2's, of a rowwise shard
    return {"full": full, "reloaded": reloaded, "placed": placed} if rank == 0 else {}


@pytest.mark.parametrize("dim", [0, 1], ids=["fsdp_dim0", "fsdp_dim1"])
def test_fsdp_over_tp_save_pretrained_and_full_load(pool4: DistPool, refs, tmp_path, dim: int) -> None:
    """``save_pretrained`` writes the checkpoint a plain process loads (the trained weights), a plain
    process reads ``dcp.save(model.state_dict())`` back, and ``set_model_state_dict`` of full tensors
    puts each rank's chunk of its shard back; FSDP2 chunking dim 0 of each shard (its default: the
    colwise shards' own dim, ``_StridedShard``) or dim 1 (the rowwise shards' own dim)."""
    import torch.distributed.checkpoint as dcp

    path, _ = refs("llama_gqa")
    out = str(tmp_path / "saved")
    got = ckptwork.at(pool4, 2).run(_save_pretrained_and_reload, path, out, dim)[0]
    assert got["placed"] == f"(Shard(dim={dim}),)", got["placed"]
    plain = {k: v for k, v in parity._load(out).state_dict().items()}
    from_dcp = parity._load(path).state_dict()
    dcp.load(from_dcp, checkpoint_id=out + "_dcp", no_dist=True)
    assert plain.keys() == got["full"].keys()
    for name, value in got["full"].items():
        assert torch.equal(plain[name], value), name
        assert torch.equal(from_dcp[name], value), name
        assert torch.equal(got["reloaded"][name], value), name
    start = parity._load(path).state_dict()
    assert any(not torch.equal(start[n], v) for n, v in plain.items())  # the trained weights, not the start


def test_fsdp_over_tp4_with_kv_heads_on_two_ranks(pool8: DistPool, refs, tmp_path) -> None:
    """dp=2 x tp=4 on 8 ranks, Llama with 2 K/V heads: each K/V head's shard is kept on two tp ranks
    (a tp sub-mesh of pieces x copies), which FSDP2 chunks again over dp. ``save_pretrained``, a plain
    process reading ``dcp.save`` back and full tensors loaded in equal the gathered weights."""
    import torch.distributed.checkpoint as dcp

    path, _ = refs("llama_gqa")
    out = str(tmp_path / "saved")
    got = ckptwork.at(pool8, 4).run(_save_pretrained_and_reload, path, out, 0)[0]
    plain = parity._load(out).state_dict()
    from_dcp = parity._load(path).state_dict()
    dcp.load(from_dcp, checkpoint_id=out + "_dcp", no_dist=True)
    for name, value in got["full"].items():
        assert torch.equal(plain[name], value), name
        assert torch.equal(from_dcp[name], value), name
        assert torch.equal(got["reloaded"][name], value), name


def _refusal(rank: int, world: int, path: str) -> str:
    """FSDP2's DTensor of a shard must be one Shard over hp_lazy's dp mesh; anything else is named."""
    from torch.distributed.tensor import DTensor, Shard

    import hp_lazy
    from hp_lazy.errors import ShardingError
    from hp_lazy.runtime.checkpoint import hooks

    model, _ = _model(path, False)
    key = "model.layers.0.self_attn.q_proj.weight"
    local = model.get_parameter(key).detach()
    over_tp = DTensor.from_local(local, hp_lazy.mesh().device_mesh["tp"], [Shard(0)], run_check=False)
    try:
        hooks._MODELS[model].present(key, over_tp)
    except ShardingError as error:
        return str(error)
    return "not refused"


def test_a_dtensor_not_fsdp2s_over_dp_is_refused(pool4: DistPool, refs) -> None:
    path, _ = refs("llama_gqa")
    text = ckptwork.at(pool4, 2).run(_refusal, path)[0]
    assert text.startswith("model.layers.0.self_attn.q_proj.weight: the tensor is a DTensor of shape [32, 32] "
                           "placed [Shard(dim=0)] on DeviceMesh((tp=2)"), text
    assert ("hp_lazy presents FSDP2's DTensors of its shards (S(0) of [32, 32], shaped [16, 32]) only as "
            "fully_shard(..., mesh=hp_lazy.mesh().device_mesh['dp']) makes them (one Shard placement on dp); "
            "save it with hp_lazy.full_state_dict(model)") in text, text

