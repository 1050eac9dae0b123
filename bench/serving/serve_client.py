"""Load generation for bench/serving/serve.py: the request set, client processes streaming raw SSE, and the metrics
over their per-request records.

Requests: half chat prompts (common.QUESTIONS, each with an index suffix), half JSON-schema requests
(guided_quality.PROMPT over a schema of --dataset, by response_format json_schema or as a forced tool call),
shuffled with a seed. Each client process runs one asyncio loop with one httpx.AsyncClient; a request's
record holds monotonic times (system-wide on Linux, so comparable across processes): arrival (scheduled),
sent, first content chunk, each content chunk with the tokens it adds (from continuous usage), end.
A content chunk carries text or tool-call arguments; chunks that only announce the role, the finish or the
usage are not content, and their tokens (if usage counts any) go to the next content chunk.

Metrics (summarize): out_tok_s = output tokens received (partial ones of cancelled requests included) /
makespan (first send -> last chunk); TTFT = first content chunk - send; ITL = gaps between successive
content chunks (vLLM's definition: a chunk adding several tokens is one gap); itl_tok = each gap divided by
the tokens its chunk adds, once per token (needs usage on every chunk: ours' continuous_usage_stats); TPOT =
(e2e - TTFT) / (tokens - 1); json_valid_frac = share of the completed JSON requests whose text validates
with jsonschema (json_stopped_frac: share that ended with the JSON complete rather than at max_tokens).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing as mp
import random
import time

from bench.common import QUESTIONS
from bench.guided.guided_quality import DATASETS, PROMPT, check_output, load_schemas, resolve


# ---- workload ------------------------------------------------------------------------------------------
def build_requests(n: int, seed: int, json_frac: float, data: str, dataset: str, distinct: int = 0) -> list[dict]:
    """distinct: JSON requests draw from the dataset's first `distinct` schemas only (0: from all)."""
    rng = random.Random(seed)
    n_json = round(n * json_frac)
    kinds = ["json"] * n_json + ["chat"] * (n - n_json)
    rng.shuffle(kinds)
    schemas = [(name, s) for name, s in load_schemas(resolve(DATASETS[dataset], data))
               if isinstance(s, dict)] if n_json else []
    schemas = schemas[:distinct] if distinct else schemas
    out = []
    for i, kind in enumerate(kinds):
        if kind == "chat":
            name, schema, text = "chat", None, f"{QUESTIONS[rng.randrange(len(QUESTIONS))]} ({i})"
        else:
            name, schema = schemas[rng.randrange(len(schemas))]
            text = PROMPT.format(json.dumps(schema))
        out.append(dict(job=i, kind=kind, name=name, schema=schema,
                        messages=[{"role": "user", "content": text}]))
    return out


def warm_set(requests: list[dict], warmup: int, schemas: int = 0) -> list[dict]:
    """Up to `warmup` distinct requests; with `schemas` (build_requests' `distinct`), JSON ones first, so that
    every schema's grammar is compiled before the timed runs."""
    distinct = list({json.dumps(r["messages"]): r for r in requests}.values())
    if schemas:
        distinct.sort(key=lambda r: r["kind"] != "json")
    return distinct[:max(warmup, schemas)]


def request_body(req: dict, model: str, opts: dict, max_tokens: int | None = None) -> dict:
    """The request as sent to `opts["target"]` (ours | peer). The peer (transformers serve) answers 422 to
    fields it does not know, so ignore_eos is ours only; its fixed length is a generation_config with an
    EOS id that never matches. It ignores response_format, tool_choice and stream_options (with a warning)."""
    peer = opts["target"] == "peer"
    body = dict(model=model, messages=req["messages"], stream=True, temperature=0.0,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    if req["kind"] == "chat":
        body["max_tokens"] = max_tokens or opts["max_tokens"]
        if opts["fixed_length"] and peer:
            body["generation_config"] = json.dumps(dict(max_new_tokens=body["max_tokens"], eos_token_id=-1,
                                                        do_sample=False))
        elif opts["fixed_length"]:
            body["ignore_eos"] = True
        return body
    body["max_tokens"] = opts["json_max_tokens"]     # not a warm-up cap: a guide refuses less than its shortest
    name = "".join(c if c.isalnum() else "_" for c in req["name"])[:64]
    if opts["json_mode"] == "tools":
        body["tools"] = [{"type": "function", "function": {"name": name, "parameters": req["schema"]}}]
        body["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": name, "schema": req["schema"], "strict": True}}
    return body


# ---- one streamed request ---------------------------------------------------------------------------------
def new_record(req: dict, arrival: float) -> dict:
    return dict(job=req["job"], kind=req["kind"], arrival=arrival, sent=None, first=None, end=None, chunks=[],
                tokens=0, usage_seen=False, per_chunk_usage=True, text="", finish=None, error=None)


def _event(rec: dict, payload: bytes, t: float, state: dict) -> bool:
    """Apply one `data:` payload; False at [DONE]."""
    if payload.strip() == b"[DONE]":
        return False
    d = json.loads(payload)
    if d.get("error") is not None:
        rec["error"] = str(d["error"])[:300]
        return True
    added = None
    usage = d.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        added = usage["completion_tokens"] - rec["tokens"]
        rec["tokens"], rec["usage_seen"] = usage["completion_tokens"], True
        state["pending"] += added
    text = ""
    for c in d.get("choices") or []:
        delta = c.get("delta") or {}
        text += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            text += (call.get("function") or {}).get("arguments") or ""
        rec["finish"] = c.get("finish_reason") or rec["finish"]
    if text:
        rec["text"] += text
        rec["first"] = rec["first"] or t
        rec["chunks"].append((t, state["pending"] if added is not None else None))
        rec["per_chunk_usage"] &= added is not None
        state["pending"] = 0
    return True


async def stream_one(client, url: str, body: dict, rec: dict) -> None:
    rec["sent"] = time.monotonic()
    state, buf = {"pending": 0}, b""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            rec["error"] = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
            return
        async for data in resp.aiter_bytes():
            t, buf = time.monotonic(), buf + data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(b"data:") and not _event(rec, line[5:], t, state):
                    rec["end"] = t
                    return
    rec["end"] = time.monotonic()


async def guarded(client, url, body, rec, deadline: float) -> dict:
    try:
        async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
            await stream_one(client, url, body, rec)
    except TimeoutError:
        rec["error"] = "cancelled at the run's time limit"
    except Exception as e:                         # noqa: BLE001 - one failed request must not end the run
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    if not rec["usage_seen"]:                      # no usage (or cut off before it): count content chunks
        rec["tokens"] = len(rec["chunks"])
    return rec


# ---- client process ---------------------------------------------------------------------------------------
async def _poisson(client, url, jobs, t0, cfg) -> list[dict]:
    async def at(req, body, offset):
        rec = new_record(req, t0 + offset)
        await asyncio.sleep(max(t0 + offset - time.monotonic(), 0))
        if time.monotonic() >= t0 + cfg["timeout"]:
            rec["error"] = "not sent: the run's time limit passed"
            return rec
        return await guarded(client, url, body, rec, t0 + cfg["timeout"])
    return list(await asyncio.gather(*(at(*job) for job in jobs)))


async def _closed(client, url, jobs, t0, cfg) -> list[dict]:
    """jobs: (worker, req, body). The process's workers (one per distinct worker id) share one queue: a worker
    takes the next request when its previous one ends, as the engine's own closed run does (serve_engine.py).
    A fixed list per worker would leave workers idle once their own lists ran out while others still had long
    requests queued. With a duration the queue repeats until then."""
    workers = len({w for w, _, _ in jobs})
    items = [(req, body) for _, req, body in jobs]
    taken = itertools.count()                  # the workers share it; one event loop: no lock
    stop = min(t0 + (cfg["duration"] or cfg["timeout"]), t0 + cfg["timeout"])

    async def worker():
        out = []
        for i in taken:
            if time.monotonic() >= stop or (i >= len(items) and not cfg["duration"]):
                break
            req, body = items[i % len(items)]
            out.append(await guarded(client, url, body, new_record(req, time.monotonic()), t0 + cfg["timeout"]))
        return out
    return [r for rs in await asyncio.gather(*(worker() for _ in range(workers))) for r in rs]


async def _run(url, jobs, t0, cfg) -> list[dict]:
    import httpx
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.sleep(max(t0 - time.monotonic(), 0))
        run = _poisson if cfg["load"] == "poisson" else _closed
        return await run(client, url, jobs, t0, cfg)


def client_main(conn, url: str, jobs: list, cfg: dict) -> None:
    """A client process: say ready, take the common start time, run, send the records back."""
    import httpx  # noqa: F401 - imported before "ready" so the import is not in the timed window
    conn.send("ready")
    t0 = conn.recv()
    try:
        conn.send(asyncio.run(_run(url, jobs, t0, cfg)))
    except Exception as e:                         # noqa: BLE001
        conn.send(f"client process failed: {type(e).__name__}: {e}")


def split_jobs(requests, bodies, load: str, x: float, procs: int, seed: int) -> list[list]:
    if load == "poisson":
        rng, t, per = random.Random(seed), 0.0, [[] for _ in range(min(procs, len(requests)))]
        for i, (req, body) in enumerate(zip(requests, bodies)):
            t += rng.expovariate(x)
            per[i % len(per)].append((req, body, t))
        return per
    workers = int(x)
    per = [[] for _ in range(min(procs, workers, len(requests)))]
    for i, (req, body) in enumerate(zip(requests, bodies)):
        per[(i % workers) % len(per)].append((i % workers, req, body))
    return per


def run_clients(url: str, per_proc: list[list], cfg: dict) -> list[dict]:
    ctx = mp.get_context("spawn")          # no inherited state (torch, threads) in the client processes
    pipes, procs = [], []
    for jobs in per_proc:
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=client_main, args=(theirs, url, jobs, cfg), daemon=True)
        p.start()
        pipes.append(mine)
        procs.append(p)
    try:
        for c in pipes:
            c.recv()
        t0 = time.monotonic() + 0.2
        for c in pipes:
            c.send(t0)
        out = []
        for c in pipes:
            if not c.poll(cfg["timeout"] + (cfg["duration"] or 0) + 120):
                raise RuntimeError("a client process sent no records")
            res = c.recv()
            if isinstance(res, str):
                raise RuntimeError(res)
            out += res
        return out
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()


# ---- metrics ----------------------------------------------------------------------------------------------
def pct(values, q: float):
    """q-th percentile, linear interpolation (numpy's default); None for no values."""
    v = sorted(values)
    if not v:
        return None
    k = (len(v) - 1) * q / 100
    lo = int(k)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)


def _ms(values, q):
    p = pct(values, q)
    return None if p is None else round(1e3 * p, 4)


def itl_per_token(chunks) -> list[float]:
    """Each chunk's gap to the previous content chunk divided by the tokens it adds, once per token."""
    out = []
    for (t0, _), (t1, n) in zip(chunks, chunks[1:]):
        out += [(t1 - t0) / n] * n if n else []
    return out


def _frac(a: int, b: int):
    return round(a / b, 4) if b else None


def summarize(recs: list[dict], requests: dict[int, dict]) -> dict:
    sent = [r for r in recs if r["sent"] is not None]
    ok = [r for r in sent if r["error"] is None and r["end"] is not None]
    ends = [r["end"] or (r["chunks"][-1][0] if r["chunks"] else r["sent"]) for r in sent]
    makespan = max(ends) - min(r["sent"] for r in sent) if sent else 0.0
    tokens = sum(r["tokens"] for r in sent)
    ttft = [r["first"] - r["sent"] for r in ok if r["first"]]
    itl = [b[0] - a[0] for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    per_tok = [g for r in ok if r["per_chunk_usage"] and r["usage_seen"] for g in itl_per_token(r["chunks"])]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["first"] and r["tokens"] > 1]
    json_ok = [r for r in ok if r["kind"] == "json"]
    checks = [check_output(requests[r["job"]]["schema"], r["text"])[0] for r in json_ok]
    chat = [r["tokens"] for r in ok if r["kind"] == "chat"]
    errors = [r["error"] for r in recs if r["error"]]
    return dict(requests=len(recs), ok=len(ok), errors=len(errors), error_example=errors[0] if errors else None,
                output_tokens=tokens, makespan_s=round(makespan, 3),
                out_tok_s=round(tokens / makespan, 1) if makespan else None,
                req_s=round(len(ok) / makespan, 3) if makespan else None,
                ttft_p50_ms=_ms(ttft, 50), ttft_p99_ms=_ms(ttft, 99), itl_p50_ms=_ms(itl, 50),
                itl_p99_ms=_ms(itl, 99), itl_tok_p50_ms=_ms(per_tok, 50), itl_tok_p99_ms=_ms(per_tok, 99),
                tpot_p50_ms=_ms(tpot, 50), tpot_p99_ms=_ms(tpot, 99),
                # a client that keeps up sends on time: this stays well under a millisecond
                send_lag_p99_ms=_ms([r["sent"] - r["arrival"] for r in sent], 99),
                tokens_per_chunk=_frac(sum(r["tokens"] for r in ok), sum(len(r["chunks"]) for r in ok)),
                chat_tokens_mean=round(sum(chat) / len(chat), 1) if chat else None, json_requests=len(checks),
                json_stopped_frac=_frac(sum(r["finish"] in ("stop", "tool_calls") for r in json_ok), len(json_ok)),
                json_valid_frac=None if "unchecked" in checks else _frac(checks.count("valid"), len(checks)))
