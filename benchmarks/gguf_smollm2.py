"""SmolLM2-135M-Instruct from its Q4_1 GGUF (tests/test_gguf_smollm2.py fetches it) against
the same weights as a bf16 safetensors checkpoint, on CPU.

    python benchmarks/gguf_smollm2.py [--gguf PATH] [--lengths 512 2048] [--repeats 3]

Load: seconds to build the model and its weight bytes on device, the GGUF kept packed
(model.weight_dtype = int_group, its default: Q4_1 codes, f32 group scales and zero points)
or dequantized to the model dtype (auto), and the bytes on disk. TTFT: `Engine.generate(max_tokens=1)` per prompt length, one engine per
(source, dtype, length) whose one token bucket is the prompt, median of --repeats after a
warm run. Accuracy: the GGUF's f32 model is the reference (the unquantized original is not
fetchable here: no hub access), so the cost measured is that of keeping it packed
(int_group: the same values up to Q4_1's f32 zero point), of running it in bf16 and of
re-quantizing it to int8 (model.weight_dtype=int8): max |dlogprob| of the chosen tokens and
greedy agreement over 100 tokens of a chat prompt. Writes benchmarks/results/gguf_smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "gguf_smollm2.json")
DEFAULT = os.path.join(os.path.expanduser("~"), ".cache", "jaxfill", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def bf16_checkpoint(gguf: str, directory: str) -> str:
    """The GGUF's weights as transformers loads them, saved as bf16 safetensors with the
    config transformers derives (its GGUF-loaded model refuses save_pretrained)."""
    import torch
    import transformers as tf
    from safetensors.torch import save_file

    from jaxfill.models.gguf import hf_config_of

    model = tf.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                    dtype=torch.float32)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**hf_config_of(gguf), "dtype": "bfloat16"}, f)
    return directory


def load(path: str, dtype: str, weight_dtype: str = "auto") -> dict:
    """Seconds to build the model, and its params' bytes."""
    import jax
    from flax import nnx

    from jaxfill.models.checkpoint import load_hf_params
    from jaxfill.models.families.registry import config_from_hf

    start = time.perf_counter()
    model = load_hf_params(path, config_from_hf(path).replace(dtype=dtype, weight_dtype=weight_dtype), progress=False)
    seconds = time.perf_counter() - start
    return {"s": seconds, "param_bytes": sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))}


def ttft(path: str, dtype: str, n: int, repeats: int, weight_dtype: str = "auto") -> float:
    import numpy as np

    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    over = {"engine.max_num_batched_tokens": n, "engine.token_buckets": [n], "engine.max_num_seqs": 1,
            "engine.seq_buckets": [1], "engine.num_pages": n // 16 + 8, "engine.max_model_len": n + 16,
            "engine.enable_prefix_caching": False, "model.dtype": dtype, "model.weight_dtype": weight_dtype}
    engine = Engine.from_config(model_path=path, overrides=over, progress=False)
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 40000, n)]
    engine.generate([prompt], SamplingParams(max_tokens=1))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1))
        times.append(time.perf_counter() - start)
    engine.close()
    return statistics.median(times)


def accuracy(gguf: str, new_tokens: int = 100) -> dict:
    """bf16 and int8 against the f32 model of the same GGUF: the reference's greedy tokens
    teacher-forced through each (logprob of the reference's token), and each one's own
    greedy tokens (agreement: the matching prefix and the share of equal positions)."""
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    base = {"engine.max_model_len": 512, "engine.num_pages": 40, "engine.max_num_seqs": 1,
            "engine.max_num_batched_tokens": 256, "engine.token_buckets": [256], "engine.seq_buckets": [1],
            "engine.scan_layers": True}
    runs = {"f32": {"model.dtype": "float32", "model.weight_dtype": "auto"},
            "int_group f32": {"model.dtype": "float32", "model.weight_dtype": "int_group"},
            "bf16": {"model.dtype": "bfloat16", "model.weight_dtype": "auto"},
            "int8": {"model.dtype": "float32", "model.weight_dtype": "int8"}}
    out, ref = {}, None
    for name, over in runs.items():
        engine = Engine.from_config(model_path=gguf, overrides={**base, **over}, progress=False)
        tok = engine.tokenizer
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about the history of Paris."}]))
        done = engine.generate([prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))[0]
        full = prompt + (ref or {"tokens": done.token_ids})["tokens"]  # the reference's tokens, teacher-forced
        c = engine.generate([full], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        forced = [e["logprob"] for e in c.prompt_logprobs[len(prompt):]]
        engine.close()
        entry = {"tokens": done.token_ids, "forced": forced, "text": done.text[:200]}
        if ref is None:
            ref = entry
        else:
            same = [a == b for a, b in zip(entry["tokens"], ref["tokens"])]
            entry.update(max_abs_dlogprob=max(abs(a - b) for a, b in zip(forced, ref["forced"])),
                         greedy_equal_share=sum(same) / len(same),
                         greedy_prefix=next((i for i, s in enumerate(same) if not s), len(same)))
        out[name] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=DEFAULT)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = {"gguf_bytes": os.path.getsize(args.gguf)}
    with tempfile.TemporaryDirectory() as tmp:
        st = bf16_checkpoint(args.gguf, tmp)
        result["bf16_safetensors_bytes"] = os.path.getsize(os.path.join(st, "model.safetensors"))
        runs = (("gguf int_group", args.gguf, "float32", "int_group"), ("gguf int_group", args.gguf, "bfloat16",
                                                                            "int_group"),
                ("gguf", args.gguf, "float32", "auto"), ("gguf", args.gguf, "bfloat16", "auto"),
                ("safetensors", st, "bfloat16", "auto"))
        result["load"] = {f"{src} {dtype}": load(path, dtype, wd) for src, path, dtype, wd in runs}
        result["ttft_s"] = {f"{src} {dtype} {n}": ttft(path, dtype, n, args.repeats, wd)
                            for n in args.lengths for src, path, dtype, wd in runs}
    result["accuracy"] = accuracy(args.gguf)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "accuracy"}, indent=1))
    print(json.dumps({k: {m: v for m, v in e.items() if m not in ("tokens", "forced")}
                      for k, e in result["accuracy"].items()}, indent=1))


if __name__ == "__main__":
    main()
