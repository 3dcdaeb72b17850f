"""Nemotron-H (NemotronHForCausalLM): a stack of single-block layers, each norm -> ONE block
-> residual, the block by `layers_block_type` (transformers 5) or `hybrid_override_pattern`
(the original configs): "M" Mamba2 (models/mixers/mamba2.py), "*" attention without rope and
with its own head_dim, "-" a squared-ReLU MLP without a gate. In ModelConfig terms: M
layers are linear_layers (linear_kind mamba2) and no_mlp_layers, * layers no_mlp_layers
and nope_layers, - layers no_mixer_layers. Norms are RMSNorm with the weight applied in
f32 before the cast.

Refused by name: "E" (mixture-of-experts) blocks (Nemotron-3 Nano's routed, latent-projected
experts are not built here), any bias (attention, MLP, Mamba projections), a sliding
window, and a pattern without attention (the page pool is sized by attention layers).
"""

from __future__ import annotations

import math

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import ACTIVATIONS, Family, HFTensor, same
from jaxfill.models.linear_state import conv_dim

# block letter of every spelling: pattern letters, transformers-5 names, their legacy names
BLOCKS = {"M": "M", "*": "*", "-": "-", "E": "E", "linear_attention": "M", "mamba": "M",
          "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
MOE_FIELDS = frozenset({  # what only "E" blocks read; with none in the pattern they change nothing
    "n_routed_experts", "n_shared_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
    "moe_latent_size", "moe_shared_expert_overlap", "num_experts_per_tok", "routed_scaling_factor", "n_group",
    "topk_group", "norm_topk_prob", "output_router_logits"})


def block_pattern(hf: dict) -> str:
    """The layers' blocks as pattern letters, from either spelling (both given must agree)."""
    listed, pattern = hf.get("layers_block_type"), hf.get("hybrid_override_pattern")
    if listed is None and pattern is None:
        raise ConfigError("config.json has neither layers_block_type nor hybrid_override_pattern")
    names = list(listed) if listed is not None else list(pattern)
    bad = sorted({str(b) for b in names} - set(BLOCKS))
    if bad:
        raise ConfigError(f"config.json layers_block_type / hybrid_override_pattern has unknown blocks {bad}")
    blocks = "".join(BLOCKS[b] for b in names)
    if listed is not None and pattern is not None and pattern != blocks:
        raise ConfigError(f"config.json hybrid_override_pattern {pattern!r} disagrees with layers_block_type")
    if hf.get("num_hidden_layers") not in (None, len(blocks)):
        raise ConfigError(f"config.json num_hidden_layers={hf['num_hidden_layers']} but the block pattern has "
                          f"{len(blocks)} layers")
    if "E" in blocks:
        raise ConfigError(f"config.json block pattern {blocks!r} has mixture-of-experts ('E' / 'moe') layers: not "
                          "supported for nemotron_h (dense Mamba2 / attention / MLP layers only)")
    if "*" not in blocks:
        raise ConfigError(f"config.json block pattern {blocks!r} has no attention ('*') layer: not supported "
                          "(the engine sizes its page pool by the attention layers)")
    return blocks


class NemotronH(Family):
    name = "nemotron_h"
    architectures = ("NemotronHForCausalLM",)
    honoured = frozenset({"layers_block_type", "hybrid_override_pattern", "layer_norm_epsilon", "mlp_hidden_act",
                          "ssm_state_size", "mamba_num_heads", "mamba_head_dim", "n_groups", "conv_kernel",
                          "use_conv_bias", "time_step_limit", "attention_head_dim"})
    # initialisation only (time_step_*, rescale_prenorm_residual), the SSD's block size
    # (chunk_size: the same function either way), transformers switches, the MTP head
    # (loaded by neither transformers nor us), `expand` (transformers sizes the Mamba2
    # width as mamba_num_heads * mamba_head_dim and never reads it), rope (NoPE
    # attention), and the MoE fields (no "E" block is accepted)
    inert = frozenset({"time_step_min", "time_step_max", "time_step_floor", "rescale_prenorm_residual",
                       "chunk_size", "use_mamba_kernels", "num_logits_to_keep", "hidden_dropout",
                       "num_nextn_predict_layers", "mtp_layers_block_type", "mtp_hybrid_override_pattern", "expand",
                       "partial_rotary_factor"}) | MOE_FIELDS
    fixed = {"attention_bias": False, "mlp_bias": False, "use_bias": False, "mamba_proj_bias": False,
             "mamba_hidden_act": "silu", "mamba_ssm_cache_dtype": "float32", "residual_in_fp32": False,
             "sliding_window": None}
    mixers = ("attention", "mamba2")
    tested = ("HF f32 logits and greedy tokens (model level: prefill in chunks carrying the state, then decode); "
              "through the Engine: prefix-cached with state snapshots = the model-level loop; mesh.tensor=2 "
              "(split by group) = one device; disaggregated prefill -> decode = one engine")

    def to_model_config(self, hf, architecture):
        blocks = block_pattern(hf)  # transformers 5 saves no num_hidden_layers: the pattern's length
        return super().to_model_config({**hf, "num_hidden_layers": len(blocks)}, architecture)

    def rope(self, hf, rope=None):
        return 10000.0, None  # NoPE attention: no rope field changes a number

    def model_fields(self, hf):
        blocks = block_pattern(hf)
        eps = hf.get("layer_norm_epsilon", 1e-5)
        if hf.get("rms_norm_eps") not in (None, eps):
            raise ConfigError(f"config.json rms_norm_eps={hf['rms_norm_eps']} disagrees with layer_norm_epsilon={eps}, "
                              "which transformers' Nemotron-H reads")
        head_dim = hf.get("head_dim") or 128  # transformers' default, not hidden / heads
        if hf.get("attention_head_dim") not in (None, head_dim):
            raise ConfigError(f"config.json attention_head_dim={hf['attention_head_dim']} disagrees with the "
                              f"head_dim={head_dim} transformers uses")
        act = hf.get("mlp_hidden_act") or "relu2"
        if act != "relu2" and act not in ACTIVATIONS:
            raise ConfigError(f"config.json mlp_hidden_act={act!r} is not supported (relu2, {', '.join(ACTIVATIONS)})")
        lo, hi = (json_number(v) for v in hf.get("time_step_limit") or (0.0, math.inf))
        heads, groups = hf["mamba_num_heads"], hf["n_groups"]
        if heads % groups:
            raise ConfigError(f"config.json mamba_num_heads={heads} is not a multiple of n_groups={groups}")
        at = lambda letters: tuple(n for n, b in enumerate(blocks) if b in letters)  # noqa: E731
        return dict(head_dim=head_dim, rms_norm_eps=eps, norm_kind="rms_f32", mlp_gated=False,
                    hidden_act=ACTIVATIONS.get(act, act), nope_layers=at("*"), linear_layers=at("M"),
                    no_mlp_layers=at("M*"), no_mixer_layers=at("-"), linear_kind="mamba2",
                    linear_num_key_heads=groups, linear_num_value_heads=heads,
                    linear_key_head_dim=hf["ssm_state_size"], linear_value_head_dim=hf["mamba_head_dim"],
                    linear_conv_kernel=hf.get("conv_kernel", 4), linear_conv_bias=bool(hf.get("use_conv_bias", True)),
                    linear_dt_limit=None if (lo, hi) == (0.0, math.inf) else (lo, hi))

    def model_defaults(self, hidden_size):
        """A TOML [model] section names the layers itself (linear_layers, no_mlp_layers,
        no_mixer_layers, nope_layers: configs/nemotron_h_8b.toml)."""
        return dict(norm_kind="rms_f32", mlp_gated=False, hidden_act="relu2", linear_kind="mamba2",
                    linear_conv_bias=True)

    # --- tensors -----------------------------------------------------------------------
    def rename(self, name: str) -> str:
        """The original checkpoints' `backbone.` prefix -> transformers' `model.`."""
        return "model." + name[len("backbone."):] if name.startswith("backbone.") else name

    ignored_prefixes = ("mtp.",)  # the multi-token-prediction head

    def tensors(self, config):
        table = super().tensors(config)
        table["model.embeddings.weight"] = table.pop("model.embed_tokens.weight")
        table["model.norm_f.weight"] = table.pop("model.norm.weight")
        return table

    def layer_tensors(self, c, p, layer):
        n, e = layer[1], c.hidden_size
        if n in c.no_mixer_layers:  # "-"
            i = c.intermediate_size
            return {p + "norm.weight": same(layer + ("mlp_norm", "weight"), (e,)),
                    p + "mixer.up_proj.weight": HFTensor(layer + ("mlp", "up"), (i, e), (i, e), (1, 0)),
                    p + "mixer.down_proj.weight": HFTensor(layer + ("mlp", "down"), (e, i), (e, i), (1, 0))}
        table = {p + "norm.weight": same(layer + ("attn_norm", "weight"), (e,))}
        if n not in c.linear.layers:  # "*": transformers' attention names under `mixer.`
            attn = self.attention_tensors(c, p, layer)
            return {**table, **{k.replace(p + "self_attn.", p + "mixer."): v for k, v in attn.items()}}
        return {**table, **mamba2_tensors(c, p + "mixer.", layer + ("attn",))}


def json_number(v) -> float:
    """A float as config.json holds it: transformers 5 writes infinities as {"__float__": "Infinity"}."""
    return float(v["__float__"] if isinstance(v, dict) and "__float__" in v else v)


def mamba2_tensors(c, m: str, a: tuple) -> dict:
    """One Mamba2 mixer's tensors (HF names under `m`) -> its params under `a`. in_proj
    holds [z (H*P), x (H*P), B (G*N), C (G*N), dt (H)] rows and conv1d the x, B, C channels
    in that order; each part becomes its own param, split by group (models/mixers/mamba2.py)."""
    e, g, n, h, p, k, cd = (c.hidden_size, c.linear.num_key_heads, c.linear.key_head_dim, c.linear.num_value_heads,
                            c.linear.value_head_dim, c.linear.conv_kernel, conv_dim(c))
    width, total = h * p, h * p + cd + h
    # the convolved parts: channels [start, stop) of conv1d (in_proj rows start + width), per group w wide
    parts = (("x", (0, width), h // g * p), ("b", (width, width + g * n), n), ("c", (width + g * n, cd), n))
    in_proj = (HFTensor(a + ("z",), (total, e), (h, p, e), (2, 0, 1), rows=(0, width)),
               *(HFTensor(a + (part,), (total, e), (g, w, e), (2, 0, 1), rows=(lo + width, hi + width))
                 for part, (lo, hi), w in parts),
               HFTensor(a + ("dt",), (total, e), (h, e), (1, 0), rows=(width + cd, total)))
    table = {
        m + "in_proj.weight": in_proj,
        m + "conv1d.weight": tuple(HFTensor(a + ("conv_" + part,), (cd, 1, k), (g, w, k), (0, 1, 2), rows)
                                   for part, rows, w in parts),
        m + "dt_bias": same(a + ("dt_bias",), (h,)),
        m + "A_log": same(a + ("a_log",), (h,)),
        m + "D": same(a + ("d",), (h,)),
        m + "norm.weight": HFTensor(a + ("norm",), (width,), (h, p), (0, 1)),
        m + "out_proj.weight": HFTensor(a + ("out",), (e, width), (e, h, p), (1, 2, 0)),
    }
    if c.linear.conv_bias:
        table[m + "conv1d.bias"] = tuple(HFTensor(a + ("conv_bias_" + part,), (cd,), (g, w), (0, 1), rows)
                                         for part, rows, w in parts)
    return table


FAMILIES = (NemotronH(),)
