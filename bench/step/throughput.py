"""Output tokens/s and ms/step of our engine: N concurrent streams x T new tokens (EOS ignored, greedy).

    python -m bench.step.throughput                             # default model, bf16, CUDA, 1/8/32 streams
    python -m bench.step.throughput --depth 1 2 --streams 1 8 32 --new-tokens 128
    python -m bench.step.throughput --device cpu --dtype float32 --streams 1 2 --new-tokens 8 --out /tmp/t.json
    python -m bench.step.throughput --depth 2 --streams 8 32 64 --prompt-tokens 1024  # agent-length contexts

One engine per (depth, streams) with max_num_seqs=streams; a short warm-up generate (other prompts)
resets nothing but the counters before the timed one.
ms_per_step = wall / engine steps (prefill steps included); steady_period_ms, steady_forward_ms and
steady_idle_ms are medians over the decode steps with every stream busy; slowest_steps lists the five longest
step periods (a mean period well above the steady one lands there). The per-step breakdown (plan, launch,
wait, commit on the CPU; forward and sampling on the GPU) comes from `engine.timings`; outside_steps_ms is
the timed generate's wall outside the engine's step calls (its period's); gc_ms, the garbage collections Python ran
in it, over a heap collected and frozen (gc.freeze) before it, as in the server's engine process
(bench.step.generate_phases splits the wall further).
On CUDA, read_floor_ms is the time to read the weights a decode step touches (every parameter but an
untied input embedding) at this GPU's copy bandwidth, measured here; floor_x = ms_per_step / read_floor_ms.
Writes JSON (`--out`) and a PNG of tok/s vs streams beside it; prints a markdown table last.
"""
from __future__ import annotations

import argparse
import time
import traceback

from bench.common import (GcClock, chat_prompts, copy_bandwidth_gbs, cuda_sync, dtype_name, engine_kwargs,
                          engine_overrides, free_gpu_memory, frozen_heap, markdown_table, note, plot, progress,
                          record, write_results)

MODES = {1: "blocking", 2: "pipelined"}
COLUMNS = ["mode", "streams", "new_tokens", "tok_s", "ms_per_step", "steps"]   # + the *_ms breakdown found
FLOOR_COLUMNS = ["weight_mb", "floor_x"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model spec (default: the default model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="lengthen every prompt to about this many tokens by one shared prefix (an agent's system "
                        "prompt and tool schemas; prefix caching prefills it once); 0: the chat prompts as they are")
    p.add_argument("--depth", type=int, nargs="+", default=[1], choices=sorted(MODES))
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE", help="further EngineConfig fields")
    p.add_argument("--out", default="bench/results/throughput.json")
    return p.parse_args(argv)


def build_engine(args, depth: int, streams: int, **extra):
    """extra: further EngineConfig fields."""
    from engine.llm_engine import LLMEngine
    kw = engine_kwargs(args, dtype=args.dtype, depth=depth, max_num_seqs=streams, enforce_eager=args.enforce_eager)
    return LLMEngine(**(kw | engine_overrides(args) | extra))


def time_generate(eng, prompts, warm_prompts, new_tokens: int, warmup_tokens: int, trace: bool = False) -> dict:
    """Warm up on other prompts, reset the counters, time one generate of all prompts. trace: keep one dict per
    committed step in eng.timings.trace (bench.step.pipeline.steady takes medians over them)."""
    from engine.requests.sequence import SamplingParams
    eng.generate(warm_prompts, SamplingParams(max_tokens=warmup_tokens, temperature=0.0, ignore_eos=True))
    cuda_sync()
    eng.timings.reset(trace=trace)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with frozen_heap(), GcClock() as clock:
        t0 = time.perf_counter()
        seqs = eng.generate(prompts, params)
        cuda_sync()
        wall = time.perf_counter() - t0
    t = eng.timings
    generated = sum(len(s.output_token_ids) for s in seqs)
    out = dict(tok_s=generated / wall, ms_per_step=1e3 * wall / max(t.steps, 1), wall_s=wall,
               outside_steps_ms=1e3 * (wall - t.wall),      # adding, taking, the final synchronize: not a step's
               gc_ms=clock.ms, gc_collections=len(clock.pauses),  # Python's collections, in steps or out
               generated_tokens=generated, steps=t.steps, step_tokens=t.tokens,
               rows_per_step=t.rows / max(t.steps, 1),
               prompt_tokens=sum(len(p) for p in prompts),
               short_outputs=sum(len(s.output_token_ids) < new_tokens for s in seqs),
               zombie_rows=getattr(t, "zombie_rows", None))
    out.update({f"{k}_ms": v for k, v in t.per_step_ms().items()})
    return out


def steady_fields(trace: list[dict], streams: int) -> dict:
    """Medians over the decode steps with every stream busy (bench.step.pipeline.steady): the period and the GPU's
    forward and idle a step once admission and ramp-down are past, which the means over the whole generate are
    not."""
    from bench.step.pipeline import steady
    st = steady(trace, streams)
    return {f"steady_{k}": st[k] for k in ("period_ms", "forward_ms", "idle_ms")} | {"steady_steps": st["steady_steps"]}


def slowest_steps(trace: list[dict], n: int = 5) -> list[dict]:
    """The n steps of the timed generate with the longest periods, in step order: where a one-time cost (a kernel
    compiled or loaded, a graph captured, a collection) lands, and whether it was a prefill or a decode step."""
    longest = sorted(range(len(trace)), key=lambda i: trace[i]["period"], reverse=True)[:n]
    return [dict(step=i, period_ms=1e3 * trace[i]["period"], forward_ms=1e3 * trace[i]["forward_gpu"],
                 decode=trace[i]["decode"], rows=trace[i]["rows"], tokens=trace[i]["tokens"]) for i in sorted(longest)]


def shared_prefix(prompts: list[list[int]], total: int) -> list[list[int]]:
    """The prompts behind one shared prefix that brings the longest to `total` tokens (none if it is as long): the
    prompts' own ids repeated, which decode as well as any text. The warm-up prompts share it, so the timed
    generate finds it in the prefix cache and its steps are decode steps over the long context."""
    pad = total - max(len(p) for p in prompts)
    if pad <= 0:
        return prompts
    ids = [t for p in prompts for t in p]
    prefix = (ids * (pad // len(ids) + 1))[:pad]
    return [prefix + p for p in prompts]


def step_weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads: all parameters, less an untied input embedding."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not getattr(model, "tied", True):
        w = model.embed_tokens.weight
        total -= w.numel() * w.element_size()
    return total


def floor_fields(eng, ms_per_step: float, bandwidth_gbs: float | None) -> dict:
    model = getattr(getattr(eng, "runner", None), "model", None)
    if bandwidth_gbs is None or model is None:
        return {}
    nbytes = step_weight_bytes(model)
    floor_ms = nbytes / (bandwidth_gbs * 1e9) * 1e3
    return dict(weight_mb=nbytes / 1e6, copy_gbs=bandwidth_gbs, read_floor_ms=floor_ms,
                floor_x=ms_per_step / floor_ms)


def run_one(args, depth: int, streams: int, bandwidth_gbs: float | None = None) -> dict:
    mode = MODES[depth]
    model, dtype = args.model or "default", args.dtype
    extra = dict(depth=depth, enforce_eager=args.enforce_eager, **engine_overrides(args))
    if args.prompt_tokens:
        extra["shared_prompt_tokens"] = args.prompt_tokens
    try:
        t0 = time.perf_counter()
        eng = build_engine(args, depth, streams)
        extra["start_s"] = time.perf_counter() - t0       # load, route tuning, graph captures
        model = eng.source.name
        dtype = dtype_name(eng, dtype)
        prompts = shared_prefix(chat_prompts(eng, 2 * streams), args.prompt_tokens)  # timed: [:streams]
        fields = time_generate(eng, prompts[:streams], prompts[streams:], args.new_tokens, args.warmup_tokens,
                               trace=True)
        fields.update(steady_fields(eng.timings.trace, streams), slowest_steps=slowest_steps(eng.timings.trace))
        tok_s, ms = fields.pop("tok_s"), fields.pop("ms_per_step")
        fields.update(floor_fields(eng, ms, bandwidth_gbs))
        rec = record("throughput", mode, model, dtype, streams, args.new_tokens, tok_s, ms, **extra, **fields)
        note(f"{mode} streams={streams}: {tok_s:,.1f} tok/s, {ms:.2f} ms/step")
    except Exception as e:                # noqa: BLE001 - one failing config must not end the sweep
        traceback.print_exc()
        rec = record("throughput", mode, model, dtype, streams, args.new_tokens, None, None, **extra,
                     error=f"{type(e).__name__}: {e}")
    finally:
        eng = None
        free_gpu_memory()
    return rec


def table_columns(records) -> list[str]:
    ms = [k for r in records for k in r if k.endswith("_ms")]
    cols = COLUMNS + list(dict.fromkeys(ms)) + [c for c in FLOOR_COLUMNS if any(c in r for r in records)]
    return cols + ["error"] if any(r.get("error") for r in records) else cols


def main(argv=None):
    args = parse_args(argv)
    cases = [(d, s) for d in args.depth for s in args.streams]
    bandwidth = copy_bandwidth_gbs()      # once, before any engine holds the GPU's memory
    records = [run_one(args, d, s, bandwidth) for d, s in progress(cases, "throughput (depth, streams)")]
    write_results(records, args.out)
    plot(records, "streams", "tok_s", "mode", str(args.out).rsplit(".", 1)[0] + ".png",
         f"specdec throughput ({records[0]['model']}, {args.dtype}, {args.new_tokens} new tokens)")
    print(markdown_table(records, table_columns(records)))
    return records


if __name__ == "__main__":
    main()
