"""The planner's 'sequence' (context parallel) arithmetic: which attention form a prefill
step takes and what it sends, per device (models/parallel/context.py, ring_attention.py).

Under mesh.sequence = N the KV pool is split: each rank holds 1/N of every sequence's
pages (page j on rank j mod N), so a prompt's KV bytes per device are the tensor-split
figure / N. Each layer then runs one of two forms:

* pass-Q (any step): all-gather the step's Q and new K/V over 'sequence', attend every
  query row against the rank's own pages (1/N of the keys: the causal FLOPs / N), merge
  by one all-max of the LSEs [T, Hq_local] f32 and one reduce-scatter of the outputs and
  weights [T, Hq_local, D + 1] f32. Ring bytes sent per device and layer:
  (N - 1)/N x T x (Hq_local x D x dtype + the new K/V's cache bytes)
  + (N - 1)/N x T x Hq_local x (D + 1) x 4 + (N - 1)/N x T x Hq_local x 4.
* pass-KV ring (a step with nothing cached, unquantized pages, model.context_attention
  = pass_kv): N - 1 ppermute hops of each rank's [T/N, 2 Hkv_local, D] block; Q and outputs
  stay. Bytes: (N - 1)/N x T x the new K/V's cache bytes. Its blocks are dense
  [T/N, T/N] per hop, masked after the fact: it computes the full T x T score square,
  twice the causal triangle pass-Q's paged kernel does (ring_attention.py's docstring).

The planner costs both where the ring is eligible and reports both floors; the floor it
quotes is the form the engine runs: pass-Q, unless model.context_attention = "pass_kv"
(the engine's `auto` is pass-Q: on CPU the ring was 2-17x slower at 1k-8k tokens,
benchmarks/context_modes.py, and no accelerator has run it). `cheaper_ring_mode` says
which form this hardware's numbers favour (the ring's 2x attention FLOPs lose at long
prompts even though it sends fewer bytes).
"""

from __future__ import annotations

from jaxfill.engine.config import MeshSettings
from jaxfill.engine.planner.layout import dtype_bytes, kv_bytes_per_token_per_device
from jaxfill.models.config import ModelConfig

PASS_Q, PASS_KV = "pass-Q", "pass-KV"


def ring_modes(model: ModelConfig, mesh: MeshSettings, context: int = 0, kv_cache_dtype: str = "auto") -> tuple:
    """Attention forms the engine may run for a step (models/mixers/attention.py's rule): none
    without 'sequence'; pass-KV only with nothing cached and unquantized pages."""
    if mesh.sequence == 1:
        return (None,)
    if context == 0 and kv_cache_dtype == "auto" and model.attention.context_attention != "pass_q" and not model.mla.kv_lora_rank:
        return (PASS_Q, PASS_KV)
    return (PASS_Q,)


def engine_ring_mode(model: ModelConfig, modes: tuple):
    """The form the engine takes among `modes` (ring_modes'): the ring only when asked."""
    return PASS_KV if PASS_KV in modes and model.attention.context_attention == "pass_kv" else modes[0]


def new_kv_bytes_per_token_layer(model: ModelConfig, mesh: MeshSettings, kv_cache_dtype: str = "auto") -> float:
    """One token's new K/V in one attention layer on one tensor rank, as the cache stores it
    (2 Hkv_local x D x dtype for plain pages; the latent for MLA; scales when quantized)."""
    stage_layers = max(1, model.kv_layers // mesh.stage)
    return kv_bytes_per_token_per_device(model, mesh, kv_cache_dtype) / stage_layers


def context_bytes_per_layer(model: ModelConfig, mesh: MeshSettings, num_tokens: float,
                            kv_cache_dtype: str = "auto") -> dict:
    """Ring bytes one device sends per attention layer for a step of `num_tokens` under
    each form (module docstring), and their parts. 0 without 'sequence'."""
    n = mesh.sequence
    share = (n - 1) / n
    hq = model.num_heads // mesh.heads
    d, b = model.head_dim, dtype_bytes(model)
    kv = new_kv_bytes_per_token_layer(model, mesh, kv_cache_dtype)
    gather = share * num_tokens * (hq * d * b + kv)
    scatter = share * num_tokens * hq * (d + 1) * 4
    all_max = share * num_tokens * hq * 4
    return {"pass_q_all_gather": gather, "pass_q_reduce_scatter": scatter, "pass_q_all_max": all_max,
            PASS_Q: gather + scatter + all_max, PASS_KV: share * num_tokens * kv}


def kv_pages_per_device(pages: int, mesh: MeshSettings) -> int:
    """Pages of one sequence on its busiest sequence rank (page j on rank j mod N)."""
    return -(-pages // mesh.sequence)


def activation_estimate(model: ModelConfig, mesh: MeshSettings, step_tokens: int) -> float:
    """A rough per-device activation peak of one layer in a step of `step_tokens` (the
    engine chunks prompts at engine.max_num_batched_tokens): the gathered Q and new K/V of
    the step [T, Hq_local + 2 Hkv_local, D], pass-Q's f32 partial outputs and weights
    [T, Hq_local, D + 1], and this rank's T/N rows of the MLP's gate and up [T/N, 2 I/tp]
    and the f32 residual [T/N, E]. Not XLA's number (the engine measures that at start-up)."""
    n, d, b = mesh.sequence, model.head_dim, dtype_bytes(model)
    hq = model.num_heads // mesh.heads
    inter = max(model.intermediate_size, model.moe.intermediate_size * model.moe.experts_per_token) / mesh.heads
    gathered = step_tokens * (hq * d * b + new_kv_bytes_per_token_layer(model, mesh))
    partial = step_tokens * hq * (d + 1) * 4 if n > 1 else step_tokens * hq * d * b
    local = step_tokens / n
    return gathered + partial + local * (2 * inter * b + model.hidden_size * 4)
