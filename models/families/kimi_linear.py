"""Kimi Linear (KimiLinearForCausalLM): Kimi Delta Attention layers (models/mixers/kda.py)
beside multi-head latent attention layers without rope (DeepSeek's MLA, models/mixers/mla.py,
its qk_rope_head_dim part still one key shared by the heads, just never turned), DeepSeek
V3's MLP: the first `first_k_dense_replace` layers dense (or as `mlp_layer_types` says),
then sigmoid grouped routing with a correction bias beside shared experts.

Which layer is which: transformers 5's `layer_types` ("linear_attention" /
"full_attention"), else the checkpoint's `linear_attn_config` (1-indexed `kda_layers` and
`full_attn_layers`, with the KDA shapes), else transformers' default (full attention at
every 4th layer from layer 4). transformers reads some fields under other names
(attribute_map: num_experts, num_experts_per_token, num_expert_group, moe_renormalize,
model_max_length): either spelling is read.

Refused by name: a MLA with rope (`mla_use_nope` false), a router other than sigmoid, MoE
layers at an interval (`moe_layer_freq`), an activation other than SiLU (KDA's
convolution uses hidden_act too), multi-token-prediction layers, biases.
"""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import Family, HFTensor, same
from jaxfill.models.families.deepseek import DeepseekV3
from jaxfill.models.families.experts import expert_tensors, shared_expert_tensors
from jaxfill.models.moe import is_moe_layer

LAYER_KINDS = ("linear_attention", "full_attention")
MLP_KINDS = ("dense", "sparse")
# transformers' attribute_map: one field, two spellings in config.json
SPELLINGS = {"n_group": ("num_expert_group",), "num_experts_per_tok": ("num_experts_per_token",),
             "n_shared_experts": ("num_shared_experts",), "norm_topk_prob": ("moe_renormalize",),
             "num_local_experts": ("num_experts",), "max_position_embeddings": ("model_max_length",)}


def read(hf: dict, key: str, default=None):
    """`key` or its other spelling (SPELLINGS), else `default`."""
    for name in (key,) + SPELLINGS.get(key, ()):
        if hf.get(name) is not None:
            return hf[name]
    return default


def layer_types(hf: dict, layers: int) -> list[str]:
    """transformers' precedence: layer_types, then linear_attn_config's 1-indexed lists,
    then full attention at layers 4, 8, ... (0-indexed)."""
    linear = hf.get("linear_attn_config") or {}
    types = hf.get("layer_types")
    if not types and "full_attn_layers" in linear and "kda_layers" in linear:
        types = [None] * layers
        for kind, listed in (("full_attention", linear["full_attn_layers"]), ("linear_attention", linear["kda_layers"])):
            for n in listed:
                types[n - 1] = kind
    types = types or ["full_attention" if n and n % 4 == 0 else "linear_attention" for n in range(layers)]
    if len(types) != layers or set(types) - set(LAYER_KINDS):
        raise ConfigError(f"config.json layer_types (or linear_attn_config's kda_layers / full_attn_layers) must "
                          f"name {list(LAYER_KINDS)} once per layer, got {types}")
    return list(types)


class KimiLinear(DeepseekV3):
    name = "kimi_linear"
    architectures = ("KimiLinearForCausalLM",)
    honoured = frozenset({"kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                          "moe_intermediate_size", "routed_scaling_factor", "topk_group", "first_k_dense_replace",
                          "layer_types", "mlp_layer_types", "linear_attn_config", "linear_head_dim",
                          "linear_num_heads", "linear_conv_kernel_dim", *SPELLINGS,
                          *(name for names in SPELLINGS.values() for name in names)})
    # num_key_value_heads: one latent per token; head_dim and qk_head_dim: what transformers
    # derives (qk_rope_head_dim, nope + rope); rope: the MLA turns nothing
    inert = frozenset({"num_key_value_heads", "head_dim", "qk_head_dim", "output_router_logits", "pretraining_tp",
                       "router_aux_loss_coef"})
    fixed = {"attention_bias": False, "hidden_act": "silu", "mla_use_nope": True, "moe_router_activation_func":
             "sigmoid", "moe_layer_freq": 1, "num_nextn_predict_layers": 0}
    mixers = ("mla", "kda")
    experts = True
    tested = ("HF f32 logits and greedy tokens (KDA x3 : NoPE MLA, a dense first layer, sigmoid grouped MoE "
              "+ shared expert); through the Engine: chunked = prefix-cached with state snapshots = tensor 2")

    def rope(self, hf, rope=None):
        return 10000.0, None  # NoPE latent attention: no rope field changes a number

    def model_fields(self, hf):
        layers = hf["num_hidden_layers"]
        types = layer_types(hf, layers)
        lin = hf.get("linear_attn_config") or {}
        heads = int(lin.get("num_heads", hf.get("linear_num_heads", 32)))
        dim = int(lin.get("head_dim", hf.get("linear_head_dim", 128)))
        mlp = hf.get("mlp_layer_types") or ["dense" if n < int(hf.get("first_k_dense_replace", 1)) else "sparse"
                                            for n in range(layers)]
        if len(mlp) != layers or set(mlp) - set(MLP_KINDS):
            raise ConfigError(f"config.json mlp_layer_types must name {list(MLP_KINDS)} once per layer, got {mlp}")
        lat, rope, nope = int(hf["kv_lora_rank"]), int(hf["qk_rope_head_dim"]), int(hf["qk_nope_head_dim"])
        full = tuple(n for n, t in enumerate(types) if t == "full_attention")
        fields = dict(num_kv_heads=1, head_dim=lat + rope, rotary_dim=rope, kv_lora_rank=lat,
                      q_lora_rank=int(hf.get("q_lora_rank") or 0), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                      v_head_dim=int(hf["v_head_dim"]), query_scale=(nope + rope) ** -0.5, nope_layers=full,
                      max_position_embeddings=int(read(hf, "max_position_embeddings", 1048576)),
                      linear_kind="kda", linear_layers=tuple(n for n, t in enumerate(types) if t == "linear_attention"),
                      linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=dim,
                      linear_value_head_dim=dim,
                      linear_conv_kernel=int(lin.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4))))
        if "sparse" in mlp:
            fields.update(self.moe_fields(hf, mlp))
        return fields

    # transformers' defaults of the config class: experts, groups, groups kept, routed scaling
    moe_defaults = (256, 1, 1, 2.446)

    def moe_fields(self, hf, mlp: list[str]) -> dict:
        """DeepSeek V3's MoE (sigmoid scores with a correction bias, groups, shared experts)
        under this family's names and defaults."""
        experts, groups, kept, scaling = self.moe_defaults
        inter = int(hf["moe_intermediate_size"])
        return dict(num_experts=int(read(hf, "num_local_experts", experts)),
                    experts_per_token=int(read(hf, "num_experts_per_tok", 8)), moe_intermediate_size=inter,
                    dense_layers=tuple(n for n, t in enumerate(mlp) if t == "dense"),
                    router_scoring="sigmoid", router_bias=True, router_f32=True,
                    router_renormalize=bool(read(hf, "norm_topk_prob", True)),
                    router_groups=int(read(hf, "n_group", groups)), router_topk_groups=int(hf.get("topk_group") or kept),
                    routed_scaling=float(hf.get("routed_scaling_factor", scaling)),
                    shared_expert_size=int(read(hf, "n_shared_experts", 1)) * inter)

    def model_defaults(self, hidden_size):
        return dict(super().model_defaults(hidden_size), rope_interleave=False, linear_kind="kda",
                    linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16)

    # --- tensors -----------------------------------------------------------------------
    def rename(self, name: str) -> str:
        """Moonshot's names (what save_pretrained writes back): MLPs, dense or sparse, under
        `block_sparse_moe.` in transformers' output and the MoE ones in the published files."""
        return name.replace(".block_sparse_moe.", ".mlp.")

    def layer_tensors(self, c, p, layer):
        if layer[1] not in c.linear.layers:
            return super().layer_tensors(c, p, layer)
        e, h, d, k = c.hidden_size, c.linear.num_value_heads, c.linear.key_head_dim, c.linear.conv_kernel
        a, s = layer + ("attn",), p + "self_attn."
        heads = lambda name: HFTensor(a + (name,), (h * d, e), (h, d, e), (2, 0, 1))  # noqa: E731
        low_rank = lambda name: {  # noqa: E731  E -> D -> H x D
            s + f"{name}_a_proj.weight": HFTensor(a + (name + "_a",), (d, e), (d, e), (1, 0)),
            s + f"{name}_b_proj.weight": HFTensor(a + (name + "_b",), (h * d, d), (h, d, d), (2, 0, 1))}
        return {
            **self.mlp_tensors(c, p, layer),
            **{p + hf + ".weight": same(layer + (ours, "weight"), (e,)) for ours, hf in self.norm_names.items()},
            **{s + f"{n}_proj.weight": heads(n) for n in "qkv"},
            **{s + f"{n}_conv1d.weight": HFTensor(a + ("conv_" + n,), (h * d, 1, k), (h, d, k), (0, 1, 2))
               for n in "qkv"},
            **low_rank("f"), **low_rank("g"),
            s + "dt_bias": HFTensor(a + ("dt_bias",), (h * d,), (h, d), (0, 1)),
            s + "A_log": HFTensor(a + ("a_log",), (1, 1, h, 1), (h,), (0,)),
            s + "b_proj.weight": HFTensor(a + ("b",), (h, e), (h, e), (1, 0)),
            s + "o_norm.weight": same(a + ("norm",), (d,)),
            s + "o_proj.weight": HFTensor(a + ("out",), (e, h * d), (e, h, d), (1, 2, 0)),
        }

    def mlp_tensors(self, c, p, layer):
        if not is_moe_layer(c, layer[1]):
            return Family.mlp_tensors(self, c, p, layer)
        table = expert_tensors(c, p, layer, names=("w1", "w3", "w2"))
        table[f"{p}mlp.gate.e_score_correction_bias"] = HFTensor(layer + ("mlp", "router_bias"), (c.moe.num_experts,),
                                                                 (c.moe.num_experts,), (0,))
        if c.moe.shared_expert_size:
            table.update(shared_expert_tensors(c, p, layer, name="shared_experts", gate=None))
        return table

    ignored_prefixes = ()

    def skipped_prefixes(self, config, hf):
        return ()


FAMILIES = (KimiLinear(),)
