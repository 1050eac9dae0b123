"""Starting and stopping the servers bench/serving/serve.py loads: `specdec serve` (ours), `transformers serve` (the
peer; see bench/serving/serve.py for its flags) and vLLM's OpenAI server (staged as docs/peers.md says), and reading our
engine's step counters from /metrics."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import REPO

LISTENING = re.compile(r"specdec serve: listening on (http://\S+)")


def launch(cmd: list[str], log_path: Path, env: dict):
    """Start `cmd`; a thread copies its stdout to the log and watches for our "listening" line."""
    log = open(log_path, "w")
    log.write(" ".join(map(shlex.quote, cmd)) + "\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO, env=env,
                            start_new_session=True)
    found, ready = {}, threading.Event()

    def pump():
        for line in proc.stdout:
            log.write(line)
            log.flush()
            m = LISTENING.search(line)
            if m and not ready.is_set():
                found["url"] = m.group(1).rstrip("/")
                ready.set()
        ready.set()
    threading.Thread(target=pump, daemon=True).start()
    return proc, ready, found


def log_tail(path: Path, n: int = 1500) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def stop(proc, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def http_ok(url: str, timeout: float = 10.0) -> bool:
    import httpx
    return httpx.get(url, timeout=timeout).status_code == 200


def http_json(url: str, timeout: float = 10.0):
    import httpx
    r = httpx.get(url, timeout=timeout)
    r.raise_for_status()
    return r.json()


def help_text(cmd: list[str], env: dict) -> str:
    out = subprocess.run(cmd + ["--help"], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    return out.stdout + out.stderr


def has_flag(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def start_ours(args, requests, logdir: Path, extra: list[str] = ()):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    base = shlex.split(args.ours_cmd.format(python=sys.executable)) if args.ours_cmd else \
        [sys.executable, "-m", "engine.cli", "serve"]
    cmd = base + ["--model", args.model, "--host", "127.0.0.1", "--port", "0",
                  "--max-num-seqs", str(args.max_num_seqs or max(args.concurrency or [32]))]
    text = help_text(base, env)
    if has_flag(text, "--max-queued"):          # more waiting than this is answered 429
        cmd += ["--max-queued", str(max(256, len(requests)))]
    if args.speculative != "none":
        # --num-draft-tokens is an alias that older engine.cli builds lack
        k_flag = "--num-draft-tokens" if has_flag(text, "--num-draft-tokens") else "--num-speculative-tokens"
        cmd += ["--speculative", args.speculative, k_flag, str(args.num_draft_tokens)]
    cmd += shlex.split(args.ours_args) + list(extra)
    log = logdir / f"ours{''.join(extra).replace('-', '_')}.log"
    proc, ready, found = launch(cmd, log, env)
    ready.wait(args.start_timeout)
    if "url" not in found:
        stop(proc)
        raise RuntimeError(f"no 'listening' line (exit {proc.poll()}); log tail: {log_tail(log)}")
    model = http_json(found["url"] + "/v1/models")["data"][0]["id"]
    return proc, found["url"], model, dict(server_cmd=" ".join(cmd), server_log=str(log))


def peer_blocks(args, requests) -> int:
    """KV blocks (256 tokens each) for every request that can be in flight at once, at its longest."""
    longest = max(len(json.dumps(r["messages"])) for r in requests) // 3 + 64   # ~3 chars a token + template
    per_request = -(-(longest + max(args.max_tokens, args.json_max_tokens)) // 256)
    in_flight = max(max(args.concurrency or [1]), len(requests) if args.rates else 1)
    return per_request * in_flight + 16


def start_peer(args, requests, logdir: Path):
    from engine.models.loader import resolve_model
    path = resolve_model(args.model).path
    if path is None:
        raise RuntimeError(f"{args.model} has no checkpoint directory for transformers")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               NO_COLOR="1", TERM="dumb", COLUMNS="200", PYTHONUNBUFFERED="1")
    base = [sys.executable, "-m", "transformers.cli.transformers", "serve"]
    text, port = help_text(base, env), free_port()
    if not has_flag(text, "--continuous-batching"):
        raise RuntimeError(f"`transformers serve --help` lists no --continuous-batching: {text[-800:]}")
    gpu = os.path.exists("/dev/nvidiactl")          # not torch.cuda: no CUDA context in this process
    dtype = args.peer_dtype or ("bfloat16" if gpu else "float32")
    device = args.peer_device or ("cuda:0" if gpu else "cpu")
    flags = {"--continuous-batching": None, "--host": "127.0.0.1", "--port": str(port), "--dtype": dtype,
             "--device": device, "--attn-implementation": args.peer_attn, "--cb-block-size": "256",
             "--cb-num-blocks": str(peer_blocks(args, requests)), "--cb-max-batch-tokens": "2048",
             "--log-level": "warning"}
    cmd, missing = list(base), [f for f in flags if not has_flag(text, f)]
    for flag, value in flags.items():
        cmd += [] if flag in missing else [flag] if value is None else [flag, value]
    cmd += ["--force-model", str(path)] if has_flag(text, "--force-model") else [str(path)]
    cmd += shlex.split(args.peer_args)
    log = logdir / "peer.log"
    proc, _, _ = launch(cmd, log, env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log, args.start_timeout)
    return proc, url, str(path), dict(server_cmd=" ".join(cmd), server_log=str(log), peer_dtype=dtype,
                                      peer_flags_missing=missing or None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url: str, log: Path, timeout: float) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end and proc.poll() is None:
        try:
            if http_ok(url + "/health", 2.0):       # vLLM's answers 200 with an empty body, ours with JSON
                return
        except Exception:                           # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"not healthy (exit {proc.poll()}); log tail: {log_tail(log)}")


def start_vllm(args, requests, logdir: Path):
    """vLLM's OpenAI server on the same checkpoint directory, with only its own wheels on the path
    (--vllm-site), the settings bench/peers/peers_vllm.py matches: bf16, max_num_seqs as ours, 2048 batched tokens,
    half the GPU's memory, xgrammar without free whitespace, no prefix caching unless --vllm-prefix-caching."""
    from engine.models.loader import resolve_model
    path = resolve_model(args.model).path
    if path is None:
        raise RuntimeError(f"{args.model} has no checkpoint directory for vLLM")
    env = dict(os.environ, PYTHONPATH=args.vllm_site, PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1",
               VLLM_USE_FLASHINFER_SAMPLER="0",
               DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--seed", "0",
           "--max-num-seqs", str(args.max_num_seqs or max(args.concurrency or [32])),
           "--max-num-batched-tokens", "2048", "--gpu-memory-utilization", "0.5",
           "--structured-outputs-config", json.dumps(dict(backend="xgrammar", disable_any_whitespace=True)),
           "--enable-prefix-caching" if args.vllm_prefix_caching else "--no-enable-prefix-caching",
           "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    if args.speculative == "ngram":
        cmd += ["--speculative-config", json.dumps(dict(method="ngram", num_speculative_tokens=args.num_draft_tokens,
                                                        prompt_lookup_min=1, prompt_lookup_max=3))]
    elif args.speculative != "none":
        raise RuntimeError(f"vLLM has no {args.speculative} drafter for this model")
    cmd += shlex.split(args.vllm_serve_args)
    log = logdir / "vllm.log"
    proc, _, _ = launch(cmd, log, env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log, args.start_timeout)
    return proc, url, str(path), dict(server_cmd=" ".join(cmd), server_log=str(log), peer_dtype="bfloat16")


HOST_PARTS = ("host_plan", "host_commit", "host_wait", "server_io")     # /metrics' specdec_<part>_seconds


def engine_counters(url: str) -> dict[str, float]:
    """Our engine's step counters from /metrics (prometheus text, unlabelled samples)."""
    import httpx
    keep = ("specdec_steps_total", "specdec_gpu_idle_seconds_total", "specdec_generation_tokens_total",
            *(f"specdec_{part}_seconds_total" for part in HOST_PARTS))
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in keep:
            out[name] = float(value)
    return out


def engine_rates(before: dict, after: dict, seconds: float) -> dict:
    """Per run: engine steps per second, wall ms per step, tokens per step, compute-stream idle fraction, and the
    engine loop's host ms per step by part (plan, commit, blocked on tokens, the engine process's request intake
    and output sends)."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)
    steps = delta("specdec_steps_total")
    idle = delta("specdec_gpu_idle_seconds_total")
    tokens = delta("specdec_generation_tokens_total")
    host = {f"{part.split('_')[-1]}_ms": round(1e3 * delta(f"specdec_{part}_seconds_total") / steps, 4)
            if steps else None for part in HOST_PARTS}
    return dict(engine_steps=int(steps), step_ms=round(1e3 * seconds / steps, 3) if steps else None,
                tokens_per_step=round(tokens / steps, 2) if steps else None, gpu_idle_frac=round(idle / seconds, 4),
                **host)


def ttft_probe(url: str, model: str, tokens: int, n: int = 20) -> dict:
    """Time to first token at one stream for a chat prompt of about `tokens` tokens (counted by the server's
    /tokenize through the chat template), n requests one after another, each prompt different."""
    import httpx
    from bench.common import QUESTIONS

    def prompt(i: int, parts: int) -> list[dict]:
        return [{"role": "user", "content": f"({i}) " + " ".join(QUESTIONS[(i + k) % len(QUESTIONS)]
                                                              for k in range(parts))}]
    parts, count = 1, 0
    with httpx.Client(timeout=60) as client:
        while count < tokens and parts < 1000:
            parts += 1
            count = client.post(f"{url}/tokenize", json={"model": model, "messages": prompt(0, parts)}).json()["count"]
        ttft = []
        for i in range(n):
            body = dict(model=model, messages=prompt(i, parts), max_tokens=2, temperature=0, stream=True)
            t0 = time.perf_counter()
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        ttft.append(time.perf_counter() - t0)
                        break
    ttft.sort()
    return dict(load="ttft", x=1, prompt_tokens=count, ok=len(ttft), requests=n,
                ttft_p50_ms=round(1e3 * ttft[len(ttft) // 2], 2) if ttft else None,
                ttft_p99_ms=round(1e3 * ttft[-1], 2) if ttft else None)
