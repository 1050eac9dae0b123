"""The CPU matmul of a few rows (engine/kernels/matmul/cpu_gemm.py) against torch's F.linear, on the default model's
shapes, float32, one thread (as each test worker runs), and the CPU decode step with both.

    python -m bench.kernels.cpu_gemm               # writes bench/results/cpu_gemm.json, .md, .png
    python -m bench.kernels.cpu_gemm --rows 1 4 --reps 3 --no-step --out /tmp/g.json

Matmuls: each shape is a stack of weight matrices larger than the caches (as a step's 30 layers are), timed
as weight bytes read per second (GB/s): the bound is the machine's memory bandwidth, and a sum over a large
tensor (torch.sum) stands for it. Step: an engine on the default model (torch attention, float32) decodes
--step-tokens tokens for 1 / 4 / 8 streams, with the native kernel and with it off (cpu_gemm.NATIVE = False);
ms_per_step = (wall of a long generate - wall of a 2-token one) / the extra tokens. Best of --reps.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.common import markdown_table, note, plot, progress, record, write_results

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def matmul_records(rows_list, reps: int) -> list[dict]:
    from engine.kernels.matmul import cpu_gemm
    big = torch.randn(50_000_000)
    bandwidth = big.numel() * 4 / best(big.sum, reps) / 1e9
    out = []
    for name, (n, k) in progress(SHAPES.items(), "shapes"):
        weights = [torch.randn(n, k) for _ in range(max(1, 60_000_000 // (n * k)))]
        nbytes = sum(w.numel() * 4 for w in weights)
        for rows in rows_list:
            x = torch.randn(rows, k)
            for impl, fn in (("F.linear", F.linear), ("cpu_gemm", cpu_gemm.linear)):
                gbs = nbytes / best(lambda: [fn(x, w) for w in weights], reps) / 1e9
                out.append(record("cpu_gemm", impl, "SmolLM2-135M shapes", "float32", rows, 0, None, None,
                                  shape=name, n=n, k=k, rows=rows, gb_s=gbs, sum_gb_s=bandwidth))
    return out


def step_records(streams_list, tokens: int, reps: int) -> list[dict]:
    from engine.kernels.matmul import cpu_gemm
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    eng = LLMEngine(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=max(streams_list))
    prompt = eng.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    native, out = cpu_gemm.NATIVE, []
    try:
        for streams in progress(streams_list, "steps"):
            for impl, on in (("F.linear", False), ("cpu_gemm", native)):
                cpu_gemm.NATIVE = on

                def gen(n):
                    return eng.generate([prompt] * streams, SamplingParams(max_tokens=n, temperature=0.0,
                                                                              ignore_eos=True))
                ms = (best(lambda: gen(tokens), reps) - best(lambda: gen(2), reps)) / (tokens - 2) * 1e3
                out.append(record("cpu_gemm_step", impl, "SmolLM2-135M-Instruct", "float32", streams, tokens,
                                  streams / ms * 1e3, ms))
    finally:
        cpu_gemm.NATIVE = native
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--step-tokens", type=int, default=12)
    p.add_argument("--no-step", action="store_true", help="matmuls only")
    p.add_argument("--out", default="bench/results/cpu_gemm.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    records = matmul_records(args.rows, args.reps)
    if not args.no_step:
        records += step_records(args.streams, args.step_tokens, args.reps)
    path = write_results(records, args.out)
    mm = [dict(r, impl_shape=f"{r['mode']} {r['shape']}") for r in records if r["bench"] == "cpu_gemm"]
    plot(mm, "rows", "gb_s", "impl_shape", path.with_suffix(".png"), "float32 weight reads (GB/s), one thread")
    table = markdown_table(mm, ["shape", "rows", "mode", "gb_s", "sum_gb_s"])
    steps = [r for r in records if r["bench"] == "cpu_gemm_step"]
    if steps:
        table += "\n\n" + markdown_table(steps, ["streams", "mode", "ms_per_step", "tok_s"])
    path.with_suffix(".md").write_text(f"`{records[0]['command']}` on {records[0]['device']}\n\n{table}\n")
    note(table)


if __name__ == "__main__":
    main()
