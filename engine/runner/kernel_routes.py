"""The route table a model runner starts with (engine/kernels/routes.py): measured on a GPU (engine/kernels/
tune.py), cuBLAS for everything under kernels="reference", pins from a route file over either.

Where nothing can be timed (the CPU, where the Triton kernels run in the interpreter) the table holds only the
pins: cuBLAS wherever none matches. The persistent decode stack is routed by pins only: it runs a step's layers
layer by layer unless a pin says "persistent".
"""
from __future__ import annotations

import sys
import warnings

import torch

from engine.kernels.routes import RouteTable, load_pins
from engine.models.loader import cache_dir
from engine.runner.graphs import graph_batch_sizes
from engine.speculative.budget import engine_levels


def captured_rows(config, spec_rows: int) -> tuple[list[int], list[int]]:
    """(decode batch sizes, verification widths in tokens) the engine captures graphs for."""
    decode = graph_batch_sizes(config.max_num_seqs)
    spec = sorted({bs * (k + 1) for k in engine_levels(config) for bs in graph_batch_sizes(spec_rows)}) if spec_rows \
        else []
    return decode, spec


def check_pins(pins, sites, rows, backend) -> None:
    """ValueError naming a pin whose kernel cannot run a matmul it matches; a warning for one matching none."""
    for pin in pins:
        if pin.op == "stack":           # checked where the stack is built (decode_stack)
            continue
        matched = False
        for site in sites:
            op, n, k = site.key
            for r in rows:
                if not pin.matches(op, n, k, r):
                    continue
                matched = True
                w = site.weights[0]
                x = torch.empty(r, k, dtype=w.dtype, device=w.device)
                residual = torch.empty_like(x) if op in ("norm_linear", "norm_linear_silu") else None
                if not backend.can_run(pin.kernel, op, x, w, norm_weight=site.norm_weight, residual=residual):
                    raise ValueError(f"route file: {pin} cannot run {op} {n}x{k} at {r} rows")
        if not matched:
            warnings.warn(f"route file: {pin} matches no matmul of this model", stacklevel=2)


def route_table(config, sites, backend, spec_rows: int = 0) -> RouteTable:
    """The table for `sites` (the model's and its drafter's matmuls) on the Triton `backend`."""
    from engine.kernels.tune import measured_table, tuning_rows, unique_sites
    if config.kernels == "reference":
        return RouteTable(reference=True)
    pins = load_pins(config.kernel_routes) if config.kernel_routes else ()
    decode, spec = captured_rows(config, spec_rows)
    rows = tuning_rows(decode, spec)
    sites = unique_sites(sites)
    check_pins(pins, sites, rows, backend)
    device = sites[0].weights[0].device if sites else torch.device("cpu")
    from engine.kernels.common import kernels_interpreted
    if device.type != "cuda" or kernels_interpreted():
        return RouteTable(pins=pins)
    from engine.backend import RoutedBackend
    table = measured_table(sites, rows, set(decode), device, sites[0].weights[0].dtype,
                           lambda routes: RoutedBackend(routes=routes, device=device), cache_dir(), pins,
                           log=lambda line: print(f"specdec: {line}", file=sys.stderr))
    return table


def decode_stack(model, kv_caches, routes, aux_layers=()):
    """The persistent decode stack (engine/kernels/persistent/stack.py) where the table routes a step of up to its
    rows (tokens) to it, else None; ValueError where it does and the model is one it cannot run. aux_layers: the
    layers whose outputs the drafter reads (EAGLE's)."""
    from engine.kernels.persistent import MAX_ROWS
    hidden, inter = model.cfg["hidden_size"], model.layers[0].mlp.inter
    if not any(routes.lookup("stack", hidden, inter, rows) == "persistent" for rows in range(1, MAX_ROWS + 1)):
        return None
    from engine.kernels.persistent.stack import DecodeStack, unsupported
    reason = unsupported(model)
    if reason:
        raise ValueError(f"route file: the persistent decode stack cannot run this model: {reason}")
    return DecodeStack(model, kv_caches, aux_layers=aux_layers)
