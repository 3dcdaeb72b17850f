"""What every family module fills in: config.json -> ModelConfig, HF tensor names -> params.

A family reads the fields it names in `honoured`, ignores those in `inert` (dropout,
init ranges, ids that change no number), accepts those in `fixed` only at the value given
there, and refuses every other field by name unless it is empty (None, false, [], {}):
a checkpoint is never loaded with a field that would silently change its math. Keys that
start with "_" are transformers' own bookkeeping (`_name_or_path`, `_attn_implementation_autoset`,
`_commit_hash`), not the model's math: never refused, in every family (one that carries
math is read by name, as Gemma 3's transformers-4 `_sliding_window_pattern`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from jaxfill.models.config import DTYPES, ConfigError, as_tuple, freeze
from jaxfill.models.rope import ROPE_TYPES

# Fields of every transformers config that change no number of the forward.
COMMON_INERT = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "use_cache",
    "initializer_range", "attention_dropout", "pad_token_id", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type", "tokenizer_class",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "pruned_heads", "torchscript", "task_specific_params",
    "finetuning_task", "prefix", "sep_token_id", "decoder_start_token_id", "tie_encoder_decoder",
    "output_scores", "return_dict_in_generate", "num_labels", "auto_map", "torch_dtype", "dtype",
    "embedding_dropout", "residual_dropout", "resid_pdrop", "embd_pdrop", "layerdrop",
})
# Fields every family reads (Family.common_fields).
COMMON_READ = frozenset({
    "bos_token_id", "eos_token_id", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_theta", "rope_scaling",
    "rope_parameters",
})


class HFTensor(NamedTuple):
    """Where an HF tensor goes: param path, its HF shape, and the param as a view of it
    (rows `rows` of the stored array, reshaped to `stored_shape`, transposed by `perm`).
    `rows` cuts one part out of a fused tensor (Phi-3's qkv_proj, gate_up_proj). `stack`
    places the tensor as one entry of a param stacked from several (a MoE layer's experts):
    per stacked axis of the param, (its position in the param, this tensor's index, count)."""
    param_path: tuple
    hf_shape: tuple
    stored_shape: tuple
    perm: tuple
    rows: tuple | None = None  # (start, stop) on the stored axis 0
    stack: tuple = ()  # ((param axis, index, count), ...), outermost first


# What tests/test_family_parity.py, test_family_layouts*.py and test_weight_quant.py show
# for each family added with the registry.
FAMILY_TESTED = ("HF f32 logits and greedy tokens, bf16 at the noise floor; chunked = prefix-cached = "
                 "tensor 2 = sequence 2 = scan = stage 2 through the Engine; int8 weights + int8 KV run")


class Family:
    """One family of HF architectures; subclasses override what differs."""

    name = "llama"
    architectures: tuple[str, ...] = ()
    honoured: frozenset = frozenset()  # read beyond the shapes every family reads
    inert: frozenset = frozenset()
    fixed: dict[str, Any] = {}  # accepted only at this value
    depends: dict[str, dict] = {}  # honoured fields that count only beside these values (for tests)
    rope_types: tuple[str, ...] = ROPE_TYPES
    partial_rotary = False  # honours partial_rotary_factor (model_fields reads it into rotary_dim)
    # What its models hold: the capability table (engine/capabilities/table.py) derives what runs
    # on them from these, never from a hand-written list.
    mixers: tuple[str, ...] = ("attention",)  # attention | mla | gated_deltanet | mamba2 | kda
    experts = False  # mixture-of-experts MLPs
    indexer = False  # DeepSeek sparse attention's lightning indexer over MLA (kind "dsa")
    mixed_kv = False  # attention layers of two shapes (Gemma 4's global layers: ModelConfig.mixed_kv)
    shortcut = False  # a MoE whose output skips to the next layer (kind "shortcut", models/shortcut_decoder.py)
    multimodal_rope = False  # (t, h, w) positions and image rows (kind "mrope", engine/vision/)
    tested = ""  # what the parity tests show, for `jaxfill models` and the README table

    # --- config.json -> ModelConfig ------------------------------------------------
    def model_defaults(self, hidden_size: int) -> dict[str, Any]:
        """The ModelConfig fields that make a model of this family (a TOML [model] section
        naming only the architecture and shapes gets these)."""
        return {}

    def model_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The family's own ModelConfig fields (beyond `common_fields`)."""
        return {}

    def to_model_config(self, hf: dict[str, Any], architecture: str):
        from jaxfill.models.config import ModelConfig

        self.check_fields(hf)
        fields = self.common_fields(hf)
        fields.update(self.model_fields(hf))
        return ModelConfig.of(architecture=architecture, **fields)

    def check_fields(self, hf: dict[str, Any]) -> None:
        for key, value in hf.items():
            if key.startswith("_") or key in self.honoured or key in self.inert or key in COMMON_INERT \
                    or key in COMMON_READ:
                continue
            if key in self.fixed:
                if value != self.fixed[key] and not (value is None and self.fixed[key] in (None, False)):
                    raise ConfigError(f"config.json {key}={value!r} is not supported for {self.name} "
                                      f"(only {self.fixed[key]!r})")
                continue
            if value in (None, False, [], {}):
                continue
            raise ConfigError(f"config.json field {key!r} (= {value!r}) is not understood for {self.name}; "
                              "jaxfill refuses what it cannot reproduce")

    def common_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}")
        heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
        theta, scaling = self.rope(hf)
        dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").replace("torch.", "")
        context = hf.get("max_position_embeddings", 2048)
        if scaling and scaling["rope_type"] == "longrope" and self.longrope_caps_context(hf):
            context = min(context, scaling["original_max_position_embeddings"])  # models/rope.py
        return dict(
            vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"], num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rope_theta=float(theta), rope_scaling=freeze(scaling) if scaling else None,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=context,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=dtype if dtype in DTYPES else "float32",
            bos_token_id=hf.get("bos_token_id"), eos_token_id=as_tuple(hf.get("eos_token_id")),
            tokenizer="hf",
        )

    def rope(self, hf: dict[str, Any], rope: dict | None = None) -> tuple[float, dict | None]:
        """(theta, scaling or None) from transformers-5 `rope_parameters` or -4 `rope_theta`
        + `rope_scaling`; a type this family does not implement is refused by name."""
        rope = rope if rope is not None else (hf.get("rope_parameters") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0) and not self.partial_rotary:
            raise ConfigError(f"config.json partial_rotary_factor={partial!r} is not supported for {self.name} "
                              "(only 1.0: rope over the whole head)")
        scaling = hf.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") not in ("default", None):
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling is None:
            return theta, None
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in ("default", None):
            return theta, None
        if kind not in self.rope_types:
            raise ConfigError(f"rope scaling type {kind!r} is not supported for {self.name} "
                              f"(supported: {', '.join(t for t in self.rope_types if t != 'default')})")
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        scaling["rope_type"] = kind
        scaling.pop("type", None)
        if kind == "yarn":  # the context it was trained at, as transformers reads it
            scaling.setdefault("original_max_position_embeddings",
                               hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings"))
        if kind == "longrope":
            scaling = longrope_scaling(hf, scaling)
        return theta, scaling

    def longrope_caps_context(self, hf: dict[str, Any]) -> bool:
        """Whether transformers turns this family's longrope differently past
        original_max_position_embeddings (the long factors, for the whole sequence), so the
        context stops there."""
        return True

    # --- HF tensors -> params --------------------------------------------------------
    prefix = "model."
    norm_names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}

    def tensors(self, config) -> dict[str, HFTensor | tuple[HFTensor, ...]]:
        """HF tensor name -> HFTensor (a tuple of parts for a fused tensor). HF Linear
        weights are [out, in]; params are [in, ...]."""
        c, pre = config, self.prefix
        e = c.hidden_size
        table = {
            pre + "embed_tokens.weight": same(("embed", "embedding"), (c.vocab_size, e)),
            pre + "norm.weight": same(("norm", "weight"), (e,)),
        }
        if not c.embeddings.tied and c.embeddings.head:
            table["lm_head.weight"] = HFTensor(("lm_head",), (c.vocab_size, e), (c.vocab_size, e), (1, 0))
        if c.pooling.num_labels:
            table["score.weight"] = HFTensor(("score",), (c.pooling.num_labels, e), (c.pooling.num_labels, e), (1, 0))
        if c.embeddings.head_bias:
            table["lm_head.bias"] = same(("lm_head_bias",), (c.vocab_size,))
        if c.norms.kind == "layer":  # LayerNorms carry a bias
            table[pre + "norm.bias"] = same(("norm", "bias"), (e,))
        for n in range(c.num_layers):
            table.update(self.layer_tensors(c, f"{pre}layers.{n}.", ("layers", n)))
        return table

    def layer_tensors(self, c, p: str, layer: tuple) -> dict:
        e, d, hq, hk = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
        table = {
            **self.attention_tensors(c, p, layer),
            **self.mlp_tensors(c, p, layer),
            **{p + hf + ".weight": same(layer + (ours, "weight"), (e,)) for ours, hf in self.norm_names.items()},
        }
        if c.norms.kind == "layer":
            table.update({p + hf + ".bias": same(layer + (ours, "bias"), (e,)) for ours, hf in self.norm_names.items()})
        a = layer + ("attn",)
        if c.attention.qk_norm == "head":
            table[p + "self_attn.q_norm.weight"] = same(a + ("q_norm", "weight"), (d,))
            table[p + "self_attn.k_norm.weight"] = same(a + ("k_norm", "weight"), (d,))
        elif c.attention.qk_norm == "projection":
            table[p + "self_attn.q_norm.weight"] = HFTensor(a + ("q_norm", "weight"), (hq * d,), (hq, d), (0, 1))
            table[p + "self_attn.k_norm.weight"] = HFTensor(a + ("k_norm", "weight"), (hk * d,), (hk, d), (0, 1))
        if c.attention.bias:
            table.update({
                p + "self_attn.q_proj.bias": HFTensor(a + ("q_bias",), (hq * d,), (hq, d), (0, 1)),
                p + "self_attn.k_proj.bias": HFTensor(a + ("k_bias",), (hk * d,), (hk, d), (0, 1)),
                p + "self_attn.v_proj.bias": HFTensor(a + ("v_bias",), (hk * d,), (hk, d), (0, 1)),
            })
        if c.attention.out_bias:
            table[p + "self_attn.o_proj.bias"] = same(a + ("o_bias",), (e,))
        return table

    def attention_tensors(self, c, p: str, layer: tuple) -> dict:
        e, d, hq, hk = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
        a = layer + ("attn",)
        return {  # [H*D, E] stored as [H, D, E] -> [E, H, D]; o: [E, H*D] as [E, H, D] -> [H, D, E]
            p + "self_attn.q_proj.weight": HFTensor(a + ("q",), (hq * d, e), (hq, d, e), (2, 0, 1)),
            p + "self_attn.k_proj.weight": HFTensor(a + ("k",), (hk * d, e), (hk, d, e), (2, 0, 1)),
            p + "self_attn.v_proj.weight": HFTensor(a + ("v",), (hk * d, e), (hk, d, e), (2, 0, 1)),
            p + "self_attn.o_proj.weight": HFTensor(a + ("o",), (e, hq * d), (e, hq, d), (1, 2, 0)),
        }

    def mlp_tensors(self, c, p: str, layer: tuple) -> dict:
        e, i = c.hidden_size, c.intermediate_size
        m = layer + ("mlp",)
        return {
            p + "mlp.gate_proj.weight": HFTensor(m + ("gate",), (i, e), (i, e), (1, 0)),
            p + "mlp.up_proj.weight": HFTensor(m + ("up",), (i, e), (i, e), (1, 0)),
            p + "mlp.down_proj.weight": HFTensor(m + ("down",), (e, i), (e, i), (1, 0)),
        }

    def ungated_mlp_tensors(self, c, p: str, layer: tuple) -> dict:
        """The ungated MLP's up_proj and down_proj (mlp_gated = False), and xIELU's scalars
        (`mlp.act_fn.*`) where hidden_act is xielu."""
        e, i = c.hidden_size, c.intermediate_size
        m = layer + ("mlp",)
        table = {
            p + "mlp.up_proj.weight": HFTensor(m + ("up",), (i, e), (i, e), (1, 0)),
            p + "mlp.down_proj.weight": HFTensor(m + ("down",), (e, i), (e, i), (1, 0)),
        }
        if c.hidden_act == "xielu":
            table.update({p + f"mlp.act_fn.{name}": same(m + ("act_fn", name), shape)
                          for name, shape in (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()), ("eps", ()))})
        return table

    ignored_tensors: tuple[str, ...] = ("rotary_emb.inv_freq",)  # name suffixes never loaded
    ignored_prefixes: tuple[str, ...] = ()  # e.g. a vision tower beside the text model

    def skipped_prefixes(self, config, hf: dict) -> tuple[str, ...]:
        """Tensor name prefixes the loader skips: the family's, plus what this checkpoint's
        config.json (`hf`, {} when absent) announces beside the model."""
        return self.ignored_prefixes

    def stored_layout(self, name: str, shape: tuple, parts: tuple) -> tuple:
        """The parts of tensor `name` as stored with `shape`: the table's, unless the family
        reads a second layout of it (Qwen3-VL-MoE's fused experts, models/families/qwen3_vl.py)."""
        return parts

    def model_class(self):
        from jaxfill.models.decoder import Decoder

        return Decoder


def longrope_scaling(hf: dict[str, Any], scaling: dict) -> dict:
    """LongRoPE as models/rope.py turns it: the short factors, and the attention factor
    transformers derives (from `factor`, else max_position_embeddings / original); the long
    factors serve only past original_max_position_embeddings, where the context is capped."""
    original = scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if not original or not scaling.get("short_factor"):
        raise ConfigError("rope scaling type 'longrope' needs short_factor and original_max_position_embeddings")
    scaling = dict(scaling, original_max_position_embeddings=int(original),
                   short_factor=tuple(float(v) for v in scaling["short_factor"]))
    if scaling.get("attention_factor") is None:
        factor = scaling.get("factor") or hf.get("max_position_embeddings", original) / original
        scaling["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    scaling.pop("long_factor", None)
    return scaling


def text_tower_config(hf: dict[str, Any], architecture: str, tie_default: bool, outer_tie: bool = False) -> dict:
    """An image-text checkpoint's `text_config` with the top-level fields its text tower
    reads: the tie of the embeddings (the outer one wins with `outer_tie`, where transformers
    follows it), the special tokens and the dtype."""
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ConfigError(f"{architecture} config.json has no text_config")
    tie = hf.get("tie_word_embeddings", tie_default)
    text["tie_word_embeddings"] = bool(tie) if outer_tie else text.get("tie_word_embeddings", tie)
    for key in ("bos_token_id", "eos_token_id", "dtype", "torch_dtype"):
        if key in hf and key not in text:
            text[key] = hf[key]
    return text


def head_under(table: dict, prefix: str) -> dict:
    """The tensor table with the LM head stored under `prefix` (image-text checkpoints)."""
    if "lm_head.weight" in table:
        table[prefix + "lm_head.weight"] = table.pop("lm_head.weight")
    return table


def same(path: tuple, shape: tuple) -> HFTensor:
    return HFTensor(path, shape, shape, tuple(range(len(shape))))


def layer_types_from(hf: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """transformers-5 `layer_types` ("full_attention" / "sliding_attention") -> ours."""
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    types = hf.get("layer_types")
    if not types:
        return ()
    bad = sorted(set(types) - set(names))
    if bad:
        raise ConfigError(f"config.json layer_types {bad} are not supported (only {sorted(names)})")
    if len(types) != num_layers:
        raise ConfigError(f"config.json layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(names[t] for t in types)


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# Activations of the ungated MLP only (a family names those it accepts): squared ReLU, and
# xIELU with its learned per-layer parameters (models/layers.py)
UNGATED_ACTIVATIONS = {"relu2": "relu2", "xielu": "xielu"}


def activation(hf: dict[str, Any], key: str = "hidden_act", default: str = "silu", extra: tuple[str, ...] = ()) -> str:
    """The ModelConfig activation of `hf[key]`; `extra` names UNGATED_ACTIVATIONS the family accepts."""
    known = {**ACTIVATIONS, **{name: UNGATED_ACTIVATIONS[name] for name in extra}}
    name = hf.get(key) or default
    if name not in known:
        raise ConfigError(f"config.json {key}={name!r} is not supported (supported: {', '.join(known)})")
    return known[name]


def layer_type_ropes(family: Family, hf: dict[str, Any]) -> tuple[float, dict | None, float] | None:
    """transformers-5 `rope_parameters` given per layer type (`{"full_attention": {...},
    "sliding_attention": {...}}`, Gemma 3, OLMo 3): (the full layers' theta, their scaling,
    the sliding layers' theta); None when the file holds one rope for every layer. A scaled
    rope on sliding layers is refused (ModelConfig's local rope is unscaled)."""
    rope = hf.get("rope_parameters") or {}
    if "full_attention" not in rope and "sliding_attention" not in rope:
        return None
    theta, scaling = family.rope(hf, rope.get("full_attention") or {})
    local_theta, local_scaling = family.rope(hf, rope.get("sliding_attention") or {})
    if local_scaling:
        raise ConfigError(f"{family.name}: a scaled rope on sliding layers is not supported")
    return theta, scaling, local_theta


# Qwen2/Qwen3-style sliding fields count only together (for the field walker's test).
SLIDING_DEPENDS = {
    "use_sliding_window": {"sliding_window": 16, "max_window_layers": 1},
    "sliding_window": {"use_sliding_window": True, "max_window_layers": 1},
    "max_window_layers": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    "layer_types": {"use_sliding_window": True, "sliding_window": 16},
}


def sliding_layers(hf: dict[str, Any], num_layers: int, first_sliding: int = 0) -> tuple[str, ...]:
    """Qwen2/Qwen3-style `use_sliding_window` (layers from `max_window_layers` on slide),
    unless the file spells `layer_types` out."""
    types = layer_types_from(hf, num_layers)
    if types or not hf.get("use_sliding_window"):
        return types
    first = hf.get("max_window_layers", first_sliding)
    return tuple("sliding" if n >= first else "full" for n in range(num_layers))


def window_fields(types: tuple[str, ...], window: int | None) -> dict[str, Any]:
    """layer_types and sliding_window for ModelConfig: () when every layer is alike."""
    if "sliding" not in types or not window:
        return dict(layer_types=(), sliding_window=None)
    return dict(layer_types=types if "full" in types else (), sliding_window=int(window))
