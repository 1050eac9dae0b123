"""One decode_attention launch on Llama 1B's heads (32 q / 8 KV heads, head_dim 64), bf16, pages of 16 shuffled over
the cache, at each launch config: KV tile (TILE_N), warps, tiles read before the wait (PREFETCH), pipeline stages and
KV splits; beside it the engine's own call and dense SDPA on the same sizes. Times: triton.testing.do_bench medians
(us), its L2 flush before each call. CUDA only; writes $OUT/attn_probe.json (default /tmp).

    PYTHONPATH=. python bench/results/attention_tiles/per_call_probe.py
"""
import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.testing

from engine.kernels.attention import decode_attention as da
from engine.kernels.attention.paged_attention import _LOG2E
from engine.kernels.attention.split_merge import split_partials

H, KVH, D, BS = 32, 8, 64, 16
SHAPES = [(1, 256), (8, 2048), (32, 2048), (128, 256), (128, 1024)]      # (sequences, cached keys)
CONFIGS = list(itertools.product([32, 64, 128], [2, 4, 8], [1, 2], [1, 3]))  # tile, warps, prefetch, stages
PEAK = 3.35e12                                                              # bytes/s, the floor's bandwidth


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40) * 1e3


def inputs(b: int, ctx: int) -> dict:
    blocks = triton.cdiv(ctx + 1, BS)
    kc = torch.randn((b * blocks + 1, BS, KVH, D), device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(b * blocks, device="cuda").view(b, blocks).to(torch.int32)
    ang = torch.rand(4096, D, device="cuda")
    return dict(q=torch.randn(b, H, D, device="cuda", dtype=torch.bfloat16),
                k=torch.randn(b, KVH, D, device="cuda", dtype=torch.bfloat16),
                v=torch.randn(b, KVH, D, device="cuda", dtype=torch.bfloat16),
                pos=torch.full((b,), ctx, device="cuda", dtype=torch.int64), cos=ang.cos(), sin=ang.sin(),
                kc=kc, vc=torch.randn_like(kc), cu=torch.arange(b + 1, device="cuda", dtype=torch.int32),
                seq_lens=torch.full((b,), ctx + 1, device="cuda", dtype=torch.int32), tables=tables,
                slots=tables[:, ctx // BS].long() * BS + ctx % BS)


def launch(s: dict, tile_n: int, warps: int, prefetch: int, stages: int, splits: int = 1, sem=None):
    q, kc, out = s["q"], s["kc"], s.setdefault("out", torch.empty_like(s["q"]))
    pa, pm, pl = split_partials(out, splits, D)
    da._decode_attn_kernel[(splits, q.shape[0], KVH)](
        q, s["k"], s["v"], kc, s["vc"], out, pa, pm, pl, s["cu"], s["seq_lens"], s["tables"], s["pos"], s["slots"],
        s["cos"], s["sin"], sem if splits > 1 else s["seq_lens"], D ** -0.5 * _LOG2E, H,
        q.stride(0), q.stride(1), s["k"].stride(0), s["k"].stride(1), s["v"].stride(0), s["v"].stride(1),
        out.stride(0), out.stride(1), s["tables"].stride(0), s["tables"].stride(1), kc.stride(0), kc.stride(1),
        kc.stride(2), s["cos"].stride(0), GROUP=H // KVH, BLOCK_M=16, HEAD_DIM=D, HEAD_PAD=D, BLOCK_SIZE=BS,
        TILE_N=tile_n, NUM_SPLITS=splits, PREFETCH=prefetch, num_warps=warps, num_stages=stages, PRECISION="tf32",
        MERGE=splits > 1, USE_PDL=False)
    return out


def probe(b: int, ctx: int) -> list[dict]:
    s = inputs(b, ctx)
    floor = b * ctx * KVH * D * 2 * 2 / PEAK * 1e6
    rows = [dict(variant="engine", us=bench(lambda: da.decode_attention(
        s["q"], s["k"], s["v"], s["pos"], s["cos"], s["sin"], s["kc"], s["vc"], s["cu"], s["seq_lens"], s["tables"],
        s["slots"], D ** -0.5, out=s.setdefault("out", torch.empty_like(s["q"])))))]
    dq = torch.randn(b, H, 1, D, device="cuda", dtype=torch.bfloat16)
    dk, dv = (torch.randn(b, KVH, ctx, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rows.append(dict(variant="sdpa_dense", us=bench(lambda: F.scaled_dot_product_attention(dq, dk, dv,
                                                                                            enable_gqa=True))))
    base = launch(s, 64, 4, 2, 3).clone()
    for tile_n, warps, prefetch, stages in CONFIGS:
        err = (launch(s, tile_n, warps, prefetch, stages).float() - base.float()).abs().max().item()
        rows.append(dict(variant=f"t{tile_n}w{warps}p{prefetch}s{stages}", err=err,
                         us=bench(lambda: launch(s, tile_n, warps, prefetch, stages))))
    for splits in (2, 4):
        sem = torch.zeros(b * KVH, dtype=torch.int32, device="cuda")
        for tile_n, warps in ((64, 4), (32, 4), (64, 2)):
            rows.append(dict(variant=f"t{tile_n}w{warps}p1s3x{splits}",
                             us=bench(lambda: launch(s, tile_n, warps, 1, 3, splits, sem))))
    return [dict(r, b=b, ctx=ctx, floor_us=floor) for r in rows]


def main():
    rows = []
    for b, ctx in SHAPES:
        found = probe(b, ctx)
        best = min(found[2:], key=lambda r: r["us"])
        print(f"{b} sequences x {ctx} keys: engine {found[0]['us']:.1f} us, sdpa {found[1]['us']:.1f}, "
              f"best {best['variant']} {best['us']:.1f}, floor {found[0]['floor_us']:.1f}", flush=True)
        rows += found
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "attn_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
