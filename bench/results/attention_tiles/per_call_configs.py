# decode_attention per call by (warps, TILE_N) at Llama 8B and SmolLM2 shapes, chained under dependent launch in a
# CUDA graph (run from the repository root on a GPU machine; writes $OUT/attn_cfg.json)
import sys, json, os
import torch
sys.path[:0] = ['tests', 'tests/kernels', '.']
from test_rope_attention import make_step
import engine.kernels.attention.decode_attention as da
from bench.gemv_kernels import time_graph
orig = da._tile_config
res = []
for name, (H, KV, D) in {"llama8b": (32, 8, 128), "smollm2": (9, 3, 64)}.items():
    for streams, splits in [(1, 4), (32, 1)]:
        s = make_step([1] * streams, [170] * streams, H, KV, D, 16, torch.bfloat16)
        ref = None
        for warps, tile in [(4, 64), (8, 64), (2, 64), (4, 32), (4, 128), (8, 128)]:
            def cfg(g, q, b, warps=warps, tile=tile):
                bm, bq, tn, w = orig(g, q, b)
                return bm, bq, tile, warps
            da._tile_config = cfg
            def fn(i):
                return da.decode_attention(s["q"], s["k"], s["v"], s["positions"], s["cos"], s["sin"], s["k_cache"],
                                           s["v_cache"], s["cu"], s["seq_lens"], s["tables"], s["slots"], D ** -0.5,
                                           num_splits=splits)
            try:
                out = fn(0).float()
                us = time_graph(fn, 64, 30)
            except Exception as e:
                print(name, streams, warps, tile, "FAIL", type(e).__name__, str(e)[:200]); continue
            ref = out if ref is None else ref
            d = (out - ref).abs().max().item()
            res.append(dict(model=name, streams=streams, splits=splits, warps=warps, tile_n=tile, us=us, diff=d))
            print(f"{name} streams {streams} splits {splits} warps {warps} tile {tile}: {us:.2f} us  diff {d:.2e}",
                  flush=True)
da._tile_config = orig
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "attn_cfg.json"), "w"), indent=1)
