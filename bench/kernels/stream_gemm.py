"""stream_gemm against cuBLAS on a model's four layer matmuls, timed as the route table times them.

    python -m bench.kernels.stream_gemm                                    # Llama 1B and 8B shapes, 8 and 32 rows
    python -m bench.kernels.stream_gemm --shapes llama-1b --rows 8 --sweep # also each op over SWEEP's configs

Per (shape, rows), with engine/kernels/tune.py's Timer (a CUDA graph of the call over 8 layers' own weights, the L2
cache evicted before each replay, median of its replays):
- each op alone: qkv (residual add + RMSNorm folded in), o, gate_up (the norm and SiLU * up folded in) and down, on
  cuBLAS (the norm and SiLU as kernels of their own), on each of stream_gemm's launch shapes (the route table's
  stream, stream_wide and stream_narrow) and on stream with its L2 prefetch on (`_stream_l2_us`);
- a whole layer's four ops in call order (Timer.time_layer_us): all on cuBLAS, all on stream (its L2 prefetch off,
  then on), and each op on its fastest alone (`layer_fastest_us`, the choice in `layer_fastest`): under dependent
  launch a kernel's early reads overlap a different kernel before it, which one op alone does not show.
--sweep times stream_gemm's launch configs (BLOCK_N, BLOCK_K, NUM_STAGES, warps) on each op and reports the
fastest (every config's time in the JSON). Microseconds a call or a layer. Dummy weights; CUDA only. Writes JSON
(--out) and a markdown table beside it, printed last.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
from pathlib import Path

from bench.common import markdown_table, record, write_results
from engine.kernels.routes import STREAM_KERNELS

OPS = ("qkv", "o", "gate_up", "down")
SWEEP = [dict(BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=st, num_warps=w)
         for bn, bk, st, w in itertools.product((16, 32, 64, 128), (128, 256), (2, 4), (4, 8))]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-8b"], help="dummy shapes (engine/models)")
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    p.add_argument("--sweep", action="store_true", help="also time each op over SWEEP's launch configs")
    p.add_argument("--out", default="bench/results/stream_gemm.json")
    return p.parse_args(argv)


def layer_sites(shape: str, layers: int, device, dtype) -> dict:
    """The four matmul sites of a dummy shape's layer, `layers` random weights each (engine/kernels/routes.Site)."""
    import torch
    from engine.kernels.routes import Site
    from engine.models.loader import DUMMY_SHAPES
    cfg = DUMMY_SHAPES[shape]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    dims = {"qkv": ("norm_linear", q + 2 * kv, hidden), "o": ("linear", hidden, q),
            "gate_up": ("norm_linear_silu", 2 * inter, hidden), "down": ("linear", hidden, inter)}
    sites = {}
    for name, (op, n, k) in dims.items():
        weights = [torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5 for _ in range(layers)]
        norm = torch.ones(k, device=device, dtype=dtype) if op.startswith("norm") else None
        sites[name] = Site(op, weights, norm)
    return sites


@contextlib.contextmanager
def stream_launch(config: dict | None = None, l2_ahead: bool | None = None):
    """stream_gemm launched with `config` in place of its own (None: its own) and its L2 prefetch forced on or off
    (None: as it decides); both put back after."""
    from engine.kernels.common import l2_prefetch_runs
    from engine.kernels.matmul import stream_gemm
    saved = stream_gemm.config, stream_gemm.l2_ahead
    if config is not None:
        stream_gemm.config = lambda *shape, **fit: dict(saved[0](*shape, **fit), **config)
    if l2_ahead is not None:
        stream_gemm.l2_ahead = lambda fn, device: l2_ahead and l2_prefetch_runs(fn, device)
    try:
        yield
    finally:
        stream_gemm.config, stream_gemm.l2_ahead = saved


def bench_shape(shape: str, rows_list, sweep: bool) -> list[dict]:
    import torch
    from engine.backend import RoutedBackend
    from engine.kernels.timer import CHAIN, Timer
    from engine.kernels.tune import choose
    device = torch.device("cuda")
    sites = layer_sites(shape, CHAIN, device, torch.bfloat16)
    timer = Timer(device, lambda routes: RoutedBackend(routes=routes, device=device))
    group = [sites[name] for name in OPS]
    records = []
    for rows in rows_list:
        r, fastest = dict(shape=shape, rows=rows), {}
        for name, site in sites.items():
            alone = {kernel: round(timer.time_us(site, rows, kernel, decode=True), 2)
                     for kernel in ("cublas", *STREAM_KERNELS)}
            r.update({f"{name}_{kernel}_us": us for kernel, us in alone.items()})
            fastest[site.key] = choose(alone)
            with stream_launch(l2_ahead=True):
                r[f"{name}_stream_l2_us"] = round(timer.time_us(site, rows, "stream", decode=True), 2)
            if sweep:
                r[f"{name}_best_us"], r[f"{name}_best_config"], r[f"{name}_sweep"] = best_config(timer, site, rows)
        for kernel in ("cublas", "stream"):
            r[f"layer_{kernel}_us"] = round(timer.time_layer_us(group, rows, {s.key: kernel for s in group}, True), 2)
        with stream_launch(l2_ahead=True):
            r["layer_stream_l2_us"] = round(timer.time_layer_us(group, rows, {s.key: "stream" for s in group}, True), 2)
        r["layer_fastest_us"] = round(timer.time_layer_us(group, rows, fastest, True), 2)
        r["layer_fastest"] = {name: fastest[site.key] for name, site in sites.items()}
        r["layer_speedup"] = round(r["layer_cublas_us"] / r["layer_fastest_us"], 3)
        print(f"{shape} {rows} rows: a layer {r['layer_cublas_us']} us on cuBLAS, {r['layer_stream_us']} us on "
              f"stream_gemm, {r['layer_fastest_us']} us on each op's fastest alone", flush=True)
        records.append(record("stream_gemm", "layer", f"dummy:{shape}", "bfloat16", rows, 0, None, None, **r))
    return records


def best_config(timer, site, rows: int) -> tuple[float | None, dict | None, list]:
    """(us, config) of the fastest of SWEEP's configs for stream_gemm on the site's op, and every config's
    [BLOCK_N, BLOCK_K, NUM_STAGES, num_warps, us]; a config that fails to build or run (too much shared memory)
    is skipped."""
    best, timed = (None, None), []
    for cfg in SWEEP:
        try:
            with stream_launch(config=cfg):
                us = round(timer.time_us(site, rows, "stream", decode=True), 2)
        except Exception as e:     # noqa: BLE001 - reported, then the next config
            print(f"  {site.op} {cfg}: {type(e).__name__}", flush=True)
            continue
        timed.append([*cfg.values(), us])
        if best[0] is None or us < best[0]:
            best = (us, cfg)
    return (*best, timed)


def main(argv=None) -> None:
    args = parse_args(argv)
    records = [r for shape in args.shapes for r in bench_shape(shape, args.rows, args.sweep)]
    cols = ["shape", "rows", *(f"{n}_{k}_us" for n in OPS for k in ("cublas", *STREAM_KERNELS)),
            "layer_cublas_us", "layer_stream_us", "layer_stream_l2_us", "layer_fastest_us", "layer_speedup"]
    write_results(records, args.out)
    table = markdown_table(records, cols)
    Path(args.out).with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
