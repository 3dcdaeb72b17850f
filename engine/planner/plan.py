"""Prefill planner: what one prompt costs, from the model shape, the mesh and the hardware.

Everything here is arithmetic on `ModelConfig`, `EngineSettings`, `MeshSettings` and a
`Hardware` (engine/planner/hardware.py); nothing runs on a device. `jaxfill plan` prints it and
`jaxfill bench prefill` compares it with measured TTFT.

FLOP and byte counts are engine/planner/counts.py's (its docstring has the conventions).

Mesh (mirrors models/sharding.py): 'tensor' splits q heads, MLP columns and the vocab;
KV heads split too, or are repeated up to 'tensor' when there are fewer (then every rank
computes the small k/v projections in full). 'expert' splits a MoE layer's experts and
acts as more 'tensor' ranks for the rest of the model, so "tensor" below reads tensor x
expert; a MoE layer ends in one all-reduce over them like a dense MLP (models/moe.py).
'sequence' = N splits the tokens and the KV pool: each rank holds num_pages / N pages
(page j of a sequence on rank j mod N), so a prompt's KV bytes per device are / N. Each
layer's attention is context parallel, pass-Q (all-gather Q and the new K/V, attend 1/N
of the keys, LSE merge by an all-max and a reduce-scatter) or, for a step with nothing
cached, the pass-KV ring (N - 1 hops of the new K/V); engine/planner/context.py has the
byte counts. The floor is the form the engine runs (pass-Q unless
model.context_attention = pass_kv); `cheaper_ring_mode` names the cheaper one.
'data' holds independent replicas: it multiplies capacity, not single-request speed.
'stage' (pipeline) gives each device L / stage layers and their KV pages, and splits the
vocab tables with 'tensor'; what a device holds is engine/planner/layout.py's.

TTFT floor per device = max(FLOPs / peak, bytes / HBM bandwidth) + collective time, with
ring collectives over `link_bytes_per_s`: two all-reduces of the [T/sp, E] activations
per layer for 'tensor', the pass-Q or pass-KV ring bytes for 'sequence'. With
stages, `device_costs` says how the GPipe ticks and stage hand-overs enter it.

Disaggregated prefill/decode: the prompt's K/V crosses the link between the prefill and
the decode pool once per request; at `link_gbps` Gbit/s that adds bytes /
(link_gbps * 1e9 / 8) seconds to the TTFT floor.
"""

from __future__ import annotations

import dataclasses
import math

from jaxfill.engine.config import Config, EngineSettings, MeshSettings
from jaxfill.engine.planner.hardware import Hardware
from jaxfill.engine.planner.counts import (attention_flops, check_link_gbps, check_prompt_len,
                                           end_bytes_read_per_device, kv_bytes_per_token, kv_transfer_bytes,
                                           kv_transfer_seconds, last_layer_matmul_saving, layer_matmul_params,
                                           linear_mixer_flops, matmul_flops, pages_for, prunes_last_layer,
                                           state_bytes, weight_bytes)
from jaxfill.engine.planner.context import (PASS_KV, PASS_Q, activation_estimate, context_bytes_per_layer,
                                            engine_ring_mode, kv_pages_per_device, ring_modes)
from jaxfill.engine.planner.layout import (bubble_fraction, dtype_bytes,
                                           kv_bytes_per_token_per_device, kv_repeat, layer_bytes_per_device,
                                           pipeline_microbatches, vocab_split, weight_bytes_per_device)
from jaxfill.engine.validation import check_mesh
from jaxfill.models.config import ModelConfig


# ----------------------------------------------------------------------------- shapes
@dataclasses.dataclass(frozen=True)
class DeviceCosts:
    flops: float
    bytes: float
    collective_bytes: float  # bytes one device sends over its links for 'tensor' / 'sequence'
    compute_s: float
    memory_s: float
    collective_s: float
    microbatches: int = 1  # the step's tokens cut into this many (pipeline only)
    stages: int = 1
    stage_transfer_s: float = 0.0  # p - 1 hand-overs of one microbatch's [T/m, E]
    ring: str | None = None  # the 'sequence' attention form costed (None: no 'sequence')

    @property
    def ttft_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.collective_s + self.stage_transfer_s

    @property
    def bubble_fraction(self) -> float:
        return bubble_fraction(self.stages, self.microbatches)


def layer_work(model: ModelConfig, mesh: MeshSettings, num_tokens: float, attention: float, layers: int,
               kv_cache_dtype: str = "auto", ring: str | None = None) -> tuple[float, float, float]:
    """(FLOPs, bytes, collective bytes) on one device of `num_tokens` new tokens through
    `layers` decoder layers; `attention` is their QK^T + PV FLOPs over the whole model
    (for the pass-KV `ring`: its dense blocks, engine/planner/context.py)."""
    tp, sp = mesh.heads, mesh.sequence  # MoE experts split over expert x tensor too
    e, L = model.hidden_size, model.num_layers
    kv_proj = 2 * e * model.num_kv_heads * model.head_dim  # k and v weights of one layer
    # Matmuls split over tensor x sequence, except the k/v projections when KV heads are
    # repeated (r > 1): every tensor rank computes them in full. Attention splits over
    # sequence too: each rank attends 1/N of the keys (pass-Q) or 1/N of the queries (ring).
    replicated_kv = kv_repeat(model, tp) > 1
    per_layer = (layer_matmul_params(model) - kv_proj) / tp + (kv_proj if replicated_kv else kv_proj / tp)
    tokens_dev = num_tokens / sp
    flops = 2 * tokens_dev * layers * per_layer + attention * layers / L / (tp * sp)
    # This rank's layer weights once, plus the K/V it stores: its heads, 1/N of the pages.
    kv = num_tokens * kv_bytes_per_token_per_device(model, mesh, kv_cache_dtype) * layers * mesh.stage / L / sp
    nbytes = layer_bytes_per_device(model, mesh, layers) + kv
    # Ring collectives: all-reduce moves 2 (n-1)/n of the buffer, all-gather (n-1)/n of the
    # gathered result.
    coll = 0.0
    if tp > 1:
        coll += layers * 2 * (2 * (tp - 1) / tp) * tokens_dev * e * dtype_bytes(model)
    if sp > 1:
        attn_layers = model.kv_layers * layers / L
        coll += attn_layers * context_bytes_per_layer(model, mesh, num_tokens, kv_cache_dtype)[ring or PASS_Q]
    return flops, nbytes, coll


def device_costs(model: ModelConfig, mesh: MeshSettings, hw: Hardware, num_tokens: int,
                 context: int = 0, kv_cache_dtype: str = "auto", scan_layers: bool = False,
                 ring: str | None = None) -> DeviceCosts:
    """Per-device work of one prefill step of `num_tokens` new tokens after `context`
    cached ones under the mesh (no validation of the length). `ring`: the 'sequence'
    attention form (context.PASS_Q / PASS_KV; default pass-Q); `best_costs` picks.

    Pipeline (p = mesh.stage > 1, models/parallel/pipeline.py): the step is m microbatches of T/m
    tokens and m + p - 1 ticks; in every tick each stage runs its L/p layers on one
    microbatch (fill and drain ticks compute too, on rows that are thrown away), so a
    single prompt still passes through all p stages one after another and
    floor = (m + p - 1) x (one stage's time for one microbatch, its tensor all-reduces
    included) + (p - 1) hand-overs of one microbatch's [T/m, E] over the link: the last
    microbatch crosses every boundary after its stage finished it, the other hand-overs
    can hide behind the next microbatch's compute. Compute and memory are summed over the
    ticks before the max (a floor: each tick's max would be at least that), plus the
    embedding and LM head, which run once, outside the pipeline, on vocab shards."""
    ring = ring or (PASS_Q if mesh.sequence > 1 else None)
    p = mesh.stage
    m = pipeline_microbatches(mesh, num_tokens)
    ticks = m + p - 1
    e, b = model.hidden_size, dtype_bytes(model)
    attention = attention_flops(model, num_tokens, context)
    if ring == PASS_KV:  # dense [T/N, T/N] blocks on every hop: the whole T x T square
        attention = attention_flops(model, num_tokens, context, causal=False, kv_len=num_tokens)
    mixing = attention + linear_mixer_flops(model, num_tokens)  # a hybrid's linear layers too
    layers = model.num_layers // p
    flops, tick_bytes, coll = layer_work(model, mesh, num_tokens / m, mixing / m, layers, kv_cache_dtype, ring)
    kv_written = tick_bytes - layer_bytes_per_device(model, mesh, layers)  # only valid ticks write K/V
    flops = ticks * flops + 2 * e * model.vocab_size / vocab_split(model, mesh)
    nbytes = ticks * (tick_bytes - kv_written) + m * kv_written + end_bytes_read_per_device(model, mesh, num_tokens)
    coll *= ticks
    if prunes_last_layer(model, mesh, scan_layers):  # the last layer's q/o/MLP/attention and all-reduces on one row
        skipped = attention - attention_flops(model, num_tokens, context, sampled_last_layer=True)
        tp = mesh.heads
        flops -= (last_layer_matmul_saving(model, num_tokens) + skipped) / tp
        if tp > 1:
            coll -= 2 * (2 * (tp - 1) / tp) * (num_tokens - 1) * e * b
    peak = hw.peak_flops(model.dtype)
    bw, link = hw.hbm_bytes_per_s, hw.link_bytes_per_s
    if hw.shared_by_mesh:  # fake CPU devices share one machine
        peak, bw, link = peak / mesh.size, bw / mesh.size, link / mesh.size
    handover = (p - 1) * num_tokens / m * e * b
    coll_s, stage_s = (x / link if x and link > 0 else (math.inf if x else 0.0) for x in (coll, handover))
    return DeviceCosts(flops=flops, bytes=nbytes, collective_bytes=coll, compute_s=flops / peak,
                       memory_s=nbytes / bw, collective_s=coll_s, microbatches=m, stages=p,
                       stage_transfer_s=stage_s, ring=ring)


def best_costs(model: ModelConfig, mesh: MeshSettings, hw: Hardware, num_tokens: int, context: int = 0,
               kv_cache_dtype: str = "auto", scan_layers: bool = False) -> DeviceCosts:
    """`device_costs` under the 'sequence' form the engine runs for this step
    (context.engine_ring_mode)."""
    ring = engine_ring_mode(model, ring_modes(model, mesh, context, kv_cache_dtype))
    return device_costs(model, mesh, hw, num_tokens, context, kv_cache_dtype, scan_layers, ring)


def ttft_floor(model: ModelConfig, mesh: MeshSettings, hw: Hardware, num_tokens: int,
               chunk: int | None = None, scan_layers: bool = False) -> float:
    """Floor for a whole prompt; with `chunk`, the sum over chunked prefill steps (each
    step re-reads the weights and attends to the chunks before it)."""
    if not chunk or chunk >= num_tokens:
        return best_costs(model, mesh, hw, num_tokens, scan_layers=scan_layers).ttft_s
    return sum(best_costs(model, mesh, hw, min(chunk, num_tokens - start), start, scan_layers=scan_layers).ttft_s
               for start in range(0, num_tokens, chunk))


def plan_prefill(config: Config, hw: Hardware, prompt_len: int, link_gbps: float | None = None) -> dict:
    """Everything `jaxfill plan` reports for one prompt length (JSON-ready); with
    `link_gbps`, also the prefill-to-decode KV transfer time over that link."""
    model, engine, mesh = config.model, config.engine, config.mesh
    check_link_gbps(link_gbps)
    check_mesh(model, mesh)
    check_prompt_len(prompt_len, engine, model)
    per_token = kv_bytes_per_token(model, kv_cache_dtype=engine.kv_cache_dtype)
    pages = pages_for(prompt_len, engine.page_size)
    per_request = pages * engine.page_size * per_token
    modes = {r: device_costs(model, mesh, hw, prompt_len, kv_cache_dtype=engine.kv_cache_dtype,
                             scan_layers=engine.scan_layers, ring=r)
             for r in ring_modes(model, mesh, 0, engine.kv_cache_dtype)}
    cost = modes[engine_ring_mode(model, tuple(modes))]
    # Memory left after this device's weights; the cache holds its stage's layers of the
    # Hkv * r heads split over tensor.
    weights_dev = weight_bytes_per_device(model, mesh)
    hbm = hw.hbm_bytes / (mesh.size if hw.shared_by_mesh else 1)
    free = hbm - weights_dev
    per_token_dev = kv_bytes_per_token_per_device(model, mesh, engine.kv_cache_dtype)
    # a hybrid's working state (the same at any prompt length; two slots per request with
    # speculative decoding, engine/scheduler/verification.py); its snapshots come on top;
    # a device holds its stage's layers' state, heads split over tensor
    slots = engine.state_slots // engine.max_num_seqs if engine.state_slots else 1
    state, state_dev = slots * state_bytes(model), slots * state_bytes(model, mesh.tensor * mesh.stage)
    # the pool is split over 'sequence': the busiest rank holds ceil(pages / N) of them
    kv_dev = kv_pages_per_device(pages, mesh) * engine.page_size * per_token_dev
    per_request_dev = kv_dev + state_dev
    fit = max(0, int(free // per_request_dev)) * mesh.data if free > 0 else 0
    t2 = best_costs(model, mesh, hw, 2 * prompt_len, 0, engine.kv_cache_dtype, engine.scan_layers).ttft_s
    activations = activation_estimate(model, mesh, min(prompt_len, engine.max_num_batched_tokens))
    pruned = prunes_last_layer(model, mesh, engine.scan_layers)
    mm = matmul_flops(model, prompt_len, sampled_last_layer=pruned)
    att = attention_flops(model, prompt_len, sampled_last_layer=pruned)
    mixer = linear_mixer_flops(model, prompt_len)
    moved = kv_transfer_bytes(model, prompt_len, engine.kv_cache_dtype)
    transfer = {} if link_gbps is None else {
        "link_gbps": link_gbps,
        "kv_transfer_s": kv_transfer_seconds(moved, link_gbps),
        "kv_transfer_over_ttft_floor": kv_transfer_seconds(moved, link_gbps) / cost.ttft_s,
    }
    return {
        "prompt_len": prompt_len,
        "prefill_flops": mm + att + mixer,
        "matmul_flops": mm,
        "attention_flops": att,
        "linear_mixer_flops": mixer,
        "weight_bytes": weight_bytes(model),
        "kv_bytes_written": prompt_len * per_token,
        "kv_bytes_per_token": per_token,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "kv_bytes_per_request": per_request,
        "state_bytes_per_request": state,
        "state_bytes_per_request_per_device": state_dev,
        "kv_bytes_per_token_per_device": per_token_dev,  # L / stage layers, Hkv * r heads / tensor
        "kv_bytes_per_request_per_device": per_request_dev,
        "kv_bytes_per_device": kv_dev,  # this prompt's K/V on its busiest rank: / tensor, / sequence
        "activation_bytes_estimate": activations,
        "hbm_bytes_per_device": hbm,
        # weights + this prompt's K/V + activations within the engine pool's memory_utilization of HBM
        "fits": bool(weights_dev + kv_dev + activations <= hbm * engine.memory_utilization),
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
        "ring_mode": cost.ring,  # the 'sequence' attention form the engine runs (None without it)
        "cheaper_ring_mode": min(modes.values(), key=lambda c: c.ttft_s).ring,  # on this hardware's numbers
        **{f"{k.replace('-', '_').lower()}_{key}": v for k, c in modes.items() if k
           for key, v in (("collective_bytes_per_device", c.collective_bytes), ("ttft_floor_s", c.ttft_s))},
        "tokens_per_s_ceiling": prompt_len / cost.ttft_s,
        "weight_bytes_per_device": weights_dev,
        "free_bytes_per_device": free,
        "max_concurrent_requests": fit,
        "decay_coefficient": t2 / cost.ttft_s,
        "kv_transfer_bytes": moved,
        **transfer,
        **communication_per_token(model, mesh),
        "stages": mesh.stage,
        "microbatches": cost.microbatches,
        "bubble_fraction": cost.bubble_fraction,
        "stage_transfer_s": cost.stage_transfer_s,
    }


def communication_per_token(model: ModelConfig, mesh: MeshSettings) -> dict:
    """Activation bytes per prompt token on the wire. Pipeline: one [E] row crosses each
    of the p - 1 stage boundaries (a device of every stage but the last sends it; the
    program also hands over rows in fill/drain ticks, which are thrown away). Tensor: two
    ring all-reduces of [E] per layer, 2 (tp - 1) / tp of each sent by every device, over
    its stage's L / p layers."""
    e, b, tp = model.hidden_size, dtype_bytes(model), mesh.heads
    boundary = e * b if mesh.stage > 1 else 0
    return {"stage_boundary_bytes_per_token": boundary,
            "stage_boundary_bytes_per_token_total": (mesh.stage - 1) * boundary,
            "tensor_allreduce_bytes_per_token_per_device":
                model.num_layers // mesh.stage * 2 * (2 * (tp - 1) / tp) * e * b}


def plan(config: Config, hw: Hardware, prompt_lens: list[int], link_gbps: float | None = None) -> list[dict]:
    check_mesh(config.model, config.mesh)
    check_link_gbps(link_gbps)
    for n in prompt_lens:
        check_prompt_len(n, config.engine, config.model)
    return [plan_prefill(config, hw, n, link_gbps) for n in prompt_lens]


def default_prompt_lens(engine: EngineSettings) -> list[int]:
    return [n for n in (128, 512, 2048, 8192, 32768, 131072) if n < engine.max_model_len] or \
        [engine.max_model_len - 1]


def model_matmul_shape(model: ModelConfig, tokens: int = 2048) -> tuple[int, int, int]:
    """The matmul `--hardware cpu` times: the MLP up-projection of a `tokens` chunk."""
    return (tokens, model.hidden_size, model.intermediate_size)


def kv_pool_pages(config: Config, hw: Hardware, activation_bytes: float = 0) -> dict:
    """What `engine.num_pages = 0` gives on `hw` (engine/memory.py, the same formula): pages
    per data replica (mesh.sequence x what one device fits) and the tokens they hold, from this device's memory after its weights
    and `activation_bytes` (the engine measures them as the compiled step's temp buffers)."""
    from jaxfill.engine.memory import cpu_cap_pages, pool_pages

    model, engine, mesh = config.model, config.engine, config.mesh
    check_mesh(model, mesh)
    weights_dev = weight_bytes_per_device(model, mesh)
    page_bytes = engine.page_size * kv_bytes_per_token_per_device(model, mesh, engine.kv_cache_dtype)
    capacity = hw.hbm_bytes / (mesh.size if hw.shared_by_mesh else 1)
    pages = pool_pages(capacity, weights_dev, activation_bytes, page_bytes, engine.memory_utilization, mesh.sequence)
    if hw.shared_by_mesh and engine.cpu_kv_cache_gb > 0:  # the host's RAM: engine.cpu_kv_cache_gb caps it
        pages = min(pages, cpu_cap_pages(engine.cpu_kv_cache_gb, mesh.size, page_bytes, mesh.sequence))
    return {"kv_pool_pages": pages, "kv_pool_tokens": max(0, pages - 1) * engine.page_size,
            "kv_page_bytes_per_device": page_bytes, "memory_utilization": engine.memory_utilization,
            "activation_bytes": activation_bytes}
