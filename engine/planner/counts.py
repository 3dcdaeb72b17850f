"""What a prompt costs in FLOPs and bytes, from the model shape alone (engine/planner/plan.py
adds the mesh and the hardware).

Counting conventions (tests/test_planner.py checks them against XLA's cost analysis):

* matmul FLOPs = 2 * tokens * (the layer's projection weights, read off the model's
  abstract params: q, k, v, o, gate, up, down; a MoE layer's router, shared expert and
  k / E of its routed experts, the ones a token visits) per layer, plus the
  LM head for the ONE row whose logits are computed (the forward never computes
  [T, vocab]). The embedding is a gather: no FLOPs.
* last layer: in the unrolled layout with no 'sequence' split the engine runs the last
  layer's q/o projections, attention and MLP on the sampled row only (models/decoder.py,
  models/execution_plan.py); its K/V projections still see every token.
  `sampled_last_layer=True` counts that.
* attention FLOPs = QK^T and PV over the causal lower triangle, diagonal included:
  4 * layers * q_heads * head_dim * (visible key count summed over the new tokens),
  with visible keys min(position + 1, the layer's sliding window).
* bytes = every weight read once (of an untied embedding table only the prompt's rows)
  + the new tokens' K/V written once. Activations are
  assumed to stay on chip: this is a floor, not an estimate.
* disaggregation: the prompt's K/V (every layer, the model's logical KV heads, in
  engine.kv_cache_dtype) crosses the link once per request.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxfill.engine.config import EngineSettings, MeshSettings
from jaxfill.models.execution_plan import ExecutionPlan, scan_period
from jaxfill.engine.planner.layout import dtype_bytes, vocab_param_bytes, vocab_split
from jaxfill.models.config import ModelConfig
from jaxfill.models.families.registry import layer_params, layer_projection_params, param_count
from jaxfill.models.kv_cache import kv_bytes_per_token as cache_bytes_per_token, shares_kv
from jaxfill.models.linear_state import state_bytes_per_sequence


def layer_matmul_params(model: ModelConfig, layer: int | None = None) -> float:
    """Weights one token multiplies through in decoder layer `layer` (None: the mean over
    the layers), from the model's abstract params (models/families/registry.py); a MoE
    layer's routed experts count k / E, what a token visits."""
    if layer is not None:
        return sum(layer_projection_params(model, layer).values())
    return sum(layer_matmul_params(model, n) for n in range(model.num_layers)) / model.num_layers


def kv_projection_params(model: ModelConfig) -> int:
    """The k and v weights of one layer (MLA: the latent's kv_a)."""
    return sum(n for path, n in layer_projection_params(model).items() if path[-1] in ("k", "v", "kv_a"))


def matmul_flops(model: ModelConfig, num_tokens: int, logit_rows: int = 1, sampled_last_layer: bool = False) -> int:
    """Projection and MLP matmuls for `num_tokens`, LM head for `logit_rows` rows;
    `sampled_last_layer`: the last layer's k/v over every token, the rest over one row."""
    full = 2 * num_tokens * model.num_layers * layer_matmul_params(model)
    head = 2 * logit_rows * model.hidden_size * model.vocab_size
    return full + head - (last_layer_matmul_saving(model, num_tokens) if sampled_last_layer else 0)


def last_layer_matmul_saving(model: ModelConfig, num_tokens: int) -> float:
    """Matmul FLOPs the sampled-row last layer skips: q/o/MLP on all but one row."""
    last = model.num_layers - 1
    return 2 * (num_tokens - 1) * (layer_matmul_params(model, last) - kv_projection_params(model))


def visible_pairs(num_tokens: int, context: int = 0, sliding_window: int | None = None,
                  attention_chunk: int | None = None) -> int:
    """Sum over new tokens at positions context..context+T-1 of the keys each one sees
    (in a chunked layer, Llama 4's, the keys of its own chunk up to it)."""
    if attention_chunk is not None:
        pos = np.arange(context, context + num_tokens, dtype=np.int64)
        keys = pos % attention_chunk + 1
        return int((keys if sliding_window is None else np.minimum(keys, sliding_window)).sum())
    lo, hi = context + 1, context + num_tokens  # visible keys = position + 1
    if sliding_window is None or hi <= sliding_window:
        return (lo + hi) * (hi - lo + 1) // 2
    w = sliding_window
    if lo > w:
        return w * num_tokens
    return (lo + w) * (w - lo + 1) // 2 + w * (hi - w)


def attention_flops(model: ModelConfig, num_tokens: int, context: int = 0, causal: bool = True,
                    kv_len: int | None = None, sampled_last_layer: bool = False) -> int:
    """QK^T + PV FLOPs. causal: over the lower triangle (what a prefill needs);
    causal=False: full [num_tokens, kv_len] score matrices (what a dense impl computes).
    `sampled_last_layer`: the last layer has one query row, the last token's."""
    per_pair = 4 * model.num_heads * model.head_dim
    total = 0
    for layer in range(model.num_layers):  # each layer with its own window (Gemma's full/sliding)
        if not model.attends(layer):
            continue  # a hybrid's linear layers (linear_mixer_flops) and MLP-only layers; Falcon-H1's attend too
        window = model.attention.layer_window(layer), model.attention.layer_chunk(layer)
        if not causal:
            keys = kv_len if kv_len is not None else context + num_tokens
            total += keys if sampled_last_layer and layer == model.num_layers - 1 else num_tokens * keys
        elif sampled_last_layer and layer == model.num_layers - 1:
            total += visible_pairs(1, context + num_tokens - 1, *window)
        else:
            total += visible_pairs(num_tokens, context, *window)
    return per_pair * total


# The chunk of the chunked gated delta rule (pallas_kernels/gated_delta_rule.py)
DELTA_RULE_CHUNK = 64


def linear_mixer_flops(model: ModelConfig, num_tokens: int) -> int:
    """The gated delta rule's FLOPs over a hybrid's linear layers (0 for other models): per
    token and value head, reading, correcting and writing the [Dk, Dv] state (3 matmuls),
    plus the within-chunk [C, C] scores against keys and values. Linear in the prompt."""
    if not model.linear.layers:
        return 0
    dk, dv, c = model.linear.key_head_dim, model.linear.value_head_dim, DELTA_RULE_CHUNK
    per_token = model.linear.num_value_heads * (6 * dk * dv + 2 * c * (dk + dv))
    return len(model.linear.layers) * num_tokens * per_token


def state_bytes(model: ModelConfig, heads_split: int = 1) -> int:
    """A hybrid's recurrent + convolution state of one request (0 for other models), on one
    of `heads_split` tensor ranks."""
    return state_bytes_per_sequence(model, heads_split) if model.linear.layers else 0


def prunes_last_layer(model: ModelConfig, mesh: MeshSettings, scan_layers: bool = False) -> bool:
    """Whether the engine runs the last layer on the sampled rows only (models/execution_plan.py)."""
    return ExecutionPlan.of(model.num_layers, mesh, scan_layers, scan_period(model)).prunes_last_layer


def prefill_flops(model: ModelConfig, num_tokens: int, context: int = 0, sampled_last_layer: bool = True) -> int:
    return (matmul_flops(model, num_tokens, sampled_last_layer=sampled_last_layer)
            + attention_flops(model, num_tokens, context, sampled_last_layer=sampled_last_layer)
            + linear_mixer_flops(model, num_tokens))


def weight_bytes(model: ModelConfig) -> int:
    """Every param's bytes as allocated: with weight_dtype int8 the projections take one
    byte per weight plus 4 per output channel; embedding, LM head, norms and biases keep
    the model dtype."""
    total = param_count(model) * dtype_bytes(model)
    if model.weight_dtype == "auto":
        return total
    float_model = dataclasses.replace(model, weight_dtype="auto")
    for n in range(model.num_layers):
        layer = sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in layer_params(model, n))
        total += layer - sum(math.prod(p.shape) for p in layer_params(float_model, n)) * dtype_bytes(model)
    return total


def end_bytes_read_per_device(model: ModelConfig, mesh: MeshSettings, num_tokens: int) -> float:
    """Bytes outside the decoder layers one step reads on one device: its share of the LM
    head and the final norm; of an untied embedding table only the prompt's rows (a
    gather, at most the whole table)."""
    e, b = model.hidden_size, dtype_bytes(model)
    tables = vocab_param_bytes(model)
    if not model.embeddings.tied:
        tables += (min(num_tokens, model.vocab_size) - model.vocab_size) * e * b
    return tables / vocab_split(model, mesh) + e * b


def kv_bytes_per_token(model: ModelConfig, kv_heads: int | None = None,
                       kv_cache_dtype: str = "auto") -> int:
    """K and V of every attention layer (int8 / fp8: plus their f32 scales), as the cache
    allocates them: the one formula lives beside KVCache (models/kv_cache.py)."""
    if kv_heads is not None:
        return cache_bytes_per_token(model.kv_layers, kv_heads, model.head_dim, kv_cache_dtype, model.jnp_dtype,
                                     shares_kv(model))
    return sum(cache_bytes_per_token(layers, heads, dim, kv_cache_dtype, model.jnp_dtype, shares_kv(model))
               for (heads, dim), layers in model.kv_shapes().items())  # Gemma 4: two shapes


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


# ----------------------------------------------------------------------------- mesh
def check_prompt_len(prompt_len: int, engine: EngineSettings, model: ModelConfig | None = None) -> None:
    """A prompt plus one generated token must fit engine.max_model_len; past the model's
    max_position_embeddings the message says so (raising max_model_len alone is refused)."""
    if prompt_len <= 0:
        raise ValueError(f"prompt length {prompt_len} must be positive")
    if prompt_len < engine.max_model_len:
        return
    if model is not None and prompt_len >= model.max_position_embeddings:
        n = 1 << prompt_len.bit_length()  # a power of two above the prompt
        raise ValueError(
            f"prompt length {prompt_len} does not fit engine.max_model_len={engine.max_model_len} and is "
            f"past the model's max_position_embeddings="
            f"{model.max_position_embeddings} (rope_theta {model.attention.rope_theta:g}, rope_scaling "
            f"{model.attention.rope_scaling_dict or 'none'}): its rope was not trained that far. For the planner's "
            f"arithmetic anyway: --set model.max_position_embeddings={n} --set engine.max_model_len={n}")
    raise ValueError(f"prompt length {prompt_len} does not fit engine.max_model_len={engine.max_model_len} "
                     "(prompt plus at least one generated token; raise it with --set engine.max_model_len=N)")


def check_link_gbps(link_gbps: float | None) -> None:
    if link_gbps is not None and not (link_gbps > 0 and math.isfinite(link_gbps)):
        raise ValueError(f"--link-gbps must be a positive number of Gbit/s, got {link_gbps}")


def kv_transfer_bytes(model: ModelConfig, prompt_len: int, kv_cache_dtype: str = "auto") -> int:
    """K/V a prefill worker hands a decode worker for one prompt: every prompt token's
    K and V in every layer (values and, when quantized, their scales). jaxfill's own
    handoff sends len(prompt) - 1 rows padded to a power-of-two number of pages
    (engine/kv_rows.py), so its wire bytes are up to 2x this."""
    return prompt_len * kv_bytes_per_token(model, kv_cache_dtype=kv_cache_dtype)


def kv_transfer_seconds(nbytes: float, link_gbps: float) -> float:
    """Time to move `nbytes` at `link_gbps` Gbit/s (no latency, no protocol overhead)."""
    check_link_gbps(link_gbps)
    return nbytes / (link_gbps * 1e9 / 8)
