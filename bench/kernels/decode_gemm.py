"""Per-call GPU time of engine.kernels.matmul.decode_gemm vs the separate kernels + cuBLAS at 8-32 rows, in CUDA graphs,
with and without programmatic dependent launch.

    python -m bench.kernels.decode_gemm               # H100: SmolLM2-135M's four ops at M 8/16/32, bf16
    python -m bench.kernels.decode_gemm --sweep       # also time decode_gemm over SWEEP configs (PDL on)
    python -m bench.kernels.decode_gemm --device cpu  # interpreter smoke test: tiny shapes, correctness only

Ops per decoder layer (bench/kernels/gemv_kernels.py's cases): norm_qkv (residual add + rms_norm, then qkv),
norm_gate_up, silu_down (silu_mul, then down), o_proj (plain). Impls: "cublas" (fused_ops' kernels + F.linear,
the route table's "cublas"), "gemm" (decode_gemm), "gemv" (decode_gemv as it picks: all rows at once at 2-4
rows, else its row loop, forced past its 4 rows for scale), "gemv_loop" (the row loop at any rows); "_pdl" with
dependent launch up to 32 rows (common.PDL_MAX_ROWS, as SPECDEC_PDL_MAX_ROWS=32 sets it),
else none. Timing is gemv_kernels.time_graph's: back-to-back calls in one CUDA graph, the weights cycling over
~256 MB of copies so that they come from HBM (`--hot`: one copy), us = median replay / calls; each call is the
dependent of the one before, as each matmul of a step is of the kernel before it. max_abs_diff: gemm vs the
torch ops (*_ref), ref_max: their largest |value|; a diff over 2^-6 * ref_max fails the run. Writes JSON
(`--out`) and a markdown table beside it, printed last.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import sys

from bench.common import REPO, kernel_device, markdown_table, write_results

ROWS = (8, 16, 32)
EPS = 1e-5
IMPLS = ("cublas", "cublas_pdl", "gemm", "gemm_pdl", "gemv_pdl", "gemv_loop_pdl")
COLUMNS = ["model", "mode", "streams", "K", "N", *(f"{i}_us" for i in IMPLS), "speedup", "max_abs_diff", "ref_max",
           "config", "best_us", "best_config"]
# GROUPS 2: one program takes two row groups with the weight tile it holds (17-32 rows read it once, not twice)
SWEEP = [dict(BLOCK_M=bm, GROUPS=g, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=1)
         for bm, g, bn, bk, w in itertools.product((8, 16, 32), (1, 2), (16, 32, 64), (64, 128), (4, 8))]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--models", nargs="+", default=["smollm2"], help="bench/kernels/gemv_kernels.py MODELS (cuda)")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--calls", type=int, default=50, help="calls captured per graph (at least one per copy)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--hot", action="store_true", help="one weight copy (L2-resident) instead of cycling copies")
    p.add_argument("--sweep", action="store_true", help="also time decode_gemm (PDL on) over SWEEP configs")
    p.add_argument("--quick-sweep", action="store_true", help="only SWEEP's configs of one group a program and 4 warps")
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/decode_gemm.json on cuda, "
                                                "none on cpu); the markdown goes beside it")
    args = p.parse_args(argv)
    args.sweep = args.sweep or args.quick_sweep
    return args


@contextlib.contextmanager
def pdl_rows(rows: int):
    """Launch dependently up to `rows` rows (0: never): engine.kernels.common.pdl reads PDL_MAX_ROWS per call."""
    from engine.kernels import common
    saved, common.PDL_MAX_ROWS = common.PDL_MAX_ROWS, rows
    try:
        yield
    finally:
        common.PDL_MAX_ROWS = saved


@contextlib.contextmanager
def gemm_config(cfg: dict):
    """decode_gemm's launches with `cfg` in place of decode_gemm_config's choice."""
    from engine.kernels.matmul import decode_gemm as gm
    saved, gm.decode_gemm_config = gm.decode_gemm_config, lambda m, n, k, decode=False: dict(cfg)
    try:
        yield
    finally:
        gm.decode_gemm_config = saved


def make_impls(op, M, K, N, copies, dev, dtype):
    """{impl: fn(i)} for "cublas", "gemm", "gemv" and "ref" (torch ops); the weights cycle over `copies`."""
    import torch.nn.functional as F

    from bench.kernels.gemv_kernels import operands
    from engine.kernels.matmul import decode_gemm as gm, decode_gemv as dg
    from engine.kernels import fused_ops as ops
    a = operands(op, M, K, N, copies, dev, dtype)
    ws, x, res, nw, gu = a["ws"], a.get("x"), a.get("res"), a.get("nw"), a.get("gu")
    if op.startswith("norm"):
        return dict(cublas=lambda i: F.linear(ops.rms_norm(x, nw, EPS, res)[0], ws[i % copies]),
                    gemm=lambda i: gm.decode_norm_linear(x, nw, EPS, ws[i % copies], res)[0],
                    gemv=lambda i: dg.launch(x, ws[i % copies], K, "norm", nw=nw, eps=EPS, residual=res)[0],
                    gemv_loop=lambda i: dg.launch(x, ws[i % copies], K, "norm", nw=nw, eps=EPS, residual=res,
                                                  at_once=False)[0],
                    ref=lambda i: F.linear(ops.rms_norm_ref(x, nw, EPS, res)[0], ws[i % copies]))
    if op == "silu_down":
        return dict(cublas=lambda i: F.linear(ops.silu_mul(gu), ws[i % copies]),
                    gemm=lambda i: gm.decode_silu_linear(gu, ws[i % copies]),
                    gemv=lambda i: dg.launch(gu, ws[i % copies], K, "silu")[0],
                    gemv_loop=lambda i: dg.launch(gu, ws[i % copies], K, "silu", at_once=False)[0],
                    ref=lambda i: F.linear(ops.silu_mul_ref(gu), ws[i % copies]))
    return dict(cublas=lambda i: F.linear(x, ws[i % copies]), gemm=lambda i: gm.decode_linear(x, ws[i % copies]),
                gemv=lambda i: dg.launch(x, ws[i % copies], K, "none")[0],
                gemv_loop=lambda i: dg.launch(x, ws[i % copies], K, "none", at_once=False)[0],
                ref=lambda i: F.linear(x, ws[i % copies]))


def sweep(fn, want, timer, calls, replays, quick=False):
    """(best us, its config, every (us, config)) of decode_gemm over SWEEP, each config's result checked against
    `want`."""
    best, timed = (float("inf"), None), []
    for cfg in SWEEP:
        if quick and (cfg["GROUPS"] != 1 or cfg["num_warps"] != 4):
            continue
        with gemm_config(cfg):
            try:
                bad = diff(fn(0), want) > 2 ** -6 * want.float().abs().max().item()
                us = timer(fn, calls, replays)
            except Exception as e:  # noqa: BLE001 - e.g. out of registers or shared memory: skip the config
                print(f"skip {cfg}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
        if bad:
            raise AssertionError(f"config {cfg} disagrees with the torch ops")
        best = min(best, (us, cfg), key=lambda t: t[0])
        timed.append((us, cfg))
    return (*best, timed)


def diff(got, want) -> float:
    return (got.float() - want.float()).abs().max().item()


def run(args):
    import torch

    from bench.common import note, record
    from bench.kernels.gemv_kernels import COLD_BYTES, MAX_COPIES, MODELS, TINY, cases, time_eager, time_graph
    from engine.kernels.matmul import decode_gemm as gm
    dev, dtype = args.device, torch.bfloat16
    models, timer = ({m: MODELS[m] for m in args.models}, time_graph) if dev == "cuda" else (TINY, time_eager)
    records, failed = [], []
    for model, op, M, K, N in cases(models, args.rows):
        if K > gm.MAX_K:        # e.g. Llama 1B's down projection: cuBLAS and the GEMV's loop take it in the engine
            note(f"{model} {op} M={M}: K {K} is past decode_gemm's {gm.MAX_K}, skipped")
            continue
        copies = 1 if args.hot or dev == "cpu" else min(MAX_COPIES, math.ceil(COLD_BYTES / (N * K * dtype.itemsize)))
        calls = max(args.calls, copies)
        impls = make_impls(op, M, K, N, copies, dev, dtype)
        want = impls["ref"](0)
        d = diff(impls["gemm"](0), want)
        if d > 2 ** -6 * want.float().abs().max().item():
            failed.append(f"{model} {op} M={M}: max|diff| {d:.3g}")
        us = {}
        for impl in IMPLS:
            with pdl_rows(gm.MAX_ROWS if impl.endswith("_pdl") else 0):
                us[impl] = timer(impls[impl.removesuffix("_pdl")], calls, args.replays)
        extra = {}
        if args.sweep:
            with pdl_rows(gm.MAX_ROWS):
                best_us, best_cfg, timed = sweep(impls["gemm"], want, timer, calls, args.replays, args.quick_sweep)
            extra = dict(best_us=best_us, best_config=best_cfg, sweep=timed)
        records.append(record("decode_gemm", op, model, "bfloat16", M, None, None, None, K=K, N=N,
                              **{f"{i}_us": t for i, t in us.items()}, speedup=us["cublas"] / us["gemm_pdl"],
                              max_abs_diff=d, ref_max=want.float().abs().max().item(),
                              config=gm.decode_gemm_config(M, N, K), weight_copies=copies, calls=calls,
                              replays=args.replays, triton=__import__("triton").__version__,
                              torch=torch.__version__, **extra))
        note(f"{model} {op} M={M}: " + ", ".join(f"{i} {t:.2f} us" for i, t in us.items()) + f", max|diff| {d:.3g}")
        del impls
        if dev == "cuda":
            torch.cuda.empty_cache()
    return records, failed


def main(argv=None):
    args = parse_args(argv)
    kernel_device(args.device, "decode_gemm.py")
    records, failed = run(args)
    table = markdown_table(records, COLUMNS if args.sweep else COLUMNS[:-2])
    out = args.out or (REPO / "bench" / "results" / "decode_gemm.json" if args.device == "cuda" else None)
    if out:
        path = write_results(records, out)
        path.with_suffix(".md").write_text(table + "\n")
    print(table)
    if failed:
        sys.exit("decode_gemm disagrees with the torch ops: " + "; ".join(failed))


if __name__ == "__main__":
    main()
