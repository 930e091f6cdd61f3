"""Tiny transformers models for parity tests: built from config objects with fixed random
weights, saved with ``save_pretrained`` and loaded back, so the real loading path runs."""

from __future__ import annotations

import os
from typing import Any

VOCAB = 128

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama_bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    # tp=4 > num_key_value_heads=2: each K/V head lives on two ranks
    "llama_gqa": ("LlamaConfig", {"num_key_value_heads": 2}),
    # tp=2 > num_key_value_heads=1: the K/V head lives on both ranks (its gradient norm counted once)
    "llama_mqa": ("LlamaConfig", {"num_key_value_heads": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    # tied weights behind a scaled nn.Embedding subclass
    "gemma": ("GemmaConfig", {"head_dim": 8, "tie_word_embeddings": True}),
    # experts tensor parallel (moe_tp_experts); layer 0 a dense MLP, layer 1 an MoE block
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "mlp_only_layers": [0], "norm_topk_prob": True}),
}

MOE = ("qwen3_moe",)

_DSA = {"q_lora_rank": 16, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
        "head_dim": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 16, "n_group": 1, "topk_group": 1, "index_topk": 4, "index_n_heads": 2,
        "index_head_dim": 8}

_GEMMA4 = {"head_dim": 8, "global_head_dim": 8, "num_key_value_heads": 2, "sliding_window": 6,
           "layer_types": ["sliding_attention", "full_attention"], "hidden_size_per_layer_input": 8,
           "vocab_size_per_layer_input": VOCAB, "num_kv_shared_layers": 0, "pad_token_id": 0, "bos_token_id": 1,
           "eos_token_id": 2}

_T5GEMMA = {"head_dim": 8, "num_key_value_heads": 2, "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 6}

MORE_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # layer 0 a sliding-window layer (window 6), layer 1 full attention; q/k norms; GQA
    "qwen3_sliding": ("Qwen3Config", {"head_dim": 8, "num_key_value_heads": 2, "use_sliding_window": True,
                                      "sliding_window": 6, "max_window_layers": 1,
                                      "layer_types": ["sliding_attention", "full_attention"]}),
    # two heads: fewer than cp=4 ranks, which Ulysses cannot split
    "llama_2heads": ("LlamaConfig", {"num_attention_heads": 2, "num_key_value_heads": 2}),
    # transformers 5.25's head-unit styles: k/v_proj "unit_colwise" with 2 K/V heads (at tp=4 each on
    # two ranks), a gated q projection; layer 0 dense, layer 1 routed experts and a shared MLP
    "minicpm5_moe": ("MiniCPM5MoeConfig", {"head_dim": 8, "num_key_value_heads": 2, "n_routed_experts": 4,
                                           "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                           "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # a fused qkv_proj planned as leaves (no attention boundary in its TP plan)
    "phi3": ("Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # GLM-4: gate_up_proj's output halved by chunk(2) (transformers gathers it; hp_lazy packs it)
    "glm4": ("Glm4Config", {"head_dim": 8, "pad_token_id": 0, "eos_token_id": 2}),
    # transformers 5.25's config plans only the embedding: the layers stay whole under tp (warned)
    "diffllama": ("DiffLlamaConfig", {}),
    # an MoE block that hands its shared experts the hidden states flattened to rows, [B * S, H]
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32,
                                            "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
                                            "moe_layer_end_index": 1}),
    # dynamic RoPE rescales by the largest position seen: 16-token batches pass the 8 it was built for
    "llama_dynamic": ("LlamaConfig", {"max_position_embeddings": 8,
                                      "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    # expert parallel: a shared expert beside 4 routed experts (top-2), layer 0 dense
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48, "mlp_only_layers": [0],
                                     "norm_topk_prob": False}),
    # expert parallel at ep=4: 8 experts, top-2, both layers MoE
    "qwen3_moe8": ("Qwen3MoeConfig", {"head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 16, "norm_topk_prob": True}),
    # 3 experts: not divisible by ep=2 (refused)
    "qwen3_moe3": ("Qwen3MoeConfig", {"head_dim": 8, "num_experts": 3, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 16, "mlp_only_layers": [0]}),
    # MLA (multi-head latent attention): a q LoRA (q_a_proj -> norm -> q_b_proj), the joint K/V down
    # projection kv_a_proj_with_mqa ('mla_kv_a_proj', replicated) and kv_b_proj; DeepSeek-V2's MoE
    # (4 routed experts top-2, a shared expert, softmax routing), layer 0 dense
    "deepseek_v2": ("DeepseekV2Config", {"q_lora_rank": 16, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
                                         "qk_nope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4,
                                         "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 16,
                                         "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                                         "attention_bias": True}),
    # MLA without a q LoRA (q_proj colwise), a dense model; V heads wider than K heads (12 > 8)
    "minicpm3": ("MiniCPM3Config", {"q_lora_rank": None, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
                                    "qk_nope_head_dim": 4, "v_head_dim": 12}),
    # MLA with DeepSeek-V3 routing (sigmoid, a correction bias, a shared expert)
    "glm4_moe_lite": ("Glm4MoeLiteConfig", {"q_lora_rank": 16, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
                                            "qk_nope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4,
                                            "num_experts_per_tok": 2, "n_shared_experts": 1,
                                            "moe_intermediate_size": 16, "first_k_dense_replace": 1,
                                            "n_group": 1, "topk_group": 1}),
    # GPT-OSS: experts with biases and a clamped SwiGLU, forward(hidden_states, router_indices,
    # routing_weights); a router with a bias (mlp.router); attention sinks, a sliding layer and a full one
    # logit softcapping at 0.1, where it moves the logits (3.4e-4 relative; the default 50 does not, 1.7e-7)
    "gemma2": ("Gemma2Config", {"head_dim": 8, "attn_logit_softcapping": 0.1}),
    "mistral_large4_text": ("MistralLarge4TextConfig", {  # transformers 5.25: DSA (a top-k indexer), MLA
        "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8, "q_lora_rank": None,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "index_topk": 4,
        "index_n_heads": 2, "index_head_dim": 8}),
    # what context parallel refuses by layer: Doge builds its own (dynamic) mask; DeepSeek-V4 attends
    # to K/V compressed over the whole sequence
    "doge": ("DogeConfig", {"num_key_value_heads": 2}),
    "deepseek_v4": ("DeepseekV4Config", {"moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                         "q_lora_rank": 16, "qk_rope_head_dim": 8, "head_dim": 8,
                                         "num_key_value_heads": 2, "sliding_window": 8,
                                         "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention"],
                                         "mlp_layer_types": ["hash_moe", "moe"]}),
    # Llama 4: layer 0 chunked attention (chunks of 8 tokens) with RoPE, layer 1 full attention without RoPE
    # whose queries are temperature-tuned by their row's index (floor_scale 2, so the factor varies at 16
    # tokens; the default 8,192 leaves it 1 below 8k tokens); a routed expert and a shared one
    "llama4": ("Llama4TextConfig", {"head_dim": 8, "num_key_value_heads": 2, "intermediate_size_mlp": 64,
                                    "num_local_experts": 4, "num_experts_per_tok": 1, "attention_chunk_size": 8,
                                    "floor_scale": 2, "layer_types": ["chunked_attention", "full_attention"],
                                    "no_rope_layers": [1, 0]}),
    # DeepSeek Sparse Attention: MLA whose queries attend to the top 4 of the 16 keys an indexer (2 heads
    # of 8) scores highest; GLM-MoE-DSA: layer 1 reuses layer 0's top-k (indexer_types "shared")
    "deepseek_v32": ("DeepseekV32Config", {**_DSA, "first_k_dense_replace": 1}),
    "glm_moe_dsa": ("GlmMoeDsaConfig", {**_DSA, "num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"],
                                        "first_k_dense_replace": 1}),
    # Kolibri 1.1: sparse layers whose indexer selects, from the attention's own NVFP4-rounded keys, a pool
    # of key blocks (layers 1 and 3: 8 keys of 2-key blocks) and then each row's top 3 of its pool plus 1
    # sink and 2 local tokens: rows past 6 keys select, rows past 8 pool. Layer 2 rescores layer 1's pool
    # and reads its K/V; layer 0 is a sliding window with no indexer
    "kolibri1_1": ("Kolibri1_1Config", {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 6,
                                        "layer_types": ["sliding_attention"] + ["indexed_attention"] * 3,
                                        "num_hidden_layers": 4, "index_layers": [1, 3], "kv_source_layers": [0, 1, 1, 3],
                                        "index_topk": 3, "index_pool_size": 8, "index_compression": 2,
                                        "index_num_heads": 2, "index_num_local_tokens": 2, "index_num_sink_tokens": 1,
                                        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                        "shared_expert_intermediate_size": 16, "mlp_only_layers": [0],
                                        "mlp_only_intermediate_size": 32}),
    "gpt_oss": ("GptOssConfig", {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "intermediate_size": 16, "sliding_window": 6,
                                 "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                     "original_max_position_embeddings": 32},
                                 "layer_types": ["sliding_attention", "full_attention"]}),
    # Muse Spark (a base model only: AutoModel): a norm inside the experts (post_expert_norm, kept whole
    # on every ep rank: 'replicated_with_grad_allreduce'), projections to and from the experts' width,
    # sigmoid routing with a correction bias
    "muse_spark": ("MuseSparkTextConfig", {"head_dim": 8, "num_key_value_heads": 2, "num_local_experts": 4,
                                           "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                           "moe_hidden_size": 16, "sliding_window": 6,
                                           "layer_types": ["sliding_attention", "full_attention"],
                                           "layer_rope_theta": [10000.0, 0], "mlp_layer_types": ["sparse", "sparse"]}),
    # HRM: two stacks (L and H) run in cycles; transformers fuses gate/q/k/v into one checkpoint tensor
    # (attn.gqkv_proj) and gate/up into another, chunked back on load (shard-on-read reads them whole)
    "hrm_text": ("HrmTextConfig", {"head_dim": 8, "L_cycles": 2, "H_cycles": 2,
                                   "L_bp_cycles": [1]}),
    # Jamba: layers of two classes (mamba, attention) picked from a table, each with a feed-forward
    # picked by a conditional (MoE on odd layers): layer 0 mamba + MLP, layer 1 attention + MoE
    "jamba": ("JambaConfig", {"num_experts": 4, "num_experts_per_tok": 2, "attn_layer_period": 2,
                              "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
                              "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 4,
                              "use_mamba_kernels": False}),
    # MiniMax: layer 0 lightning attention (its recurrence in the class's own forward), layer 1 full attention
    # + MoE
    "minimax": ("MiniMaxConfig", {"head_dim": 8, "num_key_value_heads": 2, "num_local_experts": 4,
                                  "num_experts_per_tok": 2, "block_size": 4,
                                  "layer_types": ["linear_attention", "full_attention"]}),
    # MiniMax with blocks of 3 (not dividing cp's chunks) and two lightning layers (different decays)
    "minimax_blocks3": ("MiniMaxConfig", {"head_dim": 8, "num_key_value_heads": 2, "num_local_experts": 4,
                                          "num_experts_per_tok": 2, "block_size": 3, "num_hidden_layers": 3,
                                          "layer_types": ["linear_attention", "linear_attention", "full_attention"]}),
    # a Gated DeltaNet hybrid: layer 0 linear attention (conv kernel 4, 2 key / 4 value heads), layer 1
    # gated full attention; a routed MoE with a shared expert
    # Qwen3-MoE with its load-balancing aux loss on in the config (what a Trainer then adds to the loss)
    "qwen3_moe_aux": ("Qwen3MoeConfig", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 32, "mlp_only_layers": [0], "norm_topk_prob": True,
                                         "output_router_logits": True, "router_aux_loss_coef": 0.5}),
    "qwen3_next": ("Qwen3NextConfig", {"head_dim": 8, "num_key_value_heads": 2, "linear_num_key_heads": 2,
                                       "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                       "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                                       "layer_types": ["linear_attention", "full_attention"]}),
    # Kimi Linear: layer 0 KDA, layer 1 MLA attention, which its TP plan leaves out (the MLPs are planned)
    # no TP plan, only an ep plan (which locates its attention for cp); a sliding layer (RoPE) and a
    # global one (no RoPE), a dense first block, then MoE with a shared expert and per-expert norms
    "ergo": ("ErgoConfig", {"head_dim": 8, "num_key_value_heads": 2, "first_dense_intermediate_size": 64,
                            "moe_intermediate_size": 32, "shared_intermediate_size": 32, "num_experts": 4,
                            "num_experts_per_tok": 2, "sliding_window": 8, "global_attention_every_n_layers": 2,
                            "num_hidden_layers": 2, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}),
    "kimi_linear": ("KimiLinearConfig", {"head_dim": 8, "num_key_value_heads": 4, "kv_lora_rank": 16,
                                         "q_lora_rank": None, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                                         "v_head_dim": 8, "linear_head_dim": 8, "linear_num_heads": 4,
                                         "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 32,
                                         "layer_types": ["linear_attention", "full_attention"],
                                         "mlp_layer_types": ["dense", "dense"], "pad_token_id": 0,
                                         "bos_token_id": 1, "eos_token_id": 2}),
    # the same with layer 1's MLP dense: every contract of the plan finds a module (an explicit plan's rule)
    "qwen3_next_dense": ("Qwen3NextConfig", {"head_dim": 8, "num_key_value_heads": 2, "linear_num_key_heads": 2,
                                             "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                                             "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4,
                                             "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                             "shared_expert_intermediate_size": 32, "mlp_only_layers": [1],
                                             "layer_types": ["linear_attention", "full_attention"]}),
    # a Mamba2 hybrid: layer 0 Mamba2 (4 heads of 16, state 8, SSD chunks of 4, conv kernel 4), layer 1 attention
    "bamba": ("BambaConfig", {"attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8,
                              "mamba_n_groups": 1, "mamba_chunk_size": 4, "num_key_value_heads": 2,
                              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # short gated convolutions: layer 0 a conv layer of kernel 7 (its halo of 6 spans the chunks of 4 tokens
    # before it at cp=2), layer 1 attention
    "lfm3": ("Lfm3Config", {"head_dim": 8, "num_key_value_heads": 2, "layer_types": ["conv", "full_attention"],
                            "conv_L_cache": 7, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # transformers 5.25's 'local_params': per-head vectors cut with their heads. GraniteSWA: attention sinks on
    # both layers (full, then sliding window 6); MiMo-V2-Flash: sinks only on its sliding layer (1), which has
    # twice the config's K/V heads (4, so at tp=4 one each, while layer 0's 2 sit on two ranks each);
    # Beam: a per-head output gate bias, q/k norms (replicated_with_grad_allreduce)
    "granite_swa": ("GraniteSWAConfig", {"num_key_value_heads": 2, "sliding_window": 6, "pad_token_id": 0,
                                         "bos_token_id": 1, "eos_token_id": 2}),
    "mimo_v2_flash": ("MiMoV2FlashConfig", {"num_key_value_heads": 2, "head_dim": 8, "v_head_dim": 8,
                                            "sliding_window": 6}),
    "beam": ("BeamConfig", {"num_key_value_heads": 2, "head_dim": 8, "sliding_window": 6, "pad_token_id": 0,
                            "bos_token_id": 1, "eos_token_id": 2}),
    # q/k norms over every head of the projection (tp splits their features): OLMo 2 an RMSNorm with 2 K/V heads
    # (at tp=4 each K slice, and its k_norm slice, on two ranks); ESM C (a masked LM) a LayerNorm without bias
    "olmo2": ("Olmo2Config", {"num_key_value_heads": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "esmc": ("EsmcConfig", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Gemma 3n: layer 0's MLP keeps the gate activations above mean + 1.64 std of its intermediate row
    # (activation sparsity 0.95), statistics of features tp splits; AltUp, LAuReL, per-layer inputs beside
    "gemma3n": ("Gemma3nTextConfig", {"head_dim": 8, "num_key_value_heads": 2, "hidden_size_per_layer_input": 8,
                                      "vocab_size_per_layer_input": VOCAB, "altup_num_inputs": 2, "laurel_rank": 8,
                                      "num_kv_shared_layers": 0, "activation_sparsity_pattern": [0.95, 0.0],
                                      "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6,
                                      "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Gemma 4: its text model's TP plan translates, its vision tower's (projections wrapped in clippable
    # linears) does not; text-only it runs under tp, with the tower it is refused
    "gemma4": ("Gemma4TextConfig", {**_GEMMA4}),
    "gemma4_vl": ("Gemma4Config", {"text_config": {**_GEMMA4}, "audio_config": None, "vision_config": {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 4, "head_dim": 8, "global_head_dim": 8}}),
    # an encoder-decoder whose one module config plans both stacks (T5Gemma): the decoder's layers and its
    # embedding, tied to the head, are planned like the encoder's
    "t5gemma": ("T5GemmaConfig", {"encoder": {**_T5GEMMA}, "decoder": {**_T5GEMMA}, "vocab_size": VOCAB,
                                  "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True}),
    # Qwen4-Exp (transformers 5.25): layer 0 Gated DeltaNet with per-layer n-gram embeddings (PLE: 4 hashed
    # n-gram heads of 8 features over tables of ~70 rows, transformers' embedding_colwise), layer 1 attention
    # whose QSA indexer keeps each row's top 2 blocks of 2 keys; 2 hyper-connection streams; MoE with a shared expert
    "qwen4_exp": ("Qwen4ExpTextConfig", {"head_dim": 8, "num_key_value_heads": 2, "linear_num_key_heads": 2,
                                         "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                                         "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                                         "layer_types": ["linear_attention", "indexed_attention"],
                                         "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8,
                                         "indexer_budget": 4, "indexer_compress_ratio": 2, "hc_count": 2,
                                         "hc_lowrank": 8, "ple_layer_ids": [1], "ple_embed_dim": 32,
                                         "heads_per_ngram": 2, "ngram_vocab_size_base": 64,
                                         "make_ngram_vocab_size_divisible_by": 8, "eos_token_id": 2}),
    # vision-language: a vision tower with its own config (2 blocks) beside the text stack; under
    # cp the text stack splits and the tower runs whole (text-only batches; image inputs refused)
    "qwen2_vl": ("Qwen2VLConfig", {
        "text_config": {"head_dim": 8, "num_key_value_heads": 2,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}},
        "vision_config": {"depth": 2, "embed_dim": 32, "num_heads": 4, "hidden_size": 32, "patch_size": 2,
                          "temporal_patch_size": 1, "spatial_merge_size": 1},
        "image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 7, "tie_word_embeddings": False}),
}
"""Models only some test modules use (the parity modules sweep :data:`CONFIGS`)."""

AUTO = {"qwen2_vl": "AutoModelForImageTextToText", "esmc": "AutoModelForMaskedLM",
        "gemma4_vl": "AutoModelForImageTextToText", "t5gemma": "AutoModelForSeq2SeqLM"}
MASKED = ("esmc",)
"""Families no causal-LM Auto class maps: the Auto class they are built with."""

BASE_ONLY = ("muse_spark", "mistral_large4_text")
"""Families with no causal-LM head: built as ``AutoModel`` (the tests take a loss of the hidden states)."""

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def build(name: str, root: str, seed: int = 0) -> str:
    """Save model ``name`` under ``root/name`` (once) and return its directory."""
    import torch
    import transformers

    path = os.path.join(root, name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config_cls, extra = CONFIGS[name] if name in CONFIGS else MORE_CONFIGS[name]
    if "text_config" in extra:  # a composite config: the text stack is the tiny one
        config = getattr(transformers, config_cls)(**{**extra, "text_config": {**BASE, **extra["text_config"]}})
    elif "encoder" in extra:  # an encoder-decoder: both stacks tiny
        config = getattr(transformers, config_cls)(**{k: {**BASE, **v} if k in ("encoder", "decoder") else v
                                                      for k, v in extra.items()})
    else:
        config = getattr(transformers, config_cls)(**{**BASE, **extra})
    torch.manual_seed(seed)
    auto = getattr(transformers, AUTO.get(name, "AutoModel" if name in BASE_ONLY else "AutoModelForCausalLM"))
    model = auto.from_config(config)
    with torch.no_grad():  # visible biases and norm weights, so a dropped one shows
        for pname, param in model.named_parameters():
            if pname.endswith(("bias", "sinks")) or "norm" in pname:
                param.normal_(mean=1.0 if "norm" in pname else 0.0, std=0.1 if "norm" in pname else 0.02)
    model.save_pretrained(path)
    return path


def skip_unless_released(name: str) -> None:
    """Skip the calling test where this transformers release lacks the config class of ``name`` (a
    family that first shipped with 5.25: CI's 5.24 leg lacks it)."""
    import pytest
    import transformers

    config = (CONFIGS.get(name) or MORE_CONFIGS[name])[0]
    if not hasattr(transformers, config):
        pytest.skip(f"{name}: transformers {transformers.__version__} has no {config}")


def batch(seed: int = 1, batch_size: int = 2, seq: int = 16):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch_size, seq), generator=gen)


def run_training(model, ids, *, steps: int = 3, lr: float = 0.1, weight_decay: float = 0.01,
                 full_grads=None, full_state_dict=None) -> dict[str, Any]:
    """One fwd+bwd (logits, loss, grads), then ``steps`` SGD steps with weight decay."""
    import torch

    grads_of = full_grads or (lambda m: {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None})
    state_of = full_state_dict or (lambda m: {k: v.detach().clone() for k, v in m.state_dict().items()})
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    result = {"logits": out.logits.detach().clone(), "loss": out.loss.detach().clone(), "grads": grads_of(model)}
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    result["losses"] = torch.stack(losses)
    result["state"] = state_of(model)
    return result


def reference(path: str, ids) -> dict[str, Any]:
    """The same run in this process, without hp_lazy."""
    import torch

    torch.manual_seed(0)
    return run_training(load(path), ids)


def load(path: str, dtype: str = "float32", **options):
    """The model saved at ``path`` as a causal LM (a masked LM for :data:`MASKED` families, T5Gemma a
    sequence-to-sequence LM); ``options`` go to ``from_pretrained``."""
    import torch
    import transformers

    name = os.path.basename(path)
    auto = AUTO[name] if name in MASKED + ("t5gemma",) else "AutoModelForCausalLM"
    return getattr(transformers, auto).from_pretrained(path, dtype=getattr(torch, dtype), **options)


def rel_err(a, b) -> float:

    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
