"""The parts of a model that vary by family, each its own small frozen dataclass.

A mixer or MLP reads its own section (`config.attention`, `config.mla`, `config.moe`,
`config.linear`), so a new family's switch lands in one section and the modules that read
it, and each section checks its own values. The flat names a TOML `[model]` section, a
`--set model.x=...` override and the families' `model_fields` use are mapped onto these
fields by `FLAT_KEYS` (models/config/model.py), so what users write does not change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxfill.models.config.errors import ConfigError

LAYER_TYPES = ("full", "sliding", "chunked")


def _choose(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"model.{name} must be one of {list(allowed)}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Softmax attention over the paged KV cache, and the rotary embedding it (and MLA) turns."""
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen dict items
    rope_local_theta: float | None = None  # rope base of "sliding" layers, unscaled (Gemma 3)
    # the rope dims come in (even, odd) pairs (DeepSeek V3's layout in MLA; GLM's and ERNIE 4.5's in attention)
    rope_interleave: bool = False
    # Qwen3-VL's multimodal rope: frequency i turns with the (t, h, w) position axis that its
    # section gives (interleaved: h at i % 3 == 1 below 3 * h, w at i % 3 == 2 below 3 * w, else t;
    # models/rope.py mrope_axes); () = one position per token. Text-only rows give t = h = w.
    mrope_section: tuple[int, ...] = ()
    rope_f32: bool = False  # q and k rotated in f32 and rounded once (OLMo 2/3); else in the model dtype
    rotary_dim: int = 0  # rope over each head's first rotary_dim dims (partial rotary, GLM); 0: all
    nope_layers: tuple[int, ...] = ()  # layers without rotary embedding (SmolLM3)
    sliding_window: int | None = None  # the window of "sliding" layers (all layers if layer_types is empty)
    layer_types: tuple[str, ...] = ()  # per layer "full" | "sliding" | "chunked"; () = every layer alike
    # "chunked" layers see only keys of the row's own chunk [k C, (k + 1) C) of positions
    # (Llama 4's local layers; all layers if layer_types is empty); None: no chunks
    attention_chunk: int | None = None
    bias: bool = False  # q/k/v bias (Qwen2; Llama/Qwen3 attention_bias)
    out_bias: bool = False  # o bias (Llama/Qwen3/OLMo 2 attention_bias)
    # head: RMSNorm over each head's D (Qwen3, Gemma 3); projection: over all Hq*D (OLMo 2);
    # weightless: RMS over each head's D with no weight, on layers with rope only (Llama 4)
    qk_norm: str = "none"
    qk_norm_after_rope: bool = False  # the q/k norms apply to the roped q and k (Hunyuan), not before rope
    qkv_clip: float | None = None  # q, k and v clipped to [-clip, clip] after bias and norms (OLMoE clip_qkv)
    query_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    # q times 1 + beta * log(1 + floor(position / length)) after rope (Ministral 3's
    # Llama-4-style attention temperature); beta 0: off
    query_temperature_beta: float = 0.0
    query_temperature_length: int = 0
    # Llama 4's form: positions counted from 1 (floor((position + 1) / length)), on NoPE layers only
    query_temperature_offset: int = 0
    query_temperature_nope_only: bool = False
    soft_cap: float | None = None  # cap * tanh(score / cap) (Gemma 2)
    sinks: bool = False  # a learned per-head logit in each softmax denominator (gpt-oss)
    # "full" layers with their own KV shape (Gemma 4's global layers); 0: head_dim / num_kv_heads.
    # Such a model's layers hold pages of two shapes, so they neither stack nor share one page format
    global_head_dim: int = 0
    global_kv_heads: int = 0
    global_k_eq_v: bool = False  # "full" layers' V is their K projection, before the K norm (Gemma 4)
    v_norm: bool = False  # V through an RMSNorm without weight over each head (Gemma 4)
    # image rows' key limits (models/vision/rows.py: an image attended both ways) hold on
    # sliding layers only, full layers stay causal (Gemma 4's mask); else on every layer (Gemma 3)
    image_limits_sliding_only: bool = False
    output_gate: bool = False  # output times sigmoid(a per-head gate q_proj also gives) (Qwen3.5)
    gate_proj: bool = False  # output times sigmoid(x @ a gate projection of its own, [Hq, D]) (AFMoE)
    # Falcon-H1's muP multipliers: K times key_scale (before rope), the block's input times
    # in_scale and its output times out_scale (1.0: off)
    key_scale: float = 1.0
    in_scale: float = 1.0
    out_scale: float = 1.0
    # mesh.sequence > 1 (models/parallel/context.py): pass_kv = the pass-KV ring for a step
    # with nothing cached (unquantized pages), pass-Q otherwise; pass_q = always pass-Q;
    # auto = pass_q until an accelerator measures the ring ahead (on CPU it is 2-17x
    # slower at 1k-8k tokens: benchmarks/context_modes.py)
    context_attention: str = "auto"

    def __post_init__(self):
        _choose("qk_norm", self.qk_norm, ("none", "head", "projection", "weightless"))
        _choose("context_attention", self.context_attention, ("auto", "pass_q", "pass_kv"))
        if self.qk_norm_after_rope and self.qk_norm == "none":
            raise ConfigError("model.qk_norm_after_rope needs a qk_norm (head or projection)")
        if self.qk_norm_after_rope and self.rope_interleave and self.qk_norm != "weightless":
            raise ConfigError("model.qk_norm_after_rope with rope_interleave would norm permuted heads")
        if self.output_gate and self.gate_proj:
            raise ConfigError("model.attn_output_gate (the gate from q_proj) and model.attn_gate_proj (from a "
                              "projection of its own) are two spellings of one gate: set one")
        if self.qkv_clip is not None and self.qkv_clip <= 0:
            raise ConfigError(f"model.qkv_clip must be positive, got {self.qkv_clip}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"model.sliding_window must be positive, got {self.sliding_window}")
        if set(self.layer_types) - set(LAYER_TYPES):
            raise ConfigError(f"model.layer_types must name {list(LAYER_TYPES)}, got {list(self.layer_types)}")
        if self.query_temperature_beta and self.query_temperature_length <= 0:
            raise ConfigError(f"model.query_temperature_beta = {self.query_temperature_beta} needs a positive "
                              f"query_temperature_length, got {self.query_temperature_length}")
        if min(self.global_head_dim, self.global_kv_heads) < 0 or self.global_head_dim % 2:
            raise ConfigError(f"model.global_head_dim ({self.global_head_dim}) must be even and global_kv_heads "
                              f"({self.global_kv_heads}) >= 0 (0: the other layers')")
        if "sliding" in self.layer_types and self.sliding_window is None:
            raise ConfigError("model.layer_types has sliding layers but model.sliding_window is not set")
        if self.attention_chunk is not None and self.attention_chunk <= 0:
            raise ConfigError(f"model.attention_chunk must be positive, got {self.attention_chunk}")
        if "chunked" in self.layer_types and self.attention_chunk is None:
            raise ConfigError("model.layer_types has chunked layers but model.attention_chunk is not set")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: none)."""
        if self.layer_types and self.layer_types[layer] != "sliding":
            return None
        return self.sliding_window

    def layer_chunk(self, layer: int) -> int | None:
        """The attention chunk of `layer` (None: none)."""
        if self.layer_types and self.layer_types[layer] != "chunked":
            return None
        return self.attention_chunk

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (models/mixers/mla.py, DeepSeek); kv_lora_rank = 0: not MLA. The
    cache then holds one "head" per token: the normalised latent and the roped key,
    head_dim = kv_lora_rank + qk_rope_head_dim, num_kv_heads = 1. DeepSeek sparse attention
    (index_topk > 0, models/mixers/mla_indexer.py: V3.2, GLM-5) adds the lightning
    indexer's key as index_head_dim more columns of that entry, and each query attends
    only the index_topk cached positions its indexer scores highest."""
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q straight from the hidden state (V2-Lite)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # absorbed: attend over the latent; expanded: K/V per head from it (models/mixers/mla_expanded.py);
    # auto: per step, whichever costs fewer multiply-adds for the batch's lengths
    form: str = "auto"
    index_topk: int = 0  # keys each query attends (DeepSeek sparse attention); 0: every causal key
    index_n_heads: int = 0  # the indexer's query heads
    index_head_dim: int = 0  # its key (one per token, cached) and query head width
    # the indexer's rope turns (even, odd) pairs (GLM-5), not the halves (V3.2)
    index_rope_interleave: bool = False
    # each head's output times sigmoid(x @ w_g), one scalar per head and token, before the
    # output projection (Ling 2.5's MLA: BailingHybridAttention's g_proj)
    head_gate: bool = False
    # the normalised latent times this before it is cached (LongCat-Flash's sqrt(hidden / kv_lora_rank))
    latent_scale: float = 1.0

    def __post_init__(self):
        _choose("mla_form", self.form, ("auto", "absorbed", "expanded"))
        if self.index_topk < 0:
            raise ConfigError(f"model.index_topk must be >= 0, got {self.index_topk}")
        if self.index_topk and not (self.kv_lora_rank and self.q_lora_rank and self.index_n_heads > 0
                                    and self.qk_rope_head_dim <= self.index_head_dim):
            raise ConfigError("model.index_topk (DeepSeek sparse attention) needs an MLA model with q_lora_rank "
                              "(the indexer's queries come from the q latent), index_n_heads > 0 and "
                              f"index_head_dim >= qk_rope_head_dim; got q_lora_rank={self.q_lora_rank}, "
                              f"index_n_heads={self.index_n_heads}, index_head_dim={self.index_head_dim}")
        if self.head_gate and not self.kv_lora_rank:
            raise ConfigError("model.mla_head_gate gates latent attention's heads: it needs kv_lora_rank > 0")
        if self.kv_lora_rank and not (self.qk_nope_head_dim > 0 and self.qk_rope_head_dim > 0
                                      and self.v_head_dim > 0):
            raise ConfigError(f"an MLA model (kv_lora_rank={self.kv_lora_rank}) needs positive "
                              "qk_nope/qk_rope/v head dims")

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def entry_width(self) -> int:
        """A cached token's values: the latent, the roped key and the indexer's key."""
        return self.kv_lora_rank + self.qk_rope_head_dim + (self.index_head_dim if self.index_topk else 0)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs (models/moe.py); num_experts = 0: every layer's MLP is dense."""
    num_experts: int = 0
    experts_per_token: int = 0
    intermediate_size: int = 0  # one expert's intermediate size
    dense_layers: tuple[int, ...] = ()  # layers with the dense MLP in a MoE model
    # softmax: softmax over experts, top k (Mixtral, Qwen3-MoE), of prob + bias with a
    # selection bias (ERNIE 4.5); sigmoid: sigmoid scores, top k of score + bias within the
    # best groups (DeepSeek-V3, GLM-4.5, MiniMax-M2); topk_softmax: top k of the logits,
    # softmax over those k (gpt-oss); sparsemixer: two experts, each the best left, weighted
    # by a softmax over the experts within 2 * sparsemixer_eps of it (Phi-3.5-MoE); softmax and
    # sigmoid take router_groups alike (Mistral 4: softmax probabilities in groups)
    scoring: str = "softmax"
    renormalize: bool = True  # top-k weights divided by their sum
    renormalize_min: float = 0.0  # ... clamped below at this (ERNIE 4.5's moe_norm_min); 0: not clamped
    # ... plus this before dividing (LFM2-MoE: 1e-6); None: 1e-20 under sigmoid scoring (DeepSeek), else 0
    renormalize_eps: float | None = None
    # a per-expert correction bias on the selection scores only (sigmoid, softmax)
    selection_bias: bool = False
    groups: int = 1  # experts in this many groups; only the best topk_groups are chosen from
    topk_groups: int = 1
    routed_scaling: float = 1.0  # the routed experts' weights times this
    # each expert gets its token times the routing weight and its output is summed as it
    # is (Llama 4), instead of the weight times the expert's output
    weights_inputs: bool = False
    router_f32: bool = False  # router weight and matmul in f32 whatever the dtype (DeepSeek, GLM)
    router_logit_bias: bool = False  # the router is x @ w + b (gpt-oss)
    shared_expert_size: int = 0  # intermediate size of the always-on shared expert(s), 0: none
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(x @ w) (Qwen2-MoE)
    expert_bias: bool = False  # every expert's gate/up and down projections have biases (gpt-oss)
    # gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(alpha * gate);
    # None: the plain hidden_act(gate) * up
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    sparsemixer_eps: float = 0.01  # sparsemixer's relative threshold (Phi-3.5-MoE's router_jitter_noise)
    # the experts beside the dense MLP, each with its own norms, the router reading the
    # unnormed input through a weightless norm and a learned scale, each expert's weight
    # times a learned scale (Gemma 4: models/moe_beside_dense.py)
    beside_dense: bool = False
    # zero-compute experts (LongCat-Flash): router columns num_experts .. + zero_experts - 1 are
    # identity experts, their weight times the token itself; they hold no weights
    zero_experts: int = 0
    # the MoE of each even layer reads that layer's MLP input and is added to the next
    # layer's output (LongCat-Flash's shortcut MoE, models/shortcut_decoder.py)
    shortcut: bool = False

    def __post_init__(self):
        _choose("router_scoring", self.scoring, ("softmax", "sigmoid", "topk_softmax", "sparsemixer"))
        if self.beside_dense and (self.scoring != "softmax" or self.selection_bias or self.shared_expert_size):
            raise ConfigError("model.beside_dense (Gemma 4's block) routes by softmax, without a selection bias or "
                              "shared experts")
        if self.sparsemixer_eps < 0:
            raise ConfigError(f"model.sparsemixer_eps must be >= 0, got {self.sparsemixer_eps}")
        if self.renormalize_eps is not None and self.renormalize_eps < 0:
            raise ConfigError(f"model.router_renormalize_eps must be >= 0, got {self.renormalize_eps}")
        if self.renormalize_min < 0:
            raise ConfigError(f"model.router_renormalize_min must be >= 0, got {self.renormalize_min}")
        if self.zero_experts < 0 or (self.zero_experts and self.scoring != "softmax"):
            raise ConfigError(f"model.zero_experts ({self.zero_experts}) must be >= 0, and > 0 only with "
                              "router_scoring = softmax")
        if self.selection_bias and self.scoring in ("topk_softmax", "sparsemixer"):
            raise ConfigError("model.router_bias (a selection bias) applies to router_scoring softmax or sigmoid")
        if not self.num_experts:
            return
        if self.num_experts < 0 or not 1 <= self.experts_per_token <= self.num_experts + self.zero_experts:
            raise ConfigError(f"model.experts_per_token must be in [1, num_experts={self.num_experts}], "
                              f"got {self.experts_per_token}")
        if self.intermediate_size <= 0:
            raise ConfigError(f"model.moe_intermediate_size must be positive, got {self.intermediate_size}")
        if self.scoring == "sparsemixer" and (self.experts_per_token != 2 or self.renormalize):
            raise ConfigError("model.router_scoring = sparsemixer picks two experts, weights not renormalised "
                              f"(experts_per_token = 2, router_renormalize = false); got {self.experts_per_token}, "
                              f"{self.renormalize}")
        g, kg = self.groups, self.topk_groups
        if g < 1 or self.num_experts % g or not 1 <= kg <= g:
            raise ConfigError(f"model.router_groups ({g}) must divide num_experts ({self.num_experts}) and "
                              f"router_topk_groups ({kg}) be in [1, router_groups]")
        if g > 1 and (self.scoring not in ("sigmoid", "softmax") or self.num_experts // g < 2):
            raise ConfigError("model.router_groups > 1 needs router_scoring = sigmoid or softmax and 2+ experts "
                              "per group")
        if g > 1 and kg * self.num_experts // g < self.experts_per_token:
            raise ConfigError(f"the best {kg} of {g} expert groups hold fewer than experts_per_token experts")

    @property
    def router_width(self) -> int:
        """The router's columns: the experts, then the zero-compute ones."""
        return self.num_experts + self.zero_experts

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    """Linear-attention layers: a recurrent rule (kind), a state per sequence instead of
    attention over the KV cache. Mamba2 is linear attention with C as the query, B as the
    key and x as the value, so the shapes name both: for mamba2, key heads = n_groups (B and
    C per group), key head dim = ssm_state_size, value heads = the SSM heads, value head
    dim = their head_dim; the state is [value heads, Dk, Dv]."""
    layers: tuple[int, ...] = ()
    # Gated DeltaNet (models/mixers/gated_deltanet.py, Qwen3.5), Mamba2's SSD (models/mixers/mamba2.py,
    # Nemotron-H) or Kimi Delta Attention (models/mixers/kda.py, Kimi Linear: key heads = value heads,
    # key head dim = value head dim)
    kind: str = "gated_deltanet"
    # the chunk loop: XLA's, or the Pallas TPU kernel (pallas_kernels/gated_delta_rule_tpu.py,
    # ssd_tpu.py); auto = xla until a TPU measurement says otherwise
    impl: str = "auto"
    num_key_heads: int = 0
    num_value_heads: int = 0
    key_head_dim: int = 0
    value_head_dim: int = 0
    conv_kernel: int = 4  # the short causal convolution over q, k, v (Mamba2: x, B, C)
    grouped_proj: bool = False  # q, k, v, z (and b, a) fused per key head (Qwen3-Next), not apart
    conv_bias: bool = False  # the convolution adds a bias (Mamba2; LFM2: its projections too)
    dt_limit: tuple[float, float] | None = None  # Mamba2's time steps clipped to [lo, hi]; None: not
    # KDA's forget and output gates projected E -> H x D in one matrix each (Ling 2.5), not
    # through Kimi Linear's rank-D bottleneck (f_a f_b, g_a g_b)
    full_rank_gates: bool = False
    # KDA's bounded forget gate, log decay = bound * sigmoid(exp(A_log) (f + dt_bias)) in
    # [bound, 0] (Ling 2.5's kda_safe_gate, kda_lower_bound); None: Kimi's unbounded
    # -exp(A_log) softplus(f + dt_bias)
    gate_lower_bound: float | None = None
    # Falcon-H1: each linear layer also runs attention on the same normed input and adds both
    # outputs (models/mixers/parallel_hybrid.py); such a layer holds pages and a state slot
    parallel: bool = False
    # Mamba2 as Falcon-H1 configures it: its input times in_scale, its output times out_scale,
    # the projections (z, x, B, C, dt) times part_scales (the muP vector; (): all 1), the
    # gated norm "after_gate" (Nemotron-H: norm(y * silu(z))), "before_gate" (norm(y) *
    # silu(z)) or "none" (y * silu(z), no norm weight), and a bias on the output projection
    in_scale: float = 1.0
    out_scale: float = 1.0
    part_scales: tuple[float, ...] = ()
    gated_norm: str = "after_gate"
    out_bias: bool = False

    def __post_init__(self):
        _choose("linear_gated_norm", self.gated_norm, ("after_gate", "before_gate", "none"))
        if self.part_scales and len(self.part_scales) != 5:
            raise ConfigError(f"model.linear_part_scales must be 5 multipliers (z, x, B, C, dt), got "
                              f"{list(self.part_scales)}")
        falcon = {"linear_parallel": self.parallel, "linear_in_scale": self.in_scale != 1.0,
                  "linear_out_scale": self.out_scale != 1.0, "linear_part_scales": bool(self.part_scales),
                  "linear_gated_norm": self.gated_norm != "after_gate", "linear_out_bias": self.out_bias}
        if self.kind != "mamba2" and any(falcon.values()):
            raise ConfigError(f"model.{', '.join(k for k, on in falcon.items() if on)} apply to linear_kind mamba2 "
                              f"only, not {self.kind}")
        _choose("linear_kind", self.kind, ("gated_deltanet", "mamba2", "short_conv", "kda"))
        _choose("linear_impl", self.impl, ("auto", "xla", "pallas_tpu"))
        if self.layers and self.kind == "short_conv" and self.conv_kernel < 2:
            raise ConfigError(f"model.linear_conv_kernel must be >= 2, got {self.conv_kernel}")
        if self.layers and self.kind != "short_conv":
            dims = (self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim,
                    self.conv_kernel - 1)
            if min(dims) <= 0 or self.num_value_heads % self.num_key_heads:
                raise ConfigError("model.linear_layers needs positive linear_* head counts and dims (value heads "
                                  f"a multiple of key heads) and linear_conv_kernel >= 2; got {dims}")
        mamba = {"linear_conv_bias": self.conv_bias, "linear_dt_limit": self.dt_limit is not None}
        if self.kind == "short_conv":
            mamba.pop("linear_conv_bias")
        if self.kind != "mamba2" and any(mamba.values()):
            raise ConfigError(f"model.{', '.join(k for k, on in mamba.items() if on)} apply to linear_kind mamba2 "
                              f"only, not {self.kind}")
        if self.kind != "gated_deltanet" and self.grouped_proj:
            raise ConfigError(f"model.linear_grouped_proj is Qwen3-Next's DeltaNet layout, not {self.kind}'s")
        kda = {"linear_full_rank_gates": self.full_rank_gates,
               "linear_gate_lower_bound": self.gate_lower_bound is not None}
        if self.kind != "kda" and any(kda.values()):
            raise ConfigError(f"model.{', '.join(k for k, on in kda.items() if on)} apply to linear_kind kda "
                              f"only, not {self.kind}")
        if self.gate_lower_bound is not None and not self.gate_lower_bound < 0:
            raise ConfigError(f"model.linear_gate_lower_bound must be negative (a log decay), got "
                              f"{self.gate_lower_bound}")
        if self.kind == "kda" and self.impl == "pallas_tpu":
            raise ConfigError("model.linear_impl = pallas_tpu has no Kimi delta rule kernel (linear_kind kda runs "
                              "the XLA chunk loop: linear_impl = auto or xla)")
        if self.kind == "kda" and self.layers and (self.num_key_heads != self.num_value_heads
                                                   or self.key_head_dim != self.value_head_dim):
            raise ConfigError("model.linear_kind = kda gives every head its own q, k and v: linear_num_key_heads "
                              "= linear_num_value_heads and linear_key_head_dim = linear_value_head_dim; got "
                              f"{self.num_key_heads}, {self.num_value_heads}, {self.key_head_dim}, "
                              f"{self.value_head_dim}")
        limit = self.dt_limit
        if limit is not None and not (len(limit) == 2 and 0 <= limit[0] < limit[1]):
            raise ConfigError(f"model.linear_dt_limit must be [lo, hi] with 0 <= lo < hi, got {list(limit)}")


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """The RMSNorms around the blocks."""
    eps: float = 1e-5
    # rms: w * cast(x * rsqrt) (Llama); rms_f32: cast(w * x * rsqrt) (OLMo 2);
    # rms_one_plus: cast((1 + w) * x * rsqrt), all in f32 (Gemma); layer: LayerNorm with a
    # bias, cast(w * (x - mean) * rsqrt + b) (Phi-3.5-MoE)
    kind: str = "rms"
    # pre: norm before attention and MLP (Llama); sandwich: before and after both
    # (Gemma 2/3); post: after both only (OLMo 2)
    layout: str = "pre"

    def __post_init__(self):
        _choose("norm_kind", self.kind, ("rms", "rms_f32", "rms_one_plus", "layer"))
        _choose("norm_layout", self.layout, ("pre", "sandwich", "post"))


@dataclasses.dataclass(frozen=True)
class EmbeddingConfig:
    """Tokens in, logits out."""
    tied: bool = False  # the LM head is the embedding table (tie_word_embeddings)
    scale: float = 1.0  # embeddings times this, rounded to dtype (Gemma: sqrt(E); Granite)
    logits_scale: float = 1.0  # logits times this (Granite: 1 / logits_scaling)
    final_soft_cap: float | None = None  # cap * tanh(logits / cap) (Gemma 2)
    head_bias: bool = False  # the LM head adds a bias (Phi-3.5-MoE's lm_head_bias)
    # False: no LM head at all (an embedding backbone: neither lm_head.weight nor tied
    # embeddings); such a model embeds and scores by pooling, and refuses generation
    head: bool = True

