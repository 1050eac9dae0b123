"""How close a one-row decode matmul comes to the GPU's copy bandwidth at 1B and 8B shapes: cuBLAS, the shipped
decode GEMV (engine/kernels/matmul/decode_gemv.py) at its own config and over SWEEP_REG (weight elements per program,
warps), and a K-looping GEMV (STREAM: BLOCK_N rows x BLOCK_K columns a stage, software-pipelined) over SWEEP_STREAM.

    python -m bench.kernels.gemv_bandwidth           # H100: Llama-3.2-1B and Llama-3-8B layer shapes + LM heads
    python -m bench.kernels.gemv_bandwidth --models llama1b --quick

Timing: gemv_kernels.time_graph (back-to-back calls in one CUDA graph, the weight cycling over copies so that
each call reads HBM). pct_copy = (weight bytes / us) over the copy bandwidth measured here ((read + write) / s).
Writes JSON (`--out`) and a markdown table beside it, printed last.
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch
import triton
import triton.language as tl

from bench.common import copy_bandwidth_gbs, markdown_table, note, progress, record, write_results
from bench.kernels.gemv_kernels import time_graph
from engine.kernels.matmul import decode_gemv

SHAPES = {"llama1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                      "lm_head": (128256, 2048)},
          "llama8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                      "lm_head": (128256, 4096)}}
SWEEP_REG = [dict(elems=e, num_warps=w) for e, w in itertools.product((8192, 16384, 32768), (4, 8, 16))]
SWEEP_STREAM = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
                for bn, bk, w, s in itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (2, 3, 4))]
COLUMNS = ["model", "op", "N", "K", "mb", "floor_us", "cublas_us", "gemv_us", "best_reg_us", "best_stream_us",
           "pct_copy_gemv", "pct_copy_best", "best_reg", "best_stream"]


@triton.jit
def _stream_gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        STAGES: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def stream_gemv(x, w, out, cfg):
    n, k = w.shape
    _stream_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, w, out, n, k, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], STAGES=cfg["num_stages"],
        num_warps=cfg["num_warps"])


def reg_gemv(x, w, out, cfg, epilogue="store"):
    """The shipped kernel with a chosen weight tile (elements per program) and warps; epilogue "silu_mul": w is
    [gate; up] and out [1, N / 2] their silu(gate) * up, BLOCK_N / 2 pairs a program."""
    n, k = w.shape
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(cfg["elems"] // block_k, triton.next_power_of_2(n)))
    outputs = n // 2 if epilogue == "silu_mul" else n
    grid = triton.cdiv(outputs, block_n // 2 if epilogue == "silu_mul" else block_n)
    decode_gemv._decode_gemv_kernel[(grid,)](
        x, x, x, w, out, x, x, x, x.stride(0), x.stride(0), out.stride(0), x.stride(0), x.stride(0), 1, outputs, k,
        0.0, PROLOGUE="none", HAS_RESIDUAL=False, EPILOGUE=epilogue, BLOCK_N=block_n, BLOCK_K=block_k, ROWS=0,
        USE_PDL=False, num_warps=cfg["num_warps"])


def silu_gemv(x, w, out, cfg):
    reg_gemv(x, w, out, cfg, "silu_mul")


def time_op(fn, weights, x, calls, replays, width=None):
    outs = [torch.empty((1, width or w.shape[0]), dtype=x.dtype, device=x.device) for w in weights]
    return time_graph(lambda i: fn(x, weights[i % len(weights)], outs[i % len(weights)]), calls, replays)


def best(fn_of_cfg, sweep, weights, x, want, calls, replays):
    """(us, cfg) of the fastest config whose output matches `want`; configs that fail to compile are skipped."""
    found = (math.inf, None)
    for cfg in sweep:
        try:
            out = torch.empty_like(want)
            fn_of_cfg(x, weights[0], out, cfg)
            if (out.float() - want.float()).abs().max().item() > 2 ** -5 * want.float().abs().max().item():
                note(f"{cfg}: wrong result, skipped")
                continue
            us = time_op(lambda a, w, o: fn_of_cfg(a, w, o, cfg), weights, x, calls, replays, want.shape[1])
        except Exception as e:              # noqa: BLE001 - out of registers / shared memory: not a candidate
            note(f"{cfg}: {type(e).__name__}")
            continue
        found = min(found, (us, cfg), key=lambda t: t[0])
    return found


def operands(n, k, args):
    """(weights, x, calls, replays, bytes of one weight): bf16 copies of an [n, k] weight filling 256 MB, so that
    calls cycling over them read HBM, and one row x."""
    nbytes = n * k * 2
    copies = max(1, math.ceil((256 << 20) / nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    return weights, x, max(args.calls, copies), args.replays, nbytes


def run_case(model, op, n, k, args, bandwidth):
    weights, x, calls, replays, nbytes = operands(n, k, args)
    want = torch.nn.functional.linear(x, weights[0])
    cublas = time_op(lambda a, w, o: torch.mm(a, w.t(), out=o), weights, x, calls, replays)
    shipped = None
    if k <= decode_gemv.MAX_K_PLAIN:
        shipped = time_op(lambda a, w, o: o.copy_(decode_gemv.decode_linear(a, w)), weights, x, calls, replays)
    reg_sweep = [c for c in SWEEP_REG if k <= decode_gemv.MAX_K_PLAIN][: 3 if args.quick else None]
    stream_sweep = SWEEP_STREAM[::6] if args.quick else SWEEP_STREAM
    reg_us, reg_cfg = best(reg_gemv, reg_sweep, weights, x, want, calls, replays)
    st_us, st_cfg = best(stream_gemv, stream_sweep, weights, x, want, calls, replays)
    floor = nbytes / (bandwidth * 1e9) * 1e6
    top = min(u for u in (cublas, shipped, reg_us, st_us) if u is not None)
    del weights
    torch.cuda.empty_cache()
    return record("gemv_bandwidth", op, model, "bfloat16", 1, None, None, None, op=op, N=n, K=k,
                  mb=nbytes / 1e6, floor_us=floor, cublas_us=cublas, gemv_us=shipped,
                  best_reg_us=None if reg_cfg is None else reg_us, best_stream_us=None if st_cfg is None else st_us,
                  pct_copy_gemv=None if shipped is None else 100 * floor / shipped, pct_copy_best=100 * floor / top,
                  best_reg=reg_cfg and str(reg_cfg), best_stream=st_cfg and str(st_cfg), copy_gbs=bandwidth)


def run_silu_case(model, args, bandwidth):
    """gate_up with SiLU * up in the epilogue (the GEMV route's gate_up) over SWEEP_REG: shipped = its config."""
    n, k = SHAPES[model]["gate_up"]
    weights, x, calls, replays, nbytes = operands(n, k, args)
    gate_up = torch.nn.functional.linear(x, weights[0])
    want = torch.nn.functional.silu(gate_up[:, : n // 2]) * gate_up[:, n // 2:]
    cfg = decode_gemv.decode_gemv_config(n, k)
    shipped = dict(elems=cfg["BLOCK_N"] * cfg["BLOCK_K"], num_warps=cfg["num_warps"])
    rows = []
    for c in [shipped] + [c for c in SWEEP_REG if c != shipped]:
        us, _ = best(silu_gemv, [c], weights, x, want, calls, replays)
        rows.append(record("gemv_bandwidth", "gate_up_silu", model, "bfloat16", 1, None, None, None,
                           op="gate_up_silu", N=n, K=k, mb=nbytes / 1e6, floor_us=nbytes / (bandwidth * 1e9) * 1e6,
                           gemv_us=us, cfg=str(c), shipped=c == shipped, copy_gbs=bandwidth))
    del weights
    torch.cuda.empty_cache()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--ops", nargs="+", default=None, help="a subset of qkv o gate_up down lm_head")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="a few configs of each sweep")
    p.add_argument("--silu", action="store_true", help="only gate_up with the SiLU * up epilogue, over SWEEP_REG")
    p.add_argument("--out", default="bench/results/gemv_bandwidth.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gemv_bandwidth needs a CUDA GPU")
    bandwidth = copy_bandwidth_gbs()
    note(f"copy bandwidth {bandwidth:,.0f} GB/s")
    if args.silu:
        records = [r for m in progress(args.models, "gate_up silu (model)") for r in run_silu_case(m, args, bandwidth)]
        path = write_results(records, args.out)
        table = markdown_table(records, ["model", "N", "K", "floor_us", "gemv_us", "cfg", "shipped"])
        path.with_suffix(".md").write_text(f"copy bandwidth {bandwidth:,.0f} GB/s\n\n{table}\n")
        print(table)
        return
    cases = [(m, op, *nk) for m in args.models for op, nk in SHAPES[m].items() if not args.ops or op in args.ops]
    records = [run_case(*c, args, bandwidth) for c in progress(cases, "gemv bandwidth (model, op)")]
    path = write_results(records, args.out)
    table = markdown_table(records, COLUMNS)
    path.with_suffix(".md").write_text(f"copy bandwidth {bandwidth:,.0f} GB/s\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
