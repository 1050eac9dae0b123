"""How the decode GEMV could take several rows at once, against its row loop and decode_gemm, at 1-8 rows (CUDA).

    python -m bench.kernels.gemv_rows_variants --out bench/results/gemv_rows/variants.json

Variants of the work after the dependent-launch wait, each with 4 or 8 warps: "hoist" loads every row's x in one
load, then reduces the rows one by one; "3d" reduces one [rows, BLOCK_N, BLOCK_K] product (what
engine/kernels/matmul/decode_gemv.py ships for 2-4 rows). Each record: us per call
(bench/kernels/gemv_kernels.time_graph, weights cycling through HBM) and the largest difference from the shipped
kernel's output, with bench/common.record's device, commit and command.
"""
from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.language as tl

from bench.common import record, write_results

from engine.kernels.common import reduce_sum, round_to
from engine.kernels.matmul.decode_gemv import _rows_prologue


@triton.jit
def _rows_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, out_ptr, new_res_ptr, stride_x, stride_res, stride_out,
                 stride_new_res, M, N, K, eps, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, MODE: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok, k_ok = offs_n < N, offs_k < K
    if MODE == "3d":
        w = tl.load(w_ptr + offs_n.to(tl.int64)[None, :, None] * K + offs_k[None, None, :],
                    mask=n_ok[None, :, None] & k_ok[None, None, :], other=0.0).to(tl.float32)
    else:
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
    nw = w
    if PROLOGUE == "norm":
        nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    a, offs_m, m_ok = _rows_prologue(x_ptr, res_ptr, nw, new_res_ptr, stride_x, stride_res, stride_new_res, M, K,
                                     eps, pid, offs_k, k_ok, PROLOGUE, HAS_RESIDUAL, ROWS)
    if MODE == "3d":
        y = round_to(reduce_sum(w * a[:, None, :], 2), dtype)                    # [ROWS, BLOCK_N]
        tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])
    else:
        for m in tl.static_range(ROWS):
            am = reduce_sum(tl.where(offs_m[:, None] == m, a, 0.0), 0)
            y = round_to(reduce_sum(w * am[None, :], 1), dtype)
            tl.store(out_ptr + m * stride_out + offs_n, y, mask=n_ok & (offs_n * 0 + m < M))


def rows_launch(x, weight, k, prologue, mode, nw=None, eps=0.0, residual=None, elems=8192, warps=None):
    from engine.kernels.common import pdl
    m, n = x.shape[0], weight.shape[0]
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(elems // block_k, triton.next_power_of_2(n)))
    grid = triton.cdiv(n, block_n)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_res = x if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    res = x if residual is None else residual
    _rows_kernel[(grid,)](x, res, x if nw is None else nw, weight, out, new_res, x.stride(0), res.stride(0),
                          out.stride(0), new_res.stride(0), m, n, k, float(eps), PROLOGUE=prologue,
                          HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, BLOCK_K=block_k,
                          ROWS=triton.next_power_of_2(m), MODE=mode,
                          num_warps=warps or (4 if block_k <= 2048 else 8), **pdl(_rows_kernel, x.device, m))
    return out


VARIANTS = ("hoist:4", "hoist:8", "3d:4", "3d:8")    # mode:warps[:weight elements a program, default 8192]


def impls(op, M, K, N, copies, dev, dtype, variants=VARIANTS, eps=1e-5):
    """{name: fn(i)}: the shipped GEMV ("gemv"), decode_gemm ("gemm") and each variant, weights cycling."""
    from bench.kernels.gemv_kernels import operands
    from engine.kernels.matmul import decode_gemm as gm, decode_gemv as dg
    a = operands(op, M, K, N, copies, dev, dtype)
    ws, x, res, nw, gu = a["ws"], a.get("x"), a.get("res"), a.get("nw"), a.get("gu")
    if op.startswith("norm"):
        src, pro, kw = x, "norm", dict(nw=nw, eps=eps, residual=res)
        out = dict(gemm=lambda i: gm.decode_norm_linear(x, nw, eps, ws[i % copies], res)[0])
    elif op == "silu_down":
        src, pro, kw = gu, "silu", {}
        out = dict(gemm=lambda i: gm.decode_silu_linear(gu, ws[i % copies]))
    else:
        src, pro, kw = x, "none", {}
        out = dict(gemm=lambda i: gm.decode_linear(x, ws[i % copies]))
    out["gemv"] = lambda i: dg.launch(src, ws[i % copies], K, pro, **kw)[0]
    for v in variants:
        mode, warps, *elems = v.split(":")
        cfg = dict(warps=int(warps), elems=int(elems[0]) if elems else 8192)
        out[v.replace(":", "_")] = (lambda mode, cfg: lambda i: rows_launch(
            src, ws[i % copies], K, pro, mode, **kw, **cfg))(mode, cfg)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    p.add_argument("--models", nargs="+", default=["smollm2", "llama1b"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help="mode:warps[:elements], e.g. 3d:4:4096")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import json

    from bench.kernels.gemv_kernels import COLD_BYTES, MAX_COPIES, MODELS, cases, time_graph
    from engine.kernels import common
    common.PDL_MAX_ROWS = 32
    dev, dtype = "cuda", torch.bfloat16
    recs = []
    for model, op, M, K, N in cases({m: MODELS[m] for m in args.models}, args.rows):
        copies = min(MAX_COPIES, math.ceil(COLD_BYTES / (N * K * 2)))
        fns = impls(op, M, K, N, copies, dev, dtype, args.variants)
        want = fns["gemv"](0).float()
        rec = record("gemv_rows_variants", op, model, "bfloat16", M, None, None, None, op=op, M=M, K=K, N=N)
        for name, fn in fns.items():
            try:
                got = fn(0).float()
                rec[f"{name}_diff"] = (got - want).abs().max().item()
                rec[f"{name}_us"] = round(time_graph(fn, max(50, copies), 20), 2)
            except Exception as e:  # noqa: BLE001
                rec[f"{name}_us"] = None
                rec[f"{name}_err"] = str(e)[:200]
        print(json.dumps(rec), flush=True)
        recs.append(rec)
        del fns
        torch.cuda.empty_cache()
    if args.out:
        write_results(recs, args.out)


if __name__ == "__main__":
    main()
