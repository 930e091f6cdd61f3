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


def _save_on_rank0(rank: int, world: int, path: str, out: str) -> dict:
    """The idiom ``if rank == 0: model.save_pretrained(d)``; rank 1 goes on (here: it waits)."""
    import os
    import time

    import hp_lazy

    os.environ["HP_LAZY_ARRIVAL_TIMEOUT_S"] = "3"
    model = hp_lazy.parallelize(parity._load(path))
    if rank != 0:
        time.sleep(8)  # past rank 0's arrival timeout: the ranks meet again afterwards
        return {}
    start = time.monotonic()
    try:
        model.save_pretrained(out)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None}


def _torch_save(rank: int, world: int, path: str, out: str) -> str:
    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    try:
        torch.save(model.state_dict(), out)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def _stream(rank: int, world: int, path: str, bucket_mb: float, alone: bool = False) -> dict:
    """``hp_lazy.full_weights`` on every rank (``alone``: rank 0 only, the others wait past its timeout)."""
    import os
    import time

    import hp_lazy

    os.environ["HP_LAZY_ARRIVAL_TIMEOUT_S"] = "3"
    model = hp_lazy.parallelize(parity._load(path))
    if alone and rank != 0:
        time.sleep(8)
        return {}
    start = time.monotonic()
    try:
        buckets = [[(name, tensor.clone()) for name, tensor in bucket] for bucket in hp_lazy.full_weights(model, bucket_mb)]
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    full = hp_lazy.full_state_dict(model)
    return {"sizes": [sum(t.numel() * t.element_size() for _, t in b) for b in buckets],
            "largest": max(t.numel() * t.element_size() for b in buckets for _, t in b),
            "streamed": {n: t for b in buckets for n, t in b}, "full": full}


def test_full_weights_streams_every_tensor_in_buckets(pool2: DistPool, refs) -> None:
    path, _ = refs("llama")
    limit = 16 * 2**10
    for got in parity.activated(pool2, tp=2).run(_stream, path, limit / 2**20):
        assert got["streamed"].keys() == got["full"].keys()
        assert all(torch.equal(got["streamed"][n], v) for n, v in got["full"].items())
        assert len(got["sizes"]) > 3 and all(size <= max(limit, got["largest"]) for size in got["sizes"])


def test_full_weights_on_one_rank_fails_fast(pool2: DistPool, refs) -> None:
    path, _ = refs("llama")
    got = parity.activated(pool2, tp=2).run(_stream, path, 1.0, alone=True)[0]
    pool2.close()  # the arrival check's group is out of step now
    assert got["seconds"] < 10
    assert got["error"].startswith("ShardingError: hp_lazy: rank 0 entered hp_lazy.full_weights, but not every rank of "
                                   "the world did within 3 s"), got["error"]
    assert "iterate it on every rank" in got["error"]


def test_save_pretrained_on_rank0_only_fails_fast(pool2: DistPool, refs, tmp_path) -> None:
    """It hung until the process-group timeout (600 s), then a gloo error with no hint."""
    path, _ = refs("llama")
    got = parity.activated(pool2, tp=2).run(_save_on_rank0, path, str(tmp_path / "rank0"))[0]
    pool2.close()  # the arrival check's group is out of step now (the job would stop at this error)
    assert got["error"] is not None and got["seconds"] < 10
    assert got["error"].startswith("ShardingError: hp_lazy: rank 0 entered LlamaForCausalLM.save_pretrained, but not "
                                   "every rank of the world did within 3 s")
    assert "call save_pretrained on every rank (transformers writes on rank 0 only), not under `if rank == 0:`" in got["error"]
    assert not os.path.exists(os.path.join(tmp_path, "rank0", "model.safetensors"))


def test_torch_save_of_the_parallel_state_dict_is_refused(pool2: DistPool, refs, tmp_path) -> None:
    """It wrote a file a plain process cannot load ("Could not resolve the process group")."""
    path, _ = refs("llama")
    for text in parity.activated(pool2, tp=2).run(_torch_save, path, str(tmp_path / "sd.pt")):
        assert text.startswith("ShardingError: model.embed_tokens.weight: torch.save of an hp_lazy model's "
                               "state_dict() would pickle this rank's shard as a DTensor"), text
        assert "torch.save(hp_lazy.full_state_dict(model))" in text


@pytest.mark.parametrize("name", ["llama", "gemma", "qwen3_moe"])
def test_tp(pool2: DistPool, refs, tmp_path, name: str) -> None:
    path, _ = refs(name)
    _check(parity.activated(pool2, tp=2), path, str(tmp_path / "tp"), str(tmp_path / "plain"))


def test_sequence_parallel(pool2: DistPool, refs, tmp_path) -> None:
    path, _ = refs("llama")
    pool2.close()  # new workers: the modeling code is lowered for the sequence-parallel plan
    _check(parity.activated(pool2, tp=2, sequence_parallel=True), path, str(tmp_path / "sp"), str(tmp_path / "plain"))
