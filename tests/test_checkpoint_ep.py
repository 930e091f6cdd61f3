"""Distributed checkpoints of expert-parallel models: ``torch.distributed.checkpoint`` with
torch's ``get_state_dict``/``set_state_dict`` or the model's own ``state_dict()``, each rank writing
only its expert slices (DTensors on the expert mesh ``(edp, ep, tp)``), resumed at the same layout
and by one plain process (which reads the slices back as full tensors), against the uninterrupted
run. World 2: ep=2 (SGD with momentum, tight); world 4: ep=2 x tp=2 (AdamW; the packed gate_up
cut on ep and, where the release's TP plan has experts-TP entries, as two blocks on tp)."""

from __future__ import annotations

import ckptwork
import epwork
import models
import parity
import test_checkpoint_dcp as ck
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)


def _shards(rank: int, world: int, path: str) -> dict:
    """How each expert weight is presented to checkpoints: its DTensor's mesh and placements."""
    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    return {k: (tuple(v.device_mesh.mesh_dim_names), [str(p) for p in v.placements], tuple(v.to_local().shape))
            for k, v in model.state_dict().items() if "experts" in k}


def test_ep2_resumes_exactly(pool2: DistPool, tmp_path) -> None:
    path = models.build("qwen3_moe", str(tmp_path / "models"))
    ckpt = str(tmp_path / "ep2")
    pool = parity.once(pool2, epwork.activate, ep=2)
    faces = pool.run(_shards, path)
    mine = faces[0]["model.layers.1.mlp.experts.gate_up_proj"]
    assert mine == (("ep",), ["S(0)"], (2, 64, 32)), mine
    ref = pool.run(ck._train_and_save, path, "sgd", ckpt)[0]
    errors = {"ep2 -> same": ckptwork.errors(pool.run(ck._resume, path, "sgd", ckpt, "dsd")[0], ref),
              "ep2 -> one plain process": ckptwork.errors(ck._resume_plain(path, "sgd", ckpt), ref)}
    print("ep=2 SGD resume errors:", errors)
    assert errors["ep2 -> same"] <= ck.SAME and errors["ep2 -> one plain process"] <= ck.OTHER["sgd"], errors


def test_ep2_tp2_resumes(pool4: DistPool, tmp_path) -> None:
    path = models.build("qwen3_moe8", str(tmp_path / "models"))
    ckpt = str(tmp_path / "ep2tp2")
    pool = parity.once(pool4, epwork.activate, ep=2, tp=2)
    faces = pool.run(_shards, path)
    gate_up = faces[0]["model.layers.0.mlp.experts.gate_up_proj"]
    if epwork.expert_axes("qwen3_moe") == ["ep", "tp"]:  # the release's TP plan still has experts-TP (5.24)
        assert gate_up[:2] == (("ep", "tp"), ["S(0)", "_S(1, 2)"]), gate_up  # _StridedShard: the [gate; up] blocks
    else:  # experts cut on ep alone (5.25's plans), kept whole on both tp ranks
        assert gate_up[:2] == (("ep", "tp"), ["S(0)", "R"]) or gate_up[:2] == (("ep",), ["S(0)"]), gate_up
    ref = pool.run(ck._train_and_save, path, "adamw", ckpt)[0]
    errors = {"ep2xtp2 -> same": ckptwork.errors(pool.run(ck._resume, path, "adamw", ckpt, "plain")[0], ref),
              "ep2xtp2 -> one plain process": ckptwork.errors(ck._resume_plain(path, "adamw", ckpt), ref)}
    print("ep=2 x tp=2 AdamW resume errors:", errors)
    assert errors["ep2xtp2 -> same"] <= ck.SAME and errors["ep2xtp2 -> one plain process"] <= ck.OTHER["adamw"], errors
