"""What every Triton kernel module shares: the interpreter check, the reductions, rounding, pool-row indexing and
dependent launch.

tl.max and tl.sum are @jit functions of triton.language, compiled or interpreted as TRITON_INTERPRET was
when triton was first imported; ours follow it as it is when this module is (re)loaded. If the two disagree
(interpreter enabled after triton's import), the interpreter cannot call the compiled stdlib reductions:
reduce with local combiners instead (correct, but slow to interpret). A kernel module reloaded for the
interpreter must reload this one first (tests/conftest.py's triton_module does). Apart from these
reductions, the kernels use only builtins.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Programmatic dependent launch, on unless SPECDEC_PDL=0 (read once, at import), for launches of at most
# PDL_MAX_ROWS rows: steps whose matmuls are ours (engine/kernels/matmul/decode_gemv.py or decode_gemm.py, up to
# its 32 rows, where the route table gives them the step), so that a decode layer is all our kernels, each loading
# what does not depend on the one before while that one finishes (decode_gemm gains only under it). Next to cuBLAS
# matmuls, which never signal early, it gains nothing and costs a little (docs/decode_step.md), so larger launches
# are plain. SPECDEC_PDL_MAX_ROWS (read once, at
# import; default 32, decode_gemm's MAX_ROWS) moves the limit, e.g. down where the route table gives the larger
# steps to cuBLAS.
PDL_MAX_ROWS = int(os.environ.get("SPECDEC_PDL_MAX_ROWS", "32"))
_PDL_ON = os.environ.get("SPECDEC_PDL", "1") != "0"


@triton.jit
def _max_op(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_op(a, b):
    return tl.minimum(a, b)


@triton.jit
def _add_op(a, b):
    return a + b


def is_interpreted(fn) -> bool:
    """True when the @triton.jit function `fn` was built for the CPU interpreter."""
    return type(fn).__name__ == "InterpretedFunction"


def kernels_interpreted() -> bool:
    """True when this process's kernels run in the CPU interpreter (TRITON_INTERPRET=1 when Triton loaded)."""
    return is_interpreted(_max_op)


_LOCAL_REDUCE = tl.constexpr(is_interpreted(_max_op) and not is_interpreted(tl.max))


@triton.jit
def reduce_max(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, _max_op) if _LOCAL_REDUCE else tl.max(x, AXIS)


@triton.jit
def reduce_min(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, _min_op) if _LOCAL_REDUCE else tl.min(x, AXIS)


@triton.jit
def reduce_sum(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, _add_op) if _LOCAL_REDUCE else tl.sum(x, AXIS)


@triton.jit
def wrap_row(row, n_rows):
    """A row index as torch indexing reads it: -1 (a graph padding row's pool row) is the last, dummy row."""
    return tl.where(row < 0, row + n_rows, row)


# The interpreter casts fp32 -> bf16 by truncation (triton/runtime/interpreter.py cast_impl); compiled kernels
# and torch round to nearest even
_CAST_TRUNCATES = tl.constexpr(is_interpreted(_max_op))


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE to nearest even, as torch rounds an op's fp32 result (the interpreter too: there
    the bf16 rounding is done on the bits, then the truncating cast is exact)."""
    if _CAST_TRUNCATES and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(DTYPE)


def unit_stride(x: torch.Tensor) -> bool:
    """Whether a 1-D tensor holds entry i at offset i, as kernels that take no stride for it read it (a column view
    x[:, j] of a wider tensor does not)."""
    return x.shape[0] <= 1 or x.stride(0) == 1


@functools.lru_cache(maxsize=None)
def device_index(device: torch.device) -> int:
    """A CUDA device's index: its own, or the current device's where it names none ("cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of CUDA device `device`."""
    return torch.cuda.get_device_properties(device_index(device)).multi_processor_count


@functools.lru_cache(maxsize=None)
def shared_memory_bytes(device: torch.device) -> int:
    """The shared memory one program may take on `device` (the Triton driver's figure); 99 KiB, a floor every
    tensor-core GPU has, where it cannot be read (the CPU interpreter)."""
    try:
        from triton.runtime import driver
        return int(driver.active.utils.get_device_properties(device_index(device))["max_shared_mem"])
    except Exception:       # noqa: BLE001 - no CUDA driver: a conservative figure
        return 99 * 1024


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(fn, device: torch.device, rows: int) -> dict:
    """Launch keywords for a kernel with a USE_PDL constexpr. Unless SPECDEC_PDL=0, for `rows` <= PDL_MAX_ROWS
    on Hopper and newer (compiled, CUDA), the kernel is launched with programmatic dependent launch: it may start
    while the kernel before it on the stream finishes, and its first act is gdc_wait (all of that kernel's writes
    visible), so it reads nothing early. CUDA graphs capture the dependency as a programmatic edge. Elsewhere
    USE_PDL is False: a plain launch."""
    on = (_PDL_ON and rows <= PDL_MAX_ROWS and device.type == "cuda" and not is_interpreted(fn)
          and _hopper_or_newer(device_index(device)))
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """A dependent-launched kernel's first call: wait for the kernel before it, then let the next one launch
    (it too waits before reading, so starting it early only hides its launch)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def l2_prefetch(ptr, nbytes):
    """Start bringing `nbytes` at `ptr` (both multiples of 16) into L2 and go on (Hopper's bulk prefetch, issued
    by the program's first thread). A hint: nothing waits for it and it changes no value. Compiled kernels on
    Hopper or newer only (inline assembly): call it under a constexpr that is off elsewhere."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch_runs(fn, device: torch.device) -> bool:
    """Whether l2_prefetch runs in kernel `fn` on `device`: compiled, CUDA, Hopper or newer."""
    return device.type == "cuda" and not is_interpreted(fn) and _hopper_or_newer(device_index(device))


def l2_ahead(fn, device: torch.device) -> bool:
    """Whether kernel `fn` uses l2_prefetch on `device`: where it runs and is turned on (SPECDEC_L2_AHEAD=1, read
    at import; off by default: alone, each matmul measured slower with it)."""
    return _L2_AHEAD_ON and l2_prefetch_runs(fn, device)


_L2_AHEAD_ON = os.environ.get("SPECDEC_L2_AHEAD", "0") == "1"
