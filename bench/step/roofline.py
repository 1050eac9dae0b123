"""Roofline: each decode step's time against the least time its reads can take, over shapes, streams and contexts.

    python -m bench.step.roofline --out bench/results/roofline        # every default shape, auto and reference
    python -m bench.step.roofline --shapes llama-1b llama-8b --streams 1 8 32 128 --out $OUT/roofline
    python -m bench.step.roofline --resume --out $OUT/roofline        # a cut run goes on from its roofline.json
    python -m bench.step.roofline --render --out $OUT/roofline        # the table and heat map again, from the JSON
    python -m bench.step.roofline --device cpu --dtype float32 --peak-gbps 50 --shapes tiny --streams 1 2 \\
        --contexts 16 --steps 4 --out /tmp/roofline                   # smoke run (the CPU's torch backend)

A decode step of a memory-bound model cannot take less than reading what it must read: every weight once (the
layers' matmuls and norms, the LM head) and the KV cache each stream attends over. The floor is those bytes over
the GPU's peak bandwidth (a table by GPU name, or --peak-gbps); step / floor is how far a cell is from it.
A cell is (shape, kernels side, streams, context): every stream's prompt is random ids (dummy weights have no
tokenizer), sized so that the timed decode steps read `context` tokens a stream on average, and generates with EOS
ignored. Step time: the median period of the steady decode steps (every stream decoding) of the pipelined engine
(depth 2, CUDA graphs), and the median GPU forward beside it; tok/s = streams / period. The KV length the floor
counts is the mean those steps really read. One engine per (shape, side), the sides one after the other per shape
(their order alternates by shape), so both sides of a cell ran on the machine in the same state; --kernels
reference is cuBLAS for every matmul and LM head, the baseline. Each record holds the engine's route table
(`routes`, a line a matmul site). Writes roofline.json after every cell (--resume),
then roofline.md (the table and which targets hold) and roofline.png (bench/step/roofline_report.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import traceback
from pathlib import Path
from types import SimpleNamespace

from bench.common import (device_name, engine_overrides, free_gpu_memory, note, progress, random_prompts, record,
                          write_results)
from bench.step.roofline_floor import DTYPE_BYTES, floor_bytes, kv_bytes, param_count, peak_gbps, weight_params

DEFAULT_SHAPES = ("smollm2-135m", "llama-1b", "llama-3b", "llama-8b", "qwen2.5-1.5b", "qwen3-8b")
WARMUP_TOKENS = 4
RUN_FIELDS = ("wall_s", "steps", "generated_tokens", "gc_ms")     # of throughput.time_generate's
RESERVE_BYTES = 8 << 30   # GPU memory left beside weights and KV pages: activations, graphs, the route tuning


# ---- arguments -----------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    from engine.models.loader import DUMMY_SHAPES
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=[s for s in DEFAULT_SHAPES if s in DUMMY_SHAPES],
                   help=f"dummy-weight shapes (known: {', '.join(DUMMY_SHAPES)})")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 2048], help="KV tokens a stream, >= 16")
    p.add_argument("--kernels", nargs="+", default=["auto", "reference"], choices=["auto", "reference"])
    p.add_argument("--steps", type=int, default=32, help="steady decode steps timed a cell (about)")
    p.add_argument("--peak-gbps", type=float, default=None, help="the GPU's peak bandwidth (default: by its name)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest --streams")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE", help="further EngineConfig fields")
    p.add_argument("--resume", action="store_true", help="keep the cells of --out's roofline.json; run the rest")
    p.add_argument("--render", action="store_true", help="only write the table and heat map from the JSON")
    p.add_argument("--out", default="bench/results/roofline", help="directory of roofline.json, .md and .png")
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes if s not in DUMMY_SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(DUMMY_SHAPES)}")
    for name, values, least in (("--streams", args.streams, 1), ("--contexts", args.contexts, 16),
                                ("--steps", [args.steps], 1)):
        if min(values) < least:
            p.error(f"{name} must be >= {least}, got {min(values)}")
    if args.peak_gbps is not None and not args.peak_gbps > 0:
        p.error(f"--peak-gbps must be > 0, got {args.peak_gbps}")
    args.max_num_seqs = args.max_num_seqs or max(args.streams)
    if args.max_num_seqs < max(args.streams):
        p.error(f"--max-num-seqs {args.max_num_seqs} is below the largest --streams {max(args.streams)}")
    args.shapes, args.kernels = list(dict.fromkeys(args.shapes)), list(dict.fromkeys(args.kernels))
    return args


# ---- cells and engines ---------------------------------------------------------------------------------------------
def cells(args) -> list[tuple[str, str, int, int]]:
    """(shape, side, streams, context) in run order: by shape, the sides one after the other (their order
    alternating by shape), each side's cells by context, then streams."""
    out = []
    for i, shape in enumerate(args.shapes):
        for side in args.kernels[::-1] if i % 2 else args.kernels:
            out += [(shape, side, n, c) for c in sorted(set(args.contexts)) for n in sorted(set(args.streams))]
    return out


def cell_tokens(streams: int, context: int, steps: int, budget: int) -> tuple[int, int]:
    """(prompt tokens, new tokens) of a cell. The prompts prefill in about `fill` steps of `budget` tokens, while
    the streams admitted first already decode: each samples about fill / 2 tokens before every stream decodes, and
    then about `steps` + 1 in the steady steps. The prompt is half of those short of `context`, so the steady steps
    read `context` tokens a stream on average."""
    fill = -(-streams * context // max(budget - streams, 1))
    return max(8, context - (fill + steps + 1) // 2), fill + steps + 1


def pages(streams: int, context: int, args, budget: int, block: int) -> int:
    prompt, new = cell_tokens(streams, context, args.steps, budget)
    return streams * (-(-(prompt + new) // block) + 1)


def engine_size(cfg: dict, args, budget: int, block: int) -> dict:
    """max_model_len and num_kv_blocks for every cell, the pages capped by the GPU's free memory (less the weights
    and RESERVE_BYTES); a cell needing more pages than the engine got is skipped."""
    grid = [(n, c) for n in args.streams for c in args.contexts]
    longest = max(sum(cell_tokens(n, c, args.steps, budget)) for n, c in grid)
    need = max(pages(n, c, args, budget, block) for n, c in grid)
    out = dict(max_model_len=block * (-(-longest // block) + 1), num_kv_blocks=need)
    import torch
    from engine.memory.kv_cache import PagedCache
    if args.device != "cpu" and torch.cuda.is_available():
        dtype = getattr(torch, args.dtype)
        page = PagedCache.of_config("target", cfg).page_bytes(block, dtype)
        spare = torch.cuda.mem_get_info()[0] - param_count(cfg) * DTYPE_BYTES[args.dtype] - RESERVE_BYTES
        out["num_kv_blocks"] = max(1, min(need, int(0.9 * spare) // page))
    return out


def start_engine(shape: str, side: str, args):
    """The (shape, side) engine, sized for every cell; its config dict."""
    from bench.step.throughput import build_engine
    from engine.config import EngineConfig
    from engine.models.loader import resolve_model
    cfg = resolve_model(f"dummy:{shape}").config
    chosen = EngineConfig.of(model=f"dummy:{shape}", **engine_overrides(args))     # the budget and page size it gets
    size = engine_size(cfg, args, chosen.max_num_batched_tokens, chosen.block_size)
    spec = SimpleNamespace(model=f"dummy:{shape}", device=args.device, dtype=args.dtype, enforce_eager=False,
                           engine=args.engine)
    return build_engine(spec, 2, args.max_num_seqs, kernels=side, **size), cfg


# ---- one cell ------------------------------------------------------------------------------------------------------
def steady_kv_tokens(trace: list[dict], streams: int, prompt_tokens: int) -> float:
    """The mean KV length a stream's row reads over the steady decode steps (the steps bench.step.pipeline.steady
    takes medians over): its prompt and every token sampled for it before the step."""
    steady = [s["decode"] and s["rows"] >= streams for s in trace]
    pick = steady if any(steady) else [s["decode"] for s in trace]
    sampled, lengths = 0, []
    for step, picked in zip(trace, pick):
        if picked:
            lengths.append(prompt_tokens + sampled / streams)
        sampled += step["tokens"]
    return statistics.mean(lengths) if lengths else float(prompt_tokens)


def floor_fields(cfg: dict, streams: int, context: float, dtype: str, peak: float) -> dict:
    nbytes = floor_bytes(cfg, streams, context, DTYPE_BYTES[dtype])
    return dict(floor_bytes=nbytes, weight_bytes=weight_params(cfg) * DTYPE_BYTES[dtype], params=param_count(cfg),
                kv_bytes=kv_bytes(cfg, streams, context, DTYPE_BYTES[dtype]), peak_gbps=peak,
                floor_ms=1e3 * nbytes / (peak * 1e9))


def measure(eng, cfg: dict, streams: int, context: int, args, peak: float) -> dict:
    """The steady step of `streams` streams at `context` tokens: medians, tok/s and the floor at the KV read."""
    from bench.step.pipeline import steady
    from bench.step.throughput import time_generate
    budget, vocab = eng.config.max_num_batched_tokens, int(eng.runner.vocab)
    prompt, new = cell_tokens(streams, context, args.steps, budget)
    prompts = random_prompts(vocab, streams, prompt, seed=100003 * streams + context)
    warm = random_prompts(vocab, streams, 16, seed=-(100003 * streams + context))
    run = time_generate(eng, prompts, warm, new, WARMUP_TOKENS, trace=True)
    st = steady(eng.timings.trace, streams)
    kv = steady_kv_tokens(eng.timings.trace, streams, prompt)
    out = dict(prompt_tokens=prompt, new_tokens=new, kv_tokens=kv, **{k: run[k] for k in RUN_FIELDS}, **st,
               **floor_fields(cfg, streams, kv, args.dtype, peak))
    out.update(tok_s=streams / (st["period_ms"] * 1e-3), x_floor=st["period_ms"] / out["floor_ms"])
    return out


def misfit(eng, streams: int, context: int, args) -> str | None:
    """Why the cell cannot run on `eng` (too few KV pages, too short a max_model_len), or None."""
    budget, block = eng.config.max_num_batched_tokens, eng.config.block_size
    prompt, new = cell_tokens(streams, context, args.steps, budget)
    need = pages(streams, context, args, budget, block)
    if need > eng.runner.num_blocks:
        return f"needs {need} KV pages, the engine has {eng.runner.num_blocks}"
    if prompt + new > eng.max_model_len:
        return f"needs {prompt + new} tokens a stream, max_model_len is {eng.max_model_len}"
    return None


def cell_record(held, cell, args, peak: float) -> dict:
    """One cell's record: measured, skipped (it does not fit the engine) or failed (the error)."""
    shape, side, streams, context = cell
    eng, cfg, error = held
    base = dict(bench="roofline", mode=side, model=f"dummy:{shape}", dtype=args.dtype, streams=streams)
    fields = dict(shape=shape, kernels=side, context=context, steps_asked=args.steps)
    if error:
        return record(**base, new_tokens=None, tok_s=None, ms_per_step=None, **fields,
                      error=f"the engine did not start: {error}")
    try:
        if skip := misfit(eng, streams, context, args):
            note(f"{shape} {side} {streams} streams, {context} tokens: skipped, {skip}")
            return record(**base, new_tokens=None, tok_s=None, ms_per_step=None, skipped=skip, **fields,
                          **floor_fields(cfg, streams, context, args.dtype, peak))
        m = measure(eng, cfg, streams, context, args, peak)
        note(f"{shape} {side} {streams} streams, {context} tokens: {m['period_ms']:.3f} ms a step "
             f"(forward {m['forward_ms']:.3f}), {m['x_floor']:.2f}x the floor {m['floor_ms']:.3f}")
        tok_s, new = m.pop("tok_s"), m.pop("new_tokens")
        return record(**base, new_tokens=new, tok_s=tok_s, ms_per_step=m["period_ms"], **fields, **m,
                      routes=routes(eng))
    except Exception as e:                  # noqa: BLE001 - one failing cell must not end the sweep
        traceback.print_exc()
        return record(**base, new_tokens=None, tok_s=None, ms_per_step=None, **fields,
                      error=f"{type(e).__name__}: {e}")


def routes(eng) -> list[str] | None:
    """The engine's route table, a line a matmul site (RouteTable.summary), where its backend has one."""
    table = getattr(eng.runner.backend, "routes", None)
    return table.summary().splitlines() if table is not None else None


def start(shape: str, side: str, args):
    """(engine, config, None) for (shape, side), or (None, config, the error) where it did not start."""
    try:
        return (*start_engine(shape, side, args), None)
    except Exception as e:                  # noqa: BLE001 - its cells record the error
        traceback.print_exc()
        from engine.models.loader import resolve_model
        return None, resolve_model(f"dummy:{shape}").config, f"{type(e).__name__}: {e}"


def release(held) -> None:
    """Close the engine held; the caller drops its last reference, then frees the memory."""
    if held and held[0] is not None:
        held[0].close()


def run(args, peak: float, path: Path) -> list[dict]:
    """Every cell not already in `path` (with --resume; failed ones again), `path` rewritten after each."""
    records = json.loads(path.read_text()) if args.resume and path.exists() else []
    key = lambda r: (r["shape"], r["kernels"], r["streams"], r["context"])  # noqa: E731
    done = {key(r) for r in records if not r.get("error")}
    held, held_key = None, None
    for cell in progress([c for c in cells(args) if c not in done], "roofline cells"):
        if held_key != cell[:2]:
            held = release(held)            # no reference left to the old engine while the next one starts
            free_gpu_memory()
            held, held_key = start(*cell[:2], args), cell[:2]
        records = [r for r in records if key(r) != cell] + [cell_record(held, cell, args, peak)]
        write_results(records, path)
    held = release(held)
    free_gpu_memory()
    return records


def main(argv=None):
    from bench.step.roofline_report import render
    args = parse_args(argv)
    out = Path(args.out)
    path = out / "roofline.json"
    if args.render:
        if not path.exists():
            raise SystemExit(f"roofline: --render reads {path}, which does not exist")
        records = json.loads(path.read_text())
    else:
        try:
            peak = peak_gbps(device_name() if args.device != "cpu" else "cpu", args.peak_gbps)
        except ValueError as e:
            raise SystemExit(f"roofline: {e}") from None
        records = run(args, peak, path)
    print(render(records, out))
    return records


if __name__ == "__main__":
    main()
