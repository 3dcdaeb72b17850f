"""Hugging Face safetensors -> params, a slice at a time; orbax save/restore of params.

Each checkpoint tensor is handed to `place(path, tensor)` as a `TensorSlices`: its
header entry, not its data. `place` reads the slices it needs (one device: the whole
tensor, engine/placement.py: each local device's shard) and each read maps only that
slice's bytes, copies and casts them, and unmaps them. No tensor is read whole unless a
device holds it whole, and nothing of the file stays mapped between tensors.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxfill.models.config import ModelConfig
from jaxfill.models.llama import Llama
from jaxfill.models.quant import QUANTIZED_INPUT_AXES, QuantizedSlices, is_quantized, quantize, scale_path

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model it is loaded into."""


class StoredTensor(NamedTuple):
    """A tensor's safetensors header entry: where its bytes are, nothing read yet."""
    file: str
    offset: int  # absolute byte offset of the first element in `file`
    dtype: np.dtype
    shape: tuple


@dataclasses.dataclass(frozen=True)
class TensorSlices:
    """A stored tensor seen in param layout, read one box at a time.

    The param is the stored array reshaped (C order) to `stored_shape` and transposed by
    `perm` (param axis i is stored axis perm[i]): both are views, so any box of the param
    is a box of the file, and reading it maps only the byte range from its first to its
    last element. Pages a box skips inside that range (an inner-axis split) are never
    touched."""
    stored: StoredTensor
    stored_shape: tuple
    perm: tuple
    target: np.dtype  # the param's dtype; the cast happens on the slice

    @property
    def shape(self) -> tuple:
        return tuple(self.stored_shape[p] for p in self.perm)

    def read(self, index: tuple = ()) -> np.ndarray:
        """The box `index` (slices with step 1, as make_array_from_callback passes) of the
        param: a new C-contiguous array in the target dtype, independent of the file."""
        index = tuple(index) + (slice(None),) * (len(self.perm) - len(tuple(index)))
        box = [(0, 0)] * len(self.perm)
        for axis, (s, dim) in enumerate(zip(index, self.shape)):
            start, stop, step = s.indices(dim)
            if step != 1:
                raise ValueError(f"slice {s} of a checkpoint tensor must have step 1")
            box[self.perm[axis]] = (start, max(start, stop))
        lengths = [hi - lo for lo, hi in box]
        if 0 in lengths:
            return np.empty([lengths[p] for p in self.perm], self.target)
        itemsize = np.dtype(self.stored.dtype).itemsize
        strides = [int(np.prod(self.stored_shape[i + 1:], dtype=np.int64)) for i in range(len(box))]
        first = sum(lo * st for (lo, _), st in zip(box, strides))
        last = sum((hi - 1) * st for (_, hi), st in zip(box, strides))
        lo_byte = self.stored.offset + first * itemsize
        aligned = lo_byte - lo_byte % mmap.ALLOCATIONGRANULARITY
        with open(self.stored.file, "rb") as f:
            mapped = mmap.mmap(f.fileno(), self.stored.offset + (last + 1) * itemsize - aligned,
                               offset=aligned, access=mmap.ACCESS_READ)
        try:
            view = np.ndarray(lengths, self.stored.dtype, buffer=mapped, offset=lo_byte - aligned,
                              strides=[st * itemsize for st in strides])
            out = np.array(view.transpose(self.perm), dtype=self.target, order="C")
            del view  # the map cannot close while a view exports it
        finally:
            mapped.close()
        return out


class StackedSlices:
    """Several tensors of one shape seen as one stacked [n, ...] param (the layers of a
    pipelined model, models/pipeline.py), read one box at a time: a box reads only the
    rows (layers) it covers, each through its own reader (TensorSlices or an int8 view)."""

    def __init__(self, parts: list):
        self.parts = parts
        self.shape = (len(parts),) + tuple(parts[0].shape)

    def read(self, index: tuple = ()) -> np.ndarray:
        index = tuple(index) or (slice(None),)
        start, stop, _ = index[0].indices(len(self.parts))
        return np.stack([self.parts[i].read(index[1:]) for i in range(start, stop)])


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


def read_safetensors(path: str) -> Iterator[tuple[str, StoredTensor]]:
    """Yields (name, header entry) per tensor; reads the header only."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    size = os.path.getsize(path)
    for name, info in header.items():
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
        start, end = info["data_offsets"]
        shape = tuple(int(n) for n in info["shape"])
        if end - start != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or 8 + header_len + end > size:
            raise CheckpointError(f"{path}: tensor {name} has data_offsets {info['data_offsets']} that do not "
                                  f"match shape {list(shape)} {info['dtype']} or lie past the end of the file")
        yield name, StoredTensor(path, 8 + header_len + start, dtype, shape)


class HFTensor(NamedTuple):
    """Where an HF tensor goes: param path, its HF shape, and the param as a view of it
    (reshape the stored array to `stored_shape`, then transpose by `perm`)."""
    param_path: tuple
    hf_shape: tuple
    stored_shape: tuple
    perm: tuple


def hf_to_param(config: ModelConfig) -> dict[str, HFTensor]:
    """HF tensor name -> HFTensor. HF Linear weights are [out, in]; params are [in, ...]."""
    c = config
    e, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    hq, hk = c.num_heads, c.num_kv_heads
    same = lambda path, shape: HFTensor(path, shape, shape, tuple(range(len(shape))))  # noqa: E731
    table = {
        "model.embed_tokens.weight": same(("embed", "embedding"), (c.vocab_size, e)),
        "model.norm.weight": same(("norm", "weight"), (e,)),
    }
    if not c.tie_word_embeddings:
        table["lm_head.weight"] = HFTensor(("lm_head",), (c.vocab_size, e), (c.vocab_size, e), (1, 0))
    for n in range(c.num_layers):
        p, layer = f"model.layers.{n}.", ("layers", n)
        table.update({  # [H*D, E] stored as [H, D, E] -> [E, H, D]; o: [E, H*D] as [E, H, D] -> [H, D, E]
            p + "self_attn.q_proj.weight": HFTensor(layer + ("attn", "q"), (hq * d, e), (hq, d, e), (2, 0, 1)),
            p + "self_attn.k_proj.weight": HFTensor(layer + ("attn", "k"), (hk * d, e), (hk, d, e), (2, 0, 1)),
            p + "self_attn.v_proj.weight": HFTensor(layer + ("attn", "v"), (hk * d, e), (hk, d, e), (2, 0, 1)),
            p + "self_attn.o_proj.weight": HFTensor(layer + ("attn", "o"), (e, hq * d), (e, hq, d), (1, 2, 0)),
            p + "mlp.gate_proj.weight": HFTensor(layer + ("mlp", "gate"), (i, e), (i, e), (1, 0)),
            p + "mlp.up_proj.weight": HFTensor(layer + ("mlp", "up"), (i, e), (i, e), (1, 0)),
            p + "mlp.down_proj.weight": HFTensor(layer + ("mlp", "down"), (e, i), (e, i), (1, 0)),
            p + "input_layernorm.weight": same(layer + ("attn_norm", "weight"), (e,)),
            p + "post_attention_layernorm.weight": same(layer + ("mlp_norm", "weight"), (e,)),
        })
        if c.attention_bias:
            table.update({
                p + "self_attn.q_proj.bias": HFTensor(layer + ("attn", "q_bias"), (hq * d,), (hq, d), (0, 1)),
                p + "self_attn.k_proj.bias": HFTensor(layer + ("attn", "k_bias"), (hk * d,), (hk, d), (0, 1)),
                p + "self_attn.v_proj.bias": HFTensor(layer + ("attn", "v_bias"), (hk * d,), (hk, d), (0, 1)),
            })
    return table


def default_place(path: tuple, tensor: TensorSlices) -> jax.Array:
    """One device: the whole tensor, read and cast once."""
    return jax.device_put(tensor.read())


def load_hf_params(model_dir: str, config: ModelConfig, attention_impl: str = "auto",
                   place: Callable[[tuple, TensorSlices], jax.Array] = default_place,
                   progress: bool = True, stages: int = 1, microbatches: int = 1) -> Llama:
    """Builds a Llama whose params come from a Hugging Face safetensors checkpoint.

    Every header is checked (names, shapes) before any tensor data is read, so a wrong
    checkpoint fails fast and whole. With `stages` > 1 the params go straight into the
    stacked layout of models/pipeline.py: `place` gets each stacked param as one
    StackedSlices, so a device reads only its own stage's layers."""
    model = nnx.eval_shape(lambda: Llama(config, nnx.Rngs(0), attention_impl=attention_impl, stages=stages,
                                         microbatches=microbatches))
    graphdef, state = nnx.split(model)
    params = {path: var for path, var in nnx.to_flat_state(state)}
    table = hf_to_param(config)
    files = safetensors_files(model_dir)
    todo: list[tuple[HFTensor, StoredTensor]] = []
    seen: set[str] = set()
    for path in files:
        for name, stored in read_safetensors(path):
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # some exports write the tied head too
            if name in seen:
                raise CheckpointError(f"tensor {name!r} appears twice ({os.path.basename(path)} again)")
            if name not in table:
                raise CheckpointError(f"unexpected tensor {name!r} in {os.path.basename(path)} "
                                      f"(not part of a {config.architecture} with this config)")
            if stored.shape != table[name].hf_shape:
                raise CheckpointError(f"tensor {name!r} has shape {stored.shape}, "
                                      f"config.json implies {table[name].hf_shape}")
            todo.append((table.pop(name), stored))
            seen.add(name)
    if table:
        missing = sorted(table)
        raise CheckpointError(f"checkpoint {model_dir} is missing {len(missing)} tensors, e.g. {missing[:3]}")
    target = np.dtype(config.jnp_dtype)
    readers: dict[tuple, object] = {}  # param path -> reader (a list of stage rows while stacking)
    per_stage = config.num_layers // stages
    for spec, stored in todo:
        path = spec.param_path
        if is_quantized(path, config.weight_dtype):  # int8 from the f32 values, slice by slice
            tensor = QuantizedSlices(TensorSlices(stored, spec.stored_shape, spec.perm, np.dtype(np.float32)),
                                     QUANTIZED_INPUT_AXES[path[-1]])
            pairs = [(path, tensor), (scale_path(path), tensor.scales)]
        else:
            pairs = [(path, TensorSlices(stored, spec.stored_shape, spec.perm, target))]
        for p, reader in pairs:
            if stages > 1 and p[0] == "layers":  # layer n is row n // K of module n % K
                rows = readers.setdefault(("layers", p[1] % per_stage) + p[2:], [None] * stages)
                rows[p[1] // per_stage] = reader
            else:
                readers[p] = reader
    for path, reader in tqdm(readers.items(), desc="loading weights", unit="tensor", disable=not progress):
        params[path].set_value(place(path, StackedSlices(reader) if isinstance(reader, list) else reader))
    return nnx.merge(graphdef, state)


def quantize_model(model: Llama, weight_dtype: str = "int8") -> Llama:
    """The same model with its projections quantized (models/quant.py), as loading a
    checkpoint with model.weight_dtype = weight_dtype would give."""
    if model.config.weight_dtype != "auto":
        raise ValueError(f"model is already {model.config.weight_dtype}; quantize the float model")
    config = dataclasses.replace(model.config, weight_dtype=weight_dtype)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(config, nnx.Rngs(0),
                                                             attention_impl=model.attention_impl)))
    params = dict(nnx.to_flat_state(state))
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if is_quantized(path, weight_dtype):
            q, scale = quantize(np.asarray(var[...], np.float32), QUANTIZED_INPUT_AXES[path[-1]])
            params[path].set_value(jnp.asarray(q))
            params[scale_path(path)].set_value(jnp.asarray(scale))
        else:
            params[path].set_value(var[...])
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
