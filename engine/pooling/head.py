"""The LM head applied to pooled hidden states, for a CausalLM reranker's yes/no logits.

Module level, built once; the state is an argument. Rows are padded to a power of two so a
few programs serve every number of documents.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx


@functools.partial(jax.jit, static_argnums=0)
def _head(graphdef: nnx.GraphDef, state: nnx.State,
          hidden: jax.Array,  # [n, E] f32 final-norm hidden states
          ) -> jax.Array:  # [n, V] f32 logits
    model = nnx.merge(graphdef, state)
    return model.head(hidden.astype(model.config.jnp_dtype))


def head_logits(runner, hidden: np.ndarray,  # [n, E] f32
                token_ids: tuple[int, ...]) -> np.ndarray:  # [n, len(token_ids)] f32
    """The logits of `token_ids` for each row, as the engine's step would compute them."""
    n = hidden.shape[0]
    size = 1 << max(n - 1, 0).bit_length()
    padded = np.zeros((size, hidden.shape[1]), np.float32)
    padded[:n] = hidden
    with runner.mesh_context():
        logits = _head(runner.graphdef, runner.state, padded)
    return np.asarray(jax.device_get(logits[:n][:, np.asarray(token_ids)]), np.float32)
