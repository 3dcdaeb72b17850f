"""DeepSeek V3.2 (DeepseekV32ForCausalLM) and GLM-5 (GlmMoeDsaForCausalLM): DeepSeek V3's
latent attention and grouped sigmoid MoE with DeepSeek sparse attention, a lightning
indexer per layer whose top-`index_topk` keys are all each query attends
(models/mixers/mla_indexer.py). The indexer ropes its key and queries in halves (V3.2) or
in interleaved pairs (GLM-5); the latent's rope is always interleaved. Which layers are
dense is `mlp_layer_types` (transformers derives it from first_k_dense_replace).

Refused by name: GLM-5's cross-layer top-k sharing (`indexer_types` "shared": a layer
reusing the previous layer's selection, which our per-layer mixers do not carry across
layers), and MLA without q_lora_rank (the indexer's queries come from the q latent)."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import HFTensor, same
from jaxfill.models.families.deepseek import DeepseekV3

INDEX_KEYS = frozenset({"index_topk", "index_head_dim", "index_n_heads"})


class DeepseekV32(DeepseekV3):
    name = "deepseek_v32"
    architectures = ("DeepseekV32ForCausalLM",)
    honoured = (DeepseekV3.honoured - {"rope_interleave"}) | INDEX_KEYS | {"mlp_layer_types", "layer_types"}
    # rope_interleave: transformers' V3.2 interleaves the latent's rope whatever a file says
    inert = DeepseekV3.inert | {"rope_interleave"}
    fixed = {"attention_bias": False, "mlp_bias": False}
    indexer = True
    index_rope_interleave = False
    tested = ("HF f32 logits and greedy tokens with the top-k binding (16 of 64 and 300 tokens) and dense MLA "
              "below it, the sparse attention's keys from the cache across chunks")

    def model_fields(self, hf):
        layers = int(hf["num_hidden_layers"])
        types = list(hf.get("layer_types") or ["indexed_attention"] * layers)
        if types != ["indexed_attention"] * layers:
            raise ConfigError(f"config.json layer_types must be 'indexed_attention' for every layer, got {types}")
        mlp = list(hf.get("mlp_layer_types") or [])
        if mlp and (len(mlp) != layers or set(mlp) - {"dense", "sparse"}):
            raise ConfigError(f"config.json mlp_layer_types must name 'dense' or 'sparse' per layer, got {mlp}")
        dense = [n for n, t in enumerate(mlp) if t == "dense"] if mlp else None
        first = layers if dense is not None and len(dense) == layers else 0 if dense is not None else None
        fields = super().model_fields({**hf, "rope_interleave": True,
                                       **({} if first is None else {"first_k_dense_replace": first})})
        if dense is not None and fields.get("num_experts"):
            fields["dense_layers"] = tuple(dense)
        lat, rope, d = fields["kv_lora_rank"], fields["qk_rope_head_dim"], int(hf["index_head_dim"])
        fields.update(index_topk=int(hf["index_topk"]), index_n_heads=int(hf["index_n_heads"]), index_head_dim=d,
                      index_rope_interleave=self.index_rope_interleave, head_dim=lat + rope + d)
        return fields

    def model_defaults(self, hidden_size):
        return dict(super().model_defaults(hidden_size), q_lora_rank=32, index_topk=16, index_n_heads=4,
                    index_head_dim=32, head_dim=80, index_rope_interleave=self.index_rope_interleave)

    def attention_tensors(self, c, p, layer):
        table = super().attention_tensors(c, p, layer)
        e, r, h, d = c.hidden_size, c.mla.q_lora_rank, c.mla.index_n_heads, c.mla.index_head_dim
        a, s = layer + ("attn", "indexer"), p + "self_attn.indexer."
        table.update({
            s + "wq_b.weight": HFTensor(a + ("index_q",), (h * d, r), (h, d, r), (2, 0, 1)),
            s + "wk.weight": HFTensor(a + ("index_k",), (d, e), (d, e), (1, 0)),
            s + "k_norm.weight": same(a + ("k_norm", "weight"), (d,)),
            s + "k_norm.bias": same(a + ("k_norm", "bias"), (d,)),
            s + "weights_proj.weight": HFTensor(a + ("index_weights",), (h, e), (h, e), (1, 0)),
        })
        return table


class GlmMoeDsa(DeepseekV32):
    """GLM-5: V3.2's model with the indexer's rope in interleaved pairs."""

    name = "glm_moe_dsa"
    architectures = ("GlmMoeDsaForCausalLM",)
    honoured = DeepseekV32.honoured | {"indexer_types"}
    # they only derive indexer_types (transformers' __post_init__), which is read
    inert = DeepseekV32.inert | {"index_topk_freq", "index_skip_topk_offset", "index_topk_pattern"}
    index_rope_interleave = True
    tested = DeepseekV32.tested + "; the indexer's interleaved rope"

    def model_fields(self, hf):
        kinds = list(hf.get("indexer_types") or [])
        if set(kinds) - {"full"}:
            raise ConfigError(f"config.json indexer_types {kinds}: 'shared' layers (reusing the previous layer's "
                              "top-k) are not supported; only 'full' (every layer runs its own indexer)")
        return super().model_fields(hf)


FAMILIES = (DeepseekV32(), GlmMoeDsa())
