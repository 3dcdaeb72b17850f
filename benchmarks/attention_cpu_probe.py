"""Where the CPU attention kernel's time goes: the same flash loop stripped down, step by step.

    taskset -c 1 python benchmarks/attention_cpu_probe.py

One KV head (4 q heads stacked: 1024 rows x 256 keys per step, the xla impl's tiles at
2048 tokens), 36 KV steps = the causal block count at 2048 tokens, contiguous K/V, f32.
Prints process CPU ms (min of 12; pin to one core) for: only the two matmuls; plus the
online softmax with the polynomial exp2; the same split into 8 items like the kernel;
and the real kernel (`impl="xla"`, paged, shuffled pages) on the same shape.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxfill.pallas_kernels.ragged_paged_attention.xla import exp2, ragged_paged_attention_xla

R, BK, D, N, NB, SEQ, PAGE = 1024, 256, 64, 36, 8, 2048, 16


def cpu_ms(fn, *args, n=12) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(n):
        c = time.process_time()
        fn(*args).block_until_ready()
        times.append(time.process_time() - c)
    return min(times) * 1e3


def softmax_step(q, k, v, carry):  # q [1, R, D], k/v [1, BK, D]
    m, l, acc = carry
    sc = jnp.einsum("hrd,hkd->hrk", q, k)
    m_new = jnp.maximum(m, sc.max(-1))
    alpha, p = exp2(m - m_new), exp2(sc - m_new[..., None])
    return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + jnp.einsum("hrk,hkd->hrd", p, v)


def init():
    return jnp.full((1, R), -1e30), jnp.zeros((1, R)), jnp.zeros((1, R, D))


@jax.jit
def matmuls_only(q, kk, vv):  # kk/vv [N, 1, BK, D]
    def body(j, acc):
        return acc + jnp.einsum("hrk,hkd->hrd", jnp.einsum("hrd,hkd->hrk", q, kk[j]), vv[j])
    return jax.lax.fori_loop(0, N, body, jnp.zeros((1, R, D)))


@jax.jit
def with_softmax(q, kk, vv):
    return jax.lax.fori_loop(0, N, lambda j, c: softmax_step(q, kk[j], vv[j], c), init())[2]


@jax.jit
def as_items(q, kk, vv):
    def item(b, out):
        c = jax.lax.fori_loop(0, b + 1, lambda j, c: softmax_step(q, kk[j], vv[j], c), init())
        return out.at[b].set(c[2] / c[1][..., None])
    return jax.lax.fori_loop(0, NB, item, jnp.zeros((NB, 1, R, D)))


def main() -> None:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, R, D), np.float32))
    kk = jnp.asarray(rng.standard_normal((N, 1, BK, D), np.float32))
    vv = jnp.asarray(rng.standard_normal((N, 1, BK, D), np.float32))
    print(f"matmuls only        {cpu_ms(matmuls_only, q, kk, vv):6.1f} ms")
    print(f"+ online softmax    {cpu_ms(with_softmax, q, kk, vv):6.1f} ms")
    print(f"+ 8 items           {cpu_ms(as_items, q, kk, vv):6.1f} ms")
    qt = jnp.asarray(rng.standard_normal((SEQ, 4, D), np.float32))
    pages = jnp.asarray(rng.standard_normal((SEQ // PAGE, PAGE, 2, D), np.float32))
    meta = (jnp.asarray([SEQ], jnp.int32), jnp.asarray(rng.permutation(SEQ // PAGE)[None].astype(np.int32)),
            jnp.asarray([0, SEQ], jnp.int32), jnp.asarray([1], jnp.int32))
    kernel = jax.jit(lambda q, p, *m: ragged_paged_attention_xla(q, p, *m, sm_scale=D ** -0.5))
    print(f"xla impl (paged)    {cpu_ms(kernel, qt, pages, *meta):6.1f} ms")


if __name__ == "__main__":
    main()
