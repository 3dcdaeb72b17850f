"""DeepSeek V3 / R1 and Kimi K2 (DeepseekV3ForCausalLM), DeepSeek V2 / V2-Lite
(DeepseekV2ForCausalLM): multi-head latent attention
(models/mixers/mla.py; q through a low-rank q_a/q_b pair or straight, the latent through
kv_a_proj_with_mqa + kv_a_layernorm, kv_b_proj absorbed), rope on qk_rope_head_dim dims
in DeepSeek's interleaved layout, YaRN with the mscale softmax correction; the first
`first_k_dense_replace` layers dense, then sigmoid grouped routing with a correction
bias beside shared experts (the router of GLM-4.5); V2: softmax routing, greedy top-k,
no renormalisation. The multi-token-prediction layer runs as a speculative proposer
(speculative.method = "mtp", models/mtp.py)."""

from __future__ import annotations

import logging

from jaxfill.models.families.base import Family, HFTensor, activation, same
from jaxfill.models.families.mtp_tensors import skipped_mtp_prefixes
from jaxfill.models.families.experts import expert_tensors, grouped_sigmoid_moe_tensors, shared_expert_tensors
from jaxfill.models.moe import is_moe_layer
from jaxfill.models.rope import yarn_mscale

log = logging.getLogger(__name__)


class DeepseekV3(Family):
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    honoured = frozenset({"hidden_act", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                          "v_head_dim", "qk_head_dim", "rope_interleave", "moe_intermediate_size",
                          "n_shared_experts", "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor",
                          "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob"})
    # num_key_value_heads: MLA has one latent per token whatever it says (transformers fills
    # in num_attention_heads); num_nextn_predict_layers changes no number of the target (model_fields
    # reads it into mtp_layers, the proposer speculative.method = "mtp" runs)
    inert = frozenset({"num_key_value_heads", "router_aux_loss_coef", "output_router_logits", "num_mtp_layers",
                       "num_nextn_predict_layers", "pretraining_tp", "ep_size", "moe_layer_freq",
                       "topk_method", "scoring_func", "seq_aux", "aux_loss_alpha"})
    fixed = {"attention_bias": False}
    mixers = ("mla",)
    experts = True
    tested = ("HF f32 logits and greedy tokens (MLA with and without q_lora_rank, interleaved rope, YaRN "
              "mscale, dense-only and with sigmoid grouped MoE + shared experts)")

    def model_fields(self, hf):
        lat, rope, nope = int(hf["kv_lora_rank"]), int(hf["qk_rope_head_dim"]), int(hf["qk_nope_head_dim"])
        layers = hf["num_hidden_layers"]
        _theta, scaling = self.rope(hf)
        scale = (nope + rope) ** -0.5
        if scaling and scaling.get("mscale_all_dim"):
            scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        experts = int(hf.get("n_routed_experts") or 0)
        dense = min(int(hf.get("first_k_dense_replace") or 0), layers) if experts else layers
        fields = dict(hidden_act=activation(hf), num_kv_heads=1, head_dim=lat + rope, rotary_dim=rope,
                      kv_lora_rank=lat, q_lora_rank=int(hf.get("q_lora_rank") or 0), qk_nope_head_dim=nope,
                      qk_rope_head_dim=rope, v_head_dim=int(hf["v_head_dim"]), query_scale=scale,
                      rope_interleave=bool(hf.get("rope_interleave", True)),
                      mtp_layers=int(hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0))
        if experts and dense < layers:
            fields.update(num_experts=experts, experts_per_token=hf["num_experts_per_tok"],
                          moe_intermediate_size=hf["moe_intermediate_size"], dense_layers=tuple(range(dense)),
                          router_scoring="sigmoid", router_bias=True, router_f32=True,
                          router_renormalize=bool(hf.get("norm_topk_prob", True)),
                          router_groups=int(hf.get("n_group") or 1),
                          router_topk_groups=int(hf.get("topk_group") or 1),
                          routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
                          shared_expert_size=int(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"])
        return fields

    def model_defaults(self, hidden_size):
        return dict(num_kv_heads=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                    head_dim=48, rotary_dim=16, rope_interleave=True)

    def attention_tensors(self, c, p, layer):
        e, h, lat, rope = c.hidden_size, c.num_heads, c.mla.kv_lora_rank, c.mla.qk_rope_head_dim
        qk, vd = c.mla.qk_nope_head_dim + rope, c.mla.v_head_dim
        a, s = layer + ("attn",), p + "self_attn."
        table = {
            s + "kv_a_proj_with_mqa.weight": HFTensor(a + ("kv_a",), (lat + rope, e), (lat + rope, e), (1, 0)),
            s + "kv_a_layernorm.weight": same(a + ("kv_a_norm", "weight"), (lat,)),
            s + "kv_b_proj.weight": HFTensor(a + ("w_ukv",), (h * (qk - rope + vd), lat), (h, qk - rope + vd, lat),
                                             (2, 0, 1)),
            s + "o_proj.weight": HFTensor(a + ("o",), (e, h * vd), (e, h, vd), (1, 2, 0)),
        }
        if c.mla.q_lora_rank:
            r = c.mla.q_lora_rank
            table[s + "q_a_proj.weight"] = HFTensor(a + ("q_a",), (r, e), (r, e), (1, 0))
            table[s + "q_a_layernorm.weight"] = same(a + ("q_a_norm", "weight"), (r,))
            table[s + "q_b_proj.weight"] = HFTensor(a + ("q_b",), (h * qk, r), (h, qk, r), (2, 0, 1))
        else:
            table[s + "q_proj.weight"] = HFTensor(a + ("q",), (h * qk, e), (h, qk, e), (2, 0, 1))
        return table

    def mlp_tensors(self, c, p, layer):
        if not is_moe_layer(c, layer[1]):
            return super().mlp_tensors(c, p, layer)
        return grouped_sigmoid_moe_tensors(c, p, layer)

    ignored_prefixes = ("model.mtp.",)

    def skipped_prefixes(self, config, hf):
        """DeepSeek's checkpoints store their multi-token-prediction layers after the last
        decoder layer (V3: model.layers.61.*); the first is loaded only to propose
        (speculative.method = "mtp", models/families/mtp_tensors.py)."""
        n = int(hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0)
        if n and not config.run_mtp:
            log.info("%s: skipping %d multi-token-prediction layer(s) in the checkpoint (model.layers.%d.*%s)",
                     config.architecture, n, config.num_layers, "" if n == 1 else f" to {config.num_layers + n - 1}")
        return self.ignored_prefixes + skipped_mtp_prefixes(config, n)


class DeepseekV2(DeepseekV3):
    """V2's attention is V3's (its complex-number rope turns interleaved pairs too); its
    router is a softmax over every expert, the greedy top-k times routed_scaling_factor."""

    name = "deepseek_v2"
    architectures = ("DeepseekV2ForCausalLM",)
    honoured = DeepseekV3.honoured - {"rope_interleave", "n_group", "topk_group"}
    # norm_topk_prob: transformers' V2 router never renormalises, whatever the file says
    inert = DeepseekV3.inert | {"norm_topk_prob", "n_group", "topk_group"}
    fixed = {"attention_bias": False, "mlp_bias": False, "topk_method": "greedy"}
    tested = "HF f32 logits and greedy tokens (V2-Lite's shape: plain q, softmax greedy routing, shared experts)"

    def model_fields(self, hf):
        fields = super().model_fields({**hf, "rope_interleave": True, "n_group": 1, "topk_group": 1})
        if fields.get("num_experts"):
            fields.update(router_scoring="softmax", router_bias=False, router_renormalize=False)
        return fields

    def mlp_tensors(self, c, p, layer):
        if not is_moe_layer(c, layer[1]):
            return Family.mlp_tensors(self, c, p, layer)
        table = expert_tensors(c, p, layer)
        table.update(shared_expert_tensors(c, p, layer, name="shared_experts", gate=None))
        return table


FAMILIES = (DeepseekV3(), DeepseekV2())
