"""Falcon-H1 (FalconH1ForCausalLM): every layer runs attention and Mamba2 in parallel on
the same normed input and adds their outputs, then a gated MLP (norm -> both mixers ->
residual, norm -> MLP -> residual). In ModelConfig terms every layer is a linear layer
(linear_kind mamba2) with `linear_parallel` on: models/mixers/parallel_hybrid.py, a cache
entry of pages and a state slot (models/linear_state.PagesAndState).

muP multipliers, each a config field (transformers' FalconH1 modeling file and config
defaults): embedding_multiplier (embed_scale), lm_head_multiplier (logits_scale),
attention_in_multiplier / key_multiplier / attention_out_multiplier (the attention
block's input, K before rope, output), ssm_in_multiplier / ssm_multipliers /
ssm_out_multiplier (Mamba2's input, its in_proj groups z, x, B, C, dt, its output) and
mlp_multipliers (the gate's pre-activation, the down projection's output). Mamba2's
width is mamba_d_ssm (mamba_expand x hidden when null); its gated RMSNorm is there only
with mamba_rms_norm, before the gate with mamba_norm_before_gate (after it otherwise);
projectors_bias is a bias on its out_proj.

Refused by name: mamba_proj_bias (an in_proj bias), mlp_bias, and an activation other than
SiLU (transformers' Mamba convolution reads hidden_act too; models/mixers/mamba2.py applies
SiLU). transformers applies time_step_limit in its prefill scan but not in its one-token
decode step; we apply it in both, so with a finite limit HF's own prefill and decode
disagree (tests/test_falcon_h1.py runs the default, unbounded limit for greedy tokens).
"""

from __future__ import annotations

import math

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, HFTensor, same
from jaxfill.models.families.nemotron_h import json_number, mamba2_tensors


def _moved(table: dict, old: tuple, new: tuple) -> dict:
    """The table's param paths under `old` moved under `new` (fused parts included)."""
    def move(t: HFTensor) -> HFTensor:
        path = t.param_path
        return t._replace(param_path=new + path[len(old):]) if path[:len(old)] == old else t

    return {k: tuple(map(move, v)) if isinstance(v, tuple) and isinstance(v[0], HFTensor) else move(v)
            for k, v in table.items()}


class FalconH1(Family):
    name = "falcon_h1"
    architectures = ("FalconH1ForCausalLM",)
    honoured = frozenset({"mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
                          "mamba_d_conv", "mamba_expand", "mamba_conv_bias", "mamba_norm_before_gate",
                          "mamba_rms_norm", "time_step_limit", "projectors_bias", "attention_bias",
                          "embedding_multiplier", "lm_head_multiplier", "attention_in_multiplier",
                          "attention_out_multiplier", "key_multiplier", "ssm_in_multiplier", "ssm_out_multiplier",
                          "ssm_multipliers", "mlp_multipliers"})
    # the SSD's block size (the same function either way), generate's logits count; the
    # published configs' init-only time-step fields and switches transformers never reads
    inert = frozenset({"mamba_chunk_size", "num_logits_to_keep", "time_step_min", "time_step_max",
                       "time_step_floor", "time_step_rank", "mamba_use_mlp", "mlp_expansion_factor"})
    fixed = {"mamba_proj_bias": False, "mlp_bias": False, "hidden_act": "silu"}
    # fields that count only beside others: the width without mamba_d_ssm, the norm's place with the norm
    depends = {"mamba_expand": {"mamba_d_ssm": None, "mamba_d_head": "auto"},
               "mamba_norm_before_gate": {"mamba_rms_norm": True}}
    mixers = ("attention", "mamba2")
    tested = ("HF f32 logits and greedy tokens (every multiplier off 1; with and without Mamba's gated norm, "
              "either side of the gate; projectors and attention biases); through the Engine: unchunked = "
              "chunked = prefix-cached (state snapshots) = tensor 2 = host tier = disaggregated prefill -> decode")

    def model_fields(self, hf):
        e, heads, groups = hf["hidden_size"], hf.get("mamba_n_heads", 128), hf.get("mamba_n_groups", 1)
        width = hf.get("mamba_d_ssm", 1024)
        width = int(hf.get("mamba_expand", 2) * e) if width is None else width
        head_dim = hf.get("mamba_d_head", "auto")
        head_dim = width // heads if head_dim == "auto" else head_dim
        if head_dim * heads != width or heads % groups:
            raise ConfigError(f"config.json mamba_n_heads={heads} x mamba_d_head={head_dim} must be the Mamba width "
                              f"(mamba_d_ssm, else mamba_expand x hidden_size) = {width}, and a multiple of "
                              f"mamba_n_groups={groups}")
        ssm = tuple(float(m) for m in hf.get("ssm_multipliers") or (1.0,) * 5)
        mlp = tuple(float(m) for m in hf.get("mlp_multipliers") or (1.0, 1.0))
        if len(ssm) != 5 or len(mlp) != 2:
            raise ConfigError(f"config.json ssm_multipliers ({len(ssm)}) must hold 5 multipliers (z, x, B, C, dt) "
                              f"and mlp_multipliers ({len(mlp)}) 2 (gate, down)")
        lo, hi = (json_number(v) for v in hf.get("time_step_limit") or (0.0, math.inf))
        bias = bool(hf.get("attention_bias", False))
        norm = "none" if not hf.get("mamba_rms_norm", False) else \
            "before_gate" if hf.get("mamba_norm_before_gate", True) else "after_gate"
        n = hf["num_hidden_layers"]
        return dict(
            hidden_act="silu", attention_bias=bias, attention_out_bias=bias,
            embed_scale=float(hf.get("embedding_multiplier", 1.0)),
            logits_scale=float(hf.get("lm_head_multiplier", 1.0)),
            key_scale=float(hf.get("key_multiplier", 1.0)),
            attention_in_scale=float(hf.get("attention_in_multiplier", 1.0)),
            attention_out_scale=float(hf.get("attention_out_multiplier", 1.0)),
            mlp_scales=mlp,
            linear_layers=tuple(range(n)), linear_parallel=True, linear_kind="mamba2",
            linear_num_key_heads=groups, linear_num_value_heads=heads,
            linear_key_head_dim=hf.get("mamba_d_state", 256), linear_value_head_dim=head_dim,
            linear_conv_kernel=hf.get("mamba_d_conv", 4), linear_conv_bias=bool(hf.get("mamba_conv_bias", True)),
            linear_dt_limit=None if (lo, hi) == (0.0, math.inf) else (lo, hi),
            linear_in_scale=float(hf.get("ssm_in_multiplier", 1.0)),
            linear_out_scale=float(hf.get("ssm_out_multiplier", 1.0)),
            linear_part_scales=() if ssm == (1.0,) * 5 else ssm,
            linear_gated_norm=norm, linear_out_bias=bool(hf.get("projectors_bias", False)))

    def model_defaults(self, hidden_size):
        """A TOML [model] section names its layers (linear_layers) and shapes itself."""
        return dict(linear_kind="mamba2", linear_parallel=True, linear_conv_bias=True, linear_gated_norm="none")

    # --- tensors -----------------------------------------------------------------------
    norm_names = {"attn_norm": "input_layernorm", "mlp_norm": "pre_ff_layernorm"}

    def tensors(self, config):
        table = super().tensors(config)
        table["model.final_layernorm.weight"] = table.pop("model.norm.weight")
        return table

    def layer_tensors(self, c, p, layer):
        table = _moved(super().layer_tensors(c, p, layer), layer + ("attn",), layer + ("attn", "attention"))
        mamba = mamba2_tensors(c, p + "mamba.", layer + ("attn", "mamba"))
        if c.linear.gated_norm == "none":  # transformers' nn.Identity: no weight
            mamba.pop(p + "mamba.norm.weight")
        if c.linear.out_bias:
            mamba[p + "mamba.out_proj.bias"] = same(layer + ("attn", "mamba", "out_bias"), (c.hidden_size,))
        return {**table, **mamba}

    def mlp_tensors(self, c, p, layer):
        return {k.replace(p + "mlp.", p + "feed_forward."): v for k, v in super().mlp_tensors(c, p, layer).items()}


FAMILIES = (FalconH1(),)
