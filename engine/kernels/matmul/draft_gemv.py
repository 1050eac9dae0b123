"""A greedy step's LM head on the decode GEMV: token ids straight from a draft head's (or the target's) hidden state.

    norm_linear_argmax(x [M <= MAX_ROWS, K], norm_weight [K], eps, weight [V, K]) -> int64 [M]
                        (= F.linear(fused_ops.rms_norm(x, norm_weight, eps), weight).float().argmax(-1))
    linear_argmax(x [M <= MAX_ROWS, K], weight [V, K]) -> int64 [M]     (= F.linear(x, weight).float().argmax(-1))
    either with ids [V] int64: ids[that argmax] (a draft vocabulary: weight holds its rows of the LM head)

Through the target's final norm and LM head, a draft step's token is a norm kernel, a cuBLAS GEMM, a cast and
torch's argmax, none launched dependently, so the next draft step's kernels cannot start early. Here it is two
kernels of the dependent-launch chain. Kernel 1 is decode_gemv's with the norm prologue and the argmax
epilogue: each program loads its BLOCK_N vocabulary rows before the wait, rounds their logits to the dtype as
F.linear does and keeps, per row of x, their maximum and its first vocabulary row. Kernel 2 (engine/kernels/
sampling/argmax.py's first_max) reduces the partials of each row to its first maximal vocabulary row, torch.argmax's tie
rule: the partials come in vocabulary order, and a later one wins only if strictly larger.

linear_argmax is the same two kernels without the norm (decode_gemv's "none" prologue), for a greedy
verification of a few rows on the target's already normed hidden states (the route table's "gemv" for "head").

The logits' summation order differs from cuBLAS (decode_gemv.py), so on a GPU a near-tie may pick another
token than the torch ops: a draft is a guess, verified either way; a verification then emits the other token.
"""
from __future__ import annotations

import torch

from engine.kernels.sampling import argmax
from engine.kernels.matmul import decode_gemv, gemv_checks
from engine.kernels.fused_ops import _FLOAT_DTYPES, _check_tensor

MAX_ROWS = decode_gemv.MAX_ROWS


def interpreted() -> bool:
    """True when the kernels were built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return argmax.interpreted() and decode_gemv.interpreted()


def supports(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether norm_linear_argmax takes a call; a caller computes the logits and their argmax otherwise."""
    return norm_weight is not None and decode_gemv.supports(x, weight, norm_weight=norm_weight)


def supports_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear_argmax takes a call; a caller computes the logits and their argmax otherwise."""
    return decode_gemv.supports(x, weight)


def norm_linear_argmax(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                       ids: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(fused_ops.rms_norm(x, norm_weight, eps), weight).float().argmax(-1) in two kernels: x [M <=
    MAX_ROWS, K] (unit stride in K), weight [V, K] contiguous, of x's dtype (the LM head, or the tied
    embedding). Returns int64 [M], the first maximal row on ties (ids[that row] with ids [V] int64), in `out`
    where given (int64, M entries of unit stride: a drafter's row of drafts)."""
    _check_tensor("x", x, 2, _FLOAT_DTYPES)
    _check_tensor("norm_weight", norm_weight, 1, _FLOAT_DTYPES, x.device)
    gemv_checks.check(x, weight, norm_weight=norm_weight)
    return _argmax(x, weight, "norm", norm_weight, eps, ids, out)


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight).float().argmax(-1) in two kernels, for x, weight and ids as norm_linear_argmax's."""
    gemv_checks.check(x, weight)
    return _argmax(x, weight, "none", ids=ids)


def _argmax(x, weight, prologue: str, norm_weight=None, eps: float = 0.0, ids=None, out=None) -> torch.Tensor:
    """The two kernels on checked inputs (ids and out checked here: the map's length is the weight's rows)."""
    argmax.check_ids(ids, weight.shape[0], x.device)
    if out is None:
        out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    elif out.dtype != torch.int64 or out.shape != (x.shape[0],) or out.stride(0) != 1 or out.device != x.device:
        raise ValueError(f"out must be int64 [{x.shape[0]}] of unit stride on {x.device}, got {out.dtype} "
                         f"{tuple(out.shape)} stride {out.stride()} on {out.device}")
    val, _, idx = decode_gemv.launch(x, weight, x.shape[1], prologue, nw=norm_weight, eps=eps, epilogue="argmax")
    return argmax.first_max(val, idx, out, ids)
