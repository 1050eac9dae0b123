# decode_attention per call, TILE_N 64 against 128, SmolLM2 shapes, by context and streams (run from the repository
# root on a GPU machine; writes $OUT/attn_ctx.json)
import sys, json, os
import torch
sys.path[:0] = ['tests', 'tests/kernels', '.']
from test_rope_attention import make_step
import engine.kernels.attention.decode_attention as da
from bench.gemv_kernels import time_graph
orig = da._tile_config
res = []
for streams, splits in [(32, 1), (1, 4), (8, 1)]:
    for ctx in [48, 170, 512, 1024]:
        s = make_step([1] * streams, [ctx] * streams, 9, 3, 64, 16, torch.bfloat16)
        for tile in [64, 128]:
            da._tile_config = lambda g, q, b, tile=tile: (*orig(g, q, b)[:2], tile, orig(g, q, b)[3])
            fn = lambda i: da.decode_attention(s["q"], s["k"], s["v"], s["positions"], s["cos"], s["sin"], s["k_cache"],
                                               s["v_cache"], s["cu"], s["seq_lens"], s["tables"], s["slots"], 0.125,
                                               num_splits=splits)
            us = time_graph(fn, 64, 30)
            res.append(dict(streams=streams, splits=splits, ctx=ctx, tile_n=tile, us=us))
            print(f"streams {streams} splits {splits} ctx {ctx} tile {tile}: {us:.2f} us", flush=True)
da._tile_config = orig
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "attn_ctx.json"), "w"), indent=1)
