"""Per-call GPU time of bench.kernels.gemv's fused small-M GEMVs vs the unfused kernels + cuBLAS, in CUDA
graphs.

    python -m bench.kernels.gemv_kernels               # H100: SmolLM2-135M and Llama-3.2-1B shapes, M 1/4/16, bf16
    python -m bench.kernels.gemv_kernels --sweep       # also time a grid of gemv_config choices (for tuning)
    python -m bench.kernels.gemv_kernels --device cpu  # interpreter smoke test: tiny shape, correctness only

Ops per decoder layer: norm_qkv (rms_norm(x, residual) + qkv GEMM), norm_gate_up (the same before
gate_up), silu_down (silu_mul + down GEMM), o_proj (plain GEMM, gemv.linear vs F.linear).
Each impl is captured as back-to-back calls in one torch.cuda.CUDAGraph, replayed `--replays` times;
us = median replay time / calls (cuda events). The calls cycle over enough weight copies (~256 MB in all,
so `calls` = max(--calls, copies)) that the weights come from HBM as in a real decode step, not from the
50 MB L2 (`--hot`: one copy, L2-resident). `--sweep` takes ~1-2 min more (one compile per config).
max_abs_diff: fused vs the *_ref twin; ref_max: largest |ref|, for scale. Writes JSON (`--out`), prints a
markdown table last.
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time

from bench.common import REPO, kernel_device, markdown_table, write_results

MODELS = {"smollm2": dict(hidden=576, heads=9, kv_heads=3, head_dim=64, inter=1536),
          "llama1b": dict(hidden=2048, heads=32, kv_heads=8, head_dim=64, inter=8192)}
TINY = {"tiny": dict(hidden=64, heads=2, kv_heads=1, head_dim=32, inter=96)}
ROWS = (1, 4, 16)
EPS = 1e-5
COLD_BYTES, MAX_COPIES = 256 << 20, 512
COLUMNS = ["model", "mode", "streams", "K", "N", "unfused_us", "fused_us", "speedup", "max_abs_diff", "ref_max",
           "best_us", "best_config"]
SWEEP = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
         for bn, bk, w, s in itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4))]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--calls", type=int, default=50, help="calls captured per graph (at least one per copy)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--hot", action="store_true", help="one weight copy (L2-resident) instead of cycling copies")
    p.add_argument("--sweep", action="store_true", help="also time the fused ops over SWEEP configs")
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/gemv_kernels.json on cuda, "
                                                "none on cpu)")
    return p.parse_args(argv)


def cases(models, rows):
    """(model, op, M, K, N) for each op of a decoder layer."""
    for name, m in models.items():
        qkv = (m["heads"] + 2 * m["kv_heads"]) * m["head_dim"]
        for M in rows:
            yield name, "norm_qkv", M, m["hidden"], qkv
            yield name, "norm_gate_up", M, m["hidden"], 2 * m["inter"]
            yield name, "silu_down", M, m["inter"], m["hidden"]
            yield name, "o_proj", M, m["heads"] * m["head_dim"], m["hidden"]


def operands(op, M, K, N, copies, dev, dtype) -> dict:
    """Random inputs of one op: the weight copies `ws` the calls cycle over, and x / residual / norm weight
    ("norm" ops), gate_up ("silu_down") or x (o_proj)."""
    import torch
    g = torch.Generator(device=dev).manual_seed(M * 7919 + N)
    rnd = lambda *s: torch.randn(*s, generator=g, device=dev).to(dtype)  # noqa: E731
    out = dict(ws=[rnd(N, K) / math.sqrt(K) for _ in range(copies)])
    if op.startswith("norm"):
        return out | dict(x=rnd(M, K), res=rnd(M, K), nw=rnd(K))
    if op == "silu_down":
        return out | dict(gu=rnd(M, 2 * K) * 2)
    return out | dict(x=rnd(M, K))


def make_impls(op, M, K, N, copies, dev, dtype):
    """(unfused, fused, ref): callables of the call index i (weights cycle over `copies`)."""
    import torch.nn.functional as F

    from bench.kernels import gemv as gv
    from engine.kernels import fused_ops as ops
    a = operands(op, M, K, N, copies, dev, dtype)
    ws, x, res, nw, gu = a["ws"], a.get("x"), a.get("res"), a.get("nw"), a.get("gu")
    if op.startswith("norm"):
        return (lambda i: F.linear(ops.rms_norm(x, nw, EPS, res)[0], ws[i % copies]),
                lambda i: gv.norm_linear(x, nw, EPS, ws[i % copies], residual=res)[0],
                lambda i: gv.norm_linear_ref(x, nw, EPS, ws[i % copies], residual=res)[0])
    if op == "silu_down":
        return (lambda i: F.linear(ops.silu_mul(gu), ws[i % copies]),
                lambda i: gv.silu_mul_linear(gu, ws[i % copies]),
                lambda i: gv.silu_mul_linear_ref(gu, ws[i % copies]))
    return (lambda i: F.linear(x, ws[i % copies]), lambda i: gv.linear(x, ws[i % copies]),
            lambda i: gv.linear_ref(x, ws[i % copies]))


def time_graph(fn, calls, replays):
    """us per call: `calls` calls of fn(i) captured in one CUDA graph, median over replays."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile / cuBLAS heuristics outside the capture
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def time_eager(fn, calls, replays):
    """CPU smoke mode: wall time per call (the interpreter's speed, meaningless for tuning)."""
    t0 = time.perf_counter()
    for i in range(max(1, min(calls, 2))):
        fn(i)
    return (time.perf_counter() - t0) * 1e6 / max(1, min(calls, 2))


def sweep(fused, calls, replays):
    """Best fused time over SWEEP configs (the entry points look gemv_config up at each call)."""
    from bench.kernels import gemv as gv
    default, best = gv.gemv_config, (float("inf"), None)
    try:
        for cfg in SWEEP:
            gv.gemv_config = lambda m, n, k, dt, cfg=cfg: dict(cfg)
            try:
                us = time_graph(fused, calls, replays)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip the config
                print(f"skip {cfg}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            best = min(best, (us, cfg), key=lambda t: t[0])
    finally:
        gv.gemv_config = default
    return best


def run(args):
    import torch

    from bench.common import note, record
    from bench.kernels import gemv as gv
    dev, dtype = args.device, torch.bfloat16
    models, timer = (MODELS, time_graph) if dev == "cuda" else (TINY, time_eager)
    records = []
    for model, op, M, K, N in cases(models, args.rows):
        wbytes = N * K * dtype.itemsize
        copies = 1 if args.hot or dev == "cpu" else min(MAX_COPIES, math.ceil(COLD_BYTES / wbytes))
        calls = max(args.calls, copies)
        unfused, fused, ref = make_impls(op, M, K, N, copies, dev, dtype)
        want = ref(0)
        diff = (fused(0).float() - want.float()).abs().max().item()
        t_unfused, t_fused = timer(unfused, calls, args.replays), timer(fused, calls, args.replays)
        extra = {}
        if args.sweep and dev == "cuda":
            best_us, best_cfg = sweep(fused, calls, args.replays)
            extra = dict(best_us=best_us, best_config=best_cfg)
        records.append(record("gemv_kernels", op, model, "bfloat16", M, None, None, None, K=K, N=N,
                              unfused_us=t_unfused, fused_us=t_fused, speedup=t_unfused / t_fused,
                              max_abs_diff=diff, ref_max=want.float().abs().max().item(),
                              config=gv.gemv_config(M, N, K, dtype), weight_copies=copies, calls=calls,
                              replays=args.replays, triton=__import__("triton").__version__,
                              torch=torch.__version__, **extra))
        note(f"{model} {op} M={M}: unfused {t_unfused:.2f} us, fused {t_fused:.2f} us, max|diff| {diff:.3g}")
        del unfused, fused, ref
        if dev == "cuda":
            torch.cuda.empty_cache()
    return records


def main(argv=None):
    args = parse_args(argv)
    kernel_device(args.device, "gemv_kernels.py")
    records = run(args)
    out = args.out or (REPO / "bench" / "results" / "gemv_kernels.json" if args.device == "cuda" else None)
    if out:
        write_results(records, out)
    print(markdown_table(records, COLUMNS if args.sweep else COLUMNS[:-2]))


if __name__ == "__main__":
    main()
