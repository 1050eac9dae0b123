"""What a kernel boundary costs the GPU, against a grid-wide barrier inside one persistent kernel.

    python -m bench.kernels.boundary [--grids 1 72 132 192] [--phases 150] [--elems 64 4096] [--out $OUT/boundary.json]

A decode step at 32 streams is ~150 dependent kernels (five a layer), each waiting on the one before. A persistent
layer kernel would replace those boundaries with grid-wide barriers. This prices both with the same work: `phases`
dependent phases, each program reading `elems` bf16 values that another program wrote in the phase before (as a
matmul reads the activation row its neighbours produced), adding one and storing its own part.
- `plain`: one kernel a phase, plain launches, in one CUDA graph;
- `pdl`: one kernel a phase under programmatic dependent launch, as the engine chains its decode kernels;
- `barrier`: one kernel for every phase, its programs meeting at a grid-wide barrier (an atomic counter) between.
`us_per_phase` is the graph's time to done over its phases, median over --replays replays timed by CUDA events
(bench/kernels/gemv_kernels.time_graph). Every mode's last buffer is checked against the phase count.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import triton
import triton.language as tl

from bench.common import markdown_table, note, plot, record, write_results

from bench.kernels.gemv_kernels import time_graph
from engine.kernels.common import pdl_start

MODES = ("plain", "pdl", "barrier")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grids", type=int, nargs="+", default=[1, 72, 132, 192])
    p.add_argument("--phases", type=int, default=150, help="dependent phases a graph (even)")
    p.add_argument("--elems", type=int, nargs="+", default=[64, 4096],
                   help="bf16 values each program reads a phase, a power of two (4096: ~8 tokens of a 576-wide row)")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--out", default="bench/results/boundary.json")
    return p.parse_args(argv)


@triton.jit
def _step(src, dst, pid, grid, ELEMS: tl.constexpr):
    """One phase of one program: its neighbour's part of `src` plus one into its own part of `dst`. The load skips
    L1 (.cg): a persistent program reads addresses again that other SMs rewrote since."""
    offs = tl.arange(0, ELEMS)
    x = tl.load(src + ((pid + 1) % grid) * ELEMS + offs, cache_modifier=".cg")
    tl.store(dst + pid * ELEMS + offs, x + 1.0)


@triton.jit
def _phase_kernel(src, dst, ELEMS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    _step(src, dst, tl.program_id(0), tl.num_programs(0), ELEMS)


@triton.jit
def grid_barrier(counter, target):
    """Every program of the grid waits here until `counter` reaches `target` (each arrival adds one). The CTA
    barrier before orders this program's stores before its release; the one after holds its threads until the
    acquire has seen every program's arrival. All programs must be resident at once, or this never returns."""
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(a, b, counter, PHASES: tl.constexpr, ELEMS: tl.constexpr):
    pid, grid = tl.program_id(0), tl.num_programs(0)
    for p in range(0, PHASES, 2):
        _step(a, b, pid, grid, ELEMS)
        grid_barrier(counter, (p + 1) * grid)
        _step(b, a, pid, grid, ELEMS)
        grid_barrier(counter, (p + 2) * grid)


def phases(mode: str, grid: int, count: int, elems: int):
    """(run, a): run(_) zeroes two bf16 buffers (and the counter) and runs `count` dependent phases on them, the
    last into `a`."""
    import torch
    a, b = (torch.zeros(grid * elems, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    launch = {"USE_PDL": True, "launch_pdl": True} if mode == "pdl" else {"USE_PDL": False}

    def run(_):
        a.zero_()
        counter.zero_()
        if mode == "barrier":
            _persistent_kernel[(grid,)](a, b, counter, PHASES=count, ELEMS=elems, num_warps=4)
            return
        for p in range(count):
            src, dst = (a, b) if p % 2 == 0 else (b, a)
            _phase_kernel[(grid,)](src, dst, ELEMS=elems, num_warps=4, **launch)
    return run, a


def check_args(args) -> None:
    if args.phases < 2 or args.phases % 2:
        raise ValueError(f"--phases must be even and at least 2, got {args.phases}")
    if min(args.grids) < 1 or args.replays < 1:
        raise ValueError(f"--grids and --replays must be positive, got {args.grids} and {args.replays}")
    if any(e < 16 or e & (e - 1) for e in args.elems):
        raise ValueError(f"--elems must be powers of two of at least 16, got {args.elems}")


def measure(args, torch) -> list[dict]:
    records = []
    hopper = torch.cuda.get_device_capability()[0] >= 9
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for elems in args.elems:
        for grid in args.grids:
            for mode in MODES:
                if mode == "pdl" and not hopper:
                    continue
                run, a = phases(mode, grid, args.phases, elems)
                us = time_graph(run, 1, args.replays)       # one graph of all the phases, us a replay
                if not bool((a.float() == args.phases).all()):
                    raise RuntimeError(f"{mode} at grid {grid}: the last buffer is not {args.phases} everywhere")
                records.append(record("boundary", mode, None, "bfloat16", None, None, None, us / 1e3, grid=grid,
                                      elems=elems, phases=args.phases, sms=sms, us_per_phase=us / args.phases))
                note(f"elems {elems}, grid {grid}, {mode}: {us / args.phases:.3f} us a phase")
    return records


def main(argv=None) -> list[dict]:
    import torch
    args = parse_args(argv)
    check_args(args)
    if not torch.cuda.is_available():
        raise RuntimeError("bench/kernels/boundary.py times CUDA kernels and a grid barrier: it needs a CUDA device")
    records = measure(args, torch)
    write_results(records, args.out)
    stem = str(args.out).rsplit(".", 1)[0]
    text = (f"Command: `{records[0]['command']}` on {records[0]['device']}, commit {records[0]['git_commit']}.\n\n"
            + markdown_table(records, ["elems", "grid", "mode", "us_per_phase", "ms_per_step"]))
    Path(stem + ".md").write_text(text + "\n")
    for elems in args.elems:
        plot([r for r in records if r["elems"] == elems], "grid", "us_per_phase", "mode", f"{stem}_{elems}.png",
             f"GPU time a dependent phase ({elems} bf16 read a program)")
    print(text)
    return records


if __name__ == "__main__":
    main()
