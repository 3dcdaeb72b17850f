"""Heads applied to pooled hidden states: the LM head for a CausalLM reranker's yes/no
logits, a sequence-classification head's `score` for its labels.

Module level, built once; the state is an argument. Rows are padded to a power of two so a
few programs serve every number of documents.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@functools.partial(jax.jit, static_argnums=0)
def _head(graphdef: nnx.GraphDef, state: nnx.State,
          hidden: jax.Array,  # [n, E] f32 final-norm hidden states
          ) -> jax.Array:  # [n, V] f32 logits
    model = nnx.merge(graphdef, state)
    return model.head(hidden.astype(model.config.jnp_dtype))


@functools.partial(jax.jit, static_argnums=0)
def _classify(graphdef: nnx.GraphDef, state: nnx.State,
              hidden: jax.Array,  # [n, E] f32 final-norm hidden states of the last tokens
              ) -> jax.Array:  # [n, num_labels] f32
    model = nnx.merge(graphdef, state)
    return (hidden.astype(model.config.jnp_dtype) @ model.score[...]).astype(jnp.float32)


def _padded(hidden: np.ndarray) -> np.ndarray:  # [n, E] -> [2^k >= n, E]: a few programs for every n
    size = 1 << max(hidden.shape[0] - 1, 0).bit_length()
    padded = np.zeros((size, hidden.shape[1]), np.float32)
    padded[:hidden.shape[0]] = hidden
    return padded


def head_logits(runner, hidden: np.ndarray,  # [n, E] f32
                token_ids: tuple[int, ...]) -> np.ndarray:  # [n, len(token_ids)] f32
    """The logits of `token_ids` for each row, as the engine's step would compute them."""
    with runner.mesh_context():
        logits = _head(runner.graphdef, runner.state, _padded(hidden))
    return np.asarray(jax.device_get(logits[:hidden.shape[0]][:, np.asarray(token_ids)]), np.float32)


def label_logits(runner, hidden: np.ndarray,  # [n, E] f32
                 ) -> np.ndarray:  # [n, num_labels] f32
    """A sequence-classification head's logits for each row."""
    with runner.mesh_context():
        logits = _classify(runner.graphdef, runner.state, _padded(hidden))
    return np.asarray(jax.device_get(logits[:hidden.shape[0]]), np.float32)
