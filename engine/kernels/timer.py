"""The GPU timer of the route tuner (engine/kernels/tune.py): a cell's candidates, each checked against cuBLAS and
timed as a CUDA graph of the op over CHAIN of the site's layers after a write that evicts the L2 cache."""
from __future__ import annotations

import os
import statistics
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from engine.kernels.routes import HEAD_KERNELS, MATMUL_KERNELS, Pin, RouteTable, Site, kernels_for

CHAIN = 8           # layers' weights one timing reads in a row
REPEATS = 9         # timed replays a candidate (the median counts)
COMPILE_THREADS = min(16, os.cpu_count() or 1)    # threads compiling a row count's kernels at once
AGREE_FP32, AGREE_HALF = 1e-3, 2 ** -5      # a candidate's largest error against cuBLAS, over cuBLAS's largest value


def _inputs(site: Site, rows: int):
    n, k = site.key[1:]
    w = site.weights[0]
    x = torch.randn(rows, k, device=w.device, dtype=w.dtype) * 0.5
    residual = torch.randn_like(x) * 0.5 if site.op in ("norm_linear", "norm_linear_silu") else None
    return x, residual


def call(backend, site: Site, weight, x, residual, decode: bool):
    """The backend's method for the site's op, as the model calls it."""
    meta = SimpleNamespace(max_query_len=1 if decode else 2)
    nw, eps = site.norm_weight, 1e-5
    if site.op == "linear":
        return backend.linear(x, weight, meta=meta)
    if site.op == "norm_linear":
        return backend.norm_linear(x, residual, nw, eps, weight, meta=meta)
    if site.op == "norm_linear_silu":
        return backend.norm_linear_silu(x, residual, nw, eps, weight, meta=meta)
    if site.op == "head":
        return backend.linear_argmax(x, weight)
    return backend.norm_linear_argmax(x, nw, eps, weight)


class Timer:
    """Times one cell's candidates on the GPU: CUDA graphs of the op over CHAIN layers, the L2 cache evicted
    before each replay."""

    def __init__(self, device: torch.device, backend_factory):
        props = torch.cuda.get_device_properties(device)
        self.device = device
        self.flush = torch.empty(2 * max(props.L2_cache_size, 1 << 20), dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device)
        self.backends = {kernel: backend_factory(RouteTable.pinned(Pin(kernel))) for kernel in
                         dict.fromkeys(MATMUL_KERNELS + HEAD_KERNELS)}

    def candidates(self, site: Site, rows: int) -> list[str]:
        x, residual = _inputs(site, rows)
        backend = self.backends["cublas"]
        return [kernel for kernel in kernels_for(site.op)
                if backend.can_run(kernel, site.op, x, site.weights[0], norm_weight=site.norm_weight,
                                   residual=residual)]

    def prepare(self, calls) -> None:
        """Each (site, rows, kernel, decode) call run once, on COMPILE_THREADS threads: Triton compiles a kernel
        at its first call and its compiler releases the GIL, so a first start's compiles run side by side instead
        of one by one inside the timings. A call that fails is left to the timing, which reports it."""
        def run(site, rows, kernel, decode):
            with torch.cuda.device(self.device), torch.inference_mode():
                x, residual = _inputs(site, rows)
                call(self.backends[kernel], site, site.weights[0], x, residual, decode)
        calls = [c for c in calls if c[2] != "cublas"]          # nothing to compile
        if not calls:
            return
        from triton.runtime import driver
        driver.active.get_current_device()      # Triton's driver built once, before the threads
        with ThreadPoolExecutor(max(1, min(COMPILE_THREADS, len(calls)))) as pool:
            for done in [pool.submit(run, *c) for c in calls]:
                done.exception()
        torch.cuda.synchronize(self.device)

    def agrees(self, site: Site, rows: int, kernel: str, decode: bool) -> bool:
        """Whether `kernel`'s output on the site's op agrees with cuBLAS's to its dtype's rounding (heads, whose
        argmax may break a near tie either way, are not compared): a kernel that computes wrong is no route."""
        if site.op in ("head", "norm_head"):
            return True
        x, residual = _inputs(site, rows)
        got = call(self.backends[kernel], site, site.weights[0], x, residual, decode)
        want = call(self.backends["cublas"], site, site.weights[0], x, residual, decode)
        got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
        scale = want.float().abs().max().clamp_min(1e-6)
        error = ((got.float() - want.float()).abs().max() / scale).item()
        return error <= (AGREE_FP32 if x.dtype == torch.float32 else AGREE_HALF)

    def time_us(self, site: Site, rows: int, kernel: str, decode: bool) -> float:
        """Median microseconds of one call of `kernel` on the site's op at `rows` rows."""
        backend, weights = self.backends[kernel], site.weights[:CHAIN]
        x, residual = _inputs(site, rows)

        def chain():
            for w in weights:
                call(backend, site, w, x, residual, decode)
        return self._replay_us(chain) / len(weights)

    def time_layer_us(self, group: list[Site], rows: int, choice: dict, decode: bool) -> float:
        """Median microseconds of one layer of `group`'s ops in call order, each op on its kernel in `choice`
        (site key -> kernel)."""
        inputs = [_inputs(site, rows) for site in group]
        depth = min(CHAIN, *(len(site.weights) for site in group))

        def chain():
            for layer in range(depth):
                for site, (x, residual) in zip(group, inputs):
                    call(self.backends[choice[site.key]], site, site.weights[layer], x, residual, decode)
        return self._replay_us(chain) / depth

    def _replay_us(self, chain) -> float:
        """Median microseconds of a CUDA graph of `chain`, the L2 cache evicted before each replay."""
        with torch.cuda.stream(self.stream):
            chain()                               # compiles, and warms the allocator's pool for the capture
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            chain()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        with torch.cuda.stream(self.stream):
            for _ in range(REPEATS + 1):
                self.flush.zero_()
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1000)
        del graph
        return statistics.median(times[1:])
