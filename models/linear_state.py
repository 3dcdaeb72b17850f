"""A linear-attention layer's cache entry (models/gated_deltanet.py): per-sequence state in
slots, beside the attention layers' pages in the KVCache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxfill.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearState:
    """One linear layer's per-sequence state, in slots."""

    recurrent: jax.Array  # [slots, Hv, Dk, Dv] f32
    conv: jax.Array  # [slots, conv_dim, kernel - 1] in the model dtype


def conv_dim(c: ModelConfig) -> int:
    return 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim


def init_linear_state(c: ModelConfig, slots: int, fill_value: float = 0.0) -> LinearState:
    hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    return LinearState(jnp.full((slots, hv, dk, dv), fill_value, jnp.float32),
                       jnp.full((slots, conv_dim(c), c.linear_conv_kernel - 1), fill_value, c.jnp_dtype))
