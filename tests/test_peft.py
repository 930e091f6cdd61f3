"""PEFT LoRA on ``Plan.auto`` models, ``get_peft_model`` before (lazy binding) and after
``hp_lazy.parallelize``: loss, every adapter gradient and three SGD steps against the same PEFT
model in one process; ``merge_and_unload`` and ``save_pretrained`` give the one-process adapter.
tp=2, and tp=4 with sequence parallel on a GQA model whose K/V heads (and their lora_B) are kept
on two ranks each."""

from __future__ import annotations

import os

import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def _peft(model, targets=TARGETS, **extra):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)  # the adapters' init: the same draws in every process
    config = {"r": 4, "lora_alpha": 8, "target_modules": targets, "lora_dropout": 0.0, **extra}
    peft_model = get_peft_model(model, LoraConfig(**config))
    gen = torch.Generator().manual_seed(3)  # lora_B starts at zero; make lora_A's gradient non-zero too
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return peft_model


def _reference(path: str, ids, **extra) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    model = _peft(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), **extra)
    result = models.run_training(model, ids)
    result["adapter"] = {k: v for k, v in result["state"].items() if "lora_" in k or "lm_head.base_layer" in k}
    result["merged"] = {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}
    return result


def _activate(rank: int, world: int, tp: int, sp: bool) -> None:
    import hp_lazy

    hp_lazy.activate(hp_lazy.Plan.auto(tp=tp, sequence_parallel=sp))


def _ready(pool: DistPool, sp: bool) -> DistPool:
    """``pool`` with the plan activated once per set of workers (tp = the pool's world)."""
    if getattr(pool, "_hp_peft", None) is not pool._procs or not pool._procs:
        pool.run(_activate, pool.world_size, sp)
        pool._hp_peft = pool._procs
    return pool


def _run(rank: int, world: int, path: str, ids, when: str, save_dir: str, **extra) -> dict:
    import hp_lazy

    model = parity._load(path)
    if when == "after":
        hp_lazy.parallelize(model)
    peft_model = _peft(model, **extra)
    if when == "after":
        hp_lazy.parallelize(peft_model)  # optional: the wrapper of a bound model is re-bound now
    result = models.run_training(peft_model, ids, full_grads=hp_lazy.full_grads, full_state_dict=hp_lazy.full_state_dict)
    # on every rank (the adapter is gathered); PEFT also saves the targeted lm_head's base weight
    peft_model.save_pretrained(save_dir, is_main_process=rank == 0)
    merged = peft_model.merge_and_unload()
    result["merged"] = hp_lazy.full_state_dict(merged)
    result["merged_logits"] = merged(input_ids=ids).logits.detach()
    return result if rank == 0 else {"loss": result["loss"]}


@pytest.fixture(scope="module")
def peft_refs(refs) -> dict:
    out = {}
    for name in ("llama_bias", "llama_gqa"):
        path = models.build(name, refs.root)
        out[name] = (path, _reference(path, models.batch()))
    return out


def _check(results: list[dict], ref: dict, save_dir: str) -> float:
    got = results[0]
    assert len(got["grads"]) == len([k for k in ref["grads"] if "lora_" in k]) >= 30  # adapters only: the base is frozen
    errors = parity.compare(got, ref)
    assert all(models.rel_err(r["loss"], ref["loss"]) <= parity.TOL for r in results)
    for name, value in ref["merged"].items():
        assert models.rel_err(got["merged"][name], value) <= parity.TOL, name
    _check_saved_adapter(save_dir, ref)
    return max(errors.values())


def _check_loaded_adapter(path: str, save_dir: str, ref: dict) -> None:
    """A plain process (no hp_lazy) loads the saved adapter with PEFT's own call: the trained one."""
    import torch
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, save_dir).state_dict()
    for key, value in ref["adapter"].items():
        assert models.rel_err(loaded[key], value) <= parity.TOL, key


def _check_saved_adapter(save_dir: str, ref: dict) -> None:
    from safetensors.torch import load_file

    saved = load_file(os.path.join(save_dir, "adapter_model.safetensors"))
    assert len(saved) == len(ref["adapter"])
    for key, value in ref["adapter"].items():
        stored = key.replace(".default", "")  # PEFT drops the adapter name on save
        assert saved[stored].shape == value.shape, key
        assert models.rel_err(saved[stored], value) <= parity.TOL, key


@pytest.mark.parametrize("when", ["before", "after"])
def test_lora_tp2(when: str, peft_refs, pool2: DistPool, tmp_path) -> None:
    path, ref = peft_refs["llama_bias"]  # attention and MLP biases: o_proj/down_proj's deferred
    results = _ready(pool2, False).run(_run, path, models.batch(), when, str(tmp_path))
    assert _check(results, ref, str(tmp_path)) <= parity.TOL
    _check_loaded_adapter(path, str(tmp_path), ref)


@pytest.mark.parametrize("when", ["before", "after"])
def test_lora_tp4_sequence_parallel_replicated_kv(when: str, peft_refs, pool4: DistPool, tmp_path) -> None:
    path, ref = peft_refs["llama_gqa"]  # 2 kv heads at tp=4: k/v_proj and their lora_B kept on 2 ranks
    results = _ready(pool4, True).run(_run, path, models.batch(), when, str(tmp_path))
    assert _check(results, ref, str(tmp_path)) <= parity.TOL


def test_lora_dropout_is_one_process_masks(peft_refs, pool2: DistPool, tmp_path) -> None:
    """lora_dropout=0.1: colwise adapters see the replicated input (torch's own masks), rowwise ones
    draw one process's mask for the full input and keep their columns."""
    path, _ = peft_refs["llama_bias"]
    ref = _reference(path, models.batch(), lora_dropout=0.1)
    results = _ready(pool2, False).run(_run, path, models.batch(), "before", str(tmp_path), lora_dropout=0.1)
    assert max(parity.compare(results[0], ref).values()) <= parity.TOL


def _run_refused(rank: int, world: int, path: str, targets: list[str], extra: dict) -> str:
    import transformers

    import hp_lazy
    from hp_lazy.errors import ShardingError

    # built from its config, not loaded: from_pretrained shards on read, and DoRA's own init then reads a
    # sharded base weight and fails inside PEFT before hp_lazy sees the layer
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    peft_model = _peft(model, targets=targets, **extra)
    try:
        hp_lazy.parallelize(peft_model.base_model.model)
    except ShardingError as exc:
        return str(exc)
    return "bound"


@pytest.mark.parametrize(
    ("targets", "extra", "message"),
    [
        (["o_proj"], {"use_dora": True}, "model.layers.0.self_attn.o_proj: LoRA variant ['DoraLinearVariant'] (adapters ['default'])"),
        (["o_proj"], {"lora_bias": True}, "model.layers.0.self_attn.o_proj: lora_bias=True on a rowwise base"),
        (["embed_tokens"], {}, "model.embed_tokens: PEFT wraps this sharded Embedding (S(0)) in peft.tuners.lora"),
    ],
)
def test_what_cannot_be_exact_is_refused(targets, extra, message: str, peft_refs, pool2: DistPool) -> None:
    path, _ = peft_refs["llama_bias"]
    got = _ready(pool2, False).run(_run_refused, path, targets, extra)
    assert message in got[0] and got[0] == got[1]


def _attributes(rank: int, world: int, path: str) -> list[str]:
    """Every sharded nn.Linear / nn.Embedding reports the full module's sizes (hp_lazy's contract,
    what PEFT sizes adapters from) while its weight holds the local shard of the layout table."""
    from torch import nn

    import hp_lazy
    from hp_lazy.runtime import record

    model = hp_lazy.parallelize(parity._load(path))
    table = record.of(model).table
    checked = []
    for name, module in model.named_modules():
        layout = table.get(f"{name}.weight")
        if layout is None or not layout.shards:
            continue
        assert tuple(module.weight.shape) == layout.local_shape != layout.full_shape, name
        if isinstance(module, nn.Linear):
            assert (module.out_features, module.in_features) == layout.full_shape, name
        elif isinstance(module, nn.Embedding):
            assert (module.num_embeddings, module.embedding_dim) == layout.full_shape, name
        else:
            continue
        checked.append(f"{name} {layout.describe()}")
    return checked


def test_module_attributes_are_global(peft_refs, pool4: DistPool) -> None:
    path, _ = peft_refs["llama_gqa"]
    checked = _ready(pool4, True).run(_attributes, path)[0]
    assert "model.layers.0.self_attn.k_proj S(0) (kept on 2 ranks)" in checked  # replicated K/V heads
    assert "model.embed_tokens S(0)" in checked and "lm_head S(0)" in checked
    assert len(checked) == 2 + 7 * models.BASE["num_hidden_layers"]


def _run_unsummed(rank: int, world: int, path: str, ids) -> dict:
    """Negative control: the adapters' partial gradients (colwise lora_A, rowwise lora_B) not summed over tp."""
    import hp_lazy
    from hp_lazy.runtime.style import BindContext

    model = _peft(parity._load(path))
    lora = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    original = BindContext.add_partial

    def add_partial(self, param, axis, slots=1, slot=0):  # type: ignore[no-untyped-def]
        if id(param) not in lora:
            original(self, param, axis, slots, slot)

    BindContext.add_partial = add_partial  # type: ignore[method-assign]
    try:
        result = models.run_training(model, ids, full_grads=hp_lazy.full_grads, full_state_dict=hp_lazy.full_state_dict)
    finally:
        BindContext.add_partial = original  # type: ignore[method-assign]
    return result if rank == 0 else {}


def test_unsummed_adapter_gradients_fail_parity(peft_refs, pool2: DistPool) -> None:
    path, ref = peft_refs["llama_bias"]
    got = _ready(pool2, False).run(_run_unsummed, path, models.batch())[0]
    assert models.rel_err(got["loss"], ref["loss"]) <= parity.TOL  # forward is unaffected
    with pytest.raises(AssertionError, match=r"grad base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A"):
        parity.compare(got, ref)


def _adapter_norm(model, ids) -> float:
    import torch

    model(input_ids=ids, labels=ids).loss.backward()
    return float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1e9))


def _run_norm(rank: int, world: int, path: str, ids) -> float:
    import hp_lazy

    model = hp_lazy.parallelize(parity._load(path))
    return _adapter_norm(_peft(model), ids)


def test_stock_clip_grad_norm_of_adapters(peft_refs, pool2: DistPool) -> None:
    """torch's clip_grad_norm_ over the adapters (what Trainer clips): one process's norm."""
    import torch
    import transformers

    path, _ = peft_refs["llama_bias"]
    norms = _ready(pool2, False).run(_run_norm, path, models.batch())
    torch.manual_seed(0)
    ref = _adapter_norm(_peft(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)), models.batch())
    assert all(abs(n - ref) <= parity.TOL * ref for n in norms), (norms, ref)
