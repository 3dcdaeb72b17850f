"""Prometheus series for the server, on a private CollectorRegistry per server.

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `jaxfill_time_to_first_token_seconds`)
so existing dashboards port by renaming the prefix. TTFT counts from the moment the gRPC
handler received the request (queueing included) to the engine step that produced the
first token; TPOT excludes the first token.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets reach 120 s and beyond: a long prompt queued behind others on a CPU
# host really does take minutes, and an overflowing +Inf bucket hides that.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 120.0, 240.0, 480.0, 960.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 120.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = ""):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("jaxfill_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("jaxfill_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (tokens - 1).",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("jaxfill_inter_token_latency_seconds", "Between successive streamed chunks.",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.queue_time = Histogram("jaxfill_request_queue_time_seconds", "Time spent waiting to be scheduled.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("jaxfill_request_prefill_time_seconds",
                                      "First scheduled to first token (prefill, chunks included).",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxfill_e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("jaxfill_num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("jaxfill_num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge("jaxfill_kv_cache_usage_ratio", "Fraction of KV pages in use (0..1).", registry=r)
        self.prompt_tokens = Counter("jaxfill_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("jaxfill_generation_tokens", "Generated tokens.", registry=r)
        self.prefix_hits = Counter("jaxfill_prefix_cache_hit_tokens", "Prompt tokens served from cached pages.",
                                   registry=r)
        self.success = Counter("jaxfill_request_success", "Finished requests by finish reason.",
                               ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.success.labels(finish_reason=reason)  # export zeros so rate() works from the start

    def update_stats(self, stats: dict) -> None:
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        total = stats.get("pages_total") or 0
        if total:
            self.kv_usage.set(1.0 - stats.get("pages_free", total) / total)

    def observe_finished(self, *, reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                         ttft_s: float | None, tpot_s: float | None, queue_s: float | None,
                         prefill_s: float | None, e2e_s: float | None) -> None:
        self.success.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(max(prompt_tokens, 0))
        self.prefix_hits.inc(max(cached_tokens, 0))
        for hist, value in ((self.ttft, ttft_s), (self.tpot, tpot_s), (self.queue_time, queue_s),
                            (self.prefill_time, prefill_s), (self.e2e, e2e_s)):
            if value is not None and value >= 0:
                hist.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
