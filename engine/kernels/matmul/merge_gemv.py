"""The o projection's decode GEMV with the merge of the attention's KV splits as its prologue, so a split decode
step needs no combine kernel between attention and o_proj (EngineConfig.merge_in_o):

    merge_linear(partials, weight, head_dim) -> [M, N]
        (= F.linear(out.view(M, -1), weight) for out the combine kernel's merge of partials)

partials: split_merge.SplitPartials (acc [M, heads, splits, HEAD_PAD], max and sum [M, heads, splits], fp32) of
decode_attention(defer_merge=True). As decode_gemv.py: each program owns BLOCK_N whole weight rows and loads them
before the dependent-launch wait; after it, each row's attention output is merged from the partials (heads side by
side along K, split_merge.merged_row, the combine kernel's math) and rounded to the weight's dtype as the combine
kernel stores it, then multiplied as decode_linear multiplies. Results agree with combine + decode_linear to the
order of the merge's sum over splits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention.split_merge import SplitPartials, merged_row
from engine.kernels.common import is_interpreted, pdl, pdl_start, reduce_sum, round_to
from engine.kernels.matmul import decode_gemv


@triton.jit
def _merge_gemv_kernel(acc_ptr, m_ptr, l_ptr, w_ptr, out_ptr, stride_out, M, N, K, SPLITS: tl.constexpr,
                       HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_PDL: tl.constexpr):
    dtype = w_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    # the weights do not depend on the kernel before: read them before waiting for it
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    pdl_start(USE_PDL)
    for m in range(M):
        a = merged_row(acc_ptr, m_ptr, l_ptr, m, K, offs_k, k_ok, SPLITS, HEAD_DIM, HEAD_PAD)
        a = a.to(dtype).to(tl.float32)
        tl.store(out_ptr + m * stride_out + offs_n, round_to(reduce_sum(w * a[None, :], 1), dtype), mask=n_ok)


def interpreted() -> bool:
    """True when the kernel was built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_merge_gemv_kernel)


def problem(partials: SplitPartials, weight: torch.Tensor, head_dim: int) -> str | None:
    """Why merge_linear cannot take this call, or None."""
    acc, m, l = partials
    if acc.dim() != 4 or m.dim() != 3 or m.shape != l.shape or acc.shape[:3] != m.shape:
        return f"partials must be acc [M, heads, splits, pad] and max, sum [M, heads, splits]; got {tuple(acc.shape)}"
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device != weight.device for t in partials):
        return f"partials must be contiguous float32 on {weight.device}"
    rows, heads, _ = m.shape
    if not 1 <= rows <= decode_gemv.MAX_ROWS:
        return f"{rows} rows; merge_linear takes 1 to {decode_gemv.MAX_ROWS}"
    if not 0 < head_dim <= acc.shape[3] or weight.dim() != 2 or weight.shape[1] != heads * head_dim:
        return f"weight {tuple(weight.shape)} does not take {heads} heads of {head_dim}"
    if not weight.is_contiguous() or weight.shape[1] > decode_gemv.MAX_K or weight.shape[0] == 0:
        return f"weight must be contiguous with K at most {decode_gemv.MAX_K}"
    return None


def merge_linear(partials: SplitPartials, weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """F.linear of the merged attention output [M, heads * head_dim] with weight [N, heads * head_dim]."""
    if why := problem(partials, weight, head_dim):
        raise ValueError(why)
    acc, m, l = partials
    rows, (n, k) = m.shape[0], weight.shape
    cfg = decode_gemv.decode_gemv_config(n, k, rows, at_once=False)
    out = torch.empty((rows, n), dtype=weight.dtype, device=weight.device)
    _merge_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        acc, m, l, weight, out, out.stride(0), rows, n, k, SPLITS=m.shape[2], HEAD_DIM=head_dim,
        HEAD_PAD=acc.shape[3], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
        **pdl(_merge_gemv_kernel, weight.device, rows))
    return out
