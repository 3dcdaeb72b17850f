"""Granite 4.0-H (GraniteMoeHybridForCausalLM): Granite 3's multipliers (embeddings,
residual branches, attention scores, logits) on a Mamba2 / attention hybrid. Every layer is
norm -> mixer -> residual, norm -> MLP -> residual; the mixer by `layer_types`
("mamba" / "linear_attention": Mamba2, models/mixers/mamba2.py, transformers' very
Nemotron-H scan and gated per-group RMSNorm; "attention" / "full_attention": attention,
roped only with position_embedding_type "rope"). The MLP is the checkpoints' `shared_mlp`
(gate and up fused in `input_linear`), beside a mixture of experts (top k of the router's
logits, softmax over those k) when num_local_experts > 0; with 0 experts it is the dense
MLP, shared_intermediate_size wide.

Refused by name: a Mamba projection bias, an activation other than SiLU (transformers'
Mamba convolution reads hidden_act too; models/mixers/mamba2.py applies SiLU), and a
pattern without attention (the page pool is sized by attention layers).
"""

from __future__ import annotations

import math

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, HFTensor
from jaxfill.models.families.nemotron_h import json_number, mamba2_tensors

# layer_types spellings: transformers 5's names and the published configs' legacy ones
MAMBA, ATTENTION = ("linear_attention", "mamba"), ("full_attention", "attention")
MAMBA_FIELDS = frozenset({"layer_types", "layers_block_type", "mamba_n_heads", "mamba_n_groups", "mamba_d_state",
                          "mamba_d_head", "mamba_d_conv", "mamba_expand", "mamba_conv_bias", "time_step_limit"})


def mamba_layers(hf: dict) -> tuple[int, ...]:
    types = hf.get("layer_types") or hf.get("layers_block_type")
    if types is None:  # transformers' default: every layer Mamba2
        types = ["linear_attention"] * hf["num_hidden_layers"]
    bad = sorted(set(types) - set(MAMBA) - set(ATTENTION))
    if bad:
        raise ConfigError(f"config.json layer_types {bad} are not supported for granitemoehybrid "
                          f"(only {', '.join(MAMBA + ATTENTION)})")
    if len(types) != hf["num_hidden_layers"]:
        raise ConfigError(f"config.json layer_types has {len(types)} entries for {hf['num_hidden_layers']} layers")
    if all(t in MAMBA for t in types):
        raise ConfigError("config.json layer_types has no attention layer: not supported for granitemoehybrid "
                          "(the engine sizes its page pool by the attention layers)")
    return tuple(n for n, t in enumerate(types) if t in MAMBA)


class GraniteMoeHybrid(Family):
    name = "granitemoehybrid"
    architectures = ("GraniteMoeHybridForCausalLM",)
    honoured = MAMBA_FIELDS | {"attention_bias", "embedding_multiplier", "residual_multiplier",
                               "attention_multiplier", "logits_scaling", "num_local_experts", "num_experts_per_tok",
                               "shared_intermediate_size", "position_embedding_type"}
    # the SSD's block size (the same function either way), training-only router fields
    inert = frozenset({"mamba_chunk_size", "router_aux_loss_coef", "output_router_logits"})
    fixed = {"mamba_proj_bias": False, "hidden_act": "silu"}
    mixers = ("attention", "mamba2")
    experts = True
    tested = ("HF f32 logits and greedy tokens (model level: prefill in chunks carrying the state, then decode; "
              "MoE + shared MLP and dense, with and without rope); through the Engine: unchunked = chunked = "
              "prefix-cached (state snapshots) = tensor 2")

    def rope(self, hf, rope=None):
        if hf.get("position_embedding_type") != "rope":
            return 10000.0, None  # NoPE attention: no rope field changes a number
        return super().rope(hf, rope)

    def model_fields(self, hf):
        linear = mamba_layers(hf)
        e, heads, groups = hf["hidden_size"], hf.get("mamba_n_heads", 128), hf.get("mamba_n_groups", 1)
        width = hf.get("mamba_expand", 2) * e
        head_dim = hf.get("mamba_d_head", "auto")
        head_dim = width // heads if head_dim == "auto" else head_dim
        if head_dim * heads != width or heads % groups:
            raise ConfigError(f"config.json mamba_n_heads={heads} x mamba_d_head={head_dim} must be mamba_expand x "
                              f"hidden_size = {width}, and a multiple of mamba_n_groups={groups}")
        kind = hf.get("position_embedding_type")
        if kind not in (None, "rope"):
            raise ConfigError(f"config.json position_embedding_type={kind!r} is not supported (None or 'rope')")
        lo, hi = (json_number(v) for v in hf.get("time_step_limit") or (0.0, math.inf))
        bias, shared, experts = bool(hf.get("attention_bias", False)), hf.get("shared_intermediate_size", 1024), \
            int(hf.get("num_local_experts") or 0)
        fields = dict(
            hidden_act="silu", attention_bias=bias, attention_out_bias=bias,
            embed_scale=float(hf.get("embedding_multiplier", 1.0)),
            residual_scale=float(hf.get("residual_multiplier", 1.0)),
            query_scale=float(hf.get("attention_multiplier", 1.0)),
            logits_scale=1.0 / float(hf.get("logits_scaling", 1.0)),
            nope_layers=() if kind == "rope" else tuple(n for n in range(hf["num_hidden_layers"]) if n not in linear),
            linear_layers=linear, linear_kind="mamba2", linear_num_key_heads=groups, linear_num_value_heads=heads,
            linear_key_head_dim=hf.get("mamba_d_state", 256), linear_value_head_dim=head_dim,
            linear_conv_kernel=hf.get("mamba_d_conv", 4), linear_conv_bias=bool(hf.get("mamba_conv_bias", True)),
            linear_dt_limit=None if (lo, hi) == (0.0, math.inf) else (lo, hi),
            intermediate_size=shared)  # the dense (shared) MLP; `intermediate_size` is one expert's
        if experts:
            fields.update(num_experts=experts, experts_per_token=int(hf.get("num_experts_per_tok", 2)),
                          moe_intermediate_size=hf["intermediate_size"], router_scoring="topk_softmax",
                          router_renormalize=False, shared_expert_size=shared)
        return fields

    def model_defaults(self, hidden_size):
        """A TOML [model] section names the layers (linear_layers, nope_layers) and experts itself."""
        return dict(linear_kind="mamba2", linear_conv_bias=True, router_scoring="topk_softmax",
                    router_renormalize=False)

    # --- tensors -----------------------------------------------------------------------
    def layer_tensors(self, c, p, layer):
        table = super().layer_tensors(c, p, layer)
        if layer[1] in c.linear.layers:  # the mixer is `mamba.`, not self_attn
            table = {k: v for k, v in table.items() if ".self_attn." not in k}
            table.update(mamba2_tensors(c, p + "mamba.", layer + ("attn",)))
        return table

    def mlp_tensors(self, c, p, layer):
        e = c.hidden_size
        if not c.moe.num_experts:
            return fused_mlp_tensors(p + "shared_mlp.", layer + ("mlp",), e, c.intermediate_size)
        n, i = c.moe.num_experts, c.moe.intermediate_size
        m, x = layer + ("mlp",), p + "block_sparse_moe."
        return {
            x + "router.layer.weight": HFTensor(m + ("router",), (n, e), (n, e), (1, 0)),
            # [E, 2I, H]: rows [0, I) gate, [I, 2I) up -> [E, H, 2, I]
            x + "input_linear.weight": HFTensor(m + ("experts_gate_up",), (n, 2 * i, e), (n, 2, i, e), (0, 3, 1, 2)),
            x + "output_linear.weight": HFTensor(m + ("experts_down",), (n, e, i), (n, e, i), (0, 2, 1)),
            **fused_mlp_tensors(p + "shared_mlp.", m + ("shared",), e, c.moe.shared_expert_size),
        }


def fused_mlp_tensors(m: str, path: tuple, e: int, i: int) -> dict:
    """A gated MLP whose `input_linear` holds gate (rows [0, I)) and up (rows [I, 2I))."""
    return {
        m + "input_linear.weight": (HFTensor(path + ("gate",), (2 * i, e), (i, e), (1, 0), rows=(0, i)),
                                    HFTensor(path + ("up",), (2 * i, e), (i, e), (1, 0), rows=(i, 2 * i))),
        m + "output_linear.weight": HFTensor(path + ("down",), (e, i), (e, i), (1, 0)),
    }


FAMILIES = (GraniteMoeHybrid(),)
