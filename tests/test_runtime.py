"""Run-time behaviour around parity: checkpoints from shards, eager and idempotent binding,
the errors a user meets (unbound model, ranks that lowered different code, head counts)."""

from __future__ import annotations

import os

import models
import parity
import pytest
import torch
from dist import DistPool, WorkerError, pool_fixture

pool2 = pool_fixture(2, timeout=120)


@pytest.fixture
def pool(pool2: DistPool) -> DistPool:
    return parity.activated(pool2, sequence_parallel=False)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("runtime"))


def _save_full(rank: int, world: int, path: str, out: str) -> list[int]:
    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    full = hp_lazy.full_state_dict(model)
    if rank == 0:
        model.save_pretrained(out, state_dict=full)
    return list(model.lm_head.weight.shape)


def test_full_state_dict_saves_a_checkpoint_the_plain_model_loads(pool: DistPool, root: str) -> None:
    import transformers

    path = models.build("llama_bias", root)
    out = os.path.join(root, "saved")
    shapes = pool.run(_save_full, path, out)
    assert shapes == [[models.VOCAB // 2, 32]] * 2  # the ranks really held shards
    original = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert original.keys() == reloaded.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, reloaded[name]), name


def _parallelize_twice(rank: int, world: int, path: str) -> dict:
    import hp_lazy

    model = parity._load(path)
    before = {n: id(p) for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hp_lazy.parallelize(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    hp_lazy.parallelize(model)
    ids = models.batch()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # the optimizer built before sharding steps the shards
    return {
        "same_objects": before == {n: id(p) for n, p in model.named_parameters()},
        "stable": shapes == {n: tuple(p.shape) for n, p in model.named_parameters()},
        "q_rows": shapes["model.layers.0.self_attn.q_proj.weight"][0],
        "num_key_value_groups": model.model.layers[0].self_attn.num_key_value_groups,
    }


def test_parallelize_is_eager_idempotent_and_keeps_parameter_objects(pool: DistPool, root: str) -> None:
    got = pool.run(_parallelize_twice, models.build("llama", root))
    assert got == [{"same_objects": True, "stable": True, "q_rows": 16, "num_key_value_groups": 1}] * 2


def _unbound_attention(rank: int, world: int, path: str) -> str:
    import transformers
    from transformers.models.llama import modeling_llama

    config = transformers.AutoConfig.from_pretrained(path)
    attention = modeling_llama.LlamaAttention(config, layer_idx=0)
    try:
        attention(torch.zeros(1, 4, 32), (torch.ones(1, 4, 8), torch.zeros(1, 4, 8)), None)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_unbound_lowered_forward_names_the_call_to_make(pool: DistPool, root: str) -> None:
    text = pool.run(_unbound_attention, models.build("llama", root))[0]
    assert text.startswith("ShardingError: transformers.models.llama.modeling_llama.LlamaAttention: ")
    assert "call hp_lazy.parallelize(model) on the top-level model" in text


def _mismatched_source(rank: int, world: int, path: str) -> None:
    import dataclasses

    from hp_lazy.runtime import registry

    parity._load(path)  # imports (and lowers) modeling_llama
    name = "transformers.models.llama.modeling_llama"
    entry = registry.lookup(name)
    try:
        if rank == 1:
            registry._LOWERED[name] = dataclasses.replace(entry, source_sha256="f" * 64)
        import hp_lazy

        hp_lazy.parallelize(parity._load(path))
    finally:
        registry._LOWERED[name] = entry


def test_ranks_that_lowered_different_source_fail_instead_of_hanging(pool: DistPool, root: str) -> None:
    with pytest.raises(WorkerError) as info:
        pool.run(_mismatched_source, models.build("llama", root))
    text = str(info.value)
    assert "rank 0 raised" in text and "rank 1 raised" in text
    assert "(module, plan hash, slice hash, source sha256) but ranks [1] lowered" in text
    assert "activate the same plan on every rank" in text


def _load_kv3(rank: int, world: int, path: str) -> str:
    import hp_lazy

    try:
        hp_lazy.parallelize(parity._load(path))
    except hp_lazy.ShardingError as exc:
        return str(exc)
    return "no error"


def test_kv_heads_that_tp_cannot_split_or_replicate(pool: DistPool, root: str) -> None:
    import transformers

    path = os.path.join(root, "kv3")
    config = transformers.LlamaConfig(**{**models.BASE, "num_attention_heads": 6, "num_key_value_heads": 3,
                                         "hidden_size": 48})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    text = pool.run(_load_kv3, path)[0]
    assert text == (
        "model.layers.0.self_attn: num_key_value_heads=3 is not divisible by tp=2 and tp is not a multiple "
        "of it; use tp in [1, 3, 6]"
    )


def _accumulate(rank: int, world: int, path: str) -> dict:
    import hp_lazy

    model = parity._load(path)
    for seed in (1, 2):  # two micro-batches into the same .grad
        ids = models.batch(seed=seed)
        model(input_ids=ids, labels=ids).loss.backward()
    return hp_lazy.full_grads(model)


def test_gradient_accumulation_sums_partial_gradients_once_per_pass(pool: DistPool, root: str) -> None:
    """Qwen3's q/k norm gradients are partial over tp and summed at the end of each backward pass;
    accumulating two passes must give the single-process accumulated gradient."""
    import transformers

    path = models.build("qwen3", root)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path)
    for seed in (1, 2):
        ids = models.batch(seed=seed)
        reference(input_ids=ids, labels=ids).loss.backward()
    got = pool.run(_accumulate, path)[0]
    for name, param in reference.named_parameters():
        assert models.rel_err(got[name], param.grad) <= parity.TOL, name
    assert any("q_norm" in name for name in got)


def _packed_round_trip(rank: int, world: int) -> dict:
    from hp_lazy.plan.placement import Placement
    from hp_lazy.runtime.layout import plan_layout
    from hp_lazy.runtime.mesh import get_mesh

    groups = {"tp": get_mesh({"tp": world}).group("tp")}
    gate, up = torch.arange(8.0).view(4, 2), 100 + torch.arange(8.0).view(4, 2)
    fused = torch.cat([gate, up])  # a fused gate_up_proj weight [2 * inter, hidden]
    layout = plan_layout("mlp.gate_up_proj.weight", (8, 2), {"tp": Placement.parse("SS(0,2)")}, groups)
    local = layout.local(fused)
    return {"local": local, "full": layout.gather(local, groups)}


def test_packed_shard_takes_each_rank_its_chunk_of_every_block(pool: DistPool) -> None:
    """packed_colwise: rank r holds rows r of the gate block *and* of the up block, so the local
    weight is again [gate_r; up_r] and chunk(2) splits it correctly."""
    got = pool.run(_packed_round_trip)
    gate, up = torch.arange(8.0).view(4, 2), 100 + torch.arange(8.0).view(4, 2)
    for rank, result in enumerate(got):
        expected = torch.cat([gate[2 * rank : 2 * rank + 2], up[2 * rank : 2 * rank + 2]])
        assert torch.equal(result["local"], expected)
        assert torch.equal(result["full"], torch.cat([gate, up]))


def _generate(rank: int, world: int, path: str):
    model = parity._load(path)
    return model.generate(models.batch()[:1, :8], max_new_tokens=6, do_sample=False)


def test_generate_with_kv_cache_matches_one_process(pool: DistPool, root: str) -> None:
    """Inference too: the cache holds each rank's heads; greedy tokens equal one process's."""
    import transformers

    path = models.build("llama_gqa", root)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path)
    expected = reference.generate(models.batch()[:1, :8], max_new_tokens=6, do_sample=False)
    got = pool.run(_generate, path)
    assert expected.shape == (1, 14)
    assert all(torch.equal(tokens, expected) for tokens in got)


def test_unbound_answers_introspection_with_attribute_error() -> None:
    """hasattr, copy and deepcopy of a lowered class's unbound default see an ordinary object; a real
    use (a group, an op) still raises hp_lazy's message."""
    import copy

    import pytest

    from hp_lazy.errors import ShardingError
    from hp_lazy.runtime.rt import unbound

    value = unbound("LlamaAttention")
    assert not hasattr(value, "__deepcopy__")
    assert repr(copy.deepcopy(value)) == repr(copy.copy(value)) == "<hp_lazy unbound LlamaAttention>"
    with pytest.raises(ShardingError, match="^LlamaAttention: this forward was lowered by hp_lazy but runs on an "
                                             "instance that was never bound"):
        _ = value.tp


def _unsplit_warnings(rank: int, world: int, path: str) -> list[str]:
    import warnings

    import hp_lazy
    from hp_lazy.runtime.bind import UnsplitLayersWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hp_lazy.parallelize(models.load(path))
    return [str(w.message) for w in caught if issubclass(w.category, UnsplitLayersWarning)]


def test_layers_a_config_leaves_whole_under_tp_are_warned(pool: DistPool, root: str) -> None:
    """DiffLlama's 5.25 config plans only embed_tokens: its layers run whole on every rank, said
    by name with the fix; Llama's, split, say nothing (the control)."""
    assert pool.run(_unsplit_warnings, models.build("llama", root)) == [[], []]
    for text in pool.run(_unsplit_warnings, models.build("diffllama", root)):
        assert text == [
            "DiffLlamaForCausalLM: under tp=2 no module of its 2 attention layers (model.layers.0 ... model.layers.1) "
            "is split: DiffLlamaConfig.base_model_tp_plan plans only ['embed_tokens'], so every rank holds and runs "
            "those layers whole (one process's memory and compute for them); pass a plan that names their "
            "projections (README: Plans; `python -m hp_lazy layout` shows what each rank holds), or train this "
            "family without tp"
        ]


def _backbone_first_from_config(rank: int, world: int, path: str) -> dict:
    """A model built from its config (no shard-on-read), its backbone run first, then its head."""
    import transformers

    import hp_lazy

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    ids = models.batch()
    model.lm_head(model.model(input_ids=ids).last_hidden_state).square().mean().backward()
    grads = hp_lazy.full_grads(model) if world > 1 else {n: p.grad for n, p in model.named_parameters()}
    return {"head_rows": model.lm_head.weight.shape[0], "grads": grads}


def test_a_backbone_run_first_binds_the_whole_model(pool: DistPool, root: str) -> None:
    """The backbone's first forward binds the model it was built in: the head is cut over the
    vocabulary too (it stayed whole on every rank), every gradient one process's."""
    path = models.build("llama", root)
    ref = _backbone_first_from_config(0, 1, path)
    for rank in pool.run(_backbone_first_from_config, path):
        assert rank["head_rows"] == ref["head_rows"] // 2
        errors = {n: models.rel_err(rank["grads"][n], g) for n, g in ref["grads"].items()}
        assert len(errors) > 10 and max(errors.values()) <= parity.TOL, sorted(errors.items(), key=lambda e: -e[1])[:2]
