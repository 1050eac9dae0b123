"""The serving bench's server start: a server is up once /health answers 200, whatever its body (vLLM's is
empty, ours is JSON)."""
import http.server
import subprocess
import sys
import threading

import pytest

from bench.serving.serve_servers import wait_healthy


class _EmptyHealth(http.server.BaseHTTPRequestHandler):
    def do_GET(self):                               # noqa: N802 - the http.server API
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server_and_proc(tmp_path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EmptyHealth)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    # answers SIGINT as a server does, also where the tests inherit it ignored (started as a background job)
    code = "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", proc, tmp_path / "server.log"
    finally:
        proc.kill()
        proc.wait()
        httpd.shutdown()


def test_an_empty_200_health_counts_as_up(server_and_proc):
    url, proc, log = server_and_proc
    log.write_text("")
    wait_healthy(proc, url, log, timeout=10.0)
    assert proc.poll() is None                      # not stopped: it was healthy


def test_a_server_that_never_answers_200_is_stopped_and_named(server_and_proc):
    url, proc, log = server_and_proc
    log.write_text("listening nowhere\n")
    with pytest.raises(RuntimeError, match="not healthy"):
        wait_healthy(proc, url + "/nothing-here", log, timeout=1.5)
    assert proc.poll() is not None


def test_the_engine_in_process_runs_the_served_requests_and_counts_refusals():
    """serve_engine's closed loop: every request ends once, a schema the engine cannot enforce is an error (the
    server's 400), the others stop or reach their budget, and the warm-up compiles each drawn schema first."""
    from types import SimpleNamespace

    from bench.serving import serve_client as sc
    from bench.serving.serve_engine import bench_engine
    refused = {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}, "else": {}}
    fine = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    reqs = [dict(job=i, kind=kind, name=kind, schema=schema, messages=[{"role": "user", "content": f"q{i}"}])
            for i, (kind, schema) in enumerate([("json", fine), ("chat", None), ("json", refused), ("chat", None),
                                                ("json", fine)])]
    assert [r["job"] for r in sc.warm_set(reqs, 1, schemas=2)] == [0, 2]      # the schemas first
    args = SimpleNamespace(model="default", max_num_seqs=0, concurrency=[2], speculative="none",
                           num_draft_tokens=3, max_tokens=4, json_max_tokens=24, fixed_length=True, warmup=2, schemas=0)
    (row,) = bench_engine(args, reqs)
    assert "error" not in row, row
    assert (row["ok"], row["errors"], row["x"]) == (4, 1, 2)
    assert 2 * 4 < row["output_tokens"] <= 2 * 4 + 2 * 24 and row["out_tok_s"] > 0


class _SlowStream(http.server.BaseHTTPRequestHandler):
    """An SSE answer of one content chunk after the request body's "delay" seconds."""
    protocol_version = "HTTP/1.1"

    def do_POST(self):                              # noqa: N802 - the http.server API
        import json
        import time
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(body["delay"])
        data = (b'data: {"choices": [{"delta": {"content": "x"}, "finish_reason": "stop"}]}\n\n'
                b"data: [DONE]\n\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_closed_loop_workers_share_one_queue():
    """A closed loop's workers take the next request as each ends, so requests go out in order and a worker
    whose earlier requests were short is never idle while another's are still waiting."""
    import asyncio
    import time

    from bench.serving import serve_client as sc
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowStream)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        delays = [0.6, 0.02] * 4                     # a fixed list per worker would give worker 0 every long one
        jobs = [(i % 2, dict(job=i, kind="chat"), {"delay": d}) for i, d in enumerate(delays)]
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/chat/completions"
        cfg = dict(load="closed", duration=None, timeout=30.0)
        recs = asyncio.run(sc._run(url, jobs, time.monotonic(), cfg))
    finally:
        httpd.shutdown()
    assert sorted(r["job"] for r in recs) == list(range(len(delays)))
    assert all(r["error"] is None and r["text"] == "x" for r in recs), recs
    sent = [r["sent"] for r in sorted(recs, key=lambda r: r["job"])]
    assert sent == sorted(sent)
    # the second worker serves every short request while the first waits on a long one
    assert max(r["end"] for r in recs) - min(sent) < 2.0        # a fixed list each: 4 x 0.6 s at least


def test_engine_rates_divide_the_counters_by_steps():
    """A run's engine figures from two /metrics scrapes: ms a step per host part, idle as a fraction of the run;
    a server without the host counters (an older one) leaves them at zero, not an error."""
    from bench.serving.serve_servers import engine_rates
    before = {"specdec_steps_total": 10, "specdec_gpu_idle_seconds_total": 0.5, "specdec_generation_tokens_total": 100,
              "specdec_host_plan_seconds_total": 1.0, "specdec_server_io_seconds_total": 0.25}
    after = {"specdec_steps_total": 110, "specdec_gpu_idle_seconds_total": 0.6, "specdec_generation_tokens_total": 900,
             "specdec_host_plan_seconds_total": 1.02, "specdec_server_io_seconds_total": 0.26}
    rates = engine_rates(before, after, 2.0)
    assert rates["engine_steps"] == 100 and rates["step_ms"] == 20.0 and rates["tokens_per_step"] == 8.0
    assert rates["gpu_idle_frac"] == 0.05
    assert rates["plan_ms"] == pytest.approx(0.2) and rates["io_ms"] == pytest.approx(0.1)
    assert rates["commit_ms"] == 0.0 and rates["wait_ms"] == 0.0
