"""Blocking vs pipelined decoding: the Photon article's two tables for this engine, plus the GPU idle share.

    python -m bench.step.pipeline [--models default dummy:llama-1b dummy:llama-8b] [--streams 1 8 32]
                             [--new-tokens 128] [--peers] [--out bench/results/pipeline.json]

Per model, one engine (bf16, CUDA graphs) runs two workloads at each concurrency, depth 1 then depth 2:
- "fixed": N streams x new_tokens, EOS ignored (tok/s and ms/step, the throughput targets);
- "eos": N closed-loop streams (a finished request is replaced at once) of 4N requests (at least 8), EOS on,
  max new_tokens: L is the mean output length, zombies appear.
Per-step numbers are medians over steady-state decode steps (every stream busy). Cost model (the Photon article):
predicted speedup = T_block / T_pipe x (1 - z), z = s / (L x N) with s the share of requests that end on a
stop (EOS) rather than a length cap: each leaves one wasted row, which costs a whole step at one stream and
about a row's share of one in a batch (a length cap is known ahead and costs nothing). Observed = tok/s
pipelined / tok/s blocking over the whole run.
`--peers` adds Hugging Face transformers on the same weights (bench/peers/peers_hf.py) in the same run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


from bench.common import chat_prompts, free_gpu_memory, markdown_table, note, plot, progress, record, write_results
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams

BENCH = "pipeline"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=[os.environ.get("SPECDEC_MODEL", "default"), "dummy:llama-1b",
                                                   "dummy:llama-8b"])
    p.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto", help="cpu works for a smoke run (e.g. --models dummy:tiny)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--peers", action="store_true", help="also run transformers' peers (bench/peers/peers_hf.py)")
    p.add_argument("--out", default="bench/results/pipeline.json")
    return p.parse_args(argv)


def closed_loop(eng: LLMEngine, prompts, streams: int, params: SamplingParams):
    """Keep `streams` requests running until all prompts are done; returns (wall s, finished Sequences)."""
    queue, active, done = list(prompts), set(), []
    eng.timings.reset(trace=True)
    t0 = time.perf_counter()
    while queue or eng.has_unfinished():
        while queue and len(active) < streams:
            active.add(eng.add_request(queue.pop(0), params, retain=True))
        for out in eng.step():
            if out.finished:
                active.discard(out.request_id)
                done.append(eng.take(out.request_id))
    return time.perf_counter() - t0, done


def steady(trace, streams: int) -> dict:
    """Medians over decode steps with every stream busy (prefill, ramp-up and ramp-down excluded), and over
    the steps that carried a prefill chunk (a request joining: its cost to the running batch)."""
    rows = [s for s in trace if s["decode"] and s["rows"] >= streams] or [s for s in trace if s["decode"]] or trace
    med = lambda k, r=rows: 1e3 * statistics.median(s[k] for s in r) if r else float("nan")  # noqa: E731
    mixed = [s for s in trace if not s["decode"]]
    return dict(period_ms=med("period"), forward_ms=med("forward_gpu"), sample_ms=med("sample_gpu"),
                idle_ms=med("gpu_idle"), steady_steps=len(rows), mixed_steps=len(mixed),
                mixed_period_ms=med("period", mixed), mixed_forward_ms=med("forward_gpu", mixed),
                mixed_idle_ms=med("gpu_idle", mixed))


def run_one(eng, name, workload, streams, depth, prompts, new_tokens) -> dict:
    eng.set_depth(depth)
    ignore_eos = workload == "fixed"
    closed_loop(eng, prompts[:streams], streams, SamplingParams(max_tokens=3, temperature=0.0))  # JIT warm-up
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=ignore_eos)
    wall, done = closed_loop(eng, prompts, streams, params)
    t = eng.timings
    st = steady(t.trace, streams)
    out_tokens = sum(len(s.output_token_ids) for s in done)
    return record(BENCH, "blocking" if depth == 1 else "pipelined", name, eng.config.dtype, streams, new_tokens,
                  out_tokens / wall, 1e3 * wall / max(t.steps, 1), workload=workload, depth=depth,
                  graphs=eng.runner.graphs is not None,
                  requests=len(done), L=out_tokens / max(len(done), 1), steps=t.steps, rows=t.rows,
                  stop_frac=sum(s.finish_reason == "stop" for s in done) / max(len(done), 1),
                  zombie_rows=t.zombie_rows, idle_frac=st["idle_ms"] / st["period_ms"],
                  idle_frac_run=t.gpu_idle / max(t.wall, 1e-9),
                  **st, **{f"cpu_{k}_ms": v for k, v in t.per_step_ms().items()
                           if k in ("plan", "launch", "wait", "commit")})


def bench_model(spec, args) -> list[dict]:
    eng = LLMEngine(model=spec, dtype=args.dtype, device=args.device, max_num_seqs=max(args.streams),
                    max_model_len=1024, num_kv_blocks=max(args.streams) * 16 * 2, enforce_eager=args.enforce_eager)
    name = eng.source.name
    note(f"{name}: graphs {'off' if eng.runner.graphs is None else eng.runner.graphs.sizes}")
    eng.generate(chat_prompts(eng, 2), SamplingParams(max_tokens=8, temperature=0.0))  # JIT warm-up
    records = []
    jobs = [(w, n, d) for w in ("fixed", "eos") for n in args.streams for d in (1, 2)]
    for workload, streams, depth in progress(jobs, f"{name}"):
        count = streams if workload == "fixed" else max(4 * streams, 8)
        prompts = chat_prompts(eng, count)
        records.append(run_one(eng, name, workload, streams, depth, prompts, args.new_tokens))
    del eng
    free_gpu_memory()
    return records


def cost_model(records) -> list[dict]:
    """The second table of Moondream's "Moondream Photon: Eliminating GPU Bubbles via Pipelined Decoding": predicted
    vs observed pipelining speedup on the EOS workload."""
    rows = []
    key = lambda r: (r["model"], r["streams"])  # noqa: E731
    by = {(key(r), r["mode"]): r for r in records if r.get("workload") == "eos"}
    for (k, mode), blk in sorted(by.items()):
        pipe = by.get((k, "pipelined"))
        if mode != "blocking" or pipe is None:
            continue
        z = pipe["stop_frac"] / (pipe["L"] * pipe["streams"])  # only a stop (not a length cap) leaves a zombie
        predicted = blk["period_ms"] / pipe["period_ms"] * (1 - z)
        rows.append(dict(model=k[0], streams=k[1], blocking_ms=blk["period_ms"], pipelined_ms=pipe["period_ms"],
                         L=pipe["L"], z=z, predicted=f"{100 * (predicted - 1):+.1f}%",
                         observed=f"{100 * (pipe['tok_s'] / blk['tok_s'] - 1):+.1f}%",
                         zombie_rows=pipe["zombie_rows"]))
    return rows


def plot_throughput(records, path) -> None:
    """tok/s vs streams, one line per (model, mode), fixed workload and peers."""
    rows = [dict(r, series=f"{r['model'].split('.')[0]} {r['mode']}") for r in records
            if r.get("workload") in ("fixed", None)]
    plot(rows, "streams", "tok_s", "series", path, "output tok/s, fixed new tokens (H100 run)" if rows and
         "H100" in str(rows[0].get("device")) else "output tok/s, fixed new tokens", logy=True)


def main(argv=None):
    args = parse_args(argv)
    records = []
    for spec in args.models:
        records += bench_model(spec, args)
    write_results(records, args.out)
    if args.peers:
        from bench.peers.peers_hf import run_peers
        records += run_peers(args.streams, args.new_tokens, model_spec=args.models[0])
        write_results(records, args.out)
    plot_throughput(records, args.out.replace(".json", ".png"))
    fixed = [r for r in records if r.get("workload") == "fixed" and r["mode"] == "pipelined"]
    print("\n## Pipelined, per step (steady-state medians, ms)\n")
    print(markdown_table(fixed, ["model", "streams", "forward_ms", "sample_ms", "period_ms", "idle_ms", "idle_frac"]))
    print("\n## Blocking vs pipelined (EOS on)\n")
    print(markdown_table(cost_model(records), ["model", "streams", "blocking_ms", "pipelined_ms", "L", "z",
                                               "predicted", "observed", "zombie_rows"]))
    print("\n## Requests joining a running batch (EOS on): steps that carry a prefill chunk, medians\n")
    eos = [r for r in records if r.get("workload") == "eos"]
    print(markdown_table(eos, ["model", "mode", "streams", "mixed_steps", "mixed_forward_ms", "mixed_period_ms",
                               "period_ms", "idle_frac_run"]))
    print("\n## Throughput (fixed new tokens, EOS ignored)\n")
    print(markdown_table([r for r in records if r.get("workload") in ("fixed", None)],
                         ["model", "mode", "streams", "tok_s", "ms_per_step", "period_ms", "idle_frac", "error"]))


if __name__ == "__main__":
    main()
