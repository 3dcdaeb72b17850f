"""New weights for a built engine: checked whole, placed like the old ones, then swapped.

    Engine.update_weights(source) -> new_leaves(...)  every tensor read, checked, placed
                                  -> swap(runner, new) the params replaced, old buffers deleted
                                  -> flush_kv(...)     prefix cache and host/disk tiers emptied

A source is a params tree of the engine's own structure (an nnx State or Module, or
nnx.to_pure_dict's nested dict), a checkpoint directory (read by the loader, engine/
loading.py build_model, with its sharding, dtype and quantization checks), or an iterable
of (Hugging Face tensor name, array) pairs, mapped as the checkpoint loader maps names
(models/checkpoint.py hf_to_param). Everything is read and checked before anything is
swapped, so a refused source leaves the engine as it was; a refusal is one line naming
the tensor. Each new array gets the old one's sharding (its NamedSharding on a mesh,
committed or not on one device), shape and dtype, so the jitted steps take it without
compiling: their cache key is exactly that.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from flax import nnx

from jaxfill.models.lora import is_table_path


class WeightUpdateError(ValueError):
    """A source refused before anything changed; the message names the tensor."""


def leaf_path(keypath) -> tuple:
    """A jax key path of an nnx State (or pure dict) -> the nnx param path ('layers', 0, 'attn', 'q')."""
    out = []
    for k in keypath:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
    return tuple(out)


def flat_leaves(tree) -> dict[tuple, object]:
    """param path -> array, of an nnx State, Module or pure dict."""
    if isinstance(tree, nnx.Module):
        tree = nnx.split(tree)[1]
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {leaf_path(kp): leaf for kp, leaf in pairs}


def name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def place_like(old: jax.Array, read, shape: tuple) -> jax.Array:
    """A new array placed as `old` is: its sharding, committed or not. `read(index)` gives
    the numpy box of the param at `index` (each process reads only its own shards)."""
    if not old.committed:  # one device, as the loader's default_place leaves it
        return jax.device_put(read(tuple(slice(None) for _ in shape)))
    return jax.make_array_from_callback(tuple(shape), old.sharding, read)


def _check(path: tuple, old, shape: tuple, dtype) -> None:
    if tuple(shape) != tuple(old.shape):
        raise WeightUpdateError(f"{name(path)}: shape {tuple(shape)}, the engine's param is {tuple(old.shape)}")
    if np.dtype(dtype) != np.dtype(old.dtype):
        raise WeightUpdateError(f"{name(path)}: dtype {np.dtype(dtype)}, the engine's param is {np.dtype(old.dtype)}")


# ---------------------------------------------------------------------------- sources
def from_tree(current: dict, tree) -> dict:
    """A params tree of the engine's structure: every path, shape and dtype equal."""
    new = flat_leaves(tree)
    missing = [p for p in current if p not in new and not is_table_path(p)]  # LoRA tables are the engine's
    if missing:
        raise WeightUpdateError(f"{name(missing[0])}: missing from the params tree ({len(missing)} params missing)")
    extra = [p for p in new if p not in current]
    if extra:
        raise WeightUpdateError(f"{name(extra[0])}: not a param of this engine's model")
    for path, arr in new.items():
        _check(path, current[path], np.shape(arr), getattr(arr, "dtype", np.asarray(arr).dtype))
    out = {}
    for path, arr in new.items():
        old = current[path]
        if isinstance(arr, jax.Array) and arr.sharding == old.sharding and arr.committed == old.committed:
            out[path] = arr  # already placed as the engine's (a caller's own copy, kept as is)
        else:
            host = np.asarray(arr)
            out[path] = place_like(old, lambda index, h=host: h[index], old.shape)
    return out


def from_checkpoint(config, mesh, path: str, current: dict) -> dict:
    """A checkpoint directory (or GGUF file) read as the engine's own was (engine/loading.py build_model):
    the same model config, dtype, quantization, plan and shards."""
    from jaxfill.engine.loading import build_model
    from jaxfill.models.safetensors_file import CheckpointError

    from jaxfill.models.gguf import gguf_file

    if not os.path.isdir(path) and not gguf_file(path):
        raise WeightUpdateError(f"path: {path!r} is not a checkpoint directory (or a .gguf file)")
    try:
        model = build_model(dataclasses.replace(config, model_path=path), mesh, progress=False)
    except (CheckpointError, ValueError, OSError) as e:
        raise WeightUpdateError(f"{path}: {e}") from None
    new = flat_leaves(model)
    try:
        for p, arr in new.items():
            if p not in current:
                raise WeightUpdateError(f"{name(p)}: not a param of this engine's model")
            _check(p, current[p], arr.shape, arr.dtype)
        return {p: (arr if arr.sharding == current[p].sharding else jax.device_put(arr, current[p].sharding))
                for p, arr in new.items()}
    except WeightUpdateError:
        for arr in new.values():
            arr.delete()
        raise


class _ArrayReader:
    """A host array seen as the loader's readers are: `shape`, `read(index)`."""

    def __init__(self, array: np.ndarray):
        self.array, self.shape = array, array.shape

    def read(self, index: tuple = ()) -> np.ndarray:
        return np.ascontiguousarray(self.array[tuple(index)])


def from_pairs(config, plan, current: dict, pairs) -> dict:
    """(HF tensor name, array) pairs, named as in a checkpoint; the params they name are
    replaced, the others kept. A param stacked from several tensors (a MoE layer's experts)
    needs all of them."""
    from jaxfill.models.checkpoint import assemble, hf_to_param, scale_stack, tensor_parts
    from jaxfill.models.families.registry import family_of
    from jaxfill.models.quant import STACKED_AXES, QuantizedSlices, input_axes, is_int8, scale_path

    m = config.model
    if m.weight_dtype not in ("auto", "int8"):
        raise WeightUpdateError(f"model.weight_dtype = {m.weight_dtype!r}: (name, array) updates take a float or "
                                "int8 model; pass a checkpoint directory instead")
    if plan.layer_groups > 1:
        raise WeightUpdateError("(name, array) updates do not take the stacked layer layout (mesh.stage > 1 or "
                                "engine.scan_layers); pass a checkpoint directory instead")
    family = family_of(m.architecture)
    table = hf_to_param(m)
    rename = getattr(family, "rename", lambda n: n)
    entries: dict[tuple, dict] = {}
    levels: dict[tuple, tuple] = {}
    seen: set[str] = set()
    for raw, array in pairs:
        hf = rename(raw)
        if hf not in table and "model." + hf in table:
            hf = "model." + hf
        if hf == "lm_head.weight" and m.embeddings.tied and hf not in table:
            continue  # the tied head some exports write too
        if hf not in table:
            raise WeightUpdateError(f"{raw}: not a tensor of a {m.architecture} with this config")
        if hf in seen:
            raise WeightUpdateError(f"{raw}: given twice")
        seen.add(hf)
        host = np.asarray(array)
        if not np.issubdtype(host.dtype, np.floating) and host.dtype.kind != "V":  # V: ml_dtypes bf16 via numpy
            raise WeightUpdateError(f"{raw}: dtype {host.dtype}; weights must be floating point")
        parts = tensor_parts(table[hf])
        if tuple(host.shape) != tuple(parts[0].hf_shape):
            raise WeightUpdateError(f"{raw}: shape {tuple(host.shape)}, this model's is {tuple(parts[0].hf_shape)}")
        for spec in parts:
            rows = host if spec.rows is None else host[spec.rows[0]:spec.rows[1]]
            value = rows.reshape(spec.stored_shape).transpose(spec.perm)
            path = spec.param_path
            if path not in current:
                raise WeightUpdateError(f"{raw}: maps to {name(path)}, which this engine's model does not hold")
            if is_int8(current[path].dtype):  # quantized as the loader quantizes a float checkpoint
                stacked = 0 if spec.stack else STACKED_AXES.get(path[-1], 0)
                num_in = input_axes(path[-1], value.ndim, stacked)
                q = QuantizedSlices(_ArrayReader(value.astype(np.float32)), num_in, stacked)
                todo = [(path, q, spec.stack), (scale_path(path), q.scales, scale_stack(path[-1], num_in, spec.stack))]
            else:
                todo = [(path, _ArrayReader(value.astype(np.dtype(current[path].dtype))), spec.stack)]
            for p, reader, stack in todo:
                entries.setdefault(p, {})[tuple(i for _, i, _ in stack)] = reader
                levels[p] = tuple((axis, count) for axis, _, count in stack)
    out_readers = {}
    for p, parts in entries.items():
        want = int(np.prod([count for _, count in levels[p]])) if levels[p] else 1
        if len(parts) != want:
            raise WeightUpdateError(f"{name(p)}: stacked from {want} tensors, {len(parts)} given; give all of them")
        reader = assemble(parts, levels[p])
        _check(p, current[p], reader.shape, current[p].dtype)
        out_readers[p] = reader
    return {p: place_like(current[p], r.read, r.shape) for p, r in out_readers.items()}


# ---------------------------------------------------------------------------- the swap
def swap(runner, new: dict) -> int:
    """The runner's params with `new` (path -> placed array) in place of the old, whose
    buffers are deleted (unless a caller handed the same array back). Returns bytes freed
    on this process's devices."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(runner.state)
    old = [leaf for _, leaf in pairs]
    jax.block_until_ready(runner.kv_cache)  # a step still running reads the old params
    leaves = [new.get(leaf_path(kp), leaf) for kp, leaf in pairs]
    runner.state = jax.tree_util.tree_unflatten(treedef, leaves)
    kept = {id(x) for x in leaves}
    freed = 0
    for a in old:
        if id(a) not in kept and isinstance(a, jax.Array) and not a.is_deleted():
            freed += device_bytes(a)
            a.delete()
    return freed


def device_bytes(a) -> int:
    """Bytes this process's devices hold of one array."""
    if not isinstance(a, jax.Array) or a.is_deleted():
        return 0
    return int(sum(s.data.nbytes for s in a.addressable_shards))


def flush_kv(scheduler, offload) -> None:
    """Every K/V computed with the old weights dropped: the device prefix cache of every
    replica (and hybrids' state snapshots), the host tier's blocks and the disk tier's
    files, whose fingerprint changes so the old files are never read as the new weights'.
    Call with no request running (their pages would hold old K/V)."""
    scheduler.recompute_all()
    if offload is not None:
        clear_tier(offload)


def clear_tier(offload) -> None:
    """[every process] The host (and disk) tier emptied; saves in flight land first
    (multi-process: at this point of the stream on every process, so the tiers stay equal)."""
    offload.drop_queued()
    if offload.lockstep:
        offload.sync()
    else:
        offload.flush()
    offload.tier.clear()
    if offload.tier.disk is not None:
        offload.tier.disk.clear()
