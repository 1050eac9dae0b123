"""/metrics: prometheus-client, in a registry of the server's own (several servers may share a process).

The series that routers and dashboards built for vLLM read are exposed under vLLM's names too
(engine/server/metrics_vllm.py). Request-level series (status, tokens, TTFT, ITL, latency) are observed on the
event loop as responses are made. With several API processes (PROMETHEUS_MULTIPROC_DIR set), prometheus-client
keeps them in files that every process sums when scraped. Engine-level series (queue, running, KV, steps, GPU
idle, speculation) are read from the engine when scraped (`engine_stats`, in the engine's process), so the loop
pays nothing for them between scrapes; the values it is writing meanwhile may be a step old.
"""
from __future__ import annotations

import gc
import os
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.server import metrics_vllm

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.0005, 0.00075, 0.001, 0.00125, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class ServerMetrics:
    def __init__(self, model_name: str = ""):
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
        self.vllm = metrics_vllm.VllmRequestSeries(r, model_name)     # the same values under vLLM's names
        self.engine = EngineCollector(model_name)
        self.exposed = _exposed(r)
        self.exposed.register(self.engine)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.vllm.prompt_tokens.inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm.ttft.observe(seconds)

    def inter_token(self, gap: float, tokens: int) -> None:
        self.itl.observe(gap / tokens)
        self.vllm.itl.observe(gap / tokens)

    def finished(self, gen) -> None:
        seconds = time.perf_counter() - gen.arrival
        self.latency.observe(seconds)
        self.vllm.e2e.observe(seconds)
        for st in gen.choices:
            self.finishes.labels(st.finish or "unknown").inc()
            self.generation_tokens.inc(st.tokens)
            self.vllm.finished(st.finish or "unknown", st.tokens)

    def render(self, stats: dict) -> bytes:
        """Everything, with the engine's series from `stats` (call on the event loop: no await in between)."""
        self.engine.stats = stats
        return generate_latest(self.exposed)


def engine_stats(engine, live: int, up: bool, server_io: float = 0.0) -> dict:
    """What /metrics reports of the engine: read where the engine runs (a plain dict, so it can cross processes).
    `server_io`: seconds the engine process's loop spent taking in requests and sending outputs."""
    t, service = engine.timings, engine.guided.service
    return dict(queue=len(engine.scheduler.waiting), running=len(engine.scheduler.running), live=live,
                kv_used=engine.blocks.num_blocks - engine.blocks.num_free, kv_total=engine.blocks.num_blocks,
                compiles=service.compiling() if service is not None else 0, steps=t.steps, gpu_idle=t.gpu_idle,
                spec_rows=t.spec_rows, spec_proposed=t.spec_proposed, spec_accepted=t.spec_accepted,
                acceptance_length=t.acceptance_length, up=float(up), frozen_objects=gc.get_freeze_count(),
                preemptions=engine.scheduler.num_preemptions, host_plan=t.plan, host_commit=t.commit,
                host_wait=t.wait, server_io=server_io, **engine.prefix_cache_stats())


DEAD_STATS = dict(queue=0, running=0, live=0, kv_used=0, kv_total=0, compiles=0, steps=0, gpu_idle=0.0, spec_rows=0,
                  spec_proposed=0, spec_accepted=0, acceptance_length=0.0, up=0.0, prefix_query_tokens=0,
                  prefix_hit_tokens=0, prefix_cached_pages=0, prefix_evictions=0, frozen_objects=0, preemptions=0,
                  host_plan=0.0, host_commit=0.0, host_wait=0.0, server_io=0.0)


def combine_stats(replies: list[dict]) -> dict:
    """One engine's stats from several: counts and sums add up; acceptance length is the mean over verifying rows;
    `up` counts the engines that answered."""
    if len(replies) == 1:
        return replies[0]
    out = {k: sum(r[k] for r in replies) for k in replies[0]}
    rows = out["spec_rows"]
    out["acceptance_length"] = sum(r["acceptance_length"] * r["spec_rows"] for r in replies) / rows if rows else 0.0
    return out


class EngineCollector:
    """Engine-level series from the last `engine_stats` (set just before each render), and the frozen heap of the
    API process that renders them."""

    def __init__(self, model_name: str = ""):
        self.stats, self.model_name = DEAD_STATS, model_name

    def collect(self):
        s = self.stats
        yield from metrics_vllm.engine_series(s, self.model_name)
        yield _gauge("specdec_queue_length", "Requests waiting to be scheduled", s["queue"])
        yield _gauge("specdec_running_requests", "Requests being scheduled", s["running"])
        yield _gauge("specdec_server_requests_in_progress", "Requests admitted by the server, not finished", s["live"])
        yield _gauge("specdec_kv_cache_usage_ratio", "Fraction of KV pages in use",
                     s["kv_used"] / max(s["kv_total"], 1))
        yield _gauge("specdec_kv_blocks_used", "KV pages in use", s["kv_used"])
        yield _gauge("specdec_kv_blocks_total", "KV pages", s["kv_total"])
        yield _gauge("specdec_grammar_compiles_unfinished", "Grammar compiles queued or running (abandoned ones too)",
                     s["compiles"])
        yield _counter("specdec_steps", "Committed engine steps", s["steps"])
        yield _counter("specdec_gpu_idle_seconds", "Compute stream idle between steps (CUDA)", s["gpu_idle"])
        yield _gauge("specdec_gpu_idle_per_step_seconds", "Mean compute-stream idle per step since start",
                     s["gpu_idle"] / s["steps"] if s["steps"] else 0.0)
        yield _counter("specdec_host_plan_seconds", "Engine loop: planning steps (schedule, inputs)", s["host_plan"])
        yield _counter("specdec_host_commit_seconds", "Engine loop: committing steps' tokens", s["host_commit"])
        yield _counter("specdec_host_wait_seconds", "Engine loop: blocked on a step's tokens", s["host_wait"])
        yield _counter("specdec_server_io_seconds", "Engine process loop: taking in requests, sending outputs",
                       s["server_io"])
        yield _counter("specdec_spec_verify_rows", "Row-steps that verified drafts", s["spec_rows"])
        yield _counter("specdec_spec_draft_tokens", "Draft tokens verified", s["spec_proposed"])
        yield _counter("specdec_spec_accepted_tokens", "Draft tokens accepted", s["spec_accepted"])
        yield _gauge("specdec_spec_acceptance_length", "Tokens per verifying row-step since start (0: none)",
                     s["acceptance_length"])
        yield _counter("specdec_prefix_cache_queries",
                       "Prompt tokens of admitted requests, looked up in the prefix cache", s["prefix_query_tokens"])
        yield _counter("specdec_prefix_cache_hits", "Prompt tokens found in the prefix cache", s["prefix_hit_tokens"])
        yield _gauge("specdec_prefix_cache_pages", "KV pages registered in the prefix cache", s["prefix_cached_pages"])
        yield _counter("specdec_prefix_cache_evictions", "Cached KV pages taken back for new ones",
                       s["prefix_evictions"])
        yield _gauge("specdec_engine_up", "1 while the engine runs", s["up"])
        yield _gauge("specdec_engine_frozen_objects", "Objects of the engine's process out of the garbage "
                     "collector's reach since start (gc.freeze; 0: not frozen)", s["frozen_objects"])
        yield _gauge("specdec_api_frozen_objects", "Objects of the API process answering this scrape out of the "
                     "garbage collector's reach since it serves (gc.freeze; 0: not frozen)", gc.get_freeze_count())


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _exposed(own: CollectorRegistry) -> CollectorRegistry:
    """The registry /metrics renders: this process's own, or every API process's series summed."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return own
    summed = CollectorRegistry()
    multiprocess.MultiProcessCollector(summed)
    return summed
