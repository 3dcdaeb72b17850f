"""Pass-KV ring == pass-Q == the float64 oracle, on 4 fake devices, one fresh batch.

`sharded_attention` under mesh.sequence = 4 (and tensor 2 x sequence 2) writes a step of
three fresh sequences (17, 30 and 9 tokens, pages dealt j -> rank j mod N) into a
NaN-filled pool and attends them, once by the ring (nothing cached: `lax.cond` picks it)
and once by pass-Q (ring=None). Both must equal exact causal attention of the rows'
own K/V in float64 (one with a sliding window and soft cap, one with Llama 4's chunks of
8 positions), and both must leave the
pool the same: every live slot holding its row's K/V on the rank the rule names, every
other slot still NaN. This file runs itself as a script in a subprocess (the device
count is fixed when jax starts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from xla_flags import fake_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQS, PAGE, HQ, HKV, D, T = (17, 30, 9), 4, 4, 2, 16, 64


@pytest.mark.slow
def test_ring_and_pass_q_equal_the_oracle():
    env = dict(os.environ, XLA_FLAGS=fake_devices(4), JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.path.dirname(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads([x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])
    assert len(res) == 12  # 2 meshes x 3 windows x 2 modes
    for name, r in res.items():
        assert r["finite"] and r["err"] < 1e-5, (name, r)
        assert r["pages_ok"], (name, r)


def oracle(q, k, v, window=None, cap=None, chunk=None):  # float64 causal attention per sequence
    out = np.zeros(q.shape)
    start = 0
    for n in SEQS:
        for i in range(n):
            lo = 0 if window is None else max(0, i - window + 1)
            lo = lo if chunk is None else i - i % chunk
            for h in range(HQ):
                kh = h // (HQ // HKV)
                sc = k[start + lo:start + i + 1, kh] @ q[start + i, h] * D ** -0.5
                if cap is not None:
                    sc = cap * np.tanh(sc / cap)
                p = np.exp(sc - sc.max())
                out[start + i, h] = (p / p.sum()) @ v[start + lo:start + i + 1, kh]
        start += n
    return out


def main():
    import jax
    import jax.numpy as jnp

    from jaxfill.engine.config import MeshSettings
    from jaxfill.engine.mesh import make_mesh
    from jaxfill.models.parallel.context import sharded_attention
    from jaxfill.models.kv_cache import AttentionMetadata
    from jaxfill.models.parallel.ring_attention import RingSpec
    from jaxfill.pallas_kernels import ragged_paged_attention, write_kv

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((T, h, D)).astype(np.float32) for h in (HQ, HKV, HKV))
    live = sum(SEQS)
    q[live:] = k[live:] = v[live:] = np.nan  # padding rows
    results = {}
    for t, s in ((1, 4), (2, 2)):
        mesh = make_mesh(MeshSettings(tensor=t, sequence=s), devices=jax.devices()[:4])
        per = 24  # pages per rank
        used = [0] * s
        used[0] = 1  # page 0 is the null page
        table = np.zeros((4, 10), np.int32)
        slots = np.full(T, -1, np.int32)
        cu, start = [0], 0
        for i, n in enumerate(SEQS):
            for j in range(-(-n // PAGE)):
                table[i, j] = (j % s) * per + used[j % s]
                used[j % s] += 1
            pos = np.arange(n)
            slots[start:start + n] = table[i, pos // PAGE] * PAGE + pos % PAGE
            start += n
            cu.append(start)
        meta = AttentionMetadata(
            cu_q_lens=jnp.asarray(cu + [start], jnp.int32), kv_lens=jnp.asarray(list(SEQS) + [0], jnp.int32),
            page_indices=jnp.asarray(table), num_seqs=jnp.asarray([3], jnp.int32),
            slot_mapping=jnp.asarray(slots), logits_indices=jnp.zeros(4, jnp.int32))
        for window, cap, chunk in ((None, None, None), (7, 20.0, None), (None, None, 8)):
            def attend(q, k, v, pages, meta, _, share):
                pages = write_kv(pages, k, v, meta.slot_mapping)
                return ragged_paged_attention(q, pages, meta.kv_lens, meta.page_indices, meta.cu_q_lens,
                                              meta.num_seqs, sm_scale=D ** -0.5, sliding_window=window,
                                              attention_chunk=chunk, soft_cap=cap, **share), pages

            pages = np.full((s * per, PAGE, 2 * HKV, D), np.nan, np.float32)
            want = oracle(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), window, cap, chunk)
            for mode, ring in (("ring", RingSpec(D ** -0.5, cap, window, chunk)), ("pass_q", None)):
                with jax.set_mesh(mesh):
                    fn = jax.jit(lambda q, k, v, p, m: sharded_attention(attend, q, k, v, p, m, ring=ring))
                    out, new = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pages), meta)
                out, new = np.asarray(out)[:live], np.asarray(new).reshape(-1, 2 * HKV, D)
                kv = np.stack([k, v], axis=2).reshape(T, 2 * HKV, D)
                written = np.zeros(len(new), bool)
                written[slots[:live]] = True
                pages_ok = bool(np.array_equal(new[slots[:live]], kv[:live]) and np.isnan(new[~written]).all())
                results[f"t{t}s{s}/w{window}c{chunk}/{mode}"] = {
                    "err": float(np.abs(out - want[:live]).max() / np.abs(want[:live]).max()),
                    "finite": bool(np.isfinite(out).all()), "pages_ok": pages_ok}
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
