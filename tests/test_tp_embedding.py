"""Embeddings cut along their features under tp (transformers 5.25's ``embedding_colwise``, which
Qwen4-Exp's plan puts on its n-gram tables, about 45B parameters in the real model): each rank holds
``1/tp`` of every row's features, looks up its slice, and one all-gather of the lookup joins the
slices; the gradient of each rank's slice is its own. At tp=2 and 4 against one process: logits,
loss, every gradient and 3 SGD+wd steps; the table's bytes per rank and the gather's bytes are
asserted, and each rank reads only its slice of the table from the checkpoint; the stock ``Trainer``
trains it at tp=2 as one process does. Negative control: the lookup's slices left unjoined break the
model's next projection."""

from __future__ import annotations

import models
import parity
import pytest
import test_load_sharded
import trainwork
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)

NAME = "qwen4_exp"
TABLE = "model.layers.0.ple.ple_embedding.ngram_embedding"


def _train(rank: int, world: int, path: str, ids) -> dict:
    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    table = model.get_submodule(TABLE)
    lookup = ids.clamp(max=table.num_embeddings - 1)
    with hp_lazy.collective_counter() as counter:
        rows = table(lookup)
    result = models.run_training(model, ids, full_grads=hp_lazy.full_grads, full_state_dict=hp_lazy.full_state_dict)
    return {**result, "table": tuple(table.weight.shape), "rows": rows.detach(), "lookup": lookup,
            "gather": (dict(counter.counts), dict(counter.payload))}


def _train_unjoined(rank: int, world: int, path: str, ids) -> dict:
    """Negative control: the table's exit op skipped (each rank's slice of the features goes on)."""
    from hp_lazy.runtime import binding

    original = binding.Binding.exit

    def exit_unless_table(self, value, *args, **kwargs):
        return value if self.fqn.endswith("ngram_embedding") else original(self, value, *args, **kwargs)

    binding.Binding.exit = exit_unless_table
    try:
        return _train(rank, world, path, ids)
    finally:
        binding.Binding.exit = original


@pytest.fixture(scope="module")
def ref(refs) -> tuple[str, dict, dict[str, float]]:
    """The float32 reference and one process's own round-off floor per entry: its distance from its
    float64 run. The Gated DeltaNet's ``A_log`` and ``dt_bias`` gradients are sums that nearly cancel
    (one process in float32 is 1.7e-4 from float64 on them), so each entry may reach twice its own
    floor where that is above 1e-5 (``parity.compare``); logits, loss and the steps' losses are held
    to 1e-5, and the table's gradient too."""
    models.skip_unless_released(NAME)
    path, reference = refs(NAME)
    return path, reference, parity.float64_floor(path, reference, experts_implementation="eager")


@pytest.mark.parametrize("world", [2, 4])
def test_ngram_tables_match_one_process(world: int, ref, pool2: DistPool, pool4: DistPool) -> None:
    import torch
    import transformers

    path, reference, floor = ref
    pool = parity.activated(pool2 if world == 2 else pool4, sequence_parallel=False)
    results = pool.run(_train, path, models.batch())
    errors = parity.compare(results[0], reference, floor)
    assert len(errors) > 40 and all(errors[name] <= parity.TOL for name in ("logits", "loss", "losses"))
    assert all(error <= parity.TOL for name, error in errors.items() if "ngram_embedding" in name), errors
    full = transformers.AutoModelForCausalLM.from_pretrained(path).get_submodule(TABLE).weight.detach()
    vocab, features = full.shape
    rows, cols = results[0]["lookup"].numel(), features // world
    for result in results:
        assert models.rel_err(result["loss"], reference["loss"]) <= parity.TOL
        assert result["table"] == (vocab, cols)  # bytes per rank: 1/tp of the table
        assert torch.equal(result["rows"], full[result["lookup"]])  # the joined lookup is one process's
        counts, payload = result["gather"]  # one all-gather of this rank's slice of the looked-up rows
        assert counts == {("all_gather", "forward"): 1}, counts
        assert payload == {("all_gather", "forward"): rows * cols * 4}, payload


def test_the_tables_are_read_as_slices(ref, pool2: DistPool) -> None:
    """Shard-on-read: each rank reads only its features of the table from the checkpoint."""
    path, _, _ = ref
    got = parity.activated(pool2, sequence_parallel=False).run(test_load_sharded._loaded, path, "float32")
    test_load_sharded._check(got, path, "float32")
    assert all(TABLE + ".weight" in result["shards"] for result in got)


def test_the_stock_trainer_at_tp2(ref, pool2: DistPool, tmp_path) -> None:
    """Through the user's stack: transformers' ``Trainer`` (default clipping at 1.0, which these steps
    reach; SGD) at tp=2 against one process's Trainer: the logged losses and grad norms, and every
    parameter after 3 steps."""
    path, _, _ = ref
    reference = trainwork.trainer(0, 1, path, str(tmp_path / "ref"))
    assert reference["grad_norm"].min() > 1.0  # clipping changes these steps
    got = parity.activated(pool2, sequence_parallel=False).run(trainwork.trainer, path, str(tmp_path / "hp"))
    trainwork.compare_trainer(got[0], reference)


def test_unjoined_slices_fail(ref, pool2: DistPool) -> None:
    path, _, _ = ref
    pool = parity.activated(pool2, sequence_parallel=False)
    with pytest.raises(Exception, match="cannot be multiplied"):
        pool.run(_train_unjoined, path, models.batch())
