"""Hugging Face safetensors -> params, tensor by tensor; orbax save/restore of params.

Tensors are read through a memory map one at a time, cast to the configured dtype and
handed to `place(path, array)`, which decides where the array lives (one device by
default; models/sharding.py passes a placer that shards as it loads). The whole model is
never materialised on the host or on one device first.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxfill.models.config import ModelConfig
from jaxfill.models.llama import Llama

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model it is loaded into."""


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, name) for name in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def read_safetensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, memory-mapped array) without loading the file."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    for name, info in header.items():
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        yield name, data[start:end].view(dtype).reshape(info["shape"])


def hf_to_param(config: ModelConfig) -> dict[str, tuple[tuple, Callable[[np.ndarray], np.ndarray], tuple]]:
    """HF tensor name -> (param path, transform, expected HF shape)."""
    c = config
    e, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    hq, hk = c.num_heads, c.num_kv_heads
    table = {
        "model.embed_tokens.weight": (("embed", "embedding"), lambda w: w, (c.vocab_size, e)),
        "model.norm.weight": (("norm", "weight"), lambda w: w, (e,)),
    }
    if not c.tie_word_embeddings:
        table["lm_head.weight"] = (("lm_head",), lambda w: w.T, (c.vocab_size, e))
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        table.update({
            p + "self_attn.q_proj.weight": (("layers", n, "attn", "q"), lambda w: w.T.reshape(e, hq, d), (hq * d, e)),
            p + "self_attn.k_proj.weight": (("layers", n, "attn", "k"), lambda w: w.T.reshape(e, hk, d), (hk * d, e)),
            p + "self_attn.v_proj.weight": (("layers", n, "attn", "v"), lambda w: w.T.reshape(e, hk, d), (hk * d, e)),
            p + "self_attn.o_proj.weight": (("layers", n, "attn", "o"), lambda w: w.T.reshape(hq, d, e), (e, hq * d)),
            p + "mlp.gate_proj.weight": (("layers", n, "mlp", "gate"), lambda w: w.T, (i, e)),
            p + "mlp.up_proj.weight": (("layers", n, "mlp", "up"), lambda w: w.T, (i, e)),
            p + "mlp.down_proj.weight": (("layers", n, "mlp", "down"), lambda w: w.T, (e, i)),
            p + "input_layernorm.weight": (("layers", n, "attn_norm", "weight"), lambda w: w, (e,)),
            p + "post_attention_layernorm.weight": (("layers", n, "mlp_norm", "weight"), lambda w: w, (e,)),
        })
        if c.attention_bias:
            table.update({
                p + "self_attn.q_proj.bias": (("layers", n, "attn", "q_bias"), lambda w: w.reshape(hq, d), (hq * d,)),
                p + "self_attn.k_proj.bias": (("layers", n, "attn", "k_bias"), lambda w: w.reshape(hk, d), (hk * d,)),
                p + "self_attn.v_proj.bias": (("layers", n, "attn", "v_bias"), lambda w: w.reshape(hk, d), (hk * d,)),
            })
    return table


def default_place(path: tuple, array: np.ndarray) -> jax.Array:
    return jnp.asarray(array)


def load_hf_params(model_dir: str, config: ModelConfig, attention_impl: str = "auto",
                   place: Callable[[tuple, np.ndarray], jax.Array] = default_place,
                   progress: bool = True) -> Llama:
    """Builds a Llama whose params come from a Hugging Face safetensors checkpoint."""
    model = nnx.eval_shape(lambda: Llama(config, nnx.Rngs(0), attention_impl=attention_impl))
    graphdef, state = nnx.split(model)
    params = {path: var for path, var in nnx.to_flat_state(state)}
    table = hf_to_param(config)
    seen: set[str] = set()
    files = safetensors_files(model_dir)
    # Memory-mapped views: listing them reads only the headers.
    tensors = [(path, name, array) for path in files for name, array in read_safetensors(path)]
    target = config.jnp_dtype
    for path, name, array in tqdm(tensors, desc="loading weights", unit="tensor", disable=not progress):
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some exports write the tied head too
        if name not in table:
            raise CheckpointError(f"unexpected tensor {name!r} in {os.path.basename(path)} "
                                  f"(not part of a {config.architecture} with this config)")
        param_path, transform, hf_shape = table[name]
        if tuple(array.shape) != hf_shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(array.shape)}, "
                                  f"config.json implies {hf_shape}")
        value = np.ascontiguousarray(transform(array)).astype(target)
        params[param_path].set_value(place(param_path, value))
        seen.add(name)
    missing = sorted(set(table) - seen)
    if missing:
        raise CheckpointError(f"checkpoint {model_dir} is missing {len(missing)} tensors, e.g. {missing[:3]}")
    return nnx.merge(graphdef, state)


def save_params(model: Llama, directory: str) -> None:
    """Saves the model's params with orbax (a directory per checkpoint)."""
    import orbax.checkpoint as ocp

    _, state = nnx.split(model)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(directory), nnx.to_pure_dict(state))


def restore_params(directory: str, config: ModelConfig, attention_impl: str = "auto") -> Llama:
    """Restores params saved by `save_params` into a model of the given config."""
    import orbax.checkpoint as ocp

    model = nnx.eval_shape(lambda: Llama(config, nnx.Rngs(0), attention_impl=attention_impl))
    graphdef, state = nnx.split(model)
    abstract = nnx.to_pure_dict(state)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(os.path.abspath(directory), abstract)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
