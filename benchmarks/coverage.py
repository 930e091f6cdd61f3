"""Family coverage of ``hp_lazy.activate("auto", tp=2)``: tensor-parallel parity on every
transformers family whose configuration declares ``base_model_tp_plan``.

Per family, in fresh processes (activation must precede the modeling import):

1. a clean process (no hp_lazy) builds a tiny config, picks the model class
   (``AutoModelForCausalLM`` where mapped, else ``AutoModelForSeq2SeqLM``, else ``AutoModel`` with a
   loss on its last hidden state), saves it with ``save_pretrained``, loads it back and runs one
   forward + backward: the reference logits (or hidden states), loss and every gradient;
2. two gloo ranks (127.0.0.1, ``GLOO_SOCKET_IFNAME=lo``, ``OMP_NUM_THREADS=1``) activate
   ``hp_lazy.activate("auto", tp=2)``, load the same directory, ``hp_lazy.parallelize`` it, run the
   same step and gather the full gradients (``hp_lazy.full_grads``);
3. the driver compares (relative max error <= 1e-5) and classifies the family:
   ``pass`` / ``fail`` (the exception's first line, or the worst tensor and its error) /
   ``unsupported`` (``Plan.auto`` raises a PlanError: the HF string it cannot honour yet) /
   ``skipped`` (no tiny config could be built or run without hp_lazy, with why).

With ``--cp 2`` the ranks activate ``hp_lazy.activate("auto", cp=2)`` instead (context parallel,
tp=1): each rank's logits are joined with ``hp_lazy.gather_sequence`` (the hidden-state loss is taken
of the joined states), and a ``ShardingError`` that refuses what context parallel cannot split
counts as ``unsupported``, with its reason.

With ``--ep 2`` the sweep covers the families whose configuration declares a non-empty
``base_model_ep_plan`` and the ranks activate ``hp_lazy.activate("auto", ep=2)`` (expert parallel,
tp=1; the two ranks are data parallel): rank r feeds row r of the reference's 2-row batch, the
logits (or hidden states) are concatenated over the ranks and the loss is the mean of the ranks'
losses (equal token counts per row, so one process's mean); the gradients, which hp_lazy averages
over dp, are compared whole (``full_grads`` gathers the expert shards) and each rank's local expert
shard against its slice (``chunk(2)[rank]`` along dim 0) of the reference gradient. Any PlanError or
ShardingError raised under ep counts as ``unsupported``, with its reason.

With ``--sp`` the ranks activate ``hp_lazy.activate("auto", tp=2, sequence_parallel=True)``: between
the tp boundaries each rank holds half the sequence; the step and the comparison are tp's. A
``PlanError`` or ``ShardingError`` that names sequence parallel counts as ``unsupported``, with its
reason; any other error (a shape error inside the model) is a ``fail``.

With ``--cp 2 --sp`` four ranks activate ``hp_lazy.activate("auto", cp=2, tp=2,
sequence_parallel=True)``: each cp rank's zigzag rows, cut again over its tp pair between the
boundaries; logits joined with ``gather_sequence`` and compared on every rank, refusals of either
kind counted as ``unsupported``.

With ``--ep 2 --cp 2 --sp`` (every axis at once) eight ranks activate ``hp_lazy.activate("auto",
ep=2, cp=2, tp=2, sequence_parallel=True)`` over the ep families: dp=2 x cp=2 x tp=2, the experts cut
over ep=2 carved out of dp x cp. Each dp rank feeds its row of the reference batch, each cp rank its
zigzag rows of it, cut again over tp; the logits are joined over cp and then dp, the loss is the dp
ranks' mean, and every rank's local shard of every cut parameter (experts and tp cuts alike) is
checked against its slice of the reference gradient (``ParamLayout.local``).

    python benchmarks/coverage.py [--families llama,qwen3] [--jobs 1] [--timeout 300] [--out FILE] [--cp 2 | --ep 2 | --sp | --cp 2 --sp | --ep 2 --cp 2 --sp]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

TOL = 1e-5
STATUSES = ("pass", "fail", "unsupported", "skipped")
_FIX_MARK = "instead of Plan.auto"


@dataclass(frozen=True)
class Row:
    family: str
    status: str
    reason: str


# -- discovery ---------------------------------------------------------------------------------
def transformers_dir() -> str:
    import transformers

    return os.path.dirname(transformers.__file__)


_EP_PLAN = re.compile(r"^\s*base_model_ep_plan[^=\n]*=\s*\{", re.M)


def families() -> list[str]:
    """Families with a configuration_*.py that declares ``base_model_tp_plan`` (under ``--ep``: a
    non-empty ``base_model_ep_plan``)."""
    found = set()
    for path in glob.glob(os.path.join(transformers_dir(), "models", "*", "configuration_*.py")):
        with open(path, encoding="utf-8") as f:
            text = f.read()
            if (_EP_PLAN.search(text) if _ep() > 1 else "base_model_tp_plan" in text):
                found.add(os.path.basename(os.path.dirname(path)))
    return sorted(found)


def short_plan_error(text: str) -> str:
    """``'moe_tp_experts' at XConfig.base_model_tp_plan['layers.*.mlp.experts']`` or the short text."""
    m = re.search(r"(\w+\.(?:base_model_tp_plan|_tp_plan)\[[^\]]+\]) = ('[^']+')", text)
    if m and "is not a style" in text:
        return f"{m.group(2)} at {m.group(1)}"
    text = text.split(": ", 1)[-1] if text.startswith("transformers.") else text
    return text.split("; write an explicit")[0][:220]


def precheck(family: str) -> Row | None:
    """``Plan.auto``'s verdict on ``modeling_<family>.py`` (pure: no torch, no hook)."""
    from hp_lazy.errors import PlanError
    from hp_lazy.plan.auto import auto_contracts, auto_parts
    from hp_lazy.plan.model import AutoFlags

    path = os.path.join(transformers_dir(), "models", family, f"modeling_{family}.py")
    if not os.path.exists(path):
        return Row(family, "skipped", f"no modeling_{family}.py in the installed transformers")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    try:
        name = f"transformers.models.{family}.modeling_{family}"
        if _ep() > 1:
            flags = AutoFlags(tp=2, ep=_ep(), cp=_cp(), sequence_parallel=True) if _all_axes() else AutoFlags(tp=1, ep=_ep())
            parts = auto_parts(name, source, flags)
            contracts = None if parts is None else parts[0]
        elif _cp() > 1:
            contracts = auto_contracts(name, source, tp=2 if _sp() else 1, cp=_cp(), sequence_parallel=_sp())
        else:
            contracts = auto_contracts(name, source, tp=2, sequence_parallel=_sp())
    except PlanError as exc:
        return Row(family, "unsupported", short_plan_error(str(exc)))
    if not contracts:
        return Row(family, "skipped", "Plan.auto derives no contract for the module")
    return None


# -- tiny configs ------------------------------------------------------------------------------
SHRINK: dict[str, Any] = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # MoE / MLA / linear attention / mamba / gpt-style / vision / audio
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=64, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_d_ssm=64,
    mamba_chunk_size=8, n_inner=64, rotary_dim=4, depth=2, num_heads=4, embed_dim=32, out_hidden_size=32,
    d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=64, decoder_ffn_dim=64, num_layers=2, hidden_dim=32, projection_dim=32, text_hidden_size=32,
    vision_hidden_size=32, mm_hidden_size=32, intermediate_size_mlp=64, global_head_dim=8, kv_channels=8,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, altup_num_inputs=2, laurel_rank=8,
    num_kv_shared_layers=0, attention_chunk_size=8,
    n_group=2, num_expert_group=2, topk_group=1,  # group-limited routing: 2 groups of the 4 experts, top-1 group
    moe_hidden_size=32, first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE (defaults of 2-3 leave no MoE layer)
    attention_dropout=0.0,  # a default above 0 (Seed-OSS) draws random masks: no run, one process or not, repeats
    index_topk=4, index_n_heads=2, index_head_dim=8,  # DSA: each query's top 4 of the 16 keys, so the selection shows
)
_INDEX_LIST = re.compile(r"(idx|indices|index|layers|_ids)$")


FAMILY_EXTRA: dict[str, dict[str, Any]] = {
    # its vision tower's config is an AutoConfig placeholder, which the shrink leaves at its default
    # (Pixtral, 30 layers of 2048: 6.6 GB in fp32, past this machine's memory at 4 ranks)
    "mistral_large4": dict(vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, head_dim=8)),
    # three stages (input / recurrent / output) of one layer each
    "dory": dict(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                 n_input_layers=1, n_recurrent_layers=1, n_output_layers=1),
    "bamba": dict(attn_layer_indices=[1]),  # one attention layer next to the mamba one
    "deepseek_v2": dict(num_experts_per_tok=2),  # None by default (unset)
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),  # layer 1: attention + MoE
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),  # None by default
    "deepseek_ocr2": dict(num_experts_per_tok=2, n_group=2, topk_group=1, mlp_layer_types=["dense", "sparse"]),
    "diffusion_gemma": dict(num_experts=4, top_k_experts=2, moe_intermediate_size=32),
    "ernie4_5_vl_moe": dict(mrope_section=[1, 1, 2]),  # (h, w, t): h and w interleave, so equal
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),  # None by default
    "granite4_vision": dict(deepstack_layer_map=[[1, 0]], downsample_rate="1/2", spatial_target_layers=[0, 1, 0, 1],
                            projector_dropout=0.0),  # None by default; the projector's dropout draws at random
    "granitemoehybrid": dict(layer_types=["linear_attention", "attention"]),  # all mamba by default
    "inkling2": dict(vocab_size=136, unpadded_vocab_size=128),  # the head: unpadded; the embedding: padded
    "inkling2_loop": dict(vocab_size=136, unpadded_vocab_size=128),
    "neomme": dict(head_dim=16),  # the full layers rotate a quarter of each head, a positive multiple of four
    # its compressed sparse attention keeps its default indexer: with 2 indexer heads of 8 its ep=2 run moves
    # 6.7e-5 even in float64 (selection ties; one process split by rows moves 4.7e-7), hiding what ep does
    "deepseek_v4": dict(index_topk=512, index_n_heads=64, index_head_dim=128),
    "step3p7": dict(sliding_window=8, mlp_layer_types=["dense", "sparse"]),  # no sliding window by default; MoE from layer 3
    # DSA families: dense for their first 3 layers by default, so the sweep's 2 layers would have no experts
    "deepseek_v32": dict(mlp_layer_types=["dense", "sparse"]),
    "glm_moe_dsa": dict(mlp_layer_types=["dense", "sparse"]),
    # the indexer's top-k (4) a multiple of its key pooling (16 by default); its DSA layers take no RoPE
    "glm5_next": dict(index_kpool=2, qk_rope_head_dim=0),
    "zaya": dict(num_experts_per_tok=1),  # top-1 routing only
    # one K/V source per kept layer; NVFP4 K/V rounding needs heads 16 wide; its indexer uses at most the
    # query heads of one K/V head (4 / 2). Layer 1 indexed (the defaults' 2 layers are both sliding windows),
    # with a pool of 8 keys in blocks of 2 and 1 sink + 2 local tokens, so that rows past 7 keys select
    "kolibri1_1": dict(kv_source_layers=[0, 1], head_dim=16, index_num_heads=2,
                       layer_types=["sliding_attention", "indexed_attention"], index_layers=[1], index_pool_size=8,
                       index_compression=2, index_num_local_tokens=2, index_num_sink_tokens=1),
    "gemma4": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),  # the MoE variant
    # its defaults leave the QSA indexer unset (every indexed layer needs one) and the n-gram tables at 20M rows;
    # PLE on layer 1 (linear attention, one-indexed), 4 n-gram heads of 8 over tables of ~70 rows
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                      indexer_compress_ratio=2, hc_lowrank=8, ple_layer_ids=[1], ple_embed_dim=32, heads_per_ngram=2,
                      ngram_vocab_size_base=64, make_ngram_vocab_size_divisible_by=8, eos_token_id=2),
    # MLA in both layer kinds (one K/V head per query head); its sliding layer's own sizes (per_layer_config)
    # with head_dim = nope + rope, as its validator asks
    "dots3_note": dict(per_layer_config={1: dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                                                 kv_lora_rank=16, head_dim=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                                                 v_head_dim=8)}),
    "cohere_compass": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}
FAMILY_MODEL: dict[str, tuple[str, str, str]] = {
    # no Auto class maps these configs: the model users fine-tune, by its class (config, model, mode)
    "qwen2_5_omni": ("Qwen2_5OmniThinkerConfig", "Qwen2_5OmniThinkerForConditionalGeneration", "lm"),
    "qwen3_omni_moe": ("Qwen3OmniMoeThinkerConfig", "Qwen3OmniMoeThinkerForConditionalGeneration", "lm"),
}
RETRIES: tuple[dict[str, Any], ...] = ({}, {"num_key_value_heads": 4})


def _defaults(cls: type) -> dict[str, Any]:
    """The default config's fields as the instance holds them (after ``__post_init__``)."""
    inst = cls()
    return {k: _field(inst, k, v) for k, v in inst.to_dict().items()}


def _field(inst: Any, key: str, stored: Any) -> Any:
    try:
        value = getattr(inst, key, stored)
    except Exception:  # noqa: BLE001 - a per-layer field read globally (heterogeneous configs)
        return stored
    plain = value is None or isinstance(value, (bool, int, float, str, list, tuple, dict))
    return value if plain else stored  # e.g. a per-layer config view: its stored form


def _layer_selection(default: dict[str, Any]) -> list[int] | None:
    """Old layer indices to keep: the first layer of each distinct ``layer_types`` kind (2..4)."""
    types, old = default.get("layer_types"), default.get("num_hidden_layers")
    if not isinstance(types, list) or not types:
        return None
    first: dict[str, int] = {}
    for i, kind in enumerate(types):
        first.setdefault(str(kind), i)
    sel = sorted(first.values())[:4]
    if len(sel) < 2:
        sel = [i for i in range(len(types))][:2]
    return sel if isinstance(old, int) else None


def shrunk_kwargs(cls: type, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``cls`` (a config class): SHRINK where the config has the field,
    per-layer lists cut to the kept layers, nested sub-configs shrunk the same way; ``extra`` (a
    family's FAMILY_EXTRA) last, at every level whose config declares the field."""
    extra = extra or {}
    default = _defaults(cls)
    amap = dict(getattr(cls, "attribute_map", {}) or {})
    out: dict[str, Any] = {}
    for key, value in SHRINK.items():
        target = amap.get(key, key)
        if target in default and (default[target] is not None or key in ("head_dim", "pad_token_id", "num_key_value_heads")):
            out[target] = [value] * len(default[target]) if isinstance(default[target], list) else value
    sel = _layer_selection(default)
    old_n = default.get(amap.get("num_hidden_layers", "num_hidden_layers"))
    if sel is not None:
        out["num_hidden_layers"] = len(sel)
        for key in default:
            value = out.get(key, default[key])
            if isinstance(value, list) and len(value) == old_n and not _INDEX_LIST.search(key):
                out[key] = [value[i] for i in sel]
    n = out.get("num_hidden_layers", 2)
    keep = sel or list(range(n))
    for key, value in default.items():
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value) and _INDEX_LIST.search(key):
            out[key] = [keep.index(v) for v in value if v in keep]
    per_layer = default.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer:  # heterogeneous layers: the overrides of the kept ones
        out["per_layer_config"] = {keep.index(int(i)): {k: out.get(k, v) for k, v in over.items()}  # sizes shrunk
                                   for i, over in per_layer.items() if int(i) in keep}
    for key in ("sliding_window", "attention_window"):
        if isinstance(default.get(key), int):
            out[key] = 8
    if "kv_lora_rank" in default:
        _shrink_mla(default, out)
    rope = default.get("rope_parameters")
    per_type = isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values())  # {layer type: params}
    if isinstance(rope, dict) and rope and not per_type and _uses_mrope(cls, rope):
        half = int(out.get("head_dim", 8) * rope.get("partial_rotary_factor", 1.0)) // 2  # rotated pairs
        section = extra.get("mrope_section") or [half - 2 * (half // 4), half // 4, half // 4]
        out["rope_parameters"] = {**rope, "mrope_section": section}  # sums to the rotated pairs
    for name, sub in (getattr(cls, "sub_configs", None) or {}).items():
        if isinstance(sub, type):
            try:
                out[name] = {**_defaults(sub), **shrunk_kwargs(sub, extra)}
            except Exception:  # noqa: BLE001 - an AutoConfig placeholder: leave its default
                pass
    out.update({k: v for k, v in extra.items() if k in default})
    return out


def _shrink_mla(default: dict[str, Any], out: dict[str, Any]) -> None:
    """MLA's head widths kept consistent: one K/V head per query head (kv_b_proj expands the
    latent to every head), the stored ``qk_head_dim`` = nope + rope, and ``head_dim`` (what the
    rotary table is built for) the rope width over the partial-rotary factor, as in the defaults."""
    if "num_key_value_heads" in out:
        out["num_key_value_heads"] = out.get("num_attention_heads", default.get("num_attention_heads"))
    nope, rope = out.get("qk_nope_head_dim"), out.get("qk_rope_head_dim")
    if "qk_head_dim" in default and nope and rope:
        out["qk_head_dim"] = nope + rope
    factor = (default.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    if rope and default.get("head_dim") and default["head_dim"] * factor == default.get("qk_rope_head_dim"):
        out["head_dim"] = int(rope / factor)


def _uses_mrope(cls: type, rope: dict[str, Any]) -> bool:
    if "mrope_section" in rope or "mrope_section" in getattr(cls, "ignore_keys_at_rope_validation", ()):
        return True
    modeling = sys.modules[cls.__module__].__file__.replace("configuration_", "modeling_")
    return os.path.exists(modeling) and "mrope_section" in open(modeling, encoding="utf-8").read()


def _config_classes(family: str) -> list[type]:
    import importlib

    found = []
    for path in sorted(glob.glob(os.path.join(transformers_dir(), "models", family, "configuration_*.py"))):
        name = f"transformers.models.{family}.{os.path.basename(path)[:-3]}"
        module = importlib.import_module(name)
        found += [v for v in vars(module).values()
                  if isinstance(v, type) and v.__module__ == name and isinstance(getattr(v, "model_type", None), str)
                  and getattr(v, "model_type", "")]
    return found


def pick_models(family: str) -> list[tuple[type, str, str]]:
    """(config class, Auto class name, mode) in order of preference: causal LM where mapped, else
    seq2seq LM, else AutoModel (the outermost config first, then the one declaring the TP plan)."""
    from transformers.models.auto import configuration_auto as ca
    from transformers.models.auto import modeling_auto as ma

    classes = _config_classes(family)
    if family in FAMILY_MODEL:
        config, model, mode = FAMILY_MODEL[family]
        return [(next(c for c in classes if c.__name__ == config), model, mode)]
    planned = [c for c in classes if getattr(c, "base_model_tp_plan", None)]
    nested = {sub for c in classes for sub in (getattr(c, "sub_configs", None) or {}).values()}
    tops = [c for c in classes if ca.CONFIG_MAPPING_NAMES.get(c.model_type) == c.__name__ and c not in nested]
    order = [
        (planned, ma.MODEL_FOR_CAUSAL_LM_MAPPING, "AutoModelForCausalLM", "lm"),
        (tops, ma.MODEL_FOR_CAUSAL_LM_MAPPING, "AutoModelForCausalLM", "lm"),
        (tops, ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING, "AutoModelForSeq2SeqLM", "seq2seq"),
        (tops, ma.MODEL_MAPPING, "AutoModel", "hidden"),
        (planned, ma.MODEL_MAPPING, "AutoModel", "hidden"),
    ]
    found = [(cls, auto, mode) for candidates, mapping, auto, mode in order for cls in candidates if cls in mapping]
    if not found:
        raise RuntimeError(f"no Auto class maps a config of {family} ({[c.__name__ for c in classes]})")
    return list(dict.fromkeys(found))


def _construct(cls: type, kwargs: dict[str, Any]) -> Any:
    """``cls(**kwargs)``, retried with the patches of RETRIES (e.g. no grouped-query attention)."""
    error: Exception | None = None
    for patch in RETRIES:
        try:
            return cls(**{**kwargs, **{k: v for k, v in patch.items() if k in kwargs}})
        except Exception as exc:  # noqa: BLE001 - strict dataclass validation of a family
            error = error or exc
    raise error  # type: ignore[misc]


def build_model(family: str, workdir: str) -> tuple[str, str]:
    """Save a tiny model of ``family`` in ``workdir`` (config, weights, meta.json): the first
    candidate of ``pick_models`` whose saved config the same Auto class maps back."""
    import torch
    import transformers

    errors = []
    for cls, auto, mode in pick_models(family):
        try:
            config = _construct(cls, shrunk_kwargs(cls, FAMILY_EXTRA.get(family)))
            torch.manual_seed(0)
            loader = getattr(transformers, auto)
            model = loader.from_config(config) if auto.startswith("Auto") else loader._from_config(config)
            if auto.startswith("Auto") and type(model.config) not in loader._model_mapping:
                auto = type(model).__name__  # a nested config (Emu3's text model): load by the class, as users do
        except Exception as exc:  # noqa: BLE001 - try the next candidate
            errors.append(exc)
            continue
        _perturb(model)
        model.save_pretrained(workdir)
        with open(os.path.join(workdir, "meta.json"), "w", encoding="utf-8") as f:
            json.dump({"auto": auto, "mode": mode, "config": cls.__name__, "model": type(model).__name__}, f)
        return auto, mode
    raise errors[0]


def _perturb(model: Any) -> None:
    """Visible biases and norm weights, so a dropped one shows."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1 if "norm" in name else 0.02)


# -- child processes ---------------------------------------------------------------------------
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _write_error(path: str, exc: BaseException) -> None:
    from hp_lazy.errors import PlanError, ShardingError

    kind = "plan" if isinstance(exc, PlanError) and _FIX_MARK in str(exc) else "error"
    reason = short_plan_error(str(exc)) if kind == "plan" else _first_line(exc)
    if isinstance(exc, ShardingError) and "context parallel" in str(exc) and _cp() > 1:
        kind, reason = "plan", str(exc)[:300]
    if isinstance(exc, (PlanError, ShardingError)) and _ep() > 1:
        kind, reason = "plan", _first_line(exc)
    if isinstance(exc, (PlanError, ShardingError)) and _sp() and "sequence" in str(exc):
        kind, reason = "plan", _first_line(exc)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"kind": kind, "reason": reason}, f)


def _cp() -> int:
    return int(os.environ.get("HP_COVERAGE_CP", "1"))


def _ep() -> int:
    return int(os.environ.get("HP_COVERAGE_EP", "1"))


def _sp() -> bool:
    return os.environ.get("HP_COVERAGE_SP", "0") == "1"


def _all_axes() -> bool:
    """``--ep 2 --cp 2 --sp``: dp=2 x cp=2 x tp=2 with sequence parallel, ep=2 carved out of dp x cp."""
    return _ep() > 1 and _cp() > 1 and _sp()


def _world() -> int:
    """Ranks per family: 8 for every axis at once, 4 for cp=2 x tp=2 (``--cp 2 --sp``), else 2."""
    return 8 if _all_axes() else 4 if _cp() > 1 and _sp() else 2


def _step(model: Any, mode: str, join: Any = None, rows: slice = slice(None)) -> tuple[Any, Any]:
    """One forward + backward on fixed ids (``rows`` of them): (logits or last hidden state, loss).
    ``join`` (context parallel): this rank's rows -> the whole sequence."""
    import torch

    join = join or (lambda t: t)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))[rows]
    if mode == "hidden":
        kwargs = {"decoder_input_ids": ids} if getattr(model.config, "is_encoder_decoder", False) else {}
        out = model(input_ids=ids, **kwargs)
        hidden = join(out[0])
        weight = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(2))
        loss = (hidden * weight.to(hidden.dtype)).mean()
    else:
        kwargs = {"decoder_input_ids": ids} if mode == "seq2seq" else {}
        out = model(input_ids=ids, labels=ids, **kwargs)
        hidden, loss = join(out.logits), out.loss
    loss.backward()
    return hidden.detach().clone(), loss.detach().clone()


def _load_options() -> dict[str, str]:
    """fp64 runs use the eager experts: transformers' grouped_mm kernels take no float64."""
    return {"experts_implementation": "eager"} if os.environ.get("HP_COVERAGE_DTYPE") == "float64" else {}


def _dtype() -> Any:
    import torch

    return getattr(torch, os.environ.get("HP_COVERAGE_DTYPE", "float32"))


def child_reference(family: str, workdir: str) -> None:
    """Clean process: build, save, reload, reference step."""
    import torch
    import transformers

    torch.set_num_threads(1)
    try:
        auto, mode = build_model(family, workdir)
    except Exception as exc:  # noqa: BLE001 - any failure to build is a "skipped"
        return _write_error(os.path.join(workdir, "skip.json"), exc)
    try:
        torch.manual_seed(0)
        model = getattr(transformers, auto).from_pretrained(workdir, dtype=_dtype(), **_load_options())
        out, loss = _step(model, mode)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        floor = _chunking_floor(workdir, auto, mode, out, loss, grads, type(model).__module__)
    except Exception as exc:  # noqa: BLE001
        return _write_error(os.path.join(workdir, "skip.json"), exc)
    torch.save({"out": out, "loss": loss, "grads": grads, "floor": floor}, os.path.join(workdir, "ref.pt"))


def _chunking_floor(workdir: str, auto: str, mode: str, out: Any, loss: Any, grads: dict[str, Any],
                    modeling_name: str) -> dict[str, float]:
    """For a model with a chunked recurrent kernel (transformers' gated delta rule, KDA or Mamba2
    scan, which compute in float32 whatever the dtype): how far one process is from itself when the
    kernels run in chunks of 2, per compared entry. Empty for every other model."""
    import torch
    import transformers

    modeling = sys.modules[modeling_name]
    names = [n for n in ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention", "mamba2_chunk_scan")
             if callable(getattr(modeling, n, None))]
    if not names:
        return {}
    kernels = {n: getattr(modeling, n) for n in names}
    for n, fn in kernels.items():
        setattr(modeling, n, lambda *a, _fn=fn, **k: _fn(*a, **{**k, "chunk_size": 2}))
    try:
        torch.manual_seed(0)
        model = getattr(transformers, auto).from_pretrained(workdir, dtype=_dtype(), **_load_options())
        other, other_loss = _step(model, mode)
    finally:
        for n, fn in kernels.items():
            setattr(modeling, n, fn)
    floor = {"logits/hidden": rel_err(other, out), "loss": rel_err(other_loss, loss)}
    floor.update({f"grad {n}": rel_err(p.grad, grads[n]) for n, p in model.named_parameters() if p.grad is not None})
    return floor


def child_rank(family: str, workdir: str) -> None:
    """One of the two ranks, with hp_lazy active before transformers is imported."""
    rank = int(os.environ["RANK"])
    try:
        import hp_lazy
        from hp_lazy.runtime import record

        if _all_axes():
            hp_lazy.activate("auto", ep=_ep(), cp=_cp(), tp=2, sequence_parallel=True)
        elif _ep() > 1:
            hp_lazy.activate("auto", ep=_ep())
        elif _cp() > 1:  # with --sp: cp x tp, sequence parallel inside each cp rank's rows
            hp_lazy.activate("auto", cp=_cp(), tp=2 if _sp() else 1, sequence_parallel=_sp())
        else:
            hp_lazy.activate("auto", tp=2, sequence_parallel=_sp())
        import datetime

        import torch
        import torch.distributed as tdist

        torch.set_num_threads(1)
        tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
        import transformers

        with open(os.path.join(workdir, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        import warnings

        from hp_lazy.runtime.bind import UnsplitLayersWarning

        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UnsplitLayersWarning)
            model = getattr(transformers, meta["auto"]).from_pretrained(workdir, dtype=_dtype(), **_load_options())
            hp_lazy.parallelize(model)
        unsplit = next((w.message.declared for w in caught if isinstance(w.message, UnsplitLayersWarning)), None)
        table = record.of(model).table
        sharded = sum(1 for name, _ in model.named_parameters() if table is not None and name in table)
        total = sum(1 for _ in model.parameters())
        dp = hp_lazy.mesh().group("dp")
        rows = slice(dp.rank, dp.rank + 1) if _ep() > 1 else slice(None)
        out, loss = _step(model, meta["mode"], hp_lazy.gather_sequence if _cp() > 1 else None, rows)
        local = {}
        if _ep() > 1:  # each cut parameter's gradient on this rank against its slice of the reference's
            out, loss = _join_dp(out, loss, dp.pg)
            ref = torch.load(os.path.join(workdir, "ref.pt"))["grads"]
            local = {n: (p.grad.detach().clone(), table.get(n).local(ref[n])) for n, p in model.named_parameters()
                     if p.grad is not None and table is not None and table.get(n) is not None and n in ref
                     and tuple(p.shape) != table.get(n).full_shape}
        grads = hp_lazy.full_grads(model)
    except BaseException as exc:  # noqa: BLE001
        _write_error(os.path.join(workdir, f"err{rank}.json"), exc)
        raise
    torch.save({"out": out, "loss": loss, "grads": grads, "sharded": sharded, "total": total, "local": local,
                "unsplit": unsplit},
               os.path.join(workdir, f"got{rank}.pt"))


def _join_dp(out: Any, loss: Any, group: Any) -> tuple[Any, Any]:
    """Expert parallel: this dp rank's rows -> the global batch's (logits or hidden states
    concatenated in dp rank order, the mean of the dp ranks' losses)."""
    import torch
    import torch.distributed as tdist

    size = tdist.get_world_size(group)
    parts = [torch.empty_like(out) for _ in range(size)]
    tdist.all_gather(parts, out.contiguous(), group=group)
    loss = loss.clone()
    tdist.all_reduce(loss, group=group)
    return torch.cat(parts, dim=0), loss / size


# -- driver ------------------------------------------------------------------------------------
def _env(dtype: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "HP_COVERAGE_DTYPE": dtype, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TOKENIZERS_PARALLELISM": "false"}
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(role: str, family: str, workdir: str, env: dict[str, str], log: str) -> subprocess.Popen:
    with open(log, "w", encoding="utf-8") as out:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), f"--_{role}", family, workdir],
                                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)


def _wait(procs: list[subprocess.Popen], deadline: float) -> bool:
    """Wait for every process; on the deadline kill the ones still running. True if all ended."""
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            return False
    return True


def _read_error(path: str) -> dict[str, str] | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _log_tail(path: str, proc: subprocess.Popen | None = None) -> str:
    """The last error-looking line of a child's log, else its exit status."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [ln for ln in f.read().strip().splitlines() if re.search(r"Error|Killed|Abort|Segmentation", ln)]
    status = f"exit status {proc.returncode}" if proc is not None else "no result"
    return f"{lines[-1][:260]} ({status})" if lines else status


def run_family(family: str, timeout: float) -> Row:
    row = precheck(family)
    if row is not None:
        return row
    dtype = os.environ.get("HP_COVERAGE_DTYPE", "float32")
    with tempfile.TemporaryDirectory(prefix=f"hpcov_{family}_") as workdir:
        row = _run_in(family, workdir, timeout, dtype)
    if row.status == "fail" and ": rel err " in row.reason and dtype == "float32":
        with tempfile.TemporaryDirectory(prefix=f"hpcov_{family}_") as workdir:
            again = _run_in(family, workdir, timeout, "float64")
        if again.status == "pass":  # the gradient is right; fp32 conditioning of this model is not
            row = Row(family, "pass", f"float64: {again.reason}; float32: {row.reason} (round-off only)")
        else:
            row = Row(family, row.status, f"{row.reason}; float64 rerun: {again.reason} (also fails)")
    return row


def _run_in(family: str, workdir: str, timeout: float, dtype: str) -> Row:
    deadline = time.monotonic() + timeout
    ref_log = os.path.join(workdir, "ref.log")
    ref = _spawn("ref", family, workdir, _env(dtype), ref_log)
    if not _wait([ref], deadline):
        return Row(family, "skipped", f"reference run timed out after {timeout:.0f}s")
    skip = _read_error(os.path.join(workdir, "skip.json"))
    if skip is not None or not os.path.exists(os.path.join(workdir, "ref.pt")):
        return Row(family, "skipped", skip["reason"] if skip else f"reference crashed: {_log_tail(ref_log, ref)}")
    port = str(_free_port())
    procs = [
        _spawn("rank", family, workdir, _env(dtype, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(_world()),
                                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
               os.path.join(workdir, f"rank{r}.log"))
        for r in range(_world())
    ]
    finished = _wait(procs, deadline)
    errors = [e for e in (_read_error(os.path.join(workdir, f"err{r}.json")) for r in range(_world())) if e]
    plan_errors = [e for e in errors if e["kind"] == "plan"]
    if plan_errors:
        return Row(family, "unsupported", plan_errors[0]["reason"])
    if errors:
        return Row(family, "fail", errors[0]["reason"])
    if not finished:
        return Row(family, "fail", f"timed out after {timeout:.0f}s (a rank hung in a collective?)")
    missing = [r for r in range(_world()) if not os.path.exists(os.path.join(workdir, f"got{r}.pt"))]
    if missing:
        log = os.path.join(workdir, f"rank{missing[0]}.log")
        return Row(family, "fail", f"rank {missing[0]} crashed: {_log_tail(log, procs[missing[0]])}")
    return _compare(family, workdir)


def rel_err(a: Any, b: Any) -> float:
    import torch

    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return float("inf")
    return float(torch.nan_to_num((a - b).abs().max() / b.abs().max().clamp_min(1e-12), nan=float("inf")))


def _compare(family: str, workdir: str) -> Row:
    import torch

    ref = torch.load(os.path.join(workdir, "ref.pt"))
    floor = ref.get("floor", {})
    worst: tuple[float, str] = (0.0, "")
    floored: list[str] = []
    for r in range(_world()):
        got = torch.load(os.path.join(workdir, f"got{r}.pt"))
        errs = {"logits/hidden": rel_err(got["out"], ref["out"]), "loss": rel_err(got["loss"], ref["loss"])}
        if r == 0:
            diff = set(got["grads"]) ^ set(ref["grads"])
            if diff:
                return Row(family, "fail", f"gradient sets differ: {sorted(diff)[:3]}")
            errs.update({f"grad {n}": rel_err(got["grads"][n], g) for n, g in ref["grads"].items()})
        for n, (g, want) in got.get("local", {}).items():  # this rank's shard vs its slice of the reference
            errs[f"local grad {n}"] = rel_err(g, want)
        for name, err in errs.items():
            limit = max(TOL, 2 * floor.get(name, 0.0))
            if err > limit:
                return Row(family, "fail", f"rank {r} {name}: rel err {err:.2e} (limit {limit:.1e})")
            if err > TOL:
                floored.append(f"{name} {err:.1e} (one process's own floor {floor[name]:.1e})")
        name, err = max(errs.items(), key=lambda kv: kv[1])
        worst = max(worst, (err, f"rank {r} {name}"))
        if r == 0:
            share = f"{got['sharded']}/{got['total']} params sharded"
            if _ep() > 1:  # the shards each rank was checked on, against its slice of the reference
                share += f", {len(got['local'])} local shards checked"
            if got.get("unsplit"):  # UnsplitLayersWarning: the config's plan leaves every layer whole
                share += f" (layers whole: {got['unsplit']})"
    if share.startswith("0/") and _cp() == 1:  # tp, or ep: some expert parameter must be cut
        return Row(family, "fail", f"parity holds but nothing was sharded ({share})")
    if floored:  # a float32 recurrent kernel: within twice one process's distance from itself
        return Row(family, "pass", f"{share}, max rel err {worst[0]:.1e}; above {TOL:g} only within twice one "
                   f"process's own chunking floor: {'; '.join(sorted(set(floored))[:3])}")
    return Row(family, "pass", f"{share}, max rel err {worst[0]:.1e}")


# -- report ------------------------------------------------------------------------------------
def read_table(path: str) -> dict[str, Row]:
    """The rows of a table :func:`render` wrote (``--update`` replaces some of them)."""
    rows = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and len(cells) == 3 and cells[1] in STATUSES:
                rows[cells[0]] = Row(*cells)
    return rows

def render(rows: list[Row]) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
    mode = ("ep=2, cp=2, tp=2, sequence_parallel=True" if _all_axes() else "ep=2" if _ep() > 1 else "cp=2, tp=2, sequence_parallel=True" if _cp() > 1 and _sp() else "cp=2"
            if _cp() > 1 else "tp=2, sequence_parallel=True" if _sp() else "tp=2")
    out = {"ep=2": "--ep 2 --out benchmarks/coverage_ep.md",
           "ep=2, cp=2, tp=2, sequence_parallel=True": "--ep 2 --cp 2 --sp --out benchmarks/coverage_all_axes.md", "cp=2": "--cp 2 --out benchmarks/coverage_cp.md",
           "tp=2, sequence_parallel=True": "--sp --out benchmarks/coverage_sp.md",
           "cp=2, tp=2, sequence_parallel=True": "--cp 2 --sp --out benchmarks/coverage_cp_sp.md",
           "tp=2": "--out benchmarks/coverage.md"}[mode]
    plan = "a non-empty `base_model_ep_plan`" if _ep() > 1 else "`base_model_tp_plan`"
    split = (" dp=2 x cp=2 x tp=2, ep=2 carved out of dp x cp: each dp rank feeds one of the reference's 2 rows, "
             "each cp rank its zigzag rows of it, cut again over tp between the boundaries; logits joined over cp "
             "then dp, loss the dp ranks' mean, every rank's shard of every cut parameter also checked against its "
             "slice of the reference gradient." if _all_axes() else
             " Under ep each rank feeds one of the reference's 2 rows (data parallel); logits joined over the "
             "ranks, loss the ranks' mean, expert shards also checked against their slice of the reference "
             "gradient." if _ep() > 1 else "")
    lines = [
        f"# hp_lazy `activate(\"auto\", {mode})` coverage",
        "",
        f"transformers families whose configuration declares {plan}: {len(rows)}; "
        + ", ".join(f"{s} {n}" for s, n in counts.items()) + ".",
        "",
        f"Tiny configs (hidden 32, 2-4 layers, 4 heads, 2 kv heads, vocab 128), {_world()} gloo ranks on CPU; "
        "logits (or last hidden state), loss and every gradient vs one process, relative max error "
        f"<= {TOL:g}.{split} Generated by `python benchmarks/coverage.py {out}`.",
        "",
        "| family | status | reason |",
        "|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row.family} | {row.status} | {row.reason.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="", help="comma-separated family names (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="families run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per family")
    parser.add_argument("--out", default="", help="write the markdown table here")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                        help="dtype of every run (float64 tells round-off from a wrong gradient)")
    parser.add_argument("--cp", type=int, default=1, choices=(1, 2), help="2: context parallel (cp=2) instead of tp=2")
    parser.add_argument("--ep", type=int, default=1, choices=(1, 2), help="2: expert parallel (ep=2, dp=2) instead of tp=2")
    parser.add_argument("--sp", action="store_true",
                        help="tp=2 with sequence_parallel=True (with --cp 2: cp=2 x tp=2 on 4 ranks)")
    parser.add_argument("--update", action="store_true",
                        help="rerun only --families and replace their rows in --out (the other rows kept)")
    parser.add_argument("--_ref", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--_rank", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true",
                        help="one family (llama; qwen3_moe under --ep): does the sweep run?")
    args = parser.parse_args(argv)
    if args.smoke:
        args.families = "qwen3_moe" if args.ep > 1 else "llama"
    if args._ref:
        child_reference(*args._ref)
        return 0
    if args._rank:
        child_rank(*args._rank)
        return 0
    os.environ["HP_COVERAGE_DTYPE"] = args.dtype
    os.environ["HP_COVERAGE_CP"] = str(args.cp)
    os.environ["HP_COVERAGE_EP"] = str(args.ep)
    os.environ["HP_COVERAGE_SP"] = "1" if args.sp else "0"
    if (args.ep > 1) + (args.cp > 1) + args.sp > 1 and not (args.cp > 1 and args.sp):
        parser.error("--ep, --cp and --sp are separate sweeps (but --cp 2 --sp: cp=2 x tp=2 with sequence "
                     "parallel, and --ep 2 --cp 2 --sp: every axis at once)")
    names = [f for f in args.families.split(",") if f] or families()
    if args.update and not (args.out and args.families):
        parser.error("--update needs --out (the table to update) and --families (the rows to rerun)")
    kept = read_table(args.out) if args.update else {}
    rows: dict[str, Row] = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = {pool.submit(run_family, name, args.timeout): name for name in names}
        for future in concurrent.futures.as_completed(futures):
            name = futures[future]
            try:
                rows[name] = future.result()
            except Exception as exc:  # noqa: BLE001 - a driver bug must not lose the other rows
                rows[name] = Row(name, "fail", f"driver: {_first_line(exc)}")
            print(f"{name}: {rows[name].status} — {rows[name].reason}", file=sys.stderr, flush=True)
    if args.update:
        unknown = sorted(set(names) - set(kept) - set(families()))
        if unknown:
            parser.error(f"--update: {unknown} are neither rows of {args.out} nor families of this sweep")
        kept.update(rows)
        rows, names = kept, sorted(kept)
    table = render([rows[n] for n in names])
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
