"""Distributed checkpoints that reshard: ``torch.distributed.checkpoint`` with ``model.state_dict()``
and torch's ``get_state_dict``/``set_state_dict`` (model + optimizer), saved at one layout and resumed
at the same and at others, against the uninterrupted run.

Every run trains on one global batch of 4 rows (each dp rank its rows): 3 steps, save, 3 more = the
reference. A resume loads a fresh model and a fresh optimizer (at another layout: fresh worker
processes, so the modeling code is lowered for that plan) and runs the last 3 steps. World 4 with AdamW
(K/V heads kept on two ranks each at tp=4: ``llama_gqa``): dp2 x tp2 -> the same, -> tp4 (which saves
again), and a plain process without hp_lazy resumes from either. World 2 with SGD +
momentum (tight bound): tp2 -> the same, -> dp2 x tp1; and the negative control, the old face (plain
local shards) that DCP took for replicas.
"""

from __future__ import annotations

import contextlib
import os

import ckptwork
import models
import parity
import torch
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)

STEPS = 3
SAME = 1e-6  # the same layout: the same arithmetic
OTHER = {"sgd": 1e-5, "adamw": 1e-5}  # another layout: other reduction orders (fp32 round-off)


def _global_batch():
    return models.batch(seed=3, batch_size=4)


def _optimizer(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _steps(model, opt, ids, n: int = STEPS) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()


def _rows():
    import hp_lazy

    dp = hp_lazy.mesh().group("dp")
    return _global_batch().chunk(dp.size)[dp.rank]






def _train_and_save(rank: int, world: int, path: str, kind: str, ckpt: str) -> dict | None:
    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    opt = _optimizer(kind, model.parameters())
    _steps(model, opt, _rows())
    ckptwork.save(model, opt, ckpt)
    _steps(model, opt, _rows())
    full = hp_lazy.full_state_dict(model)  # a collective
    return full if rank == 0 else None


def _resume(rank: int, world: int, path: str, kind: str, ckpt: str, api: str, save_to: str | None = None):
    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    opt = _optimizer(kind, model.parameters())
    ckptwork.load(model, opt, ckpt, api)
    if save_to is not None:
        ckptwork.save(model, opt, save_to)
    _steps(model, opt, _rows())
    full = hp_lazy.full_state_dict(model)  # a collective
    return full if rank == 0 else None


def _resume_plain(path: str, kind: str, ckpt: str) -> dict:
    """tp=1 in this process: plain transformers, no hp_lazy, no process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    model = parity._load(path)
    opt = _optimizer(kind, model.parameters())
    msd, osd = dsd.get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt, no_dist=True)
    dsd.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    _steps(model, opt, _global_batch())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}






def test_adamw_resumes_at_other_layouts(pool4: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama_gqa")
    first, again = str(tmp_path / "dp2tp2"), str(tmp_path / "tp4")
    ref = ckptwork.at(pool4, 2).run(_train_and_save, path, "adamw", first)[0]
    errors = {"dp2xtp2 -> same": ckptwork.errors(pool4.run(_resume, path, "adamw", first, "dsd")[0], ref)}
    errors["dp2xtp2 -> tp4 (K/V kept on 2 ranks)"] = ckptwork.errors(
        ckptwork.at(pool4, 4).run(_resume, path, "adamw", first, "plain", again)[0], ref)
    errors["dp2xtp2 -> one plain process"] = ckptwork.errors(_resume_plain(path, "adamw", first), ref)
    errors["tp4 -> one plain process"] = ckptwork.errors(_resume_plain(path, "adamw", again), ref)
    print("AdamW resume errors:", errors)
    assert errors.pop("dp2xtp2 -> same") <= SAME
    assert max(errors.values()) <= OTHER["adamw"], errors


def test_sgd_resumes_exactly(pool2: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama")
    ckpt = str(tmp_path / "tp2")
    ref = ckptwork.at(pool2, 2).run(_train_and_save, path, "sgd", ckpt)[0]
    errors = {"tp2 -> same": ckptwork.errors(pool2.run(_resume, path, "sgd", ckpt, "plain")[0], ref)}
    errors["tp2 -> dp2xtp1"] = ckptwork.errors(ckptwork.at(pool2, 1).run(_resume, path, "sgd", ckpt, "dsd")[0], ref)
    print("SGD resume errors:", errors)
    assert errors["tp2 -> same"] <= SAME and errors["tp2 -> dp2xtp1"] <= OTHER["sgd"], errors


# -- the old silent failure, full tensors, refusals


def _shards_after_load(rank: int, world: int, path: str, root: str) -> dict:
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    import hp_lazy
    from hp_lazy.errors import ShardingError
    from hp_lazy.runtime.checkpoint.hooks import local_shards

    model = hp_lazy.parallelize(parity._load(path))
    mine = {n: p.detach().clone() for n, p in model.named_parameters()}
    with local_shards():  # the face model.state_dict() had before: plain local shards
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(root, "old"))
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(root, "new"))

    fresh = hp_lazy.parallelize(parity._load(path))
    out: dict = {"mine": mine}
    for face in ("old", "new"):
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        with local_shards() if face == "old" else contextlib.nullcontext():
            sd = fresh.state_dict()
            dcp.load(sd, checkpoint_id=os.path.join(root, face))  # into the shards (old) or their DTensors
            fresh.load_state_dict(sd)
        out[face] = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    full = safetensors.torch.load_file(os.path.join(path, "model.safetensors"))  # a plain (full) checkpoint
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(full)
    out["full"] = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    key = "model.layers.0.self_attn.q_proj.weight"
    for what, value in (("local_refused", mine[key]), ("shape_refused", torch.zeros(3, 3))):
        try:
            fresh.load_state_dict({**full, key: value})
        except ShardingError as error:
            out[what] = str(error)
    return out


def test_shards_load_into_their_own_rank(pool2: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama")
    got = ckptwork.at(pool2, 2).run(_shards_after_load, path, str(tmp_path))
    key = "model.layers.0.self_attn.q_proj.weight"
    # negative control: DCP took the plain shards for replicas, wrote one rank's and gave it to both
    assert torch.equal(got[0]["old"][key], got[1]["old"][key])
    assert [torch.equal(got[r]["old"][key], got[r]["mine"][key]) for r in (0, 1)].count(False) == 1
    for rank in (0, 1):
        for face in ("new", "full"):
            assert got[rank][face].keys() == got[rank]["mine"].keys()
            for name, value in got[rank]["mine"].items():
                assert torch.equal(got[rank][face][name], value), (rank, face, name)
        assert got[rank]["local_refused"] == (
            f"{key}: the tensor has the shape of one rank's shard [16, 32] (S(0) of [32, 32]), and which rank's "
            "shard it is cannot be known; load the full tensor or the DTensors model.state_dict() gives "
            "(torch.distributed.checkpoint)"
        )
        assert got[rank]["shape_refused"] == (
            f"{key}: the tensor has shape [3, 3], but the parameter's full shape is [32, 32] (this rank holds "
            "[16, 32]); load a checkpoint of this model"
        )


def _packed_save(rank: int, world: int, path: str, ckpt: str) -> dict | None:
    import torch.distributed.checkpoint as dcp

    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    dcp.save(model.state_dict(), checkpoint_id=ckpt)
    full = hp_lazy.full_state_dict(model)  # a collective
    return full if rank == 0 else None


def test_packed_experts_save_as_full_tensors(pool2: DistPool, refs, tmp_path) -> None:
    """Qwen3-MoE's packed gate_up (two blocks, each cut on tp): DCP sees two chunks per rank; a
    plain process reads the full tensors back."""
    import torch.distributed.checkpoint as dcp

    path, _ = refs("qwen3_moe")
    ckpt = str(tmp_path / "moe")
    full = ckptwork.at(pool2, 2).run(_packed_save, path, ckpt)[0]
    plain = parity._load(path).state_dict()
    dcp.load(plain, checkpoint_id=ckpt, no_dist=True)
    packed = [k for k in full if "gate_up" in k]
    assert packed and full.keys() == plain.keys()
    for name, value in full.items():
        assert torch.equal(plain[name], value), name
