"""Phi-3: Llama's layer with q, k, v fused in one `qkv_proj` and gate, up in one
`gate_up_proj` (split at load, each part read as its own rows of the file). The 128k
variants' longrope turns with its short factors, the context capped at
original_max_position_embeddings (models/rope.py)."""

from __future__ import annotations

from jaxfill.models.families.base import FAMILY_TESTED, Family, HFTensor, activation


class Phi3(Family):
    name = "phi3"
    architectures = ("Phi3ForCausalLM",)
    # original_max_position_embeddings: longrope's (the 128k variants), where it caps the context
    honoured = frozenset({"hidden_act", "sliding_window", "original_max_position_embeddings"})
    depends = {"original_max_position_embeddings": {
        "original_max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.5] * 8,
                            "long_factor": [3.0] * 8}}}
    fixed = {"partial_rotary_factor": 1.0}
    rope_types = ("default", "linear", "yarn", "longrope")
    tested = FAMILY_TESTED

    def model_fields(self, hf):
        return dict(hidden_act=activation(hf), sliding_window=hf.get("sliding_window") or None)

    def attention_tensors(self, c, p, layer):
        e, d, hq, hk = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
        a, fused = layer + ("attn",), ((hq + 2 * hk) * d, e)
        q, k = hq * d, hk * d
        return {
            p + "self_attn.qkv_proj.weight": (
                HFTensor(a + ("q",), fused, (hq, d, e), (2, 0, 1), (0, q)),
                HFTensor(a + ("k",), fused, (hk, d, e), (2, 0, 1), (q, q + k)),
                HFTensor(a + ("v",), fused, (hk, d, e), (2, 0, 1), (q + k, q + 2 * k)),
            ),
            p + "self_attn.o_proj.weight": HFTensor(a + ("o",), (e, hq * d), (e, hq, d), (1, 2, 0)),
        }

    def mlp_tensors(self, c, p, layer):
        e, i = c.hidden_size, c.intermediate_size
        m = layer + ("mlp",)
        return {
            p + "mlp.gate_up_proj.weight": (
                HFTensor(m + ("gate",), (2 * i, e), (i, e), (1, 0), (0, i)),
                HFTensor(m + ("up",), (2 * i, e), (i, e), (1, 0), (i, 2 * i)),
            ),
            p + "mlp.down_proj.weight": HFTensor(m + ("down",), (e, i), (e, i), (1, 0)),
        }


FAMILIES = (Phi3(),)
