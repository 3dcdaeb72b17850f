"""The decoder of every dense family (models/families/) as a functional Flax NNX module.

    logits, kv_cache = model(tokens, positions, kv_cache, meta)

The cache goes in and comes out; logits come only for `meta.logits_indices`, one row per
sequence, because computing [T, vocab] for a long prompt would cost more than a layer.

`stages` > 1 builds the pipelined layout (models/parallel/pipeline.py): the same weights as the
plain model (the same init draws), regrouped into L / stages modules stacked per stage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.models.attention import Attention
from jaxfill.models.config import ModelConfig
from jaxfill.models.gated_deltanet import GatedDeltaNet
from jaxfill.models.kv_cache import AttentionMetadata, KVCache
from jaxfill.models.layers import MLP, Embed, GatedMLP, RMSNorm, param
from jaxfill.models.mamba2 import Mamba2
from jaxfill.models.mla import LatentAttention
from jaxfill.models.moe import MoE, is_moe_layer
from jaxfill.models.parallel.pipeline import pipeline_layers, run_layers, stack_layers
from jaxfill.models.sharding import constrain, rows_split_over_sequence


LINEAR_MIXERS = {"gated_deltanet": GatedDeltaNet, "mamba2": Mamba2}  # by config.linear_kind


def mixer(c: ModelConfig, rngs: nnx.Rngs, index: int):
    """Layer `index`'s mixer (attention, latent attention or a linear rule), None in an
    MLP-only layer."""
    if index in c.no_mixer_layers:
        return None
    if index in c.linear_layers:
        return LINEAR_MIXERS[c.linear_kind](c, rngs)
    return LatentAttention(c, rngs) if c.kv_lora_rank else Attention(c, rngs)


def mlp(c: ModelConfig, rngs: nnx.Rngs, index: int):
    """Layer `index`'s MLP (a mixture of experts in a MoE model's sparse layers), None in
    a mixer-only layer."""
    if index in c.no_mlp_layers:
        return None
    if is_moe_layer(c, index):
        return MoE(c, rngs)
    dense = GatedMLP if c.mlp_gated else MLP
    return dense(c.hidden_size, c.intermediate_size, c.jnp_dtype, rngs, c.weight_dtype, c.hidden_act)


class DecoderLayer(nnx.Module):
    """Mixer (attention) and MLP blocks with their norms where config.norm_layout puts
    them: before each block (pre), before and after (sandwich), or after only (post). A
    single-block layer (Nemotron-H's) has the one block and its norms only."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, index: int = 0):
        c, dt = config, config.jnp_dtype
        has_mixer, has_mlp = index not in c.no_mixer_layers, index not in c.no_mlp_layers

        def norm(present: bool, placed: bool):
            return RMSNorm(c.hidden_size, c.rms_norm_eps, dt, rngs, kind=c.norm_kind) if present and placed else None

        self.attn_norm = norm(has_mixer, c.norm_layout != "post")
        self.attn = mixer(c, rngs, index)
        self.attn_post_norm = norm(has_mixer, c.norm_layout != "pre")
        self.mlp_norm = norm(has_mlp, c.norm_layout != "post")
        self.mlp = mlp(c, rngs, index)
        self.mlp_post_norm = norm(has_mlp, c.norm_layout != "pre")
        self.residual_scale = c.residual_scale

    def __call__(self,
                 x: jax.Array,  # [T, E]
                 positions: jax.Array,  # [T] int32
                 pages,  # this layer's KV pages
                 meta: AttentionMetadata,
                 impl: str,
                 layer,  # the layer's number (models/layer_settings.py)
                 sampled_only: bool = False,
                 ):  # ([T, E] or [S, E], pages, expert token counts [experts] int32 or None)
        if self.attn is not None:
            h, pages = self.attn(_maybe(self.attn_norm, x), positions, pages, meta, impl, layer, sampled_only)
        if sampled_only:  # only the sampled rows go on (see Attention)
            x = jnp.take(x, meta.logits_indices, axis=0)
        if self.attn is not None:
            x = x + self._scaled(_maybe(self.attn_post_norm, h))
        if self.mlp is None:
            return x, pages, None
        h, counts = _maybe(self.mlp_norm, x), None
        if isinstance(self.mlp, MoE):
            valid = meta.slot_mapping >= 0  # real token rows: padding is computed, never counted
            if sampled_only:
                valid = (jnp.take(valid, meta.logits_indices) & (jnp.arange(x.shape[0]) < meta.num_seqs[0]))
            h, counts = self.mlp(h, valid)
        else:
            h = self.mlp(h)
        h = _maybe(self.mlp_post_norm, h)
        return x + self._scaled(h), pages, counts

    def _scaled(self, h):
        return h if self.residual_scale == 1.0 else h * jnp.asarray(self.residual_scale, h.dtype)


def _maybe(norm, x):
    return x if norm is None else norm(x)


def prunes_last_layer(layer_groups: int, rows_split: bool) -> bool:
    """The one rule for running the last layer on the sampled rows only: the unrolled
    layout (scan and pipeline stages stack the last layer with the others) and rows not
    split over 'sequence'. The planner counts FLOPs with the same rule."""
    return layer_groups == 1 and not rows_split


class Decoder(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs | None = None,
                 attention_impl: str = "auto", stages: int = 1, microbatches: int = 1):
        rngs = rngs or nnx.Rngs(config.seed)
        dt = config.jnp_dtype
        self.config = config
        self.attention_impl = attention_impl
        self.stages, self.microbatches = stages, microbatches
        self.embed = Embed(config.vocab_size, config.hidden_size, dt, rngs)
        layers = [DecoderLayer(config, rngs, n) for n in range(config.num_layers)]
        self.layers = nnx.List(stack_layers(layers, stages) if stages > 1 else layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt, rngs, kind=config.norm_kind)
        if not config.tie_word_embeddings:
            self.lm_head = param(rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), dt)

    def staged(self, stages: int, microbatches: int) -> "Decoder":
        """This model's weights in the pipelined layout (a loaded checkpoint, say)."""
        if self.stages != 1:
            raise ValueError(f"the model is already split into {self.stages} stages")
        graphdef, state = nnx.split(self)
        model = nnx.merge(graphdef, state)  # a copy to regroup; self keeps its layers
        model.layers = nnx.List(stack_layers(list(model.layers), stages))
        model.stages, model.microbatches = stages, microbatches
        return model

    def __call__(self,
                 tokens: jax.Array,  # [T] int32
                 positions: jax.Array,  # [T] int32
                 kv_cache: KVCache,
                 meta: AttentionMetadata,
                 ) -> tuple[jax.Array, KVCache]:  # logits [S, vocab] float32
        if kv_cache.stages != self.stages:
            raise ValueError(f"the cache is laid out for {kv_cache.stages} stage(s), the model for {self.stages}")
        x = self.embed(tokens)
        if self.config.embed_scale != 1.0:
            x = x * jnp.asarray(self.config.embed_scale, x.dtype)
        if self.stages > 1:
            x, new_pages, counts = pipeline_layers(self.layers, x, positions, kv_cache.pages, meta,
                                                   self.attention_impl, self.microbatches)
        else:
            # The last layer's rows other than the sampled ones feed nothing (their K/V
            # come from the layer's input), so it runs only those, unless the rows are
            # split over 'sequence' or the caller asks for more rows than one per
            # sequence (every-row logits, as training and evaluation read them).
            one_row_per_seq = meta.logits_indices.shape[0] == meta.kv_lens.shape[0]
            prune = one_row_per_seq and prunes_last_layer(self.stages, rows_split_over_sequence())
            x, new_pages, counts = run_layers(self.layers, x, positions, kv_cache.pages, meta,
                                              self.attention_impl, prune)
            if not prune:
                x = jnp.take(x, meta.logits_indices, axis=0)
        x = self.norm(constrain(x, ("seqs", "act_embed")))  # [S, E]
        if self.config.tie_word_embeddings:
            logits = self.embed.attend(x)
        else:
            logits = constrain(x @ self.lm_head[...], ("seqs", "act_vocab"))  # vocab-parallel
        return final_logits(self.config, logits), kv_cache.updated(new_pages, counts)


def final_logits(config: ModelConfig, logits: jax.Array) -> jax.Array:  # [S, V] -> [S, V] f32
    """Granite's logits scale, then Gemma 2's soft cap, in f32."""
    logits = logits.astype(jnp.float32)
    if config.logits_scale != 1.0:
        logits = logits * config.logits_scale
    if config.final_soft_cap is not None:
        logits = config.final_soft_cap * jnp.tanh(logits / config.final_soft_cap)
    return logits
