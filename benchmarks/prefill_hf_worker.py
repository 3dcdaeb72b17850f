"""Hugging Face side of benchmarks/prefill_cpu.py, run in its own process.

    python benchmarks/prefill_hf_worker.py save DIR [--arch qwen3]  # random-init bench-shape checkpoint
    python benchmarks/prefill_hf_worker.py time DIR --lengths 128 512 --repeats 3 --threads 2

`time` prints one JSON object: per length the wall seconds (`lengths`) and process CPU
seconds (`cpu_times`) of each timed prefill
(`model(input_ids, logits_to_keep=1)` under inference_mode, --dtype (f32 default), sdpa attention, KV cache
on as in a real prefill) after one warm-up run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# The bench shape (configs/bench.toml), as a Hugging Face LlamaConfig.
BENCH_SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                   rope_theta=10000.0, max_position_embeddings=16384, tie_word_embeddings=False,
                   bos_token_id=256, eos_token_id=257)


# The same shape in the other families the benchmark compares: Qwen3 (q/k norms) and the
# Gemma 3 text model (5 sliding : 1 full layers, window 512, local/global rope).
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=512, query_pre_attn_scalar=64,
                                                               tie_word_embeddings=False)),
    # the bench shape's MLP as 8 experts of the same width, top 2 (issue 25)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2)),
    # the same experts with gpt-oss's sinks, biases, clamped SwiGLU and a 128-token window
    # on every other layer; transformers has no sdpa for it (eager attention)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2,
                                                          sliding_window=128)),
    # Qwen3.5-MoE (issue 45): 6 Gated DeltaNet + 2 gated attention layers (3:1), DeltaNet 4 key /
    # 8 value heads of 64, every MLP 8 experts of 704 top 2 beside a gated shared expert of 704
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=704, shared_expert_intermediate_size=704)),
    # Gemma 4 dense (issue 45): sliding 512 : full at 3:1, the full layers with 128-wide heads,
    # one KV head and V = K, proportional rope over a quarter of them; no per-layer inputs
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        global_head_dim=128, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=512,
        final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
        layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1e6}})),
    # DeepSeek V3.2 (issue 45): MLA (latent 256 + rope 32) over 8 heads, a first dense layer then
    # 8 experts of 704 top 2 beside one shared; the lightning indexer 8 heads x 64 keeping the top
    # 256 keys, so both bench lengths run sparse (transformers masks, dense cost)
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        num_key_value_heads=8, kv_lora_rank=256, q_lora_rank=384, qk_rope_head_dim=32, qk_nope_head_dim=64,
        v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=704, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, index_topk=256, index_head_dim=64, index_n_heads=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
}


def save(directory: str, seed: int = 0, arch: str = "llama") -> None:
    import torch
    import transformers as tf

    config_name, model_name, extra = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(tf, config_name)(**{**BENCH_SHAPE, **extra})
    model = getattr(tf, model_name)(config).to(torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)


def time_prefill(directory: str, lengths: list[int], repeats: int, warmup: int, threads: int, seed: int,
                 dtype: str = "float32") -> dict:
    import numpy as np
    import torch
    import transformers as tf

    torch.set_num_threads(threads)

    def load(attention):
        return tf.AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype),
                                                       attn_implementation=attention).eval()

    try:
        model = load("sdpa")
    except ValueError:  # a family without sdpa (gpt-oss): its eager attention
        model = load("eager")
    prompt = np.random.default_rng(seed).integers(0, model.config.vocab_size, size=max(lengths))
    out = {"framework": "transformers", "torch": torch.__version__, "transformers": tf.__version__,
           "threads": torch.get_num_threads(), "dtype": dtype, "attn_implementation": model.config._attn_implementation,
           "lengths": {}, "cpu_times": {}}
    for n in lengths:
        ids = torch.as_tensor(prompt[:n], dtype=torch.long)[None]
        times, cpu_times = [], []
        with torch.inference_mode():
            for i in range(warmup + repeats):
                start, cpu_start = time.perf_counter(), time.process_time()
                logits = model(input_ids=ids, logits_to_keep=1).logits
                assert logits.shape[1] == 1
                if i >= warmup:
                    times.append(time.perf_counter() - start)
                    cpu_times.append(time.process_time() - cpu_start)
        print(f"hf len={n}: " + " ".join(f"{t * 1e3:.0f}" for t in times) + " ms", file=sys.stderr, flush=True)
        out["lengths"][str(n)] = times
        out["cpu_times"][str(n)] = cpu_times
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "time"])
    p.add_argument("directory")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 8192])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama", help="family of the saved checkpoint")
    args = p.parse_args()
    if args.mode == "save":
        save(args.directory, args.seed, args.arch)
    else:
        print(json.dumps(time_prefill(args.directory, args.lengths, args.repeats, args.warmup, args.threads,
                                      args.seed, args.dtype)))


if __name__ == "__main__":
    main()
