"""Inputs the plain model rejects are rejected, and ranks fail together, within a bound.

- Token ids outside the vocabulary and out-of-range labels raise the plain model's ``IndexError``
  (the vocab-parallel embedding and loss would otherwise zero them silently);
- ranks of one tp group given different shapes (or, by default on the first forward, different
  ids) raise a ``ShardingError`` naming the input and every rank's shape, instead of aborting inside
  gloo or training on a mix of batches;
- a rank whose binding fails makes every rank raise, instead of leaving its peers in a collective;
- a rank that never arrives makes its peers raise within ``HP_LAZY_PG_TIMEOUT_S``.

One pool, activated with ``Plan.auto(tp=2, sequence_parallel=True, loss_parallel=True)``: the
embedding is vocab parallel, activations are sequence sharded and the loss is vocab parallel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=90)


@pytest.fixture(scope="module")
def ready(pool2: DistPool, tmp_path_factory) -> tuple[DistPool, str]:
    path = models.build("llama", str(tmp_path_factory.mktemp("models")))
    return parity.activated(pool2, sequence_parallel=True, loss_parallel=True), path


def _forward(rank: int, world: int, path: str, ids_by_rank: list, labels_by_rank: list | None = None,
             env: dict | None = None) -> str:
    """One forward + backward of a fresh model; the error's type and text, or 'ok'."""
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        model = parity._load(path)
        ids = ids_by_rank[rank]
        labels = ids if labels_by_rank is None else labels_by_rank[rank]
        model(input_ids=ids, labels=labels).loss.backward()
        return "ok"
    except Exception as exc:  # the test compares the text across ranks
        return f"{type(exc).__name__}: {exc}"
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _plain_error(path: str, ids, labels) -> str:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    try:
        model(input_ids=ids, labels=labels)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _bad_ids(value: int):
    ids = models.batch()
    ids[1, 5] = value
    return ids


@pytest.mark.parametrize("value", [models.VOCAB, models.VOCAB + 7, -1])
def test_an_id_outside_the_vocabulary_raises_the_plain_models_index_error(ready, value: int) -> None:
    pool, path = ready
    ids = _bad_ids(value)
    plain = _plain_error(path, ids, models.batch())
    assert plain == "IndexError: index out of range in self"
    assert pool.run(_forward, path, [ids, ids], [models.batch()] * 2) == [plain, plain]


@pytest.mark.parametrize("value", [models.VOCAB, -5])
def test_a_label_outside_the_vocabulary_raises_the_plain_models_index_error(ready, value: int) -> None:
    pool, path = ready
    labels = _bad_ids(value)
    plain = _plain_error(path, models.batch(), labels)
    assert plain == f"IndexError: Target {value} is out of bounds."
    assert pool.run(_forward, path, [models.batch()] * 2, [labels, labels]) == [plain, plain]


def test_ignored_labels_and_good_inputs_still_train(ready) -> None:
    pool, path = ready
    labels = models.batch()
    labels[:, :4] = -100
    assert pool.run(_forward, path, [models.batch()] * 2, [labels, labels]) == ["ok", "ok"]


@pytest.mark.parametrize(("rows", "seq"), [((2, 2), (16, 12)), ((2, 1), (16, 16))])
def test_different_shapes_on_the_ranks_of_a_tp_group_are_a_sharding_error(ready, rows, seq) -> None:
    pool, path = ready
    ids = [models.batch(batch_size=rows[r], seq=seq[r]) for r in range(2)]
    got = pool.run(_forward, path, ids)
    assert got[0] == got[1], got  # every rank raises the same error
    assert got[0].startswith("ShardingError: LlamaForCausalLM: the 2 ranks of its tp group were given different inputs: ")
    assert f"input 'input_ids' (rank 0: [{rows[0]}, {seq[0]}] int64, rank 1: [{rows[1]}, {seq[1]}] int64)" in got[0]
    assert "input 'labels' (rank 0:" in got[0]
    assert "split the global batch over the dp ranks only" in got[0]
    # the pool is still usable: nothing was left inside a collective
    assert pool.run(_forward, path, [models.batch()] * 2) == ["ok", "ok"]


def test_different_ids_of_one_shape_are_caught_by_default(ready) -> None:
    """The first forward compares a digest of the values too (by default); HP_LAZY_CHECK_INPUTS=0
    compares shapes only (the opt-out: the mix then trains silently, a negative control), =1 on
    every forward."""
    pool, path = ready
    ids = [models.batch(seed=1), models.batch(seed=2)]
    for env in ({}, {"HP_LAZY_CHECK_INPUTS": "1"}):
        got = pool.run(_forward, path, ids, env=env)
        assert got[0] == got[1] and "input 'input_ids' has the same shape on every rank but different values" in got[0]
    assert pool.run(_forward, path, ids, env={"HP_LAZY_CHECK_INPUTS": "0"}) == ["ok", "ok"]
    same = [models.batch(seed=1)] * 2
    assert pool.run(_forward, path, same) == ["ok", "ok"]
    assert pool.run(_forward, path, same, env={"HP_LAZY_CHECK_INPUTS": "1"}) == ["ok", "ok"]


def _bind_with_one_rank_broken(rank: int, world: int, path: str, broken: str) -> str:
    import hp_lazy

    try:  # from_pretrained binds as it reads the weights (shard on read)
        hp_lazy.parallelize(parity._load(broken if rank == 1 else path))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "bound"


def test_a_bind_failure_on_one_rank_raises_on_every_rank(ready, tmp_path) -> None:
    import torch
    import transformers

    pool, path = ready
    config = transformers.LlamaConfig(**{**models.BASE, "intermediate_size": 63})  # not divisible by tp=2
    torch.manual_seed(0)
    broken = str(tmp_path / "odd")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(broken)
    start = time.monotonic()
    got = pool.run(_bind_with_one_rank_broken, path, broken)
    assert time.monotonic() - start < 30
    assert got[0] == got[1], got
    assert got[0].startswith("ShardingError: LlamaForCausalLM: binding failed on rank(s) [1] of 2 (rank 1: ShardingError: ")
    assert "63" in got[0] and "every rank raises this error so that none waits in a collective" in got[0]
    assert pool.run(_forward, path, [models.batch()] * 2) == ["ok", "ok"]


_ABSENT_PEER = textwrap.dedent(
    """
    import os, sys, time
    rank = int(os.environ["RANK"])
    if rank == 1:  # a rank that never activates hp_lazy: it joins the world and then does other work
        import torch.distributed as dist
        dist.init_process_group("gloo")
        time.sleep(60)
        sys.exit(0)
    import hp_lazy
    hp_lazy.activate("auto", tp=2)
    import torch, transformers
    sys.path.insert(0, sys.argv[1])
    import models
    config = transformers.LlamaConfig(**models.BASE)
    model = transformers.LlamaForCausalLM(config)
    start = time.monotonic()
    try:
        model(input_ids=models.batch())
    except Exception as exc:
        print(f"RAISED after {time.monotonic() - start:.1f}s: {type(exc).__name__}: {exc}", flush=True)
        os._exit(3)
    print("NO ERROR", flush=True)
    """
)


def test_a_rank_that_never_arrives_makes_its_peer_raise_within_the_timeout(tmp_path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "absent_peer.py"
    script.write_text(_ABSENT_PEER)
    tests = os.path.dirname(os.path.abspath(__file__))
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
            "HP_LAZY_PG_TIMEOUT_S": "4", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
            "HP_LAZY_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, str(script), tests], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 3, (out, err[-2000:])
    waited = float(out.split("RAISED after ")[1].split("s:")[0])
    print(f"peer raised after {waited:.1f}s")
    assert waited < 30, out  # bounded by HP_LAZY_PG_TIMEOUT_S (4 s), not torch's 30 minutes
    assert ("ShardingError: hp_lazy mesh tp2/world2: rank 0 came to build the mesh (the first model bound under "
            "this plan), but rank(s) [1] of 2 did not within 4 s") in out, out  # named, not torch's DistStoreError
