"""Per-call GPU time of a greedy LM head's argmax: engine.kernels.matmul.head_mma against cuBLAS's logits +
argmax.py's two kernels (the route table's "cublas" head) and draft_gemv's GEMV argmax (1-4 rows).

    python -m bench.kernels.head_mma --out $OUT/head_mma.json              # SmolLM2's head, 1-32 rows, the sweep
    python -m bench.kernels.head_mma --heads smollm2 llama1b --rows 8 32    # Llama 1B's head (128256 x 2048) too
    python -m bench.kernels.head_mma --device cpu                           # interpreter smoke test: tiny shapes

Impls: "cublas" (F.linear, then argmax.argmax_rows), "gemv" (draft_gemv.linear_argmax, up to 4 rows), "mma"
(head_mma with its head_config), and at --sweep-rows (8 and 32) "best": head_mma over SWEEP, its fastest config
named. Each call is the dependent of the one before (programmatic dependent launch where the engine uses
it); timing is bench/kernels/gemv_kernels.time_graph's: back-to-back calls in one CUDA graph, the weight cycling over
~256 MB of copies so that it comes from HBM. Every impl's tokens are checked against torch's argmax of the logits
(a near-tie may differ in summation order: `agree` counts the rows equal). Writes JSON (`--out`) and a markdown
table beside it, printed last.
"""
from __future__ import annotations

import argparse
import itertools

from bench.common import kernel_device, markdown_table, write_results

HEADS = {"smollm2": (49152, 576), "llama1b": (128256, 2048), "tiny": (300, 64)}
SWEEP = ([dict(BLOCK_V=bv, BLOCK_K=bk, PRELOAD=False, num_warps=w, num_stages=s)
          for bv, bk, w, s in itertools.product((64, 128, 256), (64, 128), (4, 8), (3, 4))] +
         [dict(BLOCK_V=bv, BLOCK_K=bk, PRELOAD=True, num_warps=w, num_stages=1)      # its own double buffer
          for bv, bk, w in itertools.product((64, 128, 256), (64, 128), (4, 8))])
COLUMNS = ["head", "V", "K", "rows", "cublas_us", "gemv_us", "mma_us", "best_us", "best_config", "speedup", "agree"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--heads", nargs="+", default=["smollm2"], choices=sorted(HEADS))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 5, 8, 16, 32])
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--sweep-rows", type=int, nargs="*", default=[8, 32], help="rows timed over SWEEP (CUDA)")
    p.add_argument("--out", default=None, help="JSON path; the markdown goes beside it")
    return p.parse_args(argv)


def impls(x, copies, hm, dr, argmax, config=None):
    import torch.nn.functional as F
    out = {"cublas": lambda i: argmax.argmax_rows(F.linear(x, copies[i % len(copies)])),
           "mma": lambda i: hm.first_max(*hm.partials(x, copies[i % len(copies)], config))}
    if x.shape[0] <= dr.MAX_ROWS and dr.supports_linear(x, copies[0]):
        out["gemv"] = lambda i: dr.linear_argmax(x, copies[i % len(copies)])
    return out


def sweep(impls, x, copies, hm, dr, argmax, args):
    """(us, config) of head_mma's fastest SWEEP config at x's rows; configs whose tiles do not fit the shared
    memory are skipped."""
    from triton.runtime.errors import OutOfResources
    from bench.kernels.gemv_kernels import time_graph
    best = (float("inf"), None)
    for config in SWEEP:
        try:
            best = min(best, (time_graph(impls(x, copies, hm, dr, argmax, config)["mma"], args.calls, args.replays),
                              config), key=lambda t: t[0])
        except OutOfResources:
            continue
    return best


def run(args):
    import torch
    import torch.nn.functional as F
    from bench.kernels.gemv_kernels import time_eager, time_graph
    from engine.kernels.matmul import draft_gemv as dr, head_mma as hm
    from engine.kernels.sampling import argmax
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    timer = time_graph if dev == "cuda" else time_eager
    records = []
    for name in (args.heads if dev == "cuda" else ["tiny"]):
        v, k = HEADS[name]
        w = torch.randn(v, k, device=dev, dtype=dtype) / k ** 0.5
        copies = [w] + [w.clone() for _ in range(max(0, 256 * 2 ** 20 // w.nbytes))] if dev == "cuda" else [w]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            want = F.linear(x, w).float().argmax(-1)
            rec = {"head": name, "V": v, "K": k, "rows": m, "agree": {}}
            for impl, fn in impls(x, copies, hm, dr, argmax).items():
                rec["agree"][impl] = int((fn(0) == want).sum())
                rec[f"{impl}_us"] = timer(fn, args.calls, args.replays)
            if m in args.sweep_rows and dev == "cuda":
                rec["best_us"], rec["best_config"] = sweep(impls, x, copies, hm, dr, argmax, args)
            rec["speedup"] = min(rec["cublas_us"], rec.get("gemv_us", float("inf"))) / min(
                rec["mma_us"], rec.get("best_us", float("inf")))
            print(name, m, {c: rec.get(c) for c in COLUMNS[4:]}, flush=True)
            records.append(rec)
        del copies, w
        if dev == "cuda":
            torch.cuda.empty_cache()
    return records


def main(argv=None):
    args = parse_args(argv)
    kernel_device(args.device, "head_mma.py")
    records = run(args)
    table = markdown_table(records, COLUMNS)
    if args.out:
        write_results(records, args.out).with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
