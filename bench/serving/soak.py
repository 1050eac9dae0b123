"""Soak: `specdec serve` under a mixed load with hostile requests in it, for minutes; is it still well?

    python -m bench.serving.soak --minutes 10 --streams 32             # GPU: the default model
    python -m bench.serving.soak --minutes 1 --baseline-minutes 1 --streams 4 --max-tokens 16 \\
        --server-args="--device cpu --dtype float32 --attention-backend torch --max-model-len 1024" \\
        --out /tmp/soak_cpu.json                                                                     # CPU smoke

First a baseline: --baseline-minutes of the same load with the hostile share sent as chat (0: none). Then the soak:
--streams closed-loop workers (asyncio, one client process) each send one request after another for --minutes. Each
request is, by --mix weights: `chat` (a question, --max-tokens), `guided` (a JME schema as response_format), `tools`
(a forced tool call with a JME schema as its parameters) or `hostile` (a turn through HOSTILE,
bench/serving/soak_hostile.py: oversized and broken bodies, stop strings past the bounds, grammars that compile for
minutes, a body sent a byte a second), from another source address on loopback. Well-behaved requests must answer
200 and hostile ones their 4xx; anything else (a 5xx, a timeout, a wrong status) is counted as an error with its
text. Every --sample-s the bench records the server's RSS (all its processes), the GPU memory in use
(torch.cuda.mem_get_info, or 0 on CPU) and the engine's KV pages from /metrics (bench/serving/soak_state.py). Per
minute: requests by kind, errors, and the p50 / p99 latency of the well-behaved ones. At the end, once idle: KV pages
held (must be 0). The verdict: no error among well-behaved requests, their p99 within 1.5x the baseline's, and RSS
flat (within --rss-flat-mb) over the last half of the soak, at most its last 5 minutes. Writes --out (JSON), a .md
beside it (printed last) and a .png (p99 latency per minute; RSS and GPU memory over time).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

from bench.common import QUESTIONS, markdown_table, note, record, write_results
from bench.guided.guided_quality import DATASETS, load_schemas, resolve
from bench.serving.serve_servers import launch, log_tail, stop
from bench.serving.soak_hostile import HOSTILE, slow_body
from bench.serving.soak_state import gpu_used_mb, metric, rss_mb, sampler

HOSTILE_ADDRESS = "127.0.0.2"      # the hostile client's source address when the server is on loopback


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--baseline-minutes", type=float, default=None, help="the load without hostile requests first "
                   "(default: --minutes; 0: none)")
    p.add_argument("--rss-flat-mb", type=float, default=200.0, help="RSS growth allowed over the soak's last part")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--mix", default="chat=0.35,guided=0.3,tools=0.25,hostile=0.1")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    p.add_argument("--data", default="../shared/data/jsonschemabench")
    p.add_argument("--server-args", default="", help="more `specdec serve` flags")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/soak.json")
    return p.parse_args(argv)


# ---- requests ----------------------------------------------------------------------------------------------
class Requests:
    def __init__(self, args, model: str):
        self.args, self.model = args, model
        self.kinds, self.weights = zip(*((k, float(w)) for k, w in (x.split("=") for x in args.mix.split(","))))
        # the schemas the server takes: those it refuses by design (a keyword it cannot enforce) are not load
        from engine.guided.schema_check import unenforced_keywords
        self.schemas = [s for _, s in load_schemas(resolve(DATASETS["JME"], args.data))
                        if isinstance(s, dict) and not unenforced_keywords(s)]
        self.hostile = sorted(HOSTILE)
        self.turn = 0

    def next(self, rng: random.Random, hostile: bool = True) -> tuple[str, bytes | None, int]:
        """(kind or hostile name, body bytes (None: slow_body), the status it must get). hostile=False: the hostile
        share goes to chat (the baseline)."""
        kind = rng.choices(self.kinds, self.weights)[0]
        kind = "chat" if kind == "hostile" and not hostile else kind
        if kind == "hostile":
            name = self.hostile[self.turn % len(self.hostile)]
            self.turn += 1
            return name, self._hostile(name), HOSTILE[name][1]
        body = {"model": self.model, "temperature": 0, "max_tokens": self.args.max_tokens,
                "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}]}
        if kind != "chat":
            schema = rng.choice(self.schemas)
            body["messages"] = [{"role": "user", "content": f"Produce a JSON object for: {json.dumps(schema)}"}]
            if kind == "guided":
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            else:
                body["tools"] = [{"type": "function", "function": {"name": "act", "parameters": schema}}]
                body["tool_choice"] = {"type": "function", "function": {"name": "act"}}
        return kind, json.dumps(body).encode(), 200

    def _hostile(self, name: str) -> bytes:
        body, _ = HOSTILE[name]
        if name == "slow_body":
            return None
        if name == "body_too_large":
            return json.dumps({"model": self.model, "messages": [{"role": "user", "content": "a" * (
                self.args.max_request_bytes + 1024)}]}).encode()
        if callable(body):
            return body(self.model)
        base = {"model": self.model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        return json.dumps(base | body).encode()


async def worker(clients, url: str, reqs: Requests, seed: int, deadline: float, out: list, hostile: bool,
                 address: str | None) -> None:
    """clients: (well-behaved, hostile): the hostile requests come from their own address, as from another
    client, so the server's per-client shares (the grammar compile pool's, its connections) keep them apart."""
    import httpx
    rng = random.Random(seed)
    while time.perf_counter() < deadline:
        kind, body, want = reqs.next(rng, hostile)
        wanted = want if isinstance(want, tuple) else (want,)
        t0 = time.perf_counter()
        try:
            if body is None:
                u = httpx.URL(url)
                status, text = await slow_body(u.host, u.port, address, reqs.model, reqs.args.timeout_s)
            else:
                r = await clients[want != 200].post(url, content=body, headers={"content-type": "application/json"})
                status, text = r.status_code, r.text[:200]
            text = "" if status in wanted else text
        except (httpx.HTTPError, OSError) as e:
            status, text = 0, f"{type(e).__name__}: {e}"[:200]
        out.append(dict(kind=kind, t=t0, s=time.perf_counter() - t0, status=status, ok=status in wanted,
                        good=want == 200, error=text or None))


# ---- the run -----------------------------------------------------------------------------------------------
async def soak(args, base: str, model: str, pid: int, minutes: float, hostile: bool) -> tuple[list, list, float]:
    """One phase: --streams workers for `minutes` (hostile=False: the baseline), then idle."""
    import httpx
    reqs = Requests(args, model)
    limits = httpx.Limits(max_connections=args.streams + 4)
    address = HOSTILE_ADDRESS if base.startswith("http://127.") else None
    hostile_from = httpx.AsyncHTTPTransport(local_address=address, limits=limits) if address else None
    async with httpx.AsyncClient(timeout=args.timeout_s, limits=limits) as client, \
            httpx.AsyncClient(timeout=args.timeout_s, limits=limits, transport=hostile_from) as bad:
        t0 = time.perf_counter()
        deadline = t0 + 60 * minutes
        done, samples = [], []
        tasks = [worker((client, bad), f"{base}/v1/chat/completions", reqs, args.seed + i, deadline, done, hostile,
                        address) for i in range(args.streams)]
        await asyncio.gather(sampler(client, base, pid, args.sample_s, deadline, samples), *tasks)
        for _ in range(100):                 # idle: every page back
            kv = await metric(client, base, "specdec_kv_blocks_used")
            if kv == 0:
                break
            await asyncio.sleep(0.2)
        compiles, idle_at = None, time.perf_counter()
        for _ in range(300):                 # compiles still running when the load stopped finish within budget
            compiles = await metric(client, base, "specdec_grammar_compiles_unfinished")
            if compiles == 0:
                break
            await asyncio.sleep(0.2)
        samples.append(dict(t=time.perf_counter() - t0, rss_mb=rss_mb(pid), gpu_mb=gpu_used_mb(), kv_blocks=kv,
                            idle=True, compiles=compiles, compiles_drain_s=round(time.perf_counter() - idle_at, 2)))
    return done, samples, t0


# ---- report ------------------------------------------------------------------------------------------------
def pct(xs: list[float], q: float):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def minutes(done: list, t0: float) -> list[dict]:
    rows = []
    for m in range(int(max((d["t"] - t0 for d in done), default=0) // 60) + 1):
        part = [d for d in done if m <= (d["t"] - t0) / 60 < m + 1]
        good = [1e3 * d["s"] for d in part if d["good"] and d["ok"]]
        rows.append(dict(minute=m, requests=len(part), hostile=sum(not d["good"] for d in part),
                         errors=sum(not d["ok"] for d in part), good_p50_ms=pct(good, 0.5),
                         good_p99_ms=pct(good, 0.99)))
    return rows


def plot_soak(rows: list[dict], samples: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note(f"matplotlib is not installed; skipping the plot {path}")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([r["minute"] for r in rows], [r["good_p99_ms"] or 0 for r in rows], marker="o", label="p99")
    a.plot([r["minute"] for r in rows], [r["good_p50_ms"] or 0 for r in rows], marker="o", label="p50")
    a.set(xlabel="minute", ylabel="ms per well-behaved request", title="latency under hostile load")
    a.legend()
    t = [s["t"] / 60 for s in samples]
    b.plot(t, [s["rss_mb"] for s in samples], label="server RSS (MB)")
    b.plot(t, [s["gpu_mb"] for s in samples], label="GPU memory in use (MB)")
    b.set(xlabel="minute", ylabel="MB", title="memory")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rss_growth(samples: list[dict], minutes_: float) -> float:
    """RSS growth (MB) over the last half of the soak, at most its last 5 minutes (load samples only)."""
    load = [x for x in samples if not x.get("idle")]
    start = load[-1]["t"] - min(300.0, 30.0 * minutes_) if load else 0.0
    window = [x["rss_mb"] for x in load if x["t"] >= start]
    return round(max(window) - window[0], 1) if window else 0.0


def main(argv=None):
    args = parse_args(argv)
    base_minutes = args.minutes if args.baseline_minutes is None else args.baseline_minutes
    logdir = Path(tempfile.mkdtemp(prefix="soak-"))
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--model", args.model, "--port", "0",
           "--max-num-seqs", str(args.streams), "--max-request-bytes", str(args.max_request_bytes)]
    cmd += shlex.split(args.server_args)
    proc, ready, found = launch(cmd, logdir / "server.log", dict(os.environ, PYTHONUNBUFFERED="1"))
    ready.wait(600)
    if "url" not in found:
        stop(proc)
        raise SystemExit(f"the server did not start: {log_tail(logdir / 'server.log')}")
    import httpx
    model = httpx.get(found["url"] + "/v1/models", timeout=30).json()["data"][0]["id"]
    note(f"soak: {args.streams} streams, {base_minutes} min baseline then {args.minutes} min against {found['url']}")
    try:
        baseline = asyncio.run(soak(args, found["url"], model, proc.pid, base_minutes, False))[0] \
            if base_minutes > 0 else []
        done, samples, t0 = asyncio.run(soak(args, found["url"], model, proc.pid, args.minutes, True))
    finally:
        alive = proc.poll() is None
        stop(proc)
    rows = minutes(done, t0)
    good = [1e3 * d["s"] for d in done if d["good"] and d["ok"]]
    base_good = [1e3 * d["s"] for d in baseline if d["ok"]]
    errors = [d for d in done if not d["ok"]]
    by_kind = collections.Counter(f"{d['kind']} {d['status']}" for d in errors)
    good_errors = sum(d["good"] for d in errors)
    ratio = round(pct(good, 0.99) / pct(base_good, 0.99), 3) if good and base_good else None
    growth = rss_growth(samples, args.minutes)
    summary = dict(requests=len(done), hostile=sum(not d["good"] for d in done), errors=len(errors),
                   good_errors=good_errors, errors_by_kind=dict(by_kind.most_common()),
                   error_examples=sorted({f"{d['kind']}: {d['status']} {d['error']}" for d in errors})[:10],
                   good_p50_ms=pct(good, 0.5), good_p99_ms=pct(good, 0.99), baseline_requests=len(baseline),
                   baseline_errors=sum(not d["ok"] for d in baseline), baseline_p99_ms=pct(base_good, 0.99),
                   baseline_error_examples=sorted({f"{d['kind']}: {d['status']} {d['error']}" for d in baseline
                                                   if not d["ok"]})[:5],
                   p99_vs_baseline=ratio, rss_growth_last_mb=growth, server_alive_at_end=alive,
                   rss_mb_start=samples[0]["rss_mb"], rss_mb_end=samples[-1]["rss_mb"],
                   gpu_mb_start=samples[0]["gpu_mb"], gpu_mb_end=samples[-1]["gpu_mb"],
                   kv_blocks_idle_at_end=samples[-1]["kv_blocks"],
                   compiles_at_end=samples[-1].get("compiles"),
                   compiles_drain_s=samples[-1].get("compiles_drain_s"),
                   passed=bool(alive and good_errors == 0 and (ratio is None or ratio <= 1.5)
                               and growth <= args.rss_flat_mb and samples[-1]["kv_blocks"] == 0),
                   minutes=rows, samples=samples)
    rec = record("soak", "mixed+hostile", model, "", args.streams, args.max_tokens, None, None, mix=args.mix,
                 duration_min=args.minutes, server_cmd=" ".join(cmd), **summary)
    out = write_results([rec], args.out)
    head = {k: v for k, v in summary.items()
            if k not in ("minutes", "samples", "error_examples", "errors_by_kind", "baseline_error_examples")}
    text = (f"Command: `{rec['command']}` on {rec['device']}, commit {rec['git_commit']}; mix {args.mix}.\n\n"
            + markdown_table([head], list(head)) + "\n\n### Per minute\n\n"
            + markdown_table(rows, list(rows[0]))
            + "\n\nErrors by kind and status: " + (json.dumps(summary["errors_by_kind"]) if errors else "none")
            + "\n\nExamples: " + ("; ".join(summary["error_examples"]) or "none")
            + "\n\nBaseline errors: " + ("; ".join(summary["baseline_error_examples"]) or "none"))
    out.with_suffix(".md").write_text(text + "\n")
    print(text, flush=True)
    plot_soak(rows, samples, out.with_suffix(".png"))     # last: matplotlib's first import on a fresh machine is slow


if __name__ == "__main__":
    main()
