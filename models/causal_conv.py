"""The short causal depthwise convolution of the linear layers (Gated DeltaNet's over q, k,
v; Mamba2's over x, B, C) over the flat ragged token array: each sequence's first rows
read the inputs before them from its history (its slot's last K-1 inputs), so a prefill
cut into chunks, or a decode, convolves exactly what the whole sequence would."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv(x: jax.Array,  # [T, C]
                weight: jax.Array,  # [C, K]
                history: jax.Array,  # [S, C, K-1] each batch sequence's last K-1 inputs (zeros if fresh)
                cu_q_lens: jax.Array,  # [S+1] int32
                seq: jax.Array,  # [T] int32 (token_sequences; -1 padding)
                bias: jax.Array | None = None,  # [C]
                ) -> tuple[jax.Array, jax.Array]:  # y [T, C] (before the activation), history [S, C, K-1]
    """y_t = bias + sum_i weight[:, i] * input_{t - (K-1) + i}, where inputs before a
    sequence's first new row come from its history; returns each sequence's new last K-1
    inputs. Summed in f32, rounded to x's dtype once."""
    t, k = x.shape[0], weight.shape[1]
    sc = jnp.clip(seq, 0)
    start = cu_q_lens[sc]  # [T]
    rows = jnp.arange(t)

    def tap(src, s, start):  # the input at row `src` of sequence s (history when before `start`)
        back = start - src  # >= 1: that many rows before the sequence's first new row
        hist = history[s, :, jnp.clip(k - 1 - back, 0, k - 2)]  # [.., C]
        return jnp.where((back >= 1)[..., None], hist, x[jnp.clip(src, 0, t - 1)])

    y = sum(weight[:, i].astype(jnp.float32) * tap(rows - (k - 1) + i, sc, start).astype(jnp.float32)
            for i in range(k))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    s = history.shape[0]
    ends = cu_q_lens[1:]  # [S]
    cols = ends[:, None] - (k - 1) + jnp.arange(k - 1)[None, :]  # [S, K-1] rows of the new history
    new = tap(cols, jnp.arange(s)[:, None], cu_q_lens[:-1][:, None])  # [S, K-1, C]
    return y.astype(x.dtype), new.transpose(0, 2, 1)
