"""vLLM's metric names beside specdec's own, so that what was built for vLLM reads this server unchanged: routers
and endpoint pickers (llm-d's reads vllm:num_requests_waiting and vllm:kv_cache_usage_perc), autoscalers and
Grafana dashboards. Every series carries vLLM's labels, model_name (the served name) and engine: the engine
process's index for the engine-level series (one each with --data-parallel-size), "0" for the request-level ones.

The values are specdec's, under vLLM's meaning: queue and running requests of the scheduler, the fraction of KV
pages in use, prompt tokens looked up in and found in the prefix cache, preemptions, and per request the time to
first token, the gap between tokens, the end-to-end latency, its tokens and its finish reason.
"""
from __future__ import annotations

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LABELS = ("model_name", "engine")
ENGINE = "0"
# from a fast token's gap to a long request's end
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class VllmRequestSeries:
    """The request-level series, observed where specdec's are (engine/server/metrics.py ServerMetrics)."""

    def __init__(self, registry, model_name: str):
        self.values = (model_name, ENGINE)
        r, labels = registry, LABELS
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, registry=r, buckets=TTFT_BUCKETS).labels(*self.values)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, registry=r, buckets=ITL_BUCKETS).labels(*self.values)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, registry=r, buckets=E2E_BUCKETS).labels(*self.values)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=r).labels(*self.values)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                         registry=r).labels(*self.values)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               (*labels, "finished_reason"), registry=r)

    def finished(self, reason: str, tokens: int) -> None:
        self.success.labels(*self.values, reason).inc()
        self.generation_tokens.inc(tokens)


def engine_series(stats: dict, model_name: str):
    """The engine-level series of `stats` (engine/server/metrics.py engine_stats), as vLLM names them: one sample
    an engine process, labelled by its index, where stats["engines"] has them (--data-parallel-size)."""
    engines = {str(i): s for i, s in stats.get("engines", {ENGINE: stats}).items()}
    for kind, name, doc, value in (
            (GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.",
             lambda s: s["running"]),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             lambda s: s["queue"]),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             lambda s: s["kv_used"] / max(s["kv_total"], 1)),
            (CounterMetricFamily, "vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", lambda s: s["prefix_query_tokens"]),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             lambda s: s["prefix_hit_tokens"]),
            (CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             lambda s: s["preemptions"])):
        family = kind(name, doc, labels=LABELS)
        for engine, s in engines.items():
            family.add_metric([model_name, engine], value(s))
        yield family


