"""Prefill planner: what one prompt costs, from the model shape, the mesh and the hardware.

Everything here is arithmetic on `ModelConfig`, `EngineSettings`, `MeshSettings` and a
`Hardware` (engine/hardware.py); nothing runs on a device. `jaxfill plan` prints it and
`jaxfill bench prefill` compares it with measured TTFT.

Counting conventions (tests/test_planner.py checks them against XLA's cost analysis):

* matmul FLOPs = 2 * tokens * (q, k, v, o, gate, up, down weights) per layer, plus the
  LM head for the ONE row whose logits are computed (the forward never computes
  [T, vocab]). The embedding is a gather: no FLOPs.
* attention FLOPs = QK^T and PV over the causal lower triangle, diagonal included:
  4 * layers * q_heads * head_dim * (visible key count summed over the new tokens),
  with visible keys min(position + 1, sliding_window).
* bytes = every weight read once (of an untied embedding table only the prompt's rows)
  + the new tokens' K/V written once. Activations are
  assumed to stay on chip: this is a floor, not an estimate.

Mesh (mirrors models/sharding.py): 'tensor' splits q heads, MLP columns and the vocab;
KV heads split too, or are repeated up to 'tensor' when there are fewer (then every rank
computes the small k/v projections in full). 'sequence' splits the tokens; each layer
all-gathers the new K/V over it and every sequence rank keeps a full copy of the pages.
'data' holds independent replicas: it multiplies capacity, not single-request speed.

TTFT floor per device = max(FLOPs / peak, bytes / HBM bandwidth) + collective time, with
ring collectives over `link_bytes_per_s`: two all-reduces of the [T/sp, E] activations
per layer for 'tensor', one all-gather of the layer's new K/V for 'sequence'.

Disaggregated prefill/decode: the prompt's K/V (every layer, the model's logical KV
heads, in engine.kv_cache_dtype) crosses the link between the prefill and the decode
pool once per request; at `link_gbps` Gbit/s that takes bytes / (link_gbps * 1e9 / 8)
seconds on top of the TTFT floor. Disaggregation pays when that is small next to the
TTFT floor and the decode steps the prefill would otherwise stall.
"""

from __future__ import annotations

import dataclasses
import math

from jaxfill.engine.config import Config, EngineSettings, MeshSettings
from jaxfill.engine.hardware import Hardware
from jaxfill.models.config import ModelConfig
from jaxfill.models.kv_cache import kv_bytes_per_token as cache_bytes_per_token

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----------------------------------------------------------------------------- shapes
def dtype_bytes(model: ModelConfig) -> int:
    return DTYPE_BYTES[model.dtype]


def layer_matmul_params(model: ModelConfig) -> int:
    """Weights one token multiplies through in one decoder layer."""
    e, d = model.hidden_size, model.head_dim
    q, kv = model.num_heads * d, model.num_kv_heads * d
    return e * q + 2 * e * kv + q * e + 3 * e * model.intermediate_size


def matmul_flops(model: ModelConfig, num_tokens: int, logit_rows: int = 1) -> int:
    """Projection and MLP matmuls for `num_tokens`, LM head for `logit_rows` rows."""
    return (2 * num_tokens * model.num_layers * layer_matmul_params(model)
            + 2 * logit_rows * model.hidden_size * model.vocab_size)


def visible_pairs(num_tokens: int, context: int = 0, sliding_window: int | None = None) -> int:
    """Sum over new tokens at positions context..context+T-1 of the keys each one sees."""
    lo, hi = context + 1, context + num_tokens  # visible keys = position + 1
    if sliding_window is None or hi <= sliding_window:
        return (lo + hi) * (hi - lo + 1) // 2
    w = sliding_window
    if lo > w:
        return w * num_tokens
    return (lo + w) * (w - lo + 1) // 2 + w * (hi - w)


def attention_flops(model: ModelConfig, num_tokens: int, context: int = 0, causal: bool = True,
                    kv_len: int | None = None) -> int:
    """QK^T + PV FLOPs. causal: over the lower triangle (what a prefill needs);
    causal=False: full [num_tokens, kv_len] score matrices (what a dense impl computes)."""
    per_pair = 4 * model.num_layers * model.num_heads * model.head_dim
    if causal:
        return per_pair * visible_pairs(num_tokens, context, model.sliding_window)
    return per_pair * num_tokens * (kv_len if kv_len is not None else context + num_tokens)


def prefill_flops(model: ModelConfig, num_tokens: int, context: int = 0) -> int:
    return matmul_flops(model, num_tokens) + attention_flops(model, num_tokens, context)


def projection_scales(model: ModelConfig) -> int:
    """f32 scales of one layer's int8 projections: one per output channel of q, k, v, o,
    gate, up, down (models/quant.py)."""
    e, d = model.hidden_size, model.head_dim
    return (model.num_heads + 2 * model.num_kv_heads) * d + e + 2 * model.intermediate_size + e


def weight_bytes(model: ModelConfig) -> int:
    """Every param's bytes as allocated: with weight_dtype int8 the projections take one
    byte per weight plus 4 per output channel; embedding, LM head, norms and biases keep
    the model dtype."""
    total = model.num_params() * dtype_bytes(model)
    if model.weight_dtype == "auto":
        return total
    proj = model.num_layers * layer_matmul_params(model)
    return total - proj * dtype_bytes(model) + proj + 4 * model.num_layers * projection_scales(model)


def kv_projection_bytes(model: ModelConfig) -> int:
    """Bytes of one layer's k and v weights (with their scales when int8)."""
    n = 2 * model.hidden_size * model.num_kv_heads * model.head_dim
    if model.weight_dtype == "auto":
        return n * dtype_bytes(model)
    return n + 4 * 2 * model.num_kv_heads * model.head_dim


def weights_read_bytes(model: ModelConfig, num_tokens: int) -> int:
    """Weight bytes a prefill reads: all of them, except that an untied embedding table is
    only gathered (the rows of the prompt's tokens, at most the whole table)."""
    total = weight_bytes(model)
    if model.tie_word_embeddings:
        return total
    e, b = model.hidden_size, dtype_bytes(model)
    return total - model.vocab_size * e * b + min(num_tokens, model.vocab_size) * e * b


def kv_bytes_per_token(model: ModelConfig, kv_heads: int | None = None,
                       kv_cache_dtype: str = "auto") -> int:
    """K and V of every layer (int8 / fp8: plus their f32 scales), as the cache allocates
    them: the one formula lives beside KVCache (models/kv_cache.py)."""
    heads = model.num_kv_heads if kv_heads is None else kv_heads
    return cache_bytes_per_token(model.num_layers, heads, model.head_dim, kv_cache_dtype, model.jnp_dtype)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


# ----------------------------------------------------------------------------- mesh
def kv_repeat(model: ModelConfig, tensor: int) -> int:
    """Copies of each KV head so the cache splits evenly over 'tensor' (as models/sharding.py)."""
    if model.num_kv_heads % tensor == 0:
        return 1
    if tensor % model.num_kv_heads == 0:
        return tensor // model.num_kv_heads
    raise ValueError(f"mesh.tensor={tensor} does not divide model.num_kv_heads={model.num_kv_heads} "
                     "(nor is it a multiple of it)")


def check_mesh(model: ModelConfig, mesh: MeshSettings) -> None:
    tp = mesh.tensor
    if model.num_heads % tp:
        raise ValueError(f"mesh.tensor={tp} does not divide model.num_heads={model.num_heads}")
    kv_repeat(model, tp)
    if model.intermediate_size % tp:
        raise ValueError(f"mesh.tensor={tp} does not divide model.intermediate_size={model.intermediate_size}")


def check_prompt_len(prompt_len: int, engine: EngineSettings) -> None:
    if prompt_len <= 0:
        raise ValueError(f"prompt length must be positive, got {prompt_len}")
    if prompt_len >= engine.max_model_len:
        raise ValueError(f"prompt length {prompt_len} does not fit engine.max_model_len={engine.max_model_len} "
                         "(prompt plus at least one generated token; raise it with --set engine.max_model_len=N)")


@dataclasses.dataclass(frozen=True)
class DeviceCosts:
    flops: float
    bytes: float
    collective_bytes: float  # bytes one device sends over its links
    compute_s: float
    memory_s: float
    collective_s: float

    @property
    def ttft_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.collective_s


def device_costs(model: ModelConfig, mesh: MeshSettings, hw: Hardware, num_tokens: int,
                 context: int = 0, kv_cache_dtype: str = "auto") -> DeviceCosts:
    """Per-device work of one prefill step of `num_tokens` new tokens after `context`
    cached ones under the mesh (no validation of the length)."""
    tp, sp = mesh.tensor, mesh.sequence
    r = kv_repeat(model, tp)
    b = dtype_bytes(model)
    e, d, L = model.hidden_size, model.head_dim, model.num_layers
    kv_proj = 2 * e * model.num_kv_heads * d  # k and v weights of one layer
    # Matmuls: everything splits over tensor x sequence except the k/v projections when KV
    # heads are replicated (r > 1): every tensor rank computes them in full.
    tokens_dev = num_tokens / sp
    per_layer = (layer_matmul_params(model) - kv_proj) / tp + (kv_proj if r > 1 else kv_proj / tp)
    flops = 2 * tokens_dev * L * per_layer + 2 * e * model.vocab_size / tp
    flops += attention_flops(model, num_tokens, context) / (tp * sp)
    # Bytes: this rank's weights once, plus the K/V heads it stores for every token (pages
    # are replicated over 'sequence').
    kv_w = L * kv_projection_bytes(model)
    w = weights_read_bytes(model, num_tokens) - kv_w
    w_dev = w / tp + kv_w * (1 if r > 1 else 1 / tp)
    kv_dev = num_tokens * kv_bytes_per_token(model, model.num_kv_heads * r, kv_cache_dtype) / tp
    nbytes = w_dev + kv_dev
    # Collectives (ring): all-reduce moves 2 (n-1)/n of the buffer, all-gather (n-1)/n of
    # the gathered result.
    coll = 0.0
    if tp > 1:
        coll += L * 2 * (2 * (tp - 1) / tp) * tokens_dev * e * b
    if sp > 1:
        coll += (sp - 1) / sp * kv_dev
    peak = hw.peak_flops(model.dtype)
    bw, link = hw.hbm_bytes_per_s, hw.link_bytes_per_s
    if hw.shared_by_mesh:  # fake CPU devices share one machine
        peak, bw, link = peak / mesh.size, bw / mesh.size, link / mesh.size
    coll_s = coll / link if coll and link > 0 else (math.inf if coll else 0.0)
    return DeviceCosts(flops=flops, bytes=nbytes, collective_bytes=coll,
                       compute_s=flops / peak, memory_s=nbytes / bw, collective_s=coll_s)


def ttft_floor(model: ModelConfig, mesh: MeshSettings, hw: Hardware, num_tokens: int,
               chunk: int | None = None) -> float:
    """Floor for a whole prompt; with `chunk`, the sum over chunked prefill steps (each
    step re-reads the weights and attends to the chunks before it)."""
    if not chunk or chunk >= num_tokens:
        return device_costs(model, mesh, hw, num_tokens).ttft_s
    return sum(device_costs(model, mesh, hw, min(chunk, num_tokens - start), start).ttft_s
               for start in range(0, num_tokens, chunk))


def check_link_gbps(link_gbps: float | None) -> None:
    if link_gbps is not None and not (link_gbps > 0 and math.isfinite(link_gbps)):
        raise ValueError(f"--link-gbps must be a positive number of Gbit/s, got {link_gbps}")


def kv_transfer_bytes(model: ModelConfig, prompt_len: int, kv_cache_dtype: str = "auto") -> int:
    """K/V a prefill worker hands a decode worker for one prompt: every prompt token's
    K and V in every layer (values and, when quantized, their scales). jaxfill's own
    handoff sends len(prompt) - 1 rows padded to a power-of-two number of pages
    (engine/kv_transfer.py), so its wire bytes are up to 2x this."""
    return prompt_len * kv_bytes_per_token(model, kv_cache_dtype=kv_cache_dtype)


def kv_transfer_seconds(nbytes: float, link_gbps: float) -> float:
    """Time to move `nbytes` at `link_gbps` Gbit/s (no latency, no protocol overhead)."""
    check_link_gbps(link_gbps)
    return nbytes / (link_gbps * 1e9 / 8)


def plan_prefill(config: Config, hw: Hardware, prompt_len: int, link_gbps: float | None = None) -> dict:
    """Everything `jaxfill plan` reports for one prompt length (JSON-ready); with
    `link_gbps`, also the prefill-to-decode KV transfer time over that link."""
    model, engine, mesh = config.model, config.engine, config.mesh
    check_link_gbps(link_gbps)
    check_mesh(model, mesh)
    check_prompt_len(prompt_len, engine)
    tp = mesh.tensor
    r = kv_repeat(model, tp)
    per_token = kv_bytes_per_token(model, kv_cache_dtype=engine.kv_cache_dtype)
    pages = pages_for(prompt_len, engine.page_size)
    per_request = pages * engine.page_size * per_token
    # Memory left after this device's weights; the cache holds Hkv * r heads split over tp.
    cost = device_costs(model, mesh, hw, prompt_len, kv_cache_dtype=engine.kv_cache_dtype)
    kv_w = model.num_layers * kv_projection_bytes(model)  # k/v weights: replicated when r > 1
    weights_dev = (weight_bytes(model) - kv_w) / tp + kv_w * (1 if r > 1 else 1 / tp)
    hbm = hw.hbm_bytes / (mesh.size if hw.shared_by_mesh else 1)
    free = hbm - weights_dev
    per_request_dev = (pages * engine.page_size
                       * kv_bytes_per_token(model, model.num_kv_heads * r, engine.kv_cache_dtype) / tp)
    fit = max(0, int(free // per_request_dev)) * mesh.data if free > 0 else 0
    t2 = ttft_floor(model, mesh, hw, 2 * prompt_len)
    mm = matmul_flops(model, prompt_len)
    att = attention_flops(model, prompt_len)
    moved = kv_transfer_bytes(model, prompt_len, engine.kv_cache_dtype)
    transfer = {} if link_gbps is None else {
        "link_gbps": link_gbps,
        "kv_transfer_s": kv_transfer_seconds(moved, link_gbps),
        "kv_transfer_over_ttft_floor": kv_transfer_seconds(moved, link_gbps) / cost.ttft_s,
    }
    return {
        "prompt_len": prompt_len,
        "prefill_flops": mm + att,
        "matmul_flops": mm,
        "attention_flops": att,
        "weight_bytes": weight_bytes(model),
        "kv_bytes_written": prompt_len * per_token,
        "kv_bytes_per_token": per_token,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "kv_bytes_per_request": per_request,
        "kv_bytes_per_request_per_device": per_request_dev,  # Hkv * r heads / tensor
        "pages_per_request": pages,
        "page_size": engine.page_size,
        "flops_per_device": cost.flops,
        "bytes_per_device": cost.bytes,
        "collective_bytes_per_device": cost.collective_bytes,
        "compute_s": cost.compute_s,
        "memory_s": cost.memory_s,
        "collective_s": cost.collective_s,
        "bound": "compute" if cost.compute_s >= cost.memory_s else "memory",
        "ttft_floor_s": cost.ttft_s,
        "tokens_per_s_ceiling": prompt_len / cost.ttft_s,
        "weight_bytes_per_device": weights_dev,
        "free_bytes_per_device": free,
        "max_concurrent_requests": fit,
        "decay_coefficient": t2 / cost.ttft_s,
        "kv_transfer_bytes": moved,
        **transfer,
    }


def plan(config: Config, hw: Hardware, prompt_lens: list[int], link_gbps: float | None = None) -> list[dict]:
    check_mesh(config.model, config.mesh)
    check_link_gbps(link_gbps)
    for n in prompt_lens:
        check_prompt_len(n, config.engine)
    return [plan_prefill(config, hw, n, link_gbps) for n in prompt_lens]


def default_prompt_lens(engine: EngineSettings) -> list[int]:
    return [n for n in (128, 512, 2048, 8192, 32768, 131072) if n < engine.max_model_len] or \
        [engine.max_model_len - 1]


def model_matmul_shape(model: ModelConfig, tokens: int = 2048) -> tuple[int, int, int]:
    """The matmul `--hardware cpu` times: the MLP up-projection of a `tokens` chunk."""
    return (tokens, model.hidden_size, model.intermediate_size)


def kv_pool_pages(config: Config, hw: Hardware, activation_bytes: float = 0) -> dict:
    """What `engine.num_pages = 0` gives on `hw` (engine/memory.py, the same formula): pages
    per data replica and the tokens they hold, from this device's memory after its weights
    and `activation_bytes` (the engine measures them as the compiled step's temp buffers)."""
    from jaxfill.engine.memory import pool_pages

    model, engine, mesh = config.model, config.engine, config.mesh
    check_mesh(model, mesh)
    r = kv_repeat(model, mesh.tensor)
    kv_w = model.num_layers * kv_projection_bytes(model)
    weights_dev = (weight_bytes(model) - kv_w) / mesh.tensor + kv_w * (1 if r > 1 else 1 / mesh.tensor)
    heads_dev = model.num_kv_heads * r // mesh.tensor
    page_bytes = engine.page_size * kv_bytes_per_token(model, heads_dev, engine.kv_cache_dtype)
    capacity = hw.hbm_bytes / (mesh.size if hw.shared_by_mesh else 1)
    pages = pool_pages(capacity, weights_dev, activation_bytes, page_bytes, engine.memory_utilization)
    return {"kv_pool_pages": pages, "kv_pool_tokens": max(0, pages - 1) * engine.page_size,
            "kv_page_bytes_per_device": page_bytes, "memory_utilization": engine.memory_utilization,
            "activation_bytes": activation_bytes}
