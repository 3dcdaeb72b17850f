"""LongCat-Flash (LongcatFlashForCausalLM): each HF layer is two MLA + dense-MLP blocks and
one MoE whose output skips to the end of the second block (models/shortcut_decoder.py:
HF layer i is our layers 2i and 2i + 1, each with its own latent cache entry).

MLA as DeepSeek V3's (low-rank q, interleaved rope) with LongCat's LoRA scales: the
query times sqrt(hidden / q_lora_rank), folded into the softmax scale (both its nope and
rope parts are scaled, so every score is), and the normalised latent times
sqrt(hidden / kv_lora_rank) before it is cached (`mla_latent_scale`: it keys the nope part
and is the value, not the rope key). The router is a softmax over the experts and
`zero_expert_num` zero-compute (identity) experts, chosen on prob + correction bias,
weighted by the plain probs times routed_scaling_factor, never renormalised
(models/moe.py)."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, HFTensor, activation, same
from jaxfill.models.families.deepseek import DeepseekV3
from jaxfill.models.families.experts import expert_tensors
from jaxfill.models.moe import is_moe_layer
from jaxfill.models.rope import yarn_mscale


class LongcatFlash(Family):
    name = "longcat_flash"
    architectures = ("LongcatFlashForCausalLM",)
    honoured = frozenset({"num_layers", "ffn_hidden_size", "hidden_act", "kv_lora_rank", "q_lora_rank",
                          "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "qk_head_dim", "moe_topk",
                          "n_routed_experts", "zero_expert_num", "expert_ffn_hidden_size", "routed_scaling_factor"})
    # num_key_value_heads: one latent per token whatever it says; the MTP layers are a training head
    inert = frozenset({"num_key_value_heads", "output_router_logits", "router_aux_loss_coef"})
    fixed = {"attention_bias": False, "router_bias": False, "zero_expert_type": "identity"}
    rope_types = ("default", "yarn")
    mixers = ("mla",)
    experts = True
    shortcut = True
    tested = ("HF f32 logits and greedy tokens (shortcut MoE, zero-compute experts chosen through a "
              "non-zero correction bias, routed scaling, MLA LoRA scales); through the Engine: unchunked = "
              "chunked = prefix-cached = tensor 2 = expert 2 = expert 2 x tensor 2")

    def to_model_config(self, hf, architecture):
        """transformers derives num_hidden_layers (2 per layer) and intermediate_size; ours
        counts each block as a layer."""
        hf = dict(hf, num_hidden_layers=2 * int(hf["num_layers"]), intermediate_size=hf["ffn_hidden_size"])
        return super().to_model_config(hf, architecture)

    def rope(self, hf, rope=None):
        """transformers' LongCat default theta is 1e7, not 1e4."""
        rope = rope if rope is not None else (hf.get("rope_parameters") or {})
        return super().rope(hf, {"rope_theta": hf.get("rope_theta", 1e7), **rope})

    def model_fields(self, hf):
        lat, rope, nope = int(hf["kv_lora_rank"]), int(hf["qk_rope_head_dim"]), int(hf["qk_nope_head_dim"])
        q_rank, hidden = int(hf["q_lora_rank"]), int(hf["hidden_size"])
        # transformers builds the rope of `head_dim` dims (default 64) and turns qk_rope_head_dim with it
        if int(hf.get("head_dim", 64)) != rope:
            raise ConfigError(f"config.json head_dim={hf.get('head_dim', 64)} must equal qk_rope_head_dim={rope} "
                              "for longcat_flash (transformers ropes with head_dim's frequencies)")
        if int(hf.get("qk_head_dim") or nope + rope) != nope + rope:
            raise ConfigError(f"config.json qk_head_dim={hf['qk_head_dim']} must be qk_nope_head_dim + "
                              f"qk_rope_head_dim = {nope + rope} for longcat_flash")
        _theta, scaling = self.rope(hf)
        scale = (nope + rope) ** -0.5 * (hidden / q_rank) ** 0.5  # the q LoRA scale on every score
        if scaling and scaling.get("mscale_all_dim"):
            scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        layers = 2 * int(hf["num_layers"])
        return dict(hidden_act=activation(hf), num_kv_heads=1, head_dim=lat + rope, rotary_dim=rope,
                    kv_lora_rank=lat, q_lora_rank=q_rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                    v_head_dim=int(hf["v_head_dim"]), query_scale=scale, rope_interleave=True,
                    mla_latent_scale=(hidden / lat) ** 0.5,
                    num_experts=int(hf["n_routed_experts"]), zero_experts=int(hf.get("zero_expert_num") or 0),
                    experts_per_token=int(hf["moe_topk"]), moe_intermediate_size=int(hf["expert_ffn_hidden_size"]),
                    dense_layers=tuple(range(1, layers, 2)), moe_shortcut=True, router_scoring="softmax",
                    router_bias=True, router_f32=True, router_renormalize=False,
                    routed_scaling=float(hf.get("routed_scaling_factor", 1.0)))

    def model_defaults(self, hidden_size):
        return dict(num_kv_heads=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16,
                    v_head_dim=16, head_dim=48, rotary_dim=16, rope_interleave=True, num_experts=8,
                    zero_experts=4, experts_per_token=4, moe_intermediate_size=hidden_size, moe_shortcut=True,
                    router_bias=True, router_f32=True, router_renormalize=False)

    def layer_tensors(self, c, p, layer):
        """Our layer n is block n % 2 of HF layer n // 2: `{p}` names the HF layer."""
        n = layer[1]
        hf, block = f"{self.prefix}layers.{n // 2}.", n % 2
        table = {f"{hf}self_attn.{block}.{k[len(p) + len('self_attn.'):]}": v
                 for k, v in DeepseekV3.attention_tensors(self, c, p, layer).items()}
        e, i = c.hidden_size, c.intermediate_size
        m = layer + ("mlp",)
        table.update({
            f"{hf}input_layernorm.{block}.weight": same(layer + ("attn_norm", "weight"), (e,)),
            f"{hf}post_attention_layernorm.{block}.weight": same(layer + ("mlp_norm", "weight"), (e,)),
            f"{hf}mlps.{block}.gate_proj.weight": HFTensor(m + ("gate",), (i, e), (i, e), (1, 0)),
            f"{hf}mlps.{block}.up_proj.weight": HFTensor(m + ("up",), (i, e), (i, e), (1, 0)),
            f"{hf}mlps.{block}.down_proj.weight": HFTensor(m + ("down",), (e, i), (e, i), (1, 0)),
        })
        if is_moe_layer(c, n):
            width = c.moe.router_width
            experts = expert_tensors(c, hf, layer, router="router.classifier")
            table.update({k: v._replace(param_path=layer + ("moe",) + v.param_path[3:]) for k, v in experts.items()})
            table[f"{hf}mlp.router.classifier.weight"] = HFTensor(layer + ("moe", "router"), (width, e), (width, e),
                                                                  (1, 0))
            table[f"{hf}mlp.router.e_score_correction_bias"] = same(layer + ("moe", "router_bias"), (width,))
        return table

    ignored_prefixes = ("model.mtp.",)

    def model_class(self):
        from jaxfill.models.shortcut_decoder import ShortcutDecoder

        return ShortcutDecoder


FAMILIES = (LongcatFlash(),)
