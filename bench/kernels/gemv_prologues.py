"""What the decode GEMV's prologue and epilogue cost its bandwidth at one row, by launch config (CUDA).

    python -m bench.kernels.gemv_prologues [--model llama8b] [--out bench/results/gemv_prologues/llama8b.json]

In a Llama 8B decode step at one stream the LM head's GEMV (no prologue) reads its weight at ~4.65 TB/s on an H200,
gate_up's (residual add + RMSNorm before, SiLU * up after) at ~3.9. This times one call of
engine/kernels/matmul/decode_gemv.py's kernel at one layer's shapes with each prologue / epilogue the engine uses,
at the shipped config and at others (BLOCK_N weight rows a program, warps). The calls are chained in a CUDA graph
under dependent launch, as in the step, the weight cycling through enough copies to come from HBM
(bench/kernels/gemv_kernels.time_graph). `tb_s`: weight bytes over time; `x_store`: time over the prologue-free call's
at the same shapes and config. Each fused call's output is checked against torch.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from bench.common import bars, markdown_table, note, record, write_results

from bench.kernels.gemv_kernels import time_graph
from engine.kernels.fused_ops import rms_norm_ref, silu_mul_ref
from engine.kernels.matmul import decode_gemv

SHAPES = {"llama8b": dict(hidden=4096, qkv=6144, inter=14336),
          "llama1b": dict(hidden=2048, qkv=3072, inter=8192)}
# (label, prologue, residual, epilogue, N of the weight)
KINDS = [("plain", "none", False, "store", "inter2"), ("norm", "norm", True, "store", "inter2"),
         ("norm_silu", "norm", True, "silu_mul", "inter2"), ("qkv_norm", "norm", True, "store", "qkv"),
         ("qkv_plain", "none", False, "store", "qkv"), ("down", "none", False, "store", "down")]
L2_BYTES = 128 << 20     # weight bytes the calls cycle over, past any L2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="llama8b")
    p.add_argument("--configs", nargs="+", default=["shipped", "2x4", "4x8", "4x16", "8x16"],
                   help="launch configs: 'shipped' or BLOCK_N x warps")
    p.add_argument("--kinds", nargs="+", default=[k[0] for k in KINDS[:-1]], choices=[k[0] for k in KINDS],
                   help="down: the down projection's long rows (no prologue; K = the MLP width)")
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default="bench/results/gemv_prologues.json")
    p.add_argument("--render", action="store_true", help="only redo the table and plot from --out's JSON")
    return p.parse_args(argv)


def config(spec: str, n: int, k: int) -> dict:
    cfg = decode_gemv.decode_gemv_config(n, k)
    if spec != "shipped":
        rows, warps = (int(v) for v in spec.split("x"))
        cfg = dict(cfg, BLOCK_N=rows, num_warps=warps)
    return cfg


def operands(n: int, k: int, copies: int, device="cuda"):
    g = torch.Generator(device=device).manual_seed(n + k)
    rnd = lambda *s: torch.randn(*s, generator=g, device=device).to(torch.bfloat16)  # noqa: E731
    return [rnd(n, k) / math.sqrt(k) for _ in range(copies)], rnd(1, k), rnd(1, k), rnd(k)


def launcher(prologue: str, residual: bool, epilogue: str, cfg: dict, ws, x, res, nw):
    """fn(i): one call of the engine's launch at config `cfg` on weight copy i % copies; returns its output."""
    k = ws[0].shape[1]

    def fn(i):
        return decode_gemv.launch(x, ws[i % len(ws)], k, prologue, nw=nw, eps=1e-5, residual=res if residual else None,
                                  epilogue=epilogue, config=cfg)[0]
    return fn


def reference(prologue: str, residual: bool, epilogue: str, w, x, res, nw):
    a = x
    if prologue == "norm":
        a = rms_norm_ref(x, nw, 1e-5, res)[0] if residual else rms_norm_ref(x, nw, 1e-5)
    y = torch.nn.functional.linear(a, w)
    return silu_mul_ref(y) if epilogue == "silu_mul" else y


def run_case(label, prologue, residual, epilogue, n, k, spec, args) -> dict:
    cfg = config(spec, n, k)
    if cfg["BLOCK_N"] < 2 and epilogue == "silu_mul":
        raise ValueError(f"silu_mul needs at least 2 weight rows a program, config {spec}")
    copies = max(2, math.ceil(L2_BYTES / (n * k * 2)))
    ws, x, res, nw = operands(n, k, copies)
    fn = launcher(prologue, residual, epilogue, cfg, ws, x, res, nw)
    us = time_graph(fn, max(args.calls, copies), args.replays)
    out = fn(0)
    ref = reference(prologue, residual, epilogue, ws[0], x, res, nw)
    diff = (out.float() - ref.float()).abs().max().item()
    return record("gemv_prologues", label, args.model, "bfloat16", 1, None, None, None, N=n, K=k, config=spec,
                  prologue=prologue,
                  block_n=cfg["BLOCK_N"], warps=cfg["num_warps"], us=us, tb_s=n * k * 2 / us / 1e6,
                  max_abs_diff=diff, ref_max=ref.float().abs().max().item())


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.render:
        records = json.loads(Path(args.out).read_text())
        print(render(records, args.out))
        return records
    if not torch.cuda.is_available():
        raise RuntimeError("bench/kernels/gemv_prologues.py times CUDA kernels: it needs a CUDA device")
    shapes = SHAPES[args.model]
    records = []
    for spec in args.configs:
        for label, prologue, residual, epilogue, which in (k for k in KINDS if k[0] in args.kinds):
            n, k = {"inter2": (2 * shapes["inter"], shapes["hidden"]), "qkv": (shapes["qkv"], shapes["hidden"]),
                    "down": (shapes["hidden"], shapes["inter"])}[which]
            records.append(run_case(label, prologue, residual, epilogue, n, k, spec, args))
            note(f"{spec} {label}: {records[-1]['us']:.2f} us, {records[-1]['tb_s']:.2f} TB/s")
    for r in records:
        base = [b for b in records if b["config"] == r["config"] and b["N"] == r["N"] and b["prologue"] == "none"]
        r["x_store"] = r["us"] / base[0]["us"] if base else None
    write_results(records, args.out)
    print(render(records, args.out))
    return records


def render(records: list[dict], out) -> str:
    """The markdown table and the bar plot (TB/s by kind, a bar per config) beside `out`; returns the table."""
    stem = str(out).rsplit(".", 1)[0]
    text = (f"Command: `{records[0]['command']}` on {records[0]['device']}, commit {records[0]['git_commit']}.\n\n"
            + markdown_table(records, ["config", "block_n", "warps", "mode", "N", "K", "us", "tb_s", "x_store",
                                       "max_abs_diff", "ref_max"]))
    Path(stem + ".md").write_text(text + "\n")
    configs = list(dict.fromkeys(r["config"] for r in records))
    rows = [{"model": r["model"], "mode": r["mode"]} for r in records if r["config"] == configs[0]]
    for row in rows:
        row.update({c: r["tb_s"] for c in configs for r in records
                    if r["config"] == c and r["mode"] == row["mode"]})
    bars(rows, "model", "mode", configs, stem + ".png", "Decode GEMV, one row: TB/s by launch config (BLOCK_N x warps)")
    return text


if __name__ == "__main__":
    main()
