"""The persistent decode stack against the layer-by-layer forward: a decode step's forward alone (embedded inputs to
the final norm) at 1-4 rows, for dummy-weight shapes, contexts and the stack's variants.

    python -m bench.step.stack --out bench/results/decode_stack/stack.json
    python -m bench.step.stack --shapes llama-1b --rows 1 --contexts 256 --variants w4:num_warps=4 \\
        w8:num_warps=8,product=16384 --out $OUT/stack.json
    python -m bench.step.stack --device cpu --dtype float32 --shapes tiny --rows 1 2 --contexts 32 --repeats 2 \\
        --peak-gbps 50 --out /tmp/stack.json                       # smoke run (the Triton interpreter)

One engine a shape (the measured kernel routes; eager, so this bench captures its own graphs). A cell is (shape,
rows, context): `rows` sequences each with `context` cached tokens in the engine's KV pool and one new token. Each
side is a CUDA graph of the inputs' copy and the forward: "layers" (the model's fused path on the route table's
kernels) and each stack variant (engine/kernels/persistent/stack.py DecodeStack's num_warps, product, programs).
The graphs replay --repeats times, the sides taking turns, and a side's figure is its median replay. The floor is
the layers' weights and the step's KV at the GPU's peak bandwidth (bench/step/roofline_floor.py; the LM head is
not part of this forward). max_err: a variant's largest difference from the layers side over its largest value.
Writes JSON (--out), a markdown table and a bar plot beside it.
"""
from __future__ import annotations

import argparse
import statistics
import time
import traceback
from pathlib import Path

from bench.common import (bars, device_name, free_gpu_memory, markdown_table, note, parse_variants, progress, record,
                          write_results)
from bench.step.roofline_floor import DTYPE_BYTES, kv_bytes, peak_gbps, weight_params

DEFAULT_VARIANTS = ["w4:", "w8:num_warps=8", "w8p16k:num_warps=8,product=16384"]
COLUMNS = ["shape", "rows", "context", "side", "us", "x_layers", "floor_us", "x_floor", "max_err"]


def parse_args(argv=None):
    from engine.models.loader import DUMMY_SHAPES
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-1b", "llama-8b"],
                   choices=sorted(DUMMY_SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], choices=[1, 2, 3, 4])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, metavar="NAME:KEY=VALUE,...",
                   help="DecodeStack keywords a variant (num_warps, product, programs)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--peak-gbps", type=float, default=None)
    p.add_argument("--out", default="bench/results/decode_stack/stack.json")
    args = p.parse_args(argv)
    args.variants = parse_variants(args.variants)
    if min(args.contexts) < 1 or args.repeats < 1:
        p.error("--contexts and --repeats must be >= 1")
    return args


def start(shape: str, args):
    from engine.llm_engine import LLMEngine
    block = 16
    pages = max(args.rows) * (max(args.contexts) // block + 1)
    kw = dict(device=args.device) if args.device != "auto" else {}
    return LLMEngine(model=f"dummy:{shape}", dtype=args.dtype, max_num_seqs=4, block_size=block,
                     max_model_len=block * (max(args.contexts) // block + 2), num_kv_blocks=pages + 1,
                     enforce_eager=True, **kw)


def step_inputs(eng, rows: int, context: int):
    """(x, positions, meta) of a decode step: row i's pages are a run of the pool, its new token at `context`; the
    block tables as wide as the engine's (the stack's KV splits follow their capacity)."""
    import torch
    from engine.attention import AttentionMetadata
    runner, block = eng.runner, eng.runner.config.block_size
    dev, per = runner.device, context // block + 1
    tables = torch.zeros(rows, -(-runner.max_model_len // block), dtype=torch.int32)   # the engine's table width
    tables[:, :per] = torch.arange(rows * per, dtype=torch.int32).view(rows, per)
    slots = tables[:, context // block].long() * block + context % block
    meta = AttentionMetadata(slot_mapping=slots.to(dev), cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32,
                                                                                    device=dev),
                             seq_lens=torch.full((rows,), context + 1, dtype=torch.int32, device=dev),
                             block_tables=tables.to(dev), max_query_len=1, max_seq_len=context + 1)
    positions = torch.full((rows,), context, dtype=torch.int64, device=dev)
    x = torch.randn(rows, runner.model.cfg["hidden_size"], device=dev).to(runner.dtype) * 0.5
    return x, positions, meta


def sides(eng, args, x, positions, meta) -> dict:
    """{side: a callable running its forward and returning its output}: each copies x into its own input first."""
    from engine.kernels.persistent.stack import DecodeStack
    runner = eng.runner
    model, caches, backend = runner.model, runner.kv_caches, runner.backend
    work = x.clone()

    def layers():
        work.copy_(x)
        return model(None, positions, meta, caches, backend, embeds=work)
    out = {"layers": layers}
    for name, kw in args.variants.items():
        stack = DecodeStack(model, caches, **kw)
        out[f"stack {name}".strip()] = lambda stack=stack: (work.copy_(x), stack(work, positions, meta))[1]
    return out


def timed(fns: dict, repeats: int, cuda: bool) -> tuple[dict, dict]:
    """({side: median us}, {side: its output}): CUDA graphs replayed in turns, or (CPU) plain calls."""
    import torch
    runs, outs = {}, {}
    if cuda:
        stream = torch.cuda.Stream()
        for side, fn in fns.items():
            with torch.cuda.stream(stream):
                fn()
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outs[side] = fn()
            runs[side] = graph.replay
    else:
        runs = {side: (lambda fn=fn, side=side: outs.__setitem__(side, fn())) for side, fn in fns.items()}
    times = {side: [] for side in runs}
    for i in range(repeats + 1):
        order = list(runs) if i % 2 else list(runs)[::-1]
        for side in order:
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                runs[side]()
                end.record()
                end.synchronize()
                us = begin.elapsed_time(end) * 1e3
            else:
                t0 = time.perf_counter()
                runs[side]()
                us = (time.perf_counter() - t0) * 1e6
            if i:                                   # the first round warms up
                times[side].append(us)
    return {side: statistics.median(t) for side, t in times.items()}, outs


def cell_records(eng, shape: str, rows: int, context: int, args, peak: float) -> list[dict]:
    import torch
    cfg = eng.runner.model.cfg
    nbytes = DTYPE_BYTES[args.dtype]
    layer_bytes = (weight_params(cfg) - cfg["vocab_size"] * cfg["hidden_size"]) * nbytes
    floor_us = (layer_bytes + kv_bytes(cfg, rows, context + 1, nbytes)) / (peak * 1e3)
    x, positions, meta = step_inputs(eng, rows, context)
    with torch.inference_mode():
        us, outs = timed(sides(eng, args, x, positions, meta), args.repeats, eng.runner.cuda)
    ref = outs["layers"].float()
    scale = ref.abs().max().clamp_min(1e-6)
    out = []
    for side, t in us.items():
        err = ((outs[side].float() - ref).abs().max() / scale).item()
        out.append(record("decode_stack", side, f"dummy:{shape}", args.dtype, rows, None, rows / t * 1e6, t / 1e3,
                          shape=shape, rows=rows, context=context, side=side, us=round(t, 1),
                          x_layers=round(t / us["layers"], 3), floor_us=round(floor_us, 1),
                          x_floor=round(t / floor_us, 2), max_err=float(f"{err:.2e}")))
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        import os
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        peak = peak_gbps(device_name() if args.device != "cpu" else "cpu", args.peak_gbps)
    except ValueError as e:
        raise SystemExit(f"stack: {e}") from None
    records = []
    for shape in args.shapes:
        note(f"{shape}: starting an engine")
        try:
            eng = start(shape, args)
        except Exception as e:             # noqa: BLE001 - the other shapes still run
            traceback.print_exc()
            records.append(dict(shape=shape, error=f"{type(e).__name__}: {e}"))
            continue
        for rows, context in progress([(r, c) for c in args.contexts for r in args.rows], f"{shape} cells"):
            try:
                records += cell_records(eng, shape, rows, context, args, peak)
            except Exception as e:         # noqa: BLE001 - one failing cell must not end the sweep
                traceback.print_exc()
                records.append(dict(shape=shape, rows=rows, context=context, error=f"{type(e).__name__}: {e}"))
            write_results(records, args.out)
        eng.close()
        del eng
        free_gpu_memory()
    path = write_results(records, args.out)
    ok = [r for r in records if "us" in r]
    if ok:
        bars(_by_cell(ok), "shape", "cell", list(dict.fromkeys(r["side"] for r in ok)), Path(path).with_suffix(".png"),
             f"decode forward (us), layers vs the persistent stack ({device_name()})")
    print(markdown_table(ok, COLUMNS))
    return records


def _by_cell(records: list[dict]) -> list[dict]:
    """One row per (shape, rows, context), each side's microseconds under its name."""
    rows = {}
    for r in records:
        row = rows.setdefault((r["shape"], r["rows"], r["context"]),
                              dict(shape=r["shape"], cell=f"{r['rows']}r {r['context']}"))
        row[r["side"]] = r["us"]
    return list(rows.values())


if __name__ == "__main__":
    main()
