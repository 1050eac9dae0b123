"""The route table's cache on disk (engine/kernels/tune.py measures what it lacks): one JSON file per fingerprint
(GPU, driver, torch, Triton, dtype and the kernels' source), cells keyed by "op N K rows". A damaged or stale file is
not trusted: load_cache warns and returns nothing, so its cells are measured again.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import torch

from engine.kernels.routes import kernels_for

FORMAT = 1          # the cache file's layout
_KERNEL_SOURCES = ("matmul/decode_gemv.py", "matmul/decode_gemm.py", "matmul/draft_gemv.py", "matmul/head_mma.py",
                   "matmul/gemv_checks.py", "matmul/stream_gemm.py", "matmul/silu_pairs.py", "matmul/split_k.py",
                   "sampling/argmax.py", "common.py", "fused_ops.py", "routes.py", "tune.py",
                   "timer.py")


def fingerprint(device: torch.device, dtype: torch.dtype) -> dict:
    import triton
    props = torch.cuda.get_device_properties(device)
    driver = driver_version()
    here = Path(__file__).parent
    digest = hashlib.sha256(b"".join((here / f).read_bytes() for f in _KERNEL_SOURCES)).hexdigest()[:16]
    return dict(format=FORMAT, gpu=props.name, capability=f"{props.major}.{props.minor}", driver=driver,
                torch=torch.__version__, triton=triton.__version__, dtype=str(dtype).removeprefix("torch."),
                kernels=digest)


def driver_version() -> int:
    """The CUDA driver's API version (13000 for 13.0) from libcuda, 0 where it cannot be read."""
    import ctypes
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    version = ctypes.c_int(0)
    return version.value if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 else 0


def cache_path(directory: Path, fp: dict) -> Path:
    """Where the measurements of `fp` are kept under `directory`, the engine's cache (the caller's to name)."""
    name = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return directory / "routes" / f"{name}.json"


def load_cache(path: Path, fp: dict) -> dict:
    """{cell name: {"kernel": ..., "us": {...}}}; {} with a warning for a damaged or stale file."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("fingerprint") != fp:
            raise ValueError("it was measured on another GPU, driver, torch, Triton or kernel version")
        cells = data["cells"]
        for name, cell in cells.items():
            op, *dims = name.split()
            if len(dims) != 3 or cell["kernel"] not in kernels_for(op) or not all(d.isdigit() for d in dims):
                raise ValueError(f"cell {name!r} is not a route")
        return cells
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"kernel route cache {path} is not usable ({e}); measuring again", stacklevel=2)
        return {}


def save_cache(path: Path, fp: dict, cells: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"fingerprint": fp, "cells": cells}, indent=1, sort_keys=True))
    os.replace(tmp, path)
