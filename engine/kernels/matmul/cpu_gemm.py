"""float32 matmuls of a few rows on the CPU: engine/kernels/matmul/csrc/cpu_gemm.cpp where it applies, F.linear
elsewhere.

A CPU decode step reads every weight once, so its matmuls are bound by memory bandwidth. torch's BLAS sgemm reaches
that bound for one row but not for 2-16 (speculative verification, small batches), where the native kernel reads
weights faster; for one row the two are even (docs/results.md, cpu_gemm). The native kernel also makes a row's
result independent of the rows beside it (batch-invariant), which BLAS does not promise.

The kernel has no backward: inputs that need gradients take F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16          # from 16 rows BLAS is as fast (two passes over the weights here against its one)

try:
    from engine.kernels.matmul import _cpu_gemm as _native
    NATIVE = _native.available()
except ImportError:    # not built (an editable checkout before `setup.py build_ext`): F.linear everywhere
    _native, NATIVE = None, False


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether linear() takes the native kernel for these operands."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return (NATIVE and x.device.type == "cpu" and 0 < rows <= MAX_ROWS and x.dtype == weight.dtype == torch.float32
            and weight.dim() == 2 and weight.is_contiguous() and x.shape[-1] == weight.shape[1]
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()
                                  and bias.shape == (weight.shape[0],)))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), by the native kernel where applies() says so."""
    if not applies(x, weight, bias):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=torch.float32)
    _native.linear(x2.data_ptr(), x2.stride(0), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                   out.data_ptr(), out.stride(0), x2.shape[0], weight.shape[0], weight.shape[1],
                   torch.get_num_threads())
    return out.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear whose forward is linear() above (same parameters and state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
