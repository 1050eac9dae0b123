"""GPU timing of the Triton paged-attention kernel vs the torch reference and dense SDPA.

    python -m bench.kernels.attention_kernels [--out bench/results/attention_kernels.json] [--no-ref]

Decode: B in {1, 8, 32} at seq_len {512, 2048}; prefill: one 1024-token prompt. SmolLM2-135M
(9 q / 3 kv heads, head_dim 64) and Llama-8B (32 / 8, 128) shapes, bf16, pages of 16 shuffled over the
cache. Times are triton.testing.do_bench medians (us). "sdpa" is
torch.nn.functional.scaled_dot_product_attention on the equivalent dense [B, heads, seq, head_dim]
tensors (no paging): the speed to aim for. "triton_1split" forces num_splits=1 (no split-KV).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

from bench.common import REPO, command_line, git_commit
from engine.attention import AttentionMetadata, paged_attention_torch
from engine.kernels.attention import paged_attention as ta

SHAPES = {"smollm": (9, 3, 64), "llama8b": (32, 8, 128)}
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


def make_paged(q_lens, seq_len, num_heads, num_kv_heads, head_dim):
    """Paged inputs: every sequence seq_len long, pages shuffled over the cache."""
    b = len(q_lens)
    blocks = triton.cdiv(seq_len, BLOCK_SIZE)
    cache_shape = (b * blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(cache_shape, device="cuda", dtype=DTYPE)
    tables = torch.randperm(b * blocks, device="cuda").view(b, blocks).to(torch.int32)
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    seq_lens = torch.full((b,), seq_len, device="cuda", dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, device="cuda", dtype=DTYPE)
    return q, k_cache, v_cache, AttentionMetadata(None, cu, seq_lens, tables, max(q_lens), seq_len)


def candidates(mode, b, seq_len, shape, with_ref):
    """name -> zero-arg callable running one attention step."""
    num_heads, num_kv_heads, head_dim = shape
    q_len = 1 if mode == "decode" else seq_len
    q, k_cache, v_cache, meta = make_paged([q_len] * b, seq_len, *shape)
    scale = head_dim ** -0.5
    args = (q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale, meta.max_query_len)
    out = torch.empty_like(q)
    fns = {"triton": lambda: ta.paged_attention(*args, out=out)}
    if mode == "decode":
        fns["triton_1split"] = lambda: ta.paged_attention(*args, out=out, num_splits=1)
    if with_ref:
        fns["torch_ref"] = lambda: paged_attention_torch(q, k_cache, v_cache, meta, scale)
    dq = torch.randn(b, num_heads, q_len, head_dim, device="cuda", dtype=DTYPE)
    dk = torch.randn(b, num_kv_heads, seq_len, head_dim, device="cuda", dtype=DTYPE)
    dv = torch.randn_like(dk)
    fns["sdpa"] = lambda: F.scaled_dot_product_attention(dq, dk, dv, is_causal=mode == "prefill", scale=scale,
                                                         enable_gqa=True)
    return fns


def cases():
    for model in SHAPES:
        for seq_len in (512, 2048):
            for b in (1, 8, 32):
                yield "decode", model, b, seq_len
        yield "prefill", model, 1, 1024


def run(with_ref):
    device = torch.cuda.get_device_name()
    records, rows = [], []
    for mode, model, b, seq_len in cases():
        shape = SHAPES[model]
        times = {}
        for impl, fn in candidates(mode, b, seq_len, shape, with_ref).items():
            times[impl] = triton.testing.do_bench(fn, return_mode="median") * 1e3
            records.append({"bench": "attention_kernels", "mode": mode, "impl": impl, "device": device,
                            "shape": {"model": model, "batch": b, "seq_len": seq_len,
                                      "q_len": 1 if mode == "decode" else seq_len, "num_heads": shape[0],
                                      "num_kv_heads": shape[1], "head_dim": shape[2],
                                      "block_size": BLOCK_SIZE},
                            "dtype": str(DTYPE).removeprefix("torch."), "us": round(times[impl], 2)})
        rows.append((mode, model, b, seq_len, times))
        torch.cuda.empty_cache()
    return device, records, rows


def markdown(device, rows):
    impls = list(dict.fromkeys(i for *_, t in rows for i in t))
    lines = [f"attention kernels on {device}, {str(DTYPE).removeprefix('torch.')}, median us", "",
             "| mode | model | B | seq | " + " | ".join(impls) + " | triton/sdpa |",
             "|" + "---|" * (len(impls) + 5)]
    for mode, model, b, seq_len, t in rows:
        cells = " | ".join(f"{t[i]:.1f}" if i in t else "-" for i in impls)
        lines.append(f"| {mode} | {model} | {b} | {seq_len} | {cells} | {t['triton'] / t['sdpa']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "attention_kernels.json"))
    parser.add_argument("--no-ref", action="store_true", help="skip the (slow, host-syncing) torch reference")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    device, records, rows = run(not opts.no_ref)
    print(markdown(device, rows))
    meta = {"commit": git_commit(), "command": command_line(),
            "triton": triton.__version__, "torch": torch.__version__}
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out, "w") as f:
        json.dump([{**r, **meta} for r in records], f, indent=1)
    print(f"\nwrote {len(records)} records to {opts.out}")


if __name__ == "__main__":
    main()
