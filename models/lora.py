"""Multi-LoRA inside the step: per projection, a slot table of adapters that is data.

For a targeted projection y = x W (W [in..., out...]) each layer module holds, in its
`lora` child (a LoraTables), two stacked params

    A [L, in..., R]   B [L, R, out...]     L = lora.max_loras slots, R = lora.max_lora_rank

with the adapter's scaling (alpha / r, or alpha / sqrt(r) with rslora) folded into B and
ranks below R padded with zeros. A row of the step names its slot in
`meta.lora_slots` [T]: 0 = no adapter, s = table row s - 1. The delta is one dense
formulation, no gathers and no sort:

    xa   = einsum(x, A)            [T, L, R]   every slot's down-projection
    xa  *= onehot(slot)            [T, L, 1]   keep the row's own slot (none for slot 0)
    y   += einsum(xa, B)           [T, out...]

which costs two projections of width L * R (max_loras 8 x rank 16 = 128 columns: ~5% more
projection FLOPs at Llama-3-8B's shape) whenever any row of the step has an adapter, however
many adapters it uses; a step of base rows only skips them (a lax.cond). Writing an adapter into a slot replaces arrays of the same shape and
sharding, so the step never recompiles (engine/lora/slots.py). A and B carry the base
weight's logical axes: under mesh.tensor a column-parallel projection (q, k, v, gate, up)
keeps A whole and splits B's output like W; a row-parallel one (o, down) splits A's
input like W and keeps B whole, the partial [T, L, R] sums reduced by XLA.

Modules without a `lora` child (LoRA not configured) run exactly as before: the step
program does not change (`meta.lora_slots` is None then too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# projection -> (PEFT module name, the module kind holding it: "attn" | "mlp")
PROJECTIONS = {"q": ("q_proj", "attn"), "k": ("k_proj", "attn"), "v": ("v_proj", "attn"),
               "o": ("o_proj", "attn"), "gate": ("gate_proj", "mlp"), "up": ("up_proj", "mlp"),
               "down": ("down_proj", "mlp")}
PEFT_NAMES = {peft: ours for ours, (peft, _) in PROJECTIONS.items()}
# the base weight's einsum layout: how many leading dims of W are its input
NUM_IN = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


def _axes_of(weight: nnx.Variable) -> tuple:
    meta = weight.get_metadata()
    return tuple(meta.get("out_sharding") or (None,) * weight.ndim)


class LoraTables(nnx.Module):
    """A [L, in..., R] and B [L, R, out...] per projection of one module, zeros (no adapter
    anywhere) until engine/lora/slots.py writes a slot."""

    def __init__(self, module: nnx.Module, names: tuple[str, ...], max_loras: int, rank: int):
        self.names = tuple(names)
        for name in names:
            w = getattr(module, name)
            n_in = NUM_IN[name]
            axes = _axes_of(w)
            shape_in, shape_out = w.shape[:n_in], w.shape[n_in:]
            dt = w.dtype if jnp.issubdtype(w.dtype, jnp.floating) else jnp.float32
            setattr(self, name + "_a", nnx.Param(jnp.zeros((max_loras, *shape_in, rank), dt),
                                                 out_sharding=(None, *axes[:n_in], None), eager_sharding=False))
            setattr(self, name + "_b", nnx.Param(jnp.zeros((max_loras, rank, *shape_out), dt),
                                                 out_sharding=(None, None, *axes[n_in:]), eager_sharding=False))

    def delta(self, name: str,
              x: jax.Array,  # [T, in...]
              slots: jax.Array,  # [T] i32: 0 = none, s = table row s - 1
              ) -> jax.Array:  # [T, out...]
        a, b = getattr(self, name + "_a")[...], getattr(self, name + "_b")[...]
        n_in = a.ndim - 2
        letters = "ijk"[:n_in]
        out = "pqr"[:b.ndim - 2]

        def delta():
            xa = jnp.einsum(f"t{letters},l{letters}z->tlz", x.astype(a.dtype), a)  # [T, L, R]
            hit = slots[:, None] == jnp.arange(1, a.shape[0] + 1, dtype=slots.dtype)[None, :]  # [T, L]
            xa = xa * hit[:, :, None].astype(xa.dtype)
            return jnp.einsum(f"tlz,lz{out}->t{out}", xa, b).astype(x.dtype)

        # a batch of base rows only skips the two matmuls (their delta is an exact zero anyway)
        shape = x.shape[:1] + b.shape[2:]
        return jax.lax.cond(jnp.any(slots > 0), delta, lambda: jnp.zeros(shape, x.dtype))


def add_delta(module: nnx.Module, name: str,
              x: jax.Array,  # [T, in...] the projection's input rows
              y: jax.Array,  # [T, out...] its output
              slots: jax.Array | None,  # [T] i32 or None (LoRA off)
              ) -> jax.Array:  # [T, out...]
    """y plus the rows' adapters' delta of projection `name`, or y itself when the module
    has no tables for it (LoRA not configured, or not a target)."""
    tables = getattr(module, "lora", None)
    if tables is None or slots is None or name not in tables.names:
        return y
    return y + tables.delta(name, x, slots)


class ExpertLoraTables(nnx.Module):
    """A MoE layer's routed experts (models/moe.py): per projection, A [E, in, L, R] and
    B [E, L, R, out...], expert-major so the grouped matmul takes them as [E, in, L * R] and
    [E, L * R, out] with no copy; the slot axis is 2 of A and 1 of B (engine/lora/slots.py)."""

    def __init__(self, moe: nnx.Module, max_loras: int, rank: int):
        for name in ("gate_up", "down"):
            w = getattr(moe, "experts_" + name)
            axes = _axes_of(w)  # gate_up [E, H, 2, I], down [E, I, H]
            e, d_in, out = w.shape[0], w.shape[1], w.shape[2:]
            setattr(self, name + "_a", nnx.Param(jnp.zeros((e, d_in, max_loras, rank), w.dtype),
                                                 out_sharding=(axes[0], axes[1], None, None), eager_sharding=False))
            setattr(self, name + "_b", nnx.Param(jnp.zeros((e, max_loras, rank, *out), w.dtype),
                                                 out_sharding=(axes[0], None, None, *axes[2:]), eager_sharding=False))

    def params(self) -> dict:  # the tables as grouped_experts takes them beside the experts' params
        return {f"lora_{n}_{h}": getattr(self, f"{n}_{h}")[...] for n in ("gate_up", "down") for h in "ab"}


EXPERT_TABLE_AXES = {"lora_gate_up_a": ("experts", "embed", None, None),
                     "lora_gate_up_b": ("experts", None, None, None, "moe_mlp"),
                     "lora_down_a": ("experts", "moe_mlp", None, None), "lora_down_b": ("experts", None, None, "embed")}


def grouped_delta(rows: jax.Array,  # [N, in] rows sorted by expert
                  a: jax.Array,  # [E, in, L, R]
                  b: jax.Array,  # [E, L, R, out...]
                  slots: jax.Array,  # [N] i32 each row's slot (0 = none)
                  sizes: jax.Array,  # [E] i32 rows per expert
                  matmul) -> jax.Array:  # [N, prod(out)]
    """The routed experts' LoRA delta: two grouped matmuls of width L * R, each row keeping
    its own slot's columns between them (models/grouped_matmul.py does the grouping)."""
    e, d_in, lo, r = a.shape
    xa = matmul(rows, a.reshape(e, d_in, lo * r).astype(rows.dtype), sizes).reshape(-1, lo, r)  # [N, L, R]
    hit = slots[:, None] == jnp.arange(1, lo + 1, dtype=slots.dtype)[None, :]
    xa = (xa * hit[:, :, None].astype(xa.dtype)).reshape(-1, lo * r)
    return matmul(xa, b.reshape(e, lo * r, -1).astype(rows.dtype), sizes)


def attach_tables(model: nnx.Module, max_loras: int, rank: int) -> nnx.Module:
    """A copy of `model` whose attention and gated-MLP modules hold zero LoraTables for
    every projection of PROJECTIONS they have (the caller's model is left as it was:
    tests share one). engine/lora/settings.py refuses the models this does not cover."""
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, state)
    for layer in model.layers:
        for kind in ("attn", "mlp"):
            module = getattr(layer, kind, None)
            names = tuple(n for n, (_, k) in PROJECTIONS.items()
                          if k == kind and getattr(module, n, None) is not None)
            if module is not None and names:
                module.lora = LoraTables(module, names, max_loras, rank)
            elif kind == "mlp" and getattr(module, "experts_gate_up", None) is not None:
                module.lora = ExpertLoraTables(module, max_loras, rank)
    return model


def table_leaves(state) -> dict[tuple[int, str], tuple]:
    """(layer, projection) -> (A variable, B variable) in a split model's state; a MoE
    layer's experts are "experts_gate_up" and "experts_down"."""
    out = {}
    for i, layer in state["layers"].items():
        for kind in ("attn", "mlp"):
            if kind in layer and "lora" in layer[kind]:
                tables = layer[kind]["lora"]
                for name in (*PROJECTIONS, "gate_up"):
                    if name + "_a" in tables:
                        key = "experts_" + name if "gate_up_a" in tables else name  # a MoE layer's experts
                        out[(int(i), key)] = (tables[name + "_a"], tables[name + "_b"])
    return out


def slot_axes(name: str) -> tuple[int, int]:
    """The slot axis of a projection's (A, B) tables."""
    return (2, 1) if name.startswith("experts_") else (0, 0)


def is_table_path(path: tuple) -> bool:
    """A param path of the LoRA tables: engine state, not checkpoint weights (a weight
    update or a checkpoint reload at wake leaves them as they are)."""
    return "lora" in path
