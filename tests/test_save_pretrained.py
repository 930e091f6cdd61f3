"""``model.save_pretrained(d)`` on every rank of a parallel model, with no extra argument, writes the
standard full checkpoint: a plain process loads every tensor equal to ``hp_lazy.full_state_dict``,
and the files (sharded by ``max_shard_size``, with their index) are named as transformers names the
plain model's. tp=2 (Llama, Gemma's tied embedding, Qwen3-MoE's packed experts) and tp=2 with sequence parallel."""

from __future__ import annotations

import json
import os

import parity
import pytest
import torch
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)

SHARD = "40KB"  # the tiny Llama is ~115 KB: several files and an index


def _save(rank: int, world: int, path: str, out: str) -> dict | None:
    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    ids = torch.arange(16).reshape(2, 8) % 100
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # weights no checkpoint on disk has
    model.save_pretrained(out, max_shard_size=SHARD)
    full = hp_lazy.full_state_dict(model)
    return full if rank == 0 else None


def _check(pool: DistPool, path: str, out: str, plain_out: str) -> None:
    import transformers

    full = pool.run(_save, path, out)[0]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert reloaded.keys() == full.keys()
    for name, value in full.items():
        assert torch.equal(reloaded[name], value), name
    parity._load(path).save_pretrained(plain_out, max_shard_size=SHARD)
    assert sorted(os.listdir(out)) == sorted(os.listdir(plain_out))
    index = "model.safetensors.index.json"
    with open(os.path.join(out, index)) as mine, open(os.path.join(plain_out, index)) as plain:
        assert json.load(mine)["weight_map"] == json.load(plain)["weight_map"]


@pytest.mark.parametrize("name", ["llama", "gemma", "qwen3_moe"])
def test_tp(pool2: DistPool, refs, tmp_path, name: str) -> None:
    path, _ = refs(name)
    _check(parity.activated(pool2, tp=2), path, str(tmp_path / "tp"), str(tmp_path / "plain"))


def test_sequence_parallel(pool2: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama")
    pool2.close()  # new workers: the modeling code is lowered for the sequence-parallel plan
    _check(parity.activated(pool2, tp=2, sequence_parallel=True), path, str(tmp_path / "sp"), str(tmp_path / "plain"))
