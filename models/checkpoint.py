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
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfill.models import fp8_block, mxfp4
from jaxfill.models.int_group import INPUT_AXES as INT_GROUP_INPUT_AXES
from jaxfill.models.config import ModelConfig
from jaxfill.models.decoder import Decoder
from jaxfill.models.execution_plan import ExecutionPlan
from jaxfill.models.families.base import HFTensor
from jaxfill.models.families.registry import family_of, new_model
from jaxfill.models.gguf import GGUFTensor, gguf_file, hf_config_of
from jaxfill.models.gguf import tensors as gguf_tensors
from jaxfill.models.progress import progress_bar
from jaxfill.models.safetensors_file import (  # noqa: F401 (CheckpointError, StoredTensor: their old home)
    CheckpointError, StoredTensor, TensorSlices, read_safetensors, rows_of, safetensors_files,
)
from jaxfill.models.quant import STACKED_AXES, QuantizedSlices, input_axes, is_int8, quantize_param, scale_path


class StackedSlices:
    """Several tensors of one shape seen as one param stacked on `axis` (the layers of a
    pipelined model, models/parallel/pipeline.py, on axis 0; a MoE layer's experts), read one box
    at a time: a box reads only the entries it covers, each through its own reader
    (TensorSlices, an int8 view, or another stack)."""

    def __init__(self, parts: list, axis: int = 0):
        self.parts, self.axis = parts, axis
        inner = tuple(parts[0].shape)
        self.shape = inner[:axis] + (len(parts),) + inner[axis:]

    def read(self, index: tuple = ()) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(tuple(index)))
        start, stop, _ = index[self.axis].indices(len(self.parts))
        rest = index[:self.axis] + index[self.axis + 1:]
        return np.stack([self.parts[i].read(rest) for i in range(start, stop)], axis=self.axis)


def assemble(parts: dict, levels: tuple):
    """{indices: reader} and the stack's ((param axis, count), ...) -> one reader; no
    levels: the one reader. An outer level's axis is gone inside it, so inner positions shift."""
    if not levels:
        return parts[()]
    (axis, count), inner = levels[0], tuple((a - (a > levels[0][0]), n) for a, n in levels[1:])
    return StackedSlices([assemble({k[1:]: r for k, r in parts.items() if k[0] == i}, inner)
                          for i in range(count)], axis)


def scale_stack(name: str, num_in: int, stack: tuple) -> tuple:
    """A stacked projection's stack as its scales see it: they lack the `num_in` input axes."""
    first = STACKED_AXES.get(name, 0)
    inputs = range(first, first + num_in)
    return tuple((axis - sum(i < axis for i in inputs), index, count) for axis, index, count in stack)


def hf_to_param(config: ModelConfig) -> dict[str, HFTensor | tuple[HFTensor, ...]]:
    """HF tensor name -> where it goes (a tuple of parts for a fused tensor): the family's table,
    and the multi-token-prediction layer's when the engine runs it (models/mtp.py)."""
    from jaxfill.models.families.mtp_tensors import mtp_tensors
    from jaxfill.models.families.qwen_mtp_tensors import qwen_mtp_tensors

    family = family_of(config.architecture)
    table = family.tensors(config)
    if config.run_mtp:  # DeepSeek's layout, or Qwen3.5's mtp.* names (family.mtp_naming)
        table.update((qwen_mtp_tensors if getattr(family, "mtp_naming", None) == "qwen" else mtp_tensors)(family, config))
    return table


def tensor_parts(spec) -> tuple[HFTensor, ...]:
    return (spec,) if isinstance(spec, HFTensor) else spec


def _plain_reader(stored: StoredTensor | GGUFTensor, spec: HFTensor) -> Callable:
    if isinstance(stored, GGUFTensor):
        return lambda target: stored.slices(spec.stored_shape, spec.perm, target)
    return lambda target: TensorSlices(stored, spec.stored_shape, spec.perm, target)


def _mxfp4_reader(name: str, pair: dict, spec: HFTensor) -> Callable:
    """The reader of an [E, in, out] tensor stored as MXFP4 `name`_blocks and `name`_scales."""
    blocks, scales = (pair.get(suffix) for suffix in mxfp4.SUFFIXES)
    if blocks is None or scales is None:
        raise CheckpointError(f"MXFP4 tensor {name!r} needs both {name}_blocks and {name}_scales")
    want = mxfp4.packed_shapes(spec.hf_shape)
    for stored, shape, suffix in zip((blocks, scales), want, mxfp4.SUFFIXES):
        if stored.shape != shape or stored.dtype != np.uint8:
            raise CheckpointError(f"tensor {name + suffix!r} is {stored.shape} {stored.dtype}, an MXFP4 "
                                  f"{list(spec.hf_shape)} tensor needs {shape} uint8")
    u8 = np.dtype(np.uint8)
    return lambda target: mxfp4.Mxfp4Slices(
        TensorSlices(blocks, blocks.shape, tuple(range(4)), u8), TensorSlices(scales, scales.shape, (0, 1, 2), u8),
        spec.stored_shape, spec.perm, target)


def default_place(path: tuple, tensor: TensorSlices) -> jax.Array:
    """One device: the whole tensor, read and cast once."""
    return jax.device_put(tensor.read())


def load_hf_params(model_dir: str, config: ModelConfig, attention_impl: str = "auto",
                   place: Callable[[tuple, TensorSlices], jax.Array] = default_place,
                   progress: bool = True, plan: ExecutionPlan = ExecutionPlan()) -> Decoder:
    """Builds the config's model whose params come from a Hugging Face safetensors checkpoint
    (or a GGUF file, models/gguf/).

    Every header is checked (names, shapes) before any tensor data is read, so a wrong
    checkpoint fails fast and whole. With a stacked `plan` the params go straight into the
    stacked layout of models/parallel/pipeline.py: `place` gets each stacked param as one
    StackedSlices, so a device reads only its own stage's layers."""
    from jaxfill.models.config.int_quantization import file_format, int_format_of, is_int
    from jaxfill.models.int_group import IntGroupFormat
    from jaxfill.models.fp8_reader import Fp8Reader  # it reads through this module's TensorSlices
    from jaxfill.models.int_group_reader import IntGroupReader, projection_of

    model = nnx.eval_shape(lambda: new_model(config, nnx.Rngs(0), attention_impl=attention_impl, plan=plan))
    graphdef, state = nnx.split(model)
    params = {path: var for path, var in nnx.to_flat_state(state)}
    family = family_of(config.architecture)
    table = hf_to_param(config)
    rename = getattr(family, "rename", lambda name: name)
    gguf = gguf_file(model_dir)  # a GGUF: its tensors dequantized at read, or kept packed (models/gguf/)
    files = [gguf] if gguf else safetensors_files(model_dir)
    hf_json = os.path.join(model_dir, "config.json")
    with open(hf_json) if os.path.exists(hf_json) and not gguf else open(os.devnull) as f:
        hf = hf_config_of(gguf) if gguf else json.loads(f.read() or "{}")
    skipped = family.skipped_prefixes(config, hf)
    todo: list[tuple[HFTensor, Callable]] = []  # (where, target dtype -> reader)
    seen: set[str] = set()
    packed: dict[str, dict] = {}  # MXFP4 tensors: name -> {suffix: stored}
    fp8_scales: dict[str, StoredTensor] = {}  # fp8 weight name -> its weight_scale_inv
    fp8: list[tuple[str, StoredTensor, tuple]] = []  # (name, stored, parts) of fp8 weights
    # AWQ / GPTQ / compressed-tensors: projection weight name -> {stored suffix: stored}
    # (a GGUF's packable projections: only when kept packed; auto and int8 read ggml's own values)
    int_fmt = file_format(hf["quantization_config"]) if is_int(hf) and (
        not gguf or config.weight_dtype == "int_group") else None
    int_form = int_fmt and IntGroupFormat(**int_format_of(hf["quantization_config"]))
    packed_ints: dict[str, dict] = {}
    # fp8 weights' scales and (unused: weight-only) activation scales; compressed-tensors spells them otherwise
    quant = hf.get("quantization_config") or {}
    fp8_suffixes = (".weight_scale", ".input_scale") if quant.get("format") == "float-quantized" else (
        fp8_block.HF_SCALE, fp8_block.HF_ACTIVATION_SCALE)
    for path in files:
        for name, stored in gguf_tensors(path) if gguf else read_safetensors(path):
            name = rename(name)
            if name not in table and "model." + name in table:
                name = "model." + name  # a bare backbone (Qwen3-Embedding: embed_tokens.*, layers.*, norm.*)
            if name.endswith(family.ignored_tensors) or name.startswith(skipped):
                continue
            if name == "lm_head.weight" and config.embeddings.tied:
                continue  # some exports write the tied head too
            if name in seen:
                raise CheckpointError(f"tensor {name!r} appears twice ({os.path.basename(path)} again)")
            seen.add(name)
            if name.endswith(fp8_suffixes) and name not in table:
                if name.endswith(fp8_suffixes[0]):
                    fp8_scales[name[:-len(fp8_suffixes[0])] + ".weight"] = stored
                continue
            hit = int_fmt and projection_of(name, stored, table, int_fmt[0])
            if hit:
                packed_ints.setdefault(hit[0], {})[hit[1]] = stored
                continue
            base = name[:-len(mxfp4.SUFFIXES[0])]
            if name not in table and name.endswith(mxfp4.SUFFIXES) and isinstance(table.get(base), HFTensor):
                packed.setdefault(base, {})[name[len(base):]] = stored
                continue
            if name not in table:
                raise CheckpointError(f"unexpected tensor {name!r} in {os.path.basename(path)} "
                                      f"(not part of a {config.architecture} with this config)")
            parts = family.stored_layout(name, stored.shape, tensor_parts(table.pop(name)))
            if stored.shape != parts[0].hf_shape:
                raise CheckpointError(f"tensor {name!r} has shape {stored.shape}, "
                                      f"config.json implies {parts[0].hf_shape}")
            if fp8_block.is_fp8(stored.dtype):
                fp8.append((name, stored, parts))
                continue
            todo.extend((part, _plain_reader(rows_of(stored, part.rows), part)) for part in parts)
    for name, stored, parts in fp8:
        scales = fp8_scales.pop(name, None)
        todo.extend((part, Fp8Reader(name, stored, scales, part, config.weight_block_size)) for part in parts)
    if fp8_scales:
        raise CheckpointError(f"scales without an fp8 weight: {sorted(fp8_scales)[:3]}")
    for base, pair in packed.items():
        spec = table.pop(base)
        todo.append((spec, _mxfp4_reader(base, pair, spec)))
    for base, parts in packed_ints.items():
        todo.extend((spec, IntGroupReader(base, parts, spec, int_fmt[0], int_form.of(spec.param_path[-1]),
                                          int_fmt[1])) for spec in tensor_parts(table.pop(base)))
    if table:
        missing = sorted(table)
        mtp = (f"model.layers.{config.num_layers}.", "mtp.")  # DeepSeek's / Qwen3.5's names
        if config.run_mtp and any(name.startswith(mtp) for name in missing):
            raise CheckpointError(f"checkpoint {model_dir} has no multi-token-prediction layer (e.g. {missing[0]}) "
                                  "although its config.json says num_nextn_predict_layers (or "
                                  "mtp_num_hidden_layers) > 0 (an export that strips it): use "
                                  "speculative.method = ngram, suffix or none")
        raise CheckpointError(f"checkpoint {model_dir} is missing {len(missing)} tensors, e.g. {missing[:3]}")
    target = np.dtype(config.jnp_dtype)
    entries: dict[tuple, dict] = {}  # param path -> {indices in its stack: reader}
    levels: dict[tuple, tuple] = {}  # param path -> ((param axis, count), ...) of its stack
    stages = plan.layer_groups
    per_stage = config.num_layers // stages

    def dtype_of(p: tuple) -> np.dtype:  # the model's param (a stacked plan holds layer n at n % K)
        return np.dtype(params[("layers", p[1] % per_stage) + p[2:] if stages > 1 and p[0] == "layers" else p].dtype)

    for spec, reader_of in todo:
        path = spec.param_path
        if isinstance(reader_of, IntGroupReader) and config.weight_dtype == "int_group":  # codes and scales
            if dtype_of(path) != np.uint8:
                raise CheckpointError(f"{path} is stored packed but model.weight_int_scope = "
                                      f"{config.weight_int_scope!r} keeps it unquantized")
            pairs = reader_of.pairs(path)
        elif dtype_of(path) == np.uint8 and path[-1] in INT_GROUP_INPUT_AXES:
            raise CheckpointError(f"{path} is stored unquantized but model.weight_dtype = int_group keeps it packed "
                                  "as an AWQ / GPTQ / compressed-tensors checkpoint stores it")
        elif fp8_block.is_fp8(dtype_of(path)):  # kept as stored, with its block scales
            if not isinstance(reader_of, Fp8Reader):
                raise CheckpointError(f"{path} is stored unquantized but model.weight_dtype = fp8_block keeps it "
                                      "in fp8: set model.weight_dtype = auto")
            s, n, _ = fp8_block.LAYOUTS[path[-1]]
            stack = tuple((axis - (n - 1) * (axis >= s + n), index, count) for axis, index, count in spec.stack)
            pairs = [(path, reader_of(dtype_of(path)), spec.stack), (scale_path(path), reader_of.scales, stack)]
        elif is_int8(dtype_of(path)):  # the model keeps it int8: quantized from the f32 values, slice by slice
            # experts stacked in the checkpoint itself (gpt-oss) carry their expert axis
            stacked = 0 if spec.stack else STACKED_AXES.get(path[-1], 0)
            floats = reader_of(np.dtype(np.float32))
            num_in = input_axes(path[-1], len(floats.shape), stacked)
            tensor = QuantizedSlices(floats, num_in, stacked)
            pairs = [(path, tensor, spec.stack),
                     (scale_path(path), tensor.scales, scale_stack(path[-1], num_in, spec.stack))]
        else:
            pairs = [(path, reader_of(target), spec.stack)]
        for p, reader, stack in pairs:
            entries.setdefault(p, {})[tuple(index for _, index, _ in stack)] = reader
            levels[p] = tuple((axis, count) for axis, _, count in stack)
    readers: dict[tuple, object] = {}  # param path -> reader (a list of stage rows while stacking)
    for p, parts in entries.items():
        reader = assemble(parts, levels[p])
        if stages > 1 and p[0] == "layers":  # layer n is row n // K of module n % K
            rows = readers.setdefault(("layers", p[1] % per_stage) + p[2:], [None] * stages)
            rows[p[1] // per_stage] = reader
        else:
            readers[p] = reader
    for path, reader in progress_bar(readers.items(), desc="loading weights", unit="tensor", disable=not progress):
        params[path].set_value(place(path, StackedSlices(reader) if isinstance(reader, list) else reader))
    IntGroupReader._last = (None, None)  # the projection unpacked last
    return nnx.merge(graphdef, state)


def quantize_model(model: Decoder, weight_dtype: str = "int8") -> Decoder:
    """The same model with its projections quantized (models/quant.py), as loading a
    checkpoint with model.weight_dtype = weight_dtype would give."""
    if model.config.weight_dtype != "auto":
        raise ValueError(f"model is already {model.config.weight_dtype}; quantize the float model")
    config = dataclasses.replace(model.config, weight_dtype=weight_dtype)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: new_model(config, nnx.Rngs(0),
                                                                 attention_impl=model.attention_impl)))
    params = dict(nnx.to_flat_state(state))
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if is_int8(params[path].dtype):  # the quantized model's own choice (models/layers.py projection)
            q, scale = quantize_param(path[-1], np.asarray(var[...], np.float32))
            params[path].set_value(jnp.asarray(q))
            params[scale_path(path)].set_value(jnp.asarray(scale))
        else:
            params[path].set_value(var[...])
    return nnx.merge(graphdef, state)


def save_params(model: Decoder, directory: str) -> None:
    """Saves the model's params with orbax (a directory per checkpoint)."""
    import orbax.checkpoint as ocp

    _, state = nnx.split(model)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(directory), nnx.to_pure_dict(state))


def restore_params(directory: str, config: ModelConfig, attention_impl: str = "auto") -> Decoder:
    """Restores params saved by `save_params` into a model of the given config."""
    import orbax.checkpoint as ocp

    model = nnx.eval_shape(lambda: new_model(config, nnx.Rngs(0), attention_impl=attention_impl))
    graphdef, state = nnx.split(model)
    abstract = nnx.to_pure_dict(state)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(os.path.abspath(directory), abstract)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
