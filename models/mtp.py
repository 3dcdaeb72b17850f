"""The multi-token-prediction (MTP) layer of DeepSeek-V3 / GLM-4.5 checkpoints, run as a
speculative proposer (engine/speculative/mtp.py, speculative.method = "mtp"). Qwen3.5,
Qwen3.5-MoE and Qwen3-Next store the same block under `mtp.*` names
(models/families/qwen_mtp_tensors.py): this module runs both.

For position t, from the target's hidden state h_t and the next token x_{t+1}:

    z = eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)])     2E -> E, the embedding half first
    z = one decoder layer (the kinds of the target's layer number num_layers: MLA + MoE for V3)
    logits = head(norm(z))                                a guess at x_{t+2}

What h_t is and the order of the concatenation follow vLLM's DeepSeekMultiTokenPredictorLayer
(vllm/model_executor/models/deepseek_mtp.py, read through the `search` tool): the target's
hidden state *after* its final norm (what its model forward returns and the LM head reads),
and `torch.cat([inputs_embeds, previous_hidden_states])`. vLLM also zeroes the embedding of
rows at position 0, a leftover of a shifted layout; the DeepSeek-V3 paper's module has no such
mask (the row at position 0 carries x_1, a real token), and neither does this one.

The embedding and the LM head are the target's (Decoder.embed, Decoder.head). DeepSeek-V3 and
GLM-4.5 checkpoints store copies of both under the MTP layer (`embed_tokens`, `shared_head.head`);
the loader skips them (models/families/deepseek.py), so the layer never holds a second
vocabulary-sized matrix. A checkpoint whose copies differ from the target's would be proposed
from the target's tables: proposals only, never what is emitted (verification is exact).

Chaining (speculative.num_tokens > 1, as vLLM does): the layer's output z (before `norm`) is
the next step's h. The KV this layer attends over is one more cache entry after the target's
(KVCache.create with ModelConfig.run_mtp), sharing the sequences' page tables: position t's
MTP K/V lives in the slot of the target's K/V for t.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfill.models.config import ModelConfig
from jaxfill.models.layers import RMSNorm, param
from jaxfill.models.mixers import MixerContext


class MTPLayer(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, layer_class):
        """`layer_class`: the decoder's own layer composition (models/decoder.py), so the
        MTP layer is built as the target's layer number num_layers would be."""
        c, dt, e = config, config.jnp_dtype, config.hidden_size
        norm = lambda: RMSNorm(e, c.norms.eps, dt, rngs, kind=c.norms.kind)  # noqa: E731
        self.enorm = norm()
        self.hnorm = norm()
        self.eh_proj = param(rngs, (2 * e, e), ("embed", "embed"), dt)  # [2E, E]: embedding rows, then hidden
        self.layer = layer_class(c, rngs, c.num_layers)  # the checkpoint's layer number num_layers
        self.norm = norm()  # shared_head.norm
        self.index = c.num_layers

    def __call__(self,
                 embedded: jax.Array,  # [T, E] the target's embedding of each row's next token
                 hidden: jax.Array,  # [T, E] the target's final-norm hidden state of each row
                 positions: jax.Array,  # [T] i32
                 pages,  # the MTP layer's cache entry
                 meta,  # AttentionMetadata of the step's rows
                 impl: str,
                 ) -> tuple[jax.Array, object]:  # ([T, E] z before the shared head's norm, pages)
        z = jnp.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1) @ self.eh_proj[...]
        ctx = MixerContext(positions, meta, impl, layer=self.index)
        z, pages, _counts = self.layer(z, pages, ctx)  # expert load of the MTP layer is not counted
        return z, pages
