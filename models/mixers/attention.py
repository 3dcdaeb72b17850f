"""One attention block: qkv -> rope -> KV write into pages -> ragged paged attention -> out."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.models.config import ModelConfig
from jaxfill.models.kv_cache import sampled_rows_metadata
from jaxfill.models.layer_settings import by_window, layer_settings
from jaxfill.models.layers import RMSNorm, param, projection, unit_rms as weightless_rms  # noqa: F401 (exported)
from jaxfill.models.lora import add_delta
from jaxfill.models.mixers.context import MixerContext
from jaxfill.models.rope import apply_rope
from jaxfill.models.quant import qeinsum
from jaxfill.models.parallel.context import sharded_attention
from jaxfill.models.parallel.ring_attention import RingSpec
from jaxfill.models.sharding import constrain, kv_heads_for
from jaxfill.pallas_kernels import ragged_paged_attention, write_kv


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        """`layer` picks the shapes: a "full" layer of a model with global_head_dim /
        global_kv_heads (Gemma 4) has its own; in a stacked layout all layers share one."""
        c, dt = config, config.jnp_dtype
        (hk, d), e, hq, wd = c.attention_dims(layer), c.hidden_size, c.num_heads, c.weight_form
        # Gemma 4's full layers may take V from the K projection (no v weight); its KV-sharing
        # layers read an earlier layer's pages (no k, v or k norm)
        k_is_v = c.attention.global_k_eq_v and c.attention.layer_window(layer) is None
        shared = c.kv_source(layer) is not None
        # with an output gate (Qwen3.5) q_proj gives each head [q, gate]: 2D columns
        q_cols = 2 * d if c.attention.output_gate else d
        qkv = ("embed", "q_heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        self.q, self.q_scale = projection(rngs, (e, hq, q_cols), qkv[0], dt, 1, wd, name="q")
        self.k, self.k_scale = (None, None) if shared else projection(rngs, (e, hk, d), qkv[1], dt, 1, wd, name="k")
        self.v, self.v_scale = (None, None) if k_is_v or shared else projection(rngs, (e, hk, d), qkv[1], dt, 1, wd,
                                                                                name="v")
        self.o, self.o_scale = projection(rngs, (hq, d, e), ("q_heads", "head_dim", "embed"), dt, 2, wd, name="o")
        if c.attention.gate_proj:  # AFMoE: the output gate from a projection of its own
            self.gate, self.gate_scale = projection(rngs, (e, hq, d), qkv[0], dt, 1, wd, name="gate")
        if c.attention.bias:
            self.q_bias = param(rngs, (hq, d), ("q_heads", "head_dim"), dt)
            self.k_bias = None if shared else param(rngs, (hk, d), ("kv_heads", "head_dim"), dt)
            self.v_bias = None if shared else param(rngs, (hk, d), ("kv_heads", "head_dim"), dt)
        if c.attention.qk_norm == "head":  # over each head's D
            self.q_norm = RMSNorm(d, c.norms.eps, dt, rngs, kind=c.norms.kind, axes=("head_dim",))
            self.k_norm = None if shared else RMSNorm(d, c.norms.eps, dt, rngs, kind=c.norms.kind,
                                                      axes=("head_dim",))
        elif c.attention.qk_norm == "projection":  # over all heads of the projection
            self.q_norm = RMSNorm(d, c.norms.eps, dt, rngs, kind=c.norms.kind, shape=(hq, d),
                                  axes=("q_heads", "head_dim"))
            self.k_norm = RMSNorm(d, c.norms.eps, dt, rngs, kind=c.norms.kind, shape=(hk, d),
                                  axes=("kv_heads", "head_dim"))
        if c.attention.out_bias:
            self.o_bias = param(rngs, (e,), ("embed",), dt)
        # gpt-oss: one learned logit per head in the softmax denominator
        self.sinks = param(rngs, (hq,), ("q_heads",), dt, scale=1.0) if c.attention.sinks else None
        self.config, self.head_dim = c, d
        self.sm_scale = c.attention.query_scale if c.attention.query_scale is not None else d ** -0.5

    def __call__(self,
                 x: jax.Array,  # [T, E]
                 pages: jax.Array,  # [num_pages, page_size, 2 * Hkv, D]
                 ctx: MixerContext,
                 ) -> tuple[jax.Array, jax.Array]:  # [T, E] ([S, E] if ctx.sampled_only), pages
        """K/V of every row go into the pages; queries (and the output) exist only for the
        rows ctx.sampled keeps. The layer's rope and window come from
        models/layer_settings.py by `ctx.layer`."""
        a = self.config.attention
        if a.in_scale != 1.0:  # Falcon-H1's attention_in_multiplier
            x = x * jnp.asarray(a.in_scale, x.dtype)
        q, k, v, gate = self._project(x, ctx)
        if k is None:  # a KV-sharing layer (Gemma 4): no rows to write; zeros stand in for the kernel's k/v
            k = v = jnp.zeros((x.shape[0], jax.tree.leaves(pages)[0].shape[2] // 2, self.head_dim), q.dtype)
        # A cache laid out for more KV heads than the model has (tensor parallel with
        # Hkv < tensor, see models/sharding.py) holds each head repeated r times in a row.
        r = kv_heads_for(pages.shape[2], k.shape[1])
        if r > 1:
            k, v = jnp.repeat(k, r, axis=1), jnp.repeat(v, r, axis=1)
        q = constrain(q, ("tokens", "act_heads", None))
        k = constrain(k, ("tokens", "act_kv_heads", None))
        v = constrain(v, ("tokens", "act_kv_heads", None))
        q_meta = sampled_rows_metadata(ctx.meta) if ctx.sampled_only else ctx.meta
        sinks = None if self.sinks is None else self.sinks[...].astype(jnp.float32)
        out, pages = by_window(layer_settings(self.config), ctx.layer,
                               functools.partial(self._attend_window, q, k, v, pages, q_meta, sinks, ctx.impl))
        if gate is not None:
            out = out * jax.nn.sigmoid(gate).astype(out.dtype)
        out = add_delta(self, "o", out, qeinsum("thd,hde->te", out, self.o[...], self.o_scale),  # all-reduce over tensor
                        _sampled_slots(ctx))
        if a.out_bias:
            out = out + self.o_bias[...]
        if a.out_scale != 1.0:  # Falcon-H1's attention_out_multiplier
            out = out * jnp.asarray(a.out_scale, out.dtype)
        return constrain(out, ("tokens", "act_embed")), pages

    def _project(self, x: jax.Array,  # [T, E]
                 ctx: MixerContext):  # q [T', Hq, D], k, v [T, Hkv, D], gate [T', Hq, D] or None
        """q (T' = the rows ctx.sampled keeps), k and v of every row, biased, normed, roped."""
        a = self.config.attention
        if self.k is None:  # a KV-sharing layer: q alone (rope and norms pass None through)
            k = v = None
        else:
            slots = ctx.meta.lora_slots  # [T] each row's LoRA slot, None without LoRA (models/lora.py)
            k = add_delta(self, "k", x, qeinsum("te,ehd->thd", x, self.k[...], self.k_scale), slots)
            v = k if self.v is None else add_delta(self, "v", x, qeinsum("te,ehd->thd", x, self.v[...], self.v_scale),
                                                    slots)
        xq = ctx.sampled(x)  # [T', E] the rows whose queries are needed
        q = add_delta(self, "q", xq, qeinsum("te,ehd->thd", xq, self.q[...], self.q_scale), _sampled_slots(ctx))
        gate = None
        if a.output_gate:
            q, gate = q[..., :self.head_dim], q[..., self.head_dim:]  # [T, Hq, D] each
        elif a.gate_proj:
            gate = qeinsum("te,ehd->thd", ctx.sampled(x), self.gate[...], self.gate_scale)  # [T', Hq, D]
        if a.bias:
            q = q + self.q_bias[...]
            if k is not None:
                k, v = k + self.k_bias[...], v + self.v_bias[...]
        if a.key_scale != 1.0 and k is not None:  # Falcon-H1's key_multiplier (V = K is not its layout)
            k = k * jnp.asarray(a.key_scale, k.dtype)
        settings = layer_settings(self.config)
        if a.qk_norm != "none" and not a.qk_norm_after_rope:
            q, k = self._norm_qk(q, k, settings, ctx.layer)
        if a.v_norm and v is not None:
            v = weightless_rms(v, self.config.norms.eps)
        if a.qkv_clip is not None:
            q, k, v = (jnp.clip(t, -a.qkv_clip, a.qkv_clip) for t in (q, k, v))
        if not (isinstance(ctx.layer, int) and not settings.has_rope[ctx.layer]):
            inv_freq, scale = settings.rope(ctx.layer)
            rope = functools.partial(apply_rope, inv_freq=inv_freq, scale=scale, interleaved=a.rope_interleave,
                                     in_f32=a.rope_f32)
            turns = ctx.positions if ctx.rope_positions is None else ctx.rope_positions
            q, k = rope(q, ctx.sampled(turns)), _maybe(functools.partial(rope, positions=turns), k)
        if a.qk_norm_after_rope:
            q, k = self._norm_qk(q, k, settings, ctx.layer)
        beta = settings.of_layer(settings.temperature, ctx.layer)
        if a.query_temperature_beta and not (isinstance(ctx.layer, int) and beta == 0):
            positions = ctx.sampled(ctx.positions) + a.query_temperature_offset
            q = q * query_temperature(positions, beta, a.query_temperature_length).astype(q.dtype)[:, None, None]
        return q, k, v, gate

    def _norm_qk(self, q, k, settings, layer):  # q [T', Hq, D], k [T, Hkv, D] -> the same
        """The q/k norms; Llama 4's weightless RMS over each head's D only where the layer
        turns rope (a traced layer selects)."""
        if k is None:  # a KV-sharing layer (Gemma 4; qk_norm "head"): its q alone
            return self.q_norm(q), None
        if self.config.attention.qk_norm != "weightless":
            return self.q_norm(q), self.k_norm(k)
        has_rope = settings.of_layer(settings.has_rope, layer)
        if isinstance(layer, int) and not has_rope:
            return q, k
        eps = self.config.norms.eps
        nq, nk = weightless_rms(q, eps), weightless_rms(k, eps)
        if isinstance(layer, int):
            return nq, nk
        return jnp.where(has_rope, nq, q), jnp.where(has_rope, nk, k)

    def _attend_window(self, q, k, v, pages, meta, sinks, impl: str, window):  # ([T', Hq, D], pages)
        """Attention for one (sliding window, attention chunk) ((None, None): full), over the
        mesh's shares of heads and rows."""
        a = self.config.attention
        ring = RingSpec(self.sm_scale, a.soft_cap, *window) if a.context_attention == "pass_kv" else None
        attend = functools.partial(self._write_and_attend, impl=impl, window=window, write=self.k is not None)
        return sharded_attention(attend, q, k, v, pages, meta, sinks, sinks=sinks is not None, ring=ring)

    def _write_and_attend(self, q, k, v, pages, meta, sinks, share, *, impl: str, window, write: bool = True):
        """One device's view under a mesh: this step's K/V rows into the pages (unless the
        pages are an earlier layer's, `write` False), then the kernel."""
        if write:
            pages = write_kv(pages, k, v, meta.slot_mapping)
        extra = {} if sinks is None else {"sinks": sinks}
        a = self.config.attention
        if meta.key_limits is not None and not (a.image_limits_sliding_only and window[0] is None):
            extra["key_limits"] = meta.key_limits  # image rows attended both ways (models/vision/rows.py)
        out = ragged_paged_attention(
            q, pages, meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs,
            sm_scale=self.sm_scale, sliding_window=window[0], attention_chunk=window[1],
            soft_cap=self.config.attention.soft_cap, impl=impl, **extra, **share)
        return out, pages


def _maybe(f, x):
    return None if x is None else f(x)


def _sampled_slots(ctx: MixerContext):  # [T'] i32 or None: the LoRA slots of the rows ctx.sampled keeps
    return None if ctx.meta.lora_slots is None else ctx.sampled(ctx.meta.lora_slots)


def query_temperature(positions: jax.Array,  # [T] int32 (Llama 4: position + 1)
                      beta, length: int) -> jax.Array:  # [T] f32; beta a float or traced []
    """1 + beta * log(1 + floor(position / length)): Ministral 3's and Llama 4's query scale,
    1 over the first `length` positions, growing by beta * log 2 at the next boundary (f32,
    as transformers computes it before the cast to q's dtype)."""
    return 1.0 + beta * jnp.log(1.0 + jnp.floor(positions.astype(jnp.float32) / length))
