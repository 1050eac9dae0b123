"""Tensor parallelism: per-step time and tok/s of one model at TP = 1, 2 (, 4), side by side in one run.

    python -m bench.step.tp [--model dummy:llama-8b] [--tp 1 2] [--streams 1 8 32] [--new-tokens 128]
                       [--out bench/results/tp.json]

Per TP size, one engine (bf16, CUDA graphs, pipelined) runs N streams x new_tokens with EOS ignored, after a
warm-up. Per-step numbers are medians over steady-state decode steps (every stream busy) on rank 0's compute
stream: period (step to step), forward, and idle (the compute stream waiting for the host between steps;
idle_frac = idle / period; cpu_launch_ms: rank 0's host time to send a step to the workers and enqueue its
own). step_vs_tp1 = this TP's period / TP = 1's at the same streams (target at 1 stream
and TP = 2: <= 0.6, with idle_frac < 2%). TP sizes the machine lacks GPUs for are skipped with a note.
"""
from __future__ import annotations

import argparse

import torch

from bench.common import free_gpu_memory, markdown_table, note, plot, random_prompts, record, write_results
from bench.step.pipeline import closed_loop, steady
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams

BENCH = "tp"
COLUMNS = ["tp", "streams", "tok_s", "period_ms", "forward_ms", "idle_ms", "idle_frac", "step_vs_tp1", "cpu_launch_ms",
           "graphs"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dummy:llama-8b")
    p.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    p.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto", help="cpu works for a smoke run (--model dummy:tiny, gloo)")
    p.add_argument("--out", default="bench/results/tp.json")
    return p.parse_args(argv)


def bench_tp(args, tp: int) -> list[dict]:
    streams = max(args.streams)
    eng = LLMEngine(model=args.model, dtype=args.dtype, device=args.device, tensor_parallel_size=tp,
                    max_num_seqs=streams, max_model_len=1024, num_kv_blocks=streams * 16 * 2)
    try:
        vocab = eng.runner.vocab
        warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        closed_loop(eng, random_prompts(vocab, streams, seed=1), streams, warm)
        records = []
        for n in args.streams:
            params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
            wall, done = closed_loop(eng, random_prompts(vocab, n), n, params)
            st, t = steady(eng.timings.trace, n), eng.timings
            tokens = sum(len(s.output_token_ids) for s in done)
            records.append(record(BENCH, f"tp{tp}", eng.source.name, args.dtype, n, args.new_tokens, tokens / wall,
                                  1e3 * wall / max(t.steps, 1), tp=tp, graphs=eng.runner.graphs is not None,
                                  idle_frac=st["idle_ms"] / st["period_ms"], **st,
                                  **{f"cpu_{k}_ms": v for k, v in t.per_step_ms().items()
                                     if k in ("plan", "launch", "wait", "commit")}))
            note(f"tp {tp}, {n} streams: {tokens / wall:,.0f} tok/s, step {st['period_ms']:.3f} ms, "
                 f"idle {100 * records[-1]['idle_frac']:.2f}%")
        return records
    finally:
        eng.close()
        del eng
        free_gpu_memory()


def main(argv=None):
    args = parse_args(argv)
    cuda = args.device != "cpu" and torch.cuda.is_available()
    records = []
    for tp in args.tp:
        if cuda and tp > torch.cuda.device_count():
            note(f"tp {tp}: skipped, {torch.cuda.device_count()} GPU(s) visible")
            continue
        records += bench_tp(args, tp)
        write_results(records, args.out)
    base = {r["streams"]: r["period_ms"] for r in records if r["tp"] == 1}
    for r in records:
        r["step_vs_tp1"] = r["period_ms"] / base[r["streams"]] if r["streams"] in base else None
    write_results(records, args.out)
    plot([dict(r, series=f"TP={r['tp']}") for r in records], "streams", "tok_s", "series",
         args.out.replace(".json", ".png"), f"{records[0]['model']} output tok/s by tensor-parallel size")
    print(markdown_table(records, COLUMNS))


if __name__ == "__main__":
    main()
