"""Layer weights as one tensor per kind, each layer's parameter a slice of it: what the persistent decode stack
(engine/kernels/persistent/decode_stack.py) walks at a fixed offset a layer. Plain torch: no Triton here, so the
loader imports it wherever it runs."""
from __future__ import annotations

import torch


def stack_params(params: list[torch.Tensor], copy: bool = True) -> torch.Tensor:
    """[len(params), *shape]: the parameters as one tensor. Parameters that are already equal slices of one
    tensor are viewed as it; others are pointed at the slices of a new one (param.data), their values copied
    there unless `copy` is False (parameters not loaded yet)."""
    first = params[0]
    if any(p.shape != first.shape or p.dtype != first.dtype or p.device != first.device for p in params):
        raise ValueError("layer parameters of one kind must share shape, dtype and device")
    if _stacked(params):
        return first.as_strided((len(params), *first.shape), (first.numel(), *first.stride()), first.storage_offset())
    stacked = torch.empty((len(params), *first.shape), dtype=first.dtype, device=first.device)
    for i, p in enumerate(params):
        if copy:
            stacked[i].copy_(p.data)
        p.data = stacked[i]
    return stacked


def _stacked(params) -> bool:
    first = params[0]
    base, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    step = first.numel()
    return first.is_contiguous() and all(
        p.is_contiguous() and p.untyped_storage().data_ptr() == base and p.storage_offset() == offset + i * step
        for i, p in enumerate(params))
