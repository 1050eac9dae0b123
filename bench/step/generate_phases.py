"""Where a timed generate's wall goes outside the engine's steps: adding the requests, the step loop (and the time
inside `LLMEngine.step` within it), taking the results, the final synchronize, and every garbage collection.

    python -m bench.step.generate_phases --streams 32 --new-tokens 128 --variants ref:kernels=reference \
        mma:kernel_routes=mma.json --rounds 3 --profile     # mma.json: {"pins": [{"kernel": "mma", "op": "head"}]}
    python -m bench.step.generate_phases --device cpu --dtype float32 --streams 2 --new-tokens 4 --rounds 1

The throughput bench's outside_steps_ms is this bench's add + loop_outside + take + sync. One engine per variant;
a warm-up generate on other prompts first, then --rounds timed generates of the same prompts. With --profile, one
more generate runs under cProfile and its top functions by cumulative time go into the record.
Writes JSON (`--out`) and prints a markdown table last.
"""
from __future__ import annotations

import argparse
import gc
import traceback

from bench.common import (GcClock, chat_prompts, cuda_sync, dtype_name, engine_kwargs, engine_overrides,
                          markdown_table, note, parse_variants, progress, record, write_results)
from bench.step.step_walls import phased_generate, profiled_round

PHASES = ["add_ms", "loop_ms", "in_steps_ms", "loop_outside_ms", "take_ms", "sync_ms", "gc_ms"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model spec (default: the default model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="timed generates per variant")
    p.add_argument("--variants", nargs="*", default=[], metavar="NAME:KEY=VALUE,...")
    p.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE", help="EngineConfig fields for all")
    p.add_argument("--profile", action="store_true", help="one more generate under cProfile")
    p.add_argument("--top", type=int, default=25, help="cProfile's functions kept (by cumulative time)")
    p.add_argument("--out", default="bench/results/generate_phases.json")
    return p.parse_args(argv)


def timed_generate(eng, prompts, params) -> dict:
    """LLMEngine.generate's own phases, each timed (the same calls in the same order)."""
    with GcClock() as clock:
        in_steps0 = eng.timings.wall
        seqs, (t0, t1, t2, t3, t4) = phased_generate(eng, prompts, params)
    in_steps = 1e3 * (eng.timings.wall - in_steps0)
    loop = 1e3 * (t2 - t1)
    return dict(wall_ms=1e3 * (t4 - t0), add_ms=1e3 * (t1 - t0), loop_ms=loop, in_steps_ms=in_steps,
                loop_outside_ms=loop - in_steps, take_ms=1e3 * (t3 - t2), sync_ms=1e3 * (t4 - t3),
                gc_ms=clock.ms, gc_counts=dict(clock.count),
                generated_tokens=sum(len(s.output_token_ids) for s in seqs))


def build_engine(args, overrides: dict):
    from engine.llm_engine import LLMEngine
    return LLMEngine(**(engine_kwargs(args, dtype=args.dtype, max_num_seqs=args.streams) | engine_overrides(args)
                        | overrides))


def run_variant(args, name: str, overrides: dict) -> list[dict]:
    from engine.requests.sequence import SamplingParams
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    eng = build_engine(args, overrides)
    dtype = dtype_name(eng, args.dtype)
    prompts = chat_prompts(eng, 2 * args.streams)
    eng.generate(prompts[args.streams:], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    cuda_sync()
    records = []
    for rnd in range(args.rounds):
        steps0 = eng.timings.steps
        fields = timed_generate(eng, prompts[:args.streams], params)
        steps = eng.timings.steps - steps0
        tok_s = fields["generated_tokens"] / (fields["wall_ms"] / 1e3)
        records.append(record("generate_phases", name, eng.source.name, dtype, args.streams, args.new_tokens,
                              tok_s, fields["wall_ms"] / max(steps, 1), round=rnd, steps=steps,
                              overrides=overrides, **fields))
        note(f"{name} round {rnd}: " + ", ".join(f"{k} {fields[k]:.2f}" for k in ["wall_ms"] + PHASES))
    if args.profile:
        records[-1]["profile"] = profiled_round(eng, prompts[:args.streams], params, args.top)
    return records


def main(argv=None):
    args = parse_args(argv)
    records = []
    for name, overrides in progress(parse_variants(args.variants).items(), "generate_phases (variant)"):
        try:
            records += run_variant(args, name or "default", overrides)
        except Exception as e:          # noqa: BLE001 - one failing variant must not end the run
            traceback.print_exc()
            records.append(record("generate_phases", name, args.model or "default", args.dtype, args.streams,
                                  args.new_tokens, None, None, error=f"{type(e).__name__}: {e}"))
        gc.collect()
    write_results(records, args.out)
    print(markdown_table(records, ["mode", "round", "tok_s", "ms_per_step", "wall_ms"] + PHASES))
    return records


if __name__ == "__main__":
    main()
