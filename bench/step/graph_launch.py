"""Host time of one CUDA graph replay by the graph's kernel count, with and without dependent-launch edges.

    python -m bench.step.graph_launch [--nodes 16 64 128 192 256 512] [--replays 200] [--out $OUT/graph_launch.json]

A step of the default model at one stream is one graph of ~190 kernels, and its host launch (profile_step's
replay_ms) is of the order of the GPU's step. This measures what a graph's replay costs the host as its kernels
grow, so "fewer kernels" can be priced on the host side as well as on the GPU. Each graph chains `nodes`
launches of one tiny Triton kernel (a program that adds one to a scalar), plain or under programmatic dependent
launch (the engine's launch keywords, engine.kernels.common.pdl). Each replay is timed alone on the host, the
stream drained before it, so the GPU never pushes back: `host_us` is the median over --replays of the
cudaGraphLaunch call's time, `gpu_us` the replay's wall time to the drained stream.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import triton
import triton.language as tl

from bench.common import markdown_table, note, plot, record, write_results

from engine.kernels.common import pdl_start


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 128, 192, 256, 512])
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out", default="bench/results/graph_launch.json")
    return p.parse_args(argv)


@triton.jit
def _add_one(x_ptr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


def capture(kernel, nodes: int, use_pdl: bool, stream):
    """A graph of `nodes` launches of the tiny kernel on one scalar (checked after the replays)."""
    import torch
    x = torch.zeros(1, device="cuda")
    launch = {"USE_PDL": True, "launch_pdl": True} if use_pdl else {"USE_PDL": False}
    with torch.cuda.stream(stream):
        kernel[(1,)](x, **launch)           # compile outside the capture
        stream.synchronize()
        x.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(nodes):
                kernel[(1,)](x, **launch)
    stream.synchronize()
    return graph, x


def time_replays(graph, stream, replays: int, warmup: int) -> tuple[float, float]:
    """(median host us of replay(), median us to the drained stream), each replay on an idle stream."""
    host, wall = [], []
    for i in range(warmup + replays):
        stream.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        stream.synchronize()
        if i >= warmup:
            host.append(t1 - t0)
            wall.append(time.perf_counter() - t0)
    return statistics.median(host) * 1e6, statistics.median(wall) * 1e6


def main(argv=None) -> list[dict]:
    import torch
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise RuntimeError("bench/step/graph_launch.py times CUDA graph replays: it needs a CUDA device")
    if min(args.nodes) < 1 or args.replays < 1:
        raise ValueError(f"--nodes and --replays must be positive, got {args.nodes} and {args.replays}")
    kernel, stream = _add_one, torch.cuda.Stream()
    hopper = torch.cuda.get_device_capability()[0] >= 9
    records = []
    for nodes in args.nodes:
        for use_pdl in ([False, True] if hopper else [False]):
            graph, x = capture(kernel, nodes, use_pdl, stream)
            with torch.cuda.stream(stream):
                host_us, wall_us = time_replays(graph, stream, args.replays, args.warmup)
            if x.item() != nodes * (args.replays + args.warmup):
                raise RuntimeError(f"the graph of {nodes} kernels did not run every kernel: x = {x.item()}")
            launch = "pdl" if use_pdl else "plain"
            records.append(record("graph_launch", launch, None, "float32", 1, None, None, None, nodes=nodes,
                                  host_us=host_us, gpu_us=wall_us, host_us_per_node=host_us / nodes))
            note(f"{nodes} kernels, {launch}: replay {host_us:.1f} us on the host, {wall_us:.1f} us to done")
    write_results(records, args.out)
    stem = str(args.out).rsplit(".", 1)[0]
    text = (f"Command: `{records[0]['command']}` on {records[0]['device']}, commit {records[0]['git_commit']}.\n\n"
            + markdown_table(records, ["nodes", "mode", "host_us", "gpu_us", "host_us_per_node"]))
    Path(stem + ".md").write_text(text + "\n")
    plot(records, "nodes", "host_us", "mode", stem + ".png", "Host time of one graph replay")
    print(text)
    return records


if __name__ == "__main__":
    main()
