"""dp x tp on one mesh: 4 ranks with tp=2 give two tensor-parallel groups ({0, 1} and {2, 3});
each is exact on its own, and tp rank r of each group holds the same shard."""

from __future__ import annotations

import torch

import parity
from dist import DistPool, pool_fixture

pool4 = pool_fixture(4, timeout=180)


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
