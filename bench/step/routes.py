"""The kernel route table of each model shape: what the tuner measured and chose, and how long a start spends on it.

    python -m bench.step.routes --models dummy:smollm2-135m dummy:llama-1b dummy:llama-8b --out $OUT/routes.json

For each model: a cold start (an empty route cache: every cell measured, compiles included, as a first start on a new
machine) and a warm one (every cell read from the cache), each timed; then the table (op, N x K: kernel by rows) and
every cell's candidates in microseconds. No KV cache or graphs are built: only the weights and the tuner.
Triton keeps what it compiled in memory and under TRITON_CACHE_DIR: a first start on a new machine is one model a
process with an empty TRITON_CACHE_DIR; --compile-threads 1 compiles one kernel at a time, as before threads.

    python -m bench.step.routes --replay bench/results/kernel_routes/route_cache_h200_bf16.json

--replay (no GPU): each recorded tuner run (a route cache file, or records holding its "cells") goes through the
tuner again with its own recorded times in place of the GPU's: how many of the recorded timings the tuner takes
now (the candidates each op may take, less those dropped after losing at fewer rows), and the cells whose choice
alone would differ (the layer timings are not recorded, so the choice inside the layer is not replayed).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench.common import free_gpu_memory, markdown_table, note, record, write_results
from engine.kernels.tune import cell_name


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["dummy:smollm2-135m", "dummy:llama-1b", "dummy:llama-8b"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=64, help="the engine's rows: the decode batches it captures")
    p.add_argument("--speculative", default="none", help="none | eagle | ngram | draft_model (its matmuls too)")
    p.add_argument("--compile-threads", type=int, default=None,
                   help="threads compiling a row count's kernels at once (default: timer.COMPILE_THREADS)")
    p.add_argument("--replay", nargs="+", metavar="FILE", help="recorded tuner runs to replay instead (no GPU)")
    p.add_argument("--out", default="bench/results/routes.json")
    return p.parse_args(argv)


class Recorded:
    """A tuner's timer that reads a recorded run's times: (op, n, k, rows) -> {kernel: us}."""

    def __init__(self, cells: dict):
        self.cells, self.calls = cells, 0

    def candidates(self, site, rows):
        from engine.kernels.routes import kernels_for
        us = self.cells[cell_name(*site.key, rows)]["us"]
        return [kernel for kernel in kernels_for(site.op) if kernel in us] or ["cublas"]

    def agrees(self, site, rows, kernel, decode):
        return True

    def time_us(self, site, rows, kernel, decode):
        self.calls += 1
        return self.cells[cell_name(*site.key, rows)]["us"][kernel]


def replay(cells: dict) -> dict:
    """One recorded run through the tuner: timings recorded, timings taken now, cells whose choice differs."""
    import torch
    from engine.kernels import tune
    from engine.kernels.routes import Site, kernels_for
    timer, changed = Recorded(cells), []
    for (op, n, k), by_rows in sorted(tune.table_from_cells(cells).cells().items()):
        rows = sorted(by_rows)
        site = Site(op, [torch.empty(n, k, device="meta")])
        got, _ = tune.measure([site], rows, set(rows), timer, progress=False)
        for name, cell in got.items():
            allowed = {kernel: us for kernel, us in cells[name]["us"].items() if kernel in kernels_for(op)}
            if allowed and cell["kernel"] != tune.choose(allowed):
                changed.append(name)
    recorded = sum(sum(kernel in kernels_for(name.split()[0]) for kernel in cell["us"]) for name, cell in cells.items())
    return dict(cells=len(cells), recorded_timings=recorded, timings_now=timer.calls, changed=changed)


def start(model: str, args) -> tuple[float, object, list]:
    """(seconds the route table took, the table, the sites) for one start of `model`."""
    import torch
    from engine.backend import RoutedBackend
    from engine.config import EngineConfig
    from engine.models.loader import resolve_model
    from engine.models.weights import build_model
    from engine.runner.kernel_routes import route_table
    from engine.runner.model_runner import spec_rows_limit
    config = EngineConfig(model=model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                          speculative=args.speculative)
    source = resolve_model(model)
    weights = build_model(source, config.torch_dtype(), torch.device("cuda"), 4096)
    sites = weights.route_sites()
    backend = RoutedBackend(device=torch.device("cuda"))
    begin = time.perf_counter()
    table = route_table(config, sites, backend, spec_rows_limit(config))
    return time.perf_counter() - begin, table, sites


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.replay:
        rows = []
        for path in args.replay:
            data = json.loads(Path(path).read_text())
            runs = [data] if isinstance(data, dict) else [r for r in data if isinstance(r.get("cells"), dict)]
            rows += [dict(file=path, run=run.get("study", ""), **replay(run["cells"])) for run in runs]
        print(markdown_table(rows, ["file", "run", "cells", "recorded_timings", "timings_now", "changed"]))
        return
    from engine.kernels import timer
    if args.compile_threads:
        timer.COMPILE_THREADS = args.compile_threads
    records = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["SPECDEC_CACHE"] = cache
            cold, table, sites = start(model, args)
            free_gpu_memory()
            warm, _, _ = start(model, args)
            free_gpu_memory()
            measured = {}
            for path in Path(cache, "routes").glob("*.json"):
                measured.update(json.loads(path.read_text())["cells"])
        note(f"{model}: cold {cold:.1f} s, warm {warm:.2f} s\n{table.summary()}")
        records.append(record("routes", "start", model, args.dtype, args.max_num_seqs, 0, 0.0, 0.0,
                              cold_s=round(cold, 2), warm_s=round(warm, 3), compile_threads=timer.COMPILE_THREADS,
                              triton_cache=os.environ.get("TRITON_CACHE_DIR", "default"),
                              cells=sum(map(len, table.cells().values())),
                              table=table.summary().splitlines(), measured=measured))
        del sites
    write_results(records, args.out)
    print(markdown_table(records, ["model", "cold_s", "warm_s", "cells"]))


if __name__ == "__main__":
    main()
