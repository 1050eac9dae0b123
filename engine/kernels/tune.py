"""The route table of a loaded model, measured on its GPU once and cached on disk (engine/kernels/routes.py).

For each site (a matmul or LM head of the model: op, N x K, one weight per layer) and each row count the engine
captures, every kernel that can run the call is timed and the fastest is routed to. A timing replays a CUDA graph
of the op over up to CHAIN of the site's layers (their own weights, as a step reads them) after a write that
evicts the L2 cache, so a kernel that hides its weight read behind the kernel before it (dependent launch) shows
it, and no weight is read warm. cuBLAS is always a candidate; a kernel that lost by over DROP at a site's fewer
rows is not timed at its larger rows.

Alone, one op over layers does not see what the step sees between different ops under dependent launch, so
where kernels are near a tie alone they are timed again inside their layer: the layer's ops in call order over
CHAIN layers, one op's kernel changed at a time (coordinate descent from the choices made alone), then the whole
layer on each kernel near the fastest alone on every op.

The measurements are cached on disk (engine/kernels/route_cache.py): a model whose shapes were measured before on
the same GPU, driver, torch, Triton and kernel sources starts without timing.
"""
from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch

from engine.kernels.route_cache import cache_path, fingerprint, load_cache, save_cache
from engine.kernels.routes import RouteTable, Site
from engine.kernels.timer import Timer

MAX_ROWS = 64       # no kernel but cuBLAS takes more rows (head_mma's limit)
NEAR = 1.3          # kernels within this factor of a cell's fastest alone are timed again inside the layer
DROP = 2.0          # a kernel over this factor of a site's fastest at some rows is not timed at its larger rows


def unique_sites(sites) -> list[Site]:
    """One site a key (the EAGLE head's down projection may share the target's shape)."""
    seen = {}
    for site in sites:
        seen.setdefault(site.key, site)
    return list(seen.values())


def layer_groups(sites) -> list[list[Site]]:
    """The ops of each layer stack in call order (sites sharing a layer count above one), where there are two or
    more to interleave."""
    groups: dict[int, list[Site]] = {}
    for site in sites:
        if len(site.weights) > 1:
            groups.setdefault(len(site.weights), []).append(site)
    return [group for group in groups.values() if len(group) > 1]


def tuning_rows(decode_rows, spec_tokens=()) -> list[int]:
    """The row counts to measure: the captured decode batches and verification widths, up to MAX_ROWS."""
    return sorted({r for r in (*decode_rows, *spec_tokens) if 0 < r <= MAX_ROWS})


def cell_name(op: str, n: int, k: int, rows: int) -> str:
    return f"{op} {n} {k} {rows}"


# ---- timing -------------------------------------------------------------------------------------------------------
def choose(times_us: dict[str, float]) -> str:
    """The fastest kernel; cuBLAS on a tie (it is the reference)."""
    return min(times_us, key=lambda kernel: (times_us[kernel], kernel != "cublas"))


def refine_in_layer(group: list[Site], rows: int, cells: dict, timer, decode: bool) -> None:
    """Each op of the layer whose kernels are near a tie alone (within NEAR) is routed to the one fastest inside
    the layer, the other ops on their current choice; the timings go to the cell as "layer_us". Then each kernel
    near the fastest alone on every op runs the whole layer, and takes it where that is faster: a kernel overlaps
    the one before it under dependent launch only where both launch so, which one op changed at a time misses."""
    names = {site.key: cell_name(*site.key, rows) for site in group}
    choice = {key: cells[name]["kernel"] for key, name in names.items()}
    near = {key: _near(cells[name]["us"]) for key, name in names.items()}
    timed: dict = {}

    def layer_us(kernels: dict) -> float:
        key = tuple(sorted(kernels.items()))
        if key not in timed:
            timed[key] = round(timer.time_layer_us(group, rows, kernels, decode), 2)
        return timed[key]

    for key, name in names.items():
        if len(near[key]) < 2:
            continue
        in_layer = {kernel: layer_us({**choice, key: kernel}) for kernel in near[key]}
        choice[key] = choose(in_layer)
        cells[name] = {**cells[name], "kernel": choice[key], "layer_us": in_layer}
    for kernel in sorted(set.intersection(*(set(kernels) for kernels in near.values()))):
        whole = dict.fromkeys(choice, kernel)
        if whole != choice and layer_us(whole) < layer_us(choice):
            for key, name in names.items():
                cells[name] = {**cells[name], "kernel": kernel,
                               "whole_layer_us": {kernel: layer_us(whole), "mixed": layer_us(choice)}}
            choice = whole


def _far(alone: dict) -> list[str]:
    """The kernels but cuBLAS over DROP times the fastest alone: a kernel made for fewer rows only loses more
    ground to cuBLAS as rows grow, so it is not timed at the site's larger rows (a first start compiles less)."""
    return [kernel for kernel, us in alone.items() if kernel != "cublas" and us > DROP * min(alone.values())]


def _near(alone: dict) -> list[str]:
    """The kernels within NEAR of the fastest alone."""
    return [kernel for kernel, us in alone.items() if us <= NEAR * min(alone.values())] if alone else []


def measure(sites, rows, decode_rows, timer, cached: dict | None = None, progress: bool = True,
            pinned=lambda op, n, k, rows: False) -> tuple[dict, int]:
    """Every (site, rows) cell not in `cached` and not `pinned` timed by `timer` (a Timer's candidates and
    time_us) -> (cells, how many were timed); cells as the cache's. Row counts go in ascending order, every site
    at one count before the next: a timer with `prepare` first runs that count's candidates once all at once."""
    cells, todo = dict(cached or {}), {}
    for site in unique_sites(sites):
        for r in rows:
            if cell_name(*site.key, r) not in cells and not pinned(*site.key, r):
                todo.setdefault(r, []).append(site)
    if not todo:
        return cells, 0
    from tqdm import tqdm
    timer = timer() if callable(timer) else timer         # built only where there is something to time
    bar = tqdm(total=sum(map(len, todo.values())), desc="measuring kernel routes", unit="cell", file=sys.stderr,
               disable=not progress)
    dropped: dict = {}          # site key -> kernels that lost by over DROP at fewer rows
    for r in sorted(todo):
        decode = r in decode_rows
        candidates = {site.key: [kernel for kernel in timer.candidates(site, r)
                                 if kernel not in dropped.get(site.key, ())] for site in todo[r]}
        if hasattr(timer, "prepare"):
            timer.prepare([(site, r, kernel, decode) for site in todo[r] for kernel in candidates[site.key]
                           if len(candidates[site.key]) > 1])
        for site in todo[r]:
            times = _time_cell(site, r, candidates[site.key], timer, decode)
            cells[cell_name(*site.key, r)] = {"kernel": choose(times) if times else "cublas", "us": times}
            dropped.setdefault(site.key, set()).update(_far(times))
            bar.update()
    bar.close()
    timed = {(site.key, r) for r, at_rows in todo.items() for site in at_rows}   # keys: a Site's == compares weights
    for group in layer_groups(sites):
        for r in rows:
            if any((site.key, r) in timed for site in group) and all(
                    cell_name(*site.key, r) in cells for site in group):
                refine_in_layer(group, r, cells, timer, decode=r in decode_rows)
    return cells, len(timed)


def _time_cell(site: Site, rows: int, candidates: list[str], timer, decode: bool) -> dict:
    """{kernel: us} of the candidates that agree with cuBLAS and run; {} where cuBLAS alone runs the cell."""
    if len(candidates) == 1:                # nothing to choose: cuBLAS alone runs it
        return {}
    times = {}
    for kernel in candidates:
        try:
            if kernel != "cublas" and not timer.agrees(site, rows, kernel, decode):
                warnings.warn(f"kernel {kernel} disagrees with cuBLAS on {site.op} {site.key[1:]} at {rows} rows: "
                              "not a route there", stacklevel=3)
                continue
            times[kernel] = round(timer.time_us(site, rows, kernel, decode), 2)
        except Exception as e:      # a kernel that fails to build or run here is no route
            if kernel == "cublas":
                raise
            warnings.warn(f"kernel {kernel} failed on {site.op} {site.key[1:]} at {rows} rows: {e}", stacklevel=3)
    return times


def table_from_cells(cells: dict, pins=()) -> RouteTable:
    by_site: dict = {}
    for name, cell in cells.items():
        op, n, k, rows = name.split()
        by_site.setdefault((op, int(n), int(k)), {})[int(rows)] = cell["kernel"]
    return RouteTable(by_site, pins)


def measured_table(sites, rows, decode_rows, device, dtype, backend_factory, directory: Path, pins=(),
                   progress: bool = True, log=print) -> RouteTable:
    """The model's route table from the cache under `directory`, measuring the cells it lacks (and saving them)."""
    fp = fingerprint(device, dtype)
    path = cache_path(directory, fp)
    pinned = lambda *cell: any(pin.matches(*cell) for pin in pins)     # a pinned cell is never looked up
    wanted = {cell_name(*s.key, r) for s in sites for r in rows if not pinned(*s.key, r)}
    begin = time.perf_counter()
    cached = load_cache(path, fp)
    with torch.inference_mode():
        cells, timed = measure(sites, rows, decode_rows, lambda: Timer(device, backend_factory), cached, progress,
                               pinned)
    if timed:
        save_cache(path, fp, cells)
    log(f"kernel routes: {len(wanted) - timed} cells from {path}, {timed} measured in "
        f"{time.perf_counter() - begin:.1f} s" + (" (pins route the rest)" if pins else ""))
    return table_from_cells({name: cells[name] for name in wanted}, pins)
