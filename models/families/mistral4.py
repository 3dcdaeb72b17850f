"""Mistral 4 (Mistral4ForCausalLM: Mistral Small 4).

DeepSeek V3's multi-head latent attention (models/families/deepseek.py: low-rank q or
straight, rope on qk_rope_head_dim dims, interleaved pairs by `rope_interleave`, YaRN
with the mscale softmax correction) whose queries, nope and rope parts alike, are scaled
by position after rope as Ministral 3's are: q * (1 + beta * log(1 + floor(position /
L))), beta the rope parameters' `llama_4_scaling_beta` and L their
`original_max_position_embeddings`. The first `first_k_dense_replace` layers are dense;
the rest route with a softmax over every expert, the top k within the best `topk_group`
of `n_group` groups (a group scores the sum of its two best), renormalised (+ 1e-20) by
`norm_topk_prob`, times `routed_scaling_factor`, beside `n_shared_experts` shared
experts. The experts are stored stacked as transformers 5 holds them (gate_up_proj
[E, 2I, H], down_proj [E, H, I]).

Only a YaRN rope is accepted: transformers' default rope spans the whole head_dim
(qk_nope + qk_rope) and does not fit the rope dims of q and k (its forward fails)."""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, HFTensor, head_under, text_tower_config
from jaxfill.models.families.deepseek import DeepseekV3
from jaxfill.models.families.experts import shared_expert_tensors
from jaxfill.models.families.ministral import TEMPERATURE_KEYS
from jaxfill.models.moe import is_moe_layer

TESTED = ("HF f32 logits and greedy tokens (MLA with a low-rank q, interleaved YaRN rope with the mscale "
          "correction, a query temperature stepping every 16 positions, a dense first layer, softmax grouped "
          "routing x1.8 beside a shared expert); through the Engine chunked = prefix-cached = tensor 2 = "
          "sequence 2 = expert 2 x tensor 2")


class Mistral4(DeepseekV3):
    name = "mistral4"
    architectures = ("Mistral4ForCausalLM",)
    inert = DeepseekV3.inert | {"pretraining_tp"}
    rope_types = ("yarn",)
    partial_rotary = True  # rope_parameters' partial_rotary_factor: qk_rope_head_dim / head_dim, checked below
    tested = TESTED

    def model_fields(self, hf):
        rope = hf.get("rope_parameters") or {}
        beta, length = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
        if beta is None or not length:
            raise ConfigError("config.json rope_parameters of mistral4 need llama_4_scaling_beta and "
                              f"original_max_position_embeddings (got {beta!r}, {length!r})")
        _theta, scaling = self.rope(hf)
        if scaling is None:
            raise ConfigError("config.json rope_parameters of mistral4 must be rope_type 'yarn': transformers' "
                              "default rope spans head_dim, not the qk_rope_head_dim dims it turns")
        nope, dims = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
        partial = rope.get("partial_rotary_factor", 1.0)
        if int((nope + dims) * partial) != dims:
            raise ConfigError(f"config.json rope_parameters partial_rotary_factor={partial!r} of mistral4 must turn "
                              f"qk_rope_head_dim={dims} of the {nope + dims} head dims")
        fields = super().model_fields(hf)
        fields.update(query_temperature_beta=float(beta), query_temperature_length=int(length))
        if fields.get("num_experts"):
            fields.update(router_scoring="softmax", router_bias=False, router_f32=False,
                          router_renormalize_eps=1e-20)
        return fields

    def model_defaults(self, hidden_size):
        return dict(super().model_defaults(hidden_size), query_temperature_beta=0.1, query_temperature_length=8192)

    def rope(self, hf, rope=None):
        rope = rope if rope is not None else (hf.get("rope_parameters") or {})
        theta, scaling = super().rope(hf, {k: v for k, v in rope.items() if k not in TEMPERATURE_KEYS})
        if scaling:
            scaling.pop("partial_rotary_factor", None)  # the rope dims are qk_rope_head_dim (checked)
        return theta, scaling

    def mlp_tensors(self, c, p, layer):
        if not is_moe_layer(c, layer[1]):
            return Family.mlp_tensors(self, c, p, layer)
        e, h, i = c.moe.num_experts, c.hidden_size, c.moe.intermediate_size
        m = layer + ("mlp",)
        return {
            p + "mlp.gate.weight": HFTensor(m + ("router",), (e, h), (e, h), (1, 0)),
            # [E, 2I, H]: gate rows, then up rows -> [E, H, 2, I]
            p + "mlp.experts.gate_up_proj": HFTensor(m + ("experts_gate_up",), (e, 2 * i, h), (e, 2, i, h),
                                                     (0, 3, 1, 2)),
            p + "mlp.experts.down_proj": HFTensor(m + ("experts_down",), (e, h, i), (e, h, i), (0, 2, 1)),
            **shared_expert_tensors(c, p, layer, name="shared_experts", gate=None),
        }


class Mistral4Multimodal(Mistral4):
    """The text tower of Mistral3ForConditionalGeneration whose text_config is Mistral 4's
    (as Mistral Small 4 ships); the vision tower and projector are skipped. Another text
    tower under that architecture is refused by name. Tying the LM head to the embeddings
    is the outer config's `tie_word_embeddings`, as transformers ties it."""
    architectures = ("Mistral3ForConditionalGeneration",)
    prefix = "language_model.model."
    ignored_prefixes = ("vision_tower.", "multi_modal_projector.")
    tested = "HF parity f32 of the text tower (text-only prompts), vision weights skipped"

    def to_model_config(self, hf, architecture):
        text = text_tower_config(hf, "Mistral3ForConditionalGeneration", tie_default=True, outer_tie=True)
        if text.get("model_type") != "mistral4":
            raise ConfigError(f"Mistral3ForConditionalGeneration text_config.model_type="
                              f"{text.get('model_type')!r} is not supported (only 'mistral4')")
        text.pop("model_type")
        return super().to_model_config(text, architecture)

    def tensors(self, config):
        return head_under(super().tensors(config), "language_model.")


FAMILIES = (Mistral4(), Mistral4Multimodal())
