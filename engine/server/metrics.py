"""/metrics: prometheus-client, in a registry of the server's own (several servers may share a process).

Request-level series (status, tokens, TTFT, ITL, latency) are observed on the event loop as responses are
made. Engine-level series (queue, running, KV, steps, GPU idle, speculation) are read from the engine when
scraped, so the engine thread pays nothing for them; the values it is writing meanwhile may be a step old.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.0005, 0.00075, 0.001, 0.00125, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class ServerMetrics:
    def __init__(self, aengine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specdec_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finishes = Counter("specdec_request_finish", "Finished choices by finish reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("specdec_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("specdec_inter_token_latency_seconds", "Time per output token between deliveries "
                             "(a delivery of k tokens after a gap g counts once, as g / k)", registry=r,
                             buckets=ITL_BUCKETS)
        self.latency = Histogram("specdec_request_latency_seconds", "Arrival to last token", registry=r,
                                 buckets=LATENCY_BUCKETS)
        r.register(EngineCollector(aengine))

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, gap: float, tokens: int) -> None:
        self.itl.observe(gap / tokens)

    def finished(self, gen) -> None:
        self.latency.observe(time.perf_counter() - gen.arrival)
        for st in gen.choices:
            self.finishes.labels(st.finish or "unknown").inc()
            self.generation_tokens.inc(st.tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    def __init__(self, aengine):
        self.aengine = aengine

    def collect(self):
        eng, t = self.aengine.engine, self.aengine.engine.timings
        used = eng.blocks.num_blocks - eng.blocks.num_free
        yield _gauge("specdec_queue_length", "Requests waiting to be scheduled", len(eng.scheduler.waiting))
        yield _gauge("specdec_running_requests", "Requests being scheduled", len(eng.scheduler.running))
        yield _gauge("specdec_server_requests_in_progress", "Requests admitted by the server, not finished",
                     self.aengine.live)
        yield _gauge("specdec_kv_cache_usage_ratio", "Fraction of KV pages in use", used / max(eng.blocks.num_blocks, 1))
        yield _gauge("specdec_kv_blocks_used", "KV pages in use", used)
        yield _gauge("specdec_kv_blocks_total", "KV pages", eng.blocks.num_blocks)
        service = eng.guided.service
        yield _gauge("specdec_grammar_compiles_unfinished", "Grammar compiles queued or running (abandoned ones too)",
                     service.compiling() if service is not None else 0)
        yield _counter("specdec_steps", "Committed engine steps", t.steps)
        yield _counter("specdec_gpu_idle_seconds", "Compute stream idle between steps (CUDA)", t.gpu_idle)
        yield _gauge("specdec_gpu_idle_per_step_seconds", "Mean compute-stream idle per step since start",
                     t.gpu_idle / t.steps if t.steps else 0.0)
        yield _counter("specdec_spec_verify_rows", "Row-steps that verified drafts", t.spec_rows)
        yield _counter("specdec_spec_draft_tokens", "Draft tokens verified", t.spec_proposed)
        yield _counter("specdec_spec_accepted_tokens", "Draft tokens accepted", t.spec_accepted)
        yield _gauge("specdec_spec_acceptance_length", "Tokens per verifying row-step since start (0: none)",
                     t.acceptance_length)
        yield _gauge("specdec_engine_up", "1 while the engine thread runs", float(self.aengine.healthy()))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
