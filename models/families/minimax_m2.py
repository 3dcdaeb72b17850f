"""MiniMax-M2 (MiniMaxM2ForCausalLM): q/k RMSNorms over the whole projection (all heads at
once) before rope, rope over the first `rotary_dim` dims of each head (the legacy
`rotary_dim` field, or `partial_rotary_factor`), and every MLP a mixture of experts routed
by sigmoid scores: experts chosen on score + `e_score_correction_bias`, weighted by the
plain scores renormalised (GLM's router without groups or scaling). Experts at
block_sparse_moe.experts.{j}.w1 (gate), w3 (up), w2 (down), as Mixtral. No new math."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, HFTensor, activation
from jaxfill.models.families.experts import expert_tensors

TESTED = ("HF f32 logits and greedy tokens (sigmoid routing with its correction bias, projection q/k norms, "
          "rope over half of each head)"
          "; through the Engine prefix-cached = expert 4 = expert 2 x tensor 2")


class MiniMaxM2(Family):
    name = "minimax_m2"
    architectures = ("MiniMaxM2ForCausalLM",)
    honoured = frozenset({"hidden_act", "num_local_experts", "num_experts", "num_experts_per_tok", "rotary_dim",
                          "partial_rotary_factor"})
    # training only: the load-balancing loss and router noise change no inference number
    inert = frozenset({"router_aux_loss_coef", "output_router_logits", "router_jitter_noise"})
    partial_rotary = True
    experts = True
    tested = TESTED

    def model_fields(self, hf):
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        rotary = hf.get("rotary_dim")
        if rotary is None:
            rotary = int(head_dim * (1.0 if partial is None else partial))
        elif partial is not None and int(head_dim * partial) != int(rotary):
            raise ConfigError(f"config.json rotary_dim={rotary} and partial_rotary_factor={partial} disagree "
                              f"(head_dim {head_dim})")
        experts = hf.get("num_local_experts", hf.get("num_experts"))
        if not experts:
            raise ConfigError("config.json has no num_local_experts")
        return dict(self.model_defaults(hf["hidden_size"]), hidden_act=activation(hf),
                    rotary_dim=0 if int(rotary) == head_dim else int(rotary),
                    num_experts=int(experts), experts_per_token=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=hf["intermediate_size"])

    def model_defaults(self, hidden_size):
        return dict(qk_norm="projection", num_experts=8, experts_per_token=2, moe_intermediate_size=hidden_size,
                    router_scoring="sigmoid", router_bias=True, router_renormalize=True)

    def mlp_tensors(self, c, p, layer):
        table = expert_tensors(c, p, layer, "block_sparse_moe", ("w1", "w3", "w2"))
        n = c.moe.num_experts
        table[f"{p}block_sparse_moe.e_score_correction_bias"] = HFTensor(layer + ("mlp", "router_bias"), (n,),
                                                                         (n,), (0,))
        return table


FAMILIES = (MiniMaxM2(),)
