"""Qwen3.5-MoE (35B-A3B, 122B-A10B, 397B-A17B): Qwen3.5's stack (Gated DeltaNet x3, gated
full attention, its projection layout) with Qwen3-Next's sparse MLP in every layer:
softmax top-k experts, always renormalised, beside a sigmoid-gated shared expert. Experts
are read per expert (`experts.{j}.gate_proj`, as transformers' save_pretrained writes them
and its loader converts); the fused `experts.gate_up_proj` of a raw state dict is not read
yet. No new math: this module is the config and tensor mapping only."""

from __future__ import annotations

from jaxfill.models.families.experts import expert_tensors, shared_expert_tensors
from jaxfill.models.families.qwen3_5 import Qwen3_5, Qwen3_5Multimodal
from jaxfill.models.families.qwen3_moe import TRAINING_ONLY

SPARSE = frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"})


class Qwen3_5Moe(Qwen3_5):
    name = "qwen3_5_moe"
    architectures = ("Qwen3_5MoeForCausalLM",)
    experts = True
    honoured = Qwen3_5.honoured | SPARSE
    inert = Qwen3_5.inert | TRAINING_ONLY
    tested = ("HF f32 logits and greedy tokens (model level: prefill in chunks carrying the state, then decode); "
              "through the Engine: unchunked = chunked = prefix-cached "
              "(state snapshots) = tensor 2")

    def model_fields(self, hf):
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        return dict(super().model_fields(hf), num_experts=int(hf["num_experts"]),
                    experts_per_token=int(hf["num_experts_per_tok"]), moe_intermediate_size=hf["moe_intermediate_size"],
                    router_renormalize=True, shared_expert_size=shared, shared_expert_gate=bool(shared))

    def model_defaults(self, hidden_size):
        return dict(super().model_defaults(hidden_size), num_experts=8, experts_per_token=2,
                    moe_intermediate_size=hidden_size, router_renormalize=True, shared_expert_size=hidden_size,
                    shared_expert_gate=True)

    def mlp_tensors(self, c, p, layer):
        table = expert_tensors(c, p, layer)
        if c.moe.shared_expert_size:
            table.update(shared_expert_tensors(c, p, layer))
        return table


class Qwen3_5MoeMultimodal(Qwen3_5Multimodal, Qwen3_5Moe):
    """The image-text checkpoint (what Qwen/Qwen3.5-*-A*B publish): Qwen3.5-MoE's text tower
    under `model.language_model.`, its attention layers roping with the (t, h, w) sections,
    and Qwen3.5's vision tower beside it (engine/vision/, kind `mrope`). With
    `model.mrope_section = []` it loads as its text tower only: the plain rope, no tower, and
    none of the (t, h, w) rope's refusals (docs/vision.md)."""
    name = "qwen3_5_moe_vl"
    architectures = ("Qwen3_5MoeForConditionalGeneration",)
    tested = ("HF f32 logits and greedy tokens with an image, its rows split over prefill chunks (the recurrent "
              "state carried inside the image), = unchunked; the text tower alone (model level)")


FAMILIES = (Qwen3_5Moe(), Qwen3_5MoeMultimodal())
