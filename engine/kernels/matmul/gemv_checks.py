"""Which calls the decode GEMV and decode_gemm take, and the errors for the others
(engine/kernels/matmul/decode_gemv.py, decode_gemm.py, draft_gemv.py)."""
from __future__ import annotations

from engine.kernels.common import kernels_interpreted, unit_stride
from engine.kernels.fused_ops import _FLOAT_DTYPES, _check_same, _check_tensor

MAX_ROWS = 8            # more rows: decode_gemm.py or cuBLAS (past AT_ONCE_ROWS a row is a pass over the registers);
                        # the engine hands it the steps its route table gives it (engine/kernels/routes.py)
MAX_K = 8192            # a whole weight row sits in registers
MAX_K_PLAIN = 16384     # the same with no prologue (decode_linear), 8 warps a row: Llama 8B's down projection


def problem(x, weight, k, norm_weight=None, residual=None, add=None, rows=(1, MAX_ROWS), max_k=MAX_K) -> str | None:
    """Why these kernels cannot take a call, or None: one list of conditions for supports() and the checks
    (rows, max_k: the limits of the kernel asking, decode_gemm.py's too)."""
    if x.dim() != 2 or weight.dim() != 2:
        return f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}"
    if not rows[0] <= x.shape[0] <= rows[1]:
        return f"x has {x.shape[0]} rows; these kernels take {rows[0]} to {rows[1]}"
    if weight.shape[1] != k or not 0 < k <= max_k or weight.shape[0] == 0:
        return f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)} (K at most {max_k})"
    if not weight.is_contiguous() or x.stride(1) != 1:
        return "weight must be contiguous and x must have unit stride in K"
    if x.dtype != weight.dtype:
        return f"weight dtype {weight.dtype} != x dtype {x.dtype}"
    if x.device.type != "cuda" and not kernels_interpreted():
        return f"x on {x.device} needs a CUDA device or the Triton interpreter (TRITON_INTERPRET=1)"
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.dtype != x.dtype
                                    or norm_weight.device != x.device or not unit_stride(norm_weight)):
        return f"norm_weight must be [{k}] of x's dtype and device, with unit stride"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        return "residual must match x's shape and dtype, with unit stride in K"
    if add is not None and (add.shape != (x.shape[0], weight.shape[0]) or add.dtype != x.dtype
                            or add.device != x.device or add.stride(1) != 1):
        return f"the added residual must be [{x.shape[0]}, {weight.shape[0]}] of x's dtype and device, unit stride in N"
    return None


def check(x, weight, k=None, norm_weight=None, residual=None, add=None, **limits):
    """Raises TypeError / ValueError naming what keeps these kernels from a call (problem's conditions)."""
    _check_tensor("x", x, 2, _FLOAT_DTYPES)
    _check_tensor("weight", weight, 2, _FLOAT_DTYPES, x.device)
    _check_same("weight", weight, "x", x, shape=False)
    if add is not None:
        _check_tensor("residual", add, 2, _FLOAT_DTYPES, x.device)
    why = problem(x, weight, x.shape[1] if k is None else k, norm_weight, residual, add, **limits)
    if why:
        raise ValueError(why)
