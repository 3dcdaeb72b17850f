"""Prometheus series for the server, on a private CollectorRegistry per server.

Names and labels follow vLLM's (`vllm:time_to_first_token_seconds` ->
`jaxfill_time_to_first_token_seconds`, `model_name` on every series, `finished_reason` on
request_success) so existing dashboards port by renaming the prefix. TTFT counts from the
moment the gRPC handler received the request (queueing included) to the engine step that
produced the first token; TPOT excludes the first token.

Every admitted request is observed exactly once, when it ends (EngineLoop calls
`observe_finished`), whether it finished, was aborted, failed, or its client cancelled or
passed its deadline. Engine-wide counters (prefix-cache queries and hits, preemptions)
are read from Engine.stats() deltas. No `_created` series: they double the scrape for
nothing a dashboard uses.
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily

from jaxfill.engine.expert_load import LOAD_RATIO_BUCKETS

# Latency buckets reach 120 s and beyond: a long prompt queued behind others on a CPU
# host really does take minutes, and an overflowing +Inf bucket hides that.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 120.0, 240.0, 480.0, 960.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 120.0)
# stop / length / abort (Abort RPC, shutdown) / error come from the engine; cancelled and
# deadline are streams whose client went away or ran out of time before the end.
FINISHED_REASONS = ("stop", "length", "abort", "error", "cancelled", "deadline")
# Engine.stats() counters -> whether they count pages (x page_size: tokens, as vLLM counts)
_ENGINE_COUNTERS = {"prefix_cache_queries": True, "prefix_cache_hits": True, "num_preemptions": False,
                    "host_kv_queries": True, "host_kv_hits": True, "disk_kv_queries": True, "disk_kv_hits": True,
                    "spec_verifications": False, "spec_proposed_tokens": False, "spec_accepted_tokens": False}


def count_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's request-token buckets)."""
    out, base = [], 1
    while True:
        for m in (1, 2, 5):
            if m * base > limit:
                return tuple(out)
            out.append(m * base)
        base *= 10


class _NoCreatedRegistry(CollectorRegistry):
    """A registry whose scrape leaves out the `_created` samples, for this server only
    (prometheus_client.disable_created_metrics() would change every registry in the process)."""

    def collect(self):
        for metric in super().collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class ExpertLoadHistogram:
    """`jaxfill_moe_expert_load_ratio`: between two stats snapshots, each (MoE layer,
    expert)'s share of its layer's (token, expert) pairs, over the mean share (1 = balanced;
    an expert at 3 does three times its fair share and sets the layer's pace). Observed
    in bulk from the engine's per-expert counts, so a 48-layer x 128-expert model costs
    one numpy pass per snapshot, not 6,144 observe() calls."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.buckets = np.zeros(len(LOAD_RATIO_BUCKETS), np.int64)  # cumulative: ratio <= le
        self.count, self.total = 0, 0.0
        self._seen: dict | None = None
        self._source: dict | None = None

    def update(self, per_layer: dict) -> None:  # layer -> [E] pairs so far (Engine.stats)
        if per_layer is self._source:  # the engine rebuilds it only when new counts arrived
            return
        self._source = per_layer
        seen = {layer: np.asarray(c, np.int64) for layer, c in per_layer.items()}
        if self._seen is not None:
            for layer, counts in seen.items():
                delta = counts - self._seen.get(layer, 0)
                if delta.sum() > 0:
                    ratio = delta * len(delta) / delta.sum()
                    self.buckets += (ratio[None, :] <= np.asarray(LOAD_RATIO_BUCKETS)[:, None]).sum(axis=1)
                    self.count += len(ratio)
                    self.total += float(ratio.sum())
        self._seen = seen

    def collect(self):
        family = HistogramMetricFamily("jaxfill_moe_expert_load_ratio",
                                       "Per MoE layer and expert, between snapshots: the expert's share of its "
                                       "layer's routed (token, expert) pairs over the mean share.",
                                       labels=["model_name"])
        family.add_metric([self.model_name],
                          [(repr(float(le)), int(n)) for le, n in zip(LOAD_RATIO_BUCKETS, self.buckets)]
                          + [("+Inf", self.count)], self.total)
        yield family


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "", max_model_len: int = 4096):
        self.registry = registry or _NoCreatedRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist("jaxfill_time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.tpot = hist("jaxfill_time_per_output_token_seconds",
                         "Per request: (last token - first token) / (tokens - 1).", TOKEN_BUCKETS)
        self.itl = hist("jaxfill_inter_token_latency_seconds", "Between successive streamed chunks.", TOKEN_BUCKETS)
        self.queue_time = hist("jaxfill_request_queue_time_seconds", "Time spent waiting to be scheduled.",
                               LATENCY_BUCKETS)
        self.prefill_time = hist("jaxfill_request_prefill_time_seconds",
                                 "First scheduled to first token (prefill, chunks included).", LATENCY_BUCKETS)
        self.e2e = hist("jaxfill_e2e_request_latency_seconds", "Arrival to the end of the request.",
                        LATENCY_BUCKETS)
        self.request_prompt_tokens = hist("jaxfill_request_prompt_tokens", "Prompt tokens per request.",
                                          count_buckets(max_model_len))
        self.request_generation_tokens = hist("jaxfill_request_generation_tokens",
                                              "Generated tokens per request.", count_buckets(max_model_len))
        self.running = Gauge("jaxfill_num_requests_running", "Requests in the running batch.", m,
                             registry=r).labels(model_name)
        self.waiting = Gauge("jaxfill_num_requests_waiting", "Requests waiting to be scheduled.", m,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge("jaxfill_kv_cache_usage_ratio", "Fraction of KV pages in use (0..1).", m,
                              registry=r).labels(model_name)
        self.prompt_tokens = Counter("jaxfill_prompt_tokens", "Prompt tokens of ended requests.", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("jaxfill_generation_tokens", "Generated tokens.", m,
                                         registry=r).labels(model_name)
        self.engine_counters = {
            "prefix_cache_queries": Counter("jaxfill_prefix_cache_queries",
                                            "Prompt tokens in full pages looked up in the prefix cache.", m,
                                            registry=r).labels(model_name),
            "prefix_cache_hits": Counter("jaxfill_prefix_cache_hits",
                                         "Prompt tokens served from cached pages.", m, registry=r).labels(model_name),
            "num_preemptions": Counter("jaxfill_num_preemptions", "Running requests preempted for pages.", m,
                                       registry=r).labels(model_name),
        }
        for tier in ("host", "disk"):  # the prefix cache's tiers below the device (engine.host_kv_cache_gb)
            self.engine_counters[f"{tier}_kv_queries"] = Counter(
                f"jaxfill_{tier}_prefix_cache_queries", f"Prompt tokens looked up in the {tier} KV tier "
                "after a device miss.", m, registry=r).labels(model_name)
            self.engine_counters[f"{tier}_kv_hits"] = Counter(
                f"jaxfill_{tier}_prefix_cache_hits", f"Prompt tokens restored from the {tier} KV tier.", m,
                registry=r).labels(model_name)
        # speculative decoding (engine/speculative/), under vLLM's names: zeros while it is off
        for key, name, doc in (("spec_verifications", "num_drafts", "Decodes that verified proposals."),
                               ("spec_proposed_tokens", "num_draft_tokens", "Proposed tokens verified."),
                               ("spec_accepted_tokens", "num_accepted_tokens", "Proposed tokens accepted.")):
            self.engine_counters[key] = Counter(f"jaxfill_spec_decode_{name}", doc, m, registry=r).labels(model_name)
        self.tier_bytes = Gauge("jaxfill_kv_tier_usage_bytes", "Bytes of K/V kept in each tier below the device.",
                                ["model_name", "tier"], registry=r)
        self.success = Counter("jaxfill_request_success", "Ended requests by finished reason.",
                               ["model_name", "finished_reason"], registry=r)
        for reason in FINISHED_REASONS:
            self.success.labels(model_name, reason)  # export zeros so rate() works from the start
        self._engine_seen: dict | None = None
        self.expert_load = ExpertLoadHistogram(model_name)
        r.register(self.expert_load)

    def update_stats(self, stats: dict) -> None:
        """Gauges from an Engine.stats() snapshot, and the engine counters' growth since the
        previous one (the first call only sets the baseline: counts start at server start)."""
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        total = stats.get("pages_total") or 0
        if total:
            self.kv_usage.set(1.0 - stats.get("pages_free", total) / total)
        seen = {k: stats.get(k, 0) * (stats.get("page_size", 1) if per_page else 1)
                for k, per_page in _ENGINE_COUNTERS.items()}
        if self._engine_seen is not None:
            for k, value in seen.items():
                if value > self._engine_seen[k]:
                    self.engine_counters[k].inc(value - self._engine_seen[k])
        self._engine_seen = seen
        for tier in ("host", "disk"):
            if f"{tier}_kv_cache_bytes" in stats:
                self.tier_bytes.labels(self.model_name, tier).set(stats[f"{tier}_kv_cache_bytes"])
        if "moe_expert_tokens" in stats:
            self.expert_load.update(stats["moe_expert_tokens"])

    def observe_finished(self, *, reason: str, prompt_tokens: int, completion_tokens: int,
                         ttft_s: float | None, tpot_s: float | None, queue_s: float | None,
                         prefill_s: float | None, e2e_s: float | None) -> None:
        self.success.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(max(prompt_tokens, 0))
        self.request_prompt_tokens.observe(max(prompt_tokens, 0))
        self.request_generation_tokens.observe(max(completion_tokens, 0))
        for hist, value in ((self.ttft, ttft_s), (self.tpot, tpot_s), (self.queue_time, queue_s),
                            (self.prefill_time, prefill_s), (self.e2e, e2e_s)):
            if value is not None and value >= 0:
                hist.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
