"""Gemma 4 text: Gemma 3's sandwich layer with plain-weight RMSNorms (w * x in f32), q/k
norms and a weightless V norm per head, softmax scale 1, a learned scalar on each layer's
output, and global ("full") layers that differ from the sliding ones: their own head dim
and KV heads, their V from the K projection (`attention_k_eq_v`), and the proportional
rope (a part of each half-head turned at the whole head's frequencies). The file gives
the global shape in either spelling: transformers' `per_layer_config` (overrides of
head_dim / num_key_value_heads on each full layer) or the hub's `global_head_dim` /
`num_global_key_value_heads` (the latter only with attention_k_eq_v, as transformers reads it).

`Gemma4ForConditionalGeneration` loads as its text tower (`model.language_model.`), the
vision tower loaded beside it by engine/vision/loading.py, the audio tower skipped. The MoE models' block (`enable_moe_block`): experts beside
the dense MLP in every layer (models/moe_beside_dense.py). The "E" models: per-layer inputs
(`hidden_size_per_layer_input`, models/per_layer_inputs.py) and their last
`num_kv_shared_layers` layers attending over the pages of the last earlier layer of their
type, holding none (twice-wide MLPs with `use_double_wide_mlp`). Refused by name:
bidirectional attention (`use_bidirectional_attention`, "vision" accepted for the text tower)."""

from __future__ import annotations

from jaxfill.models.config import ConfigError, freeze
from jaxfill.models.families.base import (
    Family, HFTensor, activation, layer_types_from, same, text_tower_config, window_fields,
)

GLOBAL_KEYS = ("head_dim", "num_key_value_heads")  # what a per_layer_config entry may override


class Gemma4(Family):
    name = "gemma4"
    architectures = ("Gemma4ForCausalLM",)
    honoured = frozenset({"hidden_activation", "attention_bias", "sliding_window", "layer_types",
                          "final_logit_softcapping", "attention_k_eq_v", "per_layer_config", "global_head_dim",
                          "num_global_key_value_heads", "enable_moe_block", "num_experts", "top_k_experts",
                          "moe_intermediate_size", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
                          "num_kv_shared_layers", "use_double_wide_mlp"})
    depends = {name: {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
               for name in ("num_experts", "top_k_experts", "moe_intermediate_size")}
    depends = {**depends, "vocab_size_per_layer_input": {"hidden_size_per_layer_input": 8},
               "num_kv_shared_layers": {"layer_types": ["sliding_attention", "full_attention"] * 2},
               "use_double_wide_mlp": {"num_kv_shared_layers": 1,
                                       "layer_types": ["sliding_attention", "full_attention"] * 2}}
    fixed = {"use_bidirectional_attention": None}
    rope_types = ("default", "linear", "proportional")
    partial_rotary = True  # read per layer type: proportional's factor only (model_fields)
    norm_names = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                  "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
    mixed_kv = True  # global layers hold pages of their own shape (engine/capabilities/table.py)
    experts = True  # the MoE checkpoints (enable_moe_block) share the architecture name with the dense ones
    tested = ("HF f32 logits and greedy tokens (global layers of their own head dim, KV heads and V = K; the MoE "
              "block; the E models' per-layer inputs and KV-sharing layers), bf16 at the noise floor; chunked = "
              "prefix-cached = tensor 2 = sequence 2 through the Engine (MoE: = expert 4 = expert 2 x tensor 2); "
              "int8 weights + int8 KV run")

    def layer_type_names(self, hf) -> tuple[str, ...]:
        """transformers' layer_types: by default 5 sliding : 1 full; the last layer always full."""
        layers = hf["num_hidden_layers"]
        types = list(layer_types_from(hf, layers) or ("full" if (n + 1) % 6 == 0 else "sliding"
                                                      for n in range(layers)))
        types[-1] = "full"
        return tuple(types)

    def global_dims(self, hf, types) -> tuple[int, int]:
        """(head dim, KV heads) of the full layers, from either spelling of the file."""
        head_dim, kv_heads = hf.get("head_dim") or 256, hf.get("num_key_value_heads") or hf["num_attention_heads"]
        if "per_layer_config" not in hf:
            global_kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
            return int(hf.get("global_head_dim", 512)), int(global_kv or kv_heads)
        try:
            overrides = {int(k): dict(v) for k, v in (hf["per_layer_config"] or {}).items()}
        except (TypeError, ValueError) as e:
            raise ConfigError(f"gemma4: per_layer_config must map layer numbers to overrides ({e})") from None
        full = [n for n, t in enumerate(types) if t == "full"]
        kinds = {tuple(sorted(overrides.get(n, {}).items())) for n in full}
        bad = sorted({k for v in overrides.values() for k in v} - set(GLOBAL_KEYS))
        if set(overrides) - set(full) or len(kinds) > 1 or bad:
            raise ConfigError("gemma4: per_layer_config must give every full_attention layer the same overrides "
                              f"of {list(GLOBAL_KEYS)} and no other layer any; got {hf['per_layer_config']}")
        one = dict(kinds.pop()) if kinds else {}
        return int(one.get("head_dim", head_dim)), int(one.get("num_key_value_heads", kv_heads))

    def ropes(self, hf):
        """(full layers' theta, their scaling, sliding layers' theta) from the per-type
        rope_parameters transformers always writes for Gemma 4."""
        rope = hf.get("rope_parameters") or {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
        if set(rope) - {"full_attention", "sliding_attention"}:
            raise ConfigError(f"gemma4: rope_parameters must be given per layer type, got {sorted(rope)}")
        for kind, params in rope.items():
            partial = params.get("partial_rotary_factor", 1.0)
            if partial not in (None, 1, 1.0) and params.get("rope_type") != "proportional":
                raise ConfigError(f"gemma4: {kind} partial_rotary_factor={partial} is supported with the "
                                  "proportional rope only")
        theta, scaling = self.rope(hf, rope.get("full_attention") or {})
        local_theta, local_scaling = self.rope(hf, rope.get("sliding_attention") or {})
        if local_scaling:
            raise ConfigError("gemma4: a scaled rope on sliding layers is not supported")
        return theta, scaling, local_theta

    def model_fields(self, hf):
        types = self.layer_type_names(hf)
        head_dim, kv_heads = hf.get("head_dim") or 256, hf.get("num_key_value_heads") or hf["num_attention_heads"]
        global_dim, global_kv = self.global_dims(hf, types)
        theta, scaling, local_theta = self.ropes(hf)
        bias = bool(hf.get("attention_bias", False))
        window = window_fields(types, hf.get("sliding_window"))
        return dict(
            self.model_defaults(hf["hidden_size"]),
            head_dim=head_dim, num_kv_heads=kv_heads,
            hidden_act=activation(hf, "hidden_activation", "gelu_pytorch_tanh"),
            attention_bias=bias, attention_out_bias=bias,
            final_soft_cap=float(hf["final_logit_softcapping"]) if hf.get("final_logit_softcapping") else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            rope_theta=float(theta), rope_scaling=freeze(scaling) if scaling else None,
            rope_local_theta=float(local_theta),
            global_head_dim=global_dim if global_dim != head_dim else 0,
            global_kv_heads=global_kv if global_kv != kv_heads else 0,
            global_k_eq_v=bool(hf.get("attention_k_eq_v")), **window, **self.moe_fields(hf),
            **self.e_model_fields(hf),
        )

    def e_model_fields(self, hf) -> dict:
        """The "E" models' per-layer inputs and KV-sharing layers (transformers' defaults:
        per-layer inputs 256 wide from a 262,144-row table)."""
        size, shared = int(hf.get("hidden_size_per_layer_input", 256) or 0), int(hf.get("num_kv_shared_layers") or 0)
        vocab = int(hf.get("vocab_size_per_layer_input", 262_144))
        types = self.layer_type_names(hf)
        first = len(types) - shared
        if shared and (first <= 0 or not set(types[first:]) <= set(types[:first])):
            raise ConfigError(f"gemma4: num_kv_shared_layers={shared} leaves no earlier layer of each type to read "
                              f"(layer types {list(types)})")
        return dict(per_layer_input_size=size, per_layer_vocab_size=vocab if size and vocab != hf["vocab_size"] else 0,
                    kv_shared_layers=shared, double_wide_shared_mlp=bool(shared and hf.get("use_double_wide_mlp")))

    def moe_fields(self, hf) -> dict:
        """The MoE block (every layer: experts beside the dense MLP), when enabled."""
        if not hf.get("enable_moe_block"):
            return {}
        missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if not hf.get(k)]
        if missing:
            raise ConfigError(f"gemma4: enable_moe_block needs {', '.join(missing)}")
        return dict(num_experts=int(hf["num_experts"]), experts_per_token=int(hf["top_k_experts"]),
                    moe_intermediate_size=int(hf["moe_intermediate_size"]), router_scoring="softmax",
                    router_renormalize=True, moe_beside_dense=True)

    def model_defaults(self, hidden_size):
        return dict(hidden_act="gelu_tanh", norm_kind="rms_f32", norm_layout="sandwich", qk_norm="head",
                    v_norm=True, query_scale=1.0, layer_scalar=True, embed_scale=float(hidden_size) ** 0.5,
                    tie_word_embeddings=True, image_limits_sliding_only=True)

    def common_fields(self, hf):  # rope_parameters (per layer type) are read in model_fields
        return super().common_fields({k: v for k, v in hf.items() if k != "rope_parameters"})

    def layer_tensors(self, c, p: str, layer: tuple) -> dict:
        n, e, hq = layer[1], c.hidden_size, c.num_heads
        hk, d = c.attention_dims(n)
        a = layer + ("attn",)
        table = {  # [H*D, E] stored as [H, D, E] -> [E, H, D]; o: [E, H*D] as [E, H, D] -> [H, D, E]
            p + "self_attn.q_proj.weight": HFTensor(a + ("q",), (hq * d, e), (hq, d, e), (2, 0, 1)),
            p + "self_attn.k_proj.weight": HFTensor(a + ("k",), (hk * d, e), (hk, d, e), (2, 0, 1)),
            p + "self_attn.o_proj.weight": HFTensor(a + ("o",), (e, hq * d), (e, hq, d), (1, 2, 0)),
            p + "self_attn.q_norm.weight": same(a + ("q_norm", "weight"), (d,)),
            p + "self_attn.k_norm.weight": same(a + ("k_norm", "weight"), (d,)),
            p + "layer_scalar": same(layer + ("layer_scalar",), (1,)),
            **(self.moe_block_tensors(c, p, layer) if c.moe.num_experts else self.mlp_tensors(c, p, layer)),
            **{p + hf + ".weight": same(layer + (ours, "weight"), (e,)) for ours, hf in self.norm_names.items()
               if not (c.moe.num_experts and ours == "mlp_norm")},
        }
        if c.per_layer_input_size:  # [P, H] -> [H, P]; [H, P] -> [P, H]
            size, b = c.per_layer_input_size, layer + ("per_layer",)
            table.update({
                p + "per_layer_input_gate.weight": HFTensor(b + ("input_gate",), (size, e), (size, e), (1, 0)),
                p + "per_layer_projection.weight": HFTensor(b + ("proj",), (e, size), (e, size), (1, 0)),
                p + "post_per_layer_input_norm.weight": same(b + ("norm", "weight"), (e,))})
        if c.kv_source(n) is not None:  # reads an earlier layer's K/V: no k, v or k norm of its own
            del table[p + "self_attn.k_proj.weight"], table[p + "self_attn.k_norm.weight"]
            if c.double_wide_shared_mlp:
                table.update(self.mlp_tensors(c.replace(intermediate_size=2 * c.intermediate_size), p, layer))
        elif not (c.attention.global_k_eq_v and c.attention.layer_window(n) is None):
            table[p + "self_attn.v_proj.weight"] = HFTensor(a + ("v",), (hk * d, e), (hk, d, e), (2, 0, 1))
        if c.attention.bias:
            table.update({p + f"self_attn.{x}_proj.bias": HFTensor(a + (f"{x}_bias",), (h * d,), (h, d), (0, 1))
                          for x, h in (("q", hq), ("k", hk), ("v", hk)) if p + f"self_attn.{x}_proj.weight" in table})
        if c.attention.out_bias:
            table[p + "self_attn.o_proj.bias"] = same(a + ("o_bias",), (e,))
        return table


    def tensors(self, config):
        table = super().tensors(config)
        if config.per_layer_input_size:  # the per-layer inputs' tables (models/per_layer_inputs.py)
            c, pre, width = config, self.prefix, config.num_layers * config.per_layer_input_size
            table.update({
                pre + "embed_tokens_per_layer.weight": same(("per_layer_inputs", "embed", "embedding"),
                                                            (c.per_layer_vocab_size or c.vocab_size, width)),
                pre + "per_layer_model_projection.weight": HFTensor(("per_layer_inputs", "projection"),
                                                                    (width, c.hidden_size), (width, c.hidden_size),
                                                                    (1, 0)),
                pre + "per_layer_projection_norm.weight": same(("per_layer_inputs", "norm", "weight"),
                                                               (c.per_layer_input_size,))})
        return table

    def moe_block_tensors(self, c, p: str, layer: tuple) -> dict:
        """The dense MLP and the experts of models/moe_beside_dense.py, with their norms."""
        e, i, n, m = c.hidden_size, c.moe.intermediate_size, c.moe.num_experts, layer + ("mlp",)
        dense = {hf: t._replace(param_path=m + ("dense",) + t.param_path[len(m):])
                 for hf, t in self.mlp_tensors(c, p, layer).items()}
        norms = {"dense_norm": "pre_feedforward_layernorm", "dense_post_norm": "post_feedforward_layernorm_1",
                 "experts_norm": "pre_feedforward_layernorm_2", "experts_post_norm": "post_feedforward_layernorm_2"}
        return {
            **dense,
            **{p + hf + ".weight": same(m + (ours, "weight"), (e,)) for ours, hf in norms.items()},
            p + "router.proj.weight": HFTensor(m + ("moe", "router"), (n, e), (n, e), (1, 0)),
            p + "router.scale": same(m + ("router_scale",), (e,)),
            p + "router.per_expert_scale": same(m + ("expert_scale",), (n,)),
            # [E, 2I, H] as [E, 2, I, H] -> [E, H, 2, I]; down [E, H, I] -> [E, I, H]
            p + "experts.gate_up_proj": HFTensor(m + ("moe", "experts_gate_up"), (n, 2 * i, e), (n, 2, i, e),
                                                 (0, 3, 1, 2)),
            p + "experts.down_proj": HFTensor(m + ("moe", "experts_down"), (n, e, i), (n, e, i), (0, 2, 1)),
        }


class Gemma4Multimodal(Gemma4):
    """The text tower of an image-text(-audio) checkpoint."""
    architectures = ("Gemma4ForConditionalGeneration",)
    prefix = "model.language_model."
    ignored_prefixes = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
    tested = ("HF parity f32 of the text tower (text-only prompts); images through the Engine (its vision tower, "
              "engine/vision/gemma4_tower.py) equal to transformers' greedy tokens and logprobs; the audio tower skipped")

    def to_model_config(self, hf, architecture):
        text = text_tower_config(hf, "Gemma4ForConditionalGeneration", tie_default=True)
        if text.get("use_bidirectional_attention") == "vision":  # image tokens only: text prompts are causal
            text["use_bidirectional_attention"] = None
        return super().to_model_config(text, architecture)


FAMILIES = (Gemma4(), Gemma4Multimodal())
