"""What a full garbage collection costs the engine's process, before and after it freezes its start-up heap.

    python -m bench.serving.gc_pause                                   # the default model, CUDA where there is one
    python -m bench.serving.gc_pause --model dummy:tiny --device cpu --dtype float32 --out /tmp/gc.json

The engine process (engine/server/processes/engine_process.py) calls `freeze_heap` once the engine is up. This
builds the same engine in this process and times, each --collects times: a full `gc.collect()` while the
start-up heap (model, tokenizer, torch's modules) is still tracked, then the same after `freeze_heap`. Between,
and after, a generate of --streams x --new-tokens runs with a gc callback timing every collection Python starts
by itself inside it, by generation. Writes --out (JSON) and a .md beside it (printed last).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

from bench.common import GcClock, chat_prompts, dtype_name, engine_kwargs, markdown_table, note, record, write_results

COLUMNS = ["phase", "tracked_objects", "frozen_objects", "full_collect_ms_median", "full_collect_ms_max",
           "loop_collections", "loop_gen2_collections", "loop_max_pause_ms", "loop_s"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model spec (default: the default model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--collects", type=int, default=5)
    p.add_argument("--out", default="bench/results/gc_pause.json")
    return p.parse_args(argv)


def full_collects(n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        gc.collect()
        times.append(1e3 * (time.perf_counter() - t))
    return times


def loop(eng, prompts, new_tokens: int) -> dict:
    """One generate under a GcClock: Python's own collections inside it."""
    from engine.requests.sequence import SamplingParams
    with GcClock() as clock:
        t = time.perf_counter()
        eng.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        seconds = time.perf_counter() - t
    pauses = clock.pauses
    return dict(loop_collections=len(pauses), loop_gen2_collections=sum(g == 2 for g, _ in pauses),
                loop_max_pause_ms=max((ms for _, ms in pauses), default=0.0), loop_s=seconds)


def phase_row(name: str, collects: list[float], looped: dict) -> dict:
    return dict(phase=name, tracked_objects=len(gc.get_objects()), frozen_objects=gc.get_freeze_count(),
                full_collect_ms_median=statistics.median(collects), full_collect_ms_max=max(collects), **looped)


def main(argv=None):
    args = parse_args(argv)
    from engine.llm_engine import LLMEngine
    from engine.server.processes.engine_process import freeze_heap
    eng = LLMEngine(**engine_kwargs(args, dtype=args.dtype, max_num_seqs=args.streams))
    prompts = chat_prompts(eng, args.streams)
    try:
        loop(eng, prompts, 4)                                   # warm-up
        rows = [phase_row("tracked", full_collects(args.collects), loop(eng, prompts, args.new_tokens))]
        frozen = freeze_heap()
        note(f"froze {frozen:,} objects")
        rows.append(phase_row("frozen", full_collects(args.collects), loop(eng, prompts, args.new_tokens)))
    finally:
        gc.unfreeze()
    dtype = dtype_name(eng, args.dtype)
    records = [record("gc_pause", r["phase"], eng.source.name, dtype, args.streams, args.new_tokens, None, None, **r)
               for r in rows]
    path = write_results(records, args.out)
    text = (f"Command: `{records[0]['command']}` on {records[0]['device']}, commit {records[0]['git_commit']}; "
            f"{eng.source.name}. full_collect: gc.collect() with nothing to free, ms; loop: one generate of "
            f"{args.streams} x {args.new_tokens} tokens, the collections Python started inside it.\n\n"
            + markdown_table(records, COLUMNS))
    path.with_suffix(".md").write_text(text + "\n")
    print(text)
    return records


if __name__ == "__main__":
    main()
