"""The EAGLE head's input in one kernel: each row's token embedding and feature, each RMS-normed on its own,
side by side (engine/speculative/eagle_paged.py), where torch launches an embedding, a stack and the norm.

    embed_pair_norm(ids [N] (any stride), emb [V, H], feature [N, H], weight [H], eps) -> [N, 2H]
        = fused_ops.rms_norm(stack([emb[ids], feature], 1).reshape(2N, H), weight, eps).view(N, 2H)

The norm is fused_ops.rms_norm's (rms_norm_row): the same bits. An id outside [0, V) reads
row 0 or V - 1 (a graph padding row's garbage id; torch's embedding would fault on it).
"""
from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, pdl, pdl_start
from engine.kernels.fused_ops import rms_norm_row


@triton.jit
def _embed_pair_norm_kernel(ids_ptr, emb_ptr, feat_ptr, w_ptr, out_ptr, stride_ids, stride_emb, stride_feat, stride_out,
                            n_cols, vocab, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)                    # 0: the embedding of ids[row], 1: feature[row]
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    if piece == 0:
        tok = tl.minimum(tl.maximum(tl.load(ids_ptr + row * stride_ids).to(tl.int64), 0), vocab - 1)
        h = tl.load(emb_ptr + tok * stride_emb + cols, mask=ok, other=0.0)
    else:
        h = tl.load(feat_ptr + row * stride_feat + cols, mask=ok, other=0.0)
    out = rms_norm_row(h, w_ptr, cols, ok, n_cols, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + piece * n_cols + cols, out, mask=ok)


def interpreted() -> bool:
    """True when the kernel was built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_embed_pair_norm_kernel)


def embed_pair_norm(ids: torch.Tensor, emb: torch.Tensor, feature: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """[rms_norm(emb[ids]), rms_norm(feature)] per row -> a new [N, 2H] tensor in emb's dtype (see the module)."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be a 1-D int32/int64 tensor, got {ids.dim()}-D {ids.dtype}")
    if emb.dim() != 2 or feature.dim() != 2 or weight.dim() != 1:
        raise ValueError("emb must be [V, H], feature [N, H] and weight [H]")
    n, h = feature.shape
    if emb.shape[1] != h or weight.shape[0] != h or ids.shape[0] != n:
        raise ValueError(f"shapes disagree: ids {tuple(ids.shape)}, emb {tuple(emb.shape)}, feature "
                         f"{tuple(feature.shape)}, weight {tuple(weight.shape)}")
    if not (emb.dtype == feature.dtype == weight.dtype):
        raise ValueError(f"emb, feature and weight must share a dtype, got {emb.dtype}, {feature.dtype}, "
                         f"{weight.dtype}")
    if len({t.device for t in (ids, emb, feature, weight)}) != 1:
        raise ValueError("ids, emb, feature and weight must be on one device")
    if emb.stride(1) != 1 or feature.stride(1) != 1 or weight.stride(0) != 1:
        raise ValueError("emb, feature and weight need unit stride along H")
    if isinstance(eps, torch.Tensor) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a host float, got {type(eps).__name__}")
    out = torch.empty((n, 2 * h), dtype=emb.dtype, device=emb.device)
    if n:
        block = triton.next_power_of_2(h)
        _embed_pair_norm_kernel[(n, 2)](
            ids, emb, feature, weight, out, ids.stride(0), emb.stride(0), feature.stride(0), out.stride(0), h,
            emb.shape[0], float(eps), BLOCK=block,
            num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16,  # as rms_norm's
            **pdl(_embed_pair_norm_kernel, emb.device, n))
    return out
