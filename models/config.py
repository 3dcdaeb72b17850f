"""Model shape and numerics, independent of how the model is served.

`ModelConfig` is the one description of a decoder of any registered family: the shapes,
and the few switches in which the families' math differs (norm kind and placement, q/k
norms, activation, soft caps, per-layer attention kinds). It knows no family: the
registry (models/families/registry.py) builds it from a TOML `[model]` section
(`config_from_dict`, which adds the family's switches) or a Hugging Face `config.json`
(`config_from_hf`, through the family `architectures[0]` names).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")  # jax.numpy names; jax is imported only when one is used
WEIGHT_DTYPES = ("auto", "int8")  # auto: projections stored in `dtype`; int8: see models/quant.py
CHOICES = {
    "hidden_act": ("silu", "gelu_tanh", "relu2"),  # relu2: relu(x)^2 (Nemotron-H's MLP)
    # rms: w * cast(x * rsqrt) (Llama); rms_f32: cast(w * x * rsqrt) (OLMo 2);
    # rms_one_plus: cast((1 + w) * x * rsqrt), all in f32 (Gemma)
    "norm_kind": ("rms", "rms_f32", "rms_one_plus"),
    # pre: norm before attention and MLP (Llama); sandwich: before and after both
    # (Gemma 2/3); post: after both only (OLMo 2)
    "norm_layout": ("pre", "sandwich", "post"),
    # head: RMSNorm over each head's D (Qwen3, Gemma 3); projection: over all Hq*D (OLMo 2)
    "qk_norm": ("none", "head", "projection"),
    "mla_form": ("auto", "absorbed", "expanded"),
    # softmax: softmax over experts, top k (Mixtral, Qwen3-MoE); sigmoid: sigmoid scores,
    # top k of score + bias within the best groups (DeepSeek-V3, GLM-4.5); topk_softmax:
    # top k of the logits, softmax over those k (gpt-oss); models/moe.py
    "router_scoring": ("softmax", "sigmoid", "topk_softmax"),
    # the rule of the linear layers: Gated DeltaNet (models/gated_deltanet.py, Qwen3.5) or
    # Mamba2's SSD (models/mamba2.py, Nemotron-H)
    "linear_kind": ("gated_deltanet", "mamba2"),
    # the linear layers' chunk loop: XLA's, or the Pallas TPU kernel (pallas_kernels/
    # gated_delta_rule_tpu.py, ssd_tpu.py); auto = xla until a TPU measurement says otherwise
    "linear_impl": ("auto", "xla", "pallas_tpu"),
    # mesh.sequence > 1 (models/parallel/context.py): pass_kv = the pass-KV ring for a step
    # with nothing cached (unquantized pages), pass-Q otherwise; pass_q = always pass-Q;
    # auto = pass_q until an accelerator measures the ring ahead (on CPU it is 2-17x
    # slower at 1k-8k tokens: benchmarks/context_modes.py)
    "context_attention": ("auto", "pass_q", "pass_kv"),
}
LAYER_TYPES = ("full", "sliding")


class ConfigError(ValueError):
    """A config value that cannot describe a runnable model."""


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
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen dict items
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    sliding_window: int | None = None  # the window of "sliding" layers (all layers if layer_types is empty)
    attention_bias: bool = False  # q/k/v bias (Qwen2; Llama/Qwen3 attention_bias)
    attention_out_bias: bool = False  # o bias (Llama/Qwen3/OLMo 2 attention_bias)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    norm_kind: str = "rms"
    norm_layout: str = "pre"
    qk_norm: str = "none"
    embed_scale: float = 1.0  # embeddings times this, rounded to dtype (Gemma: sqrt(E); Granite)
    residual_scale: float = 1.0  # each block's output times this before the residual add (Granite)
    logits_scale: float = 1.0  # logits times this (Granite: 1 / logits_scaling)
    query_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_soft_cap: float | None = None  # cap * tanh(score / cap) (Gemma 2)
    final_soft_cap: float | None = None  # the same on the logits
    layer_types: tuple[str, ...] = ()  # per layer "full" | "sliding"; () = every layer alike
    rope_local_theta: float | None = None  # rope base of "sliding" layers, unscaled (Gemma 3)
    nope_layers: tuple[int, ...] = ()  # layers without rotary embedding (SmolLM3)
    rotary_dim: int = 0  # rope over each head's first rotary_dim dims (partial rotary, GLM); 0: all
    attention_sinks: bool = False  # a learned per-head logit in each softmax denominator (gpt-oss)
    # Multi-head latent attention (models/mla.py, DeepSeek); kv_lora_rank = 0: not MLA. The
    # cache then holds one "head" per token: the normalised latent and the roped key,
    # head_dim = kv_lora_rank + qk_rope_head_dim, num_kv_heads = 1.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q straight from the hidden state (V2-Lite)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rope dims come in (even, odd) pairs (DeepSeek V3's layout)
    # absorbed: attend over the latent; expanded: K/V per head from it (models/mla_expanded.py);
    # auto: per step, whichever costs fewer multiply-adds for the batch's lengths
    mla_form: str = "auto"
    context_attention: str = "auto"  # under mesh.sequence: see the choices above
    # Linear-attention hybrids: these layers run a recurrent rule (linear_kind), a state per
    # sequence instead of attention over the KV cache. Mamba2 is linear attention with C as
    # the query, B as the key and x as the value, so the shapes below name both: for mamba2,
    # key heads = n_groups (B and C per group), key head dim = ssm_state_size, value heads =
    # the SSM heads, value head dim = their head_dim; the state is [value heads, Dk, Dv].
    linear_layers: tuple[int, ...] = ()
    linear_kind: str = "gated_deltanet"
    linear_impl: str = "auto"
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4  # the short causal convolution over q, k, v (Mamba2: x, B, C)
    linear_grouped_proj: bool = False  # q, k, v, z (and b, a) fused per key head (Qwen3-Next), not apart
    linear_conv_bias: bool = False  # the convolution adds a bias (Mamba2)
    linear_dt_limit: tuple[float, float] | None = None  # Mamba2's time steps clipped to [lo, hi]; None: not
    # Single-block layers (Nemotron-H): a layer is its mixer (attention or linear) and its MLP,
    # each behind its norm, unless named here; an MLP-only layer holds no cache entry (None)
    no_mlp_layers: tuple[int, ...] = ()
    no_mixer_layers: tuple[int, ...] = ()
    mlp_gated: bool = True  # act(x W_gate) * (x W_up) -> W_down; False: act(x W_up) -> W_down
    attn_output_gate: bool = False  # attention output times sigmoid(a per-head gate q_proj also gives) (Qwen3.5)
    # Mixture of experts (models/moe.py); num_experts = 0: every layer's MLP is dense
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # one expert's intermediate size
    dense_layers: tuple[int, ...] = ()  # layers with the dense MLP in a MoE model
    router_scoring: str = "softmax"
    router_renormalize: bool = True  # top-k weights divided by their sum
    router_bias: bool = False  # a per-expert correction bias on the selection scores (sigmoid)
    router_groups: int = 1  # experts in this many groups; only the best router_topk_groups are chosen from
    router_topk_groups: int = 1
    routed_scaling: float = 1.0  # the routed experts' weights times this
    router_f32: bool = False  # router weight and matmul in f32 whatever the dtype (DeepSeek, GLM)
    shared_expert_size: int = 0  # intermediate size of the always-on shared expert(s), 0: none
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(x @ w) (Qwen2-MoE)
    router_logit_bias: bool = False  # the router is x @ w + b (gpt-oss)
    expert_bias: bool = False  # every expert's gate/up and down projections have biases (gpt-oss)
    # gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate);
    # None: the plain hidden_act(gate) * up
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    dtype: str = "float32"  # parameter and activation dtype
    weight_dtype: str = "auto"  # projection weights: "auto" (= dtype) or "int8" (w8a16, per-channel f32 scales)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    tokenizer: str = "byte"  # "byte" or "hf" (tokenizer.json beside the weights)
    seed: int = 0  # random init when no checkpoint is given

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"model.weight_dtype must be one of {list(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads ({self.num_heads}) must be a multiple of "
                f"model.num_kv_heads ({self.num_kv_heads})"
            )
        if self.kv_lora_rank:
            want = dict(num_kv_heads=1, head_dim=self.kv_lora_rank + self.qk_rope_head_dim,
                        rotary_dim=self.qk_rope_head_dim)
            bad = {k: getattr(self, k) for k, v in want.items() if getattr(self, k) != v}
            if bad or not (self.qk_nope_head_dim > 0 and self.qk_rope_head_dim > 0 and self.v_head_dim > 0):
                raise ConfigError(f"an MLA model (kv_lora_rank={self.kv_lora_rank}) needs {want} and positive "
                                  f"qk_nope/qk_rope/v head dims; got {bad or 'zero head dims'}")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim must be even (rotary pairs), got {self.head_dim}")
        if self.rotary_dim and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ConfigError(f"model.rotary_dim must be even and in (0, head_dim={self.head_dim}], "
                              f"got {self.rotary_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"model.sliding_window must be positive, got {self.sliding_window}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ConfigError(f"model.layer_types must name {list(LAYER_TYPES)} once per layer "
                                  f"({self.num_layers}), got {list(self.layer_types)}")
            if "sliding" in self.layer_types and self.sliding_window is None:
                raise ConfigError("model.layer_types has sliding layers but model.sliding_window is not set")
        if self.linear_layers:
            dims = (self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                    self.linear_value_head_dim, self.linear_conv_kernel - 1)
            if min(dims) <= 0 or self.linear_num_value_heads % self.linear_num_key_heads:
                raise ConfigError("model.linear_layers needs positive linear_* head counts and dims (value heads "
                                  f"a multiple of key heads) and linear_conv_kernel >= 2; got {dims}")
        self._check_linear_kind()
        if set(self.no_mixer_layers) & (set(self.no_mlp_layers) | set(self.linear_layers)):
            raise ConfigError(f"model.no_mixer_layers {list(self.no_mixer_layers)} must be neither no_mlp_layers "
                              f"{list(self.no_mlp_layers)} (a layer with no block) nor linear_layers")
        for name in ("nope_layers", "dense_layers", "linear_layers", "no_mlp_layers", "no_mixer_layers"):
            bad = [n for n in getattr(self, name) if not 0 <= n < self.num_layers]
            if bad:
                raise ConfigError(f"model.{name} {bad} are not layers of a {self.num_layers}-layer model")
        if self.num_experts:
            self._check_moe()

    def _check_linear_kind(self):
        mamba = {"linear_conv_bias": self.linear_conv_bias, "linear_dt_limit": self.linear_dt_limit is not None}
        if self.linear_kind != "mamba2" and any(mamba.values()):
            raise ConfigError(f"model.{', '.join(k for k, on in mamba.items() if on)} apply to linear_kind mamba2 "
                              f"only, not {self.linear_kind}")
        if self.linear_kind == "mamba2" and self.linear_grouped_proj:
            raise ConfigError("model.linear_grouped_proj is Qwen3-Next's DeltaNet layout, not mamba2's")
        limit = self.linear_dt_limit
        if limit is not None and not (len(limit) == 2 and 0 <= limit[0] < limit[1]):
            raise ConfigError(f"model.linear_dt_limit must be [lo, hi] with 0 <= lo < hi, got {list(limit)}")

    def _check_moe(self):
        if self.num_experts < 0 or not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(f"model.experts_per_token must be in [1, num_experts={self.num_experts}], "
                              f"got {self.experts_per_token}")
        if self.moe_intermediate_size <= 0:
            raise ConfigError(f"model.moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        g, kg = self.router_groups, self.router_topk_groups
        if g < 1 or self.num_experts % g or not 1 <= kg <= g:
            raise ConfigError(f"model.router_groups ({g}) must divide num_experts ({self.num_experts}) and "
                              f"router_topk_groups ({kg}) be in [1, router_groups]")
        if g > 1 and (self.router_scoring != "sigmoid" or self.num_experts // g < 2):
            raise ConfigError("model.router_groups > 1 needs router_scoring = sigmoid and 2+ experts per group")
        if g > 1 and kg * self.num_experts // g < self.experts_per_token:
            raise ConfigError(f"the best {kg} of {g} expert groups hold fewer than experts_per_token experts")

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp

        return getattr(jnp, self.dtype)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def rope_dim(self) -> int:
        """Dims of each head the rotary embedding turns."""
        return self.rotary_dim or self.head_dim

    @property
    def kv_layers(self) -> int:
        """Layers that hold KV pages (a hybrid's linear layers hold a fixed state instead, its
        MLP-only layers nothing)."""
        return self.num_layers - len(self.linear_layers) - len(self.no_mixer_layers)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: full attention)."""
        if self.layer_types and self.layer_types[layer] == "full":
            return None
        return self.sliding_window

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown [model] keys: {sorted(unknown)}; known: {sorted(known)}")
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = freeze(d["rope_scaling"])
        if "eos_token_id" in d:
            d["eos_token_id"] = as_tuple(d["eos_token_id"])
        for name in ("layer_types", "nope_layers", "dense_layers", "linear_layers", "no_mlp_layers",
                     "no_mixer_layers"):
            if name in d:
                d[name] = tuple(d[name])
        if d.get("linear_dt_limit") is not None:
            d["linear_dt_limit"] = tuple(float(v) for v in d["linear_dt_limit"])
        if d.get("sliding_window") in (0, -1):
            d["sliding_window"] = None
        return cls(**d)


def read_config_json(path: str) -> dict[str, Any]:
    """A model directory (or its config.json) -> dict; every way it can be wrong is a ConfigError."""
    if not os.path.exists(path):
        raise ConfigError(f"model directory {path!r} does not exist")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{path!r} has no config.json: --model wants a Hugging Face model directory")
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return config


def freeze(d: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, v) for k, v in d.items() if not isinstance(v, (dict, list))))


def as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, (list, tuple)):
        return tuple(int(i) for i in x)
    return (int(x),)
