"""Replicas of `specdec serve` behind an existing gateway, SGLang's Model Gateway (`smg`): the prefix-cache hit rate of
its cache-aware routing against round robin on the same agent load, and a replica killed in the middle of a load.

    python -m bench.serving.gateway --out bench/results/gateway/gateway.json                # CPU, 2 replicas
    python -m bench.serving.gateway --server-args="--device cuda" --agents 33 --prefix-words 900 --kv-pages 600

Each replica is `specdec serve` with --kv-pages KV pages, sized to hold about half of the agents' system prompts.
Load: --agents agents, each with a system prompt of its own (its id first, so no two share a page) and --turns
questions. Their first questions go out together, as a fleet of agents starting at once; then the agents take
turns, one request at a time, in the same order under both policies. (A gateway places a prefix it has not seen by
load: sent one at a time, every first question would find the replicas idle and go to the first.) An odd number of
agents makes round robin send each agent to every replica in turn, so each replica must hold every agent's prompt
and evicts them; cache-aware routing sends an agent back to the replica that holds its prompt. The hit rate is the
replicas' prompt tokens found in their prefix cache over those looked up (their /metrics), per policy, the caches
emptied between policies (POST /reset_prefix_cache).

Failover: --clients concurrent clients send cache-aware requests; after --kill-after-s the last replica is killed
(SIGKILL). Every request must end within --timeout-s (no hang), and every one sent a second after the kill, once
the gateway has seen the replica fail, must succeed on the others. The gateway's own retry and health checks are
what is measured; it is installed as the `smg` command (`pip install smg`; --gateway names another path).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.common import markdown_table, note, record, write_results
from bench.serving.serve_servers import free_port, launch, log_tail, stop

CPU_SERVER = "--device cpu --dtype float32 --attention-backend torch --max-num-seqs 4 --max-model-len 2048"
WORDS = ("ledger", "harbor", "violet", "engine", "summit", "copper", "meadow", "signal", "falcon", "timber")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--agents", type=int, default=9, help="odd: round robin then visits every replica per agent")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prefix-words", type=int, default=150, help="words of each agent's system prompt")
    p.add_argument("--kv-pages", type=int, default=96, help="each replica's KV pages (16 tokens each)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--clients", type=int, default=3, help="failover: concurrent clients")
    p.add_argument("--kill-after-s", type=float, default=8.0)
    p.add_argument("--failover-s", type=float, default=25.0, help="failover: how long the clients send")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request: longer counts as a hang")
    p.add_argument("--server-args", default=CPU_SERVER)
    p.add_argument("--gateway", default=shutil.which("smg") or "smg")
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    p.add_argument("--out", default="bench/results/gateway/gateway.json")
    return p.parse_args(argv)


def system_prompt(agent: int, words: int) -> str:
    body = " ".join(WORDS[(agent * 7 + i) % len(WORDS)] for i in range(words))
    return f"Agent {agent}. You keep the {body} records."


def start_replicas(args, logdir: Path) -> list[tuple]:
    """(process, url, log) of each replica, all started at once."""
    started = []
    for i in range(args.replicas):
        log = logdir / f"replica{i}.log"
        cmd = [sys.executable, "-m", "engine.cli", "serve", *args.server_args.split(), "--port", "0",
               "--num-kv-blocks", str(args.kv_pages), "--allow-cache-reset", "--single-process"]
        proc, ready, found = launch(cmd, log, dict(os.environ))
        started.append((proc, ready, found, log))
    out = []
    for proc, ready, found, log in started:
        if not ready.wait(600) or "url" not in found:
            raise RuntimeError(f"a replica did not start: {log_tail(log)}")
        out.append((proc, found["url"], log))
    return out


def start_gateway(args, urls: list[str], policy: str, logdir: Path):
    """The gateway over `urls` with `policy`, once every replica is a ready worker of it and it answers a chat
    request -> (process, url, log). (It registers workers in the background: a load sent before the last one joins
    goes to the others alone.)"""
    port, log = free_port(), logdir / f"gateway_{policy}.log"
    cmd = [args.gateway, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
           "--policy", policy, "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--shutdown-grace-period-secs", "1"]     # stopped once its requests are done: SIGINT then takes 5 s
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if ready_workers(url) >= len(urls) and httpx.post(f"{url}/v1/chat/completions",
                                                              json=chat(0, 0, args, "ping"), timeout=60).is_success:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"the gateway did not start: {log_tail(log)}")


def ready_workers(gateway: str) -> int:
    """Workers the gateway lists as healthy and ready (its GET /workers)."""
    workers = httpx.get(f"{gateway}/workers", timeout=10).json().get("workers", [])
    return sum(w.get("is_healthy", False) and w.get("status") == "ready" for w in workers)


def chat(agent: int, turn: int, args, question: str | None = None) -> dict:
    return {"model": args.model_name, "max_tokens": args.max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system_prompt(agent, args.prefix_words)},
                         {"role": "user", "content": question or f"Question {turn}: what is record {turn * 3}?"}]}


def cache_counters(urls: list[str]) -> tuple[float, float]:
    """(prompt tokens looked up, found) summed over the replicas."""
    queries = hits = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("specdec_prefix_cache_queries_total "):
                queries += float(line.split()[1])
            elif line.startswith("specdec_prefix_cache_hits_total "):
                hits += float(line.split()[1])
    return queries, hits


def hit_rate(args, gateway: str, urls: list[str]) -> dict:
    for url in urls:
        httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
    q0, h0 = cache_counters(urls)
    begin, status = time.perf_counter(), []
    with httpx.Client(timeout=args.timeout_s) as client:
        def send(agent: int, turn: int):
            status.append(client.post(f"{gateway}/v1/chat/completions", json=chat(agent, turn, args)).status_code)

        first = [threading.Thread(target=send, args=(agent, 0)) for agent in range(args.agents)]
        for t in first:
            t.start()
        for t in first:
            t.join()
        for turn in range(1, args.turns):
            for agent in range(args.agents):
                send(agent, turn)
    q1, h1 = cache_counters(urls)
    return dict(requests=len(status), failed=sum(s != 200 for s in status),
                seconds=round(time.perf_counter() - begin, 1), query_tokens=int(q1 - q0), hit_tokens=int(h1 - h0),
                hit_rate=round((h1 - h0) / max(q1 - q0, 1), 3))


def failover(args, gateway: str, victim) -> dict:
    """Clients send until --failover-s while `victim` is killed at --kill-after-s: outcomes before and after."""
    results, start, stop_at = [], time.monotonic(), time.monotonic() + args.failover_s
    killed: dict = {}

    def client(c: int):
        with httpx.Client(timeout=args.timeout_s) as http:
            turn = 0
            while time.monotonic() < stop_at:
                sent = time.monotonic()
                try:
                    status = http.post(f"{gateway}/v1/chat/completions", json=chat(c, turn, args)).status_code
                except httpx.TimeoutException:
                    status = "hang"
                except httpx.HTTPError as e:
                    status = type(e).__name__
                results.append((sent - start, time.monotonic() - start, status))
                turn += 1

    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(args.kill_after_s)
    os.killpg(victim.pid, signal.SIGKILL)
    killed["at"] = time.monotonic() - start
    for t in threads:
        t.join()
    settled = killed["at"] + 1.0
    before = [r for r in results if r[0] < settled]
    after = [r for r in results if r[0] >= settled]
    return dict(killed_at_s=round(killed["at"], 1), requests=len(results),
                hangs=sum(r[2] == "hang" for r in results),
                errors_around_kill=sorted({str(r[2]) for r in before if r[2] != 200}),
                failed_around_kill=sum(r[2] != 200 for r in before),
                sent_after=len(after), failed_after=sum(r[2] != 200 for r in after),
                longest_s=round(max((r[1] - r[0] for r in results), default=0.0), 1))


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if shutil.which(args.gateway) is None and not Path(args.gateway).exists():
        raise SystemExit(f"the gateway command {args.gateway!r} is not installed (pip install smg)")
    logdir = Path(args.out).parent / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    replicas = start_replicas(args, logdir)
    urls = [url for _, url, _ in replicas]
    args.model_name = httpx.get(f"{urls[0]}/v1/models", timeout=30).json()["data"][0]["id"]
    records, rates = [], {}
    try:
        for policy in args.policies:
            gw, gw_url, _ = start_gateway(args, urls, policy, logdir)
            try:
                rates[policy] = hit_rate(args, gw_url, urls)
                note(f"{policy}: hit rate {rates[policy]['hit_rate']}")
                records.append(record("gateway", policy, "default", None, args.replicas, args.max_tokens, None, None,
                                      part="hit_rate", **rates[policy]))
                if policy == args.policies[-1]:
                    fo = failover(args, gw_url, replicas[-1][0])
                    records.append(record("gateway", policy, "default", None, args.replicas, args.max_tokens, None,
                                          None, part="failover", **fo))
            finally:
                stop(gw)
    finally:
        for proc, _, _ in replicas:
            stop(proc)
    write_results(records, args.out)
    text = markdown_table([r for r in records if r["part"] == "hit_rate"],
                          ["mode", "requests", "failed", "query_tokens", "hit_tokens", "hit_rate", "seconds"])
    fo = [r for r in records if r["part"] == "failover"]
    if fo:
        text += "\n\n" + markdown_table(fo, ["mode", "killed_at_s", "requests", "hangs", "failed_around_kill",
                                             "errors_around_kill", "sent_after", "failed_after", "longest_s"])
    Path(args.out).with_suffix(".md").write_text(f"Command: `{records[0]['command']}` on {records[0]['device']}, "
                                                 f"commit {records[0]['git_commit']}.\n\n{text}\n")
    print(text)
    return records


if __name__ == "__main__":
    main()
