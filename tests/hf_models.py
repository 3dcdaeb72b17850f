"""Random-init Hugging Face checkpoints for parity tests (written with save_pretrained)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")

HF_SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rms_norm_eps=1e-5, initializer_range=0.1)


# Shapes the tests choose, not the presets': each exercises what its family adds (an
# explicit head_dim, a window shorter than the 64- and 300-token prompts, soft caps small
# enough to bend the scores, a scaled rope, NoPE layers, multipliers far from 1).
FAMILY_KWARGS = {
    "qwen3": ("Qwen3", dict(head_dim=24, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                           "original_max_position_embeddings": 64})),
    "gemma2": ("Gemma2", dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=24, attn_logit_softcapping=5.0,
                              final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh")),
    "gemma3": (("Gemma3Text", "Gemma3"), dict(num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1e6}})),
    "phi3": ("Phi3", dict(sliding_window=24, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "olmo2": ("Olmo2", dict(pad_token_id=0)),
    # OLMo 3: a sliding layer (24-token window) and a full one, each with its own rope (YaRN
    # on the full layer only, another theta on the sliding one)
    "olmo3": ("Olmo3", dict(pad_token_id=0, sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                             "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                                                "original_max_position_embeddings": 64}})),
    # GLM: rope over half of each 32-wide head (the class's default partial_rotary_factor),
    # interleaved pairs; GLM-4 the same with 3/4 of each head and its sandwich norms
    "glm": ("Glm", dict(head_dim=32, pad_token_id=0, eos_token_id=2)),
    "glm4": ("Glm4", dict(head_dim=32, pad_token_id=0, eos_token_id=2,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75})),
    # Seed-OSS: q/k/v biases and (not the class's default) an output-projection bias
    "seed_oss": ("SeedOss", dict(head_dim=24, attention_out_bias=True, pad_token_id=0)),
    # EXAONE 4: layer 0 sliding (24-token window, roped), layer 1 full without rope; llama3 rope
    "exaone4": ("Exaone4", dict(sliding_window=24, sliding_window_pattern=2,
                                rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                                 "rope_theta": 1e6})),
    # Ministral: a sliding layer (24-token window), then a full one
    "ministral": ("Ministral", dict(head_dim=16, sliding_window=24, layer_types=["sliding_attention", "full_attention"])),
    # Ministral 3: its YaRN with the query temperature of every 64 positions (so the 300-token
    # prompt's last query is scaled by 1 + 0.1 log 5)
    "ministral3": ("Ministral3", dict(head_dim=16, pad_token_id=0,
                                      rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                       "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                       "llama_4_scaling_beta": 0.1,
                                                       "max_position_embeddings": 1024})),
    # Arcee: the ungated squared-ReLU MLP, q/k/v/o biases, YaRN
    "arcee": ("Arcee", dict(attention_bias=True, bos_token_id=1, eos_token_id=2,
                            rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                             "original_max_position_embeddings": 64})),
    # Apertus: xIELU with its scalars randomised per layer (below), q/k norms, llama3 rope
    "apertus": ("Apertus", dict(pad_token_id=0,
                                rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                                 "rope_theta": 1e6})),
    "smollm3": ("SmolLM3", dict(num_hidden_layers=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "ernie4_5": ("Ernie4_5", dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    "hunyuan_v1_dense": ("HunYuanDenseV1", dict(head_dim=16, rope_parameters={"rope_type": "dynamic", "alpha": 50.0,
                                                                              "factor": 1.0, "rope_theta": 1e4})),
    "granite": ("Granite", dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3,
                                logits_scaling=2.0)),
}
# Linear-attention hybrids: Qwen3.5's 3:1 pattern (DeltaNet x3, gated full attention), two
# key heads each serving two value heads, a quarter of each attention head roped
HYBRID_KWARGS = {
    "qwen3_5": (("Qwen3_5Text", "Qwen3_5"), dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2,
                                                 linear_num_value_heads=4, linear_key_head_dim=16,
                                                 linear_value_head_dim=24, linear_conv_kernel_dim=4,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                  "partial_rotary_factor": 0.25,
                                                                  "mrope_section": [2, 1, 1],
                                                                  "mrope_interleaved": True})),
    # Qwen3-Next: the same stack, DeltaNet projections fused per key head, 8 experts top 2 with
    # a gated shared expert; layer 1 keeps a dense MLP (mlp_only_layers)
    "qwen3_next": ("Qwen3Next", dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2,
                                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
                                     linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                                     moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                     norm_topk_prob=True, mlp_only_layers=[1],
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                      "partial_rotary_factor": 0.25})),
    # Qwen3.5-MoE: Qwen3.5's stack (separate DeltaNet projections) with every MLP sparse: 8
    # experts top 2, and a gated shared expert
    "qwen3_5_moe": (("Qwen3_5MoeText", "Qwen3_5Moe"), dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2,
                                                         linear_num_value_heads=4, linear_key_head_dim=16,
                                                         linear_value_head_dim=24, linear_conv_kernel_dim=4,
                                                         num_experts=8, num_experts_per_tok=2,
                                                         moe_intermediate_size=32,
                                                         shared_expert_intermediate_size=48,
                                                         rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                          "partial_rotary_factor": 0.25})),
    # Nemotron-H: single-block layers M(amba2) -(MLP) M * (attention, no rope) - M; 8 SSM
    # heads of 12 in 2 groups (B, C per group), a 16-wide state, attention heads of 24 (not
    # hidden / heads); the SSD's chunks (16) shorter than the 64- and 300-token prompts
    "nemotron_h": ("NemotronH", dict(hybrid_override_pattern="M-M*-M", num_hidden_layers=6, head_dim=24,
                                     mamba_num_heads=8, mamba_head_dim=12, n_groups=2, ssm_state_size=16,
                                     conv_kernel=4, chunk_size=16, layer_norm_epsilon=1e-5)),
    # LFM2: conv, attention, conv, conv (full_attn_idxs), a 4-wide conv with biases on it and
    # both projections, the MLP width derived (int(2 * 160 / 3) * 1.5 rounded up to 32: 160),
    # an untied head (tied, the greedy continuation repeats one token), rope theta 1e4
    "lfm2": ("Lfm2", dict(num_hidden_layers=4, full_attn_idxs=[1], conv_L_cache=4, conv_bias=True, norm_eps=1e-5,
                          block_multiple_of=32, block_ffn_dim_multiplier=1.5, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    # LFM2-MoE: conv, attention, conv, attention; layer 0 dense (num_dense_layers), then 8
    # experts top 2 by sigmoid + expert bias (randomised below), renormalised, times 1.7
    "lfm2_moe": ("Lfm2Moe", dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
                                 conv_L_cache=3, conv_bias=True, norm_eps=1e-5, num_dense_layers=1, num_experts=8,
                                 num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=1.7,
                                 tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    # Granite 4.0-H: Mamba2, roped attention, Mamba2 (the last layer runs its sampled rows
    # only); 8 SSM heads of 16 in 2 groups, a 16-wide state, 16-token SSD chunks; 8 experts
    # top 2 beside the shared MLP; Granite's four multipliers far from 1
    "granitemoehybrid": ("GraniteMoeHybrid", dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                                                  mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
                                                  mamba_d_head=16, mamba_chunk_size=16, intermediate_size=32,
                                                  num_local_experts=8, num_experts_per_tok=2,
                                                  shared_intermediate_size=48, position_embedding_type="rope",
                                                  embedding_multiplier=3.0, residual_multiplier=0.5,
                                                  attention_multiplier=0.3, logits_scaling=2.0,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    # Kimi Linear: KDA, KDA, NoPE MLA (plain q, as the published 48B), KDA; 4 KDA heads of 16
    # (each its own q, k, v; per-channel decay); layer 0 dense, then 8 experts top 2 in 4
    # groups (the best 2 chosen from), x1.8, beside one shared expert
    "kimi_linear": ("KimiLinear", dict(num_hidden_layers=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                                       qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20,
                                       layer_types=["linear_attention", "linear_attention", "full_attention",
                                                    "linear_attention"],
                                       linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
                                       num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                       n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=1.8,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Ling 2.5: KDA, KDA, roped MLA with its per-head gate, KDA; 4 KDA heads of 16 (head_dim
    # = qk_rope_head_dim: transformers re-derives the KDA head dim from the head_dim it saves,
    # qk_rope_head_dim); the bounded decay at -3; layer 0 dense, then 8 experts top 2 in 4
    # groups (the best 2 chosen from), x1.8, beside one shared expert
    "bailing_hybrid": ("BailingHybrid", dict(num_hidden_layers=4, num_key_value_heads=4, kv_lora_rank=32,
                                             q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=24,
                                             v_head_dim=20, head_dim=16, short_conv_kernel_size=3,
                                             layer_types=["linear_attention", "linear_attention", "full_attention",
                                                          "linear_attention"],
                                             kda_lower_bound=-3.0, first_k_dense_replace=1,
                                             num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=1.8,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                                             pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Falcon-H1: attention (4 heads of 16, 2 KV heads) beside Mamba2 (8 SSM heads of 12 in 2
    # groups, a 16-wide state, mamba_d_ssm 96 not expand x hidden, 16-token SSD chunks) in each
    # of 3 layers; the gated norm before the gate, a projectors (out_proj) bias; every muP
    # multiplier off 1 and each apart from the others
    "falcon_h1": ("FalconH1", dict(num_hidden_layers=3, mamba_d_ssm=96, mamba_n_heads=8, mamba_d_head=12,
                                   mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16,
                                   mamba_rms_norm=True, mamba_norm_before_gate=True, projectors_bias=True,
                                   embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=0.6,
                                   attention_in_multiplier=1.3, attention_out_multiplier=0.7,
                                   ssm_in_multiplier=1.2, ssm_out_multiplier=0.8,
                                   ssm_multipliers=[0.7, 1.3, 0.8, 1.2, 0.9], mlp_multipliers=[1.4, 0.6],
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}
# Gemma 4 (tests/test_gemma4.py): sliding, full, sliding, full; the full layers with their own
# head dim (32, not 16), one KV head (not 2) and V = K; the proportional rope over half of each
# full head; a sliding theta apart from the full one; a window (24) shorter than the prompts
GEMMA4_KWARGS = {
    "gemma4": (("Gemma4Text", "Gemma4"), dict(num_hidden_layers=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                                  attention_k_eq_v=True, sliding_window=24, final_logit_softcapping=3.0,
                                  hidden_size_per_layer_input=0,
                                  layer_types=["sliding_attention", "full_attention"] * 2,
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
                                                   "full_attention": {"rope_type": "proportional",
                                                                      "partial_rotary_factor": 0.5,
                                                                      "rope_theta": 1e4}})),
}
# Gemma 4's MoE block in every layer: 8 experts, top 2, beside the dense MLP
GEMMA4_KWARGS["gemma4_moe"] = (GEMMA4_KWARGS["gemma4"][0], dict(GEMMA4_KWARGS["gemma4"][1], enable_moe_block=True,
                                                                num_experts=8, top_k_experts=2,
                                                                moe_intermediate_size=32))
# Gemma 4's "E" shape: 8-wide per-layer inputs; layers 2 and 3 read the K/V of layers 0 (sliding)
# and 1 (full) with twice-wide MLPs; the full layers with their own V here (k_eq_v off)
GEMMA4_KWARGS["gemma4_e"] = (GEMMA4_KWARGS["gemma4"][0], dict(GEMMA4_KWARGS["gemma4"][1], attention_k_eq_v=False,
                                                              hidden_size_per_layer_input=8,
                                                              vocab_size_per_layer_input=512, num_kv_shared_layers=2,
                                                              use_double_wide_mlp=True))
ARCHS = ("llama", "mistral", "qwen2") + tuple(FAMILY_KWARGS)
# DeepSeek sparse attention's MoE models (V3.2, GLM-5, in MOE_KWARGS): a dense first layer
# then two sparse ones, MLA with a low-rank q (the indexer's queries come from it)
DSA_SHAPE = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                 qk_nope_head_dim=24, v_head_dim=20, n_routed_experts=8, num_experts_per_tok=3,
                 moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, index_topk=16,
                 index_head_dim=32, index_n_heads=8)
# Mixtures of experts (tests/test_moe_parity.py): 8 experts, top 2, so with expert=4 each
# rank holds two and short prompts leave some ranks' experts without a token; Qwen3-MoE
# keeps a dense layer between its sparse ones, Qwen2-MoE adds the gated shared expert.
MOE_KWARGS = {
    # Llama 4: chunks of 32 under the 64- and 300-token prompts on the roped layers 0 and 2,
    # global NoPE layers 1 and 3 whose query temperature steps every 16 positions (attn_scale
    # 0.5, not 0.1), q/k/v/o biases, llama3 rope; experts on layers 1 and 2 (top 2 of 4,
    # sigmoid weights on the inputs) beside a shared expert, dense MLPs of another width on 0, 3
    "llama4": (("Llama4Text", "Llama4"), dict(
        num_hidden_layers=4, head_dim=16, no_rope_layer_interval=2, attention_chunk_size=32, floor_scale=16,
        attn_scale=0.5, attention_bias=True, num_local_experts=4, num_experts_per_tok=2, moe_layers=[1, 2],
        intermediate_size=48, intermediate_size_mlp=96,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64, "rope_theta": 5e5})),
    "mixtral": ("Mixtral", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48,
                                sliding_window=None)),
    "qwen3_moe": ("Qwen3Moe", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True,
                                   head_dim=24)),
    "qwen2_moe": ("Qwen2Moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=48, norm_topk_prob=False)),
    "glm4_moe": ("Glm4Moe", dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=3,
                                 moe_intermediate_size=32, n_shared_experts=2, n_group=4, topk_group=2,
                                 routed_scaling_factor=1.8, first_k_dense_replace=1, attention_bias=True,
                                 use_qk_norm=True, head_dim=32)),
    # DeepSeek V3 (MLA): low-rank q, interleaved rope, YaRN with the mscale correction,
    # a dense first layer, then sigmoid grouped routing with shared experts
    "deepseek_v3": ("DeepseekV3", dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                                       qk_nope_head_dim=24, v_head_dim=20, n_routed_experts=8, num_experts_per_tok=3,
                                       moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                                       routed_scaling_factor=1.8, first_k_dense_replace=1,
                                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                        "mscale": 0.707, "mscale_all_dim": 1.0,
                                                        "beta_fast": 32.0, "beta_slow": 1.0,
                                                        "original_max_position_embeddings": 64})),
    # LongCat-Flash: 2 layers of two MLA blocks + a shortcut MoE (our 4 layers); 8 experts and 4
    # zero-compute ones, top 4 on softmax + the randomised correction bias, weights x 1.7
    "longcat_flash": ("LongcatFlash", dict(num_hidden_layers=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                                           qk_rope_head_dim=16, head_dim=16, qk_nope_head_dim=24, v_head_dim=20,
                                           n_routed_experts=8, zero_expert_num=4, moe_topk=4,
                                           expert_ffn_hidden_size=32, routed_scaling_factor=1.7,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    # dense only, q straight from the hidden state (V2-Lite's shape), plain rope
    "deepseek_v3_dense": ("DeepseekV3", dict(num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                                             qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20,
                                             n_routed_experts=8, first_k_dense_replace=2, num_experts_per_tok=2,
                                             moe_intermediate_size=32)),
    # DeepSeek V2-Lite's shape: plain q, a dense first layer, softmax greedy routing x1.5
    # (never renormalised) beside two shared experts
    "deepseek_v2": ("DeepseekV2", dict(num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                                       qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20, n_routed_experts=8,
                                       num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
                                       first_k_dense_replace=1, routed_scaling_factor=1.5)),
    # DeepSeek V3.2 (sparse attention): V3's shape with a lightning indexer of 8 heads x 32
    # (rope on its first 16 dims, in halves) whose top 16 keys bind on the 64- and 300-token
    # prompts and the greedy continuation; 8 heads keep exact ties of the ReLU'd scores (all
    # heads 0) rare; YaRN with the mscale correction
    "deepseek_v32": ("DeepseekV32", dict(DSA_SHAPE, n_group=4, topk_group=2, routed_scaling_factor=1.8,
                                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                          "mscale": 0.707, "mscale_all_dim": 1.0,
                                                          "beta_fast": 32.0, "beta_slow": 1.0,
                                                          "original_max_position_embeddings": 64})),
    # GLM-5: the same with the indexer's rope in interleaved pairs, ungrouped routing x2.5
    "glm_moe_dsa": ("GlmMoeDsa", dict(DSA_SHAPE, num_experts_per_tok=2,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    # 4 layers: sliding (a 24-token window), full, sliding, full; a clamp low enough to bind
    "gpt_oss": ("GptOss", dict(num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2,
                               intermediate_size=32, head_dim=16, sliding_window=24, swiglu_limit=0.5,
                               rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 150000.0,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 64})),
    # OLMoE: projection q/k norms, a clip_qkv low enough to bind on q, k and v, top 3 of 8
    # experts not renormalised (norm_topk_prob false, as the published checkpoints)
    "olmoe": ("Olmoe", dict(num_experts=8, num_experts_per_tok=3, intermediate_size=32, clip_qkv=1.0,
                            norm_topk_prob=False, pad_token_id=0, eos_token_id=2)),
    # MiniMax-M2: sigmoid routing with its correction bias (randomised below), projection
    # q/k norms, rope over 16 of each head's 32 dims
    "minimax_m2": ("MiniMaxM2", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=32,
                                     bos_token_id=1, eos_token_id=2,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                      "partial_rotary_factor": 0.5})),
    # ERNIE 4.5 MoE: interleaved rope; sparse layers 1 and 3 (interval 2), dense 0 and 2; a
    # softmax router whose selection bias is randomised below and whose moe_norm_min binds
    # (top 2 of 8 probs often sum below 0.4); two shared experts; an untied head (tied, the
    # greedy continuation repeats one token: the dense ERNIE test covers the tied head)
    "ernie4_5_moe": ("Ernie4_5_Moe", dict(num_hidden_layers=4, tie_word_embeddings=False, moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
                                          moe_num_shared_experts=2, moe_layer_start_index=0, moe_layer_interval=2,
                                          moe_norm_min=0.4, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e4})),
    # Hunyuan MoE: q/k norms after rope, the checkpoints' NTK-alpha rope (alpha 1000, as
    # Hunyuan-A13B), q/k/v/o biases, top 3 of 8 experts beside the shared MLP
    "hunyuan_v1_moe": ("HunYuanMoEV1", dict(num_experts=8, moe_topk=3, intermediate_size=32, head_dim=24,
                                            attention_bias=True,
                                            rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                             "rope_theta": 1e4})),
    # AFMoE (Arcee Trinity): sliding (24-token window, roped), global (NoPE), sliding, global;
    # q/k/v/o biases, the output gate, muP embeddings; a dense first layer, then top 3 of 8
    # sigmoid scores + the selection bias (randomised below, as the router HF inits to 0)
    # times route_scale 2.5, beside two shared experts
    "afmoe": ("Afmoe", dict(num_hidden_layers=4, head_dim=24, global_attn_every_n_layers=2, sliding_window=24,
                            attention_bias=True, mup_enabled=True, num_dense_layers=1, num_experts=8,
                            num_experts_per_tok=3, num_shared_experts=2, moe_intermediate_size=32,
                            route_scale=2.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    # Mistral 4: DeepSeek V3's MLA (low-rank q, interleaved YaRN rope with the mscale
    # correction) whose query temperature steps every 16 positions (beta 0.5, not 0.1); a
    # dense first layer, then softmax routing, top 3 of the best 2 of 4 groups, x1.8
    "mistral4": ("Mistral4", dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                                  qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20, n_routed_experts=8,
                                  num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1, n_group=4,
                                  topk_group=2, routed_scaling_factor=1.8, first_k_dense_replace=1,
                                  rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                   "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32.0,
                                                   "beta_slow": 1.0, "original_max_position_embeddings": 16,
                                                   "llama_4_scaling_beta": 0.5})),
    # Phi-3.5-MoE: sparsemixer with a neighbourhood (router_jitter_noise) wide enough that its
    # softmax weighs several experts, LayerNorms, biased attention and LM head; longrope whose
    # original context (64) the 300-token prompt passes (equal mscales: the same rope throughout)
    "phimoe": ("Phimoe", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, attention_bias=True,
                              lm_head_bias=True, router_jitter_noise=0.3,
                              rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                               "short_factor": [1.0 + 0.4 * i for i in range(8)],
                                               "long_factor": [2.0 + i for i in range(8)],
                                               "short_mscale": 1.2, "long_mscale": 1.2,
                                               "original_max_position_embeddings": 64})),
}


def make_hf_checkpoint(directory: str, arch: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                       **overrides) -> str:
    """Saves a random-init model of `arch` (a key of ARCHS) and returns its dir."""
    import transformers as tf

    kw = dict(HF_SMALL, **overrides)
    if arch in ("qwen3_vl", "qwen3_5_vl", "qwen3_vl_moe", "qwen3_5_moe_vl"):  # image-text: the vision tower too
        import vision_models  # tests/vision_models.py

        return {"qwen3_vl": vision_models.tiny_qwen3_vl, "qwen3_5_vl": vision_models.tiny_qwen3_5_vl,
                "qwen3_vl_moe": vision_models.tiny_qwen3_vl_moe,
                "qwen3_5_moe_vl": vision_models.tiny_qwen3_5_moe_vl}[arch](directory)
    if arch == "llama":
        kw.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        kw.setdefault("rope_theta", 500000.0)
        cfg, cls = tf.LlamaConfig(**kw), tf.LlamaForCausalLM
    elif arch == "mistral":
        kw.setdefault("sliding_window", 24)
        cfg, cls = tf.MistralConfig(**kw), tf.MistralForCausalLM
    elif arch == "qwen2":
        kw.setdefault("tie_word_embeddings", True)
        cfg, cls = tf.Qwen2Config(**kw), tf.Qwen2ForCausalLM
    elif arch in FAMILY_KWARGS or arch in MOE_KWARGS or arch in HYBRID_KWARGS or arch in GEMMA4_KWARGS:
        name, extra = {**FAMILY_KWARGS, **MOE_KWARGS, **HYBRID_KWARGS, **GEMMA4_KWARGS}[arch]
        kw = dict(HF_SMALL, **extra)
        kw.update(overrides)
        config_name, model_name = (name, name) if isinstance(name, str) else name
        cfg, cls = getattr(tf, config_name + "Config")(**kw), getattr(tf, model_name + "ForCausalLM")
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype).eval()
    with torch.no_grad():  # HF inits norms to ones and biases to zero: randomise them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("sinks"):  # gpt-oss: sink logits large enough to move the softmax
                p.add_(torch.randn_like(p))
            if name.endswith(("mixer.D", "mixer.A_log", "mamba.D", "mamba.A_log")):  # Mamba2 inits them per head alike
                p.add_(0.3 * torch.randn_like(p))
            if name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):  # xIELU (Apertus): alike in every layer
                p.add_(0.3 * torch.randn_like(p))
            if name.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4: ones
                p.add_(0.3 * torch.randn_like(p))
            if name.endswith("router.gate.weight") and not p.any():  # AFMoE inits its router to 0
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():  # a router's selection bias (GLM, LFM2-MoE) starts at 0
            if name.endswith(("correction_bias", "expert_bias")):  # LFM2-MoE's expert_bias too
                b.add_(0.3 * torch.randn_like(b))
            if name.endswith("act_fn.beta"):  # xIELU's beta (0.5 in every layer)
                b.add_(0.2 * torch.randn_like(b))
            if name.endswith("layer_scalar"):  # Gemma 4: 1 in every layer
                b.add_(0.3 * torch.randn_like(b))
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def load_hf(directory: str, dtype: torch.dtype = torch.float32):
    import transformers as tf

    # eager experts too: the grouped-mm kernel of a MoE has no float64 (the truth runs)
    kwargs = dict(dtype=dtype, attn_implementation="eager", experts_implementation="eager")
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    except ValueError:  # transformers 5.25 maps no AutoModelForCausalLM to Mistral4Config: the class it names
        model = getattr(tf, tf.AutoConfig.from_pretrained(directory).architectures[0]).from_pretrained(directory,
                                                                                                       **kwargs)
    return model.eval()
