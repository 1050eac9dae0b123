"""Each step's wall in the throughput bench's timed generate, in any tree of this engine: it calls only what
every tree has (LLMEngine, add_request, step, take), so an old checkout's engine runs under the same clock.

    python -m bench.step.step_walls --streams 1 32 --rounds 3
    cd <old tree> && PYTHONPATH=. python <this tree>/bench/step/step_walls.py --streams 32 --out /tmp/w.json
    python -m bench.step.step_walls --device cpu --dtype float32 --streams 2 --new-tokens 4 --rounds 1

One engine per stream count (depth 2, max_num_seqs = streams). A warm-up generate of other prompts first (as the
throughput bench's), then --rounds timed generates of the same prompts on the same engine: a one-time cost (a
kernel compiled, a graph first launched) lands in the first round only. Per round: the generate's phases (adding
the requests, the step loop, taking the results, the final synchronize), the median step wall and the --slowest
steps by index (step 0 admits the prompts). With --profile, one more round under cProfile; its top functions by
cumulative time go into the record. Writes JSON (`--out`) and prints a markdown table last.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

from bench.common import chat_prompts, cuda_sync, engine_kwargs, markdown_table, record, write_results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model spec (default: the default model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--slowest", type=int, default=8, help="steps of the longest walls kept a round")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="one more round under cProfile: its top N")
    p.add_argument("--out", default="bench/results/step_walls.json")
    args = p.parse_args(argv)
    if min(args.streams) < 1 or args.new_tokens < 1 or args.rounds < 1 or args.slowest < 0 or args.profile < 0:
        raise ValueError("--streams, --new-tokens and --rounds must be positive; --slowest and --profile >= 0")
    return args


class StepClock:
    """Wraps eng.step: the wall of every call, kept until cleared."""

    def __init__(self, eng):
        self.walls, self._step = [], eng.step
        eng.step = self

    def __call__(self):
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.walls.append(time.perf_counter() - t0)


def phased_generate(eng, prompts, params) -> tuple[list, tuple[float, ...]]:
    """generate()'s own calls in its order -> (the finished sequences, perf_counter times at the start, once the
    requests are added, once the step loop ends, once the results are taken, after the final synchronize)."""
    t0 = time.perf_counter()
    ids = [eng.add_request(p, params, retain=True) for p in prompts]
    t1 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    t2 = time.perf_counter()
    seqs = [eng.take(i) for i in ids]
    t3 = time.perf_counter()
    cuda_sync()
    return seqs, (t0, t1, t2, t3, time.perf_counter())


def timed_round(eng, clock: StepClock, prompts, params, slowest: int) -> dict:
    clock.walls.clear()
    seqs, (t0, t1, t2, t3, t4) = phased_generate(eng, prompts, params)
    walls = clock.walls
    longest = sorted(range(len(walls)), key=lambda i: walls[i], reverse=True)[:slowest]
    return dict(wall_ms=1e3 * (t4 - t0), add_ms=1e3 * (t1 - t0), loop_ms=1e3 * (t2 - t1),
                in_steps_ms=1e3 * sum(walls), take_ms=1e3 * (t3 - t2), sync_ms=1e3 * (t4 - t3), steps=len(walls),
                median_step_ms=1e3 * statistics.median(walls) if walls else None,
                slowest=[dict(step=i, ms=1e3 * walls[i]) for i in sorted(longest)],
                tokens=sum(len(s.output_token_ids) for s in seqs))


def profiled_round(eng, prompts, params, top: int) -> list[str]:
    """One generate under cProfile: its `top` functions by cumulative time, as pstats prints them."""
    prof = cProfile.Profile()
    prof.enable()
    eng.generate(prompts, params)
    cuda_sync()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()]


def run_streams(args, streams: int) -> dict:
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    t0 = time.perf_counter()
    eng = LLMEngine(**engine_kwargs(args, dtype=args.dtype, depth=2, max_num_seqs=streams))
    start_s = time.perf_counter() - t0
    prompts = chat_prompts(eng, 2 * streams)
    clock = StepClock(eng)
    eng.generate(prompts[streams:], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    cuda_sync()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rounds = [timed_round(eng, clock, prompts[:streams], params, args.slowest) for _ in range(args.rounds)]
    profile = profiled_round(eng, prompts[:streams], params, args.profile) if args.profile else None
    eng.close()
    wall = statistics.median(r["wall_ms"] for r in rounds)
    return record("step_walls", "pipelined", eng.source.name, args.dtype, streams, args.new_tokens,
                  rounds[0]["tokens"] / wall * 1e3, wall / rounds[0]["steps"], start_s=start_s, rounds=rounds,
                  profile=profile)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    records = [run_streams(args, s) for s in args.streams]
    write_results(records, args.out)
    rows = [dict(streams=r["streams"], round=i, **{k: v for k, v in rnd.items() if k != "slowest"},
                 slowest=" ".join(f"{s['step']}:{s['ms']:.2f}" for s in rnd["slowest"]))
            for r in records for i, rnd in enumerate(r["rounds"])]
    print(markdown_table(rows, ["streams", "round", "wall_ms", "add_ms", "in_steps_ms", "take_ms", "sync_ms",
                                "median_step_ms", "slowest"]))
    return records


if __name__ == "__main__":
    main()
