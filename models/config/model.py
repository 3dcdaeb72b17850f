"""Model shape and numerics, independent of how the model is served.

`ModelConfig` is the one description of a decoder of any registered family: the shapes
every layer shares at the top, and what varies by family in sections
(models/config/sections.py): `attention`, `mla`, `moe`, `linear`, `norms`, `embeddings`.
It knows no family: the registry (models/families/registry.py) builds it from a TOML
`[model]` section or a Hugging Face `config.json` through flat keys (`FLAT_KEYS`), the
names users write; `of(**flat)` and `replace(**flat)` take the same names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxfill.models.config.errors import ConfigError
from jaxfill.models.config.sections import (AttentionConfig, EmbeddingConfig, LinearConfig, MLAConfig, MoEConfig,
                                            NormConfig)
from jaxfill.models.config.pooling import PoolingConfig

DTYPES = ("float32", "bfloat16", "float16")  # jax.numpy names; jax is imported only when one is used
# auto: projections stored in `dtype`; int8: see models/quant.py; fp8_block: kept as an FP8
# checkpoint stores them, with a scale per weight_block_size block (models/fp8_block.py);
# int_group: AWQ / GPTQ / compressed-tensors integer codes kept packed (models/int_group.py)
WEIGHT_DTYPES = ("auto", "int8", "fp8_block", "int_group")
WEIGHT_FP8 = ("float8_e4m3fn", "float8_e5m2")
# relu2: relu(x)^2 (Nemotron-H's MLP); xielu: xIELU with learned per-layer scalars (Apertus),
# in the ungated dense MLP only (models/layers.py)
ACTIVATIONS = ("silu", "gelu_tanh", "relu2", "xielu")

SECTIONS = {"attention": AttentionConfig, "mla": MLAConfig, "moe": MoEConfig, "linear": LinearConfig,
            "norms": NormConfig, "embeddings": EmbeddingConfig, "pooling": PoolingConfig}
# flat key (TOML [model], --set model.x, a family's model_fields) -> (section, field); a
# key a section names as it is (rope_theta, num_experts) is added below
RENAMED = {
    "attention_bias": ("attention", "bias"), "attention_out_bias": ("attention", "out_bias"),
    "attn_soft_cap": ("attention", "soft_cap"), "attention_sinks": ("attention", "sinks"),
    "attn_output_gate": ("attention", "output_gate"), "mla_form": ("mla", "form"),
    "mla_head_gate": ("mla", "head_gate"),
    "mla_latent_scale": ("mla", "latent_scale"), "moe_shortcut": ("moe", "shortcut"),
    "attn_gate_proj": ("attention", "gate_proj"),
    "moe_intermediate_size": ("moe", "intermediate_size"), "router_scoring": ("moe", "scoring"),
    "router_renormalize": ("moe", "renormalize"), "router_renormalize_min": ("moe", "renormalize_min"),
    "router_renormalize_eps": ("moe", "renormalize_eps"),
    "router_bias": ("moe", "selection_bias"), "router_weights_inputs": ("moe", "weights_inputs"),
    "moe_beside_dense": ("moe", "beside_dense"),
    "router_groups": ("moe", "groups"), "router_topk_groups": ("moe", "topk_groups"),
    **{"linear_" + f: ("linear", f) for f in ("layers", "kind", "impl", "num_key_heads", "num_value_heads",
                                              "key_head_dim", "value_head_dim", "conv_kernel", "grouped_proj",
                                              "conv_bias", "dt_limit", "full_rank_gates",
                                              "gate_lower_bound", "parallel", "in_scale", "out_scale",
                                              "part_scales", "gated_norm", "out_bias")},
    "key_scale": ("attention", "key_scale"), "attention_in_scale": ("attention", "in_scale"),
    "attention_out_scale": ("attention", "out_scale"),
    "rms_norm_eps": ("norms", "eps"), "norm_kind": ("norms", "kind"), "norm_layout": ("norms", "layout"),
    "tie_word_embeddings": ("embeddings", "tied"), "embed_scale": ("embeddings", "scale"),
    "lm_head_bias": ("embeddings", "head_bias"), "has_lm_head": ("embeddings", "head"),
    "pooling": ("pooling", "mode"), "normalize_embeddings": ("pooling", "normalize"),
}
FLAT_KEYS = {**{f.name: (section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
                if (section, f.name) not in RENAMED.values()}, **RENAMED}
TUPLE_KEYS = ("weight_block_size", "mlp_scales", "linear_part_scales", "layer_types", "nope_layers", "dense_layers",
              "linear_layers", "no_mlp_layers", "no_mixer_layers", "mrope_section",
              "score_token_ids")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 320
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    mlp_gated: bool = True  # act(x W_gate) * (x W_up) -> W_down; False: act(x W_up) -> W_down
    residual_scale: float = 1.0  # each block's output times this before the residual add (Granite)
    # the gated MLP's gate pre-activation and its output times these (Falcon-H1's mlp_multipliers)
    mlp_scales: tuple[float, float] = (1.0, 1.0)
    layer_scalar: bool = False  # each layer's output times its own learned scalar (Gemma 4)
    # Gemma 4's "E" models (models/per_layer_inputs.py): each layer adds a gated input of this
    # width from a per-layer embedding table (of per_layer_vocab_size rows, 0: vocab_size)
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # ... and their last kv_shared_layers layers attend over the K/V of the last earlier layer
    # of their type (its pages), writing none; their MLP twice as wide with double_wide_shared_mlp
    kv_shared_layers: int = 0
    double_wide_shared_mlp: bool = False
    # Single-block layers (Nemotron-H): a layer is its mixer (attention or linear) and its MLP,
    # each behind its norm, unless named here; an MLP-only layer holds no cache entry (None)
    no_mlp_layers: tuple[int, ...] = ()
    no_mixer_layers: tuple[int, ...] = ()
    # multi-token-prediction layers after the last one (DeepSeek-V3 / GLM-4.5's
    # num_nextn_predict_layers); run_mtp: build and load the first as a speculative proposer
    # (models/mtp.py; set by speculative.method = "mtp"), with one more KV cache entry
    mtp_layers: int = 0
    run_mtp: bool = False
    attention: AttentionConfig = AttentionConfig()
    mla: MLAConfig = MLAConfig()
    moe: MoEConfig = MoEConfig()
    linear: LinearConfig = LinearConfig()
    norms: NormConfig = NormConfig()
    embeddings: EmbeddingConfig = EmbeddingConfig()
    pooling: PoolingConfig = PoolingConfig()
    dtype: str = "float32"  # parameter and activation dtype
    # projection weights: "auto" (= dtype), "int8" (w8a16, per-channel f32 scales), "fp8_block"
    weight_dtype: str = "auto"
    weight_fp8: str = "float8_e4m3fn"  # fp8_block: the fp8 format the projections are kept in
    # an fp8 checkpoint's scale blocks (outputs, inputs); 0: the whole axis (compressed-tensors channel / tensor)
    weight_block_size: tuple[int, int] = (128, 128)
    # int_group (from quantization_config, models/config/int_quantization.py): bits a code, inputs
    # a group (-1: one group per output channel), stored zero points, GPTQ act order (g_idx)
    weight_bits: int = 4
    weight_group_size: int = 128
    weight_zero_point: bool = True
    weight_act_order: bool = False
    weight_int_scope: str = "all"  # int_group: "all" projections, or "experts" (the rest unquantized)
    # int_group: projections kept in another form, "name:bits:group:zero_point,..." (a GGUF's
    # mix of types, e.g. Q4_K_M's "v:8:16:1,down:8:16:1"; models/gguf/int_codes.py)
    weight_int_forms: str = ""
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    tokenizer: str = "byte"  # "byte" or "hf" (tokenizer.json beside the weights)
    seed: int = 0  # random init when no checkpoint is given

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"model.weight_dtype must be one of {list(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        if self.weight_fp8 not in WEIGHT_FP8:
            raise ConfigError(f"model.weight_fp8 must be one of {list(WEIGHT_FP8)}, got {self.weight_fp8!r}")
        if len(self.weight_block_size) != 2 or min(int(b) for b in self.weight_block_size) < 0:
            raise ConfigError(f"model.weight_block_size must be two sizes (0: the whole axis), got "
                              f"{list(self.weight_block_size)}")
        if self.weight_int_scope not in ("all", "experts"):
            raise ConfigError(f"model.weight_int_scope must be all or experts, got {self.weight_int_scope!r}")
        if self.weight_bits not in (4, 8):
            raise ConfigError(f"model.weight_bits must be 4 or 8, got {self.weight_bits!r}")
        if self.weight_group_size != -1 and (self.weight_group_size <= 0 or self.weight_group_size % 2):
            raise ConfigError(f"model.weight_group_size must be -1 (per output channel) or a positive even size, "
                              f"got {self.weight_group_size!r}")
        from jaxfill.models.int_group import parse_forms

        try:
            parse_forms(self.weight_int_forms)
        except ValueError as e:
            raise ConfigError(f"model.weight_int_forms = {self.weight_int_forms!r}: {e}") from None
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"model.hidden_act must be one of {list(ACTIVATIONS)}, got {self.hidden_act!r}")
        if self.hidden_act == "xielu" and (self.mlp_gated or self.moe.num_experts):
            raise ConfigError("model.hidden_act = xielu (learned parameters per layer) needs mlp_gated = false "
                              "and no experts")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads ({self.num_heads}) must be a multiple of "
                f"model.num_kv_heads ({self.num_kv_heads})"
            )
        if len(self.mlp_scales) != 2 or (tuple(self.mlp_scales) != (1.0, 1.0)
                                         and (not self.mlp_gated or self.moe.num_experts)):
            raise ConfigError(f"model.mlp_scales must be two multipliers (gate, down) of a dense gated MLP, got "
                              f"{list(self.mlp_scales)} (mlp_gated = {self.mlp_gated}, "
                              f"num_experts = {self.moe.num_experts})")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim must be even (rotary pairs), got {self.head_dim}")
        self._check_sections_fit()
        for name, layers in self.layer_lists().items():
            bad = [n for n in layers if not 0 <= n < self.num_layers]
            if bad:
                raise ConfigError(f"model.{name} {bad} are not layers of a {self.num_layers}-layer model")

    def _check_sections_fit(self):
        """What a section cannot check alone: its fields against the model's shapes."""
        a, mla = self.attention, self.mla
        if not (self.embeddings.head or self.pooling.enabled):
            raise ConfigError("a model without an LM head (has_lm_head = false, untied) can only embed or score: "
                              "set model.pooling (last, mean or cls)")
        if mla.enabled:
            want = dict(num_kv_heads=1, head_dim=mla.entry_width)
            bad = {k: getattr(self, k) for k, v in want.items() if getattr(self, k) != v}
            if a.rotary_dim != mla.qk_rope_head_dim:
                bad["rotary_dim"] = a.rotary_dim
            if bad:
                raise ConfigError(f"an MLA model (kv_lora_rank={mla.kv_lora_rank}) needs "
                                  f"{dict(want, rotary_dim=mla.qk_rope_head_dim)}; got {bad}")
        if a.rotary_dim and (a.rotary_dim % 2 or not 0 < a.rotary_dim <= self.head_dim):
            raise ConfigError(f"model.rotary_dim must be even and in (0, head_dim={self.head_dim}], "
                              f"got {a.rotary_dim}")
        if a.layer_types and len(a.layer_types) != self.num_layers:
            raise ConfigError(f"model.layer_types must name one type per layer ({self.num_layers}), "
                              f"got {list(a.layer_types)}")
        if self.norms.kind == "layer" and (a.qk_norm != "none" or mla.enabled or self.linear.layers):
            raise ConfigError("model.norm_kind = layer (LayerNorm) is for the blocks' norms: it does not combine "
                              "with qk_norm, MLA or linear layers, whose norms are RMSNorms")
        if (a.global_head_dim or a.global_kv_heads or a.global_k_eq_v) and (mla.enabled or a.rotary_dim):
            raise ConfigError("model.global_head_dim / global_kv_heads / global_k_eq_v are for plain attention "
                              "(no MLA, rotary_dim = 0)")
        if self.num_heads % self.attention_dims(self.num_layers - 1, full=True)[0]:
            raise ConfigError(f"model.num_heads ({self.num_heads}) must be a multiple of model.global_kv_heads "
                              f"({self.attention.global_kv_heads})")
        if self.kv_shared_layers:
            if mla.enabled or self.linear.layers or self.no_mixer_layers or a.context_attention == "pass_kv":
                raise ConfigError("model.kv_shared_layers is for plain attention layers (no MLA, linear or "
                                  "MLP-only layers, context_attention not pass_kv)")
            if not 0 < self.kv_shared_layers < self.num_layers or None in map(self._kv_source, self.shared_layers):
                raise ConfigError(f"model.kv_shared_layers ({self.kv_shared_layers}) must leave an earlier layer of "
                                  "each of their types to read")
        if set(self.no_mixer_layers) & (set(self.no_mlp_layers) | set(self.linear.layers)):
            raise ConfigError(f"model.no_mixer_layers {list(self.no_mixer_layers)} must be neither no_mlp_layers "
                              f"{list(self.no_mlp_layers)} (a layer with no block) nor linear_layers")

    def layer_lists(self) -> dict[str, tuple[int, ...]]:
        """Every list of layer numbers, by its flat key."""
        return {"nope_layers": self.attention.nope_layers, "dense_layers": self.moe.dense_layers,
                "linear_layers": self.linear.layers, "no_mlp_layers": self.no_mlp_layers,
                "no_mixer_layers": self.no_mixer_layers}

    # --- flat keys in and out ----------------------------------------------------------
    @classmethod
    def of(cls, **flat) -> "ModelConfig":
        """From flat keys (`ModelConfig.of(num_experts=8, router_scoring="sigmoid")`)."""
        return cls.from_dict(flat)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """A TOML `[model]` section (flat keys) -> ModelConfig."""
        top = {f.name for f in dataclasses.fields(cls) if f.name not in SECTIONS}
        unknown = set(d) - top - set(FLAT_KEYS)
        if unknown:
            raise ConfigError(f"unknown [model] keys: {sorted(unknown)}; known: {sorted(flat_keys())}")
        d = _normalised(d)
        parts: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        for key in set(d) - top:
            section, name = FLAT_KEYS[key]
            parts[section][name] = d.pop(key)
        return cls(**d, **{s: SECTIONS[s](**v) for s, v in parts.items()})

    def replace(self, **flat) -> "ModelConfig":
        """A copy with these flat keys changed (`config.replace(linear_layers=())`)."""
        return type(self).from_dict({**self.flat(), **flat})

    def value(self, key: str):
        """One field by its flat key (`config.value("num_experts")`)."""
        if key in FLAT_KEYS:
            section, name = FLAT_KEYS[key]
            return getattr(getattr(self, section), name)
        if key in SECTIONS or not hasattr(self, key):
            raise KeyError(f"no [model] key {key!r}")
        return getattr(self, key)

    def flat(self) -> dict[str, Any]:
        """Every field by its flat key: what `from_dict` takes back."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in SECTIONS}
        for key, (section, name) in FLAT_KEYS.items():
            out[key] = getattr(getattr(self, section), name)
        return out

    # --- derived ------------------------------------------------------------------------
    @property
    def jnp_dtype(self):
        import jax.numpy as jnp

        return getattr(jnp, self.dtype)

    @property
    def weight_form(self):
        """How projections are stored: weight_dtype, or for fp8_block its format and blocks, for
        int_group its bits, groups, zero points and act order."""
        from jaxfill.models.fp8_block import Fp8Format
        from jaxfill.models.int_group import IntGroupFormat, parse_forms

        if self.weight_dtype == "int_group":
            return IntGroupFormat(int(self.weight_bits), int(self.weight_group_size), bool(self.weight_zero_point),
                                  bool(self.weight_act_order), self.weight_int_scope == "experts",
                                  parse_forms(self.weight_int_forms))
        if self.weight_dtype != "fp8_block":
            return self.weight_dtype
        return Fp8Format(self.weight_fp8, tuple(int(b) for b in self.weight_block_size))

    @property
    def rope_dim(self) -> int:
        """Dims of each head the rotary embedding turns."""
        return self.attention.rotary_dim or self.head_dim

    @property
    def kv_layers(self) -> int:
        """Layers that hold KV pages (a hybrid's linear layers hold a fixed state instead, its
        MLP-only layers nothing)."""
        return sum(self.attends(n) for n in range(self.num_layers)) - self.kv_shared_layers

    def attends(self, layer: int) -> bool:
        """Whether layer `layer` runs attention: an attention layer, or a linear layer that
        runs it beside its linear mixer (linear.parallel, Falcon-H1), whose cache entry holds
        pages and a state slot (models/linear_state.PagesAndState)."""
        if layer in self.no_mixer_layers:
            return False
        return layer not in self.linear.layers or self.linear.parallel

    def attention_dims(self, layer: int, full: bool | None = None) -> tuple[int, int]:
        """(KV heads, head dim) of attention layer `layer`: a "full" layer's own when the
        model gives full layers another shape (global_head_dim / global_kv_heads)."""
        a = self.attention
        if full is None:
            full = a.layer_window(layer) is None
        if not full:
            return self.num_kv_heads, self.head_dim
        return a.global_kv_heads or self.num_kv_heads, a.global_head_dim or self.head_dim

    @property
    def shared_layers(self) -> range:
        """The layers that read an earlier layer's K/V (Gemma 4's kv_shared_layers)."""
        return range(self.num_layers - self.kv_shared_layers, self.num_layers)

    def kv_source(self, layer: int) -> int | None:
        """The layer whose pages `layer` attends over, None when it writes its own."""
        return self._kv_source(layer) if layer in self.shared_layers else None

    def _kv_source(self, layer: int) -> int | None:
        window = self.attention.layer_window(layer)
        earlier = [n for n in range(self.num_layers - self.kv_shared_layers)
                   if self.attention.layer_window(n) == window]
        return earlier[-1] if earlier else None

    def kv_shapes(self) -> dict[tuple[int, int], int]:
        """{(KV heads, head dim): attention layers of that shape}: what the planner counts."""
        out: dict[tuple[int, int], int] = {}
        for n in range(self.num_layers):
            if self.attends(n) and self.kv_source(n) is None:
                out[self.attention_dims(n)] = out.get(self.attention_dims(n), 0) + 1
        return out

    @property
    def mixed_kv(self) -> bool:
        """Whether attention layers differ in shape (Gemma 4's global layers: their pages, or
        their V taken from K; its E models' layers reading others' pages, their per-layer
        inputs), so they neither stack nor share one page format."""
        a = self.attention
        kinds = {(self.attention_dims(n), a.global_k_eq_v and a.layer_window(n) is None)
                 for n in range(self.num_layers) if self.attends(n)}
        # layers reading others' pages, or a per-layer input: not stackable either
        return len(kinds) > 1 or bool(self.kv_shared_layers or self.per_layer_input_size)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


def flat_keys() -> set[str]:
    """Every key a `[model]` section may hold."""
    return {f.name for f in dataclasses.fields(ModelConfig) if f.name not in SECTIONS} | set(FLAT_KEYS)


def _normalised(d: dict[str, Any]) -> dict[str, Any]:
    """TOML and JSON values as the dataclasses hold them: tuples, frozen dicts, None windows."""
    d = dict(d)
    if d.get("rope_scaling") is not None and isinstance(d["rope_scaling"], dict):
        d["rope_scaling"] = freeze(d["rope_scaling"])
    if "eos_token_id" in d:
        d["eos_token_id"] = as_tuple(d["eos_token_id"])
    for name in TUPLE_KEYS:
        if name in d:
            d[name] = tuple(d[name])
    if d.get("linear_dt_limit") is not None:
        d["linear_dt_limit"] = tuple(float(v) for v in d["linear_dt_limit"])
    if d.get("sliding_window") in (0, -1):
        d["sliding_window"] = None
    return d


def freeze(d: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, v) for k, v in d.items() if not isinstance(v, (dict, list))))


def as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, (list, tuple)):
        return tuple(int(i) for i in x)
    return (int(x),)
