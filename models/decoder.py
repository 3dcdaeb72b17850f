"""The decoder of every dense family (models/families/) as a functional Flax NNX module.

    logits, kv_cache = model(tokens, positions, kv_cache, meta)

The cache goes in and comes out; logits come only for `meta.logits_indices`, one row per
sequence, because computing [T, vocab] for a long prompt would cost more than a layer.

A stacked ExecutionPlan (models/execution_plan.py) builds the pipelined or scanned layout
(models/parallel/pipeline.py): the same weights as the plain model (the same init draws),
regrouped into L / groups modules stacked per group. Each layer's mixer is any of
models/mixers/, called through one protocol (models/mixers/context.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.models.config import ModelConfig
from jaxfill.models.execution_plan import ExecutionPlan
from jaxfill.models.kv_cache import AttentionMetadata, KVCache
from jaxfill.models.layers import MLP, Embed, GatedMLP, RMSNorm, param
from jaxfill.models.mixers import MixerContext, build_mixer
from jaxfill.models.moe import MoE, is_moe_layer
from jaxfill.models.moe_beside_dense import ExpertsBesideDense
from jaxfill.models.mtp import MTPLayer
from jaxfill.models.per_layer_inputs import PerLayerBlock, PerLayerInputs
from jaxfill.models.parallel.pipeline import pipeline_layers, run_layers, stack_layers
from jaxfill.models.rope import mrope_axes, mrope_positions
from jaxfill.models.sharding import constrain, rows_split_over_sequence
from jaxfill.models.vision.rows import VisionRows


def mlp(c: ModelConfig, rngs: nnx.Rngs, index: int):
    """Layer `index`'s MLP (a mixture of experts in a MoE model's sparse layers), None in
    a mixer-only layer."""
    if index in c.no_mlp_layers:
        return None
    if is_moe_layer(c, index):
        return ExpertsBesideDense(c, rngs) if c.moe.beside_dense else MoE(c, rngs)
    wide = 2 if c.double_wide_shared_mlp and c.kv_source(index) is not None else 1  # Gemma 4's KV-sharing layers
    if c.mlp_gated:
        return GatedMLP(c.hidden_size, wide * c.intermediate_size, c.jnp_dtype, rngs, c.weight_form, c.hidden_act,
                        c.mlp_scales)
    return MLP(c.hidden_size, wide * c.intermediate_size, c.jnp_dtype, rngs, c.weight_form, c.hidden_act)


class DecoderLayer(nnx.Module):
    """Mixer and MLP blocks with their norms where config.norms.layout puts
    them: before each block (pre), before and after (sandwich), or after only (post). A
    single-block layer (Nemotron-H's) has the one block and its norms only."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, index: int = 0):
        c, dt = config, config.jnp_dtype
        has_mixer, has_mlp = index not in c.no_mixer_layers, index not in c.no_mlp_layers

        def norm(present: bool, placed: bool):
            return RMSNorm(c.hidden_size, c.norms.eps, dt, rngs, kind=c.norms.kind) if present and placed else None

        self.attn_norm = norm(has_mixer, c.norms.layout != "post")
        self.attn = build_mixer(c, rngs, index)
        self.attn_post_norm = norm(has_mixer, c.norms.layout != "pre")
        # Gemma 4's experts-beside-dense block norms its two branches itself
        self.mlp_norm = norm(has_mlp and not (c.moe.beside_dense and is_moe_layer(c, index)), c.norms.layout != "post")
        self.mlp = mlp(c, rngs, index)
        self.mlp_post_norm = norm(has_mlp, c.norms.layout != "pre")
        self.residual_scale = c.residual_scale
        # Gemma 4: the layer's whole output (residual included) times a learned scalar
        self.layer_scalar = param(rngs, (1,), (None,), dt, init="one_plus_normal", scale=0.1) if c.layer_scalar \
            else None
        self.per_layer = PerLayerBlock(c, rngs) if c.per_layer_input_size else None  # Gemma 4's E models
        self.kv_source = c.kv_source(index)  # the layer whose pages this one reads (models/parallel/pipeline.py)

    def __call__(self,
                 x: jax.Array,  # [T, E]
                 pages,  # this layer's cache entry (KV pages, latent pages, a LinearState or None)
                 ctx: MixerContext,
                 ):  # ([T, E] or [S, E], pages, expert token counts [experts] int32 or None)
        x, pages, counts = self._blocks(x, pages, ctx)
        if self.per_layer is not None:
            x = self.per_layer(x, ctx.sampled(ctx.per_layer_input[:, ctx.layer]))
        if self.layer_scalar is not None:
            x = x * self.layer_scalar[...]
        return x, pages, counts

    def _blocks(self, x, pages, ctx: MixerContext):
        if self.attn is not None:
            h, pages = self.attn(_maybe(self.attn_norm, x), pages, ctx)
        x = ctx.sampled(x)  # with sampled_only, only the sampled rows go on
        if self.attn is not None:
            x = x + self._scaled(_maybe(self.attn_post_norm, h))
        if self.mlp is None:
            return x, pages, None
        h, counts = _maybe(self.mlp_norm, x), None
        if isinstance(self.mlp, (MoE, ExpertsBesideDense)):
            slots = {} if ctx.meta.lora_slots is None else {"lora_slots": ctx.sampled(ctx.meta.lora_slots)}
            h, counts = self.mlp(h, token_rows(x, ctx), **slots)
        elif ctx.meta.lora_slots is not None and isinstance(self.mlp, GatedMLP):  # per-row adapters (models/lora.py)
            h = self.mlp(h, ctx.sampled(ctx.meta.lora_slots))
        else:
            h = self.mlp(h)
        h = _maybe(self.mlp_post_norm, h)
        return x + self._scaled(h), pages, counts

    def _scaled(self, h):
        return h if self.residual_scale == 1.0 else h * jnp.asarray(self.residual_scale, h.dtype)


def token_rows(x: jax.Array,  # [T, E] or [S, E]: the rows the MLP runs on
               ctx: MixerContext) -> jax.Array:  # [T] or [S] bool
    """Which of the rows are real tokens: padding is computed, never counted as expert load."""
    valid = ctx.meta.slot_mapping >= 0
    if ctx.sampled_only:
        valid = ctx.sampled(valid) & (jnp.arange(x.shape[0]) < ctx.meta.num_seqs[0])
    return valid


def _plain(tokens: jax.Array, vision: VisionRows | None) -> jax.Array:  # [T] int32 -> [T] int32
    """The ids Gemma 4's per-layer inputs read: an image row reads the pad id (transformers
    swaps image tokens for it there); the context part reads the image rows' embeddings."""
    if vision is None or vision.images is None or vision.images.pad_id is None:
        return tokens
    return jnp.where(vision.images.mask, vision.images.pad_id, tokens)


def _maybe(norm, x):
    return x if norm is None else norm(x)


class Decoder(nnx.Module):
    layer_class = DecoderLayer  # a layer composition of its own (models/shortcut_decoder.py) overrides it

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs | None = None,
                 attention_impl: str = "auto", plan: ExecutionPlan = ExecutionPlan()):
        """`plan`: the layers' layout (unrolled, or stacked for a scan or pipeline stages)
        and whether the last layer runs on the sampled rows only: the engine's
        ExecutionPlan.of_config, so the model runs what the planner counts."""
        rngs = rngs or nnx.Rngs(config.seed)
        dt = config.jnp_dtype
        self.config = config
        self.attention_impl = attention_impl
        self.plan = plan
        self.embed = Embed(config.vocab_size, config.hidden_size, dt, rngs)
        self.per_layer_inputs = PerLayerInputs(config, rngs) if config.per_layer_input_size else None
        layers = [self.layer_class(config, rngs, n) for n in range(config.num_layers)]
        self.layers = nnx.List(stack_layers(layers, self.stages) if self.stages > 1 else layers)
        self.norm = RMSNorm(config.hidden_size, config.norms.eps, dt, rngs, kind=config.norms.kind)
        if not config.embeddings.tied and config.embeddings.head:
            self.lm_head = param(rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), dt)
        if config.embeddings.head_bias:
            self.lm_head_bias = param(rngs, (config.vocab_size,), ("vocab",), dt)
        if config.pooling.num_labels:  # a sequence-classification head (engine/pooling/head.py)
            self.score = param(rngs, (config.hidden_size, config.pooling.num_labels), ("embed", "labels"), dt)
        if config.run_mtp:  # built last: the target's random-init draws stay what they were
            self.mtp = MTPLayer(config, rngs, self.layer_class)

    def stream_in(self, x: jax.Array) -> jax.Array:  # [T, E] embedded -> what the layers carry
        return x

    def stream_out(self, x: jax.Array) -> jax.Array:  # what the layers carry ([S, ...] rows) -> [S, E]
        return x

    @property
    def stages(self) -> int:
        """Stacked layer groups (1: unrolled); the KV cache is laid out to match."""
        return self.plan.layer_groups

    def staged(self, plan: ExecutionPlan) -> "Decoder":
        """This model's weights in a stacked layout (a loaded checkpoint, say)."""
        if self.stages != 1:
            raise ValueError(f"the model is already split into {self.stages} stages")
        graphdef, state = nnx.split(self)
        model = nnx.merge(graphdef, state)  # a copy to regroup; self keeps its layers
        model.layers = nnx.List(stack_layers(list(model.layers), plan.layer_groups))
        model.plan = plan
        return model

    def __call__(self,
                 tokens: jax.Array,  # [T] int32
                 positions: jax.Array,  # [T] int32
                 kv_cache: KVCache,
                 meta: AttentionMetadata,
                 pool_seg: jax.Array | None = None,  # [T] i32: each row's sequence to pool into, S = none
                 hidden_rows: bool = False,
                 vision: VisionRows | None = None,
                 ):  # (logits [S, vocab] f32, cache), or with pool_seg (logits or None, cache, pooled [S, E] f32)
        """`pool_seg` (engine/pooling/): the last layer runs on every row, and the final-norm
        hidden states are summed per sequence row; a model without an LM head returns no logits.
        `hidden_rows` (the MTP proposer, models/mtp.py): the last layer runs on every row too,
        and every row's final-norm hidden state [T, E] comes back third.
        `vision` (models/vision/rows.py): the (t, h, w) positions the multimodal rope turns
        with, the image rows that replace their placeholder embeddings, and DeepStack's adds."""
        if kv_cache.stages != self.stages:
            raise ValueError(f"the cache is laid out for {kv_cache.stages} stage(s), the model for {self.stages}")
        x = self.embed(tokens)
        if self.config.embeddings.scale != 1.0:
            x = x * jnp.asarray(self.config.embeddings.scale, x.dtype)
        rope_positions = deepstack = None
        if vision is not None:
            if self.plan.layer_groups != 1:
                raise ValueError("images and multimodal rope run on the unrolled layout only (no scan, no stages)")
            a = self.config.attention
            if vision.mrope is not None:
                rope_positions = mrope_positions(vision.mrope, mrope_axes(a.mrope_section, self.config.rope_dim // 2))
            if vision.images is not None:  # after the embedding scale: image rows are not scaled (Gemma 3)
                x = jnp.where(vision.images.mask[:, None], vision.images.embeds.astype(x.dtype), x)
                deepstack = vision.images.deepstack
            if vision.key_limits is not None:
                meta = dataclasses.replace(meta, key_limits=vision.key_limits)
        x = self.stream_in(x)
        if self.stages > 1:  # stacked layers hand back the rows of logits_indices: all of them to pool
            rows = meta if pool_seg is None else dataclasses.replace(
                meta, logits_indices=jnp.arange(tokens.shape[0], dtype=jnp.int32))
            x, new_pages, counts = pipeline_layers(self.layers, x, positions, kv_cache.pages, rows,
                                                   self.attention_impl, self.plan.microbatches)
        else:
            # The last layer's rows other than the sampled ones feed nothing (their K/V
            # come from the layer's input), so the plan may run only those; not when the
            # caller asks for more rows than one per sequence (every-row logits, as
            # training and evaluation read them).
            one_row_per_seq = meta.logits_indices.shape[0] == meta.kv_lens.shape[0]
            prune = one_row_per_seq and self.plan.prunes_last_layer and pool_seg is None and not hidden_rows
            if prune and rows_split_over_sequence():
                raise ValueError("the execution plan runs the last layer on the sampled rows, but the mesh splits "
                                 "the rows over 'sequence': build the model with ExecutionPlan.of(..., mesh)")
            per_layer = None if self.per_layer_inputs is None else self.per_layer_inputs(_plain(tokens, vision), x)
            x, new_pages, counts = run_layers(self.layers, x, positions, kv_cache.pages, meta,
                                              self.attention_impl, prune, per_layer=per_layer,
                                              rope_positions=rope_positions, deepstack=deepstack)
            if not prune and pool_seg is None and not hidden_rows:
                x = jnp.take(x, meta.logits_indices, axis=0)
        if hidden_rows:  # x: every row [T, E]; the norm is per row, so the head reads the same rows
            h = self.norm(self.stream_out(x))
            return self.head(jnp.take(h, meta.logits_indices, axis=0)), kv_cache.updated(new_pages, counts), h
        if pool_seg is not None:  # x: every row [T, E]
            pooled = pool_rows(self.norm(self.stream_out(x)), pool_seg, meta.kv_lens.shape[0])
            logits = self.head(self.norm(jnp.take(self.stream_out(x), meta.logits_indices, axis=0))) \
                if self.has_head else None
            return logits, kv_cache.updated(new_pages, counts), pooled
        x = self.norm(constrain(self.stream_out(x), ("seqs", "act_embed")))  # [S, E]
        return self.head(x), kv_cache.updated(new_pages, counts)

    def mtp_forward(self,
                    hidden: jax.Array,  # [T, E] the target's final-norm hidden state of each row
                    next_tokens: jax.Array,  # [T] i32 each row's next token
                    positions: jax.Array,  # [T] i32
                    kv_cache: KVCache,
                    meta: AttentionMetadata,  # logits_indices: the rows whose guesses are wanted
                    ):  # (z [T, E], logits [S, vocab] f32, cache)
        """The MTP layer over the rows (models/mtp.py), writing its cache entry (the last one):
        each row's guess at the token after its next one, from meta.logits_indices' rows."""
        x = self.embed(next_tokens)
        if self.config.embeddings.scale != 1.0:
            x = x * jnp.asarray(self.config.embeddings.scale, x.dtype)
        z, pages = self.mtp(x, hidden, positions, kv_cache.pages[-1], meta, self.attention_impl)
        logits = self.head(self.mtp.norm(jnp.take(z, meta.logits_indices, axis=0)))
        return z, logits, dataclasses.replace(kv_cache, pages=kv_cache.pages[:-1] + (pages,))

    @property
    def has_head(self) -> bool:
        return self.config.embeddings.head

    def head(self, x: jax.Array) -> jax.Array:  # [S, E] final-norm hidden -> [S, vocab] f32 logits
        if not self.has_head:
            raise ValueError("this model has no LM head (an embedding backbone): it embeds and scores, "
                             "it does not generate")
        if self.config.embeddings.tied:
            logits = self.embed.attend(x)
        else:
            logits = constrain(x @ self.lm_head[...], ("seqs", "act_vocab"))  # vocab-parallel
        if self.config.embeddings.head_bias:
            logits = logits + self.lm_head_bias[...]
        return final_logits(self.config, logits)


def pool_rows(h: jax.Array,  # [T, E] final-norm hidden states of the step's rows
              seg: jax.Array,  # [T] i32: the sequence row each token row adds into; num_seqs = none
              num_seqs: int) -> jax.Array:  # [S, E] f32 sums
    """A segment sum over the ragged token axis: which rows a sequence pools (its last, all,
    its first) is the host's choice of `seg`, so one program serves every pooling mode."""
    return jax.ops.segment_sum(h.astype(jnp.float32), seg, num_segments=num_seqs + 1)[:num_seqs]


def final_logits(config: ModelConfig, logits: jax.Array) -> jax.Array:  # [S, V] -> [S, V] f32
    """Granite's logits scale, then Gemma 2's soft cap, in f32."""
    logits = logits.astype(jnp.float32)
    if config.embeddings.logits_scale != 1.0:
        logits = logits * config.embeddings.logits_scale
    if config.embeddings.final_soft_cap is not None:
        logits = config.embeddings.final_soft_cap * jnp.tanh(logits / config.embeddings.final_soft_cap)
    return logits
