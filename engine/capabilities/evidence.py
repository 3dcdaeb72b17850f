"""Which test runs which cell of the capability matrix (engine/capabilities/table.py).

A cell is "tested" only where a row here names a test that runs that capability on that
family, compared with a reference (one device, unchunked, uncached or HF); a cell no rule
refuses and no row names is "untested". tests/test_capabilities.py checks that every
named test exists and that its file (or a tests/ helper it imports) sets the capability's
config key. Families are the registry's names (models/families/); `tiny_random` is Llama.
"""

from __future__ import annotations

from typing import NamedTuple


class Evidence(NamedTuple):
    test: str  # pytest node id, parameters included where the test is parametrized
    families: tuple[str, ...]
    columns: tuple[str, ...]


_LAYOUTS = ("mesh.tensor", "mesh.sequence", "mesh.stage", "engine.scan_layers", "model.weight_dtype=int8",
            "engine.kv_cache_dtype=int8", "engine.enable_prefix_caching")  # tests/family_layouts.py LAYOUTS


def _each(test: str, families: tuple[str, ...], columns: tuple[str, ...]) -> tuple[Evidence, ...]:
    """One parametrized test, a case per family: `test[family]`."""
    return tuple(Evidence(f"{test}[{f}]", (f,), columns) for f in families)


EVIDENCE: tuple[Evidence, ...] = (
    # Qwen3-VL with images against transformers (engine/vision/): the same image cached, another not
    Evidence("tests/test_vision_engine.py::test_prefix_cache_shares_an_image_only_with_itself", ("qwen3_vl",),
             ("engine.enable_prefix_caching",)),
    # Engine.embed / score against sentence-transformers and transformers (engine/pooling/)
    *_each("tests/test_embed.py::test_embeddings_equal_the_references", ("qwen3", "llama"), ("model.pooling",)),
    # Llama (tiny_random) through the Engine, each layout against one device
    Evidence("tests/test_engine_mesh.py::test_sharded_engine_equals_one_device", ("llama",), ("mesh.tensor",)),
    Evidence("tests/test_engine_mesh.py::test_data_replicas_equal_one_device[d2]", ("llama",), ("mesh.data",)),
    Evidence("tests/test_context_engine.py::test_sequence4_serves_a_prompt_larger_than_a_device_share", ("llama",),
             ("mesh.sequence",)),
    Evidence("tests/test_pipeline.py::test_two_stages_equal_one_device", ("llama",), ("mesh.stage",)),
    Evidence("tests/test_scan_layers.py::test_scanned_layers_give_the_unrolled_tokens[auto]", ("llama",),
             ("engine.scan_layers",)),
    Evidence("tests/test_weight_quant.py::test_int8_engine_tokens_plain_chunked_cached_sharded", ("llama",),
             ("model.weight_dtype=int8",)),
    Evidence("tests/test_kv_quant_engine.py::test_quantized_engine_chunked_cached_plain_agree[int8]", ("llama",),
             ("engine.kv_cache_dtype=int8",)),
    Evidence("tests/test_kv_quant_engine.py::test_quantized_engine_chunked_cached_plain_agree[float8_e4m3fn]",
             ("llama",), ("engine.kv_cache_dtype=float8_e4m3fn",)),
    Evidence("tests/test_engine.py::test_prefix_cache_reports_whole_shared_pages", ("llama",),
             ("engine.enable_prefix_caching",)),
    Evidence("tests/test_host_kv_tier.py::test_host_tier_serves_evicted_prefixes_with_the_same_tokens", ("llama",),
             ("engine.host_kv_cache_gb",)),
    Evidence("tests/test_disk_kv_tier.py::test_a_restarted_engine_serves_old_prefixes_from_disk", ("llama",),
             ("engine.disk_kv_cache_dir",)),
    Evidence("tests/test_multihost.py::test_engine_leader_generates_and_follower_runs_every_step[engine]",
             ("llama",), ("mesh.num_processes",)),
    # dense families: every layout of tests/family_layouts.py
    *_each("tests/test_family_layouts.py::test_every_layout_gives_the_same_tokens",
           ("qwen3", "olmo2", "smollm3", "granite"), _LAYOUTS),
    *_each("tests/test_family_layouts_round.py::test_every_layout_gives_the_same_tokens",
           ("apertus", "ernie4_5", "hunyuan_v1_dense"), _LAYOUTS),
    *_each("tests/test_family_layouts_sliding.py::test_every_layout_gives_the_same_tokens",
           ("gemma2", "gemma3", "phi3"), _LAYOUTS),
    # Gemma 4: layers of two shapes (stacking and the KV tiers refused, engine/capabilities/table.py)
    Evidence("tests/test_gemma4_layouts.py::test_every_layout_gives_the_same_tokens", ("gemma4",),
             ("mesh.tensor", "mesh.sequence", "model.weight_dtype=int8", "engine.kv_cache_dtype=int8",
              "engine.enable_prefix_caching")),
    Evidence("tests/test_gemma4_layouts.py::test_moe_block_layouts", ("gemma4",), ("mesh.expert",)),
    Evidence("tests/test_weight_quant.py::test_logits_equal_float64_model_with_the_same_quantized_weights[qwen2]",
             ("qwen2",), ("model.weight_dtype=int8",)),
    # mixtures of experts
    Evidence("tests/test_moe_layouts.py::test_four_devices", ("mixtral",),
             ("mesh.expert", "mesh.tensor", "mesh.sequence", "mesh.stage", "model.weight_dtype=int8",
              "engine.kv_cache_dtype=int8", "engine.enable_prefix_caching")),
    Evidence("tests/test_moe_layouts.py::test_eight_devices", ("mixtral",), ("mesh.data",)),
    *_each("tests/test_moe_layouts.py::test_dense_and_sparse_layers", ("qwen3_moe", "glm4_moe", "ernie4_5_moe"),
           ("mesh.expert", "mesh.tensor", "engine.enable_prefix_caching")),
    *_each("tests/test_moe_layouts.py::test_every_layer_sparse",
           ("olmoe", "minimax_m2", "hunyuan_v1_moe", "phimoe"),
           ("mesh.expert", "mesh.tensor", "engine.enable_prefix_caching")),
    Evidence("tests/test_moe_layouts.py::test_gpt_oss", ("gpt_oss",),
             ("mesh.expert", "mesh.tensor", "model.weight_dtype=int8", "engine.kv_cache_dtype=int8",
              "engine.enable_prefix_caching")),
    Evidence("tests/test_llama4_layouts.py::test_llama4_layouts", ("llama4",),
             ("mesh.expert", "mesh.tensor", "mesh.sequence", "model.weight_dtype=int8", "engine.kv_cache_dtype=int8",
              "engine.enable_prefix_caching")),
    Evidence("tests/test_longcat_layouts.py::test_longcat_layouts", ("longcat_flash",),
             ("mesh.expert", "mesh.tensor", "engine.enable_prefix_caching")),
    Evidence("tests/test_afmoe.py::test_afmoe_layouts", ("afmoe",),
             ("mesh.expert", "mesh.tensor", "mesh.sequence", "model.weight_dtype=int8", "engine.kv_cache_dtype=int8",
              "engine.enable_prefix_caching")),
    # multi-head latent attention
    Evidence("tests/test_mla_layouts.py::test_dense_mla", ("deepseek_v3",),
             ("mesh.tensor", "mesh.sequence", "mesh.stage", "engine.scan_layers", "engine.kv_cache_dtype=int8",
              "engine.enable_prefix_caching")),
    Evidence("tests/test_mla_layouts.py::test_mla_with_experts", ("deepseek_v3",), ("mesh.expert",)),
    Evidence("tests/test_multihost.py::test_latent_attention_over_two_processes", ("deepseek_v3",),
             ("mesh.num_processes",)),
    Evidence("tests/test_mistral4.py::test_mistral4_layouts", ("mistral4",),
             ("mesh.tensor", "mesh.sequence", "mesh.expert", "engine.kv_cache_dtype=int8",
              "engine.enable_prefix_caching")),
    # DeepSeek sparse attention (MLA + the lightning indexer's top-k)
    Evidence("tests/test_dsa_layouts.py::test_deepseek_v32_layouts", ("deepseek_v32",),
             ("mesh.tensor", "mesh.stage", "engine.scan_layers", "engine.kv_cache_dtype=int8",
              "engine.enable_prefix_caching")),
    Evidence("tests/test_dsa_layouts.py::test_glm_moe_dsa_layouts", ("glm_moe_dsa",),
             ("mesh.tensor", "engine.enable_prefix_caching")),
    # fp8 block-scaled checkpoints kept in fp8 (model.weight_dtype = fp8_block)
    *_each("tests/test_fp8_block.py::test_fp8_checkpoint_matches_hf_on_its_dequantized_weights",
           ("llama", "qwen3_moe", "deepseek_v3"), ("model.weight_dtype=fp8_block",)),
    # AWQ / GPTQ / compressed-tensors ints kept packed (model.weight_dtype = int_group)
    Evidence("tests/test_int_group.py::test_int_checkpoint_matches_hf_on_its_dequantized_weights[gptq_act_order]",
             ("llama",), ("model.weight_dtype=int_group",)),
    Evidence("tests/test_int_group_layouts.py::test_int_group_act_order_layouts", ("llama",),
             ("model.weight_dtype=int_group",)),
    Evidence("tests/test_int_group.py::test_fused_projections_split_by_rows", ("phi3",),
             ("model.weight_dtype=int_group",)),
    Evidence("tests/test_int_group_experts.py::test_experts_kept_packed_match_hf", ("qwen2_moe",),
             ("model.weight_dtype=int_group",)),
    Evidence("tests/test_int_group_experts.py::test_kimi_k2_thinking_layout_routed_experts_alone", ("deepseek_v3",),
             ("model.weight_dtype=int_group",)),
    Evidence("tests/test_int_group_moe_layouts.py::test_int_group_experts_layouts", ("qwen3_moe",),
             ("model.weight_dtype=int_group",)),
    Evidence("tests/test_gguf_int_group.py::test_packed_model_equals_the_dequantized_load[qwen2_Q4_1]", ("qwen2",),
             ("model.weight_dtype=int_group",)),
    # llama.cpp's k-quant mixes, each projection in its own form (models/gguf/int_codes.py)
    Evidence("tests/test_gguf_kquant.py::test_llama_cpp_mix_packed_equals_transformers_and_our_dequantized_run"
             "[qwen3_Q5_K_M]", ("qwen3",), ("model.weight_dtype=int_group",)),
    # linear-attention hybrids
    *_each("tests/test_hybrid_layouts.py::test_hybrid_layouts_agree", ("qwen3_5", "qwen3_next", "qwen3_5_moe",
                                                                       "nemotron_h"),
           ("mesh.tensor", "engine.enable_prefix_caching")),
    # engine.scan_layers (one scan step per period of the layer pattern) and mesh.stage (each stage
    # its layers' state slots): against the unrolled model
    Evidence("tests/test_hybrid_scan.py::test_qwen3_5_scans_one_period_per_step", ("qwen3_5",),
             ("engine.scan_layers",)),
    Evidence("tests/test_hybrid_scan.py::test_mamba2_single_block_pattern_scans", ("nemotron_h",),
             ("engine.scan_layers",)),
    Evidence("tests/test_hybrid_scan.py::test_pipeline_stages_hold_their_layers_state", ("qwen3_5",),
             ("mesh.stage",)),
    # state slots per data replica, replicated over expert ranks: against one device
    Evidence("tests/test_hybrid_data_expert.py::test_gated_deltanet_moe_data_and_expert_match_one_device",
             ("qwen3_5_moe",), ("mesh.data", "mesh.expert")),
    Evidence("tests/test_hybrid_data_expert_mamba2.py::test_mamba2_moe_data_and_expert_match_one_device",
             ("granitemoehybrid",), ("mesh.data", "mesh.expert")),
    Evidence("tests/test_hybrid_data_host_tier.py::test_host_tier_snapshots_resume_on_both_replicas", ("qwen3_5",),
             ("mesh.data", "engine.host_kv_cache_gb")),
    Evidence("tests/test_lfm2_layouts.py::test_lfm2_layouts_agree[lfm2]", ("lfm2",),
             ("mesh.tensor", "engine.enable_prefix_caching")),
    Evidence("tests/test_lfm2_layouts.py::test_lfm2_layouts_agree[lfm2_moe]", ("lfm2_moe",),
             ("mesh.tensor", "mesh.expert", "engine.enable_prefix_caching")),
    *(Evidence(f"tests/test_granitemoehybrid.py::test_layouts_agree[{variant}]", ("granitemoehybrid",),
               ("mesh.tensor", "engine.enable_prefix_caching")) for variant in ("moe", "dense")),
    Evidence("tests/test_kimi_linear_layouts.py::test_kimi_linear_layouts_agree", ("kimi_linear",),
             ("mesh.tensor", "engine.enable_prefix_caching")),
    Evidence("tests/test_bailing_hybrid_layouts.py::test_bailing_hybrid_layouts_agree", ("bailing_hybrid",),
             ("mesh.tensor", "engine.enable_prefix_caching")),
    # int8 weights on MLA, the indexer and the linear mixers: logits against the dequantized f32
    # model, then through the Engine at mesh.tensor = 2 in chunks with a prefix hit
    *(Evidence(f"tests/test_int8_mla_linear.py::test_int8_logits_equal_the_dequantized_f32_model[{kind}]",
               (family,), ("model.weight_dtype=int8",))
      for kind, family in (("mla", "deepseek_v3"), ("dsa", "deepseek_v32"), ("gated_deltanet", "qwen3_next"),
                           ("mamba2", "nemotron_h"), ("kda", "kimi_linear"), ("kda_gates", "bailing_hybrid"),
                           ("short_conv", "lfm2"), ("parallel_hybrid", "falcon_h1"))),
    Evidence("tests/test_int8_mla_linear.py::test_engine_int8_tensor2_chunked_cached_equal_whole",
             ("deepseek_v32", "kimi_linear"), ("model.weight_dtype=int8",)),
    # Falcon-H1: attention beside Mamba2 in every layer (pages and a state slot per layer)
    Evidence("tests/test_falcon_h1_engine.py::test_layouts_agree", ("falcon_h1",),
             ("mesh.tensor", "engine.enable_prefix_caching", "engine.kv_cache_dtype=int8")),
    Evidence("tests/test_falcon_h1_tiers.py::test_host_tier_snapshots_resume_like_prefix_caching_off", ("falcon_h1",),
             ("engine.host_kv_cache_gb",)),
    Evidence("tests/test_hybrid_engine.py::test_quantized_attention_pages_beside_f32_state[int8]", ("qwen3_5",),
             ("engine.kv_cache_dtype=int8",)),
    Evidence("tests/test_hybrid_host_tier.py::test_host_tier_snapshots_resume_like_prefix_caching_off", ("qwen3_5",),
             ("engine.host_kv_cache_gb",)),
    # state snapshots in files beside the pages: a repeated prompt resumes from disk, a restart too
    *_each("tests/test_hybrid_disk_tier.py::test_a_repeated_prompt_resumes_from_a_snapshot_on_disk",
           ("qwen3_5", "granitemoehybrid"), ("engine.disk_kv_cache_dir",)),
)


def tests_of(family: str) -> dict[str, str]:
    """column -> the first test that runs it on this family."""
    out: dict[str, str] = {}
    for ev in EVIDENCE:
        if family in ev.families:
            for col in ev.columns:
                out.setdefault(col, ev.test)
    return out
