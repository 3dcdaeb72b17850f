"""The chunked gated delta rule with its sequential part as a Pallas TPU kernel.

The WY/UT form (pallas_kernels/gated_delta_rule.py) splits into work every chunk does on
its own, which XLA does for all chunks at once (`_prepare`: the cumulative decay, the UT
inverse, U, W, the masked q k^T), and the recurrence between chunks, which the shared
driver (pallas_kernels/ragged_scan_tpu.py) runs in VMEM. Per chunk, with S the [K, V] state:

    new_v = U - W S,   o = (exp(G) q) S + (q k^T * L) new_v,   S = exp(G_C) S + k_out^T new_v

`auto` keeps the XLA loop until a TPU measurement says otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfill.pallas_kernels.gated_delta_rule import token_step, unit_lower_inverse
from jaxfill.pallas_kernels.ragged_scan_tpu import matmul, scan_chunks_tpu


def _prepare(q, k, v, g, beta):  # [N, C, H, ...] f32 each -> per chunk, heads second: [N, H, ...]
    """Every chunk's state-free terms at once."""
    c = q.shape[1]
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # [N, H, C, .]
    g, beta = g.transpose(0, 2, 1), beta.transpose(0, 2, 1)  # [N, H, C]
    big_g = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, big_g[..., :, None] - big_g[..., None, :], 0.0)), 0.0)
    kk = jnp.einsum("nhik,nhjk->nhij", k, k) * decay * beta[..., None]
    t = unit_lower_inverse(jnp.where(jnp.tril(lower, -1), kk, 0.0))
    u = jnp.einsum("nhij,nhjv->nhiv", t, v * beta[..., None])
    w = jnp.einsum("nhij,nhjk->nhik", t, k * (beta * jnp.exp(big_g))[..., None])
    qk = jnp.einsum("nhik,nhjk->nhij", q, k) * decay
    qg = q * jnp.exp(big_g)[..., None]
    last = big_g[..., -1:]  # [N, H, 1]
    k_out_t = (k * jnp.exp(last - big_g)[..., None]).transpose(0, 1, 3, 2)  # [N, H, K, C]
    return u, w, qk, qg, k_out_t, jnp.exp(last)[..., None]  # the last: [N, H, 1, 1]


def _step(s, u, w, qk, qg, k_out_t, dec):  # S [K, V] f32; one (chunk, head) block of each of _prepare's
    new_v = u - matmul(w, s)
    return matmul(qg, s) + matmul(qk, new_v), s * dec + matmul(k_out_t, new_v)


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"))
def gated_delta_rule_tpu(q: jax.Array,  # [T, H, K]
                         k: jax.Array,  # [T, H, K]
                         v: jax.Array,  # [T, H, V]
                         g: jax.Array,  # [T, H] log decay (<= 0)
                         beta: jax.Array,  # [T, H]
                         cu_q_lens: jax.Array,  # [S+1] int32
                         num_seqs: jax.Array,  # [1] int32
                         states: jax.Array,  # [S, H, K, V] f32
                         chunk: int = 64,
                         interpret=None,  # None: the TPU interpreter off TPU; False; or InterpretParams
                         ) -> tuple[jax.Array, jax.Array]:  # o [T, H, V], states [S, H, K, V]
    o, states = scan_chunks_tpu(token_step, _prepare, _step, (q, k, v, g, beta), cu_q_lens, num_seqs, states, chunk,
                                interpret)
    return o.astype(v.dtype), states
