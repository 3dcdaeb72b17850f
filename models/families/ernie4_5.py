"""ERNIE 4.5 (Ernie4_5ForCausalLM, dense) and ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM):
Llama's layer with rope on (even, odd) pairs of each head (attention.rope_interleave) and
a tied head by default. The MoE's sparse layers are those from `moe_layer_start_index` to
`moe_layer_end_index` where (layer + 1) is a multiple of `moe_layer_interval`; their
router, in f32, takes a softmax over all experts, chooses the top k of prob +
`e_score_correction_bias` and weights them by the plain probs divided by their sum
(clamped below at `moe_norm_min`), beside `moe_num_shared_experts` shared experts. The
multi-token-prediction layer is not run (its tensors are skipped)."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, HFTensor, activation
from jaxfill.models.families.experts import expert_tensors, shared_expert_tensors
from jaxfill.models.moe import is_moe_layer

TESTED_MOE = ("HF f32 logits and greedy tokens (interleaved rope, softmax routing with its selection bias and a "
              "binding moe_norm_min, shared experts, dense layers between sparse ones)"
              "; through the Engine prefix-cached = expert 4 = expert 2 x tensor 2")


class Ernie4_5(Family):
    name = "ernie4_5"
    architectures = ("Ernie4_5ForCausalLM",)
    honoured = frozenset({"hidden_act"})
    # use_bias puts biases on the MLPs too, which no MLP here has (the published checkpoints: false)
    fixed = {"use_bias": False}
    tested = ("HF f32 logits and greedy tokens, bf16 at the noise floor (interleaved rope, a tied head); through "
              "the Engine chunked = prefix-cached = tensor 2 = sequence 2 = scan = stage 2; int8 weights + int8 KV run")

    def model_fields(self, hf):
        return dict(self.model_defaults(hf["hidden_size"]), hidden_act=activation(hf),
                    tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))

    def model_defaults(self, hidden_size):
        return dict(rope_interleave=True)


def sparse_layers(hf, num_layers: int) -> tuple[int, ...]:
    start = int(hf.get("moe_layer_start_index") or 0)
    end = hf.get("moe_layer_end_index")
    end = num_layers - 1 if end is None or end == -1 else int(end)
    step = int(hf.get("moe_layer_interval") or 1)
    return tuple(n for n in range(num_layers) if (n + 1) % step == 0 and start <= n <= end)


class Ernie4_5Moe(Ernie4_5):
    name = "ernie4_5_moe"
    architectures = ("Ernie4_5_MoeForCausalLM",)
    honoured = frozenset({"hidden_act", "moe_intermediate_size", "moe_k", "moe_num_experts", "moe_num_shared_experts",
                          "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval", "moe_norm_min",
                          "num_experts", "num_experts_per_tok"})
    # training only; the multi-token-prediction layer is a training head (its tensors are skipped)
    inert = frozenset({"router_aux_loss_coef", "output_router_logits", "num_nextn_predict_layers",
                       "num_mtp_layers"})
    depends = {"moe_layer_end_index": {"moe_layer_end_index": 1}}  # the walker's doubled last layer is past the end
    experts = True
    tested = TESTED_MOE
    ignored_prefixes = ("model.mtp",)  # mtp_block, mtp_emb_norm, mtp_hidden_norm, mtp_linear_proj

    def model_fields(self, hf):
        layers = hf["num_hidden_layers"]
        experts = hf.get("moe_num_experts", hf.get("num_experts"))
        k = hf.get("moe_k", hf.get("num_experts_per_tok"))
        if not experts or not k:
            raise ConfigError("config.json has no moe_num_experts / moe_k")
        sparse = sparse_layers(hf, layers)
        shared = int(hf.get("moe_num_shared_experts") or 0) * int(hf["moe_intermediate_size"])
        return dict(super().model_fields(hf), num_experts=int(experts), experts_per_token=int(k),
                    moe_intermediate_size=int(hf["moe_intermediate_size"]),
                    dense_layers=tuple(n for n in range(layers) if n not in sparse),
                    router_scoring="softmax", router_bias=True, router_f32=True, router_renormalize=True,
                    router_renormalize_min=float(hf.get("moe_norm_min", 1e-12) or 0.0), shared_expert_size=shared)

    def model_defaults(self, hidden_size):
        return dict(rope_interleave=True, num_experts=8, experts_per_token=2, moe_intermediate_size=hidden_size,
                    router_bias=True, router_f32=True, router_renormalize_min=1e-12,
                    shared_expert_size=2 * hidden_size, dense_layers=(0,))

    def mlp_tensors(self, c, p, layer):
        if not is_moe_layer(c, layer[1]):
            return super().mlp_tensors(c, p, layer)
        n = c.moe.num_experts
        table = expert_tensors(c, p, layer)
        table[f"{p}mlp.moe_statics.e_score_correction_bias"] = HFTensor(layer + ("mlp", "router_bias"), (1, n),
                                                                        (n,), (0,))
        if c.moe.shared_expert_size:
            table.update(shared_expert_tensors(c, p, layer, name="shared_experts", gate=None))
        return table


FAMILIES = (Ernie4_5(), Ernie4_5Moe())
