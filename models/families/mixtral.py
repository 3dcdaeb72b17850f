"""Mixtral: Mistral's attention with every MLP a mixture of experts (softmax top-k,
renormalised); experts at block_sparse_moe.experts.{j}.w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from jaxfill.models.families.base import Family, activation
from jaxfill.models.families.experts import expert_tensors

MOE_TESTED = ("HF f32 logits and greedy tokens, bf16 at the noise floor; through the Engine chunked = "
              "prefix-cached = expert 4 = expert 2 x tensor 2 = expert 2 x sequence 2 = expert 2 x stage 2 "
              "= expert 4 x data 2 = one device; int8 experts + int8 KV run")


class Mixtral(Family):
    name = "mixtral"
    architectures = ("MixtralForCausalLM",)
    honoured = frozenset({"hidden_act", "sliding_window", "num_local_experts", "num_experts_per_tok"})
    # training-time only: the load-balancing loss and router noise change no inference number
    inert = frozenset({"router_aux_loss_coef", "output_router_logits", "router_jitter_noise"})
    experts = True
    tested = MOE_TESTED

    def model_fields(self, hf):
        return dict(hidden_act=activation(hf), sliding_window=hf.get("sliding_window") or None,
                    num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"], router_renormalize=True)

    def model_defaults(self, hidden_size):
        return dict(num_experts=8, experts_per_token=2, moe_intermediate_size=4 * hidden_size)

    def mlp_tensors(self, c, p, layer):
        return expert_tensors(c, p, layer, "block_sparse_moe", ("w1", "w3", "w2"))


FAMILIES = (Mixtral(),)
